/* The ffn experts on a CUDA device (DESIGN.md section 9): this rank's weights in device memory,
 * the received records grouped by local expert, cuBLASLt GEMMs per expert (gate and up fused in
 * one [2I, H] GEMM, then down; BF16, or FP8 with the DeepSeek 128x128 weight block scales and
 * 1x128 activation scales), SwiGLU with the intermediate's rounding or quantization in one kernel,
 * and the weighted sum of section 2 step 6 into the partials (BF16, or FP8 with combine.dtype
 * fp8). A plain C header: gpu/ops_cuda.cu
 * and the benchmark use it, nothing else sees CUDA. */
#ifndef EPD_GPU_FFN_CUDA_H
#define EPD_GPU_FFN_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "gpu/ffn.h"
#include "gpu/ops.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct epd_ffn_cuda epd_ffn_cuda_t;

/* Copies the weights (all their layers) to the current device and prepares cuBLASLt on stream
 * (a cudaStream_t). EPD_ERR_NO_MEMORY naming the bytes when the device cannot hold them,
 * EPD_ERR_UNSUPPORTED when cuBLASLt has no GEMM for the format on this device, EPD_ERR_CUDA with
 * the CUDA or cuBLAS message; err says which. The weights stay the caller's. */
epd_status_t epd_ffn_cuda_create(const epd_ffn_weights_t *weights, void *stream,
                                 epd_ffn_cuda_t **ffn_p, char err[EPD_ERR_LEN]);
void epd_ffn_cuda_destroy(epd_ffn_cuda_t *ffn);

/* The experts op for ffn (gpu/ops.h experts) on device records: n_records partials of
 * epd_partial_layout (bf16 [H], or with shape->combine_dtype fp8 e4m3 [H] + group128 fp32
 * scales, the bytes epd_partial_store_host gives for the same sums). Queued on the stream.
 * expert_rows_host: rows per local expert among the records (the count exchange's); NULL:
 * counted on the device and read back, one wait. qe: the device telemetry sums (gpu/
 * partial_dev.cuh, EPD_QE_SLOTS x EPD_QE_SUMS doubles) the FP8 partials' error is added to, or
 * NULL. */
epd_status_t epd_ffn_cuda_experts(epd_ffn_cuda_t *ffn, const epd_moe_shape_t *shape,
                                  uint32_t layer, const void *recv_buf, uint32_t n_records,
                                  const uint32_t *expert_rows_host, void *partials, double *qe,
                                  char err[EPD_ERR_LEN]);

/* Device bytes of the weights (all layers). */
uint64_t epd_ffn_cuda_weight_bytes(const epd_ffn_cuda_t *ffn);

/* The benchmark's same-run baselines on the current device (own buffers, own stream), each the
 * median of iters timed runs after a warm-up, in microseconds:
 *   gemm: one dense cuBLASLt BF16 GEMM [m, k] x [k, n] (fp32 accumulation, BF16 out);
 *   read: one pass of a kernel reading `bytes` of device memory (16-byte loads, summed so the
 *         reads cannot be dropped).
 * EPD_ERR_CUDA / EPD_ERR_NO_MEMORY with err. */
epd_status_t epd_ffn_cuda_bench_gemm(uint32_t m, uint32_t n, uint32_t k, uint32_t iters,
                                     double *us_p, char err[EPD_ERR_LEN]);
epd_status_t epd_ffn_cuda_bench_read(uint64_t bytes, uint32_t iters, double *us_p,
                                     char err[EPD_ERR_LEN]);

#ifdef __cplusplus
}
#endif

#endif
