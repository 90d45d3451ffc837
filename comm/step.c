/* The collective step: owns the step buffers and runs the phases of DESIGN.md section 2 through
 * the ops table (so it works the same on host and device memory) and the transport, timing each
 * phase. Only the count exchange calls MPI directly. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/step.h"
#include "common/clock.h"

struct epd_step {
    epd_moe_shape_t shape;
    uint32_t max_tokens;
    const epd_ops_t *ops;
    epd_ops_ctx_t *ops_ctx;
    const epd_transport_t *transport;
    epd_transport_ctx_t *transport_ctx;
    MPI_Comm comm;
    epd_record_layout_t record;
    size_t send_capacity; /* records */
    size_t recv_capacity;

    epd_step_layout_t layout; /* slot in ops memory, counts/offsets on the host */
    int32_t *slot_host;       /* [max_tokens * W] pinned: the host layout's slots, uploaded */
    const int32_t *ids_host;  /* the next run's ids on the host (epd_step_set_host_ids), or NULL */
    uint32_t *recv_counts32;  /* [W] from the count exchange */
    /* The count exchange's blocks, one per peer: [records, rows of each of the peer's E/W
     * experts, with the scale exchange the largest scale] (sent: this rank's records for the
     * peer; received: the peer's for this rank). */
    uint32_t *xsend_block;    /* [W * (2 + E/W)] */
    uint32_t *xrecv_block;    /* [W * (2 + E/W)] */
    uint32_t *expert_rows;    /* [E/W] rows per local expert of the records one experts op gets */
    uint32_t *local_rows;     /* [E/W] rows per local expert of the whole step (all senders) */
    /* The step scale (DESIGN.md section 3), with epd_step_set_scale_exchange: each block of the
     * count exchange then ends with one more word, the bits of the largest scale of the records
     * for that peer (positive floats order like their bits), and S is the largest received. */
    bool scale_exchange;
    float *scale_max_host;    /* [W] pinned: the pack's maxima per destination */
    float scale;              /* S of the last run (0: off, BF16, or nothing received) */
    size_t xblock;            /* words a peer of the last count exchange (1 + E/W [+ 1]) */
    uint64_t *send_counts;    /* [W] in records, for the transport */
    uint64_t *send_displs;
    uint64_t *recv_counts;
    uint64_t *recv_displs;
    uint64_t *xsend_counts;   /* [W] what the transport moves: the counts without this rank's */
    uint64_t *xrecv_counts;

    void *send_buf;
    void *recv_buf;
    epd_partial_layout_t partial; /* one partial of the combine (BF16 or FP8 + scales) */
    void *partials;
    void *partials_back;
    epd_step_io_t io;
    /* experts.kind external: the hook that runs the experts phase, and the ranks' failure codes
     * of the last run ([W]) */
    epd_step_experts_fn experts_hook;
    void *experts_arg;
    uint8_t *experts_failures;
};

/* a * b, or SIZE_MAX when it overflows */
static size_t mul_sat(size_t a, size_t b)
{
    if (a != 0 && b > SIZE_MAX / a) return SIZE_MAX;
    return a * b;
}

static size_t add_sat(size_t a, size_t b)
{
    return a > SIZE_MAX - b ? SIZE_MAX : a + b;
}

/* The buffer sizes of a step, in bytes: [0] send records, [1] recv records, [2] partials,
 * [3] partials_back, [4] slot, [5] x, [6] ids, [7] weights, [8] y. */
