/* The host implementation of the device ops (gpu/ops.h): shape check, record layout, the host
 * expert kinds (one table each), routing layout, pack (quantizing for FP8), experts and combine
 * on host memory, plus epd_moe_reference, the single-process reference of DESIGN.md section 2
 * that every distributed result must equal bit for bit. The CPU fallback of the daemon runs
 * these; the CUDA ops must give the same bytes. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/fp8.h"
#include "gpu/ops.h"
#include "gpu/quant.h"

#define RECORD_ALIGN 16

/* Records why an op failed when there is a context to keep it in (tests call the ops without). */
#define OPS_ERR(ctx, ...)                                                  \
    do {                                                                   \
        if ((ctx) != NULL) snprintf((ctx)->err, EPD_ERR_LEN, __VA_ARGS__); \
    } while (0)

struct epd_ops_ctx {
    int device_id; /* kept for symmetry with the CUDA ops; unused */
    const epd_ffn_weights_t *ffn; /* the caller's, from experts_load; NULL until then */
    epd_quant_error_t quant_error; /* telemetry sums since the last quant_error_take */
    char err[EPD_ERR_LEN];
};

/* Host "events" are always complete: every host op and copy is synchronous. */
struct epd_ops_event {
    int unused;
};

/* ---- expert kinds ------------------------------------------------------------------------ */

static void identity_accumulate(const epd_moe_shape_t *shape, int32_t e, float w, const float *x,
                                float *acc)
{
    for (uint32_t i = 0; i < shape->hidden; i++) {
        float wy = w * x[i];
        acc[i] = acc[i] + wy;
    }
}

static float identity_element(const epd_moe_shape_t *shape, int32_t e, float x)
{
    return x;
}

/* The factor of DESIGN.md section 9: f_e = 1 + e/E (fp32). */
static inline float scale_factor(const epd_moe_shape_t *shape, int32_t e)
{
    return 1.0f + (float)e / (float)shape->num_experts;
}

static void scale_accumulate(const epd_moe_shape_t *shape, int32_t e, float w, const float *x,
                             float *acc)
{
    float f = scale_factor(shape, e);

    for (uint32_t i = 0; i < shape->hidden; i++) {
        float y = x[i] * f;
        float wy = w * y;
        acc[i] = acc[i] + wy;
    }
}

static float scale_element(const epd_moe_shape_t *shape, int32_t e, float x)
{
    return x * scale_factor(shape, e);
}

static const epd_expert_ops_t expert_kinds[] = {
    {
        .name = "identity",
        .kind = EPD_EXPERTS_IDENTITY,
        .accumulate = identity_accumulate,
        .element = identity_element,
    },
    {
        .name = "scale",
        .kind = EPD_EXPERTS_SCALE,
        .accumulate = scale_accumulate,
        .element = scale_element,
    },
    {
        .name = "ffn",
        .kind = EPD_EXPERTS_FFN,
        .weights = true,
    },
    {
        .name = "external",
        .kind = EPD_EXPERTS_EXTERNAL,
        .external = true,
    },
};

const epd_expert_ops_t *epd_expert_ops_find(epd_expert_kind_t kind)
{
    for (size_t i = 0; i < EPD_ARRAY_SIZE(expert_kinds); i++)
        if (expert_kinds[i].kind == kind) return &expert_kinds[i];
    return NULL;
}

const epd_expert_ops_t *epd_expert_ops_find_name(const char *name)
{
    if (name == NULL) return NULL;
    for (size_t i = 0; i < EPD_ARRAY_SIZE(expert_kinds); i++)
        if (strcmp(expert_kinds[i].name, name) == 0) return &expert_kinds[i];
    return NULL;
}

/* ---- shape and records ------------------------------------------------------------------- */

epd_status_t epd_moe_experts_check(uint32_t num_experts, uint32_t world, char err[EPD_ERR_LEN])
{
    if (world == 0) {
        snprintf(err, EPD_ERR_LEN, "no ranks to own the %u experts", num_experts);
        return EPD_ERR_INVALID_ARG;
    }
    if (num_experts % world != 0) {
        snprintf(err, EPD_ERR_LEN,
                 "num_experts = %u is not a multiple of the %u ranks (each rank owns E/W experts)",
                 num_experts, world);
        return EPD_ERR_INVALID_ARG;
    }
    return EPD_OK;
}

epd_status_t epd_moe_shape_check(const epd_moe_shape_t *shape, char err[EPD_ERR_LEN])
{
    const char *problem = NULL;

    if (shape == NULL) {
        snprintf(err, EPD_ERR_LEN, "no shape");
        return EPD_ERR_INVALID_ARG;
    }
    if (shape->hidden == 0 || shape->hidden % EPD_QUANT_GROUP != 0) {
        snprintf(err, EPD_ERR_LEN, "hidden = %u is not a positive multiple of %d", shape->hidden,
                 EPD_QUANT_GROUP);
        return EPD_ERR_INVALID_ARG;
    }
    if (shape->topk == 0)
        problem = "topk is 0";
    else if (shape->num_experts == 0)
        problem = "num_experts is 0";
    else if (shape->world == 0)
        problem = "no ranks";
    else if (shape->dtype != EPD_WIRE_FP8 && shape->dtype != EPD_WIRE_BF16)
        problem = "unknown dtype";
    else if (shape->scale != EPD_SCALE_GROUP128 && shape->scale != EPD_SCALE_PER_TOKEN)
        problem = "unknown scale kind";
    else if (shape->scale_format != EPD_SCALE_FMT_FP32 &&
             shape->scale_format != EPD_SCALE_FMT_UE8M0)
        problem = "unknown scale format";
    else if (epd_expert_ops_find(shape->expert_kind) == NULL)
        problem = "unknown expert kind";
    else if (shape->combine_dtype != EPD_COMBINE_BF16 && shape->combine_dtype != EPD_COMBINE_FP8)
        problem = "unknown combine dtype";
    if (problem != NULL) {
        snprintf(err, EPD_ERR_LEN, "%s", problem);
        return EPD_ERR_INVALID_ARG;
    }
    if (shape->rank >= shape->world) {
        snprintf(err, EPD_ERR_LEN, "rank %u is not below the %u ranks", shape->rank, shape->world);
        return EPD_ERR_INVALID_ARG;
    }
    return epd_moe_experts_check(shape->num_experts, shape->world, err);
}

