#!/usr/bin/env python3
"""A small MoE layer in PyTorch whose routed experts run in epd: the router (a linear gate,
softmax, top-k, renormalized weights) runs in PyTorch on the GPU, then one epd call does the
dispatch, the experts and the combine, reading x, topk_ids (int64, as torch.topk returns them)
and topk_weights from device regions and writing y into one (no copy through the socket).
Every call's y is checked bit for bit against the same layer computed in pure PyTorch
(examples/moe_reference.py: the daemon's identity or scale experts, DESIGN.md section 2's order),
and the epd call is timed against the payload path (the same tensors through host copies and the
socket) and against the layer's own GPU work.

    examples/torch_moe.py [--socket /run/epd/epd-0.sock] [--tokens 128] [--iters 50]
    examples/torch_moe.py --group --socket-pattern /tmp/e/epd-%r.sock   (ranks sharing a GPU)

The daemon must run experts.kind identity or scale (any dispatch.dtype) on CUDA devices this
process can reach. Exit 0 when every checked y matched, 1 otherwise."""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.isdir(os.path.join(HERE, "..", "python", "epd")):
    sys.path.insert(0, os.path.join(HERE, "..", "python"))  # a checkout: no install needed

import torch  # noqa: E402

import epd  # noqa: E402
from moe_reference import TorchOps, moe_reference  # noqa: E402


class EpdMoE(torch.nn.Module):
    """The MoE layer: routing in PyTorch, routed experts and combine in epd. group: an epd.Group
    (the batch is split over its ranks); y goes into a preallocated bf16 buffer, registered with
    each rank once."""

    def __init__(self, group, hidden, num_experts, topk, max_tokens, device):
        super().__init__()
        self.group, self.topk = group, topk
        self.gate = torch.nn.Linear(hidden, num_experts, bias=False, device=device,
                                    dtype=torch.float32)
        self.out = torch.empty(max_tokens, hidden, dtype=torch.bfloat16, device=device)

    def route(self, x):
        scores = torch.softmax(self.gate(x.float()), dim=-1)
        w, ids = torch.topk(scores, self.topk, dim=-1)
        return ids.contiguous(), (w / w.sum(dim=-1, keepdim=True)).contiguous()

    def experts(self, x, ids, w, layer=0):
        """The epd call alone: y = sum_k w_k expert_{ids_k}(x), bf16 [N, H] on x's device."""
        return self.group.submit(x, ids, w, layer=layer, out=self.out[:x.shape[0]])

    def forward(self, x, layer=0):
        ids, w = self.route(x)
        return self.experts(x, ids, w, layer)


def payload_call(group, x, ids, w, layer):
    """The same call without regions: host copies, the socket both ways, y back on the GPU."""
    y = group.submit(x.cpu(), ids.cpu(), w.cpu(), layer=layer)
    return y.to(x.device)


