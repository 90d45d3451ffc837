#!/usr/bin/env bash
# Device regions (DESIGN.md section 4b) on the GPU: x, ids and weights in the client's device
# memory shared by CUDA IPC, y written there by the daemon, equal to the payload path bit for bit
# (build/tests/region_check --cuda-device 0), with one rank, and with two ranks sharing the GPU
# (staged mpi); a NaN in device x is non_finite_input; a freed allocation's handle and a region
# past its allocation are bad_region; host regions through the same daemons as well. Skips
# visibly without a GPU.
source "$(dirname "$(readlink -f "$0")")/../integration/daemon_lib.bash"

nvidia-smi -L 2>/dev/null | grep -q '^GPU ' || skip "no GPU"
H=7168 K=8 E=256
model=(--set model.hidden=$H --set model.num_experts=$E --set model.topk=$K
       --set dispatch.max_tokens_per_request=64 --set device.backend=cuda --set device.id=0)

for np in 1 2; do
    extra=()
    ((np == 1)) || extra=(--set dispatch.transport=mpi --set dispatch.mpi_cuda_aware=false)
    EPD_LOG=$TMP/epd.log
    setsid "$MPIRUN" --oversubscribe -np $np --mca pml ucx --mca pml_ucx_tls any \
        --mca pml_ucx_devices any "$EPD" --set "socket.path=$TMP/epd-%r.sock" "${model[@]}" \
        "${extra[@]}" >"$EPD_LOG" 2>&1 &
    EPD_PID=$!
    epd_wait_healthy $np 90 "np $np"
    socks=()
    for ((r = 0; r < np; r++)); do socks+=(--socket "$(sock $r)"); done
    timeout 300 "$BUILD/tests/region_check" --hidden $H --topk $K --experts $E \
        --cuda-device 0 "${socks[@]}" || die "np $np: device regions"
    timeout 300 "$BUILD/tests/region_check" --hidden $H --topk $K --experts $E "${socks[@]}" ||
        die "np $np: host regions"
    epd_stop_ranks
    echo "ok    np $np: device and host regions equal the payload path"
done
echo "PASS: device regions (1 rank, 2 ranks sharing the GPU) equal the payload path bit for bit"
