#!/usr/bin/env python3
"""Lines up the client's and the daemon's per-request times of tests/gpu/e2e_gpu.sh's latency runs
(E2E_TIMES=1): the daemon's EPD_TRACE_TIMES file (id, then CLOCK_MONOTONIC ns: recv, read,
queued, taken, step begins, step ends, done, handed, delivered, written) and one EPD_BENCH_TIMES
file per epctl bench run (id, send called, send returned, the RESULT's recv returned, the reply
returned). Both processes read the same clock, so a request's client wait splits into the
socket's legs and the daemon's. Ids repeat from one bench run to the next: a run's daemon lines
are those inside its time window. Prints p50s in us, one block per run."""
import glob
import os
import sys


def load(path):
    with open(path) as f:
        return [list(map(int, line.split())) for line in f if line.strip()]


def p50(values):
    values = sorted(values)
    return values[len(values) // 2] / 1e3 if values else float("nan")


def main(folder):
    daemon = load(os.path.join(folder, "daemon.txt"))
    legs = [
        ("send called -> returned (before the clock starts)", lambda c, d: c[2] - c[1]),
        ("send returned -> daemon's recv(2) returned", lambda c, d: d[1] - c[2]),
        ("daemon: recv -> frame read (decode)", lambda c, d: d[2] - d[1]),
        ("daemon: read -> queued (validation, ingest)", lambda c, d: d[3] - d[2]),
        ("daemon: queued -> step begins", lambda c, d: d[5] - d[3]),
        ("daemon: step", lambda c, d: d[6] - d[5]),
        ("daemon: step end -> loop has it", lambda c, d: d[9] - d[6]),
        ("daemon: loop has it -> RESULT written", lambda c, d: d[10] - d[9]),
        ("RESULT written -> client's recv(2) returned", lambda c, d: c[3] - d[10]),
        ("client's recv -> reply returned (decode)", lambda c, d: c[4] - c[3]),
        ("epctl's latency (send returned -> reply)", lambda c, d: c[4] - c[2]),
    ]
    for path in sorted(glob.glob(os.path.join(folder, "client-*.txt"))):
        client = load(path)
        if not client:
            continue
        lo, hi = client[0][1], client[-1][4]
        by_id = {d[0]: d for d in daemon if lo <= d[2] <= hi}
        pairs = [(c, by_id[c[0]]) for c in client if c[0] in by_id]
        print(f"{os.path.basename(path)[7:-4]}: {len(pairs)} of {len(client)} requests lined up (p50 us)")
        for name, f in legs:
            print(f"  {name:<52} {p50([f(c, d) for c, d in pairs]):8.1f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
