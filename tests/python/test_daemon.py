#!/usr/bin/env python3
"""The Python client against the real daemon (started by tests/integration/python_client.sh:
2 ranks, H 256, E 16, K 4, scale experts, FP8 dispatch, max_tokens_per_request 64,
max_queued_tokens 512, max_frame_bytes 1 MiB). Payload results equal libepd's and the host
reference's bit for bit (py_ref), on both ranks, from Client, AsyncClient and Group, and from
prepared calls refilled in place (copies refused before anything is sent); pipelining
with errors overtaking results; every code a client can provoke surfaced as its exception, the
connection kept for request errors and closed for framing errors; CONTROL queries.
Environment: EPDPY_SOCKETS (colon-separated, rank order), EPDPY_REF, EPDPY_TMP."""
import asyncio
import os
import signal
import subprocess
import sys
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import epd  # noqa: E402
from epd import frame as fr  # noqa: E402

SOCKETS = os.environ.get("EPDPY_SOCKETS", "").split(":")
PY_REF = os.environ.get("EPDPY_REF", "build/tests/py_ref")
TMP = os.environ.get("EPDPY_TMP", "/tmp")
H, E, K, MAX_N = 256, 16, 4, 64


def make_batch(n, seed, ids_dtype=np.int32, empty_slots=True, hidden=H):
    """x normal(0,1) in bf16 with an outlier, K distinct ids per token (some -1), weights."""
    rng = np.random.default_rng(seed)
    xf = rng.standard_normal((n, hidden)).astype(np.float32)
    xf[rng.integers(0, n), rng.integers(0, hidden)] = 37.5
    ids = np.stack([rng.permutation(E)[:K] for _ in range(n)]).astype(ids_dtype)
    if empty_slots:
        ids[rng.random((n, K)) < 0.1] = -1
    w = rng.random((n, K)).astype(np.float32)
    return epd.bf16.from_f32(xf), ids, w


_refs = {}


def c_side(sock, x, ids, w):
    """(libepd's y, the host reference's y) for the batch, from py_ref."""
    key = (sock, x.tobytes(), ids.astype(np.int32).tobytes(), w.tobytes())
    if key in _refs:
        return _refs[key]
    n, hidden = x.shape
    src, dst = os.path.join(TMP, "py_ref.in"), os.path.join(TMP, "py_ref.out")
    with open(src, "wb") as f:
        f.write(np.array([n, hidden, K], np.uint32).tobytes() + x.tobytes() +
                ids.astype(np.int32).tobytes() + w.tobytes())
    subprocess.run([PY_REF, sock, src, dst], check=True, timeout=30)
    both = np.fromfile(dst, np.uint16).reshape(2, n, hidden)
    _refs[key] = (both[0], both[1])
    return _refs[key]


def good_client(test, c):
    """The connection still serves: a right result right after."""
    x, ids, w = make_batch(3, 99)
    test.assertTrue((c.submit(x, ids, w) == c_side(c.path, x, ids, w)[1]).all())


