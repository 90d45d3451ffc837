#!/usr/bin/env bash
# A same-run A/B of a change to the ffn experts' GPU code, in one device call: the tree as it is
# (the change) against the tree with PATCH reversed (the base), both built here, then PAIRS turns
# of base then change: build/gemmbench --routed (the Hopper GEMMs alone, BF16 alone and in pairs,
# FP8, both projections) at ROWS rows an expert, and the ffn bench's default
# (FFN_BENCH_TUNINGS=none) at TOKENS tokens. Prints each turn's figures and, per figure, the
# change over the base in every pair and their median (below 1: the change is faster). Each
# session wrote this by hand before.
# Make the patch on the build machine, against what the base should be, and carry it:
#   git diff BASE -- gpu tests/gpu daemon > .dbg/ab.patch
# then on the GPU machine (after scripts/gpu-node-build.sh's dependencies, or it runs them):
#   tests/gpu/ffn_ab.sh .dbg/ab.patch [--pairs N] [--rows LIST] [--tokens LIST] [--iters N]
# Logs in $OUT (or build/ffn-ab). Exit 0 when every run ran; 77 (skip) without a GPU.
set -uo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.." || exit 2
out=${OUT:-build/ffn-ab}
patch_file=""
pairs=2
rows=32,64,128
tokens=128,256,512
iters=30
usage() {
    echo "usage: $0 PATCH [--pairs N] [--rows LIST] [--tokens LIST] [--iters N]" >&2
    exit 2
}
while (($#)); do
    case $1 in
    --pairs) pairs=$2; shift ;;
    --rows) rows=$2; shift ;;
    --tokens) tokens=$2; shift ;;
    --iters) iters=$2; shift ;;
    -*) usage ;;
    *) [[ -z $patch_file ]] || usage; patch_file=$1 ;;
    esac
    shift
done
[[ -n $patch_file && -f $patch_file ]] || usage
[[ $pairs =~ ^[1-9][0-9]?$ ]] || usage
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "SKIP: no GPU"
    exit 77
fi
mkdir -p "$out"
patch_file=$(readlink -f "$patch_file")
base=$(mktemp -d /tmp/epd-ab-base.XXXXXX)

# the base: this tree without the change (its own build directory, nothing shared)
tar --exclude=./build --exclude=./.git -cf - . | tar -C "$base" -xf -
if ! (cd "$base" && patch -s -R -p1 <"$patch_file"); then
    echo "FAIL: $patch_file does not reverse-apply to this tree"
    exit 1
fi
scripts/gpu-node-build.sh --version >"$out/deps.log" 2>&1
# shellcheck disable=SC1091
source /tmp/epd-env.sh
jobs=$(nproc)
make -j$((jobs / 2 + 1)) build/epd build/gemmbench >"$out/build.log" 2>&1 &
(cd "$base" && make -j$((jobs / 2 + 1)) build/epd build/gemmbench) >"$out/build_base.log" 2>&1
base_rc=$?
wait $!
change_rc=$?
if ((base_rc != 0 || change_rc != 0)); then
    echo "FAIL: build (change rc $change_rc, base rc $base_rc; $out/build*.log)"
    exit 1
fi

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi=(mpirun -np 1 --bind-to none --mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any)
bench=(--bench --set experts.kind=ffn --bench-weights random --set model.num_experts=32
       --set model.hidden=7168 --set model.intermediate=2048 --set model.topk=8
       --set device.backend=cuda --bench-tokens "$tokens" --bench-iters "$iters")
echo "ffn A/B: $patch_file reversed is the base; $pairs pairs; gemmbench rows $rows; bench" \
     "tokens $tokens"
failed=0
for ((t = 1; t <= pairs; t++)); do
    for v in base change; do
        dir=.
        [[ $v == base ]] && dir=$base
        log=$out/turn${t}_$v.log
        {
            "$dir/build/gemmbench" --routed --rows "$rows" --pair
            "$dir/build/gemmbench" --routed --rows "$rows" --fp8
            FFN_BENCH_TUNINGS=none "${mpi[@]}" "$dir/build/epd" "${bench[@]}"
        } >"$log" 2>&1 || { echo "FAIL: turn $t $v ($log)"; failed=1; }
    done
done
rm -rf "$base"
python3 - "$out" "$pairs" <<'EOF'
import re, statistics, sys
out, pairs = sys.argv[1], int(sys.argv[2])
def figures(path):
    f = {}
    for line in open(path, errors='replace'):
        m = re.match(r'(bf16|fp8) +(gate/up|down|both) +rows +(\d+) '
                     r'tile +\d+( pair)?: +([\d.]+) us', line)
        if m:
            f['gemm %-4s %-7s %4s rows%s' % (m[1], m[2], m[3], m[4] or '')] = float(m[5])
            continue
        w = line.split()
        if len(w) > 8 and w[0] in ('bf16', 'fp8-block') and w[1] == 'default' and w[2].isdigit():
            f['bench %-4s %5s tokens' % (w[0].split('-')[0], w[2])] = float(w[5])
    return f
turns = [(figures('%s/turn%d_base.log' % (out, t)), figures('%s/turn%d_change.log' % (out, t)))
         for t in range(1, pairs + 1)]
keys = [k for k in turns[0][0] if all(k in b and k in c for b, c in turns)]
print('%-34s %s  %s' % ('figure (us)', '  '.join('base -> change' for _ in turns), 'median ratio'))
for k in keys:
    cells = ['%7.1f -> %7.1f' % (b[k], c[k]) for b, c in turns]
    print('%-34s %s  %.3f' % (k, '  '.join(cells),
                              statistics.median(c[k] / b[k] for b, c in turns)))
if not keys:
    print('FAIL: no figure in every turn (logs in %s)' % out)
    sys.exit(1)
EOF
py_rc=$?
((failed == 0 && py_rc == 0)) || exit 1
