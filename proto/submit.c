/* The meaning of frames: full validation of a SUBMIT (schema, tensors, shapes, ids, weights, x)
 * into borrowed views, and the encoders of SUBMIT, RESULT, ERROR, CONTROL and REPLY frames. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bf16.h"
#include "proto/frame.h"

enum { T_X = EPD_SUBMIT_X, T_IDS = EPD_SUBMIT_IDS, T_WEIGHTS = EPD_SUBMIT_WEIGHTS,
       T_Y = EPD_SUBMIT_Y, T_COUNT = EPD_SUBMIT_TENSORS };

static const char *const tensor_names[T_COUNT] = {"x", "topk_ids", "topk_weights", "y"};
static const epd_dtype_t tensor_dtypes[T_COUNT] = {EPD_DTYPE_BF16, EPD_DTYPE_I32, EPD_DTYPE_F32,
                                                   EPD_DTYPE_BF16};

/* Every payload byte belongs to exactly one payload tensor: sorted by begin, they must tile
 * [0, len). Region tensors (and an absent y) take no part. */
static epd_status_t check_cover(const epd_tensor_t t[T_COUNT], const bool present[T_COUNT],
                                uint64_t payload_len, char err[EPD_ERR_LEN])
{
    int order[T_COUNT], n = 0;
    uint64_t at = 0;

    for (int k = 0; k < T_COUNT; k++)
        if (present[k] && !t[k].in_region) order[n++] = k;
    for (int i = 1; i < n; i++) {
        for (int j = i; j > 0 && t[order[j]].begin < t[order[j - 1]].begin; j--) {
            int tmp = order[j];
            order[j] = order[j - 1];
            order[j - 1] = tmp;
        }
    }
    for (int i = 0; i < n; i++) {
        const epd_tensor_t *cur = &t[order[i]];
        if (cur->begin < at) {
            snprintf(err, EPD_ERR_LEN, "tensor %s [%" PRIu64 ", %" PRIu64 ") overlaps tensor %s",
                     tensor_names[order[i]], cur->begin, cur->end, tensor_names[order[i - 1]]);
            return EPD_ERR_BAD_TENSOR;
        }
        if (cur->begin > at) {
            snprintf(err, EPD_ERR_LEN,
                     "payload bytes [%" PRIu64 ", %" PRIu64 ") belong to no tensor", at,
                     cur->begin);
            return EPD_ERR_BAD_TENSOR;
        }
        at = cur->end;
    }
    if (at != payload_len) {
        snprintf(err, EPD_ERR_LEN,
                 "payload bytes [%" PRIu64 ", %" PRIu64 ") belong to no tensor", at, payload_len);
        return EPD_ERR_BAD_TENSOR;
    }
    return EPD_OK;
}

/* Parses the "tensors" object: x, topk_ids, topk_weights each once, y at most once (in a region),
 * right dtypes (topk_ids i32 or i64), 2-D. */
static epd_status_t parse_tensors(const cJSON *tensors, uint64_t payload_len,
                                  epd_tensor_t t[T_COUNT], bool seen[T_COUNT],
                                  char err[EPD_ERR_LEN])
{
    const cJSON *item;
    epd_status_t status;

    cJSON_ArrayForEach(item, tensors) {
        int k;
        for (k = 0; k < T_COUNT; k++) {
            if (strcmp(item->string, tensor_names[k]) == 0) break;
        }
        if (k == T_COUNT) {
            snprintf(err, EPD_ERR_LEN,
                     "unknown tensor \"%.40s\" (a SUBMIT has x, topk_ids, topk_weights and "
                     "optionally y)",
                     item->string);
            return EPD_ERR_BAD_TENSOR;
        }
        if (seen[k]) {
            snprintf(err, EPD_ERR_LEN, "tensor %s is described twice", tensor_names[k]);
            return EPD_ERR_BAD_TENSOR;
        }
        seen[k] = true;
        status = epd_tensor_parse(item, tensor_names[k], payload_len, &t[k], err);
        if (status != EPD_OK) return status;
        bool ids64 = k == T_IDS && t[k].dtype == EPD_DTYPE_I64;
        if (t[k].dtype != tensor_dtypes[k] && !ids64) {
            snprintf(err, EPD_ERR_LEN, "tensor %s has dtype %s, only %s%s is supported",
                     tensor_names[k], epd_dtype_name(t[k].dtype),
                     epd_dtype_name(tensor_dtypes[k]), k == T_IDS ? " or i64" : "");
            return EPD_ERR_UNSUPPORTED_DTYPE;
        }
        if (t[k].ndim != 2) {
            snprintf(err, EPD_ERR_LEN, "tensor %s has %u dimensions, must be 2", tensor_names[k],
                     t[k].ndim);
            return EPD_ERR_BAD_TENSOR;
        }
        if (k == T_Y && !t[k].in_region) {
            snprintf(err, EPD_ERR_LEN,
                     "tensor y must name a region (without one, y comes back in the RESULT)");
            return EPD_ERR_BAD_TENSOR;
        }
    }
    for (int k = 0; k < T_Y; k++) {
        if (!seen[k]) {
            snprintf(err, EPD_ERR_LEN, "tensor %s is missing", tensor_names[k]);
            return EPD_ERR_BAD_TENSOR;
        }
    }
    return EPD_OK;
}

