/* Unit tests of comm/: the collective step at world = 1 (MPI singleton: no mpirun needed) against
 * epd_moe_reference, a failing transport's own sentence in the step's error, and the mpi
 * transport's 64-bit count conversion, datatype items and last error. The transport choice is
 * tests/unit/test_registry.c; multi-rank steps are tests/integration/step_np.sh. */
#include <limits.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <mpi.h>

#include "comm/step.h"
#include "comm/transport_mpi.h"
#include "common/rng.h"
#include "gpu/fp8.h"
#include "gpu/ops.h"
#include "gpu/quant.h"
#include "tests/unit/mpi_main.h"

static epd_moe_shape_t world1_shape(epd_wire_dtype_t dtype, epd_expert_kind_t kind)
{
    epd_moe_shape_t s = {
        .hidden = 256,
        .topk = 4,
        .num_experts = 16,
        .world = 1,
        .rank = 0,
        .dtype = dtype,
        .scale = EPD_SCALE_GROUP128,
        .scale_format = EPD_SCALE_FMT_FP32,
        .expert_kind = kind,
    };
    return s;
}

typedef struct fixture {
    epd_ops_ctx_t *ops_ctx;
    epd_transport_ctx_t *tctx;
} fixture_t;

static int setup(void **state)
{
    fixture_t *f = calloc(1, sizeof *f);
    char err[EPD_ERR_LEN];

    if (f == NULL) return -1;
    if (epd_ops_host.init(-1, &f->ops_ctx, err) != EPD_OK) return -1;
    if (epd_transport_mpi.init(MPI_COMM_WORLD, &epd_ops_host, f->ops_ctx, &f->tctx, err) != EPD_OK)
        return -1;
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture_t *f = *state;

    epd_transport_mpi.fini(f->tctx);
    epd_ops_host.fini(f->ops_ctx);
    free(f);
    return 0;
}

/* Random batch of n tokens into the step's own buffers (host ops: plain memory). */
static void fill_batch(const epd_moe_shape_t *s, const epd_step_io_t *io, uint32_t n, uint64_t seed)
{
    for (size_t i = 0; i < (size_t)n * s->hidden; i++)
        io->x[i] = epd_f32_to_bf16((float)((int64_t)(epd_rng_next(&seed) % 20001) - 10000) / 2500.0f);
    for (uint32_t t = 0; t < n; t++) {
        for (uint32_t k = 0; k < s->topk; k++) {
            /* distinct ids: k-th pick from a rotating window, some slots empty */
            int32_t e = (int32_t)((epd_rng_next(&seed) % 4 + (uint64_t)k * 4) % s->num_experts);
            io->topk_ids[(size_t)t * s->topk + k] =
                (t % 6 == 5 || epd_rng_next(&seed) % 8 == 0) ? -1 : e;
            io->topk_weights[(size_t)t * s->topk + k] =
                (float)(epd_rng_next(&seed) % 1000 + 1) / 1000.0f;
        }
    }
}

static void test_step__world1_batches__equal_reference(void **state)
{
    fixture_t *f = *state;
    const uint32_t sizes[] = {0, 1, 17, 64, 3};
    char err[EPD_ERR_LEN];

    for (int d = 0; d < 2; d++) {
        for (int k = 0; k < 2; k++) {
            epd_moe_shape_t s = world1_shape(d ? EPD_WIRE_BF16 : EPD_WIRE_FP8,
                                             k ? EPD_EXPERTS_IDENTITY : EPD_EXPERTS_SCALE);
            epd_step_t *step = NULL;
            uint16_t *ref = malloc(64 * (size_t)s.hidden * 2);
            assert_non_null(ref);
            assert_int_equal(epd_step_create(&s, 64, &epd_ops_host, f->ops_ctx, &epd_transport_mpi,
                                             f->tctx, MPI_COMM_WORLD, &step, err),
                             EPD_OK);
            const epd_step_io_t *io = epd_step_io(step);
            for (size_t i = 0; i < EPD_ARRAY_SIZE(sizes); i++) {
                uint32_t n = sizes[i];
                epd_step_timing_t tm;
                fill_batch(&s, io, n, 1000 + i + 10 * (uint64_t)(d * 2 + k));
                assert_int_equal(
                    epd_step_run(step, n, io->x, io->topk_ids, io->topk_weights, io->y, &tm, err),
                    EPD_OK);
                assert_int_equal(
                    epd_moe_reference(&s, n, io->x, io->topk_ids, io->topk_weights, ref), EPD_OK);
                if (n > 0) assert_memory_equal(io->y, ref, (size_t)n * s.hidden * 2);
                /* world 1: everything stays on the rank, one record per routed token */
                assert_int_equal(tm.n_tokens, n);
                assert_int_equal(tm.records_sent_off_rank, 0);
                assert_int_equal(tm.dispatch_bytes_off_rank, 0);
                assert_int_equal(tm.records_recv, tm.records_sent);
                epd_record_layout_t rec;
                epd_record_layout(&s, &rec);
                assert_int_equal(tm.dispatch_bytes, (uint64_t)tm.records_sent * rec.size);
                assert_int_equal(tm.combine_bytes, (uint64_t)tm.records_recv * s.hidden * 2);
                uint64_t sum = 0;
                for (int p = 0; p < EPD_PHASE_MAX; p++) sum += tm.phase_ns[p];
                assert_true(sum <= tm.total_ns);
            }
            epd_step_exchange_t ex;
            epd_step_last_exchange(step, &ex);
            assert_int_equal(ex.partial_bytes, s.hidden * 2);
            assert_int_equal(ex.send_capacity, 64);
            assert_int_equal(ex.recv_capacity, 64);
            epd_step_destroy(step);
            free(ref);
        }
    }
}

