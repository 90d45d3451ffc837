#!/usr/bin/env python3
"""The hand-over latency of external experts (issue 24's target): one connection to a 1-rank
CUDA daemon (experts.kind external) serves the rank's experts with device regions (torch) and
submits batches of N tokens (device tensors: x, ids, weights and y in device regions too), STEPS
times. The worker writes its outputs with one device memset (the latency, not the experts, is
measured) and records when it read each EXPERTS against the daemon's sent_ns (the same
CLOCK_MONOTONIC). Prints the p50 and p90 of: EXPERTS written -> worker read it, and the whole
call. The daemon's own side (EXPERTS_DONE sent -> step resumed -> partials queued, i.e. the
combine starts) is in its log at exit ("external experts: p50 over the last N exchanges").

    external_latency.py SOCKET TOKENS STEPS
Exit 0 when every call was answered with a RESULT."""
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import torch  # noqa: E402

import epd  # noqa: E402


def main():
    sock, n, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dev = torch.device("cuda", 0)
    c = epd.Client(sock, timeout=60)
    cfg = c.config()
    H, E, K = cfg["model.hidden"], cfg["model.num_experts"], cfg["model.topk"]
    seen = []

    def worker(batch):
        if batch.sent_ns:
            seen.append((batch.seen_ns - batch.sent_ns) / 1e3)
        batch.y.zero_()

    rows = n * min(K, E)
    in_bytes, out_bytes = epd.experts.region_bytes(dict(cfg, **{
        "dispatch.max_tokens_per_step": n}), 1)
    reply = c.serve_experts(worker, input_bytes=in_bytes, output_bytes=out_bytes, device=dev)
    print("serve_experts: %s" % reply)
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(n, H, device=dev, generator=g).to(torch.bfloat16)
    ids = torch.rand(n, E, device=dev, generator=g).argsort(dim=1)[:, :K].contiguous()
    w = torch.rand(n, K, device=dev, generator=g)
    y = torch.empty(n, H, dtype=torch.bfloat16, device=dev)
    calls = []
    for i in range(steps):
        t0 = time.perf_counter()
        c.submit(x, ids, w, out=y)
        calls.append((time.perf_counter() - t0) * 1e6)
    warm = seen[steps // 10:] or seen
    calls = calls[steps // 10:] or calls
    q = statistics.quantiles
    print("tokens %d, rows %d per step, %d steps: EXPERTS written -> worker read it p50 %.1f us "
          "p90 %.1f us; whole call p50 %.1f us"
          % (n, rows, steps, statistics.median(warm), q(warm, n=10)[-1], statistics.median(calls)))
    c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
