#!/usr/bin/env python3
"""Wire-protocol v1 helpers for the daemon's integration tests (DESIGN.md section 4), in plain
python3: frames, SUBMIT payloads, control queries. As a command:
    daemon_wire.py health|stats|config|metrics SOCKET   prints the reply (JSON, or the text)
    daemon_wire.py stat SOCKET KEY.PATH                 prints one value of the stats reply
"""
import json
import socket
import struct
import sys

MAGIC = b"EPD1"
SUBMIT, RESULT, ERROR, CONTROL, REPLY = 1, 2, 3, 4, 5


def header(ftype, meta_len, payload_len, magic=MAGIC, version=1, reserved=0):
    return magic + struct.pack("<HHIIQ", version, ftype, meta_len, reserved, payload_len)


def frame(ftype, meta, payload=b""):
    m = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
    return header(ftype, len(m), len(payload)) + m + payload


def bf16(value):
    """Nearest-even bf16 bit pattern of a python float (finite or not)."""
    u = struct.unpack("<I", struct.pack("<f", value))[0]
    if (u & 0x7F800000) == 0x7F800000:
        return u >> 16
    u += 0x7FFF + ((u >> 16) & 1)
    return (u >> 16) & 0xFFFF


def submit(req_id, n, hidden, topk, x=None, ids=None, weights=None, dtypes=None, shapes=None):
    """A SUBMIT frame; x defaults to small values, ids to 0..K-1, weights to 0.5."""
    if x is None:
        x = [bf16(((i % 7) - 3) * 0.25) for i in range(n * hidden)]
    if ids is None:
        ids = [k for _ in range(n) for k in range(topk)]
    if weights is None:
        weights = [0.5] * (n * topk)
    xb = struct.pack("<%dH" % len(x), *x)
    ib = struct.pack("<%di" % len(ids), *ids)
    wb = struct.pack("<%df" % len(weights), *weights)
    dt = {"x": "bf16", "topk_ids": "i32", "topk_weights": "f32"}
    dt.update(dtypes or {})
    sh = {"x": [n, hidden], "topk_ids": [n, topk], "topk_weights": [n, topk]}
    sh.update(shapes or {})
    tensors = {
        "topk_ids": {"dtype": dt["topk_ids"], "shape": sh["topk_ids"],
                     "data_offsets": [0, len(ib)]},
        "topk_weights": {"dtype": dt["topk_weights"], "shape": sh["topk_weights"],
                         "data_offsets": [len(ib), len(ib) + len(wb)]},
        "x": {"dtype": dt["x"], "shape": sh["x"],
              "data_offsets": [len(ib) + len(wb), len(ib) + len(wb) + len(xb)]},
    }
    return frame(SUBMIT, {"id": req_id, "tensors": tensors}, ib + wb + xb)


def connect(path, timeout=10.0):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    return s


def recv_exact(s, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError("connection closed after %d of %d bytes" % (len(buf), n))
        buf += chunk
    return bytes(buf)


def read_frame(s):
    """(type, meta dict, payload bytes); EOFError when the daemon closed the connection."""
    head = recv_exact(s, 24)
    if head[:4] != MAGIC:
        raise ValueError("bad magic from the daemon: %r" % head[:4])
    _, ftype, meta_len, _, payload_len = struct.unpack("<HHIIQ", head[4:])
    meta = json.loads(recv_exact(s, meta_len)) if meta_len else {}
    payload = recv_exact(s, payload_len) if payload_len else b""
    return ftype, meta, payload


def is_closed(s, timeout=5.0):
    """True when the daemon closes its end (EOF or reset) within timeout."""
    s.settimeout(timeout)
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def control(path, op):
    with connect(path) as s:
        s.sendall(frame(CONTROL, {"op": op}))
        ftype, meta, payload = read_frame(s)
    if ftype != REPLY:
        raise RuntimeError("%s: expected REPLY, got type %d %s" % (op, ftype, meta))
    return meta, payload


def stat(path, dotted):
    meta, _ = control(path, "stats")
    value = meta
    for part in dotted.split("."):
        value = value[part]
    return value


def main(argv):
    if len(argv) == 3 and argv[1] in ("health", "stats", "config", "metrics"):
        meta, payload = control(argv[2], argv[1])
        if argv[1] == "metrics":
            sys.stdout.write(payload.decode())
        else:
            print(json.dumps(meta))
        return 0
    if len(argv) == 4 and argv[1] == "stat":
        print(json.dumps(stat(argv[2], argv[3])))
        return 0
    sys.stderr.write(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
