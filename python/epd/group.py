"""A router's view of one node: a Client per rank socket. submit() splits a batch over the
ranks (each rank gets a contiguous share of the tokens) and joins the answers; submit_each()
sends each rank its own batch; both pipeline (every rank's SUBMIT is sent before any answer is
awaited)."""
import numpy as np

from ._session import torch_module
from .client import Client
from .errors import InvalidArgument


class Group:
    """Clients of every rank: Group(["/run/epd/epd-0.sock", ...]) or
    Group.node("/run/epd/epd-%r.sock", ranks=8) (%r is the rank, as in socket.path)."""

    def __init__(self, paths, timeout=None, connect_timeout=10.0):
        paths = list(paths)
        if not paths:
            raise InvalidArgument("a Group needs at least one socket")
        self.clients = []
        try:
            for path in paths:
                self.clients.append(Client(path, timeout=timeout,
                                           connect_timeout=connect_timeout))
        except BaseException:
            self.close()
            raise

    @classmethod
    def node(cls, pattern, ranks, **kw):
        """Clients of ranks 0..ranks-1, their paths made from pattern with %r replaced."""
        if "%r" not in pattern:
            raise InvalidArgument("the socket pattern %r has no %%r" % pattern)
        return cls([pattern.replace("%r", str(r)) for r in range(ranks)], **kw)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __len__(self):
        return len(self.clients)

    def __getitem__(self, rank):
        return self.clients[rank]

    def close(self):
        for c in self.clients:
            c.close()

    def health(self):
        """Every rank's health reply, in rank order."""
        pendings = [c.control_async("health") for c in self.clients]
        return [p.result(c.timeout)[0] for c, p in zip(self.clients, pendings)]

    def stats(self):
        return [c.stats() for c in self.clients]

    def submit_each(self, batches, layer=None, outs=None):
        """batches[r] = (x, topk_ids, topk_weights) or None for rank r; returns the list of y
        (None where no batch). Every SUBMIT is sent before any answer is awaited; the first
        error is raised once all have answered."""
        if len(batches) != len(self.clients):
            raise InvalidArgument("%d batches for %d ranks" % (len(batches), len(self.clients)))
        outs = outs if outs is not None else [None] * len(batches)
        pendings = []
        for c, b, out in zip(self.clients, batches, outs):
            pendings.append(None if b is None else c.submit_async(*b, layer=layer, out=out))
        return self._gather(pendings)

    def _gather(self, pendings):
        """The answers of one Pending (or None) a rank, once all are in; the first error
        raised then."""
        results, first = [], None
        for c, p in zip(self.clients, pendings):
            if p is None:
                results.append(None)
                continue
            exc = p.exception(c.timeout)
            if exc is not None and first is None:
                first = exc
            results.append(None if exc is not None else p.result())
        if first is not None:
            raise first
        return results

    def prepare(self, x, topk_ids, topk_weights, out=None):
        """A prepared submit() (Client.prepare's, a rank at a time): each rank's share of the
        rows prepared on its Client, as row slices of the buffers; call.submit(layer) sends every
        share, then waits for all, and returns y: out, or the one y [N, H] made here (numpy
        uint16, or bf16 on x's device for torch) that every call writes."""
        return GroupPrepared(self, x, topk_ids, topk_weights, out)

    def _cuts(self, n):
        w = len(self.clients)
        cuts = [n * r // w for r in range(w + 1)]
        return [(cuts[r], cuts[r + 1]) for r in range(w)]

    def submit(self, x, topk_ids, topk_weights, layer=None, out=None):
        """One batch spread over the ranks: rank r gets rows [r*N/W, (r+1)*N/W) (ranks whose
        share is empty get nothing); returns y [N, H] in the rows' order."""
        batches, outs = [], []
        for lo, hi in self._cuts(int(x.shape[0])):
            if lo == hi:
                batches.append(None)
                outs.append(None)
                continue
            batches.append((x[lo:hi], topk_ids[lo:hi], topk_weights[lo:hi]))
            outs.append(None if out is None else out[lo:hi])
        ys = self.submit_each(batches, layer, outs)
        if out is not None:
            return out
        parts = [y for y in ys if y is not None]
        tm = torch_module(x)
        if tm is not None:
            import torch
            return torch.cat(parts)
        return np.concatenate(parts)


class GroupPrepared:
    """Group.prepare's call: a Prepared a rank with a share of the rows."""

    def __init__(self, group, x, topk_ids, topk_weights, out=None):
        self._g = group
        if out is None:
            n, hidden = int(x.shape[0]), int(x.shape[1])
            tm = torch_module(x)
            out = tm.empty_like_y(x, n, hidden) if tm is not None else np.empty((n, hidden),
                                                                                 np.uint16)
        self.out = out
        self._calls = []
        for c, (lo, hi) in zip(group.clients, group._cuts(int(x.shape[0]))):
            self._calls.append(None if lo == hi else c.prepare(
                x[lo:hi], topk_ids[lo:hi], topk_weights[lo:hi], out=out[lo:hi]))

    def submit(self, layer=None):
        self._g._gather([None if p is None else p.submit_async(layer) for p in self._calls])
        return self.out
