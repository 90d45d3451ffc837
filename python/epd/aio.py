"""The asyncio client: one connection to one rank's socket, a reader task that matches every
answer to its request by id, and writes serialized by a lock (frames never interleave). Many
coroutines may share one AsyncClient; pipelining is simply many awaits in flight. A worker
(serve_experts) gets its EXPERTS served by a task of its own, one at a time, while the reader
goes on matching answers: a coroutine that submits on the same connection cannot deadlock."""
import array
import asyncio
import inspect
import socket
import time

from . import experts as ex
from . import frame as fr
from ._session import PreparedCall, Session, default_out, sync_cuda_inputs
from .client import DEFAULT_SOCKET, connect_unix
from .errors import ConnectionClosed, ProtocolError, Timeout, UnknownOp
from .regions import HostRegion

_STAGE = 65536


class AsyncPrepared(PreparedCall):
    """Client.prepare's Prepared on an AsyncClient (`await AsyncClient.prepare(...)`): await
    submit(layer) for y, or await submit_async(layer) for its Future."""

    def __init__(self, client, x, topk_ids, topk_weights, out=None):
        super().__init__(client._s, (x, topk_ids, topk_weights, default_out(x, out)))
        self._c = client

    async def _make(self):
        self._set_plan(await self._c._placements(*self._tensors))

    async def submit(self, layer=None, timeout=None):
        return await self._c._await(await self.submit_async(layer), timeout)

    async def submit_async(self, layer=None):
        if self._stale():
            await self._make()
        p, bufs = self._frame(layer)
        fut = self._c._future(p)
        await self._c._send(bufs)
        return fut


