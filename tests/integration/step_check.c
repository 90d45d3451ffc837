/* MPI test program for tests/integration/step_np.sh: every rank runs random batches (a different
 * N per rank and per step, 0 included) through epd_step_run on the host ops and the mpi transport,
 * and checks its y bit for bit against epd_moe_reference, for BF16 and FP8 (both scale kinds and
 * formats), identity and scale experts. With the step scale exchange on (all cases but two), it
 * checks that epd_step_scale equals the largest scale of the records the rank received, reduced
 * here over those records, and that it is 0 when off. `--ops cuda` runs the same on the CUDA ops
 * (device 0, staged mpi transport; tests/gpu/quant_gpu.sh runs it on 2 ranks sharing a GPU).
 * Exit 0 when every rank passed, 77 when the ops asked for are not built. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/step.h"
#include "comm/transport_mpi.h"
#include "comm/transport_staged.h"
#include "common/rng.h"
#include "gpu/fp8.h"
#include "gpu/ops.h"

#define HIDDEN     256
#define TOPK       4
#define EXPERTS    16
#define MAX_TOKENS 48
#define STEPS      6

static void random_batch(uint64_t *seed, uint32_t n, uint16_t *x, int32_t *ids, float *w)
{
    for (size_t i = 0; i < (size_t)n * HIDDEN; i++) {
        float v = (float)((int64_t)(epd_rng_next(seed) % 40001) - 20000) / 5000.0f;
        if (epd_rng_next(seed) % 101 == 0) v *= 50.0f; /* outliers make group scales differ */
        x[i] = epd_f32_to_bf16(v);
    }
    for (uint32_t t = 0; t < n; t++) {
        int32_t *row = ids + (size_t)t * TOPK;
        for (uint32_t k = 0; k < TOPK; k++) {
            int32_t e;
            int dup;
            do {
                e = (int32_t)(epd_rng_next(seed) % EXPERTS);
                dup = 0;
                for (uint32_t j = 0; j < k; j++) dup |= row[j] == e;
            } while (dup);
            row[k] = e;
            w[(size_t)t * TOPK + k] = (float)(epd_rng_next(seed) % 10000 + 1) / 10000.0f;
        }
        for (uint32_t k = 0; k < TOPK; k++)
            if (t % 7 == 6 || epd_rng_next(seed) % 6 == 0) row[k] = -1;
    }
}

/* The largest scale of the records this rank received in the last run (its own in send_buf),
 * read from the records themselves. */
static float received_scale_max(epd_step_t *step, const epd_ops_t *ops, epd_ops_ctx_t *octx,
                                const epd_moe_shape_t *shape, uint32_t me, uint32_t world)
{
    epd_step_exchange_t x;
    epd_record_layout_t rec;
    float big = 0.0f;
    epd_step_last_exchange(step, &x);
    epd_record_layout(shape, &rec);
    uint8_t *buf = malloc(rec.size);
    for (uint32_t r = 0; r < world && buf != NULL; r++) {
        const uint8_t *base = r == me ? (const uint8_t *)x.send_buf + x.send_displs[me] * rec.size
                                      : (const uint8_t *)x.recv_buf + x.recv_displs[r] * rec.size;
        uint64_t n = r == me ? x.send_counts[me] : x.recv_counts[r];
        for (uint64_t i = 0; i < n; i++) {
            if (ops->copy_to_host(octx, buf, base + i * rec.size, rec.size) != EPD_OK) {
                fprintf(stderr, "rank %u: copy_to_host of a record failed\n", me);
                MPI_Abort(MPI_COMM_WORLD, 3);
            }
            for (size_t k = 0; k < rec.n_scales; k++) {
                float v;
                memcpy(&v, buf + rec.scales + k * sizeof v, sizeof v);
                if (v > big) big = v;
            }
        }
    }
    free(buf);
    return big;
}

