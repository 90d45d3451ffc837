/* test_ops_cuda: the CUDA device ops (gpu/ops_cuda.cu) against the host ops (gpu/ops_host.c),
 * byte for byte, in one process without MPI. For every case a world of W ranks is simulated: each
 * rank runs layout and pack on its own random batch with both implementations, records move
 * between ranks with memcpy (host) and device copies (CUDA) as the alltoallv would, then experts,
 * the reverse move and combine. Slots, counts, records, partials and outputs must be identical.
 * Cases: BF16 and FP8 (group128 / per_token x fp32 / ue8m0), identity and scale experts,
 * W in {1,2,4,8}, N in {1,7,128,4096}, H in {128,7168}, K=8, E=256, with empty slots and tokens
 * whose slots are all empty; the same with FP8 partials (combine.dtype fp8) after three of the
 * dispatch formats; the telemetry sums (telemetry.quant_error) against the host's in half of
 * them, and all zero in the others. Also the transport hooks (events, async copies) and a bad id.
 * Prints one line per case and 'N passed, N failed'; exit 77 with 'SKIP: no GPU' without one. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <thread>
#include <vector>

extern "C" {
#include "gpu/ops.h"
}
#include "common/rng.h"
#include "gpu/fp8.h"

#define TOPK 8
#define EXPERTS 256
#define MAX_WORLD 8

static int n_passed, n_failed;

/* ---- random inputs ------------------------------------------------------------------------ */

static float rng_uniform(uint64_t *s, float lo, float hi)
{
    return lo + (hi - lo) * epd_rng_unit_f32(s);
}

/* x: values in [-3, 3], an outlier (x40) now and then, some rows all zero (amax floor), some
 * groups of tiny values; ids: distinct experts, ~1 in 8 slots empty, every 11th token all empty;
 * weights: mostly positive, some negative. */
static void random_batch(uint64_t seed, uint32_t n, uint32_t hidden, uint16_t *x, int32_t *ids,
                         float *w)
{
    uint64_t s = seed;
    for (uint32_t t = 0; t < n; t++) {
        uint16_t *row = x + (size_t)t * hidden;
        bool zero_row = epd_rng_next(&s) % 13 == 0;
        for (uint32_t i = 0; i < hidden; i++) {
            float v = rng_uniform(&s, -3.0f, 3.0f);
            if (epd_rng_next(&s) % 97 == 0) v *= 40.0f;
            if ((i / 128) % 5 == 3 && t % 3 == 0) v *= 1e-6f;
            row[i] = zero_row ? 0 : epd_f32_to_bf16(v);
        }
        for (uint32_t k = 0; k < TOPK; k++) {
            int32_t e;
            bool dup;
            do {
                e = (int32_t)(epd_rng_next(&s) % EXPERTS);
                dup = false;
                for (uint32_t j = 0; j < k; j++) dup |= ids[(size_t)t * TOPK + j] == e;
            } while (dup);
            if (t % 11 == 5 || epd_rng_next(&s) % 8 == 0) e = -1;
            ids[(size_t)t * TOPK + k] = e;
            w[(size_t)t * TOPK + k] = rng_uniform(&s, -0.25f, 1.0f);
        }
    }
}

/* ---- helpers ------------------------------------------------------------------------------ */

static char fail_msg[512];

static bool failf(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(fail_msg, sizeof fail_msg, fmt, ap);
    va_end(ap);
    return false;
}

