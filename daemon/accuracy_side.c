/* The side path of `epd --accuracy` (see daemon/accuracy_side.h): the fp32 dispatch reference and
 * the per-tensor requantization modes, over a host-memory exchange that routes tokens exactly as
 * the step does (epd_layout_host), so every destination sees the rows the step would give it. */
#include "daemon/accuracy_side.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/fp8.h"
#include "gpu/quant.h"

struct epd_acc_side {
    epd_acc_experts_t ex;
    uint32_t max_tokens, max_records; /* tokens a rank, records a rank sends or receives */
    size_t row_bytes;                 /* a side row: bf16 [H], int32 ids [K], fp32 weights [K] */
    MPI_Datatype row_type, ref_type, partial_type;
    uint32_t n_tokens, n_send, n_recv;
    int32_t *slot;                    /* [max_tokens * W]: record of (token, rank), or -1 */
    uint32_t *send_counts, *send_offsets;
    int *sc, *so, *rc, *ro;           /* [W] MPI counts and displacements, in records */
    uint8_t *send_rows, *recv_rows;   /* [max_records] side rows */
    float *ref_recv, *ref_back;       /* [max_records][H] fp32 partials */
    uint8_t *q, *q_out;               /* [max_records][H] received rows' group128 bytes */
    float *scales;                    /* [max_records][H/128] */
    epd_moe_shape_t rq_shape;         /* FP8 group128 fp32 records, BF16 partials */
    epd_record_layout_t rec;
    epd_partial_layout_t pl;
    uint8_t *records, *partials, *partials_back; /* host: [max_records] records / partials */
    void *records_ops, *partials_ops;            /* the same in ops memory */
    float *sum;                                  /* [H] */
};

/* One thread's scratch of the reference. */
typedef struct ref_scratch {
    float *x, *y, *work, *scales;
    uint8_t *q;
} ref_scratch_t;

typedef struct ref_job {
    const epd_acc_side_t *side;
    uint32_t lo, hi; /* received rows [lo, hi) */
    ref_scratch_t s;
} ref_job_t;

static void *xmalloc(size_t bytes)
{
    return malloc(bytes == 0 ? 1 : bytes);
}

void epd_acc_side_destroy(epd_acc_side_t *side)
{
    if (side == NULL) return;
    const epd_ops_t *ops = side->ex.ops;
    if (side->records_ops != NULL) ops->free(side->ex.ops_ctx, side->records_ops);
    if (side->partials_ops != NULL) ops->free(side->ex.ops_ctx, side->partials_ops);
    if (side->row_type != MPI_DATATYPE_NULL) MPI_Type_free(&side->row_type);
    if (side->ref_type != MPI_DATATYPE_NULL) MPI_Type_free(&side->ref_type);
    if (side->partial_type != MPI_DATATYPE_NULL) MPI_Type_free(&side->partial_type);
    free(side->slot);
    free(side->send_counts);
    free(side->send_offsets);
    free(side->sc);
    free(side->so);
    free(side->rc);
    free(side->ro);
    free(side->send_rows);
    free(side->recv_rows);
    free(side->ref_recv);
    free(side->ref_back);
    free(side->q);
    free(side->q_out);
    free(side->scales);
    free(side->records);
    free(side->partials);
    free(side->partials_back);
    free(side->sum);
    free(side);
}

