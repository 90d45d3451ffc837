"""The blocking client: one connection to one rank's socket. Requests pipeline (submit_async
returns a Pending; as_completed yields answers in arrival order); while a large SUBMIT waits for
room in the socket, answers that arrive are read, so pipelining never deadlocks with the
daemon's backpressure. One Client must not be used by two threads at once."""
import array
import errno
import os
import select
import socket
import time

from . import experts as ex
from . import frame as fr
from ._session import PreparedCall, Session, default_out, sync_cuda_inputs
from .errors import ConnectError, ConnectionClosed, ProtocolError, Timeout, UnknownOp
from .regions import HostRegion

DEFAULT_SOCKET = "/run/epd/epd-0.sock"
_STAGE = 65536


def _deadline(timeout):
    return None if timeout is None else time.monotonic() + timeout


def _left_ms(deadline):
    if deadline is None:
        return -1
    return max(0, int((deadline - time.monotonic()) * 1000 + 0.999))


def connect_unix(path, timeout):
    """A connected non-blocking AF_UNIX socket; waits up to timeout seconds while the daemon's
    accept queue is full. ConnectError names the path and the reason."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    # a Unix stream socket holds at most the sender's SO_SNDBUF in flight (208 KiB by default): a
    # few MiB lets a request go in one or two writes (the kernel caps it at net.core.wmem_max)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    sock.setblocking(False)
    deadline = _deadline(timeout)
    while True:
        try:
            sock.connect(path)
            return sock
        except InterruptedError:
            continue
        except BlockingIOError:
            # a full accept queue answers EAGAIN on a non-blocking Unix socket: retry until the end
            if deadline is not None and time.monotonic() >= deadline:
                sock.close()
                raise ConnectError("cannot connect to %s: the daemon's accept queue stayed full"
                                   % path) from None
            time.sleep(0.005)
        except OSError as e:
            sock.close()
            raise ConnectError("cannot connect to %s: %s" % (path, e.strerror or e)) from None


def _default_spin_s():
    """libepd's default wait (EPD_CLIENT_DEFAULT_SPIN_US in proto/epd.h): poll the socket for up
    to 200 us before sleeping, where this process may use at least 4 cores."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return 200e-6 if cpus >= 4 else 0.0


class Prepared(PreparedCall):
    """A SUBMIT prepared once on a Client (Client.prepare) and sent by each call: submit(layer)
    returns y as Client.submit does; submit_async(layer) its Pending. The tensors are read at
    each call; their buffers are fixed (the call holds them). Payload tensors must be the
    caller's own contiguous arrays or tensors (a copy made at prepare time would be sent every
    call). When a region the frame names is let go (evicted for another, unregistered), the next
    call makes the frame again."""

    def __init__(self, client, x, topk_ids, topk_weights, out=None):
        super().__init__(client._s, (x, topk_ids, topk_weights, default_out(x, out)))
        self._c = client
        self._make()

    def _make(self):
        self._set_plan(self._c._placements(*self._tensors))

    def submit(self, layer=None, timeout=None):
        return self.submit_async(layer).result(self._c.timeout if timeout is None else timeout)

    def submit_async(self, layer=None):
        if self._stale():
            self._make()
        p, bufs = self._frame(layer)
        p._wait = self._c._wait_for
        self._c._send(bufs)
        return p