#define CUDA_OK(call)                                                                          \
    do {                                                                                       \
        cudaError_t rc_ = (call);                                                              \
        if (rc_ != cudaSuccess) return failf("%s: %s", #call, cudaGetErrorString(rc_));       \
    } while (0)

#define OPS_OK(ops, ctx, call, what)                                                          \
    do {                                                                                       \
        epd_status_t st_ = (call);                                                             \
        if (st_ != EPD_OK)                                                                     \
            return failf("%s %s: %s %s", (ops)->name, what, epd_status_name(st_),              \
                         (ops)->last_error != NULL ? (ops)->last_error(ctx) : "");             \
    } while (0)

/* Device bytes equal to host bytes? Reports the first difference. */
static bool same_bytes(const void *dev, const void *host, size_t bytes, const char *what)
{
    if (bytes == 0) return true;
    uint8_t *tmp = (uint8_t *)malloc(bytes);
    if (tmp == NULL) return failf("out of memory");
    cudaError_t rc = cudaMemcpy(tmp, dev, bytes, cudaMemcpyDeviceToHost);
    if (rc != cudaSuccess) {
        free(tmp);
        return failf("download %s: %s", what, cudaGetErrorString(rc));
    }
    bool ok = memcmp(tmp, host, bytes) == 0;
    if (!ok) {
        size_t i = 0;
        while (((const uint8_t *)host)[i] == tmp[i]) i++;
        failf("%s differs at byte %zu of %zu: cuda 0x%02x host 0x%02x", what, i, bytes, tmp[i],
              ((const uint8_t *)host)[i]);
    }
    free(tmp);
    return ok;
}

/* One simulated rank's buffers: _h on the host ops, _d on the CUDA ops. */
typedef struct sim_rank {
    uint16_t *x_h, *x_d;
    int32_t *ids_h, *ids_d;
    float *w_h, *w_d;
    epd_step_layout_t lay_h, lay_d;
    uint32_t counts_h[MAX_WORLD], offs_h[MAX_WORLD], counts_d[MAX_WORLD], offs_d[MAX_WORLD];
    float smax_h[MAX_WORLD], smax_d[MAX_WORLD]; /* the packs' scale maxima per destination */
    uint8_t *send_h, *send_d;
    uint8_t *recv_h, *recv_d;
    uint32_t n_recv;
    uint8_t *part_h, *part_d;
    uint8_t *back_h, *back_d;
    uint16_t *y_h, *y_d;
} sim_rank_t;

/* hctx for allocations; hctxs[r] for the ops of simulated host rank r (their telemetry sums
 * are per context, and the host ranks run in parallel threads) */
static epd_ops_ctx_t *hctx, *dctx, *hctxs[MAX_WORLD];

/* layout, then layout_counts: the first failure of the two */
static epd_status_t layout_all(const epd_ops_t *ops, const epd_moe_shape_t *shape, const int32_t *ids,
                               epd_step_layout_t *lay)
{
    epd_status_t st = ops->layout(dctx, shape, ids, lay);
    return st != EPD_OK ? st : ops->layout_counts(dctx, shape, lay);
}

static void sim_free(sim_rank_t *r)
{
    const epd_ops_t *h = &epd_ops_host, *d = &epd_ops_cuda;
    h->free(hctx, r->x_h);
    h->free(hctx, r->ids_h);
    h->free(hctx, r->w_h);
    h->free(hctx, r->lay_h.slot);
    h->free(hctx, r->send_h);
    h->free(hctx, r->recv_h);
    h->free(hctx, r->part_h);
    h->free(hctx, r->back_h);
    h->free(hctx, r->y_h);
    d->free(dctx, r->x_d);
    d->free(dctx, r->ids_d);
    d->free(dctx, r->w_d);
    d->free(dctx, r->lay_d.slot);
    d->free(dctx, r->send_d);
    d->free(dctx, r->recv_d);
    d->free(dctx, r->part_d);
    d->free(dctx, r->back_d);
    d->free(dctx, r->y_d);
    memset(r, 0, sizeof *r);
}

/* ---- one case ----------------------------------------------------------------------------- */

/* The host side of each phase runs one thread per simulated rank (the reference is the slow
 * part); a thread's failure lands in its slot of host_err. */
static char host_err[MAX_WORLD][256];

static void host_failf(uint32_t r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(host_err[r], sizeof host_err[r], fmt, ap);
    va_end(ap);
}

template <typename F>
static bool host_parallel(uint32_t world, F fn)
{
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < world; r++) {
        host_err[r][0] = '\0';
        threads.emplace_back(fn, r);
    }
    for (auto &th : threads) th.join();
    for (uint32_t r = 0; r < world; r++)
        if (host_err[r][0] != '\0') return failf("host rank %u: %s", r, host_err[r]);
    return true;
}

