#!/usr/bin/env python3
"""The Python client without a daemon: bf16 rounding, the frame codec, every wire code as its
exception (answered by a scripted stand-in daemon, fake_daemon.py), answers matched by id in any
order, REPLYs with and without an echoed id, closed and silent peers, protocol errors, a host
region's fd through SCM_RIGHTS, AsyncClient and Group."""
import asyncio
import mmap
import os
import random
import struct
import sys
import time
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, HERE)
import epd  # noqa: E402
from epd import frame as fr  # noqa: E402
from fake_daemon import FakeDaemon, x_bytes  # noqa: E402

# DESIGN.md section 4's list, written out here so that a code missing from the package fails.
FRAMING = ["bad_magic", "bad_version", "bad_type", "bad_header", "frame_too_large", "bad_json"]
REQUEST = ["bad_tensor", "unsupported_dtype", "shape_mismatch", "expert_out_of_range",
           "invalid_topk", "non_finite_input", "too_many_tokens", "unknown_layer", "bad_region",
           "experts_unavailable", "busy", "shutting_down", "unknown_op", "internal"]
H, K = 128, 4


def batch(n, seed=0):
    rng = np.random.default_rng(seed)
    x = epd.bf16.from_f32(rng.standard_normal((n, H)).astype(np.float32))
    ids = np.tile(np.arange(K, dtype=np.int32), (n, 1))
    w = np.full((n, K), 0.25, np.float32)
    return x, ids, w


def echo(peer, count=None):
    """Answers every SUBMIT with y = x, every CONTROL with a REPLY echoing op and id."""
    served = 0
    while count is None or served < count:
        ftype, meta, payload = peer.read()
        if ftype == fr.SUBMIT:
            n, h = meta["tensors"]["x"]["shape"]
            peer.result(meta["id"], x_bytes(meta, payload), n, h)
        else:
            peer.send(fr.REPLY, {"id": meta["id"], "op": meta["op"]})
        served += 1


def bf16_ref(value):
    u = struct.unpack("<I", struct.pack("<f", value))[0]
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return ((u >> 16) | 0x40) & 0xFFFF
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


class TestBf16(unittest.TestCase):
    def test_bf16__random_bits_and_specials__match_common_bf16_h(self):
        rng = np.random.default_rng(7)
        bits = rng.integers(0, 1 << 32, 20000, dtype=np.uint64).astype(np.uint32)
        special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001,
                            0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x00000001],
                           np.uint32)
        f = np.concatenate([bits, special]).view(np.float32)
        got = epd.bf16.from_f32(f)
        want = np.array([bf16_ref(struct.unpack("<f", struct.pack("<I", int(u)))[0])
                         for u in np.concatenate([bits, special])], np.uint16)
        # NaN payloads may change through a python float; compare NaN-ness there
        nan = np.isnan(f)
        self.assertTrue((got[~nan] == want[~nan]).all())
        self.assertTrue(np.isnan(epd.bf16.to_f32(got[nan])).all())
        self.assertEqual(epd.bf16.from_f32(np.float32(1.00390625)).item(), 0x3F80)  # tie: even
        self.assertEqual(epd.bf16.from_f32(np.float32(1.01171875)).item(), 0x3F82)  # tie: up

    def test_bf16__widening__is_exact(self):
        h = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
        f = epd.bf16.to_f32(h)
        self.assertTrue(((f.view(np.uint32) >> 16).astype(np.uint16) == h).all())
        fin = epd.bf16.is_finite(h)
        self.assertTrue((fin == np.isfinite(f)).all())


