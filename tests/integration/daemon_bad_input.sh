#!/usr/bin/env bash
# The bad-input matrix (DESIGN.md section 8) on rank 0 of a 2-rank daemon, while a well-behaved
# client on the same ranks keeps getting correct results: framing errors answered and closed,
# request errors answered for their id with the connection kept, busy on a full queue and on too
# many clients, unknown_op. The daemon stays up and its error counters say what happened.
source "$(dirname "$0")/daemon_lib.bash"

epd_start 2 --set model.hidden=256 --set model.num_experts=16 --set model.topk=4 \
    --set dispatch.max_tokens_per_request=64 --set dispatch.max_tokens_per_step=64 \
    --set dispatch.max_queued_tokens=128 --set socket.max_frame_bytes=1048576 \
    --set socket.max_clients=12

# The well-behaved client: small requests on both ranks, retrying busy answers like a real one,
# round after round until the matrix is done (so it runs alongside every row).
(
    round=0
    while [[ ! -e $TMP/matrix-done ]] || ((round == 0)); do
        round=$((round + 1))
        "$CHECK" --socket "$(sock 0)" --socket "$(sock 1)" --clients 2 --requests 100 \
            --max-tokens 8 --window 2 --retry-busy --seed "$round" --quiet || exit 1
    done
    echo "good client: $round rounds, every result equal to the reference"
) >"$TMP/good.log" 2>&1 &
good=$!

GOOD_PID=$good timeout 120 python3 tests/integration/daemon_bad_input.py "$(sock 0)" 12 || {
    touch "$TMP/matrix-done"
    wait "$good"
    die "bad-input matrix"
}
touch "$TMP/matrix-done"
wait "$good" || { cat "$TMP/good.log"; die "the well-behaved client failed"; }
tail -n 3 "$TMP/good.log"

# Still up on both ranks, and the counters saw the rows.
for r in 0 1; do
    $WIRE health "$(sock $r)" | grep -q '"status": "ok"' || die "rank $r does not answer health"
done
errors=$($WIRE stat "$(sock 0)" server.errors)
echo "rank 0 errors: $errors"
python3 - "$errors" <<'PY' || die "error counters do not match the matrix"
import json, sys
e = json.loads(sys.argv[1])
want = {"bad_magic": 1, "bad_version": 1, "bad_type": 3, "bad_header": 1, "frame_too_large": 2,
        "bad_json": 5, "bad_tensor": 8, "unsupported_dtype": 2, "shape_mismatch": 3,
        "expert_out_of_range": 2, "invalid_topk": 1, "too_many_tokens": 1,
        "non_finite_input": 5, "unknown_op": 1}
bad = {k: (e.get(k), v) for k, v in want.items() if e.get(k) != v}
if bad or e.get("busy", 0) < 4:
    print("counter mismatch (got, want):", bad, "busy:", e.get("busy"))
    sys.exit(1)
PY
epd_stop
echo "PASS: every bad input got its code, the good client was served throughout"
