#!/usr/bin/env bash
# A two-node job on one machine: two network namespaces made here are the "hosts" (own addresses
# on a veth pair, own host names through a UTS namespace), mpirun runs in the first with a
# hostfile naming both and `--mca plm_rsh_agent` a script that enters the other namespace instead
# of ssh, 2 ranks per node. Each rank's socket is named %h-%l (host, local rank); the results
# through all four equal the single-process reference bit for bit; SIGUSR1 to mpirun stops the
# ranks of both nodes gracefully (exit 0, every rank logs its drain).
# Needs root and the right to create namespaces: without them (e.g. an unprivileged CI container)
# it SKIPs, saying why.
source "$(dirname "$0")/daemon_lib.bash"
command -v ip >/dev/null 2>&1 || skip "no ip command (scripts/deps.sh installs iproute2)"
command -v unshare >/dev/null 2>&1 || skip "no unshare (util-linux)"
[[ $(id -u) -eq 0 ]] || skip "creating network namespaces needs root"

tag=epd$$
nsa=${tag}a nsb=${tag}b
netns_cleanup() {
    ip netns del "$nsa" 2>/dev/null
    ip netns del "$nsb" 2>/dev/null
    cleanup
}
trap netns_cleanup EXIT
if ! err=$(ip netns add "$nsa" 2>&1); then
    skip "cannot create a network namespace here: $err"
fi
ip netns add "$nsb" || die "ip netns add $nsb"
unshare --uts true 2>/dev/null || skip "cannot create a UTS namespace here (unshare --uts)"
# 10.A.B.1 and .2 on a veth pair, a /30 from the pid so parallel runs do not collide
net=10.$((200 + $$ % 50)).$(($$ / 50 % 250))
ip link add "${tag}x" type veth peer name "${tag}y" || skip "cannot create a veth pair here"
ip link set "${tag}x" netns "$nsa" && ip link set "${tag}y" netns "$nsb" || die "moving the veth ends"
ip -n "$nsa" addr add "$net.1/30" dev "${tag}x" && ip -n "$nsb" addr add "$net.2/30" dev "${tag}y" ||
    die "addresses"
for ns in "$nsa" "$nsb"; do ip -n "$ns" link set lo up; done
ip -n "$nsa" link set "${tag}x" up && ip -n "$nsb" link set "${tag}y" up || die "links up"
# reachable: a connection to a closed port is refused (not timed out)
ip netns exec "$nsa" python3 -c "
import socket, sys
s = socket.socket(); s.settimeout(5)
try:
    s.connect(('$net.2', 9))
except ConnectionRefusedError:
    sys.exit(0)
except OSError as e:
    sys.exit('%s' % e)" || die "the namespaces cannot reach each other"

# The launcher agent: what ssh would do, into the namespace of the host it is given.
cat >"$TMP/agent" <<AGENT
#!/bin/sh
host=\$1; shift
case \$host in
    $net.1) ns=$nsa name=node-a ;;
    $net.2) ns=$nsb name=node-b ;;
    *) echo "agent: unknown host \$host" >&2; exit 1 ;;
esac
echo "\$host \$*" >>"$TMP/agent.log"
exec ip netns exec \$ns unshare --uts sh -c "hostname \$name && \$*"
AGENT
chmod +x "$TMP/agent"
printf '%s slots=2\n%s slots=2\n' "$net.1" "$net.2" >"$TMP/hostfile"

# mpirun itself runs on "node-a".
EPD_LOG=$TMP/epd.log
setsid ip netns exec "$nsa" unshare --uts sh -c "hostname node-a && exec \"\$@\"" sh \
    "$MPIRUN" -np 4 --hostfile "$TMP/hostfile" --mca plm_rsh_agent "$TMP/agent" \
    --mca oob_tcp_if_include "$net.0/30" --mca pml ucx --mca pml_ucx_tls any \
    --mca pml_ucx_devices any -x UCX_NET_DEVICES="${tag}x,${tag}y,lo" \
    -x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM \
    "$EPD" --set "socket.path=$TMP/%h-%l.sock" --set device.backend=cpu \
    --set model.hidden=256 --set model.num_experts=16 --set model.topk=4 \
    --set dispatch.max_tokens_per_request=64 >"$EPD_LOG" 2>&1 &
EPD_PID=$!

socks=("$TMP/node-a-0.sock" "$TMP/node-a-1.sock" "$TMP/node-b-0.sock" "$TMP/node-b-1.sock")
deadline=$((SECONDS + 60))
for s in "${socks[@]}"; do
    until [[ -S $s ]] && $WIRE health "$s" >/dev/null 2>&1; do
        kill -0 "$EPD_PID" 2>/dev/null || die "the job exited during start-up"
        ((SECONDS < deadline)) || die "$s did not come up within 60 s"
        sleep 0.2
    done
done
grep -q "^$net.2 " "$TMP/agent.log" || die "mpirun did not start node-b through the agent"
# each node's sockets belong to that node's ranks: world 4, two ranks a node
for i in 0 1 2 3; do
    rank=$($WIRE health "${socks[$i]}" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["rank"], d["world"])')
    [[ $rank == "$i 4" ]] || die "${socks[$i]} is rank/world '$rank', expected '$i 4'"
done
args=()
for s in "${socks[@]}"; do args+=(--socket "$s"); done
timeout 60 "$CHECK" "${args[@]}" --clients 2 --requests 10 --max-tokens 40 --window 4 --seed 21 \
    --empty-slots || die "results through the two nodes differ from the reference"

kill -USR1 "$EPD_PID"
epd_wait_exit 30
[[ $EPD_RC == 0 ]] || die "mpirun exited $EPD_RC after SIGUSR1 (124: still running after 30 s)"
for r in 0 1 2 3; do
    grep -q "epd\[rank $r\] INFO: drained" "$EPD_LOG" || die "rank $r did not drain"
done
grep -q "^[0-9T:.-]*Z epd\[rank 2\] INFO: serving on $TMP/node-b-0.sock" "$EPD_LOG" || die "rank 2 does not serve node-b-0"
echo "PASS: 2 nodes x 2 ranks (netns $nsa, $nsb; hosts node-a, node-b): results equal the reference; SIGUSR1 drained every rank"