/* Four 32-bit lanes, GCC's and clang's vector extension (one SSE2 register; wider vectors are
 * split into scalars on a build without AVX), for the passes over every id and weight. */
typedef uint32_t lanes4_t __attribute__((vector_size(16)));
typedef int32_t signed4_t __attribute__((vector_size(16)));

/* True when some 32-bit word w of words[n] (any 4-byte type) has ((w + add) & mask) > limit
 * (unsigned), eight words a step. The unsigned compare is a signed one of the words with their
 * top bits flipped (SSE2 has only that). */
static bool any_above(const void *words, uint64_t n, uint32_t add, uint32_t mask, uint32_t limit)
{
    const uint8_t *at = words;
    const signed4_t top = (signed4_t){0} + INT32_MIN;
    const signed4_t bound = (signed4_t){0} + (int32_t)(limit ^ 0x80000000u);
    signed4_t acc0 = {0}, acc1 = {0};
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        lanes4_t v0, v1;
        memcpy(&v0, at + i * 4, sizeof v0);
        memcpy(&v1, at + i * 4 + 16, sizeof v1);
        acc0 |= ((signed4_t)((v0 + add) & mask) ^ top) > bound;
        acc1 |= ((signed4_t)((v1 + add) & mask) ^ top) > bound;
    }
    acc0 |= acc1;
    uint32_t any = 0;
    for (int k = 0; k < 4; k++) any |= (uint32_t)acc0[k];
    for (; i < n; i++) {
        uint32_t w;
        memcpy(&w, at + i * 4, sizeof w);
        any |= ((w + add) & mask) > limit;
    }
    return any != 0;
}

/* Ids in [0, E) or -1, distinct within a token: first the ranges of all of them, eight at a time
 * (-1 + 1 is 0 and [0, E) + 1 is [1, E]: one unsigned compare), then the repeats in one O(N*K)
 * pass where each expert remembers the last token (a 16-bit stamp) that named it, so nothing is
 * cleared between tokens. An id out of range anywhere is reported before a repeated id (the
 * first of each). */
static epd_status_t check_ids(const int32_t *ids, uint64_t n_tokens, uint32_t topk,
                              uint32_t num_experts, char err[EPD_ERR_LEN])
{
    uint16_t stack_stamps[1024];
    uint16_t *stamp = stack_stamps;
    uint64_t dup_tok = UINT64_MAX;
    int32_t dup_id = 0;
    uint16_t cur = 0;

    uint64_t n_ids = n_tokens * topk;
    if (any_above(ids, n_ids, 1u, UINT32_MAX, num_experts)) {
        for (uint64_t i = 0; i < n_ids; i++) {
            if ((uint32_t)ids[i] + 1u > num_experts) {
                snprintf(err, EPD_ERR_LEN,
                         "token %" PRIu64 " slot %" PRIu64 ": expert id %d is not in [0, %u) or -1",
                         i / topk, i % topk, ids[i], num_experts);
                return EPD_ERR_EXPERT_OUT_OF_RANGE;
            }
        }
    }

    if (num_experts > EPD_ARRAY_SIZE(stack_stamps)) {
        stamp = malloc(num_experts * sizeof *stamp);
        if (stamp == NULL) {
            snprintf(err, EPD_ERR_LEN, "cannot allocate the expert stamps");
            return EPD_ERR_NO_MEMORY;
        }
    }
    memset(stamp, 0, num_experts * sizeof *stamp);
    for (uint64_t tok = 0; tok < n_tokens && dup_tok == UINT64_MAX; tok++) {
        const int32_t *row = ids + tok * topk;
        if (++cur == 0) { /* the stamps wrapped: start them again */
            memset(stamp, 0, num_experts * sizeof *stamp);
            cur = 1;
        }
        for (uint32_t k = 0; k < topk; k++) {
            if (row[k] < 0) continue;
            if (stamp[row[k]] == cur && dup_tok == UINT64_MAX) {
                dup_tok = tok;
                dup_id = row[k];
            }
            stamp[row[k]] = cur;
        }
    }
    if (stamp != stack_stamps) free(stamp);
    if (dup_tok != UINT64_MAX) {
        snprintf(err, EPD_ERR_LEN, "token %" PRIu64 ": expert id %d appears twice", dup_tok,
                 dup_id);
        return EPD_ERR_INVALID_TOPK;
    }
    return EPD_OK;
}

