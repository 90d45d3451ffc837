#!/usr/bin/env python3
"""docs/protocol.md against the real daemon (tests/integration/protocol_doc.sh starts it with the
doc's example settings): the worked SUBMIT gets exactly the documented RESULT bytes from rank 0
(its first step) and the same y from rank 1; the patched SUBMIT gets exactly the documented ERROR
and the connection stays; every checked example gets its documented code on the wire, with the
connection closed after framing codes (the error table's "closed") and open after the others; the
REPLY documents have the documented fields; the minimal client of section 14 runs as written.
    protocol_doc.py DOC SOCKET0 SOCKET1
"""
import json
import mmap
import os
import re
import socket
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import daemon_wire as w  # noqa: E402

failures = []


def fail(line, msg):
    failures.append("%s:%d: %s" % (DOC, line, msg))


def directives(text):
    """[(line, kind, args dict, first word, body text)] of the doc's `<!-- check: -->` blocks."""
    out = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"<!-- check: (\S+)(.*?)\s*-->", lines[i])
        if not m:
            i += 1
            continue
        kind, rest, line = m.group(1), m.group(2).split(), i + 1
        args = dict(a.split("=", 1) for a in rest if "=" in a)
        first = rest[0] if rest and "=" not in rest[0] else ""
        i += 1
        body = []
        if i < len(lines) and lines[i].startswith("```"):
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
        else:
            while i < len(lines) and lines[i].startswith("|"):
                body.append(lines[i])
                i += 1
        out.append((line, kind, args, first, "\n".join(body)))
    return out


def hexdump(body):
    """The bytes of a `hexdump -C` block ('*' repeats the line above)."""
    out, last, repeat = bytearray(), b"", False
    for line in body.split("\n"):
        if line == "*":
            repeat = True
            continue
        off = int(line[:8], 16)
        if repeat:
            while len(out) < off:
                out += last
            repeat = False
        hexpart = line[8:].split("|")[0].split()
        if hexpart:
            last = bytes(int(b, 16) for b in hexpart)
            out += last
    return bytes(out)


def error_table(dirs):
    """code -> 'closed' | 'stays', from the doc's error-code table."""
    for _, kind, _, _, body in dirs:
        if kind == "error-codes":
            rows = [[c.strip().strip("`") for c in r.strip("|").split("|")]
                    for r in body.split("\n")[2:]]
            return {r[0]: r[2].split()[0] for r in rows}
    return {}


def connect(path):
    return w.connect(path, timeout=10.0)


def still_open(s):
    """The connection still answers: a CONTROL health gets its REPLY."""
    s.sendall(w.frame(w.CONTROL, {"op": "health"}))
    ftype, _, _ = w.read_frame(s)
    return ftype == w.REPLY


def raw_frame(s):
    """One whole frame's bytes as they came."""
    head = w.recv_exact(s, 24)
    meta_len = int.from_bytes(head[8:12], "little")
    payload_len = int.from_bytes(head[16:24], "little")
    return head + w.recv_exact(s, meta_len) + w.recv_exact(s, payload_len)


def register_regions(s, spec, content, line):
    """regions=ID:BYTES,...: registers host regions (memfds holding content at offset 0) on s; the
    daemon must give them the ids the doc names. Returns the mappings."""
    maps = []
    for item in spec.split(","):
        rid, size = (int(v) for v in item.split(":"))
        fd = os.memfd_create("epd-doc-region")
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
        m[:len(content)] = content
        meta = json.dumps({"op": "register", "kind": "host", "bytes": size, "id": rid}).encode()
        socket.send_fds(s, [w.header(w.CONTROL, len(meta), 0) + meta], [fd])
        os.close(fd)
        ftype, reply, _ = w.read_frame(s)
        want = {"id": rid, "region": rid, "kind": "host", "bytes": size}
        if ftype != w.REPLY or reply != want or list(reply)[0] != "id":
            fail(line, "register answered %d %s, the doc expects REPLY %s" % (ftype, reply, want))
        maps.append(m)
    return maps