void epd_record_layout(const epd_moe_shape_t *shape, epd_record_layout_t *layout_p)
{
    epd_record_layout_t l;
    size_t off = 0;

    memset(&l, 0, sizeof l);
    l.payload = 0;
    if (shape->dtype == EPD_WIRE_FP8) {
        off = shape->hidden;
        l.n_scales = shape->scale == EPD_SCALE_PER_TOKEN ? 1 : shape->hidden / EPD_QUANT_GROUP;
    } else {
        off = (size_t)shape->hidden * 2;
        l.n_scales = 0;
    }
    /* hidden is a multiple of 128, so every field below is naturally aligned */
    l.scales = off;
    off += l.n_scales * sizeof(float);
    l.ids = off;
    off += (size_t)shape->topk * sizeof(int32_t);
    l.weights = off;
    off += (size_t)shape->topk * sizeof(float);
    l.src = off;
    off += sizeof(uint32_t);
    l.size = (off + RECORD_ALIGN - 1) / RECORD_ALIGN * RECORD_ALIGN;
    *layout_p = l;
}

/* Every e4m3 code's value (epd_e4m3_to_f32), filled before main: the telemetry decodes each
 * quantized element once more, and a table keeps that cheaper than the quantization. */
static float e4m3_values[256];

__attribute__((constructor)) static void e4m3_values_fill(void)
{
    for (int c = 0; c < 256; c++) e4m3_values[c] = epd_e4m3_to_f32((uint8_t)c);
}

void epd_partial_layout(const epd_moe_shape_t *shape, epd_partial_layout_t *layout_p)
{
    epd_partial_layout_t l;

    memset(&l, 0, sizeof l);
    if (shape->combine_dtype == EPD_COMBINE_FP8) {
        l.scales = shape->hidden;
        l.n_scales = shape->hidden / EPD_QUANT_GROUP;
    } else {
        l.scales = (size_t)shape->hidden * 2;
        l.n_scales = 0;
    }
    l.size = (l.scales + l.n_scales * sizeof(float) + RECORD_ALIGN - 1) / RECORD_ALIGN *
             RECORD_ALIGN;
    *layout_p = l;
}

void epd_partial_store_host(const epd_moe_shape_t *shape, const float *acc, uint8_t *out,
                            double *error_p)
{
    uint32_t hidden = shape->hidden;
    epd_partial_layout_t pl;

    epd_partial_layout(shape, &pl);
    if (shape->combine_dtype != EPD_COMBINE_FP8) {
        for (uint32_t i = 0; i < hidden; i++) {
            uint16_t h = epd_f32_to_bf16(acc[i]);
            memcpy(out + (size_t)i * 2, &h, 2);
        }
        memset(out + pl.scales, 0, pl.size - pl.scales);
        return;
    }
    for (uint32_t g = 0; g < pl.n_scales; g++) {
        size_t off = (size_t)g * EPD_QUANT_GROUP;
        float scale;
        /* the dispatch's own quantization of one group: group128, fp32 scale */
        epd_quant_row_f32_host(acc + off, EPD_QUANT_GROUP, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32,
                               out + off, &scale);
        memcpy(out + pl.scales + g * sizeof(float), &scale, sizeof scale);
        if (error_p != NULL) {
            float e2 = 0.0f, r2 = 0.0f;
            for (uint32_t i = 0; i < EPD_QUANT_GROUP; i++) {
                float d = acc[off + i] - e4m3_values[out[off + i]] * scale;
                e2 = e2 + d * d;
                r2 = r2 + acc[off + i] * acc[off + i];
            }
            error_p[0] += e2;
            error_p[1] += r2;
        }
    }
    size_t end = pl.scales + pl.n_scales * sizeof(float);
    memset(out + end, 0, pl.size - end);
}

void epd_partial_add_host(const epd_moe_shape_t *shape, const uint8_t *p, float *acc)
{
    uint32_t hidden = shape->hidden;

    if (shape->combine_dtype != EPD_COMBINE_FP8) {
        for (uint32_t i = 0; i < hidden; i++) {
            uint16_t h;
            memcpy(&h, p + (size_t)i * 2, 2);
            acc[i] = acc[i] + epd_bf16_to_f32(h);
        }
        return;
    }
    for (uint32_t g = 0; g < hidden / EPD_QUANT_GROUP; g++) {
        float scale;
        memcpy(&scale, p + hidden + g * sizeof(float), sizeof scale);
        for (uint32_t i = g * EPD_QUANT_GROUP; i < (g + 1) * EPD_QUANT_GROUP; i++)
            acc[i] = acc[i] + epd_e4m3_to_f32(p[i]) * scale;
    }
}

/* Checks what every op relies on; the daemon validates the same at start-up. */
static epd_status_t host_fail(epd_ops_ctx_t *ctx, epd_status_t status, const char *why)
{
    OPS_ERR(ctx, "host ops: %s", why);
    return status;
}

#define BAD_ARGS(ctx, op) \
    host_fail(ctx, EPD_ERR_INVALID_ARG, op ": a shape it cannot serve or a missing buffer")
#define NO_MEMORY(ctx, op) host_fail(ctx, EPD_ERR_NO_MEMORY, op ": out of host memory")
#define BAD_SLOT(ctx, op) \
    host_fail(ctx, EPD_ERR_INVALID_ARG, op ": a slot points past the layout's records")

static bool shape_ok(const epd_moe_shape_t *shape)
{
    char err[EPD_ERR_LEN];

    return epd_moe_shape_check(shape, err) == EPD_OK;
}

static epd_status_t host_init(int device_id, epd_ops_ctx_t **ctx_p, char err[EPD_ERR_LEN])
{
    epd_ops_ctx_t *ctx = calloc(1, sizeof *ctx);

    if (ctx == NULL) {
        snprintf(err, EPD_ERR_LEN, "host ops: out of memory");
        return EPD_ERR_NO_MEMORY;
    }
    ctx->device_id = device_id;
    *ctx_p = ctx;
    return EPD_OK;
}

static void host_fini(epd_ops_ctx_t *ctx)
{
    free(ctx);
}

/* 64-byte aligned so records and rows start on cache lines; NULL for 0 bytes is avoided so a
 * step with nothing to hold still gets a valid pointer. */
static void *host_alloc(epd_ops_ctx_t *ctx, size_t bytes)
{
    size_t rounded = (bytes + 63) / 64 * 64;

    if (rounded < bytes) return NULL;
    return aligned_alloc(64, rounded == 0 ? 64 : rounded);
}

