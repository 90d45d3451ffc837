#!/usr/bin/env bash
# Runs build/tests/gpu/mpi_cuda_aware under mpirun with Open MPI's UCX PML (docs/gpu-nodes.md).
#   tests/gpu/run-mpi-cuda-aware.sh [ARGS...]   ARGS go to the test (--iters N, --max-tokens N, --check-only)
# Environment: BUILD (build), NP (2), MPIRUN (default: the mpirun beside the libmpi the test is
# linked with, else mpirun on PATH), UCX_* (passed on to the ranks, e.g. UCX_TLS=cuda_ipc,cuda_copy,sm,self).
# Exit: the test's (0 pass, 1 failure, 77 no GPU: prints 'SKIP: no GPU').
set -u
BUILD=${BUILD:-build}
NP=${NP:-2}
bin=$BUILD/tests/gpu/mpi_cuda_aware
if [[ ! -x $bin ]]; then
    echo "run-mpi-cuda-aware: no $bin; build it with 'make CUDA=1 MPI_HOME=/opt/epd-cuda-mpi $bin'" >&2
    exit 1
fi

# The mpirun must belong to the Open MPI the test was linked with: mixing a system mpirun with the
# CUDA-aware prefix's libmpi fails at start-up.
if [[ -z ${MPIRUN:-} ]]; then
    libmpi=$(ldd "$bin" 2>/dev/null | awk '$1 ~ /^libmpi\.so/ { print $3; exit }')
    if [[ -n $libmpi && -x $(dirname "$libmpi")/../bin/mpirun ]]; then
        MPIRUN=$(cd "$(dirname "$libmpi")/../bin" && pwd)/mpirun
    else
        MPIRUN=mpirun
    fi
fi
command -v "$MPIRUN" >/dev/null 2>&1 || { echo "run-mpi-cuda-aware: no mpirun ($MPIRUN)" >&2; exit 1; }

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
args=(-np "$NP" --mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any)
# UCX_* settings (UCX_TLS, UCX_MEMTYPE_CACHE, UCX_LOG_LEVEL, ...) go to every rank, on any node.
while IFS= read -r name; do
    args+=(-x "$name")
done < <(compgen -e | grep '^UCX_' || true)
echo "run-mpi-cuda-aware: $MPIRUN ${args[*]} $bin $*"
exec "$MPIRUN" "${args[@]}" "$bin" "$@"
