"""Shared host memory for the zero-copy data plane (DESIGN.md section 4b): a HostRegion is a
memfd mapped shared into this process; registered with a rank (Client.register), tensors inside
it travel as (region, offset) and the daemon writes y there. numpy arrays are views of it."""
import mmap
import os

import numpy as np

from .errors import InvalidArgument

ALIGN = 64


class HostRegion:
    """nbytes of shared memory (a memfd), usable by several clients (each registers it and gets
    its own region id). Views: array(shape, dtype, offset) or take(shape, dtype), a bump
    allocator (64-byte aligned) reset by reset(). Close with close() once no request uses it."""

    def __init__(self, nbytes, name="epd-region"):
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidArgument("a host region needs a positive byte count, got %r" % (nbytes,))
        self.nbytes = nbytes
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            self._map = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(self.fd)
            raise
        self._whole = np.frombuffer(self._map, dtype=np.uint8)
        self.base = self._whole.ctypes.data
        self._next = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def array(self, shape, dtype, offset=0):
        """A numpy view of shape and dtype at byte offset (aligned to the dtype's size)."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        end = offset + count * dtype.itemsize
        if offset < 0 or end > self.nbytes:
            raise InvalidArgument("[%d, %d) is outside the %d-byte region" % (offset, end,
                                                                             self.nbytes))
        if offset % dtype.itemsize:
            raise InvalidArgument("offset %d is not aligned to %s" % (offset, dtype))
        return self._whole[offset:end].view(dtype).reshape(shape)

    def take(self, shape, dtype):
        """The next free 64-byte-aligned view of shape and dtype (see reset)."""
        dtype = np.dtype(dtype)
        offset = (self._next + ALIGN - 1) // ALIGN * ALIGN
        view = self.array(shape, dtype, offset)
        self._next = offset + view.nbytes
        return view

    def reset(self):
        """Forgets every take(); earlier views stay valid memory and alias the new ones."""
        self._next = 0

    def contains(self, address, nbytes):
        """The byte offset of [address, address + nbytes) in this region, or None."""
        if self.base <= address and address + nbytes <= self.base + self.nbytes:
            return address - self.base
        return None

    def close(self):
        """Unmaps the memory and closes the fd (views must not be used afterwards)."""
        if self.fd is not None:
            self._whole = None
            try:
                self._map.close()
            except BufferError:
                # numpy views still export the buffer: the mapping goes with the last of them
                pass
            os.close(self.fd)
            self.fd = None