/* Index of the first bf16 value of x[n] that is Inf or NaN, or -1 when all are finite. */
static int64_t find_non_finite(const uint16_t *x, uint64_t n)
{
    uint64_t i = 0;
    /* branch-free blocks (the compiler vectorizes them) until one holds a non-finite value */
    for (; i + 64 <= n; i += 64) {
        unsigned bad = 0;
        for (uint64_t k = 0; k < 64; k++) bad |= !epd_bf16_is_finite(x[i + k]);
        if (bad) break;
    }
    for (; i < n; i++)
        if (!epd_bf16_is_finite(x[i])) return (int64_t)i;
    return -1;
}

/* Narrows i64 ids (n values) to i32 in out: each must be -1 or in [0, E). */
static epd_status_t narrow_ids(const int64_t *ids, uint64_t n, uint32_t topk, uint32_t num_experts,
                               int32_t *out, char err[EPD_ERR_LEN])
{
    for (uint64_t i = 0; i < n; i++) {
        if (ids[i] != -1 && (ids[i] < 0 || ids[i] >= (int64_t)num_experts)) {
            snprintf(err, EPD_ERR_LEN,
                     "token %" PRIu64 " slot %" PRIu64 ": expert id %" PRId64
                     " is not in [0, %u) or -1", i / topk, i % topk, ids[i], num_experts);
            return EPD_ERR_EXPERT_OUT_OF_RANGE;
        }
        out[i] = (int32_t)ids[i];
    }
    return EPD_OK;
}

epd_status_t epd_submit_validate(const epd_frame_t *frame, const epd_submit_limits_t *limits,
                                 epd_submit_view_t *view_p, char err[EPD_ERR_LEN])
{
    return epd_submit_validate_regions(frame, limits, NULL, view_p, err);
}