class TestPayload(unittest.TestCase):
    def test_payload__random_batches_on_every_rank__equal_libepd_and_reference(self):
        checked = 0
        for rank, sock in enumerate(SOCKETS):
            with epd.Client(sock, timeout=20) as c:
                for i, n in enumerate([1, 2, 17, MAX_N]):
                    for ids_dtype in (np.int32, np.int64):
                        x, ids, w = make_batch(n, 100 * rank + i)
                        ids = ids.astype(ids_dtype)
                        y = c.submit(x, ids, w)
                        lib, ref = c_side(sock, x, ids, w)
                        self.assertEqual(y.dtype, np.uint16)
                        self.assertEqual(y.shape, (n, H))
                        self.assertTrue((lib == ref).all(), "libepd differs from the reference")
                        self.assertTrue((y == lib).all(), "python differs from libepd (n=%d)" % n)
                        checked += 1
        print("payload: %d batches equal to libepd and the reference bit for bit" % checked)

    def test_payload__out_array_and_all_empty_slots__are_right(self):
        with epd.Client(SOCKETS[0], timeout=20) as c:
            x, ids, w = make_batch(5, 7)
            ids[2] = -1  # a token with no expert gets zeros
            out = np.full((5, H), 0xFFFF, np.uint16)
            self.assertIs(c.submit(x, ids, w, out=out, layer=0), out)
            self.assertTrue((out == c_side(c.path, x, ids, w)[1]).all())
            self.assertTrue((out[2] == 0).all())

    def test_async__gathered_requests__equal_the_reference(self):
        batches = [make_batch(1 + 7 * i, 300 + i) for i in range(8)]

        async def main():
            cs = [await epd.AsyncClient.connect(s, timeout=20) for s in SOCKETS]
            try:
                return await asyncio.gather(*(cs[i % len(cs)].submit(*b)
                                              for i, b in enumerate(batches)))
            finally:
                for c in cs:
                    await c.close()
        ys = asyncio.run(main())
        for i, (b, y) in enumerate(zip(batches, ys)):
            self.assertTrue((y == c_side(SOCKETS[i % len(SOCKETS)], *b)[1]).all())

    def test_group__a_batch_split_over_the_ranks__equals_the_reference(self):
        x, ids, w = make_batch(MAX_N, 11)
        with epd.Group(SOCKETS, timeout=20) as g:
            self.assertEqual([h["rank"] for h in g.health()], list(range(len(SOCKETS))))
            y = g.submit(x, ids, w)
        # the reference is row-wise: one batch through py_ref gives every row's answer
        self.assertTrue((y == c_side(SOCKETS[0], x, ids, w)[1]).all())


class TestTorchCpu(unittest.TestCase):
    """CPU torch tensors (bytes sent from torch's own memory) give the numpy path's y, bit for
    bit: bf16 x (also a strided view, sent from a contiguous copy), int64 ids, float32 weights
    that require grad; through AsyncClient with six requests in flight at once. Needs torch:
    skipped, and said so, where it is not installed."""

    def setUp(self):
        try:
            import torch
        except ImportError:
            self.skipTest("torch is not installed for %s" % sys.executable)
        self.torch = torch

    def as_torch(self, x, ids, w):
        t = self.torch
        return (t.from_numpy(x.view(np.int16)).view(t.bfloat16), t.from_numpy(ids.astype(np.int64)),
                t.from_numpy(w).requires_grad_(True))

    def test_torch_cpu__tensors__give_the_numpy_y_bit_for_bit(self):
        t = self.torch
        with epd.Client(SOCKETS[0], timeout=20) as c:
            for i, n in enumerate([1, 5, MAX_N]):
                x, ids, w = make_batch(n, 500 + i)
                want = c.submit(x, ids, w)
                tx, tids, tw = self.as_torch(x, ids, w)
                y = c.submit(tx, tids, tw)
                self.assertEqual(y.dtype, t.bfloat16)
                self.assertTrue((y.view(t.int16).numpy().view(np.uint16) == want).all())
                # a strided x: every other row of a tensor twice as long
                wide = t.zeros((2 * n, H), dtype=t.bfloat16)
                wide[::2] = tx
                y2 = c.submit(wide[::2], tids, tw)
                self.assertTrue((y2.view(t.int16).numpy().view(np.uint16) == want).all())

    def test_torch_cpu__async_requests_in_flight_together__give_the_numpy_y(self):
        t = self.torch
        batches = [make_batch(1 + 9 * i, 600 + i) for i in range(6)]

        async def main():
            c = await epd.AsyncClient.connect(SOCKETS[0], timeout=20)
            try:
                futs = [await c.submit_async(*self.as_torch(*b)) for b in batches]
                return [await f for f in futs]
            finally:
                await c.close()
        ys = asyncio.run(main())
        with epd.Client(SOCKETS[0], timeout=20) as c:
            for b, y in zip(batches, ys):
                self.assertTrue((y.view(t.int16).numpy().view(np.uint16) == c.submit(*b)).all())


