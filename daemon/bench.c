/* `epd --bench`: synthetic steps (uniform random routing, random BF16 inputs, seeded per rank)
 * through the same step the daemon runs, for each tokens-per-rank count and four variants: FP8
 * dispatch with BF16 and with FP8 combine, BF16 with BF16, and FP8 with FP8 combine again with
 * telemetry.quant_error switched the other way (its cost, in the same run).
 * Each timed iteration: MPI_Barrier, one step (per-phase times), then a raw MPI_Alltoallv of the
 * step's dispatch bytes and one of its combine bytes (same per-peer counts), each after a
 * barrier. Per iteration, every time is the max over ranks (MPI_Reduce MAX to rank 0); rank 0
 * reports median and p99 over the iterations. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/step.h"
#include "comm/transport_mpi.h"
#include "common/clock.h"
#include "common/rng.h"
#include "daemon/bench.h"
#include "daemon/daemon.h"
#include "daemon/engine.h"
#include "gpu/fp8.h"

#define BENCH_DEFAULT_TOKENS "128,512,2048,4096,8192"
#define BENCH_DEFAULT_ITERS  20
#define BENCH_WARMUP         3
#define BENCH_MAX_SIZES      64
#define BENCH_ABORT          3

/* Per-iteration values reduced over ranks: the phases, the step, raw dispatch, raw combine. */
enum { V_STEP = EPD_PHASE_MAX, V_RAW_DISPATCH, V_RAW_COMBINE, V_MAX };
/* Per-rank byte counts summed over ranks. */
enum { B_DISPATCH = 0, B_DISPATCH_OFF, B_COMBINE, B_COMBINE_OFF, B_MAX };

typedef struct bench_ctx {
    const epd_config_t *cfg;
    int rank, world, local_size;
    epd_rank_backend_t backend;
    epd_transport_ctx_t *raw_ctx; /* plain MPI_Alltoallv for the baseline */
    bool raw_self;                /* the baseline is the transport's own alltoallv (raw_baseline) */
    bool raw_on_step_buffers;     /* the baseline runs on the step's own buffers */
    const char *raw_kind;         /* what the baseline is, for the header and --json */
    bool json;
    int json_items;               /* results printed so far in the --json document */
    uint32_t iters;
} bench_ctx_t;

/* What one configuration of a size runs: the wire dtypes and the telemetry switch. */
typedef struct bench_variant {
    epd_wire_dtype_t dtype;
    epd_combine_dtype_t combine;
    bool quant_error;
} bench_variant_t;

/* One (tokens, variant) result on rank 0. */
typedef struct bench_result {
    bool ran;
    double median_us[V_MAX], p99_us[V_MAX];
    double bytes[B_MAX]; /* mean per rank per step */
    double ratio;        /* (dispatch + combine) / (raw dispatch + raw combine), medians */
} bench_result_t;

static void bench_fail(const bench_ctx_t *b, const char *what, const char *err)
{
    fprintf(stderr, "epd bench: rank %d: %s: %s\n", b->rank, what, err);
    MPI_Abort(MPI_COMM_WORLD, BENCH_ABORT);
}

/* Bytes of memory the kernel says it can still give, or 0 when unknown. */
static uint64_t mem_available(void)
{
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    unsigned long long kb = 0;

    if (f == NULL) return 0;
    while (fgets(line, sizeof line, f) != NULL)
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) break;
    fclose(f);
    return (uint64_t)kb * 1024;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Median and nearest-rank p99 of n values (sorted in place), in microseconds. */
static void summarize(uint64_t *v, uint32_t n, double *median_p, double *p99_p)
{
    qsort(v, n, sizeof *v, cmp_u64);
    double med = n % 2 ? (double)v[n / 2] : ((double)v[n / 2 - 1] + (double)v[n / 2]) / 2.0;
    uint32_t k = (uint32_t)ceil(0.99 * n);
    *median_p = med / 1000.0;
    *p99_p = (double)v[(k > 0 ? k : 1) - 1] / 1000.0;
}

/* Random routing and inputs for n tokens of this rank: distinct expert ids drawn uniformly,
 * weights positive and summing to 1 per token, x roughly N(0, 1) in BF16. */
