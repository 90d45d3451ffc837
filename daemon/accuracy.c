/* `epd --accuracy`: every wire format against an fp32 dispatch of the same tokens.
 *
 * Activations are shaped like a real model's hidden states rather than uniform noise: per-channel
 * scales spread over an order of magnitude, a few "massive" channels 100x larger than the rest
 * (the same channels on every token, as in LLM residual streams), a token in 32 with a handful of
 * spikes 50x its channel, a token in 64 8x louder overall; BF16, seeded per rank and step. Routing
 * is uniform, distinct top-k experts with positive weights summing to 1 per token.
 *
 * The reference is an fp32 dispatch: each token's BF16 row widened to fp32, sent unquantized, the
 * experts' weighted sum in fp32 (ascending k, epd_expert_ops_t.accumulate) and never rounded.
 * Each step mode runs the daemon's own step (ops and transport of the configuration) with its
 * dispatch and combine formats; the requant modes (the per-tensor requantization DESIGN.md
 * section 3 specifies for experts that take one activation scale) are not in the step's path
 * (no ops table entry calls them: they serve the external experts' input), so they are computed
 * here on the host with the real epd_requant_host on each received copy of a token: group128
 * dispatch, then one S per destination rank (step S: the max of the scales it receives, reduced
 * over the ranks as the count exchange would carry them), or a static S calibrated once on a
 * separate batch of the same distribution (which this batch's outliers may exceed: they
 * saturate).
 *
 * Per mode, over every token of every rank and step: calc_diff = 1 - 2 sum(xy) / sum(x^2 + y^2)
 * (DeepEP's check), the relative L2 error of each token ||y - ref|| / ||ref|| (median, p99, max),
 * the largest absolute error, and the bytes a token puts on the wire (records and partials, each
 * destination counted). */
#include "daemon/accuracy.h"

#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/step.h"
#include "common/rng.h"
#include "daemon/daemon.h"
#include "daemon/engine.h"
#include "gpu/fp8.h"
#include "gpu/quant.h"

#define ACC_DEFAULT_TOKENS "512"
#define ACC_DEFAULT_ITERS  2
#define ACC_MAX_SIZES      16
#define ACC_ABORT          3
#define ACC_MASSIVE        4    /* massive channels */
#define ACC_MASSIVE_GAIN   100.0f
#define ACC_SPIKE_EVERY    32   /* a token in 32 has spikes */
#define ACC_SPIKES         8    /* elements spiked in such a token */
#define ACC_SPIKE_GAIN     50.0f
#define ACC_LOUD_EVERY     64   /* a token in 64 is louder overall */
#define ACC_LOUD_GAIN      8.0f
#define ACC_CALIBRATION    0x5ca1eull /* seed of the static-S calibration batch */

typedef enum {
    MODE_STEP = 0,       /* through epd_step_run */
    MODE_REQUANT_STATIC, /* group128 dispatch, requantized to a calibrated static S (host) */
    MODE_REQUANT_STEP,   /* ... to the step S of the destination rank (host) */
} mode_kind_t;

typedef struct acc_mode {
    const char *name;
    mode_kind_t kind;
    epd_wire_dtype_t dtype;
    epd_scale_kind_t scale;
    epd_scale_fmt_t format;
    epd_combine_dtype_t combine;
} acc_mode_t;

static const acc_mode_t modes[] = {
    {"bf16", MODE_STEP, EPD_WIRE_BF16, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, EPD_COMBINE_BF16},
    {"fp8 group128 fp32", MODE_STEP, EPD_WIRE_FP8, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32,
     EPD_COMBINE_BF16},
    {"fp8 group128 ue8m0", MODE_STEP, EPD_WIRE_FP8, EPD_SCALE_GROUP128, EPD_SCALE_FMT_UE8M0,
     EPD_COMBINE_BF16},
    {"fp8 per_token fp32", MODE_STEP, EPD_WIRE_FP8, EPD_SCALE_PER_TOKEN, EPD_SCALE_FMT_FP32,
     EPD_COMBINE_BF16},
    {"fp8 per_token ue8m0", MODE_STEP, EPD_WIRE_FP8, EPD_SCALE_PER_TOKEN, EPD_SCALE_FMT_UE8M0,
     EPD_COMBINE_BF16},
    {"fp8 group128 -> requant, static S", MODE_REQUANT_STATIC, EPD_WIRE_FP8, EPD_SCALE_GROUP128,
     EPD_SCALE_FMT_FP32, EPD_COMBINE_BF16},
    {"fp8 group128 -> requant, step S", MODE_REQUANT_STEP, EPD_WIRE_FP8, EPD_SCALE_GROUP128,
     EPD_SCALE_FMT_FP32, EPD_COMBINE_BF16},
    {"bf16 + fp8 combine", MODE_STEP, EPD_WIRE_BF16, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32,
     EPD_COMBINE_FP8},
    {"fp8 group128 fp32 + fp8 combine", MODE_STEP, EPD_WIRE_FP8, EPD_SCALE_GROUP128,
     EPD_SCALE_FMT_FP32, EPD_COMBINE_FP8},
};
#define N_MODES EPD_ARRAY_SIZE(modes)

