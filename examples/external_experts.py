#!/usr/bin/env python3
"""A frontend that runs its rank's routed experts itself (epd with experts.kind external): one
thread per rank, each with ONE connection to its rank that serves the rank's experts (SwiGLU
experts in PyTorch, y = down(silu(gate(x)) * up(x)), with the weights of the same safetensors
checkpoint epd's ffn experts load) and submits its own batches, as one frontend process per GPU
does. Every answer is checked against a second daemon that runs experts.kind=ffn on the same
weights: per token, ||y - y_ffn|| / ||y_ffn|| <= 1e-2 (BF16 weights) or 3e-2 (FP8 block weights),
the tolerances of DESIGN.md section 9. The hand-over latencies the workers see are printed
(EXPERTS written -> read by the worker, p50).

    examples/external_experts.py --sockets /tmp/x/epd-%r.sock --ffn-sockets /tmp/f/epd-%r.sock \
        --ranks 2 --weights /models/tiny [--layers 1,2,3] [--batches 12] [--tokens 32]
    examples/external_experts.py ... --device cuda   (the experts on this process's GPU)

The external daemon runs experts.kind=external (any experts.external_input, packed or masked),
the ffn daemon experts.kind=ffn with experts.weights = --weights, both with the same model.*
settings and ranks. Without torch it prints SKIP and exits 77. Exit 0 when every answer is
within the tolerance, 1 otherwise."""
import argparse
import json
import mmap
import os
import queue
import statistics
import struct
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.isdir(os.path.join(HERE, "..", "python", "epd")):
    sys.path.insert(0, os.path.join(HERE, "..", "python"))  # a checkout: no install needed

try:
    import torch
except ImportError:
    print("SKIP: torch is not installed (this example runs its experts in PyTorch)")
    sys.exit(77)
import numpy as np  # noqa: E402

import epd  # noqa: E402

# ---- the checkpoint (the layout gpu/safetensors.c reads: one file, or shards with an index) ----


