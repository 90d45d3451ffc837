/* mpi_cuda_aware: proves, or disproves, the direct CUDA-aware MPI path that the mpi transport uses.
 * Reports MPIX_Query_cuda_support(), runs an MPI_Alltoallv of device buffers with uneven counts
 * (zeros included) and checks every byte, then times raw MPI_Alltoallv on device, pinned-host and
 * host-staged buffers for DeepSeek-V3-sized dispatches. An MPI program: run it with
 * tests/gpu/run-mpi-cuda-aware.sh (mpirun -np 2, UCX PML). Exit 0 pass, 1 failure, 77 no GPU. */
#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mpi.h>
#if defined(__has_include)
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif
#endif
#include <cuda_runtime_api.h>

#include "common/mpi_error.h"
#include "common/parse.h"

#define EXIT_SKIP 77
#define GUARD_BYTES 4096          /* after the received bytes, must stay untouched */
#define GUARD_VALUE 0xEE
#define CHECK_RECORD_BYTES 7168   /* one FP8 token of hidden 7168 */
#define TIMED_RECORD_BYTES 14336  /* one BF16 token of hidden 7168 */
#define MAX_REPORTED_MISMATCHES 8

/* Per-rank token counts of the timed dispatches: 1.8 MB .. 470 MB of BF16 tokens per rank. */
static const int timed_tokens[] = {128, 512, 2048, 8192, 32768};
#define N_TIMED ((int)(sizeof(timed_tokens) / sizeof(timed_tokens[0])))

typedef enum {
    MODE_DEVICE, /* device pointers straight to MPI (CUDA-aware MPI only) */
    MODE_HOST,   /* pinned host pointers: the MPI cost alone */
    MODE_STAGED, /* device -> pinned host, MPI, pinned host -> device (non-aware MPI) */
    MODE_MAX
} xfer_mode_t;

static const char *const mode_names[MODE_MAX] = {"device", "host", "staged"};

typedef struct {
    uint64_t iters;
    uint64_t warmup;
    uint64_t max_tokens;
    int check_only;
} options_t;

typedef struct {
    MPI_Comm comm;
    int rank;
    int size;
    int local_rank;
    int local_size;
    int device;
} world_t;

/* The timing of one mode and size, as rank 0 prints it. */
typedef struct {
    int done;
    double median_us;
    double offrank_gbps;
} timing_t;

static int agree_all(const world_t *world, int ok)
{
    int all = 0;
    MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, world->comm);
    return all;
}

static int cuda_ok(cudaError_t err, const world_t *world, const char *what)
{
    if (err == cudaSuccess) return 1;
    fprintf(stderr, "FAIL: rank %d: %s: %s (%s)\n", world->rank, what, cudaGetErrorString(err),
            cudaGetErrorName(err));
    return 0;
}

/* A CUDA failure in the middle of a collective sequence cannot be agreed on without deadlock
 * risk: the job aborts, as the daemon does on a GPU error. */
static void cuda_or_abort(cudaError_t err, const world_t *world, const char *what)
{
    if (!cuda_ok(err, world, what)) MPI_Abort(world->comm, 1);
}

static void mpi_or_abort(int rc, const world_t *world, const char *what)
{
    char msg[MPI_MAX_ERROR_STRING];

    if (rc == MPI_SUCCESS) return;
    fprintf(stderr, "FAIL: rank %d: %s: %s\n", world->rank, what, epd_mpi_error_text(rc, msg));
    MPI_Abort(world->comm, 1);
}

/* The byte at offset `byte` of record `rec` that rank src sends to rank dst: distinct for every
 * (src, dst, record, offset), so a misplaced, missing or duplicated block shows. */
static uint8_t pattern_byte(int src, int dst, size_t rec, size_t byte)
{
    uint32_t h = (uint32_t)src * 0x9E3779B1u ^ (uint32_t)dst * 0x85EBCA77u ^
                 (uint32_t)rec * 0xC2B2AE3Du ^ (uint32_t)byte * 0x27D4EB2Fu;

    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    h *= 0x297A2D39u;
    h ^= h >> 15;
    return (uint8_t)h;
}

