/* The ffn experts' GEMM kernel of our own (gpu/ffn_gemm.cu): one launch computes one projection
 * of every local expert with rows, D[row][n] = sum_k X[row][k] W[n][k] (BF16, or e4m3 with the
 * DeepSeek 128x128 weight block scales and 1x128 activation scales), fp32 accumulation, over a
 * grid of (row tile, 128 output features) covering only the experts with rows. A plain C header:
 * gpu/ffn_cuda.cu and the GPU test use it. */
#ifndef EPD_GPU_FFN_GEMM_H
#define EPD_GPU_FFN_GEMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* rows of one expert a CTA computes (an expert with more rows gets more row tiles, each reading
 * the expert's weights again, mostly from L2: the row tiles of an expert are adjacent CTAs) */
#define EPD_FFN_GEMM_ROW_TILE 64u
/* output features of one CTA: one FP8 weight scale block */
#define EPD_FFN_GEMM_BN 128u
/* the weights' L2 prefetch the daemon uses (args.prefetch P: every P stages, one request per
 * weight row for P stages of 128 bytes, P stages beyond the cp.async pipeline's front); 0: none,
 * the pipeline (EPD_FFN_GEMM_STAGES deep) keeps the bytes in flight */
#define EPD_FFN_GEMM_PREFETCH 0u
/* the shared-memory pipeline's depth in stages of 128 bytes of K (weights and activations) */
#define EPD_FFN_GEMM_STAGES 4u
/* split_k: the kernel picks (epd_ffn_gemm_auto_split of gpu/ffn_gemm_layout.h) */
#define EPD_FFN_GEMM_SPLIT_AUTO 0u

/* One projection over the experts [0, n_experts) (device pointers unless said otherwise). */
typedef struct epd_ffn_gemm_args {
    bool fp8;          /* e4m3 weights and activations with block scales; false: BF16 */
    bool out_bf16;     /* D in BF16 (round to nearest even); false: fp32 */
    uint32_t n, k;     /* output features and reduction length, both multiples of 128 */
    uint32_t n_experts;
    const void *w;     /* [n_experts][n][k] row-major (DeepSeek's [out, in]) */
    const float *w_scale; /* fp8: [n_experts][n / 128][w_scale_ld] (w = q * scale of its block) */
    uint32_t w_scale_ld;  /* fp8: the row length of w_scale (>= k / 128) */
    const void *x;     /* [row_base[n_experts]][k] row-major: expert e's rows from row_base[e] */
    const float *x_scale; /* fp8: expert e's [k / 128][row_base[e + 1] - row_base[e]] from
                           * x_scale + row_base[e] * (k / 128) (x = q * scale of its 1x128) */
    const uint32_t *row_base;  /* [n_experts + 1] ascending, multiples of 16: expert e's padded
                                * rows (16-byte aligned FP8 scale columns) */
    const uint32_t *counts;    /* [n_experts]: rows of expert e (its count rounded up to 8 at
                                * most its padded rows; the rows from the count to that multiple
                                * of 8 are computed too, and written: keep them finite) */
    const uint32_t *tile_base; /* [n_experts + 1]: prefix sums of ceil(counts / ROW_TILE) */
    uint32_t n_tiles;          /* tile_base[n_experts] (host) */
    void *d;           /* [row_base[n_experts]][n]: the rows of each tile written, others not */
    uint32_t prefetch; /* the weights' L2 prefetch run in stages (EPD_FFN_GEMM_PREFETCH; 0: none) */
    uint32_t split_k;  /* K ranges over the grid's z (EPD_FFN_GEMM_SPLIT_AUTO: the kernel picks
                        * by the grid's waves; 1: none; more: at most that many, fewer when K's
                        * stages or the workspace are short): each range's fp32 sums go to
                        * split_ws, then one more launch adds them in range order into d (the
                        * same bits run to run) */
    uint32_t total_rows; /* row_base[n_experts] (host): the workspace's rows */
    void *split_ws;      /* device scratch for split-K, split_ws_bytes of it (NULL: no split) */
    size_t split_ws_bytes;
    uint32_t *split_used_p; /* host, optional: the K ranges the launch used */
    uint32_t row_tile;   /* epd_ffn_wgmma_launch only: the most rows of a row tile (32, 64, 96,
                          * 128, 160, 192 or 256; FP8: up to 192; epd_ffn_wgmma_row_tile picks
                          * one), tile_base then the prefix sums of ceil(counts / row_tile); an
                          * expert's rows are shared evenly over its tiles, each computing its
                          * rows rounded up to 16. The mma.sync kernel ignores it (its tiles are
                          * EPD_FFN_GEMM_ROW_TILE rows) */
    void *swiglu_h;      /* epd_ffn_wgmma_launch, BF16 gate/up only (optional): SwiGLU fused
                          * into the epilogue: h [total_rows][n / 2] BF16 = bf16(silu(g) * u)
                          * (the SwiGLU kernel's fp32 operations) of D's features g in [0, n / 2)
                          * and u = the feature n / 2 on, for the rows the kernel writes; D then
                          * not written. Only without split-K: *swiglu_done_p says whether it
                          * was (else D is written as without it) */
    bool *swiglu_done_p; /* host, optional */
    bool pdl;            /* epd_ffn_wgmma_launch: launched as a programmatic dependent of the
                          * stream's previous kernel, which writes x (and x_scale) and lets
                          * it start early (griddepcontrol.launch_dependents, as the gather, the
                          * SwiGLU kernel and this kernel do; another kernel lets it start once
                          * it is done): the first stages' weights load while that kernel ends.
                          * Only where nothing else this launch reads or writes is still being
                          * written or read by that kernel */
    bool pair;           /* epd_ffn_wgmma_launch: CTAs in pairs (clusters of two) computing
                          * neighbouring feature blocks of one row tile, each bringing half of
                          * the activations into both by multicast (the pair reads them from L2
                          * once); where the feature blocks pair up and a cluster fits, else
                          * alone. Same sums either way */
    bool *pair_used_p;   /* host, optional: whether the launch went in pairs */
} epd_ffn_gemm_args_t;

