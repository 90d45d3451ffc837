/* `epd --bench --set experts.kind=ffn`: the ffn experts op alone on one rank, at the configured
 * shape (model.hidden, model.intermediate or 2048, model.num_experts local experts, top-k), with
 * synthetic weights (--bench-weights random: BF16 and FP8 block in the same run) or
 * experts.weights. For each --bench-tokens count: uniform routing, records packed by the ops,
 * the experts op timed (median of --bench-iters, each synchronized); beside it, same run, a dense
 * cuBLASLt BF16 GEMM of the same FLOPs and a device read of the layer's weight bytes; once per
 * format, the accuracy of the device partials against the host reference (fp32, fp64 sums).
 * The partials are combine.dtype's (BF16, or FP8 group128), compared after dequantization. */
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

typedef struct ffn_run {
    double us, gemm_us, read_us;
    double rows_per_expert;
    double worst_rel;
    bool have_gemm, have_read;
} ffn_run_t;

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Random tokens routed uniformly over the experts (distinct ids), packed into records. */
static epd_status_t make_records(const epd_ops_t *ops, epd_ops_ctx_t *ctx,
                                 const epd_moe_shape_t *s, uint32_t tokens, uint64_t seed,
                                 void **records_p, uint8_t **records_host_p, char err[EPD_ERR_LEN])
{
    uint32_t H = s->hidden, K = s->topk;
    epd_record_layout_t rec;
    epd_step_layout_t lay;
    uint16_t *x = malloc((size_t)tokens * H * 2);
    int32_t *ids = malloc((size_t)tokens * K * 4);
    float *w = malloc((size_t)tokens * K * 4);
    uint32_t counts[1], offsets[1];
    void *dx = NULL, *dids = NULL, *dw = NULL, *drec = NULL;
    uint8_t *hrec = NULL;
    epd_status_t status = EPD_ERR_NO_MEMORY;

    epd_record_layout(s, &rec);
    memset(&lay, 0, sizeof lay);
    lay.n_tokens = tokens;
    lay.send_counts_host = counts;
    lay.send_offsets_host = offsets;
    if (x == NULL || ids == NULL || w == NULL) goto out;
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
    drec = ops->alloc(ctx, (size_t)tokens * rec.size);
    hrec = malloc((size_t)tokens * rec.size);
    if (dx == NULL || dids == NULL || dw == NULL || lay.slot == NULL || drec == NULL ||
        hrec == NULL)
        goto out;
    status = ops->copy_to_ops(ctx, dx, x, (size_t)tokens * H * 2);
    if (status == EPD_OK) status = ops->copy_to_ops(ctx, dids, ids, (size_t)tokens * K * 4);
    if (status == EPD_OK) status = ops->copy_to_ops(ctx, dw, w, (size_t)tokens * K * 4);
    if (status == EPD_OK) status = ops->layout(ctx, s, dids, &lay);
    if (status == EPD_OK) status = ops->pack(ctx, s, dx, dids, dw, &lay, drec);
    if (status == EPD_OK) status = ops->layout_counts(ctx, s, &lay);
    if (status == EPD_OK) status = ops->sync(ctx);
    if (status == EPD_OK) status = ops->copy_to_host(ctx, hrec, drec, (size_t)tokens * rec.size);
    if (status != EPD_OK) {
        snprintf(err, EPD_ERR_LEN, "packing the records: %s", ops->last_error(ctx));
        goto out;
    }
    *records_p = drec;
    *records_host_p = hrec;
    drec = NULL;
    hrec = NULL;
out:
    if (status == EPD_ERR_NO_MEMORY)
        snprintf(err, EPD_ERR_LEN, "out of memory for %u tokens", tokens);
    if (dx != NULL) ops->free(ctx, dx);
    if (dids != NULL) ops->free(ctx, dids);
    if (dw != NULL) ops->free(ctx, dw);
    if (lay.slot != NULL) ops->free(ctx, lay.slot);
    if (drec != NULL) ops->free(ctx, drec);
    free(hrec);
    free(x);
    free(ids);
    free(w);
    return status;
}

/* The device partials of the first records against the host experts op on the same records,
 * both read back to fp32 as combine reads them (epd_partial_add_host). */
