#!/usr/bin/env bash
# The ffn experts on the GPU through the real sockets: the model scripts/make-test-model.py writes
# (BF16 and FP8 block weights, three MoE layers interleaved on every connection), one rank, then
# two ranks sharing GPU 0 (device.id = 0, staged mpi); every token within DESIGN.md section 9's
# tolerance of the host reference (relative L2 1e-2 BF16, 3e-2 FP8), by build/tests/check_client;
# with FP8 partials (combine.dtype fp8) 3e-2 more: both sides quantize their slightly different
# sums, and a value at a rounding boundary lands one e4m3 step apart. Skips visibly without a GPU.
source "$(dirname "$(readlink -f "$0")")/../integration/daemon_lib.bash"

n_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
((n_gpus >= 1)) || skip "no GPU: needs 1, found ${n_gpus:-0}"
py=
for p in python3 /usr/bin/python3; do
    if $p -c 'import numpy' 2>/dev/null; then py=$p; break; fi
done
[[ -n $py ]] || die "no python3 with numpy (scripts/deps.sh installs python3-numpy)"
# H 1024, I 512: GEMMs with several 128 blocks each way, still quick to check on the host
$py scripts/make-test-model.py "$TMP/bf16" --format bf16 --hidden 1024 --intermediate 512 \
    --seed 5 ||
    die "make-test-model bf16"
$py scripts/make-test-model.py "$TMP/fp8" --format fp8 --hidden 1024 --intermediate 512 \
    --seed 6 ||
    die "make-test-model fp8"

model=(--set model.hidden=1024 --set model.num_experts=16 --set model.topk=8
       --set dispatch.max_tokens_per_request=128 --set experts.kind=ffn --set device.backend=cuda
       --set device.id=0)

# run_case NP WEIGHTS TOLERANCE SEED ARGS...
run_case() {
    local np=$1 weights=$2 tol=$3 seed=$4; shift 4
    EPD_LOG=$TMP/epd.log
    setsid "$MPIRUN" --oversubscribe -np "$np" --mca pml ucx --mca pml_ucx_tls any \
        --mca pml_ucx_devices any "$EPD" --set "socket.path=$TMP/epd-%r.sock" "${model[@]}" \
        --set "experts.weights=$TMP/$weights" "$@" >"$EPD_LOG" 2>&1 &
    EPD_PID=$!
    epd_wait_healthy "$np" 120 "$*"
    grep -q "ffn experts: 3 layers" "$EPD_LOG" || die "np=$np: the log does not say what was loaded"
    local socks=() r
    for ((r = 0; r < np; r++)); do socks+=(--socket "$(sock $r)"); done
    timeout 300 "$CHECK" "${socks[@]}" --clients 2 --requests 6 --max-tokens 128 --window 3 \
        --seed "$seed" --empty-slots --layers 1,2,3 --tolerance "$tol" ||
        die "np=$np $weights $*: results outside the tolerance"
    epd_stop_ranks
    echo "ok    np=$np $weights weights $*"
}

run_case 1 bf16 1e-2 31 --set dispatch.dtype=bf16
run_case 1 bf16 1e-2 32 --set dispatch.dtype=fp8
run_case 1 fp8 3e-2 33 --set dispatch.dtype=fp8
run_case 1 fp8 3e-2 34 --set dispatch.dtype=bf16
run_case 2 bf16 1e-2 35 --set dispatch.dtype=fp8 --set dispatch.transport=mpi \
    --set dispatch.mpi_cuda_aware=false
run_case 2 fp8 3e-2 36 --set dispatch.dtype=fp8 --set dispatch.scale=per_token \
    --set dispatch.transport=mpi --set dispatch.mpi_cuda_aware=false
run_case 1 bf16 4e-2 37 --set dispatch.dtype=fp8 --set combine.dtype=fp8
run_case 2 fp8 6e-2 38 --set dispatch.dtype=bf16 --set combine.dtype=fp8 \
    --set dispatch.transport=mpi --set dispatch.mpi_cuda_aware=false
echo "PASS: ffn experts on the GPU (1 rank, 2 ranks sharing GPU 0; bf16 and fp8 block weights," \
    "bf16 and fp8 partials, layers 1-3) within the tolerance of the host reference"