/* One rank's run of the study at one size. */
typedef struct acc_ctx {
    const epd_config_t *cfg;
    int rank, world, local_size;
    epd_rank_backend_t backend;
    const epd_expert_ops_t *experts;
    bool json;
    uint32_t tokens, iters;
    epd_moe_shape_t base; /* the configuration's shape for this rank */
    float *channel;       /* [H] per-channel scale, the same on every rank */
    /* one step's inputs (host) and outputs */
    uint16_t *x, *y;
    int32_t *ids;
    float *w;
    float *ref;          /* [N, H] fp32 reference */
    float *x_in, *acc, *sum; /* [H] scratch of the requant emulation */
    uint8_t *q, *qo;
    float *scales;
} acc_ctx_t;

/* What one mode measured on this rank, summed over its steps. */
typedef struct acc_tally {
    double sxy, sxxyy, max_abs;
    double records; /* (token, destination rank) pairs */
    double *rel;    /* per-token relative L2 error, [iters * N] */
    uint32_t n_rel;
} acc_tally_t;

static void acc_fail(const acc_ctx_t *a, const char *what, const char *err)
{
    fprintf(stderr, "epd accuracy: rank %d: %s: %s\n", a->rank, what, err);
    MPI_Abort(MPI_COMM_WORLD, ACC_ABORT);
}

/* Roughly N(0, 1): the sum of four uniforms, rescaled. */
static float gauss(uint64_t *s)
{
    float u = epd_rng_unit_f32(s) + epd_rng_unit_f32(s) + epd_rng_unit_f32(s) +
              epd_rng_unit_f32(s) - 2.0f;
    return u * 1.7320508f;
}

/* Per-channel scales (seeded identically on every rank): log-uniform over [0.1, 1], and the
 * massive channels ACC_MASSIVE_GAIN times larger. */
static void make_channels(uint32_t hidden, float *channel)
{
    uint64_t s = 0xc4a77e15ull;
    for (uint32_t i = 0; i < hidden; i++)
        channel[i] = expf(-2.3025851f * epd_rng_unit_f32(&s));
    for (uint32_t m = 0; m < ACC_MASSIVE && m < hidden; m++) {
        uint32_t c = (uint32_t)(epd_rng_next(&s) % hidden);
        channel[c] *= ACC_MASSIVE_GAIN;
    }
}

/* n tokens of activations and routing (see the top comment). */
static void make_batch(const acc_ctx_t *a, uint64_t seed, uint16_t *x, int32_t *ids, float *w)
{
    const epd_moe_shape_t *sh = &a->base;
    uint64_t s = seed;
    for (uint32_t t = 0; t < a->tokens; t++) {
        uint16_t *row = x + (size_t)t * sh->hidden;
        float gain = epd_rng_next(&s) % ACC_LOUD_EVERY == 0 ? ACC_LOUD_GAIN : 1.0f;
        bool spiky = epd_rng_next(&s) % ACC_SPIKE_EVERY == 0;
        for (uint32_t i = 0; i < sh->hidden; i++)
            row[i] = epd_f32_to_bf16(gauss(&s) * a->channel[i] * gain);
        for (uint32_t j = 0; spiky && j < ACC_SPIKES; j++) {
            uint32_t i = (uint32_t)(epd_rng_next(&s) % sh->hidden);
            row[i] = epd_f32_to_bf16(epd_bf16_to_f32(row[i]) * ACC_SPIKE_GAIN +
                                     ACC_SPIKE_GAIN * a->channel[i]);
        }
        int32_t *r = ids + (size_t)t * sh->topk;
        float *wr = w + (size_t)t * sh->topk, sum = 0.0f;
        for (uint32_t k = 0; k < sh->topk; k++) {
            int32_t e;
            bool dup;
            do {
                e = (int32_t)(epd_rng_next(&s) % sh->num_experts);
                dup = false;
                for (uint32_t j = 0; j < k; j++) dup |= r[j] == e;
            } while (dup);
            r[k] = e;
            wr[k] = 0.05f + epd_rng_unit_f32(&s);
            sum += wr[k];
        }
        for (uint32_t k = 0; k < sh->topk; k++) wr[k] /= sum;
    }
}

