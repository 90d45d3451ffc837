#!/usr/bin/env bash
# External experts on the GPU (issue 24): a CUDA daemon's gather and partials kernels
# (gpu/external_cuda.cu) must give the host ops' bytes: tests/python/test_external.py's scale
# workers equal experts.kind=scale bit for bit on 1 rank (2 ranks when there are 2 GPUs), every
# input format, with host regions and with device regions (torch CUDA workers); then the
# hand-over latency at the DeepSeek-V3 shape (H 7168, K 8, E 256, one rank, device regions) at
# 128 and 2048 tokens, with a C worker (tests/integration/external_check.c --latency) sleeping
# between EXPERTS and one spinning on its socket, and a torch one (tests/gpu/external_latency.py),
# and the daemon's own p50 line at exit. EPDX_LATENCY_ONLY=1 runs the latency part alone.
# Skips visibly without a GPU or a python3 with torch (CUDA).
source "$(dirname "$(readlink -f "$0")")/../integration/daemon_lib.bash"
source tests/python/python_lib.bash

n_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
((n_gpus >= 1)) || skip "no GPU: needs 1, found ${n_gpus:-0}"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null ||
    skip "$PY cannot import torch with CUDA"
[[ -x $BUILD/tests/py_ref ]] || die "$BUILD/tests/py_ref is not built"
export EPDPY_REF=$BUILD/tests/py_ref EPDPY_TMP=$TMP PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False

# launch NP SETTINGS...: a CUDA daemon of NP ranks (rank r on GPU r)
launch() {
    local np=$1; shift
    EPD_LOG=$TMP/epd.log
    setsid "$MPIRUN" --oversubscribe -np "$np" --bind-to none --mca pml ucx --mca pml_ucx_tls any \
        --mca pml_ucx_devices any "$EPD" --set "socket.path=$TMP/epd-%r.sock" \
        --set device.backend=cuda --set experts.kind=external "$@" >"$EPD_LOG" 2>&1 &
    EPD_PID=$!
    epd_wait_healthy "$np" 120 "$*"
}

small=(--set model.hidden=7168 --set model.num_experts=8 --set model.topk=4
       --set dispatch.max_tokens_per_request=64 --set dispatch.max_tokens_per_step=128
       --set experts.external_timeout_ms=5000)
# exact NP DEVICE SETTINGS...: scale workers (host regions, or device regions on DEVICE) equal
# experts.kind=scale bit for bit
exact() {
    local np=$1 dev=$2; shift 2
    echo "== $np rank(s), regions ${dev:-host}: $* ($(date +%T))"
    launch "$np" "${small[@]}" "$@"
    local socks=$(sock 0)
    ((np == 2)) && socks="$socks:$(sock 1)"
    EPDPY_SOCKETS=$socks EPDX_CASE=exact EPDX_DEVICE=$dev timeout 300 \
        "$PY" tests/python/test_external.py 2>&1 || die "exact ($np ranks, ${dev:-host}, $*)"
    epd_stop_ranks
}
[[ ${EPDX_LATENCY_ONLY:-0} == 1 ]] || for dev in "" cuda:0; do
    for input in fp8_group128 bf16 fp8_per_tensor; do
        exact 1 "$dev" --set experts.external_input=$input
    done
    exact 1 "$dev" --set experts.external_input=fp8_group128 --set dispatch.dtype=bf16 \
        --set combine.dtype=fp8
done
# two ranks on two GPUs (host regions: one test process cannot put each worker's device regions
# on its own rank's GPU through EPDX_DEVICE)
if [[ ${EPDX_LATENCY_ONLY:-0} != 1 ]] && ((n_gpus >= 2)); then
    exact 2 "" --set experts.external_input=fp8_per_tensor --set combine.dtype=fp8
fi

echo "== latency: V3 shape, one rank, device regions ($(date +%T))"
# latency_run N LABEL CMD...: a fresh one-rank daemon for N tokens, CMD as its worker, then the
# daemon's own p50 line prefixed with LABEL
latency_run() {
    local n=$1 label=$2; shift 2
    launch 1 --set model.hidden=7168 --set model.num_experts=256 --set model.topk=8 \
        --set dispatch.max_tokens_per_request=$n --set dispatch.max_tokens_per_step=$n \
        --set experts.external_input=fp8_group128 --set experts.external_timeout_ms=10000 \
        --set socket.max_frame_bytes=268435456
    timeout 600 "$@" 2>&1 || die "latency run at $n tokens ($label)"
    epd_stop_ranks
    grep "external experts: p50" "$EPD_LOG" | sed "s/^/daemon, $n tokens, $label: /" ||
        die "the daemon logged no latency summary"
}
for n in 128 2048; do
    # the C worker (libepd) first: the daemon's hand-over without Python's own costs; sleeping
    # in poll(2) between EXPERTS (spin=0, the library's default), then polling its socket
    # (epd_client_set_spin, 200 ms: longer than any step here) in the same session
    latency_run $n "C worker" "$BUILD/tests/external_check" "$(sock 0)" --latency "$n" 2000
    latency_run $n "C worker spinning" "$BUILD/tests/external_check" "$(sock 0)" --latency "$n" \
        2000 spin=200000
    latency_run $n "Python worker" "$PY" tests/gpu/external_latency.py "$(sock 0)" "$n" 2000
done
if [[ ${EPDX_LATENCY_ONLY:-0} == 1 ]]; then
    echo "PASS: latencies above (EPDX_LATENCY_ONLY: the exactness runs were left out)"
else
    echo "PASS: CUDA external experts equal scale experts bit for bit; latencies above"
fi
