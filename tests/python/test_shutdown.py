#!/usr/bin/env python3
"""The Python client while the daemon goes away (run by tests/integration/python_client.sh).
    test_shutdown.py stop   SIGUSR1 to mpirun with rank 0's queue full (rank 1 held by SIGSTOP
                            meanwhile): the queued requests are served right, SUBMITs during
                            the drain get shutting_down (which must be seen), then the
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

WINDOW = 32


def fail(why):
    print("FAIL:", why)
    sys.exit(1)


def flood(clients, batches, wants, trigger, limit_s=60):
    """Keeps WINDOW requests in flight on every client until every connection ended; calls
    trigger() once 40 results came, the windows full, then keeps sending without waiting.
    Returns counts {"ok", "busy", "shutting_down", "closed"}."""
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
                while len(inflight[c]) < (4 * WINDOW if fired else WINDOW):
                    b = seq % len(batches)
                    inflight[c].append((b, c.submit_async(*batches[b])))
                    seq += 1
            except epd.ConnectionClosed:
                counts["closed"] += 1
                live.discard(c)
                continue
            b, p = inflight[c][0]
            try:
                # before the trigger: wait for the oldest; after it: keep sending, take what came
                exc = p.exception(timeout=0.002 if fired else 20)
            except epd.Timeout:
                continue
            inflight[c].pop(0)
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
            # with every window full: the drain then has requests to answer while the
            # answers prompt new SUBMITs, which must be refused
            for c in live:
                while len(inflight[c]) < WINDOW:
                    b = seq % len(batches)
                    inflight[c].append((b, c.submit_async(*batches[b])))
                    seq += 1
            trigger()
            fired = True
    return counts


def stop_under_load(clients, batches, wants, mpirun_pid):
    """SIGUSR1 to mpirun with rank 0's queue full: rank 1 is stopped (SIGSTOP) while rank 0
    queues max_queued_tokens of requests and gets the signal, then resumed; the agreed drain
    has those requests to serve, and every SUBMIT sent meanwhile must be answered
    shutting_down (or served, before the agreement). Every connection then ends closed."""
    c0 = clients[0]
    cfg = c0.config()
    per = batches[0][0].shape[0]
    queued_n = cfg["dispatch.max_queued_tokens"] // per
    pid1 = clients[1].health()["pid"]
    os.kill(pid1, signal.SIGSTOP)
    try:
        queued = [(i % len(batches), c0.submit_async(*batches[i % len(batches)]))
                  for i in range(queued_n)]
        os.kill(mpirun_pid, signal.SIGUSR1)
        time.sleep(0.3)  # mpirun forwards it; rank 1 gets it once resumed
    finally:
        os.kill(pid1, signal.SIGCONT)
    counts = {"ok": 0, "busy": 0, "shutting_down": 0, "closed": 0}
    later = []
    deadline = time.monotonic() + 60
    while True:
        if time.monotonic() > deadline:
            fail("rank 0 still open 60 s after the stop: %s" % counts)
        try:
            b = len(later) % len(batches)
            later.append((b, c0.submit_async(*batches[b])))
            later[-1][1].exception(timeout=0.001)
        except epd.Timeout:
            pass
        except epd.ConnectionClosed:
            counts["closed"] += 1
            break
        if later[-1][1].done() and isinstance(later[-1][1].exception(), epd.ConnectionClosed):
            counts["closed"] += 1
            break
    for b, p in queued:
        exc = p.exception(timeout=20)
        if exc is not None:
            fail("a request queued before the stop got %r" % exc)
        if not (p.result() == wants[b]).all():
            fail("a wrong result for id %d" % p.id)
    for b, p in later:
        exc = p.exception(timeout=20)
        if exc is None:
            if not (p.result() == wants[b]).all():
                fail("a wrong result for id %d" % p.id)
            counts["ok"] += 1
        elif isinstance(exc, epd.ShuttingDown):
            counts["shutting_down"] += 1
        elif isinstance(exc, epd.Busy):
            counts["busy"] += 1
        elif isinstance(exc, epd.ConnectionClosed):
            counts["unread at the close"] = counts.get("unread at the close", 0) + 1
        else:
            fail("unexpected %r" % exc)
    counts["queued before the stop, all served"] = len(queued)
    if counts["shutting_down"] == 0:
        fail("no SUBMIT was answered shutting_down during the drain: %s" % counts)
    deadline = time.monotonic() + 30
    while True:
        try:
            clients[1].health()
        except epd.ConnectionClosed:
            counts["closed"] += 1
            break
        if time.monotonic() > deadline:
            fail("rank 1 still answers 30 s after the stop")
        time.sleep(0.05)
    return counts


def main(mode):
    pid = int(os.environ["EPDPY_MPIRUN_PID"])
    clients = [epd.Client(s, timeout=20) for s in SOCKETS]
    hidden = clients[0].config()["model.hidden"]
    batches = [make_batch(64, 900 + i, hidden=hidden) for i in range(3)]
    wants = [c_side(SOCKETS[0], *b)[1] for b in batches]
    if mode == "stop":
        counts = stop_under_load(clients, batches, wants, pid)
        print("graceful stop:", counts)
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