class TestPrepared(unittest.TestCase):
    def test_prepared__buffers_refilled_in_place__each_call_sends_their_contents(self):
        """A prepared payload call on each rank: refilled in place between calls, every y equals
        Client.submit's and the reference of that call's contents; layers as given; out= gets y;
        async calls in flight together; AsyncClient's prepared call the same."""
        checked = 0
        for rank, sock in enumerate(SOCKETS):
            with epd.Client(sock, timeout=20) as c:
                x, ids, w = make_batch(9, 1300 + rank, ids_dtype=np.int64)
                call = c.prepare(x, ids, w)
                out = np.zeros_like(x)
                into = c.prepare(x, ids, w, out=out)
                for i in range(4):
                    nx, nids, nw = make_batch(9, 1310 + 10 * rank + i, ids_dtype=np.int64)
                    x[:], ids[:], w[:] = nx, nids, nw
                    y = call.submit(layer=i % 2)
                    self.assertTrue((y == c.submit(nx, nids, nw, layer=i % 2)).all())
                    self.assertTrue((y == c_side(sock, nx, nids, nw)[1]).all())
                    self.assertIs(into.submit(), out)
                    self.assertTrue((out == y).all())
                    checked += 1
                ps = [call.submit_async(layer=3) for _ in range(3)]
                self.assertTrue(all((p.result(20) == y).all() for p in ps))
                self.assertEqual(c.in_flight, 0)

            async def run():
                ac = await epd.AsyncClient.connect(sock, timeout=20)
                acall = await ac.prepare(x, ids, w)
                got = await asyncio.gather(*[acall.submit(layer=k) for k in range(3)])
                await ac.close()
                return got
            self.assertTrue(all((g == y).all() for g in asyncio.run(run())))
        self.assertEqual(checked, 4 * len(SOCKETS))

    def test_prepared__group__shares_over_the_ranks_equal_group_submit(self):
        """Group.prepare: refilled in place, each call's y (the one out it made, or the given
        out) equals Group.submit's of the same contents, a batch shorter than the group
        included."""
        with epd.Group(SOCKETS, timeout=20) as g:
            for n in (13, 1):
                x, ids, w = make_batch(n, 1600 + n)
                call = g.prepare(x, ids, w)
                out = np.zeros_like(x)
                into = g.prepare(x, ids, w, out=out)
                for i in range(3):
                    nx, nids, nw = make_batch(n, 1610 + 10 * n + i)
                    x[:], ids[:], w[:] = nx, nids, nw
                    want = g.submit(nx, nids, nw, layer=i)
                    self.assertIs(call.submit(layer=i), call.out)
                    self.assertTrue((call.out == want).all())
                    self.assertIs(into.submit(layer=i), out)
                    self.assertTrue((out == want).all())

    def test_prepared__copies_refused__nothing_sent_and_the_connection_serves(self):
        """Inputs that would be sent as a copy made at prepare time (a strided array, a list,
        a dtype the wire has no name for) are refused before anything is sent; a bad layer
        is refused at the call."""
        x, ids, w = make_batch(4, 1400)
        with epd.Client(SOCKETS[0], timeout=20) as c:
            wide = np.zeros((4, 2 * H), np.uint16)
            for bad in ((wide[:, ::2], ids, w), (x, ids.tolist(), w),
                        (x, ids, w.astype(np.float16).astype(object))):
                with self.assertRaises(epd.InvalidArgument):
                    c.prepare(*bad)
            call = c.prepare(x, ids, w)
            for layer in (-1, 1 << 31, True, "1"):
                with self.assertRaises(epd.InvalidArgument):
                    call.submit(layer=layer)
            self.assertEqual(c.in_flight, 0)
            self.assertTrue((call.submit() == c_side(c.path, x, ids, w)[1]).all())
            good_client(self, c)