static epd_status_t accuracy(const epd_ops_t *ops, epd_ops_ctx_t *ctx, const epd_moe_shape_t *s,
                             const epd_ffn_weights_t *w, const uint8_t *records_host,
                             const void *partials_dev, uint32_t n, double *worst_p,
                             char err[EPD_ERR_LEN])
{
    epd_ops_ctx_t *hctx = NULL;
    epd_partial_layout_t pl;
    uint32_t H = s->hidden;
    epd_partial_layout(s, &pl);
    uint8_t *ref = malloc((size_t)n * pl.size), *got = malloc((size_t)n * pl.size);
    float *a = calloc(H, sizeof *a), *b = calloc(H, sizeof *b);
    epd_status_t status = EPD_ERR_NO_MEMORY;

    *worst_p = 0;
    if (ref == NULL || got == NULL || a == NULL || b == NULL) goto out;
    CHECK_GOTO(ops->copy_to_host(ctx, got, partials_dev, (size_t)n * pl.size), out);
    CHECK_GOTO(epd_ops_host.init(-1, &hctx, err), out);
    CHECK_GOTO(epd_ops_host.experts_load(hctx, s, w, err), out);
    CHECK_GOTO(epd_ops_host.experts(hctx, s, w->layers[0].layer, records_host, n, NULL, ref),
               out);
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
        if (rel > *worst_p) *worst_p = rel;
    }
    status = EPD_OK;
out:
    if (status == EPD_ERR_NO_MEMORY) snprintf(err, EPD_ERR_LEN, "out of memory");
    if (hctx != NULL) epd_ops_host.fini(hctx);
    free(ref);
    free(got);
    free(a);
    free(b);
    return status;
}

/* One (format, tokens) measurement. */
static epd_status_t run_one(const epd_ops_t *ops, epd_ops_ctx_t *ctx, const epd_moe_shape_t *s,
                            const epd_ffn_weights_t *w, uint32_t tokens, uint32_t iters,
                            bool check, ffn_run_t *run, char err[EPD_ERR_LEN])
{
    void *records = NULL;
    uint8_t *records_host = NULL;
    epd_partial_layout_t pl;
    epd_partial_layout(s, &pl);
    void *partials = ops->alloc(ctx, (size_t)tokens * pl.size);
    uint64_t *t = calloc(iters, sizeof *t);
    uint32_t layer = w->layers[0].layer;
    epd_status_t status = EPD_ERR_NO_MEMORY;

    memset(run, 0, sizeof *run);
    if (partials == NULL || t == NULL) {
        snprintf(err, EPD_ERR_LEN, "out of memory for %u tokens", tokens);
        goto out;
    }
    CHECK_GOTO(make_records(ops, ctx, s, tokens, 0x5eed + tokens, &records, &records_host, err),
               out);
    for (uint32_t i = 0; i < iters + 2; i++) {
        uint64_t t0 = epd_now_ns();
        status = ops->experts(ctx, s, layer, records, tokens, NULL, partials);
        if (status == EPD_OK) status = ops->sync(ctx);
        if (status != EPD_OK) {
            snprintf(err, EPD_ERR_LEN, "experts: %s", ops->last_error(ctx));
            goto out;
        }
        if (i >= 2) t[i - 2] = epd_now_ns() - t0;
    }
    qsort(t, iters, sizeof *t, cmp_u64);
    run->us = (double)t[iters / 2] / 1e3;
    run->rows_per_expert = (double)tokens * s->topk / s->num_experts;
    if (check) {
        uint32_t n = tokens < ACCURACY_RECORDS ? tokens : ACCURACY_RECORDS;
        CHECK_GOTO(accuracy(ops, ctx, s, w, records_host, partials, n, &run->worst_rel, err), out);
    }
#ifdef EPD_HAVE_CUDA
    if (ops->device_memory) {
        char why[EPD_ERR_LEN];
        uint64_t rows = (uint64_t)tokens * s->topk;
        /* the experts' FLOPs 2 * rows * (2I * H + H * I) as one [rows, H] x [H, 3I] GEMM */
        run->have_gemm = rows <= UINT32_MAX &&
                         epd_ffn_cuda_bench_gemm((uint32_t)rows, 3 * w->intermediate, w->hidden,
                                                 iters, &run->gemm_us, why) == EPD_OK;
        uint64_t bytes = w->local_bytes / w->n_layers; /* one layer's weights and scales */
        run->have_read = epd_ffn_cuda_bench_read(bytes, iters, &run->read_us, why) == EPD_OK;
    }
#endif
    status = EPD_OK;
out:
    if (records != NULL) ops->free(ctx, records);
    if (partials != NULL) ops->free(ctx, partials);
    free(records_host);
    free(t);
    return status;
}