class TestFrame(unittest.TestCase):
    def test_frame__header__round_trips_and_rejects(self):
        head = fr.encode_header(fr.RESULT, 17, 1 << 40)
        self.assertEqual(len(head), 24)
        self.assertEqual(fr.decode_header(head), (fr.RESULT, 17, 1 << 40))
        bad = [b"XPD1" + head[4:], head[:4] + struct.pack("<H", 2) + head[6:],
               head[:6] + struct.pack("<H", 9) + head[8:], head[:12] + b"\1\0\0\0" + head[16:],
               head[:8] + struct.pack("<I", 65537) + head[12:]]
        for b in bad:
            with self.assertRaises(epd.ProtocolError):
                fr.decode_header(b)

    def test_frame__submit_meta__written_as_json_dumps_would(self):
        from epd._session import Session, _Placement

        class Whole:  # a registered host region holding every array, at a fixed offset
            def contains(self, address, nbytes):
                return 4096

        rng = random.Random(5)
        for trial in range(200):
            s = Session()
            s.host = [(Whole(), 1 + trial % 3)] if trial % 2 else []
            n, h, k = rng.randint(1, 300), rng.choice([4, 7168]), rng.choice([1, 8])
            x = np.zeros((n, h), np.uint16)
            ids = np.zeros((n, k), rng.choice([np.int32, np.int64]))
            w = np.zeros((n, k), np.float32)
            out = np.zeros((n, h), np.uint16) if trial % 4 == 1 else None
            layer = rng.choice([None, 0, 3, (1 << 31) - 1])
            placed, needs = s.plan_submit(x, ids, w, out)
            p, bufs = s.submit(placed, x, out, layer)
            head = bytes(bufs[0])
            ftype, meta_len, payload_len = fr.decode_header(head[:fr.HEADER_LEN])
            text = head[fr.HEADER_LEN:fr.HEADER_LEN + meta_len]
            # the same meta as a dict, the way it was written before (json.dumps)
            tensors, at = {}, 0
            for name in ("x", "topk_ids", "topk_weights", "y"):
                if name in placed and placed[name].data is None:
                    tensors[name] = placed[name].descriptor()
            order = sorted((q for q in ("x", "topk_ids", "topk_weights")
                            if placed[q].data is not None),
                           key=lambda q: -fr.DTYPE_SIZES.get(placed[q].dtype, 1))
            for name in order:
                tensors[name] = placed[name].descriptor(at)
                at += len(placed[name].data)
            meta = {"id": p.id, "tensors": tensors}
            if layer is not None:
                meta["layer"] = layer
            self.assertEqual(text, fr.encode_meta(meta))
            self.assertEqual(payload_len, at)
        self.assertIsInstance(_Placement("bf16", [2, 3], region=1, offset=0).text(), str)

    def test_frame__receiver__any_split_gives_the_same_frames(self):
        frames = [fr.encode(fr.REPLY, {"id": 1, "op": "health"}),
                  fr.encode(fr.RESULT, {"id": 2}, bytes(range(256)) * 3),
                  fr.encode(fr.ERROR, {"id": None, "code": "busy", "message": "m"})]
        stream = b"".join(frames)
        rng = random.Random(3)
        for _ in range(20):
            rx, out, at = fr.Receiver(), [], 0
            while at < len(stream):
                want = rx.want()
                n = min(len(want), rng.randint(1, 40), len(stream) - at)
                want[:n] = stream[at:at + n]
                at += n
                f = rx.got(n)
                if f is not None:
                    out.append((f[0], f[1], bytes(f[2])))
            self.assertEqual([t for t, _, _ in out], [fr.REPLY, fr.RESULT, fr.ERROR])
            self.assertEqual(out[1][2], bytes(range(256)) * 3)
            self.assertTrue(rx.idle())


    def test_frame__receiver_take__chunks_of_any_size_give_the_frames_of_want_and_got(self):
        frames = [fr.encode(fr.REPLY, {"id": 1, "op": "health"}),
                  fr.encode(fr.RESULT, {"id": 2}, bytes(range(256)) * 3),
                  fr.encode(fr.RESULT, {"id": 3}, b""),
                  fr.encode(fr.ERROR, {"id": None, "code": "busy", "message": "m"}),
                  fr.encode(fr.RESULT, {"id": 4}, bytes(range(7)))]
        stream = b"".join(frames)
        placed = bytearray(7)
        rng = random.Random(4)
        for chunk_max in (1, 30, 200, len(stream)):  # whole frames at once, and split ones
            rx = fr.Receiver(lambda t, m, n: memoryview(placed) if m.get("id") == 4 else None)
            out, at = [], 0
            while at < len(stream):
                chunk = memoryview(bytearray(stream[at:at + rng.randint(1, chunk_max)]))
                used_all = 0
                while used_all < len(chunk):
                    used, f = rx.take(chunk[used_all:])
                    self.assertGreater(used, 0)
                    used_all += used
                    if f is not None:
                        out.append((f[0], f[1], bytes(f[2]), f[2].obj is placed))
                chunk[:] = bytes(len(chunk))  # the caller reuses its buffer: frames keep theirs
                at += len(chunk)
            self.assertEqual([(t, m["id"]) for t, m, _, _ in out],
                             [(fr.REPLY, 1), (fr.RESULT, 2), (fr.RESULT, 3), (fr.ERROR, None),
                              (fr.RESULT, 4)])
            self.assertEqual(out[1][2], bytes(range(256)) * 3)
            self.assertEqual(out[2][2], b"")
            self.assertEqual((out[4][2], out[4][3]), (bytes(range(7)), True))
            self.assertTrue(rx.idle())
        for bad in (b"XPD1" + stream[4:24], fr.encode_header(fr.RESULT, 1, 0) + b"{"):
            with self.assertRaises(epd.ProtocolError):
                fr.Receiver().take(memoryview(bad + bytes(64)))


