/* GPU test of the ffn experts (gpu/ffn_cuda.cu through epd_ops_cuda): records packed by the host
 * ops, the same records through the CUDA experts op and the host one (the reference: fp32 with
 * fp64 sums), every record's partial within DESIGN.md section 9's tolerance (relative L2 per
 * token 1e-2 with BF16 weights, 3e-2 with FP8 block weights). BF16 and FP8 weights, BF16 and FP8
 * (group128, per_token) dispatch, BF16 and FP8 partials (combine.dtype, compared dequantized,
 * with the FP8 partials' telemetry against the host's), ranks 0 and 1 of 2, a few rows per
 * expert up to hundreds (the padding), empty slots, a layer that was not loaded refused; hidden
 * and intermediate sizes whose K/128 is 1, 2, 3 or a multiple of 4 (cuBLAS pads the rows of
 * 128x128 block scales to 4). Each case runs through the ops (the default tuning) and then
 * through gpu/ffn_cuda.h directly with the tunings the benchmark sweeps (1 and 4 streams, the
 * SM target, batched BF16 GEMMs, the autotune's timed algorithms with split-K candidates, FP8
 * fast accumulation, strided batches over runs of experts with the default run cost, with none
 * and as one run, BF16 grouped GEMMs, the GEMM kernel of our own alone (split-K its own
 * choice, off, 3 ranges) and up to 16 rows per expert before strided or 4 streams): every one
 * within the tolerance. Routing: uniform, one hot expert, or
 * rows per expert at the padding's, the runs' and the kernel's row tiles' edges (16, 17, 128,
 * 129, 1, 0, 33), and all 32 experts live with more rows than a row tile.
 * Before the cases, the GEMM kernel's own checks (gpu/ffn_gemm.h), each failure naming the
 * element: one mma.sync (BF16 m16n8k16, e4m3 m16n8k32) on the PTX ISA's fragment layouts against
 * a CPU dot product (small integers: exact), then the kernel itself on small integers with
 * power-of-two scales against CPU sums (0, 1, 7, 8, 9, 16, 17, 64, 65, 130 rows per expert, one
 * FP8 K block, K/128 of 3, the real shape's K 7168 and 2048 and N 7168), without split-K, with
 * 3, 4 and 5 K ranges (ranges of one stage, uneven ones, more asked than stages) and with the
 * kernel's own choice at the real shapes; the cases also run the kernel with split-K off and at
 * 3 ranges.
 * The Hopper kernel (gpu/ffn_gemm_wgmma.cu, tuning wgmma) the same way: first its layout (the
 * TMA's swizzle, one stage's wgmmas), then its own checks at each row tile (32 .. 256; FP8 up to
 * 128) on small integers with 0 .. 600 rows per expert
 * around every tile's edges, BF16 and FP8, fp32 and BF16 out, split-K off, fixed and auto, the
 * real shapes; then every case with the wgmma tunings (alone, split off and at 3, the smallest
 * and largest tiles forced, above the kernel's 16 rows as the default would run it, and with
 * SwiGLU fused into the gate/up GEMM; the kernel's own checks include the fused SwiGLU against
 * silu(g) u of the CPU's sums).
 * TEST_FFN_ONLY=wgmma runs only the wgmma kernel's checks and tunings (seconds: a wrong kernel
 * shows first); a wait of the kernel that timed out is named (CTA, thread, stage).
 * Every tuning's call is also held to the path gpu/ffn_path.h chooses for it (epd_ffn_cuda_
 * last_call), and the default's FP8 calls up to 64 rows per expert to the wgmma kernel where the
 * device runs it. The tunings "default" (the daemon's, written out and checked equal to
 * epd_ffn_cuda_default_tuning) and "default,no_wgmma" (as set where wgmma is refused: the
 * mma.sync kernel up to 32 rows for FP8) run as epd_ffn_cuda_create sets them, without the parts
 * their checks refused. TEST_FFN_ONLY=default runs only the cases through the ops and those two
 * (no kernel checks).
 * Prints one line per case and 'N passed, N failed'; exit 77 with 'SKIP: no GPU' without one. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "gpu/ops.h"
}
#include "common/rng.h"
#include "gpu/ffn.h"
#include "gpu/ffn_cuda.h"
#include "gpu/ffn_gemm.h"
#include "gpu/ffn_gemm_layout.h"
#include "gpu/ffn_gemm_wgmma_layout.h"
#include "gpu/ffn_path.h"
#include "gpu/fp8.h"
#include "tests/gpu/cuda_check.cuh"

static int passed, failed;
/* TEST_FFN_ONLY=wgmma: the wgmma kernel's checks and tunings only; TEST_FFN_ONLY=default: the
 * cases through the ops and the tunings named default* only (no kernel checks) */
static bool only_wgmma, only_default;

typedef struct ffn_case {
    epd_ffn_format_t format;
    epd_wire_dtype_t dtype;
    epd_scale_kind_t scale;
    uint32_t hidden, inter, experts, topk, world, rank, tokens;
    uint32_t hot; /* 0: uniform routing; 1: every token's slot 0 goes to one expert; 2: edge_rows */
    epd_combine_dtype_t combine;
} ffn_case_t;

/* the tunings every case runs (epd_ffn_cuda_set_tuning; main sets the default's row limit for
 * the device) */
static epd_ffn_cuda_tuning_t tunings[] = {
    {.streams = 1, .batched = false, .sm_target = false},
    {.streams = 4, .batched = false, .sm_target = false},
    {.streams = 4, .batched = false, .sm_target = true},
    {.streams = 1, .batched = true, .sm_target = false},
    {.streams = 1, .autotune = true},
    {.streams = 4, .autotune = true},
    {.streams = 4, .autotune = true, .fast_accum = true},
    {.streams = 4, .strided = true, .run_cost = EPD_FFN_RUN_COST},
    {.streams = 1, .strided = true, .run_cost = 0},
    {.streams = 1, .strided = true, .run_cost = UINT32_MAX},
    {.streams = 1, .grouped = true},
    {.streams = 1, .kernel = true},
    {.streams = 4, .strided = true, .run_cost = EPD_FFN_RUN_COST, .kernel = true,
     .kernel_max_rows = 16},
    {.streams = 4, .kernel = true, .kernel_max_rows = 16, .kernel_fp8_max_rows = 64,
     .kernel_prefetch = 2},
    {.streams = 1, .kernel = true, .kernel_split = 1},
    {.streams = 1, .kernel = true, .kernel_split = 3},
    {.streams = 1, .wgmma = true},
    {.streams = 1, .wgmma = true, .wgmma_split = 1},
    {.streams = 1, .wgmma = true, .wgmma_split = 3},
    {.streams = 1, .wgmma = true, .wgmma_row_tile = 32},
    {.streams = 1, .wgmma = true, .wgmma_row_tile = 256},
    {.streams = 4, .kernel = true, .kernel_max_rows = 16, .kernel_fp8_max_rows = 16,
     .wgmma = true},
    {.streams = 1, .wgmma = true, .wgmma_swiglu = true},
    {.streams = 1, .wgmma = true, .wgmma_swiglu = true, .wgmma_pdl = true},
    /* the GEMMs' D in BF16: every path that writes it */
    {.streams = 4, .d_bf16 = true},
    {.streams = 4, .strided = true, .run_cost = EPD_FFN_RUN_COST, .d_bf16 = true},
    {.streams = 1, .kernel = true, .d_bf16 = true},
    {.streams = 1, .wgmma = true, .d_bf16 = true},
    {.streams = 1, .wgmma = true, .wgmma_split = 3, .d_bf16 = true},
    {.streams = 1, .wgmma = true, .wgmma_swiglu = true, .wgmma_pdl = true, .d_bf16 = true},
    /* the Hopper kernel's CTAs in pairs (the activations by multicast): SwiGLU fused, a row
     * tile of one box, split-K */
    {.streams = 1, .wgmma = true, .wgmma_swiglu = true, .wgmma_pdl = true, .d_bf16 = true,
     .wgmma_pair = true},
    {.streams = 1, .wgmma = true, .wgmma_row_tile = 32, .wgmma_pair = true},
    {.streams = 1, .wgmma = true, .wgmma_split = 3, .wgmma_pair = true},
    /* the default (epd_ffn_default_tuning_fill, written out: main checks the two equal, the
     * wgmma row limits 128 (BF16) and 176 (FP8) on an H100 SXM), and as it is set where the
     * Hopper kernel's check refuses it */
    {.streams = 4, .strided = true, .run_cost = EPD_FFN_RUN_COST, .kernel = true,
     .kernel_max_rows = 16, .kernel_fp8_max_rows = 32, .wgmma = true,
     .wgmma_max_rows = 64, .wgmma_fp8_max_rows = 192, .wgmma_first = true, .wgmma_swiglu = true,
     .wgmma_pdl = true, .d_bf16 = true, .wgmma_pair = true},
    {.streams = 4, .strided = true, .run_cost = EPD_FFN_RUN_COST, .kernel = true,
     .kernel_max_rows = 16, .kernel_fp8_max_rows = 32, .d_bf16 = true},
};
static const char *const tuning_names[] = {"streams=1", "streams=4", "streams=4,sm_target",
                                           "batched", "streams=1,autotune", "streams=4,autotune",
                                           "streams=4,autotune,fast_accum", "strided",
                                           "strided,cost=0", "strided,one", "grouped",
                                           "kernel", "kernel,upto=16,strided",
                                           "kernel,upto=16,fp8_upto=64,streams=4,prefetch=2",
                                           "kernel,split=1", "kernel,split=3", "wgmma",
                                           "wgmma,split=1", "wgmma,split=3", "wgmma,tile=32",
                                           "wgmma,tile=256", "kernel,upto=16,wgmma",
                                           "wgmma,swiglu", "wgmma,swiglu,pdl", "streams=4,d_bf16",
                                           "strided,d_bf16", "kernel,d_bf16", "wgmma,d_bf16",
                                           "wgmma,split=3,d_bf16", "wgmma,swiglu,pdl,d_bf16",
                                           "wgmma,swiglu,pdl,d_bf16,pair", "wgmma,tile=32,pair",
                                           "wgmma,split=3,pair", "default",
                                           "default,no_wgmma"};
