/* `epd --bench --set experts.kind=ffn`: the ffn experts op alone on one rank, at the configured
 * shape (model.hidden, model.intermediate or 2048, model.num_experts local experts, top-k), with
 * synthetic weights (--bench-weights random: BF16 and FP8 block in the same run) or
 * experts.weights. Same run, once per format: a device read of one layer's weight bytes (the
 * decode bound). For each --bench-tokens count: uniform routing, records packed by the ops, the
 * rows per expert passed as the count exchange gives them, the experts op timed (median of
 * --bench-iters, each synchronized) under every tuning of gpu/ffn_cuda.h the sweep lists (the
 * daemon's default first), beside a dense cuBLASLt BF16 GEMM of the same FLOPs; once per format
 * the accuracy of the device partials against the host reference (fp32, fp64 sums). The
 * partials are combine.dtype's (BF16, or FP8 group128), compared after dequantization. Each row
 * also says how many experts had rows (an expert without rows reads no weights), the host's
 * time until the call returned, and the time over the read of the used experts' weights. Besides
 * the table, one `ffn-result key=value ...` line per measurement and, after each tuning, one
 * `ffn-plan ...` line per GEMM plan it made (the algorithm, and the autotune's times) for
 * scripts (tests/gpu/ffn_gpu.sh). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/rng.h"
#include "daemon/bench.h"
#include "gpu/ffn.h"
#include "gpu/fp8.h"
#include "gpu/ops.h"
#ifdef EPD_HAVE_CUDA
#include "gpu/ffn_cuda.h"
#endif

#define ACCURACY_RECORDS 4 /* records checked against the host reference (seconds each at 7168) */
#define MAX_SIZES 64

/* The experts op under test: through the ops table (host ops, or the CUDA ops' default), or with
 * CUDA the device experts directly under one tuning. */
typedef struct ffn_runner {
    const epd_ops_t *ops;
    epd_ops_ctx_t *ctx;
#ifdef EPD_HAVE_CUDA
    epd_ffn_cuda_t *ffn; /* NULL: through ops */
#endif
} ffn_runner_t;

typedef struct ffn_sweep {
    const char *name;
#ifdef EPD_HAVE_CUDA
    epd_ffn_cuda_tuning_t tuning;
#endif
    bool from_default; /* the default tuning with this one's d_bf16 (the GEMMs' D) */
    bool alone;        /* from_default: and the Hopper kernel's CTAs alone (wgmma_pair off) */
    bool bf16_only; /* batched and grouped GEMMs: BF16 weights only */
    bool fp8_only;  /* FP8 fast accumulation */
} ffn_sweep_t;

#ifdef EPD_HAVE_CUDA
/* The tunings timed; the first is the daemon's default (epd_ffn_cuda_default_tuning, filled in
 * at run time). */