def gpu_ms(fn, reps):
    """Mean GPU time of fn() over reps runs, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def wall_ms(fn, reps):
    """Per-call wall times (ms) of fn(), the GPU idle before each."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", help="the rank socket this process talks to (default: "
                    "--socket-pattern with the rank of this process's GPU)")
    ap.add_argument("--socket-pattern", default="/run/epd/epd-%r.sock",
                    help="rank socket path with %%r for the rank (default /run/epd/epd-%%r.sock)")
    ap.add_argument("--group", action="store_true",
                    help="split each batch over every rank of the daemon (a router's view; every "
                    "rank must run on this process's GPU, as when ranks share one GPU)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per call (default 128)")
    ap.add_argument("--iters", type=int, default=50, help="timed calls (default 50)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4, help="distinct layer ids cycled through")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-payload", action="store_true", help="skip the payload-path baseline")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("torch_moe: torch sees no CUDA device")
        return 2
    device = torch.device(args.device)
    torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    if args.group:
        with epd.Client(args.socket_pattern.replace("%r", "0"), timeout=30) as c:
            ranks = c.health()["world"]
        paths = [args.socket_pattern.replace("%r", str(r)) for r in range(ranks)]
    else:
        paths = [args.socket or args.socket_pattern.replace("%r", str(device.index or 0))]
    group = epd.Group(paths, timeout=60)
    cfg = group[0].config()
    world = group[0].health()["world"]
    hidden, num_experts, topk = cfg["model.hidden"], cfg["model.num_experts"], cfg["model.topk"]
    n = min(args.tokens, cfg["dispatch.max_tokens_per_request"] * len(group))
    print("torch_moe: %d ranks (talking to %d), H %d, E %d, top-%d, dispatch %s, experts %s; "
          "torch %s on %s" % (world, len(group), hidden, num_experts, topk,
                              cfg["dispatch.dtype"], cfg["experts.kind"], torch.__version__,
                              torch.cuda.get_device_name(device)))

    layer = EpdMoE(group, hidden, num_experts, topk, n, device)
    xs = [torch.randn(n, hidden, device=device).to(torch.bfloat16)
          for _ in range(args.layers)]
    routes = [layer.route(x) for x in xs]
    xp = TorchOps()

    # correctness: every layer's y against the pure-PyTorch layer, bit for bit
    checked, bad = 0, 0
    for i in range(args.warmup + args.layers):
        x = xs[i % args.layers]
        ids, w = routes[i % args.layers]
        y = layer.experts(x, ids, w, layer=i % args.layers)
        ref = moe_reference(xp, x, ids, w, cfg, world)
        same = torch.equal(y.view(torch.int16), ref.view(torch.int16))
        if not same:
            diff = (y.view(torch.int16) != ref.view(torch.int16)).nonzero()
            print("MISMATCH layer %d: %d elements differ, first at %s: epd %r, reference %r"
                  % (i, diff.shape[0], diff[0].tolist(), y[tuple(diff[0])].item(),
                     ref[tuple(diff[0])].item()))
            bad += 1
        checked += 1
    if not args.no_payload:
        y_payload = payload_call(group, xs[0], *routes[0], 0)
        y_region = layer.experts(xs[0], *routes[0], 0)
        if not torch.equal(y_payload.view(torch.int16), y_region.view(torch.int16)):
            print("MISMATCH: the payload path and device regions disagree")
            bad += 1
    print("check: %d calls, y %s the pure-PyTorch layer bit for bit%s"
          % (checked, "equal to" if bad == 0 else "NOT equal to",
             "" if args.no_payload else "; the payload path gives the same bytes"))

    # timing: the epd call alone, the payload path, the layer's GPU work
    k = [0]

    def region_once():
        i = k[0] % args.layers
        k[0] += 1
        layer.experts(xs[i], *routes[i], i)

    def payload_once():
        i = k[0] % args.layers
        k[0] += 1
        payload_call(group, xs[i], *routes[i], i)

    region = wall_ms(region_once, args.iters)
    router = gpu_ms(lambda: layer.route(xs[0]), args.iters)
    reference = gpu_ms(lambda: moe_reference(xp, xs[0], *routes[0], cfg, world),
                       max(3, args.iters // 10))
    mib = n * hidden * 2 / (1 << 20)
    line = ("per call, %d tokens (%.2f MiB of x): epd with device regions p50 %.3f ms, mean "
            "%.3f ms, min %.3f ms" % (n, mib, statistics.median(region),
                                      statistics.fmean(region), min(region)))
    if not args.no_payload:
        payload = wall_ms(payload_once, args.iters)
        line += "; payload path p50 %.3f ms (%.2fx the region call)" % (
            statistics.median(payload), statistics.median(payload) / statistics.median(region))
    print(line)
    print("layer GPU time: router %.3f ms; the same experts+combine in pure PyTorch (the "
          "reference, unfused) %.3f ms; epd call / (router + epd call) = %.0f%%"
          % (router, reference, 100 * statistics.median(region) /
             (router + statistics.median(region))))
    group.close()
    print("PASS" if bad == 0 else "FAIL")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
