"""The protocol state one connection keeps, shared by Client and AsyncClient (no I/O here):
request ids, requests in flight and their answers, registered regions, how each tensor travels
(payload bytes, or a host or device region and an offset), SUBMIT and CONTROL frames, and the
meaning of every frame the daemon sends."""
import base64
import collections
import time

import numpy as np

from . import frame as fr
from .experts import ExpertsBatch
from .errors import (ConnectionClosed, FramingError, InvalidArgument, ProtocolError,
                     error_from_meta)

_NP_WIRE = {np.dtype(np.uint16): "bf16", np.dtype(np.float16): "f16",
            np.dtype(np.float32): "f32", np.dtype(np.float64): "f64", np.dtype(np.int8): "i8",
            np.dtype(np.uint8): "u8", np.dtype(np.int16): "i16", np.dtype(np.int32): "i32",
            np.dtype(np.uint32): "u32", np.dtype(np.int64): "i64", np.dtype(np.uint64): "u64",
            np.dtype(np.bool_): "bool"}


_torch_glue = None  # epd._torch, once a torch tensor has been seen


def torch_module(obj):
    """The epd._torch module when obj is a torch tensor, else None (torch is never imported for
    numpy callers). After the first tensor, one isinstance (it runs a dozen times a SUBMIT)."""
    global _torch_glue
    if _torch_glue is not None:
        return _torch_glue if isinstance(obj, _torch_glue.torch.Tensor) else None
    if type(obj).__module__.split(".")[0] != "torch":
        return None
    from . import _torch
    if not _torch.is_tensor(obj):
        return None
    _torch_glue = _torch
    return _torch


def is_cuda(obj):
    """True for a torch CUDA tensor."""
    return torch_module(obj) is not None and obj.is_cuda


def default_out(x, out):
    """out, or for a 2-D CUDA x a new bf16 y on its device (y never travels in the payload
    then)."""
    if out is None and is_cuda(x) and x.dim() == 2:
        return torch_module(x).empty_like_y(x, x.shape[0], x.shape[1])
    return out


def check_prepared(placed, tensors):
    """InvalidArgument when a prepared call's payload tensor is not the caller's own memory
    (a list, a strided array, a converted dtype: its copy would be sent every call)."""
    for (name, pl), obj in zip(((k, placed[k]) for k in ("x", "topk_ids", "topk_weights")),
                               tensors):
        if pl.data is None:
            continue
        tm = torch_module(obj)
        if tm is not None:
            own = obj.is_contiguous() and pl.owner is not None and \
                pl.owner.data_ptr() == obj.data_ptr()
        else:
            own = isinstance(obj, np.ndarray) and obj.flags.c_contiguous and \
                _NP_WIRE.get(obj.dtype) is not None
        if not own:
            raise InvalidArgument("a prepared call's %s must be a contiguous numpy array or "
                                  "torch tensor of a wire dtype: a copy of it would be sent "
                                  "every call" % name)


class PreparedCall:
    """What a prepared call is on either client (Client.prepare, AsyncClient.prepare): its
    tensors, held for as long as it lives, and the SubmitPlan it sends each time."""

    def __init__(self, session, tensors):
        session.check_usable()
        self._s = session
        self._tensors = tensors                      # x, topk_ids, topk_weights, out
        cuda = [t for t in tensors if is_cuda(t)]
        self._tm = torch_module(cuda[0]) if cuda else None
        self._devices = self._tm.cuda_devices(cuda) if cuda else ()
        self._plan = None

    @property
    def out(self):
        """Where y goes (None: a new y each call, in the payload)."""
        return self._tensors[3]

    def _set_plan(self, placed):
        check_prepared(placed, self._tensors)
        self._plan = self._s.prepared_plan(placed, self._tensors[0], self._tensors[3])

    def _stale(self):
        """True when the plan must be made again (a region it names was let go)."""
        self._s.check_usable()
        return self._plan is None or not self._s.plan_current(self._plan)

    def _frame(self, layer):
        """(Pending, buffers) of this call's next SUBMIT, its CUDA inputs' streams synced."""
        if self._devices:
            self._tm.sync_devices(self._devices)
        return self._s.submit_planned(self._plan, layer)

    def __repr__(self):
        return "<epd.%s %s>" % (type(self).__name__,
                                self._plan.tensors_text if self._plan else "(no plan)")