static bool run_case(const epd_moe_shape_t *base, uint32_t n, uint64_t seed, sim_rank_t *sim)
{
    const epd_ops_t *h = &epd_ops_host, *d = &epd_ops_cuda;
    const uint32_t world = base->world, hidden = base->hidden;
    const size_t xb = (size_t)n * hidden * 2, kb = (size_t)n * TOPK * 4, sb = (size_t)n * world * 4;
    epd_record_layout_t rec;
    epd_partial_layout_t pl;
    epd_moe_shape_t shape[MAX_WORLD];
    epd_quant_error_t qe_h = {0, 0, 0, 0}, qe_d, qe_r;

    epd_record_layout(base, &rec);
    epd_partial_layout(base, &pl);
    for (uint32_t r = 0; r < world; r++) OPS_OK(h, hctxs[r], h->quant_error_take(hctxs[r], &qe_r), "take");
    OPS_OK(d, dctx, d->quant_error_take(dctx, &qe_d), "quant_error_take");
    for (uint32_t r = 0; r < world; r++) {
        shape[r] = *base;
        shape[r].rank = r;
    }

    /* inputs, layout, pack on every rank: host in parallel, then the device rank by rank */
    bool ok = host_parallel(world, [&](uint32_t r) {
        sim_rank_t *s = &sim[r];
        s->x_h = (uint16_t *)h->alloc(hctx, xb);
        s->ids_h = (int32_t *)h->alloc(hctx, kb);
        s->w_h = (float *)h->alloc(hctx, kb);
        s->lay_h.slot = (int32_t *)h->alloc(hctx, sb);
        if (!s->x_h || !s->ids_h || !s->w_h || !s->lay_h.slot) return host_failf(r, "alloc");
        random_batch(seed * 131 + r, n, hidden, s->x_h, s->ids_h, s->w_h);
        s->lay_h.n_tokens = n;
        s->lay_h.send_counts_host = s->counts_h;
        s->lay_h.send_offsets_host = s->offs_h;
        epd_status_t st = h->layout(hctx, &shape[r], s->ids_h, &s->lay_h);
        if (st != EPD_OK) return host_failf(r, "layout: %s", epd_status_name(st));
        size_t pb = (size_t)s->lay_h.n_send * rec.size;
        s->send_h = (uint8_t *)h->alloc(hctx, pb);
        if (!s->send_h) return host_failf(r, "alloc");
        memset(s->send_h, 0, pb);
        memset(s->smax_h, 0, sizeof s->smax_h);
        s->lay_h.scale_max_host = s->smax_h;
        st = h->pack(hctxs[r], &shape[r], s->x_h, s->ids_h, s->w_h, &s->lay_h, s->send_h);
        if (st != EPD_OK) return host_failf(r, "pack: %s", epd_status_name(st));
    });
    if (!ok) return false;
    for (uint32_t r = 0; r < world; r++) {
        sim_rank_t *s = &sim[r];
        s->x_d = (uint16_t *)d->alloc(dctx, xb);
        s->ids_d = (int32_t *)d->alloc(dctx, kb);
        s->w_d = (float *)d->alloc(dctx, kb);
        s->lay_d.slot = (int32_t *)d->alloc(dctx, sb);
        if (!s->x_d || !s->ids_d || !s->w_d || !s->lay_d.slot) return failf("alloc of the inputs");
        OPS_OK(d, dctx, d->copy_to_ops(dctx, s->x_d, s->x_h, xb), "copy_to_ops x");
        OPS_OK(d, dctx, d->copy_to_ops(dctx, s->ids_d, s->ids_h, kb), "copy_to_ops ids");
        OPS_OK(d, dctx, d->copy_to_ops(dctx, s->w_d, s->w_h, kb), "copy_to_ops weights");
        s->lay_d.n_tokens = n;
        s->lay_d.send_counts_host = s->counts_d;
        s->lay_d.send_offsets_host = s->offs_d;
        OPS_OK(d, dctx, layout_all(d, &shape[r], s->ids_d, &s->lay_d), "layout");
        if (s->lay_h.n_send != s->lay_d.n_send)
            return failf("rank %u: n_send cuda %u host %u", r, s->lay_d.n_send, s->lay_h.n_send);
        if (memcmp(s->counts_h, s->counts_d, world * 4) != 0 || memcmp(s->offs_h, s->offs_d, world * 4) != 0)
            return failf("rank %u: send counts or offsets differ", r);
        if (!same_bytes(s->lay_d.slot, s->lay_h.slot, sb, "slot")) return false;

        size_t pb = (size_t)s->lay_h.n_send * rec.size;
        s->send_d = (uint8_t *)d->alloc(dctx, pb);
        if (!s->send_d) return failf("alloc of the send buffers");
        CUDA_OK(cudaMemset(s->send_d, 0, pb < 256 ? 256 : pb));
        /* cudaMemset is asynchronous and on the legacy stream, which the ops' non-blocking stream
         * does not wait for: without this the zeros could land on the packed records (seen with
         * the GPU shared by other processes) */
        CUDA_OK(cudaDeviceSynchronize());
        memset(s->smax_d, 0, sizeof s->smax_d);
        s->lay_d.scale_max_host = s->smax_d;
        OPS_OK(d, dctx, d->pack(dctx, &shape[r], s->x_d, s->ids_d, s->w_d, &s->lay_d, s->send_d), "pack");
        OPS_OK(d, dctx, d->sync(dctx), "sync after pack");
        char what[64];
        snprintf(what, sizeof what, "rank %u records", r);
        if (!same_bytes(s->send_d, s->send_h, pb, what)) return false;
        for (uint32_t k = 0; k < world; k++)
            if (memcmp(&s->smax_d[k], &s->smax_h[k], sizeof(float)) != 0)
                return failf("rank %u: scale max for rank %u: cuda %.9g host %.9g", r, k,
                             s->smax_d[k], s->smax_h[k]);
    }

    /* dispatch: destination dst receives the records of sources 0..W-1 in order */
    ok = host_parallel(world, [&](uint32_t dst) {
        sim_rank_t *s = &sim[dst];
        s->n_recv = 0;
        for (uint32_t src = 0; src < world; src++) s->n_recv += sim[src].counts_h[dst];
        s->recv_h = (uint8_t *)h->alloc(hctx, (size_t)s->n_recv * rec.size);
        s->part_h = (uint8_t *)h->alloc(hctx, (size_t)s->n_recv * pl.size);
        if (!s->recv_h || !s->part_h) return host_failf(dst, "alloc");
        size_t at = 0;
        for (uint32_t src = 0; src < world; src++) {
            size_t bytes = (size_t)sim[src].counts_h[dst] * rec.size;
            memcpy(s->recv_h + at, sim[src].send_h + (size_t)sim[src].offs_h[dst] * rec.size, bytes);
            at += bytes;
        }
        epd_status_t st = h->experts(hctxs[dst], &shape[dst], 0, s->recv_h, s->n_recv, NULL, s->part_h);
        if (st != EPD_OK) return host_failf(dst, "experts: %s", epd_status_name(st));
    });
    if (!ok) return false;
    for (uint32_t dst = 0; dst < world; dst++) {
        sim_rank_t *s = &sim[dst];
        s->recv_d = (uint8_t *)d->alloc(dctx, (size_t)s->n_recv * rec.size);
        s->part_d = (uint8_t *)d->alloc(dctx, (size_t)s->n_recv * pl.size);
        if (!s->recv_d || !s->part_d) return failf("alloc of the receive buffers");
        size_t at = 0;
        for (uint32_t src = 0; src < world; src++) {
            size_t bytes = (size_t)sim[src].counts_h[dst] * rec.size;
            if (bytes == 0) continue;
            CUDA_OK(cudaMemcpy(s->recv_d + at, sim[src].send_d + (size_t)sim[src].offs_h[dst] * rec.size,
                               bytes, cudaMemcpyDeviceToDevice));
            at += bytes;
        }
        /* cudaMemcpy between device buffers returns before the copy is done, on the legacy
         * stream, which the ops' non-blocking stream does not wait for */
        CUDA_OK(cudaDeviceSynchronize());
        OPS_OK(d, dctx, d->experts(dctx, &shape[dst], 0, s->recv_d, s->n_recv, NULL, s->part_d), "experts");
        OPS_OK(d, dctx, d->sync(dctx), "sync after experts");
        char what[64];
        snprintf(what, sizeof what, "rank %u partials", dst);
        if (!same_bytes(s->part_d, s->part_h, (size_t)s->n_recv * pl.size, what)) return false;
    }

    /* combine: the partials go back to their sources, at the records' send positions; `at` is
     * the first row of dst's partials that came from src */
    ok = host_parallel(world, [&](uint32_t src) {
        sim_rank_t *s = &sim[src];
        s->back_h = (uint8_t *)h->alloc(hctx, (size_t)s->lay_h.n_send * pl.size);
        s->y_h = (uint16_t *)h->alloc(hctx, xb);
        if (!s->back_h || !s->y_h) return host_failf(src, "alloc");
        for (uint32_t dst = 0; dst < world; dst++) {
            size_t at = 0;
            for (uint32_t o = 0; o < src; o++) at += sim[o].counts_h[dst];
            memcpy(s->back_h + (size_t)s->offs_h[dst] * pl.size, sim[dst].part_h + at * pl.size,
                   (size_t)s->counts_h[dst] * pl.size);
        }
        epd_status_t st = h->combine(hctxs[src], &shape[src], &s->lay_h, s->back_h, s->y_h);
        if (st != EPD_OK) return host_failf(src, "combine: %s", epd_status_name(st));
    });
    if (!ok) return false;
    for (uint32_t src = 0; src < world; src++) {
        sim_rank_t *s = &sim[src];
        s->back_d = (uint8_t *)d->alloc(dctx, (size_t)s->lay_h.n_send * pl.size);
        s->y_d = (uint16_t *)d->alloc(dctx, xb);
        if (!s->back_d || !s->y_d) return failf("alloc of the outputs");
        for (uint32_t dst = 0; dst < world; dst++) {
            size_t at = 0;
            for (uint32_t o = 0; o < src; o++) at += sim[o].counts_h[dst];
            size_t rows = s->counts_h[dst];
            if (rows == 0) continue;
            CUDA_OK(cudaMemcpy(s->back_d + (size_t)s->offs_h[dst] * pl.size, sim[dst].part_d + at * pl.size,
                               rows * pl.size, cudaMemcpyDeviceToDevice));
        }
        CUDA_OK(cudaMemset(s->y_d, 0x5a, xb));
        CUDA_OK(cudaDeviceSynchronize()); /* as above: the copies and the memset are not on the ops stream */
        OPS_OK(d, dctx, d->combine(dctx, &shape[src], &s->lay_d, s->back_d, s->y_d), "combine");
        OPS_OK(d, dctx, d->sync(dctx), "sync after combine");
        char what[64];
        snprintf(what, sizeof what, "rank %u output y", src);
        if (!same_bytes(s->y_d, s->y_h, xb, what)) return false;
    }
    /* telemetry: the same sums up to the order of the additions (fp32 per thread on the GPU) */
    for (uint32_t r = 0; r < world; r++) {
        OPS_OK(h, hctxs[r], h->quant_error_take(hctxs[r], &qe_r), "quant_error_take");
        qe_h.dispatch_err2 += qe_r.dispatch_err2;
        qe_h.dispatch_ref2 += qe_r.dispatch_ref2;
        qe_h.combine_err2 += qe_r.combine_err2;
        qe_h.combine_ref2 += qe_r.combine_ref2;
    }
    OPS_OK(d, dctx, d->quant_error_take(dctx, &qe_d), "quant_error_take");
    const double got[4] = {qe_d.dispatch_err2, qe_d.dispatch_ref2, qe_d.combine_err2, qe_d.combine_ref2};
    const double want[4] = {qe_h.dispatch_err2, qe_h.dispatch_ref2, qe_h.combine_err2, qe_h.combine_ref2};
    const bool on[4] = {base->quant_error && base->dtype == EPD_WIRE_FP8,
                        base->quant_error && base->dtype == EPD_WIRE_FP8,
                        base->quant_error && base->combine_dtype == EPD_COMBINE_FP8,
                        base->quant_error && base->combine_dtype == EPD_COMBINE_FP8};
    static const char *const names[4] = {"dispatch err2", "dispatch ref2", "combine err2", "combine ref2"};
    for (int k = 0; k < 4; k++) {
        if (!on[k] && (got[k] != 0.0 || want[k] != 0.0))
            return failf("telemetry %s: %g (cuda) %g (host) while off", names[k], got[k], want[k]);
        if (on[k] && !(fabs(got[k] - want[k]) <= 1e-4 * fabs(want[k]) + 1e-30))
            return failf("telemetry %s: cuda %.9g host %.9g", names[k], got[k], want[k]);
    }
    return true;
}

