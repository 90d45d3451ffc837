#!/usr/bin/env bash
# Guards issue 20 item 6: after a burst of big frames on many connections (whole SUBMITs, frames
# abandoned half-way) the daemon trims once it is quiet, and its RSS is back within 20% of where
# it was. (The heap that glibc keeps is shown by tests/unit/test_trim.c; this burst, on this
# glibc, is mostly returned even without the trim: the log line is what fails without it.)
source "$(dirname "$0")/daemon_lib.bash"

epd_start 1 --set model.hidden=1024 --set model.num_experts=16 --set model.topk=4 \
    --set socket.max_frame_bytes=67108864 --set dispatch.max_tokens_per_request=4096 \
    --set dispatch.max_queued_tokens=1048576 --set log.level=debug
# warm-up: the first requests allocate what stays (staging, buffers)
timeout 60 "$CHECK" --socket "$(sock 0)" --clients 2 --requests 3 --max-tokens 8 --seed 3 \
    || die "warm-up requests"
PYTHONPATH=tests/integration timeout 120 python3 tests/integration/daemon_memory_burst.py "$(sock 0)" 1024 4 \
    || die "memory after the burst"
grep -q "idle after a burst: malloc_trim" "$EPD_LOG" || die "no trim after the burst"
epd_stop
echo "PASS: memory freed after a burst went back to the system"
