#!/usr/bin/env bash
# Everything epd runs on a GPU node, in one go (what the closing notes quote):
#   build    build/ against the system MPI, build-cuda-mpi/ against /opt/epd-cuda-mpi when present
#   unit     the GPU unit tests (tests/gpu/test_*: numerics and device ops against the host, bit for bit)
#   kbench   tests/gpu/quant_gpu.sh: test_quant, the step scale on 2 ranks, kbench's sweep (issue 18)
#   mpi      tests/gpu/mpi_cuda_aware with the stock MPI and with the CUDA-aware one
#   daemon   tests/gpu/daemon_gpu.sh: the daemon on 2 GPUs through its sockets, every transport
#   bench    epd --bench on 2 ranks for each transport (staged mpi, direct mpi, nccl)
#   accuracy tests/gpu/accuracy_gpu.sh: epd --accuracy with ffn experts, 1 and 2 ranks (docs/accuracy.md)
#   python   tests/gpu/python_cuda.sh: the Python client's device regions and examples/torch_moe.py
#   ffn      tests/gpu/ffn_gpu.sh: test_ffn_cuda, daemon_ffn_gpu.sh and the ffn bench's sweep
#            at E_local 32, H 7168, I 2048 (issue 17)
#   external tests/gpu/external_gpu.sh: external experts bit for bit, hand-over latency (issue 24)
#   e2e      tests/gpu/e2e_gpu.sh: the end-to-end path against the step (issue 25)
# Every stage runs under a time limit (STAGE_TIMEOUT seconds, default 420): a hang costs one
# stage, not the session's GPU time.
# Usage: scripts/gpu-suite.sh [STAGE...]   (default: all). Logs go to $OUT (or build/gpu-suite).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/gpu-suite}
mkdir -p "$out"
stages=${*:-build unit kbench mpi daemon bench accuracy python ffn external e2e}
cuda_mpi=/opt/epd-cuda-mpi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi_args=(--mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any)
[[ -f /tmp/epd-env.sh ]] && source /tmp/epd-env.sh
status=0

stage() { # stage NAME CMD...: runs CMD, its output in $out/NAME.log, one summary line
    local name=$1 rc start=$SECONDS; shift
    timeout -k 10 "${STAGE_TIMEOUT:-420}" "$@" >"$out/$name.log" 2>&1
    rc=$?
    [[ $rc -eq 124 || $rc -eq 137 ]] && echo "stage $name: killed after ${STAGE_TIMEOUT:-420} s" >>"$out/$name.log"
    printf '%-28s exit %-3d %4ss  %s\n' "$name" "$rc" "$((SECONDS - start))" \
        "$(grep -E 'passed|PASS|SKIP|FAIL|error' "$out/$name.log" | tail -n 1)"
    [[ $rc -eq 0 || $rc -eq 77 ]] || status=1
}

for s in $stages; do
    case $s in
    build)
        stage build scripts/gpu-node-build.sh all
        source /tmp/epd-env.sh
        if [[ -x $cuda_mpi/bin/mpicc ]]; then
            stage build-cuda-mpi make -j"$(nproc)" -k MPI_HOME=$cuda_mpi BUILD=build-cuda-mpi all
        fi
        ;;
    unit)
        for t in build/tests/gpu/test_*; do
            [[ -x $t ]] && stage "unit-$(basename "$t")" "$t"
        done
        ;;
    kbench)
        stage quant env OUT="$out/quant" bash tests/gpu/quant_gpu.sh
        ;;
    mpi)
        stage mpi-stock env BUILD=build tests/gpu/run-mpi-cuda-aware.sh
        [[ -x build-cuda-mpi/tests/gpu/mpi_cuda_aware ]] &&
            stage mpi-cuda-aware env BUILD=build-cuda-mpi tests/gpu/run-mpi-cuda-aware.sh
        ;;
    daemon)
        stage daemon-stock env BUILD=build MPIRUN=mpirun bash tests/gpu/daemon_gpu.sh
        [[ -x build-cuda-mpi/epd ]] &&
            stage daemon-cuda-mpi env BUILD=build-cuda-mpi MPIRUN=$cuda_mpi/bin/mpirun bash tests/gpu/daemon_gpu.sh
        ;;
    bench)
        tokens=${EPD_BENCH_TOKENS:-128,512,2048,4096,8192}
        stage bench-nccl mpirun -np 2 "${mpi_args[@]}" build/epd --bench --bench-tokens "$tokens" \
            --set device.backend=cuda --set dispatch.transport=nccl
        stage bench-mpi-staged mpirun -np 2 "${mpi_args[@]}" ${EPD_TEST_STAGED_CHUNK:+-x EPD_TEST_STAGED_CHUNK} build/epd --bench \
            --bench-tokens "$tokens" --set device.backend=cuda --set dispatch.transport=mpi
        if [[ -x build-cuda-mpi/epd ]]; then
            stage bench-mpi-direct $cuda_mpi/bin/mpirun -np 2 "${mpi_args[@]}" build-cuda-mpi/epd --bench \
                --bench-tokens "$tokens" --set device.backend=cuda --set dispatch.transport=mpi \
                --set dispatch.mpi_cuda_aware=true
        fi
        ;;
    accuracy)
        # ffn experts at H 7168, I 2048: 1 rank, then 2 ranks sharing GPU 0 (docs/accuracy.md)
        stage accuracy env BUILD=build MPIRUN=mpirun bash tests/gpu/accuracy_gpu.sh
        ;;
    python)
        stage python env BUILD=build MPIRUN=mpirun bash tests/gpu/python_cuda.sh
        ;;
    ffn)
        stage ffn env OUT="$out/ffn" BUILD=build MPIRUN=mpirun bash tests/gpu/ffn_gpu.sh
        ;;
    external)
        stage external env BUILD=build MPIRUN=mpirun bash tests/gpu/external_gpu.sh
        ;;
    e2e)
        stage e2e env OUT="$out/e2e" BUILD=build MPIRUN=mpirun bash tests/gpu/e2e_gpu.sh
        ;;
    *)
        echo "unknown stage $s" >&2
        status=2
        ;;
    esac
done
exit $status
