#!/usr/bin/env bash
# The accuracy study of docs/accuracy.md on the GPU: `epd --accuracy` with ffn experts at
# DeepSeek-V3's expert shape (H 7168, I 2048, top-8; 32 experts, each a real-shape expert: the
# error of a format does not depend on how many there are, the time to generate and load them
# does), generated BF16 and FP8 block weights, CUDA ops; on 1 rank, then on 2 ranks sharing GPU 0
# over staged mpi. Prints the commands and the markdown tables (stdout, for docs/accuracy.md),
# and fails when a table lacks a mode or holds a NaN. Skips visibly without a GPU.
# ACC_TOKENS / ACC_ITERS change the tokens per rank and steps (default 256 x 2 on 1 rank, 256 x 1
# a rank on 2); the host fp32 reference is most of the time (about 3 minutes on an H200 node).
set -u
cd "$(dirname "$(readlink -f "$0")")/../.."
BUILD=${BUILD:-build}
MPIRUN=${MPIRUN:-mpirun}
EPD=$BUILD/epd
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

skip() { echo "SKIP: $*"; exit 77; }
die() { echo "FAIL: $*"; exit 1; }

n_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
((n_gpus >= 1)) || skip "no GPU: needs 1, found ${n_gpus:-0}"
command -v "$MPIRUN" >/dev/null 2>&1 || skip "no mpirun ($MPIRUN)"
[[ -x $EPD ]] || skip "$EPD is not built"

shape=(--set model.hidden=7168 --set model.intermediate=2048 --set model.num_experts=32
       --set model.topk=8 --set experts.kind=ffn --bench-weights random
       --set device.backend=cuda --set device.id=0)
mpi=(--bind-to none --mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any)
out=$(mktemp)
trap 'rm -f "$out"' EXIT

# study NP TOKENS ITERS ARGS...: one run, its tables on stdout, checked
study() {
    local np=$1 tokens=$2 iters=$3 start=$SECONDS; shift 3
    echo "\$ $MPIRUN -np $np ${mpi[*]} $EPD --accuracy ${shape[*]} --bench-tokens $tokens" \
        "--bench-iters $iters $*"
    timeout 600 "$MPIRUN" -np "$np" "${mpi[@]}" "$EPD" --accuracy "${shape[@]}" \
        --bench-tokens "$tokens" --bench-iters "$iters" "$@" >"$out" 2>&1
    local rc=$?
    cat "$out"
    ((rc == 0)) || die "np=$np: epd --accuracy exited $rc"
    local tables rows
    tables=$(grep -c '^ffn .*: .* tokens per rank' "$out")
    rows=$(grep -c '^| \(bf16\|fp8\)' "$out")
    ((tables == 2 && rows == 18)) || die "np=$np: $tables tables, $rows rows (want 2 and 18)"
    ! grep -qi '| nan\|| -nan\|| inf' "$out" || die "np=$np: a table holds NaN or Inf"
    echo "ok    np=$np: 2 tables in $((SECONDS - start)) s"
    echo
}

study 1 "${ACC_TOKENS:-256}" "${ACC_ITERS:-2}"
study 2 "${ACC_TOKENS:-256}" "${ACC_ITERS:-1}" --set dispatch.transport=mpi \
    --set dispatch.mpi_cuda_aware=false
echo "PASS: epd --accuracy with ffn experts at H 7168, I 2048 on the GPU (1 rank, 2 ranks" \
    "sharing GPU 0)"