/* Records rank src sends to rank dst in the correctness check: uneven and rank-dependent, zero
 * for some pairs (an odd rank's self-send among them), and one large block per rank (to the next
 * rank, > 2 MB) so that the rendezvous protocol (cuda_ipc, cuda_copy) is exercised too. */
static int check_count(int src, int dst, int size)
{
    if (size > 1 && dst == (src + 1) % size) return 300 + src;
    if (src == dst && src % 2 == 1) return 0;
    if ((src + dst) % 3 == 2) return 0;
    return 1 + (src * 37 + dst * 11) % 23;
}

static void usage(FILE *out, const char *argv0)
{
    fprintf(out,
            "usage: mpirun -np N %s [--iters N] [--warmup N] [--max-tokens N] [--check-only]\n"
            "  --iters N       timed iterations per size and mode, median reported\n"
            "                  (20..100000, default 20)\n"
            "  --warmup N      untimed iterations first (0..1000, default 3)\n"
            "  --max-tokens N  skip timed sizes above N tokens per rank (1..32768, default 32768)\n"
            "  --check-only    byte checks only, no timing\n"
            "Exit: 0 pass, 1 failure (mismatch, MPI or CUDA error), 77 no GPU.\n",
            argv0);
}

/* Returns 0 on success, 1 on a bad argument (message written by rank 0), 2 for --help. */
static int options_parse(int argc, char **argv, int rank, options_t *opts_p)
{
    char err[EPD_ERR_LEN];
    int i;

    opts_p->iters = 20;
    opts_p->warmup = 3;
    opts_p->max_tokens = 32768;
    opts_p->check_only = 0;
    for (i = 1; i < argc; i++) {
        const char *arg = argv[i];
        uint64_t *target = NULL;
        uint64_t min = 0, max = 0;

        if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) return 2;
        if (strcmp(arg, "--check-only") == 0) {
            opts_p->check_only = 1;
            continue;
        }
        if (strcmp(arg, "--iters") == 0) {
            target = &opts_p->iters, min = 20, max = 100000;
        } else if (strcmp(arg, "--warmup") == 0) {
            target = &opts_p->warmup, min = 0, max = 1000;
        } else if (strcmp(arg, "--max-tokens") == 0) {
            target = &opts_p->max_tokens, min = 1, max = 32768;
        } else {
            if (rank == 0) fprintf(stderr, "mpi_cuda_aware: unknown argument '%s'\n", arg);
            return 1;
        }
        if (i + 1 >= argc) {
            if (rank == 0) fprintf(stderr, "mpi_cuda_aware: %s needs a value\n", arg);
            return 1;
        }
        if (epd_parse_u64(argv[++i], 10, min, max, target, err) != EPD_OK) {
            if (rank == 0) fprintf(stderr, "mpi_cuda_aware: %s: %s\n", arg, err);
            return 1;
        }
    }
    return 0;
}

/* What this MPI says about CUDA: compile-time macro and run-time query (Open MPI's mpi-ext.h). */
static int query_cuda_aware(const world_t *world, char *why, size_t why_len)
{
#if defined(MPIX_CUDA_AWARE_SUPPORT)
    int runtime = MPIX_Query_cuda_support();

    if (world->rank == 0)
        printf("MPIX_CUDA_AWARE_SUPPORT (compile time) = %d, MPIX_Query_cuda_support() = %d\n",
               (int)MPIX_CUDA_AWARE_SUPPORT, runtime);
    snprintf(why, why_len, "%s",
             runtime ? "CUDA-aware"
                     : "this Open MPI was built without CUDA support; build one with "
                       "scripts/cuda-mpi.sh, see docs/gpu-nodes.md");
    return runtime != 0;
#else
    if (world->rank == 0) printf("MPIX_CUDA_AWARE_SUPPORT: not defined by this MPI's headers\n");
    snprintf(why, why_len, "%s",
             "mpi-ext.h has no MPIX_CUDA_AWARE_SUPPORT: not an Open MPI, or one without the cuda "
             "extension");
    return 0;
#endif
}

/* Finds the local rank, sets the device and reports it. Returns 0 when some rank has no usable
 * GPU (every rank then returns 0, after printing why). */
