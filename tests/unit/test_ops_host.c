/* Unit tests of the host device ops (gpu/ops_host.c): record layout, routing layout, pack,
 * experts and combine through a simulated world of W ranks (records moved with memcpy as the
 * alltoallv would), checked bit for bit against epd_moe_reference, and the reference itself
 * against hand-computed values. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/rng.h"
#include "gpu/fp8.h"
#include "gpu/ops.h"
#include "gpu/quant.h"

static float rng_uniform(uint64_t *r, float lo, float hi)
{
    return lo + (hi - lo) * epd_rng_unit_f32(r);
}

static epd_moe_shape_t make_shape(uint32_t hidden, uint32_t topk, uint32_t experts, uint32_t world,
                                  epd_wire_dtype_t dtype, epd_scale_kind_t scale,
                                  epd_scale_fmt_t fmt, epd_expert_kind_t kind)
{
    epd_moe_shape_t s = {
        .hidden = hidden,
        .topk = topk,
        .num_experts = experts,
        .world = world,
        .rank = 0,
        .dtype = dtype,
        .scale = scale,
        .scale_format = fmt,
        .expert_kind = kind,
    };
    return s;
}

/* Random tokens: bf16 values in [-3, 3] with an outlier now and then, distinct ids with some
 * empty slots, every 5th token all empty, positive weights. */
static void random_batch(uint64_t *r, const epd_moe_shape_t *s, uint32_t n, uint16_t *x, int32_t *ids,
                         float *w)
{
    for (size_t i = 0; i < (size_t)n * s->hidden; i++) {
        float v = rng_uniform(r, -3.0f, 3.0f);
        if (epd_rng_next(r) % 97 == 0) v *= 40.0f;
        x[i] = epd_f32_to_bf16(v);
    }
    for (uint32_t t = 0; t < n; t++) {
        int32_t *row = ids + (size_t)t * s->topk;
        for (uint32_t k = 0; k < s->topk; k++) {
            int32_t e;
            bool dup;
            do {
                e = (int32_t)(epd_rng_next(r) % s->num_experts);
                dup = false;
                for (uint32_t j = 0; j < k; j++) dup |= row[j] == e;
            } while (dup);
            row[k] = e;
            w[(size_t)t * s->topk + k] = rng_uniform(r, 0.01f, 1.0f);
        }
        for (uint32_t k = 0; k < s->topk; k++)
            if (t % 5 == 4 || epd_rng_next(r) % 7 == 0) row[k] = -1;
    }
}

typedef struct sim_rank {
    uint32_t n;
    uint16_t *x, *y;
    int32_t *ids;
    float *w;
    epd_step_layout_t layout;
    uint8_t *send, *recv;
    uint8_t *partials, *partials_back;
    uint32_t n_recv;
    uint32_t *recv_from; /* [W] records received from each source */
} sim_rank_t;

/* Runs the host ops for `world` simulated ranks with n[r] tokens each, moving records and
 * partials between them with memcpy, and checks every rank's y against the reference. */
