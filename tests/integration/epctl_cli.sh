#!/usr/bin/env bash
# epctl's command line: help texts, exit codes (2 usage, 3 cannot connect, 1 daemon error); when
# python3 is present, every command end to end against a small fake daemon (protocol v1 in
# Python, y = x); when mpirun and build/epd are present, submit and bench against 2 real ranks.
set -u
BUILD=${BUILD:-build}
EPCTL=$BUILD/epctl
[[ -x $EPCTL ]] || { echo "FAIL: $EPCTL is not built"; exit 1; }
tmp=$(mktemp -d /tmp/epctl-cli.XXXXXX)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
    if [[ -n ${epd_pid:-} ]] && kill -0 "$epd_pid" 2>/dev/null; then
        kill -KILL -- "-$epd_pid" 2>/dev/null
        wait "$epd_pid" 2>/dev/null
    fi
    rm -rf "$tmp"
}
trap cleanup EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# expect RC CMD...: runs CMD, checks its exit status, leaves stdout/stderr in $tmp/out, $tmp/err
expect() {
    local want=$1; shift
    "$@" >"$tmp/out" 2>"$tmp/err"
    local rc=$?
    if [[ $rc -ne $want ]]; then
        fail "'$*' exited $rc, expected $want; stderr: $(head -c 400 "$tmp/err")"
        return 1
    fi
    echo "ok: '$*' -> $rc"
}
contains() { grep -q -- "$2" "$tmp/$1" || fail "$1 of the last command lacks '$2': $(head -c 400 "$tmp/$1")"; }

# help
expect 0 "$EPCTL" --help && contains out "usage: epctl" && contains out "bench"
for c in health stats config metrics submit bench; do
    expect 0 "$EPCTL" "$c" --help && contains out "usage: epctl"
done
expect 0 "$EPCTL" --version && contains out "epctl "

# usage errors: exit 2 with a message
expect 2 "$EPCTL" && contains err "no command"
expect 2 "$EPCTL" frobnicate && contains err "unknown command"
expect 2 "$EPCTL" health --bogus && contains err "unknown option"
expect 2 "$EPCTL" --socket && contains err "needs a value"
expect 2 "$EPCTL" submit --tokens abc
expect 2 "$EPCTL" bench --concurrency 0
expect 2 "$EPCTL" health --tokens 4

# no daemon: exit 3 naming the path and the errno text
expect 3 "$EPCTL" --socket /tmp/nonexistent.sock health &&
    contains err "/tmp/nonexistent.sock" && contains err "No such file or directory"
: >"$tmp/plain-file"
expect 3 "$EPCTL" --socket "$tmp/plain-file" stats && contains err "Connection refused"
expect 3 env EPD_SOCKET=/tmp/nonexistent-env.sock "$EPCTL" config && contains err "nonexistent-env"

if ! command -v python3 >/dev/null 2>&1; then
    echo "python3 not found: the end-to-end part (fake daemon) is not run"
    [[ $fails -eq 0 ]] && exit 0 || exit 1
fi

cat >"$tmp/fake_epd.py" <<'PY'
# A fake epd: protocol v1 frames, CONTROL replies, SUBMIT answered with y = x (H 64, K 4, E 16).
import json, os, socketserver, struct, sys
H, K, E, MAX_TOKENS = 64, 4, 16, 1024
HDR = struct.Struct("<4sHHIIQ")

def frame(ftype, meta, payload=b""):
    m = json.dumps(meta).encode()
    return HDR.pack(b"EPD1", 1, ftype, len(m), 0, len(payload)) + m + payload