static int world_init(world_t *world)
{
    MPI_Comm local;
    cudaError_t err;
    int ndev = 0, ok;
    char bus[32] = "?";
    struct cudaDeviceProp prop;

    world->comm = MPI_COMM_WORLD;
    MPI_Comm_rank(world->comm, &world->rank);
    MPI_Comm_size(world->comm, &world->size);
    MPI_Comm_split_type(world->comm, MPI_COMM_TYPE_SHARED, world->rank, MPI_INFO_NULL, &local);
    MPI_Comm_rank(local, &world->local_rank);
    MPI_Comm_size(local, &world->local_size);
    MPI_Comm_free(&local);

    err = cudaGetDeviceCount(&ndev);
    ok = err == cudaSuccess && ndev > 0;
    if (!agree_all(world, ok)) {
        if (err != cudaSuccess)
            printf("SKIP: no GPU (rank %d: cudaGetDeviceCount: %s)\n", world->rank,
                   cudaGetErrorString(err));
        else if (ndev == 0)
            printf("SKIP: no GPU (rank %d: no CUDA device)\n", world->rank);
        else
            printf("SKIP: no GPU (rank %d has one, another rank has none)\n", world->rank);
        return 0;
    }
    world->device = world->local_rank % ndev;
    if (world->local_size > ndev && world->local_rank == 0)
        fprintf(stderr, "warning: %d ranks on this node share %d GPUs: numbers are not per-GPU\n",
                world->local_size, ndev);
    ok = cuda_ok(cudaSetDevice(world->device), world, "cudaSetDevice") &&
         cuda_ok(cudaGetDeviceProperties(&prop, world->device), world, "cudaGetDeviceProperties") &&
         cuda_ok(cudaDeviceGetPCIBusId(bus, (int)sizeof(bus), world->device), world,
                 "cudaDeviceGetPCIBusId");
    if (!agree_all(world, ok)) {
        printf("SKIP: no GPU (a rank could not use its CUDA device)\n");
        return 0;
    }
    printf("rank %d: local rank %d of %d, device %d of %d: %s (%s)\n", world->rank,
           world->local_rank, world->local_size, world->device, ndev, prop.name, bus);
    fflush(stdout);
    return 1;
}

/* Counts and displacements, in records, of a balanced or a check exchange. */
typedef struct {
    int *send_counts, *send_displs, *recv_counts, *recv_displs;
    size_t send_records, recv_records;
} layout_t;

static void layout_free(layout_t *layout)
{
    free(layout->send_counts);
    free(layout->send_displs);
    free(layout->recv_counts);
    free(layout->recv_displs);
    memset(layout, 0, sizeof(*layout));
}

/* tokens < 0: the uneven check layout; else `tokens` records per rank split evenly over ranks
 * (the first tokens % size destinations get one more). */
static int layout_init(const world_t *world, int tokens, layout_t *layout_p)
{
    int peer;
    size_t sent = 0, received = 0;

    memset(layout_p, 0, sizeof(*layout_p));
    layout_p->send_counts = calloc((size_t)world->size, sizeof(int));
    layout_p->send_displs = calloc((size_t)world->size, sizeof(int));
    layout_p->recv_counts = calloc((size_t)world->size, sizeof(int));
    layout_p->recv_displs = calloc((size_t)world->size, sizeof(int));
    if (!layout_p->send_counts || !layout_p->send_displs || !layout_p->recv_counts ||
        !layout_p->recv_displs) {
        layout_free(layout_p);
        return 0;
    }
    for (peer = 0; peer < world->size; peer++) {
        if (tokens < 0) {
            layout_p->send_counts[peer] = check_count(world->rank, peer, world->size);
            layout_p->recv_counts[peer] = check_count(peer, world->rank, world->size);
        } else {
            int share = tokens / world->size;
            layout_p->send_counts[peer] = share + (peer < tokens % world->size);
            layout_p->recv_counts[peer] = share + (world->rank < tokens % world->size);
        }
        layout_p->send_displs[peer] = (int)sent;
        layout_p->recv_displs[peer] = (int)received;
        sent += (size_t)layout_p->send_counts[peer];
        received += (size_t)layout_p->recv_counts[peer];
    }
    layout_p->send_records = sent;
    layout_p->recv_records = received;
    return 1;
}

