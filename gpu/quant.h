/* FP8 quantization API (DESIGN.md section 3): host reference implementations, and the CUDA
 * kernels' launchers when built with CUDA. The element helpers live in gpu/fp8.h. */
#ifndef EPD_GPU_QUANT_H
#define EPD_GPU_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "config/config.h"

/* Number of fp32 scales of one row: H/128 for group128, 1 for per_token. */
uint32_t epd_quant_n_scales(uint32_t hidden, epd_scale_kind_t kind);

/* Quantizes one row of `hidden` bf16 values (bit patterns) to e4m3 bytes q[hidden] and its scales. */
void epd_quant_row_host(const uint16_t *x, uint32_t hidden, epd_scale_kind_t kind,
                        epd_scale_fmt_t fmt, uint8_t *q, float *scales);

/* Dequantizes one row: out[i] = (float)q[i] * scale of i's group (or the token). */
void epd_dequant_row_host(const uint8_t *q, const float *scales, uint32_t hidden,
                          epd_scale_kind_t kind, float *out);

/* Index of the first bf16 value of x[n] that is Inf or NaN, or -1 when all are finite. */
int64_t epd_bf16_find_non_finite(const uint16_t *x, size_t n);

#endif