static void host_free(epd_ops_ctx_t *ctx, void *ptr)
{
    free(ptr);
}

static epd_status_t host_copy(epd_ops_ctx_t *ctx, void *dst, const void *src, size_t bytes)
{
    if (bytes == 0) return EPD_OK;
    if (dst == NULL || src == NULL) return EPD_ERR_INVALID_ARG;
    memmove(dst, src, bytes);
    return EPD_OK;
}

static epd_status_t host_sync(epd_ops_ctx_t *ctx)
{
    return EPD_OK;
}

/* Host ops run in order as they are called: the queued copy is done at once. */
static epd_status_t host_copy_queued(epd_ops_ctx_t *ctx, void *dst, const void *src, size_t bytes)
{
    if (bytes > 0) memcpy(dst, src, bytes);
    return EPD_OK;
}

epd_status_t epd_layout_host(const epd_moe_shape_t *shape, uint32_t n, const int32_t *topk_ids,
                             int32_t *slot_all, uint32_t *send_counts, uint32_t *send_offsets,
                             uint32_t *expert_counts, uint32_t *n_send_p, char err[EPD_ERR_LEN])
{
    uint32_t world = shape->world, per_rank = shape->num_experts / world, k_count = shape->topk;
    uint32_t num_experts = shape->num_experts;
    uint32_t rank_stack[1024], next_stack[256];
    uint64_t mask_stack[512];
    bool seen[256];
    /* rank_of: each expert's owner (a table: a division per id cost microseconds at 128
     * tokens); masks: each token's destinations as bits, with world <= 64 */
    uint32_t *rank_of = rank_stack, *next = next_stack;
    uint64_t *masks = mask_stack;
    bool *dest = seen;
    const bool narrow = world <= 64;
    epd_status_t status = EPD_OK;

    if (num_experts > EPD_ARRAY_SIZE(rank_stack)) rank_of = malloc(num_experts * sizeof *rank_of);
    if (narrow && n > EPD_ARRAY_SIZE(mask_stack)) masks = malloc((size_t)n * sizeof *masks);
    if (world > EPD_ARRAY_SIZE(seen)) {
        dest = malloc(world * sizeof *dest);
        next = malloc(world * sizeof *next);
    }
    if (rank_of == NULL || masks == NULL || dest == NULL || next == NULL) {
        snprintf(err, EPD_ERR_LEN, "layout: out of memory");
        status = EPD_ERR_NO_MEMORY;
        goto out;
    }
    for (uint32_t r = 0; r < world; r++)
        for (uint32_t j = 0; j < per_rank; j++) rank_of[r * per_rank + j] = r;

    /* first pass: validate ids and count records per destination (and tokens per expert) */
    memset(send_counts, 0, world * sizeof(uint32_t));
    if (expert_counts != NULL) memset(expert_counts, 0, num_experts * sizeof(uint32_t));
    for (uint32_t t = 0; t < n; t++) {
        const int32_t *ids = topk_ids + (size_t)t * k_count;
        uint64_t mask = 0;
        for (uint32_t k = 0; k < k_count; k++) {
            int32_t id = ids[k];
            if ((uint32_t)id + 1u > num_experts) { /* not in [-1, E) */
                snprintf(err, EPD_ERR_LEN, "layout: expert id %d of token %u is outside [0, %u)",
                         id, t, num_experts);
                status = EPD_ERR_EXPERT_OUT_OF_RANGE;
                goto out;
            }
            if (id < 0) continue;
            if (narrow) mask |= 1ull << rank_of[id];
            if (expert_counts != NULL) expert_counts[id]++;
        }
        if (narrow) {
            masks[t] = mask;
            for (; mask != 0; mask &= mask - 1) send_counts[__builtin_ctzll(mask)]++;
        } else {
            memset(dest, 0, world * sizeof *dest);
            for (uint32_t k = 0; k < k_count; k++)
                if (ids[k] >= 0) dest[rank_of[ids[k]]] = true;
            for (uint32_t r = 0; r < world; r++) send_counts[r] += dest[r];
        }
    }
    uint32_t total = 0;
    for (uint32_t r = 0; r < world; r++) {
        send_offsets[r] = total;
        total += send_counts[r];
    }
    *n_send_p = total;

    /* second pass: record indices, in token order within each destination's group */
    memcpy(next, send_offsets, world * sizeof *next);
    for (uint32_t t = 0; t < n; t++) {
        const int32_t *ids = topk_ids + (size_t)t * k_count;
        int32_t *slot = slot_all + (size_t)t * world;
        if (narrow) {
            for (uint32_t r = 0; r < world; r++)
                slot[r] = (masks[t] >> r) & 1u ? (int32_t)next[r]++ : -1;
        } else {
            memset(dest, 0, world * sizeof *dest);
            for (uint32_t k = 0; k < k_count; k++)
                if (ids[k] >= 0) dest[rank_of[ids[k]]] = true;
            for (uint32_t r = 0; r < world; r++) slot[r] = dest[r] ? (int32_t)next[r]++ : -1;
        }
    }
out:
    if (rank_of != rank_stack) free(rank_of);
    if (masks != mask_stack) free(masks);
    if (dest != seen) free(dest);
    if (next != next_stack) free(next);
    return status;
}

static epd_status_t host_layout(epd_ops_ctx_t *ctx, const epd_moe_shape_t *shape,
                                const int32_t *topk_ids, epd_step_layout_t *layout)
{
    char err[EPD_ERR_LEN];

    if (!shape_ok(shape) || layout == NULL || layout->send_counts_host == NULL ||
        layout->send_offsets_host == NULL ||
        (layout->n_tokens > 0 && (topk_ids == NULL || layout->slot == NULL)))
        return BAD_ARGS(ctx, "layout");
    epd_status_t status = epd_layout_host(shape, layout->n_tokens, topk_ids, layout->slot,
                                          layout->send_counts_host, layout->send_offsets_host,
                                          layout->expert_counts_host, &layout->n_send, err);
    if (status == EPD_ERR_EXPERT_OUT_OF_RANGE) OPS_ERR(ctx, "%s", err);
    if (status == EPD_ERR_NO_MEMORY) return NO_MEMORY(ctx, "layout");
    return status;
}

/* The host layout is complete when host_layout returns. */
static epd_status_t host_layout_counts(epd_ops_ctx_t *ctx, const epd_moe_shape_t *shape,
                                       epd_step_layout_t *layout)
{
    if (!shape_ok(shape) || layout == NULL) return BAD_ARGS(ctx, "layout_counts");
    return EPD_OK;
}

