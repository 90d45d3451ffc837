#!/usr/bin/env python3
"""The client's device-region code without a GPU: a stand-in `torch` module (CUDA tensors that
are only pointers, storages whose `_share_cuda_()` gives torch 2.x's 66-byte handle) drives
epd._torch and the session through the path torch takes when the CUDA driver library is absent:
the handle's prefix parsed, torch's reference count given back, one registration per allocation
reused, tensors named by offset, y written in its region, the current streams synchronized,
expandable segments and unknown handle formats refused before anything is sent; with a
stand-in driver, one allocation query a SUBMIT and the stream synchronized by the driver; a
prepared call registered once and made again after an eviction; CPU tensors
(numpy arrays behind the stand-in) sent from their own memory. A scripted
daemon (fake_daemon.py) checks every frame. The driver path itself runs on the GPU machine
(tests/gpu/test_python_cuda.py)."""
import asyncio
import base64
import os
import sys
import types
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, HERE)

# ---- the stand-in torch --------------------------------------------------------------------
torch = types.ModuleType("torch")
class DType:
    def __init__(self, name):
        self.name = name


for _name in ("bfloat16", "float16", "float32", "float64", "int8", "uint8", "int16", "int32",
              "int64", "bool", "float8_e4m3fn", "float8_e5m2"):
    setattr(torch, _name, DType(_name))
SIZES = {"bfloat16": 2, "float32": 4, "int64": 8, "int32": 4}
events = {"synced": [], "released": []}


class Device:
    def __init__(self, index):
        self.index, self.type = index, "cuda"


class Storage:
    def __init__(self, block, block_base, offset, nbytes, prefix=b"\x02c"):
        self.block, self.block_base, self.offset, self._nbytes = block, block_base, offset, nbytes
        self.prefix = prefix

    def _share_cuda_(self):
        return (0, self.prefix + self.block, self._nbytes, self.offset, b"/torch_ref", 8, None,
                False)

    @classmethod
    def _release_ipc_counter_cuda(cls, handle, offset):
        events["released"].append((handle, offset))

    def data_ptr(self):
        return self.block_base + self.offset

    def nbytes(self):
        return self._nbytes


class Tensor:
    """A contiguous CUDA tensor at storage.data_ptr() + byte offset."""

    def __init__(self, storage, byte_offset, shape, dtype):
        self.storage, self.byte_offset, self.shape, self.dtype = storage, byte_offset, shape, dtype
        self.is_cuda, self.device = True, Device(0)

    def is_contiguous(self):
        return True

    def untyped_storage(self):
        return self.storage

    def data_ptr(self):
        return self.storage.data_ptr() + self.byte_offset

    def element_size(self):
        return SIZES[self.dtype.name]

    def numel(self):
        n = 1
        for d in self.shape:
            n *= d
        return n

    def dim(self):
        return len(self.shape)


class _Stream:
    def __init__(self, device):
        self.device = device

    def synchronize(self):
        events["synced"].append(self.device.index)


class _DeviceGuard:
    def __init__(self, device):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NP = {"bfloat16": np.uint16, "int16": np.int16, "int64": np.int64, "int32": np.int32,
       "float32": np.float32}


class CpuTensor(Tensor):
    """A CPU tensor over a numpy array (its memory): as much of torch's API as the client uses."""

    def __init__(self, arr, dtype, requires_grad=False):
        self.arr, self.dtype, self.shape = arr, dtype, tuple(arr.shape)
        self.is_cuda, self.requires_grad = False, requires_grad

    def is_contiguous(self):
        return self.arr.flags.c_contiguous

    def contiguous(self):
        return CpuTensor(np.ascontiguousarray(self.arr), self.dtype)

    def detach(self):
        return CpuTensor(self.arr, self.dtype)

    def data_ptr(self):
        return self.arr.__array_interface__["data"][0]

    def element_size(self):
        return self.arr.itemsize

    def numel(self):
        return self.arr.size

    def view(self, dtype):
        return CpuTensor(self.arr.view(_NP[dtype.name]), dtype)

    def numpy(self):
        return self.arr


