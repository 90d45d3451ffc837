/* Which way one ffn experts call of gpu/ffn_cuda.cu runs its GEMMs (its path), chosen from the
 * tuning as set (the parts whose checks refused them already cleared) and the call's rows per
 * local expert; and the daemon's default tuning. Inline and free of CUDA, so that the choice is
 * checked on the CPU (tests/unit/test_ffn_path.c). */
#ifndef EPD_GPU_FFN_PATH_H
#define EPD_GPU_FFN_PATH_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "gpu/ffn_cuda.h"

typedef enum epd_ffn_path {
    EPD_FFN_PATH_KERNEL,  /* the mma.sync GEMM kernel: one launch per projection */
    EPD_FFN_PATH_WGMMA,   /* the Hopper GEMM kernel: one launch per projection */
    EPD_FFN_PATH_STRIDED, /* one strided-batched cuBLASLt GEMM per run of experts and projection */
    EPD_FFN_PATH_GROUPED, /* one cublasGemmGroupedBatchedEx per projection (BF16) */
    EPD_FFN_PATH_BATCHED, /* one pointer-array batched GEMM per group of equal rows (BF16) */
    EPD_FFN_PATH_STREAMS, /* one cuBLASLt GEMM per expert and projection, round-robin on the
                           * tuning's streams: two GEMM calls and a SwiGLU launch per expert
                           * with rows, each a launch or more on the host */
    EPD_FFN_PATH_MAX
} epd_ffn_path_t;

/* (a switch, not a designated table: the header is C++ too, in gpu/ffn_cuda.cu) */
static inline const char *epd_ffn_path_name(epd_ffn_path_t path)
{
    switch (path) {
    case EPD_FFN_PATH_KERNEL: return "kernel";
    case EPD_FFN_PATH_WGMMA: return "wgmma";
    case EPD_FFN_PATH_STRIDED: return "strided";
    case EPD_FFN_PATH_GROUPED: return "grouped";
    case EPD_FFN_PATH_BATCHED: return "batched";
    case EPD_FFN_PATH_STREAMS: return "streams";
    case EPD_FFN_PATH_MAX: break;
    }
    return "none";
}

/* A kernel's row limit for a format: max_rows, or for FP8 block weights fp8_max_rows when set
 * (UINT32_MAX there: every call). Returns 0 for every call, EPD_FFN_ROWS_NONE for none, else
 * the largest mean rows per expert with rows it takes. */
static inline uint32_t epd_ffn_path_limit(bool fp8, uint32_t max_rows, uint32_t fp8_max_rows)
{
    if (fp8 && fp8_max_rows != 0) return fp8_max_rows == UINT32_MAX ? 0 : fp8_max_rows;
    return max_rows;
}

/* Whether a kernel that is on, with these limits, takes a call of these rows per local expert
 * (counts, n_local of them): the mean over the experts with rows against the limit (a call
 * without rows is taken by every kernel that takes any). */
static inline bool epd_ffn_path_takes(bool on, bool fp8, uint32_t max_rows, uint32_t fp8_max_rows,
                                      const uint32_t *counts, uint32_t n_local)
{
    uint64_t rows = 0, used = 0;
    uint32_t limit = epd_ffn_path_limit(fp8, max_rows, fp8_max_rows);
    if (!on || limit == EPD_FFN_ROWS_NONE) return false;
    if (limit == 0) return true;
    for (uint32_t e = 0; e < n_local; e++) {
        rows += counts[e];
        used += counts[e] > 0;
    }
    return used == 0 || rows <= (uint64_t)limit * used;
}

/* The path of a call: wgmma or kernel where they take it (kernel first unless wgmma_first),
 * else strided, grouped (BF16, with libcublas loaded: grouped_ready), batched (BF16), and the
 * streams when none of those is on. */
static inline epd_ffn_path_t epd_ffn_path_choose(const epd_ffn_cuda_tuning_t *t, bool fp8,
                                                 bool grouped_ready, const uint32_t *counts,
                                                 uint32_t n_local)
{
    bool kernel = epd_ffn_path_takes(t->kernel, fp8, t->kernel_max_rows, t->kernel_fp8_max_rows,
                                     counts, n_local);
    bool wgmma = epd_ffn_path_takes(t->wgmma, fp8, t->wgmma_max_rows, t->wgmma_fp8_max_rows,
                                    counts, n_local);
    if (wgmma && (t->wgmma_first || !kernel)) return EPD_FFN_PATH_WGMMA;
    if (kernel) return EPD_FFN_PATH_KERNEL;
    if (t->strided) return EPD_FFN_PATH_STRIDED;
    if (t->grouped && !fp8 && grouped_ready) return EPD_FFN_PATH_GROUPED;
    if (t->batched && !fp8) return EPD_FFN_PATH_BATCHED;
    return EPD_FFN_PATH_STREAMS;
}

/* The default tuning (epd_ffn_cuda_default_tuning), from the same-run benchmarks of
 * docs/results.md on the H200; epd_ffn_default_tuning_for below moves it for a device measured
 * apart. */