/* Telemetry of one packed token: its error counted once per record it went into. Sums in fp32
 * per group of 128, then in double. */
static void add_row_error(const epd_moe_shape_t *shape, const uint16_t *row, const uint8_t *q,
                          const float *scales, uint32_t n_records, epd_quant_error_t *error)
{
    double e2 = 0.0, r2 = 0.0;

    for (uint32_t g = 0; g < shape->hidden / EPD_QUANT_GROUP; g++) {
        float s = shape->scale == EPD_SCALE_PER_TOKEN ? scales[0] : scales[g];
        float ge = 0.0f, gr = 0.0f;
        for (uint32_t i = g * EPD_QUANT_GROUP; i < (g + 1) * EPD_QUANT_GROUP; i++) {
            float x = epd_bf16_to_f32(row[i]);
            float d = x - e4m3_values[q[i]] * s;
            ge = ge + d * d;
            gr = gr + x * x;
        }
        e2 += ge;
        r2 += gr;
    }
    error->dispatch_err2 += e2 * n_records;
    error->dispatch_ref2 += r2 * n_records;
}

static epd_status_t host_pack(epd_ops_ctx_t *ctx, const epd_moe_shape_t *shape, const uint16_t *x,
                              const int32_t *topk_ids, const float *topk_weights,
                              const epd_step_layout_t *layout, void *send_buf)
{
    epd_record_layout_t rec;
    uint8_t *q = NULL;
    float *scales = NULL;
    uint32_t world, hidden, k_count;

    if (!shape_ok(shape) || layout == NULL) return BAD_ARGS(ctx, "pack");
    if (layout->n_tokens == 0) return EPD_OK;
    if (x == NULL || topk_ids == NULL || topk_weights == NULL || layout->slot == NULL ||
        (layout->n_send > 0 && send_buf == NULL))
        return BAD_ARGS(ctx, "pack");
    /* host memory is ops memory: the slots made on the host are the layout's slots */
    if (layout->slot_src_host != NULL && layout->slot_src_host != layout->slot)
        memcpy(layout->slot, layout->slot_src_host,
               (size_t)layout->n_tokens * shape->world * sizeof(int32_t));
    epd_record_layout(shape, &rec);
    world = shape->world;
    hidden = shape->hidden;
    k_count = shape->topk;
    if (shape->dtype == EPD_WIRE_FP8) {
        q = malloc(hidden);
        scales = malloc((rec.n_scales > 0 ? rec.n_scales : 1) * sizeof *scales);
        if (q == NULL || scales == NULL) {
            free(q);
            free(scales);
            return NO_MEMORY(ctx, "pack");
        }
    }

    for (uint32_t t = 0; t < layout->n_tokens; t++) {
        const uint16_t *row = x + (size_t)t * hidden;
        const int32_t *slot = layout->slot + (size_t)t * world;
        bool quantized = false;
        uint32_t n_dst = 0;
        for (uint32_t r = 0; r < world; r++) {
            if (slot[r] < 0) continue;
            if ((uint32_t)slot[r] >= layout->n_send) {
                free(q);
                free(scales);
                return BAD_SLOT(ctx, "pack");
            }
            uint8_t *out = (uint8_t *)send_buf + (size_t)slot[r] * rec.size;
            if (shape->dtype == EPD_WIRE_FP8) {
                /* one quantization per token, copied to each of its destinations */
                if (!quantized) {
                    epd_quant_row_host(row, hidden, shape->scale, shape->scale_format, q, scales);
                    quantized = true;
                }
                memcpy(out + rec.payload, q, hidden);
                memcpy(out + rec.scales, scales, rec.n_scales * sizeof(float));
                if (layout->scale_max_host != NULL)
                    for (size_t g = 0; g < rec.n_scales; g++)
                        if (scales[g] > layout->scale_max_host[r])
                            layout->scale_max_host[r] = scales[g];
            } else {
                memcpy(out + rec.payload, row, (size_t)hidden * 2);
            }
            memcpy(out + rec.ids, topk_ids + (size_t)t * k_count, k_count * sizeof(int32_t));
            memcpy(out + rec.weights, topk_weights + (size_t)t * k_count, k_count * sizeof(float));
            memcpy(out + rec.src, &t, sizeof t);
            /* padding is zeroed so records are the same bytes on every implementation */
            memset(out + rec.src + sizeof t, 0, rec.size - rec.src - sizeof t);
            n_dst++;
        }
        if (quantized && shape->quant_error && ctx != NULL)
            add_row_error(shape, row, q, scales, n_dst, &ctx->quant_error);
    }
    free(q);
    free(scales);
    return EPD_OK;
}

/* One record's partial: acc = 0; for k ascending with a local expert, acc = acc + w_k * y with
 * y = expert_e(x') (a multiply, then an add: -ffp-contract=off keeps them apart). x_in is the
 * dequantized or widened payload; acc is scratch of hidden floats. */
static void partial_row(const epd_moe_shape_t *shape, const epd_expert_ops_t *experts,
                        uint32_t rank, const float *x_in, const int32_t *ids,
                        const float *weights, float *acc, uint8_t *partial, double *error_p)
{
    uint32_t hidden = shape->hidden;
    uint32_t per_rank = shape->num_experts / shape->world;
    int32_t lo = (int32_t)(rank * per_rank), hi = (int32_t)((rank + 1) * per_rank);

    for (uint32_t i = 0; i < hidden; i++) acc[i] = 0.0f;
    for (uint32_t k = 0; k < shape->topk; k++) {
        int32_t e = ids[k];
        float w = weights[k];
        if (e == -1 || e < lo || e >= hi) continue;
        experts->accumulate(shape, e, w, x_in, acc);
    }
    epd_partial_store_host(shape, acc, partial, error_p);
}

/* ---- ffn experts on the host ------------------------------------------------------------ */

/* Scratch of one ffn record: the row as the experts see it and one expert's output. */
typedef struct ffn_scratch {
    float *x;      /* [H] BF16 numbers as fp32 (BF16 weights) */
    uint8_t *q;    /* [H] e4m3 (FP8 weights) */
    float *scales; /* [H/128] */
    float *y;      /* [H] */
    float *work;   /* epd_ffn_scratch_floats */
} ffn_scratch_t;

static void ffn_scratch_free(ffn_scratch_t *s)
{
    free(s->x);
    free(s->q);
    free(s->scales);
    free(s->y);
    free(s->work);
}

