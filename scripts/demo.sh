#!/usr/bin/env bash
# `make demo`: two CPU ranks of epd with a small built-in model (H 1024, 16 experts, top-4),
# `epctl bench` against both sockets with BF16 dispatch, a graceful stop (SIGUSR1 to mpirun,
# showing the drain), then the same with FP8; throughput, latency and wire bytes per token for
# each, and the FP8/BF16 ratios. Environment: BUILD (default build), MPIRUN (default mpirun),
# DEMO_REQUESTS (default 600 requests of DEMO_TOKENS=128 tokens).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
MPIRUN=${MPIRUN:-mpirun}
REQUESTS=${DEMO_REQUESTS:-600}
TOKENS=${DEMO_TOKENS:-128}
EPD=$BUILD/epd
EPCTL=$BUILD/epctl
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

for bin in "$EPD" "$EPCTL"; do
    [[ -x $bin ]] || { echo "demo: $bin is not built (run make)" >&2; exit 1; }
done
command -v "$MPIRUN" >/dev/null || { echo "demo: no $MPIRUN" >&2; exit 1; }
command -v python3 >/dev/null || { echo "demo: python3 is needed to summarize" >&2; exit 1; }

tmp=$(mktemp -d /tmp/epd-demo.XXXXXX)
pid=
cleanup() {
    if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then kill -KILL -- "-$pid" 2>/dev/null || true; fi
    rm -rf "$tmp"
}
trap cleanup EXIT

model=(--set model.hidden=1024 --set model.num_experts=16 --set model.topk=4
       --set device.backend=cpu --set experts.kind=scale)
sockets=(--socket "$tmp/epd-0.sock" --socket "$tmp/epd-1.sock")

# run DTYPE: start 2 ranks, bench, collect stats, stop gracefully; writes $tmp/DTYPE.json.
run() {
    local dtype=$1 log=$tmp/$1.log
    echo "=== dispatch.dtype=$dtype: starting 2 ranks (mpirun -np 2, sockets in $tmp)"
    setsid "$MPIRUN" --oversubscribe -np 2 --mca pml ucx --mca pml_ucx_tls any \
        --mca pml_ucx_devices any "$EPD" --set "socket.path=$tmp/epd-%r.sock" "${model[@]}" \
        --set "dispatch.dtype=$dtype" >"$log" 2>&1 &
    pid=$!
    local deadline=$((SECONDS + 30))
    until "$EPCTL" "${sockets[@]}" --timeout 1000 health >/dev/null 2>&1; do
        if ! kill -0 "$pid" 2>/dev/null || ((SECONDS >= deadline)); then
            cat "$log"
            echo "demo: the daemon did not come up" >&2
            exit 1
        fi
        sleep 0.2
    done
    grep -E "transport:|serving on" "$log" | sed 's/^/    /'

    echo "--- epctl bench: $REQUESTS requests of $TOKENS tokens, 4 connections, 4 in flight each"
    "$EPCTL" "${sockets[@]}" --json bench --tokens "$TOKENS" --requests "$REQUESTS" \
        --concurrency 4 --pipeline 4 --seed 1 >"$tmp/$dtype.bench.json"
    "$EPCTL" --socket "$tmp/epd-0.sock" --json stats >"$tmp/$dtype.stats0.json"
    "$EPCTL" --socket "$tmp/epd-1.sock" --json stats >"$tmp/$dtype.stats1.json"

    echo "--- graceful stop: SIGUSR1 to mpirun"
    kill -USR1 "$pid"
    # Open MPI 4.1.4 (Debian 12) forwards SIGUSR1 to the ranks; 4.1.6 as packaged by Ubuntu 24.04
    # was seen not to. Then the ranks get it themselves, as systemd's KillSignal does.
    local waited=0
    while kill -0 "$pid" 2>/dev/null && ! grep -q "shutdown requested" "$log" && ((waited < 50)); do
        sleep 0.1
        waited=$((waited + 1))
    done
    if kill -0 "$pid" 2>/dev/null && ! grep -q "shutdown requested" "$log"; then
        echo "    mpirun did not forward SIGUSR1 within 5 s: SIGUSR1 to the ranks"
        pkill -USR1 -P "$pid" -x epd || true
    fi
    local rc=0
    wait "$pid" || rc=$?
    pid=
    grep -E "shutdown requested|draining|drained" "$log" | sed 's/^/    /'
    [[ $rc == 0 ]] || { echo "demo: mpirun exited $rc" >&2; exit 1; }
    echo "    mpirun exited 0"

    python3 - "$dtype" "$tmp" <<'PY'
import json, sys
dtype, tmp = sys.argv[1], sys.argv[2]
bench = json.load(open("%s/%s.bench.json" % (tmp, dtype)))
ranks = [json.load(open("%s/%s.stats%d.json" % (tmp, dtype, r))) for r in (0, 1)]
def unwrap(d):  # epctl --json: {"command", "sockets": [{"socket", "reply"}]}
    if isinstance(d, dict) and isinstance(d.get("sockets"), list):
        return unwrap(d["sockets"][0])
    for key in ("reply", "stats"):
        if isinstance(d, dict) and key in d and isinstance(d[key], dict):
            return d[key]
    if isinstance(d, list):
        return unwrap(d[0])
    return d
ranks = [unwrap(r) for r in ranks]
tokens = sum(r["engine"]["tokens"] for r in ranks)
wire = sum(r["engine"]["bytes_sent"][dtype] for r in ranks)
step_ms = max(sum(r["engine"]["phase_seconds"].values()) / max(r["engine"]["steps"], 1)
              for r in ranks) * 1e3
summary = {
    "dtype": dtype,
    "tokens_per_s": bench["tokens_per_s"],
    "requests_per_s": bench["requests_per_s"],
    "p50_ms": bench["latency_ms"]["p50"],
    "p99_ms": bench["latency_ms"]["p99"],
    "errors": bench["errors"],
    "bytes_per_token": wire / tokens if tokens else 0.0,
    "step_ms": step_ms,
    "steps": ranks[0]["engine"]["steps"],
}
json.dump(summary, open("%s/%s.json" % (tmp, dtype), "w"))
print("--- %s: %.0f tokens/s, %.1f requests/s, latency p50 %.2f ms, p99 %.2f ms, %d errors"
      % (dtype, summary["tokens_per_s"], summary["requests_per_s"], summary["p50_ms"],
         summary["p99_ms"], summary["errors"]))
print("    wire: %.1f dispatch bytes per token (%d bytes for %d tokens), %d steps of %.3f ms"
      % (summary["bytes_per_token"], wire, tokens, summary["steps"], step_ms))
PY
    echo
}

run bf16
run fp8

python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
b = json.load(open(tmp + "/bf16.json"))
f = json.load(open(tmp + "/fp8.json"))
print("=== FP8/BF16: bytes per token %.3f (%.1f / %.1f), step time %.3f (%.3f / %.3f ms), "
      "throughput %.3f" % (f["bytes_per_token"] / b["bytes_per_token"], f["bytes_per_token"],
                           b["bytes_per_token"], f["step_ms"] / b["step_ms"], f["step_ms"],
                           b["step_ms"], f["tokens_per_s"] / b["tokens_per_s"]))
print("    (2 CPU ranks on one host: the bytes ratio is the wire format's; the time ratio says "
      "little about GPUs)")
PY