static ffn_sweep_t sweeps[] = {
    {.name = "default"},
    {.name = "streams=1", .tuning = {.streams = 1}},
    {.name = "streams=2", .tuning = {.streams = 2}},
    {.name = "streams=4", .tuning = {.streams = 4}},
    {.name = "streams=8", .tuning = {.streams = 8}},
    {.name = "streams=4,sm_target", .tuning = {.streams = 4, .sm_target = true}},
    {.name = "streams=8,sm_target", .tuning = {.streams = 8, .sm_target = true}},
    {.name = "batched", .tuning = {.streams = 1, .batched = true}, .bf16_only = true},
    {.name = "streams=1,autotune", .tuning = {.streams = 1, .autotune = true}},
    {.name = "streams=2,autotune", .tuning = {.streams = 2, .autotune = true}},
    {.name = "streams=4,autotune", .tuning = {.streams = 4, .autotune = true}},
    {.name = "streams=8,autotune", .tuning = {.streams = 8, .autotune = true}},
    {.name = "streams=4,autotune,fast_accum",
     .tuning = {.streams = 4, .autotune = true, .fast_accum = true},
     .fp8_only = true},
    /* strided batches over runs of consecutive experts (gpu/ffn_cuda.h), the run cost in rows */
    {.name = "strided",
     .tuning = {.streams = 4, .strided = true, .run_cost = EPD_FFN_RUN_COST}},
    {.name = "strided,streams=1",
     .tuning = {.streams = 1, .strided = true, .run_cost = EPD_FFN_RUN_COST}},
    {.name = "strided,cost=64", .tuning = {.streams = 4, .strided = true, .run_cost = 64}},
    {.name = "strided,one", .tuning = {.streams = 1, .strided = true, .run_cost = UINT32_MAX}},
    {.name = "grouped", .tuning = {.streams = 1, .grouped = true}, .bf16_only = true},
    /* the GEMM kernel of our own (gpu/ffn_gemm.h), alone (split-K where its grid is short),
     * without split-K and with 2 or 4 K ranges always, with L2 prefetches of runs of 4 or 8
     * stages of each weight row (beyond its cp.async pipeline), and up to a mean of 32 or 64 rows
     * per expert with the default's strided batches above */
    {.name = "kernel", .tuning = {.streams = 1, .kernel = true}},
    {.name = "kernel,split=1", .tuning = {.streams = 1, .kernel = true, .kernel_split = 1}},
    {.name = "kernel,split=2", .tuning = {.streams = 1, .kernel = true, .kernel_split = 2}},
    {.name = "kernel,split=4", .tuning = {.streams = 1, .kernel = true, .kernel_split = 4}},
    {.name = "kernel,prefetch=4", .tuning = {.streams = 1, .kernel = true, .kernel_prefetch = 4}},
    {.name = "kernel,prefetch=8", .tuning = {.streams = 1, .kernel = true, .kernel_prefetch = 8}},
    {.name = "kernel,upto=32,strided",
     .tuning = {.streams = 4, .strided = true, .run_cost = EPD_FFN_RUN_COST, .kernel = true,
                .kernel_max_rows = 32}},
    {.name = "kernel,upto=64,strided",
     .tuning = {.streams = 4, .strided = true, .run_cost = EPD_FFN_RUN_COST, .kernel = true,
                .kernel_max_rows = 64}},
    /* FP8 block weights have no strided batches: the kernel up to 64 rows, then the streams */
    {.name = "kernel,upto=64,streams=4",
     .tuning = {.streams = 4, .kernel = true, .kernel_max_rows = 64},
     .fp8_only = true},
    /* the Hopper kernel (gpu/ffn_gemm_wgmma.cu), alone: its row tile picked by the rows, then
     * each row tile forced, split-K off and at 2; then the kernel up to 16 rows and it above
     * (strided left out, so that FP8 is not refused for it; the default runs wgmma first, BF16
     * up to 64 rows, FP8 up to 192, gpu/ffn_path.h) */
    {.name = "wgmma", .tuning = {.streams = 1, .wgmma = true}},
    {.name = "wgmma,split=1", .tuning = {.streams = 1, .wgmma = true, .wgmma_split = 1}},
    {.name = "wgmma,split=2", .tuning = {.streams = 1, .wgmma = true, .wgmma_split = 2}},
    {.name = "wgmma,tile=32", .tuning = {.streams = 1, .wgmma = true, .wgmma_row_tile = 32}},
    {.name = "wgmma,tile=64", .tuning = {.streams = 1, .wgmma = true, .wgmma_row_tile = 64}},
    {.name = "wgmma,tile=96", .tuning = {.streams = 1, .wgmma = true, .wgmma_row_tile = 96}},
    {.name = "wgmma,tile=128", .tuning = {.streams = 1, .wgmma = true, .wgmma_row_tile = 128}},
    {.name = "wgmma,tile=160", .tuning = {.streams = 1, .wgmma = true, .wgmma_row_tile = 160}},
    {.name = "wgmma,tile=192", .tuning = {.streams = 1, .wgmma = true, .wgmma_row_tile = 192}},
    {.name = "wgmma,tile=256",
     .tuning = {.streams = 1, .wgmma = true, .wgmma_row_tile = 256},
     .bf16_only = true},
    {.name = "kernel,upto=16,wgmma",
     .tuning = {.streams = 4, .kernel = true, .kernel_max_rows = 16, .kernel_fp8_max_rows = 16,
                .wgmma = true}},
    /* the default where the Hopper kernel's check refuses it (as set then: wgmma off, strided
     * kept for BF16): the mma.sync kernel up to 16 rows (BF16) or 32 (FP8) */
    {.name = "default,no_wgmma",
     .tuning = {.streams = 4, .strided = true, .run_cost = EPD_FFN_RUN_COST, .kernel = true,
                .kernel_max_rows = 16, .kernel_fp8_max_rows = 32}},
    /* and with SwiGLU fused into its gate/up GEMM (BF16; FP8 runs as without), then its GEMMs
     * launched behind the kernels before them (programmatic dependent launches) */
    {.name = "wgmma,swiglu", .tuning = {.streams = 1, .wgmma = true, .wgmma_swiglu = true}},
    {.name = "wgmma,swiglu,pdl",
     .tuning = {.streams = 1, .wgmma = true, .wgmma_swiglu = true, .wgmma_pdl = true}},
    {.name = "kernel,upto=16,wgmma,swiglu",
     .tuning = {.streams = 4, .kernel = true, .kernel_max_rows = 16, .kernel_fp8_max_rows = 16,
                .wgmma = true, .wgmma_swiglu = true}},
    /* the default with the GEMMs' D in fp32 (its d_bf16 off: the experts' outputs, and BF16
     * weights' gate/up sums where SwiGLU is not fused), and the Hopper kernel with D in BF16 */
    {.name = "default,d_f32", .tuning = {.d_bf16 = false}, .from_default = true},
    /* the default with the Hopper kernel's CTAs alone (BF16; in pairs by default, the
     * activations by multicast), and the Hopper kernel at every size alone and in pairs */
    {.name = "default,no_pair", .tuning = {.d_bf16 = true}, .from_default = true, .alone = true},
    {.name = "wgmma,swiglu,pdl,d_bf16",
     .tuning = {.streams = 1, .wgmma = true, .wgmma_swiglu = true, .wgmma_pdl = true,
                .d_bf16 = true}},
    {.name = "wgmma,swiglu,pdl,d_bf16,pair",
     .tuning = {.streams = 1, .wgmma = true, .wgmma_swiglu = true, .wgmma_pdl = true,
                .d_bf16 = true, .wgmma_pair = true}},
};
#else
static ffn_sweep_t sweeps[] = {{.name = "default"}};
#endif
enum { N_SWEEPS = sizeof sweeps / sizeof sweeps[0] };

