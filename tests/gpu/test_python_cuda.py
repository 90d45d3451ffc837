#!/usr/bin/env python3
"""Device regions through the Python client (DESIGN.md section 4b) with torch CUDA tensors, against
a daemon on the GPU(s) (run by tests/gpu/python_cuda.sh): x bf16, topk_ids int64 (torch.topk's
dtype), topk_weights and y on the device give the payload path's y and the pure-PyTorch
reference (examples/moe_reference.py) bit for bit; one registration per allocation, reused;
the driver's IPC handle is torch's own, also for memory freed and allocated again; bad values
on the device get their codes; a tensor of another GPU is bad_region; expandable segments are
refused with a clear error; AsyncClient and a Group of ranks sharing a GPU.
Exit 77 (skip, saying why) without torch, without CUDA in torch, or when the daemon does not
serve regions. Environment: EPDPY_SOCKETS, EPDPY_DEVICES (the GPU of each rank, e.g. 0:1)."""
import asyncio
import os
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "examples"))

try:
    import torch
except ImportError:
    print("SKIP: torch is not importable by %s" % sys.executable)
    sys.exit(77)
if not torch.cuda.is_available():
    print("SKIP: torch %s sees no CUDA device" % torch.__version__)
    sys.exit(77)

import epd  # noqa: E402
from epd import _torch  # noqa: E402
from moe_reference import TorchOps, moe_reference  # noqa: E402

SOCKETS = os.environ.get("EPDPY_SOCKETS", "").split(":")
DEVICES = [int(d) for d in os.environ.get("EPDPY_DEVICES", "0:0").split(":")]
XP = TorchOps()


