#!/usr/bin/env bash
# The engine under real mpirun at 2 ranks and at 1 (alone: agreements without MPI), without
# sockets (build/tests/engine_check): results equal the reference, busy past the queue limit,
# shutdown asked on one rank drains every accepted request on all and stops them together, an
# idle engine does not spin, a failed step answers `internal` and reports the failure (np 2).
set -u
BUILD=${BUILD:-build}
MPIRUN=${MPIRUN:-mpirun}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
bin=$BUILD/tests/engine_check
if [[ ! -x $bin ]]; then
    echo "FAIL: $bin is not built (make builds it)"
    exit 1
fi
rc=0
for np in 2 1; do
    timeout 120 "$MPIRUN" --oversubscribe -np $np --mca pml ucx --mca pml_ucx_tls any \
        --mca pml_ucx_devices any "$bin" || { echo "FAIL: engine_check at np $np exited $?"; rc=1; }
done
exit $rc
