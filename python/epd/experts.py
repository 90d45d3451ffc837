"""External experts (experts.kind external, DESIGN.md section 9, docs/protocol.md section 16): a
connection that sent CONTROL serve_experts gets an EXPERTS frame for each step that has rows for
its rank's experts; the rows are in its input region, grouped by local expert; it writes each
row's expert output (bf16) into its output region and answers EXPERTS_DONE {"step"}.

ExpertsBatch is one EXPERTS frame as numpy views of the worker's host regions. Client.serve_experts
(callback) makes a Client a worker: every wait of that Client (submit, result, serve) then
services EXPERTS by calling callback(batch) and answering, so one single-threaded process can
submit its tokens and serve its rank's experts on one connection without deadlocking."""
import numpy as np

from .errors import InvalidArgument, ProtocolError

_DTYPES = {"f8_e4m3": np.uint8, "bf16": np.uint16, "f32": np.float32, "i32": np.int32}


def _e4m3_table():
    """The fp32 value of every e4m3fn byte (DESIGN.md section 3: no infinities, 0x7f/0xff NaN)."""
    out = np.zeros(256, np.float32)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        exp, man = (b >> 3) & 0xF, b & 0x7
        if exp == 0xF and man == 0x7:
            out[b] = np.nan
        elif exp == 0:
            out[b] = sign * man * 2.0 ** -9
        else:
            out[b] = sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)
    return out


#: E4M3[q] is the fp32 value of the e4m3 byte q (numpy: E4M3[x] dequantizes an array of bytes).
E4M3 = _e4m3_table()


def max_rows(cfg, world):
    """The most rows one step can hand a rank's worker (the daemon's own bound), from the config
    document and the job's size."""
    n_local = cfg["model.num_experts"] // world
    if cfg.get("experts.external_layout") == "masked":
        return n_local * cfg["experts.external_capacity"]
    return cfg["dispatch.max_tokens_per_step"] * world * min(cfg["model.topk"], n_local)


def region_bytes(cfg, world):
    """(input bytes, output bytes) that hold the largest step (the serve_experts REPLY says the
    same as input_bytes and output_bytes)."""
    rows, hidden = max_rows(cfg, world), cfg["model.hidden"]
    n_local = cfg["model.num_experts"] // world
    fmt = cfg.get("experts.external_input", "fp8_group128")
    row = 2 * hidden if fmt == "bf16" else hidden
    x = rows * row
    scales = 4 if fmt == "fp8_per_tensor" else 0
    if fmt == "fp8_group128":
        per = 1 if (cfg.get("dispatch.dtype") == "fp8" and
                    cfg.get("dispatch.scale") == "per_token") else hidden // 128
        scales = rows * per * 4
    a = (x + 15) // 16 * 16
    b = (a + scales + 15) // 16 * 16
    return b + 4 * n_local, rows * hidden * 2