epd_status_t epd_acc_side_create(const epd_acc_experts_t *experts, uint32_t max_tokens,
                                 epd_acc_side_t **side_p, char err[EPD_ERR_LEN])
{
    epd_acc_side_t *s = calloc(1, sizeof *s);
    const epd_moe_shape_t *sh = &experts->shape;
    uint32_t W = sh->world, H = sh->hidden, K = sh->topk;

    *side_p = NULL;
    if (s == NULL) goto no_memory;
    s->row_type = s->ref_type = s->partial_type = MPI_DATATYPE_NULL;
    s->ex = *experts;
    s->max_tokens = max_tokens;
    /* a destination receives each source's token at most once: max_tokens from each rank */
    if ((uint64_t)max_tokens * W > UINT32_MAX / 2) goto no_memory;
    s->max_records = max_tokens * W;
    s->row_bytes = (size_t)H * 2 + (size_t)K * 8;
    s->rq_shape = *sh;
    s->rq_shape.dtype = EPD_WIRE_FP8;
    s->rq_shape.scale = EPD_SCALE_GROUP128;
    s->rq_shape.scale_format = EPD_SCALE_FMT_FP32;
    s->rq_shape.combine_dtype = EPD_COMBINE_BF16;
    s->rq_shape.quant_error = false;
    s->rq_shape.layer = experts->layer;
    epd_record_layout(&s->rq_shape, &s->rec);
    epd_partial_layout(&s->rq_shape, &s->pl);

    size_t R = s->max_records;
    s->slot = xmalloc((size_t)max_tokens * W * sizeof *s->slot);
    s->send_counts = xmalloc(W * sizeof *s->send_counts);
    s->send_offsets = xmalloc(W * sizeof *s->send_offsets);
    s->sc = xmalloc(W * sizeof *s->sc);
    s->so = xmalloc(W * sizeof *s->so);
    s->rc = xmalloc(W * sizeof *s->rc);
    s->ro = xmalloc(W * sizeof *s->ro);
    s->send_rows = xmalloc(R * s->row_bytes);
    s->recv_rows = xmalloc(R * s->row_bytes);
    s->ref_recv = xmalloc(R * H * sizeof(float));
    s->ref_back = xmalloc(R * H * sizeof(float));
    s->q = xmalloc(R * H);
    s->q_out = xmalloc(R * H);
    s->scales = xmalloc(R * (H / EPD_QUANT_GROUP) * sizeof(float));
    s->records = calloc(R ? R : 1, s->rec.size);
    s->partials = xmalloc(R * s->pl.size);
    s->partials_back = xmalloc(R * s->pl.size);
    s->sum = xmalloc(H * sizeof *s->sum);
    if (s->slot == NULL || s->send_counts == NULL || s->send_offsets == NULL || s->sc == NULL ||
        s->so == NULL || s->rc == NULL || s->ro == NULL || s->send_rows == NULL ||
        s->recv_rows == NULL || s->ref_recv == NULL || s->ref_back == NULL || s->q == NULL ||
        s->q_out == NULL || s->scales == NULL || s->records == NULL || s->partials == NULL ||
        s->partials_back == NULL || s->sum == NULL)
        goto no_memory;
    s->records_ops = experts->ops->alloc(experts->ops_ctx, R * s->rec.size);
    s->partials_ops = experts->ops->alloc(experts->ops_ctx, R * s->pl.size);
    if (s->records_ops == NULL || s->partials_ops == NULL) {
        snprintf(err, EPD_ERR_LEN, "accuracy side path: out of %s memory for %zu records",
                 experts->ops->name, R);
        epd_acc_side_destroy(s);
        return EPD_ERR_NO_MEMORY;
    }
    MPI_Type_contiguous((int)s->row_bytes, MPI_BYTE, &s->row_type);
    MPI_Type_contiguous((int)H, MPI_FLOAT, &s->ref_type);
    MPI_Type_contiguous((int)s->pl.size, MPI_BYTE, &s->partial_type);
    MPI_Type_commit(&s->row_type);
    MPI_Type_commit(&s->ref_type);
    MPI_Type_commit(&s->partial_type);
    *side_p = s;
    return EPD_OK;

no_memory:
    snprintf(err, EPD_ERR_LEN, "accuracy side path: out of host memory for %u tokens a rank",
             max_tokens);
    epd_acc_side_destroy(s);
    return EPD_ERR_NO_MEMORY;
}