class Conn(socketserver.StreamRequestHandler):
    def handle(self):
        while True:
            head = self.rfile.read(24)
            if len(head) < 24:
                return
            magic, ver, ftype, mlen, res, plen = HDR.unpack(head)
            if magic != b"EPD1":
                self.wfile.write(frame(3, {"id": None, "code": "bad_magic", "message": "bad magic"}))
                return
            meta = json.loads(self.rfile.read(mlen))
            payload = self.rfile.read(plen)
            if ftype == 4:
                op = meta.get("op")
                if op == "health":
                    out = frame(5, {"status": "ok", "rank": 0})
                elif op == "stats":
                    out = frame(5, {"requests": 3, "tokens": 12})
                elif op == "config":
                    out = frame(5, {"model.hidden": H, "model.topk": K, "model.num_experts": E,
                                    "dispatch.dtype": "fp8"})
                elif op == "metrics":
                    out = frame(5, {}, b"# TYPE epd_steps_total counter\nepd_steps_total 5\n")
                else:
                    out = frame(3, {"id": None, "code": "unknown_op", "message": "no op " + str(op)})
            else:
                t = meta["tensors"]
                x = t["x"]
                n = x["shape"][0]
                ids = struct.unpack("<%di" % (n * K),
                                    payload[t["topk_ids"]["data_offsets"][0]:t["topk_ids"]["data_offsets"][1]])
                if x["shape"][1] != H or t["topk_ids"]["shape"][1] != K:
                    out = frame(3, {"id": meta["id"], "code": "shape_mismatch", "message": "H or K"})
                elif n > MAX_TOKENS:
                    out = frame(3, {"id": meta["id"], "code": "too_many_tokens",
                                    "message": "%d tokens exceed the limit of %d" % (n, MAX_TOKENS)})
                elif any(i < -1 or i >= E for i in ids):
                    out = frame(3, {"id": meta["id"], "code": "expert_out_of_range", "message": "ids"})
                else:
                    b, e = x["data_offsets"]
                    out = frame(2, {"id": meta["id"], "step": 7,
                                    "tensors": {"y": {"dtype": "bf16", "shape": [n, H],
                                                      "data_offsets": [0, e - b]}}}, payload[b:e])
            self.wfile.write(out)

class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

srv = Server(sys.argv[1], Conn)
open(sys.argv[1] + ".ready", "w").close()
srv.serve_forever()
PY

start_fake() {
    python3 "$tmp/fake_epd.py" "$1" &
    pids+=($!)
    for _ in $(seq 100); do [[ -e $1.ready ]] && return 0; sleep 0.05; done
    fail "fake daemon on $1 did not start"
    return 1
}
s0=$tmp/epd-0.sock s1=$tmp/epd-1.sock
start_fake "$s0" && start_fake "$s1" || exit 1

expect 0 "$EPCTL" --socket "$s0" health && contains out "status = ok"
expect 0 "$EPCTL" --socket "$s0" --json health && contains out '"status":"ok"'
expect 0 "$EPCTL" --socket "$s0" stats && contains out "requests = 3"
expect 0 "$EPCTL" --socket "$s0" config && contains out "model.hidden = 64" && contains out 'dispatch.dtype = fp8'
expect 0 "$EPCTL" --socket "$s0" metrics && contains out "epd_steps_total 5"
expect 0 "$EPCTL" --socket "$s0" --json metrics && contains out '"text":"# TYPE'
expect 0 "$EPCTL" --socket "$s0,$s1" --json health && contains out "$s1"
# --json: one document of one shape, whether one socket, several, or one of them down
json_shape() { # N_OK N_ERR: the last output is {"command", "sockets": [...]} with that many
    python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
assert set(d) == {"command", "sockets"}, d
ok = [e for e in d["sockets"] if set(e) >= {"socket", "reply"} and "error" not in e]
bad = [e for e in d["sockets"] if set(e) == {"socket", "error"}]
assert (len(ok), len(bad)) == (int(sys.argv[2]), int(sys.argv[3])), d
assert d["command"] != "health" or all(e["reply"]["status"] == "ok" for e in ok), d
' "$tmp/out" "$1" "$2" || fail "--json document: $(cat "$tmp/out")"
}
expect 0 "$EPCTL" --socket "$s0" --json health && json_shape 1 0
expect 0 "$EPCTL" --socket "$s0,$s1" --json health && json_shape 2 0
expect 3 "$EPCTL" --socket "$s0,$tmp/missing.sock" --json health && json_shape 1 1
expect 0 "$EPCTL" --socket "$s0,$s1" --json metrics && json_shape 2 0
expect 0 "$EPCTL" --socket "$s0" --json submit --tokens 8 --seed 3 --id 42 &&
    contains out '"id":42' && contains out '"tokens":8' && contains out '"step":7'
# y = x here: the summary depends on the seed only
"$EPCTL" --socket "$s0" --json submit --tokens 8 --seed 3 --id 42 | sed 's/"time_ms":[0-9.]*//' >"$tmp/a"
"$EPCTL" --socket "$s0" --json submit --tokens 8 --seed 3 --id 42 | sed 's/"time_ms":[0-9.]*//' >"$tmp/b"
"$EPCTL" --socket "$s0" --json submit --tokens 8 --seed 4 --id 42 | sed 's/"time_ms":[0-9.]*//' >"$tmp/c"
cmp -s "$tmp/a" "$tmp/b" || fail "same seed gave different batches"
cmp -s "$tmp/a" "$tmp/c" && fail "another seed gave the same batch"
expect 0 "$EPCTL" --socket "$s0" submit --tokens 3 && contains out "abs-mean"
# the daemon's error: exit 1 with its code and message
expect 1 "$EPCTL" --socket "$s0" submit --tokens 2000 && contains err "too_many_tokens" &&
    contains err "exceed the limit"