epd_status_t epd_submit_validate_regions(const epd_frame_t *frame,
                                         const epd_submit_limits_t *limits,
                                         const epd_submit_regions_t *regions,
                                         epd_submit_view_t *view_p, char err[EPD_ERR_LEN])
{
    epd_tensor_t t[T_COUNT];
    bool seen[T_COUNT] = {false, false, false, false};
    void *host[T_COUNT] = {NULL, NULL, NULL, NULL};
    bool device[T_COUNT] = {false, false, false, false};
    const cJSON *tensors;
    uint64_t n_tokens;
    epd_status_t status;

    memset(view_p, 0, sizeof(*view_p));
    memset(t, 0, sizeof t);
    if (frame == NULL || frame->type != EPD_FRAME_SUBMIT || limits == NULL || limits->hidden == 0 ||
        limits->topk == 0) {
        snprintf(err, EPD_ERR_LEN, "epd_submit_validate needs a SUBMIT frame and H, K >= 1");
        return EPD_ERR_INVALID_ARG;
    }
    switch (frame->id_kind) {
    case EPD_FRAME_ID_VALID:
        view_p->id = frame->id;
        break;
    case EPD_FRAME_ID_ABSENT:
        snprintf(err, EPD_ERR_LEN, "SUBMIT meta has no \"id\"");
        return EPD_ERR_BAD_JSON;
    default:
        snprintf(err, EPD_ERR_LEN, "SUBMIT \"id\" must be an integer in [0, 2^64)");
        return EPD_ERR_BAD_JSON;
    }
    tensors = cJSON_GetObjectItemCaseSensitive(frame->meta, "tensors");
    if (!cJSON_IsObject(tensors)) {
        snprintf(err, EPD_ERR_LEN, "SUBMIT meta has no \"tensors\" object");
        return EPD_ERR_BAD_JSON;
    }
    const cJSON *layer = cJSON_GetObjectItemCaseSensitive(frame->meta, "layer");
    if (layer != NULL) {
        double v = cJSON_IsNumber(layer) ? layer->valuedouble : -1.0;
        if (!(v >= 0.0 && v <= (double)INT32_MAX && v == (double)(int64_t)v)) {
            snprintf(err, EPD_ERR_LEN, "SUBMIT \"layer\" must be an integer in [0, 2^31)");
            return EPD_ERR_BAD_JSON;
        }
        view_p->layer = (uint32_t)v;
        if (limits->layer_known != NULL && !limits->layer_known(limits->layer_arg, view_p->layer)) {
            snprintf(err, EPD_ERR_LEN, "layer %u is not served by this daemon (experts.layers)",
                     view_p->layer);
            return EPD_ERR_UNKNOWN_LAYER;
        }
    }
    status = parse_tensors(tensors, frame->payload_len, t, seen, err);
    if (status != EPD_OK) return status;
    status = check_cover(t, seen, frame->payload_len, err);
    if (status != EPD_OK) return status;

    n_tokens = t[T_X].shape[0];
    if (n_tokens == 0) {
        snprintf(err, EPD_ERR_LEN, "a SUBMIT must carry at least one token (N = 0)");
        return EPD_ERR_BAD_TENSOR;
    }
    if (t[T_IDS].shape[0] != n_tokens || t[T_WEIGHTS].shape[0] != n_tokens ||
        (seen[T_Y] && t[T_Y].shape[0] != n_tokens)) {
        snprintf(err, EPD_ERR_LEN,
                 "tensors disagree on N: x has %" PRIu64 ", topk_ids %" PRIu64
                 ", topk_weights %" PRIu64 "%s", n_tokens, t[T_IDS].shape[0],
                 t[T_WEIGHTS].shape[0], seen[T_Y] ? ", y another" : "");
        return EPD_ERR_SHAPE_MISMATCH;
    }
    if (t[T_X].shape[1] != limits->hidden || (seen[T_Y] && t[T_Y].shape[1] != limits->hidden)) {
        snprintf(err, EPD_ERR_LEN, "%s has hidden size %" PRIu64 ", the daemon runs %u",
                 t[T_X].shape[1] != limits->hidden ? "x" : "y",
                 t[T_X].shape[1] != limits->hidden ? t[T_X].shape[1] : t[T_Y].shape[1],
                 limits->hidden);
        return EPD_ERR_SHAPE_MISMATCH;
    }
    if (t[T_IDS].shape[1] != limits->topk || t[T_WEIGHTS].shape[1] != limits->topk) {
        snprintf(err, EPD_ERR_LEN,
                 "topk_ids has K = %" PRIu64 " and topk_weights K = %" PRIu64
                 ", the daemon runs top-%u", t[T_IDS].shape[1], t[T_WEIGHTS].shape[1],
                 limits->topk);
        return EPD_ERR_SHAPE_MISMATCH;
    }
    if (n_tokens > limits->max_tokens) {
        snprintf(err, EPD_ERR_LEN, "%" PRIu64 " tokens exceed the limit of %u per request",
                 n_tokens, limits->max_tokens);
        return EPD_ERR_TOO_MANY_TOKENS;
    }

    /* where each tensor is */
    for (int k = 0; k < T_COUNT; k++) {
        if (!seen[k]) continue;
        if (!t[k].in_region) {
            host[k] = frame->payload + t[k].begin;
            continue;
        }
        if (regions == NULL || regions->resolve == NULL) {
            snprintf(err, EPD_ERR_LEN, "tensor %s names region %u, but no region is registered",
                     tensor_names[k], t[k].region);
            return EPD_ERR_BAD_REGION;
        }
        if (t[k].begin % EPD_REGION_ALIGN != 0) {
            snprintf(err, EPD_ERR_LEN,
                     "tensor %s: offset %" PRIu64 " into region %u is not a multiple of %u",
                     tensor_names[k], t[k].begin, t[k].region, EPD_REGION_ALIGN);
            return EPD_ERR_BAD_REGION;
        }
        epd_region_span_t span;
        char why[EPD_ERR_LEN];
        status = regions->resolve(regions->arg, t[k].region, t[k].begin, t[k].end, &span, why);
        if (status != EPD_OK) {
            snprintf(err, EPD_ERR_LEN, "tensor %s: %.200s", tensor_names[k], why);
            return status;
        }
        host[k] = span.ptr;
        device[k] = span.device;
        view_p->regions[k] = span.region;
    }
    view_p->n_tokens = (uint32_t)n_tokens;
    view_p->hidden = limits->hidden;
    view_p->topk = limits->topk;

    /* ids and weights on the host, i32: read from the device and narrowed from i64 as needed */
    uint64_t n_slots = n_tokens * limits->topk;
    size_t id_bytes = (size_t)n_slots * epd_dtype_size(t[T_IDS].dtype);
    bool ids64 = t[T_IDS].dtype == EPD_DTYPE_I64;
    bool x_scanned = false; /* a device x already scanned with the ids and weights */
    int64_t x_bad = -1;
    size_t owned_bytes = (ids64 || device[T_IDS] ? id_bytes : 0) +
                         (device[T_WEIGHTS] ? (size_t)n_slots * sizeof(float) : 0) +
                         (ids64 ? (size_t)n_slots * sizeof(int32_t) : 0);
    if (owned_bytes > 0) {
        uint8_t *owned = malloc(owned_bytes), *at = owned;
        if (owned == NULL) {
            snprintf(err, EPD_ERR_LEN, "cannot allocate %zu bytes for the top-k tensors",
                     owned_bytes);
            return EPD_ERR_NO_MEMORY;
        }
        view_p->owned = owned;
        if (device[T_IDS] || device[T_WEIGHTS]) {
            if (regions->device_fetch == NULL) {
                snprintf(err, EPD_ERR_LEN, "device tensors cannot be read on this daemon");
                return EPD_ERR_BAD_REGION;
            }
            /* ids, weights and the scan of a device x in one round trip */
            uint8_t *ids_at = at, *w_at = at + (device[T_IDS] ? id_bytes : 0);
            x_scanned = device[T_X];
            status = regions->device_fetch(
                regions->arg, device[T_IDS] ? host[T_IDS] : NULL, device[T_IDS] ? id_bytes : 0,
                ids_at, device[T_WEIGHTS] ? host[T_WEIGHTS] : NULL,
                device[T_WEIGHTS] ? (size_t)n_slots * sizeof(float) : 0, w_at,
                device[T_X] ? host[T_X] : NULL, n_tokens * limits->hidden, &x_bad, err);
            if (status != EPD_OK) return status;
            if (device[T_IDS]) {
                host[T_IDS] = ids_at;
                at += id_bytes;
            }
            if (device[T_WEIGHTS]) {
                host[T_WEIGHTS] = w_at;
                at += (size_t)n_slots * sizeof(float);
            }
        }
        if (ids64) {
            int64_t wide[64];
            int32_t *narrow = (int32_t *)(void *)at;
            /* the source may be unaligned for i64 only in a payload, never: offsets are aligned */
            for (uint64_t i = 0; i < n_slots; i += 64) {
                uint64_t m = n_slots - i < 64 ? n_slots - i : 64;
                memcpy(wide, (const int64_t *)host[T_IDS] + i, (size_t)m * sizeof(int64_t));
                status = narrow_ids(wide, m, 1, limits->num_experts, narrow + i, err);
                if (status != EPD_OK) {
                    /* name the token and slot of the whole request, not of the chunk */
                    uint64_t bad = i;
                    while (bad < i + m && (wide[bad - i] == -1 ||
                                           (wide[bad - i] >= 0 &&
                                            wide[bad - i] < (int64_t)limits->num_experts)))
                        bad++;
                    snprintf(err, EPD_ERR_LEN,
                             "token %" PRIu64 " slot %" PRIu64 ": expert id %" PRId64
                             " is not in [0, %u) or -1", bad / limits->topk,
                             bad % limits->topk, wide[bad - i], limits->num_experts);
                    return status;
                }
            }
            host[T_IDS] = narrow;
        }
    }
    view_p->x = host[T_X];
    view_p->x_device = device[T_X];
    view_p->topk_ids = host[T_IDS];
    view_p->topk_weights = host[T_WEIGHTS];
    if (seen[T_Y]) {
        view_p->y = host[T_Y];
        view_p->y_device = device[T_Y];
        view_p->y_region = t[T_Y].region;
        view_p->y_offset = t[T_Y].begin;
    }

    status = check_ids(view_p->topk_ids, n_tokens, limits->topk, limits->num_experts, err);
    if (status != EPD_OK) return status;
    /* the weights' exponents all at once (Inf and NaN have them all ones: (bits & exponent)
     * above the largest finite one's), the index only when one is bad */
    bool non_finite = any_above(view_p->topk_weights, n_slots, 0, 0x7f800000u, 0x7f000000u);
    for (uint64_t i = 0; non_finite && i < n_slots; i++) {
        if (!isfinite(view_p->topk_weights[i])) {
            snprintf(err, EPD_ERR_LEN, "token %" PRIu64 " slot %" PRIu64 ": weight is %s",
                     i / limits->topk, i % limits->topk,
                     isnan(view_p->topk_weights[i]) ? "NaN" : "infinite");
            return EPD_ERR_NON_FINITE_INPUT;
        }
    }
    int64_t bad = x_bad;
    if (view_p->x_device && !x_scanned) {
        if (regions->device_fetch == NULL) {
            snprintf(err, EPD_ERR_LEN, "device tensors cannot be read on this daemon");
            return EPD_ERR_BAD_REGION;
        }
        status = regions->device_fetch(regions->arg, NULL, 0, NULL, NULL, 0, NULL, view_p->x,
                                       n_tokens * limits->hidden, &bad, err);
        if (status != EPD_OK) return status;
    } else if (!view_p->x_device) {
        uint64_t x_n = n_tokens * limits->hidden;
        status = EPD_ERR_AGAIN;
        if (regions != NULL && regions->host_scan != NULL &&
            x_n * sizeof(uint16_t) >= EPD_SUBMIT_DEVICE_SCAN_BYTES) {
            char why[EPD_ERR_LEN] = "";
            status = regions->host_scan(regions->scan_arg, view_p->x, x_n, &bad, why);
        }
        /* not page-locked, or the device failed (the step will say so): the host scans it */
        if (status != EPD_OK) bad = find_non_finite(view_p->x, x_n);
    }
    if (bad >= 0) {
        snprintf(err, EPD_ERR_LEN, "x[%" PRId64 "][%" PRId64 "] is not finite (Inf or NaN)",
                 bad / (int64_t)limits->hidden, bad % (int64_t)limits->hidden);
        return EPD_ERR_NON_FINITE_INPUT;
    }
    return EPD_OK;
}

