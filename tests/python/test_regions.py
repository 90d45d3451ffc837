#!/usr/bin/env python3
"""Host regions (DESIGN.md section 4b) through the Python client against the real daemon (run by
tests/integration/python_regions.sh, same daemon shape as test_daemon.py): x, topk_ids (i32 and
i64), topk_weights and y in a memfd registered over SCM_RIGHTS give the payload path's y bit for
bit; pipelined; a prepared call named in the region, made again once it is unregistered; one
region on every rank of a Group; bad regions, unregistered regions and bad
registrations are bad_region; non-finite values in a region are non_finite_input.
When the daemon does not serve regions (register answered unknown_op), it exits 77 (skip) saying
so; when it does, every case must pass."""
import asyncio
import os
import sys
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, HERE)
import epd  # noqa: E402
from epd import frame as fr  # noqa: E402
from test_daemon import E, H, K, MAX_N, SOCKETS, c_side, make_batch  # noqa: E402


def in_region(region, x, ids, w):
    """Copies of x, ids, w and an empty y in the region (64-byte aligned, one after another)."""
    region.reset()
    rx = region.take(x.shape, np.uint16)
    rids = region.take(ids.shape, ids.dtype)
    rw = region.take(w.shape, np.float32)
    ry = region.take(x.shape, np.uint16)
    rx[:], rids[:], rw[:] = x, ids, w
    ry[:] = 0xFFFF
    return rx, rids, rw, ry


def region_submit(c, req_id, rid, descs):
    """A hand-made SUBMIT naming tensors in region rid: descs {name: (dtype, shape, offset)}."""
    tensors = {k: fr.region_tensor(d, s, rid, o) for k, (d, s, o) in descs.items()}
    return fr.encode(fr.SUBMIT, {"id": req_id, "tensors": tensors})


