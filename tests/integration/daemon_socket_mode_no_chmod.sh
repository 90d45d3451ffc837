#!/usr/bin/env bash
# Guards issue 20 item 1: the socket file gets socket.mode through the umask around bind, never
# through a chmod of the path afterwards (whoever can write the directory could swap the path for
# a symlink between bind and chmod and have the daemon change the mode of any file). Checks that
# no path-based chmod is left in the daemon's sources and that the bound socket has exactly the
# configured mode whatever the umask of the shell that started it.
source "$(dirname "$0")/daemon_lib.bash"

model=(--set model.hidden=256 --set model.num_experts=16 --set model.topk=4)

echo "== no path-based chmod in daemon/"
if grep -nE '\b(l?chmod|fchmodat)[[:space:]]*\(' daemon/*.c; then
    die "a path-based chmod is back in daemon/ (set the mode through the umask before bind)"
fi

for pair in 000:0640 077:0666 022:0600; do
    mask=${pair%%:*} mode=${pair##*:}
    echo "== umask $mask, socket.mode $mode"
    old=$(umask)
    umask "$mask"
    epd_launch 1 "$TMP/epd.log" "${model[@]}" --set "socket.mode=$mode"
    umask "$old"
    epd_wait_healthy 1 30
    got=$(stat -c %a "$(sock 0)")
    [[ $got == "${mode#0}" ]] || die "umask $mask, socket.mode $mode: the socket has mode $got"
    epd_stop
done
echo "PASS: socket mode set through the umask before bind, no chmod of the path"