/* One all-to-all in `mode`. For MODE_STAGED the device buffers are copied through the pinned
 * host buffers; the other modes hand their own buffers to MPI. */
static void exchange(const world_t *world, xfer_mode_t mode, const layout_t *layout,
                     MPI_Datatype record, size_t record_bytes, void *dev_send, void *dev_recv,
                     void *host_send, void *host_recv)
{
    switch (mode) {
    case MODE_DEVICE:
        mpi_or_abort(MPI_Alltoallv(dev_send, layout->send_counts, layout->send_displs, record,
                                   dev_recv, layout->recv_counts, layout->recv_displs, record,
                                   world->comm),
                     world, "MPI_Alltoallv (device buffers)");
        break;
    case MODE_HOST:
        mpi_or_abort(MPI_Alltoallv(host_send, layout->send_counts, layout->send_displs, record,
                                   host_recv, layout->recv_counts, layout->recv_displs, record,
                                   world->comm),
                     world, "MPI_Alltoallv (pinned host buffers)");
        break;
    case MODE_STAGED:
        cuda_or_abort(cudaMemcpy(host_send, dev_send, layout->send_records * record_bytes,
                                 cudaMemcpyDeviceToHost),
                      world, "cudaMemcpy device to host");
        mpi_or_abort(MPI_Alltoallv(host_send, layout->send_counts, layout->send_displs, record,
                                   host_recv, layout->recv_counts, layout->recv_displs, record,
                                   world->comm),
                     world, "MPI_Alltoallv (staged through pinned host buffers)");
        cuda_or_abort(cudaMemcpy(dev_recv, host_recv, layout->recv_records * record_bytes,
                                 cudaMemcpyHostToDevice),
                      world, "cudaMemcpy host to device");
        break;
    default:
        MPI_Abort(world->comm, 1);
    }
}

/* The byte check: an uneven MPI_Alltoallv whose results land in device memory, copied back and
 * compared byte for byte, guard bytes included. Returns the number of mismatches on all ranks
 * together (every rank gets the same number), or -1 when buffers could not be allocated. */
