#!/usr/bin/env bash
# Host regions (DESIGN.md 4b) through the Python client on a 2-rank daemon: tests/python/
# test_regions.py. Skips (exit 77, saying why) only while the daemon answers register with
# unknown_op; a daemon that serves regions must pass every case.
source "$(dirname "$0")/daemon_lib.bash"
source tests/python/python_lib.bash

[[ -x $BUILD/tests/py_ref ]] || skip "$BUILD/tests/py_ref is not built"
export EPDPY_REF=$BUILD/tests/py_ref EPDPY_TMP=$TMP
epd_start 2 --set model.hidden=256 --set model.num_experts=16 --set model.topk=4 \
    --set experts.kind=scale --set dispatch.max_tokens_per_request=64 \
    --set dispatch.max_tokens_per_step=128 --set dispatch.max_queued_tokens=2048
rc=0
EPDPY_SOCKETS="$(sock 0):$(sock 1)" timeout 120 "$PY" tests/python/test_regions.py 2>&1 || rc=$?
[[ $rc == 0 || $rc == 77 ]] || die "region tests"
epd_stop
exit $rc