#define N_BUFS 9
static void buffer_sizes(const epd_moe_shape_t *shape, uint32_t max_tokens, size_t *send_cap_p,
                         size_t *recv_cap_p, size_t sizes[N_BUFS])
{
    epd_record_layout_t rec;
    epd_partial_layout_t part;
    size_t fanout = shape->world < shape->topk ? shape->world : shape->topk;
    size_t row = (size_t)shape->hidden * 2;

    epd_record_layout(shape, &rec);
    epd_partial_layout(shape, &part);
    *send_cap_p = mul_sat(max_tokens, fanout);
    *recv_cap_p = mul_sat(max_tokens, shape->world);
    sizes[0] = mul_sat(*send_cap_p, rec.size);
    sizes[1] = mul_sat(*recv_cap_p, rec.size);
    sizes[2] = mul_sat(*recv_cap_p, part.size);
    sizes[3] = mul_sat(*send_cap_p, part.size);
    sizes[4] = mul_sat(mul_sat(max_tokens, shape->world), sizeof(int32_t));
    sizes[5] = mul_sat(max_tokens, row);
    /* room for the weights after the ids too, so that both go in one copy (epd_step_io_t) */
    sizes[6] = mul_sat(mul_sat(max_tokens, shape->topk), sizeof(int32_t) + sizeof(float));
    sizes[7] = mul_sat(mul_sat(max_tokens, shape->topk), sizeof(float));
    sizes[8] = mul_sat(max_tokens, row);
}

size_t epd_step_memory_bytes(const epd_moe_shape_t *shape, uint32_t max_tokens)
{
    size_t sizes[N_BUFS], send_cap, recv_cap, total = 0;

    buffer_sizes(shape, max_tokens, &send_cap, &recv_cap, sizes);
    for (int i = 0; i < N_BUFS; i++) total = add_sat(total, sizes[i]);
    /* host arrays: counts and displacements per peer */
    return add_sat(total, mul_sat(shape->world, 2 * sizeof(uint32_t) + 7 * sizeof(uint64_t)));
}

void epd_step_destroy(epd_step_t *step)
{
    if (step == NULL) return;
    void *ops_bufs[] = {step->send_buf,      step->recv_buf,        step->partials,
                        step->partials_back, step->layout.slot,     step->io.x,
                        step->io.topk_ids,   step->io.topk_weights, step->io.y};
    for (size_t i = 0; i < EPD_ARRAY_SIZE(ops_bufs); i++)
        if (ops_bufs[i] != NULL) step->ops->free(step->ops_ctx, ops_bufs[i]);
    if (step->slot_host != NULL) step->ops->free_host(step->ops_ctx, step->slot_host);
    if (step->scale_max_host != NULL) step->ops->free_host(step->ops_ctx, step->scale_max_host);
    free(step->layout.send_counts_host);
    free(step->layout.send_offsets_host);
    free(step->recv_counts32);
    free(step->layout.expert_counts_host);
    free(step->xsend_block);
    free(step->xrecv_block);
    free(step->expert_rows);
    free(step->local_rows);
    free(step->send_counts);
    free(step->send_displs);
    free(step->recv_counts);
    free(step->recv_displs);
    free(step->xsend_counts);
    free(step->xrecv_counts);
    free(step->experts_failures);
    free(step);
}