/* The fp32 dispatch: ref[t] = sum over ascending k of w_k * expert(x_t) in fp32, unrounded. */
static void fp32_reference(acc_ctx_t *a)
{
    const epd_moe_shape_t *sh = &a->base;
    for (uint32_t t = 0; t < a->tokens; t++) {
        float *acc = a->ref + (size_t)t * sh->hidden;
        for (uint32_t i = 0; i < sh->hidden; i++) {
            a->x_in[i] = epd_bf16_to_f32(a->x[(size_t)t * sh->hidden + i]);
            acc[i] = 0.0f;
        }
        for (uint32_t k = 0; k < sh->topk; k++)
            a->experts->accumulate(sh, a->ids[(size_t)t * sh->topk + k],
                                   a->w[(size_t)t * sh->topk + k], a->x_in, acc);
    }
}

/* The largest group scale of each token's group128 fp32 quantization, reduced per destination
 * rank (step S) or over everything (static S, on the calibration batch) over all ranks. */
static void scale_maxima(acc_ctx_t *a, float *per_dest, float *overall_p)
{
    const epd_moe_shape_t *sh = &a->base;
    uint32_t per_rank = sh->num_experts / sh->world, ns = sh->hidden / EPD_QUANT_GROUP;
    float *local = calloc(sh->world + 1, sizeof *local);
    if (local == NULL) acc_fail(a, "scale maxima", "out of memory");
    for (uint32_t t = 0; t < a->tokens; t++) {
        epd_quant_row_host(a->x + (size_t)t * sh->hidden, sh->hidden, EPD_SCALE_GROUP128,
                           EPD_SCALE_FMT_FP32, a->q, a->scales);
        float smax = 0.0f;
        for (uint32_t g = 0; g < ns; g++) smax = a->scales[g] > smax ? a->scales[g] : smax;
        for (uint32_t k = 0; k < sh->topk; k++) {
            uint32_t r = (uint32_t)a->ids[(size_t)t * sh->topk + k] / per_rank;
            if (smax > local[r]) local[r] = smax;
        }
        if (smax > local[sh->world]) local[sh->world] = smax;
    }
    float *all = malloc((sh->world + 1) * sizeof *all);
    if (all == NULL) acc_fail(a, "scale maxima", "out of memory");
    MPI_Allreduce(local, all, (int)sh->world + 1, MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD);
    if (per_dest != NULL) memcpy(per_dest, all, sh->world * sizeof *all);
    if (overall_p != NULL) *overall_p = all[sh->world];
    free(local);
    free(all);
}

/* The requant modes on the host: each token's group128 row, requantized (epd_requant_host) to
 * S of each destination rank that owns one of its experts, dequantized with S; that rank's
 * partial (its experts in ascending k, fp32) rounded to BF16; partials summed in ascending rank
 * order and rounded to BF16, as the step does. */