static inline void epd_ffn_default_tuning_fill(epd_ffn_cuda_tuning_t *t)
{
    memset(t, 0, sizeof *t);
    t->streams = 4;
    t->batched = false;
    t->sm_target = false;
    /* the autotune did not help on the H200 (docs/results.md, ffn run 2) */
    t->autotune = false;
    t->fast_accum = false;
    /* strided: the fastest for BF16 weights at every row count of ffn run 3 (docs/results.md);
     * FP8 block weights fall back to the streams (this cuBLASLt has no batched block-scaled
     * GEMM); grouped: cuBLAS refused it for BF16 in, fp32 out */
    t->strided = true;
    t->run_cost = EPD_FFN_RUN_COST;
    t->grouped = false;
    /* the GEMM kernel of our own (gpu/ffn_gemm.cu) up to 16 rows per expert for BF16 (mean over
     * the experts with rows), where ffn run 7 (docs/results.md) measured it faster than strided;
     * for FP8 block weights up to 32, where it beat the streams in ffn run 9 (the streams issue
     * ~100 launches a call: their host time is the phase there). It serves only where wgmma
     * does not (wgmma_first): off Hopper, or where wgmma's check refused it.
     * kernel_max_rows: 0 is every call, so 16 is written out */
    t->kernel = true;
    t->kernel_max_rows = 16;
    t->kernel_fp8_max_rows = 32;
    t->kernel_prefetch = 0;
    t->kernel_split = 0;
    /* the Hopper kernel (gpu/ffn_gemm_wgmma.cu) first: for BF16 weights up to 64 rows per expert
     * (strided above; 128 on an H100 SXM, epd_ffn_default_tuning_for), for FP8 block weights up
     * to 192 (176 on an H100 SXM; the streams above, where their GEMMs, not their launches, are
     * the limit), where the same-run benches of sessions 13 and 14 measured it the fastest
     * (docs/results.md; FP8 at 160 rows 812 us against the streams' 1147, at 192 1046 against
     * 1077, at 224 1192 against 1105). Off sm_90a its check refuses it: the kernel, strided and
     * the streams then serve as above */
    t->wgmma = true;
    t->wgmma_max_rows = 64;
    t->wgmma_fp8_max_rows = 192;
    t->wgmma_first = true;
    t->wgmma_split = 0;
    t->wgmma_row_tile = 0;
    /* BF16: SwiGLU in the gate/up GEMM's epilogue (gate and up interleaved by the weights'
     * tensor map, so a thread holds both): session 15's bench measured it 19-50 us faster a call
     * at 32-256 rows per expert (docs/results.md). FP8 stays unfused (its two weight scales a
     * thread cost the promotion more than the SwiGLU kernel saved) */
    t->wgmma_swiglu = true;
    /* the GEMMs launched behind the kernels before them, their first weights loaded early */
    t->wgmma_pdl = true;
    /* BF16: the Hopper kernel's CTAs in pairs, the activations brought once a pair by multicast:
     * on the H100 the bench's experts phase 0-1.8% faster at 32-128 rows per expert (one
     * comparison of ten even), the GEMMs alone 0-1% (session 22, docs/results.md); FP8 stays
     * alone (even to 2% slower in pairs) */
    t->wgmma_pair = true;
    /* the experts' outputs y in BF16 (and BF16 weights' unfused gate/up sums): half the bytes
     * the down GEMM writes and the combine reads (session 18, docs/results.md) */
    t->d_bf16 = true;
}

/* The device whose own same-run benches moved the default (docs/results.md, sessions 19 and
 * 21), by its CUDA name: on an H100 SXM (HBM3, 3.35 TB/s) the Hopper kernel beat strided for
 * BF16 up to 128 rows per expert (experts_us in two calls: at 96 rows 1113-1120 against
 * 1172-1210, at 128 1172-1197 against 1236-1273; at 160 1313-1316 against 1248-1255), where on
 * the H200 (4.8 TB/s: the weights' read shorter, the kernel's tensor-core work the same) strided
 * is faster from 96 rows (838-842 against 905-915); and for FP8 block weights the Hopper kernel
 * beat the streams up to 176 rows, not at 192 (two turns: at 176 rows 923.0 / 916.5 against
 * 972.4 / 975.5, at 192 1132.6 / 1131.7 against 992.8 / 994.2), where on the H200 the two are
 * even at 192. Any other device, unmeasured, takes the H200's default (NULL: no device). */
#define EPD_FFN_H100_SXM_NAME "NVIDIA H100 80GB HBM3"

static inline void epd_ffn_default_tuning_for(epd_ffn_cuda_tuning_t *t, const char *device_name)
{
    epd_ffn_default_tuning_fill(t);
    if (device_name != NULL && strcmp(device_name, EPD_FFN_H100_SXM_NAME) == 0) {
        t->wgmma_max_rows = 128;
        t->wgmma_fp8_max_rows = 176;
    }
}

#endif