class TestPipelining(unittest.TestCase):
    def test_pipelining__errors_overtake_results__every_answer_matched_by_id(self):
        # 32 good requests of 8 tokens stay under the 512-token queue: no busy here
        good = [make_batch(8, 500 + i) for i in range(4)]
        x0, ids0, w0 = good[0]
        bad_ids = ids0.copy()
        bad_ids[0, 0] = E  # expert_out_of_range, answered at ingest
        with epd.Client(SOCKETS[0], timeout=30) as c:
            sent = []
            for i in range(48):
                if i % 3 == 2:
                    sent.append(("bad", c.submit_async(x0, bad_ids, w0)))
                else:
                    sent.append((i % 4, c.submit_async(*good[i % 4])))
            self.assertGreater(c.in_flight, 0)
            arrival = [p for p in c.as_completed([p for _, p in sent])]
            self.assertEqual(len(arrival), len(sent))
            ids_in_order = [p.id for p in arrival]
            self.assertNotEqual(ids_in_order, sorted(ids_in_order),
                                "no answer arrived out of submit order")
            for what, p in sent:
                if what == "bad":
                    self.assertIsInstance(p.exception(), epd.ExpertOutOfRange)
                    self.assertEqual(p.exception().id, p.id)
                else:
                    self.assertTrue((p.result() == c_side(c.path, *good[what])[1]).all())
                    self.assertIsInstance(p.step, int)
            self.assertEqual(c.in_flight, 0)
        print("pipelining: answers in arrival order", ids_in_order[:12], "...")


    def test_pipelining__layers_interleaved__every_result_right(self):
        batches = [make_batch(4 + i, 600 + i) for i in range(4)]
        with epd.Client(SOCKETS[1], timeout=30) as c:
            ps = [(i % 4, c.submit_async(*batches[i % 4], layer=i % 3)) for i in range(24)]
            for b, p in ps:
                self.assertTrue((p.result() == c_side(c.path, *batches[b])[1]).all())
            with self.assertRaises(epd.InvalidArgument):
                c.submit_async(*batches[0], layer=-1)  # refused before anything is sent
            self.assertEqual(c.in_flight, 0)
            good_client(self, c)


class TestControl(unittest.TestCase):
    def test_control__health_stats_config_metrics(self):
        with epd.Client(SOCKETS[1], timeout=10) as c:
            h = c.health()
            self.assertEqual((h["status"], h["rank"], h["world"]), ("ok", 1, len(SOCKETS)))
            cfg = c.config()
            self.assertEqual((cfg["model.hidden"], cfg["model.topk"], cfg["model.num_experts"]),
                             (H, K, E))
            s = c.stats()
            self.assertIn("errors", s["server"])
            m = c.metrics()
            self.assertIn("# TYPE", m)
            # pipelined CONTROLs and SUBMITs on one connection
            x, ids, w = make_batch(2, 5)
            ps = [c.control_async("health"), c.submit_async(x, ids, w), c.control_async("stats")]
            self.assertEqual(ps[0].result()[0]["rank"], 1)
            self.assertTrue((ps[1].result() == c_side(c.path, x, ids, w)[1]).all())
            self.assertIn("engine", ps[2].result()[0])