static bool ffn_scratch_alloc(const epd_ffn_weights_t *w, ffn_scratch_t *s)
{
    s->x = malloc((size_t)w->hidden * sizeof *s->x);
    s->q = malloc(w->hidden);
    s->scales = malloc((size_t)w->hidden / EPD_QUANT_GROUP * sizeof *s->scales);
    s->y = malloc((size_t)w->hidden * sizeof *s->y);
    s->work = malloc(epd_ffn_scratch_floats(w) * sizeof *s->work);
    if (s->x && s->q && s->scales && s->y && s->work) return true;
    ffn_scratch_free(s);
    return false;
}

/* The row an ffn expert sees (DESIGN.md section 9), from the dispatched payload: with BF16
 * weights, BF16 values (FP8 payloads dequantized and rounded to BF16); with FP8 weights, e4m3
 * bytes and group128 scales (a per-token scale repeated over the groups; a BF16 payload quantized
 * group128 with fp32 scales as dispatch would). payload_q/scales: the FP8 payload, or
 * payload_bf16 the BF16 one (host memory, any alignment). */
static void ffn_row_from_payload(const epd_moe_shape_t *shape, const epd_ffn_weights_t *w,
                                 const uint8_t *payload, const float *payload_scales,
                                 ffn_scratch_t *s, epd_ffn_row_t *row)
{
    uint32_t H = shape->hidden, n_groups = H / EPD_QUANT_GROUP;
    bool fp8_wire = shape->dtype == EPD_WIRE_FP8;

    memset(row, 0, sizeof *row);
    if (w->format == EPD_FFN_BF16) {
        for (uint32_t i = 0; i < H; i++) {
            if (fp8_wire) {
                uint32_t g = shape->scale == EPD_SCALE_PER_TOKEN ? 0 : i / EPD_QUANT_GROUP;
                float sc = payload_scales[g];
                s->x[i] = epd_bf16_to_f32(epd_f32_to_bf16(epd_e4m3_to_f32(payload[i]) * sc));
            } else {
                uint16_t h;
                memcpy(&h, payload + (size_t)i * 2, 2);
                s->x[i] = epd_bf16_to_f32(h);
            }
        }
        row->x = s->x;
        return;
    }
    if (fp8_wire) {
        memcpy(s->q, payload, H);
        for (uint32_t g = 0; g < n_groups; g++)
            s->scales[g] = shape->scale == EPD_SCALE_PER_TOKEN ? payload_scales[0]
                                                               : payload_scales[g];
    } else {
        uint16_t *bf = (uint16_t *)s->y; /* y is free until the expert runs: H floats >= H bf16 */
        memcpy(bf, payload, (size_t)H * 2);
        epd_quant_row_host(bf, H, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, s->q, s->scales);
    }
    row->q = s->q;
    row->scales = s->scales;
}

/* One record's ffn partial: acc = 0; for k ascending with a local expert, acc = acc + w_k * y
 * with y = expert_{e_k}(row); stored by epd_partial_store_host (bf16, or FP8 group128 with
 * combine.dtype fp8; error_p as there). e - first is the expert's index in w. */
static void ffn_partial_row(const epd_moe_shape_t *shape, const epd_ffn_weights_t *w,
                            const epd_ffn_layer_t *layer, uint32_t rank, const epd_ffn_row_t *row,
                            const int32_t *ids, const float *weights, ffn_scratch_t *s,
                            float *acc, uint8_t *partial, double *error_p)
{
    uint32_t hidden = shape->hidden;
    uint32_t per_rank = shape->num_experts / shape->world;
    int32_t lo = (int32_t)(rank * per_rank), hi = (int32_t)((rank + 1) * per_rank);

    for (uint32_t i = 0; i < hidden; i++) acc[i] = 0.0f;
    for (uint32_t k = 0; k < shape->topk; k++) {
        int32_t e = ids[k];
        float wk = weights[k];
        if (e == -1 || e < lo || e >= hi) continue;
        epd_ffn_expert_host(w, layer, (uint32_t)e - w->first_expert, row, s->work, s->y);
        for (uint32_t i = 0; i < hidden; i++) {
            float wy = wk * s->y[i];
            acc[i] = acc[i] + wy;
        }
    }
    epd_partial_store_host(shape, acc, partial, error_p);
}

/* The ffn weights fit shape on rank: same H, the rank's experts all present. */
static bool ffn_fits(const epd_moe_shape_t *shape, const epd_ffn_weights_t *w, uint32_t rank,
                     char err[EPD_ERR_LEN])
{
    uint32_t per_rank = shape->num_experts / shape->world;

    if (w->hidden != shape->hidden || w->num_experts != shape->num_experts ||
        w->first_expert > rank * per_rank ||
        w->first_expert + w->n_local < (rank + 1) * per_rank) {
        snprintf(err, EPD_ERR_LEN,
                 "ffn weights (H %u, experts [%u, %u) of %u) do not fit rank %u (H %u, experts "
                 "[%u, %u) of %u)",
                 w->hidden, w->first_expert, w->first_expert + w->n_local, w->num_experts, rank,
                 shape->hidden, rank * per_rank, (rank + 1) * per_rank, shape->num_experts);
        return false;
    }
    return true;
}

static epd_status_t host_experts_load(epd_ops_ctx_t *ctx, const epd_moe_shape_t *shape,
                                      const epd_ffn_weights_t *weights, char err[EPD_ERR_LEN])
{
    if (ctx == NULL || !shape_ok(shape) || weights == NULL) {
        snprintf(err, EPD_ERR_LEN, "host ops: experts_load: no context, shape or weights");
        return EPD_ERR_INVALID_ARG;
    }
    if (!ffn_fits(shape, weights, shape->rank, err)) return EPD_ERR_INVALID_ARG;
    ctx->ffn = weights;
    return EPD_OK;
}

