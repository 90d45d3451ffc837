#!/usr/bin/env bash
# docs/protocol.md against the real daemon: 2 CPU ranks with the settings of the doc's worked
# example; tests/integration/protocol_doc.py sends the doc's frames and examples and compares the
# answers (bytes, codes, whether the connection stays) with what the doc says.
source "$(dirname "$0")/daemon_lib.bash"

epd_start 2 --set model.hidden=128 --set model.topk=2 --set model.num_experts=8 \
    --set experts.kind=scale
timeout 60 python3 tests/integration/protocol_doc.py docs/protocol.md "$(sock 0)" "$(sock 1)" ||
    die "docs/protocol.md and the daemon disagree"
epd_stop
echo "PASS: docs/protocol.md agrees with the daemon"