def sync_cuda_inputs(tensors):
    """Before a SUBMIT goes: the current stream of every CUDA device the tensors (None for
    absent ones) live on is synchronized (DESIGN.md 4b: the inputs are complete)."""
    cuda = [t for t in tensors if is_cuda(t)]
    if cuda:
        torch_module(cuda[0]).stream_sync(cuda)


class Pending:
    """One request in flight: a SUBMIT (its result is y) or a CONTROL (its result is (meta,
    payload)). result(timeout) waits for the answer and returns it or raises its EpdError;
    step is the daemon's step of a RESULT, meta the answer's meta."""

    def __init__(self, req_id, kind, op=None):
        # kind: "submit", "control", or "raw" (a hand-made frame: the answer is (meta, payload))
        self.id = req_id
        self.kind = kind
        self.op = op
        self.step = None
        self.meta = None
        self.arrival = None     # order of arrival among this connection's answers
        self._done = False
        self._value = None
        self._exc = None
        self._wait = None       # the client's way to drive I/O until this is done
        self._callbacks = []
        # submit only
        self.n_tokens = self.hidden = None
        self.out = None          # caller's y (any kind), returned as the result
        self.out_view = None     # writable bytes of out when y comes in the payload
        self.y_region = False    # y named in a region: the daemon writes it there
        self.y_torch = False     # return y as a torch tensor (CPU)
        self.keep = ()           # objects that must live until the answer (payload buffers)
        self.on_result = None    # a hook run with the answer's meta before callbacks

    def done(self):
        return self._done

    def result(self, timeout=None):
        """The answer (y for a SUBMIT), waiting at most timeout seconds (None: no limit);
        raises the request's EpdError, or epd.Timeout."""
        if not self._done:
            self._wait(self, timeout)
        if self._exc is not None:
            raise self._exc
        return self._value

    def exception(self, timeout=None):
        """The request's EpdError or None, waiting like result()."""
        if not self._done:
            self._wait(self, timeout)
        return self._exc

    def add_done_callback(self, fn):
        if self._done:
            fn(self)
        else:
            self._callbacks.append(fn)

    def _finish(self, value=None, exc=None):
        if self._done:
            return
        self._done, self._value, self._exc = True, value, exc
        self.keep = ()
        for fn in self._callbacks:
            fn(self)
        self._callbacks = []

    def __repr__(self):
        state = "pending" if not self._done else ("error" if self._exc else "done")
        return "<epd.Pending %s id=%d %s>" % (self.op or self.kind, self.id, state)


class _Placement:
    """How one tensor travels: in the payload (data: its bytes; owner: what must live while they
    are read) or in a region."""
    __slots__ = ("dtype", "shape", "data", "owner", "region", "offset")

    def __init__(self, dtype, shape, data=None, region=None, offset=None, owner=None):
        self.dtype, self.shape, self.data, self.owner = dtype, tuple(shape), data, owner
        self.region, self.offset = region, offset

    def descriptor(self, begin=None):
        if self.region is not None:
            return fr.region_tensor(self.dtype, self.shape, self.region, self.offset)
        return fr.payload_tensor(self.dtype, self.shape, begin, begin + len(self.data))

    def text(self, begin=None):
        """descriptor(begin) as compact JSON, written directly: its dtype is a wire name and
        the rest integers (json.dumps of a SUBMIT's meta cost 10 us a call)."""
        shape = ",".join(map(str, self.shape))
        if self.region is not None:
            return '{"dtype":"%s","shape":[%s],"region":%d,"offset":%d}' % (
                self.dtype, shape, self.region, self.offset)
        return '{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}' % (
            self.dtype, shape, begin, begin + len(self.data))