static long long check_exchange(const world_t *world, xfer_mode_t mode)
{
    const size_t rb = CHECK_RECORD_BYTES;
    layout_t layout;
    MPI_Datatype record;
    uint8_t *host_send = NULL, *host_recv = NULL, *check = NULL;
    void *dev_send = NULL, *dev_recv = NULL;
    size_t send_bytes, recv_bytes, rec, byte;
    long long mismatches = 0, total = 0;
    int ok, peer, reported = 0;

    ok = layout_init(world, -1, &layout);
    if (!agree_all(world, ok)) {
        if (ok) layout_free(&layout);
        return -1;
    }
    send_bytes = layout.send_records * rb;
    recv_bytes = layout.recv_records * rb;
    ok = cuda_ok(cudaMallocHost((void **)&host_send, send_bytes + 1), world, "cudaMallocHost") &&
         cuda_ok(cudaMallocHost((void **)&host_recv, recv_bytes + GUARD_BYTES), world,
                 "cudaMallocHost") &&
         cuda_ok(cudaMalloc(&dev_send, send_bytes + 1), world, "cudaMalloc") &&
         cuda_ok(cudaMalloc(&dev_recv, recv_bytes + GUARD_BYTES), world, "cudaMalloc") &&
         (check = malloc(recv_bytes + GUARD_BYTES)) != NULL;
    if (!agree_all(world, ok)) {
        mismatches = -1;
        goto out_free;
    }

    for (peer = 0; peer < world->size; peer++) {
        uint8_t *dst = host_send + (size_t)layout.send_displs[peer] * rb;
        for (rec = 0; rec < (size_t)layout.send_counts[peer]; rec++)
            for (byte = 0; byte < rb; byte++)
                dst[rec * rb + byte] = pattern_byte(world->rank, peer, rec, byte);
    }
    cuda_or_abort(cudaMemcpy(dev_send, host_send, send_bytes, cudaMemcpyHostToDevice), world,
                  "cudaMemcpy host to device");
    cuda_or_abort(cudaMemset(dev_recv, GUARD_VALUE, recv_bytes + GUARD_BYTES), world,
                  "cudaMemset");
    cuda_or_abort(cudaDeviceSynchronize(), world, "cudaDeviceSynchronize");
    /* Only the device copy holds the pattern now: a staged exchange must really copy it out. */
    memset(host_send, 0, send_bytes);
    memset(host_recv, GUARD_VALUE, recv_bytes + GUARD_BYTES);

    MPI_Type_contiguous((int)rb, MPI_BYTE, &record);
    MPI_Type_commit(&record);
    exchange(world, mode, &layout, record, rb, dev_send, dev_recv, host_send, host_recv);
    MPI_Type_free(&record);

    cuda_or_abort(cudaMemcpy(check, dev_recv, recv_bytes + GUARD_BYTES, cudaMemcpyDeviceToHost),
                  world, "cudaMemcpy device to host");
    for (peer = 0; peer < world->size; peer++) {
        const uint8_t *src = check + (size_t)layout.recv_displs[peer] * rb;
        for (rec = 0; rec < (size_t)layout.recv_counts[peer]; rec++) {
            for (byte = 0; byte < rb; byte++) {
                uint8_t want = pattern_byte(peer, world->rank, rec, byte);
                uint8_t got = src[rec * rb + byte];
                if (got == want) continue;
                mismatches++;
                if (reported++ < MAX_REPORTED_MISMATCHES)
                    fprintf(stderr,
                            "MISMATCH %s: rank %d, from rank %d, record %zu, byte %zu: got 0x%02x, "
                            "want 0x%02x\n",
                            mode_names[mode], world->rank, peer, rec, byte, got, want);
            }
        }
    }
    for (byte = 0; byte < GUARD_BYTES; byte++) {
        if (check[recv_bytes + byte] == GUARD_VALUE) continue;
        mismatches++;
        if (reported++ < MAX_REPORTED_MISMATCHES)
            fprintf(stderr,
                    "MISMATCH %s: rank %d wrote past its %zu received bytes (offset +%zu)\n",
                    mode_names[mode], world->rank, recv_bytes, byte);
    }
    printf("check %s: rank %d received %zu records (%zu bytes) from %d ranks, counts",
           mode_names[mode], world->rank, layout.recv_records, recv_bytes, world->size);
    for (peer = 0; peer < world->size; peer++) printf(" %d", layout.recv_counts[peer]);
    printf(": %lld mismatched bytes\n", mismatches);
    fflush(stdout);
    MPI_Allreduce(&mismatches, &total, 1, MPI_LONG_LONG, MPI_SUM, world->comm);
    mismatches = total;

out_free:
    free(check);
    if (dev_recv) cudaFree(dev_recv);
    if (dev_send) cudaFree(dev_send);
    if (host_recv) cudaFreeHost(host_recv);
    if (host_send) cudaFreeHost(host_send);
    layout_free(&layout);
    return mismatches;
}

static int compare_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Buffers of the timed runs, sized once for the largest dispatch. */
typedef struct {
    void *dev_send, *dev_recv, *host_send, *host_recv;
} buffers_t;

/* Times `iters` all-to-alls of `tokens` BF16 tokens per rank in `mode`. Each iteration starts
 * after a barrier; its time is the slowest rank's wall clock for the call (MPI_Wtime). */
