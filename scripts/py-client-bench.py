#!/usr/bin/env python3
"""The Python client's cost a call, against the C client on the same daemon in the same run.

    scripts/py-client-bench.py --socket /run/epd/epd-0.sock [--tokens 1] [--calls 3000]

On one rank's socket: `epctl bench` (libepd, the baseline) and then epd.Client.submit in a loop
with numpy arrays and, where torch is installed, CPU torch tensors (payload path, one call in
flight), each as a plain submit and as a prepared call (Client.prepare); then the client's own work without a daemon (submit_async and result() over a
socketpair whose peer answers at once). Prints p50s, the ratio to epctl's p50, and the client's
own microseconds; the daemon must take the batch (model.hidden, topk and num_experts are read
from its config). Where the microseconds of a call go is in docs/python.md."""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.isdir(os.path.join(HERE, "..", "python", "epd")):
    sys.path.insert(0, os.path.join(HERE, "..", "python"))  # a checkout: no install needed

import numpy as np  # noqa: E402

import epd  # noqa: E402
from epd import client as cl  # noqa: E402
from epd import frame as fr  # noqa: E402
from epd._session import Session  # noqa: E402


def batch(kind, n, hidden, experts, topk):
    ids = np.array([[(t * 7 + k * 31) % experts for k in range(topk)] for t in range(n)],
                   np.int64)
    x = np.full((n, hidden), 0x3f80, np.uint16)
    w = np.full((n, topk), 1.0 / topk, np.float32)
    if kind == "numpy":
        return x, ids, w
    import torch
    return (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16), torch.from_numpy(ids),
            torch.from_numpy(w))


def p50_us(samples_ns):
    return statistics.median(samples_ns) / 1e3


def loop(sock, args, kind, dims):
    """p50 of Client.submit over args.calls calls (after 200 warm-up calls); of a prepared
    call's submit() for the kinds "... prepared"."""
    x, ids, w = batch(kind.split()[0], args.tokens, *dims)
    with epd.Client(sock, timeout=30) as c:
        if kind.endswith(" prepared"):
            call = c.prepare(x, ids, w)
            one = call.submit
        else:
            def one():
                c.submit(x, ids, w)
        for _ in range(200):
            one()
        ts = []
        for _ in range(args.calls):
            t0 = time.perf_counter_ns()
            one()
            ts.append(time.perf_counter_ns() - t0)
    return p50_us(ts)


def own_cost(args, kind, dims):
    """(submit_async, result) p50 us of the client alone: a socketpair whose peer has the RESULT
    waiting when result() is called."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for s, opt in ((a, socket.SO_SNDBUF), (b, socket.SO_RCVBUF)):
        s.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
    a.setblocking(False)
    c = cl.Client.__new__(cl.Client)  # a Client over the pair, as __init__ makes it
    c.path, c.timeout, c.spin = "socketpair", 10.0, 0.0
    c._s = Session()
    c._rx = fr.Receiver(c._s.place_payload)
    c._stage = bytearray(cl._STAGE)
    c._stage_view = memoryview(c._stage)
    c._s0 = c._s1 = 0
    c._sock, c._poller, c._poll_events, c._config = a, None, 0, None
    c._sending = c._serving = False
    x, ids, w = batch(kind.split()[0], args.tokens, *dims)
    n, hidden = args.tokens, dims[0]
    call = c.prepare(x, ids, w) if kind.endswith(" prepared") else None
    y = bytes(2 * n * hidden)
    sink = bytearray(8 << 20)
    ts, tr = [], []
    for i in range(args.calls + 200):
        t0 = time.perf_counter_ns()
        p = call.submit_async() if call is not None else c.submit_async(x, ids, w)
        t1 = time.perf_counter_ns()
        while True:
            try:
                b.recv_into(sink, len(sink), socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
        meta = {"id": p.id, "step": 1, "tensors": {"y": fr.payload_tensor("bf16", [n, hidden], 0,
                                                                            len(y))}}
        b.sendall(fr.encode(fr.RESULT, meta, y))
        t2 = time.perf_counter_ns()
        p.result(10)
        t3 = time.perf_counter_ns()
        if i >= 200:
            ts.append(t1 - t0)
            tr.append(t3 - t2)
    a.close()
    b.close()
    return p50_us(ts), p50_us(tr)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", required=True, help="one rank's socket")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--calls", type=int, default=3000, help="calls of each client in all")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--epctl", default=os.path.join(HERE, "..", "build", "epctl"))
    args = ap.parse_args(argv)

    with epd.Client(args.socket, timeout=30) as c:
        cfg = c.config()
    dims = (cfg["model.hidden"], cfg["model.num_experts"], cfg["model.topk"])
    kinds = ["numpy", "numpy prepared"]
    try:
        import torch  # noqa: F401
        kinds += ["torch", "torch prepared"]
    except ImportError:
        print("torch is not installed for %s: CPU torch tensors not timed" % sys.executable)
    # rounds of each client in turn: a daemon's own latency drifts over a run, so the ratio is
    # taken round by round and its median printed
    per = max(100, args.calls // args.rounds)
    sub = argparse.Namespace(tokens=args.tokens, calls=per)
    p50s = {k: [] for k in ["epctl"] + kinds}
    for _ in range(args.rounds):
        out = subprocess.run([args.epctl, "--socket", args.socket, "--json", "bench", "--tokens",
                              str(args.tokens), "--requests", str(per)],
                             check=True, capture_output=True, text=True).stdout
        p50s["epctl"].append(json.loads(out)["latency_ms"]["p50"] * 1e3)
        for kind in kinds:
            p50s[kind].append(loop(args.socket, sub, kind, dims))
    print("daemon %s, H %d, E %d, top-%d, %d tokens a call; %d rounds of %d calls each, medians"
          % (args.socket, dims[0], dims[1], dims[2], args.tokens, args.rounds, per))
    base = statistics.median(p50s["epctl"])
    print("%-34s p50 %8.1f us" % ("epctl bench (libepd, baseline)", base))
    for kind in kinds:
        t = statistics.median(p50s[kind])
        ratio = statistics.median(a / b for a, b in zip(p50s[kind], p50s["epctl"]))
        print("%-34s p50 %8.1f us  %.2fx epctl  (+%.1f us)"
              % ("epd.Client.submit, %s" % kind, t, ratio, t - base))
    for kind in kinds:
        s, r = own_cost(args, kind, dims)
        print("%-34s submit_async %.1f us + result %.1f us = %.1f us"
              % ("client alone, %s" % kind, s, r, s + r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
