#!/usr/bin/env bash
# Large payloads through the socket (issue 25: read straight into the frame's payload buffer):
# SUBMITs of up to 600 tokens at the V3 hidden size (up to 8.6 MB each, above the 4 MiB that is
# allocated whole, so buffers also grow while they are read), pipelined by several clients over
# two ranks, every RESULT equal to the single-process reference bit for bit; then each rank's stats
# show every request answered, no error and nothing left of the budget of unfinished frames.
source "$(dirname "$0")/daemon_lib.bash"

epd_start 2 --set model.hidden=7168 --set model.num_experts=16 --set model.topk=4 \
    --set dispatch.dtype=bf16 --set experts.kind=scale \
    --set dispatch.max_tokens_per_request=600
timeout 120 "$CHECK" --socket "$(sock 0)" --socket "$(sock 1)" --clients 2 --requests 5 \
    --max-tokens 600 --window 2 --seed 25 --empty-slots \
    || die "large payloads: results differ from the reference"
for r in 0 1; do
    "$BUILD/epctl" --socket "$(sock $r)" --json stats | python3 -c '
import json, sys
s = json.load(sys.stdin)["sockets"][0]["reply"]["server"]
assert s["requests_accepted"] > 0 and s["results_sent"] == s["requests_accepted"], s
assert s["buffered_bytes"] == 0, s
assert not any(s["errors"].values()), s["errors"]
# every accepted SUBMIT carried at least one token of x (14336 bytes)
assert s["bytes_in"] >= s["requests_accepted"] * 7168 * 2, s
' || die "rank $r: stats after the large payloads are not what was sent"
done
epd_stop
echo "PASS: SUBMITs of up to 8.6 MB through the socket equal the reference bit for bit"