static timing_t time_exchange(const world_t *world, const options_t *opts, xfer_mode_t mode,
                              int tokens, const buffers_t *bufs, double *samples)
{
    const size_t rb = TIMED_RECORD_BYTES;
    layout_t layout;
    MPI_Datatype record;
    timing_t timing = {0, 0.0, 0.0};
    size_t offrank_records;
    uint64_t i;

    if (!agree_all(world, layout_init(world, tokens, &layout))) {
        if (world->rank == 0) fprintf(stderr, "FAIL: out of host memory for the layout\n");
        MPI_Abort(world->comm, 1);
    }
    offrank_records = layout.send_records - (size_t)layout.send_counts[world->rank];
    MPI_Type_contiguous((int)rb, MPI_BYTE, &record);
    MPI_Type_commit(&record);
    for (i = 0; i < opts->warmup + opts->iters; i++) {
        double t, slowest = 0.0;

        MPI_Barrier(world->comm);
        t = MPI_Wtime();
        exchange(world, mode, &layout, record, rb, bufs->dev_send, bufs->dev_recv, bufs->host_send,
                 bufs->host_recv);
        t = MPI_Wtime() - t;
        MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, world->comm);
        if (i >= opts->warmup) samples[i - opts->warmup] = slowest;
    }
    MPI_Type_free(&record);
    if (world->rank == 0) {
        double median, min_s, max_s;
        qsort(samples, opts->iters, sizeof(double), compare_double);
        median = opts->iters % 2 ? samples[opts->iters / 2]
                                 : 0.5 * (samples[opts->iters / 2 - 1] + samples[opts->iters / 2]);
        min_s = samples[0];
        max_s = samples[opts->iters - 1];
        timing.done = 1;
        timing.median_us = median * 1e6;
        timing.offrank_gbps = median > 0 ? (double)(offrank_records * rb) / median / 1e9 : 0.0;
        printf("alltoallv mode=%s ranks=%d tokens=%d record_bytes=%zu bytes_per_rank=%zu "
               "offrank_bytes_per_rank=%zu iters=%" PRIu64 " median_us=%.1f min_us=%.1f "
               "max_us=%.1f offrank_GBps=%.2f\n",
               mode_names[mode], world->size, tokens, rb, layout.send_records * rb,
               offrank_records * rb, opts->iters, timing.median_us, min_s * 1e6, max_s * 1e6,
               timing.offrank_gbps);
        fflush(stdout);
    }
    layout_free(&layout);
    return timing;
}

/* Times every size in every mode this MPI can take; returns 0 on success. */
static int run_timings(const world_t *world, const options_t *opts, int cuda_aware)
{
    timing_t table[N_TIMED][MODE_MAX];
    buffers_t bufs = {NULL, NULL, NULL, NULL};
    double *samples = NULL;
    size_t max_bytes = 0;
    int s, m, ok, max_tokens = 0;

    memset(table, 0, sizeof(table));
    for (s = 0; s < N_TIMED; s++)
        if ((uint64_t)timed_tokens[s] <= opts->max_tokens) max_tokens = timed_tokens[s];
    if (max_tokens == 0) {
        if (world->rank == 0)
            printf("timing: no size within --max-tokens %" PRIu64 "\n", opts->max_tokens);
        return 0;
    }
    /* The layout rounds up per destination, so one extra record per rank is enough room. */
    max_bytes = ((size_t)max_tokens + (size_t)world->size) * TIMED_RECORD_BYTES;
    ok = (samples = calloc(opts->iters, sizeof(double))) != NULL &&
         cuda_ok(cudaMalloc(&bufs.dev_send, max_bytes), world, "cudaMalloc (timing)") &&
         cuda_ok(cudaMalloc(&bufs.dev_recv, max_bytes), world, "cudaMalloc (timing)") &&
         cuda_ok(cudaMallocHost(&bufs.host_send, max_bytes), world, "cudaMallocHost (timing)") &&
         cuda_ok(cudaMallocHost(&bufs.host_recv, max_bytes), world, "cudaMallocHost (timing)") &&
         cuda_ok(cudaMemset(bufs.dev_send, 0x3c, max_bytes), world, "cudaMemset") &&
         cuda_ok(cudaDeviceSynchronize(), world, "cudaDeviceSynchronize");
    if (ok) memset(bufs.host_send, 0x3c, max_bytes);
    if (!agree_all(world, ok)) {
        if (world->rank == 0)
            fprintf(stderr,
                    "FAIL: cannot allocate 2 x %zu bytes of device and pinned host memory per rank\n",
                    max_bytes);
        ok = 0;
        goto out_free;
    }
    if (world->rank == 0)
        printf("timing: MPI_Alltoallv, BF16 tokens of hidden 7168 (%d bytes) as one contiguous "
               "datatype, %" PRIu64 " warm-up + %" PRIu64 " timed iterations, median of the "
               "slowest rank\n",
               TIMED_RECORD_BYTES, opts->warmup, opts->iters);
    for (s = 0; s < N_TIMED; s++) {
        if (timed_tokens[s] > max_tokens) continue;
        for (m = 0; m < MODE_MAX; m++) {
            if (m == MODE_DEVICE && !cuda_aware) continue;
            table[s][m] =
                time_exchange(world, opts, (xfer_mode_t)m, timed_tokens[s], &bufs, samples);
        }
    }
    if (world->rank == 0) {
        printf("\n%8s %14s %12s %12s %12s %12s %12s %12s\n", "tokens", "bytes/rank", "device_us",
               "device_GB/s", "host_us", "host_GB/s", "staged_us", "staged_GB/s");
        for (s = 0; s < N_TIMED; s++) {
            if (timed_tokens[s] > max_tokens) continue;
            printf("%8d %14zu", timed_tokens[s], (size_t)timed_tokens[s] * TIMED_RECORD_BYTES);
            for (m = 0; m < MODE_MAX; m++) {
                if (table[s][m].done)
                    printf(" %12.1f %12.2f", table[s][m].median_us, table[s][m].offrank_gbps);
                else
                    printf(" %12s %12s", "-", "-");
            }
            printf("\n");
        }
        printf("(GB/s: bytes each rank sends to other ranks / median time; 1 GB = 1e9 bytes)\n");
        fflush(stdout);
    }

out_free:
    if (bufs.host_recv) cudaFreeHost(bufs.host_recv);
    if (bufs.host_send) cudaFreeHost(bufs.host_send);
    if (bufs.dev_recv) cudaFree(bufs.dev_recv);
    if (bufs.dev_send) cudaFree(bufs.dev_send);
    free(samples);
    return ok ? 0 : 1;
}

