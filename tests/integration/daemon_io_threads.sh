#!/usr/bin/env bash
# The socket copy threads (socket.io_threads, daemon/bulk.c): with every payload offloaded
# (socket.io_offload_bytes=1), a small SO_SNDBUF and clients that trickle their SUBMITs and read
# their RESULTs slowly (slower than a copy job waits), payloads are read and written in parts by
# the threads, the loop thread writing what a job left; every RESULT still equals the reference
# bit for bit, beside full-speed clients on the same ranks, and nothing of the budget is left.
# Then the same traffic with socket.io_threads=0 (all I/O on the loop thread).
source "$(dirname "$0")/daemon_lib.bash"

stats_clean() {
    for r in 0 1; do
        "$BUILD/epctl" --socket "$(sock $r)" --json stats | python3 -c '
import json, sys
s = json.load(sys.stdin)["sockets"][0]["reply"]["server"]
assert s["requests_accepted"] > 0 and s["results_sent"] == s["requests_accepted"], s
assert s["buffered_bytes"] == 0, s
assert not any(s["errors"].values()), s["errors"]
' || die "rank $r: stats after the traffic are not what was sent ($1)"
    done
}

shape=(--set model.hidden=7168 --set model.num_experts=16 --set model.topk=4
       --set dispatch.dtype=bf16 --set experts.kind=scale --set dispatch.max_tokens_per_request=200)

epd_start 2 "${shape[@]}" --set socket.io_offload_bytes=1 --set socket.sndbuf_bytes=65536 \
    --set log.level=debug
timeout 120 "$CHECK" --socket "$(sock 0)" --socket "$(sock 1)" --clients 2 --requests 4 \
    --max-tokens 200 --window 2 --seed 41 --trickle-us 1500 --quiet &
slow=$!
timeout 120 "$CHECK" --socket "$(sock 0)" --socket "$(sock 1)" --clients 2 --requests 12 \
    --max-tokens 200 --window 3 --seed 42 --empty-slots --quiet \
    || die "io threads: full-speed clients' results differ from the reference"
wait $slow || die "io threads: slow clients' results differ from the reference"
stats_clean "io threads"
grep -q 'write job has [0-9]* bytes left; waiting for the socket' "$EPD_LOG" \
    || die "no write job was left part of its bytes (the slow readers did not exercise it)"
grep -q 'read job read [0-9]* bytes; the rest on the next readable event' "$EPD_LOG" \
    || die "no read job came back before its payload was whole"
epd_stop

epd_start 2 "${shape[@]}" --set socket.io_threads=0
timeout 120 "$CHECK" --socket "$(sock 0)" --socket "$(sock 1)" --clients 2 --requests 8 \
    --max-tokens 200 --window 2 --seed 43 --quiet \
    || die "socket.io_threads=0: results differ from the reference"
stats_clean "socket.io_threads=0"
epd_stop
echo "PASS: payloads copied by the socket copy threads (in parts, for slow clients) equal the reference bit for bit; socket.io_threads=0 too"