static void report(bool ok, const char *name)
{
    if (ok) {
        n_passed++;
        printf("ok    %s\n", name);
    } else {
        n_failed++;
        printf("FAIL  %s: %s\n", name, fail_msg);
    }
    fflush(stdout);
}

/* ---- the hooks and the errors ------------------------------------------------------------- */

static bool hooks_case(void)
{
    const epd_ops_t *d = &epd_ops_cuda;
    const size_t bytes = (3u << 20) + 5;
    epd_ops_event_t *ev = NULL;
    uint8_t *a = (uint8_t *)d->alloc_host(dctx, bytes), *b = (uint8_t *)d->alloc_host(dctx, bytes);
    uint8_t *da = (uint8_t *)d->alloc(dctx, bytes), *db = (uint8_t *)d->alloc(dctx, bytes);
    bool ok = false;

    if (!a || !b || !da || !db) {
        failf("alloc");
        goto out;
    }
    if (d->stream(dctx) == NULL) {
        failf("no stream");
        goto out;
    }
    for (size_t i = 0; i < bytes; i++) a[i] = (uint8_t)(i * 7 + 1);
    memset(b, 0, bytes);
    if (d->event_create(dctx, &ev) != EPD_OK ||
        d->copy_to_ops_async(dctx, da, a, bytes, NULL) != EPD_OK ||
        d->copy_ops_to_ops_async(dctx, db, da, bytes, ev) != EPD_OK || d->event_wait(dctx, ev) != EPD_OK ||
        d->event_query(dctx, ev) != EPD_OK || d->copy_to_host_async(dctx, b, db, bytes, ev) != EPD_OK) {
        failf("hook failed: %s", d->last_error(dctx));
        goto out;
    }
    while (d->event_query(dctx, ev) == EPD_ERR_AGAIN) {
    }
    if (d->event_query(dctx, ev) != EPD_OK || memcmp(a, b, bytes) != 0) {
        failf("async copies do not round-trip");
        goto out;
    }
    ok = true;
out:
    if (ev) d->event_destroy(dctx, ev);
    d->free_host(dctx, a);
    d->free_host(dctx, b);
    d->free(dctx, da);
    d->free(dctx, db);
    return ok;
}

