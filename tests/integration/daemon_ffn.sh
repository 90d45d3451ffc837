#!/usr/bin/env bash
# ffn experts through the real sockets: the model scripts/make-test-model.py writes (H 256, I 128,
# E 16, three MoE layers after a dense one, BF16 and FP8 block weights, sharded with an index),
# 2 and 4 CPU ranks, requests of the three layers interleaved on every connection, BF16 and FP8
# partials (combine.dtype); every result equals the single-process reference bit for bit (same
# host arithmetic), and FP8 partials feed the combine telemetry. Then the start-up
# refusals: a missing shard, a wrong model.intermediate, a layer the weights lack.
source "$(dirname "$0")/daemon_lib.bash"

py=
for p in python3 /usr/bin/python3; do
    if $p -c 'import numpy' 2>/dev/null; then py=$p; break; fi
done
[[ -n $py ]] || die "no python3 with numpy (scripts/deps.sh installs python3-numpy)"
$py scripts/make-test-model.py "$TMP/bf16" --format bf16 --seed 3 || die "make-test-model bf16"
$py scripts/make-test-model.py "$TMP/fp8" --format fp8 --seed 4 || die "make-test-model fp8"

model=(--set model.hidden=256 --set model.num_experts=16 --set model.topk=8
       --set dispatch.max_tokens_per_request=32 --set experts.kind=ffn)

# unknown_layer SOCKET L: a SUBMIT naming layer L is answered unknown_layer, the connection stays.
unknown_layer() {
    python3 - "$1" "$2" <<'PY' || die "layer $2: not answered unknown_layer"
import json, struct, sys
sys.path.insert(0, "tests/integration")
import daemon_wire as w
raw = w.submit(7, 2, 256, 8)
meta_len, payload_len = struct.unpack("<I", raw[8:12])[0], struct.unpack("<Q", raw[16:24])[0]
meta = json.loads(raw[24:24 + meta_len])
meta["layer"] = int(sys.argv[2])
s = w.connect(sys.argv[1])
s.sendall(w.frame(w.SUBMIT, meta, raw[24 + meta_len:]))
kind, reply, _ = w.read_frame(s)
assert kind == w.ERROR and reply["code"] == "unknown_layer" and reply["id"] == 7, reply
print("layer", sys.argv[2], "->", reply["code"] + ":", reply["message"])
PY
}

# run_case NP WEIGHTS SEED ARGS...: starts the daemon, checks every rank, stops it.
run_case() {
    local np=$1 weights=$2 seed=$3; shift 3
    epd_start "$np" "${model[@]}" --set "experts.weights=$TMP/$weights" "$@"
    grep -q "ffn experts: 3 layers" "$EPD_LOG" ||
        die "np=$np: the start-up log does not say what was loaded"
    local socks=() r
    for ((r = 0; r < np; r++)); do socks+=(--socket "$(sock $r)"); done
    timeout 120 "$CHECK" "${socks[@]}" --clients 2 --requests 5 --max-tokens 16 --window 3 \
        --seed "$seed" --empty-slots --layers 1,2,3 ||
        die "np=$np $weights $*: results differ from the reference"
    # per-layer stats: only layers 1-3 stepped, and they add up to the tokens; the combine
    # telemetry measured steps exactly when the partials are FP8
    local fp8_combine=0
    [[ " $* " == *" combine.dtype=fp8 "* ]] && fp8_combine=1
    $WIRE stats "$(sock 0)" | python3 -c '
import json, sys
e = json.load(sys.stdin)["engine"]
lt = {x["layer"]: x["tokens"] for x in e["layer_tokens"]}
assert lt and set(lt) <= {1, 2, 3} and sum(lt.values()) == e["tokens"], e
c = e["quant_error"]["combine"]
assert (c["steps"] > 0 and 0 < c["overall"] < 0.1) if sys.argv[1] == "1" else c["steps"] == 0, c
' "$fp8_combine" ||
        die "np=$np: stats engine.layer_tokens or quant_error.combine is wrong"
    unknown_layer "$(sock 0)" 0 # the dense layer: no experts
    unknown_layer "$(sock $((np - 1)))" 4
    epd_stop
}

run_case 2 bf16 21 --set dispatch.dtype=bf16
run_case 4 bf16 22 --set dispatch.dtype=fp8 --set model.intermediate=128 --set combine.dtype=fp8 \
    --set telemetry.quant_error=true
run_case 2 fp8 23 --set dispatch.dtype=fp8 --set combine.dtype=fp8 --set telemetry.quant_error=true
run_case 4 fp8 24 --set dispatch.dtype=bf16 --set experts.layers=1-3

# start-up refusals name the file and tensor, and the daemon exits non-zero
expect_refusal() {
    local what=$1 needle=$2; shift 2
    epd_launch 2 "$TMP/refused.log" "${model[@]}" "$@"
    epd_wait_exit 30
    [[ $EPD_RC != 0 && $EPD_RC != 124 ]] ||
        die "$what: the daemon did not refuse to start (rc $EPD_RC)"
    grep -q -- "$needle" "$TMP/refused.log" || die "$what: the log does not say '$needle'"
}
rm "$TMP/fp8/model-00002-of-00002.safetensors"
expect_refusal "missing shard" "model-00002-of-00002.safetensors: missing shard" \
    --set "experts.weights=$TMP/fp8"
expect_refusal "intermediate" "model.intermediate = 256" --set "experts.weights=$TMP/bf16" \
    --set model.intermediate=256
expect_refusal "unknown layer" "layer 7, which has no experts" --set "experts.weights=$TMP/bf16" \
    --set experts.layers=1,7
expect_refusal "no weights" "needs experts.weights"
echo "PASS: ffn experts at np 2 and 4 (bf16 and fp8 block weights, layers 1-3 interleaved," \
    "bf16 and fp8 partials) equal the reference; unknown layers and start-up refusals named"
