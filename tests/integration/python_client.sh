#!/usr/bin/env bash
# The Python client package (python/epd) against the real daemon. Offline first: codec, bf16,
# every code as its exception (a scripted stand-in daemon), the device-region code (a stand-in
# torch), the numpy run of the reference the torch example checks against (equal to
# epd_moe_reference). Then tests/python/test_daemon.py on a 2-rank daemon (payload results equal
# libepd's and the reference, pipelining, errors, CONTROL), a graceful stop under load
# (shutting_down, then a clean ConnectionClosed) and a killed job (no hang).
source "$(dirname "$0")/daemon_lib.bash"
source tests/python/python_lib.bash

[[ -x $BUILD/tests/py_ref ]] || skip "$BUILD/tests/py_ref is not built"
export EPDPY_REF=$BUILD/tests/py_ref EPDPY_TMP=$TMP

echo "== offline ($PY) ($(date +%T))"
timeout 120 "$PY" tests/python/test_offline.py 2>&1 || die "offline tests"
timeout 60 "$PY" tests/python/test_fake_torch.py 2>&1 || die "device-region code (stand-in torch)"
timeout 120 "$PY" tests/python/test_reference.py 2>&1 ||
    die "the reference port (examples/moe_reference.py)"

opts=(--set model.hidden=256 --set model.num_experts=16 --set model.topk=4
      --set experts.kind=scale --set dispatch.max_tokens_per_request=64
      --set dispatch.max_tokens_per_step=128 --set dispatch.max_queued_tokens=512
      --set socket.max_frame_bytes=1048576 --set socket.max_clients=24)
echo "== against a 2-rank daemon ($(date +%T))"
epd_start 2 "${opts[@]}"
EPDPY_SOCKETS="$(sock 0):$(sock 1)" timeout 240 "$PY" tests/python/test_daemon.py 2>&1 \
    || die "daemon tests"
# the client benchmark runs (its numbers are not judged here)
bench=$(timeout 60 "$PY" scripts/py-client-bench.py --socket "$(sock 0)" --epctl "$BUILD/epctl" \
    --calls 200 --rounds 1 2>&1) && grep -q "client alone, numpy" <<<"$bench" ||
    die "py-client-bench.py: $bench"
for r in 0 1; do
    $WIRE health "$(sock $r)" | grep -q '"status": "ok"' || die "rank $r does not answer health"
done
epd_stop

echo "== graceful stop under load, then a killed job ($(date +%T))"
# H 2048, one 64-token request per step, room for every window: the queue fills faster than
# steps empty it, so the drain has steps to run while new SUBMITs arrive
opts+=(--set model.hidden=2048 --set dispatch.max_tokens_per_step=64
       --set dispatch.max_queued_tokens=4096)
epd_start 2 "${opts[@]}"
EPDPY_SOCKETS="$(sock 0):$(sock 1)" EPDPY_MPIRUN_PID=$EPD_PID timeout 120 \
    "$PY" tests/python/test_shutdown.py stop 2>&1 || die "shutdown test"
epd_wait_exit 30
[[ $EPD_RC == 0 ]] || die "mpirun exited $EPD_RC after SIGUSR1"
epd_start 2 "${opts[@]}"
EPDPY_SOCKETS="$(sock 0):$(sock 1)" EPDPY_MPIRUN_PID=$EPD_PID timeout 120 \
    "$PY" tests/python/test_shutdown.py kill 2>&1 || die "killed-job test"
epd_wait_exit 30
[[ $EPD_RC != 124 ]] || die "the job still runs 30 s after a rank was killed"
echo "PASS: the Python client agrees with libepd and the reference, and fails cleanly"
