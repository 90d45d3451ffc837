/* `epd --accuracy`: every wire format against an fp32 dispatch of the same tokens.
 *
 * Activations are shaped like a real model's hidden states rather than uniform noise: per-channel
 * scales spread over an order of magnitude, a few "massive" channels 100x larger than the rest
 * (the same channels on every token, as in LLM residual streams), a token in 32 with a handful of
 * spikes 50x its channel, a token in 64 8x louder overall; BF16, seeded per rank and step. Routing
 * is uniform, distinct top-k experts with positive weights summing to 1 per token.
 *
 * The experts are those of experts.kind: the toy kinds, or ffn with weights generated at the
 * configured shape (--bench-weights: BF16 and/or FP8 block weights, expert e's from a seed of
 * its own, so they do not depend on the number of ranks) or loaded from experts.weights (the
 * first layer loaded is studied). The reference is an fp32 dispatch through the same experts:
 * each token's BF16 row sent unquantized, each destination's partial in fp32 (the experts' host
 * arithmetic), never rounded, summed in fp32 (daemon/accuracy_side.c). Each step mode runs the
 * daemon's own step (ops and transport of the configuration) with its dispatch and combine
 * formats; the requant modes (the per-tensor requantization DESIGN.md section 3 specifies for
 * experts that take one activation scale) are not in the step's path (no ops table entry calls
 * them: they serve the external experts' input), so the side path runs them: each destination
 * requantizes its received group128 records with epd_requant_host to its step S (the largest
 * scale it received) or a static S (the experts' input_scale when the checkpoint has one, else
 * calibrated once on a separate batch of the same distribution, which this batch's outliers may
 * exceed: they saturate), then the ops' own experts run on them.
 *
 * Per mode, over every token of every rank and step: calc_diff = 1 - 2 sum(xy) / sum(x^2 + y^2)
 * (DeepEP's check), the relative L2 error of each token ||y - ref|| / ||ref|| (median, p99, max),
 * the largest absolute error, and the bytes a token puts on the wire (records and partials, each
 * destination counted). */
#include "daemon/accuracy.h"

#include <math.h>
#include <mpi.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm/step.h"
#include "common/clock.h"
#include "common/parse.h"
#include "common/rng.h"
#include "daemon/accuracy_side.h"
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
#define ACC_CALIBRATION    0x5ca1eull /* seed of the static-S calibration batches */
#define ACC_CALIBRATION_TOKENS 2048   /* their tokens a rank, at least */
#define ACC_CALIBRATION_BATCH  128    /* tokens a calibration batch */
#define ACC_WEIGHT_SEED    0xacc3e1f5ull
#define ACC_INTERMEDIATE   2048 /* generated ffn weights without model.intermediate: V3's I */
#define ACC_MAX_THREADS    64

