#!/usr/bin/env bash
# Graceful stops with requests queued on every rank (DESIGN.md sections 5 and 8):
#   SIGUSR1 to mpirun                -> every accepted request answered, exit 0;
#   SIGTERM to one rank only         -> the same;
#   SIGKILL to one rank              -> the job exits non-zero (bounded wait), it does not hang.
source "$(dirname "$0")/daemon_lib.bash"

# One request per step and large requests: the queues are never empty while clients flood.
opts=(--set model.hidden=256 --set model.num_experts=16 --set model.topk=4
      --set dispatch.max_tokens_per_request=64 --set dispatch.max_tokens_per_step=64)

# flood: clients on both ranks send until the daemon closes; answers must all be right.
flood() {
    "$CHECK" --socket "$(sock 0)" --socket "$(sock 1)" --clients 3 --requests 100000 \
        --max-tokens 64 --window 8 --until-closed --seed "$1" >"$TMP/flood.log" 2>&1 &
    flood_pid=$!
    # Let the queues fill.
    local deadline=$((SECONDS + 20))
    until (($($WIRE stat "$(sock 0)" engine.steps) > 20 && \
            $($WIRE stat "$(sock 1)" engine.steps) > 20)); do
        ((SECONDS < deadline)) || die "no steps while flooding"
        sleep 0.1
    done
}

# rank_pid R: the pid of rank R (from its health reply).
rank_pid() {
    $WIRE health "$(sock "$1")" | python3 -c 'import json,sys; print(json.load(sys.stdin)["pid"])'
}

# hold R: stops rank R (SIGSTOP) for a moment so that the other rank's requests wait in its queue
# for the agreement: the steps are faster than the clients, so without it the queues are empty
# whenever the signal comes. The caller continues it (SIGCONT) after sending its signal.
hold() {
    held_pid=$(rank_pid "$1")
    kill -STOP "$held_pid"
    sleep 0.3
}

# check_drain LOG R: rank R (the one not held) logged a drain with requests in flight, every rank
# answered all it accepted, and the flood client saw only right answers.
check_drain() {
    wait "$flood_pid" || { cat "$TMP/flood.log"; die "the flooding client saw a wrong answer"; }
    cat "$TMP/flood.log"
    grep -E "epd\[rank $2\] INFO: draining: .* [1-9][0-9]* in flight" "$1" \
        || die "rank $2 did not drain with requests in flight"
    for r in 0 1; do
        line=$(grep -E "epd\[rank $r\] INFO: drained: answered" "$1") || die "rank $r: no drained line"
        echo "$line"
        [[ $line =~ accepted\ ([0-9]+),\ answered\ ([0-9]+) ]] || die "rank $r: unexpected drained line"
        [[ ${BASH_REMATCH[1]} == "${BASH_REMATCH[2]}" ]] || die "rank $r: accepted != answered"
    done
    ! grep -q "never answered" "$1" || die "a request was dropped"
}

echo "== SIGUSR1 to mpirun"
epd_start 2 "${opts[@]}"
flood 1
hold 1
kill -USR1 "$EPD_PID"
kill -CONT "$held_pid"
epd_wait_exit 30
[[ $EPD_RC == 0 ]] || die "mpirun exited $EPD_RC after SIGUSR1"
check_drain "$TMP/epd.log" 0
grep -q "shutdown requested by SIGUSR1" "$TMP/epd.log" || die "no 'shutdown requested' line"

echo "== SIGTERM to rank 1 only"
epd_start 2 "${opts[@]}"
flood 2
pid1=$(rank_pid 1)
hold 0
kill -TERM "$pid1"
kill -CONT "$held_pid"
epd_wait_exit 30
[[ $EPD_RC == 0 ]] || die "mpirun exited $EPD_RC after SIGTERM to rank 1"
check_drain "$TMP/epd.log" 1
grep -q "epd\[rank 1\] INFO: shutdown requested by SIGTERM" "$TMP/epd.log" || die "rank 1 did not see SIGTERM"
! grep -q "epd\[rank 0\] INFO: shutdown requested" "$TMP/epd.log" || die "rank 0 got a signal too"

echo "== SIGUSR1 to one hot rank whose loop spins (--bind-to none), five times"
# The drain's last wake-up reaches a spinning loop through a flag, outside libevent's loop: the
# stop must still end the loop (it once hung there, blocked in epoll with nothing left to wake it).
for i in 1 2 3 4 5; do
    MPIRUN_EXTRA="--bind-to none" epd_start 1 "${opts[@]}" --set dispatch.hot_ms=10000
    "$CHECK" --socket "$(sock 0)" --clients 1 --requests 200 --max-tokens 8 --seed "$i" \
        >"$TMP/hot.log" 2>&1 || { cat "$TMP/hot.log"; die "the client saw a wrong answer"; }
    kill -USR1 "$(rank_pid 0)"
    epd_wait_exit 15
    [[ $EPD_RC == 0 ]] || die "run $i: mpirun exited $EPD_RC after SIGUSR1 to a hot rank (124: still running after 15 s)"
done

echo "== SIGKILL to rank 1"
epd_start 2 "${opts[@]}"
pid1=$($WIRE health "$(sock 1)" | python3 -c 'import json,sys; print(json.load(sys.stdin)["pid"])')
kill -KILL "$pid1"
epd_wait_exit 30
[[ $EPD_RC != 124 ]] || die "the job still runs 30 s after a rank was killed"
[[ $EPD_RC != 0 ]] || die "the job exited 0 after a rank was killed"
echo "mpirun exited $EPD_RC after rank 1 was killed"
echo "PASS: SIGUSR1 and SIGTERM drains answer every accepted request; a killed rank ends the job"
