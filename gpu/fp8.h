/* FP8 element helpers shared by host C and CUDA device code (DESIGN.md section 3): OCP e4m3fn
 * encode (clamp to [-448, 448], round to nearest even) and decode, and the scale rules (amax
 * floor 1e-4, fp32 and ue8m0 scale formats); bf16 <-> fp32 comes from common/bf16.h. Pure bit
 * arithmetic, so host and device give the same bits; the CUDA kernels may use the hardware
 * SATFINITE conversion, which tests/gpu/test_quant.cu checks against epd_e4m3_from_f32
 * exhaustively. */
#ifndef EPD_GPU_FP8_H
#define EPD_GPU_FP8_H

#include <stdint.h>
#include <string.h>

#include "common/bf16.h" /* EPD_HD, epd_f32_bits, bf16 <-> fp32 */

#define EPD_FP8_MAX 448.0f       /* largest finite e4m3fn value */
#define EPD_FP8_NAN 0x7f         /* the NaN code epd_e4m3_from_f32 writes (0xff decodes as NaN too) */
#define EPD_QUANT_GROUP 128      /* elements per group scale */
#define EPD_QUANT_AMAX_MIN 1e-4f /* floor of a row's or group's amax (DeepEP low-latency convention) */

/* e4m3fn code -> fp32 (exact). 0x7f and 0xff are NaN; 0x80 is -0. */
EPD_HD float epd_e4m3_to_f32(uint8_t c)
{
    uint32_t sign = (uint32_t)(c & 0x80u) << 24;
    uint32_t e = (c >> 3) & 0xfu, m = c & 0x7u;
    if (e == 0xfu && m == 0x7u) return epd_f32_from_bits(sign | 0x7fc00000u);
    if (e == 0) {
        /* subnormal: m * 2^-9, exact in fp32 */
        float v = (float)m * 0.001953125f;
        return epd_f32_from_bits(epd_f32_bits(v) | sign);
    }
    return epd_f32_from_bits(sign | ((e + 120u) << 23) | (m << 20));
}

/* fp32 -> e4m3fn code: clamp to [-448, 448] (Inf included), then round to nearest even. NaN ->
 * 0x7f whatever its sign (the canonical NaN, as CUDA's SATFINITE conversion writes). -0 -> 0x80;
 * values that round to zero keep their sign. */
EPD_HD uint8_t epd_e4m3_from_f32(float f)
{
    uint32_t u = epd_f32_bits(f);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return EPD_FP8_NAN;
    if (u >= 0x43e00000u) return (uint8_t)(sign | 0x7eu); /* >= 448 */
    if (u >= 0x3c800000u) {
        /* normal range [2^-6, 448): drop 20 mantissa bits with nearest-even; a carry moves into
         * the exponent, and nothing below 448 can round past 448 (0x7e). */
        uint32_t r = (u + 0x7ffffu + ((u >> 20) & 1u)) >> 20;
        return (uint8_t)(sign | (r - ((127u - 7u) << 3)));
    }
    /* subnormal range: m = round_even(|f| * 2^9), m = 8 is the smallest normal 0x08 */
    uint32_t e = u >> 23;
    if (e == 0) return sign; /* fp32 subnormal: far below 2^-10 */
    uint32_t mant = (u & 0x7fffffu) | 0x800000u;
    uint32_t shift = 141u - e; /* |f| * 2^9 = mant * 2^(e - 141), e <= 120 so shift >= 21 */
    if (shift >= 25u) return sign; /* < 0.5 */
    uint32_t m = (mant + (1u << (shift - 1)) - 1u + ((mant >> shift) & 1u)) >> shift;
    return (uint8_t)(sign | m);
}

/* Smallest power of two >= s, for s > 0 (Inf stays Inf). The ue8m0 scale rule. */
EPD_HD float epd_ue8m0_ceil(float s)
{
    uint32_t u = epd_f32_bits(s) & 0x7fffffffu;
    if (u >= 0x7f800000u || u == 0) return epd_f32_from_bits(u);
    if ((u >> 23) == 0) {
        /* fp32 subnormal (unreachable with the amax floor, kept for completeness) */
        uint32_t p = 1;
        while (p < u) p <<= 1;
        return epd_f32_from_bits(p);
    }
    if (u & 0x7fffffu) u = (u & 0x7f800000u) + 0x800000u;
    return epd_f32_from_bits(u);
}

/* The scale rule of one row (per_token) or one group of 128 (group128) with amax = max |x| over
 * it: stores the scale s that dequantization multiplies by, and the multiplier q = e4m3(x * mult).
 *   fp32:  a = max(amax, 1e-4), s = a * (1/448), mult = 448 / a
 *   ue8m0: s = smallest power of two >= a * (1/448), mult = 1 / s (exact) */
EPD_HD void epd_quant_scale(float amax, int ue8m0, float *scale_p, float *mult_p)
{
    float a = amax > EPD_QUANT_AMAX_MIN ? amax : EPD_QUANT_AMAX_MIN;
    float s = a * (1.0f / 448.0f);
    if (ue8m0) {
        s = epd_ue8m0_ceil(s);
        *scale_p = s;
        *mult_p = 1.0f / s;
    } else {
        *scale_p = s;
        *mult_p = 448.0f / a;
    }
}

#endif
