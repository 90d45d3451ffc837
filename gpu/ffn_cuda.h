/* The ffn experts on a CUDA device (DESIGN.md section 9): this rank's weights in device memory,
 * the received records grouped by local expert, cuBLASLt GEMMs per expert (gate and up fused in
 * one [2I, H] GEMM, then down; BF16, or FP8 with the DeepSeek 128x128 weight block scales and
 * 1x128 activation scales) spread over a few streams, batched (pointer arrays, strided runs of
 * experts) or grouped, or one launch per projection of a GEMM kernel of our own, SwiGLU with the intermediate's rounding or quantization in one kernel,
 * and the weighted sum of section 2 step 6 into the
 * partials (BF16, or FP8 with combine.dtype fp8). A plain C header: gpu/ops_cuda.cu, the
 * benchmark and the GPU test use it, nothing else sees CUDA. */
#ifndef EPD_GPU_FFN_CUDA_H
#define EPD_GPU_FFN_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "gpu/ffn.h"
#include "gpu/ops.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct epd_ffn_cuda epd_ffn_cuda_t;

#define EPD_FFN_MAX_STREAMS 8

/* How an experts call spreads its GEMMs (the results are the same bytes whatever the choice:
 * each output element is one GEMM's, and the weighted sum after it is fixed). */
