#!/usr/bin/env bash
# A client that does not read its results: once its unsent output passes
# socket.max_output_bytes the daemon stops reading from it (so it cannot grow without bound),
# and resumes when the client reads; every request is still answered.
source "$(dirname "$0")/daemon_lib.bash"

limit=65536
epd_start 1 --set model.hidden=256 --set model.num_experts=16 --set model.topk=4 \
    --set dispatch.max_tokens_per_request=64 --set socket.max_output_bytes=$limit \
    --set log.level=debug --set socket.sndbuf_bytes=0
timeout 60 python3 tests/integration/daemon_clients.py slow-reader "$(sock 0)" 200 $limit \
    || die "slow reader"
grep -q "reading -> paused" "$TMP/epd.log" || die "the connection never paused"
grep -q "paused -> reading" "$TMP/epd.log" || die "the connection never resumed"
$WIRE health "$(sock 0)" >/dev/null || die "health"
epd_stop
echo "PASS: reads paused above socket.max_output_bytes and resumed; every request answered"
