#!/usr/bin/env bash
# The end-to-end benchmark of issue 25 on one GPU (docs/results.md, "the end-to-end path"): one
# CUDA rank (mpirun --bind-to none), epctl bench at 1 and 128 tokens with the tensors in the
# frame, in a host region and in a device region, each with libepd's default wait and with
# --spin-us 0 (sleeping in poll at once), then 128
# tokens x 8 connections; the daemon's own per-leg p50s (EPD_TRACE) and, in the same run, the
# GPU step (epd --bench) they are compared with. Prints; fails only when a run fails.
# E2E_DATA narrows the data kinds (default "cuda host payload"; on a machine without a GPU
# "host payload" with E2E_BACKEND=cpu). Logs in $OUT (or build/e2e-gpu). E2E_TIMES=1 also
# writes every latency run's per-request times on both sides (EPD_TRACE_TIMES, EPD_BENCH_TIMES)
# and lines them up (tests/gpu/e2e_times.py): the client's wait split at the daemon's legs.
# E2E_CPUS=LIST runs the daemon, epctl and epd --bench on those CPUs only (taskset -c LIST);
# E2E_CPUS=gpu: on the CPUs of GPU 0's NUMA node (its PCI device's local_cpulist), where a
# deployment would put the frontend and its rank.
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
out=${OUT:-$BUILD/e2e-gpu}
mkdir -p "$out"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
backend=${E2E_BACKEND:-cuda}
data=${E2E_DATA:-cuda host payload}
requests=${E2E_REQUESTS:-3000}
mpi=(--mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any --bind-to none)
if [[ $backend == cuda ]] && ! nvidia-smi -L >/dev/null 2>&1; then
    echo "SKIP: no GPU (E2E_BACKEND=cpu E2E_DATA='host payload' runs it on the host)"
    exit 77
fi
pin=()
if [[ -n ${E2E_CPUS:-} ]]; then
    cpus=$E2E_CPUS
    if [[ $cpus == gpu ]]; then
        bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader -i 0 | tr 'A-F' 'a-f')
        cpus=$(cat "/sys/bus/pci/devices/${bus#0000}/local_cpulist") || exit 1 # 8-digit domain
    fi
    pin=(taskset -c "$cpus")
    echo "the daemon, epctl and epd --bench on CPUs $cpus"
fi
dir=$(mktemp -d /tmp/epd-e2e.XXXXXX)
sock=$dir/epd-0.sock
times=()
[[ -n ${E2E_TIMES:-} ]] && { mkdir -p "$out/times"; export EPD_TRACE_TIMES=$out/times/daemon.txt; times=(-x EPD_TRACE_TIMES); }
EPD_TRACE=$requests setsid "${pin[@]}" "${MPIRUN:-mpirun}" -np 1 "${mpi[@]}" -x EPD_TRACE "${times[@]}" "$BUILD/epd" \
    --set "socket.path=$dir/epd-%r.sock" --set device.backend="$backend" >"$out/daemon.log" 2>&1 &
mp=$!
stop() { # SIGUSR1 to the rank (mpirun may not forward it), bounded wait, then SIGKILL
    local pid
    pid=$("$BUILD/epctl" --socket "$sock" --json health 2>/dev/null | python3 -c \
        'import json,sys; d=json.load(sys.stdin); print(d["sockets"][0]["reply"]["pid"])' 2>/dev/null)
    [[ -n $pid ]] && kill -USR1 "$pid"
    for _ in $(seq 100); do kill -0 "$mp" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$mp" 2>/dev/null; then
        echo "FAIL: the daemon did not exit within 10 s of SIGUSR1"
        kill -KILL -- -"$mp" 2>/dev/null
        return 1
    fi
}
trap 'kill -KILL -- -$mp 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 120); do "$BUILD/epctl" --socket "$sock" health >/dev/null 2>&1 && break; sleep 0.5; done
"$BUILD/epctl" --socket "$sock" health >/dev/null 2>&1 || { echo "FAIL: the daemon did not come up"; tail "$out/daemon.log"; exit 1; }
rc=0
for t in 1 128; do
    for d in $data; do
        # libepd's default wait (a spin of EPD_CLIENT_DEFAULT_SPIN_US where there are cores for
        # it), then sleeping in poll(2) at once
        for spin in default 0; do
            [[ -n ${E2E_TIMES:-} ]] && export EPD_BENCH_TIMES=$out/times/client-$d-$t-$spin.txt
            spin_arg=()
            [[ $spin != default ]] && spin_arg=(--spin-us "$spin")
            line=$(timeout 120 "${pin[@]}" "$BUILD/epctl" --socket "$sock" bench --tokens $t --requests "$requests" \
                --data "$d" "${spin_arg[@]}" 2>&1 | grep -E 'latency|error' | tr '\n' ' ') || rc=1
            printf '%-8s %4s tokens  spin %7s: %s\n' "$d" "$t" "$spin" "$line"
        done
    done
done
unset EPD_BENCH_TIMES
for d in $data; do
    line=$(timeout 120 "${pin[@]}" "$BUILD/epctl" --socket "$sock" bench --tokens 128 --requests 8000 \
        --concurrency 8 --data "$d" 2>&1 | grep -E 'throughput|error' | tr '\n' ' ') || rc=1
    printf '%-8s  128 tokens x 8 connections: %s\n' "$d" "$line"
done
stop || rc=1
echo "the daemon's legs per bench run above, in order (EPD_TRACE; us: p10 p50 p90 p99):"
grep -E 'trace: ' "$out/daemon.log" | sed 's/^.*trace: /  /' | tee "$out/trace.txt" | head -130
[[ -n ${E2E_TIMES:-} ]] && python3 tests/gpu/e2e_times.py "$out/times"
timeout 120 "${pin[@]}" "${MPIRUN:-mpirun}" -np 1 "${mpi[@]}" "$BUILD/epd" --bench --set device.backend="$backend" \
    --bench-tokens 1,128 >"$out/bench.log" 2>&1 || rc=1
echo "the GPU step in the same run (epd --bench, median us):"
grep -E '^ +(1|128) (fp8|bf16) ' "$out/bench.log" | grep median
# the page-locked copies the host-region target allows (x in, y out at 128 tokens), same run
if [[ $backend == cuda ]]; then
    timeout 60 python3 - <<'PY' || echo "(no torch: the copy baseline is not measured)"
import time, torch
n = 128 * 7168 * 2
h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
d = torch.empty(n, dtype=torch.uint8, device="cuda")
def p50(f):
    ts = []
    for _ in range(300):
        torch.cuda.synchronize(); t = time.perf_counter(); f(); torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e6)
    return sorted(ts)[len(ts) // 2]
up = p50(lambda: d.copy_(h, non_blocking=True))
down = p50(lambda: h.copy_(d, non_blocking=True))
print(f"cudaMemcpy of 128 tokens' x (1.84 MB, page-locked), p50: host->device {up:.1f} us, "
      f"device->host {down:.1f} us; the host-region target is step + {up + down:.1f} + 40 us")
PY
fi
exit $rc