typedef struct epd_ffn_cuda_tuning {
    uint32_t streams; /* [1, EPD_FFN_MAX_STREAMS]: experts run round-robin on this many streams,
                       * forked from and joined back into the call's stream with events */
    bool batched;     /* BF16 weights: the experts with equal padded rows as one pointer-array
                       * batched cuBLASLt GEMM per projection (FP8 weights: ignored) */
    bool sm_target;   /* with streams > 1: cuBLASLt's heuristic picks tiles for SMs / streams */
    bool autotune;    /* each GEMM plan (projection, padded rows) times its candidates at first
                       * use and keeps the fastest: cuBLASLt's heuristic's answers (up to 16)
                       * and split-K variants of its first few; off: the heuristic's first.
                       * Pointer-array batched plans always take the heuristic's first */
    bool fast_accum;  /* FP8 weights: cuBLASLt's FP8 fast accumulation (no periodic promotion
                       * of the sums; BF16 weights: ignored) */
    bool strided;     /* the experts as strided-batched cuBLASLt GEMMs: runs of consecutive
                       * local experts (their weights lie at a fixed stride), every expert of a
                       * run given the run's largest padded row count (rows of zeros, whose
                       * outputs are never read), one GEMM per run and projection and one SwiGLU
                       * per run, the runs round-robin on the streams. BF16 weights, and FP8 where
                       * this cuBLASLt's batched block-scaled GEMM agrees with its single GEMMs
                       * (checked when the tuning is set: EPD_ERR_UNSUPPORTED otherwise). Takes
                       * precedence over batched; its plans take the heuristic's first */
    uint32_t run_cost; /* strided: the cost of one more run, in rows of one expert; the runs
                        * are those that minimise run_cost per run plus, per expert in a run,
                        * the larger of the run's rows and EPD_FFN_READ_ROWS (an expert's GEMMs
                        * never cost less than reading its weights; experts without rows
                        * outside the runs cost nothing). UINT32_MAX: one run from the first to
                        * the last expert with rows */
    bool grouped;     /* BF16 weights: one cublasGemmGroupedBatchedEx call per projection over
                       * every expert with rows (a group per distinct padded row count),
                       * libcublas loaded at run time (EPD_ERR_UNSUPPORTED without it, or
                       * without a grouped GEMM of these types); FP8 weights: ignored. Takes
                       * precedence over batched, strided over it */
    bool kernel;      /* the GEMM kernel of our own (gpu/ffn_gemm.h): each projection one launch
                       * over every expert with rows, BF16 and FP8 block weights, on the call's
                       * stream; checked against cuBLASLt's single GEMMs when the tuning is set
                       * (EPD_ERR_UNSUPPORTED saying where when they disagree, or where the
                       * device or the build cannot run it: the tuning then set without it; a
                       * CUDA error of the check is returned). Takes precedence over the others
                       * for the calls it takes (kernel_max_rows); the others serve the rest */
    uint32_t kernel_max_rows; /* kernel: only calls whose mean rows per expert with rows is at
                               * most this (0: every call; EPD_FFN_ROWS_NONE: none) */
    uint32_t kernel_fp8_max_rows; /* kernel, FP8 block weights: their own kernel_max_rows (0:
                                   * kernel_max_rows; UINT32_MAX: every call;
                                   * EPD_FFN_ROWS_NONE: none) */
    uint32_t kernel_prefetch; /* kernel: the weights' L2 prefetch run in 128-byte stages of K
                               * (each row's next run that many stages beyond the kernel's
                               * copies; 0: EPD_FFN_GEMM_PREFETCH of gpu/ffn_gemm.h;
                               * EPD_FFN_NO_PREFETCH: none) */
    uint32_t kernel_split;    /* kernel: K ranges of a launch (0: the kernel picks by its grid's
                               * waves, splitting short grids only; 1: none; n: at most n), their
                               * sums added in order by a second launch (deterministic) in the
                               * first stream's cuBLASLt workspace (fewer ranges where it is
                               * short) */
    bool wgmma;               /* the Hopper GEMM kernel (gpu/ffn_gemm_wgmma.cu: wgmma, TMA; sm_90a
                               * only): each projection one launch over every expert with rows,
                               * BF16 and FP8 block weights, on the call's stream; checked against
                               * cuBLASLt at each of its row tiles when the tuning is set, like
                               * kernel (EPD_ERR_UNSUPPORTED, the tuning then set without it).
                               * Takes the calls within wgmma_max_rows that kernel does not take
                               * (kernel first, unless wgmma_first); the others serve the rest.
                               * Its check runs only for a format it takes calls of */
    uint32_t wgmma_max_rows;     /* wgmma: kernel_max_rows' meaning (0: every call) */
    uint32_t wgmma_fp8_max_rows; /* wgmma, FP8 block weights: kernel_fp8_max_rows' meaning */
    bool wgmma_first;            /* wgmma takes the calls within its rows before kernel does
                                  * (kernel then serves those within its own rows that wgmma
                                  * does not take: all of them where wgmma's check refused it) */
    uint32_t wgmma_split;        /* wgmma: kernel_split's meaning */
    bool wgmma_swiglu;           /* wgmma, BF16 weights: SwiGLU fused into the gate/up GEMM's
                                  * epilogue (no fp32 gate/up output, no SwiGLU launch) where the
                                  * launch has no split-K and cuBLASLt has fp32 D for the format
                                  * (the unfused paths then share its arithmetic); checked
                                  * against the unfused kernel and the SwiGLU kernel when set */
    bool wgmma_pdl;              /* wgmma: each GEMM launched behind the kernel before it
                                  * (gather, SwiGLU, the gate/up GEMM) as a programmatic
                                  * dependent launch, its first weights loaded while that kernel
                                  * ends (ffn_gemm.h's pdl) */
    uint32_t wgmma_row_tile;     /* wgmma: the rows of a row tile (32, 64, 96, 128, 160, 192,
                                  * 256; FP8 at most 192, larger is 192); 0: picked per call by
                                  * the rows */
    bool d_bf16;                 /* the GEMMs write D in BF16 (round to nearest even) instead of
                                  * fp32: the experts' outputs y, which the combine reads (as
                                  * external experts answer them, DESIGN.md section 9), and, for
                                  * BF16 weights, the gate/up sums where SwiGLU is not fused (the
                                  * cuBLAS paths), which the SwiGLU kernel reads. Half the bytes
                                  * written and read again; a rounding more, inside section 9's
                                  * tolerance. The fused SwiGLU still works from fp32 sums, and
                                  * FP8 weights' SwiGLU kernel too (it quantizes h to FP8) */
    bool wgmma_pair;             /* wgmma, BF16 weights: CTAs in pairs, each bringing half of
                                  * the activations into both (ffn_gemm.h's pair): the pair reads
                                  * them from L2 once; same sums. FP8 block weights' launches stay
                                  * alone (even to 2% slower in pairs, session 22) */
} epd_ffn_cuda_tuning_t;

/* strided: an expert's GEMMs cost at least about as much as computing this many of its rows
 * (the weights' read at decode sizes; the tensor cores' FLOPs per byte of memory on Hopper) */
#define EPD_FFN_READ_ROWS 128u
/* strided: the run cost of epd_ffn_cuda_default_tuning's strided variant, in rows */
#define EPD_FFN_RUN_COST 256u

/* kernel_prefetch: no L2 prefetch */
#define EPD_FFN_NO_PREFETCH UINT32_MAX

/* kernel_max_rows, kernel_fp8_max_rows, wgmma_max_rows, wgmma_fp8_max_rows: no call */
#define EPD_FFN_ROWS_NONE (UINT32_MAX - 1u)

