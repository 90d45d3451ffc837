/* bf16 <-> fp32 (round to nearest even, a NaN stays a quiet NaN) and the bf16 finiteness test:
 * the one copy of these bit rules. Header-only and free of CUDA headers, so the codec, the
 * clients and device code (where __CUDACC__ makes each helper __host__ __device__) round alike. */
#ifndef EPD_COMMON_BF16_H
#define EPD_COMMON_BF16_H

#include <stdint.h>
#include <string.h>

#ifndef EPD_HD
#ifdef __CUDACC__
#define EPD_HD static inline __host__ __device__
#else
#define EPD_HD static inline
#endif
#endif

/* Bits of an fp32 value and back (no aliasing tricks: memcpy on the host, intrinsics on device). */
EPD_HD uint32_t epd_f32_bits(float f)
{
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
#endif
}

EPD_HD float epd_f32_from_bits(uint32_t u)
{
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* bf16 bit pattern -> fp32 (exact). */
EPD_HD float epd_bf16_to_f32(uint16_t h)
{
    return epd_f32_from_bits((uint32_t)h << 16);
}

/* fp32 -> bf16 bit pattern, round to nearest even; overflow rounds to +-Inf as IEEE does; a NaN
 * stays a NaN (quieted, sign kept). */
EPD_HD uint16_t epd_f32_to_bf16(float f)
{
    uint32_t u = epd_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* True when a bf16 bit pattern is neither Inf nor NaN. */
EPD_HD int epd_bf16_is_finite(uint16_t h)
{
    return (h & 0x7f80u) != 0x7f80u;
}

#endif
