#!/usr/bin/env python3
"""External experts against the real daemon (run by tests/integration/external_experts.sh: H 256,
E 8, K 3, experts.kind external, experts.external_timeout_ms 1000). Every rank has a frontend
thread with ONE connection that both serves its rank's experts (Client.serve_experts, scale
experts in numpy) and submits its own tokens, as a deployment with one frontend per GPU does.

The data is chosen so that a worker's BF16 output is exactly the fp32 value experts.kind=scale
uses (y = x' * f_e, f_e = 1 + e/8: 4 significant bits times x' with 4, every group's largest
magnitude 1.75 * 2^j so that the FP8 scales are powers of two): then the results must equal the
host reference of experts.kind=scale (py_ref, which the daemon's scale kind equals) bit for bit.

EPDX_CASE: exact (random batches on every rank, empty steps; Client and AsyncClient workers),
static (fp8_per_tensor with a static input_scale), failures (no worker, a second worker, a worker
that dies mid-step, one that is late, one whose callback raises, EXPERTS_DONE for a wrong step or
from a non-worker, EXPERTS sent by a client).
Environment: EPDPY_SOCKETS (rank order), EPDPY_REF, EPDPY_TMP, EPDX_CASE; EPDX_DEVICE (e.g.
cuda:0, tests/gpu/external_gpu.sh): the workers' regions are device memory there, the experts run
in torch on it."""
import asyncio
import os
import queue
import subprocess
import sys
import threading
import time
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import epd  # noqa: E402
from epd import frame as fr  # noqa: E402

SOCKETS = os.environ.get("EPDPY_SOCKETS", "").split(":")
PY_REF = os.environ.get("EPDPY_REF", "build/tests/py_ref")
TMP = os.environ.get("EPDPY_TMP", "/tmp")
CASE = os.environ.get("EPDX_CASE", "exact")
W = len(SOCKETS)
STATIC_S = 2.0 ** -5
DEVICE = os.environ.get("EPDX_DEVICE") or None  # a torch CUDA device: the workers' regions there

with epd.Client(SOCKETS[0], timeout=20) as _c:
    CFG = _c.config()
H, E, K = CFG["model.hidden"], CFG["model.num_experts"], CFG["model.topk"]
PER_RANK = E // W


def factor(e):
    return np.float32(1.0) + np.float32(e) / np.float32(E)


class ScaleWorker:
    """scale experts on a batch's rows, in numpy fp32 (what the daemon's scale kind computes,
    then rounded to the worker's BF16 output)."""

    def __init__(self):
        self.batches = []

    def __call__(self, batch):
        self.batches.append((batch.step, batch.layer, batch.rows, batch.scale, list(batch.counts)))
        for e, x, sc, y in batch.experts():
            if batch.on_device:  # torch views of device regions (EPDX_DEVICE)
                import torch
                y[...] = (batch.dequantized(x, sc) * float(factor(e))).to(torch.bfloat16)
            else:
                y[...] = epd.bf16.from_f32(batch.dequantized(x, sc) * factor(e))


