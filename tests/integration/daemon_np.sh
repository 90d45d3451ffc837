#!/usr/bin/env bash
# Results equal the single-process reference bit for bit at np = 1, 2 and 4, with several
# concurrent clients per rank: BF16 and FP8 dispatch (group128 and per_token scales, fp32 and
# ue8m0 scale formats), identity and scale experts, empty top-k slots, BF16 and FP8 combine.
source "$(dirname "$0")/daemon_lib.bash"

model=(--set model.hidden=256 --set model.num_experts=16 --set model.topk=4
       --set dispatch.max_tokens_per_request=64)

# telemetry WANT...: rank 0's `stats` has quant_error steps > 0 in the directions named (dispatch,
# combine) and none in the others, with a relative RMS error in (0, 0.1) where measured.
telemetry() {
    "$BUILD/epctl" --socket "$(sock 0)" --json stats | python3 -c '
import json, sys
want = sys.argv[1:]
qe = json.load(sys.stdin)["sockets"][0]["reply"]["engine"]["quant_error"]  # epctl --json: one document
for d in ("dispatch", "combine"):
    v = qe[d]
    if d in want:
        assert v["steps"] > 0 and 0 < v["overall"] < 0.1 and 0 < v["max"] < 0.1, (d, v)
    else:
        assert v["steps"] == 0 and v["last"] == 0, (d, v)
' "$@" || die "quant_error telemetry in stats is not what was expected (measured: $*)"
}

# run_case NP CLIENTS SEED ARGS...: starts the daemon, checks every rank, stops it; the telemetry
# directions expected in rank 0's stats are in $TELEMETRY (unset: not checked).
run_case() {
    local np=$1 clients=$2 seed=$3; shift 3
    epd_start "$np" "${model[@]}" "$@"
    local socks=() r
    for ((r = 0; r < np; r++)); do socks+=(--socket "$(sock $r)"); done
    timeout 60 "$CHECK" "${socks[@]}" --clients "$clients" --requests 12 --max-tokens 40 \
        --window 4 --seed "$seed" --empty-slots || die "np=$np $*: results differ from the reference"
    if [[ -n ${TELEMETRY+set} ]]; then telemetry $TELEMETRY; fi
    epd_stop
}

run_case 1 3 11 --set dispatch.dtype=bf16 --set experts.kind=identity
run_case 2 3 12 --set dispatch.dtype=fp8 --set dispatch.scale=group128 \
    --set dispatch.scale_format=fp32 --set experts.kind=scale
run_case 2 2 13 --set dispatch.dtype=fp8 --set dispatch.scale=per_token \
    --set dispatch.scale_format=ue8m0 --set experts.kind=scale
run_case 4 2 14 --set dispatch.dtype=bf16 --set experts.kind=scale
run_case 4 2 15 --set dispatch.dtype=fp8 --set dispatch.scale=group128 \
    --set dispatch.scale_format=ue8m0 --set experts.kind=identity
run_case 4 2 16 --set dispatch.dtype=fp8 --set dispatch.scale=per_token \
    --set dispatch.scale_format=fp32 --set experts.kind=scale
# FP8 partials (combine.dtype fp8): the source rank's sum of dequantized partials
# (and the quantization error telemetry in rank 0's stats)
TELEMETRY="dispatch combine" run_case 2 2 17 --set dispatch.dtype=fp8 --set combine.dtype=fp8 \
    --set experts.kind=scale
TELEMETRY="" run_case 4 2 18 --set dispatch.dtype=bf16 --set combine.dtype=fp8 \
    --set experts.kind=scale --set telemetry.quant_error=false
TELEMETRY="dispatch combine" run_case 4 2 19 --set dispatch.dtype=fp8 \
    --set dispatch.scale=per_token --set combine.dtype=fp8 --set experts.kind=identity
TELEMETRY="dispatch" run_case 2 2 20 --set dispatch.dtype=fp8 --set combine.dtype=bf16
echo "PASS: np 1, 2, 4 equal the reference (bf16, fp8 group128/per_token x fp32/ue8m0," \
    "identity/scale, bf16 and fp8 combine); quant_error telemetry in stats"