def _from_numpy(a):
    names = {np.dtype(v): k for k, v in _NP.items() if k != "bfloat16"}
    return CpuTensor(a, getattr(torch, names[a.dtype]))


def _empty(shape, dtype, device):
    """A new CUDA tensor, as the caching allocator would place it: in the 2 MiB block of the
    tensors() made before it (block A at 1 << 40), from 1 MiB on."""
    n = SIZES[dtype.name]
    for d in shape:
        n *= d
    t = Tensor(Storage(BLOCK_A, 1 << 40, 1 << 20, n), 0, tuple(shape), dtype)
    t.device = device
    return t


Tensor.__module__ = "torch"  # as torch.Tensor says of itself
CpuTensor.__module__ = "torch"
torch.Tensor = Tensor
torch.from_numpy = _from_numpy
torch.empty = _empty
torch.cuda = types.SimpleNamespace(current_device=lambda: 0, device=_DeviceGuard,
                                   current_stream=_Stream)
sys.modules["torch"] = torch

import epd  # noqa: E402
from epd import _torch  # noqa: E402
from epd import frame as fr  # noqa: E402
from fake_daemon import FakeDaemon, x_bytes  # noqa: E402

H, K = 256, 4
BLOCK_A, BLOCK_B = bytes(range(64)), bytes(range(64, 128))


def tensors(n, block=BLOCK_A, base=1 << 40, prefix=b"\x02c"):
    """x, ids, w, out: four storages of one 2 MiB block (as the caching allocator lays them)."""
    sizes = [n * H * 2, n * K * 8, n * K * 4, n * H * 2]
    out, at = [], 4096
    for size, (shape, dtype) in zip(sizes, [((n, H), torch.bfloat16), ((n, K), torch.int64),
                                            ((n, K), torch.float32), ((n, H), torch.bfloat16)]):
        out.append(Tensor(Storage(block, base, at, size, prefix), 0, shape, dtype))
        at += (size + 511) // 512 * 512
    return out


