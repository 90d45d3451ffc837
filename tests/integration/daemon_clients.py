#!/usr/bin/env python3
"""Misbehaving clients for the daemon's integration tests (H=256, K=4 by default):
    daemon_clients.py disconnect SOCKET N         N pipelined SUBMITs, then close without reading
    daemon_clients.py slow-reader SOCKET N LIMIT  keep sending without reading until the daemon
        stops reading (the send blocks), check that it stays stopped, then read everything:
        every request must get its RESULT
    daemon_clients.py pipeline SOCKET N C         N one-token SUBMITs, each followed by C health
        CONTROLs, all in one write: every SUBMIT gets its RESULT once, every CONTROL its REPLY
    daemon_clients.py refused-as UID SOCKET       as UID, connect and expect to be closed unanswered
    daemon_clients.py health-as UID SOCKET        as UID, connect and expect a health REPLY
"""
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import daemon_wire as w  # noqa: E402

H, K = 256, 4


def disconnect(path, n):
    s = w.connect(path)
    s.sendall(b"".join(same_requests(n, 64)))
    s.close()
    print("disconnect: sent %d requests and closed without reading" % n)
    return 0


def bytes_in(path):
    return w.stat(path, "server.bytes_in")


def same_requests(n, tokens):
    """n SUBMITs with ids 0..n-1 and one shared payload (built once: python is slow at it)."""
    template = w.submit(10**9, tokens, H, K)
    return [template.replace(b'"id": 1000000000', b'"id": %10d' % i, 1) for i in range(n)]


def slow_reader(path, n, limit):
    frames = same_requests(n, 64)
    s = w.connect(path)
    # First a few requests, and wait until their results are queued (or the daemon, already over
    # the limit, stopped reading before it took all of them): unread, they put this connection's
    # output over the limit whatever the relative speed of client and steps.
    first_batch = 10
    s.sendall(b"".join(frames[:first_batch]))
    deadline = time.time() + 30
    last, last_change = -1, time.time()
    while True:
        done = w.stat(path, "server.results_sent")
        if done != last:
            last, last_change = done, time.time()
        if done >= first_batch or (done > 0 and time.time() - last_change > 1.0):
            break
        if time.time() > deadline:
            print("FAIL: none of the first %d requests was answered" % first_batch)
            return 1
        time.sleep(0.05)
    s.settimeout(2.0)
    sent = first_batch
    partial = b""
    try:
        while sent < n:
            data = partial or frames[sent]
            k = s.send(data)
            partial = data[k:]
            if not partial:
                sent += 1
    except socket.timeout:
        pass
    if sent == n:
        print("FAIL: all %d requests were taken without the client reading" % n)
        return 1
    # The daemon must have stopped reading this client: bytes_in stays where it is.
    first = bytes_in(path)
    time.sleep(1.0)
    second = bytes_in(path)
    # Each stats query counts its own CONTROL frame, nothing else may arrive.
    if second - first != len(w.frame(w.CONTROL, {"op": "stats"})):
        print("FAIL: the daemon kept reading (bytes_in %d -> %d)" % (first, second))
        return 1
    print("slow reader: the daemon paused after %d of %d requests, %d bytes in; output limit %d"
          % (sent, n, first, limit))
    # Catch up: read while sending the rest; every request gets its RESULT.
    s.setblocking(True)
    results = 0
    import threading

    def sender():
        s.sendall(partial + b"".join(frames[sent + 1:] if partial else frames[sent:]))

    t = threading.Thread(target=sender)
    t.start()
    s.settimeout(30.0)
    while results < n:
        ftype, meta, payload = w.read_frame(s)
        if ftype != w.RESULT or len(payload) != 64 * H * 2:
            print("FAIL: expected RESULT, got type %d %s" % (ftype, meta))
            return 1
        results += 1
    t.join()
    s.close()
    print("slow reader: all %d requests answered once it read again" % results)
    return 0


def pipeline(path, n, c):
    import threading

    template = w.submit(10**9, 1, H, K)
    # Small frames: many of them arrive with each read of the socket.
    healths = w.frame(w.CONTROL, {"op": "health"}) * c
    parts = []
    for i in range(n):
        parts.append(template.replace(b'"id": 1000000000', b'"id": %10d' % i, 1))
        parts.append(healths)
    burst = b"".join(parts)
    controls = n * c
    s = w.connect(path, timeout=30.0)
    # Sent from a thread: the answers are read meanwhile, so neither side waits on the other.
    t = threading.Thread(target=s.sendall, args=(burst,))
    t.start()
    seen = set()
    replies = 0
    while len(seen) < n or replies < controls:
        ftype, meta, payload = w.read_frame(s)
        if ftype == w.RESULT:
            if meta["id"] in seen or len(payload) != H * 2:
                print("FAIL: RESULT %s repeated or of %d bytes" % (meta["id"], len(payload)))
                return 1
            seen.add(meta["id"])
        elif ftype == w.REPLY and meta.get("status") == "ok":
            replies += 1
        else:
            print("FAIL: expected RESULT or REPLY, got type %d %s" % (ftype, meta))
            return 1
    t.join()
    s.close()
    if seen != set(range(n)):
        print("FAIL: answered ids differ from those sent")
        return 1
    print("pipeline: %d frames in one write (%d bytes): %d RESULTs, %d REPLYs"
          % (n + controls, len(burst), len(seen), replies))
    return 0


def as_uid(uid):
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def refused_as(uid, path):
    as_uid(uid)
    s = w.connect(path)
    try:
        s.sendall(w.frame(w.CONTROL, {"op": "health"}))
    except (BrokenPipeError, ConnectionResetError):
        pass
    if not w.is_closed(s):
        print("FAIL: uid %d was served" % uid)
        return 1
    print("uid %d: closed without an answer" % uid)
    return 0


def health_as(uid, path):
    as_uid(uid)
    meta, _ = w.control(path, "health")
    print("uid %d: health %s" % (uid, meta["status"]))
    return 0 if meta["status"] == "ok" else 1


def main(argv):
    cmd = argv[1]
    if cmd == "disconnect":
        return disconnect(argv[2], int(argv[3]))
    if cmd == "slow-reader":
        return slow_reader(argv[2], int(argv[3]), int(argv[4]))
    if cmd == "pipeline":
        return pipeline(argv[2], int(argv[3]), int(argv[4]))
    if cmd == "refused-as":
        return refused_as(int(argv[2]), argv[3])
    if cmd == "health-as":
        return health_as(int(argv[2]), argv[3])
    sys.stderr.write(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
