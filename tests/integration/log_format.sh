#!/usr/bin/env bash
# The daemon's log lines through mpirun: RFC 3339 UTC timestamps with microseconds, rank and level
# by default; with JOURNAL_STREAM set (as systemd sets it for mpirun, whose environment the ranks
# inherit) a syslog priority prefix instead — <6> info, <3> error — on every rank's lines, so
# `journalctl -p err` finds the errors.
source "$(dirname "$0")/daemon_lib.bash"

epd_start 2
epd_stop
grep -Eq '^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{6}Z epd\[rank 1\] INFO: serving on ' \
    "$EPD_LOG" || die "no RFC 3339 timestamped line from rank 1"
grep -Ev '^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:.]{15}Z epd(\[rank [0-9]+\] |: )[A-Z]+: ' "$EPD_LOG" |
    grep '^.*epd\[rank' && die "a line of epd without the timestamp prefix"

export JOURNAL_STREAM=8:4242
epd_launch 2 "$TMP/journal.log"
epd_wait_healthy 2 30
epd_stop
grep -q '^<6>epd\[rank 0\] INFO: serving on ' "$EPD_LOG" || die "rank 0: no <6> info line"
grep -q '^<6>epd\[rank 1\] INFO: drained' "$EPD_LOG" || die "rank 1: no <6> info line"
grep -E '^[0-9]{4}-' "$EPD_LOG" && die "timestamps under journald"
epd_launch 1 "$TMP/journal-err.log" --set metrics.listen=nonsense
epd_wait_exit 30
[[ $EPD_RC != 0 ]] || die "a bad setting did not stop the start-up"
grep -q '^<3>epd\[rank 0\] ERROR: start-up failed: configuration: .*metrics.listen' "$EPD_LOG" ||
    die "the start-up error is not a <3> line naming the setting"
echo "PASS: timestamps by default; <N> priorities under JOURNAL_STREAM on every rank"
