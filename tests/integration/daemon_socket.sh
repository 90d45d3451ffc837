#!/usr/bin/env bash
# The socket file: its mode (socket.mode, default 0660), the %h/%l/%%/%r template, a stale
# socket replaced, a regular file or a live socket at the path refused, a missing directory
# refused, socket.allow_uids (SO_PEERCRED), and READY=1 / STOPPING=1 sent to a fake
# $NOTIFY_SOCKET by rank 0 only.
source "$(dirname "$0")/daemon_lib.bash"

model=(--set model.hidden=256 --set model.num_experts=16 --set model.topk=4)

# expect_start_failure PATTERN ARGS...: the job must exit non-zero within 30 s logging PATTERN.
expect_start_failure() {
    local pattern=$1; shift
    epd_launch 1 "$TMP/fail.log" "${model[@]}" "$@"
    epd_wait_exit 30
    [[ $EPD_RC != 124 ]] || die "a failed start-up still runs after 30 s"
    [[ $EPD_RC != 0 ]] || die "start-up with $* succeeded"
    grep -q -- "$pattern" "$TMP/fail.log" || { cat "$TMP/fail.log"; die "no '$pattern' in the log"; }
    echo "refused as expected (exit $EPD_RC): $(grep -m1 -o "start-up failed: .*" "$TMP/fail.log")"
}

echo "== mode"
epd_start 1 "${model[@]}"
[[ $(stat -c %a "$(sock 0)") == 660 ]] || die "default mode is $(stat -c %a "$(sock 0)"), want 660"
epd_stop
[[ ! -e $(sock 0) ]] || die "the socket file is left behind after a clean stop"
epd_start 1 "${model[@]}" --set socket.mode=0600
[[ $(stat -c %a "$(sock 0)") == 600 ]] || die "mode is $(stat -c %a "$(sock 0)"), want 600"
epd_stop

echo "== template"
host=$(python3 -c 'import socket; print(socket.gethostname().split(".")[0])')
EPD_LOG=$TMP/tpl.log
setsid "$MPIRUN" --oversubscribe -np 2 --mca pml ucx --mca pml_ucx_tls any \
    --mca pml_ucx_devices any "$EPD" --set "socket.path=$TMP/s-%h-%l-%%-%r.sock" \
    --set device.backend=cpu "${model[@]}" >"$EPD_LOG" 2>&1 &
EPD_PID=$!
for r in 0 1; do
    f="$TMP/s-$host-$r-%-$r.sock"
    deadline=$((SECONDS + 30))
    until [[ -S $f ]] && $WIRE health "$f" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "no socket $f"
        sleep 0.1
    done
done
epd_stop

echo "== stale socket"
python3 -c 'import socket,sys; s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1])' "$(sock 0)"
[[ -S $(sock 0) ]] || die "could not make a stale socket"
epd_start 1 "${model[@]}"
grep -q "removed stale socket" "$TMP/epd.log" || die "no 'removed stale socket' line"
epd_stop

echo "== regular file"
echo keep >"$(sock 0)"
expect_start_failure "exists and is not a socket"
[[ $(cat "$(sock 0)") == keep ]] || die "the regular file was touched"
rm -f "$(sock 0)"

echo "== live socket"
python3 - "$(sock 0)" "$TMP/live.ready" <<'PY' &
import os, socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen(8)
open(sys.argv[2], "w").close()
time.sleep(60)
PY
live=$!
until [[ -e $TMP/live.ready ]]; do sleep 0.05; done
expect_start_failure "another process is already listening"
kill "$live"
wait "$live" 2>/dev/null
rm -f "$(sock 0)"

echo "== missing directory"
expect_start_failure "does not exist" --set "socket.path=$TMP/missing/epd-%r.sock"

echo "== bad template"
expect_start_failure "%q" --set "socket.path=$TMP/epd-%q.sock"

echo "== allow_uids"
chmod 0755 "$TMP"
epd_start 1 "${model[@]}" --set socket.mode=0666 --set socket.allow_uids=4242
$WIRE health "$(sock 0)" >/dev/null || die "root was refused"
python3 tests/integration/daemon_clients.py refused-as 65534 "$(sock 0)" || die "uid 65534 was served"
grep -q "refused a connection from uid 65534 .*not in socket.allow_uids" "$TMP/epd.log" \
    || die "no log line for the refused uid"
epd_stop
epd_start 1 "${model[@]}" --set socket.mode=0666 --set socket.allow_uids=65534
python3 tests/integration/daemon_clients.py health-as 65534 "$(sock 0)" || die "an allowed uid was refused"
epd_stop

echo "== NOTIFY_SOCKET"
for name in "$TMP/notify" "@epd-test-notify-$$"; do
    rm -f "$TMP/notify.out"
    python3 - "$name" "$TMP/notify.out" "$TMP/notify.ready" <<'PY' &
import socket, sys
name, out, ready = sys.argv[1:4]
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind("\0" + name[1:] if name.startswith("@") else name)
open(ready, "w").close()
s.settimeout(40)
with open(out, "a") as f:
    while True:
        msg = s.recv(4096).decode()
        f.write(msg.replace("\n", " | ") + "\n")
        f.flush()
        if "STOPPING=1" in msg:
            break
PY
    listener=$!
    until [[ -e $TMP/notify.ready ]]; do sleep 0.05; done
    rm -f "$TMP/notify.ready"
    NOTIFY_SOCKET=$name epd_start 2 "${model[@]}"
    deadline=$((SECONDS + 10))
    until grep -q "READY=1" "$TMP/notify.out" 2>/dev/null; do
        ((SECONDS < deadline)) || die "no READY=1 on $name"
        sleep 0.1
    done
    epd_stop
    wait "$listener" || die "the notify listener did not see STOPPING=1"
    cat "$TMP/notify.out"
    [[ $(grep -c "READY=1" "$TMP/notify.out") == 1 ]] || die "READY=1 sent more than once"
    grep -q "STATUS=serving: 2 ranks" "$TMP/notify.out" || die "no STATUS with READY=1"
    grep -q "told systemd READY=1" "$TMP/epd.log" || die "no log line for READY=1"
done
echo "PASS: socket mode, template, stale/regular/live files, missing directory, allow_uids, READY/STOPPING"
