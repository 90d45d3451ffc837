/* MPI test program for tests/integration/step_np.sh: every rank runs random batches (a different
 * N per rank and per step, 0 included) through epd_step_run on the host ops and the mpi transport,
 * and checks its y bit for bit against epd_moe_reference, for BF16 and FP8 (both scale kinds and
 * formats), identity and scale experts. Exit 0 when every rank passed. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/step.h"
#include "comm/transport_mpi.h"
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
    int provided, rank, world, failures = 0, all_failures = 0, checked = 0;
    uint16_t *ref = malloc((size_t)MAX_TOKENS * HIDDEN * 2);

    MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (ref == NULL || epd_ops_host.init(-1, &octx, err) != EPD_OK ||
        epd_transport_mpi.init(MPI_COMM_WORLD, &epd_ops_host, octx, &tctx, err) != EPD_OK) {
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
        if (epd_step_create(&shape, MAX_TOKENS, &epd_ops_host, octx, &epd_transport_mpi, tctx,
                            MPI_COMM_WORLD, &step, err) != EPD_OK) {
            fprintf(stderr, "rank %d: %s\n", rank, err);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
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
            random_batch(&seed, n, io->x, io->topk_ids, io->topk_weights);
            epd_step_timing_t tm;
            if (epd_step_run(step, n, io->x, io->topk_ids, io->topk_weights, io->y, &tm, err) !=
                EPD_OK) {
                fprintf(stderr, "rank %d: step failed: %s\n", rank, err);
                MPI_Abort(MPI_COMM_WORLD, 3);
            }
            if (epd_moe_reference(&shape, n, io->x, io->topk_ids, io->topk_weights, ref) !=
                EPD_OK) {
                fprintf(stderr, "rank %d: reference failed\n", rank);
                MPI_Abort(MPI_COMM_WORLD, 3);
            }
            for (size_t i = 0; i < (size_t)n * HIDDEN; i++) {
                if (io->y[i] != ref[i]) {
                    fprintf(stderr,
                            "rank %d case %zu step %d: token %zu element %zu: step 0x%04x, "
                            "reference 0x%04x\n",
                            rank, c, s, i / HIDDEN, i % HIDDEN, io->y[i], ref[i]);
                    failures++;
                    break;
                }
            }
            checked += (int)n;
        }
        epd_step_destroy(step);
    }

    MPI_Allreduce(&failures, &all_failures, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    printf("rank %d/%d: %d tokens checked in %zu cases x %d steps, %d mismatching steps\n", rank,
           world, checked, sizeof cases / sizeof cases[0], STEPS, failures);
    epd_transport_mpi.fini(tctx);
    epd_ops_host.fini(octx);
    free(ref);
    MPI_Finalize();
    return all_failures == 0 ? 0 : 1;
}
