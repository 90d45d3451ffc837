/* Device helpers of the FP8 partials (combine.dtype fp8, DESIGN.md section 3) and of the
 * quantization error telemetry (telemetry.quant_error), for every kernel that writes partials
 * (the experts kernels of gpu/ops_cuda.cu, and any expert kind's final weighted sum) or packs
 * FP8 records. CUDA code only; the host twins are epd_partial_store_host (gpu/ops.h). */
#ifndef EPD_GPU_PARTIAL_DEV_CUH
#define EPD_GPU_PARTIAL_DEV_CUH

#include <stdint.h>

#include "gpu/fp8.h"
#include "gpu/quant_dev.cuh"

#define EPD_QE_SLOTS 64 /* telemetry accumulators, blockIdx % slots: fewer atomics on each */
#define EPD_QE_SUMS 4   /* dispatch err2, ref2, combine err2, ref2 (epd_quant_error_t order) */

/* Telemetry: e2 and r2 of every thread of the block added into sums [which] and [which + 1] of
 * the block's slot of qe (EPD_QE_SLOTS slots of EPD_QE_SUMS doubles; quant_error_take adds the
 * slots up). Every thread of the block calls it; blocks are whole warps. */
__device__ __forceinline__ void epd_dev_qe_block_add(double *qe, uint32_t which, float e2,
                                                     float r2)
{
    __shared__ float s_e[32], s_r[32];
    for (uint32_t off = 16; off > 0; off >>= 1) {
        e2 += __shfl_xor_sync(0xffffffffu, e2, off);
        r2 += __shfl_xor_sync(0xffffffffu, r2, off);
    }
    const uint32_t warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
    if ((threadIdx.x & 31) == 0) {
        s_e[warp] = e2;
        s_r[warp] = r2;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double e = 0.0, r = 0.0;
        for (uint32_t w = 0; w < n_warps; w++) {
            e += s_e[w];
            r += s_r[w];
        }
        double *slot = qe + (size_t)(blockIdx.x % EPD_QE_SLOTS) * EPD_QE_SUMS + which;
        if (r != 0.0 || e != 0.0) {
            atomicAdd(slot, e);
            atomicAdd(slot + 1, r);
        }
    }
}

/* Adds the squared error of 16 codes q with scale s against the values x to *e2, and the
 * squared values to *r2 (fp32, no FMA: the build has --fmad=false). */
__device__ __forceinline__ void epd_dev_qe_chunk(uint4 q, float s, const float *x, float *e2,
                                                 float *r2)
{
    float dq[16];
    epd_dev_dequant16(q, s, dq);
#pragma unroll
    for (int i = 0; i < 16; i++) {
        float d = x[i] - dq[i];
        *e2 += d * d;
        *r2 += x[i] * x[i];
    }
}

/* Elements [16c, 16c + 16) of one FP8 partial at part (part_size bytes: H e4m3 codes, then H/128
 * fp32 group scales, then zero padding) from their fp32 sums acc, exactly as the host's
 * epd_partial_store_host: the group's amax over its 8 consecutive lanes (fmaxf ignores NaN as
 * the host's `>` does), the dispatch's scale rule (group128, fp32 scale), q = e4m3(acc * mult);
 * the group's first lane writes the scale, chunk 0's lane the padding. The 8 chunks of a group
 * must be 8 consecutive lanes (8-aligned) of one warp, and every lane of the warp calls it (the
 * shuffles), active or not; inactive lanes store nothing. With telemetry, adds the chunk's error
 * to *e2 and *r2 (for epd_dev_qe_block_add into sums 2 and 3). */
__device__ __forceinline__ void epd_dev_store_fp8_partial16(uint8_t *part, uint32_t hidden,
                                                            uint32_t part_size, bool active,
                                                            uint32_t c, const float *acc,
                                                            bool telemetry, float *e2, float *r2)
{
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; i++) m = fmaxf(m, fabsf(acc[i]));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
    if (!active) return;
    float scale, mult;
    epd_quant_scale(m, 0, &scale, &mult);
    uint4 q;
    q.x = epd_dev_cvt4(__fmul_rn(acc[0], mult), __fmul_rn(acc[1], mult), __fmul_rn(acc[2], mult),
                       __fmul_rn(acc[3], mult));
    q.y = epd_dev_cvt4(__fmul_rn(acc[4], mult), __fmul_rn(acc[5], mult), __fmul_rn(acc[6], mult),
                       __fmul_rn(acc[7], mult));
    q.z = epd_dev_cvt4(__fmul_rn(acc[8], mult), __fmul_rn(acc[9], mult), __fmul_rn(acc[10], mult),
                       __fmul_rn(acc[11], mult));
    q.w = epd_dev_cvt4(__fmul_rn(acc[12], mult), __fmul_rn(acc[13], mult),
                       __fmul_rn(acc[14], mult), __fmul_rn(acc[15], mult));
    *reinterpret_cast<uint4 *>(part + (size_t)c * 16) = q;
    if ((c & 7u) == 0) *reinterpret_cast<float *>(part + hidden + 4u * (c >> 3)) = scale;
    if (c == 0)
        for (uint32_t b = hidden + hidden / 32; b < part_size; b += 4)
            *reinterpret_cast<uint32_t *>(part + b) = 0;
    if (telemetry) epd_dev_qe_chunk(q, scale, acc, e2, r2);
}

#endif
