#!/usr/bin/env bash
# External experts (experts.kind external, DESIGN.md section 9) on CPU ranks: Python workers
# (python/epd Client.serve_experts) applying scale experts give results bit for bit equal to
# experts.kind=scale (the host reference epd_moe_reference, py_ref) on 2 and 4 ranks, in every
# input format (fp8_group128, bf16, fp8_per_tensor with the step scale and with a static S),
# packed and masked, FP8 and BF16 dispatch; one connection that submits and serves; empty steps
# send no EXPERTS; no worker, a worker that dies mid-step and one that is late get
# experts_unavailable for the requests that reached that rank and the next steps are right again;
# a second worker is refused; EXPERTS_DONE for a wrong step or from a non-worker is closed.
source "$(dirname "$0")/daemon_lib.bash"
source tests/python/python_lib.bash

[[ -x $BUILD/tests/py_ref ]] || skip "$BUILD/tests/py_ref is not built"
export EPDPY_REF=$BUILD/tests/py_ref EPDPY_TMP=$TMP

base=(--set model.hidden=256 --set model.num_experts=8 --set model.topk=3
      --set experts.kind=external --set experts.external_timeout_ms=1000
      --set dispatch.max_tokens_per_request=64 --set dispatch.max_tokens_per_step=128
      --set dispatch.max_queued_tokens=1024 --set socket.max_frame_bytes=1048576)

# run NP CASE SETTINGS...: a daemon of NP ranks with the settings, then the Python case
run() {
    local np=$1 case=$2; shift 2
    echo "== $np ranks, $case: $* ($(date +%T))"
    epd_start "$np" "${base[@]}" "$@"
    local socks=() r
    for ((r = 0; r < np; r++)); do socks+=("$(sock "$r")"); done
    EPDPY_SOCKETS=$(IFS=:; echo "${socks[*]}") EPDX_CASE=$case EPDX_SETTINGS="$*" \
        timeout 120 "$PY" tests/python/test_external.py 2>&1 || die "$case ($np ranks, $*)"
    epd_stop
}

# libepd: one thread, one connection that serves the rank's experts and submits (1 rank: the
# step that holds its SUBMIT waits for its own EXPERTS_DONE)
[[ -x $BUILD/tests/external_check ]] || die "$BUILD/tests/external_check is not built"
for fmt in fp8_group128 fp8_per_tensor bf16; do
    echo "== 1 rank, libepd worker, $fmt ($(date +%T))"
    epd_start 1 "${base[@]}" --set experts.external_input=$fmt
    timeout 60 "$BUILD/tests/external_check" "$(sock 0)" 24 || die "libepd worker ($fmt)"
    epd_stop
done

run 2 failures --set experts.external_input=fp8_group128
grep -q "rank 1 step [0-9]*: has no expert worker" "$TMP/epd.log" ||
    die "no log line names the rank and the step of a step without a worker"
run 2 exact --set experts.external_input=fp8_group128
run 2 exact --set experts.external_input=bf16
run 2 exact --set experts.external_input=fp8_per_tensor
run 2 static --set experts.external_input=fp8_per_tensor
run 2 exact --set experts.external_input=fp8_group128 --set dispatch.dtype=bf16 \
    --set combine.dtype=fp8
run 2 exact --set experts.external_input=bf16 --set dispatch.scale_format=ue8m0 \
    --set dispatch.scale=per_token
run 2 exact --set experts.external_input=fp8_per_tensor --set experts.external_layout=masked \
    --set experts.external_capacity=512
run 4 exact --set experts.external_input=fp8_group128
run 4 exact --set experts.external_input=fp8_per_tensor --set combine.dtype=fp8
echo "PASS: external experts equal scale experts bit for bit; failures answered experts_unavailable"
