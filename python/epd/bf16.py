"""bf16 in numpy, which has no bf16 dtype: a bf16 array is a uint16 array of bit patterns. The
conversions follow common/bf16.h: fp32 -> bf16 rounds to nearest even, overflow goes to +-Inf, a
NaN stays a (quiet) NaN with its sign; bf16 -> fp32 is exact."""
import numpy as np


def from_f32(a):
    """fp32 (any float array, converted to fp32 first) -> bf16 bit patterns (uint16), same shape."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    quiet = (u >> np.uint32(16)) | np.uint32(0x0040)
    return np.where(nan, quiet, rounded).astype(np.uint16)


def to_f32(h):
    """bf16 bit patterns (uint16) -> fp32, exact."""
    h = np.asarray(h)
    if h.dtype != np.uint16:
        raise TypeError("bf16 arrays are uint16 bit patterns, got %s" % h.dtype)
    return (h.astype(np.uint32) << np.uint32(16)).view(np.float32)


def is_finite(h):
    """True where a bf16 bit pattern is neither Inf nor NaN."""
    return (np.asarray(h, dtype=np.uint16) & np.uint16(0x7F80)) != np.uint16(0x7F80)


def round_f32(a):
    """fp32 values rounded to the nearest bf16 and widened back to fp32."""
    return to_f32(from_f32(a))
