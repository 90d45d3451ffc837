#!/usr/bin/env bash
# socket.sndbuf_bytes: each accepted connection asks the kernel for that SO_SNDBUF (Linux doubles
# it, capped at twice net.core.wmem_max), and 0 leaves the system's default alone.
source "$(dirname "$0")/daemon_lib.bash"

ask=1048576
epd_start 1 --set model.hidden=256 --set model.num_experts=16 --set model.topk=4 \
    --set socket.sndbuf_bytes=$ask --set log.level=debug
$WIRE health "$(sock 0)" >/dev/null || die "health"
line=$(grep -m1 "SO_SNDBUF" "$TMP/epd.log") || die "no SO_SNDBUF line for the connection"
got=$(sed -E 's/.*SO_SNDBUF ([0-9]+) bytes.*/\1/' <<<"$line")
wmem=$(cat /proc/sys/net/core/wmem_max)
want=$((2 * ask)); ((want > 2 * wmem)) && want=$((2 * wmem))
((got == want)) || die "SO_SNDBUF $got, expected $want (asked $ask, wmem_max $wmem): $line"
epd_stop
epd_start 1 --set model.hidden=256 --set model.num_experts=16 --set model.topk=4 \
    --set socket.sndbuf_bytes=0 --set log.level=debug
$WIRE health "$(sock 0)" >/dev/null || die "health"
! grep -q "SO_SNDBUF" "$TMP/epd.log" || die "socket.sndbuf_bytes=0 still set SO_SNDBUF"
epd_stop
echo "PASS: socket.sndbuf_bytes sets each connection's SO_SNDBUF ($got bytes for $ask); 0 leaves it"