epd_status_t epd_step_create(const epd_moe_shape_t *shape, uint32_t max_tokens,
                             const epd_ops_t *ops, epd_ops_ctx_t *ops_ctx,
                             const epd_transport_t *transport, epd_transport_ctx_t *transport_ctx,
                             MPI_Comm comm, epd_step_t **step_p, char err[EPD_ERR_LEN])
{
    static const char *const names[N_BUFS] = {"send records",      "receive records", "partials",
                                              "returned partials", "slots",           "x",
                                              "top-k ids",         "top-k weights",   "y"};
    epd_step_t *step;
    size_t sizes[N_BUFS];
    void **bufs[N_BUFS];
    int rank = 0, world = 0;
    char why[EPD_ERR_LEN];

    if (shape == NULL || ops == NULL || transport == NULL || step_p == NULL) {
        snprintf(err, EPD_ERR_LEN, "step: missing shape, ops or transport");
        return EPD_ERR_INVALID_ARG;
    }
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &world);
    if (shape->world != (uint32_t)world || shape->rank != (uint32_t)rank) {
        snprintf(err, EPD_ERR_LEN,
                 "step: shape says rank %u of %u but the communicator has rank %d of %d",
                 shape->rank, shape->world, rank, world);
        return EPD_ERR_INVALID_ARG;
    }
    if (epd_moe_shape_check(shape, why) != EPD_OK) {
        snprintf(err, EPD_ERR_LEN, "step: %.240s", why);
        return EPD_ERR_INVALID_ARG;
    }
    if (max_tokens == 0 || (uint64_t)max_tokens * shape->world > INT32_MAX) {
        snprintf(err, EPD_ERR_LEN, "step: max_tokens %u x %u ranks must be in [1, %d] records",
                 max_tokens, shape->world, INT32_MAX);
        return EPD_ERR_INVALID_ARG;
    }

    step = calloc(1, sizeof *step);
    if (step == NULL) goto no_memory_host;
    step->shape = *shape;
    step->max_tokens = max_tokens;
    step->ops = ops;
    step->ops_ctx = ops_ctx;
    step->transport = transport;
    step->transport_ctx = transport_ctx;
    step->comm = comm;
    epd_record_layout(shape, &step->record);
    epd_partial_layout(shape, &step->partial);

    step->layout.send_counts_host = calloc(shape->world, sizeof(uint32_t));
    step->layout.send_offsets_host = calloc(shape->world, sizeof(uint32_t));
    step->recv_counts32 = calloc(shape->world, sizeof(uint32_t));
    {
        size_t block = 2 + shape->num_experts / shape->world; /* with the scale word */
        step->layout.expert_counts_host = calloc(shape->num_experts, sizeof(uint32_t));
        step->xsend_block = calloc(shape->world * block, sizeof(uint32_t));
        step->xrecv_block = calloc(shape->world * block, sizeof(uint32_t));
        step->expert_rows = calloc(block, sizeof(uint32_t));
        step->local_rows = calloc(block, sizeof(uint32_t));
        if (step->layout.expert_counts_host == NULL || step->xsend_block == NULL ||
            step->xrecv_block == NULL || step->expert_rows == NULL || step->local_rows == NULL)
            goto no_memory_host;
    }
    step->send_counts = calloc(shape->world, sizeof(uint64_t));
    step->send_displs = calloc(shape->world, sizeof(uint64_t));
    step->recv_counts = calloc(shape->world, sizeof(uint64_t));
    step->recv_displs = calloc(shape->world, sizeof(uint64_t));
    step->xsend_counts = calloc(shape->world, sizeof(uint64_t));
    step->xrecv_counts = calloc(shape->world, sizeof(uint64_t));
    step->experts_failures = calloc(shape->world, 1);
    if (step->xsend_counts == NULL || step->xrecv_counts == NULL ||
        step->experts_failures == NULL)
        goto no_memory_host;
    if (step->layout.send_counts_host == NULL || step->layout.send_offsets_host == NULL ||
        step->recv_counts32 == NULL || step->send_counts == NULL || step->send_displs == NULL ||
        step->recv_counts == NULL || step->recv_displs == NULL)
        goto no_memory_host;

    buffer_sizes(shape, max_tokens, &step->send_capacity, &step->recv_capacity, sizes);
    bufs[0] = &step->send_buf;
    bufs[1] = &step->recv_buf;
    bufs[2] = (void **)&step->partials;
    bufs[3] = (void **)&step->partials_back;
    bufs[4] = (void **)&step->layout.slot;
    bufs[5] = (void **)&step->io.x;
    bufs[6] = (void **)&step->io.topk_ids;
    bufs[7] = (void **)&step->io.topk_weights;
    bufs[8] = (void **)&step->io.y;
    for (int i = 0; i < N_BUFS; i++) {
        *bufs[i] = sizes[i] == SIZE_MAX ? NULL : ops->alloc(ops_ctx, sizes[i]);
        if (*bufs[i] == NULL) {
            snprintf(err, EPD_ERR_LEN,
                     "step: cannot allocate %zu bytes of %s memory for the %s of %u tokens "
                     "(the whole step needs %zu bytes; lower the tokens per step)",
                     sizes[i], ops->name, names[i], max_tokens,
                     epd_step_memory_bytes(shape, max_tokens));
            epd_step_destroy(step);
            return EPD_ERR_NO_MEMORY;
        }
    }
    step->slot_host = ops->alloc_host(ops_ctx, mul_sat(mul_sat(max_tokens, shape->world),
                                                       sizeof(int32_t)));
    step->scale_max_host = ops->alloc_host(ops_ctx, shape->world * sizeof(float));
    if (step->slot_host == NULL || step->scale_max_host == NULL) {
        snprintf(err, EPD_ERR_LEN, "step: cannot allocate pinned host memory for the slots");
        epd_step_destroy(step);
        return EPD_ERR_NO_MEMORY;
    }
    *step_p = step;
    return EPD_OK;