static void requant_emulation(acc_ctx_t *a, const float *dest_s)
{
    const epd_moe_shape_t *sh = &a->base;
    uint32_t per_rank = sh->num_experts / sh->world;
    int32_t count = 1;
    char err[EPD_ERR_LEN];

    for (uint32_t t = 0; t < a->tokens; t++) {
        const int32_t *ids = a->ids + (size_t)t * sh->topk;
        const float *w = a->w + (size_t)t * sh->topk;
        epd_quant_row_host(a->x + (size_t)t * sh->hidden, sh->hidden, EPD_SCALE_GROUP128,
                           EPD_SCALE_FMT_FP32, a->q, a->scales);
        for (uint32_t i = 0; i < sh->hidden; i++) a->sum[i] = 0.0f;
        for (uint32_t r = 0; r < sh->world; r++) {
            bool owns = false;
            for (uint32_t k = 0; k < sh->topk; k++) owns |= (uint32_t)ids[k] / per_rank == r;
            if (!owns) continue;
            float big_s = 0.0f;
            if (epd_requant_host(a->q, a->scales, &count, 1, 1, sh->hidden, EPD_SCALE_GROUP128,
                                 dest_s[r], a->qo, &big_s, err) != EPD_OK)
                acc_fail(a, "requantization", err);
            for (uint32_t i = 0; i < sh->hidden; i++) {
                a->x_in[i] = epd_e4m3_to_f32(a->qo[i]) * big_s;
                a->acc[i] = 0.0f;
            }
            for (uint32_t k = 0; k < sh->topk; k++)
                if ((uint32_t)ids[k] / per_rank == r)
                    a->experts->accumulate(sh, ids[k], w[k], a->x_in, a->acc);
            for (uint32_t i = 0; i < sh->hidden; i++)
                a->sum[i] = a->sum[i] + epd_bf16_to_f32(epd_f32_to_bf16(a->acc[i]));
        }
        for (uint32_t i = 0; i < sh->hidden; i++)
            a->y[(size_t)t * sh->hidden + i] = epd_f32_to_bf16(a->sum[i]);
    }
}

/* A step of the daemon's own path with mode's formats, on this rank's batch. */
static void step_mode(acc_ctx_t *a, epd_step_t *step)
{
    const epd_ops_t *ops = a->backend.ops;
    epd_ops_ctx_t *octx = a->backend.ops_ctx;
    const epd_step_io_t *io = epd_step_io(step);
    size_t xb = (size_t)a->tokens * a->base.hidden * 2, kb = (size_t)a->tokens * a->base.topk * 4;
    char err[EPD_ERR_LEN];

    if (ops->copy_to_ops(octx, io->x, a->x, xb) != EPD_OK ||
        ops->copy_to_ops(octx, io->topk_ids, a->ids, kb) != EPD_OK ||
        ops->copy_to_ops(octx, io->topk_weights, a->w, kb) != EPD_OK)
        acc_fail(a, "copying the inputs", ops->last_error ? ops->last_error(octx) : "");
    if (epd_step_run(step, a->tokens, io->x, io->topk_ids, io->topk_weights, io->y, NULL, err) !=
        EPD_OK)
        acc_fail(a, "step", err);
    if (ops->copy_to_host(octx, a->y, io->y, xb) != EPD_OK)
        acc_fail(a, "copying the outputs", ops->last_error ? ops->last_error(octx) : "");
}

/* Adds this step's y against ref to the tally. */
static void tally_step(const acc_ctx_t *a, acc_tally_t *tl)
{
    const epd_moe_shape_t *sh = &a->base;
    uint32_t per_rank = sh->num_experts / sh->world;
    for (uint32_t t = 0; t < a->tokens; t++) {
        double e2 = 0.0, r2 = 0.0;
        for (uint32_t i = 0; i < sh->hidden; i++) {
            double y = epd_bf16_to_f32(a->y[(size_t)t * sh->hidden + i]);
            double r = a->ref[(size_t)t * sh->hidden + i];
            double d = y - r;
            e2 += d * d;
            r2 += r * r;
            tl->sxy += y * r;
            tl->sxxyy += y * y + r * r;
            if (fabs(d) > tl->max_abs) tl->max_abs = fabs(d);
        }
        if (r2 > 0.0) tl->rel[tl->n_rel++] = sqrt(e2 / r2);
        for (uint32_t r = 0; r < sh->world; r++) {
            bool owns = false;
            for (uint32_t k = 0; k < sh->topk; k++)
                owns |= (uint32_t)a->ids[(size_t)t * sh->topk + k] / per_rank == r;
            tl->records += owns;
        }
    }
}

static int cmp_double(const void *x, const void *y)
{
    double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b;
}