static void run_simulated(epd_moe_shape_t shape, const uint32_t *n, uint64_t seed)
{
    const epd_ops_t *ops = &epd_ops_host;
    epd_ops_ctx_t *ctx = NULL;
    char err[EPD_ERR_LEN];
    uint32_t world = shape.world;
    epd_record_layout_t rec;
    epd_partial_layout_t pl;
    sim_rank_t *ranks = calloc(world, sizeof *ranks);
    uint64_t rng = seed;

    assert_non_null(ranks);
    assert_int_equal(ops->init(-1, &ctx, err), EPD_OK);
    epd_record_layout(&shape, &rec);
    epd_partial_layout(&shape, &pl);

    for (uint32_t r = 0; r < world; r++) {
        sim_rank_t *sr = &ranks[r];
        sr->n = n[r];
        size_t nn = sr->n ? sr->n : 1;
        sr->x = malloc(nn * shape.hidden * 2);
        sr->y = malloc(nn * shape.hidden * 2);
        sr->ids = malloc(nn * shape.topk * 4);
        sr->w = malloc(nn * shape.topk * 4);
        sr->layout.send_counts_host = calloc(world, 4);
        sr->layout.send_offsets_host = calloc(world, 4);
        sr->layout.slot = malloc(nn * world * 4);
        sr->layout.n_tokens = sr->n;
        sr->send = malloc(nn * world * rec.size);
        sr->partials_back = malloc(nn * world * pl.size);
        sr->recv_from = calloc(world, 4);
        assert_non_null(sr->x);
        assert_non_null(sr->send);
        random_batch(&rng, &shape, sr->n, sr->x, sr->ids, sr->w);
        shape.rank = r;
        assert_int_equal(ops->layout(ctx, &shape, sr->ids, &sr->layout), EPD_OK);
        assert_int_equal(ops->pack(ctx, &shape, sr->x, sr->ids, sr->w, &sr->layout, sr->send),
                         EPD_OK);
    }
    /* the dispatch alltoallv: rank d receives source s's group for d, sources in ascending order */
    for (uint32_t d = 0; d < world; d++) {
        sim_rank_t *dr = &ranks[d];
        for (uint32_t s = 0; s < world; s++) dr->n_recv += ranks[s].layout.send_counts_host[d];
        dr->recv = malloc((dr->n_recv ? dr->n_recv : 1) * rec.size);
        dr->partials = malloc((dr->n_recv ? dr->n_recv : 1) * pl.size);
        size_t at = 0;
        for (uint32_t s = 0; s < world; s++) {
            uint32_t c = ranks[s].layout.send_counts_host[d];
            memcpy(dr->recv + at * rec.size,
                   ranks[s].send + (size_t)ranks[s].layout.send_offsets_host[d] * rec.size,
                   (size_t)c * rec.size);
            dr->recv_from[s] = c;
            at += c;
        }
        shape.rank = d;
        assert_int_equal(ops->experts(ctx, &shape, dr->recv, dr->n_recv, dr->partials), EPD_OK);
    }
    /* the reverse alltoallv of partials */
    for (uint32_t d = 0; d < world; d++) {
        size_t at = 0;
        for (uint32_t s = 0; s < world; s++) {
            uint32_t c = ranks[d].recv_from[s];
            memcpy(ranks[s].partials_back + (size_t)ranks[s].layout.send_offsets_host[d] * pl.size,
                   ranks[d].partials + at * pl.size, (size_t)c * pl.size);
            at += c;
        }
    }
    for (uint32_t r = 0; r < world; r++) {
        sim_rank_t *sr = &ranks[r];
        uint16_t *ref = malloc((sr->n ? sr->n : 1) * (size_t)shape.hidden * 2);
        shape.rank = r;
        assert_int_equal(ops->combine(ctx, &shape, &sr->layout, sr->partials_back, sr->y), EPD_OK);
        assert_int_equal(epd_moe_reference(&shape, sr->n, sr->x, sr->ids, sr->w, ref), EPD_OK);
        for (size_t i = 0; i < (size_t)sr->n * shape.hidden; i++) {
            if (sr->y[i] != ref[i])
                fail_msg("world %u rank %u token %zu element %zu: ops 0x%04x, reference 0x%04x",
                         world, r, i / shape.hidden, i % shape.hidden, sr->y[i], ref[i]);
        }
        /* tokens with no destination come back as zeros */
        for (uint32_t t = 0; t < sr->n; t++) {
            bool empty = true;
            for (uint32_t k = 0; k < shape.topk; k++)
                empty &= sr->ids[(size_t)t * shape.topk + k] == -1;
            if (!empty) continue;
            for (uint32_t i = 0; i < shape.hidden; i++)
                assert_int_equal(sr->y[(size_t)t * shape.hidden + i], 0);
        }
        free(ref);
    }
    for (uint32_t r = 0; r < world; r++) {
        sim_rank_t *sr = &ranks[r];
        free(sr->x);
        free(sr->y);
        free(sr->ids);
        free(sr->w);
        free(sr->layout.send_counts_host);
        free(sr->layout.send_offsets_host);
        free(sr->layout.slot);
        free(sr->send);
        free(sr->recv);
        free(sr->partials);
        free(sr->partials_back);
        free(sr->recv_from);
    }
    free(ranks);
    ops->fini(ctx);
}

static void test_ops_host__record_layout_bf16__offsets_and_16_byte_size(void **state)
{
    epd_record_layout_t l;
    epd_moe_shape_t s = make_shape(256, 4, 16, 1, EPD_WIRE_BF16, EPD_SCALE_GROUP128,
                                   EPD_SCALE_FMT_FP32, EPD_EXPERTS_SCALE);

    epd_record_layout(&s, &l);
    assert_int_equal(l.payload, 0);
    assert_int_equal(l.n_scales, 0);
    assert_int_equal(l.scales, 512);
    assert_int_equal(l.ids, 512);
    assert_int_equal(l.weights, 528);
    assert_int_equal(l.src, 544);
    assert_int_equal(l.size, 560);

    s = make_shape(7168, 8, 256, 8, EPD_WIRE_BF16, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32,
                   EPD_EXPERTS_SCALE);
    epd_record_layout(&s, &l);
    assert_int_equal(l.ids, 14336);
    assert_int_equal(l.weights, 14368);
    assert_int_equal(l.src, 14400);
    assert_int_equal(l.size, 14416);
}

static void test_ops_host__record_layout_fp8__scales_per_kind(void **state)
{
    epd_record_layout_t l;
    epd_moe_shape_t s = make_shape(256, 4, 16, 1, EPD_WIRE_FP8, EPD_SCALE_GROUP128,
                                   EPD_SCALE_FMT_FP32, EPD_EXPERTS_SCALE);

    epd_record_layout(&s, &l);
    assert_int_equal(l.scales, 256);
    assert_int_equal(l.n_scales, 2);
    assert_int_equal(l.ids, 264);
    assert_int_equal(l.weights, 280);
    assert_int_equal(l.src, 296);
    assert_int_equal(l.size, 304);

    s.scale = EPD_SCALE_PER_TOKEN;
    s.scale_format = EPD_SCALE_FMT_UE8M0; /* the format does not change the layout */
    epd_record_layout(&s, &l);
    assert_int_equal(l.n_scales, 1);
    assert_int_equal(l.ids, 260);
    assert_int_equal(l.weights, 276);
    assert_int_equal(l.src, 292);
    assert_int_equal(l.size, 304);

    /* DeepSeek-V3: 7168 e4m3 + 56 group scales + 8 ids + 8 weights + src */
    s = make_shape(7168, 8, 256, 8, EPD_WIRE_FP8, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32,
                   EPD_EXPERTS_SCALE);
    epd_record_layout(&s, &l);
    assert_int_equal(l.n_scales, 56);
    assert_int_equal(l.ids, 7392);
    assert_int_equal(l.src, 7456);
    assert_int_equal(l.size, 7472);
}