static_assert(sizeof tunings / sizeof tunings[0] == sizeof tuning_names / sizeof tuning_names[0],
              "a name per tuning");

/* hot 2: every token's slot 0 goes to the next local expert with rows left of these (the
 * padding's and the strided runs' edges: 16 and 17 rows, 128 and 129, one, none), the other
 * slots are empty; the case's tokens are their sum */
static const uint32_t edge_rows[] = {16, 17, 0, 128, 129, 1, 0, 33};

static int32_t edge_expert(uint32_t t)
{
    for (uint32_t e = 0; e < sizeof edge_rows / sizeof edge_rows[0]; e++) {
        if (t < edge_rows[e]) return (int32_t)e;
        t -= edge_rows[e];
    }
    return -1;
}

/* The worst relative L2 over n partials of got against ref, both read as combine reads them
 * (dequantized when FP8); a_f, b_f: H floats of scratch. NaN stays NaN (never within a tolerance). */
static double worst_rel(const epd_moe_shape_t *s, const uint8_t *got, const uint8_t *ref,
                        uint32_t n, float *a_f, float *b_f)
{
    epd_partial_layout_t pl;
    double worst = 0;
    uint32_t H = s->hidden;
    epd_partial_layout(s, &pl);
    for (uint32_t j = 0; j < n; j++) {
        double num = 0, den = 0;
        memset(a_f, 0, (size_t)H * sizeof(float));
        memset(b_f, 0, (size_t)H * sizeof(float));
        epd_partial_add_host(s, got + (size_t)j * pl.size, a_f);
        epd_partial_add_host(s, ref + (size_t)j * pl.size, b_f);
        for (uint32_t i = 0; i < H; i++) {
            double a = a_f[i], b = b_f[i];
            num += (a - b) * (a - b);
            den += b * b;
        }
        double rel = den > 0 ? sqrt(num / den) : sqrt(num);
        if (!(rel <= worst)) worst = rel;
    }
    return worst;
}

/* the larger of two errors, NaN the largest */
static double worse(double a, double b)
{
    return b > a || b != b ? b : a;
}

/* The path the last experts call took (epd_ffn_cuda_last_call) against gpu/ffn_path.h's choice
 * for the tuning as set and the call's rows per expert (rows, n_local of them; "none" without
 * rows); with the default tuning on a device that runs the wgmma kernel, also that a call
 * within the default's wgmma limit of its format (mean rows over the experts with rows) ran it,
 * so that a check that silently turned it off shows. Prints FAIL and returns false otherwise. */
static bool path_ok(const epd_ffn_cuda_t *ffn, const ffn_case_t *c, const char *name,
                    const uint32_t *rows, uint32_t n_local)
{
    epd_ffn_cuda_tuning_t cur;
    epd_ffn_cuda_call_info_t info;
    char why[EPD_ERR_LEN];
    bool fp8 = c->format == EPD_FFN_FP8_BLOCK;
    uint64_t sum = 0, used = 0;
    for (uint32_t e = 0; e < n_local; e++) {
        sum += rows[e];
        used += rows[e] > 0;
    }
    epd_ffn_cuda_get_tuning(ffn, &cur);
    epd_ffn_cuda_last_call(ffn, &info);
    const char *want =
        used == 0 ? "none"
                  : epd_ffn_path_name(epd_ffn_path_choose(&cur, fp8, cur.grouped, rows, n_local));
    if (strcmp(info.path, want) != 0) {
        printf("FAIL  tuning %s: the call ran path %s, the tuning as set chooses %s\n", name,
               info.path, want);
        return false;
    }
    epd_ffn_cuda_tuning_t d;
    epd_ffn_cuda_default_tuning(&d);
    const uint32_t limit = epd_ffn_path_limit(fp8, d.wgmma_max_rows, d.wgmma_fp8_max_rows);
    if (strcmp(name, "default") == 0 && used > 0 && limit != EPD_FFN_ROWS_NONE &&
        sum <= (uint64_t)limit * used && epd_ffn_wgmma_supported(fp8, why) == EPD_OK &&
        strcmp(info.path, "wgmma") != 0) {
        printf("FAIL  tuning default: %s at %.1f rows per expert ran %s, not wgmma (its check "
               "turned it off on a device that runs it)\n",
               fp8 ? "FP8" : "BF16", (double)sum / (double)used, info.path);
        return false;
    }
    if (used > 0 && info.gemm_calls == 0) {
        printf("FAIL  tuning %s: path %s queued no GEMM\n", name, info.path);
        return false;
    }
    return true;
}