/* ---- encoders ---- */

void epd_frame_out_free(epd_frame_out_t *out)
{
    if (out == NULL) return;
    free(out->head);
    memset(out, 0, sizeof(*out));
}

epd_status_t epd_frame_out_flatten(const epd_frame_out_t *out, uint8_t **buf_p, size_t *len_p,
                                   char err[EPD_ERR_LEN])
{
    size_t len = out->head_len;
    uint8_t *buf, *p;

    if (out->payload_len > SIZE_MAX - len) {
        snprintf(err, EPD_ERR_LEN, "frame too large to flatten");
        return EPD_ERR_NO_MEMORY;
    }
    len += (size_t)out->payload_len;
    buf = malloc(len);
    if (buf == NULL) {
        snprintf(err, EPD_ERR_LEN, "cannot allocate %zu bytes for a frame", len);
        return EPD_ERR_NO_MEMORY;
    }
    memcpy(buf, out->head, out->head_len);
    p = buf + out->head_len;
    for (size_t i = 0; i < out->n_parts; i++) {
        if (out->part_len[i] > 0) memcpy(p, out->part[i], out->part_len[i]);
        p += out->part_len[i];
    }
    *buf_p = buf;
    *len_p = len;
    return EPD_OK;
}

/* Head = header + the given meta text (meta_len bytes). */
static epd_status_t out_make_head(epd_frame_type_t type, const char *meta, size_t meta_len,
                                  uint64_t payload_len, epd_frame_out_t *out_p,
                                  char err[EPD_ERR_LEN])
{
    if (meta_len > EPD_FRAME_MAX_META) {
        snprintf(err, EPD_ERR_LEN, "meta of %zu bytes exceeds the %u-byte limit", meta_len,
                 EPD_FRAME_MAX_META);
        return EPD_ERR_FRAME_TOO_LARGE;
    }
    memset(out_p, 0, sizeof(*out_p));
    out_p->head = malloc(EPD_FRAME_HEADER_LEN + meta_len);
    if (out_p->head == NULL) {
        snprintf(err, EPD_ERR_LEN, "cannot allocate a frame head");
        return EPD_ERR_NO_MEMORY;
    }
    epd_frame_header_encode(type, (uint32_t)meta_len, payload_len, out_p->head);
    memcpy(out_p->head + EPD_FRAME_HEADER_LEN, meta, meta_len);
    out_p->head_len = EPD_FRAME_HEADER_LEN + meta_len;
    out_p->payload_len = payload_len;
    return EPD_OK;
}

