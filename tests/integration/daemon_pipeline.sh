#!/usr/bin/env bash
# A client that pipelines far more frames than a connection handles per event, in one write: the
# connection yields and resumes on its own with the rest still buffered (no more bytes arrive to
# wake it), every frame is answered, and another client of the same rank is answered beside it.
source "$(dirname "$0")/daemon_lib.bash"

epd_start 2 --set model.hidden=256 --set model.num_experts=16 --set model.topk=4 \
    --set log.level=debug
timeout 60 python3 tests/integration/daemon_clients.py pipeline "$(sock 0)" 200 8 \
    >"$TMP/pipeline.log" 2>&1 &
burst=$!
$WIRE health "$(sock 0)" >/dev/null || die "health beside the burst"
wait "$burst" || { cat "$TMP/pipeline.log"; die "pipelined client"; }
cat "$TMP/pipeline.log"
grep -q "reading -> yielded" "$TMP/epd.log" || die "the connection never yielded"
grep -q "yielded -> reading" "$TMP/epd.log" || die "the connection never resumed"
$WIRE health "$(sock 0)" >/dev/null || die "health"
epd_stop
echo "PASS: a pipelined burst over the per-event frame budget is answered in full"
