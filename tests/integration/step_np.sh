#!/usr/bin/env bash
# The collective step under real mpirun at 1, 2 and 4 ranks: build/tests/step_check runs random
# batches (different N per rank, 0 included) through epd_step_run and checks every rank's output
# bit for bit against epd_moe_reference, BF16 and FP8, identity and scale experts, BF16 and FP8
# combine.
set -u
BUILD=${BUILD:-build}
MPIRUN=${MPIRUN:-mpirun}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
bin=$BUILD/tests/step_check
if [[ ! -x $bin ]]; then
    echo "FAIL: $bin is not built (make builds it)"
    exit 1
fi
rc=0
for np in 1 2 4; do
    echo "== np=$np"
    timeout 120 "$MPIRUN" --oversubscribe -np "$np" --mca pml ucx --mca pml_ucx_tls any \
        --mca pml_ucx_devices any "$bin"
    r=$?
    if [[ $r -ne 0 ]]; then
        echo "FAIL: step_check at np=$np exited $r"
        rc=1
    fi
done
exit $rc
