/* staged_check: the staged mpi transport (comm/transport_staged.c) between real ranks, on the host
 * ops (whose async copies complete at once): random uneven per-peer counts (zeros included), gaps
 * between the displacements, several item sizes and chunk sizes (1 byte, odd, 4 KiB, the
 * default), the same transport reused across calls. Every received byte and every gap byte is
 * checked. Run under mpirun by tests/integration/transport_staged.sh; exit 0 when all ranks pass. */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mpi.h>

#include "comm/transport_staged.h"
#include "common/rng.h"
#include "gpu/ops.h"

#define GAP_ITEMS 2
#define FILL 0xee

/* Items rank `from` sends rank `to` in a trial: the same on every rank, in [min, max]; with
 * min = 0 one in five is zero. */
static uint64_t count_of(uint64_t trial, int from, int to, uint64_t min, uint64_t max)
{
    uint64_t v = epd_rng_hash(trial * 1000003u + (uint64_t)from * 1009u + (uint64_t)to);
    return min == 0 && v % 5 == 0 ? 0 : min + v % (max - min + 1);
}

static uint8_t byte_of(uint64_t trial, int from, int to, size_t i)
{
    return (uint8_t)epd_rng_hash((trial << 40) ^ ((uint64_t)from << 32) ^ ((uint64_t)to << 24) ^ i);
}

/* One alltoallv through ctx; returns the number of bad bytes seen by this rank. */
static long run_trial(epd_transport_ctx_t *ctx, uint64_t trial, int me, int world, size_t item,
                      uint64_t min_items, uint64_t max_items)
{
    uint64_t *sc = calloc((size_t)world * 4, sizeof *sc), *sd = sc + world, *rc = sc + 2 * world,
             *rd = sc + 3 * world;
    size_t s_total = 0, r_total = 0;
    long bad = 0;

    for (int p = 0; p < world; p++) {
        sc[p] = count_of(trial, me, p, min_items, max_items);
        rc[p] = count_of(trial, p, me, min_items, max_items);
        /* peers in reverse order in the buffers, with gaps, so displacements matter */
        sd[world - 1 - p] = 0;
    }
    for (int i = 0; i < world; i++) {
        int p = world - 1 - i;
        sd[p] = s_total / item;
        s_total += (sc[p] + GAP_ITEMS) * item;
        rd[p] = r_total / item;
        r_total += (rc[p] + GAP_ITEMS) * item;
    }
    uint8_t *send = malloc(s_total + 1), *recv = malloc(r_total + 1);
    memset(send, FILL, s_total + 1);
    memset(recv, FILL, r_total + 1);
    for (int p = 0; p < world; p++)
        for (size_t i = 0; i < sc[p] * item; i++) send[sd[p] * item + i] = byte_of(trial, me, p, i);

    epd_status_t status = epd_transport_mpi_staged.alltoallv(ctx, send, sc, sd, recv, rc, rd, item);
    if (status != EPD_OK) {
        fprintf(stderr, "rank %d trial %" PRIu64 ": alltoallv failed: %s (%s)\n", me, trial,
                epd_status_name(status), epd_transport_mpi_staged.last_error(ctx));
        bad++;
    }
    for (int p = 0; p < world && status == EPD_OK; p++) {
        for (size_t i = 0; i < rc[p] * item; i++) {
            if (recv[rd[p] * item + i] != byte_of(trial, p, me, i)) {
                if (bad < 5)
                    fprintf(stderr, "rank %d trial %" PRIu64 ": byte %zu from rank %d wrong\n", me,
                            trial, i, p);
                bad++;
            }
        }
        for (size_t i = 0; i < GAP_ITEMS * item; i++) {
            if (recv[(rd[p] + rc[p]) * item + i] != FILL) {
                if (bad < 5) fprintf(stderr, "rank %d: gap after rank %d written\n", me, p);
                bad++;
            }
        }
    }
    free(send);
    free(recv);
    free(sc);
    return bad;
}

int main(int argc, char **argv)
{
    static const char *chunks[] = { "1", "7", "4096", NULL };
    static const size_t items[] = { 1, 3, 16, 304 };
    epd_ops_ctx_t *ops_ctx;
    char err[EPD_ERR_LEN];
    int me, world, provided;
    long bad = 0, bad_all = 0, cases = 0;

    MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (epd_ops_host.init(-1, &ops_ctx, err) != EPD_OK) {
        fprintf(stderr, "host ops: %s\n", err);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    double t0 = MPI_Wtime();
    for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
        epd_transport_ctx_t *ctx;
        if (chunks[c] != NULL)
            setenv(EPD_STAGED_CHUNK_ENV, chunks[c], 1);
        else
            unsetenv(EPD_STAGED_CHUNK_ENV);
        if (epd_transport_mpi_staged.init(MPI_COMM_WORLD, &epd_ops_host, ops_ctx, &ctx, err) != EPD_OK) {
            fprintf(stderr, "rank %d: init: %s\n", me, err);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        for (size_t i = 0; i < sizeof items / sizeof items[0]; i++) {
            /* 1-byte chunks: few bytes, or the test is all message overhead */
            uint64_t max_items = c == 0 ? 120 / items[i] : c == 1 ? 4000 / items[i] : 2000;
            for (uint64_t trial = 0; trial < 3; trial++) {
                bad += run_trial(ctx, c * 100 + i * 10 + trial, me, world, items[i], 0, max_items);
                cases++;
            }
        }
        epd_transport_mpi_staged.fini(ctx);
        if (me == 0)
            printf("chunk %s: %.2f s\n", chunks[c] != NULL ? chunks[c] : "default", MPI_Wtime() - t0);
        t0 = MPI_Wtime();
    }
    /* a large one with the default chunk: several chunks per peer */
    {
        epd_transport_ctx_t *ctx;
        unsetenv(EPD_STAGED_CHUNK_ENV);
        if (epd_transport_mpi_staged.init(MPI_COMM_WORLD, &epd_ops_host, ops_ctx, &ctx, err) != EPD_OK)
            MPI_Abort(MPI_COMM_WORLD, 1);
        bad += run_trial(ctx, 999, me, world, 7168 + 304, 0, 1200);
        cases++;
        epd_transport_mpi_staged.fini(ctx);
    }
    epd_ops_host.fini(ops_ctx);
    MPI_Allreduce(&bad, &bad_all, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (me == 0)
        printf("staged_check: %d ranks, %ld cases per rank, %ld bad bytes\n", world, cases, bad_all);
    MPI_Finalize();
    return bad_all == 0 ? 0 : 1;
}