no_memory_host:
    snprintf(err, EPD_ERR_LEN, "step: out of host memory");
    epd_step_destroy(step);
    return EPD_ERR_NO_MEMORY;
}

const epd_step_io_t *epd_step_io(const epd_step_t *step)
{
    return &step->io;
}

void epd_step_set_host_ids(epd_step_t *step, const int32_t *ids_host)
{
    step->ids_host = ids_host;
}

void epd_step_set_layer(epd_step_t *step, uint32_t layer)
{
    step->shape.layer = layer;
}

void epd_step_set_scale_exchange(epd_step_t *step, bool on)
{
    step->scale_exchange = on;
}

float epd_step_scale(const epd_step_t *step)
{
    return step->scale;
}

void epd_step_last_exchange(const epd_step_t *step, epd_step_exchange_t *exchange_p)
{
    exchange_p->send_counts = step->send_counts;
    exchange_p->send_displs = step->send_displs;
    exchange_p->recv_counts = step->recv_counts;
    exchange_p->recv_displs = step->recv_displs;
    exchange_p->send_buf = step->send_buf;
    exchange_p->recv_buf = step->recv_buf;
    exchange_p->record_bytes = step->record.size;
    exchange_p->partials = step->partials;
    exchange_p->partials_back = step->partials_back;
    exchange_p->partial_bytes = step->partial.size;
    exchange_p->send_capacity = step->send_capacity;
    exchange_p->recv_capacity = step->recv_capacity;
}

void epd_step_set_experts_hook(epd_step_t *step, epd_step_experts_fn fn, void *arg)
{
    step->experts_hook = fn;
    step->experts_arg = arg;
}

const uint8_t *epd_step_experts_failures(const epd_step_t *step)
{
    return step->experts_failures;
}

/* The experts phase through the hook: every received record at once (the worker gets one
 * exchange per step), then the ranks' failure codes. */
static epd_status_t run_experts_hook(epd_step_t *step, uint64_t n_recv, char err[EPD_ERR_LEN])
{
    uint32_t me = step->shape.rank;
    uint64_t own_first = step->recv_displs[me], after = own_first + step->recv_counts[me];
    epd_step_experts_t call;
    uint8_t failure = 0;
    char why[EPD_ERR_LEN] = "";

    memset(&call, 0, sizeof call);
    call.layer = step->shape.layer;
    call.segments[0] = (epd_external_segment_t){.records = step->recv_buf,
                                                .count = (uint32_t)own_first,
                                                .partials = step->partials};
    call.segments[1] = (epd_external_segment_t){
        .records = (uint8_t *)step->send_buf + step->send_displs[me] * step->record.size,
        .count = (uint32_t)step->send_counts[me],
        .partials = (uint8_t *)step->partials_back + step->send_displs[me] * step->partial.size};
    call.segments[2] = (epd_external_segment_t){
        .records = (uint8_t *)step->recv_buf + after * step->record.size,
        .count = (uint32_t)(n_recv - after),
        .partials = (uint8_t *)step->partials + after * step->partial.size};
    call.n_segments = EPD_EXTERNAL_SEGMENTS;
    call.n_records = (uint32_t)n_recv;
    call.expert_rows = step->local_rows; /* every sender's rows: the count exchange's sums */
    call.scale = step->scale;
    epd_status_t status = step->experts_hook(step->experts_arg, &step->shape, &call, &failure, why);
    if (status != EPD_OK) {
        snprintf(err, EPD_ERR_LEN, "step: experts: %s: %.200s", epd_status_name(status), why);
        return status;
    }
    int rc = MPI_Allgather(&failure, 1, MPI_UINT8_T, step->experts_failures, 1, MPI_UINT8_T,
                           step->comm);
    if (rc != MPI_SUCCESS) {
        snprintf(err, EPD_ERR_LEN, "step: MPI_Allgather of the experts' failures failed (code %d)",
                 rc);
        return EPD_ERR_MPI;
    }
    return EPD_OK;
}