static void run_case(const ffn_case_t *c, epd_ops_ctx_t *hctx_unused)
{
    char err[EPD_ERR_LEN];
    epd_moe_shape_t s;
    epd_record_layout_t rec;
    epd_partial_layout_t pl;
    epd_quant_error_t hqe, dqe;
    epd_ffn_weights_t *w = NULL;
    epd_ops_ctx_t *hctx = NULL, *dctx = NULL;
    uint32_t H = c->hidden, K = c->topk, N = c->tokens;
    uint64_t rng = 1234 + c->hidden + c->tokens * 7 + c->rank;
    /* section 9's tolerance; FP8 partials quantize the two sides' slightly different sums, and
     * a value near a rounding boundary lands one e4m3 step (1/16 relative) apart: 3e-2 more */
    double worst = 0, tol = (c->format == EPD_FFN_FP8_BLOCK ? 3e-2 : 1e-2) +
                            (c->combine == EPD_COMBINE_FP8 ? 3e-2 : 0.0);
    bool ok = true;

    memset(&s, 0, sizeof s);
    s.hidden = H;
    s.topk = K;
    s.num_experts = c->experts;
    s.world = c->world;
    s.rank = c->rank;
    s.dtype = c->dtype;
    s.scale = c->scale;
    s.expert_kind = EPD_EXPERTS_FFN;
    s.combine_dtype = c->combine;
    s.quant_error = c->combine == EPD_COMBINE_FP8;
    epd_record_layout(&s, &rec);
    epd_partial_layout(&s, &pl);
    uint32_t per_rank = c->experts / c->world;
    if (epd_ffn_random(c->format, H, c->inter, c->experts, c->rank * per_rank, per_rank, 2, 99, &w,
                       err) != EPD_OK ||
        epd_ops_host.init(-1, &hctx, err) != EPD_OK || epd_ops_cuda.init(0, &dctx, err) != EPD_OK ||
        epd_ops_host.experts_load(hctx, &s, w, err) != EPD_OK ||
        epd_ops_cuda.experts_load(dctx, &s, w, err) != EPD_OK) {
        printf("FAIL  setup: %s\n", err);
        failed++;
        goto out;
    }
    {
        uint16_t *x = (uint16_t *)malloc((size_t)N * H * 2);
        int32_t *ids = (int32_t *)malloc((size_t)N * K * 4);
        float *kw = (float *)malloc((size_t)N * K * 4);
        epd_step_layout_t lay;
        memset(&lay, 0, sizeof lay);
        lay.n_tokens = N;
        lay.send_counts_host = (uint32_t *)calloc(c->world, 4);
        lay.send_offsets_host = (uint32_t *)calloc(c->world, 4);
        lay.slot = (int32_t *)calloc((size_t)N * c->world, 4);
        lay.expert_counts_host = (uint32_t *)calloc(c->experts, 4);
        for (size_t i = 0; i < (size_t)N * H; i++)
            x[i] = epd_f32_to_bf16((2.0f * epd_rng_unit_f32(&rng) - 1.0f) *
                                   (1.0f + 3.0f * (float)(i / H % 5)));
        for (uint32_t t = 0; t < N; t++) {
            for (uint32_t k = 0; c->hot == 2 && k < K; k++) {
                ids[t * K + k] = k == 0 ? (int32_t)(c->rank * per_rank) + edge_expert(t) : -1;
                kw[t * K + k] = epd_rng_unit_f32(&rng);
            }
            for (uint32_t k = 0; c->hot != 2 && k < K; k++) {
                int32_t e;
                bool dup;
                do {
                    e = (int32_t)(epd_rng_next(&rng) % c->experts);
                    if (k == 0 && c->hot) e = (int32_t)(c->rank * per_rank);
                    dup = false;
                    for (uint32_t j = 0; j < k; j++) dup = dup || ids[t * K + j] == e;
                } while (dup);
                if (k > 0 && epd_rng_next(&rng) % 6 == 0) e = -1;
                ids[t * K + k] = e;
                kw[t * K + k] = epd_rng_unit_f32(&rng);
            }
        }
        size_t n_rec = (size_t)N * c->world;
        uint8_t *records = (uint8_t *)calloc(n_rec, rec.size);
        if (epd_ops_host.layout(hctx, &s, ids, &lay) != EPD_OK ||
            epd_ops_host.pack(hctx, &s, x, ids, kw, &lay, records) != EPD_OK) {
            printf("FAIL  host pack\n");
            failed++;
            ok = false;
        }
        /* the records this rank receives: its block of the packed ones */
        uint32_t n = lay.send_counts_host[c->rank];
        const uint8_t *mine = records + (size_t)lay.send_offsets_host[c->rank] * rec.size;
        uint8_t *ref = (uint8_t *)malloc((size_t)(n ? n : 1) * pl.size);
        uint8_t *got = (uint8_t *)malloc((size_t)(n ? n : 1) * pl.size);
        float *a_f = (float *)malloc((size_t)H * sizeof(float));
        float *b_f = (float *)malloc((size_t)H * sizeof(float));
        void *d_rec, *d_part;
        CUDA_OK(cudaMalloc(&d_rec, (size_t)(n ? n : 1) * rec.size));
        CUDA_OK(cudaMalloc(&d_part, (size_t)(n ? n : 1) * pl.size));
        CUDA_OK(cudaMemcpy(d_rec, mine, (size_t)n * rec.size, cudaMemcpyHostToDevice));
        /* the rows per expert as the count exchange brings them (the layout's counts) */
        const uint32_t *rows = lay.expert_counts_host + (size_t)c->rank * per_rank;
        if (ok && epd_ops_host.experts(hctx, &s, 1, mine, n, rows, ref) != EPD_OK) ok = false;
        if (ok && epd_ops_host.quant_error_take(hctx, &hqe) != EPD_OK) ok = false;
        /* once counting on the device, once with the exchanged counts: the same partials */
        for (int pass = 0; pass < 2; pass++) {
            if (ok && epd_ops_cuda.experts(dctx, &s, 1, d_rec, n, pass ? rows : NULL, d_part) !=
                          EPD_OK) {
                printf("FAIL  cuda experts: %s\n", epd_ops_cuda.last_error(dctx));
                ok = false;
            }
            if (ok && epd_ops_cuda.sync(dctx) != EPD_OK) ok = false;
            CUDA_OK(cudaMemcpy(got, d_part, (size_t)n * pl.size, cudaMemcpyDeviceToHost));
            if (ok) worst = worse(worst, worst_rel(&s, got, ref, n, a_f, b_f));
        }
        if (ok && !(worst <= tol)) ok = false;
        /* every tuning of gpu/ffn_cuda.h on its own stream, with the exchanged counts */
        {
            epd_ffn_cuda_t *ffn = NULL;
            if (ok && epd_ffn_cuda_create(w, NULL, &ffn, err) != EPD_OK) {
                printf("FAIL  epd_ffn_cuda_create: %s\n", err);
                ok = false;
            }
            for (size_t t = 0; ok && t < sizeof tunings / sizeof tunings[0]; t++) {
                double tw = 0;
                epd_status_t st;
                bool is_default = strncmp(tuning_names[t], "default", 7) == 0;
                if (only_wgmma && !tunings[t].wgmma) continue;
                if (only_default && !is_default) continue;
                CUDA_OK(cudaMemset(d_part, 0xff, (size_t)(n ? n : 1) * pl.size));
                CUDA_OK(cudaDeviceSynchronize()); /* the ffn's stream does not wait for it */
                st = epd_ffn_cuda_set_tuning(ffn, &tunings[t], err);
                /* the default runs as epd_ffn_cuda_create sets it: without what its checks
                 * refused (FP8: strided); the path check below sees what that left */
                if (st == EPD_ERR_UNSUPPORTED && is_default) {
                    printf("note  tuning %s set without a part: %s\n", tuning_names[t], err);
                    st = EPD_OK;
                }
                if (st == EPD_OK) st = epd_ffn_cuda_experts(ffn, &s, 1, d_rec, n, rows, d_part,
                                                            NULL, err);
                if (st == EPD_OK) st = epd_ffn_cuda_sync(ffn, err);
                if (st == EPD_OK && !path_ok(ffn, c, tuning_names[t], rows, per_rank)) {
                    ok = false;
                    break;
                }
                char why[EPD_ERR_LEN];
                if (st == EPD_ERR_UNSUPPORTED &&
                    (tunings[t].batched || tunings[t].fast_accum || tunings[t].grouped ||
                     (tunings[t].strided && c->format == EPD_FFN_FP8_BLOCK) ||
                     (tunings[t].kernel &&
                      epd_ffn_gemm_supported(c->format == EPD_FFN_FP8_BLOCK, why) != EPD_OK) ||
                     (tunings[t].wgmma &&
                      epd_ffn_wgmma_supported(c->format == EPD_FFN_FP8_BLOCK, why) != EPD_OK))) {
                    /* an optional tuning this cuBLAS lacks: said, and not the daemon's (BF16
                     * strided batches are plain cuBLASLt: never optional) */
                    printf("note  tuning %s not supported here: %s\n", tuning_names[t], err);
                    continue;
                }
                if (st != EPD_OK) {
                    printf("FAIL  tuning %s: %s\n", tuning_names[t], err);
                    ok = false;
                    break;
                }
                CUDA_OK(cudaMemcpy(got, d_part, (size_t)n * pl.size, cudaMemcpyDeviceToHost));
                tw = worst_rel(&s, got, ref, n, a_f, b_f);
                if (!(tw <= tol)) {
                    printf("FAIL  tuning %s: worst relative L2 %.2e (tolerance %.0e)\n",
                           tuning_names[t], tw, tol);
                    ok = false;
                }
                worst = worse(worst, tw);
            }
            epd_ffn_cuda_destroy(ffn);
        }
        /* the FP8 partials' telemetry: the device summed both passes, the host one */
        if (ok && epd_ops_cuda.quant_error_take(dctx, &dqe) != EPD_OK) ok = false;
        if (ok && c->combine == EPD_COMBINE_FP8 && n > 0 &&
            (!(hqe.combine_ref2 > 0) || !(dqe.combine_err2 > 0) ||
             fabs(dqe.combine_ref2 - 2 * hqe.combine_ref2) > 5e-2 * 2 * hqe.combine_ref2)) {
            printf("FAIL  FP8 partials' telemetry: device ref2 %.6g err2 %.6g, host ref2 %.6g "
                   "(x2 expected)\n", dqe.combine_ref2, dqe.combine_err2, hqe.combine_ref2);
            ok = false;
        }
        if (ok && c->combine != EPD_COMBINE_FP8 && (dqe.combine_ref2 != 0 || hqe.combine_ref2 != 0)) {
            printf("FAIL  BF16 partials fed the combine telemetry\n");
            ok = false;
        }
        /* a layer that was not loaded is refused */
        if (ok && epd_ops_cuda.experts(dctx, &s, 7, d_rec, n, NULL, d_part) == EPD_OK) {
            printf("FAIL  layer 7 was accepted\n");
            ok = false;
        }
        printf("%s  ffn %-9s weights, %s%s wire, %s partials, H %u I %u E %u K %u, rank %u of %u, "
               "%u records: worst relative L2 %.2e (tolerance %.0e)\n",
               ok ? "PASS" : "FAIL", epd_ffn_format_name(c->format),
               c->dtype == EPD_WIRE_FP8 ? "fp8" : "bf16",
               c->dtype != EPD_WIRE_FP8                ? ""
               : c->scale == EPD_SCALE_PER_TOKEN ? " per_token"
                                                 : " group128",
               c->combine == EPD_COMBINE_FP8 ? "fp8" : "bf16", H, c->inter, c->experts, K,
               c->rank, c->world, n, worst, tol);
        if (ok)
            passed++;
        else
            failed++;
        cudaFree(d_rec);
        cudaFree(d_part);
        free(ref);
        free(got);
        free(a_f);
        free(b_f);
        free(records);
        free(x);
        free(ids);
        free(kw);
        free(lay.send_counts_host);
        free(lay.send_offsets_host);
        free(lay.slot);
        free(lay.expert_counts_host);
    }
out:
    if (dctx != NULL) epd_ops_cuda.fini(dctx);
    if (hctx != NULL) epd_ops_host.fini(hctx);
    epd_ffn_free(w);
    (void)hctx_unused;
}

