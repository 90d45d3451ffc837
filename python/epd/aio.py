"""The asyncio client: one connection to one rank's socket, a reader task that matches every
answer to its request by id, and writes serialized by a lock (frames never interleave). Many
coroutines may share one AsyncClient; pipelining is simply many awaits in flight."""
import array
import asyncio
import socket

from . import frame as fr
from ._session import Session, torch_module
from .client import DEFAULT_SOCKET, connect_unix
from .errors import ConnectionClosed, ProtocolError, Timeout, UnknownOp
from .regions import HostRegion

_STAGE = 65536


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
        self._config = None
        self._closing = False
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
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            self._s.on_eof("the client was closed")

    # ---- requests --------------------------------------------------------------------------

    async def submit(self, x, topk_ids, topk_weights, layer=None, out=None, timeout=None):
        """As Client.submit: returns y, raises the request's EpdError."""
        fut = await self.submit_async(x, topk_ids, topk_weights, layer, out)
        return await self._await(fut, timeout)

    async def submit_async(self, x, topk_ids, topk_weights, layer=None, out=None):
        """Sends one SUBMIT; returns an asyncio Future of y (its .epd_pending is the Pending)."""
        self._s.check_usable()
        tm = torch_module(x)
        if out is None and tm is not None and x.is_cuda and x.dim() == 2:
            out = tm.empty_like_y(x, x.shape[0], x.shape[1])
        placed, needs = self._s.plan_submit(x, topk_ids, topk_weights, out)
        if needs:
            if self._config is None:
                self._s.limit_device_regions(await self.config())
            futs = []
            for need in needs:
                p, data = self._s.register_device(need)
                futs.append(self._future(p))
                await self._send([data])
            for fut in futs:
                await self._await(fut, None)
            for p, data in self._s.evictions():
                self._future(p)
                await self._send([data])
            placed, needs = self._s.plan_submit(x, topk_ids, topk_weights, out)
            if needs:
                raise ProtocolError("device regions registered, yet still unknown")
        cuda = [t for t in (x, topk_ids, topk_weights, out)
                if torch_module(t) is not None and t.is_cuda]
        if cuda:
            torch_module(cuda[0]).stream_sync(cuda)
        p, bufs = self._s.submit(placed, x, out, layer)
        fut = self._future(p)
        await self._send(bufs)
        return fut

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
                    target = self._rx.want()
                    k = min(len(target), n - at)
                    target[:k] = view[at:at + k]
                    at += k
                    self._got(k)
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
            self._s.on_frame(*frame)
