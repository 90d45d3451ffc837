#!/usr/bin/env bash
# Shared host regions (DESIGN.md section 4b) on 2 CPU ranks: results through regions equal the
# payload path bit for bit on both ranks (region_check, through libepd), a misbehaving client on
# the same rank gets bad_region and leaves the others alone; registers without a usable file
# descriptor are refused; the daemon counts the discarded results of a client that closed with
# requests in flight and keeps serving.
source "$(dirname "$0")/daemon_lib.bash"

H=256 K=4 E=16
epd_start 2 --set model.hidden=$H --set model.num_experts=$E --set model.topk=$K \
    --set dispatch.max_tokens_per_request=64 --set socket.max_regions=4
"$BUILD/tests/region_check" --hidden $H --topk $K --experts $E \
    --socket "$(sock 0)" --socket "$(sock 1)" || die "region_check"

# register without an fd, with a pipe, with a memfd smaller than asked, and past max_regions
python3 - "$(sock 0)" <<'PY' || die "register refusals"
import json, os, socket, struct, sys
sys.path.insert(0, "tests/integration")
import daemon_wire as w

def control(s, meta, fds=()):
    data = w.frame(4, meta)
    s.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("%di" % len(fds), *fds))] if fds else [])
    ftype, m, _ = w.read_frame(s)
    return ftype, m

s = w.connect(sys.argv[1])
ftype, m = control(s, {"op": "register", "kind": "host", "bytes": 4096, "id": 7})
assert ftype == 3 and m["code"] == "bad_region" and m["id"] == 7 and "file descriptor" in m["message"], m
r, wfd = os.pipe()
ftype, m = control(s, {"op": "register", "kind": "host", "bytes": 4096}, [r])
assert ftype == 3 and m["code"] == "bad_region" and "memfd" in m["message"], m
fd = os.memfd_create("small")
os.ftruncate(fd, 100)
ftype, m = control(s, {"op": "register", "kind": "host", "bytes": 4096}, [fd])
assert ftype == 3 and m["code"] == "bad_region" and "100 bytes" in m["message"], m
ftype, m = control(s, {"op": "register", "kind": "cuda", "handle": "AAAA", "bytes": 64})
assert ftype == 3 and m["code"] == "bad_region", m
ftype, m = control(s, {"op": "register", "kind": "disk", "bytes": 64})
assert ftype == 3 and m["code"] == "bad_region", m
ids = []
for i in range(5):
    big = os.memfd_create("ok")
    os.ftruncate(big, 4096)
    ftype, m = control(s, {"op": "register", "kind": "host", "bytes": 4096, "id": 100 + i}, [big])
    os.close(big)
    if i < 4:
        assert ftype == 5 and m["id"] == 100 + i and m["kind"] == "host" and m["bytes"] == 4096, m
        ids.append(m["region"])
    else:
        assert ftype == 3 and m["code"] == "bad_region" and "max_regions" in m["message"], m
ftype, m = control(s, {"op": "unregister", "region": ids[0], "id": 9})
assert ftype == 5 and m == {"id": 9, "region": ids[0]}, m
ftype, m = control(s, {"op": "health", "id": 12})
assert ftype == 5 and m["id"] == 12, m
print("register refusals: no fd, a pipe, a short memfd, a bad handle, an unknown kind, max_regions; REPLY ids echoed")
PY
discarded=$($WIRE stat "$(sock 0)" server.results_discarded)
echo "rank 0 discarded $discarded results of the client that closed with requests in flight"
$WIRE health "$(sock 0)" >/dev/null || die "health after the misbehaving clients"
epd_stop
echo "PASS: host regions equal the payload path; bad region use is refused, the daemon serves on"
