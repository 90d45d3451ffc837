"""PyTorch glue, imported only when a torch tensor is passed: wire dtypes of torch dtypes, host
views of CPU tensors, and the CUDA IPC handle of a tensor's memory for device regions (DESIGN.md
4b: `untyped_storage()._share_cuda_()`; torch 2.x gives 2 prefix bytes, version 2 and 'c' for a
cudaMalloc'd block, then the 64-byte cudaIpcMemHandle_t)."""
import collections
import ctypes

import numpy as np
import torch

from .errors import InvalidArgument

IPC_HANDLE_LEN = 64
CU_POINTER_ATTRIBUTE_BUFFER_ID = 7  # cuda.h: unsigned long long, unique within a process
MAX_KNOWN_ALLOCATIONS = 1024  # allocations whose handle is remembered

_WIRE = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32", torch.float64: "f64",
         torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32",
         torch.int64: "i64", torch.bool: "bool"}
for _name, _wire in (("float8_e4m3fn", "f8_e4m3"), ("float8_e5m2", "f8_e5m2")):
    if hasattr(torch, _name):
        _WIRE[getattr(torch, _name)] = _wire


def is_tensor(obj):
    return isinstance(obj, torch.Tensor)


def wire_dtype(t):
    try:
        return _WIRE[t.dtype]
    except KeyError:
        raise InvalidArgument("tensor dtype %s has no wire name" % t.dtype) from None


# dtypes numpy has no type for: (the torch dtype of the same width, the numpy view of it)
_HOST_AS = {torch.bfloat16: (torch.int16, np.uint16)}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _HOST_AS[getattr(torch, _name)] = (torch.uint8, np.uint8)


def host_tensor(t):
    """A CPU tensor as it is sent: without autograd, contiguous (copied if not)."""
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t


def host_bytes(address, nbytes):
    """A writable memoryview of nbytes at address (a CPU tensor's data: its owner must outlive
    the view)."""
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def host_array(t):
    """A numpy view of a CPU tensor (bf16 as uint16 bit patterns); contiguous (copied if not)."""
    t = host_tensor(t)
    as_ = _HOST_AS.get(t.dtype)
    if as_ is None:
        return t.numpy()
    return t.view(as_[0]).numpy().view(as_[1])


def from_host(a, like):
    """A CPU torch tensor of the bf16 bit patterns a (uint16 numpy array)."""
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)


def empty_like_y(x, n_tokens, hidden):
    return torch.empty((n_tokens, hidden), dtype=torch.bfloat16, device=x.device)


# torch's own C entry points for the current device and the current stream's handle, where this
# torch has them (every 2.x): a call each, against ~2.5 us for torch.cuda.current_device() and
# ~6 us for torch.cuda.current_stream(d).synchronize() through their Python layers, which ran
# several times a SUBMIT. Without them (or the driver library) the public calls are used.
_TORCH_C = getattr(torch, "_C", None)
_get_device = getattr(_TORCH_C, "_cuda_getDevice", None)
_raw_stream = getattr(_TORCH_C, "_cuda_getCurrentRawStream", None)


def current_device():
    """The index of the calling thread's current CUDA device."""
    return _get_device() if _get_device is not None else torch.cuda.current_device()


def stream_sync(tensors):
    """Waits for the current stream of every CUDA device the tensors live on (DESIGN.md 4b: the
    inputs are complete before SUBMIT is sent)."""
    sync_devices(cuda_devices(tensors))


def cuda_devices(tensors):
    """The CUDA devices the tensors live on, each once, in order."""
    devices = {}
    for t in tensors:
        if t.is_cuda:
            device = t.device
            devices.setdefault(device.index, device)
    return tuple(devices.values())


def sync_devices(devices):
    """Waits for the current stream of each device."""
    for device in devices:
        _sync_current_stream(device)


def _sync_current_stream(device):
    """cuStreamSynchronize on the device's current stream (its handle from torch, the GIL let go
    meanwhile, as torch's synchronize() does) when that device is current: the legacy default
    stream, handle 0, is the current context's. Else torch's public call."""
    index = device.index
    drv = _driver()
    if drv and _raw_stream is not None and current_device() == index:
        rc = drv.stream_sync(_raw_stream(index))
        if rc != 0:
            raise RuntimeError("cuStreamSynchronize failed on the current stream of cuda:%d (%s)"
                               % (index, drv.name(rc)))
        return
    torch.cuda.current_stream(device).synchronize()