/* ---- the GEMM kernel's own checks (gpu/ffn_gemm.h) ---------------------------------------- */

/* a small integer in [-3, 3] from a hash of (i, seed): products and their sums stay exact */
static int small_int(uint64_t i, uint64_t seed)
{
    return (int)(epd_rng_hash(i * 0x9e3779b97f4a7c15ull + seed) % 7) - 3;
}

/* element i of an operand: BF16 or e4m3 bytes of the integer v */
static void put_elem(uint8_t *p, size_t i, bool fp8, int v)
{
    if (fp8) {
        p[i] = epd_e4m3_from_f32((float)v);
    } else {
        uint16_t h = epd_f32_to_bf16((float)v);
        memcpy(p + 2 * i, &h, 2);
    }
}

/* One mma.sync on the PTX ISA's fragment layouts against a CPU dot product: a [16][K], b [8][K]
 * (K 16 BF16 or 32 e4m3: 32 bytes a row), d = a b^T exactly. */
static void mma_check(bool fp8)
{
    const uint32_t K = fp8 ? 32 : 16;
    uint8_t a[16 * 32], b[8 * 32];
    int av[16][32], bv[8][32];
    float d[16 * 8];
    char err[EPD_ERR_LEN];
    int bad = 0;

    for (uint32_t m = 0; m < 16; m++)
        for (uint32_t k = 0; k < K; k++) put_elem(a, m * K + k, fp8, av[m][k] = small_int(m * K + k, 1));
    for (uint32_t n = 0; n < 8; n++)
        for (uint32_t k = 0; k < K; k++) put_elem(b, n * K + k, fp8, bv[n][k] = small_int(n * K + k, 2));
    epd_status_t st = epd_ffn_gemm_mma_check(fp8, a, b, d, err);
    if (st == EPD_ERR_UNSUPPORTED) {
        printf("note  mma layout check (%s) not run: %s\n", fp8 ? "e4m3 m16n8k32" : "bf16 m16n8k16",
               err);
        return;
    }
    if (st != EPD_OK) {
        printf("FAIL  mma layout check (%s): %s\n", fp8 ? "e4m3 m16n8k32" : "bf16 m16n8k16", err);
        failed++;
        return;
    }
    for (uint32_t m = 0; m < 16; m++) {
        for (uint32_t n = 0; n < 8; n++) {
            int want = 0;
            for (uint32_t k = 0; k < K; k++) want += av[m][k] * bv[n][k];
            if (d[m * 8 + n] != (float)want && bad++ < 6)
                printf("      mma %s D[m %u][n %u] = %g, want %d (lane %u register %u)\n",
                       fp8 ? "e4m3" : "bf16", m, n, d[m * 8 + n], want, (m % 8) * 4 + n / 2,
                       (m / 8) * 2 + n % 2);
        }
    }
    printf("%s  mma layout check (%s m16n8k%u on the PTX ISA's fragments): %d of 128 wrong\n",
           bad ? "FAIL" : "PASS", fp8 ? "e4m3" : "bf16", K, bad);
    if (bad)
        failed++;
    else
        passed++;
}

/* The wgmma kernel's layout on the GPU, in two halves that fail apart: the TMA's 128-byte
 * swizzle against epd_wgmma_tile_off (the shared tiles dumped as they lie), then one stage's
 * wgmmas through the kernel's descriptors against a CPU dot product (small integers: exact):
 * a [64][K], b [32][K] (K 64 BF16 or 128 e4m3: 128 bytes a row), d = a b^T. */