int main(int argc, char **argv)
{
    static const struct {
        epd_wire_dtype_t dtype;
        epd_scale_kind_t scale;
        epd_scale_fmt_t fmt;
        epd_expert_kind_t kind;
        epd_combine_dtype_t combine;
    } cases[] = {
        {EPD_WIRE_FP8, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, EPD_EXPERTS_SCALE,
         EPD_COMBINE_BF16},
        {EPD_WIRE_FP8, EPD_SCALE_PER_TOKEN, EPD_SCALE_FMT_UE8M0, EPD_EXPERTS_IDENTITY,
         EPD_COMBINE_BF16},
        {EPD_WIRE_FP8, EPD_SCALE_GROUP128, EPD_SCALE_FMT_UE8M0, EPD_EXPERTS_SCALE,
         EPD_COMBINE_BF16},
        {EPD_WIRE_FP8, EPD_SCALE_PER_TOKEN, EPD_SCALE_FMT_FP32, EPD_EXPERTS_SCALE,
         EPD_COMBINE_BF16},
        {EPD_WIRE_BF16, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, EPD_EXPERTS_SCALE,
         EPD_COMBINE_BF16},
        {EPD_WIRE_BF16, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, EPD_EXPERTS_IDENTITY,
         EPD_COMBINE_BF16},
        /* FP8 partials (combine.dtype fp8), after FP8 and BF16 dispatch */
        {EPD_WIRE_FP8, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, EPD_EXPERTS_SCALE,
         EPD_COMBINE_FP8},
        {EPD_WIRE_FP8, EPD_SCALE_PER_TOKEN, EPD_SCALE_FMT_UE8M0, EPD_EXPERTS_IDENTITY,
         EPD_COMBINE_FP8},
        {EPD_WIRE_BF16, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, EPD_EXPERTS_SCALE,
         EPD_COMBINE_FP8},
    };
    char err[EPD_ERR_LEN];
    epd_ops_ctx_t *octx = NULL;
    epd_transport_ctx_t *tctx = NULL;
    int provided, rank, world, failures = 0, all_failures = 0, checked = 0, scales_checked = 0;
    uint16_t *ref = malloc((size_t)MAX_TOKENS * HIDDEN * 2);
    /* the batch on the host; the step's own buffers are ops memory */
    uint16_t *x = malloc((size_t)MAX_TOKENS * HIDDEN * 2), *y = malloc((size_t)MAX_TOKENS * HIDDEN * 2);
    int32_t *ids = malloc((size_t)MAX_TOKENS * TOPK * 4);
    float *w = malloc((size_t)MAX_TOKENS * TOPK * 4);
    const epd_ops_t *ops = &epd_ops_host;
    const epd_transport_t *transport = &epd_transport_mpi;
    int device = -1;

    MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (argc == 3 && strcmp(argv[1], "--ops") == 0 && strcmp(argv[2], "cuda") == 0) {
#ifdef EPD_HAVE_CUDA
        ops = &epd_ops_cuda;
        transport = &epd_transport_mpi_staged;
        device = 0;
#else
        if (rank == 0) printf("SKIP: built without CUDA\n");
        MPI_Finalize();
        return 77;
#endif
    } else if (argc != 1 && !(argc == 3 && strcmp(argv[1], "--ops") == 0 &&
                              strcmp(argv[2], "host") == 0)) {
        if (rank == 0) fprintf(stderr, "usage: step_check [--ops host|cuda]\n");
        MPI_Finalize();
        return 2;
    }
    if (ref == NULL || x == NULL || y == NULL || ids == NULL || w == NULL) {
        fprintf(stderr, "rank %d: out of memory\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    {
        /* the CUDA ops on a machine without a usable GPU: every rank skips together */
        int ok = ops->init(device, &octx, err) == EPD_OK, all_ok = 0;
        MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
        if (!all_ok) {
            if (device >= 0) {
                if (!ok) printf("SKIP: rank %d: %s\n", rank, err);
                if (ok) ops->fini(octx);
                MPI_Finalize();
                return 77;
            }
            fprintf(stderr, "rank %d: setup failed: %s\n", rank, err);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
    }
    if (transport->init(MPI_COMM_WORLD, ops, octx, &tctx, err) != EPD_OK) {
        fprintf(stderr, "rank %d: setup failed: %s\n", rank, err);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    if (EXPERTS % world != 0) {
        if (rank == 0) printf("SKIP: %d ranks do not divide %d experts\n", world, EXPERTS);
        MPI_Finalize();
        return 77;
    }

    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        epd_moe_shape_t shape = {
            .hidden = HIDDEN,
            .topk = TOPK,
            .num_experts = EXPERTS,
            .world = (uint32_t)world,
            .rank = (uint32_t)rank,
            .dtype = cases[c].dtype,
            .scale = cases[c].scale,
            .scale_format = cases[c].fmt,
            .expert_kind = cases[c].kind,
            .combine_dtype = cases[c].combine,
            .quant_error = c % 2 == 0, /* the telemetry changes no byte */
        };
        epd_step_t *step = NULL;
        if (epd_step_create(&shape, MAX_TOKENS, ops, octx, transport, tctx, MPI_COMM_WORLD, &step,
                            err) != EPD_OK) {
            fprintf(stderr, "rank %d: %s\n", rank, err);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        /* the scale exchange on all but two cases (off must leave S at 0, no byte changed) */
        const bool scale_on = c != 1 && c != 5;
        epd_step_set_scale_exchange(step, scale_on);
        const epd_step_io_t *io = epd_step_io(step);
        uint64_t seed = 0x5eed0000ull + (uint64_t)rank * 7919 + c * 104729;
        for (int s = 0; s < STEPS; s++) {
            /* step 0: every rank empty; step 1: rank 0 empty, others full; then random sizes */
            uint32_t n;
            if (s == 0)
                n = 0;
            else if (s == 1)
                n = rank == 0 ? 0 : MAX_TOKENS;
            else
                n = (uint32_t)(epd_rng_next(&seed) % (MAX_TOKENS + 1));
            random_batch(&seed, n, x, ids, w);
            if (n > 0 && (ops->copy_to_ops(octx, io->x, x, (size_t)n * HIDDEN * 2) != EPD_OK ||
                          ops->copy_to_ops(octx, io->topk_ids, ids, (size_t)n * TOPK * 4) != EPD_OK ||
                          ops->copy_to_ops(octx, io->topk_weights, w, (size_t)n * TOPK * 4) !=
                              EPD_OK)) {
                fprintf(stderr, "rank %d: copy of the batch failed\n", rank);
                MPI_Abort(MPI_COMM_WORLD, 3);
            }
            epd_step_timing_t tm;
            if (epd_step_run(step, n, io->x, io->topk_ids, io->topk_weights, io->y, &tm, err) !=
                EPD_OK) {
                fprintf(stderr, "rank %d: step failed: %s\n", rank, err);
                MPI_Abort(MPI_COMM_WORLD, 3);
            }
            if (n > 0 && ops->copy_to_host(octx, y, io->y, (size_t)n * HIDDEN * 2) != EPD_OK) {
                fprintf(stderr, "rank %d: copy of y failed\n", rank);
                MPI_Abort(MPI_COMM_WORLD, 3);
            }
            if (epd_moe_reference(&shape, n, x, ids, w, ref) != EPD_OK) {
                fprintf(stderr, "rank %d: reference failed\n", rank);
                MPI_Abort(MPI_COMM_WORLD, 3);
            }
            for (size_t i = 0; i < (size_t)n * HIDDEN; i++) {
                if (y[i] != ref[i]) {
                    fprintf(stderr,
                            "rank %d case %zu step %d: token %zu element %zu: step 0x%04x, "
                            "reference 0x%04x\n",
                            rank, c, s, i / HIDDEN, i % HIDDEN, y[i], ref[i]);
                    failures++;
                    break;
                }
            }
            checked += (int)n;
            /* S: the senders' maxima through the count exchange = the largest scale received */
            const bool fp8_on = scale_on && shape.dtype == EPD_WIRE_FP8;
            float got = epd_step_scale(step);
            float want = fp8_on ? received_scale_max(step, ops, octx, &shape, (uint32_t)rank,
                                                     (uint32_t)world)
                                : 0.0f;
            if (memcmp(&got, &want, sizeof got) != 0 ||
                (fp8_on && tm.records_recv > 0 && !(got > 0.0f))) {
                fprintf(stderr,
                        "rank %d case %zu step %d: step scale %.9g, the received records' "
                        "largest scale %.9g (exchange %s, %u records received)\n",
                        rank, c, s, (double)got, (double)want, scale_on ? "on" : "off",
                        tm.records_recv);
                failures++;
            }
            if (fp8_on && tm.records_recv > 0) scales_checked++;
        }
        epd_step_destroy(step);
    }

    MPI_Allreduce(&failures, &all_failures, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    printf("rank %d/%d (%s ops): %d tokens checked in %zu cases x %d steps, step scale checked "
           "in %d steps, %d mismatching steps\n", rank, world, ops->name, checked,
           sizeof cases / sizeof cases[0], STEPS, scales_checked, failures);
    transport->fini(tctx);
    ops->fini(octx);
    free(ref);
    free(x);
    free(y);
    free(ids);
    free(w);
    MPI_Finalize();
    return all_failures == 0 ? 0 : 1;
}
