#!/usr/bin/env bash
# Guards issue 20 item 5: a rank that stops taking part (SIGSTOP) used to stop every rank's steps
# while `health` answered ok. Now the other rank's health says `stalled` naming the phase once the
# agreement has waited dispatch.stall_warn_ms, goes back to ok (and serves correctly) when the
# rank continues, and after dispatch.step_timeout_ms the job aborts non-zero naming the phase.
source "$(dirname "$0")/daemon_lib.bash"

epd_start 2 --set model.hidden=256 --set model.num_experts=16 --set model.topk=4 \
    --set dispatch.stall_warn_ms=500 --set dispatch.step_timeout_ms=4000

field() { $WIRE health "$(sock "$1")" | python3 -c "import json,sys; print(json.load(sys.stdin).get('$2'))"; }

# wait_health RANK STATUS SECONDS: until rank's health status is STATUS.
wait_health() {
    local deadline=$((SECONDS + $3)) got
    while :; do
        got=$(field "$1" status)
        [[ $got == "$2" ]] && return 0
        ((SECONDS < deadline)) || die "rank $1 health is '$got' after $3 s, want '$2'"
        sleep 0.1
    done
}

[[ $(field 0 status) == ok ]] || die "rank 0 is not ok at the start"
pid1=$(field 1 pid)
[[ $pid1 =~ ^[0-9]+$ ]] || die "no pid from rank 1's health"

echo "== SIGSTOP rank 1 (pid $pid1): rank 0 reports stalled"
kill -STOP "$pid1"
wait_health 0 stalled 3
phase=$(field 0 stalled_phase)
[[ $phase == agreement ]] || die "stalled_phase is '$phase', want 'agreement'"
echo "rank 0 health: $($WIRE health "$(sock 0)")"
# epctl says so too, and exits 1 (scripts and probes see the stall)
rc=0
"$BUILD/epctl" --socket "$(sock 0)" health >"$TMP/h.out" 2>"$TMP/h.err" || rc=$?
[[ $rc == 1 ]] || die "epctl health exited $rc while the rank is stalled, want 1"
grep -q "status stalled, waiting in the agreement" "$TMP/h.err" || die "epctl health: $(cat "$TMP/h.err")"
grep -q "stalled: the agreement has waited" "$EPD_LOG" || die "no 'stalled' line in the log"

echo "== SIGCONT: ok again, and it still serves"
kill -CONT "$pid1"
wait_health 0 ok 3
wait_health 1 ok 3
timeout 60 "$CHECK" --socket "$(sock 0)" --clients 2 --requests 3 --max-tokens 8 --seed 5 \
    || die "requests after the stall"
grep -q "the stall is over" "$EPD_LOG" || die "no 'stall is over' line in the log"
stalls=$($WIRE stat "$(sock 0)" server.stalls)
((stalls >= 1)) || die "server.stalls is $stalls"

echo "== SIGSTOP again for longer than dispatch.step_timeout_ms: the job aborts"
kill -STOP "$pid1"
epd_wait_exit 20
[[ $EPD_RC != 124 ]] || { kill -CONT "$pid1" 2>/dev/null; die "the job still runs 20 s after the stall"; }
[[ $EPD_RC != 0 ]] || die "the job exited 0 after a stalled rank"
grep -q "aborting the job: the agreement has waited" "$EPD_LOG" || die "no abort line naming the phase"
echo "aborted as expected (mpirun exit $EPD_RC): $(grep -m1 -o 'aborting the job: .*' "$EPD_LOG")"
echo "PASS: a stopped rank shows as stalled (phase named), recovers, and past the timeout aborts the job"