# bench over both sockets, plain and pipelined; output is machine-readable with --json
expect 0 "$EPCTL" --socket "$s0" --socket "$s1" --json bench --tokens 4 --requests 60 --concurrency 3 &&
    contains out '"requests_ok":60' && contains out '"errors":0' && contains out '"sockets":2'
expect 0 "$EPCTL" --socket "$s0,$s1" bench --tokens 2 --requests 40 --concurrency 2 --pipeline 4 &&
    contains out "requests: 40 ok, 0 errors" && contains out "latency ms: p50"
grep -q $'\r' "$tmp/err" && fail "bench printed a progress line into a non-terminal"
expect 0 "$EPCTL" --socket "$s0" --json bench --tokens 1 --duration 0.3 --concurrency 2 &&
    contains out '"errors":0'
expect 1 "$EPCTL" --socket "$s0" --json bench --tokens 2000 --requests 5 &&
    contains out '"too_many_tokens":5'
# one socket down: bench says which and exits 3
expect 3 "$EPCTL" --socket "$s0,$tmp/missing.sock" bench --tokens 1 --requests 4 --concurrency 2 &&
    contains err "missing.sock"

# the real daemon: 2 CPU ranks under mpirun, epctl against both sockets, graceful stop
MPIRUN=${MPIRUN:-mpirun}
if command -v "$MPIRUN" >/dev/null 2>&1 && [[ -x $BUILD/epd ]]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    setsid "$MPIRUN" --oversubscribe -np 2 --mca pml ucx --mca pml_ucx_tls any \
        --mca pml_ucx_devices any "$BUILD/epd" --set "socket.path=$tmp/real-%r.sock" \
        --set device.backend=cpu --set model.hidden=256 --set model.num_experts=16 \
        --set model.topk=4 >"$tmp/epd.log" 2>&1 &
    epd_pid=$!
    up=0
    for _ in $(seq 300); do
        if "$EPCTL" --socket "$tmp/real-0.sock,$tmp/real-1.sock" health >/dev/null 2>&1; then
            up=1
            break
        fi
        kill -0 "$epd_pid" 2>/dev/null || break
        sleep 0.1
    done
    if [[ $up -eq 1 ]]; then
        r0=$tmp/real-0.sock r1=$tmp/real-1.sock
        expect 0 "$EPCTL" --socket "$r0" config && contains out "model.hidden = 256"
        expect 0 "$EPCTL" --socket "$r1" --json submit --tokens 32 --seed 9 &&
            contains out '"hidden":256' && contains out '"topk":4'
        expect 0 "$EPCTL" --socket "$r0,$r1" --json bench --tokens 16 --requests 40 --concurrency 4 \
            --pipeline 2 && contains out '"requests_ok":40' && contains out '"errors":0'
        # 200 connections for 1 s: the clock starts once all are connected, so requests count
        expect 0 "$EPCTL" --socket "$r0,$r1" --json bench --tokens 4 --duration 1 --concurrency 200 &&
            python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
assert d["requests_ok"] > 0 and d["errors"] == 0 and d["seconds"] >= 1.0, d
assert d["payload_bytes"]["sent"] > 0 and d["payload_gb_per_s"]["received"] > 0, d
' "$tmp/out" || fail "bench --duration 1 --concurrency 200: $(cat "$tmp/out")"
        expect 0 "$EPCTL" --socket "$r0" bench --tokens 4 --requests 10 &&
            contains out "MB sent (.* GB/s), .* MB received (.* GB/s)"
        # a request-level error from the real daemon: exit 1 naming its code
        expect 1 "$EPCTL" --socket "$r0" submit --tokens 5000 && contains err "too_many_tokens"
        expect 0 "$EPCTL" --socket "$r0" metrics && contains out "# TYPE"
        kill -USR1 "$epd_pid"
        for _ in $(seq 300); do kill -0 "$epd_pid" 2>/dev/null || break; sleep 0.1; done
        wait "$epd_pid" || fail "mpirun exited $? after SIGUSR1"
        epd_pid=
    else
        fail "the real daemon did not come up: $(tail -n 20 "$tmp/epd.log")"
    fi
else
    echo "no $MPIRUN or $BUILD/epd: the real-daemon part is not run"
fi

[[ $fails -eq 0 ]] || { echo "$fails failure(s)"; exit 1; }
echo "all epctl CLI checks passed"
