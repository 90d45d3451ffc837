#!/usr/bin/env bash
# The daemon (2 ranks, device.backend = cuda) through the real sockets, on 2 GPUs or with both
# ranks sharing one, on every GPU transport this build has: staged mpi (dispatch.mpi_cuda_aware =
# false, small chunks), direct mpi (when the MPI it was built with is CUDA-aware: make
# MPI_HOME=<scripts/cuda-mpi.sh prefix>), nccl (when built with NCCL); on one GPU staged only.
# BF16 and FP8 (group128 / per_token, fp32 / ue8m0), BF16 and FP8 combine, identity and scale
# experts, random batches with empty slots, checked bit for bit against the reference by
# build/tests/check_client. Skips visibly without a GPU; says which transports it could not try.
source "$(dirname "$(readlink -f "$0")")/../integration/daemon_lib.bash"

n_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
((n_gpus >= 1)) || skip "no GPU: needs 1 GPU (2 ranks share it) or 2, found ${n_gpus:-0}"
# One GPU: both ranks on device 0, staged mpi only (NCCL refuses two ranks on one GPU, and the
# direct path needs a CUDA-aware MPI across two devices to mean anything).
share=()
((n_gpus >= 2)) || share=(--set device.id=0)

model=(--set model.hidden=7168 --set model.num_experts=256 --set model.topk=8
       --set dispatch.max_tokens_per_request=256 --set device.backend=cuda)
wires=(
    "--set dispatch.dtype=bf16 --set experts.kind=identity"
    "--set dispatch.dtype=bf16 --set experts.kind=scale"
    "--set dispatch.dtype=fp8 --set dispatch.scale=group128 --set dispatch.scale_format=fp32 --set experts.kind=scale"
    "--set dispatch.dtype=fp8 --set dispatch.scale=group128 --set dispatch.scale_format=ue8m0 --set experts.kind=identity"
    "--set dispatch.dtype=fp8 --set dispatch.scale=per_token --set dispatch.scale_format=fp32 --set experts.kind=identity"
    "--set dispatch.dtype=fp8 --set dispatch.scale=per_token --set dispatch.scale_format=ue8m0 --set experts.kind=scale"
    "--set dispatch.dtype=fp8 --set dispatch.scale=group128 --set combine.dtype=fp8 --set experts.kind=scale"
    "--set dispatch.dtype=bf16 --set combine.dtype=fp8 --set experts.kind=identity --set telemetry.quant_error=false"
)

# gpu_start ARGS...: 2 ranks on GPUs 0 and 1 (both on GPU 0 when there is one), waits (90 s at most: CUDA and NCCL start-up) until
# both answer health. EPD_TEST_STAGED_CHUNK goes to the ranks.
gpu_start() {
    EPD_LOG=$TMP/epd.log
    setsid "$MPIRUN" --oversubscribe -np 2 --mca pml ucx --mca pml_ucx_tls any \
        --mca pml_ucx_devices any -x EPD_TEST_STAGED_CHUNK "$EPD" \
        --set "socket.path=$TMP/epd-%r.sock" "${model[@]}" "${share[@]}" "$@" >"$EPD_LOG" 2>&1 &
    EPD_PID=$!
    epd_wait_healthy 2 90 "$*"
}

# run_case NAME EXPECT SEED ARGS...: starts, checks the device and transport lines of the log
# against EXPECT (a regex), runs the client on both sockets, stops gracefully.
run_case() {
    local name=$1 expect=$2 seed=$3; shift 3
    gpu_start "$@"
    grep -q "device: device.backend = cuda: CUDA device 0 of" "$EPD_LOG" ||
        die "$name: rank 0 is not on CUDA device 0"
    grep -Eq "transport: $expect" "$EPD_LOG" || die "$name: transport is not /$expect/"
    timeout 120 "$CHECK" --socket "$(sock 0)" --socket "$(sock 1)" --clients 2 --requests 8 \
        --max-tokens 256 --window 4 --seed "$seed" --empty-slots --quiet ||
        die "$name $*: results differ from the reference"
    epd_stop_ranks
    echo "ok    $name: $*"
}

tried=()
seed=100

# staged: forced even on a CUDA-aware MPI; 100000-byte chunks split records mid-way
export EPD_TEST_STAGED_CHUNK=100000
for w in "${wires[@]}"; do
    run_case staged "mpi-staged" $((seed++)) --set dispatch.transport=mpi \
        --set dispatch.mpi_cuda_aware=false $w
done
tried+=(staged)
export EPD_TEST_STAGED_CHUNK= # empty: the default chunk

# direct: only where the MPI this build uses says it is CUDA-aware
ompi_info=$(dirname "$(command -v "$MPIRUN")")/ompi_info
if ((n_gpus < 2)); then
    echo "note: direct mpi and nccl not tried: 2 ranks share the one GPU"
elif [[ -x $ompi_info ]] && "$ompi_info" --parsable --all 2>/dev/null |
        grep -q 'mpi_built_with_cuda_support:value:true'; then
    for w in "${wires[@]}"; do
        run_case direct "mpi: MPI_Alltoallv directly on device buffers" $((seed++)) \
            --set dispatch.transport=mpi $w
    done
    tried+=(direct)
else
    echo "note: direct mpi not tried: $MPIRUN's MPI is not CUDA-aware (scripts/cuda-mpi.sh, then" \
         "make MPI_HOME=<prefix> check)"
fi

# nccl: only in an NCCL build
if ((n_gpus < 2)); then
    :
elif ldd "$EPD" 2>/dev/null | grep -q libnccl; then
    for w in "${wires[@]}"; do
        run_case nccl "nccl: " $((seed++)) --set dispatch.transport=nccl $w
    done
    tried+=(nccl)
else
    echo "note: nccl not tried: $EPD is built without NCCL"
fi

echo "PASS: $((n_gpus >= 2 ? 2 : 1)) GPU(s), 2 ranks, transports: ${tried[*]} (bf16, fp8 group128/per_token x fp32/ue8m0, identity/scale)"
