#!/usr/bin/env python3
"""The soak's traffic and checks (tests/soak/soak.sh starts the daemon and calls this).
    soak.py --check CHECK_CLIENT --clients N --minutes M SOCKET0 SOCKET1
Good traffic: check_client runs in a loop (results compared with the reference bit for bit).
Bad traffic, from N threads: malformed frames (bad magic, bad version, non-strict JSON, bad
tensors, non-finite input, oversize), partial frames abandoned, slow frames (past
socket.frame_timeout_ms), idle connections (past socket.idle_timeout_ms), a frame over the
buffer budget, connect/disconnect storms, requests whose client leaves before the answer. Every
60 s one rank is SIGSTOPped for 3 s and continued. At the end each rank must have accepted =
answered + discarded, no buffered bytes, and RSS within 20% of where it was after the warm-up."""
import argparse
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import daemon_wire as w

H, K = 256, 4
stop = threading.Event()
counts = {}
counts_lock = threading.Lock()
failures = []


def count(what, n=1):
    with counts_lock:
        counts[what] = counts.get(what, 0) + n


def fail(message):
    with counts_lock:
        failures.append(message)
    print("FAIL:", message, flush=True)


def stats(path):
    meta, _ = w.control(path, "stats")
    return meta


def health(path):
    return w.control(path, "health")[0]