static void test_step__bad_create_arguments__clear_errors(void **state)
{
    fixture_t *f = *state;
    epd_moe_shape_t s = world1_shape(EPD_WIRE_FP8, EPD_EXPERTS_SCALE);
    epd_step_t *step = NULL;
    char err[EPD_ERR_LEN] = "";

    s.world = 2;
    assert_int_equal(epd_step_create(&s, 8, &epd_ops_host, f->ops_ctx, &epd_transport_mpi, f->tctx,
                                     MPI_COMM_WORLD, &step, err),
                     EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(err, "rank 0 of 2"));
    s.world = 1;
    s.hidden = 200;
    assert_int_equal(epd_step_create(&s, 8, &epd_ops_host, f->ops_ctx, &epd_transport_mpi, f->tctx,
                                     MPI_COMM_WORLD, &step, err),
                     EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(err, "multiple of 128"));
    s.hidden = 256;
    assert_int_equal(epd_step_create(&s, 0, &epd_ops_host, f->ops_ctx, &epd_transport_mpi, f->tctx,
                                     MPI_COMM_WORLD, &step, err),
                     EPD_ERR_INVALID_ARG);
    assert_null(step);
}

static void test_step__too_many_tokens_and_bad_ids__refused_with_message(void **state)
{
    fixture_t *f = *state;
    epd_moe_shape_t s = world1_shape(EPD_WIRE_BF16, EPD_EXPERTS_SCALE);
    epd_step_t *step = NULL;
    char err[EPD_ERR_LEN] = "";

    assert_int_equal(epd_step_create(&s, 4, &epd_ops_host, f->ops_ctx, &epd_transport_mpi, f->tctx,
                                     MPI_COMM_WORLD, &step, err),
                     EPD_OK);
    const epd_step_io_t *io = epd_step_io(step);
    fill_batch(&s, io, 4, 5);
    assert_int_equal(epd_step_run(step, 5, io->x, io->topk_ids, io->topk_weights, io->y, NULL, err),
                     EPD_ERR_TOO_MANY_TOKENS);
    assert_non_null(strstr(err, "5 tokens"));
    assert_int_equal(epd_step_run(step, 2, NULL, io->topk_ids, io->topk_weights, io->y, NULL, err),
                     EPD_ERR_INVALID_ARG);
    /* an id past E is caught by the layout before anything is exchanged */
    io->topk_ids[1] = 16;
    assert_int_equal(epd_step_run(step, 4, io->x, io->topk_ids, io->topk_weights, io->y, NULL, err),
                     EPD_ERR_EXPERT_OUT_OF_RANGE);
    assert_non_null(strstr(err, "layout"));
    assert_non_null(strstr(err, "expert id 16 of token 0 is outside [0, 16)"));
    epd_step_destroy(step);
}

static void test_step__memory_bytes__counts_every_buffer(void **state)
{
    epd_moe_shape_t s = world1_shape(EPD_WIRE_BF16, EPD_EXPERTS_SCALE);
    epd_record_layout_t rec;

    epd_record_layout(&s, &rec);
    /* world 1, 10 tokens: 10 send + 10 recv records, 20 partial rows, slots, x, ids (with room
     * for the weights behind them), weights, y */
    size_t want = 20 * rec.size + 20 * 512 + 10 * 4 + 10 * 512 + 10 * 32 + 10 * 16 + 10 * 512 +
                  1 * (2 * 4 + 7 * 8);
    assert_int_equal(epd_step_memory_bytes(&s, 10), want);
    s.world = 8;
    s.hidden = 65536;
    s.topk = 64;
    assert_true(epd_step_memory_bytes(&s, UINT32_MAX) > (size_t)1 << 40);
}

