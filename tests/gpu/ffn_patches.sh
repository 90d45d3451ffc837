#!/usr/bin/env bash
# Measures the Hopper GEMM changes kept as patches in docs/notes (built and right, not faster on
# the H100 where they were measured, never run on an H200) in one device call: each patch applied
# to its own copy of this tree, built there, then TURNS turns of its A/B, both sides in the same
# binary: build/gemmbench --routed at 32, 64, 96 and 128 rows an expert (BF16 and FP8 block
# weights, both projections; the change and without it) and the ffn bench's tunings that turn it
# on and off (experts_us at 256, 384 and 512 tokens). Prints the gemmbench totals and the bench's
# rows; logs in $OUT (or build/ffn-patches).
#   tests/gpu/ffn_patches.sh [--require NAME] [--turns N] [--test] [PATCH_NAME ...]
# PATCH_NAME: pair (docs/notes/pair-multicast.patch), tail (docs/notes/tail-stream-k.patch); none
# given: both. --require NAME: run only on a GPU whose name contains NAME (exit 0 at once
# elsewhere, so that a device call that got another card costs nothing more); --test: also
# TEST_FFN_ONLY=wgmma build/tests/gpu/test_ffn_cuda in each tree. Exit 77 (skip) without a GPU,
# 1 when a patch does not apply or its build fails.
set -uo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.." || exit 2
out=${OUT:-build/ffn-patches}
require=""
turns=2
test=0
names=()
usage() {
    echo "usage: $0 [--require NAME] [--turns N] [--test] [pair|tail ...]" >&2
    exit 2
}
while (($#)); do
    case $1 in
    --require) require=$2; shift ;;
    --turns) turns=$2; shift ;;
    --test) test=1 ;;
    pair | tail) names+=("$1") ;;
    *) usage ;;
    esac
    shift
done
[[ $turns =~ ^[1-9]$ ]] || usage
((${#names[@]})) || names=(pair tail)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
if [[ -z $gpu ]]; then
    echo "SKIP: no GPU"
    exit 77
fi
echo "GPU: $gpu"
if [[ -n $require && $gpu != *"$require"* ]]; then
    echo "not a $require: nothing run"
    exit 0
fi
mkdir -p "$out"
scripts/gpu-node-build.sh --version >"$out/deps.log" 2>&1
# shellcheck disable=SC1091
source /tmp/epd-env.sh

patch_of() { [[ $1 == pair ]] && echo docs/notes/pair-multicast.patch || echo docs/notes/tail-stream-k.patch; }
# the gemmbench modes of a patch (each a run; pair's one run times both) and its bench tunings
modes_of() { [[ $1 == pair ]] && echo "--pair" || echo "_ --no-tail"; }
tunings_of() {
    [[ $1 == pair ]] && echo "default,pair wgmma,swiglu,pdl,d_bf16 wgmma,swiglu,pdl,d_bf16,pair" ||
        echo "default,no_tail"
}

jobs=$(nproc)
pids=()
for n in "${names[@]}"; do
    tree=/tmp/epd-patch-$n
    rm -rf "$tree"
    mkdir -p "$tree"
    tar --exclude=./build --exclude=./.git -cf - . | tar -C "$tree" -xf -
    if ! (cd "$tree" && patch -s -p1 <"$(patch_of "$n")"); then
        echo "FAIL: $(patch_of "$n") does not apply to this tree"
        exit 1
    fi
    targets="build/epd build/gemmbench"
    ((test)) && targets+=" build/tests/gpu/test_ffn_cuda"
    # shellcheck disable=SC2086
    (cd "$tree" && make -j$((jobs / ${#names[@]} + 1)) $targets) >"$out/build_$n.log" 2>&1 &
    pids+=($!)
done
for i in "${!names[@]}"; do
    if ! wait "${pids[$i]}"; then
        echo "FAIL: build of ${names[$i]} ($out/build_${names[$i]}.log)"
        tail -20 "$out/build_${names[$i]}.log"
        exit 1
    fi
done

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi=(mpirun -np 1 --bind-to none --mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any)
bench=(--bench --set experts.kind=ffn --bench-weights random --set model.num_experts=32
       --set model.hidden=7168 --set model.intermediate=2048 --set model.topk=8
       --set device.backend=cuda --bench-tokens "256,384,512" --bench-iters 20)
for n in "${names[@]}"; do
    tree=/tmp/epd-patch-$n
    echo "== $n ($(patch_of "$n"))"
    if ((test)); then
        TEST_FFN_ONLY=wgmma "$tree/build/tests/gpu/test_ffn_cuda" >"$out/test_$n.log" 2>&1
        echo "test_ffn_cuda (wgmma): rc $?, $(grep -E '^[0-9]+ passed' "$out/test_$n.log")"
        grep '^FAIL' "$out/test_$n.log" | head -5
    fi
    for ((t = 1; t <= turns; t++)); do
        for f in bf16 fp8; do
            for m in $(modes_of "$n"); do
                args=(--routed --rows "32,64,96,128" --iters 10)
                [[ $f == fp8 ]] && args+=(--fp8)
                [[ $m != _ ]] && args+=("$m")
                log=$out/gemm_${n}_${t}_${f}_${m#--}.log
                "$tree/build/gemmbench" "${args[@]}" >"$log" 2>&1
                echo "turn $t gemmbench ${args[*]}: rc $?"
                grep ' both ' "$log"
            done
        done
        log=$out/bench_${n}_$t.log
        FFN_BENCH_TUNINGS="$(tunings_of "$n")" "${mpi[@]}" "$tree/build/epd" "${bench[@]}" \
            >"$log" 2>&1
        echo "turn $t bench ($(tunings_of "$n")): rc $?"
        grep -E '^(bf16|fp8|ffn-baseline)' "$log"
    done
done