class TestFakeTorch(unittest.TestCase):
    def test_device_regions__async_client__registers_then_names_by_offset(self):
        got = []

        def handler(peer):
            while True:
                ftype, meta, _ = peer.read()
                got.append(meta.get("op", "submit"))
                if ftype == fr.SUBMIT:
                    peer.send(fr.RESULT, {"id": meta["id"], "step": 1,
                                          "tensors": {"y": meta["tensors"]["y"]}})
                else:
                    peer.send(fr.REPLY, {"id": meta["id"], "region": 3, "bytes": 1})

        async def main(path):
            c = await epd.AsyncClient.connect(path, timeout=10)
            x, ids, w, out = tensors(3)
            ys = [await c.submit(x, ids, w, out=out) for _ in range(2)]
            await c.close()
            return ys, out

        fake = FakeDaemon(handler)
        with fake as path:
            ys, out = asyncio.run(main(path))
        self.assertEqual(fake.errors, [])
        self.assertTrue(all(y is out for y in ys))
        self.assertEqual(got, ["config", "register", "submit", "submit"])

    def test_cpu_tensors__bytes_sent_from_their_memory__a_strided_one_from_a_copy(self):
        seen = []

        def handler(peer):
            while True:
                ftype, meta, payload = peer.read()
                t = meta["tensors"]
                seen.append({k: (d["dtype"], payload[d["data_offsets"][0]:d["data_offsets"][1]])
                             for k, d in t.items()})
                n, h = t["x"]["shape"]
                peer.result(meta["id"], x_bytes(meta, payload), n, h)

        rng = np.random.default_rng(5)
        x = rng.integers(0, 0x7f00, (3, H), dtype=np.uint16)
        ids = rng.integers(-1, 16, (3, K)).astype(np.int64)
        w = rng.random((3, K)).astype(np.float32)
        wide = np.zeros((6, H), np.uint16)
        wide[::2] = x
        fake = FakeDaemon(handler)
        with fake as path:
            with epd.Client(path, timeout=10) as c:
                tids, tw = CpuTensor(ids, torch.int64), CpuTensor(w, torch.float32, True)
                for tx in (CpuTensor(x, torch.bfloat16), CpuTensor(wide[::2], torch.bfloat16)):
                    y = c.submit(tx, tids, tw)
                    self.assertIsInstance(y, CpuTensor)
                    self.assertIs(y.dtype, torch.bfloat16)
                    self.assertTrue((y.arr == x).all())
        self.assertEqual(fake.errors, [])
        want = {"x": ("bf16", x.tobytes()), "topk_ids": ("i64", ids.tobytes()),
                "topk_weights": ("f32", w.tobytes())}
        self.assertEqual(seen, [want, want])

    def test_device_regions__one_block__registered_once_and_named_by_offset(self):
        seen = {"registers": [], "submits": []}

        def handler(peer):
            while True:
                ftype, meta, payload = peer.read()
                if ftype == fr.CONTROL and meta["op"] == "config":
                    peer.send(fr.REPLY, {"id": meta["id"], "socket.max_regions": 4})
                elif ftype == fr.CONTROL and meta["op"] == "register":
                    seen["registers"].append(meta)
                    peer.send(fr.REPLY, {"id": meta["id"], "region": 10 + len(seen["registers"]),
                                         "bytes": meta["bytes"]})
                elif ftype == fr.SUBMIT:
                    assert payload == b""
                    seen["submits"].append(meta["tensors"])
                    peer.send(fr.RESULT, {"id": meta["id"], "step": 1,
                                          "tensors": {"y": meta["tensors"]["y"]}})
                else:
                    seen.setdefault("other", []).append(meta)
                    peer.send(fr.REPLY, {"id": meta["id"]})

        fake = FakeDaemon(handler)
        with fake as path:
            with epd.Client(path, timeout=10) as c:
                x, ids, w, out = tensors(8)
                for _ in range(3):
                    self.assertIs(c.submit(x, ids, w, out=out), out)
                x2, ids2, w2, out2 = tensors(4, BLOCK_B, base=1 << 41)
                self.assertIs(c.submit(x2, ids2, w2, out=out2), out2)
                # a third allocation: over half of socket.max_regions, A (least recent) goes
                x3, ids3, w3, out3 = tensors(2, bytes(range(128, 192)), base=1 << 42)
                self.assertIs(c.submit(x3, ids3, w3, out=out3), out3)
                c.health()  # the unregister's REPLY has come back by now
                for prefix, says in ((b"\x02e", "expandable"), (b"\x03c", "format")):
                    xe, ie, we, oe = tensors(2, bytes(64), prefix=prefix)
                    with self.assertRaises(epd.InvalidArgument) as cm:
                        c.submit(xe, ie, we, out=oe)
                    self.assertIn(says, str(cm.exception))
                self.assertEqual(c.in_flight, 0)
        self.assertEqual(fake.errors, [])
        # one registration per allocation, over the storages' bytes from the block's start
        regs = seen["registers"]
        self.assertEqual(len(regs), 3, regs)
        self.assertEqual([base64.b64decode(r["handle"]) for r in regs][:2], [BLOCK_A, BLOCK_B])
        self.assertEqual([(m["op"], m.get("region")) for m in seen["other"]],
                         [("unregister", 11), ("health", None)])
        self.assertEqual({(r["kind"], r["offset"]) for r in regs}, {("cuda", 0)})
        self.assertEqual(regs[0]["bytes"], out.storage.offset + out.storage.nbytes())
        t = seen["submits"][0]
        self.assertEqual(t["x"], fr.region_tensor("bf16", [8, H], 11, 4096))
        self.assertEqual(t["topk_ids"]["dtype"], "i64")
        self.assertEqual(t["y"]["offset"], out.storage.offset)
        self.assertEqual({d["region"] for d in seen["submits"][3].values()}, {12})
        self.assertEqual(len(seen["submits"]), 5)
        self.assertTrue(events["synced"])
        self.assertTrue(events["released"])

    def test_device_regions__handles__parsed_as_torch_2_gives_them(self):
        h, off = _torch.torch_ipc_handle(Storage(BLOCK_A, 1 << 40, 512, 100))
        self.assertEqual((h, off), (BLOCK_A, 512))
        h, off = _torch.torch_ipc_handle(Storage(BLOCK_A, 1 << 40, 0, 100, prefix=b""))
        self.assertEqual(h, BLOCK_A)
        self.assertEqual(_torch.wire_dtype(Tensor(None, 0, (1,), torch.int64)), "i64")

    def test_device_regions__driver__one_query_a_submit_for_tensors_of_one_allocation(self):
        """With the driver library: the allocation of a SUBMIT's first CUDA tensor answers for
        the others inside it (one query a SUBMIT, not four); a tensor outside it is asked
        about; every tensor named by its offset in its own allocation's region."""
        queries = []
        blocks = {BLOCK_A: (1 << 40, 4 << 20), BLOCK_B: (1 << 41, 4 << 20)}

        class Drv:
            def allocation(self, ptr):
                queries.append(ptr)
                for handle, (base, size) in blocks.items():
                    if base <= ptr < base + size:
                        return handle, base, size
                return None

            def stream_sync(self, handle):
                return 0

        submits = []

        def handler(peer):
            while True:
                ftype, meta, _ = peer.read()
                if ftype == fr.SUBMIT:
                    submits.append(meta["tensors"])
                    peer.send(fr.RESULT, {"id": meta["id"], "step": 1,
                                          "tensors": {"y": meta["tensors"]["y"]}})
                elif ftype == fr.CONTROL and meta["op"] == "register":
                    region = 20 if base64.b64decode(meta["handle"]) == BLOCK_A else 21
                    peer.send(fr.REPLY, {"id": meta["id"], "region": region,
                                         "bytes": meta["bytes"]})
                else:
                    peer.send(fr.REPLY, {"id": meta["id"], "socket.max_regions": 8})

        saved = _torch._driver
        _torch._driver = lambda: drv
        drv = Drv()
        try:
            fake = FakeDaemon(handler)
            with fake as path:
                with epd.Client(path, timeout=10) as c:
                    x, ids, w, out = tensors(8)
                    for _ in range(2):
                        c.submit(x, ids, w, out=out)
                    self.assertEqual(queries, [x.data_ptr()] * 3)  # planned twice, then once
                    queries.clear()
                    out_b = tensors(8, BLOCK_B, base=1 << 41)[3]
                    c.submit(x, ids, w, out=out_b)
                    self.assertEqual(queries, [x.data_ptr(), out_b.data_ptr()] * 2)
            self.assertEqual(fake.errors, [])
        finally:
            _torch._driver = saved
        self.assertEqual(submits[1]["topk_weights"],
                         fr.region_tensor("f32", [8, K], 20, w.data_ptr() - (1 << 40)))
        self.assertEqual(submits[2]["y"],
                         fr.region_tensor("bf16", [8, H], 21, out_b.data_ptr() - (1 << 41)))

    def test_device_regions__prepared_call__registered_once_synced_each_call_remade_on_eviction(
            self):
        """A prepared call on CUDA tensors: its allocation registered once, each call the same
        tensors' text under a new id with the current stream synchronized; without out, one y
        made at prepare time gets every answer; when other allocations evict its region, the
        next call registers it again and names the new region."""
        log = []
        regions = iter(range(40, 60))

        def handler(peer):
            while True:
                ftype, meta, _ = peer.read()
                if ftype == fr.SUBMIT:
                    log.append(("submit", meta["id"], meta["tensors"], meta.get("layer")))
                    peer.send(fr.RESULT, {"id": meta["id"], "step": 1,
                                          "tensors": {"y": meta["tensors"]["y"]}})
                elif ftype == fr.CONTROL and meta["op"] == "config":
                    peer.send(fr.REPLY, {"id": meta["id"], "socket.max_regions": 2})
                elif ftype == fr.CONTROL and meta["op"] == "register":
                    rid = next(regions)
                    log.append(("register", base64.b64decode(meta["handle"]), rid))
                    peer.send(fr.REPLY, {"id": meta["id"], "region": rid, "bytes": meta["bytes"]})
                else:
                    log.append((meta["op"], meta.get("region")))
                    peer.send(fr.REPLY, {"id": meta["id"]})

        events["synced"].clear()
        fake = FakeDaemon(handler)
        with fake as path:
            with epd.Client(path, timeout=10) as c:
                x, ids, w, _ = tensors(5)
                call = c.prepare(x, ids, w)
                ys = [call.submit(layer=k) for k in range(3)]
                self.assertTrue(all(y is call.out for y in ys))
                self.assertEqual(len(events["synced"]), 3)
                # max_regions 2: one device region a connection; another allocation evicts it
                x2, ids2, w2, out2 = tensors(5, BLOCK_B, base=1 << 41)
                c.submit(x2, ids2, w2, out=out2)
                self.assertIs(call.submit(), call.out)
                c.health()
        self.assertEqual(fake.errors, [])
        kinds = [e[0] for e in log]
        self.assertEqual(kinds, ["register", "submit", "submit", "submit", "unregister",
                                 "register", "submit", "unregister", "register", "submit",
                                 "health"], log)
        first = [e for e in log if e[0] == "submit"]
        self.assertEqual([e[3] for e in first[:3]], [0, 1, 2])
        self.assertEqual(len({e[1] for e in first}), len(first))  # a new id each call
        self.assertEqual(first[0][2], first[2][2])                # the same tensors
        self.assertEqual({d["region"] for d in first[0][2].values()}, {40})
        self.assertEqual([e[1:] for e in log if e[0] == "register"],
                         [(BLOCK_A, 40), (BLOCK_B, 41), (BLOCK_A, 42)])
        self.assertEqual({d["region"] for d in first[4][2].values()}, {42})

    def test_stream_sync__driver_and_torch_entry_points__current_device_by_driver_else_torch(self):
        """With the driver library and torch's C entry points: cuStreamSynchronize on the
        current device's raw stream, once a device; another device's stream through torch's
        public call; a failed sync raised with the driver's error name."""
        calls = []

        class Drv:
            rc = 0

            def stream_sync(self, handle):
                calls.append(("driver", handle))
                return self.rc

            def name(self, rc):
                return "CUDA_ERROR_LAUNCH_FAILED"

        drv = Drv()
        saved = (_torch._driver, _torch._get_device, _torch._raw_stream)
        _torch._driver = lambda: drv
        _torch._get_device = lambda: 0
        _torch._raw_stream = lambda index: 0x5000 + index
        events["synced"].clear()
        try:
            a = Tensor(Storage(BLOCK_A, 1 << 40, 0, 64), 0, (4,), torch.float32)
            b = Tensor(Storage(BLOCK_A, 1 << 40, 64, 64), 0, (4,), torch.float32)
            c = Tensor(Storage(BLOCK_B, 1 << 41, 0, 64), 0, (4,), torch.float32)
            c.device = Device(1)
            _torch.stream_sync([a, b, c, c])
            self.assertEqual(calls, [("driver", 0x5000)])  # cuda:0 once, by the driver
            self.assertEqual(events["synced"], [1])        # cuda:1 is not current: torch's call
            drv.rc = 719
            with self.assertRaisesRegex(RuntimeError, "CUDA_ERROR_LAUNCH_FAILED"):
                _torch.stream_sync([a])
            _torch._raw_stream = None  # a torch without the entry point: its public call
            _torch.stream_sync([a])
            self.assertEqual(events["synced"], [1, 0])
        finally:
            _torch._driver, _torch._get_device, _torch._raw_stream = saved


if __name__ == "__main__":
    unittest.main(verbosity=2)
