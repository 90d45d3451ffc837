#!/usr/bin/env bash
# `epd --accuracy` at 2 CPU ranks on a small shape: one JSON object per mode, in the documented
# order; BF16 closest to the fp32 dispatch, every FP8 mode within DeepEP's calc_diff threshold
# (9e-4) and a few percent of relative L2 error, FP8 dispatch + FP8 combine at most 0.53 of the
# BF16 bytes; an expert kind without a host reference or an oversize tokens count is refused.
set -u
BUILD=${BUILD:-build}
MPIRUN=${MPIRUN:-mpirun}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
epd=$BUILD/epd
if [[ ! -x $epd ]]; then
    echo "SKIP: $epd not built"
    exit 77
fi
if ! command -v python3 >/dev/null; then
    echo "SKIP: python3 is needed to read the JSON lines"
    exit 77
fi
run() {
    timeout 120 "$MPIRUN" --oversubscribe -np 2 --mca pml ucx --mca pml_ucx_tls any \
        --mca pml_ucx_devices any "$epd" --accuracy --set device.backend=cpu "$@"
}
out=$(mktemp)
trap 'rm -f "$out"' EXIT

run --json --set model.hidden=1024 --set model.num_experts=16 --set model.topk=4 \
    --bench-tokens 64 --bench-iters 2 >"$out" || { echo "FAIL: epd --accuracy exited $?"; exit 1; }
cat "$out"
python3 - "$out" <<'PY' || exit 1
import json, sys
rows = {r["accuracy"]: r for r in (json.loads(l) for l in open(sys.argv[1]) if l.strip())}
names = ["bf16", "fp8 group128 fp32", "fp8 group128 ue8m0", "fp8 per_token fp32",
         "fp8 per_token ue8m0", "fp8 group128 -> requant, static S",
         "fp8 group128 -> requant, step S", "bf16 + fp8 combine", "fp8 group128 fp32 + fp8 combine"]
assert list(rows) == names, list(rows)
bf16 = rows["bf16"]
assert bf16["tokens"] == 256 and bf16["bytes_vs_bf16"] == 1.0, bf16
for name, r in rows.items():
    l2 = r["rel_l2"]
    assert 0 < l2["median"] <= l2["p99"] <= l2["max"], r
    assert r["max_abs_error"] > 0 and 0 < r["calc_diff"] < 9e-4, r
    if name != "bf16":
        # e4m3: a few percent, an order of magnitude above BF16's rounding
        assert r["calc_diff"] > 10 * bf16["calc_diff"] and 0.005 < l2["median"] < 0.06, r
assert 0.45 < rows["fp8 group128 fp32 + fp8 combine"]["bytes_vs_bf16"] <= 0.53, rows
assert 0.7 < rows["fp8 group128 fp32"]["bytes_vs_bf16"] < 0.8, rows
# group scales beat one scale per token on rows with large channels
assert rows["fp8 group128 fp32"]["calc_diff"] < rows["fp8 per_token fp32"]["calc_diff"], rows
print("accuracy JSON: ok")
PY

run --bench-tokens 8192 --set model.hidden=1024 --set model.num_experts=16 >"$out" 2>&1
rc=$?
cat "$out"
[[ $rc -eq 2 ]] && grep -q "above dispatch.max_tokens_per_step" "$out" ||
    { echo "FAIL: an oversize --bench-tokens was not refused (exit $rc)"; exit 1; }
echo "accuracy refusals: ok"
