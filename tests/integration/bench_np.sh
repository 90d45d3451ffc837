#!/usr/bin/env bash
# `epd --bench` at 2 CPU ranks on a small shape: --json is one document whose results hold an
# object for each tokens count and variant (fp8/bf16 combine, fp8/fp8, bf16/bf16, fp8/fp8 with the
# telemetry switched) plus the FP8/BF16 comparisons and the telemetry's cost, FP8 dispatch bytes
# about half of BF16's, FP8 dispatch + FP8 combine at most 0.53 of BF16's, times and GB/s present
# and positive; a size that cannot fit in memory is skipped with a reason, not a crash.
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
        --mca pml_ucx_devices any "$epd" --bench --set device.backend=cpu "$@"
}
out=$(mktemp)
trap 'rm -f "$out"' EXIT

run --json --set model.hidden=512 --set model.num_experts=16 --set model.topk=4 \
    --bench-tokens 16,64 --bench-iters 3 >"$out" || { echo "FAIL: epd --bench exited $?"; exit 1; }
cat "$out"
python3 - "$out" <<'PY' || exit 1
import json, sys
doc = json.load(open(sys.argv[1]))   # one document, not one per line
assert doc["bench"] == "epd", doc
rows = doc["results"]
steps = [r for r in rows if r["bench"] == "step"]
cmps = [r for r in rows if r["bench"] == "compare"]
tele = [r for r in rows if r["bench"] == "telemetry"]
variants = [("fp8", "bf16", True), ("fp8", "fp8", True), ("bf16", "bf16", True), ("fp8", "fp8", False)]
assert [(r["tokens"], r["dtype"], r["combine_dtype"], r["quant_error"]) for r in steps] == \
    [(n,) + v for n in (16, 64) for v in variants], steps
assert [r["tokens"] for r in cmps] == [16, 16, 64, 64], cmps
assert [r["tokens"] for r in tele] == [16, 64] and all(t["quant_error_on_over_off"]["pack"] > 0 for t in tele), tele
for r in steps:
    assert r["world"] == 2 and r["hidden"] == 512 and r["iters"] == 3, r
    for p in ("pack", "counts", "dispatch", "experts", "combine", "reduce"):
        assert r["phases_us"][p]["median"] > 0 and r["phases_us"][p]["p99"] >= r["phases_us"][p]["median"], (p, r)
    assert r["step_us"]["median"] > 0 and r["raw_us"]["dispatch"]["median"] > 0, r
    b = r["bytes_per_rank"]
    assert 0 < b["dispatch_off_rank"] < b["dispatch"] and 0 < b["combine_off_rank"] < b["combine"], r
    assert r["ratio_vs_raw"] > 0, r
    g = r["gb_per_s_per_rank"]
    assert g["dispatch"] > 0 and g["combine"] > 0, r
for c in cmps:
    if "fp8_over_bf16" in c:
        r = c["fp8_over_bf16"]
        assert 0.45 < r["dispatch_bytes"] < 0.6 and r["combine_bytes"] == 1.0, c
    else:
        r = c["fp8_fp8_combine_over_bf16"]
        # e4m3 + scales both ways: at most 0.53 of the BF16 bytes
        assert 0.45 < r["bytes"] <= 0.53 and 0.45 < r["combine_bytes"] <= 0.53, c
print("bench JSON: ok")
PY

# 65536 tokens of hidden 65536 need ~90 GiB a rank: refused before allocating, the run goes on
run --set model.hidden=65536 --set model.num_experts=16 --set model.topk=4 \
    --set dispatch.max_tokens_per_request=1024 --bench-tokens 65536,2 --bench-iters 2 >"$out" 2>&1
rc=$?
cat "$out"
[[ $rc -eq 0 ]] || { echo "FAIL: the oversize run exited $rc"; exit 1; }
grep -q "65536 fp8   bf16 on  skipped: needs" "$out" || { echo "FAIL: no skip line for the oversize size"; exit 1; }
grep -q "2 fp8/bf16" "$out" || { echo "FAIL: the next size did not run"; exit 1; }
grep -Eq "^ +2 fp8 +bf16 +o[nf]+ +median .* \([0-9.]+ [kMG]?B, [0-9.]+ GB/s\) / .* GB/s\)$" "$out" ||
    { echo "FAIL: no GB/s beside the byte counts"; exit 1; }
echo "bench oversize: ok"