epd_status_t epd_acc_side_dispatch(epd_acc_side_t *s, uint32_t n, const uint16_t *x,
                                   const int32_t *ids, const float *weights,
                                   char err[EPD_ERR_LEN])
{
    const epd_moe_shape_t *sh = &s->ex.shape;
    uint32_t W = sh->world, H = sh->hidden, K = sh->topk;
    epd_status_t status;

    if (n > s->max_tokens) {
        snprintf(err, EPD_ERR_LEN, "accuracy side path: %u tokens, sized for %u", n,
                 s->max_tokens);
        return EPD_ERR_INVALID_ARG;
    }
    CHECK_GOTO(epd_layout_host(sh, n, ids, s->slot, s->send_counts, s->send_offsets, NULL,
                               &s->n_send, err), out);
    for (uint32_t t = 0; t < n; t++) {
        for (uint32_t r = 0; r < W; r++) {
            int32_t j = s->slot[(size_t)t * W + r];
            if (j < 0) continue;
            uint8_t *row = s->send_rows + (size_t)j * s->row_bytes;
            memcpy(row, x + (size_t)t * H, (size_t)H * 2);
            memcpy(row + (size_t)H * 2, ids + (size_t)t * K, (size_t)K * 4);
            memcpy(row + (size_t)H * 2 + (size_t)K * 4, weights + (size_t)t * K, (size_t)K * 4);
        }
    }
    for (uint32_t r = 0; r < W; r++) {
        s->sc[r] = (int)s->send_counts[r];
        s->so[r] = (int)s->send_offsets[r];
    }
    MPI_Alltoall(s->sc, 1, MPI_INT, s->rc, 1, MPI_INT, s->ex.comm);
    s->n_recv = 0;
    for (uint32_t r = 0; r < W; r++) {
        s->ro[r] = (int)s->n_recv;
        s->n_recv += (uint32_t)s->rc[r];
    }
    if (s->n_recv > s->max_records) {
        snprintf(err, EPD_ERR_LEN, "accuracy side path: %u records received, sized for %u",
                 s->n_recv, s->max_records);
        return EPD_ERR_INTERNAL;
    }
    MPI_Alltoallv(s->send_rows, s->sc, s->so, s->row_type, s->recv_rows, s->rc, s->ro,
                  s->row_type, s->ex.comm);
    s->n_tokens = n;
    status = EPD_OK;
out:
    return status;
}

/* ---- the fp32 dispatch reference ---------------------------------------------------------- */

static void ref_scratch_free(ref_scratch_t *r)
{
    free(r->x);
    free(r->y);
    free(r->work);
    free(r->scales);
    free(r->q);
}

static bool ref_scratch_alloc(const epd_acc_side_t *s, ref_scratch_t *r)
{
    uint32_t H = s->ex.shape.hidden;
    memset(r, 0, sizeof *r);
    r->x = xmalloc(H * sizeof *r->x);
    r->y = xmalloc(H * sizeof *r->y);
    r->scales = xmalloc(H / EPD_QUANT_GROUP * sizeof *r->scales);
    r->q = xmalloc(H);
    r->work = xmalloc((s->ex.ffn ? epd_ffn_scratch_floats(s->ex.ffn) : 1) * sizeof *r->work);
    if (r->x && r->y && r->scales && r->q && r->work) return true;
    ref_scratch_free(r);
    return false;
}

/* One received row's fp32 partial into out[H]. */
static void ref_row(const epd_acc_side_t *s, const uint8_t *row, ref_scratch_t *r, float *out)
{
    const epd_moe_shape_t *sh = &s->ex.shape;
    uint32_t H = sh->hidden, K = sh->topk, per_rank = sh->num_experts / sh->world;
    int32_t lo = (int32_t)(sh->rank * per_rank), hi = lo + (int32_t)per_rank;
    const uint16_t *x = (const uint16_t *)row;
    const int32_t *ids = (const int32_t *)(row + (size_t)H * 2);
    const float *w = (const float *)(row + (size_t)H * 2 + (size_t)K * 4);
    const epd_ffn_weights_t *ffn = s->ex.ffn;
    const epd_ffn_layer_t *layer = ffn ? epd_ffn_find_layer(ffn, s->ex.layer) : NULL;
    epd_ffn_row_t frow = {.x = r->x};

    for (uint32_t i = 0; i < H; i++) {
        r->x[i] = epd_bf16_to_f32(x[i]);
        out[i] = 0.0f;
    }
    if (ffn != NULL && ffn->format == EPD_FFN_FP8_BLOCK) {
        /* an FP8 GEMM reads FP8: the bytes an unquantized dispatch leaves it to make */
        epd_quant_row_host(x, H, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, r->q, r->scales);
        frow.q = r->q;
        frow.scales = r->scales;
    }
    for (uint32_t k = 0; k < K; k++) {
        if (ids[k] < lo || ids[k] >= hi) continue;
        if (ffn == NULL) {
            s->ex.kind->accumulate(sh, ids[k], w[k], r->x, out);
            continue;
        }
        epd_ffn_expert_host(ffn, layer, (uint32_t)ids[k] - ffn->first_expert, &frow, r->work,
                            r->y);
        for (uint32_t i = 0; i < H; i++) {
            float wy = w[k] * r->y[i];
            out[i] = out[i] + wy;
        }
    }
}

