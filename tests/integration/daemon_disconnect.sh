#!/usr/bin/env bash
# A client that disconnects with requests in flight: their results are discarded and counted
# (stats results_discarded), every accepted request is accounted for, and another client on the
# same rank is unaffected.
source "$(dirname "$0")/daemon_lib.bash"

# One request per step, so most of the departing client's requests are still queued.
epd_start 2 --set model.hidden=256 --set model.num_experts=16 --set model.topk=4 \
    --set dispatch.max_tokens_per_request=64 --set dispatch.max_tokens_per_step=64

"$CHECK" --socket "$(sock 0)" --socket "$(sock 1)" --clients 2 --requests 60 --max-tokens 16 \
    --seed 3 >"$TMP/good.log" 2>&1 &
good=$!
# Rank 1 held (SIGSTOP) while the client sends and leaves: no agreement completes, so its
# requests are still queued when it goes (steps are faster than a client otherwise).
pid1=$($WIRE health "$(sock 1)" | python3 -c 'import json,sys; print(json.load(sys.stdin)["pid"])')
kill -STOP "$pid1"
python3 tests/integration/daemon_clients.py disconnect "$(sock 0)" 40 || {
    kill -CONT "$pid1"
    die "disconnect client"
}
kill -CONT "$pid1"

# Wait until rank 0 has answered (or discarded) everything it accepted.
deadline=$((SECONDS + 20))
while :; do
    read -r accepted sent discarded < <(python3 - "$(sock 0)" <<'PY'
import sys
sys.path.insert(0, "tests/integration")
import daemon_wire as w
m, _ = w.control(sys.argv[1], "stats")
s = m["server"]
print(s["requests_accepted"], s["results_sent"], s["results_discarded"])
PY
)
    [[ $((sent + discarded)) -eq $accepted && $accepted -ge 40 ]] && break
    ((SECONDS < deadline)) || die "rank 0: accepted $accepted, sent $sent, discarded $discarded"
    sleep 0.2
done
echo "rank 0: accepted $accepted, results sent $sent, discarded $discarded"
((discarded >= 1)) || die "no result was discarded"
grep -q "closed with [0-9]* requests in flight" "$TMP/epd.log" || die "no log line for the departed client"
wait "$good" || { cat "$TMP/good.log"; die "the other client was disturbed"; }
cat "$TMP/good.log"
$WIRE metrics "$(sock 0)" | grep -E "^epd_results_discarded_total $discarded$" \
    || die "metrics do not show $discarded discarded results"
epd_stop
echo "PASS: results of a departed client discarded and counted, others unaffected"