def rss_mb(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return -1.0


def expect_error(s, codes):
    try:
        ftype, meta, _ = w.read_frame(s)
    except (EOFError, ConnectionResetError, socket.timeout) as e:
        return "closed: %s" % e
    if ftype != w.ERROR or meta.get("code") not in codes:
        return "expected ERROR %s, got type %d %s" % (codes, ftype, meta)
    return None


def bad_frames(path, rng):
    """One malformed thing per connection; each must get its ERROR (framing: then closed)."""
    good = w.submit(1, 2, H, K)
    cases = [
        ("bad_magic", w.header(w.SUBMIT, 2, 0, magic=b"EPDX") + b"{}", {"bad_magic"}),
        ("bad_version", w.header(w.SUBMIT, 2, 0, version=9) + b"{}", {"bad_version"}),
        ("bom", w.frame(w.CONTROL, b"\xef\xbb\xbf{\"op\":\"health\"}"), {"bad_json"}),
        ("leading_zero", w.frame(w.CONTROL, b"{\"op\":\"health\",\"id\":007}"), {"bad_json"}),
        ("nul", w.frame(w.CONTROL, b"{\"op\":\"he\\u0000alth\"}"), {"bad_json"}),
        ("unknown_op", w.frame(w.CONTROL, {"op": "nope", "id": 3}), {"unknown_op"}),
        ("expert_range", w.submit(2, 1, H, K, ids=[0, 1, 2, 99]), {"expert_out_of_range"}),
        ("invalid_topk", w.submit(3, 1, H, K, ids=[1, 1, 2, 3]), {"invalid_topk"}),
        ("non_finite", w.submit(4, 1, H, K, x=[0x7F80] * H), {"non_finite_input"}),
        ("shape", w.submit(5, 1, H, K, shapes={"x": [1, H + 128]}), {"bad_tensor", "shape_mismatch"}),
        ("oversize", w.header(w.SUBMIT, 2, 1 << 40) + b"{}", {"frame_too_large"}),
        ("over_max_frame", w.header(w.SUBMIT, 2, 17 << 20) + b"{}", {"frame_too_large"}),
        ("bad_type", w.frame(w.RESULT, {"id": 1}), {"bad_type"}),
    ]
    name, data, codes = rng.choice(cases)
    try:
        with w.connect(path, timeout=10) as s:
            s.sendall(data)
            why = expect_error(s, codes)
            if why:
                fail("%s: %s" % (name, why))
            elif name in ("expert_range", "invalid_topk", "non_finite", "unknown_op"):
                s.sendall(good)  # a request-level error leaves the connection usable
                ftype, meta, _ = w.read_frame(s)
                if ftype not in (w.RESULT, w.ERROR) or (ftype == w.ERROR and meta.get("code") != "busy"):
                    fail("%s: the connection did not serve after the error: %d %s" % (name, ftype, meta))
        count("bad:" + name)
    except (ConnectionError, socket.timeout, EOFError) as e:
        fail("%s: %s" % (name, e))


def abandoned(path, rng):
    """A frame started and left half-way; or requests whose client leaves before the answers."""
    try:
        s = w.connect(path, timeout=10)
        if rng.random() < 0.5:
            data = w.submit(7, 64, H, K)
            s.sendall(data[: rng.randrange(1, len(data))])
            count("abandoned_partial")
        else:
            for i in range(rng.randrange(1, 8)):
                s.sendall(w.submit(100 + i, rng.randrange(1, 64), H, K))
            count("left_before_answers")
        s.close()
    except (ConnectionError, socket.timeout) as e:
        fail("abandoned: %s" % e)


def slow_frame(path, rng):
    """A frame one byte at a time, slower than socket.frame_timeout_ms: must be closed."""
    try:
        with w.connect(path, timeout=10) as s:
            data = w.submit(9, 1, H, K)
            t0 = time.time()
            for i in range(len(data) - 1):
                s.sendall(data[i:i + 1])
                time.sleep(0.1)
                if time.time() - t0 > 6:
                    break
            if not w.is_closed(s, timeout=5):
                fail("slow frame: not closed after the frame timeout")
            count("slow_frame_closed")
    except (ConnectionError, BrokenPipeError):
        count("slow_frame_closed")
    except socket.timeout as e:
        fail("slow frame: %s" % e)


def idle(path, rng):
    """A connection that says nothing: closed after socket.idle_timeout_ms."""
    try:
        with w.connect(path, timeout=10) as s:
            if not w.is_closed(s, timeout=8):
                fail("idle connection not closed after the idle timeout")
            count("idle_closed")
    except (ConnectionError, socket.timeout) as e:
        fail("idle: %s" % e)


def storm(path, rng):
    for _ in range(50):
        try:
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            s.close()
        except OSError as e:
            fail("storm: %s" % e)
            return
    count("storm_connects", 50)


def over_budget(path, rng):
    """Two frames of 14 MiB announced at once against a 24 MiB budget: one is answered busy."""
    meta = json.dumps({"id": 77, "tensors": {}}).encode()
    try:
        a = w.connect(path, timeout=20)
        b = w.connect(path, timeout=20)
        a.sendall(w.header(w.SUBMIT, len(meta), 14 << 20) + meta + b"\0" * (1 << 20))
        time.sleep(0.1)
        b.sendall(w.header(w.SUBMIT, len(meta), 14 << 20) + meta)
        b.sendall(b"\0" * (14 << 20))
        # busy, or (when a's frame timed out first) the frame's own error: no tensors
        why = expect_error(b, {"busy", "bad_tensor", "bad_json"})
        if why:
            fail("over budget: %s" % why)
        else:
            count("over_budget_answered")
        a.close()
        b.close()
    except (ConnectionError, socket.timeout) as e:
        # a stopped rank can make either side wait past the frame timeout: not a finding
        count("over_budget_interrupted")


def bad_worker(paths, seed):
    rng = random.Random(seed)
    kinds = [bad_frames] * 6 + [abandoned] * 3 + [storm] + [slow_frame, idle] + [over_budget]
    while not stop.is_set():
        rng.choice(kinds)(rng.choice(paths), rng)
        time.sleep(rng.random() * 0.2)


def good_worker(check, paths, seed):
    n = 0
    while not stop.is_set():
        args = [check]
        for p in paths:
            args += ["--socket", p]
        args += ["--seed", str(seed + n), "--clients", "2", "--requests", "40", "--max-tokens",
                 "64", "--window", "4", "--retry-busy", "--quiet"]
        r = subprocess.run(args, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            fail("check_client exit %d: %s" % (r.returncode, (r.stdout + r.stderr)[-400:]))
        else:
            count("good_runs")
            count("good_requests", 2 * 40 * len(paths))
        n += 1


def stopper(pids, period):
    k = 0
    while not stop.wait(period):
        pid = pids[k % len(pids)]
        os.kill(pid, signal.SIGSTOP)
        time.sleep(3)
        os.kill(pid, signal.SIGCONT)
        count("sigstops")
        k += 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", required=True)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("sockets", nargs="+")
    a = ap.parse_args()
    paths = a.sockets
    pids = [health(p)["pid"] for p in paths]

    # warm-up: the step buffers are touched once, then the baseline is taken
    subprocess.run([a.check] + sum([["--socket", p] for p in paths], []) +
                   ["--clients", "4", "--requests", "20", "--max-tokens", "256", "--quiet"],
                   check=True, timeout=300)
    time.sleep(1.5)
    rss0 = [rss_mb(p) for p in pids]
    start = time.time()
    threads = [threading.Thread(target=good_worker, args=(a.check, paths, 1000 * i))
               for i in range(max(1, a.clients // 4))]
    threads += [threading.Thread(target=bad_worker, args=(paths, 7 + i)) for i in range(a.clients)]
    threads.append(threading.Thread(target=stopper, args=(pids, 60)))
    for t in threads:
        t.start()
    peak = list(rss0)
    while time.time() - start < a.minutes * 60 and not failures:
        time.sleep(1)
        peak = [max(x, rss_mb(p)) for x, p in zip(peak, pids)]
    stop.set()
    for t in threads:
        t.join()
    time.sleep(6)  # every connection closed or timed out; the daemon is idle and has trimmed

    ok = not failures
    print("soak: %.1f min, %d clients, %d sockets" % ((time.time() - start) / 60, a.clients,
                                                       len(paths)))
    print("traffic: " + ", ".join("%s %d" % kv for kv in sorted(counts.items())))
    for r, p in enumerate(paths):
        s = stats(p)["server"]
        rss = rss_mb(pids[r])
        answered = s["results_sent"] + s["results_discarded"]
        line = ("rank %d: accepted %d, results sent %d + discarded %d = %d; clients now %d, "
                "refused %d, closed idle %d, frame timeout %d, stalls %d, buffered %d; errors %s; "
                "RSS %.1f MB (start %.1f, peak %.1f, %+.0f%%)" %
                (r, s["requests_accepted"], s["results_sent"], s["results_discarded"], answered,
                 s["clients"], s["clients_refused"], s["closed_idle"], s["closed_frame_timeout"],
                 s["stalls"], s["buffered_bytes"],
                 {k: v for k, v in s["errors"].items() if v}, rss, rss0[r], peak[r],
                 100.0 * (rss - rss0[r]) / rss0[r]))
        print(line)
        if s["requests_accepted"] != answered:
            ok = False
            print("FAIL: rank %d: accepted %d != answered + discarded %d" %
                  (r, s["requests_accepted"], answered))
        if s["buffered_bytes"] != 0:
            ok = False
            print("FAIL: rank %d: %d bytes still buffered" % (r, s["buffered_bytes"]))
        if rss > rss0[r] * 1.2:
            ok = False
            print("FAIL: rank %d: RSS %.1f MB is more than 20%% over its start %.1f MB" %
                  (r, rss, rss0[r]))
    print("soak: %s" % ("PASS" if ok else "FAIL (%d failures)" % len(failures)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