/* EPD_OK when the kernel can run on the current device for the format (BF16: compute capability
 * 8.0 and code built for it; FP8: 8.9; the pipeline's shared memory); EPD_ERR_UNSUPPORTED with
 * err saying why. */
epd_status_t epd_ffn_gemm_supported(bool fp8, char err[EPD_ERR_LEN]);

/* Queues the GEMM on stream (a cudaStream_t). EPD_ERR_INVALID_ARG for shapes the kernel does not
 * take, EPD_ERR_CUDA with the launch's error; err says which. n_tiles 0: nothing queued. */
epd_status_t epd_ffn_gemm_launch(const epd_ffn_gemm_args_t *args, void *stream,
                                 char err[EPD_ERR_LEN]);

/* The layout self-check: one mma.sync (BF16 m16n8k16, or e4m3 m16n8k32 with fp8) on the PTX
 * ISA's fragment layouts, a [16][32 bytes] row-major, b [8][32 bytes] (b[n] is column n of the
 * mma's B, i.e. a row of activations), d_host [16][8] fp32 out = a b^T; host memory, waited for.
 * EPD_ERR_UNSUPPORTED / EPD_ERR_CUDA with err. */
epd_status_t epd_ffn_gemm_mma_check(bool fp8, const void *a_host, const void *b_host,
                                    float *d_host, char err[EPD_ERR_LEN]);

/* The Hopper kernel (gpu/ffn_gemm_wgmma.cu: wgmma, TMA, mbarrier pipeline; the ffn_cuda tuning
 * `wgmma`), on the same arguments with args.row_tile. */

/* EPD_OK when it can run on the current device: compute capability 9.0 exactly (sm_90a code),
 * this build's sm_90a code, the shared memory of its pipelines, the driver's
 * cuTensorMapEncodeTiled; EPD_ERR_UNSUPPORTED with err saying why. */
epd_status_t epd_ffn_wgmma_supported(bool fp8, char err[EPD_ERR_LEN]);

/* The row tile for a launch over n_experts experts with counts[e] rows (host memory): the least
 * rows computed in vain, weighed against the tiles (gpu/ffn_gemm_wgmma_layout.h). */
uint32_t epd_ffn_wgmma_row_tile(bool fp8, const uint32_t *counts, uint32_t n_experts);

/* The layout self-check: the TMA copies a [64][128 bytes] and b [32][128 bytes] (host memory;
 * BF16, or e4m3 with fp8) into shared tiles as the kernel's producer does, the tiles are dumped
 * as they lie (dump_a [64][128 bytes], dump_b [32][128 bytes]: epd_wgmma_tile_off's places),
 * and one stage's 4 wgmmas (m64n32, the kernel's descriptors) give d_host [64][32] fp32 = a b^T.
 * Waited for. EPD_ERR_UNSUPPORTED / EPD_ERR_CUDA with err. */
epd_status_t epd_ffn_wgmma_layout_check(bool fp8, const void *a_host, const void *b_host,
                                        void *dump_a_host, void *dump_b_host, float *d_host,
                                        char err[EPD_ERR_LEN]);

/* A debugging aid: true when an mbarrier wait of an earlier launch timed out (the launch then
 * ended with wrong results instead of hanging), text (len bytes) saying which CTA, thread and
 * stage; the record is then cleared. Waits for the device. */
bool epd_ffn_wgmma_hang(char *text, size_t len);

/* Queues the GEMM on stream. EPD_ERR_INVALID_ARG for shapes, a row tile or alignments it does not
 * take (or a tensor map the driver refuses), EPD_ERR_UNSUPPORTED without the driver's tensor map
 * encoder, EPD_ERR_CUDA with the launch's error; err says which. n_tiles 0: nothing queued. */
epd_status_t epd_ffn_wgmma_launch(const epd_ffn_gemm_args_t *args, void *stream,
                                  char err[EPD_ERR_LEN]);

#ifdef __cplusplus
}
#endif

#endif