def check_answer(line, path, data, expect, closes, what, regions=None, content=b"", check=None):
    """Sends data on a fresh connection (after registering regions=...); the answer must be
    RESULT for ok, else ERROR expect, and the connection closed exactly when closes. check(meta,
    payload, maps) looks further at a RESULT."""
    with connect(path) as s:
        maps = register_regions(s, regions, content, line) if regions else []
        s.sendall(data)
        try:
            ftype, meta, _ = w.read_frame(s)
        except EOFError:
            fail(line, "%s: the daemon closed without an answer" % what)
            return
        got = "ok" if ftype == w.RESULT else meta.get("code") if ftype == w.ERROR else ftype
        if got != expect:
            fail(line, "%s: the daemon answers %s (%s), the doc says %s" %
                 (what, got, meta.get("message"), expect))
            return
        if check is not None and ftype == w.RESULT:
            check(line, meta, _, maps)
        if closes:
            if not w.is_closed(s):
                fail(line, "%s: %s should close the connection, it stays open" % (what, expect))
        else:
            try:
                if not still_open(s):
                    fail(line, "%s: no REPLY after %s" % (what, expect))
            except (EOFError, ConnectionError):
                fail(line, "%s: the connection closed after %s, the doc says it stays" %
                     (what, expect))


def shape(doc, code, path, line):
    if type(doc) is not type(code) and not (isinstance(doc, (int, float)) and
                                             isinstance(code, (int, float))):
        fail(line, "%s: the daemon sends %s, the doc shows %s" % (path, type(code).__name__,
                                                                   type(doc).__name__))
    elif isinstance(code, dict):
        for k in set(code) | set(doc):
            if k not in doc:
                fail(line, "%s.%s: sent by the daemon, not in the doc" % (path, k))
            elif k not in code:
                fail(line, "%s.%s: in the doc, not sent by the daemon" % (path, k))
            else:
                shape(doc[k], code[k], path + "." + k, line)


def y_in_region(body):
    """For an example whose y is in a region: a check that the RESULT names it, has no payload,
    and that the region holds the worked example's y."""
    y = json.loads(body)["tensors"].get("y")
    if y is None or "region" not in y:
        return None

    def check(line, meta, payload, maps):
        want = {"dtype": "bf16", "shape": y["shape"], "region": y["region"],
                "offset": y.get("offset", 0)}
        if meta["tensors"]["y"] != want or payload:
            fail(line, "RESULT %s (payload %d bytes), the doc says y %s and no payload" %
                 (meta, len(payload), want))
        m = maps[y["region"] - 1]
        rows = bytes(m[want["offset"]:want["offset"] + 512])
        if rows != RESULT_Y:
            fail(line, "the region holds other y rows than the worked example's RESULT")
    return check


def regions_lifecycle(sock, submit):
    """unregister answers at once and echoes the id; the region is gone for later SUBMITs;
    CONTROL ids are echoed first."""
    with connect(sock) as s:
        s.sendall(w.frame(w.CONTROL, {"op": "health", "id": 3}))
        ftype, meta, _ = w.read_frame(s)
        if ftype != w.REPLY or list(meta)[:2] != ["id", "status"] or meta["id"] != 3:
            fail(0, "health with id 3 answered %s" % meta)
        register_regions(s, "1:4096", submit[-544:], 0)
        s.sendall(w.frame(w.CONTROL, {"op": "unregister", "region": 1, "id": 5}))
        ftype, meta, _ = w.read_frame(s)
        if ftype != w.REPLY or meta != {"id": 5, "region": 1}:
            fail(0, "unregister answered %d %s" % (ftype, meta))
        tensors = {"topk_ids": {"dtype": "i32", "shape": [2, 2], "region": 1, "offset": 0},
                   "topk_weights": {"dtype": "f32", "shape": [2, 2], "region": 1, "offset": 16},
                   "x": {"dtype": "bf16", "shape": [2, 128], "region": 1, "offset": 32}}
        s.sendall(w.frame(w.SUBMIT, {"id": 6, "tensors": tensors}))
        ftype, meta, _ = w.read_frame(s)
        if ftype != w.ERROR or meta.get("code") != "bad_region":
            fail(0, "a SUBMIT naming an unregistered region got %s" % meta)
        s.sendall(w.frame(w.CONTROL, {"op": "register", "kind": "host", "bytes": 4096}))
        ftype, meta, _ = w.read_frame(s)
        if ftype != w.ERROR or meta.get("code") != "bad_region":
            fail(0, "a host register without a descriptor got %s" % meta)


