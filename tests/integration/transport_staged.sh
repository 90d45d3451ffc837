#!/usr/bin/env bash
# The staged mpi transport between 3 real ranks (mpirun, shared memory): uneven counts, gaps,
# chunk sizes from 1 byte to the default, on the host ops. Guards the chunk bookkeeping that the
# GPU path (device <-> pinned host copies) relies on.
set -u
BUILD=${BUILD:-build}
MPIRUN=${MPIRUN:-mpirun}
bin=$BUILD/tests/staged_check
if [[ ! -x $bin ]]; then
    echo "FAIL: $bin is not built"
    exit 1
fi
if ! command -v "$MPIRUN" >/dev/null 2>&1; then
    echo "SKIP: $MPIRUN not found"
    exit 77
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
timeout 120 "$MPIRUN" --oversubscribe -np 3 --mca pml ucx --mca pml_ucx_tls any \
    --mca pml_ucx_devices any "$bin"