def torch_ipc_handle(storage):
    """(the 64 bytes of cudaIpcMemHandle_t, the storage's offset in its cudaMalloc'd block) from
    torch itself (`_share_cuda_()`); InvalidArgument for memory torch cannot share that way
    (expandable segments). torch counts the share as a consumer's reference; it is given back at
    once (as a consumer would), else the storage's memory would never return to the caching
    allocator (torch's "limbo" of shared blocks)."""
    info = storage._share_cuda_()
    handle, offset = info[1], info[3]
    try:
        type(storage)._release_ipc_counter_cuda(info[4], info[5])
    except (AttributeError, RuntimeError, TypeError):
        pass
    if not isinstance(handle, (bytes, bytearray)):
        raise InvalidArgument("torch gave no CUDA IPC handle for this storage")
    handle = bytes(handle)
    if len(handle) == IPC_HANDLE_LEN + 2 and handle[:2] == b"\x02c":
        return handle[2:], int(offset)
    if len(handle) == IPC_HANDLE_LEN:
        return handle, int(offset)  # older torch: the bare cudaIpcMemHandle_t
    if len(handle) >= 2 and handle[1:2] == b"e":
        raise InvalidArgument(
            "this CUDA tensor lives in a torch expandable segment, which has no "
            "cudaIpcMemHandle_t: epd's device regions need cudaMalloc'd memory (run with "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False)")
    raise InvalidArgument("unknown torch CUDA IPC handle format (%d bytes, prefix %s); epd "
                          "understands 66 bytes starting 02 63 ('c', a cudaMalloc'd block)"
                          % (len(handle), handle[:2].hex(" ")))


class _Driver:
    """The CUDA driver calls device regions need (libcuda.so.1 through ctypes): the allocation a
    pointer lies in, its IPC handle, and its buffer id, by which the first two are remembered."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self.get_range = lib.cuMemGetAddressRange_v2
        self.get_range.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                   ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        self.get_range.restype = ctypes.c_int
        self.get_handle = lib.cuIpcGetMemHandle
        self.get_handle.argtypes = [ctypes.c_char_p, ctypes.c_uint64]
        self.get_handle.restype = ctypes.c_int
        self.get_attribute = lib.cuPointerGetAttribute
        self.get_attribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        self.get_attribute.restype = ctypes.c_int
        self.error_name = lib.cuGetErrorName
        self.error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self.error_name.restype = ctypes.c_int
        self.stream_sync = lib.cuStreamSynchronize
        self.stream_sync.argtypes = [ctypes.c_void_p]
        self.stream_sync.restype = ctypes.c_int
        self.buffer_id = ctypes.c_uint64()
        self.buffer_id_ref = ctypes.byref(self.buffer_id)
        # buffer id -> (handle, base, bytes), least recently used first. The driver never gives
        # a freed allocation's id to a later one, so an entry cannot describe other memory.
        self.allocations = collections.OrderedDict()

    def name(self, rc):
        s = ctypes.c_char_p()
        if self.error_name(rc, ctypes.byref(s)) == 0 and s.value:
            return s.value.decode()
        return "CUDA error %d" % rc

    def allocation(self, ptr):
        """(handle, base, bytes) of the allocation ptr lies in, or None where the driver does
        not know ptr. One driver call for an allocation seen before; the first time, its range
        and its IPC handle (InvalidArgument where it has none)."""
        if self.get_attribute(self.buffer_id_ref, CU_POINTER_ATTRIBUTE_BUFFER_ID, ptr) != 0:
            return None
        key = self.buffer_id.value
        known = self.allocations.get(key)
        if known is not None:
            try:
                self.allocations.move_to_end(key)
            except KeyError:  # another thread's client evicted it meanwhile: still right
                pass
            return known
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        if self.get_range(ctypes.byref(base), ctypes.byref(size), ptr) != 0:
            return None
        handle = ctypes.create_string_buffer(IPC_HANDLE_LEN)
        rc = self.get_handle(handle, base.value)
        if rc != 0:
            raise InvalidArgument(
                "cuIpcGetMemHandle failed (%s): this CUDA tensor's memory cannot be shared with "
                "the daemon. epd's device regions need cudaMalloc'd memory: torch's expandable "
                "segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) and the "
                "cudaMallocAsync backend are not" % self.name(rc))
        known = (handle.raw, base.value, size.value)
        self.allocations[key] = known
        while len(self.allocations) > MAX_KNOWN_ALLOCATIONS:
            self.allocations.popitem(last=False)
        return known


_driver_state = None


def _driver():
    global _driver_state
    if _driver_state is None:
        try:
            _driver_state = _Driver()
        except (OSError, AttributeError):
            _driver_state = False
    return _driver_state


def device_allocation(t):
    """(the 64-byte cudaIpcMemHandle_t, base pointer, bytes) of the cudaMalloc'd allocation a
    CUDA tensor lives in. The CUDA driver answers (cuMemGetAddressRange, cuIpcGetMemHandle on
    the base: the handle torch's `_share_cuda_()` gives after its 2-byte prefix, without torch's
    cross-process reference counting), once an allocation: later tensors in it cost one
    cuPointerGetAttribute (its buffer id). Without the driver library, torch's handle of the
    storage is used and the region covers the allocation up to the storage's end."""
    drv = _driver()
    if drv:
        guard = torch.cuda.device(t.device) if t.device.index != current_device() else None
        if guard is not None:
            guard.__enter__()
        try:
            known = drv.allocation(t.data_ptr())
            if known is not None:
                return known
        finally:
            if guard is not None:
                guard.__exit__(None, None, None)
    storage = t.untyped_storage()
    handle, offset = torch_ipc_handle(storage)
    return handle, storage.data_ptr() - offset, offset + storage.nbytes()