static void out_add_part(epd_frame_out_t *out, const void *data, size_t len)
{
    out->part[out->n_parts] = data;
    out->part_len[out->n_parts] = len;
    out->n_parts++;
}

epd_status_t epd_frame_encode_json(epd_frame_type_t type, const cJSON *meta, const void *payload,
                                   size_t payload_len, epd_frame_out_t *out_p,
                                   char err[EPD_ERR_LEN])
{
    char *text;
    epd_status_t status;

    if (!cJSON_IsObject(meta) || type < EPD_FRAME_SUBMIT || type > EPD_FRAME_EXPERTS_DONE ||
        (payload == NULL && payload_len > 0)) {
        snprintf(err, EPD_ERR_LEN, "a frame needs a known type, a JSON object meta and a payload");
        return EPD_ERR_INVALID_ARG;
    }
    text = cJSON_PrintUnformatted(meta);
    if (text == NULL) {
        snprintf(err, EPD_ERR_LEN, "cannot print the frame's meta JSON");
        return EPD_ERR_NO_MEMORY;
    }
    status = out_make_head(type, text, strlen(text), payload_len, out_p, err);
    free(text);
    if (status != EPD_OK) return status;
    if (payload_len > 0) out_add_part(out_p, payload, payload_len);
    return EPD_OK;
}

/* Adds an exact uint64 (a raw JSON literal: cJSON numbers are doubles). */
static cJSON *add_u64(cJSON *obj, const char *name, uint64_t v)
{
    char lit[24];
    snprintf(lit, sizeof(lit), "%" PRIu64, v);
    return cJSON_AddRawToObject(obj, name, lit);
}

