#!/usr/bin/env python3
"""Writes the seed corpus of tests/fuzz/fuzz_frame.c into tests/fuzz/corpus/: valid frames of
every type and broken ones (header, meta and tensor faults). Each file is one byte (the chunk size
the harness feeds the decoder with; 0 = all at once) followed by the stream. Re-run after a
protocol change; the files are committed."""
import json, os, struct, sys

HDR = struct.Struct("<4sHHIIQ")
out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def frame(ftype, meta, payload=b"", magic=b"EPD1", version=1, reserved=0, meta_len=None):
    m = meta if isinstance(meta, bytes) else json.dumps(meta, separators=(",", ":")).encode()
    return HDR.pack(magic, version, ftype, len(m) if meta_len is None else meta_len, reserved,
                    len(payload)) + m + payload


def submit(n=2, h=4, k=2, ids=None, weights=None, fid=1, tweak=None):
    ids = ids if ids is not None else [(t + j * 3) % 8 for t in range(n) for j in range(k)]
    weights = weights if weights is not None else [1.0 / k] * (n * k)
    pi = struct.pack("<%di" % (n * k), *ids)
    pw = struct.pack("<%df" % (n * k), *weights)
    px = struct.pack("<%dH" % (n * h), *[(0x3f80 + i) & 0xffff for i in range(n * h)])
    t = {
        "topk_ids": {"dtype": "i32", "shape": [n, k], "data_offsets": [0, len(pi)]},
        "topk_weights": {"dtype": "f32", "shape": [n, k], "data_offsets": [len(pi), len(pi) + len(pw)]},
        "x": {"dtype": "bf16", "shape": [n, h],
              "data_offsets": [len(pi) + len(pw), len(pi) + len(pw) + len(px)]},
    }
    meta = {"id": fid, "tensors": t}
    if tweak:
        tweak(meta)
    return frame(1, meta, pi + pw + px)


def result(n=2, h=4, fid=1):
    y = struct.pack("<%dH" % (n * h), *range(n * h))
    return frame(2, {"id": fid, "tensors": {"y": {"dtype": "bf16", "shape": [n, h],
                                                  "data_offsets": [0, len(y)]}}, "step": 3}, y)


def setk(path, value):
    def f(meta):
        d = meta
        for p in path[:-1]:
            d = d[p]
        if value is None:
            del d[path[-1]]
        else:
            d[path[-1]] = value
    return f


seeds = {
    "submit_n2": submit(),
    "submit_n1_minus1": submit(n=1, ids=[-1, 3]),
    "submit_n16": submit(n=16, ids=[(t + j * 5) % 8 for t in range(16) for j in range(2)]),
    "submit_h8_k4": submit(n=3, h=8, k=4, ids=[(t * 4 + j) % 300 for t in range(3) for j in range(4)]),
    "submit_big_id": submit(fid=18446744073709551615),
    "result": result(),
    "error_with_id": frame(3, {"id": 7, "code": "invalid_topk", "message": "token 0: dup"}),
    "error_null_id": frame(3, {"id": None, "code": "bad_json", "message": "meta is not JSON"}),
    "control_health": frame(4, {"op": "health"}),
    "reply_metrics": frame(5, {}, b"# TYPE epd_steps_total counter\nepd_steps_total 1\n"),
    "two_frames": frame(4, {"op": "stats"}) + submit(),
    "bad_magic": frame(4, {"op": "health"}, magic=b"GET "),
    "bad_version": frame(4, {"op": "health"}, version=2),
    "bad_type": frame(6, {"op": "health"}),
    "bad_reserved": frame(4, {"op": "health"}, reserved=1),
    "meta_too_long": HDR.pack(b"EPD1", 1, 4, 65537, 0, 0) + b"{",
    "payload_too_long": HDR.pack(b"EPD1", 1, 1, 2, 0, 1 << 40) + b"{}",
    "truncated_json": frame(4, b'{"op":"heal'),
    "json_array": frame(4, b"[1,2]"),
    "bad_utf8": frame(4, b'{"op":"\xff"}'),
    "truncated_stream": submit()[:-5],
    "missing_id": submit(tweak=setk(["id"], None)),
    "negative_id": submit(tweak=setk(["id"], -1)),
    "missing_tensors": submit(tweak=setk(["tensors"], None)),
    "unknown_dtype": submit(tweak=setk(["tensors", "x", "dtype"], "q7")),
    "unsupported_dtype": submit(tweak=setk(["tensors", "x", "dtype"], "f16")),
    "overlap": submit(tweak=setk(["tensors", "x", "data_offsets"], [16, 32])),
    "past_end": submit(tweak=setk(["tensors", "x", "data_offsets"], [40, 56])),
    "begin_gt_end": submit(tweak=setk(["tensors", "x", "data_offsets"], [48, 32])),
    "ndim3": submit(tweak=setk(["tensors", "x", "shape"], [2, 2, 2])),
    "n0": frame(1, {"id": 1, "tensors": {
        "x": {"dtype": "bf16", "shape": [0, 4], "data_offsets": [0, 0]},
        "topk_ids": {"dtype": "i32", "shape": [0, 2], "data_offsets": [0, 0]},
        "topk_weights": {"dtype": "f32", "shape": [0, 2], "data_offsets": [0, 0]}}}),
    "id_out_of_range": submit(ids=[0, 9, 1, 2]),
    "dup_ids": submit(ids=[3, 3, 1, 2]),
    "nan_weight": submit(weights=[0.5, float("nan"), 0.5, 0.5]),
}

os.makedirs(out_dir, exist_ok=True)
for name, data in sorted(seeds.items()):
    for chunk in (0, 1, 7):
        with open(os.path.join(out_dir, "%s-c%d" % (name, chunk)), "wb") as f:
            f.write(bytes([chunk]) + data)
print("wrote %d files to %s" % (len(seeds) * 3, out_dir), file=sys.stderr)