static void *ref_worker(void *arg)
{
    ref_job_t *job = arg;
    const epd_acc_side_t *s = job->side;
    for (uint32_t j = job->lo; j < job->hi; j++)
        ref_row(s, s->recv_rows + (size_t)j * s->row_bytes, &job->s,
                s->ref_recv + (size_t)j * s->ex.shape.hidden);
    return NULL;
}

/* The fp32 partials of every received row, on up to ex.threads threads (the ffn host experts
 * are the slow part of the study at real shapes). */
static epd_status_t ref_partials(epd_acc_side_t *s, char err[EPD_ERR_LEN])
{
    uint32_t n = s->n_recv, T = s->ex.ffn != NULL ? s->ex.threads : 1;
    if (T > n) T = n;
    if (T == 0) T = 1;
    ref_job_t *jobs = calloc(T, sizeof *jobs);
    pthread_t *tids = calloc(T, sizeof *tids);
    uint32_t started = 0;
    epd_status_t status = EPD_OK;

    if (jobs == NULL || tids == NULL) {
        status = EPD_ERR_NO_MEMORY;
        goto out;
    }
    for (uint32_t i = 0; i < T; i++) {
        jobs[i].side = s;
        jobs[i].lo = (uint32_t)((uint64_t)n * i / T);
        jobs[i].hi = (uint32_t)((uint64_t)n * (i + 1) / T);
        if (!ref_scratch_alloc(s, &jobs[i].s)) {
            status = EPD_ERR_NO_MEMORY;
            goto out;
        }
    }
    /* the calling thread takes the first share */
    for (uint32_t i = 1; i < T; i++) {
        if (pthread_create(&tids[i], NULL, ref_worker, &jobs[i]) != 0) break;
        started = i;
    }
    for (uint32_t i = started + 1; i < T; i++) ref_worker(&jobs[i]);
    ref_worker(&jobs[0]);
    for (uint32_t i = 1; i <= started; i++) pthread_join(tids[i], NULL);
out:
    if (status == EPD_ERR_NO_MEMORY)
        snprintf(err, EPD_ERR_LEN, "accuracy reference: out of host memory for %u threads", T);
    for (uint32_t i = 0; jobs != NULL && i < T; i++) ref_scratch_free(&jobs[i].s);
    free(jobs);
    free(tids);
    return status;
}

epd_status_t epd_acc_side_reference(epd_acc_side_t *s, float *ref, char err[EPD_ERR_LEN])
{
    const epd_moe_shape_t *sh = &s->ex.shape;
    uint32_t W = sh->world, H = sh->hidden;
    /* computed before the exchange; a failure is still this rank's to report (the caller aborts) */
    epd_status_t status = ref_partials(s, err);

    if (status != EPD_OK) return status;
    MPI_Alltoallv(s->ref_recv, s->rc, s->ro, s->ref_type, s->ref_back, s->sc, s->so, s->ref_type,
                  s->ex.comm);
    for (uint32_t t = 0; t < s->n_tokens; t++) {
        float *out = ref + (size_t)t * H;
        for (uint32_t i = 0; i < H; i++) out[i] = 0.0f;
        for (uint32_t r = 0; r < W; r++) {
            int32_t j = s->slot[(size_t)t * W + r];
            if (j < 0) continue;
            const float *p = s->ref_back + (size_t)j * H;
            for (uint32_t i = 0; i < H; i++) out[i] = out[i] + p[i];
        }
    }
    return EPD_OK;
}

/* ---- the requant modes ------------------------------------------------------------------- */

