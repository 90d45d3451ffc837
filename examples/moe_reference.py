"""The single-process reference of DESIGN.md section 2 for the elementwise expert kinds
(identity, scale), written once over an array namespace so that the same code runs in numpy
(checked against the C reference, epd_moe_reference, in make check) and in PyTorch on the GPU
(examples/torch_moe.py). Every step is the IEEE operation the daemon does, in its order:
  x as the experts see it: bf16 widened, or FP8 e4m3 quantized and dequantized (group128 or
  per_token scales, fp32 or ue8m0 format, DESIGN.md section 3);
  per rank r, over ascending k whose expert r owns: acc = acc + w_k * (x * f_e), fp32, a multiply
  then an add; the partial rounded to bf16 (or FP8 group128 round trip when combine.dtype: fp8);
  then over ascending ranks that own any of the token's experts: sum = sum + partial (fp32);
  y = bf16(sum).
No operation here may be fused or reordered: divisions are tensor-by-tensor (torch turns a
division by a Python scalar into a multiplication by its reciprocal on CUDA)."""
import numpy as np

F32_1_OVER_448 = float(np.float32(1.0) / np.float32(448.0))
AMAX_MIN = float(np.float32(1e-4))


class NumpyOps:
    """The namespace over numpy: fp32 arrays, bf16 as uint16 bit patterns."""

    def widen_bf16(self, x):
        return (x.astype(np.uint32) << np.uint32(16)).view(np.float32)

    def round_bf16(self, a):
        u = a.view(np.uint32)
        r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        return (r << np.uint32(16)).astype(np.uint32).view(np.float32)

    def to_bf16_bits(self, a):
        u = a.view(np.uint32)
        return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >>
                np.uint32(16)).astype(np.uint16)

    def bits(self, a):
        return np.ascontiguousarray(a).view(np.int32)

    def from_bits(self, i):
        return np.ascontiguousarray(i.astype(np.int32)).view(np.float32)

    def zeros(self, like):
        return np.zeros(like.shape, np.float32)

    def full(self, like, value):
        return np.full(like.shape, value, np.float32)

    def where(self, m, a, b):
        return np.where(m, a, b).astype(np.float32)

    def iwhere(self, m, a, b):
        return np.where(m, a, b)

    def div(self, a, b):
        return (a / b).astype(np.float32)

    def amax_abs(self, g):
        return np.abs(g).max(axis=-1, keepdims=True)

    def clamp_min(self, a, v):
        return np.maximum(a, a.dtype.type(v))

    def clamp_max(self, a, v):
        return np.minimum(a, np.float32(v))

    def rint(self, a):
        return np.rint(a)

    def copysign(self, a, b):
        return np.copysign(a, b).astype(np.float32)

    def factors(self, num_experts, kind, like_ids):
        e = np.arange(num_experts, dtype=np.float32)
        if kind == "identity":
            return np.ones(num_experts, np.float32)
        return (np.float32(1.0) + e / np.float32(num_experts)).astype(np.float32)

    def column(self, a, k):
        return a[:, k:k + 1]


class TorchOps(NumpyOps):
    """The same namespace over torch tensors (on any device)."""

    def __init__(self):
        import torch
        self.torch = torch

    def widen_bf16(self, x):
        return x.to(self.torch.float32)

    def round_bf16(self, a):
        return a.to(self.torch.bfloat16).to(self.torch.float32)

    def to_bf16_bits(self, a):
        return a.to(self.torch.bfloat16)

    def bits(self, a):
        return a.contiguous().view(self.torch.int32)

    def from_bits(self, i):
        return i.to(self.torch.int32).contiguous().view(self.torch.float32)

    def zeros(self, like):
        return self.torch.zeros(like.shape, dtype=self.torch.float32, device=like.device)

    def full(self, like, value):
        return self.torch.full(like.shape, value, dtype=self.torch.float32, device=like.device)

    def where(self, m, a, b):
        return self.torch.where(m, a, b)

    def iwhere(self, m, a, b):
        return self.torch.where(m, a, b)

    def div(self, a, b):
        return self.torch.div(a, b)  # both tensors of one shape: a true division

    def amax_abs(self, g):
        return self.torch.amax(self.torch.abs(g), dim=-1, keepdim=True)

    def clamp_min(self, a, v):
        return self.torch.clamp_min(a, v)

    def clamp_max(self, a, v):
        return self.torch.clamp_max(a, v)

    def rint(self, a):
        return self.torch.round(a)  # half to even

    def copysign(self, a, b):
        return self.torch.copysign(a, b)

    def factors(self, num_experts, kind, like_ids):
        f = NumpyOps.factors(self, num_experts, kind, None)  # exact IEEE division on the host
        return self.torch.from_numpy(f).to(like_ids.device)


