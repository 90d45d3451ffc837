#!/usr/bin/env bash
# `epd --accuracy` at 2 CPU ranks on a small shape: one JSON object per mode, in the documented
# order; BF16 closest to the fp32 dispatch, every FP8 mode within DeepEP's calc_diff threshold
# (9e-4) and a few percent of relative L2 error, FP8 dispatch + FP8 combine at most 0.53 of the
# BF16 bytes; the same with ffn experts (generated BF16 and FP8 block weights, the properties that
# hold for any weights: BF16 is the floor, FP8 combine and per-tensor requant cost more, FP8
# dispatch is free for FP8 block weights), and from experts.weights; ffn without weights,
# --bench-weights without ffn and an oversize tokens count are refused.
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

# ffn experts with generated weights, both formats, at a tiny shape (seconds on CPU ranks)
run --json --set experts.kind=ffn --bench-weights random --set model.hidden=256 \
    --set model.intermediate=128 --set model.num_experts=8 --set model.topk=4 \
    --bench-tokens 32 --bench-iters 2 >"$out" || { echo "FAIL: epd --accuracy (ffn) exited $?"; exit 1; }
cat "$out"
python3 - "$out" <<'PY' || exit 1
import json, math, sys
tables = {}
for line in open(sys.argv[1]):
    if line.strip():
        r = json.loads(line)
        tables.setdefault(r["experts"], {})[r["accuracy"]] = r
assert list(tables) == ["ffn bf16", "ffn fp8-block"], list(tables)
names = ["bf16", "fp8 group128 fp32", "fp8 group128 ue8m0", "fp8 per_token fp32",
         "fp8 per_token ue8m0", "fp8 group128 -> requant, static S",
         "fp8 group128 -> requant, step S", "bf16 + fp8 combine", "fp8 group128 fp32 + fp8 combine"]
for experts, rows in tables.items():
    assert list(rows) == names, (experts, list(rows))
    bf16 = rows["bf16"]
    assert bf16["tokens"] == 128 and bf16["bytes_vs_bf16"] == 1.0, bf16
    for name, r in rows.items():
        l2 = r["rel_l2"]
        assert 0 < l2["median"] <= l2["p99"] <= l2["max"] < 1, (experts, r)
        assert math.isfinite(r["max_abs_error"]) and r["max_abs_error"] > 0, (experts, r)
        # BF16 rounding of partials and output only: the floor of every mode's typical token
        # (calc_diff weighs tokens by their energy, so one loud token can decide it: the
        # per-token median is the robust comparison)
        assert 0 < bf16["rel_l2"]["median"] <= l2["median"], (experts, r)
        assert 0 < r["calc_diff"] < 1, (experts, r)
    med = lambda name: rows[name]["rel_l2"]["median"]
    # FP8 combine: e4m3 on the expert outputs, an order of magnitude above BF16's rounding
    for name in ["bf16 + fp8 combine", "fp8 group128 fp32 + fp8 combine"]:
        assert med(name) > 5 * med("bf16"), (experts, rows[name])
    # a per-tensor S is never finer than the group scales it replaces
    assert med("fp8 group128 -> requant, step S") > med("fp8 group128 fp32"), (experts, rows)
    fp8c = rows["fp8 group128 fp32 + fp8 combine"]["bytes_vs_bf16"]
    assert fp8c < rows["fp8 group128 fp32"]["bytes_vs_bf16"] < 1.0, (experts, rows)
bw = tables["ffn bf16"]
# BF16 weights: group128 FP8 dispatch passes DeepEP's check, costs more than BF16 and less than
# one scale a token (the large channels set a per-token scale for the whole row)
assert bw["fp8 group128 fp32"]["calc_diff"] < 9e-4, bw
assert (bw["bf16"]["rel_l2"]["median"] * 2 < bw["fp8 group128 fp32"]["rel_l2"]["median"] <
        bw["fp8 per_token fp32"]["rel_l2"]["median"]), bw
fw = tables["ffn fp8-block"]
# FP8 block weights: the GEMM reads group128 FP8 of the row anyway, so dispatching those bytes
# changes nothing (host ops: the same bytes, the same outputs)
for key in ["calc_diff", "rel_l2", "max_abs_error"]:
    assert fw["fp8 group128 fp32"][key] == fw["bf16"][key], (key, fw)
    assert fw["fp8 group128 fp32 + fp8 combine"][key] == fw["bf16 + fp8 combine"][key], (key, fw)
print("accuracy ffn JSON: ok")
PY

# ffn experts from experts.weights (the FP8 block checkpoint scripts/make-test-model.py writes)
py=
for p in python3 /usr/bin/python3; do
    if $p -c 'import numpy' 2>/dev/null; then py=$p; break; fi
done
[[ -n $py ]] || { echo "FAIL: no python3 with numpy (scripts/deps.sh installs python3-numpy)"; exit 1; }
model=$(mktemp -d)
trap 'rm -f "$out"; rm -rf "$model"' EXIT
$py scripts/make-test-model.py "$model" --format fp8 --seed 4 >/dev/null ||
    { echo "FAIL: make-test-model"; exit 1; }
run --json --set experts.kind=ffn --set "experts.weights=$model" --set experts.layers=2 \
    --set model.hidden=256 --set model.num_experts=16 --set model.topk=8 --bench-tokens 32 \
    --bench-iters 1 >"$out" || { echo "FAIL: epd --accuracy (experts.weights) exited $?"; exit 1; }
python3 - "$out" <<'PY' || exit 1
import json, sys
rows = {r["accuracy"]: r for r in (json.loads(l) for l in open(sys.argv[1]) if l.strip())}
assert len(rows) == 9 and all(r["experts"] == "ffn fp8-block" for r in rows.values()), rows
assert rows["fp8 group128 fp32"]["rel_l2"] == rows["bf16"]["rel_l2"], rows
assert rows["bf16 + fp8 combine"]["rel_l2"]["median"] > 5 * rows["bf16"]["rel_l2"]["median"], rows
print("accuracy experts.weights: ok")
PY

run --set experts.kind=ffn --set model.hidden=256 --set model.num_experts=8 >"$out" 2>&1
rc=$?
cat "$out"
[[ $rc -eq 2 ]] && grep -q "needs --bench-weights" "$out" ||
    { echo "FAIL: ffn without weights was not refused (exit $rc)"; exit 1; }
run --bench-weights random --set model.hidden=256 --set model.num_experts=8 >"$out" 2>&1
rc=$?
cat "$out"
[[ $rc -eq 2 ]] && grep -q "goes with experts.kind = ffn" "$out" ||
    { echo "FAIL: --bench-weights with the scale kind was not refused (exit $rc)"; exit 1; }

run --bench-tokens 8192 --set model.hidden=1024 --set model.num_experts=16 >"$out" 2>&1
rc=$?
cat "$out"
[[ $rc -eq 2 ]] && grep -q "above dispatch.max_tokens_per_step" "$out" ||
    { echo "FAIL: an oversize --bench-tokens was not refused (exit $rc)"; exit 1; }
echo "accuracy refusals: ok"
