"""A scripted stand-in for one epd rank, for the Python client's offline tests: a Unix socket
served by a thread that reads whole frames (and any SCM_RIGHTS fds) and runs a handler per
connection. The handler gets a Peer (read(), send(), close()) and decides what to answer."""
import array
import json
import os
import socket
import struct
import sys
import tempfile
import threading

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
from epd import frame as fr  # noqa: E402


class Peer:
    def __init__(self, sock):
        self.sock = sock
        self.fds = []

    def _exact(self, n):
        buf = bytearray()
        while len(buf) < n:
            data, anc, _, _ = self.sock.recvmsg(n - len(buf), socket.CMSG_SPACE(16 * 4))
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(payload[:len(payload) - len(payload) % 4])
                    self.fds.extend(fds)
            if not data:
                raise EOFError("client closed")
            buf += data
        return bytes(buf)

    def read(self):
        """(type, meta, payload) of the next frame from the client."""
        head = self._exact(fr.HEADER_LEN)
        ftype, meta_len, payload_len = fr.decode_header(head)
        meta = json.loads(self._exact(meta_len))
        payload = self._exact(payload_len) if payload_len else b""
        return ftype, meta, payload

    def send(self, ftype, meta, payload=b""):
        self.sock.sendall(fr.encode(ftype, meta, payload))

    def result(self, req_id, y_bytes, n, h, step=1):
        self.send(fr.RESULT, {"id": req_id, "step": step, "tensors": {
            "y": fr.payload_tensor("bf16", [n, h], 0, len(y_bytes))}}, y_bytes)

    def error(self, req_id, code, message="scripted"):
        self.send(fr.ERROR, {"id": req_id, "code": code, "message": message})

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def x_bytes(meta, payload):
    """The payload bytes of a SUBMIT's x."""
    b, e = meta["tensors"]["x"]["data_offsets"]
    return payload[b:e]


class FakeDaemon:
    """with FakeDaemon(handler) as path: ... ; handler(peer) runs for each connection in its own
    thread; its exceptions are kept in .errors (the test checks them)."""

    def __init__(self, handler):
        self.handler = handler
        self.dir = tempfile.mkdtemp(prefix="epd-fake.")
        self.path = os.path.join(self.dir, "epd.sock")
        self.errors = []
        self.threads = []
        self.lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.lsock.bind(self.path)
        self.lsock.listen(16)
        self.lsock.settimeout(0.05)
        self.stopping = False
        self.acceptor = threading.Thread(target=self._accept, daemon=True)
        self.acceptor.start()

    def _accept(self):
        while not self.stopping:
            try:
                s, _ = self.lsock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            s.settimeout(10)
            t = threading.Thread(target=self._serve, args=(Peer(s),), daemon=True)
            t.start()
            self.threads.append(t)

    def _serve(self, peer):
        try:
            self.handler(peer)
        except EOFError:
            pass
        except Exception as e:  # noqa: BLE001 - reported to the test
            self.errors.append(e)
        finally:
            for fd in peer.fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            peer.close()

    def __enter__(self):
        return self.path

    def __exit__(self, *exc):
        self.stopping = True
        self.acceptor.join(5)
        for t in self.threads:
            t.join(5)
        self.lsock.close()
        os.unlink(self.path)
        os.rmdir(self.dir)


def u16(data):
    return struct.unpack("<%dH" % (len(data) // 2), data)