/* The experts op on records [first, first + count) of records (a record buffer), into the same
 * rows of out (partials, one epd_partial_layout_t size a row); they came from ranks [src_lo,
 * src_hi), whose blocks of the count exchange give the rows per local expert. */
static epd_status_t run_experts(epd_step_t *step, void *records, uint64_t first, uint64_t count,
                                uint32_t src_lo, uint32_t src_hi, void *out)
{
    uint32_t per_rank = step->shape.num_experts / step->shape.world;
    size_t block = step->xblock;

    if (count == 0) return EPD_OK;
    for (uint32_t e = 0; e < per_rank; e++) step->expert_rows[e] = 0;
    for (uint32_t r = src_lo; r < src_hi; r++)
        for (uint32_t e = 0; e < per_rank; e++)
            step->expert_rows[e] += step->xrecv_block[r * block + 1 + e];
    return step->ops->experts(step->ops_ctx, &step->shape, step->shape.layer,
                              (uint8_t *)records + first * step->record.size, (uint32_t)count,
                              step->expert_rows, (uint8_t *)out + first * step->partial.size);
}

/* Ops that queue work on a device stream return before it runs; host ops have none. */
static bool ops_async(const epd_step_t *step)
{
    return step->ops->stream != NULL && step->ops->stream(step->ops_ctx) != NULL;
}

/* Names a failed op for err, with the ops' own sentence when they keep one. */
static epd_status_t op_failed(const epd_step_t *step, epd_status_t status, const char *what,
                              char err[EPD_ERR_LEN])
{
    const char *why = step->ops->last_error != NULL ? step->ops->last_error(step->ops_ctx) : "";

    snprintf(err, EPD_ERR_LEN, "step: %s (%s ops) failed: %s%s%.160s", what, step->ops->name,
             epd_status_name(status), why[0] ? ": " : "", why);
    return status;
}

/* Names a failed transport call for err, with the transport's own sentence. */
static epd_status_t transport_failed(const epd_step_t *step, epd_status_t status, const char *what,
                                     char err[EPD_ERR_LEN])
{
    const char *why = step->transport->last_error(step->transport_ctx);

    snprintf(err, EPD_ERR_LEN, "step: %s alltoallv (%s transport) failed: %s%s%.160s", what,
             step->transport->name, epd_status_name(status), why[0] ? ": " : "", why);
    return status;
}

