#!/usr/bin/env bash
# The Hopper ffn GEMM kernel (tuning `wgmma`, gpu/ffn_gemm_wgmma.cu) on one H200, quickest first,
# in one call. Build first: scripts/gpu-node-build.sh all; source /tmp/epd-env.sh
#   1. TEST_FFN_ONLY=wgmma build/tests/gpu/test_ffn_cuda: the kernel's own checks at each row
#      tile (small integers against CPU sums, 0..600 rows per expert, split-K off/fixed/auto),
#      then every ffn case with the wgmma tunings. Wrong outputs print (expert, row, feature,
#      got, want, and the consumer / warp / lane / register that holds it); a hung mbarrier wait
#      prints the CTA, thread, stage and bytes expected. Ends "N passed, 0 failed".
#   2. the bench at E_local 32, H 7168, I 2048, 1..512 rows per expert, the default, strided,
#      kernel and every wgmma tuning only (FFN_BENCH_TUNINGS), then tests/gpu/ffn_gpu.sh's
#      summary on that log (--skip-tests: its Done-when lines, the kernel tables with wgmma).
#   3. with --full: all of test_ffn_cuda (every tuning, the mma.sync kernel's checks) as well.
# Usage: tests/gpu/ffn_wgmma_gpu.sh [--full] [--no-bench]; logs in $OUT (or build/ffn-wgmma).
set -uo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
out=${OUT:-build/ffn-wgmma}
mkdir -p "$out"
full=0
bench=1
while (($#)); do
    case $1 in
    --full) full=1 ;;
    --no-bench) bench=0 ;;
    *) echo "usage: $0 [--full] [--no-bench]" >&2; exit 2 ;;
    esac
    shift
done
[[ -f /tmp/epd-env.sh ]] && source /tmp/epd-env.sh
nvidia-smi -L 2>/dev/null | grep -q '^GPU ' || { echo "SKIP: no GPU"; exit 77; }
status=0

echo "---- 1. test_ffn_cuda, the wgmma kernel only ($out/wgmma_test.log)"
TEST_FFN_ONLY=wgmma timeout 600 build/tests/gpu/test_ffn_cuda >"$out/wgmma_test.log" 2>&1
rc=$?
# the failures with their first wrong elements, the kernel's hang records, the notes (a check
# refused: why), the tally
grep -E '^(FAIL|note)|^      ' "$out/wgmma_test.log" | head -n 60
grep -cE '^PASS' "$out/wgmma_test.log" | sed 's/^/PASS lines: /'
tail -n 1 "$out/wgmma_test.log"
((rc == 0)) || { echo "FAIL  test_ffn_cuda (wgmma only): exit $rc"; status=1; }

if ((full)); then
    echo "---- 3. test_ffn_cuda, all ($out/test_ffn_cuda.log)"
    timeout 900 build/tests/gpu/test_ffn_cuda >"$out/test_ffn_cuda.log" 2>&1
    rc=$?
    grep -E '^FAIL|^      ' "$out/test_ffn_cuda.log" | head -n 30
    tail -n 1 "$out/test_ffn_cuda.log"
    ((rc == 0)) || { echo "FAIL  test_ffn_cuda: exit $rc"; status=1; }
fi

if ((bench)); then
    echo "---- 2. bench: default, strided, kernel, wgmma* ($out/bench.log, summary $out/summary.md)"
    export FFN_BENCH_TUNINGS="strided kernel wgmma wgmma,split=1 wgmma,split=2 wgmma,tile=32 wgmma,tile=64 wgmma,tile=96 wgmma,tile=128 wgmma,tile=192 wgmma,tile=256 kernel,upto=16,wgmma wgmma,swiglu kernel,upto=16,wgmma,swiglu"
    OUT="$out" timeout 900 bash tests/gpu/ffn_gpu.sh --skip-tests
    rc=$?
    # its Done-when lines fail for the default until the switch: this script's exit status is
    # the tests'
    echo "tests/gpu/ffn_gpu.sh --skip-tests: exit $rc"
fi
exit $status
