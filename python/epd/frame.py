"""Wire protocol v1 (DESIGN.md section 4, docs/protocol.md): the 24-byte frame header, frame
encoding, safetensors-style tensor descriptors and an incremental frame receiver that lets the
caller choose where each payload lands (so a RESULT can be read straight into its output array).
Pure: no sockets here."""
import json
import struct

from .errors import InvalidArgument, ProtocolError

MAGIC = b"EPD1"
VERSION = 1
HEADER_LEN = 24
MAX_META = 65536
MAX_PAYLOAD = 1 << 40  # far above any answer; a bigger length is a broken stream, not data

SUBMIT, RESULT, ERROR, CONTROL, REPLY, EXPERTS, EXPERTS_DONE = 1, 2, 3, 4, 5, 6, 7
TYPE_NAMES = {SUBMIT: "submit", RESULT: "result", ERROR: "error", CONTROL: "control",
              REPLY: "reply", EXPERTS: "experts", EXPERTS_DONE: "experts_done"}

_HEAD = struct.Struct("<4sHHIIQ")

#: Wire dtype names and their element sizes (proto/tensor.c).
DTYPE_SIZES = {"bool": 1, "u8": 1, "i8": 1, "f8_e4m3": 1, "f8_e5m2": 1, "u16": 2, "i16": 2,
               "f16": 2, "bf16": 2, "u32": 4, "i32": 4, "f32": 4, "u64": 8, "i64": 8, "f64": 8}


def encode_header(ftype, meta_len, payload_len):
    """The 24 header bytes (magic, version 1, reserved 0)."""
    return _HEAD.pack(MAGIC, VERSION, ftype, meta_len, 0, payload_len)


def decode_header(head):
    """(type, meta_len, payload_len) of 24 header bytes; ProtocolError when they are not a valid
    v1 header."""
    if len(head) != HEADER_LEN:
        raise ProtocolError("a frame header is %d bytes, got %d" % (HEADER_LEN, len(head)))
    magic, version, ftype, meta_len, reserved, payload_len = _HEAD.unpack(head)
    if magic != MAGIC:
        raise ProtocolError("bad magic %r from the daemon (expected %r)" % (magic, MAGIC))
    if version != VERSION:
        raise ProtocolError("protocol version %d from the daemon (expected %d)" % (version,
                                                                                  VERSION))
    if ftype not in TYPE_NAMES:
        raise ProtocolError("unknown frame type %d from the daemon" % ftype)
    if reserved != 0:
        raise ProtocolError("reserved header field is %d, not 0" % reserved)
    if meta_len > MAX_META:
        raise ProtocolError("meta of %d bytes is over the protocol's %d" % (meta_len, MAX_META))
    return ftype, meta_len, payload_len


