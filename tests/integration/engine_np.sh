#!/usr/bin/env bash
# The engine under real mpirun at 2 ranks, without sockets (build/tests/engine_check): results
# equal the reference, busy past the queue limit, shutdown asked on one rank drains every accepted
# request on both and stops them together, an idle engine does not spin, a failed step answers
# `internal` and reports the failure.
set -u
BUILD=${BUILD:-build}
MPIRUN=${MPIRUN:-mpirun}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
bin=$BUILD/tests/engine_check
if [[ ! -x $bin ]]; then
    echo "FAIL: $bin is not built (make builds it)"
    exit 1
fi
timeout 120 "$MPIRUN" --oversubscribe -np 2 --mca pml ucx --mca pml_ucx_tls any \
    --mca pml_ucx_devices any "$bin"
rc=$?
[[ $rc -eq 0 ]] || echo "FAIL: engine_check exited $rc"
exit $rc