/* The layout alone on many tokens, so its blocks walk several 256-token steps with a carry
 * (n > 64 x 256), and on more than 64 ranks (two mask words): slots, counts and offsets equal the
 * host's. */
static bool layout_large_case(uint32_t n, uint32_t world)
{
    const epd_ops_t *d = &epd_ops_cuda, *h = &epd_ops_host;
    epd_moe_shape_t shape = { 128, TOPK, EXPERTS, world, 0, EPD_WIRE_FP8, EPD_SCALE_GROUP128,
                              EPD_SCALE_FMT_FP32, EPD_EXPERTS_IDENTITY };
    size_t kb = (size_t)n * TOPK * sizeof(int32_t), sb = (size_t)n * world * sizeof(int32_t);
    int32_t *ids = (int32_t *)malloc(kb), *slot_h = (int32_t *)malloc(sb);
    uint32_t *counts_h = (uint32_t *)calloc(world, 4), *offs_h = (uint32_t *)calloc(world, 4);
    uint32_t *counts_d = (uint32_t *)calloc(world, 4), *offs_d = (uint32_t *)calloc(world, 4);
    int32_t *ids_d = (int32_t *)d->alloc(dctx, kb), *slot_d = (int32_t *)d->alloc(dctx, sb);
    bool ok = ids && slot_h && counts_h && offs_h && counts_d && offs_d && ids_d && slot_d;
    if (!ok) failf("out of memory");
    uint64_t s = 0x5eed0000u + n + world;
    for (uint32_t t = 0; ok && t < n; t++)
        for (uint32_t k = 0; k < TOPK; k++) {
            uint64_t r = epd_rng_next(&s);
            /* skewed towards low experts so some ranks get many more records than others */
            ids[(size_t)t * TOPK + k] = r % 9 == 0 ? -1 : (int32_t)((r >> 8) % ((r >> 40) % 3 ? EXPERTS : 16));
        }
    epd_step_layout_t lh = {n, counts_h, offs_h, 0, slot_h}, ld = {n, counts_d, offs_d, 0, slot_d};
    if (ok && h->layout(hctx, &shape, ids, &lh) != EPD_OK) ok = failf("host layout failed");
    if (ok && d->copy_to_ops(dctx, ids_d, ids, kb) != EPD_OK) ok = failf("copy of the ids");
    if (ok) {
        epd_status_t st = layout_all(d, &shape, ids_d, &ld);
        if (st != EPD_OK) ok = failf("cuda layout: %s %s", epd_status_name(st), d->last_error(dctx));
    }
    if (ok && ld.n_send != lh.n_send) ok = failf("n_send cuda %u host %u", ld.n_send, lh.n_send);
    if (ok && (memcmp(counts_h, counts_d, world * 4) != 0 || memcmp(offs_h, offs_d, world * 4) != 0))
        ok = failf("send counts or offsets differ");
    if (ok) ok = same_bytes(slot_d, slot_h, sb, "slot");
    free(ids);
    free(slot_h);
    free(counts_h);
    free(offs_h);
    free(counts_d);
    free(offs_d);
    d->free(dctx, ids_d);
    d->free(dctx, slot_d);
    return ok;
}