typedef enum {
    MODE_STEP = 0,       /* through epd_step_run */
    MODE_REQUANT_STATIC, /* group128 dispatch, requantized to a static S (side path) */
    MODE_REQUANT_STEP,   /* ... to the step S of the destination rank (side path) */
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

/* Where the experts of one table come from. */
typedef enum {
    WEIGHTS_NONE = 0,   /* the toy kinds */
    WEIGHTS_RANDOM_BF16,
    WEIGHTS_RANDOM_FP8,
    WEIGHTS_FILE,       /* experts.weights */
} weights_src_t;

/* One rank's run of the study. */
typedef struct acc_ctx {
    const epd_config_t *cfg;
    int rank, world, local_rank, local_size;
    uint32_t threads; /* of the host reference */
    epd_rank_backend_t backend;
    const epd_expert_ops_t *experts;
    bool json;
    uint32_t tokens, iters;
    epd_moe_shape_t base; /* the configuration's shape for this rank */
    float *channel;       /* [H] per-channel scale, the same on every rank */
    /* the experts of this table */
    weights_src_t src;
    epd_ffn_weights_t *ffn; /* this rank's ffn experts (host copy kept), or NULL */
    uint32_t layer;
    char label[64];         /* the table's experts: "scale", "ffn bf16", ... */
    /* one step's inputs (host) and outputs */
    uint16_t *x, *y;
    int32_t *ids;
    float *w;
    float *ref; /* [N, H] fp32 reference */
    uint8_t *q;
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

/* The calibrated static S, the way FP8 calibration tools observe an activation scale: over
 * ACC_CALIBRATION_TOKENS separate tokens a rank of the same distribution, in batches of
 * ACC_CALIBRATION_BATCH tokens, the mean over every rank's batches of each batch's largest
 * group128 scale (amax / 448): a moving-average min-max observer. The plain maximum over the
 * whole set would be set by its one most extreme outlier (a spike on a massive channel, 8x the
 * usual largest value), a coarse S for every ordinary token; the mean of batch maxima is what a
 * checkpoint's input_scale usually is, and the tail above it saturates. */
static float calibrated_scale(acc_ctx_t *a)
{
    const epd_moe_shape_t *sh = &a->base;
    uint32_t ns = sh->hidden / EPD_QUANT_GROUP, in_batch = 0;
    float batch_max = 0.0f;
    double local[2] = {0.0, 0.0}, all[2] = {0.0, 0.0}; /* sum of batch maxima, batches */

    for (uint32_t done = 0, b = 0; done < ACC_CALIBRATION_TOKENS; done += a->tokens, b++) {
        make_batch(a, ACC_CALIBRATION + (uint64_t)a->rank * 7919u + (uint64_t)b * 104729u, a->x,
                   a->ids, a->w);
        for (uint32_t t = 0; t < a->tokens; t++) {
            epd_quant_row_host(a->x + (size_t)t * sh->hidden, sh->hidden, EPD_SCALE_GROUP128,
                               EPD_SCALE_FMT_FP32, a->q, a->scales);
            for (uint32_t g = 0; g < ns; g++)
                batch_max = a->scales[g] > batch_max ? a->scales[g] : batch_max;
            if (++in_batch == ACC_CALIBRATION_BATCH) {
                local[0] += batch_max;
                local[1] += 1.0;
                batch_max = 0.0f;
                in_batch = 0;
            }
        }
    }
    MPI_Allreduce(local, all, 2, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    return (float)(all[0] / all[1]);
}

/* The static S of this rank's experts: their gate/up input_scale when the checkpoint has one
 * (the largest over the rank's experts, one scale for the rank's grouped GEMM), else 0. */
static float checkpoint_scale(const acc_ctx_t *a)
{
    const epd_ffn_layer_t *l = a->ffn ? epd_ffn_find_layer(a->ffn, a->layer) : NULL;
    float s = 0.0f;
    for (uint32_t e = 0; l != NULL && l->input_scale != NULL && e < a->ffn->n_local; e++)
        s = l->input_scale[(size_t)e * 2] > s ? l->input_scale[(size_t)e * 2] : s;
    return s;
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
        printf("{\"accuracy\":\"%s\",\"experts\":\"%s\",\"tokens\":%.0f,\"dispatch\":\"%s\","
               "\"combine\":\"%s\",\"calc_diff\":%.6e,\"rel_l2\":{\"median\":%.6e,\"p99\":%.6e,"
               "\"max\":%.6e},\"max_abs_error\":%.6e,\"bytes_per_token\":%.1f,"
               "\"bytes_vs_bf16\":%.4f}\n",
               mode->name, a->label, tokens, dispatch, combine, calc_diff, med, p99, max,
               max_abs, bytes, bytes / bf16_bytes);
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
    epd_acc_side_t *side = NULL;
    float static_s, s_range[2] = {INFINITY, 0.0f}; /* this rank's step S, min and max */
    uint64_t start = epd_now_ns();
    char err[EPD_ERR_LEN];

    memset(tally, 0, sizeof tally);
    a->x = malloc(rows * 2);
    a->y = malloc(rows * 2);
    a->ref = malloc(rows * sizeof *a->ref);
    a->ids = malloc((size_t)a->tokens * sh->topk * sizeof *a->ids);
    a->w = malloc((size_t)a->tokens * sh->topk * sizeof *a->w);
    if (a->x == NULL || a->y == NULL || a->ref == NULL || a->ids == NULL || a->w == NULL)
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
        epd_step_set_layer(steps[m], a->layer);
    }
    epd_acc_experts_t ex = {.shape = *sh, .kind = a->experts, .ffn = a->ffn, .layer = a->layer,
                            .ops = a->backend.ops, .ops_ctx = a->backend.ops_ctx,
                            .threads = a->threads, .comm = MPI_COMM_WORLD};
    ex.shape.layer = a->layer;
    if (epd_acc_side_create(&ex, a->tokens, &side, err) != EPD_OK) acc_fail(a, "side path", err);

    /* the static S: the checkpoint's, or calibrated once on a batch the study does not measure */
    float cal = calibrated_scale(a), own = checkpoint_scale(a), any_own = 0.0f;
    MPI_Allreduce(&own, &any_own, 1, MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD);
    static_s = own > 0.0f ? own : cal;

    for (uint32_t it = 0; it < a->iters; it++) {
        make_batch(a, 0xacc00000ull + (uint64_t)a->rank * 1000003ull + (uint64_t)it * 7777777ull,
                   a->x, a->ids, a->w);
        if (epd_acc_side_dispatch(side, a->tokens, a->x, a->ids, a->w, err) != EPD_OK ||
            epd_acc_side_reference(side, a->ref, err) != EPD_OK)
            acc_fail(a, "fp32 reference", err);
        for (size_t m = 0; m < N_MODES; m++) {
            float used = 0.0f;
            if (modes[m].kind == MODE_STEP) {
                step_mode(a, steps[m]);
            } else if (epd_acc_side_requant(side, modes[m].kind == MODE_REQUANT_STATIC
                                                      ? static_s : 0.0f,
                                            a->y, &used, err) != EPD_OK) {
                acc_fail(a, "requant", err);
            }
            if (modes[m].kind == MODE_REQUANT_STEP && used > 0.0f) {
                s_range[0] = used < s_range[0] ? used : s_range[0];
                s_range[1] = used > s_range[1] ? used : s_range[1];
            }
            tally_step(a, &tally[m]);
        }
    }

    double tokens = (double)a->tokens * a->iters * a->world, records = 0.0;
    float s_min = 0.0f, s_max = 0.0f;
    MPI_Allreduce(&tally[0].records, &records, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(&s_range[0], &s_min, 1, MPI_FLOAT, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(&s_range[1], &s_max, 1, MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD);
    double bf16_bytes = bf16_bytes_per_token(a, records, tokens);
    if (a->rank == 0 && !a->json) {
        printf("\n%s: %u tokens per rank x %u steps x %d ranks = %.0f tokens; static S = ",
               a->label, a->tokens, a->iters, a->world, tokens);
        if (any_own > 0.0f)
            printf("the experts' input_scale (up to %.6g)", (double)any_own);
        else
            printf("%.6g (calibrated: mean of the maxima of %d-token batches, %d separate "
                   "tokens a rank)", (double)cal, ACC_CALIBRATION_BATCH, ACC_CALIBRATION_TOKENS);
        printf("; step S %.6g to %.6g\n\n", (double)s_min, (double)s_max);
        printf("| mode | dispatch | combine | calc_diff | rel L2 median | rel L2 p99 | rel L2 max "
               "| max abs error | bytes/token | vs bf16 |\n");
        printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    }
    for (size_t m = 0; m < N_MODES; m++) report_mode(a, &modes[m], &tally[m], bf16_bytes);
    if (a->rank == 0 && !a->json)
        printf("\n(%s: %.1f s; host reference threads a rank: %u)\n", a->label,
               (double)(epd_now_ns() - start) / 1e9, a->threads);

    for (size_t m = 0; m < N_MODES; m++) {
        epd_step_destroy(steps[m]);
        free(tally[m].rel);
    }
    epd_acc_side_destroy(side);
    free(a->x);
    free(a->y);
    free(a->ref);
    free(a->ids);
    free(a->w);
}

static void *alloc64(size_t bytes)
{
    return aligned_alloc(64, bytes == 0 ? 64 : (bytes + 63) / 64 * 64);
}

/* Generates experts [lo, hi) of w (its layer 0 allocated), each from its own seed. */
typedef struct gen_job {
    epd_ffn_weights_t *w;
    uint32_t lo, hi;
    epd_status_t status;
    char err[EPD_ERR_LEN];
} gen_job_t;

static void *gen_experts(void *arg)
{
    gen_job_t *job = arg;
    epd_ffn_weights_t *w = job->w;
    epd_ffn_layer_t *l = &w->layers[0];
    uint32_t H = w->hidden, inter = w->intermediate;
    bool fp8 = w->format == EPD_FFN_FP8_BLOCK;
    size_t eb = fp8 ? 1 : 2;
    size_t gu = 2 * (size_t)inter * H * eb, dn = (size_t)H * inter * eb;
    size_t gus = 2 * (size_t)(inter / EPD_FFN_BLOCK) * (H / EPD_FFN_BLOCK), dns = gus / 2;

    for (uint32_t e = job->lo; e < job->hi; e++) {
        epd_ffn_weights_t *one = NULL;
        job->status = epd_ffn_random(w->format, H, inter, 1, 0, 1, 1,
                                     epd_rng_hash(ACC_WEIGHT_SEED + w->first_expert + e), &one,
                                     job->err);
        if (job->status != EPD_OK) return NULL;
        const epd_ffn_layer_t *o = &one->layers[0];
        memcpy((uint8_t *)l->gate_up + e * gu, o->gate_up, gu);
        memcpy((uint8_t *)l->down + e * dn, o->down, dn);
        if (fp8) {
            memcpy(l->gate_up_scale + e * gus, o->gate_up_scale, gus * sizeof(float));
            memcpy(l->down_scale + e * dns, o->down_scale, dns * sizeof(float));
        }
        epd_ffn_free(one);
    }
    return NULL;
}

/* This rank's experts with generated weights: expert e's from epd_ffn_random with a seed of its
 * own (so the same expert has the same weights whatever the number of ranks), one layer (0). */
static epd_status_t random_weights(const acc_ctx_t *a, epd_ffn_format_t format, uint32_t inter,
                                   epd_ffn_weights_t **w_p, char err[EPD_ERR_LEN])
{
    const epd_moe_shape_t *sh = &a->base;
    uint32_t per_rank = sh->num_experts / sh->world, first = sh->rank * per_rank;
    uint32_t H = sh->hidden;
    bool fp8 = format == EPD_FFN_FP8_BLOCK;
    size_t eb = fp8 ? 1 : 2;
    size_t gu = 2 * (size_t)inter * H * eb, dn = (size_t)H * inter * eb;
    size_t gus = 2 * (size_t)(inter / EPD_FFN_BLOCK) * (H / EPD_FFN_BLOCK), dns = gus / 2;
    epd_ffn_weights_t *w = calloc(1, sizeof *w);

    *w_p = NULL;
    if (w == NULL || (w->layers = calloc(1, sizeof *w->layers)) == NULL) goto no_memory;
    w->format = format;
    w->hidden = H;
    w->intermediate = inter;
    w->num_experts = sh->num_experts;
    w->first_expert = first;
    w->n_local = per_rank;
    w->n_layers = 1;
    w->local_bytes = (uint64_t)per_rank * (gu + dn + (fp8 ? (gus + dns) * sizeof(float) : 0));
    epd_ffn_layer_t *l = &w->layers[0];
    l->gate_up = alloc64(gu * per_rank);
    l->down = alloc64(dn * per_rank);
    if (l->gate_up == NULL || l->down == NULL) goto no_memory;
    if (fp8) {
        l->gate_up_scale = alloc64(gus * per_rank * sizeof(float));
        l->down_scale = alloc64(dns * per_rank * sizeof(float));
        if (l->gate_up_scale == NULL || l->down_scale == NULL) goto no_memory;
    }
    /* generating is seconds an expert at real shapes: the experts are split over the threads */
    uint32_t T = a->threads < per_rank ? a->threads : per_rank;
    gen_job_t jobs[ACC_MAX_THREADS];
    pthread_t tids[ACC_MAX_THREADS];
    uint32_t started = 0;
    for (uint32_t i = 0; i < T; i++)
        jobs[i] = (gen_job_t){.w = w, .lo = per_rank * i / T, .hi = per_rank * (i + 1) / T,
                              .status = EPD_OK};
    /* the calling thread takes the first share, and any a thread could not be started for */
    for (uint32_t i = 1; i < T && pthread_create(&tids[i], NULL, gen_experts, &jobs[i]) == 0; i++)
        started = i;
    for (uint32_t i = started + 1; i < T; i++) gen_experts(&jobs[i]);
    gen_experts(&jobs[0]);
    for (uint32_t i = 1; i <= started; i++) pthread_join(tids[i], NULL);
    for (uint32_t i = 0; i < T; i++) {
        if (jobs[i].status != EPD_OK) {
            snprintf(err, EPD_ERR_LEN, "%s", jobs[i].err);
            epd_ffn_free(w);
            return jobs[i].status;
        }
    }
    *w_p = w;
    return EPD_OK;

no_memory:
    epd_ffn_free(w);
    snprintf(err, EPD_ERR_LEN, "out of host memory for %u generated experts (%zu bytes)",
             per_rank, (gu + dn) * per_rank);
    return EPD_ERR_NO_MEMORY;
}

/* This rank's experts from experts.weights (experts.layers, or every layer of the file). */
static epd_status_t file_weights(const acc_ctx_t *a, epd_ffn_weights_t **w_p,
                                 char err[EPD_ERR_LEN])
{
    const epd_config_t *cfg = a->cfg;
    uint32_t per_rank = a->base.num_experts / a->base.world;
    uint32_t *layers = calloc(EPD_CONFIG_MAX_LAYERS, sizeof *layers);
    size_t n_layers = 0;
    char why[EPD_ERR_LEN];
    epd_status_t status;

    if (layers == NULL) {
        snprintf(err, EPD_ERR_LEN, "out of memory");
        return EPD_ERR_NO_MEMORY;
    }
    status = epd_parse_u32_list(cfg->experts.layers, EPD_CONFIG_MAX_LAYER, layers,
                                EPD_CONFIG_MAX_LAYERS, &n_layers, why);
    if (status != EPD_OK) {
        snprintf(err, EPD_ERR_LEN, "experts.layers: %.200s", why);
    } else {
        epd_ffn_spec_t spec = {.path = cfg->experts.weights, .layers = layers,
                               .n_layers = n_layers, .hidden = cfg->model.hidden,
                               .intermediate = cfg->model.intermediate,
                               .num_experts = cfg->model.num_experts,
                               .first_expert = a->base.rank * per_rank, .n_local = per_rank};
        status = epd_ffn_load(&spec, w_p, why);
        if (status != EPD_OK) snprintf(err, EPD_ERR_LEN, "experts.weights: %.230s", why);
    }
    free(layers);
    return status;
}

/* The experts of one table: weights made or loaded and given to the ops; the label. */
static void experts_open(acc_ctx_t *a, weights_src_t src)
{
    const epd_config_t *cfg = a->cfg;
    uint32_t inter = cfg->model.intermediate ? cfg->model.intermediate : ACC_INTERMEDIATE;
    char err[EPD_ERR_LEN], desc[256];
    epd_status_t status = EPD_OK;

    a->src = src;
    a->ffn = NULL;
    a->layer = 0;
    snprintf(a->label, sizeof a->label, "%s",
             epd_config_enum_name("experts.kind", cfg->experts.kind));
    snprintf(desc, sizeof desc, "the %s kind", a->label);
    if (src == WEIGHTS_NONE) goto out;
    if (src == WEIGHTS_FILE)
        status = file_weights(a, &a->ffn, err);
    else
        status = random_weights(a, src == WEIGHTS_RANDOM_FP8 ? EPD_FFN_FP8_BLOCK : EPD_FFN_BF16,
                                inter, &a->ffn, err);
    if (status != EPD_OK) acc_fail(a, "ffn experts", err);
    a->layer = a->ffn->layers[0].layer;
    if (a->backend.ops->experts_load == NULL) {
        snprintf(err, EPD_ERR_LEN, "the %s device ops cannot serve experts.kind = ffn",
                 a->backend.ops->name);
        acc_fail(a, "ffn experts", err);
    }
    if (a->backend.ops->experts_load(a->backend.ops_ctx, &a->base, a->ffn, err) != EPD_OK)
        acc_fail(a, "ffn experts", err);
    snprintf(a->label, sizeof a->label, "ffn %s", epd_ffn_format_name(a->ffn->format));
    if (src == WEIGHTS_FILE)
        snprintf(desc, sizeof desc, "ffn, %s weights from %.120s, layer %u (I %u)",
                 epd_ffn_format_name(a->ffn->format), cfg->experts.weights, a->layer,
                 a->ffn->intermediate);
    else
        snprintf(desc, sizeof desc, "ffn, %s weights generated (expert e from seed "
                 "hash(0x%llx + e)), I %u", epd_ffn_format_name(a->ffn->format),
                 (unsigned long long)ACC_WEIGHT_SEED, inter);
out:
    if (a->rank == 0 && !a->json)
        printf("\nexperts: %s; ops %s, transport %s\n", desc, a->backend.ops->name,
               a->backend.transport->name);
}

/* Threads of the host reference: the CPUs this rank may run on, shared with the node's other
 * ranks when it is not bound (mpirun --bind-to none), at least 1. */
static uint32_t reference_threads(int local_size)
{
    cpu_set_t set;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    long cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;

    if (cpus >= online && local_size > 1) cpus /= local_size;
    if (cpus < 1) cpus = 1;
    return cpus > ACC_MAX_THREADS ? ACC_MAX_THREADS : (uint32_t)cpus;
}

static void print_warning(void *arg, const char *message)
{
    if (*(const int *)arg == 0) fprintf(stderr, "epd: warning: %s\n", message);
}

/* The tables to make: one for the toy kinds; for ffn, one per generated weight format
 * (--bench-weights) or the file's. 0 with a sentence in err when the arguments do not fit. */
static size_t weight_sources(const acc_ctx_t *a, const epd_args_t *args, weights_src_t *srcs,
                             char err[EPD_ERR_LEN])
{
    size_t n = 0;
    if (!a->experts->weights) {
        if (args->bench_weights != NULL) {
            snprintf(err, EPD_ERR_LEN, "--bench-weights goes with experts.kind = ffn");
            return 0;
        }
        srcs[n++] = WEIGHTS_NONE;
        return n;
    }
    if (args->bench_weights != NULL) {
        if (strcmp(args->bench_weights, "random-fp8") != 0) srcs[n++] = WEIGHTS_RANDOM_BF16;
        if (strcmp(args->bench_weights, "random-bf16") != 0) srcs[n++] = WEIGHTS_RANDOM_FP8;
        return n;
    }
    if (a->cfg->experts.weights[0] != '\0') {
        srcs[n++] = WEIGHTS_FILE;
        return n;
    }
    snprintf(err, EPD_ERR_LEN, "experts.kind = ffn needs --bench-weights random|random-bf16|"
             "random-fp8 (generated weights) or experts.weights");
    return 0;
}

int epd_accuracy_run(const epd_args_t *args)
{
    acc_ctx_t a;
    epd_config_state_t *state = NULL;
    uint32_t sizes[ACC_MAX_SIZES];
    size_t n_sizes = 0, n_srcs = 0;
    weights_src_t srcs[2];
    char err[EPD_ERR_LEN];
    MPI_Comm node;
    int rc = 2;

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
    if (a.experts == NULL || (!a.experts->weights && a.experts->accumulate == NULL)) {
        if (a.rank == 0)
            fprintf(stderr, "epd: --accuracy has no host reference for experts.kind = %s\n",
                    epd_config_enum_name("experts.kind", a.cfg->experts.kind));
        goto out_state;
    }
    n_srcs = weight_sources(&a, args, srcs, err);
    if (n_srcs == 0) {
        if (a.rank == 0) fprintf(stderr, "epd: --accuracy: %s\n", err);
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
    a.q = malloc(hidden);
    a.scales = malloc((hidden / EPD_QUANT_GROUP) * sizeof *a.scales);
    if (a.channel == NULL || a.q == NULL || a.scales == NULL)
        acc_fail(&a, "set-up", "out of host memory");
    make_channels(hidden, a.channel);

    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &a.local_rank);
    MPI_Comm_size(node, &a.local_size);
    MPI_Comm_free(&node);
    a.threads = reference_threads(a.local_size);

    if (a.rank == 0 && !a.json) {
        printf("epd accuracy: %d ranks, hidden %u, %u experts, top-%u\n", a.world, hidden,
               a.base.num_experts, a.base.topk);
        printf("activations: per-channel scales log-uniform in [0.1, 1], %d channels x%.0f, a "
               "token in %d with %d spikes x%.0f, a token in %d x%.0f; reference: fp32 dispatch "
               "through the same experts, fp32 partials and sum\n",
               ACC_MASSIVE, (double)ACC_MASSIVE_GAIN, ACC_SPIKE_EVERY, ACC_SPIKES,
               (double)ACC_SPIKE_GAIN, ACC_LOUD_EVERY, (double)ACC_LOUD_GAIN);
        printf("requant modes: each destination requantizes the group128 records it receives "
               "(host epd_requant_host), then the ops' experts; bytes count every destination's "
               "record and partial\n");
    }
    for (size_t s = 0; s < n_srcs; s++) {
        /* a fresh ops context for each set of weights (experts_load is once per context) */
        if (epd_daemon_backend_open(a.cfg, MPI_COMM_WORLD, a.local_rank, a.local_size,
                                    &a.backend, err) != EPD_OK)
            acc_fail(&a, "device and transport", err);
        experts_open(&a, srcs[s]);
        for (size_t i = 0; i < n_sizes; i++) {
            a.tokens = sizes[i];
            accuracy_size(&a);
        }
        epd_daemon_backend_close(&a.backend);
        epd_ffn_free(a.ffn);
        a.ffn = NULL;
    }
    rc = 0;
    free(a.channel);
    free(a.q);
    free(a.scales);
out_state:
    epd_config_state_free(state);
    return rc;
}
