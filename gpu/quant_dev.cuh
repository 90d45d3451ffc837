/* Device-side FP8 element helpers shared by the CUDA kernels (gpu/quant.cu, and any kernel that
 * fuses quantization, e.g. a pack kernel) and the GPU test: bf16 unpacking, amax, the hardware
 * e4m3 conversions with the host's NaN code, dequantization of 16 codes, division by a launch
 * constant. CUDA code only. */
#ifndef EPD_GPU_QUANT_DEV_CUH
#define EPD_GPU_QUANT_DEV_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

__device__ __forceinline__ float epd_dev_bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float epd_dev_bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

/* max(m, |x|) over the 8 bf16 of v; NaN inputs are ignored as the host's `a > amax` ignores them. */
__device__ __forceinline__ float epd_dev_amax8(uint4 v, float m)
{
    m = fmaxf(m, fabsf(epd_dev_bf16_lo(v.x)));
    m = fmaxf(m, fabsf(epd_dev_bf16_hi(v.x)));
    m = fmaxf(m, fabsf(epd_dev_bf16_lo(v.y)));
    m = fmaxf(m, fabsf(epd_dev_bf16_hi(v.y)));
    m = fmaxf(m, fabsf(epd_dev_bf16_lo(v.z)));
    m = fmaxf(m, fabsf(epd_dev_bf16_hi(v.z)));
    m = fmaxf(m, fabsf(epd_dev_bf16_lo(v.w)));
    m = fmaxf(m, fabsf(epd_dev_bf16_hi(v.w)));
    return m;
}

/* n / d for every 32-bit n with one multiply-high and two shifts (d >= 2): Granlund and
 * Montgomery's round-up method ("Division by invariant integers using multiplication", 1994,
 * figure 4.1). The host makes it once per launch; test_quant checks it against `/` on the host. */
struct epd_fast_div {
    uint32_t m, s;
};

static inline epd_fast_div epd_fast_div_make(uint32_t d)
{
    uint32_t l = 0; /* ceil(log2(d)) */
    while ((1ull << l) < d) l++;
    epd_fast_div f;
    f.m = (uint32_t)(((1ull << 32) * ((1ull << l) - d)) / d + 1);
    f.s = l - 1;
    return f;
}

__host__ __device__ __forceinline__ uint32_t epd_fast_div_of(uint32_t n, epd_fast_div f)
{
#ifdef __CUDA_ARCH__
    const uint32_t t = __umulhi(n, f.m);
#else
    const uint32_t t = (uint32_t)(((uint64_t)n * f.m) >> 32);
#endif
    return (t + ((n - t) >> 1)) >> f.s;
}

/* Four fp32 -> four e4m3 codes (first value in the lowest byte). The hardware SATFINITE
 * conversion clamps and rounds to nearest even like epd_e4m3_from_f32. Which NaN code it writes
 * for a negative NaN is not documented (H200 writes 0x7f; test_quant prints it), so inputs must
 * not be negative NaNs: every caller passes results of IEEE multiplies (__fmul_rn), and a GPU
 * arithmetic result that is NaN is always the quiet NaN 0x7fffffff (CUDA C++ Programming Guide,
 * floating-point standard), which the conversion writes as 0x7f, the host's NaN code. No fix-up
 * is needed, which saves 12 integer instructions per 16-byte vector of the requant (test_quant
 * checks every fp32, NaNs passed through a multiply). */
__device__ __forceinline__ uint32_t epd_dev_cvt4(float a, float b, float c, float d)
{
    uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
    uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
    return lo | (hi << 16);
}

/* 8 bf16 -> 8 e4m3 of x * mult. */
__device__ __forceinline__ uint2 epd_dev_quant8(uint4 v, float mult)
{
    uint2 r;
    r.x = epd_dev_cvt4(__fmul_rn(epd_dev_bf16_lo(v.x), mult), __fmul_rn(epd_dev_bf16_hi(v.x), mult),
                       __fmul_rn(epd_dev_bf16_lo(v.y), mult), __fmul_rn(epd_dev_bf16_hi(v.y), mult));
    r.y = epd_dev_cvt4(__fmul_rn(epd_dev_bf16_lo(v.z), mult), __fmul_rn(epd_dev_bf16_hi(v.z), mult),
                       __fmul_rn(epd_dev_bf16_lo(v.w), mult), __fmul_rn(epd_dev_bf16_hi(v.w), mult));
    return r;
}