static bool bad_id_case(void)
{
    const epd_ops_t *d = &epd_ops_cuda;
    epd_moe_shape_t shape = { 128, TOPK, EXPERTS, 2, 0, EPD_WIRE_FP8, EPD_SCALE_GROUP128,
                              EPD_SCALE_FMT_FP32, EPD_EXPERTS_IDENTITY };
    int32_t ids[2 * TOPK];
    uint32_t counts[2], offs[2];
    epd_step_layout_t lay;
    bool ok;

    for (int i = 0; i < 2 * TOPK; i++) ids[i] = i;
    ids[TOPK + 3] = EXPERTS; /* out of range */
    int32_t *ids_d = (int32_t *)d->alloc(dctx, sizeof ids);
    memset(&lay, 0, sizeof lay);
    lay.n_tokens = 2;
    lay.send_counts_host = counts;
    lay.send_offsets_host = offs;
    lay.slot = (int32_t *)d->alloc(dctx, 2 * 2 * 4);
    if (d->copy_to_ops(dctx, ids_d, ids, sizeof ids) != EPD_OK) return failf("copy");
    epd_status_t st = layout_all(d, &shape, ids_d, &lay);
    ok = st == EPD_ERR_EXPERT_OUT_OF_RANGE && strstr(d->last_error(dctx), "outside") != NULL;
    if (!ok) failf("layout with id %d: %s (%s)", EXPERTS, epd_status_name(st), d->last_error(dctx));
    /* a pack queued behind a bad layout must write nothing: every slot is -1 */
    int32_t slots[4] = {0, 0, 0, 0};
    if (ok && (d->copy_to_host(dctx, slots, lay.slot, sizeof slots) != EPD_OK ||
               slots[0] != -1 || slots[1] != -1 || slots[2] != -1 || slots[3] != -1))
        ok = failf("slots after a bad id: %d %d %d %d, want all -1", slots[0], slots[1], slots[2], slots[3]);
    /* the context stays usable */
    ids[TOPK + 3] = -2;
    if (ok && (d->copy_to_ops(dctx, ids_d, ids, sizeof ids) != EPD_OK ||
               layout_all(d, &shape, ids_d, &lay) != EPD_ERR_EXPERT_OUT_OF_RANGE))
        ok = failf("id -2 accepted or context broken");
    ids[TOPK + 3] = 5;
    if (ok && (d->copy_to_ops(dctx, ids_d, ids, sizeof ids) != EPD_OK ||
               layout_all(d, &shape, ids_d, &lay) != EPD_OK || lay.n_send != 2))
        ok = failf("a good layout after bad ones: n_send %u, want 2", lay.n_send);
    d->free(dctx, ids_d);
    d->free(dctx, lay.slot);
    return ok;
}