static void test_step__counts_to_int__fit_and_overflow(void **state)
{
    const uint64_t counts[] = {0, 5, (uint64_t)INT_MAX};
    const uint64_t displs[] = {0, 0, 5};
    const uint64_t big_count[] = {1, (uint64_t)INT_MAX + 1, 0};
    const uint64_t big_displ[] = {0, 1, (uint64_t)1 << 33};
    int c[3], d[3];
    char err[EPD_ERR_LEN] = "";

    assert_int_equal(epd_mpi_counts_to_int(counts, displs, 3, c, d, err), EPD_OK);
    assert_int_equal(c[2], INT_MAX);
    assert_int_equal(d[2], 5);
    assert_int_equal(epd_mpi_counts_to_int(big_count, displs, 3, c, d, err), EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(err, "2147483648 items for rank 1"));
    assert_int_equal(epd_mpi_counts_to_int(counts, big_displ, 3, c, d, err), EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(err, "displacement 8589934592 items for rank 2"));
}

static void test_step__alltoallv_large_items__bytes_beyond_int_counts(void **state)
{
    fixture_t *f = *state;
    /* 3 items of 1 MiB + 7 bytes: the count is 3 in a contiguous type, not 3 MiB of MPI_BYTE */
    size_t item = ((size_t)1 << 20) + 7;
    uint8_t *send = malloc(3 * item), *recv = calloc(3, item);
    const uint64_t cnt[] = {3}, dsp[] = {0};
    const uint64_t too_many[] = {(uint64_t)INT_MAX + 1};

    assert_non_null(send);
    assert_non_null(recv);
    for (size_t i = 0; i < 3 * item; i++) send[i] = (uint8_t)(i * 31 + 7);
    assert_int_equal(epd_transport_mpi.alltoallv(f->tctx, send, cnt, dsp, recv, cnt, dsp, item),
                     EPD_OK);
    assert_memory_equal(send, recv, 3 * item);
    assert_int_equal(epd_transport_mpi.alltoallv(f->tctx, send, cnt, dsp, recv, cnt, dsp, 0),
                     EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_transport_mpi.alltoallv(f->tctx, send, too_many, dsp, recv, cnt, dsp, 16),
                     EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(epd_transport_mpi.last_error(f->tctx), "do not fit"));
    /* a call that succeeds clears it */
    assert_int_equal(epd_transport_mpi.alltoallv(f->tctx, send, cnt, dsp, recv, cnt, dsp, item),
                     EPD_OK);
    assert_string_equal(epd_transport_mpi.last_error(f->tctx), "");
    free(send);
    free(recv);
}

/* A transport whose alltoallv fails with a sentence of its own. */
static int broken_calls;

static epd_status_t broken_alltoallv(epd_transport_ctx_t *ctx, const void *send,
                                     const uint64_t *send_counts, const uint64_t *send_displs,
                                     void *recv, const uint64_t *recv_counts,
                                     const uint64_t *recv_displs, size_t item_bytes)
{
    broken_calls++;
    return EPD_ERR_MPI;
}

static const char *broken_last_error(const epd_transport_ctx_t *ctx)
{
    return "broken transport: the link is down on purpose";
}

/* One rank has no peer: the step calls no transport at all (a broken one cannot fail it). A
 * transport's failure and its sentence in err are checked on 2 ranks by engine_check. */
static void test_step__one_rank__calls_no_transport(void **state)
{
    fixture_t *f = *state;
    const epd_transport_t broken = {
        .name = "broken",
        .kind = EPD_TRANSPORT_MPI,
        .alltoallv = broken_alltoallv,
        .last_error = broken_last_error,
    };
    epd_moe_shape_t s = world1_shape(EPD_WIRE_FP8, EPD_EXPERTS_SCALE);
    epd_step_t *step = NULL;
    char err[EPD_ERR_LEN] = "";

    assert_int_equal(epd_step_create(&s, 4, &epd_ops_host, f->ops_ctx, &broken, NULL,
                                     MPI_COMM_WORLD, &step, err),
                     EPD_OK);
    const epd_step_io_t *io = epd_step_io(step);
    fill_batch(&s, io, 4, 9);
    broken_calls = 0;
    assert_int_equal(epd_step_run(step, 4, io->x, io->topk_ids, io->topk_weights, io->y, NULL, err),
                     EPD_OK);
    assert_int_equal(broken_calls, 0);
    epd_step_destroy(step);
}