class Checkpoint:
    """Tensors by name from model.safetensors or a sharded directory, mapped, read on demand."""

    def __init__(self, path):
        self.files = {}
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.exists(index):
                with open(index) as f:
                    shards = json.load(f)["weight_map"]
                self.where = {name: os.path.join(path, shard) for name, shard in shards.items()}
            else:
                one = os.path.join(path, "model.safetensors")
                self.where = {n: one for n in self._header(one)}
        else:
            self.where = {n: path for n in self._header(path)}

    def _header(self, path):
        if path not in self.files:
            with open(path, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(n))
                header.pop("__metadata__", None)
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self.files[path] = (header, 8 + n, data)
        return self.files[path][0]

    def has(self, name):
        return name in self.where

    def get(self, name):
        """The tensor as float32 (BF16 widened exactly, F8_E4M3 decoded)."""
        path = self.where[name]
        header, base, data = self.files[path] if path in self.files else (None, 0, None)
        if header is None:
            self._header(path)
            header, base, data = self.files[path]
        t = header[name]
        begin, end = t["data_offsets"]
        raw = np.frombuffer(data, dtype=np.uint8, count=end - begin, offset=base + begin)
        if t["dtype"] == "BF16":
            a = (raw.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
        elif t["dtype"] == "F8_E4M3":
            a = epd.experts.E4M3[raw]
        elif t["dtype"] == "F32":
            a = raw.view(np.float32)
        else:
            raise ValueError("%s: dtype %s" % (name, t["dtype"]))
        return a.reshape(t["shape"]), t["dtype"]


def dequant_block(q, scale_inv):
    """w = q * scale_inv of its 128 x 128 block (DeepSeek-V3's FP8 block weights)."""
    rows, cols = q.shape
    s = np.repeat(np.repeat(scale_inv, 128, axis=0), 128, axis=1)[:rows, :cols]
    return (q * s).astype(np.float32)


def fp8_group128(h):
    """h (fp32 [rows, I]) quantized to e4m3 with one scale per 128 columns and dequantized, as
    the ffn kind quantizes the intermediate for an FP8 down projection (DESIGN.md section 3:
    amax floor 1e-4, q = e4m3(h * (448 / amax)) to nearest even, s = amax * (1 / 448))."""
    rows, cols = h.shape
    g = h.reshape(rows, cols // 128, 128)
    amax = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)
    v = (g * (448.0 / amax)).clamp(-448.0, 448.0)
    exp = torch.floor(torch.log2(v.abs().clamp_min(2.0 ** -6)))
    quantum = torch.pow(2.0, exp - 3)
    q = torch.round(v / quantum) * quantum  # round() is half to even
    return (q * (amax * (1.0 / 448.0))).reshape(rows, cols)


class Experts:
    """One rank's SwiGLU experts of every layer the checkpoint has, as torch fp32 weights on
    `device`; fp8 tells whether the checkpoint's expert weights are F8_E4M3 blocks."""

    def __init__(self, ckpt, layers, first, count, device):
        self.w, self.device, self.fp8 = {}, device, False
        for layer in layers:
            for e in range(first, first + count):
                mats = []
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    name = "model.layers.%d.mlp.experts.%d.%s.weight" % (layer, e, proj)
                    a, dtype = ckpt.get(name)
                    if dtype == "F8_E4M3":
                        self.fp8 = True
                        a = dequant_block(a, ckpt.get(name + "_scale_inv")[0])
                    mats.append(torch.from_numpy(np.ascontiguousarray(a)).to(device))
                self.w[(layer, e)] = mats

    def run(self, layer, e, x):
        """y (bf16) = down(silu(gate(x)) * up(x)) for rows x (fp32, as the input format gives
        them). BF16 weights see x as BF16 and round the intermediate to BF16, as the ffn kind
        does (DESIGN.md section 9); FP8 weights see the FP8 values and quantize the intermediate
        group128 for the FP8 down projection."""
        g, u, d = self.w[(layer, e)]
        if not self.fp8:
            x = x.to(torch.bfloat16).float()
        h = torch.nn.functional.silu(x @ g.T) * (x @ u.T)
        h = fp8_group128(h) if self.fp8 else h.to(torch.bfloat16).float()
        return (h @ d.T).to(torch.bfloat16)


# ---- the frontend threads ----


class Frontend(threading.Thread):
    """Rank `rank`'s frontend: one connection that serves the rank's experts and submits."""

    def __init__(self, rank, path, ckpt, layers, world, num_experts, device):
        super().__init__(daemon=True)
        self.rank, self.device = rank, device
        n_local = num_experts // world
        self.experts = Experts(ckpt, layers, rank * n_local, n_local, device)
        self.tasks, self.out = queue.Queue(), queue.Queue()
        self.handoff_us, self.batches = [], 0
        self.c = epd.Client(path, timeout=120)
        self.reply = self.c.serve_experts(self.serve)
        self.stopping = False
        self.start()

    def serve(self, batch):
        """One EXPERTS: every local expert's rows through its SwiGLU, into y."""
        if batch.sent_ns:
            self.handoff_us.append((batch.seen_ns - batch.sent_ns) / 1e3)
        for e, x, scales, y in batch.experts():
            xf = torch.from_numpy(np.ascontiguousarray(batch.dequantized(x, scales)))
            out = self.experts.run(batch.layer, e, xf.to(self.device)).cpu()
            y[...] = out.view(torch.int16).numpy().view(np.uint16)
        self.batches += 1

    def run(self):
        try:
            while not self.stopping:
                try:
                    task = self.tasks.get_nowait()
                except queue.Empty:
                    self.c.serve(timeout=0.01)
                    continue
                x, ids, w, layer = task
                try:
                    self.out.put(self.c.submit(x, ids, w, layer=layer))
                except epd.EpdError as e:
                    self.out.put(e)
        except epd.ConnectionClosed as e:
            self.out.put(e)

    def stop(self):
        self.stopping = True
        self.join(10)
        self.c.close()


def batch(rng, n, hidden, num_experts, topk):
    x = epd.bf16.from_f32(rng.standard_normal((n, hidden)).astype(np.float32))
    ids = np.stack([rng.permutation(num_experts)[:topk] for _ in range(n)]).astype(np.int64)
    w = rng.random((n, topk)).astype(np.float32)
    return x, ids, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sockets", required=True, help="the external daemon's socket, %%r = rank")
    ap.add_argument("--ffn-sockets", required=True, help="the ffn daemon's socket, %%r = rank")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--weights", required=True, help="the safetensors the ffn daemon loads")
    ap.add_argument("--layers", default=None, help="MoE layers to use, e.g. 1,2,3 (default: all "
                    "the ffn daemon serves)")
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="where the experts run (torch device)")
    args = ap.parse_args()

    paths = [args.sockets.replace("%r", str(r)) for r in range(args.ranks)]
    with epd.Client(paths[0], timeout=30) as c:
        cfg = c.config()
        world = c.health()["world"]
    if cfg["experts.kind"] != "external" or world != args.ranks:
        print("%s: experts.kind = %s on %d ranks; this example wants external on %d"
              % (paths[0], cfg["experts.kind"], world, args.ranks))
        return 1
    hidden, E, K = cfg["model.hidden"], cfg["model.num_experts"], cfg["model.topk"]
    ckpt = Checkpoint(args.weights)
    if args.layers:
        layers = [int(v) for v in args.layers.split(",")]
    else:
        layers = sorted({int(n.split(".")[2]) for n in ckpt.where if ".mlp.experts." in n})
    fronts = [Frontend(r, p, ckpt, layers, world, E, args.device) for r, p in enumerate(paths)]
    ffn = [epd.Client(args.ffn_sockets.replace("%r", str(r)), timeout=120)
           for r in range(args.ranks)]
    tol = 3e-2 if fronts[0].experts.fp8 else 1e-2
    rng = np.random.default_rng(args.seed)
    worst, bad, checked = 0.0, 0, 0
    try:
        for i in range(args.batches):
            work = [(batch(rng, 1 + int(rng.integers(args.tokens)), hidden, E, K),
                     layers[(i + r) % len(layers)]) for r in range(args.ranks)]
            for f, ((x, ids, w), layer) in zip(fronts, work):
                f.tasks.put((x, ids, w, layer))
            refs = [c.submit_async(x, ids, w, layer=layer) for c, ((x, ids, w), layer)
                    in zip(ffn, work)]
            for f, ref in zip(fronts, refs):
                y = f.out.get(timeout=300)
                if isinstance(y, Exception):
                    print("rank %d: %r" % (f.rank, y))
                    return 1
                yr = epd.bf16.to_f32(ref.result(300)).astype(np.float64)
                yt = epd.bf16.to_f32(y).astype(np.float64)
                err = np.linalg.norm(yt - yr, axis=1) / np.maximum(np.linalg.norm(yr, axis=1),
                                                                  1e-30)
                worst = max(worst, float(err.max()))
                bad += int((err > tol).sum())
                checked += len(err)
    finally:
        for f in fronts:
            f.stop()
        for c in ffn:
            c.close()
    served = sum(f.batches for f in fronts)
    lat = [v for f in fronts for v in f.handoff_us]
    print("%d tokens on %d ranks, layers %s, %s weights, input %s: %d EXPERTS served; worst "
          "per-token relative L2 error against experts.kind=ffn %.2e (tolerance %.0e)%s"
          % (checked, args.ranks, ",".join(map(str, layers)),
             "FP8 block" if fronts[0].experts.fp8 else "BF16", cfg["experts.external_input"],
             served, worst, tol, "; EXPERTS written -> worker read it: p50 %.1f us"
             % statistics.median(lat) if lat else ""))
    if bad or served == 0:
        print("FAIL: %d tokens over the tolerance" % bad if bad else "FAIL: no EXPERTS served")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
