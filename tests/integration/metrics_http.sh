#!/usr/bin/env bash
# metrics.listen: every rank serves GET /metrics over HTTP (evhttp) on the configured port plus
# its local rank; the exposition passes `promtool check metrics` over HTTP, over CONTROL, and as
# `epctl -s A,B metrics` (the merge of two ranks); the histograms and expert counters count what
# was submitted; other paths get 404, other methods 501; a bad or taken address stops start-up
# naming the setting.
source "$(dirname "$0")/daemon_lib.bash"
EPCTL=$BUILD/epctl
command -v promtool >/dev/null 2>&1 ||
    skip "promtool is not installed (scripts/deps.sh installs the Debian package prometheus)"

# Two consecutive free TCP ports on 127.0.0.1.
port=$(python3 - <<'PY'
import random, socket
for _ in range(200):
    p = random.randint(20000, 60000)
    try:
        socks = []
        for q in (p, p + 1):
            s = socket.socket(); s.bind(("127.0.0.1", q)); socks.append(s)
        print(p); break
    except OSError:
        pass
    finally:
        for s in socks: s.close()
PY
)
[[ -n $port ]] || die "no two free ports"

epd_start 2 --set model.hidden=256 --set model.num_experts=16 --set model.topk=4 \
    --set metrics.listen=127.0.0.1:$port
grep -q "metrics on http://127.0.0.1:$port/metrics" "$EPD_LOG" || die "rank 0 did not log its URL"
grep -q "metrics on http://127.0.0.1:$((port + 1))/metrics" "$EPD_LOG" || die "rank 1: no URL"

# On rank 0: three requests of 5 tokens of layer 0 with ids 0..3 for every token (daemon_wire's
# default), and two of layer 7 with ids 4..7.
python3 - "$(sock 0)" <<'PY' || die "submitting the requests failed"
import json, struct, sys
sys.path.insert(0, "tests/integration")
import daemon_wire as w
s = w.connect(sys.argv[1])
for i in range(3):
    s.sendall(w.submit(100 + i, 5, 256, 4))
for i in range(2):
    f = w.submit(200 + i, 5, 256, 4, ids=[4, 5, 6, 7] * 5)
    mlen = struct.unpack_from("<I", f, 8)[0]
    meta = json.loads(f[24:24 + mlen])
    meta["layer"] = 7
    s.sendall(w.frame(w.SUBMIT, meta, f[24 + mlen:]))
for i in range(5):
    ftype, meta, _ = w.read_frame(s)
    assert ftype == w.RESULT, meta
PY

# fetch PORT PATH [METHOD]: prints "STATUS CONTENT-TYPE" then the body to $TMP/body.
fetch() {
    python3 - "$@" <<'PY'
import sys, urllib.request, urllib.error
port, path = sys.argv[1], sys.argv[2]
method = sys.argv[3] if len(sys.argv) > 3 else "GET"
req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                             data=b"" if method == "POST" else None)
try:
    with urllib.request.urlopen(req, timeout=10) as r:
        body, status, ctype = r.read(), r.status, r.headers.get("Content-Type")
except urllib.error.HTTPError as e:
    body, status, ctype = e.read(), e.code, e.headers.get("Content-Type")
import os
open(os.environ["TMP"] + "/body", "wb").write(body)
print(status, ctype)
PY
}
export TMP

for r in 0 1; do
    head=$(fetch $((port + r)) /metrics) || die "rank $r: GET /metrics failed"
    [[ $head == "200 text/plain; version=0.0.4; charset=utf-8" ]] || die "rank $r: got '$head'"
    cp "$TMP/body" "$TMP/rank$r.prom"
    promtool check metrics <"$TMP/rank$r.prom" || die "rank $r: promtool rejects /metrics"
    grep -q '^epd_request_latency_seconds_bucket{le="+Inf"}' "$TMP/rank$r.prom" ||
        die "rank $r: no request latency histogram"
done
# every family is documented for the operator
for name in $(awk '$1 == "#" && $2 == "TYPE" { print $3 }' "$TMP/rank0.prom"); do
    grep -q "^| \`$name\` |" docs/operations.md || die "docs/operations.md does not describe $name"
done
# value FILE SERIES: the sample's value (exact series text).
value() { awk -v s="$2" '$1 == s { print $2 }' "$1"; }
[[ $(value "$TMP/rank0.prom" epd_request_latency_seconds_count) == 5 ]] ||
    die "rank 0: request latency count is not 5"
[[ $(value "$TMP/rank1.prom" epd_request_latency_seconds_count) == 0 ]] ||
    die "rank 1: request latency count is not 0"
for e in 0 1 2 3; do
    [[ $(value "$TMP/rank0.prom" "epd_expert_routed_tokens_total{layer=\"0\",expert=\"$e\"}") == 15 ]] ||
        die "rank 0: expert $e did not count 15 tokens"