/* Two e4m3 codes (low 16 bits of w) -> two exact fp32 (via fp16, which holds every e4m3 value;
 * the NaN codes give a NaN, payload unspecified). */
__device__ __forceinline__ float2 epd_dev_dec2(uint32_t w)
{
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w & 0xffffu), __NV_E4M3);
    return __half22float2(__half2(h));
}

/* 16 e4m3 codes -> 16 fp32 values times s. */
__device__ __forceinline__ void epd_dev_dequant16(uint4 v, float s, float out[16])
{
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        float2 a = epd_dev_dec2(w[k]), b = epd_dev_dec2(w[k] >> 16);
        out[4 * k + 0] = __fmul_rn(a.x, s);
        out[4 * k + 1] = __fmul_rn(a.y, s);
        out[4 * k + 2] = __fmul_rn(b.x, s);
        out[4 * k + 3] = __fmul_rn(b.y, s);
    }
}

/* Requantization of one word (4 codes): ((float)q * s) * inv, clamped, as e4m3 codes. In PTX:
 * the word's halves are taken as 16-bit registers (no shift for the upper pair) and the two
 * output pairs are joined by one mov (no shift-and-or); the operations are epd_dev_dequant16's
 * conversions (e4m3x2 -> f16x2 -> f32) and round-to-nearest multiplies, then * inv and the
 * satfinite f32x2 -> e4m3x2 conversion of epd_dev_cvt4 (the first value in the lowest byte). */
__device__ __forceinline__ uint32_t epd_dev_requant4(uint32_t w, float s, float inv)
{
    uint32_t out;
    asm("{\n\t"
        ".reg .b16 c0, c1, o0, o1;\n\t"
        ".reg .b32 h0, h1;\n\t"
        ".reg .f16 a0, a1, a2, a3;\n\t"
        ".reg .f32 f0, f1, f2, f3;\n\t"
        "mov.b32 {c0, c1}, %1;\n\t"
        "cvt.rn.f16x2.e4m3x2 h0, c0;\n\t"
        "cvt.rn.f16x2.e4m3x2 h1, c1;\n\t"
        "mov.b32 {a0, a1}, h0;\n\t"
        "mov.b32 {a2, a3}, h1;\n\t"
        "cvt.f32.f16 f0, a0;\n\t"
        "cvt.f32.f16 f1, a1;\n\t"
        "cvt.f32.f16 f2, a2;\n\t"
        "cvt.f32.f16 f3, a3;\n\t"
        "mul.rn.f32 f0, f0, %2;\n\t"
        "mul.rn.f32 f1, f1, %2;\n\t"
        "mul.rn.f32 f2, f2, %2;\n\t"
        "mul.rn.f32 f3, f3, %2;\n\t"
        "mul.rn.f32 f0, f0, %3;\n\t"
        "mul.rn.f32 f1, f1, %3;\n\t"
        "mul.rn.f32 f2, f2, %3;\n\t"
        "mul.rn.f32 f3, f3, %3;\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 o0, f1, f0;\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 o1, f3, f2;\n\t"
        "mov.b32 %0, {o0, o1};\n\t"
        "}"
        : "=r"(out)
        : "r"(w), "f"(s), "f"(inv));
    return out;
}

/* 16 e4m3 codes with scale s -> 16 codes of ((float)q * s) * inv, clamped (requantization),
 * a word at a time. */
__device__ __forceinline__ uint4 epd_dev_requant16(uint4 v, float s, float inv)
{
    return make_uint4(epd_dev_requant4(v.x, s, inv), epd_dev_requant4(v.y, s, inv),
                      epd_dev_requant4(v.z, s, inv), epd_dev_requant4(v.w, s, inv));
}

/* Two fp32 -> two bf16, nearest even (the hardware conversion; for finite values it is
 * epd_f32_to_bf16, NaN payloads may differ). */
__device__ __forceinline__ uint32_t epd_dev_bf16x2(float a, float b)
{
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t *>(&h);
}

#endif