static void make_inputs(const epd_moe_shape_t *shape, uint32_t n, uint64_t seed, uint16_t *x,
                        int32_t *ids, float *w)
{
    for (size_t i = 0; i < (size_t)n * shape->hidden; i++) {
        float s = epd_rng_unit_f32(&seed) + epd_rng_unit_f32(&seed) + epd_rng_unit_f32(&seed) +
                  epd_rng_unit_f32(&seed) - 2.0f;
        x[i] = epd_f32_to_bf16(s * 1.7320508f);
    }
    for (uint32_t t = 0; t < n; t++) {
        int32_t *row = ids + (size_t)t * shape->topk;
        float *wr = w + (size_t)t * shape->topk, sum = 0.0f;
        for (uint32_t k = 0; k < shape->topk; k++) {
            int32_t e;
            bool dup;
            do {
                e = (int32_t)(epd_rng_next(&seed) % shape->num_experts);
                dup = false;
                for (uint32_t j = 0; j < k; j++) dup |= row[j] == e;
            } while (dup);
            row[k] = e;
            wr[k] = 0.05f + epd_rng_unit_f32(&seed);
            sum += wr[k];
        }
        for (uint32_t k = 0; k < shape->topk; k++) wr[k] /= sum;
    }
}

/* The raw baseline: the same per-peer counts and item sizes exchanged with nothing else around
 * them. The transport's own alltoallv when it is itself the raw library exchange (nccl: NCCL's
 * grouped send/recv on the step's device buffers); otherwise a plain MPI_Alltoallv on the step's
 * own buffers when MPI may touch them (host ops, or a transport that hands MPI the ops buffers),
 * else on pinned host buffers of the same size. Returns its time in ns. */
static uint64_t raw_alltoallv(bench_ctx_t *b, const void *send, const uint64_t *send_counts,
                              const uint64_t *send_displs, void *recv, const uint64_t *recv_counts,
                              const uint64_t *recv_displs, size_t item)
{
    uint64_t t0;
    epd_status_t status;

    MPI_Barrier(MPI_COMM_WORLD);
    t0 = epd_now_ns();
    if (b->raw_self) {
        const epd_transport_t *transport = b->backend.transport;
        status = transport->alltoallv(b->backend.transport_ctx, send, send_counts, send_displs,
                                      recv, recv_counts, recv_displs, item);
        if (status != EPD_OK)
            bench_fail(b, transport->raw_baseline, transport->last_error(b->backend.transport_ctx));
        return epd_now_ns() - t0;
    }
    status = epd_transport_mpi.alltoallv(b->raw_ctx, send, send_counts, send_displs, recv,
                                         recv_counts, recv_displs, item);
    if (status != EPD_OK)
        bench_fail(b, "raw MPI_Alltoallv", epd_transport_mpi.last_error(b->raw_ctx));
    return epd_now_ns() - t0;
}

/* Runs one (tokens, dtype) configuration; rank 0 fills *res. A configuration that does not fit
 * in memory on some rank is skipped on all of them, with the reason in skip (rank 0). */