/* FFN_BENCH_TUNINGS (sweep names separated by spaces; unset or empty: all) limits the
 * sweep to those tunings besides the default, so that a GPU run can time a few in seconds (a
 * benchmark's knob, not a daemon setting). */
static bool sweep_wanted(const char *name)
{
    const char *list = getenv("FFN_BENCH_TUNINGS");
    size_t len = strlen(name);
    if (list == NULL || *list == '\0') return true;
    for (const char *p = list; *p != '\0';) {
        const char *end = strchr(p, ' ');
        size_t n = end != NULL ? (size_t)(end - p) : strlen(p);
        if (n == len && strncmp(p, name, n) == 0) return true;
        if (end == NULL) break;
        p = end + 1;
    }
    return false;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* One token count's records: random tokens routed uniformly over the experts (distinct ids),
 * packed into records (ops memory and a host copy), and the rows per expert. */
typedef struct ffn_records {
    void *dev;
    uint8_t *host;
    uint32_t *rows; /* [E] */
} ffn_records_t;

static void records_free(const epd_ops_t *ops, epd_ops_ctx_t *ctx, ffn_records_t *r)
{
    if (r->dev != NULL) ops->free(ctx, r->dev);
    free(r->host);
    free(r->rows);
    memset(r, 0, sizeof *r);
}

static epd_status_t make_records(const epd_ops_t *ops, epd_ops_ctx_t *ctx,
                                 const epd_moe_shape_t *s, uint32_t tokens, uint64_t seed,
                                 ffn_records_t *out, char err[EPD_ERR_LEN])
{
    uint32_t H = s->hidden, K = s->topk;
    epd_record_layout_t rec;
    epd_step_layout_t lay;
    uint16_t *x = malloc((size_t)tokens * H * 2);
    int32_t *ids = malloc((size_t)tokens * K * 4);
    float *w = malloc((size_t)tokens * K * 4);
    uint32_t counts[1], offsets[1];
    void *dx = NULL, *dids = NULL, *dw = NULL;
    epd_status_t status = EPD_ERR_NO_MEMORY;

    memset(out, 0, sizeof *out);
    epd_record_layout(s, &rec);
    memset(&lay, 0, sizeof lay);
    lay.n_tokens = tokens;
    lay.send_counts_host = counts;
    lay.send_offsets_host = offsets;
    out->rows = calloc(s->num_experts, sizeof *out->rows);
    lay.expert_counts_host = out->rows;
    if (x == NULL || ids == NULL || w == NULL || out->rows == NULL) goto out;
    for (size_t i = 0; i < (size_t)tokens * H; i++)
        x[i] = epd_f32_to_bf16(2.0f * epd_rng_unit_f32(&seed) - 1.0f);
    for (uint32_t t = 0; t < tokens; t++) {
        for (uint32_t k = 0; k < K; k++) {
            int32_t e;
            bool dup;
            do {
                e = (int32_t)(epd_rng_next(&seed) % s->num_experts);
                dup = false;
                for (uint32_t j = 0; j < k; j++) dup = dup || ids[t * K + j] == e;
            } while (dup);
            ids[t * K + k] = e;
            w[t * K + k] = epd_rng_unit_f32(&seed) / (float)K;
        }
    }
    dx = ops->alloc(ctx, (size_t)tokens * H * 2);
    dids = ops->alloc(ctx, (size_t)tokens * K * 4);
    dw = ops->alloc(ctx, (size_t)tokens * K * 4);
    lay.slot = ops->alloc(ctx, (size_t)tokens * 4);
    out->dev = ops->alloc(ctx, (size_t)tokens * rec.size);
    out->host = malloc((size_t)tokens * rec.size);
    if (dx == NULL || dids == NULL || dw == NULL || lay.slot == NULL || out->dev == NULL ||
        out->host == NULL)
        goto out;
    status = ops->copy_to_ops(ctx, dx, x, (size_t)tokens * H * 2);
    if (status == EPD_OK) status = ops->copy_to_ops(ctx, dids, ids, (size_t)tokens * K * 4);
    if (status == EPD_OK) status = ops->copy_to_ops(ctx, dw, w, (size_t)tokens * K * 4);
    if (status == EPD_OK) status = ops->layout(ctx, s, dids, &lay);
    if (status == EPD_OK) status = ops->pack(ctx, s, dx, dids, dw, &lay, out->dev);
    if (status == EPD_OK) status = ops->layout_counts(ctx, s, &lay);
    if (status == EPD_OK) status = ops->sync(ctx);
    if (status == EPD_OK)
        status = ops->copy_to_host(ctx, out->host, out->dev, (size_t)tokens * rec.size);
    if (status != EPD_OK) snprintf(err, EPD_ERR_LEN, "packing the records: %s", ops->last_error(ctx));
out:
    if (status == EPD_ERR_NO_MEMORY)
        snprintf(err, EPD_ERR_LEN, "out of memory for %u tokens", tokens);
    if (status != EPD_OK) records_free(ops, ctx, out);
    if (dx != NULL) ops->free(ctx, dx);
    if (dids != NULL) ops->free(ctx, dids);
    if (dw != NULL) ops->free(ctx, dw);
    if (lay.slot != NULL) ops->free(ctx, lay.slot);
    free(x);
    free(ids);
    free(w);
    return status;
}

/* One experts call through the runner, waited for. */
static epd_status_t run_experts(const ffn_runner_t *r, const epd_moe_shape_t *s, uint32_t layer,
                                const ffn_records_t *rec, uint32_t n, void *partials,
                                char err[EPD_ERR_LEN])
{
    epd_status_t status;
#ifdef EPD_HAVE_CUDA
    if (r->ffn != NULL) {
        status = epd_ffn_cuda_experts(r->ffn, s, layer, rec->dev, n, rec->rows, partials, NULL,
                                      err);
        if (status == EPD_OK) status = epd_ffn_cuda_sync(r->ffn, err);
        return status;
    }
#endif
    status = r->ops->experts(r->ctx, s, layer, rec->dev, n, rec->rows, partials);
    if (status == EPD_OK) status = r->ops->sync(r->ctx);
    if (status != EPD_OK) snprintf(err, EPD_ERR_LEN, "experts: %s", r->ops->last_error(r->ctx));
    return status;
}

/* The device partials of the first n records against the host experts op on the same records,
 * both read back to fp32 as combine reads them (epd_partial_add_host). */
static epd_status_t accuracy(const ffn_runner_t *r, const epd_moe_shape_t *s,
                             const epd_ffn_weights_t *w, const ffn_records_t *rec, uint32_t n,
                             double *worst_p, char err[EPD_ERR_LEN])
{
    epd_ops_ctx_t *hctx = NULL;
    epd_partial_layout_t pl;
    uint32_t H = s->hidden;
    epd_partial_layout(s, &pl);
    uint8_t *ref = malloc((size_t)n * pl.size), *got = malloc((size_t)n * pl.size);
    float *a = calloc(H, sizeof *a), *b = calloc(H, sizeof *b);
    void *partials = r->ops->alloc(r->ctx, (size_t)n * pl.size);
    epd_status_t status = EPD_ERR_NO_MEMORY;

    *worst_p = 0;
    if (ref == NULL || got == NULL || a == NULL || b == NULL || partials == NULL) goto out;
    /* the device sees only the first n records: their rows per expert counted on the device */
    {
        ffn_records_t first = *rec;
        first.rows = NULL;
        CHECK_GOTO(run_experts(r, s, w->layers[0].layer, &first, n, partials, err), out);
    }
    CHECK_GOTO(r->ops->copy_to_host(r->ctx, got, partials, (size_t)n * pl.size), out);
    CHECK_GOTO(epd_ops_host.init(-1, &hctx, err), out);
    CHECK_GOTO(epd_ops_host.experts_load(hctx, s, w, err), out);
    CHECK_GOTO(epd_ops_host.experts(hctx, s, w->layers[0].layer, rec->host, n, NULL, ref), out);
    for (uint32_t j = 0; j < n; j++) {
        double num = 0, den = 0;
        memset(a, 0, H * sizeof *a);
        memset(b, 0, H * sizeof *b);
        epd_partial_add_host(s, got + (size_t)j * pl.size, a);
        epd_partial_add_host(s, ref + (size_t)j * pl.size, b);
        for (uint32_t i = 0; i < H; i++) {
            num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
            den += (double)b[i] * b[i];
        }
        double rel = den > 0 ? sqrt(num / den) : sqrt(num);
        if (!(rel <= *worst_p)) *worst_p = rel;
    }
    status = EPD_OK;
out:
    if (status == EPD_ERR_NO_MEMORY) snprintf(err, EPD_ERR_LEN, "out of memory");
    if (hctx != NULL) epd_ops_host.fini(hctx);
    if (partials != NULL) r->ops->free(r->ctx, partials);
    free(ref);
    free(got);
    free(a);
    free(b);
    return status;
}

/* What the last timed call queued (gpu/ffn_cuda.h epd_ffn_cuda_last_call): its path, GEMM
 * calls and plans made; "-" and 0 through the ops. */
typedef struct ffn_call {
    const char *path;
    uint32_t gemm_calls, plans_made;
} ffn_call_t;

/* One experts call through the runner, not waited for. */
static epd_status_t queue_experts(const ffn_runner_t *r, const epd_moe_shape_t *s, uint32_t layer,
                                  const ffn_records_t *rec, uint32_t tokens, void *partials,
                                  char err[EPD_ERR_LEN])
{
#ifdef EPD_HAVE_CUDA
    if (r->ffn != NULL)
        return epd_ffn_cuda_experts(r->ffn, s, layer, rec->dev, tokens, rec->rows, partials, NULL,
                                    err);
#endif
    epd_status_t status = r->ops->experts(r->ctx, s, layer, rec->dev, tokens, rec->rows, partials);
    if (status != EPD_OK) snprintf(err, EPD_ERR_LEN, "experts: %s", r->ops->last_error(r->ctx));
    return status;
}

static epd_status_t wait_experts(const ffn_runner_t *r, char err[EPD_ERR_LEN])
{
#ifdef EPD_HAVE_CUDA
    if (r->ffn != NULL) return epd_ffn_cuda_sync(r->ffn, err);
#endif
    epd_status_t status = r->ops->sync(r->ctx);
    if (status != EPD_OK) snprintf(err, EPD_ERR_LEN, "experts: %s", r->ops->last_error(r->ctx));
    return status;
}

/* The median time of iters experts calls (after two warm-ups: the autotune runs in the first),
 * microseconds: *us_p to the end of the wait, *host_us_p until the call returned (the host's
 * share: the launches; equal to *us_p when the host cannot queue ahead of the device); *call_p
 * what the last call queued. *queued_us_p: iters calls queued one after the other, then one
 * wait, over iters: the phase's time when the host queues it ahead of the device (as a step
 * does behind a device all-to-all), its launches hidden but for the first. */
static epd_status_t time_experts(const ffn_runner_t *r, const epd_moe_shape_t *s, uint32_t layer,
                                 const ffn_records_t *rec, uint32_t tokens, void *partials,
                                 uint32_t iters, double *us_p, double *host_us_p,
                                 double *queued_us_p, ffn_call_t *call_p, char err[EPD_ERR_LEN])
{
    call_p->path = "-";
    call_p->gemm_calls = call_p->plans_made = 0;
    uint64_t *t = calloc(2 * (size_t)iters, sizeof *t), *h = t + iters;
    if (t == NULL) {
        snprintf(err, EPD_ERR_LEN, "out of memory");
        return EPD_ERR_NO_MEMORY;
    }
    for (uint32_t i = 0; i < iters + 2; i++) {
        uint64_t t0 = epd_now_ns(), t1;
        epd_status_t status;
#ifdef EPD_HAVE_CUDA
        if (r->ffn != NULL) {
            epd_ffn_cuda_call_info_t info;
            status = epd_ffn_cuda_experts(r->ffn, s, layer, rec->dev, tokens, rec->rows, partials,
                                          NULL, err);
            t1 = epd_now_ns();
            epd_ffn_cuda_last_call(r->ffn, &info);
            call_p->path = info.path;
            call_p->gemm_calls = info.gemm_calls;
            call_p->plans_made = info.plans_made;
            if (status == EPD_OK) status = epd_ffn_cuda_sync(r->ffn, err);
        } else
#endif
        {
            status = r->ops->experts(r->ctx, s, layer, rec->dev, tokens, rec->rows, partials);
            t1 = epd_now_ns();
            if (status == EPD_OK) status = r->ops->sync(r->ctx);
            if (status != EPD_OK)
                snprintf(err, EPD_ERR_LEN, "experts: %s", r->ops->last_error(r->ctx));
        }
        if (status != EPD_OK) {
            free(t);
            return status;
        }
        if (i >= 2) {
            t[i - 2] = epd_now_ns() - t0;
            h[i - 2] = t1 - t0;
        }
    }
    qsort(t, iters, sizeof *t, cmp_u64);
    qsort(h, iters, sizeof *h, cmp_u64);
    *us_p = (double)t[iters / 2] / 1e3;
    *host_us_p = (double)h[iters / 2] / 1e3;
    free(t);
    uint64_t q0 = epd_now_ns();
    epd_status_t status = EPD_OK;
    for (uint32_t i = 0; status == EPD_OK && i < iters; i++)
        status = queue_experts(r, s, layer, rec, tokens, partials, err);
    if (status == EPD_OK) status = wait_experts(r, err);
    *queued_us_p = (double)(epd_now_ns() - q0) / 1e3 / iters;
    return status;
}

/* The local experts with at least one row among a token count's records. */
static uint32_t experts_used(const epd_moe_shape_t *s, const ffn_records_t *rec)
{
    uint32_t used = 0;
    for (uint32_t e = 0; e < s->num_experts; e++) used += rec->rows[e] > 0;
    return used;
}

#ifdef EPD_HAVE_CUDA
/* The GEMM plans the last sweep made (gpu/ffn_cuda.h epd_ffn_cuda_plans), one line each: the
 * chosen algorithm, and with the autotune its time against the heuristic's first, with the
 * weight bytes per microsecond that time reads. */
static void print_plans(const epd_ffn_cuda_t *ffn, const epd_ffn_weights_t *w, const char *tuning)
{
    epd_ffn_cuda_plan_info_t info[256];
    uint32_t n = epd_ffn_cuda_plans(ffn, info, 256);
    double es = w->format == EPD_FFN_FP8_BLOCK ? 1 : 2;
    for (uint32_t i = 0; i < n && i < 256; i++) {
        const epd_ffn_cuda_plan_info_t *p = &info[i];
        double bytes = 2.0 * w->intermediate * w->hidden * es / (p->proj == 0 ? 1 : 2);
        printf("ffn-plan weights=%s tuning=%s proj=%s rows=%u batch=%u batch_mode=%s tile=%u "
               "splitk=%u waves=%.2f candidates=%u chosen=%u heuristic_us=%.1f chosen_us=%.1f "
               "heuristic_GBps=%.0f chosen_GBps=%.0f\n",
               epd_ffn_format_name(w->format), tuning, p->proj == 0 ? "gate_up" : "down",
               p->rows, p->batch,
               p->batch == 0 ? "none" : p->strided ? "strided" : "pointers", p->tile, p->splitk,
               p->waves, p->candidates, p->chosen,
               p->heuristic_us, p->chosen_us, p->heuristic_us > 0 ? bytes / p->heuristic_us / 1e3 : 0,
               p->chosen_us > 0 ? bytes / p->chosen_us / 1e3 : 0);
    }
}
#endif

static double ratio(double a, double b)
{
    return a > 0 && b > 0 ? a / b : NAN;
}

int epd_bench_ffn(const epd_config_t *cfg, const epd_args_t *args, const epd_ops_t *ops,
                  int device_id, int world, const uint32_t *sizes, size_t n_sizes, uint32_t iters)
{
    epd_ffn_format_t formats[2];
    size_t n_formats = 0;
    /* [sweep][size]: the BF16 experts time, for the fp8/bf16 ratio of the same tuning */
    static double bf16_us[N_SWEEPS][MAX_SIZES];
    char err[EPD_ERR_LEN];
    /* random weights: model.intermediate or DeepSeek-V3's 2048; a file says its own (the header
     * shows the setting, 2048 when unset) */
    uint32_t inter = cfg->model.intermediate ? cfg->model.intermediate : 2048;
    epd_moe_shape_t s;
    int rc = 0;

    if (world != 1) {
        fprintf(stderr, "epd bench: the ffn experts bench runs on one rank (mpirun -np 1)\n");
        return 2;
    }
    if (args->bench_weights == NULL && cfg->experts.weights[0] == '\0') {
        fprintf(stderr, "epd bench: experts.kind = ffn needs --bench-weights random or "
                        "experts.weights\n");
        return 2;
    }
    if (n_sizes > MAX_SIZES) n_sizes = MAX_SIZES;
    memset(bf16_us, 0, sizeof bf16_us);
    if (args->bench_weights == NULL || strcmp(args->bench_weights, "random-fp8") != 0)
        formats[n_formats++] = EPD_FFN_BF16;
    if (args->bench_weights == NULL || strcmp(args->bench_weights, "random-bf16") != 0)
        formats[n_formats++] = EPD_FFN_FP8_BLOCK;
    if (args->bench_weights == NULL) n_formats = 1; /* the file's own format */
    memset(&s, 0, sizeof s);
    s.hidden = cfg->model.hidden;
    s.topk = cfg->model.topk;
    s.num_experts = cfg->model.num_experts;
    s.world = 1;
    s.dtype = cfg->dispatch.dtype;
    s.scale = cfg->dispatch.scale;
    s.scale_format = cfg->dispatch.scale_format;
    s.expert_kind = EPD_EXPERTS_FFN;
    s.combine_dtype = cfg->combine.dtype;
    size_t n_sweeps = ops->device_memory ? N_SWEEPS : 1;

    printf("epd bench (ffn experts): %s ops, E_local %u, H %u, I %u, top-%u, dispatch %s, "
           "combine %s, %u iterations; each row: the experts op (median, rows per expert from the "
           "count exchange) under one tuning, a dense cuBLAS BF16 GEMM of the same FLOPs on "
           "random values, and a device read of one layer's weight bytes, same run\n",
           ops->name, s.num_experts, s.hidden, inter, s.topk,
           s.dtype == EPD_WIRE_FP8 ? "fp8" : "bf16",
           s.combine_dtype == EPD_COMBINE_FP8 ? "fp8" : "bf16", iters);
    printf("%-9s %-22s %7s %7s %5s %10s %8s %9s %8s %10s %8s %8s %9s %8s %8s %8s %-8s %5s\n",
           "weights", "tuning", "tokens", "rows/e", "used", "experts_us", "host_us", "queued_us",
           "TFLOP/s",
           "dense_us", "TFLOP/s", "vs_dense", "read_us", "vs_read", "vs_used", "fp8/bf16", "path",
           "gemms");
    for (size_t f = 0; f < n_formats && rc == 0; f++) {
        epd_ffn_weights_t *w = NULL;
        epd_ops_ctx_t *ctx = NULL;
        ffn_runner_t runner = {.ops = ops};
        epd_status_t status;
        double read_us = 0, layer_bytes = 0;
        bool have_read = false;
        if (args->bench_weights != NULL) {
            status = epd_ffn_random(formats[f], s.hidden, inter, s.num_experts, 0, s.num_experts,
                                    1, 0xffe, &w, err);
        } else {
            epd_ffn_spec_t spec = {.path = cfg->experts.weights, .hidden = s.hidden,
                                   .intermediate = cfg->model.intermediate,
                                   .num_experts = s.num_experts, .n_local = s.num_experts};
            status = epd_ffn_load(&spec, &w, err);
        }
        if (status == EPD_OK) status = ops->init(device_id, &ctx, err);
        if (status == EPD_OK) status = ops->experts_load(ctx, &s, w, err);
        runner.ctx = ctx;
#ifdef EPD_HAVE_CUDA
        /* the default of the device the ops chose (gpu/ffn_path.h: it differs by device) */
        epd_ffn_cuda_default_tuning(&sweeps[0].tuning);
        for (size_t sw = 1; sw < N_SWEEPS; sw++) {
            if (!sweeps[sw].from_default) continue;
            bool d_bf16 = sweeps[sw].tuning.d_bf16;
            sweeps[sw].tuning = sweeps[0].tuning;
            sweeps[sw].tuning.d_bf16 = d_bf16;
            if (sweeps[sw].alone) sweeps[sw].tuning.wgmma_pair = false;
        }
        /* the sweep's own device experts (the ops' copy serves the accuracy check) */
        if (status == EPD_OK && ops->device_memory)
            status = epd_ffn_cuda_create(w, NULL, &runner.ffn, err);
#endif
        if (status != EPD_OK) {
            fprintf(stderr, "epd bench: ffn %s weights: %s\n",
                    w ? epd_ffn_format_name(w->format) : "", err);
            if (ctx != NULL) ops->fini(ctx);
            epd_ffn_free(w);
            return 3;
        }
        layer_bytes = (double)w->local_bytes / w->n_layers;
        double *dense_us = calloc(n_sizes, sizeof *dense_us);
        ffn_records_t *recs = calloc(n_sizes, sizeof *recs);
        void **partials = calloc(n_sizes, sizeof *partials);
        epd_partial_layout_t pl;
        epd_partial_layout(&s, &pl);
        if (dense_us == NULL || recs == NULL || partials == NULL) {
            fprintf(stderr, "epd bench: out of memory\n");
            rc = 3;
        }
        for (size_t i = 0; rc == 0 && i < n_sizes; i++) {
            if (make_records(ops, ctx, &s, sizes[i], 0x5eed + sizes[i], &recs[i], err) != EPD_OK ||
                (partials[i] = ops->alloc(ctx, (size_t)sizes[i] * pl.size)) == NULL) {
                fprintf(stderr, "epd bench: %u tokens: %s\n", sizes[i],
                        partials[i] == NULL ? "out of memory" : err);
                rc = 3;
            }
        }
#ifdef EPD_HAVE_CUDA
        /* the same-run baselines: one layer's weight read, a dense GEMM per token count */
        if (rc == 0 && ops->device_memory) {
            char why[EPD_ERR_LEN];
            have_read = epd_ffn_cuda_bench_read((uint64_t)layer_bytes, iters, &read_us, why) ==
                        EPD_OK;
            if (!have_read) printf("read baseline: %s\n", why);
            for (size_t i = 0; i < n_sizes; i++) {
                uint64_t rows = (uint64_t)sizes[i] * s.topk;
                /* the experts' FLOPs 2 * rows * (2I * H + H * I) as one [rows, H] x [H, 3I] GEMM */
                if (rows > UINT32_MAX ||
                    epd_ffn_cuda_bench_gemm((uint32_t)rows, 3 * w->intermediate, w->hidden, iters,
                                            &dense_us[i], why) != EPD_OK)
                    dense_us[i] = 0;
            }
            if (have_read)
                printf("ffn-baseline weights=%s read_bytes=%.0f read_us=%.1f read_GBps=%.0f\n",
                       epd_ffn_format_name(w->format), layer_bytes, read_us,
                       layer_bytes / read_us / 1e3);
        }
#endif
        for (size_t sw = 0; rc == 0 && sw < n_sweeps; sw++) {
            if (sw > 0 && !sweep_wanted(sweeps[sw].name)) continue;
            if (sweeps[sw].bf16_only && w->format != EPD_FFN_BF16) continue;
            if (sweeps[sw].fp8_only && w->format != EPD_FFN_FP8_BLOCK) continue;
#ifdef EPD_HAVE_CUDA
            if (runner.ffn != NULL) {
                epd_status_t set = epd_ffn_cuda_set_tuning(runner.ffn, &sweeps[sw].tuning, err);
                /* the default runs as the daemon's does: without its strided batches where
                 * they cannot run (set that way, as epd_ffn_cuda_create does) */
                if (set == EPD_ERR_UNSUPPORTED && (sw == 0 || sweeps[sw].from_default)) {
                    printf("%-9s %-22s  note: %s: the default runs without it\n",
                           epd_ffn_format_name(w->format), sweeps[sw].name, err);
                    set = EPD_OK;
                }
                if (set != EPD_OK) {
                    printf("%-9s %-22s  skipped: %s\n", epd_ffn_format_name(w->format),
                           sweeps[sw].name, err);
                    continue;
                }
            }
#endif
            for (size_t i = 0; i < n_sizes; i++) {
                double us = 0, host_us = 0, queued_us = 0;
                ffn_call_t call;
                uint32_t used = experts_used(&s, &recs[i]);
                double flops = 6.0 * sizes[i] * s.topk * (double)s.hidden * w->intermediate;
                double rows_e = (double)sizes[i] * s.topk / s.num_experts;
                if (time_experts(&runner, &s, w->layers[0].layer, &recs[i], sizes[i],
                                 partials[i], iters, &us, &host_us, &queued_us, &call,
                                 err) != EPD_OK) {
                    printf("%-9s %-22s %7u  skipped: %s\n", epd_ffn_format_name(w->format),
                           sweeps[sw].name, sizes[i], err);
                    continue;
                }
                double vs_dense = ratio(flops / us, dense_us[i] > 0 ? flops / dense_us[i] : 0);
                double vs_read = have_read ? ratio(us, read_us) : NAN;
                /* over the read of the weights of the experts with rows only (the others are
                 * not read): at 1 row per expert on average, about a third have none */
                double vs_used = have_read ? ratio(us, read_us * used / s.num_experts) : NAN;
                double fp8_bf16 = NAN;
                if (w->format == EPD_FFN_BF16) bf16_us[sw][i] = us;
                if (w->format == EPD_FFN_FP8_BLOCK) {
                    /* the same tuning's BF16 time; for FP8 'batched' does not apply */
                    fp8_bf16 = ratio(us, bf16_us[sw][i]);
                }
                (void)layer_bytes;
                printf("%-9s %-22s %7u %7.1f %5u %10.1f %8.1f %9.1f %8.1f",
                       epd_ffn_format_name(w->format), sweeps[sw].name, sizes[i], rows_e, used, us,
                       host_us, queued_us, flops / us / 1e6);
                if (dense_us[i] > 0)
                    printf(" %10.1f %8.1f %8.2f", dense_us[i], flops / dense_us[i] / 1e6,
                           vs_dense);
                else
                    printf(" %10s %8s %8s", "n/a", "n/a", "n/a");
                if (have_read)
                    printf(" %9.1f %8.2f %8.2f", read_us, vs_read, vs_used);
                else
                    printf(" %9s %8s %8s", "n/a", "n/a", "n/a");
                if (!isnan(fp8_bf16))
                    printf(" %8.2f", fp8_bf16);
                else
                    printf(" %8s", "-");
                printf(" %-8s %5u\n", call.path, call.gemm_calls);
                printf("ffn-result weights=%s tuning=%s tokens=%u rows_per_expert=%.2f "
                       "experts_used=%u experts_us=%.1f host_us=%.1f queued_us=%.1f dense_us=%.1f "
                       "read_us=%.1f vs_dense=%.3f vs_read=%.3f vs_used=%.3f queued_vs_read=%.3f "
                       "fp8_over_bf16=%.3f path=%s gemm_calls=%u plans_made=%u\n",
                       epd_ffn_format_name(w->format), sweeps[sw].name, sizes[i], rows_e, used,
                       us, host_us, queued_us, dense_us[i], read_us, vs_dense, vs_read, vs_used,
                       have_read ? ratio(queued_us, read_us) : NAN, fp8_bf16, call.path,
                       call.gemm_calls, call.plans_made);
                fflush(stdout);
            }
#ifdef EPD_HAVE_CUDA
            if (runner.ffn != NULL) print_plans(runner.ffn, w, sweeps[sw].name);
#endif
        }
        if (rc == 0) {
            uint32_t n = sizes[0] < ACCURACY_RECORDS ? sizes[0] : ACCURACY_RECORDS;
            double worst = 0;
            ffn_runner_t through_ops = {.ops = ops, .ctx = ctx};
            if (accuracy(&through_ops, &s, w, &recs[0], n, &worst, err) != EPD_OK) {
                printf("accuracy %-9s weights: %s\n", epd_ffn_format_name(w->format), err);
            } else {
                double tol = w->format == EPD_FFN_FP8_BLOCK ? 3e-2 : 1e-2;
                printf("accuracy %-9s weights: worst relative L2 of %u records against the host "
                       "reference (fp32, fp64 sums): %.2e (DESIGN.md section 9 allows %.0e)\n",
                       epd_ffn_format_name(w->format), n, worst, tol);
                printf("ffn-accuracy weights=%s records=%u worst_rel=%.3e tolerance=%.0e\n",
                       epd_ffn_format_name(w->format), n, worst, tol);
            }
        }
        for (size_t i = 0; recs != NULL && partials != NULL && i < n_sizes; i++) {
            records_free(ops, ctx, &recs[i]);
            if (partials[i] != NULL) ops->free(ctx, partials[i]);
        }
        free(recs);
        free(partials);
        free(dense_us);
#ifdef EPD_HAVE_CUDA
        epd_ffn_cuda_destroy(runner.ffn);
#endif
        ops->fini(ctx);
        epd_ffn_free(w);
    }
    printf("used: local experts with rows (the others read no weights); host_us: until the "
           "experts call returned, before the wait; queued_us: calls queued back to back, then "
           "one wait, over the calls (the host's launches behind the device's work, as in a "
           "step whose all-to-all runs on the device); vs_dense: the experts' TFLOP/s over the "
           "dense GEMM's; vs_read: the experts time over the time to read one layer's weights once "
           "(1.0 is the bound at decode sizes); vs_used: over the time to read the used "
           "experts' weights; fp8/bf16: over the same tuning's BF16 time; path, gemms: the way "
           "the last call ran its GEMMs (gpu/ffn_path.h) and the GEMM calls it queued (each a "
           "launch or more on the host; streams: two per expert with rows, and a SwiGLU)\n");
    return rc;
}