static void test_ops_host__layout_hand_made_ids__counts_offsets_slots(void **state)
{
    /* W = 4, E = 16 (4 per rank), K = 3 */
    epd_moe_shape_t s = make_shape(128, 3, 16, 4, EPD_WIRE_BF16, EPD_SCALE_GROUP128,
                                   EPD_SCALE_FMT_FP32, EPD_EXPERTS_SCALE);
    const int32_t ids[] = {
        0,  5,  -1, /* t0 -> ranks 0, 1 */
        -1, -1, -1, /* t1 -> nowhere */
        15, 12, 1,  /* t2 -> ranks 3 (once, for two experts) and 0 */
        4,  6,  7,  /* t3 -> rank 1 once */
    };
    const int32_t want_slot[] = {0, 2, -1, -1, -1, -1, -1, -1, 1, -1, -1, 4, -1, 3, -1, -1};
    uint32_t counts[4], offsets[4];
    int32_t slot[16];
    epd_step_layout_t l = {
        .n_tokens = 4, .send_counts_host = counts, .send_offsets_host = offsets, .slot = slot};

    assert_int_equal(epd_ops_host.layout(NULL, &s, ids, &l), EPD_OK);
    assert_int_equal(counts[0], 2);
    assert_int_equal(counts[1], 2);
    assert_int_equal(counts[2], 0);
    assert_int_equal(counts[3], 1);
    assert_int_equal(offsets[0], 0);
    assert_int_equal(offsets[1], 2);
    assert_int_equal(offsets[2], 4);
    assert_int_equal(offsets[3], 4);
    assert_int_equal(l.n_send, 5);
    assert_memory_equal(slot, want_slot, sizeof want_slot);
}

static void test_ops_host__layout_all_empty__no_records(void **state)
{
    epd_moe_shape_t s = make_shape(128, 2, 4, 2, EPD_WIRE_FP8, EPD_SCALE_GROUP128,
                                   EPD_SCALE_FMT_FP32, EPD_EXPERTS_SCALE);
    const int32_t ids[] = {-1, -1, -1, -1, -1, -1};
    uint32_t counts[2] = {9, 9}, offsets[2] = {9, 9};
    int32_t slot[6];
    epd_step_layout_t l = {
        .n_tokens = 3, .send_counts_host = counts, .send_offsets_host = offsets, .slot = slot};

    assert_int_equal(epd_ops_host.layout(NULL, &s, ids, &l), EPD_OK);
    assert_int_equal(l.n_send, 0);
    assert_int_equal(counts[0] + counts[1] + offsets[0] + offsets[1], 0);
    for (int i = 0; i < 6; i++) assert_int_equal(slot[i], -1);
}

static void test_ops_host__layout_bad_ids__expert_out_of_range(void **state)
{
    epd_moe_shape_t s = make_shape(128, 2, 4, 2, EPD_WIRE_BF16, EPD_SCALE_GROUP128,
                                   EPD_SCALE_FMT_FP32, EPD_EXPERTS_SCALE);
    uint32_t counts[2], offsets[2];
    int32_t slot[2];
    epd_step_layout_t l = {
        .n_tokens = 1, .send_counts_host = counts, .send_offsets_host = offsets, .slot = slot};
    const int32_t too_big[] = {0, 4};
    const int32_t negative[] = {-2, 1};

    assert_int_equal(epd_ops_host.layout(NULL, &s, too_big, &l), EPD_ERR_EXPERT_OUT_OF_RANGE);
    assert_int_equal(epd_ops_host.layout(NULL, &s, negative, &l), EPD_ERR_EXPERT_OUT_OF_RANGE);
    /* a shape the ops cannot serve is refused, not run */
    s.num_experts = 5;
    assert_int_equal(epd_ops_host.layout(NULL, &s, too_big, &l), EPD_ERR_INVALID_ARG);
    s.num_experts = 4;
    s.hidden = 100;
    assert_int_equal(epd_ops_host.layout(NULL, &s, too_big, &l), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_ops_host.layout(NULL, NULL, too_big, &l), EPD_ERR_INVALID_ARG);
}

