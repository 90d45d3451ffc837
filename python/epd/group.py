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

    def submit(self, x, topk_ids, topk_weights, layer=None, out=None):
        """One batch spread over the ranks: rank r gets rows [r*N/W, (r+1)*N/W) (ranks whose
        share is empty get nothing); returns y [N, H] in the rows' order."""
        n = int(x.shape[0])
        w = len(self.clients)
        cuts = [n * r // w for r in range(w + 1)]
        batches, outs = [], []
        for r in range(w):
            lo, hi = cuts[r], cuts[r + 1]
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