done
[[ $(value "$TMP/rank0.prom" 'epd_expert_routed_tokens_total{layer="0",expert="4"}') == 0 ]] ||
    die "rank 0: expert 4 of layer 0 counted tokens it never got"
for e in 4 5 6 7; do
    [[ $(value "$TMP/rank0.prom" "epd_expert_routed_tokens_total{layer=\"7\",expert=\"$e\"}") == 10 ]] ||
        die "rank 0: expert $e of layer 7 did not count 10 tokens"
done
[[ $(value "$TMP/rank0.prom" 'epd_expert_routed_tokens_total{layer="7",expert="0"}') == 0 ]] ||
    die "rank 0: expert 0 of layer 7 counted tokens of layer 0"
grep -q 'epd_expert_routed_tokens_total{layer="3",' "$TMP/rank0.prom" && die "a layer nobody used"
# the tokens each rank's own experts ran (16 experts: rank 0 owns 0-7, rank 1 owns 8-15)
for e in 0 1 2 3; do
    [[ $(value "$TMP/rank0.prom" "epd_expert_tokens_total{layer=\"0\",expert=\"$e\"}") == 15 ]] ||
        die "rank 0: its expert $e did not run 15 tokens of layer 0"
done
for e in 4 5 6 7; do
    [[ $(value "$TMP/rank0.prom" "epd_expert_tokens_total{layer=\"7\",expert=\"$e\"}") == 10 ]] ||
        die "rank 0: its expert $e did not run 10 tokens of layer 7"
done
grep -q 'epd_expert_tokens_total{layer="0",expert="8"}' "$TMP/rank0.prom" &&
    die "rank 0 reports tokens run by an expert it does not own"
grep -q '^epd_expert_tokens_total{' "$TMP/rank1.prom" &&
    die "rank 1 reports tokens run by its experts, which ran none"
steps=$(value "$TMP/rank0.prom" epd_steps_total)
[[ $(value "$TMP/rank0.prom" epd_step_duration_seconds_count) == "$steps" ]] ||
    die "rank 0: step histogram count differs from epd_steps_total ($steps)"
[[ $(value "$TMP/rank0.prom" epd_step_tokens_sum) == 25 ]] || die "rank 0: step tokens sum is not 25"

head=$(fetch "$port" /other) && [[ $head == 404* ]] || die "GET /other: '$head', expected 404"
head=$(fetch "$port" /metrics POST) && [[ $head == 501* ]] || die "POST /metrics: '$head', expected 501"

# The same exposition over CONTROL, and two ranks merged by epctl.
$WIRE metrics "$(sock 0)" >"$TMP/control.prom" || die "CONTROL metrics failed"
promtool check metrics <"$TMP/control.prom" || die "promtool rejects CONTROL metrics"
"$EPCTL" -s "$(sock 0),$(sock 1)" metrics >"$TMP/merged.prom" || die "epctl -s A,B metrics failed"
promtool check metrics <"$TMP/merged.prom" || die "promtool rejects epctl's merged exposition"
[[ $(grep -c '^# TYPE epd_steps_total counter$' "$TMP/merged.prom") == 1 ]] ||
    die "the merge repeats a family's TYPE line"
grep -q "^epd_steps_total{socket=\"$(sock 1)\"} " "$TMP/merged.prom" || die "no socket label"
epd_stop

# A bad value and a taken port stop start-up, naming the setting.
epd_launch 1 "$TMP/bad.log" --set metrics.listen=localhost
epd_wait_exit 30
[[ $EPD_RC != 0 ]] && grep -q "metrics.listen" "$TMP/bad.log" || die "metrics.listen=localhost was accepted"
# a port some other process listens on (chosen by the kernel, so nothing else has it)
python3 -c "
import socket, sys, time
s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1)
open('$TMP/taken.port', 'w').write(str(s.getsockname()[1])); time.sleep(30)" &
holder=$!
for _ in $(seq 50); do [[ -s $TMP/taken.port ]] && break; sleep 0.1; done
taken=$(cat "$TMP/taken.port") || die "the port holder did not start"
epd_launch 1 "$TMP/taken.log" --set metrics.listen=127.0.0.1:$taken
epd_wait_exit 30
kill "$holder" 2>/dev/null; wait "$holder" 2>/dev/null
[[ $EPD_RC != 0 ]] && grep -q "metrics.listen: cannot listen on 127.0.0.1 port $taken" "$TMP/taken.log" ||
    { cat "$TMP/taken.log"; die "a taken port did not stop start-up"; }
echo "PASS: /metrics on every rank (port + local rank) passes promtool; CONTROL and epctl's merge too"
