#!/usr/bin/env python3
"""examples/moe_reference.py (the reference examples/torch_moe.py checks epd against, on the GPU
in PyTorch) run in numpy equals the C reference, epd_moe_reference, bit for bit: every wire dtype,
scale kind and format, both combine dtypes, identity and scale experts, 1, 2 and 4 ranks, on rows
that reach FP8's subnormals, its saturation, the amax floor, -0, empty slots and all-empty tokens.
Environment: EPDPY_REF (build/tests/py_ref), EPDPY_TMP."""
import itertools
import os
import subprocess
import sys
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import epd  # noqa: E402
from moe_reference import NumpyOps, moe_reference  # noqa: E402

PY_REF = os.environ.get("EPDPY_REF", "build/tests/py_ref")
TMP = os.environ.get("EPDPY_TMP", "/tmp")
H, E, K, N = 256, 16, 4, 24


def hard_batch(seed):
    rng = np.random.default_rng(seed)
    xf = rng.standard_normal((N, H)).astype(np.float32)
    xf[1] *= np.float32(1e-6)          # under the amax floor
    xf[2] = 0.0
    xf[2, ::3] = -0.0
    xf[3] *= np.float32(3e4)           # large
    xf[4, 0] = 1e4                     # one outlier: the rest of its group goes subnormal
    xf[5, 7] = -448.5
    ids = np.stack([rng.permutation(E)[:K] for _ in range(N)]).astype(np.int32)
    ids[rng.random((N, K)) < 0.15] = -1
    ids[6] = -1
    w = rng.random((N, K)).astype(np.float32)
    w[7] = -w[7]
    return epd.bf16.from_f32(xf), ids, w


def c_reference(x, ids, w, world, dtype, scale, fmt, kind, combine):
    src, dst = os.path.join(TMP, "ref.in"), os.path.join(TMP, "ref.out")
    with open(src, "wb") as f:
        f.write(np.array([N, H, K], np.uint32).tobytes() + x.tobytes() + ids.tobytes() +
                w.tobytes())
    subprocess.run([PY_REF, "-", src, dst, str(world), str(E), dtype, scale, fmt, kind, combine],
                   check=True, timeout=30)
    return np.fromfile(dst, np.uint16).reshape(2, N, H)[0]


class TestReference(unittest.TestCase):
    def test_reference__numpy_port__equals_epd_moe_reference(self):
        xp = NumpyOps()
        cases = 0
        for seed, world, dtype, scale, fmt, kind, combine in itertools.product(
                (1, 2), (1, 2, 4), ("bf16", "fp8"), ("group128", "per_token"),
                ("fp32", "ue8m0"), ("identity", "scale"), ("bf16", "fp8")):
            if dtype == "bf16" and (scale, fmt) != ("group128", "fp32"):
                continue
            x, ids, w = hard_batch(seed)
            cfg = {"experts.kind": kind, "model.num_experts": E, "dispatch.dtype": dtype,
                   "dispatch.scale": scale, "dispatch.scale_format": fmt,
                   "combine.dtype": combine}
            for ids_dtype in (np.int32, np.int64):
                got = moe_reference(xp, x, ids.astype(ids_dtype), w, cfg, world)
                want = c_reference(x, ids, w, world, dtype, scale, fmt, kind, combine)
                bad = np.argwhere(got != want)
                self.assertEqual(len(bad), 0, "%s: first differences at %s: %s vs %s" % (
                    cfg, bad[:3].tolist(), got[tuple(bad[0])] if len(bad) else None,
                    want[tuple(bad[0])] if len(bad) else None))
            cases += 1
        print("reference port: %d configurations equal to epd_moe_reference bit for bit" % cases)


if __name__ == "__main__":
    unittest.main(verbosity=2)