static void wgmma_layout_check(bool fp8)
{
    const uint32_t K = fp8 ? 128 : 64;
    const char *name = fp8 ? "e4m3 m64n32k32" : "bf16 m64n32k16";
    static uint8_t a[64 * 128], b[32 * 128], da[64 * 128], db[32 * 128];
    static int av[64][128], bv[32][128];
    static float d[64 * 32];
    char err[EPD_ERR_LEN];
    int bad_a = 0, bad_b = 0, plain = 1, bad = 0;

    for (uint32_t m = 0; m < 64; m++)
        for (uint32_t k = 0; k < K; k++) put_elem(a, m * K + k, fp8, av[m][k] = small_int(m * K + k, 11));
    for (uint32_t n = 0; n < 32; n++)
        for (uint32_t k = 0; k < K; k++) put_elem(b, n * K + k, fp8, bv[n][k] = small_int(n * K + k, 12));
    epd_status_t st = epd_ffn_wgmma_layout_check(fp8, a, b, da, db, d, err);
    if (st == EPD_ERR_UNSUPPORTED) {
        printf("note  wgmma layout check (%s) not run: %s\n", name, err);
        return;
    }
    if (st != EPD_OK) {
        printf("FAIL  wgmma layout check (%s): %s\n", name, err);
        failed++;
        return;
    }
    char hang[EPD_ERR_LEN];
    if (epd_ffn_wgmma_hang(hang, sizeof hang)) printf("      wgmma layout check (%s): %s\n", name, hang);
    /* the TMA's placement: each 16-byte chunk where the model puts it */
    for (uint32_t r = 0; r < 64; r++)
        for (uint32_t c = 0; c < 8; c++) {
            if (memcmp(da + r * 128 + c * 16, a + r * 128 + c * 16, 16) != 0) plain = 0;
            if (memcmp(da + epd_wgmma_tile_off(r, c * 16), a + r * 128 + c * 16, 16) != 0 &&
                bad_a++ < 4)
                printf("      TMA %s: a's row %u chunk %u is not at the model's chunk %u\n",
                       fp8 ? "e4m3" : "bf16", r, c, c ^ (r % 8));
        }
    for (uint32_t r = 0; r < 32; r++)
        for (uint32_t c = 0; c < 8; c++)
            if (memcmp(db + epd_wgmma_tile_off(r, c * 16), b + r * 128 + c * 16, 16) != 0 &&
                bad_b++ < 4)
                printf("      TMA %s: b's row %u chunk %u is not at the model's chunk %u\n",
                       fp8 ? "e4m3" : "bf16", r, c, c ^ (r % 8));
    if (bad_a && plain) printf("      TMA: the tiles lie unswizzled (the swizzle mode not applied)\n");
    printf("%s  wgmma layout check (%s): TMA 128B swizzle against the model: %d of 512 a chunks, "
           "%d of 256 b chunks misplaced\n",
           bad_a || bad_b ? "FAIL" : "PASS", name, bad_a, bad_b);
    if (bad_a || bad_b)
        failed++;
    else
        passed++;
    for (uint32_t m = 0; m < 64; m++)
        for (uint32_t n = 0; n < 32; n++) {
            int want = 0;
            for (uint32_t k = 0; k < K; k++) want += av[m][k] * bv[n][k];
            if (d[m * 32 + n] != (float)want && bad++ < 8)
                printf("      wgmma %s D[m %u][n %u] = %g, want %d (warp %u lane %u register %u)\n",
                       name, m, n, d[m * 32 + n], want, m / 16, (m % 8) * 4 + (n % 8) / 2,
                       (n / 8) * 4 + (m % 16 / 8) * 2 + n % 2);
        }
    printf("%s  wgmma layout check (%s, 4 k steps through the kernel's descriptors): %d of 2048 "
           "wrong\n",
           bad ? "FAIL" : "PASS", name, bad);
    if (bad)
        failed++;
    else
        passed++;
}

/* gemm_check_x's wgmma launches with their CTAs in pairs (ffn_gemm.h's pair) */
static bool check_pair;

/* The GEMM kernel on n_exp experts with counts[e] rows (rows padded to 16, zeros after the
 * count), N n, K k: weights and activations small integers, FP8 scales powers of two, so the
 * CPU's sums are exact and the kernel's within rounding of fp32 sums; every (expert, row,
 * feature) below the counts compared, the first few wrong ones named; with check_pair the
 * launch is asked in pairs and must go so where N / 128 is even. */