RESULT_Y = b""


def main(argv):
    global DOC
    DOC, sock0, sock1 = argv[1:4]
    dirs = directives(open(DOC).read())
    frames = {first: (line, args, hexdump(body)) for line, kind, args, first, body in dirs
              if kind == "frame"}
    table = error_table(dirs)
    if not table or not {"submit", "result", "error", "control"} <= set(frames):
        fail(0, "the doc lacks the error table or the worked example's frames")
        return 1

    # The worked example, byte for byte: rank 0 serves it in its first step.
    global RESULT_Y
    RESULT_Y = frames["result"][2][-512:]
    line, _, submit = frames["submit"]
    with connect(sock0) as s:
        s.sendall(submit)
        got = raw_frame(s)
    if got != frames["result"][2]:
        fail(frames["result"][0], "rank 0 answers the worked SUBMIT with other bytes: %s" %
             got[24:24 + int.from_bytes(got[8:12], "little")])
    # The same request to rank 1: the same y (any number of ranks), a later step.
    with connect(sock1) as s:
        s.sendall(submit)
        ftype, meta, payload = w.read_frame(s)
    if ftype != w.RESULT or payload != frames["result"][2][-512:]:
        fail(line, "rank 1 answers the worked SUBMIT with type %d %s" % (ftype, meta))

    # Expert id 9 in token 1's first slot (file offset 0xf4): the documented ERROR, exactly.
    bad = bytearray(submit)
    bad[0xf4:0xf8] = (9).to_bytes(4, "little")
    with connect(sock0) as s:
        s.sendall(bytes(bad))
        got = raw_frame(s)
        if got != frames["error"][2]:
            fail(frames["error"][0], "the daemon answers the patched SUBMIT with %r" % got)
        if not still_open(s):
            fail(frames["error"][0], "no REPLY after expert_out_of_range")
    # The documented CONTROL bytes get a REPLY.
    with connect(sock0) as s:
        s.sendall(frames["control"][2])
        if w.read_frame(s)[0] != w.REPLY:
            fail(frames["control"][0], "the documented CONTROL gets no REPLY")

    # The other frames with a code, and every submit example the daemon's settings fit.
    n_checked = 0
    for line, kind, args, first, body in dirs:
        expect = args.get("expect")
        if kind == "frame" and expect not in (None, "ok"):
            check_answer(line, sock0, hexdump(body), expect, table.get(expect) == "closed",
                         "frame " + first)
            n_checked += 1
        elif kind == "submit" and not {"limits", "layers"} & set(args):
            spec = args["payload"]
            example = submit[-544:]
            if spec == "example":
                payload = bytearray(example)
            elif spec == "example-x-first":
                payload = bytearray(example[32:] + example[:32])
            elif spec == "example-topk":
                payload = bytearray(example[:32])
            else:
                payload = bytearray(int(spec.split(":")[1]))
            if "patch" in args:
                off, hexbytes = args["patch"].split(":")
                patch = bytes.fromhex(hexbytes)
                payload[int(off):int(off) + len(patch)] = patch
            meta = body.encode()
            data = w.header(w.SUBMIT, len(meta), len(payload)) + meta + bytes(payload)
            check_answer(line, sock0, data, expect, table.get(expect) == "closed",
                         "submit example", args.get("regions"), example, y_in_region(body))
            n_checked += 1
    if n_checked < 10:
        fail(0, "only %d examples were sent" % n_checked)

    regions_lifecycle(sock0, submit)

    # The REPLY documents the doc shows have the daemon's fields.
    for line, kind, args, first, body in dirs:
        if kind == "reply":
            meta, _ = w.control(sock0, first)
            shape(json.loads(body), meta, first, line)

    # The minimal client runs as written.
    clients = [(line, body) for line, kind, _, _, body in dirs if kind == "python-client"]
    if not clients:
        fail(0, "no python-client example")
    for line, body in clients:
        try:
            exec(compile(body, "%s:%d" % (DOC, line), "exec"), {"SOCKET": sock0})
        except Exception as e:  # noqa: BLE001 (any failure of the example is the finding)
            fail(line, "the minimal client fails: %r" % e)

    for f in failures:
        print("FAIL " + f)
    print("%d examples sent, %d disagreements" % (n_checked, len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