epd_status_t epd_frame_encode_submit(uint64_t id, uint32_t n_tokens, uint32_t hidden,
                                     uint32_t topk, const uint16_t *x, const int32_t *topk_ids,
                                     const float *topk_weights, epd_frame_out_t *out_p,
                                     char err[EPD_ERR_LEN])
{
    uint64_t nk_bytes = (uint64_t)n_tokens * topk * 4;
    uint64_t x_bytes = (uint64_t)n_tokens * hidden * 2;
    char meta[512];

    if ((n_tokens > 0 && (x == NULL || topk_ids == NULL || topk_weights == NULL)) ||
        x_bytes > SIZE_MAX / 2) {
        snprintf(err, EPD_ERR_LEN, "SUBMIT needs x, topk_ids and topk_weights");
        return EPD_ERR_INVALID_ARG;
    }
    /* written with snprintf, as a RESULT's: cJSON prints every number as a double and reads it
     * back (tens of microseconds a meta on a slow core) */
    int len = snprintf(
        meta, sizeof meta,
        "{\"id\":%" PRIu64 ",\"tensors\":{"
        "\"x\":{\"dtype\":\"bf16\",\"shape\":[%" PRIu32 ",%" PRIu32 "],\"data_offsets\":[%" PRIu64
        ",%" PRIu64 "]},"
        "\"topk_ids\":{\"dtype\":\"i32\",\"shape\":[%" PRIu32 ",%" PRIu32
        "],\"data_offsets\":[0,%" PRIu64 "]},"
        "\"topk_weights\":{\"dtype\":\"f32\",\"shape\":[%" PRIu32 ",%" PRIu32
        "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}}}",
        id, n_tokens, hidden, 2 * nk_bytes, 2 * nk_bytes + x_bytes, n_tokens, topk, nk_bytes,
        n_tokens, topk, nk_bytes, 2 * nk_bytes);
    if (len < 0 || (size_t)len >= sizeof meta) {
        snprintf(err, EPD_ERR_LEN, "cannot build SUBMIT meta");
        return EPD_ERR_INTERNAL;
    }
    epd_status_t status =
        out_make_head(EPD_FRAME_SUBMIT, meta, (size_t)len, 2 * nk_bytes + x_bytes, out_p, err);
    if (status != EPD_OK) return status;
    out_add_part(out_p, topk_ids, (size_t)nk_bytes);
    out_add_part(out_p, topk_weights, (size_t)nk_bytes);
    out_add_part(out_p, x, (size_t)x_bytes);
    return EPD_OK;
}

/* RESULT metas are written with snprintf, not built as cJSON trees: they are on every request's
 * path and their shape is fixed (a tree and its printing cost microseconds per answer). */
epd_status_t epd_frame_encode_result(uint64_t id, uint64_t step, uint32_t n_tokens,
                                     uint32_t hidden, const uint16_t *y, epd_frame_out_t *out_p,
                                     char err[EPD_ERR_LEN])
{
    uint64_t y_bytes = (uint64_t)n_tokens * hidden * 2;
    char meta[256];

    if ((y_bytes > 0 && y == NULL) || y_bytes > SIZE_MAX) {
        snprintf(err, EPD_ERR_LEN, "RESULT needs y");
        return EPD_ERR_INVALID_ARG;
    }
    int len = snprintf(meta, sizeof meta,
                       "{\"id\":%" PRIu64 ",\"tensors\":{\"y\":{\"dtype\":\"bf16\",\"shape\":[%" PRIu32
                       ",%" PRIu32 "],\"data_offsets\":[0,%" PRIu64 "]}},\"step\":%" PRIu64 "}",
                       id, n_tokens, hidden, y_bytes, step);
    epd_status_t status =
        out_make_head(EPD_FRAME_RESULT, meta, (size_t)len, y_bytes, out_p, err);
    if (status != EPD_OK) return status;
    if (y_bytes > 0) out_add_part(out_p, y, (size_t)y_bytes);
    return EPD_OK;
}

epd_status_t epd_frame_encode_result_region(uint64_t id, uint64_t step, uint32_t n_tokens,
                                            uint32_t hidden, uint32_t region, uint64_t offset,
                                            epd_frame_out_t *out_p, char err[EPD_ERR_LEN])
{
    char meta[256];
    int len = snprintf(meta, sizeof meta,
                       "{\"id\":%" PRIu64 ",\"tensors\":{\"y\":{\"dtype\":\"bf16\",\"shape\":[%" PRIu32
                       ",%" PRIu32 "],\"region\":%" PRIu32 ",\"offset\":%" PRIu64
                       "}},\"step\":%" PRIu64 "}",
                       id, n_tokens, hidden, region, offset, step);
    return out_make_head(EPD_FRAME_RESULT, meta, (size_t)len, 0, out_p, err);
}