/* The experts hook of the scale-exchange test: keeps the call's S, zero partials. */
static float hook_scale;
static int hook_calls;

static epd_status_t keep_scale_hook(void *arg, const epd_moe_shape_t *shape,
                                    const epd_step_experts_t *call, uint8_t *failure_p,
                                    char err[EPD_ERR_LEN])
{
    (void)arg;
    (void)err;
    for (uint32_t i = 0; i < call->n_segments; i++)
        if (call->segments[i].count > 0)
            memset(call->segments[i].partials, 0,
                   (size_t)call->segments[i].count * shape->hidden * 2);
    hook_scale = call->scale;
    hook_calls++;
    *failure_p = 0;
    return EPD_OK;
}

/* The experts hook gets the step scale of the count exchange (what external experts requantize
 * to one scale with): the largest group scale of the records received, computed here from the
 * tokens themselves; 0 with the exchange off, and on a BF16 wire (no scales travel). */
static void test_step__experts_hook__gets_the_exchange_scale_only_when_on(void **state)
{
    fixture_t *f = *state;
    char err[EPD_ERR_LEN] = "";

    for (int c = 0; c < 3; c++) {
        const bool on = c != 1, fp8 = c != 2;
        epd_moe_shape_t s = world1_shape(fp8 ? EPD_WIRE_FP8 : EPD_WIRE_BF16, EPD_EXPERTS_SCALE);
        epd_step_t *step = NULL;
        assert_int_equal(epd_step_create(&s, 32, &epd_ops_host, f->ops_ctx, &epd_transport_mpi,
                                         f->tctx, MPI_COMM_WORLD, &step, err),
                         EPD_OK);
        epd_step_set_scale_exchange(step, on);
        epd_step_set_experts_hook(step, keep_scale_hook, NULL);
        const epd_step_io_t *io = epd_step_io(step);
        fill_batch(&s, io, 32, 77 + (uint64_t)c);
        /* an outlier in a token that is sent, one in a token that is not (all slots empty) */
        io->x[3 * s.hidden + 200] = epd_f32_to_bf16(900.0f);
        for (uint32_t k = 0; k < s.topk; k++) io->topk_ids[5 * s.topk + k] = -1;
        io->x[5 * s.hidden + 7] = epd_f32_to_bf16(-30000.0f);
        float want = 0.0f;
        for (uint32_t t = 0; t < 32; t++) {
            bool sent = false;
            for (uint32_t k = 0; k < s.topk; k++) sent |= io->topk_ids[t * s.topk + k] >= 0;
            if (!sent) continue;
            uint8_t q[256];
            float sc[2];
            epd_quant_row_host(io->x + (size_t)t * s.hidden, s.hidden, EPD_SCALE_GROUP128,
                               EPD_SCALE_FMT_FP32, q, sc);
            for (int g = 0; g < 2; g++) want = sc[g] > want ? sc[g] : want;
        }
        if (!on || !fp8) want = 0.0f;
        hook_calls = 0;
        hook_scale = -1.0f;
        assert_int_equal(epd_step_run(step, 32, io->x, io->topk_ids, io->topk_weights, io->y,
                                      NULL, err),
                         EPD_OK);
        assert_int_equal(hook_calls, 1);
        assert_memory_equal(&hook_scale, &want, sizeof want);
        assert_float_equal(epd_step_scale(step), want, 0.0f);
        if (on && fp8) assert_true(want > 900.0f / 448.0f * 0.99f);
        epd_step_destroy(step);
    }
}

static int run_group(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_step__world1_batches__equal_reference),
        cmocka_unit_test(test_step__bad_create_arguments__clear_errors),
        cmocka_unit_test(test_step__too_many_tokens_and_bad_ids__refused_with_message),
        cmocka_unit_test(test_step__memory_bytes__counts_every_buffer),
        cmocka_unit_test(test_step__counts_to_int__fit_and_overflow),
        cmocka_unit_test(test_step__alltoallv_large_items__bytes_beyond_int_counts),
        cmocka_unit_test(test_step__one_rank__calls_no_transport),
        cmocka_unit_test(test_step__experts_hook__gets_the_exchange_scale_only_when_on),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

int main(int argc, char **argv)
{
    return epd_test_mpi_main(argc, argv, run_group);
}