static void bench_one(bench_ctx_t *b, uint32_t tokens, const bench_variant_t *variant,
                      bench_result_t *res, char skip[EPD_ERR_LEN])
{
    const epd_config_t *cfg = b->cfg;
    const epd_ops_t *ops = b->backend.ops;
    epd_ops_ctx_t *octx = b->backend.ops_ctx;
    epd_moe_shape_t shape = epd_moe_shape_from_config(cfg, (uint32_t)b->world, (uint32_t)b->rank);
    epd_wire_dtype_t dtype = variant->dtype;
    shape.dtype = dtype; /* the bench runs every variant, whatever the settings say */
    shape.combine_dtype = variant->combine;
    shape.quant_error = variant->quant_error;
    size_t x_bytes = (size_t)tokens * shape.hidden * 2, k_bytes = (size_t)tokens * shape.topk * 4;
    epd_step_t *step = NULL;
    uint16_t *x = NULL;
    int32_t *ids = NULL;
    float *w = NULL;
    void *raw_send = NULL, *raw_recv = NULL, *raw_part = NULL, *raw_back = NULL;
    uint64_t *vals = NULL, *all_vals = NULL;
    char err[EPD_ERR_LEN] = "";
    int ok = 1, all_ok = 0;

    memset(res, 0, sizeof *res);
    skip[0] = '\0';

    /* Host memory is checked before anything is allocated: with overcommit a too-large malloc
     * succeeds and the kernel kills the rank later, mid-collective. */
    size_t need = epd_step_memory_bytes(&shape, tokens);
    need = need > SIZE_MAX - x_bytes - 2 * k_bytes ? SIZE_MAX : need + x_bytes + 2 * k_bytes;
    uint64_t avail = mem_available();
    if (!ops->device_memory && avail > 0 &&
        (need == SIZE_MAX || (double)need * b->local_size > 0.8 * (double)avail)) {
        snprintf(err, EPD_ERR_LEN,
                 "needs %.2f GiB per rank x %d ranks on this node, only %.2f GiB available",
                 (double)need / 1073741824.0, b->local_size, (double)avail / 1073741824.0);
        ok = 0;
    }
    if (ok) {
        x = malloc(x_bytes);
        ids = malloc(k_bytes);
        w = malloc(k_bytes);
        vals = calloc((size_t)b->iters * V_MAX, sizeof *vals);
        all_vals = calloc((size_t)b->iters * V_MAX, sizeof *all_vals);
        if (x == NULL || ids == NULL || w == NULL || vals == NULL || all_vals == NULL) {
            snprintf(err, EPD_ERR_LEN, "out of host memory for %u tokens", tokens);
            ok = 0;
        }
    }
    if (ok && epd_step_create(&shape, tokens, ops, octx, b->backend.transport,
                              b->backend.transport_ctx, MPI_COMM_WORLD, &step, err) != EPD_OK)
        ok = 0;
    epd_step_exchange_t ex;
    if (ok) {
        epd_step_last_exchange(step, &ex);
        if (!b->raw_on_step_buffers) {
            raw_send = ops->alloc_host(octx, ex.send_capacity * ex.record_bytes);
            raw_recv = ops->alloc_host(octx, ex.recv_capacity * ex.record_bytes);
            raw_part = ops->alloc_host(octx, ex.recv_capacity * ex.partial_bytes);
            raw_back = ops->alloc_host(octx, ex.send_capacity * ex.partial_bytes);
            if (raw_send == NULL || raw_recv == NULL || raw_part == NULL || raw_back == NULL) {
                snprintf(err, EPD_ERR_LEN, "out of pinned host memory for the raw baseline");
                ok = 0;
            }
        } else {
            raw_send = ex.send_buf;
            raw_recv = ex.recv_buf;
            raw_part = ex.partials;
            raw_back = ex.partials_back;
        }
    }
    /* every rank must agree before the first collective of the step */
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (!all_ok) {
        /* rank 0 names its own reason, or the first rank that could not (which logs its own) */
        int bad_rank = ok ? b->world : b->rank, first_bad = 0;
        MPI_Allreduce(&bad_rank, &first_bad, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
        if (b->rank == 0 && !ok) snprintf(skip, EPD_ERR_LEN, "%s", err);
        if (b->rank == 0 && ok)
            snprintf(skip, EPD_ERR_LEN, "rank %d could not set it up (its stderr says why)",
                     first_bad);
        if (!ok && b->rank != 0)
            fprintf(stderr, "epd bench: rank %d: %u tokens %s/%s skipped: %s\n", b->rank, tokens,
                    epd_config_enum_name("dispatch.dtype", dtype),
                    epd_config_enum_name("combine.dtype", variant->combine), err);
        goto out;
    }

    const epd_step_io_t *io = epd_step_io(step);
    make_inputs(&shape, tokens, 0xbe7c4000ull + (uint64_t)b->rank * 1000003ull + tokens, x, ids, w);
    if (ops->copy_to_ops(octx, io->x, x, x_bytes) != EPD_OK ||
        ops->copy_to_ops(octx, io->topk_ids, ids, k_bytes) != EPD_OK ||
        ops->copy_to_ops(octx, io->topk_weights, w, k_bytes) != EPD_OK || ops->sync(octx) != EPD_OK)
        bench_fail(b, "copying the inputs", ops->last_error ? ops->last_error(octx) : "");

    double bytes[B_MAX] = {0}, all_bytes[B_MAX] = {0};
    for (uint32_t it = 0; it < BENCH_WARMUP + b->iters; it++) {
        epd_step_timing_t tm;
        MPI_Barrier(MPI_COMM_WORLD);
        /* as the daemon runs its steps: the ids are on the host too, the layout is made there */
        epd_step_set_host_ids(step, ids);
        if (epd_step_run(step, tokens, io->x, io->topk_ids, io->topk_weights, io->y, &tm, err) !=
            EPD_OK)
            bench_fail(b, "step", err);
        epd_step_last_exchange(step, &ex);
        uint64_t raw_d = raw_alltoallv(b, raw_send, ex.send_counts, ex.send_displs, raw_recv,
                                       ex.recv_counts, ex.recv_displs, ex.record_bytes);
        uint64_t raw_c = raw_alltoallv(b, raw_part, ex.recv_counts, ex.recv_displs, raw_back,
                                       ex.send_counts, ex.send_displs, ex.partial_bytes);
        if (it < BENCH_WARMUP) continue;
        uint64_t *v = vals + (size_t)(it - BENCH_WARMUP) * V_MAX;
        for (int p = 0; p < EPD_PHASE_MAX; p++) v[p] = tm.phase_ns[p];
        v[V_STEP] = tm.total_ns;
        v[V_RAW_DISPATCH] = raw_d;
        v[V_RAW_COMBINE] = raw_c;
        bytes[B_DISPATCH] += (double)tm.dispatch_bytes;
        bytes[B_DISPATCH_OFF] += (double)tm.dispatch_bytes_off_rank;
        bytes[B_COMBINE] += (double)tm.combine_bytes;
        bytes[B_COMBINE_OFF] += (double)tm.combine_bytes_off_rank;
    }
    MPI_Reduce(vals, all_vals, (int)(b->iters * V_MAX), MPI_UINT64_T, MPI_MAX, 0, MPI_COMM_WORLD);
    MPI_Reduce(bytes, all_bytes, B_MAX, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
    if (b->rank == 0) {
        uint64_t *col = malloc(b->iters * sizeof *col);
        if (col == NULL) bench_fail(b, "summary", "out of memory");
        for (int k = 0; k < V_MAX; k++) {
            for (uint32_t it = 0; it < b->iters; it++) col[it] = all_vals[(size_t)it * V_MAX + k];
            summarize(col, b->iters, &res->median_us[k], &res->p99_us[k]);
        }
        free(col);
        for (int k = 0; k < B_MAX; k++) res->bytes[k] = all_bytes[k] / b->world / b->iters;
        double comm = res->median_us[EPD_PHASE_DISPATCH] + res->median_us[EPD_PHASE_COMBINE];
        double raw = res->median_us[V_RAW_DISPATCH] + res->median_us[V_RAW_COMBINE];
        res->ratio = raw > 0 ? comm / raw : NAN;
        res->ran = true;
    }

out:
    if (!b->raw_on_step_buffers) {
        if (raw_send != NULL) ops->free_host(octx, raw_send);
        if (raw_recv != NULL) ops->free_host(octx, raw_recv);
        if (raw_part != NULL) ops->free_host(octx, raw_part);
        if (raw_back != NULL) ops->free_host(octx, raw_back);
    }
    epd_step_destroy(step);
    free(x);
    free(ids);
    free(w);
    free(vals);
    free(all_vals);
}

/* GB/s of bytes moved in us microseconds (0 when nothing was timed). */
static double gb_per_s(double bytes, double us)
{
    return us > 0 ? bytes / (us * 1e3) : 0.0;
}

/* --json: one document, {"bench": "epd", "results": [one object per size and variant, and per
 * size the comparisons and the telemetry's cost]}; each result on its own line. */
static void json_item_begin(bench_ctx_t *b)
{
    printf("%s\n", b->json_items++ ? "," : "");
}

/* "1.23 MB"-style text of a byte count. */
static const char *human_bytes(double v, char *buf, size_t len)
{
    if (v >= 1e9)
        snprintf(buf, len, "%.2f GB", v / 1e9);
    else if (v >= 1e6)
        snprintf(buf, len, "%.2f MB", v / 1e6);
    else if (v >= 1e3)
        snprintf(buf, len, "%.1f kB", v / 1e3);
    else
        snprintf(buf, len, "%.0f B", v);
    return buf;
}

static void print_header(const bench_ctx_t *b)
{
    const epd_config_t *cfg = b->cfg;

    if (b->json) return;
    printf("epd bench: %d ranks, hidden %u, %u experts, top-%u, experts %s, FP8 scales %s/%s\n",
           b->world, cfg->model.hidden, cfg->model.num_experts, cfg->model.topk,
           epd_config_enum_name("experts.kind", cfg->experts.kind),
           epd_config_enum_name("dispatch.scale", cfg->dispatch.scale),
           epd_config_enum_name("dispatch.scale_format", cfg->dispatch.scale_format));
    printf("  ops %s (%s); transport %s (%s)\n", b->backend.ops->name, b->backend.device_reason,
           b->backend.transport->name, b->backend.transport_reason);
    printf("  %u timed steps after %d warm-up; each time is the max over ranks of one step, then "
           "the median and p99 over steps, in microseconds\n",
           b->iters, BENCH_WARMUP);
    printf("  raw = %s of the same per-peer bytes in the same run; ratio = "
           "(dispatch + combine) / (raw dispatch + raw combine)\n",
           b->raw_kind);
    printf("  dtype = dispatch wire format, comb = combine.dtype, qe = telemetry.quant_error\n\n");
    printf("%7s %-5s %-4s %-3s %-6s %9s %9s %9s %9s %9s %9s %10s %9s %9s %6s  %s\n", "tokens",
           "dtype", "comb", "qe", "stat", "pack", "counts", "dispatch", "experts", "combine",
           "reduce", "step", "raw-disp", "raw-comb", "ratio",
           "bytes per rank: dispatch (off-rank, GB/s) / combine (off-rank, GB/s)");
    printf("%7s GB/s = off-rank bytes / the phase's median time\n", "");
}

static void print_result(bench_ctx_t *b, uint32_t tokens, const bench_variant_t *variant,
                         const bench_result_t *r, const char *skip)
{
    const epd_config_t *cfg = b->cfg;
    const char *dn = epd_config_enum_name("dispatch.dtype", variant->dtype);
    const char *cn = epd_config_enum_name("combine.dtype", variant->combine);
    const char *qn = variant->quant_error ? "on" : "off";
    char b0[32], b1[32], b2[32], b3[32];

    if (b->json) {
        json_item_begin(b);
        printf("{\"bench\":\"step\",\"tokens\":%u,\"dtype\":\"%s\",\"combine_dtype\":\"%s\","
               "\"quant_error\":%s,\"world\":%d,\"hidden\":%u,"
               "\"experts\":%u,\"topk\":%u,\"expert_kind\":\"%s\",\"scale\":\"%s\","
               "\"scale_format\":\"%s\",\"ops\":\"%s\",\"transport\":\"%s\",\"iters\":%u,"
               "\"warmup\":%d,\"timing\":\"max_over_ranks\"",
               tokens, dn, cn, variant->quant_error ? "true" : "false", b->world,
               cfg->model.hidden, cfg->model.num_experts, cfg->model.topk,
               epd_config_enum_name("experts.kind", cfg->experts.kind),
               epd_config_enum_name("dispatch.scale", cfg->dispatch.scale),
               epd_config_enum_name("dispatch.scale_format", cfg->dispatch.scale_format),
               b->backend.ops->name, b->backend.transport->name, b->iters, BENCH_WARMUP);
        if (!r->ran) {
            printf(",\"skipped\":\"");
            for (const char *p = skip; *p; p++) printf(*p == '"' || *p == '\\' ? "\\%c" : "%c", *p);
            printf("\"}");
            return;
        }
        printf(",\"phases_us\":{");
        for (int p = 0; p < EPD_PHASE_MAX; p++)
            printf("%s\"%s\":{\"median\":%.3f,\"p99\":%.3f}", p ? "," : "", epd_phase_names[p],
                   r->median_us[p], r->p99_us[p]);
        printf("},\"step_us\":{\"median\":%.3f,\"p99\":%.3f}", r->median_us[V_STEP],
               r->p99_us[V_STEP]);
        printf(",\"raw\":\"%s\",\"raw_us\":{\"dispatch\":{\"median\":%.3f,\"p99\":%.3f},"
               "\"combine\":{\"median\":%.3f,\"p99\":%.3f}}",
               b->raw_kind, r->median_us[V_RAW_DISPATCH], r->p99_us[V_RAW_DISPATCH],
               r->median_us[V_RAW_COMBINE],
               r->p99_us[V_RAW_COMBINE]);
        if (isnan(r->ratio))
            printf(",\"ratio_vs_raw\":null");
        else
            printf(",\"ratio_vs_raw\":%.4f", r->ratio);
        printf(",\"bytes_per_rank\":{\"dispatch\":%.0f,\"dispatch_off_rank\":%.0f,\"combine\":%.0f,"
               "\"combine_off_rank\":%.0f},\"gb_per_s_per_rank\":{\"dispatch\":%.4f,"
               "\"combine\":%.4f}}",
               r->bytes[B_DISPATCH], r->bytes[B_DISPATCH_OFF], r->bytes[B_COMBINE],
               r->bytes[B_COMBINE_OFF], gb_per_s(r->bytes[B_DISPATCH_OFF],
                                                 r->median_us[EPD_PHASE_DISPATCH]),
               gb_per_s(r->bytes[B_COMBINE_OFF], r->median_us[EPD_PHASE_COMBINE]));
        return;
    }
    if (!r->ran) {
        printf("%7u %-5s %-4s %-3s skipped: %s\n", tokens, dn, cn, qn, skip);
        return;
    }
    for (int line = 0; line < 2; line++) {
        const double *v = line ? r->p99_us : r->median_us;
        if (line == 0)
            printf("%7u %-5s %-4s %-3s %-6s", tokens, dn, cn, qn, "median");
        else
            printf("%7s %-5s %-4s %-3s %-6s", "", "", "", "", "p99");
        for (int p = 0; p < EPD_PHASE_MAX; p++) printf(" %9.1f", v[p]);
        printf(" %10.1f %9.1f %9.1f", v[V_STEP], v[V_RAW_DISPATCH], v[V_RAW_COMBINE]);
        if (line == 0) {
            printf(" %6.2f  %s (%s, %.2f GB/s) / %s (%s, %.2f GB/s)", r->ratio,
                   human_bytes(r->bytes[B_DISPATCH], b0, 32),
                   human_bytes(r->bytes[B_DISPATCH_OFF], b1, 32),
                   gb_per_s(r->bytes[B_DISPATCH_OFF], r->median_us[EPD_PHASE_DISPATCH]),
                   human_bytes(r->bytes[B_COMBINE], b2, 32),
                   human_bytes(r->bytes[B_COMBINE_OFF], b3, 32),
                   gb_per_s(r->bytes[B_COMBINE_OFF], r->median_us[EPD_PHASE_COMBINE]));
        }
        printf("\n");
    }
}

/* An FP8 variant against BF16 at one size: communication time (dispatch + combine medians) and
 * bytes (the off-rank ones, or all of them on one rank). name: "fp8/bf16" (FP8 dispatch, BF16
 * combine) or "fp8+fp8c/bf16" (FP8 dispatch and combine); JSON key fp8_over_bf16 or
 * fp8_fp8_combine_over_bf16. */
static void print_compare(bench_ctx_t *b, uint32_t tokens, const char *name,
                          const char *key, const bench_result_t *fp8, const bench_result_t *bf16)
{
    if (!fp8->ran || !bf16->ran) return;
    double t8 = fp8->median_us[EPD_PHASE_DISPATCH] + fp8->median_us[EPD_PHASE_COMBINE];
    double t16 = bf16->median_us[EPD_PHASE_DISPATCH] + bf16->median_us[EPD_PHASE_COMBINE];
    double off8 = fp8->bytes[B_DISPATCH_OFF] + fp8->bytes[B_COMBINE_OFF];
    double off16 = bf16->bytes[B_DISPATCH_OFF] + bf16->bytes[B_COMBINE_OFF];
    bool off = off8 > 0 && off16 > 0;
    double by8 = off ? off8 : fp8->bytes[B_DISPATCH] + fp8->bytes[B_COMBINE];
    double by16 = off ? off16 : bf16->bytes[B_DISPATCH] + bf16->bytes[B_COMBINE];
    double d8 = off ? fp8->bytes[B_DISPATCH_OFF] : fp8->bytes[B_DISPATCH];
    double d16 = off ? bf16->bytes[B_DISPATCH_OFF] : bf16->bytes[B_DISPATCH];
    double time_ratio = t16 > 0 ? t8 / t16 : NAN, bytes_ratio = by16 > 0 ? by8 / by16 : NAN;
    double disp_ratio = d16 > 0 ? d8 / d16 : NAN;
    /* dispatch time alone, and the raw transport's own ratio on the same bytes: what the wire
     * allows at this size */
    double dt8 = fp8->median_us[EPD_PHASE_DISPATCH], dt16 = bf16->median_us[EPD_PHASE_DISPATCH];
    double rt8 = fp8->median_us[V_RAW_DISPATCH], rt16 = bf16->median_us[V_RAW_DISPATCH];
    double dtime_ratio = dt16 > 0 ? dt8 / dt16 : NAN, raw_ratio = rt16 > 0 ? rt8 / rt16 : NAN;
    /* the whole step against the raw dispatch + combine of the same bytes */
    double raw8 = rt8 + fp8->median_us[V_RAW_COMBINE];
    double raw16 = rt16 + bf16->median_us[V_RAW_COMBINE];
    double step8 = raw8 > 0 ? fp8->median_us[V_STEP] / raw8 : NAN;
    double step16 = raw16 > 0 ? bf16->median_us[V_STEP] / raw16 : NAN;

    /* the combine alone: BF16 against BF16 (1.0 in bytes), or FP8 partials against BF16 */
    double c8 = off ? fp8->bytes[B_COMBINE_OFF] : fp8->bytes[B_COMBINE];
    double c16 = off ? bf16->bytes[B_COMBINE_OFF] : bf16->bytes[B_COMBINE];
    double comb_ratio = c16 > 0 ? c8 / c16 : NAN;
    double ct8 = fp8->median_us[EPD_PHASE_COMBINE], ct16 = bf16->median_us[EPD_PHASE_COMBINE];
    double ctime_ratio = ct16 > 0 ? ct8 / ct16 : NAN;

    if (b->json) {
        json_item_begin(b);
        printf("{\"bench\":\"compare\",\"tokens\":%u,\"%s\":{\"comm_time\":%.4f,"
               "\"dispatch_time\":%.4f,\"raw_dispatch_time\":%.4f,\"combine_time\":%.4f,"
               "\"bytes\":%.4f,\"dispatch_bytes\":%.4f,\"combine_bytes\":%.4f,"
               "\"bytes_kind\":\"%s\"},"
               "\"step_over_raw\":{\"fp8\":%.4f,\"bf16\":%.4f}}",
               tokens, key, time_ratio, dtime_ratio, raw_ratio, ctime_ratio, bytes_ratio,
               disp_ratio, comb_ratio, off ? "off_rank" : "total", step8, step16);
        return;
    }
    printf("%7u %s: communication time (dispatch + combine) %.2fx, bytes %.3fx (dispatch "
           "alone %.3fx, combine alone %.3fx, %s)\n",
           tokens, name, time_ratio, bytes_ratio, disp_ratio, comb_ratio,
           off ? "off-rank" : "one rank: all bytes");
    printf("%7u %s: dispatch time %.2fx (the raw alltoallv of the same bytes: %.2fx), combine "
           "time %.2fx; whole step / raw dispatch + combine: fp8 %.2fx, bf16 %.2fx\n",
           tokens, name, dtime_ratio, raw_ratio, ctime_ratio, step8, step16);
}

/* The telemetry's cost at one size: the same FP8 + FP8-combine step with telemetry.quant_error
 * on and off, pack phase and whole step medians. */
static void print_telemetry_cost(bench_ctx_t *b, uint32_t tokens, const bench_result_t *on,
                                 const bench_result_t *off)
{
    if (!on->ran || !off->ran) return;
    double p_on = on->median_us[EPD_PHASE_LAYOUT_PACK];
    double p_off = off->median_us[EPD_PHASE_LAYOUT_PACK];
    double s_on = on->median_us[V_STEP], s_off = off->median_us[V_STEP];
    double pack_ratio = p_off > 0 ? p_on / p_off : NAN, step_ratio = s_off > 0 ? s_on / s_off : NAN;

    if (b->json) {
        json_item_begin(b);
        printf("{\"bench\":\"telemetry\",\"tokens\":%u,\"quant_error_on_over_off\":"
               "{\"pack\":%.4f,\"step\":%.4f},\"pack_us\":{\"on\":%.3f,\"off\":%.3f}}",
               tokens, pack_ratio, step_ratio, p_on, p_off);
        return;
    }
    printf("%7u telemetry.quant_error on/off (fp8 + fp8 combine): pack %.3fx (%.1f / %.1f us), "
           "step %.3fx\n",
           tokens, pack_ratio, p_on, p_off, step_ratio);
}

static void print_warning(void *arg, const char *message)
{
    if (*(const int *)arg == 0) fprintf(stderr, "epd: warning: %s\n", message);
}

int epd_bench_run(const epd_args_t *args)
{
    bench_ctx_t b;
    epd_config_state_t *state = NULL;
    uint32_t sizes[BENCH_MAX_SIZES];
    size_t n_sizes = 0;
    char err[EPD_ERR_LEN];
    MPI_Comm node;
    int local_rank = 0;

    memset(&b, 0, sizeof b);
    MPI_Comm_rank(MPI_COMM_WORLD, &b.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &b.world);

    /* settings and arguments are the same on every rank, so every rank fails the same way */
    if (epd_daemon_load_config(args, print_warning, &b.rank, &state, err) != EPD_OK) {
        if (b.rank == 0) fprintf(stderr, "epd: %s\n", err);
        return 2;
    }
    b.cfg = epd_config_get(state);
    b.json = args->json;
    b.iters = args->bench_iters ? args->bench_iters : BENCH_DEFAULT_ITERS;
    if (epd_args_parse_token_list(args->bench_tokens ? args->bench_tokens : BENCH_DEFAULT_TOKENS,
                                  sizes, BENCH_MAX_SIZES, &n_sizes, err) != EPD_OK) {
        if (b.rank == 0) fprintf(stderr, "epd: --bench-tokens: %s\n", err);
        epd_config_state_free(state);
        return 2;
    }
    if (epd_moe_experts_check(b.cfg->model.num_experts, (uint32_t)b.world, err) != EPD_OK) {
        if (b.rank == 0) fprintf(stderr, "epd: model.%s\n", err); /* err: "num_experts = ..." */
        epd_config_state_free(state);
        return 2;
    }
    if (b.cfg->experts.kind == EPD_EXPERTS_EXTERNAL) {
        if (b.rank == 0)
            fprintf(stderr, "epd: --bench has no expert worker for experts.kind = external; "
                    "tests/gpu/external_gpu.sh and examples/external_experts.py time the "
                    "exchange with a worker\n");
        epd_config_state_free(state);
        return 2;
    }

    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &local_rank);
    MPI_Comm_size(node, &b.local_size);
    MPI_Comm_free(&node);
    /* a rank that cannot open its device or transport ends the job: the others are in the
     * transport's collective set-up */
    if (epd_daemon_backend_open(b.cfg, MPI_COMM_WORLD, local_rank, b.local_size, &b.backend, err) !=
        EPD_OK)
        bench_fail(&b, "device and transport", err);
    if (b.cfg->experts.kind == EPD_EXPERTS_FFN) {
        /* the experts alone: one rank, no exchange */
        int rc = b.rank == 0 ? epd_bench_ffn(b.cfg, args, b.backend.ops, b.backend.device_id,
                                             b.world, sizes, n_sizes, b.iters)
                            : 0;
        epd_daemon_backend_close(&b.backend);
        epd_config_state_free(state);
        return rc;
    }
    if (epd_transport_mpi.init(MPI_COMM_WORLD, b.backend.ops, b.backend.ops_ctx, &b.raw_ctx, err) !=
        EPD_OK)
        bench_fail(&b, "raw MPI baseline", err);
    b.raw_self = b.backend.transport->raw_baseline != NULL;
    b.raw_on_step_buffers = b.raw_self || !b.backend.ops->device_memory ||
                            b.backend.transport->mpi_on_ops_memory;
    b.raw_kind = b.raw_self               ? b.backend.transport->raw_baseline
                 : b.raw_on_step_buffers ? "a plain MPI_Alltoallv on the step's buffers"
                                         : "a plain MPI_Alltoallv on pinned host buffers";

    /* the settings' telemetry switch for the first three, the other one for the last */
    const bool qe = b.cfg->telemetry.quant_error == EPD_SWITCH_ON;
    const bench_variant_t variants[] = {
        {.dtype = EPD_WIRE_FP8, .combine = EPD_COMBINE_BF16, .quant_error = qe},
        {.dtype = EPD_WIRE_FP8, .combine = EPD_COMBINE_FP8, .quant_error = qe},
        {.dtype = EPD_WIRE_BF16, .combine = EPD_COMBINE_BF16, .quant_error = qe},
        {.dtype = EPD_WIRE_FP8, .combine = EPD_COMBINE_FP8, .quant_error = !qe},
    };
    enum { N_VARIANTS = EPD_ARRAY_SIZE(variants) };
    if (b.rank == 0) print_header(&b);
    if (b.rank == 0 && b.json) printf("{\"bench\":\"epd\",\"results\":[");
    for (size_t i = 0; i < n_sizes; i++) {
        bench_result_t res[N_VARIANTS];
        char skip[N_VARIANTS][EPD_ERR_LEN];
        for (int v = 0; v < N_VARIANTS; v++) {
            bench_one(&b, sizes[i], &variants[v], &res[v], skip[v]);
            if (b.rank == 0) {
                print_result(&b, sizes[i], &variants[v], &res[v], skip[v]);
                fflush(stdout);
            }
        }
        if (b.rank == 0) {
            print_compare(&b, sizes[i], "fp8/bf16", "fp8_over_bf16", &res[0], &res[2]);
            print_compare(&b, sizes[i], "fp8+fp8c/bf16", "fp8_fp8_combine_over_bf16", &res[1],
                          &res[2]);
            print_telemetry_cost(&b, sizes[i], qe ? &res[1] : &res[3], qe ? &res[3] : &res[1]);
            fflush(stdout);
        }
    }

    if (b.rank == 0 && b.json) printf("\n]}\n");
    epd_transport_mpi.fini(b.raw_ctx);
    epd_daemon_backend_close(&b.backend);
    epd_config_state_free(state);
    return 0;
}