def encode_meta(meta):
    """Strict JSON (no NaN, compact) as UTF-8 bytes; InvalidArgument when over MAX_META."""
    try:
        text = json.dumps(meta, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise InvalidArgument("meta is not JSON: %s" % e) from None
    if len(text) > MAX_META:
        raise InvalidArgument("meta of %d bytes is over the protocol's %d" % (len(text), MAX_META))
    return text


def encode(ftype, meta, payload=b""):
    """One whole frame as bytes; meta is a dict (or already encoded bytes)."""
    m = meta if isinstance(meta, (bytes, bytearray)) else encode_meta(meta)
    return encode_header(ftype, len(m), len(payload)) + bytes(m) + bytes(payload)


def payload_tensor(dtype, shape, begin, end):
    """A descriptor of a tensor in the payload at [begin, end)."""
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def region_tensor(dtype, shape, region, offset):
    """A descriptor of a tensor in shared region `region` at byte `offset` (DESIGN.md 4b)."""
    return {"dtype": dtype, "shape": list(shape), "region": region, "offset": offset}


def decode_meta(raw):
    """The meta JSON object of a frame from the daemon; ProtocolError when it is not one."""
    try:
        meta = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError("meta from the daemon is not JSON: %s" % e) from None
    if not isinstance(meta, dict):
        raise ProtocolError("meta from the daemon is not a JSON object")
    return meta


class Receiver:
    """Incremental frame decoder. The caller asks where the next bytes go (want()), fills that
    memoryview (from its socket), and reports how many bytes it wrote (got(n)); got() returns
    each whole frame as (type, meta, payload). Before a payload is read, place_payload(type,
    meta, length) (set by the owner) may return a writable memoryview of exactly length bytes
    to receive it (zero copy into an output array); else a bytearray is allocated."""

    def __init__(self, place_payload=None):
        self.place_payload = place_payload
        self._head = bytearray(HEADER_LEN)
        self._reset()

    def _reset(self):
        self._phase = 0  # 0 header, 1 meta, 2 payload
        self._buf = memoryview(self._head)
        self._have = 0
        self._type = self._meta = self._payload = None
        self._meta_len = self._payload_len = 0

    def idle(self):
        """True between frames."""
        return self._phase == 0 and self._have == 0

    def want(self):
        """The writable memoryview the next bytes go to (never empty)."""
        return self._buf[self._have:]

    def got(self, n):
        """n bytes were written into want(); a whole frame (type, meta, payload) or None."""
        self._have += n
        if self._have < len(self._buf):
            return None
        return self._advance()

    def take(self, view):
        """Consumes the start of view (bytes read, which the caller reuses afterwards): (bytes
        used, a whole frame or None). A frame wholly in view, with none in progress, is decoded
        from view itself (its payload copied once, into place_payload's target or a new buffer);
        else the bytes go through want() and got() as far as the frame's current part reaches."""
        n = len(view)
        if self._phase == 0 and self._have == 0 and n >= HEADER_LEN:
            ftype, meta_len, payload_len = decode_header(view[:HEADER_LEN])
            end = HEADER_LEN + meta_len + payload_len
            if meta_len >= 2 and payload_len <= MAX_PAYLOAD and n >= end:
                meta = decode_meta(view[HEADER_LEN:HEADER_LEN + meta_len])
                target = None
                if payload_len and self.place_payload is not None:
                    target = self.place_payload(ftype, meta, payload_len)
                if target is None:
                    target = memoryview(bytearray(payload_len))
                elif len(target) != payload_len:
                    raise ProtocolError("payload target of %d bytes for %d" % (len(target),
                                                                              payload_len))
                if payload_len:
                    target[:] = view[end - payload_len:end]
                return end, (ftype, meta, target)
        target = self.want()
        k = min(len(target), n)
        target[:k] = view[:k]
        return k, self.got(k)

    def _advance(self):
        while True:
            if self._phase == 0:
                self._type, self._meta_len, self._payload_len = decode_header(bytes(self._head))
                if self._meta_len < 2:
                    raise ProtocolError("frame from the daemon with %d bytes of meta"
                                        % self._meta_len)
                if self._payload_len > MAX_PAYLOAD:
                    raise ProtocolError("frame from the daemon with a %d-byte payload"
                                        % self._payload_len)
                self._phase, self._have = 1, 0
                self._buf = memoryview(bytearray(self._meta_len))
                return None
            if self._phase == 1:
                self._meta = decode_meta(self._buf)
                self._phase, self._have = 2, 0
                target = None
                if self._payload_len and self.place_payload is not None:
                    target = self.place_payload(self._type, self._meta, self._payload_len)
                if target is None:
                    target = memoryview(bytearray(self._payload_len))
                elif len(target) != self._payload_len:
                    raise ProtocolError("payload target of %d bytes for %d" % (len(target),
                                                                              self._payload_len))
                self._payload = target
                self._buf = target
                if self._payload_len:
                    return None
            frame = (self._type, self._meta, self._payload)
            self._reset()
            return frame