int epd_bench_ffn(const epd_config_t *cfg, const epd_args_t *args, const epd_ops_t *ops,
                  int device_id, int world, const uint32_t *sizes, size_t n_sizes, uint32_t iters)
{
    epd_ffn_format_t formats[2];
    size_t n_formats = 0;
    double bf16_us[64] = {0};
    char err[EPD_ERR_LEN];
    /* random weights: model.intermediate or DeepSeek-V3's 2048; a file says its own (the header
     * shows the setting, 2048 when unset) */
    uint32_t inter = cfg->model.intermediate ? cfg->model.intermediate : 2048;
    epd_moe_shape_t s;

    if (world != 1) {
        fprintf(stderr, "epd bench: the ffn experts bench runs on one rank (mpirun -np 1)\n");
        return 2;
    }
    if (args->bench_weights == NULL && cfg->experts.weights[0] == '\0') {
        fprintf(stderr, "epd bench: experts.kind = ffn needs --bench-weights random or "
                        "experts.weights\n");
        return 2;
    }
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

    printf("epd bench (ffn experts): %s ops, E_local %u, H %u, I %u, top-%u, dispatch %s, "
           "combine %s, %u iterations; each row: the experts op (median), a dense cuBLAS BF16 "
           "GEMM of the same FLOPs and a device read of one layer's weight bytes, same run\n",
           ops->name, s.num_experts, s.hidden, inter, s.topk,
           s.dtype == EPD_WIRE_FP8 ? "fp8" : "bf16",
           s.combine_dtype == EPD_COMBINE_FP8 ? "fp8" : "bf16", iters);
    printf("%-9s %7s %8s %10s %9s %10s %9s %8s %10s %9s %10s\n", "weights", "tokens", "rows/e",
           "experts_us", "TFLOP/s", "dense_us", "TFLOP/s", "vs_dense", "read_us", "read_GB/s",
           "vs_read");
    for (size_t f = 0; f < n_formats; f++) {
        epd_ffn_weights_t *w = NULL;
        epd_ops_ctx_t *ctx = NULL;
        epd_status_t status;
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
        if (status != EPD_OK) {
            fprintf(stderr, "epd bench: ffn %s weights: %s\n",
                    w ? epd_ffn_format_name(w->format) : "", err);
            if (ctx != NULL) ops->fini(ctx);
            epd_ffn_free(w);
            return 3;
        }
        double worst = -1;
        for (size_t i = 0; i < n_sizes; i++) {
            ffn_run_t run;
            if (run_one(ops, ctx, &s, w, sizes[i], iters, i == 0, &run, err) != EPD_OK) {
                printf("%-9s %7u  skipped: %s\n", epd_ffn_format_name(w->format), sizes[i], err);
                continue;
            }
            if (i == 0) worst = run.worst_rel;
            double flops = 6.0 * sizes[i] * s.topk * (double)s.hidden * w->intermediate;
            double layer_bytes = (double)w->local_bytes / w->n_layers;
            printf("%-9s %7u %8.1f %10.1f %9.1f", epd_ffn_format_name(w->format), sizes[i],
                   run.rows_per_expert, run.us, flops / run.us / 1e6);
            if (run.have_gemm)
                printf(" %10.1f %9.1f %8.2f", run.gemm_us, flops / run.gemm_us / 1e6,
                       (flops / run.us) / (flops / run.gemm_us));
            else
                printf(" %10s %9s %8s", "n/a", "n/a", "n/a");
            if (run.have_read)
                printf(" %10.1f %9.0f %10.2f", run.read_us, layer_bytes / run.read_us / 1e3,
                       run.us / run.read_us);
            else
                printf(" %10s %9s %10s", "n/a", "n/a", "n/a");
            if (w->format == EPD_FFN_BF16 && i < 64) bf16_us[i] = run.us;
            if (w->format == EPD_FFN_FP8_BLOCK && i < 64 && bf16_us[i] > 0)
                printf("  fp8/bf16 %.2f", run.us / bf16_us[i]);
            printf("\n");
            fflush(stdout);
        }
        if (worst >= 0)
            printf("accuracy %-9s weights: worst relative L2 of %u records against the host "
                   "reference (fp32, fp64 sums): %.2e (DESIGN.md section 9 allows %.0e)\n",
                   epd_ffn_format_name(w->format),
                   sizes[0] < ACCURACY_RECORDS ? sizes[0] : ACCURACY_RECORDS, worst,
                   w->format == EPD_FFN_FP8_BLOCK ? 3e-2 : 1e-2);
        ops->fini(ctx);
        epd_ffn_free(w);
    }
    printf("vs_dense: the experts' TFLOP/s over the dense GEMM's; vs_read: the experts time over "
           "the time to read one layer's weights once (1.0 is the bound at decode sizes)\n");
    return 0;
}