class TestHostRegions(unittest.TestCase):
    def test_host_region__every_tensor_in_it__equals_the_payload_path(self):
        checked = 0
        for rank, sock in enumerate(SOCKETS):
            with epd.Client(sock, timeout=20) as c:
                region = c.host_region(1 << 20)
                for i, n in enumerate([1, 9, MAX_N]):
                    for ids_dtype in (np.int32, np.int64):
                        x, ids, w = make_batch(n, 700 + 10 * rank + i)
                        ids = ids.astype(ids_dtype)
                        rx, rids, rw, ry = in_region(region, x, ids, w)
                        y = c.submit(rx, rids, rw, out=ry)
                        self.assertIs(y, ry)
                        payload = c.submit(x, ids, w)
                        self.assertTrue((ry == payload).all(), "region y != payload y")
                        self.assertTrue((ry == c_side(sock, x, ids, w)[1]).all())
                        checked += 1
                c.unregister(region)
                region.close()
        print("host regions: %d batches equal to the payload path and the reference" % checked)

    def test_host_region__prepared_call__named_in_it_then_made_again_once_let_go(self):
        """A prepared call on tensors in a host region names them there (no payload); refilled
        in place, each y right; once the region is unregistered, the next call makes its frame
        again (the tensors then travel in the payload) and is still right."""
        sock = SOCKETS[0]
        with epd.Client(sock, timeout=20) as c:
            region = c.host_region(1 << 20)
            x, ids, w = make_batch(7, 1500, ids_dtype=np.int64)
            rx, rids, rw, ry = in_region(region, x, ids, w)
            call = c.prepare(rx, rids, rw, out=ry)
            self.assertIn('"region"', repr(call))
            self.assertNotIn("data_offsets", repr(call))
            for i in range(3):
                nx, nids, nw = make_batch(7, 1510 + i, ids_dtype=np.int64)
                rx[:], rids[:], rw[:] = nx, nids, nw
                self.assertIs(call.submit(layer=i), ry)
                self.assertTrue((ry == c_side(sock, nx, nids, nw)[1]).all())
            c.unregister(region)
            ry[:] = 0
            self.assertIs(call.submit(), ry)  # y in the payload now, into the same array
            self.assertIn("data_offsets", repr(call))
            self.assertTrue((ry == c_side(sock, nx, nids, nw)[1]).all())
            region.close()

    def test_host_region__pipelined_slices__every_answer_right(self):
        with epd.Client(SOCKETS[0], timeout=30) as c:
            region = c.host_region(4 << 20)
            sent = []
            for i in range(16):
                x, ids, w = make_batch(8, 800 + i)
                views = [region.take(a.shape, a.dtype) for a in (x, ids, w, x)]
                for v, a in zip(views[:3], (x, ids, w)):
                    v[:] = a
                sent.append(((x, ids, w), views[3], c.submit_async(*views[:3], out=views[3])))
            c.wait_all([p for _, _, p in sent])
            for b, ry, p in sent:
                self.assertIs(p.result(), ry)
                self.assertTrue((ry == c_side(c.path, *b)[1]).all())

    def test_host_region__x_in_the_region_y_in_the_payload__is_right(self):
        with epd.Client(SOCKETS[1], timeout=20) as c:
            region = c.host_region(1 << 16)
            x, ids, w = make_batch(5, 33)
            rx = region.take(x.shape, np.uint16)
            rx[:] = x
            y = c.submit(rx, ids, w)
            self.assertTrue((y == c_side(c.path, x, ids, w)[1]).all())

    def test_host_region__one_region_on_every_rank__serves_a_group(self):
        region = epd.HostRegion(1 << 20)
        with epd.Group(SOCKETS, timeout=20) as g:
            rids = [c.register(region) for c in g]
            x, ids, w = make_batch(MAX_N, 44)
            rx, rids_, rw, ry = in_region(region, x, ids.astype(np.int64), w)
            self.assertIs(g.submit(rx, rids_, rw, out=ry), ry)
            self.assertTrue((ry == c_side(SOCKETS[0], x, ids, w)[1]).all())
        region.close()
        print("group: region ids per rank", rids)

    def test_host_region__bad_names__are_bad_region_and_the_connection_serves(self):
        n = 2
        xb, kb = 2 * n * H, 4 * n * K
        good = {"x": ("bf16", [n, H], 0), "topk_ids": ("i32", [n, K], xb),
                "topk_weights": ("f32", [n, K], xb + kb)}
        with epd.Client(SOCKETS[0], timeout=20) as c:
            region = c.host_region(4096)
            rid = region_id = c._s.host_region_id(region)
            x, ids, w = make_batch(n, 55, empty_slots=False)
            region.array(x.shape, np.uint16, 0)[:] = x
            region.array(ids.shape, np.int32, xb)[:] = ids
            region.array(w.shape, np.float32, xb + kb)[:] = w
            rows = [("unknown region", rid + 1000, good),
                    ("past the end", rid, dict(good, x=("bf16", [n, H], 4096 - 2 * n * H + 2))),
                    ("misaligned", rid, dict(good, topk_weights=("f32", [n, K], xb + kb + 2))),
                    ("y past the end", rid, dict(good, y=("bf16", [n, H], 4000)))]
            for what, r, descs in rows:
                req = c.new_id()
                p = c.send_raw(region_submit(c, req, r, descs), id=req)
                exc = p.exception()
                self.assertIsInstance(exc, epd.BadRegion, "%s: %r" % (what, exc))
                self.assertEqual(exc.id, req)
            req = c.new_id()
            meta, _ = c.send_raw(region_submit(c, req, region_id, good), id=req).result()
            self.assertEqual(meta["id"], req)
            y = c.submit(region.array(x.shape, np.uint16, 0),
                         region.array(ids.shape, np.int32, xb),
                         region.array(w.shape, np.float32, xb + kb))
            self.assertTrue((y == c_side(c.path, x, ids, w)[1]).all())
            c.unregister(region)
            req = c.new_id()
            exc = c.send_raw(region_submit(c, req, region_id, good), id=req).exception()
            self.assertIsInstance(exc, epd.BadRegion, "after unregister: %r" % exc)

    def test_host_region__async_client__registers_and_serves(self):
        x, ids, w = make_batch(6, 77)

        async def main():
            c = await epd.AsyncClient.connect(SOCKETS[0], timeout=20)
            try:
                region = await c.host_region(1 << 16)
                rx, rids, rw, ry = in_region(region, x, ids.astype(np.int64), w)
                y = await c.submit(rx, rids, rw, out=ry)
                await c.unregister(region)
                return y is ry, ry.copy()
            finally:
                await c.close()
        same, y = asyncio.run(main())
        self.assertTrue(same)
        self.assertTrue((y == c_side(SOCKETS[0], x, ids, w)[1]).all())

    def test_host_region__non_finite_values__are_non_finite_input(self):
        with epd.Client(SOCKETS[1], timeout=20) as c:
            region = c.host_region(1 << 16)
            x, ids, w = make_batch(3, 66)
            x[1, 5] = 0x7FC0  # NaN
            rx, rids, rw, ry = in_region(region, x, ids, w)
            with self.assertRaises(epd.NonFiniteInput):
                c.submit(rx, rids, rw, out=ry)
            x2, ids2, w2 = make_batch(3, 67)
            ids2[0, 0] = E
            rx, rids, rw, ry = in_region(region, x2, ids2, w2)
            with self.assertRaises(epd.ExpertOutOfRange):
                c.submit(rx, rids, rw, out=ry)

    def test_register__bad_registrations__are_bad_region(self):
        with epd.Client(SOCKETS[0], timeout=20) as c:
            small = epd.HostRegion(4096)
            for what, fields, fds in (("bytes over the fd's size", {"bytes": 8192}, [small.fd]),
                                      ("no fd", {"bytes": 4096}, None)):
                req = c.new_id()
                data = fr.encode(fr.CONTROL, dict({"op": "register", "kind": "host",
                                                   "id": req}, **fields))
                exc = c.send_raw(data, fds=fds, id=req).exception()
                self.assertIsInstance(exc, epd.BadRegion, "%s: %r" % (what, exc))
            self.assertEqual(c.health()["status"], "ok")
            small.close()


def main():
    with epd.Client(SOCKETS[0], timeout=10) as c:
        if not c.supports_regions():
            print("SKIP: the daemon does not serve shared regions yet: it answers CONTROL "
                  "register with unknown_op")
            return 77
    prog = unittest.main(verbosity=2, exit=False)
    return 0 if prog.result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
