#!/usr/bin/env bash
# The Python client's device regions with torch CUDA tensors (tests/gpu/test_python_cuda.py) and
# examples/torch_moe.py, on a 2-rank daemon on 2 GPUs (both ranks on GPU 0 when there is one):
# BF16 dispatch, FP8 dispatch, FP8 dispatch and combine; scale experts, the DeepSeek-V3 shape.
# Skips visibly without a GPU, without a python3 that has numpy and torch with CUDA, or while the
# daemon has no regions.
source "$(dirname "$(readlink -f "$0")")/../integration/daemon_lib.bash"
source tests/python/python_lib.bash

n_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
((n_gpus >= 1)) || skip "no GPU: needs 1 GPU (2 ranks share it) or 2, found ${n_gpus:-0}"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null ||
    skip "$PY cannot import torch with CUDA (pip install torch)"
share=() devices=0:1
# one GPU: both ranks on it, staged mpi (NCCL refuses two ranks on one GPU)
((n_gpus >= 2)) || { share=(--set device.id=0 --set dispatch.transport=mpi --set dispatch.mpi_cuda_aware=false); devices=0:0; }

rc_all=0
for wire in "--set dispatch.dtype=bf16" "--set dispatch.dtype=fp8" \
            "--set dispatch.dtype=fp8 --set combine.dtype=fp8"; do
    echo "== $wire"
    EPD_LOG=$TMP/epd.log
    setsid "$MPIRUN" --oversubscribe -np 2 --mca pml ucx --mca pml_ucx_tls any \
        --mca pml_ucx_devices any "$EPD" --set "socket.path=$TMP/epd-%r.sock" \
        --set device.backend=cuda --set model.hidden=7168 --set model.num_experts=256 \
        --set model.topk=8 --set dispatch.max_tokens_per_request=256 --set experts.kind=scale \
        $wire "${share[@]}" >"$EPD_LOG" 2>&1 &
    EPD_PID=$!
    epd_wait_healthy 2 90 "$wire"
    rc=0
    EPDPY_SOCKETS="$(sock 0):$(sock 1)" EPDPY_DEVICES=$devices timeout 300 \
        "$PY" tests/gpu/test_python_cuda.py 2>&1 || rc=$?
    if [[ $rc == 77 ]]; then
        epd_stop_ranks  # Ubuntu 24.04's mpirun does not forward SIGUSR1: signal the ranks
        exit 77
    fi
    [[ $rc == 0 ]] || die "test_python_cuda.py ($wire)"
    group=()
    [[ $devices == 0:0 ]] && group=(--group)
    timeout 300 "$PY" examples/torch_moe.py --socket-pattern "$TMP/epd-%r.sock" --tokens 128 \
        --iters 50 "${group[@]}" 2>&1 || die "examples/torch_moe.py ($wire)"
    # The issue's yardstick, same run, same request size (128 tokens to rank 0): the example's
    # device-region call against epctl bench --data cuda (libepd). Printed, never asserted.
    bench=$("$BUILD/epctl" --socket "$(sock 0)" bench --tokens 128 --requests 500 --data cuda \
        --cuda-device "${devices%%:*}" 2>&1) || die "epctl bench --data cuda ($wire): $bench"
    moe=$(timeout 300 "$PY" examples/torch_moe.py --socket "$(sock 0)" --tokens 128 \
        --iters 500 --no-payload 2>&1) || die "examples/torch_moe.py --socket ($wire): $moe"
    echo "$bench" | grep -E '^(bench|latency)'
    echo "$moe" | grep -E '^(check|per call)'
    "$PY" - "$bench" "$moe" <<'PY'
import re, sys
lib = float(re.search(r"latency ms: p50 ([0-9.]+)", sys.argv[1]).group(1))
py = float(re.search(r"device regions p50 ([0-9.]+) ms", sys.argv[2]).group(1))
print("same run, 128 tokens: torch_moe (python, device regions) p50 %.3f ms, epctl bench "
      "--data cuda p50 %.3f ms: %.2fx" % (py, lib, py / lib))
PY
    epd_stop_ranks
done
echo "PASS: device regions and the torch MoE example, BF16, FP8, FP8 with FP8 combine"