def exact_batch(n, seed, experts=None, empty=True):
    """n tokens whose every group of 128 has its largest magnitude 1.75 * 2^j and every value 4
    significant bits; K distinct ids among `experts` (default all), some slots -1."""
    rng = np.random.default_rng(seed)
    mant = (8 + rng.integers(0, 8, (n, H))) / 8.0
    j = rng.integers(-2, 3, (n, H // 128))
    p = np.repeat(j, 128, axis=1) - rng.integers(0, 6, (n, H))
    x = (mant * 2.0 ** p * rng.choice([-1.0, 1.0], (n, H))).astype(np.float32)
    x = np.minimum(np.abs(x), 1.75 * 2.0 ** np.repeat(j, 128, axis=1)) * np.sign(x)
    for t in range(n):
        for g in range(H // 128):
            x[t, g * 128 + rng.integers(0, 128)] = 1.75 * 2.0 ** j[t, g] * rng.choice([-1, 1])
    pool = np.arange(E) if experts is None else np.asarray(experts)
    ids = np.stack([rng.permutation(pool)[:K] if len(pool) >= K else
                    np.concatenate([rng.permutation(pool), -np.ones(K - len(pool), int)])
                    for _ in range(n)]).astype(np.int32)
    if empty:
        ids[rng.random((n, K)) < 0.15] = -1
    w = rng.random((n, K)).astype(np.float32)
    return epd.bf16.from_f32(x), ids, w


def reference(x, ids, w):
    """experts.kind=scale's y for the batch on this job's shape (epd_moe_reference via py_ref)."""
    n = x.shape[0]
    src, dst = os.path.join(TMP, "ext_ref.in"), os.path.join(TMP, "ext_ref.out")
    with open(src, "wb") as f:
        f.write(np.array([n, H, K], np.uint32).tobytes() + x.tobytes() +
                ids.astype(np.int32).tobytes() + w.tobytes())
    subprocess.run([PY_REF, "-", src, dst, str(W), str(E), CFG["dispatch.dtype"],
                    CFG["dispatch.scale"], CFG["dispatch.scale_format"], "scale",
                    CFG["combine.dtype"]], check=True, timeout=30)
    return np.fromfile(dst, np.uint16).reshape(2, n, H)[0]


def touches(ids, rank):
    return bool(((ids >= rank * PER_RANK) & (ids < (rank + 1) * PER_RANK)).any())


class Frontend(threading.Thread):
    """One rank's frontend: one connection that serves the rank's experts and submits the
    batches it is given (results, or the exception, go to .out)."""

    def __init__(self, rank, worker=None, input_scale=None, serve=True):
        super().__init__(daemon=True)
        self.rank = rank
        self.worker = worker or ScaleWorker()
        self.tasks, self.out = queue.Queue(), queue.Queue()
        self.c = epd.Client(SOCKETS[rank], timeout=30)
        self.reply = self.c.serve_experts(self.worker, input_scale=input_scale,
                                          device=DEVICE) if serve else None
        self.stopping = False
        self.start()

    def run(self):
        try:
            while not self.stopping:
                try:
                    task = self.tasks.get_nowait()
                except queue.Empty:
                    self.c.serve(timeout=0.01)
                    continue
                try:
                    self.out.put(self.c.submit(*task))
                except epd.EpdError as e:
                    self.out.put(e)
        except epd.ConnectionClosed as e:
            self.out.put(e)

    def submit(self, x, ids, w):
        self.tasks.put((x, ids, w))

    def result(self, timeout=60):
        return self.out.get(timeout=timeout)

    def stop(self):
        self.stopping = True
        self.join(10)
        self.c.close()


class External(unittest.TestCase):
    def check_round(self, fronts, seed, n_of=lambda r: 1 + 13 * r, experts=None):
        batches = [exact_batch(n_of(r), seed + r, experts) for r in range(W)]
        for f, b in zip(fronts, batches):
            f.submit(*b)
        for f, b in zip(fronts, batches):
            y = f.result()
            self.assertIsInstance(y, np.ndarray, "rank %d: %r" % (f.rank, y))
            ref = reference(*b)
            bad = np.argwhere(y != ref)
            self.assertEqual(len(bad), 0, "rank %d: %d values differ from scale's, first at %s"
                             % (f.rank, len(bad), bad[:1].tolist()))


@unittest.skipUnless(CASE in ("exact", "static"), "case " + CASE)
class TestExact(External):
    def test_external__scale_worker__equals_scale_bit_for_bit(self):
        scale = {"0": STATIC_S} if CASE == "static" else None
        fronts = [Frontend(r, input_scale=scale) for r in range(W)]
        try:
            for i in range(4):
                self.check_round(fronts, 100 * i, n_of=lambda r: [1, 7, 64, 33][(i + r) % 4])
            seen = [b for f in fronts for b in f.worker.batches]
            self.assertGreater(len(seen), 0)
            if CFG["experts.external_input"] == "fp8_per_tensor":
                for step, layer, rows, s, counts in seen:
                    if CASE == "static":
                        self.assertEqual(s, STATIC_S)
                    else:
                        self.assertTrue(s is not None and s > 0 and s <= 2.0 ** -6, s)
            for f in fronts:
                self.assertEqual(f.reply["experts"], PER_RANK)
                self.assertEqual(f.reply["first_expert"], f.rank * PER_RANK)
            print("rank workers served %d EXPERTS; every result equals scale's" % len(seen))
        finally:
            for f in fronts:
                f.stop()

    def test_external__a_rank_without_rows__gets_no_experts(self):
        fronts = [Frontend(r) for r in range(W)]
        try:
            before = [len(f.worker.batches) for f in fronts]
            x, ids, w = exact_batch(9, 7, experts=range(PER_RANK))  # rank 0's experts only
            fronts[W - 1].submit(x, ids, w)
            y = fronts[W - 1].result()
            self.assertTrue((y == reference(x, ids, w)).all())
            after = [len(f.worker.batches) for f in fronts]
            self.assertEqual(after[0], before[0] + 1, "rank 0 served its rows")
            self.assertEqual(after[1:], before[1:], "ranks without rows got EXPERTS")
            # tokens whose every slot is empty reach nobody: zeros, and no EXPERTS anywhere
            ids[:] = -1
            fronts[0].submit(x, ids, w)
            y = fronts[0].result()
            self.assertTrue((y == 0).all())
            self.assertEqual([len(f.worker.batches) for f in fronts], after)
        finally:
            for f in fronts:
                f.stop()


    def test_external__async_workers__equal_scale_bit_for_bit(self):
        """AsyncClient.serve_experts: one AsyncClient a rank serves its experts (a coroutine
        callback on rank 0, a function on the others) and submits on the same connection, every
        rank's batch at once."""
        workers = [ScaleWorker() for _ in range(W)]

        async def first_worker(batch):
            await asyncio.sleep(0)
            workers[0](batch)

        async def run():
            clients = [await epd.AsyncClient.connect(SOCKETS[r], timeout=30) for r in range(W)]
            try:
                for r, c in enumerate(clients):
                    reply = await c.serve_experts(first_worker if r == 0 else workers[r],
                                                  device=DEVICE)
                    self.assertEqual(reply["first_expert"], r * PER_RANK)
                    with self.assertRaises(epd.InvalidArgument):
                        await c.serve_experts(workers[r])
                results = []
                for i in range(3):
                    batches = [exact_batch([5, 40, 17][(i + r) % 3], 700 + 10 * i + r)
                               for r in range(W)]
                    ys = await asyncio.gather(*(c.submit(*b) for c, b in zip(clients, batches)))
                    results.extend(zip(ys, batches))
                await clients[0].serve(timeout=0.05)  # no failure: returns after the time
                return results
            finally:
                for c in clients:
                    await c.close()

        for r, (y, b) in enumerate(asyncio.run(run())):
            bad = np.argwhere(y != reference(*b))
            self.assertEqual(len(bad), 0, "batch %d: %d values differ from scale's, first at %s"
                             % (r, len(bad), bad[:1].tolist()))
        self.assertGreater(len(workers[0].batches), 0, "the coroutine worker served nothing")
        print("async workers served %d EXPERTS; every result equals scale's"
              % sum(len(w.batches) for w in workers))


class Dying(ScaleWorker):
    """Closes its connection on its first batch without answering (a worker that dies)."""

    def __init__(self):
        super().__init__()
        self.client = None

    def __call__(self, batch):
        self.batches.append(batch.step)
        self.client._sock.close()
        self.client._sock = None


class Late(ScaleWorker):
    """Answers its first batch after `delay` seconds (past the daemon's timeout)."""

    def __init__(self, delay):
        super().__init__()
        self.delay = delay
        self.answered = threading.Event()

    def __call__(self, batch):
        if not self.batches:
            time.sleep(self.delay)
        super().__call__(batch)
        self.answered.set()


@unittest.skipUnless(CASE == "failures", "case " + CASE)
class TestFailures(External):
    def test_external__async_callback_that_raises__unavailable_then_raised_by_serve(self):
        """An AsyncClient worker whose callback raises answers nothing for that batch (its
        requests get experts_unavailable) and serve() raises the exception, once."""
        class Boom(Exception):
            pass

        def worker(batch):
            calls.append(batch.step)
            raise Boom("the worker's kernels failed")
        calls = []

        async def run():
            clients = [await epd.AsyncClient.connect(SOCKETS[r], timeout=30) for r in range(W)]
            try:
                for c in clients:
                    await c.serve_experts(worker if c is clients[0] else ScaleWorker())
                x, ids, w = exact_batch(6, 31, experts=range(PER_RANK))  # rank 0's experts
                with self.assertRaises(epd.ExpertsUnavailable):
                    await clients[0].submit(x, ids, w)
                with self.assertRaises(Boom):
                    await clients[0].serve(timeout=10)
                await clients[0].serve(timeout=0.01)  # raised once
            finally:
                for c in clients:
                    await c.close()

        asyncio.run(run())
        self.assertEqual(len(calls), 1)

    def expect_unavailable(self, front, x, ids, w):
        front.submit(x, ids, w)
        got = front.result()
        self.assertIsInstance(got, epd.ExpertsUnavailable, repr(got))
        return got

    def test_external__failures__answered_experts_unavailable_and_recovered(self):
        self.assertEqual(W, 2, "the failures case runs on 2 ranks")
        last = W - 1
        f0 = Frontend(0)
        try:
            # no worker on the last rank: requests that reach it fail, the others do not
            x, ids, w = exact_batch(5, 1, experts=range(last * PER_RANK, E))
            e = self.expect_unavailable(f0, x, ids, w)
            self.assertIn("rank %d" % last, e.message)
            x, ids, w = exact_batch(5, 2, experts=range(PER_RANK))
            f0.submit(x, ids, w)
            self.assertTrue((f0.result() == reference(x, ids, w)).all())

            # a second worker on rank 0 is refused (busy); the first keeps serving
            with epd.Client(SOCKETS[0], timeout=10) as c2:
                with self.assertRaises(epd.Busy):
                    c2.serve_experts(ScaleWorker())

            # a worker attaches to the last rank: every rank right again
            fl = Frontend(last)
            self.check_round([f0, fl], 10, n_of=lambda r: 6)
            x, ids, w = exact_batch(12, 3)
            f0.submit(x, ids, w)
            self.assertTrue((f0.result() == reference(x, ids, w)).all())
            fl.stop()

            # a worker that dies on its first EXPERTS: that request fails, the next ones too
            # until a new worker attaches; requests that do not reach the rank are right
            dying = Dying()
            fd = Frontend(last, worker=dying)
            dying.client = fd.c
            x, ids, w = exact_batch(4, 4, experts=range(last * PER_RANK, E))
            self.expect_unavailable(f0, x, ids, w)
            self.assertEqual(len(dying.batches), 1)
            fd.stopping = True
            fd.join(10)
            self.expect_unavailable(f0, *exact_batch(3, 5, experts=[E - 1]))
            x, ids, w = exact_batch(3, 6, experts=range(PER_RANK))
            f0.submit(x, ids, w)
            self.assertTrue((f0.result() == reference(x, ids, w)).all())
            fl = Frontend(last)
            x, ids, w = exact_batch(20, 7)
            f0.submit(x, ids, w)
            self.assertTrue((f0.result() == reference(x, ids, w)).all())
            fl.stop()

            # a late worker: its step fails after the timeout, steps while it is still busy
            # fail, and once it has answered (late) it serves again
            late = Late(2.2)
            fl = Frontend(last, worker=late)
            t0 = time.monotonic()
            self.expect_unavailable(f0, *exact_batch(2, 8, experts=[E - 1]))
            self.assertLess(time.monotonic() - t0, 2.0, "the step waited past the timeout")
            self.assertFalse(late.answered.is_set())
            self.expect_unavailable(f0, *exact_batch(2, 9, experts=[E - 1]))
            self.assertTrue(late.answered.wait(10))
            time.sleep(0.3)
            x, ids, w = exact_batch(16, 10)
            f0.submit(x, ids, w)
            self.assertTrue((f0.result() == reference(x, ids, w)).all())
            fl.stop()

            # EXPERTS_DONE for a step the worker was not given: closed with bad_json
            c = epd.Client(SOCKETS[last], timeout=10)
            c.serve_experts(ScaleWorker())
            c.send_raw(fr.encode(fr.EXPERTS_DONE, {"step": 987654}))
            with self.assertRaises(epd.BadJson):
                c.control_async("health").result(10)
            c.close()
            # ... from a connection that serves no experts: bad_type; EXPERTS from a client too
            for ftype in (fr.EXPERTS_DONE, fr.EXPERTS):
                with epd.Client(SOCKETS[0], timeout=10) as c:
                    c.send_raw(fr.encode(ftype, {"step": 1}))
                    with self.assertRaises(epd.BadType):
                        c.control_async("health").result(10)
            # the closed worker left: a new one attaches and everything is right
            fl = Frontend(last)
            self.check_round([f0, fl], 20)
            fl.stop()
        finally:
            f0.stop()


if __name__ == "__main__":
    unittest.main(verbosity=2)