static void report_check(const world_t *world, xfer_mode_t mode, long long bad)
{
    if (world->rank != 0) return;
    if (bad < 0)
        printf("check %s: FAIL (a rank could not allocate its buffers)\n", mode_names[mode]);
    else
        printf("check %s: %s (%lld mismatched bytes over all ranks)\n", mode_names[mode],
               bad == 0 ? "PASS" : "FAIL", bad);
    fflush(stdout);
}

int main(int argc, char **argv)
{
    world_t world;
    options_t opts;
    char why[256];
    int rc, cuda_aware, all_aware, failed = 0;
    long long bad;

    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &world.rank);
    rc = options_parse(argc, argv, world.rank, &opts);
    if (rc != 0) {
        if (world.rank == 0) usage(rc == 2 ? stdout : stderr, argv[0]);
        MPI_Finalize();
        return rc == 2 ? 0 : 1;
    }
    if (!world_init(&world)) {
        MPI_Finalize();
        return EXIT_SKIP;
    }
    if (getenv("UCX_TLS") && world.rank == 0) printf("UCX_TLS=%s\n", getenv("UCX_TLS"));

    cuda_aware = query_cuda_aware(&world, why, sizeof(why));
    all_aware = agree_all(&world, cuda_aware);
    if (!all_aware && world.rank == 0)
        printf("not CUDA-aware: MPIX_Query_cuda_support() = 0 (%s); running the host-staged "
               "variant only, no device pointer is given to MPI\n",
               cuda_aware ? "on another rank" : why);

    if (all_aware) {
        bad = check_exchange(&world, MODE_DEVICE);
        report_check(&world, MODE_DEVICE, bad);
        failed |= bad != 0;
    }
    bad = check_exchange(&world, MODE_STAGED);
    report_check(&world, MODE_STAGED, bad);
    failed |= bad != 0;

    if (!failed && !opts.check_only) failed |= run_timings(&world, &opts, all_aware);
    failed = !agree_all(&world, !failed);
    if (world.rank == 0)
        printf("%s: MPI_Alltoallv %s\n", failed ? "FAIL" : "PASS",
               all_aware ? "on device buffers (CUDA-aware) and host-staged"
                         : "host-staged only (not CUDA-aware)");
    MPI_Finalize();
    return failed ? 1 : 0;
}