/* The received rows as the FP8 records the experts read: payload q_out, every group scale S. */
static void requant_records(epd_acc_side_t *s, float big_s)
{
    const epd_moe_shape_t *sh = &s->ex.shape;
    uint32_t H = sh->hidden, K = sh->topk;

    for (uint32_t j = 0; j < s->n_recv; j++) {
        uint8_t *rec = s->records + (size_t)j * s->rec.size;
        const uint8_t *row = s->recv_rows + (size_t)j * s->row_bytes;
        memcpy(rec + s->rec.payload, s->q_out + (size_t)j * H, H);
        for (size_t g = 0; g < s->rec.n_scales; g++)
            memcpy(rec + s->rec.scales + g * sizeof big_s, &big_s, sizeof big_s);
        memcpy(rec + s->rec.ids, row + (size_t)H * 2, (size_t)K * 4);
        memcpy(rec + s->rec.weights, row + (size_t)H * 2 + (size_t)K * 4, (size_t)K * 4);
        memcpy(rec + s->rec.src, &j, sizeof j);
    }
}

/* The ops' experts on the requantized records: their BF16 partials into s->partials. */
static epd_status_t requant_experts(epd_acc_side_t *s, char err[EPD_ERR_LEN])
{
    const epd_ops_t *ops = s->ex.ops;
    epd_ops_ctx_t *ctx = s->ex.ops_ctx;
    size_t rb = (size_t)s->n_recv * s->rec.size, pb = (size_t)s->n_recv * s->pl.size;
    epd_status_t status;

    if (s->n_recv == 0) return EPD_OK;
    status = ops->copy_to_ops(ctx, s->records_ops, s->records, rb);
    if (status == EPD_OK)
        status = ops->experts(ctx, &s->rq_shape, s->ex.layer, s->records_ops, s->n_recv, NULL,
                              s->partials_ops);
    if (status == EPD_OK) status = ops->sync(ctx);
    if (status == EPD_OK) status = ops->copy_to_host(ctx, s->partials, s->partials_ops, pb);
    if (status != EPD_OK)
        snprintf(err, EPD_ERR_LEN, "accuracy requant: the %s experts: %s", ops->name,
                 ops->last_error ? ops->last_error(ctx) : "failed");
    return status;
}

epd_status_t epd_acc_side_requant(epd_acc_side_t *s, float static_s, uint16_t *y, float *s_p,
                                  char err[EPD_ERR_LEN])
{
    const epd_moe_shape_t *sh = &s->ex.shape;
    uint32_t W = sh->world, H = sh->hidden, ns = H / EPD_QUANT_GROUP;
    int32_t count = (int32_t)s->n_recv;
    uint32_t capacity = s->n_recv ? s->n_recv : 1;
    float step_s = 0.0f, big_s = 0.0f;
    epd_status_t status = EPD_OK;

    for (uint32_t j = 0; j < s->n_recv; j++)
        epd_quant_row_host((const uint16_t *)(s->recv_rows + (size_t)j * s->row_bytes), H,
                           EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, s->q + (size_t)j * H,
                           s->scales + (size_t)j * ns);
    if (s->n_recv > 0) {
        status = epd_requant_step_scale_host(s->scales, &count, 1, capacity, H,
                                             EPD_SCALE_GROUP128, &step_s, err);
        if (status == EPD_OK)
            status = epd_requant_host(s->q, s->scales, &count, 1, capacity, H, EPD_SCALE_GROUP128,
                                      static_s, s->q_out, &big_s, err);
        if (status == EPD_OK && static_s <= 0.0f && big_s != step_s) {
            snprintf(err, EPD_ERR_LEN, "accuracy requant: the requant used S = %g, the step "
                     "scale is %g", (double)big_s, (double)step_s);
            status = EPD_ERR_INTERNAL;
        }
    }
    if (status == EPD_OK) {
        requant_records(s, big_s);
        status = requant_experts(s, err);
    }
    if (status != EPD_OK) return status;
    *s_p = big_s;
    MPI_Alltoallv(s->partials, s->rc, s->ro, s->partial_type, s->partials_back, s->sc, s->so,
                  s->partial_type, s->ex.comm);
    for (uint32_t t = 0; t < s->n_tokens; t++) {
        for (uint32_t i = 0; i < H; i++) s->sum[i] = 0.0f;
        for (uint32_t r = 0; r < W; r++) {
            int32_t j = s->slot[(size_t)t * W + r];
            if (j >= 0)
                epd_partial_add_host(&s->rq_shape, s->partials_back + (size_t)j * s->pl.size,
                                     s->sum);
        }
        for (uint32_t i = 0; i < H; i++) y[(size_t)t * H + i] = epd_f32_to_bf16(s->sum[i]);
    }
    return EPD_OK;
}