epd_status_t epd_step_run(epd_step_t *step, uint32_t n_tokens, const uint16_t *x,
                          const int32_t *topk_ids, const float *topk_weights, uint16_t *y,
                          epd_step_timing_t *timing_p, char err[EPD_ERR_LEN])
{
    const epd_ops_t *ops = step->ops;
    epd_ops_ctx_t *octx = step->ops_ctx;
    const epd_moe_shape_t *shape = &step->shape;
    uint32_t world = shape->world, me = shape->rank;
    uint64_t t[EPD_PHASE_MAX + 1], counts_begin, counts_ns;
    uint64_t n_recv = 0;
    size_t row_bytes = step->partial.size;
    epd_quant_error_t qerr;
    epd_status_t status;
    int rc;

    if (n_tokens > step->max_tokens) {
        snprintf(err, EPD_ERR_LEN, "step: %u tokens exceed the step's %u", n_tokens,
                 step->max_tokens);
        return EPD_ERR_TOO_MANY_TOKENS;
    }
    if (n_tokens > 0 && (x == NULL || topk_ids == NULL || topk_weights == NULL || y == NULL)) {
        snprintf(err, EPD_ERR_LEN, "step: missing input or output buffer");
        return EPD_ERR_INVALID_ARG;
    }

    /* 1. layout and pack, and 2. the record counts exchanged while the pack runs: the layout's
     * counts are on the host before the pack has finished. The pack phase is the time the step
     * waits for layout and pack, less the count exchange. */
    t[0] = epd_now_ns();
    step->layout.n_tokens = n_tokens;
    /* the scale maxima only when asked for: they cost a wait for the pack before the count
     * exchange (which otherwise overlaps it) */
    const bool scale_on = step->scale_exchange && shape->dtype == EPD_WIRE_FP8;
    step->scale = 0.0f;
    step->layout.scale_max_host = scale_on ? step->scale_max_host : NULL;
    if (scale_on) memset(step->scale_max_host, 0, world * sizeof(float));
    const int32_t *ids_host = step->ids_host;
    step->ids_host = NULL; /* for this run only */
    if (ids_host != NULL && ops->copy_queued != NULL) {
        /* the ids are on the host already: the layout there, its slots queued to the device
         * ahead of the pack (no layout kernels, no read-back of the counts) */
        status = epd_layout_host(shape, n_tokens, ids_host, step->slot_host,
                                 step->layout.send_counts_host, step->layout.send_offsets_host,
                                 step->layout.expert_counts_host, &step->layout.n_send, err);
        if (status != EPD_OK) return status;
        if (ops->pack_reads_host) {
            /* the pack reads them where they are and leaves them in layout.slot */
            step->layout.slot_src_host = step->slot_host;
        } else {
            status = ops->copy_queued(octx, step->layout.slot, step->slot_host,
                                      (size_t)n_tokens * world * sizeof(int32_t));
            if (status != EPD_OK) return op_failed(step, status, "slot upload", err);
        }
        status = ops->pack(octx, shape, x, topk_ids, topk_weights, &step->layout, step->send_buf);
        step->layout.slot_src_host = NULL;
        if (status != EPD_OK) return op_failed(step, status, "pack", err);
    } else {
        status = ops->layout(octx, shape, topk_ids, &step->layout);
        if (status != EPD_OK) return op_failed(step, status, "layout", err);
        status = ops->pack(octx, shape, x, topk_ids, topk_weights, &step->layout, step->send_buf);
        if (status != EPD_OK) return op_failed(step, status, "pack", err);
        status = ops->layout_counts(octx, shape, &step->layout);
        if (status != EPD_OK) return op_failed(step, status, "layout", err);
    }
    if (scale_on) {
        /* the maxima come with the pack (cuda: read back behind it) */
        status = ops->sync(octx);
        if (status != EPD_OK) return op_failed(step, status, "sync after pack", err);
    }
    counts_begin = epd_now_ns();
    {
        /* per peer: its records, then the rows of each of its experts (the experts op of a
         * weights kind groups its rows per expert without reading counts back), then with the
         * scale exchange the largest scale of its records */
        uint32_t per_rank = shape->num_experts / world;
        int block = (int)(1 + per_rank + (scale_on ? 1 : 0));
        step->xblock = (size_t)block;
        for (uint32_t r = 0; r < world; r++) {
            uint32_t *b = step->xsend_block + (size_t)r * (size_t)block;
            b[0] = step->layout.send_counts_host[r];
            memcpy(b + 1, step->layout.expert_counts_host + (size_t)r * per_rank,
                   per_rank * sizeof(uint32_t));
            if (scale_on) memcpy(b + 1 + per_rank, &step->scale_max_host[r], sizeof(uint32_t));
        }
        /* one rank exchanges with itself: a copy (the collective costs a microsecond) */
        if (world == 1) {
            memcpy(step->xrecv_block, step->xsend_block, (size_t)block * sizeof(uint32_t));
            rc = MPI_SUCCESS;
        } else {
            rc = MPI_Alltoall(step->xsend_block, block, MPI_UINT32_T, step->xrecv_block, block,
                              MPI_UINT32_T, step->comm);
        }
        if (rc != MPI_SUCCESS) {
            snprintf(err, EPD_ERR_LEN, "step: MPI_Alltoall of record counts failed (code %d)", rc);
            return EPD_ERR_MPI;
        }
        for (uint32_t r = 0; r < world; r++)
            step->recv_counts32[r] = step->xrecv_block[(size_t)r * (size_t)block];
        for (uint32_t e = 0; e < per_rank; e++) step->local_rows[e] = 0;
        for (uint32_t r = 0; r < world; r++)
            for (uint32_t e = 0; e < per_rank; e++)
                step->local_rows[e] += step->xrecv_block[(size_t)r * (size_t)block + 1 + e];
        if (scale_on) {
            uint32_t big = 0;
            for (uint32_t r = 0; r < world; r++) {
                uint32_t v = step->xrecv_block[(size_t)r * (size_t)block + 1 + per_rank];
                if (v > big) big = v;
            }
            memcpy(&step->scale, &big, sizeof big);
        }
    }
    counts_ns = epd_now_ns() - counts_begin;
    /* the transport reads send_buf: pack must be complete first, unless no record leaves or
     * reaches this rank (one rank: the experts and the combine follow the pack on the stream) */
    bool moves = false;
    for (uint32_t r = 0; r < world; r++)
        if (r != me && (step->layout.send_counts_host[r] != 0 || step->recv_counts32[r] != 0))
            moves = true;
    if (moves || !ops_async(step)) {
        status = ops->sync(octx);
        if (status != EPD_OK) return op_failed(step, status, "sync after pack", err);
    }
    t[2] = epd_now_ns();
    t[1] = t[2] - counts_ns;
    for (uint32_t r = 0; r < world; r++) {
        step->send_counts[r] = step->layout.send_counts_host[r];
        step->send_displs[r] = step->layout.send_offsets_host[r];
        step->recv_counts[r] = step->recv_counts32[r];
        step->recv_displs[r] = n_recv;
        n_recv += step->recv_counts32[r];
    }
    if (n_recv > step->recv_capacity) {
        /* only when peers run a larger max_tokens than this rank: configs differ */
        snprintf(
            err, EPD_ERR_LEN,
            "step: peers send %llu records but this rank holds %zu (max tokens per step differs "
            "between ranks?)",
            (unsigned long long)n_recv, step->recv_capacity);
        return EPD_ERR_INTERNAL;
    }

    /* 3. dispatch: only the records for other ranks travel; this rank's own stay in send_buf
     * (their block of recv_buf is left unused) */
    memcpy(step->xsend_counts, step->send_counts, world * sizeof *step->xsend_counts);
    memcpy(step->xrecv_counts, step->recv_counts, world * sizeof *step->xrecv_counts);
    step->xsend_counts[me] = 0;
    step->xrecv_counts[me] = 0;
    /* one rank has no peer: nothing to exchange (a transport call would only cost its launch) */
    status = world == 1 ? EPD_OK
                        : step->transport->alltoallv(step->transport_ctx, step->send_buf,
                                                     step->xsend_counts, step->send_displs,
                                                     step->recv_buf, step->xrecv_counts,
                                                     step->recv_displs, step->record.size);
    if (status != EPD_OK) return transport_failed(step, status, "dispatch", err);

    /* 4. experts on the records from other ranks: the blocks before and after this rank's own */
    t[3] = epd_now_ns();
    if (step->experts_hook != NULL) {
        /* all records at once, this rank's own included (sync: the hook reads the records) */
        if (ops_async(step)) {
            status = ops->sync(octx);
            if (status != EPD_OK) return op_failed(step, status, "sync before experts", err);
        }
        status = run_experts_hook(step, n_recv, err);
        if (status != EPD_OK) return status;
    } else {
        uint64_t own_first = step->recv_displs[me], after = own_first + step->recv_counts[me];
        status = run_experts(step, step->recv_buf, 0, own_first, 0, me, step->partials);
        if (status == EPD_OK)
            status = run_experts(step, step->recv_buf, after, n_recv - after, me + 1, world,
                                 step->partials);
        /* ops without a stream (host) run synchronously: nothing would overlap the combine */
        if (status == EPD_OK && !ops_async(step))
            status = run_experts(step, step->send_buf, step->send_displs[me],
                                 step->send_counts[me], me, me + 1, step->partials_back);
    }
    if (status != EPD_OK) return op_failed(step, status, "experts", err);
    if (moves || !ops_async(step)) {
        status = ops->sync(octx);
        if (status != EPD_OK) return op_failed(step, status, "sync after experts", err);
    }

    /* 5. the partials go back to their ranks along the reverse of the dispatch while the experts
     * run on this rank's own records, from send_buf straight into their rows of partials_back
     * (queued on the ops stream; the transports do not wait for it). Host ops did them above. */
    t[4] = epd_now_ns();
    if (ops_async(step) && step->experts_hook == NULL) {
        status = run_experts(step, step->send_buf, step->send_displs[me], step->send_counts[me],
                             me, me + 1, step->partials_back);
        if (status != EPD_OK) return op_failed(step, status, "experts", err);
    }
    status = world == 1 ? EPD_OK
                        : step->transport->alltoallv(step->transport_ctx, step->partials,
                                                     step->xrecv_counts, step->recv_displs,
                                                     step->partials_back, step->xsend_counts,
                                                     step->send_displs, row_bytes);
    if (status != EPD_OK) return transport_failed(step, status, "combine", err);

    /* 6. combine into y */
    t[5] = epd_now_ns();
    status = ops->combine(octx, shape, &step->layout, step->partials_back, y);
    if (status != EPD_OK) return op_failed(step, status, "combine", err);
    status = ops->sync(octx);
    if (status != EPD_OK) return op_failed(step, status, "sync after combine", err);
    t[6] = epd_now_ns();
    /* the telemetry sums of this step (pack and experts have finished): a few bytes back */
    memset(&qerr, 0, sizeof qerr);
    if (shape->quant_error && ops->quant_error_take != NULL) {
        status = ops->quant_error_take(octx, &qerr);
        if (status != EPD_OK) return op_failed(step, status, "quantization error telemetry", err);
    }

    if (timing_p != NULL) {
        epd_step_timing_t tm;
        memset(&tm, 0, sizeof tm);
        for (int i = 0; i < EPD_PHASE_MAX; i++) tm.phase_ns[i] = t[i + 1] - t[i];
        tm.total_ns = t[EPD_PHASE_MAX] - t[0];
        tm.n_tokens = n_tokens;
        tm.records_sent = step->layout.n_send;
        tm.records_sent_off_rank = step->layout.n_send - step->layout.send_counts_host[me];
        tm.records_recv = (uint32_t)n_recv;
        tm.records_recv_off_rank = (uint32_t)n_recv - step->recv_counts32[me];
        tm.dispatch_bytes = (uint64_t)tm.records_sent * step->record.size;
        tm.dispatch_bytes_off_rank = (uint64_t)tm.records_sent_off_rank * step->record.size;
        tm.combine_bytes = (uint64_t)tm.records_recv * row_bytes;
        tm.combine_bytes_off_rank = (uint64_t)tm.records_recv_off_rank * row_bytes;
        tm.quant_error = qerr;
        tm.n_local = shape->num_experts / world;
        tm.local_first = me * tm.n_local;
        tm.local_expert_rows = step->local_rows;
        tm.expert_tokens = step->layout.expert_counts_host;
        *timing_p = tm;
    }
    return EPD_OK;
}