class Client:
    """A connection to the epd rank listening on path.

    timeout: how long a call waits for the daemon, in seconds (None: no limit); connect_timeout:
    how long connecting may wait while the daemon's accept queue is full; spin: how long a wait
    polls the socket before it sleeps in poll(2), in seconds (None: libepd's default, 200 us where
    the process may use 4 cores or more; 0: sleep at once). A thread woken from poll pays about
    10 us an answer on a GPU node; spinning costs a busy core for at most spin a wait."""

    def __init__(self, path=DEFAULT_SOCKET, timeout=None, connect_timeout=10.0, spin=None):
        self.path = os.fspath(path)
        self.timeout = timeout
        self.spin = _default_spin_s() if spin is None else float(spin)
        self._s = Session()
        self._rx = fr.Receiver(self._s.place_payload)
        self._stage = bytearray(_STAGE)
        self._stage_view = memoryview(self._stage)
        self._s0 = self._s1 = 0
        self._sock = connect_unix(self.path, connect_timeout)
        self._poller, self._poll_events = None, 0
        self._config = None
        self._sending = False   # inside _send: an EXPERTS read meanwhile waits for its end
        self._serving = False   # inside an experts callback

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return "<epd.Client %s, %d in flight>" % (self.path, self.in_flight)

    @property
    def in_flight(self):
        """Requests sent whose answer has not arrived."""
        return len(self._s.pending)

    def close(self):
        """Closes the connection; requests in flight fail with ConnectionClosed."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._s.on_eof("the client was closed")

    # ---- requests --------------------------------------------------------------------------

    def submit(self, x, topk_ids, topk_weights, layer=None, out=None, timeout=None):
        """Runs one MoE layer call and returns y (bf16 [N, H]): x bf16 [N, H] (numpy uint16 bit
        patterns, or a torch bfloat16 tensor), topk_ids [N, K] (int32 or int64; -1 = empty
        slot), topk_weights float32 [N, K]; layer groups requests into steps (default 0). out:
        where y goes (in a registered region the daemon writes it there; a numpy array gets the
        payload). Raises the daemon's error as its EpdError subclass."""
        return self.submit_async(x, topk_ids, topk_weights, layer, out).result(
            self.timeout if timeout is None else timeout)

    def submit_async(self, x, topk_ids, topk_weights, layer=None, out=None):
        """Sends one SUBMIT and returns its Pending at once (result() waits for y)."""
        self._s.check_usable()
        out = default_out(x, out)
        placed = self._placements(x, topk_ids, topk_weights, out)
        sync_cuda_inputs((x, topk_ids, topk_weights, out))
        p, bufs = self._s.submit(placed, x, out, layer)
        p._wait = self._wait_for
        self._send(bufs)
        return p

    def prepare(self, x, topk_ids, topk_weights, out=None):
        """A Prepared call: this SUBMIT's frame made once (placements, device registrations,
        meta) and sent again by each call, with the tensors' contents at that moment. For
        frontends whose inputs are the same buffers call after call, refilled in place (static
        buffers, CUDA graphs). Without out, CUDA inputs get one y buffer that every call writes."""
        return Prepared(self, x, topk_ids, topk_weights, out)

    def _placements(self, x, topk_ids, topk_weights, out):
        """The tensors' placements, after registering the device allocations they need."""
        placed, needs = self._s.plan_submit(x, topk_ids, topk_weights, out)
        if needs:
            self._register_devices(needs)
            placed, needs = self._s.plan_submit(x, topk_ids, topk_weights, out)
            if needs:
                raise ProtocolError("device regions registered, yet still unknown")
        return placed

    def as_completed(self, pendings, timeout=None):
        """Yields the given Pendings as their answers arrive (in arrival order: errors can
        overtake results); timeout bounds the whole wait (epd.Timeout)."""
        deadline = _deadline(self.timeout if timeout is None else timeout)
        waiting = list(pendings)
        while waiting:
            done = sorted((p for p in waiting if p.done()), key=lambda p: p.arrival)
            for p in done:
                waiting.remove(p)
                yield p
            if waiting:
                self._pump(lambda: any(p.done() for p in waiting), deadline)

    def wait_all(self, pendings, timeout=None):
        """Waits for every Pending (their answers or errors stay in them)."""
        for _ in self.as_completed(pendings, timeout):
            pass

    # ---- CONTROL ---------------------------------------------------------------------------

    def control_async(self, op, **fields):
        """Sends CONTROL {"op": op, **fields}; the Pending's result is (meta, payload)."""
        self._s.check_usable()
        p, data = self._s.control(op, fields)
        p._wait = self._wait_for
        self._send([data])
        return p

    def control(self, op, timeout=None, **fields):
        """A CONTROL query: (REPLY meta dict, payload bytes)."""
        return self.control_async(op, **fields).result(self.timeout if timeout is None
                                                       else timeout)

    def health(self):
        return self.control("health")[0]

    def stats(self):
        return self.control("stats")[0]

    def config(self):
        """The daemon's settings, {"model.hidden": 7168, ...}."""
        self._config = self.control("config")[0]
        return self._config

    def metrics(self):
        """The Prometheus text exposition."""
        return self.control("metrics")[1].decode()

    def supports_regions(self):
        """True when the daemon serves shared regions: a 4 KiB host region is registered and
        released again; False when the daemon answers register with unknown_op. Any other
        failure is raised (the daemon has regions, and they do not work)."""
        region = HostRegion(4096, "epd-probe")
        try:
            self.register(region)
        except UnknownOp:
            return False
        finally:
            if self._s.host_region_id(region) is not None:
                self.unregister(region)
            region.close()
        return True

    # ---- regions ---------------------------------------------------------------------------

    def register(self, region):
        """Registers a HostRegion with this rank (its fd travels in SCM_RIGHTS); returns the
        region id. Tensors inside it are then named by (region, offset) and y is written there
        when out= lies in it."""
        p, data, fd = self._s.register_host(region)
        p._wait = self._wait_for
        self._send([data], fds=[fd])
        return p.result(self.timeout)

    def host_region(self, nbytes):
        """A new HostRegion of nbytes, registered with this rank."""
        region = HostRegion(nbytes)
        try:
            self.register(region)
        except BaseException:
            region.close()
            raise
        return region

    def unregister(self, region):
        """Releases a HostRegion on this rank (once the requests using it are answered)."""
        p, data = self._s.unregister_host(region)
        p._wait = self._wait_for
        self._send([data])
        p.result(self.timeout)

    def _register_devices(self, needs):
        if self._config is None:
            self._s.limit_device_regions(self.config())
        self._s.make_room(len(needs))
        for p, data in self._s.evictions():
            p._wait = self._wait_for
            self._send([data])
        pendings = []
        for need in needs:
            p, data = self._s.register_device(need)
            p._wait = self._wait_for
            self._send([data])
            pendings.append(p)
        for p in pendings:
            p.result(self.timeout)
        for p, data in self._s.evictions():
            p._wait = self._wait_for
            self._send([data])

    # ---- external experts ------------------------------------------------------------------

    def serve_experts(self, callback, input_bytes=None, output_bytes=None, input_scale=None,
                      device=None):
        """Makes this connection its rank's expert worker (experts.kind external): registers an
        input and an output HostRegion (by default as large as the largest step, from the
        daemon's config) and sends CONTROL serve_experts. From then on every wait of this Client
        (submit, result, as_completed, serve) calls callback(batch) for each EXPERTS, an
        epd.experts.ExpertsBatch whose y the callback fills, and answers EXPERTS_DONE.
        input_scale (fp8_per_tensor): S for every layer, or {layer: S}; None: the step scale.
        device (a torch CUDA device, e.g. "cuda:0"): the regions are device memory there instead
        (CUDA IPC; the daemon's rank must run on that GPU) and the batch's tensors are torch
        views; the callback's work is synchronized before EXPERTS_DONE. Returns the REPLY (rank, first_expert, experts, max_rows, input_bytes, ...). A second
        worker on a rank gets epd.Busy."""
        if self._s.experts is not None:
            raise ex.InvalidArgument("this connection already serves experts")
        if input_bytes is None or output_bytes is None:
            cfg = self.config()
            need_in, need_out = ex.region_bytes(cfg, self.health()["world"])
            input_bytes = input_bytes or need_in
            output_bytes = output_bytes or need_out
        regions = []
        try:
            if device is not None:
                ids = [self._register_buffer(ex.DeviceBuffer(n, device), regions)
                       for n in (input_bytes, output_bytes)]
            else:
                for n in (input_bytes, output_bytes):
                    regions.append(self.host_region(n))
                ids = [self._s.host_region_id(r) for r in regions]
            self._s.experts = (callback, {ids[0]: regions[0], ids[1]: regions[1]})
            reply = self.control("serve_experts", **ex.serve_fields(ids, input_scale))[0]
        except BaseException:
            self._s.experts = None
            for r in regions:
                if isinstance(r, ex.DeviceBuffer):
                    continue  # released with the connection
                if self._sock is not None and self._s.host_region_id(r) is not None:
                    self.unregister(r)
                r.close()
            raise
        self._expert_regions = regions
        self._expert_device = device
        return reply

    def _register_buffer(self, buf, regions):
        """Registers a DeviceBuffer as a cuda region; its id."""
        meta = ex.register_fields(buf)
        regions.append(buf)
        return self.control("register", **meta)[0]["region"]

    def serve(self, timeout=None):
        """Serves EXPERTS (and reads answers) until timeout seconds have passed (None: until the
        daemon closes the connection, then ConnectionClosed)."""
        deadline = _deadline(timeout)
        try:
            self._pump(lambda: self._sock is None, deadline)
        except Timeout:
            if deadline is None:
                raise
        if self._sock is None and timeout is None:
            raise ConnectionClosed("the daemon closed the connection")

    def _serve_queued(self):
        """Runs the callback on each EXPERTS read so far and answers it (not while a frame is
        being sent, nor from inside the callback)."""
        q = self._s.experts_queue
        while q and not self._sending and not self._serving and self._sock is not None:
            batch = q.popleft()
            self._serving = True
            try:
                self._s.experts[0](batch)
                if batch.on_device:
                    from . import _torch
                    _torch.stream_sync((batch.y,))
            finally:
                self._serving = False
            meta = ex.done_meta(batch, time.monotonic_ns())
            self._send([fr.encode(fr.EXPERTS_DONE, meta)])

    # ---- raw frames (tools and tests) ------------------------------------------------------

    def new_id(self):
        """A request id no other request of this connection uses (for send_raw)."""
        return self._s.new_id()

    def send_raw(self, data, fds=None, id=None):
        """Sends bytes as they are (a tool's or a test's hand-made frame), fds in SCM_RIGHTS
        with the first bytes. With id (from new_id(), the one in the frame's meta) it returns a
        Pending whose result is the answer's (meta, payload), or raises its ERROR. An ERROR
        about no request fails every request in flight and, for a framing error, every later
        call."""
        p = None
        if id is not None:
            p = self._s.raw(data, id)
            p._wait = self._wait_for
        self._send([data], fds=fds)
        return p

    # ---- I/O -------------------------------------------------------------------------------

    def _wait_for(self, p, timeout):
        self._pump(p.done, _deadline(timeout))

    def _pump(self, pred, deadline):
        """Reads and handles frames until pred() (or the connection ends); EXPERTS read on
        the way are served."""
        while not pred():
            if self._sock is None:
                self._s.on_eof()
                return
            if not self._read_some() and not self._spin_read(deadline):
                self._wait_io(select.POLLIN, deadline)
            self._serve_queued()
        self._serve_queued()

    def _spin_read(self, deadline):
        """Tries the socket again without sleeping for up to self.spin (not past deadline); True
        when something was read."""
        if self.spin <= 0:
            return False
        until = time.monotonic() + self.spin
        if deadline is not None and deadline < until:
            until = deadline
        while time.monotonic() < until:
            if self._read_some():
                return True
        return False

    def _wait_io(self, events, deadline):
        # one poll object a connection, its events set again each wait (modify: no new object
        # and no register a wait)
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self._sock, events)
            self._poll_events = events
        elif self._poll_events != events:
            self._poller.modify(self._sock, events)
            self._poll_events = events
        ready = self._poller.poll(_left_ms(deadline))
        if not ready:
            raise Timeout("no answer from %s within the timeout" % self.path)
        return ready[0][1]

    def _read_some(self):
        """Handles what one recv brings; False when nothing was there (EAGAIN)."""
        if self._s0 == self._s1:
            target = self._rx.want()
            into = target if len(target) >= _STAGE else self._stage_view
            try:
                n = self._sock.recv_into(into)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as e:
                self._lost("reading from %s failed: %s" % (self.path, e.strerror or e))
                return True
            if n == 0:
                self._lost("the daemon closed the connection")
                return True
            if into is target:
                self._got(n)
                return True
            self._s0, self._s1 = 0, n
        while self._s0 < self._s1 and self._sock is not None:
            self._take()
        return True

    def _got(self, n):
        """n bytes were read straight into the receiver's want()."""
        try:
            frame = self._rx.got(n)
            if frame is not None:
                self._s.on_frame(*frame)
        except ProtocolError as e:
            self._s.fail(e)
            self._lost("protocol error: %s" % e.message)

    def _take(self):
        """The receiver takes what it can of the staged bytes (a whole frame at once)."""
        try:
            used, frame = self._rx.take(self._stage_view[self._s0:self._s1])
            self._s0 += used
            if frame is not None:
                self._s.on_frame(*frame)
        except ProtocolError as e:
            self._s.fail(e)
            self._lost("protocol error: %s" % e.message)

    def _lost(self, why):
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._s0 = self._s1 = 0
        self._s.on_eof(why)

    def _send(self, bufs, fds=None):
        """Sends the buffers as one frame, reading answers while the socket is full."""
        self._s.check_usable()
        if self._sock is None:
            raise ConnectionClosed("the connection is closed")
        views = [v if v.ndim == 1 and v.itemsize == 1 else v.cast("B")
                 for v in map(memoryview, bufs) if v.nbytes]
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        deadline = _deadline(self.timeout)
        self._sending = True
        try:
            self._send_views(views, anc, deadline)
        finally:
            self._sending = False

    def _send_views(self, views, anc, deadline):
        while views:
            try:
                n = self._sock.sendmsg(views, anc)
            except (BlockingIOError, InterruptedError):
                try:
                    got = self._wait_io(select.POLLIN | select.POLLOUT, deadline)
                except Timeout:
                    self._s.fail(Timeout("sending to %s timed out mid-frame" % self.path))
                    self._lost("a frame was cut by a send timeout")
                    raise
                if got & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    self._read_some()
                    if self._sock is None:
                        break
                continue
            except OSError as e:
                if e.errno not in (errno.EPIPE, errno.ECONNRESET):
                    raise
                # the daemon closed on us: read what it said first (a framing ERROR, say)
                self._drain()
                break
            anc = []
            while n:
                if n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][n:]
                    n = 0
        # when the daemon closed during the send, the frame's request has failed with the reason
        # (its result() raises it); the next call raises ConnectionClosed

    def _drain(self):
        """Reads until EOF (bounded by the timeout) after the peer stopped reading."""
        deadline = _deadline(5.0 if self.timeout is None else self.timeout)
        try:
            while self._sock is not None:
                if not self._read_some():
                    self._wait_io(select.POLLIN, deadline)
        except Timeout:
            self._lost("the daemon stopped reading")