/* The rows per local expert the caller says these records hold must be theirs. */
static epd_status_t check_rows(epd_ops_ctx_t *ctx, const epd_moe_shape_t *shape,
                               const epd_record_layout_t *rec, const void *recv_buf,
                               uint32_t n_records, const uint32_t *expert_rows_host)
{
    uint32_t per_rank = shape->num_experts / shape->world, lo = shape->rank * per_rank;
    uint32_t *rows = calloc(per_rank, sizeof *rows);

    if (rows == NULL) return NO_MEMORY(ctx, "experts");
    for (uint32_t j = 0; j < n_records; j++) {
        const uint8_t *in = (const uint8_t *)recv_buf + (size_t)j * rec->size;
        for (uint32_t k = 0; k < shape->topk; k++) {
            int32_t e;
            memcpy(&e, in + rec->ids + (size_t)k * sizeof e, sizeof e);
            if (e >= (int32_t)lo && e < (int32_t)(lo + per_rank)) rows[e - (int32_t)lo]++;
        }
    }
    for (uint32_t e = 0; e < per_rank; e++) {
        if (rows[e] != expert_rows_host[e]) {
            OPS_ERR(ctx, "host ops: experts: the counts say %u rows for expert %u, the records "
                    "hold %u", expert_rows_host[e], lo + e, rows[e]);
            free(rows);
            return EPD_ERR_INTERNAL;
        }
    }
    free(rows);
    return EPD_OK;
}

static epd_status_t host_experts(epd_ops_ctx_t *ctx, const epd_moe_shape_t *shape, uint32_t layer,
                                 const void *recv_buf, uint32_t n_records,
                                 const uint32_t *expert_rows_host, void *partials)
{
    epd_record_layout_t rec;
    epd_partial_layout_t pl;
    double error[2] = {0.0, 0.0}, *error_p = NULL;
    const epd_expert_ops_t *experts;
    const epd_ffn_layer_t *ffn_layer = NULL;
    ffn_scratch_t fs = {0};
    float *x_in, *acc;
    int32_t *ids;
    float *weights;

    if (!shape_ok(shape)) return BAD_ARGS(ctx, "experts");
    experts = epd_expert_ops_find(shape->expert_kind);
    if (experts->external)
        return host_fail(ctx, EPD_ERR_INVALID_ARG,
                         "experts: external experts run in the frontend's worker, not the ops");
    if (experts->weights) {
        if (ctx == NULL || ctx->ffn == NULL)
            return host_fail(ctx, EPD_ERR_INVALID_ARG, "experts: ffn weights were not loaded");
        ffn_layer = epd_ffn_find_layer(ctx->ffn, layer);
        if (ffn_layer == NULL) {
            OPS_ERR(ctx, "host ops: experts: layer %u was not loaded", layer);
            return EPD_ERR_INVALID_ARG;
        }
    }
    if (n_records == 0) return EPD_OK;
    if (recv_buf == NULL || partials == NULL) return BAD_ARGS(ctx, "experts");
    epd_record_layout(shape, &rec);
    if (expert_rows_host != NULL) {
        epd_status_t status = check_rows(ctx, shape, &rec, recv_buf, n_records, expert_rows_host);
        if (status != EPD_OK) return status;
    }
    epd_partial_layout(shape, &pl);
    if (shape->quant_error && shape->combine_dtype == EPD_COMBINE_FP8 && ctx != NULL)
        error_p = error;
    x_in = malloc((size_t)shape->hidden * sizeof *x_in);
    acc = malloc((size_t)shape->hidden * sizeof *acc);
    ids = malloc(shape->topk * sizeof *ids);
    weights = malloc(shape->topk * sizeof *weights);
    if (x_in == NULL || acc == NULL || ids == NULL || weights == NULL ||
        (ffn_layer != NULL && !ffn_scratch_alloc(ctx->ffn, &fs))) {
        free(x_in);
        free(acc);
        free(ids);
        free(weights);
        return NO_MEMORY(ctx, "experts");
    }

    for (uint32_t j = 0; j < n_records; j++) {
        const uint8_t *in = (const uint8_t *)recv_buf + (size_t)j * rec.size;
        float scales_buf[EPD_QUANT_GROUP * 4];
        float *scales = scales_buf;
        /* copied out: the record's fields need not be aligned for their types in general */
        memcpy(ids, in + rec.ids, shape->topk * sizeof *ids);
        memcpy(weights, in + rec.weights, shape->topk * sizeof *weights);
        if (shape->dtype == EPD_WIRE_FP8) {
            if (rec.n_scales > EPD_ARRAY_SIZE(scales_buf)) {
                scales = malloc(rec.n_scales * sizeof *scales);
                if (scales == NULL) {
                    free(x_in);
                    free(acc);
                    free(ids);
                    free(weights);
                    ffn_scratch_free(&fs);
                    return NO_MEMORY(ctx, "experts");
                }
            }
            memcpy(scales, in + rec.scales, rec.n_scales * sizeof *scales);
        }
        uint8_t *partial = (uint8_t *)partials + (size_t)j * pl.size;
        if (ffn_layer != NULL) {
            epd_ffn_row_t row;
            ffn_row_from_payload(shape, ctx->ffn, in + rec.payload, scales, &fs, &row);
            ffn_partial_row(shape, ctx->ffn, ffn_layer, shape->rank, &row, ids, weights, &fs, acc,
                            partial, error_p);
        } else {
            if (shape->dtype == EPD_WIRE_FP8) {
                epd_dequant_row_host(in + rec.payload, scales, shape->hidden, shape->scale, x_in);
            } else {
                for (uint32_t i = 0; i < shape->hidden; i++) {
                    uint16_t h;
                    memcpy(&h, in + rec.payload + (size_t)i * 2, 2);
                    x_in[i] = epd_bf16_to_f32(h);
                }
            }
            partial_row(shape, experts, shape->rank, x_in, ids, weights, acc, partial, error_p);
        }
        if (scales != scales_buf) free(scales);
    }
    if (error_p != NULL) {
        ctx->quant_error.combine_err2 += error[0];
        ctx->quant_error.combine_ref2 += error[1];
    }
    free(x_in);
    free(acc);
    free(ids);
    free(weights);
    ffn_scratch_free(&fs);
    return EPD_OK;
}

