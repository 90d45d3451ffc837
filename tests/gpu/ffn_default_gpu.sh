#!/usr/bin/env bash
# The ffn experts' default tuning on one H200 or H100, in one call of a few minutes: the path
# each call takes (gpu/ffn_path.h) and what it costs the host. Build first:
# scripts/gpu-node-build.sh all; source /tmp/epd-env.sh
#   1. TEST_FFN_ONLY=default build/tests/gpu/test_ffn_cuda: every case through the ops (the
#      daemon's default) and the tunings "default" and "default,no_wgmma" (as set where the
#      Hopper kernel is refused) against the host reference within DESIGN.md section 9's
#      tolerance, each call's path against gpu/ffn_path.h's choice, the default's calls within
#      its wgmma limits (BF16 up to 64 rows per expert, 128 on an H100 SXM; FP8 up to 192) on
#      the wgmma kernel. Ends "N passed, 0 failed".
#   2. epd --bench at E_local 32, H 7168, I 2048, the default, default,no_wgmma and kernel
#      (FFN_BENCH_TUNINGS), 4..512 rows per expert: per row the experts and host times, the
#      path, the GEMM calls queued and the plans made (cuBLASLt heuristic queries), and the
#      host's share of the phase (host_us / experts_us; near 1: the launches are the phase).
# Usage: tests/gpu/ffn_default_gpu.sh [--tokens LIST] [--iters N]; logs in $OUT (or
# build/ffn-default). Exit 0 when the test passed and the bench ran.
set -uo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
out=${OUT:-build/ffn-default}
mkdir -p "$out"
tokens=16,32,64,128,256,512,1024,2048 # rows per expert = tokens * 8 / 32: 4 .. 512
iters=20
while (($#)); do
    case $1 in
    --tokens) tokens=$2; shift ;;
    --iters) iters=$2; shift ;;
    *) echo "usage: $0 [--tokens LIST] [--iters N]" >&2; exit 2 ;;
    esac
    shift
done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
[[ -f /tmp/epd-env.sh ]] && source /tmp/epd-env.sh
nvidia-smi -L 2>/dev/null | grep -q '^GPU ' || { echo "SKIP: no GPU"; exit 77; }
status=0

echo "---- 1. test_ffn_cuda, the default's paths ($out/test_default.log)"
TEST_FFN_ONLY=default timeout 300 build/tests/gpu/test_ffn_cuda >"$out/test_default.log" 2>&1
rc=$?
grep -E '^(FAIL|note)' "$out/test_default.log" | sort | uniq -c | sort -rn | head -n 20
tail -n 1 "$out/test_default.log"
((rc == 0)) || { echo "FAIL  test_ffn_cuda (default only): exit $rc"; status=1; }

echo "---- 2. the bench ($out/bench.log)"
FFN_BENCH_TUNINGS="default,no_wgmma kernel" timeout 420 \
    mpirun -np 1 --bind-to none --mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any \
    build/epd --bench --set experts.kind=ffn --bench-weights random --set model.num_experts=32 \
    --set model.hidden=7168 --set model.intermediate=2048 --set model.topk=8 \
    --set device.backend=cuda --bench-tokens "$tokens" --bench-iters "$iters" >"$out/bench.log" 2>&1
rc=$?
((rc == 0)) || { echo "FAIL  bench: exit $rc ($(tail -n 1 "$out/bench.log"))"; status=1; }
grep -E 'note:|skipped|rror|^accuracy' "$out/bench.log" | head -n 20
awk '
function kv(line, key) { if (match(line, key "=[^ ]+")) return substr(line, RSTART + length(key) + 1, RLENGTH - length(key) - 1); return "" }
BEGIN { print "| weights | tuning | rows/expert | experts_us | host_us | host / experts | path | gemm calls | plans made |"; print "|---|---|---:|---:|---:|---:|---|---:|---:|" }
/^ffn-result / {
    us = kv($0, "experts_us") + 0; h = kv($0, "host_us") + 0
    share = us > 0 ? h / us : 0 # not in printf'"'"'s list: a ">" there is a redirection
    printf "| %s | %s | %s | %s | %s | %.2f | %s | %s | %s |\n", kv($0, "weights"), kv($0, "tuning"), kv($0, "rows_per_expert") + 0, kv($0, "experts_us"), kv($0, "host_us"), share, kv($0, "path"), kv($0, "gemm_calls"), kv($0, "plans_made")
}' "$out/bench.log" | tee "$out/summary.md"
exit $status