static void gemm_check_x(bool fp8, bool out_bf16, uint32_t n, uint32_t k, const uint32_t *counts,
                         uint32_t n_exp, uint32_t split, uint32_t wg_tile, bool swiglu)
{
    /* swiglu (wgmma, BF16): SwiGLU fused, h [rows][n / 2] = bf16(silu(D[.][f]) * D[.][n/2 + f])
     * checked instead of D */
    uint16_t *hh = NULL;
    void *dhh = NULL;
    bool fused = false;
    /* wg_tile: the wgmma kernel in row tiles of that many rows; 0: the mma.sync kernel */
    const uint32_t row_tile = wg_tile ? wg_tile : EPD_FFN_GEMM_ROW_TILE;
    const size_t es = fp8 ? 1 : 2, kb = k / 128, ld = (kb + 3) / 4 * 4;
    uint32_t *row_base = (uint32_t *)calloc(n_exp + 1, 4), *tile_base = (uint32_t *)calloc(n_exp + 1, 4);
    char err[EPD_ERR_LEN];
    uint64_t bad = 0, checked = 0;
    for (uint32_t e = 0; e < n_exp; e++) {
        row_base[e + 1] = row_base[e] + (counts[e] + 15) / 16 * 16;
        tile_base[e + 1] = tile_base[e] + (counts[e] + row_tile - 1) / row_tile;
    }
    const uint32_t total = row_base[n_exp];
    uint8_t *w = (uint8_t *)malloc((size_t)n_exp * n * k * es);
    uint8_t *x = (uint8_t *)calloc((size_t)(total ? total : 1) * k, es);
    float *ws = (float *)calloc((size_t)n_exp * (n / 128) * ld, sizeof(float));
    float *xs = (float *)calloc((size_t)(total ? total : 1) * kb, sizeof(float));
    float *d = (float *)malloc((size_t)(total ? total : 1) * n * sizeof(float));
    int8_t *wv = (int8_t *)malloc((size_t)n_exp * n * k), *xv = (int8_t *)calloc((size_t)(total ? total : 1) * k, 1);
    for (size_t i = 0; i < (size_t)n_exp * n * k; i++) put_elem(w, i, fp8, wv[i] = (int8_t)small_int(i, 3 + n + k));
    for (uint32_t e = 0; e < n_exp; e++)
        for (uint32_t r = 0; r < counts[e]; r++)
            for (uint32_t c = 0; c < k; c++) {
                size_t i = (size_t)(row_base[e] + r) * k + c;
                put_elem(x, i, fp8, xv[i] = (int8_t)small_int(i, 4 + n + k));
            }
    /* scales 2^-2 .. 2^2: weights [e][n / 128][ld] (padding 0), activations [k / 128][mpad] */
    for (uint32_t e = 0; e < n_exp; e++)
        for (uint32_t nb = 0; nb < n / 128; nb++)
            for (uint32_t b = 0; b < kb; b++)
                ws[((size_t)e * (n / 128) + nb) * ld + b] = ldexpf(1.0f, small_int(e * 997 + nb * 31 + b, 5) % 3);
    for (uint32_t e = 0; e < n_exp; e++) {
        uint32_t mpad = row_base[e + 1] - row_base[e];
        for (uint32_t b = 0; b < kb; b++)
            for (uint32_t m = 0; m < mpad; m++)
                xs[(size_t)row_base[e] * kb + b * mpad + m] = ldexpf(1.0f, small_int(e * 7919 + b * 131 + m, 6) % 3);
    }
    void *dw, *dx, *dd, *dsplit = NULL;
    float *dws, *dxs;
    uint32_t split_used = 0;
    /* split-K's workspace: room for the most K ranges (NaN: a range not written shows) */
    const size_t split_bytes = (size_t)EPD_FFN_GEMM_MAX_SPLIT * (total ? total : 1) * n * 4;
    uint32_t *drb, *dcnt, *dtb;
    CUDA_OK(cudaMalloc(&dw, (size_t)n_exp * n * k * es));
    CUDA_OK(cudaMalloc(&dx, (size_t)(total ? total : 1) * k * es));
    CUDA_OK(cudaMalloc(&dd, (size_t)(total ? total : 1) * n * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&dws, (size_t)n_exp * (n / 128) * ld * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&dxs, (size_t)(total ? total : 1) * kb * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&drb, (n_exp + 1) * 4));
    CUDA_OK(cudaMalloc((void **)&dcnt, n_exp * 4));
    CUDA_OK(cudaMalloc((void **)&dtb, (n_exp + 1) * 4));
    if (split != 1) {
        CUDA_OK(cudaMalloc(&dsplit, split_bytes));
        CUDA_OK(cudaMemset(dsplit, 0xff, split_bytes));
    }
    CUDA_OK(cudaMemcpy(dw, w, (size_t)n_exp * n * k * es, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dx, x, (size_t)(total ? total : 1) * k * es, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dws, ws, (size_t)n_exp * (n / 128) * ld * sizeof(float), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dxs, xs, (size_t)(total ? total : 1) * kb * sizeof(float), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(drb, row_base, (n_exp + 1) * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dcnt, counts, n_exp * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dtb, tile_base, (n_exp + 1) * 4, cudaMemcpyHostToDevice));
    /* NaN everywhere first: a row the kernel should write and does not shows */
    CUDA_OK(cudaMemset(dd, 0xff, (size_t)(total ? total : 1) * n * sizeof(float)));
    if (swiglu) {
        CUDA_OK(cudaMalloc(&dhh, (size_t)(total ? total : 1) * (n / 2) * 2));
        CUDA_OK(cudaMemset(dhh, 0xff, (size_t)(total ? total : 1) * (n / 2) * 2));
    }

    epd_ffn_gemm_args_t a;
    memset(&a, 0, sizeof a);
    a.fp8 = fp8;
    a.out_bf16 = out_bf16;
    a.n = n;
    a.k = k;
    a.n_experts = n_exp;
    a.w = dw;
    a.w_scale = fp8 ? dws : NULL;
    a.w_scale_ld = fp8 ? (uint32_t)ld : 0;
    a.x = dx;
    a.x_scale = fp8 ? dxs : NULL;
    a.row_base = drb;
    a.counts = dcnt;
    a.tile_base = dtb;
    a.n_tiles = tile_base[n_exp];
    a.d = dd;
    a.prefetch = EPD_FFN_GEMM_PREFETCH;
    a.split_k = split;
    a.total_rows = total;
    a.split_ws = dsplit;
    a.split_ws_bytes = dsplit != NULL ? split_bytes : 0;
    a.split_used_p = &split_used;
    a.row_tile = wg_tile;
    bool pair_used = false;
    a.pair = wg_tile != 0 && check_pair;
    a.pair_used_p = &pair_used;
    if (swiglu) {
        a.swiglu_h = dhh;
        a.swiglu_done_p = &fused;
    }
    char what[200], tile_what[40] = "";
    if (wg_tile) snprintf(tile_what, sizeof tile_what, " of %u rows", wg_tile);
    snprintf(what, sizeof what, "%s%s %s%s, N %u, K %u, %u experts, %u row tiles%s, split %s",
             wg_tile ? (swiglu ? "wgmma GEMM kernel with SwiGLU fused" : "wgmma GEMM kernel")
                     : "GEMM kernel",
             a.pair ? " (CTAs in pairs)" : "",
             fp8 ? "fp8-block" : "bf16",
             out_bf16 ? " (bf16 out)" : "", n, k, n_exp, a.n_tiles, tile_what,
             split == EPD_FFN_GEMM_SPLIT_AUTO ? "auto" : split == 1 ? "none" : "fixed");
    epd_status_t st = wg_tile ? epd_ffn_wgmma_supported(fp8, err) : epd_ffn_gemm_supported(fp8, err);
    if (st == EPD_ERR_UNSUPPORTED) {
        printf("note  %s not run: %s\n", what, err);
        goto out;
    }
    st = wg_tile ? epd_ffn_wgmma_launch(&a, NULL, err) : epd_ffn_gemm_launch(&a, NULL, err);
    if (st == EPD_OK && cudaDeviceSynchronize() != cudaSuccess) {
        snprintf(err, EPD_ERR_LEN, "%s", cudaGetErrorString(cudaGetLastError()));
        st = EPD_ERR_CUDA;
    }
    if (wg_tile && st == EPD_OK) {
        char hang[EPD_ERR_LEN];
        if (epd_ffn_wgmma_hang(hang, sizeof hang)) printf("      %s: %s\n", what, hang);
    }
    if (st != EPD_OK) {
        printf("FAIL  %s: %s\n", what, err);
        failed++;
        goto out;
    }
    CUDA_OK(cudaMemcpy(d, dd, (size_t)(total ? total : 1) * n * sizeof(float), cudaMemcpyDeviceToHost));
    if (swiglu && !fused) {
        printf("FAIL  %s: the launch did not fuse SwiGLU\n", what);
        failed++;
        goto out;
    }
    if (swiglu) {
        hh = (uint16_t *)malloc((size_t)(total ? total : 1) * (n / 2) * 2);
        CUDA_OK(cudaMemcpy(hh, dhh, (size_t)(total ? total : 1) * (n / 2) * 2, cudaMemcpyDeviceToHost));
    }
    for (uint32_t e = 0; swiglu && e < n_exp; e++)
        for (uint32_t r = 0; r < counts[e]; r++) {
            size_t row = row_base[e] + r;
            for (uint32_t f = 0; f < n / 2; f++) {
                double g = 0, u = 0;
                const int8_t *wg = wv + ((size_t)e * n + f) * k, *wu = wg + (size_t)(n / 2) * k;
                const int8_t *xr = xv + row * k;
                for (uint32_t c = 0; c < k; c++) {
                    g += (double)wg[c] * xr[c];
                    u += (double)wu[c] * xr[c];
                }
                double want = g / (1.0 + exp(-g)) * u;
                double got = epd_bf16_to_f32(hh[row * (n / 2) + f]);
                checked++;
                if (!(fabs(got - want) <= fabs(want) / 128 + 1e-3) && bad++ < 6)
                    printf("      %s: expert %u row %u h feature %u = %.6g, want %.6g (gate %g, "
                           "up %g; row tile %u)\n",
                           what, e, r, f, got, want, g, u, r / wg_tile);
            }
        }
    for (uint32_t e = 0; !swiglu && e < n_exp; e++) {
        uint32_t mpad = row_base[e + 1] - row_base[e];
        for (uint32_t r = 0; r < counts[e]; r++) {
            size_t row = row_base[e] + r;
            for (uint32_t f = 0; f < n; f++) {
                double want = 0, mag = 0;
                const int8_t *wr = wv + ((size_t)e * n + f) * k, *xr = xv + row * k;
                for (uint32_t b = 0; b < kb; b++) {
                    double sum = 0, s = 1;
                    for (uint32_t c = b * 128; c < (b + 1) * 128; c++) sum += (double)wr[c] * xr[c];
                    if (fp8)
                        s = (double)ws[((size_t)e * (n / 128) + f / 128) * ld + b] *
                            xs[(size_t)row_base[e] * kb + b * mpad + r];
                    want += sum * s;
                    mag += 128 * 9 * s;
                }
                double got = out_bf16 ? epd_bf16_to_f32(((const uint16_t *)d)[row * n + f])
                                      : d[row * n + f];
                /* fp32 sums (and BF16 out: its rounding) */
                double tol = 1e-6 * mag + (out_bf16 ? fabs(want) / 128 : 0);
                checked++;
                if (!(fabs(got - want) <= tol) && bad++ < 6) {
                    if (wg_tile)
                        /* the wgmma fragment: consumer warpgroup f % 128 / 64, its warp
                         * f % 64 / 16, lane (f % 8) * 4 + (r % 8) / 2, register
                         * (r % tile / 8) * 4 + (f % 16 / 8) * 2 + r % 2 */
                        printf("      %s: expert %u row %u feature %u = %.6g, want %.6g (row tile "
                               "%u, consumer %u, warp %u, lane %u, register %u)\n",
                               what, e, r, f, got, want, r / wg_tile, f % 128 / 64, f % 64 / 16,
                               (f % 8) * 4 + (r % 8) / 2, (r % wg_tile / 8) * 4 + (f % 16 / 8) * 2 + r % 2);
                    else
                        printf("      %s: expert %u row %u feature %u = %.6g, want %.6g (row tile "
                               "%u, n8 tile %u, warp %u, m16 tile %u)\n",
                               what, e, r, f, got, want, r / EPD_FFN_GEMM_ROW_TILE,
                               r % EPD_FFN_GEMM_ROW_TILE / 8, f % 128 / 32, f % 32 / 16);
                }
            }
        }
    }
    printf("%s  %s (%u K ranges used): %llu of %llu outputs wrong\n", bad ? "FAIL" : "PASS",
           what, split_used, (unsigned long long)bad, (unsigned long long)checked);
    /* in pairs where the feature blocks pair up (a cluster of two fits on any Hopper GPU) */
    if (st == EPD_OK && a.pair && pair_used != ((n / 128) % 2 == 0)) {
        printf("FAIL  %s: the launch went %s\n", what, pair_used ? "in pairs" : "alone");
        bad++;
    }
    /* a fixed split is used as asked (within K's stages) */
    if (split > 1 && split_used != (split < k * (fp8 ? 1 : 2) / 128 ? split : k * (fp8 ? 1 : 2) / 128)) {
        printf("FAIL  %s: %u K ranges used, want %u\n", what, split_used, split);
        bad++;
    }
    if (bad)
        failed++;
    else
        passed++;
out:
    cudaFree(dw);
    cudaFree(dx);
    cudaFree(dd);
    cudaFree(dws);
    cudaFree(dxs);
    cudaFree(drb);
    cudaFree(dcnt);
    cudaFree(dtb);
    cudaFree(dsplit);
    free(row_base);
    free(tile_base);
    free(w);
    free(x);
    free(ws);
    free(xs);
    free(d);
    free(wv);
    free(xv);
    free(hh);
    cudaFree(dhh);
}

static void gemm_check(bool fp8, bool out_bf16, uint32_t n, uint32_t k, const uint32_t *counts,
                       uint32_t n_exp, uint32_t split, uint32_t wg_tile)
{
    gemm_check_x(fp8, out_bf16, n, k, counts, n_exp, split, wg_tile, false);
}

static void gemm_checks(void)
{
    /* rows at the n8 tiles', the padding's and the row tiles' edges, an expert without rows */
    static const uint32_t edges[] = {0, 1, 7, 8, 9, 16, 17, 64, 65, 130};
    static const uint32_t one[] = {5, 200};
    static const uint32_t real[] = {1, 70, 0, 9};
    static const uint32_t real_down[] = {3};
    static const uint32_t wide[] = {33, 31, 40};
    /* the wgmma kernel's row tiles' edges (32 .. 256) up to 600 rows */
    static const uint32_t wg_edges[] = {0,   1,   7,   8,   9,   31,  32,  33,  63,  64,  65, 127,
                                        128, 129, 200, 255, 256, 257, 300, 511, 512, 513, 600};
    static const uint32_t wg_real[] = {1, 70, 0, 9, 300};
    const uint32_t n_edges = sizeof edges / sizeof edges[0];
    const uint32_t n_wg = sizeof wg_edges / sizeof wg_edges[0];
    const uint32_t AUTO = EPD_FFN_GEMM_SPLIT_AUTO;
    for (int fp8 = 0; fp8 < 2; fp8++) wgmma_layout_check(fp8);
    for (int fp8 = 0; fp8 < 2; fp8++) {
        /* the wgmma kernel first: at each row tile (FP8 up to 192) */
        for (uint32_t i = 0; i < epd_wgmma_tile_count(fp8); i++) {
            const uint32_t t = epd_wgmma_tile_at(i);
            gemm_check(fp8, false, 256, 384, wg_edges, n_wg, 1, t); /* K/128 3 */
            gemm_check(fp8, true, 128, 512, wg_edges, n_wg, 1, t);  /* BF16 out */
            gemm_check(fp8, false, 128, 128, one, 2, 1, t);         /* one K block */
            gemm_check(fp8, false, 256, 384, wg_edges, n_wg, 3, t); /* split-K, ranges of 1 */
            gemm_check(fp8, true, 128, 1024, wide, 3, 5, t);       /* uneven ranges, the reduce */
            if (t % 64 == 0) gemm_check(fp8, false, 256, 7168, wg_real, 5, AUTO, t); /* gate/up's K */
            /* SwiGLU fused (BF16): gate features [0, 128), up [128, 256) */
            if (!fp8) gemm_check_x(false, false, 256, 384, wg_edges, n_wg, 1, t, true);
        }
        /* and in pairs: N 256 (two feature blocks: a pair), 128 (one: alone) */
        check_pair = true;
        for (uint32_t i = 0; i < epd_wgmma_tile_count(fp8); i++) {
            const uint32_t t = epd_wgmma_tile_at(i);
            gemm_check(fp8, false, 256, 384, wg_edges, n_wg, 1, t);
            gemm_check(fp8, true, 128, 512, wg_edges, n_wg, 1, t);
            gemm_check(fp8, false, 256, 384, wg_edges, n_wg, 3, t);
            if (t % 64 == 0) gemm_check(fp8, false, 256, 7168, wg_real, 5, AUTO, t);
            if (!fp8) gemm_check_x(false, false, 256, 384, wg_edges, n_wg, 1, t, true);
        }
        if (!fp8) gemm_check_x(false, false, 512, 384, wg_edges, n_wg, 1, 64, true);
        gemm_check(fp8, true, 7168, 2048, real_down, 1, AUTO, 64);
        check_pair = false;
        if (!fp8) gemm_check_x(false, false, 256, 7168, wg_real, 5, 1, 96, true);
        if (!fp8) gemm_check_x(false, false, 512, 384, wg_edges, n_wg, 1, 64, true); /* 4 blocks */
        gemm_check(fp8, false, 7168, 2048, real_down, 1, 1, 32); /* down's N and K */
        gemm_check(fp8, true, 7168, 2048, real_down, 1, AUTO, 64);
        if (only_wgmma) continue;
        mma_check(fp8);
        gemm_check(fp8, false, 256, 384, edges, n_edges, 1, 0); /* K/128 3: FP8 scale rows padded */
        gemm_check(fp8, false, 128, 128, one, 2, 1, 0);         /* one FP8 K block, fewer than STAGES */
        gemm_check(fp8, true, 256, 512, edges, n_edges, 1, 0);  /* BF16 out */
        gemm_check(fp8, false, 256, 7168, real, 4, 1, 0);       /* gate/up's K */
        gemm_check(fp8, false, 7168, 2048, real_down, 1, 1, 0); /* down's N and K */
        /* split-K: K ranges of one stage (FP8 K/128 3 in 3), uneven ranges, BF16 out through the
         * reduce, more ranges than stages (clamped), and the auto split on the real shapes */
        gemm_check(fp8, false, 256, 384, edges, n_edges, 3, 0);
        gemm_check(fp8, true, 256, 512, edges, n_edges, 3, 0);
        gemm_check(fp8, false, 128, 128, one, 2, 4, 0);
        gemm_check(fp8, false, 384, 1024, wide, 3, 5, 0);
        gemm_check(fp8, false, 256, 7168, real, 4, AUTO, 0);
        gemm_check(fp8, true, 7168, 2048, real_down, 1, AUTO, 0);
    }
}

int main(void)
{
    int n_dev = 0;

    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        printf("SKIP: no GPU\n");
        return 77;
    }
    const char *only = getenv("TEST_FFN_ONLY");
    only_wgmma = only != NULL && strcmp(only, "wgmma") == 0;
    only_default = only != NULL && strcmp(only, "default") == 0;
    {
        /* the written-out default is the daemon's */
        epd_ffn_cuda_tuning_t d;
        const epd_ffn_cuda_tuning_t *w = NULL;
        epd_ffn_cuda_default_tuning(&d);
        cudaDeviceProp prop;
        CUDA_OK(cudaGetDeviceProperties(&prop, 0));
        for (size_t t = 0; t < sizeof tunings / sizeof tunings[0]; t++) {
            if (strcmp(tuning_names[t], "default") != 0) continue;
            if (strcmp(prop.name, "NVIDIA H100 80GB HBM3") == 0) {
                tunings[t].wgmma_max_rows = 128;
                tunings[t].wgmma_fp8_max_rows = 176;
            }
            w = &tunings[t];
        }
        printf("      the default on %s: wgmma up to %u rows per expert (BF16), %u (FP8)\n",
               prop.name, w != NULL ? w->wgmma_max_rows : 0, w != NULL ? w->wgmma_fp8_max_rows : 0);
        if (w == NULL || w->streams != d.streams || w->strided != d.strided ||
            w->run_cost != d.run_cost || w->kernel != d.kernel ||
            w->kernel_max_rows != d.kernel_max_rows ||
            w->kernel_fp8_max_rows != d.kernel_fp8_max_rows || w->wgmma != d.wgmma ||
            w->wgmma_max_rows != d.wgmma_max_rows ||
            w->wgmma_fp8_max_rows != d.wgmma_fp8_max_rows || w->wgmma_first != d.wgmma_first ||
            w->batched != d.batched || w->grouped != d.grouped || w->autotune != d.autotune ||
            w->sm_target != d.sm_target || w->fast_accum != d.fast_accum ||
            w->kernel_prefetch != d.kernel_prefetch || w->kernel_split != d.kernel_split ||
            w->wgmma_split != d.wgmma_split || w->wgmma_swiglu != d.wgmma_swiglu ||
            w->wgmma_row_tile != d.wgmma_row_tile || w->wgmma_pdl != d.wgmma_pdl ||
            w->wgmma_pair != d.wgmma_pair) {
            printf("FAIL  the test's tuning \"default\" is not epd_ffn_cuda_default_tuning's\n");
            failed++;
        } else {
            printf("PASS  the test's tuning \"default\" is epd_ffn_cuda_default_tuning's\n");
            passed++;
        }
    }
    static const ffn_case_t cases[] = {
        {EPD_FFN_BF16, EPD_WIRE_BF16, EPD_SCALE_GROUP128, 256, 128, 16, 8, 1, 0, 40, 0},
        {EPD_FFN_BF16, EPD_WIRE_FP8, EPD_SCALE_GROUP128, 1024, 512, 16, 8, 2, 1, 300, 1},
        {EPD_FFN_BF16, EPD_WIRE_FP8, EPD_SCALE_PER_TOKEN, 512, 256, 8, 4, 2, 0, 77, 0},
        {EPD_FFN_FP8_BLOCK, EPD_WIRE_FP8, EPD_SCALE_GROUP128, 256, 128, 16, 8, 1, 0, 40, 0},
        {EPD_FFN_FP8_BLOCK, EPD_WIRE_BF16, EPD_SCALE_GROUP128, 1024, 512, 16, 8, 2, 1, 300, 1},
        {EPD_FFN_FP8_BLOCK, EPD_WIRE_FP8, EPD_SCALE_PER_TOKEN, 512, 256, 8, 4, 2, 0, 77, 0},
        {EPD_FFN_FP8_BLOCK, EPD_WIRE_FP8, EPD_SCALE_GROUP128, 7168, 2048, 8, 8, 1, 0, 6, 0},
        {EPD_FFN_BF16, EPD_WIRE_FP8, EPD_SCALE_GROUP128, 7168, 2048, 8, 8, 1, 0, 6, 0},
        /* FP8 partials (combine.dtype fp8) */
        {EPD_FFN_BF16, EPD_WIRE_FP8, EPD_SCALE_GROUP128, 1024, 512, 16, 8, 2, 1, 300, 1,
         EPD_COMBINE_FP8},
        {EPD_FFN_FP8_BLOCK, EPD_WIRE_BF16, EPD_SCALE_GROUP128, 256, 128, 16, 8, 1, 0, 40, 0,
         EPD_COMBINE_FP8},
        {EPD_FFN_FP8_BLOCK, EPD_WIRE_FP8, EPD_SCALE_PER_TOKEN, 512, 256, 8, 4, 2, 0, 77, 0,
         EPD_COMBINE_FP8},
        /* K/128 of 2 and 3 with FP8 block weights and group128 wire (the scale padding, apart
         * from per_token), per_token where every K/128 is a multiple of 4, BF16 at K/128 3 */
        {EPD_FFN_FP8_BLOCK, EPD_WIRE_FP8, EPD_SCALE_GROUP128, 512, 256, 8, 4, 2, 0, 77, 0},
        {EPD_FFN_FP8_BLOCK, EPD_WIRE_FP8, EPD_SCALE_GROUP128, 384, 384, 8, 8, 1, 0, 50, 0},
        {EPD_FFN_FP8_BLOCK, EPD_WIRE_FP8, EPD_SCALE_PER_TOKEN, 1024, 512, 16, 8, 2, 0, 120, 0},
        {EPD_FFN_BF16, EPD_WIRE_BF16, EPD_SCALE_GROUP128, 384, 384, 8, 8, 1, 0, 50, 1},
        /* 3 tokens over 32 experts: most experts without rows, one row for the others */
        {EPD_FFN_FP8_BLOCK, EPD_WIRE_FP8, EPD_SCALE_GROUP128, 1024, 512, 32, 8, 1, 0, 3, 0},
        {EPD_FFN_BF16, EPD_WIRE_FP8, EPD_SCALE_GROUP128, 1024, 512, 32, 8, 1, 0, 3, 0},
        /* rows per expert at the padding's and the strided runs' edges (edge_rows), K/128 of 3
         * (and 2 for FP8's down projection) */
        {EPD_FFN_BF16, EPD_WIRE_BF16, EPD_SCALE_GROUP128, 384, 384, 8, 8, 1, 0, 324, 2},
        {EPD_FFN_FP8_BLOCK, EPD_WIRE_FP8, EPD_SCALE_GROUP128, 384, 256, 8, 8, 1, 0, 324, 2},
        /* the same edges on rank 1 of 2, FP8 at K/128 of 4 and more (the real shape's) */
        {EPD_FFN_FP8_BLOCK, EPD_WIRE_FP8, EPD_SCALE_GROUP128, 1024, 512, 16, 8, 2, 1, 324, 2},
        /* all 32 experts live, most with more rows than the kernel's row tile (75 on average) */
        {EPD_FFN_BF16, EPD_WIRE_FP8, EPD_SCALE_GROUP128, 1024, 512, 32, 8, 1, 0, 300, 0},
        {EPD_FFN_FP8_BLOCK, EPD_WIRE_FP8, EPD_SCALE_GROUP128, 1024, 512, 32, 8, 1, 0, 300, 0},
    };
    if (!only_default) gemm_checks();
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i], NULL);
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
