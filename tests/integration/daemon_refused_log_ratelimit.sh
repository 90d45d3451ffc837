#!/usr/bin/env bash
# Guards issue 20 item 7: refused peers are logged at most once a second, with a count (2000
# refused connects used to write 2000 WARN lines in 0.1 s). Both refusals: over
# socket.max_clients, and (as root) a uid not in socket.allow_uids.
source "$(dirname "$0")/daemon_lib.bash"

chmod 0711 "$TMP" # others may reach the socket (mode 0666), not write the directory
epd_start 1 --set model.hidden=256 --set model.num_experts=16 --set model.topk=4 \
    --set socket.max_clients=1 --set socket.mode=0666 --set socket.allow_uids=4242

echo "== 300 connects over socket.max_clients"
python3 - "$(sock 0)" <<'PY' || die "the connect storm failed"
import socket, sys, time
hold = socket.socket(socket.AF_UNIX); hold.connect(sys.argv[1])
time.sleep(0.3)  # the daemon has counted the held client
for _ in range(300):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(sys.argv[1]); s.recv(4096)
    except OSError:
        pass
    s.close()
time.sleep(1.5)  # the summing-up line is due
hold.close()
PY
lines=$(grep -c "refused" "$EPD_LOG")
echo "refusal lines: $lines"
grep "refused" "$EPD_LOG" | head -5
((lines >= 1 && lines <= 8)) || die "300 refused connects wrote $lines log lines (want 1..8)"
grep -qE "refused [0-9]+ more connections" "$EPD_LOG" || die "no summing-up line with a count"
total=$($WIRE stat "$(sock 0)" server.clients_refused)
((total >= 300)) || die "clients_refused is $total, want >= 300"

if [[ $(id -u) == 0 ]]; then
    echo "== 300 connects from uid 65534, not in socket.allow_uids"
    before=$(grep -c "refused" "$EPD_LOG")
    python3 - "$(sock 0)" <<'PY' || die "the uid storm failed"
import os, socket, sys, time
os.setgid(65534); os.setuid(65534)
for _ in range(300):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(sys.argv[1]); s.recv(4096)
    except OSError:
        pass
    s.close()
time.sleep(1.5)
PY
    lines=$(($(grep -c "refused" "$EPD_LOG") - before))
    echo "refusal lines: $lines"
    ((lines >= 1 && lines <= 8)) || die "300 refused uids wrote $lines log lines (want 1..8)"
    grep -q "uid 65534" "$EPD_LOG" || die "the refused uid is not named"
    total=$($WIRE stat "$(sock 0)" server.clients_refused)
    ((total >= 600)) || die "clients_refused is $total, want >= 600"
fi
epd_stop
echo "PASS: refused peers logged at most once a second with a count"