/* The tuning a new epd_ffn_cuda_t starts with on the current device (the fastest measured,
 * docs/results.md; the values are gpu/ffn_path.h's epd_ffn_default_tuning_for with the device's
 * name). */
void epd_ffn_cuda_default_tuning(epd_ffn_cuda_tuning_t *tuning);

/* Copies the weights (all their layers) to the current device and prepares cuBLASLt on stream
 * (a cudaStream_t; NULL: a stream of its own, for the benchmark and tests). EPD_ERR_NO_MEMORY naming the bytes when the device cannot hold them,
 * EPD_ERR_UNSUPPORTED when cuBLASLt has no GEMM for the format on this device, EPD_ERR_CUDA with
 * the CUDA or cuBLAS message; err says which. The weights stay the caller's. */
epd_status_t epd_ffn_cuda_create(const epd_ffn_weights_t *weights, void *stream,
                                 epd_ffn_cuda_t **ffn_p, char err[EPD_ERR_LEN]);
void epd_ffn_cuda_destroy(epd_ffn_cuda_t *ffn);

/* Changes the tuning (waits for the stream; the GEMM plans are made again). EPD_ERR_INVALID_ARG
 * for a streams count out of range, EPD_ERR_NO_MEMORY / EPD_ERR_CUDA with err;
 * EPD_ERR_UNSUPPORTED with err saying why when strided or grouped cannot run here (their checks
 * above), the tuning then set without it. */
epd_status_t epd_ffn_cuda_set_tuning(epd_ffn_cuda_t *ffn, const epd_ffn_cuda_tuning_t *tuning,
                                     char err[EPD_ERR_LEN]);
void epd_ffn_cuda_get_tuning(const epd_ffn_cuda_t *ffn, epd_ffn_cuda_tuning_t *tuning_p);

/* Waits for the stream (an experts call's work done). EPD_ERR_CUDA with err. */
epd_status_t epd_ffn_cuda_sync(epd_ffn_cuda_t *ffn, char err[EPD_ERR_LEN]);

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

/* One GEMM plan as chosen: the projection (0 gate and up, 1 down), its padded rows and batch
 * (0: one GEMM; else a strided or pointer-array batch of that many), the chosen algorithm's
 * tile id, split-K count and cuBLASLt's waves estimate; with the autotune, how many candidates
 * were timed, the heuristic's first's time and the chosen one's (microseconds per GEMM, alone
 * on the stream; 0 when not timed). */
typedef struct epd_ffn_cuda_plan_info {
    uint32_t proj, rows, batch;
    bool strided; /* batch > 0: strided (true) or pointer-array batch */
    uint32_t tile, splitk, candidates, chosen;
    float waves;
    double heuristic_us, chosen_us;
} epd_ffn_cuda_plan_info_t;

/* Fills up to max plans made since the last tuning change (info caller-owned); returns how
 * many there are (may exceed max). */
uint32_t epd_ffn_cuda_plans(const epd_ffn_cuda_t *ffn, epd_ffn_cuda_plan_info_t *info,
                            uint32_t max);

/* What the last experts call queued (the benchmark prints it beside the call's host time): its
 * path (gpu/ffn_path.h's epd_ffn_path_name: kernel, wgmma, strided, grouped, batched, streams;
 * "none" before the first call or when no record had a row here), the GEMM calls it queued (one
 * per cuBLAS call or GEMM kernel launch; each costs the host a launch or more), and the GEMM
 * plans it made (each a cuBLASLt heuristic query on the host; 0 once the call's shapes were
 * seen). */
typedef struct epd_ffn_cuda_call_info {
    const char *path;
    uint32_t gemm_calls, plans_made;
} epd_ffn_cuda_call_info_t;
void epd_ffn_cuda_last_call(const epd_ffn_cuda_t *ffn, epd_ffn_cuda_call_info_t *info_p);

/* Device bytes of the weights (all layers). */
uint64_t epd_ffn_cuda_weight_bytes(const epd_ffn_cuda_t *ffn);

/* The benchmark's same-run baselines on the current device (own buffers, own stream), each the
 * median of iters timed runs after a warm-up, in microseconds:
 *   gemm: one dense cuBLASLt BF16 GEMM [m, k] x [k, n] (fp32 accumulation, BF16 out) on random
 *         values (constant inputs would flatter it: a GEMM's power, and so its clock, depends on
 *         the data);
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