def batch(n, cfg, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    h, e, k = cfg["model.hidden"], cfg["model.num_experts"], cfg["model.topk"]
    x = torch.randn(n, h, generator=g).to(torch.bfloat16).to(device)
    scores = torch.rand(n, e, generator=g).to(device)
    w, ids = torch.topk(scores, k, dim=-1)  # int64 ids
    w = (w / w.sum(-1, keepdim=True)).contiguous()
    return x, ids.contiguous(), w


def same(a, b):
    return torch.equal(a.view(torch.int16).cpu(), b.view(torch.int16).cpu())


class TestDeviceRegions(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with epd.Client(SOCKETS[0], timeout=30) as c:
            cls.cfg = c.config()
            cls.world = c.health()["world"]

    def test_device_regions__every_rank__equal_payload_and_reference(self):
        for rank, (sock, dev) in enumerate(zip(SOCKETS, DEVICES)):
            device = torch.device("cuda", dev)
            with epd.Client(sock, timeout=60) as c:
                for i, n in enumerate((1, 33, 256)):
                    x, ids, w = batch(n, self.cfg, device, 10 * rank + i)
                    out = torch.empty_like(x)
                    y = c.submit(x, ids, w, out=out)
                    self.assertIs(y, out)
                    payload = c.submit(x.cpu(), ids.cpu(), w.cpu())
                    ref = moe_reference(XP, x, ids, w, self.cfg, self.world)
                    self.assertTrue(same(y, payload), "rank %d n %d: device != payload" % (rank, n))
                    self.assertTrue(same(y, ref), "rank %d n %d: device != reference" % (rank, n))
        print("device regions: every rank equal to the payload path and the torch reference")

    def test_device_regions__one_registration_per_allocation__reused(self):
        device = torch.device("cuda", DEVICES[0])
        with epd.Client(SOCKETS[0], timeout=60) as c:
            x, ids, w = batch(64, self.cfg, device, 5)
            out = torch.empty_like(x)
            c.submit(x, ids, w, out=out)
            first = dict(c._s.device)
            for i in range(20):
                c.submit(x, ids, w, out=out)
            self.assertEqual(dict(c._s.device), first)
            allocations = {_torch.device_allocation(t)[1] for t in (x, ids, w, out)}
            self.assertEqual(len(first), len(allocations))
        print("registrations: %d for %d allocations, reused over 21 calls"
              % (len(first), len(allocations)))

    def test_device_regions__driver_handle__is_torchs_handle(self):
        t = torch.empty(1 << 20, dtype=torch.bfloat16, device=torch.device("cuda", DEVICES[0]))
        handle, base, nbytes = _torch.device_allocation(t)
        raw = t.untyped_storage()._share_cuda_()[1]
        self.assertEqual(len(raw), 66, "torch's handle is %d bytes" % len(raw))
        self.assertEqual(raw[:2], b"\x02c")
        self.assertEqual(handle, raw[2:])
        h2, offset = _torch.torch_ipc_handle(t.untyped_storage())
        self.assertEqual((h2, base + offset), (handle, t.data_ptr()))
        self.assertLessEqual(offset + t.untyped_storage().nbytes(), nbytes)

    def test_device_regions__memory_freed_and_reallocated__new_handle_right_result(self):
        """The client remembers an allocation's handle by the driver's buffer id: memory given
        back to CUDA and allocated again (often at the same address) is a new allocation, with
        its own handle (torch's for it) and region, never the freed one's."""
        device = torch.device("cuda", DEVICES[0])
        n = 256  # x of 3.5 MiB: with the ids, weights and y, more than one of torch's blocks
        with epd.Client(SOCKETS[0], timeout=60) as c:
            bases = []
            for seed in (21, 22, 23):
                x, ids, w = batch(n, self.cfg, device, seed)
                out = torch.empty_like(x)
                y = c.submit(x, ids, w, out=out)
                ref = moe_reference(XP, x, ids, w, self.cfg, self.world)
                self.assertTrue(same(y, ref), "seed %d: device != reference" % seed)
                handle, base, _ = _torch.device_allocation(x)
                fresh, offset = _torch.torch_ipc_handle(x.untyped_storage())  # torch's, now
                self.assertEqual((handle, base + offset), (fresh, x.data_ptr()),
                                 "seed %d: the remembered handle is not the memory's" % seed)
                bases.append(base)
                del x, ids, w, out, y
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()  # cudaFree: the next batch gets new allocations
            reused = len(set(bases)) < len(bases)
        print("freed and reallocated (%s): each time the memory's own handle, results right"
              % ("the same address again" if reused else "new addresses"))

    def test_device_regions__bad_values_on_the_device__get_their_codes(self):
        device = torch.device("cuda", DEVICES[0])
        e = self.cfg["model.num_experts"]
        with epd.Client(SOCKETS[0], timeout=60) as c:
            x, ids, w = batch(8, self.cfg, device, 6)
            bad_x = x.clone()
            bad_x[3, 7] = float("nan")
            with self.assertRaises(epd.NonFiniteInput):
                c.submit(bad_x, ids, w)
            bad_ids = ids.clone()
            bad_ids[2, 0] = e
            with self.assertRaises(epd.ExpertOutOfRange):
                c.submit(x, bad_ids, w)
            bad_ids = ids.clone()
            bad_ids[1, 1] = bad_ids[1, 0]
            with self.assertRaises(epd.InvalidTopk):
                c.submit(x, bad_ids, w)
            bad_w = w.clone()
            bad_w[0, 0] = float("inf")
            with self.assertRaises(epd.NonFiniteInput):
                c.submit(x, ids, bad_w)
            y = c.submit(x, ids, w)  # no out: a new CUDA tensor
            self.assertTrue(y.is_cuda and y.dtype == torch.bfloat16)
            self.assertTrue(same(y, moe_reference(XP, x, ids, w, self.cfg, self.world)))
            # one token: the daemon's one-block ingest (gpu/ops_cuda.cu, ingest_run), a bad
            # value at either end of x and in the last id and weight
            x1, ids1, w1 = x[5:6].clone(), ids[5:6].clone(), w[5:6].clone()
            for at in (0, x1.shape[1] - 1):
                bad_x = x1.clone()
                bad_x[0, at] = float("inf")
                with self.assertRaises(epd.NonFiniteInput):
                    c.submit(bad_x, ids1, w1)
            bad_ids = ids1.clone()
            bad_ids[0, -1] = -2
            with self.assertRaises(epd.ExpertOutOfRange):
                c.submit(x1, bad_ids, w1)
            bad_w = w1.clone()
            bad_w[0, -1] = float("nan")
            with self.assertRaises(epd.NonFiniteInput):
                c.submit(x1, ids1, bad_w)
            y1 = c.submit(x1, ids1, w1)
            self.assertTrue(same(y1, moe_reference(XP, x1, ids1, w1, self.cfg, self.world)))

    def test_device_regions__tensor_of_another_gpu__is_bad_region(self):
        if torch.cuda.device_count() < 2 or DEVICES[0] != 0:
            self.skipTest("needs a second GPU that rank 0 does not use")
        x, ids, w = batch(4, self.cfg, torch.device("cuda", 1), 7)
        with epd.Client(SOCKETS[0], timeout=60) as c:
            with self.assertRaises(epd.BadRegion):
                c.submit(x, ids, w)

    def test_device_regions__expandable_segments__refused_clearly(self):
        code = ("import sys, torch; sys.path.insert(0, %r); import epd\n"
                "x = torch.zeros(4, %d, dtype=torch.bfloat16, device='cuda:%d')\n"
                "ids = torch.zeros(4, %d, dtype=torch.int64, device=x.device)\n"
                "c = epd.Client(%r, timeout=30)\n"
                "try:\n    c.submit(x, ids, torch.zeros(4, %d, device=x.device))\n"
                "except epd.InvalidArgument as e:\n    print('refused:', e); sys.exit(0)\n"
                "sys.exit('not refused')\n"
                % (os.path.join(ROOT, "python"), self.cfg["model.hidden"], DEVICES[0],
                   self.cfg["model.topk"], SOCKETS[0], self.cfg["model.topk"]))
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("expandable", r.stdout)
        print(r.stdout.strip())

    def test_device_regions__async_pipelined__right(self):
        device = torch.device("cuda", DEVICES[0])
        batches = [batch(16 + i, self.cfg, device, 40 + i) for i in range(8)]

        async def main():
            c = await epd.AsyncClient.connect(SOCKETS[0], timeout=60)
            try:
                return await asyncio.gather(*(c.submit(*b) for b in batches))
            finally:
                await c.close()
        for b, y in zip(batches, asyncio.run(main())):
            self.assertTrue(same(y, moe_reference(XP, *b, self.cfg, self.world)))

    def test_device_regions__group_of_ranks_sharing_a_gpu__right(self):
        if len(set(DEVICES)) != 1:
            self.skipTest("the ranks run on different GPUs")
        x, ids, w = batch(200, self.cfg, torch.device("cuda", DEVICES[0]), 8)
        out = torch.empty_like(x)
        with epd.Group(SOCKETS, timeout=60) as g:
            self.assertIs(g.submit(x, ids, w, out=out), out)
        self.assertTrue(same(out, moe_reference(XP, x, ids, w, self.cfg, self.world)))


def main():
    with epd.Client(SOCKETS[0], timeout=30) as c:
        if not c.supports_regions():
            print("SKIP: the daemon does not serve shared regions yet: it answers CONTROL "
                  "register with unknown_op")
            return 77
    prog = unittest.main(verbosity=2, exit=False)
    return 0 if prog.result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