static epd_status_t host_combine(epd_ops_ctx_t *ctx, const epd_moe_shape_t *shape,
                                 const epd_step_layout_t *layout, const void *partials_back,
                                 uint16_t *y)
{
    uint32_t hidden, world;
    epd_partial_layout_t pl;
    float *acc;

    if (!shape_ok(shape) || layout == NULL) return BAD_ARGS(ctx, "combine");
    if (layout->n_tokens == 0) return EPD_OK;
    if (y == NULL || layout->slot == NULL || (layout->n_send > 0 && partials_back == NULL))
        return BAD_ARGS(ctx, "combine");
    hidden = shape->hidden;
    world = shape->world;
    epd_partial_layout(shape, &pl);
    acc = malloc((size_t)hidden * sizeof *acc);
    if (acc == NULL) return NO_MEMORY(ctx, "combine");
    for (uint32_t t = 0; t < layout->n_tokens; t++) {
        const int32_t *slot = layout->slot + (size_t)t * world;
        for (uint32_t i = 0; i < hidden; i++) acc[i] = 0.0f;
        for (uint32_t r = 0; r < world; r++) {
            if (slot[r] < 0) continue;
            if ((uint32_t)slot[r] >= layout->n_send) {
                free(acc);
                return BAD_SLOT(ctx, "combine");
            }
            epd_partial_add_host(shape, (const uint8_t *)partials_back + (size_t)slot[r] * pl.size,
                                 acc);
        }
        uint16_t *out = y + (size_t)t * hidden;
        for (uint32_t i = 0; i < hidden; i++) out[i] = epd_f32_to_bf16(acc[i]);
    }
    free(acc);
    return EPD_OK;
}

static epd_status_t host_quant_error_take(epd_ops_ctx_t *ctx, epd_quant_error_t *error_p)
{
    if (ctx == NULL || error_p == NULL) return EPD_ERR_INVALID_ARG;
    *error_p = ctx->quant_error;
    memset(&ctx->quant_error, 0, sizeof ctx->quant_error);
    return EPD_OK;
}

static const char *host_last_error(epd_ops_ctx_t *ctx)
{
    return ctx == NULL ? "" : ctx->err;
}

static void *host_stream(epd_ops_ctx_t *ctx)
{
    return NULL;
}

static epd_status_t host_event_create(epd_ops_ctx_t *ctx, epd_ops_event_t **event_p)
{
    epd_ops_event_t *event = calloc(1, sizeof *event);

    if (event == NULL) return EPD_ERR_NO_MEMORY;
    *event_p = event;
    return EPD_OK;
}

static void host_event_destroy(epd_ops_ctx_t *ctx, epd_ops_event_t *event)
{
    free(event);
}

static epd_status_t host_event_done(epd_ops_ctx_t *ctx, epd_ops_event_t *event)
{
    return event == NULL ? EPD_ERR_INVALID_ARG : EPD_OK;
}

/* The "async" copies of the host ops complete before they return. */
static epd_status_t host_copy_async(epd_ops_ctx_t *ctx, void *dst, const void *src, size_t bytes,
                                    epd_ops_event_t *done)
{
    return host_copy(ctx, dst, src, bytes);
}

const epd_ops_t epd_ops_host = {
    .name = "host",
    .device_memory = false,
    .pack_reads_host = true,
    .init = host_init,
    .fini = host_fini,
    .alloc = host_alloc,
    .free = host_free,
    .alloc_host = host_alloc,
    .free_host = host_free,
    .copy_to_ops = host_copy,
    .copy_to_host = host_copy,
    .sync = host_sync,
    .layout = host_layout,
    .layout_counts = host_layout_counts,
    .pack = host_pack,
    .experts = host_experts,
    .experts_load = host_experts_load,
    .combine = host_combine,
    .quant_error_take = host_quant_error_take,
    .stream = host_stream,
    .event_create = host_event_create,
    .event_destroy = host_event_destroy,
    .event_query = host_event_done,
    .event_wait = host_event_done,
    .copy_to_host_async = host_copy_async,
    .copy_to_ops_async = host_copy_async,
    .copy_ops_to_ops_async = host_copy_async,
    .last_error = host_last_error,
    .copy_queued = host_copy_queued,
};

/* The ffn case of epd_moe_reference_layer: each owner rank's partial as the ops form it. */
static epd_status_t ffn_reference(const epd_moe_shape_t *shape, const epd_ffn_weights_t *w,
                                  uint32_t layer, uint32_t n_tokens, const uint16_t *x,
                                  const int32_t *topk_ids, const float *topk_weights, uint16_t *y)
{
    const epd_ffn_layer_t *l = epd_ffn_find_layer(w, layer);
    uint32_t hidden = shape->hidden, per_rank = shape->num_experts / shape->world;
    uint32_t n_scales = shape->scale == EPD_SCALE_PER_TOKEN ? 1 : hidden / EPD_QUANT_GROUP;
    ffn_scratch_t fs = {0};
    float *sum = NULL, *acc = NULL, *scales = NULL;
    uint8_t *q = NULL, *partial = NULL;
    epd_partial_layout_t pl;
    epd_status_t status = EPD_ERR_NO_MEMORY;

    if (l == NULL || w->first_expert != 0 || w->n_local != shape->num_experts ||
        w->hidden != hidden)
        return EPD_ERR_INVALID_ARG;
    epd_partial_layout(shape, &pl);
    sum = malloc((size_t)hidden * sizeof *sum);
    acc = malloc((size_t)hidden * sizeof *acc);
    scales = malloc(n_scales * sizeof *scales);
    q = malloc(hidden);
    partial = malloc(pl.size);
    if (sum == NULL || acc == NULL || scales == NULL || q == NULL || partial == NULL ||
        !ffn_scratch_alloc(w, &fs))
        goto out;
    for (uint32_t t = 0; t < n_tokens; t++) {
        const uint16_t *row_bf16 = x + (size_t)t * hidden;
        const int32_t *ids = topk_ids + (size_t)t * shape->topk;
        const float *weights = topk_weights + (size_t)t * shape->topk;
        epd_ffn_row_t row;
        for (uint32_t k = 0; k < shape->topk; k++) {
            if (ids[k] < -1 || (ids[k] >= 0 && (uint32_t)ids[k] >= shape->num_experts)) {
                status = EPD_ERR_EXPERT_OUT_OF_RANGE;
                goto out;
            }
        }
        /* what every destination receives */
        if (shape->dtype == EPD_WIRE_FP8) {
            epd_quant_row_host(row_bf16, hidden, shape->scale, shape->scale_format, q, scales);
            ffn_row_from_payload(shape, w, q, scales, &fs, &row);
        } else {
            ffn_row_from_payload(shape, w, (const uint8_t *)row_bf16, NULL, &fs, &row);
        }
        for (uint32_t i = 0; i < hidden; i++) sum[i] = 0.0f;
        for (uint32_t r = 0; r < shape->world; r++) {
            bool owns = false;
            for (uint32_t k = 0; k < shape->topk; k++)
                if (ids[k] != -1 && (uint32_t)ids[k] / per_rank == r) owns = true;
            if (!owns) continue;
            /* stored as the owner stores it (bf16, or FP8 combine), added as combine adds it */
            ffn_partial_row(shape, w, l, r, &row, ids, weights, &fs, acc, partial, NULL);
            epd_partial_add_host(shape, partial, sum);
        }
        for (uint32_t i = 0; i < hidden; i++) y[(size_t)t * hidden + i] = epd_f32_to_bf16(sum[i]);
    }
    status = EPD_OK;
out:
    ffn_scratch_free(&fs);
    free(sum);
    free(acc);
    free(scales);
    free(q);
    free(partial);
    return status;
}

