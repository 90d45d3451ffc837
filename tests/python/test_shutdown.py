#!/usr/bin/env python3
"""The Python client while the daemon goes away (run by tests/integration/python_client.sh).
    test_shutdown.py stop   flood both ranks, SIGUSR1 to mpirun: every answer is a right
                            result, busy or shutting_down (which must be seen), then the
                            connections end in ConnectionClosed and connecting fails cleanly
    test_shutdown.py kill   flood, SIGKILL one rank: the requests in flight fail with
                            ConnectionClosed within a bounded time, nothing hangs
Environment: EPDPY_SOCKETS, EPDPY_MPIRUN_PID, EPDPY_REF, EPDPY_TMP."""
import os
import signal
import sys
import time


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, HERE)
import epd  # noqa: E402
from test_daemon import SOCKETS, c_side, make_batch  # noqa: E402

WINDOW = 8


def fail(why):
    print("FAIL:", why)
    sys.exit(1)


def flood(clients, batches, wants, trigger, limit_s=60):
    """Keeps WINDOW requests in flight on every client until every connection ended; calls
    trigger() once 40 results came. Returns counts {"ok", "busy", "shutting_down", "closed"}."""
    counts = {"ok": 0, "busy": 0, "shutting_down": 0, "closed": 0}
    inflight = {c: [] for c in clients}
    live = set(clients)
    fired = False
    deadline = time.monotonic() + limit_s
    seq = 0
    while live:
        if time.monotonic() > deadline:
            fail("the connections did not end within %d s: %s" % (limit_s, counts))
        for c in list(live):
            try:
                while len(inflight[c]) < WINDOW:
                    b = seq % len(batches)
                    inflight[c].append((b, c.submit_async(*batches[b])))
                    seq += 1
            except epd.ConnectionClosed:
                counts["closed"] += 1
                live.discard(c)
                continue
            b, p = inflight[c].pop(0)
            exc = p.exception(timeout=20)
            if exc is None:
                if not (p.result() == wants[b]).all():
                    fail("a wrong result for id %d" % p.id)
                counts["ok"] += 1
            elif isinstance(exc, epd.Busy):
                counts["busy"] += 1
            elif isinstance(exc, epd.ShuttingDown):
                counts["shutting_down"] += 1
            elif isinstance(exc, epd.ConnectionClosed):
                counts["closed"] += 1
                live.discard(c)
            else:
                fail("unexpected %r" % exc)
        if not fired and counts["ok"] >= 40:
            trigger()
            fired = True
    return counts


def main(mode):
    pid = int(os.environ["EPDPY_MPIRUN_PID"])
    batches = [make_batch(64, 900 + i) for i in range(3)]
    wants = [c_side(SOCKETS[0], *b)[1] for b in batches]
    clients = [epd.Client(s, timeout=20) for s in SOCKETS]
    if mode == "stop":
        counts = flood(clients, batches, wants, lambda: os.kill(pid, signal.SIGUSR1))
        print("graceful stop:", counts)
        if counts["shutting_down"] == 0:
            fail("no request was answered shutting_down during the drain")
        deadline = time.monotonic() + 30
        while True:
            try:
                epd.Client(SOCKETS[0], connect_timeout=1).close()
            except epd.ConnectError as e:
                print("after the stop:", e)
                break
            if time.monotonic() > deadline:
                fail("still accepting connections 30 s after the stop")
            time.sleep(0.1)
    else:
        victim = clients[1].health()["pid"]
        t0 = time.monotonic()
        counts = flood(clients, batches, wants, lambda: os.kill(victim, signal.SIGKILL))
        took = time.monotonic() - t0
        print("killed rank 1 (pid %d): %s, connections ended within %.1f s" % (victim, counts,
                                                                               took))
    for c in clients:
        c.close()
    if counts["closed"] < len(clients):
        fail("not every connection ended in ConnectionClosed")
    print("PASS")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "stop")