class TestErrors(unittest.TestCase):
    def test_errors__every_wire_code__has_its_class(self):
        self.assertEqual(sorted(epd.WIRE_ERRORS), sorted(FRAMING + REQUEST))
        for code in FRAMING + REQUEST:
            exc = epd.error_from_meta({"id": 42, "code": code, "message": "why"})
            self.assertIs(type(exc), epd.WIRE_ERRORS[code])
            self.assertEqual((exc.code, exc.message, exc.id), (code, "why", 42))
            self.assertIsInstance(exc, epd.EpdError)
            self.assertIsInstance(exc, epd.FramingError if code in FRAMING
                                  else epd.RequestError)
        self.assertIs(epd.Busy, epd.WIRE_ERRORS["busy"])
        self.assertIs(epd.ShuttingDown, epd.WIRE_ERRORS["shutting_down"])

    def test_errors__unknown_code__is_a_daemon_error_with_that_code(self):
        exc = epd.error_from_meta({"id": None, "code": "brand_new", "message": "m"})
        self.assertIs(type(exc), epd.DaemonError)
        self.assertEqual((exc.code, exc.id), ("brand_new", None))
        self.assertIsInstance(epd.error_from_meta({"id": 1}), epd.ProtocolError)


class TestClientFake(unittest.TestCase):
    def run_fake(self, handler, body):
        fake = FakeDaemon(handler)
        with fake as path:
            body(path)
        self.assertEqual(fake.errors, [])

    def test_client__every_code_as_an_answer__raises_its_class(self):
        codes = REQUEST + FRAMING

        def handler(peer):
            for code in codes:
                ftype, meta, payload = peer.read()
                peer.error(meta["id"], code, "scripted %s" % code)
                if code in FRAMING:
                    return  # the daemon closes after a framing error
                ftype, meta, payload = peer.read()  # the connection still serves
                n, h = meta["tensors"]["x"]["shape"]
                peer.result(meta["id"], x_bytes(meta, payload), n, h)

        def body(path):
            x, ids, w = batch(2)
            with epd.Client(path, timeout=10) as c:
                for code in codes:
                    p = c.submit_async(x, ids, w)
                    with self.assertRaises(epd.WIRE_ERRORS[code]) as cm:
                        p.result()
                    self.assertEqual((cm.exception.code, cm.exception.id), (code, p.id))
                    self.assertEqual(cm.exception.message, "scripted %s" % code)
                    if code in FRAMING:
                        break
                    self.assertTrue((c.submit(x, ids, w) == x).all())
                with self.assertRaises(epd.ConnectionClosed):
                    c.health()
        self.run_fake(handler, body)

    def test_client__framing_codes__each_closes_the_connection(self):
        for code in FRAMING:
            def handler(peer, code=code):
                peer.read()
                peer.error(None, code)

            def body(path, code=code):
                with epd.Client(path, timeout=10) as c:
                    p = c.control_async("health")
                    with self.assertRaises(epd.WIRE_ERRORS[code]) as cm:
                        p.result()
                    self.assertIsNone(cm.exception.id)
                    with self.assertRaises(epd.ConnectionClosed):
                        c.health()
            self.run_fake(handler, body)

    def test_client__error_without_id__fails_every_request_in_flight(self):
        def handler(peer):
            for _ in range(5):
                peer.read()
            peer.error(None, "busy", "too many clients")

        def body(path):
            x, ids, w = batch(1)
            with epd.Client(path, timeout=10) as c:
                ps = [c.submit_async(x, ids, w) for _ in range(5)]
                for p in ps:
                    self.assertIsInstance(p.exception(), epd.Busy)
        self.run_fake(handler, body)

    def test_client__answers_in_reverse_order__are_matched_by_id(self):
        def handler(peer):
            got = [peer.read() for _ in range(16)]
            for ftype, meta, payload in reversed(got):
                n, h = meta["tensors"]["x"]["shape"]
                peer.result(meta["id"], x_bytes(meta, payload), n, h, step=meta["id"])

        def body(path):
            with epd.Client(path, timeout=10) as c:
                batches = [batch(1 + i, seed=i) for i in range(16)]
                ps = [c.submit_async(*b) for b in batches]
                order = [p.id for p in c.as_completed(ps)]
                self.assertEqual(order, [p.id for p in reversed(ps)])
                for b, p in zip(batches, ps):
                    self.assertTrue((p.result() == b[0]).all())
                    self.assertEqual(p.step, p.id)
        self.run_fake(handler, body)

    def test_client__out_array__receives_the_payload(self):
        def body(path):
            x, ids, w = batch(3)
            out = np.zeros_like(x)
            with epd.Client(path, timeout=10) as c:
                y = c.submit(x, ids, w, out=out)
                self.assertIs(y, out)
                self.assertTrue((out == x).all())
                with self.assertRaises(epd.InvalidArgument):
                    c.submit(x, ids, w, out=np.zeros((3, H + 1), np.uint16))
        self.run_fake(lambda peer: echo(peer), body)

    def test_client__i64_ids__travel_as_i64_in_the_payload(self):
        seen = []

        def handler(peer):
            ftype, meta, payload = peer.read()
            seen.append(meta["tensors"]["topk_ids"]["dtype"])
            b, e = meta["tensors"]["topk_ids"]["data_offsets"]
            seen.append(np.frombuffer(payload[b:e], np.int64).tolist())
            n, h = meta["tensors"]["x"]["shape"]
            peer.result(meta["id"], x_bytes(meta, payload), n, h)

        def body(path):
            x, _, w = batch(1)
            with epd.Client(path, timeout=10) as c:
                c.submit(x, np.array([[3, -1, 7, 0]], np.int64), w, layer=2)
        self.run_fake(handler, body)
        self.assertEqual(seen, ["i64", [3, -1, 7, 0]])

    def test_client__replies_with_and_without_id__go_to_their_control(self):
        def handler(peer):
            a = peer.read()[1]
            b = peer.read()[1]
            c_ = peer.read()[1]
            peer.send(fr.REPLY, {"id": b["id"], "op": b["op"]})   # echoed id, out of order
            peer.send(fr.REPLY, {"op": a["op"]})                  # no id: the oldest CONTROL
            peer.send(fr.REPLY, {"op": c_["op"]}, b"text")

        def body(path):
            with epd.Client(path, timeout=10) as c:
                pa, pb, pc = (c.control_async(op) for op in ("health", "stats", "metrics"))
                self.assertEqual(pb.result()[0]["op"], "stats")
                self.assertEqual(pa.result()[0]["op"], "health")
                self.assertEqual(pc.result(), ({"op": "metrics"}, b"text"))
        self.run_fake(handler, body)

    def test_client__peer_closes_with_requests_in_flight__raises_closed(self):
        def handler(peer):
            for _ in range(3):
                peer.read()
            peer.sock.sendall(fr.encode_header(fr.RESULT, 100, 0)[:10])  # half a header

        def body(path):
            x, ids, w = batch(1)
            with epd.Client(path, timeout=10) as c:
                t0 = time.monotonic()
                ps = [c.submit_async(x, ids, w) for _ in range(3)]
                for p in ps:
                    self.assertIsInstance(p.exception(), epd.ConnectionClosed)
                self.assertLess(time.monotonic() - t0, 5)
                with self.assertRaises(epd.ConnectionClosed):
                    c.submit(x, ids, w)
        self.run_fake(handler, body)

    def test_client__spinning_wait__answers_before_and_after_the_spin(self):
        delays = [0.0, 0.005, 0.08]  # within a 30 ms spin, then past it (the poll(2) path)

        def handler(peer):
            for delay in delays:
                ftype, meta, payload = peer.read()
                time.sleep(delay)
                n, h = meta["tensors"]["x"]["shape"]
                peer.result(meta["id"], x_bytes(meta, payload), n, h)

        def body(path):
            x, ids, w = batch(2)
            with epd.Client(path, timeout=10, spin=0.03) as c:
                self.assertEqual(c.spin, 0.03)
                for _ in delays:
                    y = c.submit(x, ids, w)
                    self.assertEqual(bytes(y), bytes(x))
        self.run_fake(handler, body)

    def test_client__spin__default_follows_libepd_and_never_outlasts_the_timeout(self):
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:
            cpus = os.cpu_count()

        def handler(peer):
            peer.read()
            time.sleep(0.6)

        def body(path):
            with epd.Client(path, timeout=10) as c:
                self.assertEqual(c.spin, 200e-6 if cpus >= 4 else 0.0)
            with epd.Client(path, timeout=10, spin=0) as c:
                self.assertEqual(c.spin, 0.0)
            x, ids, w = batch(1)
            with epd.Client(path, timeout=0.1, spin=5.0) as c:
                t0 = time.monotonic()
                with self.assertRaises(epd.Timeout):
                    c.submit(x, ids, w)
                self.assertLess(time.monotonic() - t0, 0.5)
        self.run_fake(handler, body)

    def test_client__silent_peer__times_out(self):
        def handler(peer):
            peer.read()
            time.sleep(0.5)

        def body(path):
            x, ids, w = batch(1)
            with epd.Client(path, timeout=0.2) as c:
                with self.assertRaises(epd.Timeout):
                    c.submit(x, ids, w)
        self.run_fake(handler, body)

    def test_client__garbage_from_peer__is_a_protocol_error(self):
        def handler(peer):
            peer.read()
            peer.sock.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            time.sleep(0.2)

        def body(path):
            with epd.Client(path, timeout=10) as c:
                with self.assertRaises(epd.ProtocolError):
                    c.health()
                with self.assertRaises(epd.ConnectionClosed):
                    c.health()
        self.run_fake(handler, body)

    def test_client__no_daemon__is_a_connect_error(self):
        with self.assertRaises(epd.ConnectError) as cm:
            epd.Client("/nonexistent/epd.sock")
        self.assertIn("/nonexistent/epd.sock", str(cm.exception))

    def test_client__host_region__fd_travels_and_y_is_written_there(self):
        def handler(peer):
            ftype, meta, _ = peer.read()
            assert ftype == fr.CONTROL and meta["op"] == "register" and meta["kind"] == "host"
            assert len(peer.fds) == 1, "no fd came with the register frame"
            fd = peer.fds[0]
            assert os.fstat(fd).st_size >= meta["bytes"]
            mem = mmap.mmap(fd, meta["bytes"])
            peer.send(fr.REPLY, {"id": meta["id"], "region": 7, "bytes": meta["bytes"]})
            ftype, meta, payload = peer.read()
            t = meta["tensors"]
            assert payload == b"" and {d["region"] for d in t.values()} == {7}, t
            assert t["topk_ids"]["dtype"] == "i64", t["topk_ids"]
            n, h = t["x"]["shape"]
            x = np.frombuffer(mem, np.uint16, n * h, t["x"]["offset"])
            y = np.frombuffer(mem, np.uint16, n * h, t["y"]["offset"])
            y[:] = x[::-1]
            peer.send(fr.RESULT, {"id": meta["id"], "step": 3, "tensors": {"y": t["y"]}})
            ftype, meta, _ = peer.read()
            assert meta["op"] == "unregister" and meta["region"] == 7
            peer.send(fr.REPLY, {"id": meta["id"]})
            del x, y
            mem.close()

        def body(path):
            x, ids, w = batch(4)
            with epd.Client(path, timeout=10) as c:
                region = c.host_region(1 << 16)
                rx, rids, rw, ry = (region.take(x.shape, np.uint16),
                                    region.take(ids.shape, np.int64),
                                    region.take(w.shape, np.float32),
                                    region.take(x.shape, np.uint16))
                rx[:], rids[:], rw[:] = x, ids, w
                y = c.submit(rx, rids, rw, out=ry)
                self.assertIs(y, ry)
                self.assertTrue((ry == x.reshape(-1)[::-1].reshape(x.shape)).all())
                c.unregister(region)
                region.close()
        self.run_fake(handler, body)

    def test_group__split_batch__comes_back_in_row_order(self):
        fakes = [FakeDaemon(lambda peer: echo(peer)) for _ in range(3)]
        paths = [f.__enter__() for f in fakes]
        try:
            x, ids, w = batch(8)
            with epd.Group(paths, timeout=10) as g:
                self.assertEqual(len(g.health()), 3)
                self.assertTrue((g.submit(x, ids, w) == x).all())
                ys = g.submit_each([batch(2, 1), None, batch(1, 2)])
                self.assertIsNone(ys[1])
                self.assertTrue((ys[2] == batch(1, 2)[0]).all())
        finally:
            for f in fakes:
                f.__exit__(None, None, None)
                self.assertEqual(f.errors, [])