epd_status_t epd_moe_reference_layer(const epd_moe_shape_t *shape, const epd_ffn_weights_t *weights,
                                     uint32_t layer, uint32_t n_tokens, const uint16_t *x,
                                     const int32_t *topk_ids, const float *topk_weights,
                                     uint16_t *y)
{
    if (!shape_ok(shape)) return EPD_ERR_INVALID_ARG;
    if (!epd_expert_ops_find(shape->expert_kind)->weights)
        return epd_moe_reference(shape, n_tokens, x, topk_ids, topk_weights, y);
    if (weights == NULL) return EPD_ERR_INVALID_ARG;
    if (n_tokens == 0) return EPD_OK;
    if (x == NULL || topk_ids == NULL || topk_weights == NULL || y == NULL)
        return EPD_ERR_INVALID_ARG;
    return ffn_reference(shape, weights, layer, n_tokens, x, topk_ids, topk_weights, y);
}

epd_status_t epd_moe_reference(const epd_moe_shape_t *shape, uint32_t n_tokens, const uint16_t *x,
                               const int32_t *topk_ids, const float *topk_weights, uint16_t *y)
{
    uint32_t hidden, per_rank, n_scales;
    const epd_expert_ops_t *experts;
    float *x_in = NULL, *sum = NULL, *scales = NULL, *part = NULL;
    uint8_t *q = NULL, *pq = NULL;
    epd_partial_layout_t pl;
    epd_status_t status = EPD_ERR_NO_MEMORY;

    if (!shape_ok(shape)) return EPD_ERR_INVALID_ARG;
    experts = epd_expert_ops_find(shape->expert_kind);
    if (experts->weights || experts->external)
        return EPD_ERR_INVALID_ARG; /* epd_moe_reference_layer; the worker's own */
    if (n_tokens == 0) return EPD_OK;
    if (x == NULL || topk_ids == NULL || topk_weights == NULL || y == NULL)
        return EPD_ERR_INVALID_ARG;
    hidden = shape->hidden;
    per_rank = shape->num_experts / shape->world;
    n_scales = shape->scale == EPD_SCALE_PER_TOKEN ? 1 : hidden / EPD_QUANT_GROUP;
    x_in = malloc((size_t)hidden * sizeof *x_in);
    sum = malloc((size_t)hidden * sizeof *sum);
    q = malloc(hidden);
    scales = malloc(n_scales * sizeof *scales);
    epd_partial_layout(shape, &pl);
    part = malloc((size_t)hidden * sizeof *part);
    pq = malloc(pl.size);
    if (x_in == NULL || sum == NULL || q == NULL || scales == NULL || part == NULL || pq == NULL)
        goto out;

    for (uint32_t t = 0; t < n_tokens; t++) {
        const uint16_t *row = x + (size_t)t * hidden;
        const int32_t *ids = topk_ids + (size_t)t * shape->topk;
        const float *weights = topk_weights + (size_t)t * shape->topk;
        for (uint32_t k = 0; k < shape->topk; k++) {
            if (ids[k] < -1 || (ids[k] >= 0 && (uint32_t)ids[k] >= shape->num_experts)) {
                status = EPD_ERR_EXPERT_OUT_OF_RANGE;
                goto out;
            }
        }
        /* what every destination sees: the dequantized FP8 row, or the BF16 row widened */
        if (shape->dtype == EPD_WIRE_FP8) {
            epd_quant_row_host(row, hidden, shape->scale, shape->scale_format, q, scales);
            epd_dequant_row_host(q, scales, hidden, shape->scale, x_in);
        } else {
            for (uint32_t i = 0; i < hidden; i++) x_in[i] = epd_bf16_to_f32(row[i]);
        }
        for (uint32_t i = 0; i < hidden; i++) sum[i] = 0.0f;
        /* Written element by element, independently of partial_row, so that the ops are checked
         * against a second formulation: each owner rank's partial (its experts in ascending k),
         * rounded to bf16 (or, FP8 combine, quantized group128 and dequantized), summed in
         * ascending rank order. */
        for (uint32_t r = 0; r < shape->world; r++) {
            bool owns = false;
            for (uint32_t k = 0; k < shape->topk; k++)
                if (ids[k] != -1 && (uint32_t)ids[k] / per_rank == r) owns = true;
            if (!owns) continue;
            for (uint32_t i = 0; i < hidden; i++) {
                float a = 0.0f;
                for (uint32_t k = 0; k < shape->topk; k++) {
                    if (ids[k] == -1 || (uint32_t)ids[k] / per_rank != r) continue;
                    float expert_y = experts->element(shape, ids[k], x_in[i]);
                    float wy = weights[k] * expert_y;
                    a = a + wy;
                }
                part[i] = a;
            }
            if (shape->combine_dtype == EPD_COMBINE_FP8) {
                /* quantized per group of 128 with an fp32 scale, as a dispatched row is */
                for (uint32_t g = 0; g < hidden / EPD_QUANT_GROUP; g++) {
                    float s;
                    uint32_t off = g * EPD_QUANT_GROUP;
                    epd_quant_row_f32_host(part + off, EPD_QUANT_GROUP, EPD_SCALE_GROUP128,
                                           EPD_SCALE_FMT_FP32, pq + off, &s);
                    for (uint32_t i = off; i < off + EPD_QUANT_GROUP; i++)
                        sum[i] = sum[i] + epd_e4m3_to_f32(pq[i]) * s;
                }
            } else {
                for (uint32_t i = 0; i < hidden; i++)
                    sum[i] = sum[i] + epd_bf16_to_f32(epd_f32_to_bf16(part[i]));
            }
        }
        for (uint32_t i = 0; i < hidden; i++) y[(size_t)t * hidden + i] = epd_f32_to_bf16(sum[i]);
    }
    status = EPD_OK;
out:
    free(x_in);
    free(sum);
    free(q);
    free(scales);
    free(part);
    free(pq);
    return status;
}