class ExpertsBatch:
    """One step's rows for this rank's experts. step, layer, first_expert (the rank's first
    expert id), counts (rows per local expert), input (the format), layout ("packed" or
    "masked"), rows; x (uint8 e4m3 codes, or uint16 bf16 bit patterns: [rows, H], masked
    [experts, capacity, H]), scales (float32 [rows, H/128] or [rows, 1] for fp8_group128, else
    None), scale (S of fp8_per_tensor, else None), y (uint16 bf16, x's leading shape, to be
    filled). Views of the worker's regions: valid until EXPERTS_DONE is sent."""

    def __init__(self, meta, regions):
        try:
            self.step = meta["step"]
            self.layer = meta["layer"]
            self.first_expert = meta["first_expert"]
            self.counts = [int(c) for c in meta["counts"]]
            self.input = meta["input"]
            self.layout = meta["layout"]
            self.rows = meta["rows"]
            self.sent_ns = meta.get("sent_ns")
            self.scale = meta.get("scale")
            t = meta["tensors"]
            self.x = self._view(t["x"], regions)
            self.y = self._view(t["y"], regions)
            self.scales = self._view(t["scales"], regions) if "scales" in t else None
        except (KeyError, TypeError) as e:
            raise ProtocolError("EXPERTS meta without %s" % e) from None
        self.seen_ns = None

    @staticmethod
    def _view(desc, regions):
        region = regions.get(desc["region"])
        if region is None:
            raise ProtocolError("EXPERTS names region %r, not one of this worker's"
                                % (desc["region"],))
        if isinstance(region, DeviceBuffer):
            return region.view(tuple(desc["shape"]), desc["dtype"], desc["offset"])
        return region.array(tuple(desc["shape"]), _DTYPES[desc["dtype"]], desc["offset"])

    @property
    def on_device(self):
        """True when x, scales and y are torch CUDA tensors (device regions)."""
        return not isinstance(self.x, np.ndarray)

    def experts(self):
        """(expert id, x rows, scales rows or None, y rows) for each local expert with rows, in
        expert order (views into x, scales and y)."""
        at = 0
        for i, n in enumerate(self.counts):
            if self.layout == "masked":
                sl = (i, slice(0, n))
            else:
                sl = (slice(at, at + n),)
                at += n
            if n == 0:
                continue
            yield (self.first_expert + i, self.x[sl], None if self.scales is None
                   else self.scales[sl], self.y[sl])

    def dequantized(self, x, scales):
        """fp32 values of rows x as this batch's format gives them: e4m3 codes times their group
        (or token) scales, e4m3 codes times S (fp8_per_tensor), or bf16 widened. numpy arrays, or
        torch tensors on the device for device regions."""
        if self.on_device:
            return _dequantized_torch(self, x, scales)
        if self.input == "bf16":
            return (x.astype(np.uint32) << np.uint32(16)).view(np.float32)
        q = E4M3[x]
        if self.input == "fp8_per_tensor":
            return q * np.float32(self.scale)
        groups = scales.shape[-1]
        s = np.repeat(scales, x.shape[-1] // groups, axis=-1) if groups > 1 else scales
        return q * s.astype(np.float32)


class DeviceBuffer:
    """A worker's device region: a torch uint8 CUDA tensor of nbytes, whose views are torch
    tensors (x uint8 e4m3 codes, y bfloat16, scales float32)."""

    _TORCH = {"f8_e4m3": "uint8", "bf16": "bfloat16", "f32": "float32", "i32": "int32"}
    _SIZE = {"f8_e4m3": 1, "bf16": 2, "f32": 4, "i32": 4}

    def __init__(self, nbytes, device):
        import torch
        self.torch = torch
        self.nbytes = nbytes
        self.tensor = torch.zeros(nbytes + 256, dtype=torch.uint8, device=device)
        # 256-byte aligned start (rows are read with 16-byte loads)
        self.start = (-self.tensor.data_ptr()) % 256
        self.buf = self.tensor[self.start:self.start + nbytes]

    def view(self, shape, dtype, offset):
        t = self.torch
        count = 1
        for d in shape:
            count *= d
        dt = getattr(t, self._TORCH[dtype])
        size = self._SIZE[dtype]  # (not an empty tensor's element_size: a few us each)
        if offset + count * size > self.nbytes:
            raise ProtocolError("EXPERTS names [%d, %d) of a %d-byte device region"
                                % (offset, offset + count * size, self.nbytes))
        return self.buf[offset:offset + count * size].view(dt).view(shape)


_E4M3_TORCH = {}


def _dequantized_torch(batch, x, scales):
    import torch
    if batch.input == "bf16":
        return x.float()
    table = _E4M3_TORCH.get(x.device)
    if table is None:
        table = _E4M3_TORCH[x.device] = torch.from_numpy(E4M3).to(x.device)
    q = table[x.long()]
    if batch.input == "fp8_per_tensor":
        return q * torch.tensor(batch.scale, dtype=torch.float32, device=x.device)
    groups = scales.shape[-1]
    s = scales.repeat_interleave(x.shape[-1] // groups, dim=-1) if groups > 1 else scales
    return q * s


def serve_fields(ids, input_scale):
    """CONTROL serve_experts's fields for the input and output region ids and input_scale (S for
    every layer, {layer: S}, or None)."""
    fields = {"input": ids[0], "output": ids[1]}
    if input_scale is not None:
        fields["input_scale"] = ({str(k): float(v) for k, v in input_scale.items()}
                                 if isinstance(input_scale, dict) else float(input_scale))
    return fields


def register_fields(buf):
    """CONTROL register's fields for a DeviceBuffer (a cuda region)."""
    import base64
    from . import _torch
    handle, base, _ = _torch.device_allocation(buf.buf)
    return {"kind": "cuda", "handle": base64.b64encode(handle).decode(),
            "offset": buf.buf.data_ptr() - base, "bytes": buf.nbytes}


def done_meta(batch, done_ns):
    """EXPERTS_DONE's meta for a batch (with the worker's times for the daemon's latency log)."""
    if not isinstance(batch, ExpertsBatch):
        raise InvalidArgument("not an ExpertsBatch")
    meta = {"step": batch.step, "done_ns": done_ns}
    if batch.seen_ns is not None:
        meta["seen_ns"] = batch.seen_ns
    return meta