int main(void)
{
    static const struct {
        epd_wire_dtype_t dtype;
        epd_scale_kind_t scale;
        epd_scale_fmt_t fmt;
        const char *name;
    } wires[] = {
        { EPD_WIRE_BF16, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, "bf16" },
        { EPD_WIRE_FP8, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, "fp8 group128 fp32" },
        { EPD_WIRE_FP8, EPD_SCALE_GROUP128, EPD_SCALE_FMT_UE8M0, "fp8 group128 ue8m0" },
        { EPD_WIRE_FP8, EPD_SCALE_PER_TOKEN, EPD_SCALE_FMT_FP32, "fp8 per_token fp32" },
        { EPD_WIRE_FP8, EPD_SCALE_PER_TOKEN, EPD_SCALE_FMT_UE8M0, "fp8 per_token ue8m0" },
    };
    static const uint32_t worlds[] = { 1, 2, 4, 8 }, tokens[] = { 1, 7, 128, 4096 },
                          hiddens[] = { 128, 7168 };
    int n_dev = 0;
    char err[EPD_ERR_LEN];
    sim_rank_t sim[MAX_WORLD];

    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        printf("SKIP: no GPU\n");
        return 77;
    }
    if (epd_ops_host.init(-1, &hctx, err) != EPD_OK || epd_ops_cuda.init(0, &dctx, err) != EPD_OK) {
        printf("init: %s\n", err);
        return 1;
    }
    for (uint32_t r = 0; r < MAX_WORLD; r++) {
        if (epd_ops_host.init(-1, &hctxs[r], err) != EPD_OK) {
            printf("init: %s\n", err);
            return 1;
        }
    }
    memset(sim, 0, sizeof sim);
    report(hooks_case(), "hooks: events and async copies round-trip 3 MiB");
    report(bad_id_case(), "layout: expert id out of range -> expert_out_of_range");
    report(layout_large_case(16385, 2), "layout: N=16385 W=2 (512-token tiles)");
    report(layout_large_case(40000, 8), "layout: N=40000 W=8 (768-token tiles)");
    report(layout_large_case(20000, 128), "layout: N=20000 W=128 (two 64-rank mask words)");
    report(layout_large_case(100, 256), "layout: N=100 W=256");

    uint64_t seed = 1;
    for (size_t hi = 0; hi < sizeof hiddens / sizeof hiddens[0]; hi++)
        for (size_t wi = 0; wi < sizeof wires / sizeof wires[0]; wi++)
            for (int kind = 0; kind < 2; kind++)
                for (size_t w = 0; w < sizeof worlds / sizeof worlds[0]; w++)
                    for (size_t ni = 0; ni < sizeof tokens / sizeof tokens[0]; ni++) {
                        epd_moe_shape_t shape = { hiddens[hi], TOPK, EXPERTS, worlds[w], 0,
                                                  wires[wi].dtype, wires[wi].scale, wires[wi].fmt,
                                                  kind ? EPD_EXPERTS_SCALE : EPD_EXPERTS_IDENTITY,
                                                  EPD_COMBINE_BF16, (ni % 2) == 1 };
                        char name[160];
                        snprintf(name, sizeof name, "%-20s %-8s W=%u N=%-4u H=%u%s", wires[wi].name,
                                 kind ? "scale" : "identity", worlds[w], tokens[ni], hiddens[hi],
                                 shape.quant_error ? " telemetry" : "");
                        bool ok = run_case(&shape, tokens[ni], seed++, sim);
                        for (uint32_t r = 0; r < MAX_WORLD; r++) sim_free(&sim[r]);
                        report(ok, name);
                    }
    /* FP8 partials (combine.dtype fp8) after BF16 and FP8 group128 dispatch (scale experts) and
     * FP8 per_token ue8m0 (identity experts) */
    static const size_t fp8p_wires[] = { 0, 1, 4 };
    for (size_t hi = 0; hi < sizeof hiddens / sizeof hiddens[0]; hi++)
        for (size_t wj = 0; wj < sizeof fp8p_wires / sizeof fp8p_wires[0]; wj++)
            for (int kind = wj == 2 ? 0 : 1, once = 1; once; once = 0)
                for (size_t w = 0; w < sizeof worlds / sizeof worlds[0]; w++)
                    for (size_t ni = 0; ni < sizeof tokens / sizeof tokens[0]; ni++) {
                        size_t wi = fp8p_wires[wj];
                        epd_moe_shape_t shape = { hiddens[hi], TOPK, EXPERTS, worlds[w], 0,
                                                  wires[wi].dtype, wires[wi].scale, wires[wi].fmt,
                                                  kind ? EPD_EXPERTS_SCALE : EPD_EXPERTS_IDENTITY,
                                                  EPD_COMBINE_FP8, (ni % 2) == 0 };
                        char name[160];
                        snprintf(name, sizeof name, "%-20s %-8s W=%u N=%-4u H=%u fp8 combine%s",
                                 wires[wi].name, kind ? "scale" : "identity", worlds[w], tokens[ni],
                                 hiddens[hi], shape.quant_error ? " telemetry" : "");
                        bool ok = run_case(&shape, tokens[ni], seed++, sim);
                        for (uint32_t r = 0; r < MAX_WORLD; r++) sim_free(&sim[r]);
                        report(ok, name);
                    }

    for (uint32_t r = 0; r < MAX_WORLD; r++) epd_ops_host.fini(hctxs[r]);
    epd_ops_cuda.fini(dctx);
    epd_ops_host.fini(hctx);
    printf("%d passed, %d failed\n", n_passed, n_failed);
    return n_failed == 0 ? 0 : 1;
}