static void test_ops_host__shape_check__experts_not_multiple_of_ranks__message(void **state)
{
    epd_moe_shape_t s = make_shape(128, 2, 16, 3, EPD_WIRE_FP8, EPD_SCALE_GROUP128,
                                   EPD_SCALE_FMT_FP32, EPD_EXPERTS_SCALE);
    char err[EPD_ERR_LEN] = "";

    assert_int_equal(epd_moe_shape_check(&s, err), EPD_ERR_INVALID_ARG);
    assert_string_equal(err, "num_experts = 16 is not a multiple of the 3 ranks (each rank owns "
                             "E/W experts)");
    assert_int_equal(epd_moe_experts_check(16, 3, err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_moe_experts_check(16, 0, err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_moe_experts_check(16, 4, err), EPD_OK);
    s.world = 4;
    assert_int_equal(epd_moe_shape_check(&s, err), EPD_OK);
    s.rank = 4;
    assert_int_equal(epd_moe_shape_check(&s, err), EPD_ERR_INVALID_ARG);
    s.rank = 0;
    s.hidden = 200;
    assert_int_equal(epd_moe_shape_check(&s, err), EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(err, "multiple of 128"));
    s.hidden = 128;
    s.expert_kind = (epd_expert_kind_t)99;
    assert_int_equal(epd_moe_shape_check(&s, err), EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(err, "expert kind"));
}

static void test_ops_host__expert_kinds__found_by_kind_and_name(void **state)
{
    const epd_expert_kind_t kinds[] = {EPD_EXPERTS_IDENTITY, EPD_EXPERTS_SCALE};
    const char *const names[] = {"identity", "scale"};
    epd_moe_shape_t s = make_shape(128, 2, 4, 1, EPD_WIRE_BF16, EPD_SCALE_GROUP128,
                                   EPD_SCALE_FMT_FP32, EPD_EXPERTS_SCALE);
    float x[128], acc[128];

    for (size_t i = 0; i < EPD_ARRAY_SIZE(kinds); i++) {
        const epd_expert_ops_t *e = epd_expert_ops_find(kinds[i]);
        assert_non_null(e);
        assert_string_equal(e->name, names[i]);
        assert_ptr_equal(epd_expert_ops_find_name(names[i]), e);
    }
    assert_null(epd_expert_ops_find((epd_expert_kind_t)99));
    assert_null(epd_expert_ops_find_name("ffn"));
    assert_null(epd_expert_ops_find_name(NULL));

    /* scale: expert 2 of 4 multiplies by 1.5; accumulate adds w * y to what acc holds */
    for (uint32_t i = 0; i < 128; i++) {
        x[i] = (float)i;
        acc[i] = 1.0f;
    }
    const epd_expert_ops_t *scale = epd_expert_ops_find(EPD_EXPERTS_SCALE);
    assert_true(scale->element(&s, 2, 4.0f) == 6.0f);
    scale->accumulate(&s, 2, 0.5f, x, acc);
    for (uint32_t i = 0; i < 128; i++) assert_true(acc[i] == 1.0f + 0.75f * (float)i);
    const epd_expert_ops_t *identity = epd_expert_ops_find(EPD_EXPERTS_IDENTITY);
    assert_true(identity->element(&s, 2, 4.0f) == 4.0f);
    identity->accumulate(&s, 3, 2.0f, x, acc);
    for (uint32_t i = 0; i < 128; i++) assert_true(acc[i] == 1.0f + 2.75f * (float)i);
}

static void test_ops_host__pack_bf16__record_fields_and_zero_padding(void **state)
{
    epd_moe_shape_t s = make_shape(128, 3, 4, 2, EPD_WIRE_BF16, EPD_SCALE_GROUP128,
                                   EPD_SCALE_FMT_FP32, EPD_EXPERTS_SCALE);
    epd_record_layout_t rec;
    uint16_t x[2 * 128];
    const int32_t ids[] = {3, -1, 2, 0, 1, -1};
    const float w[] = {0.5f, 0.25f, 0.125f, 1.0f, 2.0f, 3.0f};
    uint32_t counts[2], offsets[2];
    int32_t slot[4];
    epd_step_layout_t l = {
        .n_tokens = 2, .send_counts_host = counts, .send_offsets_host = offsets, .slot = slot};
    uint8_t buf[2 * 304];

    epd_record_layout(&s, &rec);
    assert_true(rec.size * 2 <= sizeof buf);
    for (int i = 0; i < 256; i++) x[i] = (uint16_t)(0x3f80 + i);
    memset(buf, 0xab, sizeof buf);
    assert_int_equal(epd_ops_host.layout(NULL, &s, ids, &l), EPD_OK);
    /* token 0 -> rank 1 only (experts 3, 2), token 1 -> rank 0 only (experts 0, 1) */
    assert_int_equal(l.n_send, 2);
    assert_int_equal(slot[0], -1);
    assert_int_equal(slot[1], 1);
    assert_int_equal(slot[2], 0);
    assert_int_equal(slot[3], -1);
    assert_int_equal(epd_ops_host.pack(NULL, &s, x, ids, w, &l, buf), EPD_OK);

    const uint8_t *r0 = buf, *r1 = buf + rec.size;
    uint32_t src;
    assert_memory_equal(r0 + rec.payload, x + 128, 256);
    assert_memory_equal(r0 + rec.ids, ids + 3, 12);
    assert_memory_equal(r0 + rec.weights, w + 3, 12);
    memcpy(&src, r0 + rec.src, 4);
    assert_int_equal(src, 1);
    assert_memory_equal(r1 + rec.payload, x, 256);
    assert_memory_equal(r1 + rec.ids, ids, 12);
    memcpy(&src, r1 + rec.src, 4);
    assert_int_equal(src, 0);
    for (size_t i = rec.src + 4; i < rec.size; i++) {
        assert_int_equal(r0[i], 0);
        assert_int_equal(r1[i], 0);
    }
}

static void test_ops_host__reference_hand_computed__exact_value(void **state)
{
    /* W = 2, E = 4: expert 0 (rank 0, f = 1) weight 0.5 and expert 3 (rank 1, f = 1.75) weight
     * 0.25 on x = 1: partials 0.5 and 0.4375, y = 0.9375, all exact in bf16. */
    epd_moe_shape_t s = make_shape(128, 2, 4, 2, EPD_WIRE_BF16, EPD_SCALE_GROUP128,
                                   EPD_SCALE_FMT_FP32, EPD_EXPERTS_SCALE);
    uint16_t x[128], y[128];
    const int32_t ids[] = {0, 3};
    const float w[] = {0.5f, 0.25f};

    for (int i = 0; i < 128; i++) x[i] = epd_f32_to_bf16(1.0f);
    assert_int_equal(epd_moe_reference(&s, 1, x, ids, w, y), EPD_OK);
    for (int i = 0; i < 128; i++) assert_true(epd_bf16_to_f32(y[i]) == 0.9375f);

    /* identity experts: w * x summed, 0.5 + 0.25 */
    s.expert_kind = EPD_EXPERTS_IDENTITY;
    assert_int_equal(epd_moe_reference(&s, 1, x, ids, w, y), EPD_OK);
    for (int i = 0; i < 128; i++) assert_true(epd_bf16_to_f32(y[i]) == 0.75f);
}

static void test_ops_host__reference_partial_rounding__bf16_per_rank(void **state)
{
    /* Each rank's partial is rounded to bf16 before the sum. x = 1 + 2^-7 (exact in bf16); rank
     * 0: 0.75 x = 0.755859375, a tie between bf16 neighbours, rounds (to even) to 0.7578125; rank
     * 1: 0.5 x = 0.50390625, exact. Their sum 1.26171875 is again a tie and rounds to 1.265625;
     * summing unrounded partials would give 1.259765625 -> 1.2578125 instead. */
    epd_moe_shape_t s = make_shape(128, 2, 2, 2, EPD_WIRE_BF16, EPD_SCALE_GROUP128,
                                   EPD_SCALE_FMT_FP32, EPD_EXPERTS_IDENTITY);
    uint16_t x[128], y[128];
    const int32_t ids[] = {0, 1};
    const float w[] = {0.75f, 0.5f};

    for (int i = 0; i < 128; i++) x[i] = epd_f32_to_bf16(1.0f + 0.0078125f);
    assert_int_equal(epd_moe_reference(&s, 1, x, ids, w, y), EPD_OK);
    for (int i = 0; i < 128; i++) assert_true(epd_bf16_to_f32(y[i]) == 1.265625f);
}

static void test_ops_host__reference_fp8_identity__close_to_input(void **state)
{
    /* one expert with weight 1: y is x after the FP8 round trip, within e4m3's precision */
    epd_moe_shape_t s = make_shape(256, 1, 4, 1, EPD_WIRE_FP8, EPD_SCALE_GROUP128,
                                   EPD_SCALE_FMT_FP32, EPD_EXPERTS_IDENTITY);
    uint16_t x[256], y[256];
    const int32_t ids[] = {2};
    const float w[] = {1.0f};
    uint64_t r = 7;

    for (int kind = 0; kind < 2; kind++) {
        s.scale = kind ? EPD_SCALE_PER_TOKEN : EPD_SCALE_GROUP128;
        for (int i = 0; i < 256; i++) x[i] = epd_f32_to_bf16(rng_uniform(&r, -2.0f, 2.0f));
        assert_int_equal(epd_moe_reference(&s, 1, x, ids, w, y), EPD_OK);
        for (int i = 0; i < 256; i++) {
            float a = epd_bf16_to_f32(x[i]), b = epd_bf16_to_f32(y[i]);
            assert_true(fabsf(a - b) <= 0.07f * fabsf(a) + 2.0f / 448.0f);
        }
    }
}

static void test_ops_host__bad_arguments__invalid_arg_not_crash(void **state)
{
    epd_moe_shape_t s = make_shape(128, 2, 4, 2, EPD_WIRE_BF16, EPD_SCALE_GROUP128,
                                   EPD_SCALE_FMT_FP32, EPD_EXPERTS_SCALE);
    uint16_t x[128], y[128];
    const int32_t ids[] = {0, 1};
    const float w[] = {1.0f, 1.0f};
    epd_step_layout_t l = {.n_tokens = 1};

    assert_int_equal(epd_moe_reference(&s, 1, NULL, ids, w, y), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_moe_reference(&s, 0, NULL, NULL, NULL, NULL), EPD_OK);
    assert_int_equal(epd_ops_host.pack(NULL, &s, x, ids, w, &l, NULL), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_ops_host.experts(NULL, &s, NULL, 3, y), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_ops_host.combine(NULL, &s, &l, NULL, y), EPD_ERR_INVALID_ARG);
    const int32_t bad[] = {0, 9};
    assert_int_equal(epd_moe_reference(&s, 1, x, bad, w, y), EPD_ERR_EXPERT_OUT_OF_RANGE);
    s.rank = 2;
    assert_int_equal(epd_ops_host.experts(NULL, &s, x, 0, y), EPD_ERR_INVALID_ARG);
}

static void test_ops_host__world1_bf16_and_fp8__equals_reference(void **state)
{
    const uint32_t n[] = {37};
    for (int d = 0; d < 2; d++)
        for (int k = 0; k < 2; k++)
            run_simulated(make_shape(256, 4, 16, 1, d ? EPD_WIRE_BF16 : EPD_WIRE_FP8,
                                     EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32,
                                     k ? EPD_EXPERTS_IDENTITY : EPD_EXPERTS_SCALE),
                          n, 11 + (uint64_t)(d * 2 + k));
}

static void test_ops_host__world2_every_format__equals_reference(void **state)
{
    const uint32_t n[] = {23, 41};
    const epd_scale_kind_t kinds[] = {EPD_SCALE_GROUP128, EPD_SCALE_PER_TOKEN};
    const epd_scale_fmt_t fmts[] = {EPD_SCALE_FMT_FP32, EPD_SCALE_FMT_UE8M0};
    uint64_t seed = 100;

    for (int k = 0; k < 2; k++)
        for (int f = 0; f < 2; f++)
            for (int e = 0; e < 2; e++)
                run_simulated(make_shape(384, 4, 16, 2, EPD_WIRE_FP8, kinds[k], fmts[f],
                                         e ? EPD_EXPERTS_IDENTITY : EPD_EXPERTS_SCALE),
                              n, seed++);
    for (int e = 0; e < 2; e++)
        run_simulated(make_shape(384, 4, 16, 2, EPD_WIRE_BF16, EPD_SCALE_GROUP128,
                                 EPD_SCALE_FMT_FP32, e ? EPD_EXPERTS_IDENTITY : EPD_EXPERTS_SCALE),
                      n, seed++);
}

static void test_ops_host__world4_with_idle_rank__equals_reference(void **state)
{
    const uint32_t n[] = {19, 0, 33, 1};
    run_simulated(make_shape(128, 8, 32, 4, EPD_WIRE_FP8, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32,
                             EPD_EXPERTS_SCALE),
                  n, 7);
    run_simulated(make_shape(128, 8, 32, 4, EPD_WIRE_BF16, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32,
                             EPD_EXPERTS_SCALE),
                  n, 8);
}

static void test_ops_host__world2_and_world4_fp8_combine__equals_reference(void **state)
{
    const uint32_t n2[] = {29, 17}, n4[] = {19, 0, 33, 5};
    const epd_wire_dtype_t dtypes[] = {EPD_WIRE_FP8, EPD_WIRE_BF16};
    uint64_t seed = 300;

    for (int d = 0; d < 2; d++) {
        for (int e = 0; e < 2; e++) {
            epd_moe_shape_t s = make_shape(384, 4, 16, 2, dtypes[d], EPD_SCALE_GROUP128,
                                           EPD_SCALE_FMT_FP32,
                                           e ? EPD_EXPERTS_IDENTITY : EPD_EXPERTS_SCALE);
            s.combine_dtype = EPD_COMBINE_FP8;
            run_simulated(s, n2, seed++);
            s = make_shape(256, 8, 32, 4, dtypes[d], EPD_SCALE_PER_TOKEN, EPD_SCALE_FMT_UE8M0,
                           e ? EPD_EXPERTS_IDENTITY : EPD_EXPERTS_SCALE);
            s.combine_dtype = EPD_COMBINE_FP8;
            s.quant_error = true; /* the telemetry changes no byte */
            run_simulated(s, n4, seed++);
        }
    }
}

static void test_ops_host__partial_layout__bf16_2h_fp8_h_plus_scales_padded(void **state)
{
    epd_moe_shape_t s = make_shape(128, 2, 4, 1, EPD_WIRE_FP8, EPD_SCALE_GROUP128,
                                   EPD_SCALE_FMT_FP32, EPD_EXPERTS_SCALE);
    epd_partial_layout_t pl;

    epd_partial_layout(&s, &pl);
    assert_int_equal(pl.size, 256);
    assert_int_equal(pl.n_scales, 0);
    s.combine_dtype = EPD_COMBINE_FP8;
    epd_partial_layout(&s, &pl);
    assert_int_equal(pl.scales, 128);
    assert_int_equal(pl.n_scales, 1);
    assert_int_equal(pl.size, 144); /* 128 + 4, padded to 16 */
    s.hidden = 7168;
    epd_partial_layout(&s, &pl);
    assert_int_equal(pl.n_scales, 56);
    assert_int_equal(pl.size, 7392); /* 7168 + 224: 0.516 of BF16's 14336 */
}

static void test_ops_host__partial_store_fp8__dispatch_bytes_and_scales(void **state)
{
    /* values exact in bf16: the FP8 partial must be the bytes and scales dispatch writes for the
     * same row (group128, fp32), and adding it back must give (float)q * s */
    epd_moe_shape_t s = make_shape(384, 2, 4, 1, EPD_WIRE_FP8, EPD_SCALE_GROUP128,
                                   EPD_SCALE_FMT_FP32, EPD_EXPERTS_SCALE);
    epd_partial_layout_t pl;
    float acc[384], back[384];
    uint16_t xb[384];
    uint8_t part[512], q[384];
    float scales[3];
    double error[2] = {0.0, 0.0};
    uint64_t r = 5;

    s.combine_dtype = EPD_COMBINE_FP8;
    epd_partial_layout(&s, &pl);
    assert_true(pl.size <= sizeof part);
    for (int i = 0; i < 384; i++) {
        xb[i] = epd_f32_to_bf16(rng_uniform(&r, -5.0f, 5.0f) * (i >= 256 ? 1e-6f : 1.0f));
        acc[i] = epd_bf16_to_f32(xb[i]);
    }
    memset(part, 0xab, sizeof part);
    epd_partial_store_host(&s, acc, part, error);
    epd_quant_row_host(xb, 384, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, q, scales);
    assert_memory_equal(part, q, 384);
    assert_memory_equal(part + pl.scales, scales, sizeof scales);
    /* the last group is below the amax floor: its scale is 1e-4 / 448 */
    assert_true(scales[2] == 1e-4f * (1.0f / 448.0f));
    for (size_t i = pl.scales + sizeof scales; i < pl.size; i++) assert_int_equal(part[i], 0);
    for (int i = 0; i < 384; i++) back[i] = 0.0f;
    epd_partial_add_host(&s, part, back);
    double e2 = 0.0, r2 = 0.0;
    for (int i = 0; i < 384; i++) {
        float want = epd_e4m3_to_f32(q[i]) * scales[i / 128];
        assert_true(back[i] == want);
        e2 += (double)(acc[i] - want) * (acc[i] - want);
        r2 += (double)acc[i] * acc[i];
    }
    /* the sums run in fp32 per group of 128 */
    assert_true(fabs(error[0] - e2) <= 1e-5 * e2);
    assert_true(fabs(error[1] - r2) <= 1e-5 * r2);
    assert_true(error[0] > 0.0);
}

static void test_ops_host__reference_fp8_combine__partial_quantized_not_bf16(void **state)
{
    /* one rank, identity expert, weight 1: the partial is x. Group 0 has amax 448, so its scale
     * is 448 * (1/448) = 1 and 17 (exact in bf16) is a tie between the e4m3 neighbours 16 and
     * 18: FP8 combine gives 16 (even), BF16 combine keeps 17. */
    epd_moe_shape_t s = make_shape(128, 1, 4, 1, EPD_WIRE_BF16, EPD_SCALE_GROUP128,
                                   EPD_SCALE_FMT_FP32, EPD_EXPERTS_IDENTITY);
    uint16_t x[128], y[128];
    const int32_t ids[] = {1};
    const float w[] = {1.0f};

    for (int i = 0; i < 128; i++) x[i] = epd_f32_to_bf16(i == 0 ? 448.0f : 17.0f);
    assert_int_equal(epd_moe_reference(&s, 1, x, ids, w, y), EPD_OK);
    assert_true(epd_bf16_to_f32(y[1]) == 17.0f);
    s.combine_dtype = EPD_COMBINE_FP8;
    assert_int_equal(epd_moe_reference(&s, 1, x, ids, w, y), EPD_OK);
    assert_true(epd_bf16_to_f32(y[0]) == 448.0f);
    for (int i = 1; i < 128; i++) assert_true(epd_bf16_to_f32(y[i]) == 16.0f);
}

/* Sum over the FP8 records in buf of (x - dequant)^2 and x^2, read back from the bytes. */
static void record_error(const epd_moe_shape_t *s, const uint8_t *buf, uint32_t n_records,
                         const uint16_t *x, double *e2_p, double *r2_p)
{
    epd_record_layout_t rec;
    epd_record_layout(s, &rec);
    *e2_p = *r2_p = 0.0;
    for (uint32_t j = 0; j < n_records; j++) {
        const uint8_t *in = buf + (size_t)j * rec.size;
        uint32_t src;
        float scales[8];
        memcpy(&src, in + rec.src, 4);
        memcpy(scales, in + rec.scales, rec.n_scales * 4);
        for (uint32_t i = 0; i < s->hidden; i++) {
            float v = epd_bf16_to_f32(x[(size_t)src * s->hidden + i]);
            float d = v - epd_e4m3_to_f32(in[i]) * scales[rec.n_scales == 1 ? 0 : i / 128];
            *e2_p += (double)d * d;
            *r2_p += (double)v * v;
        }
    }
}

static void test_ops_host__quant_error_telemetry__sums_of_what_was_quantized(void **state)
{
    epd_moe_shape_t s = make_shape(256, 4, 16, 2, EPD_WIRE_FP8, EPD_SCALE_GROUP128,
                                   EPD_SCALE_FMT_FP32, EPD_EXPERTS_IDENTITY);
    const epd_ops_t *ops = &epd_ops_host;
    epd_ops_ctx_t *ctx = NULL;
    epd_quant_error_t qe;
    epd_record_layout_t rec;
    epd_partial_layout_t pl;
    char err[EPD_ERR_LEN];
    enum { N = 21 };
    uint16_t x[N * 256];
    int32_t ids[N * 4], slot[N * 2];
    float w[N * 4];
    uint32_t counts[2], offsets[2];
    epd_step_layout_t l = {
        .n_tokens = N, .send_counts_host = counts, .send_offsets_host = offsets, .slot = slot};
    uint64_t r = 77;
    double e2, r2;

    assert_int_equal(ops->init(-1, &ctx, err), EPD_OK);
    random_batch(&r, &s, N, x, ids, w);
    s.combine_dtype = EPD_COMBINE_FP8;
    for (int k = 0; k < 2; k++) {
        s.scale = k ? EPD_SCALE_PER_TOKEN : EPD_SCALE_GROUP128;
        epd_record_layout(&s, &rec);
        epd_partial_layout(&s, &pl);
        uint8_t *buf = malloc((size_t)N * 2 * rec.size);
        uint8_t *parts = malloc((size_t)N * 2 * pl.size);
        assert_non_null(buf);
        assert_non_null(parts);
        assert_int_equal(ops->layout(ctx, &s, ids, &l), EPD_OK);
        /* off: nothing is summed */
        s.quant_error = false;
        assert_int_equal(ops->pack(ctx, &s, x, ids, w, &l, buf), EPD_OK);
        assert_int_equal(ops->experts(ctx, &s, buf, l.n_send, parts), EPD_OK);
        assert_int_equal(ops->quant_error_take(ctx, &qe), EPD_OK);
        assert_true(qe.dispatch_err2 == 0.0 && qe.dispatch_ref2 == 0.0);
        assert_true(qe.combine_err2 == 0.0 && qe.combine_ref2 == 0.0);
        /* on: the pack's sums are those of the records' bytes, each record counted */
        s.quant_error = true;
        assert_int_equal(ops->pack(ctx, &s, x, ids, w, &l, buf), EPD_OK);
        record_error(&s, buf, l.n_send, x, &e2, &r2);
        assert_int_equal(ops->quant_error_take(ctx, &qe), EPD_OK);
        assert_true(r2 > 0.0 && e2 > 0.0);
        assert_true(fabs(qe.dispatch_err2 - e2) <= 1e-5 * e2);
        assert_true(fabs(qe.dispatch_ref2 - r2) <= 1e-5 * r2);
        assert_true(qe.combine_ref2 == 0.0);
        /* relative RMS of e4m3 (3 mantissa bits) on these values: a few percent */
        double dispatch_rms = sqrt(qe.dispatch_err2 / qe.dispatch_ref2);
        assert_true(dispatch_rms > 0.005 && dispatch_rms < 0.05);
        /* the experts' FP8 partials: rank 0 of 2, some records have no local expert (zeros) */
        s.rank = 0;
        assert_int_equal(ops->experts(ctx, &s, buf, l.n_send, parts), EPD_OK);
        assert_int_equal(ops->quant_error_take(ctx, &qe), EPD_OK);
        assert_true(qe.dispatch_ref2 == 0.0);
        assert_true(qe.combine_ref2 > 0.0 && qe.combine_err2 > 0.0);
        assert_true(sqrt(qe.combine_err2 / qe.combine_ref2) < 0.05);
        /* taken: zero again */
        assert_int_equal(ops->quant_error_take(ctx, &qe), EPD_OK);
        assert_true(qe.dispatch_err2 == 0.0 && qe.combine_err2 == 0.0);
        free(buf);
        free(parts);
    }
    /* BF16 dispatch and BF16 partials quantize nothing */
    s = make_shape(256, 4, 16, 2, EPD_WIRE_BF16, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32,
                   EPD_EXPERTS_IDENTITY);
    s.quant_error = true;
    epd_record_layout(&s, &rec);
    uint8_t *buf = malloc((size_t)N * 2 * rec.size), *parts = malloc((size_t)N * 2 * 512);
    assert_int_equal(ops->layout(ctx, &s, ids, &l), EPD_OK);
    assert_int_equal(ops->pack(ctx, &s, x, ids, w, &l, buf), EPD_OK);
    assert_int_equal(ops->experts(ctx, &s, buf, l.n_send, parts), EPD_OK);
    assert_int_equal(ops->quant_error_take(ctx, &qe), EPD_OK);
    assert_true(qe.dispatch_ref2 == 0.0 && qe.combine_ref2 == 0.0);
    free(buf);
    free(parts);
    ops->fini(ctx);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ops_host__record_layout_bf16__offsets_and_16_byte_size),
        cmocka_unit_test(test_ops_host__record_layout_fp8__scales_per_kind),
        cmocka_unit_test(test_ops_host__layout_hand_made_ids__counts_offsets_slots),
        cmocka_unit_test(test_ops_host__layout_all_empty__no_records),
        cmocka_unit_test(test_ops_host__layout_bad_ids__expert_out_of_range),
        cmocka_unit_test(test_ops_host__shape_check__experts_not_multiple_of_ranks__message),
        cmocka_unit_test(test_ops_host__expert_kinds__found_by_kind_and_name),
        cmocka_unit_test(test_ops_host__pack_bf16__record_fields_and_zero_padding),
        cmocka_unit_test(test_ops_host__reference_hand_computed__exact_value),
        cmocka_unit_test(test_ops_host__reference_partial_rounding__bf16_per_rank),
        cmocka_unit_test(test_ops_host__reference_fp8_identity__close_to_input),
        cmocka_unit_test(test_ops_host__bad_arguments__invalid_arg_not_crash),
        cmocka_unit_test(test_ops_host__world1_bf16_and_fp8__equals_reference),
        cmocka_unit_test(test_ops_host__world2_every_format__equals_reference),
        cmocka_unit_test(test_ops_host__world4_with_idle_rank__equals_reference),
        cmocka_unit_test(test_ops_host__world2_and_world4_fp8_combine__equals_reference),
        cmocka_unit_test(test_ops_host__partial_layout__bf16_2h_fp8_h_plus_scales_padded),
        cmocka_unit_test(test_ops_host__partial_store_fp8__dispatch_bytes_and_scales),
        cmocka_unit_test(test_ops_host__reference_fp8_combine__partial_quantized_not_bf16),
        cmocka_unit_test(test_ops_host__quant_error_telemetry__sums_of_what_was_quantized),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