def e4m3_values(xp, v):
    """The fp32 value of e4m3fn(v) for finite v: clamp to [-448, 448], round to nearest even
    (3 mantissa bits; subnormal step 2^-9 below 2^-6), the sign kept (-0 included)."""
    a = xp.clamp_max(abs(v), 448.0)
    e = xp.bits(a) >> 23
    e = xp.clamp_min(e, 121)                    # below 2^-6 the step is 2^-9
    ulp = xp.from_bits((e - 3) << 23)
    inv = xp.from_bits((254 - (e - 3)) << 23)   # 1/ulp, a power of two: exact
    return xp.copysign(xp.rint(a * inv) * ulp, v)


def fp8_round_trip(xp, v, group, ue8m0):
    """dequant(quant(v)) of DESIGN.md section 3 for v fp32 [N, H], scales over `group`
    consecutive elements (128, or H for per_token)."""
    n, h = v.shape
    g = v.reshape(n, h // group, group)
    a = xp.clamp_min(xp.amax_abs(g), AMAX_MIN)
    s = a * F32_1_OVER_448
    if ue8m0:
        u = xp.bits(s)
        frac = (u & 0x7FFFFF) != 0
        u = xp.iwhere(frac, (u & 0x7F800000) + 0x800000, u)
        s = xp.from_bits(u)
        mult = xp.div(xp.full(s, 1.0), s)
    else:
        mult = xp.div(xp.full(a, 448.0), a)
    q = e4m3_values(xp, g * mult)
    return (q * s).reshape(n, h)


def moe_reference(xp, x, topk_ids, topk_weights, cfg, world):
    """y (bf16: uint16 bits in numpy, torch.bfloat16 in torch) of DESIGN.md section 2 for x bf16
    [N, H], topk_ids [N, K] (-1 = empty), topk_weights fp32 [N, K], the daemon's config dict
    (model.num_experts, dispatch.dtype/scale/scale_format, experts.kind, combine.dtype) and the
    number of ranks."""
    kind = cfg["experts.kind"]
    if kind not in ("identity", "scale"):
        raise ValueError("the exact reference covers identity and scale experts, not %r" % kind)
    num_experts = int(cfg["model.num_experts"])
    per_rank = num_experts // world
    xin = xp.widen_bf16(x)
    if cfg["dispatch.dtype"] == "fp8":
        group = 128 if cfg["dispatch.scale"] == "group128" else xin.shape[1]
        xin = fp8_round_trip(xp, xin, group, cfg["dispatch.scale_format"] == "ue8m0")
    fp8_combine = cfg.get("combine.dtype", "bf16") == "fp8"
    f = xp.factors(num_experts, kind, topk_ids)
    total = xp.zeros(xin)
    k_slots = topk_ids.shape[1]
    for r in range(world):
        acc = xp.zeros(xin)
        owns = None
        for k in range(k_slots):
            e = topk_ids[:, k]
            mine = (e >= 0) & (e // per_rank == r)
            fe = f[e * (e >= 0)]
            expert_y = xin * fe[:, None] if kind == "scale" else xin
            wy = xp.column(topk_weights, k) * expert_y
            acc = xp.where(mine[:, None], acc + wy, acc)
            owns = mine if owns is None else (owns | mine)
        partial = fp8_round_trip(xp, acc, 128, False) if fp8_combine else xp.round_bf16(acc)
        total = xp.where(owns[:, None], total + partial, total)
    return xp.to_bf16_bits(total)