class TestAsyncFake(unittest.TestCase):
    def test_async__pipelined_answers_out_of_order__and_every_code(self):
        codes = REQUEST

        def handler(peer):
            got = [peer.read() for _ in range(10)]
            for ftype, meta, payload in reversed(got):
                n, h = meta["tensors"]["x"]["shape"]
                peer.result(meta["id"], x_bytes(meta, payload), n, h)
            for code in codes:
                ftype, meta, payload = peer.read()
                peer.error(meta["id"], code)
            meta = peer.read()[1]
            peer.send(fr.REPLY, {"id": meta["id"], "status": "ok"})
            peer.read()
            peer.error(None, "bad_json")

        async def main(path):
            c = await epd.AsyncClient.connect(path, timeout=10)
            batches = [batch(1 + i, seed=i) for i in range(10)]
            ys = await asyncio.gather(*(c.submit(*b) for b in batches))
            for b, y in zip(batches, ys):
                self.assertTrue((y == b[0]).all())
            for code in codes:
                with self.assertRaises(epd.WIRE_ERRORS[code]):
                    await c.submit(*batches[0])
            self.assertEqual((await c.health())["status"], "ok")
            with self.assertRaises(epd.BadJson):
                await c.health()
            with self.assertRaises(epd.ConnectionClosed):
                await c.health()
            await c.close()

        fake = FakeDaemon(handler)
        with fake as path:
            asyncio.run(main(path))
        self.assertEqual(fake.errors, [])

    def test_async__host_region_fd__and_closed_peer(self):
        def handler(peer):
            meta = peer.read()[1]
            assert len(peer.fds) == 1 and os.fstat(peer.fds[0]).st_size >= meta["bytes"]
            peer.send(fr.REPLY, {"id": meta["id"], "region": 1, "bytes": meta["bytes"]})
            peer.read()
            peer.read()

        async def main(path):
            c = await epd.AsyncClient.connect(path, timeout=10)
            region = await c.host_region(4096)
            x, ids, w = batch(1)
            futs = [await c.submit_async(x, ids, w) for _ in range(2)]
            for f in futs:
                with self.assertRaises(epd.ConnectionClosed):
                    await f
            await c.close()
            region.close()

        fake = FakeDaemon(handler)
        with fake as path:
            asyncio.run(main(path))
        self.assertEqual(fake.errors, [])


if __name__ == "__main__":
    unittest.main(verbosity=2)
