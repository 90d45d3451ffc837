#!/usr/bin/env python3
"""Issue 20 item 6: memory freed after a burst goes back to the system. A burst of big frames on
several connections at once (whole SUBMITs answered, and partial frames abandoned half-way),
then the clients leave; the rank's RSS must come back near where it was before the burst.
    daemon_memory_burst.py SOCKET HIDDEN TOPK  (prints the RSS figures; exit 1 on failure)"""
import json
import socket
import sys
import threading
import time

import daemon_wire as w


def rss_mb(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS")


def whole_submits(path, hidden, topk, base_id, count, tokens):
    frame = w.submit(0, tokens, hidden, topk)
    with w.connect(path, timeout=60) as s:
        for i in range(count):
            # same payload, new id: patch the meta's id by re-encoding (cheap at this size)
            s.sendall(w.submit(base_id + i, tokens, hidden, topk) if i == 0 else frame_with_id(frame, base_id + i))
        for _ in range(count):
            ftype, meta, _payload = w.read_frame(s)
            if ftype != w.RESULT:
                raise RuntimeError("expected RESULT, got %d %s" % (ftype, meta))


def frame_with_id(frame, new_id):
    meta_len = int.from_bytes(frame[8:12], "little")
    meta = json.loads(frame[24:24 + meta_len])
    meta["id"] = new_id
    m = json.dumps(meta).encode()
    return w.header(w.SUBMIT, len(m), len(frame) - 24 - meta_len) + m + frame[24 + meta_len:]


def abandoned_frame(path, announce, send, sent, leave):
    s = w.connect(path, timeout=60)
    meta = json.dumps({"id": 1, "tensors": {}}).encode()
    s.sendall(w.header(w.SUBMIT, len(meta), announce) + meta)
    chunk = b"\0" * (1 << 20)
    for _ in range(send >> 20):
        s.sendall(chunk)
    sent.release()
    leave.wait(60)
    s.close()


def main():
    path, hidden, topk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    pid = json.loads(json.dumps(w.control(path, "health")[0]))["pid"]
    # warm-up: full steps touch every page of the step buffers (allocated at start, kept)
    whole_submits(path, hidden, topk, 900000, 8, 2048)
    time.sleep(1.0)
    before = rss_mb(pid)
    threads = []
    sent, leave = threading.Semaphore(0), threading.Event()
    for c in range(6):
        threads.append(threading.Thread(target=whole_submits,
                                        args=(path, hidden, topk, 1000 * c, 12, 2048)))
        threads.append(threading.Thread(target=abandoned_frame,
                                        args=(path, 60 << 20, 40 << 20, sent, leave)))
    for t in threads:
        t.start()
    peak = before
    for _ in range(6):
        while not sent.acquire(timeout=0.05):
            peak = max(peak, rss_mb(pid))
    peak = max(peak, rss_mb(pid))
    # a client that stays: connected at the peak, so what it holds sits above the burst's memory
    keeper = w.connect(path, timeout=60)
    keeper.sendall(w.submit(5, 4, hidden, topk))
    if w.read_frame(keeper)[0] != w.RESULT:
        raise RuntimeError("the keeper's request failed")
    leave.set()
    while any(t.is_alive() for t in threads):
        peak = max(peak, rss_mb(pid))
        time.sleep(0.05)
    for t in threads:
        t.join()
    time.sleep(2.0)  # the daemon notices it is idle again
    after = rss_mb(pid)
    keeper.close()
    print("rss MB: before %.1f, peak %.1f, after %.1f" % (before, peak, after))
    if peak < before + 100:
        print("FAIL: the burst did not load the rank (peak %.1f MB)" % peak)
        return 1
    if after > before * 1.2 + 16:
        print("FAIL: after the burst the rank keeps %.1f MB (before: %.1f MB)" % (after, before))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
