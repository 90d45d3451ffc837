#!/usr/bin/env python3
"""Writes a small DeepSeek-V3-shaped MoE checkpoint for epd's ffn experts tests (numpy only).

    scripts/make-test-model.py OUT [--format bf16|fp8] [--single] [--seed N]
                               [--hidden 256] [--intermediate 128] [--experts 16] [--layers 3]
                               [--dense 1]

OUT is a directory: model.safetensors.index.json and two shards (the Hugging Face layout), or
with --single one file OUT/model.safetensors. The first --dense layers are dense
(mlp.gate_proj/up_proj/down_proj, no experts, as DeepSeek-V3's first three); the next --layers
are MoE layers with the router
(mlp.gate.weight), a shared expert and E routed experts
model.layers.{L}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight ([out, in]); fp8 writes
F8_E4M3 weights with F32 weight_scale_inv [ceil(out/128), ceil(in/128)] as DeepSeek-V3 does
(w = q * scale_inv of its 128 x 128 block). The same seed gives the same bytes.
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

BLOCK = 128


def bf16_bits(a):
    """float32 array -> uint16 BF16 codes, round to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def e4m3_table():
    """The values of the e4m3fn codes 0..126 (the non-negative finite ones), ascending."""
    vals = []
    for c in range(127):
        e, m = (c >> 3) & 0xF, c & 0x7
        vals.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7))
    return np.array(vals, dtype=np.float64)


E4M3 = e4m3_table()


def e4m3_codes(a):
    """float array -> e4m3fn codes: clamp to +-448, round to nearest even."""
    a = np.asarray(a, dtype=np.float64)
    mag = np.minimum(np.abs(a), 448.0)
    hi = np.clip(np.searchsorted(E4M3, mag), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    d_lo, d_hi = mag - E4M3[lo], E4M3[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    return code | np.where(np.signbit(a), 0x80, 0).astype(np.uint8)


def fp8_block(w):
    """[out, in] float -> (e4m3 codes, float32 scale_inv [ceil(out/128), ceil(in/128)])."""
    rows, cols = w.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    scale = np.empty((br, bc), dtype=np.float32)
    q = np.empty(w.shape, dtype=np.uint8)
    for i in range(br):
        for j in range(bc):
            rows_, cols_ = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            blk = w[rows_, cols_]
            s = np.float32(max(float(np.abs(blk).max()), 1e-12) / 448.0)
            scale[i, j] = s
            q[rows_, cols_] = e4m3_codes(blk / np.float64(s))
    return q, scale


def write_safetensors(path, tensors):
    """tensors: list of (name, dtype string, shape, bytes)."""
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [off, off + len(data)]}
        off += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, _, data in tensors:
            f.write(data)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--format", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--single", action="store_true", help="one model.safetensors, no index")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--layers", type=int, default=3, help="MoE layers (after the dense ones)")
    ap.add_argument("--dense", type=int, default=1, help="dense layers first")
    args = ap.parse_args()
    H, I, E = args.hidden, args.intermediate, args.experts
    if H % BLOCK or I % BLOCK:
        sys.exit("make-test-model: hidden and intermediate must be multiples of 128")
    rng = np.random.default_rng(args.seed)
    os.makedirs(args.out, exist_ok=True)

    def weight(name, rows, cols):
        w = rng.uniform(-1.0, 1.0, size=(rows, cols)) * np.sqrt(3.0 / cols)
        if args.format == "fp8":
            q, s = fp8_block(w)
            return [(name, "F8_E4M3", (rows, cols), q.tobytes()),
                    (name + "_scale_inv", "F32", s.shape, s.astype("<f4").tobytes())]
        return [(name, "BF16", (rows, cols), bf16_bits(w).astype("<u2").tobytes())]

    shards = [[], []]
    for L in range(args.dense):
        for p, (rows, cols) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            shards[0] += weight(f"model.layers.{L}.mlp.{p}.weight", rows, cols)
    for i in range(args.layers):
        L = args.dense + i
        shard = shards[0 if 2 * i < args.layers else 1]
        router = rng.standard_normal((E, H)).astype(np.float32)
        shard.append((f"model.layers.{L}.mlp.gate.weight", "BF16", (E, H),
                      bf16_bits(router).astype("<u2").tobytes()))
        for p, (rows, cols) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            shard += weight(f"model.layers.{L}.mlp.shared_experts.{p}.weight", rows, cols)
        for e in range(E):
            for p, (rows, cols) in (("gate_proj", (I, H)), ("up_proj", (I, H)),
                                    ("down_proj", (H, I))):
                shard += weight(f"model.layers.{L}.mlp.experts.{e}.{p}.weight", rows, cols)

    config = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": H,
              "moe_intermediate_size": I, "n_routed_experts": E, "num_experts_per_tok": 8,
              "first_k_dense_replace": args.dense,
              "num_hidden_layers": args.dense + args.layers}
    if args.format == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                         "weight_block_size": [BLOCK, BLOCK]}
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    if args.single:
        write_safetensors(os.path.join(args.out, "model.safetensors"), shards[0] + shards[1])
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        write_safetensors(os.path.join(args.out, name), shard)
        weight_map.update({t[0]: name for t in shard})
    total = sum(len(t[3]) for s in shards for t in s)
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)


if __name__ == "__main__":
    main()