epd_status_t epd_frame_encode_error(bool has_id, uint64_t id, epd_status_t code,
                                    const char *message, epd_frame_out_t *out_p,
                                    char err[EPD_ERR_LEN])
{
    /* the message is the peer's to display: keep it valid UTF-8 and within the meta bound */
    size_t max_msg = EPD_FRAME_MAX_META / 8;
    size_t len = message ? strnlen(message, max_msg) : 0;
    char *msg;
    cJSON *meta;
    epd_status_t status = EPD_ERR_NO_MEMORY;

    if (!epd_status_is_wire_code(code)) {
        snprintf(err, EPD_ERR_LEN, "status %s cannot travel in an ERROR frame",
                 epd_status_name(code));
        return EPD_ERR_INVALID_ARG;
    }
    msg = malloc(len + 1);
    if (msg == NULL) {
        snprintf(err, EPD_ERR_LEN, "cannot build ERROR meta");
        return EPD_ERR_NO_MEMORY;
    }
    if (len > 0) memcpy(msg, message, len);
    msg[len] = '\0';
    for (size_t at = 0; (at += epd_utf8_check((uint8_t *)msg + at, len - at)) < len; at++) {
        msg[at] = '?';
    }
    meta = cJSON_CreateObject();
    if (meta == NULL) goto err_msg;
    if ((has_id ? add_u64(meta, "id", id) : cJSON_AddNullToObject(meta, "id")) == NULL ||
        cJSON_AddStringToObject(meta, "code", epd_status_name(code)) == NULL ||
        cJSON_AddStringToObject(meta, "message", msg) == NULL) {
        goto err_meta;
    }
    status = epd_frame_encode_json(EPD_FRAME_ERROR, meta, NULL, 0, out_p, err);
err_meta:
    cJSON_Delete(meta);
err_msg:
    free(msg);
    if (status == EPD_ERR_NO_MEMORY) snprintf(err, EPD_ERR_LEN, "cannot build ERROR meta");
    return status;
}

epd_status_t epd_frame_encode_control(const char *op, epd_frame_out_t *out_p,
                                      char err[EPD_ERR_LEN])
{
    cJSON *meta;
    epd_status_t status = EPD_ERR_NO_MEMORY;

    if (op == NULL || *op == '\0' || strlen(op) > 64 ||
        epd_utf8_check((const uint8_t *)op, strlen(op)) != strlen(op)) {
        snprintf(err, EPD_ERR_LEN, "a CONTROL op is a short non-empty name");
        return EPD_ERR_INVALID_ARG;
    }
    meta = cJSON_CreateObject();
    if (meta != NULL && cJSON_AddStringToObject(meta, "op", op) != NULL) {
        status = epd_frame_encode_json(EPD_FRAME_CONTROL, meta, NULL, 0, out_p, err);
    }
    cJSON_Delete(meta);
    if (status == EPD_ERR_NO_MEMORY) snprintf(err, EPD_ERR_LEN, "cannot build CONTROL meta");
    return status;
}

epd_status_t epd_frame_encode_reply(const char *meta_json, const void *payload, size_t payload_len,
                                    epd_frame_out_t *out_p, char err[EPD_ERR_LEN])
{
    size_t len = meta_json ? strlen(meta_json) : 0;
    cJSON *parsed;
    epd_status_t status;

    if (meta_json == NULL || (payload == NULL && payload_len > 0)) {
        snprintf(err, EPD_ERR_LEN, "REPLY needs meta JSON");
        return EPD_ERR_INVALID_ARG;
    }
    if (epd_utf8_check((const uint8_t *)meta_json, len) != len) {
        snprintf(err, EPD_ERR_LEN, "REPLY meta is not valid UTF-8");
        return EPD_ERR_INVALID_ARG;
    }
    parsed = cJSON_ParseWithLengthOpts(meta_json, len + 1, NULL, 1);
    if (!cJSON_IsObject(parsed)) {
        cJSON_Delete(parsed);
        snprintf(err, EPD_ERR_LEN, "REPLY meta must be the JSON text of an object");
        return EPD_ERR_INVALID_ARG;
    }
    cJSON_Delete(parsed);
    status = out_make_head(EPD_FRAME_REPLY, meta_json, len, payload_len, out_p, err);
    if (status != EPD_OK) return status;
    if (payload_len > 0) out_add_part(out_p, payload, payload_len);
    return EPD_OK;
}

epd_status_t epd_frame_encode_text(epd_frame_type_t type, const char *meta_json,
                                   epd_frame_out_t *out_p, char err[EPD_ERR_LEN])
{
    if (meta_json == NULL || type < EPD_FRAME_SUBMIT || type > EPD_FRAME_EXPERTS_DONE) {
        snprintf(err, EPD_ERR_LEN, "a frame needs a known type and meta JSON");
        return EPD_ERR_INVALID_ARG;
    }
    return out_make_head(type, meta_json, strlen(meta_json), 0, out_p, err);
}