/* Reduces a mode's tallies to rank 0 and prints its row there. */
static void report_mode(const acc_ctx_t *a, const acc_mode_t *mode, acc_tally_t *tl,
                        double bf16_bytes)
{
    double sums[3] = {tl->sxy, tl->sxxyy, tl->records}, all[3] = {0, 0, 0}, max_abs = 0.0;
    int n = (int)tl->n_rel, *counts = NULL, *displs = NULL, total = 0;
    double *rel = NULL;

    MPI_Reduce(sums, all, 3, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
    MPI_Reduce(&tl->max_abs, &max_abs, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (a->rank == 0) {
        counts = malloc((size_t)a->world * sizeof *counts);
        displs = malloc((size_t)a->world * sizeof *displs);
        if (counts == NULL || displs == NULL) acc_fail(a, "report", "out of memory");
    }
    MPI_Gather(&n, 1, MPI_INT, counts, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (a->rank == 0) {
        for (int r = 0; r < a->world; r++) {
            displs[r] = total;
            total += counts[r];
        }
        rel = malloc((size_t)(total > 0 ? total : 1) * sizeof *rel);
        if (rel == NULL) acc_fail(a, "report", "out of memory");
    }
    MPI_Gatherv(tl->rel, n, MPI_DOUBLE, rel, counts, displs, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    if (a->rank != 0) return;

    qsort(rel, (size_t)total, sizeof *rel, cmp_double);
    double med = total == 0 ? NAN
                 : total % 2 ? rel[total / 2]
                             : (rel[total / 2 - 1] + rel[total / 2]) / 2.0;
    int k99 = (int)ceil(0.99 * total);
    double p99 = total == 0 ? NAN : rel[(k99 > 0 ? k99 : 1) - 1];
    double max = total == 0 ? NAN : rel[total - 1];
    double calc_diff = all[1] > 0 ? 1.0 - 2.0 * all[0] / all[1] : NAN;
    double tokens = (double)a->tokens * a->iters * a->world;
    epd_moe_shape_t sh = a->base;
    sh.dtype = mode->dtype;
    sh.scale = mode->scale;
    sh.combine_dtype = mode->combine;
    epd_record_layout_t rec;
    epd_partial_layout_t pl;
    epd_record_layout(&sh, &rec);
    epd_partial_layout(&sh, &pl);
    double bytes = all[2] * (double)(rec.size + pl.size) / tokens;
    const char *dispatch = mode->dtype == EPD_WIRE_BF16 ? "bf16" : "fp8";
    const char *combine = mode->combine == EPD_COMBINE_FP8 ? "fp8" : "bf16";

    if (a->json) {
        printf("{\"accuracy\":\"%s\",\"tokens\":%.0f,\"dispatch\":\"%s\",\"combine\":\"%s\","
               "\"calc_diff\":%.6e,\"rel_l2\":{\"median\":%.6e,\"p99\":%.6e,\"max\":%.6e},"
               "\"max_abs_error\":%.6e,\"bytes_per_token\":%.1f,\"bytes_vs_bf16\":%.4f}\n",
               mode->name, tokens, dispatch, combine, calc_diff, med, p99, max, max_abs, bytes,
               bytes / bf16_bytes);
    } else {
        printf("| %s | %s | %s | %.2e | %.2e | %.2e | %.2e | %.3g | %.0f | %.3f |\n", mode->name,
               dispatch, combine, calc_diff, med, p99, max, max_abs, bytes, bytes / bf16_bytes);
    }
    fflush(stdout);
    free(counts);
    free(displs);
    free(rel);
}

/* The BF16 dispatch + BF16 combine bytes a token puts on the wire (the table's last column's
 * denominator), from the routing. */
static double bf16_bytes_per_token(const acc_ctx_t *a, double records, double tokens)
{
    epd_moe_shape_t sh = a->base;
    sh.dtype = EPD_WIRE_BF16;
    sh.combine_dtype = EPD_COMBINE_BF16;
    epd_record_layout_t rec;
    epd_partial_layout_t pl;
    epd_record_layout(&sh, &rec);
    epd_partial_layout(&sh, &pl);
    return records * (double)(rec.size + pl.size) / tokens;
}

/* Every mode at one size. */
static void accuracy_size(acc_ctx_t *a)
{
    const epd_moe_shape_t *sh = &a->base;
    size_t rows = (size_t)a->tokens * sh->hidden;
    acc_tally_t tally[N_MODES];
    epd_step_t *steps[N_MODES];
    float *dest_s = malloc(sh->world * sizeof *dest_s);
    float *static_dest = malloc(sh->world * sizeof *static_dest);
    float static_s = 0.0f;
    char err[EPD_ERR_LEN];

    memset(tally, 0, sizeof tally);
    a->x = malloc(rows * 2);
    a->y = malloc(rows * 2);
    a->ref = malloc(rows * sizeof *a->ref);
    a->ids = malloc((size_t)a->tokens * sh->topk * sizeof *a->ids);
    a->w = malloc((size_t)a->tokens * sh->topk * sizeof *a->w);
    if (dest_s == NULL || static_dest == NULL || a->x == NULL || a->y == NULL || a->ref == NULL ||
        a->ids == NULL || a->w == NULL)
        acc_fail(a, "inputs", "out of host memory (fewer --bench-tokens?)");
    for (size_t m = 0; m < N_MODES; m++) {
        tally[m].rel = malloc((size_t)a->tokens * a->iters * sizeof *tally[m].rel);
        if (tally[m].rel == NULL) acc_fail(a, "tallies", "out of host memory");
        steps[m] = NULL;
        if (modes[m].kind != MODE_STEP) continue;
        epd_moe_shape_t shape = *sh;
        shape.dtype = modes[m].dtype;
        shape.scale = modes[m].scale;
        shape.scale_format = modes[m].format;
        shape.combine_dtype = modes[m].combine;
        shape.quant_error = false;
        if (epd_step_create(&shape, a->tokens, a->backend.ops, a->backend.ops_ctx,
                            a->backend.transport, a->backend.transport_ctx, MPI_COMM_WORLD,
                            &steps[m], err) != EPD_OK)
            acc_fail(a, "step", err);
    }

    /* the static S: calibrated once, on a batch the study does not measure */
    make_batch(a, ACC_CALIBRATION + (uint64_t)a->rank * 7919u, a->x, a->ids, a->w);
    scale_maxima(a, NULL, &static_s);
    for (uint32_t r = 0; r < sh->world; r++) static_dest[r] = static_s;

    for (uint32_t it = 0; it < a->iters; it++) {
        make_batch(a, 0xacc00000ull + (uint64_t)a->rank * 1000003ull + (uint64_t)it * 7777777ull,
                   a->x, a->ids, a->w);
        fp32_reference(a);
        scale_maxima(a, dest_s, NULL);
        for (size_t m = 0; m < N_MODES; m++) {
            if (modes[m].kind == MODE_STEP) {
                step_mode(a, steps[m]);
            } else if (modes[m].kind == MODE_REQUANT_STEP) {
                requant_emulation(a, dest_s);
            } else {
                requant_emulation(a, static_dest);
            }
            tally_step(a, &tally[m]);
        }
    }

    double tokens = (double)a->tokens * a->iters * a->world, records = 0.0;
    MPI_Allreduce(&tally[0].records, &records, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    double bf16_bytes = bf16_bytes_per_token(a, records, tokens);
    if (a->rank == 0 && !a->json) {
        printf("\n%u tokens per rank x %u steps x %d ranks = %.0f tokens; static S = %.6g "
               "(calibrated on a separate batch)\n\n",
               a->tokens, a->iters, a->world, tokens, (double)static_s);
        printf("| mode | dispatch | combine | calc_diff | rel L2 median | rel L2 p99 | rel L2 max "
               "| max abs error | bytes/token | vs bf16 |\n");
        printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    }
    for (size_t m = 0; m < N_MODES; m++) report_mode(a, &modes[m], &tally[m], bf16_bytes);

    for (size_t m = 0; m < N_MODES; m++) {
        epd_step_destroy(steps[m]);
        free(tally[m].rel);
    }
    free(dest_s);
    free(static_dest);
    free(a->x);
    free(a->y);
    free(a->ref);
    free(a->ids);
    free(a->w);
}

static void print_warning(void *arg, const char *message)
{
    if (*(const int *)arg == 0) fprintf(stderr, "epd: warning: %s\n", message);
}

int epd_accuracy_run(const epd_args_t *args)
{
    acc_ctx_t a;
    epd_config_state_t *state = NULL;
    uint32_t sizes[ACC_MAX_SIZES];
    size_t n_sizes = 0;
    char err[EPD_ERR_LEN];
    MPI_Comm node;
    int local_rank = 0, rc = 2;

    memset(&a, 0, sizeof a);
    MPI_Comm_rank(MPI_COMM_WORLD, &a.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &a.world);
    /* settings and arguments are the same on every rank, so every rank fails the same way */
    if (epd_daemon_load_config(args, print_warning, &a.rank, &state, err) != EPD_OK) {
        if (a.rank == 0) fprintf(stderr, "epd: %s\n", err);
        return 2;
    }
    a.cfg = epd_config_get(state);
    a.json = args->json;
    a.iters = args->bench_iters ? args->bench_iters : ACC_DEFAULT_ITERS;
    if (epd_args_parse_token_list(args->bench_tokens ? args->bench_tokens : ACC_DEFAULT_TOKENS,
                                  sizes, ACC_MAX_SIZES, &n_sizes, err) != EPD_OK) {
        if (a.rank == 0) fprintf(stderr, "epd: --bench-tokens: %s\n", err);
        goto out_state;
    }
    if (epd_moe_experts_check(a.cfg->model.num_experts, (uint32_t)a.world, err) != EPD_OK) {
        if (a.rank == 0) fprintf(stderr, "epd: model.%s\n", err);
        goto out_state;
    }
    a.base = epd_moe_shape_from_config(a.cfg, (uint32_t)a.world, (uint32_t)a.rank);
    a.experts = epd_expert_ops_find(a.base.expert_kind);
    if (a.experts == NULL || a.experts->accumulate == NULL) {
        if (a.rank == 0)
            fprintf(stderr, "epd: experts.kind = %s has no host implementation to compute the "
                    "fp32 reference with\n",
                    epd_config_enum_name("experts.kind", a.cfg->experts.kind));
        goto out_state;
    }
    for (size_t i = 0; i < n_sizes; i++) {
        if (sizes[i] > a.cfg->dispatch.max_tokens_per_step) {
            if (a.rank == 0)
                fprintf(stderr, "epd: --bench-tokens %u is above dispatch.max_tokens_per_step = "
                        "%u\n", sizes[i], a.cfg->dispatch.max_tokens_per_step);
            goto out_state;
        }
    }
    uint32_t hidden = a.base.hidden;
    a.channel = malloc(hidden * sizeof *a.channel);
    a.x_in = malloc(hidden * sizeof *a.x_in);
    a.acc = malloc(hidden * sizeof *a.acc);
    a.sum = malloc(hidden * sizeof *a.sum);
    a.q = malloc(hidden);
    a.qo = malloc(hidden);
    a.scales = malloc((hidden / EPD_QUANT_GROUP) * sizeof *a.scales);
    if (a.channel == NULL || a.x_in == NULL || a.acc == NULL || a.sum == NULL || a.q == NULL ||
        a.qo == NULL || a.scales == NULL)
        acc_fail(&a, "set-up", "out of host memory");
    make_channels(hidden, a.channel);

    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &local_rank);
    MPI_Comm_size(node, &a.local_size);
    MPI_Comm_free(&node);
    if (epd_daemon_backend_open(a.cfg, MPI_COMM_WORLD, local_rank, a.local_size, &a.backend,
                                err) != EPD_OK)
        acc_fail(&a, "device and transport", err);

    if (a.rank == 0 && !a.json) {
        printf("epd accuracy: %d ranks, hidden %u, %u experts, top-%u, experts %s; ops %s, "
               "transport %s\n",
               a.world, hidden, a.base.num_experts, a.base.topk,
               epd_config_enum_name("experts.kind", a.cfg->experts.kind), a.backend.ops->name,
               a.backend.transport->name);
        printf("activations: per-channel scales log-uniform in [0.1, 1], %d channels x%.0f, a "
               "token in %d with %d spikes x%.0f, a token in %d x%.0f; reference: fp32 dispatch "
               "and fp32 expert sum\n",
               ACC_MASSIVE, (double)ACC_MASSIVE_GAIN, ACC_SPIKE_EVERY, ACC_SPIKES,
               (double)ACC_SPIKE_GAIN, ACC_LOUD_EVERY, (double)ACC_LOUD_GAIN);
        printf("requant modes: computed on the host (the op is not in the step's path); bytes "
               "count every destination's record and partial\n");
    }
    for (size_t i = 0; i < n_sizes; i++) {
        a.tokens = sizes[i];
        accuracy_size(&a);
    }
    epd_daemon_backend_close(&a.backend);
    rc = 0;
    free(a.channel);
    free(a.x_in);
    free(a.acc);
    free(a.sum);
    free(a.q);
    free(a.qo);
    free(a.scales);
out_state:
    epd_config_state_free(state);
    return rc;
}