class TestErrors(unittest.TestCase):
    def expect(self, cls, c, *args, **kw):
        p = c.submit_async(*args, **kw)
        exc = p.exception()
        self.assertIs(type(exc), cls, "expected %s, got %r" % (cls.__name__, exc))
        self.assertEqual(exc.id, p.id)
        self.assertTrue(exc.message)
        return exc

    def test_errors__request_codes__raise_their_class_and_keep_the_connection(self):
        x, ids, w = make_batch(4, 1)
        with epd.Client(SOCKETS[0], timeout=20) as c:
            before = c.stats()["server"]["errors"]
            self.expect(epd.BadTensor, c, x.reshape(-1), ids, w)           # 1-D x
            self.expect(epd.BadTensor, c, x[:0], ids[:0], w[:0])           # N = 0
            self.expect(epd.UnsupportedDtype, c, x.view(np.float16), ids, w)
            self.expect(epd.UnsupportedDtype, c, x, ids, w.astype(np.float64))
            self.expect(epd.ShapeMismatch, c, x[:, :128], ids, w)          # H 128, not 256
            self.expect(epd.ShapeMismatch, c, x, ids[:, :3], w[:, :3])     # K 3
            self.expect(epd.ShapeMismatch, c, x, ids[:3], w[:3])           # N disagrees
            bad = ids.copy()
            bad[1, 2] = E
            self.expect(epd.ExpertOutOfRange, c, x, bad, w)
            bad[1, 2] = -2
            self.expect(epd.ExpertOutOfRange, c, x, bad, w)
            dup = np.array([[3, 3, 1, 2]] * 4, np.int32)
            self.expect(epd.InvalidTopk, c, x, dup, w)
            nan_w = w.copy()
            nan_w[0, 1] = np.nan
            self.expect(epd.NonFiniteInput, c, x, ids, nan_w)
            inf_x = x.copy()
            inf_x[3, 9] = 0x7F80
            self.expect(epd.NonFiniteInput, c, inf_x, ids, w)
            xb, ib, wb = make_batch(MAX_N + 1, 2)
            self.expect(epd.TooManyTokens, c, xb, ib, wb)
            with self.assertRaises(epd.UnknownOp) as cm:
                c.control("no_such_op")
            self.assertIsInstance(cm.exception.id, int)
            good_client(self, c)
            after = c.stats()["server"]["errors"]
        # the daemon counted what the client saw
        want = {"bad_tensor": 2, "unsupported_dtype": 2, "shape_mismatch": 3,
                "expert_out_of_range": 2, "invalid_topk": 1, "non_finite_input": 2,
                "too_many_tokens": 1, "unknown_op": 1}
        got = {k: after.get(k, 0) - before.get(k, 0) for k in want}
        self.assertEqual(got, want)

    def test_errors__full_queue__is_busy_and_nothing_is_lost(self):
        # rank 1 stopped: no agreement completes, so rank 0's 512-token queue keeps exactly 8
        # requests of 64 tokens and answers the other 12 busy at once; resumed, the 8 are served
        x, ids, w = make_batch(MAX_N, 3)
        want = c_side(SOCKETS[0], x, ids, w)[1]
        with epd.Client(SOCKETS[1], timeout=10) as c1:
            pid1 = c1.health()["pid"]
        with epd.Client(SOCKETS[0], timeout=30) as c:
            os.kill(pid1, signal.SIGSTOP)
            try:
                ps = [c.submit_async(x, ids, w) for _ in range(20)]
                busy = [p for p in ps[8:] if isinstance(p.exception(), epd.Busy)]
            finally:
                os.kill(pid1, signal.SIGCONT)
            self.assertEqual(len(busy), 12, [repr(p.exception()) for p in ps[8:]])
            for p in ps[:8]:
                self.assertTrue((p.result() == want).all())
            good_client(self, c)

    def test_errors__too_many_clients__is_busy(self):
        # max_clients is 24 per rank: hold 24 more connections than the test's own
        held, refused = [], None
        try:
            for _ in range(40):
                c = epd.Client(SOCKETS[1], timeout=10)
                held.append(c)
                try:
                    c.health()
                except epd.Busy as e:
                    refused = e
                    break
        finally:
            for c in held:
                c.close()
        self.assertIsNotNone(refused, "40 clients were all admitted (max_clients 24)")
        self.assertIsNone(refused.id)

    def framing(self, data, cls):
        with epd.Client(SOCKETS[0], timeout=20) as c:
            c.send_raw(data)
            with self.assertRaises(cls) as cm:
                c.health()
            with self.assertRaises(epd.ConnectionClosed):
                c.health()
            return cm.exception

    def test_errors__framing_codes__raise_their_class_and_close(self):
        good = fr.encode_meta({"op": "health"})
        self.framing(b"XPD1" + fr.encode_header(fr.CONTROL, len(good), 0)[4:] + good,
                     epd.BadMagic)
        head = bytearray(fr.encode_header(fr.CONTROL, len(good), 0))
        head[4] = 2
        self.framing(bytes(head) + good, epd.BadVersion)
        self.framing(fr.encode_header(9, len(good), 0) + good, epd.BadType)
        exc = self.framing(fr.encode(fr.RESULT, {"id": 5, "tensors": {}}), epd.BadType)
        self.assertEqual(exc.id, 5)
        head = bytearray(fr.encode_header(fr.CONTROL, len(good), 0))
        head[12] = 1
        self.framing(bytes(head) + good, epd.BadHeader)
        self.framing(fr.encode_header(fr.CONTROL, 65537, 0), epd.FrameTooLarge)
        self.framing(fr.encode(fr.CONTROL, b"not json"), epd.BadJson)
        self.framing(fr.encode(fr.SUBMIT, {"tensors": {}}), epd.BadJson)

    def test_errors__submit_over_max_frame_bytes__is_frame_too_large(self):
        # 2100 x 256 bf16 is over 1 MiB: refused from the header, before the payload
        x, ids, w = make_batch(2100, 4, empty_slots=False)
        with epd.Client(SOCKETS[0], timeout=20) as c:
            p = c.submit_async(x, ids, w)
            self.assertIsInstance(p.exception(), epd.FrameTooLarge)
            with self.assertRaises(epd.ConnectionClosed):
                c.health()
        with epd.Client(SOCKETS[0], timeout=20) as c:
            good_client(self, c)


if __name__ == "__main__":
    unittest.main(verbosity=2)