class AsyncClient:
    """Create with `await AsyncClient.connect(path)`; close with `await client.close()` (or use
    `async with`). timeout: seconds a call waits for its answer (None: no limit)."""

    def __init__(self, sock, path, timeout):
        self.path = path
        self.timeout = timeout
        self._sock = sock
        self._s = Session()
        self._rx = fr.Receiver(self._s.place_payload)
        self._wlock = asyncio.Lock()
        self._register_lock = asyncio.Lock()
        self._config = None
        self._closing = False
        self._serve_task = None     # serving the EXPERTS queued (serve_experts)
        self._serve_error = None    # the callback's exception, raised by serve()
        self._serve_failed = asyncio.Event()
        self._expert_regions = []
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def connect(cls, path=DEFAULT_SOCKET, timeout=None, connect_timeout=10.0):
        loop = asyncio.get_running_loop()
        sock = await loop.run_in_executor(None, connect_unix, str(path), connect_timeout)
        return cls(sock, str(path), timeout)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    @property
    def in_flight(self):
        return len(self._s.pending)

    async def close(self):
        """Closes the connection; requests in flight fail with ConnectionClosed."""
        if self._sock is not None:
            self._closing = True
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
            if self._serve_task is not None:
                self._serve_task.cancel()
                try:
                    await self._serve_task
                except BaseException:
                    pass
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            self._s.on_eof("the client was closed")
            for r in self._expert_regions:
                if not isinstance(r, ex.DeviceBuffer):
                    r.close()
            self._expert_regions = []

    # ---- requests --------------------------------------------------------------------------

    async def submit(self, x, topk_ids, topk_weights, layer=None, out=None, timeout=None):
        """As Client.submit: returns y, raises the request's EpdError."""
        fut = await self.submit_async(x, topk_ids, topk_weights, layer, out)
        return await self._await(fut, timeout)

    async def submit_async(self, x, topk_ids, topk_weights, layer=None, out=None):
        """Sends one SUBMIT; returns an asyncio Future of y (its .epd_pending is the Pending)."""
        self._s.check_usable()
        out = default_out(x, out)
        placed = await self._placements(x, topk_ids, topk_weights, out)
        sync_cuda_inputs((x, topk_ids, topk_weights, out))
        p, bufs = self._s.submit(placed, x, out, layer)
        fut = self._future(p)
        await self._send(bufs)
        return fut

    async def prepare(self, x, topk_ids, topk_weights, out=None):
        """As Client.prepare: an AsyncPrepared (await its submit(layer))."""
        call = AsyncPrepared(self, x, topk_ids, topk_weights, out)
        await call._make()
        return call

    async def _placements(self, x, topk_ids, topk_weights, out):
        """The tensors' placements, after registering the device allocations they need."""
        placed, needs = self._s.plan_submit(x, topk_ids, topk_weights, out)
        if needs:
            if self._config is None:
                self._s.limit_device_regions(await self.config())
            # one coroutine registers at a time, after making room: concurrent submits would
            # otherwise all register before any eviction and pass socket.max_regions
            async with self._register_lock:
                placed, needs = self._s.plan_submit(x, topk_ids, topk_weights, out)
                self._s.make_room(len(needs))
                for p, data in self._s.evictions():
                    self._future(p)
                    await self._send([data])
                futs = []
                for need in needs:
                    p, data = self._s.register_device(need)
                    futs.append(self._future(p))
                    await self._send([data])
                for fut in futs:
                    await self._await(fut, None)
                placed, needs = self._s.plan_submit(x, topk_ids, topk_weights, out)
            if needs:
                raise ProtocolError("device regions registered, yet still unknown")
        return placed

    async def control(self, op, timeout=None, **fields):
        """A CONTROL query: (REPLY meta dict, payload bytes)."""
        self._s.check_usable()
        p, data = self._s.control(op, fields)
        fut = self._future(p)
        await self._send([data])
        return await self._await(fut, timeout)

    async def health(self):
        return (await self.control("health"))[0]

    async def stats(self):
        return (await self.control("stats"))[0]

    async def config(self):
        self._config = (await self.control("config"))[0]
        return self._config

    async def metrics(self):
        return (await self.control("metrics"))[1].decode()

    async def supports_regions(self):
        """As Client.supports_regions."""
        region = HostRegion(4096, "epd-probe")
        try:
            await self.register(region)
        except UnknownOp:
            return False
        finally:
            if self._s.host_region_id(region) is not None:
                await self.unregister(region)
            region.close()
        return True

    async def register(self, region):
        """Registers a HostRegion with this rank; returns its region id."""
        p, data, fd = self._s.register_host(region)
        fut = self._future(p)
        await self._send([data], fds=[fd])
        return await self._await(fut, None)

    async def host_region(self, nbytes):
        region = HostRegion(nbytes)
        try:
            await self.register(region)
        except BaseException:
            region.close()
            raise
        return region

    async def unregister(self, region):
        p, data = self._s.unregister_host(region)
        fut = self._future(p)
        await self._send([data])
        await self._await(fut, None)

    # ---- external experts ------------------------------------------------------------------

    async def serve_experts(self, callback, input_bytes=None, output_bytes=None,
                            input_scale=None, device=None):
        """As Client.serve_experts: this connection becomes its rank's expert worker. callback
        (a function, or a coroutine function) gets each EXPERTS as an epd.experts.ExpertsBatch
        whose y it fills; EXPERTS_DONE is sent when it returns (device regions: after the
        current torch stream is synchronized). Batches are served one at a time, in order, by a
        task of this client, whatever the other coroutines await. A callback that raises
        answers nothing for its batch (the daemon's step times out) and the exception is raised
        by serve(). Returns the REPLY; a second worker on a rank gets epd.Busy."""
        if self._s.experts is not None:
            raise ex.InvalidArgument("this connection already serves experts")
        if input_bytes is None or output_bytes is None:
            cfg = await self.config()
            need_in, need_out = ex.region_bytes(cfg, (await self.health())["world"])
            input_bytes = input_bytes or need_in
            output_bytes = output_bytes or need_out
        regions = []
        try:
            if device is not None:
                ids = []
                for n in (input_bytes, output_bytes):
                    buf = ex.DeviceBuffer(n, device)
                    regions.append(buf)
                    ids.append((await self.control("register", **ex.register_fields(buf)))[0]
                               ["region"])
            else:
                for n in (input_bytes, output_bytes):
                    regions.append(await self.host_region(n))
                ids = [self._s.host_region_id(r) for r in regions]
            self._s.experts = (callback, {ids[0]: regions[0], ids[1]: regions[1]})
            reply = (await self.control("serve_experts", **ex.serve_fields(ids, input_scale)))[0]
        except BaseException:
            self._s.experts = None
            for r in regions:
                if isinstance(r, ex.DeviceBuffer):
                    continue  # released with the connection
                if self._sock is not None and self._s.host_region_id(r) is not None:
                    await self.unregister(r)
                r.close()
            raise
        self._expert_regions = regions
        return reply

    async def serve(self, timeout=None):
        """Lets the EXPERTS be served (they are, by this client's own task, whatever is awaited)
        for timeout seconds, or until the connection ends (timeout None: then
        ConnectionClosed); raises at once the exception of a callback that failed."""
        if self._s.experts is None:
            raise ex.InvalidArgument("this connection does not serve experts (serve_experts)")
        failed = asyncio.get_running_loop().create_task(self._serve_failed.wait())
        try:
            await asyncio.wait({self._reader, failed}, timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
        if self._serve_error is not None:
            e, self._serve_error = self._serve_error, None
            self._serve_failed.clear()
            raise e
        if timeout is None and self._reader.done():
            raise ConnectionClosed("the daemon closed the connection")

    def _serve_soon(self):
        """From the reader: EXPERTS are queued; the serving task runs them (one task at a
        time)."""
        if self._s.experts_queue and (self._serve_task is None or self._serve_task.done()):
            self._serve_task = asyncio.get_running_loop().create_task(self._serve_queued())

    async def _serve_queued(self):
        q = self._s.experts_queue
        while q and self._sock is not None:
            batch = q.popleft()
            try:
                answer = self._s.experts[0](batch)
                if inspect.isawaitable(answer):
                    await answer
                if batch.on_device:
                    from . import _torch
                    _torch.stream_sync((batch.y,))
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # no answer for this batch; serve() raises it
                if self._serve_error is None:
                    self._serve_error = e
                    self._serve_failed.set()
                continue
            meta = ex.done_meta(batch, time.monotonic_ns())
            try:
                await self._send([fr.encode(fr.EXPERTS_DONE, meta)])
            except ConnectionClosed:
                return

    def new_id(self):
        """A request id no other request of this connection uses (for send_raw)."""
        return self._s.new_id()

    async def send_raw(self, data, fds=None, id=None):
        """Sends bytes as they are (see Client.send_raw); with id, returns a Future of the
        answer's (meta, payload)."""
        fut = None if id is None else self._future(self._s.raw(data, id))
        await self._send([data], fds=fds)
        return fut

    # ---- I/O -------------------------------------------------------------------------------

    def _future(self, p):
        fut = asyncio.get_running_loop().create_future()
        fut.epd_pending = p

        def done(pending):
            if fut.done():
                return
            if pending._exc is not None:
                fut.set_exception(pending._exc)
            else:
                fut.set_result(pending._value)
        p.add_done_callback(done)
        # an answer nobody awaits must not warn "exception never retrieved"
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        return fut

    async def _await(self, fut, timeout):
        timeout = self.timeout if timeout is None else timeout
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            raise Timeout("no answer from %s within the timeout" % self.path) from None

    async def _send(self, bufs, fds=None):
        loop = asyncio.get_running_loop()
        async with self._wlock:
            self._s.check_usable()
            if self._sock is None:
                raise ConnectionClosed("the connection is closed")
            try:
                first = memoryview(bufs[0])
                if fds:
                    first = first[await self._sendmsg_fds(first, fds):]
                for b in [first] + list(bufs[1:]):
                    if len(b):
                        await loop.sock_sendall(self._sock, b)
            except (BrokenPipeError, ConnectionResetError):
                # the daemon closed on us: the reader gets what it said before, and fails the
                # requests in flight with it
                try:
                    await asyncio.wait_for(asyncio.shield(self._reader), 5.0)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    pass

    async def _sendmsg_fds(self, data, fds):
        """Sends the first bytes of data with fds in SCM_RIGHTS; returns how many went."""
        loop = asyncio.get_running_loop()
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        while True:
            try:
                return self._sock.sendmsg([data], anc)
            except (BlockingIOError, InterruptedError):
                ready = loop.create_future()
                loop.add_writer(self._sock.fileno(), ready.set_result, None)
                try:
                    await ready
                finally:
                    loop.remove_writer(self._sock.fileno())

    async def _read_loop(self):
        loop = asyncio.get_running_loop()
        stage = bytearray(_STAGE)
        view = memoryview(stage)
        why = "the daemon closed the connection"
        try:
            while True:
                target = self._rx.want()
                into = target if len(target) >= _STAGE else view
                n = await loop.sock_recv_into(self._sock, into)
                if n == 0:
                    break
                if into is target:
                    self._got(n)
                    continue
                at = 0
                while at < n:
                    used, frame = self._rx.take(view[at:n])
                    at += used
                    if frame is not None:
                        self._handle(frame)
        except ProtocolError as e:
            self._s.fail(e)
            why = "protocol error: %s" % e.message
        except OSError as e:
            why = "reading from %s failed: %s" % (self.path, e.strerror or e)
        finally:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            self._s.on_eof("the client was closed" if self._closing else why)

    def _got(self, n):
        frame = self._rx.got(n)
        if frame is not None:
            self._handle(frame)

    def _handle(self, frame):
        self._s.on_frame(*frame)
        if frame[0] == fr.EXPERTS:
            self._serve_soon()