class DeviceNeed:
    """A CUDA allocation a SUBMIT names that this connection has not registered yet."""

    def __init__(self, key, meta):
        self.key, self.meta = key, meta
        self.base = self.nbytes = None


class SubmitPlan:
    """A SUBMIT's frame but its id and layer (the tensors' meta text, the payload views), and
    what its Pending holds; made once for a prepared call, which sends it again and again."""
    __slots__ = ("n_tokens", "hidden", "tensors_text", "parts", "payload_len", "out", "out_view",
                 "y_region", "y_torch", "keep", "device_keys", "regions_gen")

    def __init__(self):
        self.out = self.out_view = None
        self.y_region = self.y_torch = False


class Session:
    """One connection's protocol state; the clients own the socket and call in."""

    def __init__(self):
        self._next_id = 1
        self.pending = {}
        self.controls = collections.deque()
        self.host = []                                 # [(HostRegion, region id)]
        self.device = collections.OrderedDict()        # handle -> (region id, base, bytes)
        self.stale = []                                # device region ids to unregister
        self.regions_gen = 0                           # +1 whenever a region is let go
        self.max_device_regions = 32
        self.failure = None
        self.arrivals = 0
        self.experts = None                            # serve_experts: (callback, regions)
        self.experts_queue = collections.deque()       # ExpertsBatch not answered yet

    # ---- ids and requests ------------------------------------------------------------------

    def new_id(self):
        req_id = self._next_id
        self._next_id += 1
        return req_id

    def check_usable(self):
        if self.failure is not None:
            raise self.failure

    def _track(self, p):
        self.pending[p.id] = p
        if p.kind == "control":
            self.controls.append(p.id)
        return p

    def control(self, op, fields=None, payload=b""):
        """(Pending, frame bytes) of a CONTROL {"op", "id", **fields}."""
        if not isinstance(op, str):
            raise InvalidArgument("a CONTROL op is a string, got %r" % (op,))
        meta = {"op": op}
        meta.update(fields or {})
        p = Pending(self.new_id(), "control", op)
        meta["id"] = p.id
        data = fr.encode(fr.CONTROL, meta, payload)
        return self._track(p), data

    def raw(self, data, req_id):
        """A Pending for a hand-made frame whose meta carries req_id: its answer (RESULT,
        REPLY, or ERROR raised) is (meta, payload)."""
        p = Pending(req_id, "raw")
        if req_id in self.pending:
            raise InvalidArgument("id %d is already in flight" % req_id)
        self.pending[req_id] = p
        if len(data) >= 8 and data[6] == fr.CONTROL and data[7] == 0:
            self.controls.append(req_id)
        return p

    # ---- regions ---------------------------------------------------------------------------

    def host_region_id(self, region):
        for r, rid in self.host:
            if r is region:
                return rid
        return None

    def register_host(self, region):
        """(Pending, frame bytes, fd): the CONTROL register of a HostRegion; the fd travels in
        SCM_RIGHTS with the frame's first bytes."""
        if region.fd is None:
            raise InvalidArgument("this host region is closed")
        if self.host_region_id(region) is not None:
            raise InvalidArgument("this host region is already registered on this connection")
        p, data = self.control("register", {"kind": "host", "bytes": region.nbytes})

        def registered(meta):
            rid = _region_id(meta)
            self.host.append((region, rid))
            return rid
        p.on_result = registered
        return p, data, region.fd

    def unregister_host(self, region):
        rid = self.host_region_id(region)
        if rid is None:
            raise InvalidArgument("this host region is not registered on this connection")
        self.host = [(r, i) for r, i in self.host if r is not region]
        self.regions_gen += 1
        return self.control("unregister", {"region": rid})

    def register_device(self, need):
        p, data = self.control("register", need.meta)

        def registered(meta):
            rid = _region_id(meta)
            old = self.device.pop(need.key, None)
            if old is not None:
                self.stale.append(old[0])  # a smaller region of the same allocation
                self.regions_gen += 1
            self.device[need.key] = (rid, need.base, need.nbytes)
            return rid
        p.on_result = registered
        return p, data

    def limit_device_regions(self, cfg):
        """At most half of the daemon's socket.max_regions for device regions (the rest is left
        to host regions); the least recently used go first."""
        limit = cfg.get("socket.max_regions")
        if isinstance(limit, int) and limit > 0:
            self.max_device_regions = max(1, limit // 2)

    def make_room(self, n_new):
        """Marks the least recently used device regions stale so that n_new registrations fit
        under the limit (their unregister frames come from evictions())."""
        while self.device and len(self.device) + n_new > self.max_device_regions:
            self.stale.append(self.device.popitem(last=False)[1][0])
            self.regions_gen += 1

    def evictions(self):
        """CONTROL unregister frames for the least recently used device regions over the
        limit (the daemon releases each once the requests naming it are answered)."""
        out = []
        while len(self.device) > self.max_device_regions:
            self.stale.append(self.device.popitem(last=False)[1][0])
            self.regions_gen += 1
        while self.stale:
            p, data = self.control("unregister", {"region": self.stale.pop()})
            p.on_result = lambda meta: None
            out.append((p, data))
        return out

    def _host_place(self, arr, dtype_name):
        if not self.host:
            return None
        return self._host_place_at(arr.__array_interface__["data"][0], arr.nbytes, dtype_name,
                                   arr.shape)

    def _host_place_at(self, address, nbytes, dtype_name, shape):
        for region, rid in self.host:
            off = region.contains(address, nbytes)
            if off is not None:
                return _Placement(dtype_name, shape, region=rid, offset=off)
        return None

    def _device_place(self, t, tm, needs, seen):
        """The placement of a CUDA tensor in the registered region of its allocation, or None
        after adding that allocation to needs. seen: the allocations found for this SUBMIT's
        earlier tensors; a tensor within one of them is in it (the caller holds those tensors,
        so their memory is live, and live allocations do not overlap), without asking again."""
        ptr = t.data_ptr()
        end = ptr + t.numel() * t.element_size()
        for known in seen:
            if known[1] <= ptr and end <= known[1] + known[2]:
                break
        else:
            known = tm.device_allocation(t)
            seen.append(known)
        handle, base, nbytes = known
        entry = self.device.get(handle)
        if entry is not None and entry[1] == base and end <= base + entry[2]:
            self.device.move_to_end(handle)
            return _Placement(tm.wire_dtype(t), t.shape, region=entry[0], offset=ptr - base)
        if entry is not None and entry[1] == base:
            nbytes = max(nbytes, entry[2])  # a region that grows (torch's handle: see _torch)
        for need in needs:
            if need.key == handle:
                need.nbytes = need.meta["bytes"] = max(need.nbytes, nbytes)
                return None
        need = DeviceNeed(handle, {"kind": "cuda", "handle": base64.b64encode(handle).decode(),
                                   "offset": 0, "bytes": nbytes})
        need.base, need.nbytes = base, nbytes
        needs.append(need)
        return None

    # ---- SUBMIT ----------------------------------------------------------------------------

    def place(self, obj, role, needs, seen):
        """The _Placement of one tensor, or None after appending a DeviceNeed to needs (seen:
        the CUDA allocations of this SUBMIT so far, see _device_place)."""
        tm = torch_module(obj)
        if tm is not None:
            if obj.is_cuda:
                if not obj.is_contiguous():
                    raise InvalidArgument("%s: a CUDA tensor must be contiguous" % role)
                return self._device_place(obj, tm, needs, seen)
            # a CPU tensor: its bytes straight from torch (no numpy view on the way)
            t = tm.host_tensor(obj)
            name = tm.wire_dtype(t)
            address, nbytes = t.data_ptr(), t.numel() * t.element_size()
            if self.host:
                placed = self._host_place_at(address, nbytes, name, t.shape)
                if placed is not None:
                    return placed
            if role == "y":
                raise InvalidArgument("y (out=) must be in a registered region")
            return _Placement(name, t.shape, data=tm.host_bytes(address, nbytes), owner=t)
        arr = _as_array(obj, role)
        name = _NP_WIRE.get(arr.dtype)
        if name is None:
            raise InvalidArgument("%s: numpy dtype %s has no wire name" % (role, arr.dtype))
        if arr.flags.c_contiguous:
            placed = self._host_place(arr, name)
            if placed is not None:
                return placed
        if role == "y":
            raise InvalidArgument("y (out=) must be in a registered region, or a contiguous "
                                  "numpy uint16 array for a payload result")
        arr = np.ascontiguousarray(arr)
        return _Placement(name, arr.shape, data=byte_view(arr))

    def plan_submit(self, x, topk_ids, topk_weights, out):
        """The placements of x, topk_ids, topk_weights (and out when it is in a region), and
        the DeviceNeeds to register first (plan again after registering them)."""
        needs, seen = [], []
        placed = {"x": self.place(x, "x", needs, seen),
                  "topk_ids": self.place(topk_ids, "topk_ids", needs, seen),
                  "topk_weights": self.place(topk_weights, "topk_weights", needs, seen)}
        if out is not None:
            tm = torch_module(out)
            if tm is None or not out.is_cuda:
                arr = tm.host_array(out) if tm is not None else out
                if not isinstance(arr, np.ndarray):
                    raise InvalidArgument("out must be a numpy uint16 array or a torch bfloat16 "
                                          "tensor")
                y = self._host_place(arr, "bf16") if arr.flags.c_contiguous else None
                if y is not None:
                    placed["y"] = y  # its dtype is checked with the rest of out in submit()
                return placed, needs
            placed["y"] = self.place(out, "y", needs, seen)
        return placed, needs

    def submit(self, placed, x, out, layer):
        """(Pending, list of buffers of the SUBMIT frame) once every placement is known."""
        p = Pending(self.new_id(), "submit")
        text, parts, at = self._frame_parts(placed, x, out, p)
        return self._frame(p, text, parts, at, layer)

    def submit_plan(self, placed, x, out):
        """The SubmitPlan of a SUBMIT whose placements are known: all of its frame but the id
        and the layer, and what its Pending is to hold."""
        plan = SubmitPlan()
        plan.tensors_text, plan.parts, plan.payload_len = self._frame_parts(placed, x, out, plan)
        return plan

    def submit_planned(self, plan, layer):
        """(Pending, list of buffers of the SUBMIT frame) of a SubmitPlan, with a new id."""
        p = Pending(self.new_id(), "submit")
        p.n_tokens, p.hidden, p.out = plan.n_tokens, plan.hidden, plan.out
        p.out_view, p.y_region, p.y_torch, p.keep = (plan.out_view, plan.y_region, plan.y_torch,
                                                     plan.keep)
        return self._frame(p, plan.tensors_text, plan.parts, plan.payload_len, layer)

    def _frame_parts(self, placed, x, out, into):
        """(the tensors' meta text, the payload buffers, their length) of a SUBMIT; sets what
        its Pending holds on into (a Pending, or a SubmitPlan for them), out checked against x."""
        shape = placed["x"].shape
        n_tokens, hidden = (shape[0], shape[1]) if len(shape) == 2 else (None, None)
        into.n_tokens, into.hidden = n_tokens, hidden
        tensors, parts, at = [], [], 0
        # payload tensors by decreasing element size: every offset aligned, no gap
        order = sorted((k for k in ("x", "topk_ids", "topk_weights") if placed[k].data is not None),
                       key=lambda k: -fr.DTYPE_SIZES.get(placed[k].dtype, 1))
        for name in ("x", "topk_ids", "topk_weights", "y"):
            if name in placed and placed[name].data is None:
                tensors.append('"%s":%s' % (name, placed[name].text()))
        for name in order:
            tensors.append('"%s":%s' % (name, placed[name].text(at)))
            parts.append(placed[name].data)
            at += len(placed[name].data)
        if out is not None:
            tm = torch_module(out)
            want = (n_tokens, hidden)
            got = tuple(out.shape)
            if got != want:
                raise InvalidArgument("out has shape %s, y is %s" % (list(got), list(want)))
            if tm is not None:
                if out.dtype != tm.torch.bfloat16:
                    raise InvalidArgument("out must be a torch.bfloat16 tensor")
            elif out.dtype != np.uint16:
                raise InvalidArgument("out must be uint16 (bf16 bit patterns)")
            into.out = out
            if "y" in placed:
                into.y_region = True
            else:
                host = tm.host_array(out) if tm is not None else out
                if not host.flags.c_contiguous or (tm is not None and not out.is_contiguous()):
                    raise InvalidArgument("out must be contiguous")
                into.out_view = byte_view(host)
        else:
            into.y_torch = torch_module(x) is not None
        into.keep = tuple(parts) + tuple(placed[k].owner for k in order)
        return ",".join(tensors), parts, at

    def _frame(self, p, tensors_text, parts, payload_len, layer):
        """The SUBMIT frame of Pending p (tracked from here on)."""
        text = '{"id":%d,"tensors":{%s}' % (p.id, tensors_text)
        if layer is not None:
            if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < 1 << 31:
                raise InvalidArgument("layer must be an integer in [0, 2^31), got %r" % (layer,))
            text += ',"layer":%d' % layer
        head_meta = (text + "}").encode()
        if len(head_meta) > fr.MAX_META:
            raise InvalidArgument("meta of %d bytes is over the protocol's %d"
                                  % (len(head_meta), fr.MAX_META))
        bufs = [fr.encode_header(fr.SUBMIT, len(head_meta), payload_len) + head_meta]
        bufs.extend(parts)
        return self._track(p), bufs

    def prepared_plan(self, placed, x, out):
        """submit_plan for a prepared call, with the device regions it names and the region
        generation it was made in (plan_current)."""
        plan = self.submit_plan(placed, x, out)
        regions = {pl.region for pl in placed.values() if pl.region is not None}
        plan.device_keys = tuple(k for k, e in self.device.items() if e[0] in regions)
        plan.regions_gen = self.regions_gen
        return plan

    def plan_current(self, plan):
        """True while every region a SubmitPlan names is still this connection's (nothing let
        go since it was made); its device regions then count as just used."""
        if plan.regions_gen != self.regions_gen:
            return False
        for key in plan.device_keys:
            self.device.move_to_end(key)
        return True

    # ---- frames from the daemon ------------------------------------------------------------

    def place_payload(self, ftype, meta, length):
        """Where a RESULT's payload goes: straight into the caller's out when it has one."""
        if ftype != fr.RESULT:
            return None
        p = self.pending.get(meta.get("id"))
        if p is None or p.out_view is None or len(p.out_view) != length:
            return None
        return p.out_view

    def on_frame(self, ftype, meta, payload):
        """Handles one frame; ProtocolError when it makes no sense (the caller closes)."""
        self.arrivals += 1
        if ftype == fr.RESULT:
            p = self.pending.get(meta.get("id"))
            if p is None or p.kind == "control":
                raise ProtocolError("RESULT for id %r, which is not a request in flight"
                                    % (meta.get("id"),))
            del self.pending[p.id]
            if p.kind == "raw":
                p.arrival, p.meta = self.arrivals, meta
                p._finish((meta, bytes(payload)))
            else:
                self._result(p, meta, payload)
        elif ftype == fr.ERROR:
            exc = error_from_meta(meta)
            p = self.pending.get(exc.id) if exc.id is not None else None
            if p is not None:
                self._drop(p)
                p.arrival = self.arrivals
                p.meta = meta
                p._finish(exc=exc)
                if isinstance(exc, FramingError):
                    self.failure = ConnectionClosed(
                        "the daemon closes the connection after %s" % exc)
            else:
                self.fail(exc)
        elif ftype == fr.REPLY:
            p = self.pending.get(meta.get("id"))
            if p is None or p.kind == "submit":
                if not self.controls:
                    raise ProtocolError("REPLY with no CONTROL in flight")
                p = self.pending[self.controls[0]]
            self._drop(p)
            p.arrival, p.meta = self.arrivals, meta
            value = (meta, bytes(payload))
            if p.on_result is not None:
                try:
                    value = p.on_result(meta)
                except ProtocolError as e:
                    p._finish(exc=e)
                    return
            p._finish(value)
        elif ftype == fr.EXPERTS and self.experts is not None:
            batch = ExpertsBatch(meta, self.experts[1])
            batch.seen_ns = time.monotonic_ns()
            self.experts_queue.append(batch)
        else:
            raise ProtocolError("the daemon sent a %s frame, which this client does not take"
                                % fr.TYPE_NAMES.get(ftype, ftype))

    def _drop(self, p):
        self.pending.pop(p.id, None)
        if p.kind != "submit":
            try:
                self.controls.remove(p.id)
            except ValueError:
                pass

    def _result(self, p, meta, payload):
        p.arrival, p.meta, p.step = self.arrivals, meta, meta.get("step")
        y = (meta.get("tensors") or {}).get("y") if isinstance(meta.get("tensors"), dict) else None
        want = [p.n_tokens, p.hidden]
        if not isinstance(y, dict) or y.get("dtype") != "bf16" or y.get("shape") != want:
            p._finish(exc=ProtocolError("RESULT's y is %r, expected bf16 %s" % (y, want), id=p.id))
            return
        if p.y_region:
            if "region" not in y or len(payload):
                p._finish(exc=ProtocolError("RESULT did not use the y region", id=p.id))
                return
            p._finish(p.out)
            return
        nbytes = 2 * p.n_tokens * p.hidden
        if y.get("data_offsets") != [0, nbytes] or len(payload) != nbytes:
            p._finish(exc=ProtocolError("RESULT payload of %d bytes for y of %d"
                                        % (len(payload), nbytes), id=p.id))
            return
        if p.out is not None:
            if p.out_view is not None and payload is not p.out_view:
                p.out_view[:] = payload
            p._finish(p.out)
            return
        arr = np.frombuffer(payload, dtype=np.uint16).reshape(p.n_tokens, p.hidden)
        if p.y_torch:
            from . import _torch
            arr = _torch.from_host(arr, None)
        p._finish(arr)

    def fail(self, exc):
        """Fails every request in flight with exc; the connection is unusable from now on."""
        if self.failure is None:
            self.failure = exc if isinstance(exc, ConnectionClosed) else ConnectionClosed(
                "the connection is closed after %s" % exc)
        pending = list(self.pending.values())
        self.pending.clear()
        self.controls.clear()
        for p in pending:
            self.arrivals += 1
            p.arrival = self.arrivals
            p._finish(exc=exc)

    def on_eof(self, why="the daemon closed the connection"):
        """The connection ended: every request still in flight fails with ConnectionClosed (its
        message names the error that explained the close, if one came), and so does every
        later call."""
        self.fail(self.failure if self.failure is not None else ConnectionClosed(why))


def byte_view(arr):
    """A flat writable-if-arr-is memoryview of a contiguous array's bytes (any shape, empty
    included)."""
    return memoryview(arr.reshape(-1).view(np.uint8))


def _region_id(meta):
    rid = meta.get("region")
    if not isinstance(rid, int) or isinstance(rid, bool) or rid < 0:
        raise ProtocolError("register REPLY without a region id: %r" % (meta,))
    return rid


def _as_array(obj, role):
    if isinstance(obj, np.ndarray):
        return obj
    if role == "topk_ids":
        return np.asarray(obj, dtype=np.int32)
    if role == "topk_weights":
        return np.asarray(obj, dtype=np.float32)
    raise InvalidArgument("%s must be a numpy array (bf16 as uint16) or a torch tensor, got %s"
                          % (role, type(obj).__name__))
