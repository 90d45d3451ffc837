#!/usr/bin/env bash
# examples/external_experts.py on CPU torch: a frontend per rank that serves its rank's SwiGLU
# experts in PyTorch (weights from the checkpoint scripts/make-test-model.py writes, BF16 and FP8
# blocks) and submits on the same connection, checked against experts.kind=ffn on the same
# weights (DESIGN.md section 9 tolerances), 2 CPU ranks. Skips (visibly) without torch.
source "$(dirname "$0")/daemon_lib.bash"
source tests/python/python_lib.bash
"$PY" -c 'import torch' 2>/dev/null || skip "no torch for $PY (apt-get install python3-torch)"

FFN_PID=
trap '[[ -n $FFN_PID ]] && kill -KILL -- "-$FFN_PID" 2>/dev/null; cleanup' EXIT
model=(--set model.hidden=256 --set model.num_experts=16 --set model.topk=4
       --set dispatch.max_tokens_per_request=32 --set dispatch.max_tokens_per_step=64)
for fmt in bf16 fp8; do
    "$PY" scripts/make-test-model.py "$TMP/$fmt" --format "$fmt" --seed 5 || die "make-test-model"
    input=$([[ $fmt == bf16 ]] && echo bf16 || echo fp8_group128)
    echo "== $fmt weights, experts.external_input=$input ($(date +%T))"
    epd_launch 2 "$TMP/ffn.log" "${model[@]}" --set experts.kind=ffn \
        --set "experts.weights=$TMP/$fmt" --set "socket.path=$TMP/ffn-%r.sock"
    FFN_PID=$EPD_PID
    epd_start 2 "${model[@]}" --set experts.kind=external --set experts.external_input=$input \
        --set experts.external_timeout_ms=20000
    for r in 0 1; do
        until [[ -S $TMP/ffn-$r.sock ]] && $WIRE health "$TMP/ffn-$r.sock" >/dev/null 2>&1; do
            kill -0 "$FFN_PID" 2>/dev/null || { cat "$TMP/ffn.log"; die "the ffn daemon exited"; }
            sleep 0.1
        done
    done
    timeout 300 "$PY" examples/external_experts.py --sockets "$TMP/epd-%r.sock" \
        --ffn-sockets "$TMP/ffn-%r.sock" --ranks 2 --weights "$TMP/$fmt" --batches 8 \
        --tokens 24 || die "the example with $fmt weights"
    epd_stop
    EPD_PID=$FFN_PID FFN_PID=
    epd_stop
done
echo "PASS: the torch worker's SwiGLU experts agree with experts.kind=ffn (BF16 and FP8 weights)"
