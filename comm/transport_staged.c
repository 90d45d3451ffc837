/* The staged `mpi` transport: an alltoallv of ops (device) buffers over an MPI that cannot read
 * them. Each peer's bytes move in chunks: device -> pinned host copy (async, one event per chunk),
 * MPI_Isend as soon as that chunk's event completes, MPI_Irecv into pinned host, host -> device
 * copy as each chunk arrives; the self block is one device-to-device copy. So copies in both
 * directions overlap the network. All device work goes through the ops' optional hooks. */
#include "comm/transport_staged.h"

#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/mpi_error.h"
#include "common/parse.h"

#define TAG_SPAN 32768 /* MPI guarantees tags up to 32767; chunk c uses tag c % TAG_SPAN */

/* One chunk on its way: a peer, where it lies in the device buffer and in pinned host memory. */
typedef struct chunk {
    int peer;
    int tag;
    int bytes;
    size_t ops_off;  /* from the device buffer's start */
    size_t host_off; /* from the staging buffer's start */
} chunk_t;

struct epd_transport_ctx {
    MPI_Comm comm;
    int rank;
    int world;
    const epd_ops_t *ops;
    epd_ops_ctx_t *ops_ctx;
    size_t chunk_bytes;

    uint8_t *host_send; /* pinned staging, grown on demand */
    uint8_t *host_recv;
    size_t host_send_cap;
    size_t host_recv_cap;

    chunk_t *sends; /* chunk lists and their requests / events, grown on demand */
    chunk_t *recvs;
    size_t sends_cap;
    size_t recvs_cap;
    MPI_Request *send_reqs;
    MPI_Request *recv_reqs;
    int *done_idx;
    epd_ops_event_t **events; /* one per send chunk */
    size_t n_events;
    epd_ops_event_t *up_done; /* after the last host -> device copy */

    size_t *send_host_off; /* [world] staging offsets per peer */
    size_t *recv_host_off;
    char err[EPD_ERR_LEN];
};

/* Device buffers, whatever MPI says (it never sees them): it works everywhere but costs dearly on
 * NVLink machines, so the reason says so and how to get the direct path. */
static bool staged_can_use(const epd_transport_job_t *job, char why[EPD_ERR_LEN])
{
    char grounds[EPD_ERR_LEN];

    if (!job->device_memory) {
        snprintf(why, EPD_ERR_LEN, "mpi-staged: the ops memory is host memory, nothing to stage");
        return false;
    }
    epd_mpi_cuda_direct(job, grounds);
    snprintf(why, EPD_ERR_LEN,
             "mpi-staged (%.80s): staging through pinned host memory, ~100x slower than direct on "
             "NVLink; for the direct path build a CUDA-aware MPI: scripts/cuda-mpi.sh, make "
             "MPI_HOME=<prefix>",
             grounds);
    return true;
}

static const char *staged_last_error(const epd_transport_ctx_t *ctx)
{
    return ctx == NULL ? "" : ctx->err;
}

static epd_status_t mpi_fail(epd_transport_ctx_t *ctx, const char *what, int rc)
{
    char text[MPI_MAX_ERROR_STRING];

    snprintf(ctx->err, EPD_ERR_LEN, "mpi-staged transport: %s failed: %.150s", what,
             epd_mpi_error_text(rc, text));
    return EPD_ERR_MPI;
}

/* A failed ops hook: keep the ops' own message when it has one. */
static epd_status_t ops_fail(epd_transport_ctx_t *ctx, const char *what, epd_status_t status)
{
    const char *why = ctx->ops->last_error != NULL ? ctx->ops->last_error(ctx->ops_ctx) : "";

    snprintf(ctx->err, EPD_ERR_LEN, "mpi-staged transport: %s: %s%s%.150s", what,
             epd_status_name(status), why[0] != '\0' ? ": " : "", why);
    return status;
}

static epd_status_t no_memory(epd_transport_ctx_t *ctx, const char *what)
{
    snprintf(ctx->err, EPD_ERR_LEN, "mpi-staged transport: out of memory for %s", what);
    return EPD_ERR_NO_MEMORY;
}

static void staged_fini(epd_transport_ctx_t *ctx)
{
    if (ctx == NULL) return;
    for (size_t i = 0; i < ctx->n_events; i++) ctx->ops->event_destroy(ctx->ops_ctx, ctx->events[i]);
    if (ctx->up_done != NULL) ctx->ops->event_destroy(ctx->ops_ctx, ctx->up_done);
    if (ctx->host_send != NULL) ctx->ops->free_host(ctx->ops_ctx, ctx->host_send);
    if (ctx->host_recv != NULL) ctx->ops->free_host(ctx->ops_ctx, ctx->host_recv);
    free(ctx->events);
    free(ctx->sends);
    free(ctx->recvs);
    free(ctx->send_reqs);
    free(ctx->recv_reqs);
    free(ctx->done_idx);
    free(ctx->send_host_off);
    free(ctx->recv_host_off);
    if (ctx->comm != MPI_COMM_NULL) MPI_Comm_free(&ctx->comm);
    free(ctx);
}

/* The chunk size: EPD_TEST_STAGED_CHUNK (bytes, 1 .. 1 GiB) or EPD_STAGED_CHUNK_BYTES. */
static epd_status_t chunk_size(size_t *bytes_p, char err[EPD_ERR_LEN])
{
    const char *env = getenv(EPD_STAGED_CHUNK_ENV);
    char why[EPD_ERR_LEN];
    uint64_t v;

    *bytes_p = EPD_STAGED_CHUNK_BYTES;
    if (env == NULL || env[0] == '\0') return EPD_OK;
    if (epd_parse_u64(env, 10, 1, EPD_STAGED_CHUNK_MAX, &v, why) != EPD_OK) {
        snprintf(err, EPD_ERR_LEN, "%s=%.40s: %.150s (bytes, 1 to %u)", EPD_STAGED_CHUNK_ENV, env,
                 why, EPD_STAGED_CHUNK_MAX);
        return EPD_ERR_CONFIG;
    }
    *bytes_p = (size_t)v;
    return EPD_OK;
}

/* Collective over comm. */
static epd_status_t staged_init(MPI_Comm comm, const epd_ops_t *ops, epd_ops_ctx_t *ops_ctx,
                                epd_transport_ctx_t **ctx_p, char err[EPD_ERR_LEN])
{
    epd_status_t status;
    epd_transport_ctx_t *ctx;
    size_t chunk;
    int rc;

    *ctx_p = NULL;
    if (ops == NULL || ops->alloc_host == NULL || ops->free_host == NULL || ops->sync == NULL ||
        ops->event_create == NULL || ops->event_destroy == NULL || ops->event_query == NULL ||
        ops->event_wait == NULL || ops->copy_to_host_async == NULL ||
        ops->copy_to_ops_async == NULL || ops->copy_ops_to_ops_async == NULL) {
        snprintf(err, EPD_ERR_LEN,
                 "mpi-staged transport: the %s ops have no async copies and events to stage with",
                 ops == NULL ? "(none)" : ops->name);
        return EPD_ERR_UNSUPPORTED;
    }
    CHECK_GOTO(chunk_size(&chunk, err), out);
    ctx = calloc(1, sizeof *ctx);
    if (ctx == NULL) {
        snprintf(err, EPD_ERR_LEN, "mpi-staged transport: out of memory");
        return EPD_ERR_NO_MEMORY;
    }
    ctx->comm = MPI_COMM_NULL;
    ctx->ops = ops;
    ctx->ops_ctx = ops_ctx;
    ctx->chunk_bytes = chunk;
    rc = MPI_Comm_dup(comm, &ctx->comm);
    if (rc != MPI_SUCCESS) {
        ctx->comm = MPI_COMM_NULL;
        status = mpi_fail(ctx, "MPI_Comm_dup", rc);
        goto err_ctx;
    }
    MPI_Comm_rank(ctx->comm, &ctx->rank);
    MPI_Comm_size(ctx->comm, &ctx->world);
    ctx->send_host_off = calloc((size_t)ctx->world, sizeof *ctx->send_host_off);
    ctx->recv_host_off = calloc((size_t)ctx->world, sizeof *ctx->recv_host_off);
    if (ctx->send_host_off == NULL || ctx->recv_host_off == NULL) {
        status = no_memory(ctx, "peer offsets");
        goto err_ctx;
    }
    status = ops->event_create(ops_ctx, &ctx->up_done);
    if (status != EPD_OK) {
        ctx->up_done = NULL;
        ops_fail(ctx, "event_create", status);
        goto err_ctx;
    }
    *ctx_p = ctx;
    return EPD_OK;

err_ctx:
    snprintf(err, EPD_ERR_LEN, "%s", ctx->err);
    staged_fini(ctx);
out:
    return status;
}

/* Grows *buf (element size elem) to hold n; keeps the contents. */
static bool grow(void **buf, size_t *cap, size_t n, size_t elem)
{
    size_t want;
    void *p;

    if (n <= *cap) return true;
    want = *cap < 16 ? 16 : *cap;
    while (want < n) want *= 2;
    if (want > SIZE_MAX / elem) return false;
    p = realloc(*buf, want * elem);
    if (p == NULL) return false;
    *buf = p;
    *cap = want;
    return true;
}

/* Pinned staging of at least bytes (old contents dropped). */
static epd_status_t grow_host(epd_transport_ctx_t *ctx, uint8_t **buf, size_t *cap, size_t bytes)
{
    size_t want;
    uint8_t *p;

    if (bytes <= *cap && *buf != NULL) return EPD_OK;
    want = bytes + bytes / 4; /* headroom: steps vary a little in size */
    if (want < bytes) want = bytes;
    if (*buf != NULL) ctx->ops->free_host(ctx->ops_ctx, *buf);
    *buf = NULL;
    *cap = 0;
    p = ctx->ops->alloc_host(ctx->ops_ctx, want);
    if (p == NULL) {
        snprintf(ctx->err, EPD_ERR_LEN, "mpi-staged transport: cannot pin %zu bytes of host memory",
                 want);
        return EPD_ERR_NO_MEMORY;
    }
    *buf = p;
    *cap = want;
    return EPD_OK;
}

/* Lists the chunks of the peers' ranges: round-robin over peers (starting after this rank) so
 * every peer's first chunk goes early. offs are staging offsets per peer; bytes per peer. */
static size_t list_chunks(const epd_transport_ctx_t *ctx, const size_t *bytes, const size_t *offs,
                          const uint64_t *displs, size_t item_bytes, chunk_t *out)
{
    size_t n = 0, chunk = ctx->chunk_bytes;
    bool more = true;

    for (size_t c = 0; more; c++) {
        more = false;
        for (int i = 1; i < ctx->world; i++) {
            int p = (ctx->rank + i) % ctx->world;
            size_t start = c * chunk;
            if (start >= bytes[p]) continue;
            size_t len = bytes[p] - start < chunk ? bytes[p] - start : chunk;
            out[n].peer = p;
            out[n].tag = (int)(c % TAG_SPAN);
            out[n].bytes = (int)len;
            out[n].ops_off = (size_t)displs[p] * item_bytes + start;
            out[n].host_off = offs[p] + start;
            n++;
            if (start + len < bytes[p]) more = true;
        }
    }
    return n;
}

static size_t count_chunks(const size_t *bytes, int world, int me, size_t chunk)
{
    size_t n = 0;
    for (int p = 0; p < world; p++)
        if (p != me) n += (bytes[p] + chunk - 1) / chunk;
    return n;
}

/* Checks a peer's count and displacement and turns them into bytes. */
static epd_status_t peer_bytes(epd_transport_ctx_t *ctx, const char *dir, int p, uint64_t count,
                               uint64_t displ, size_t item_bytes, size_t *bytes_p)
{
    if (count > SIZE_MAX / item_bytes || displ > SIZE_MAX / item_bytes ||
        count * item_bytes > SIZE_MAX - displ * item_bytes) {
        snprintf(ctx->err, EPD_ERR_LEN,
                 "mpi-staged transport: %s count %llu at %llu for rank %d overflows (item %zu bytes)",
                 dir, (unsigned long long)count, (unsigned long long)displ, p, item_bytes);
        return EPD_ERR_INVALID_ARG;
    }
    *bytes_p = (size_t)count * item_bytes;
    return EPD_OK;
}

static epd_status_t staged_alltoallv(epd_transport_ctx_t *ctx, const void *send,
                                     const uint64_t *send_counts, const uint64_t *send_displs,
                                     void *recv, const uint64_t *recv_counts,
                                     const uint64_t *recv_displs, size_t item_bytes)
{
    epd_status_t status = EPD_OK;
    const epd_ops_t *ops;
    const int me = ctx == NULL ? 0 : ctx->rank;
    size_t *sbytes = NULL, *rbytes = NULL;
    size_t total_s = 0, total_r = 0, n_sends, n_recvs, sent = 0, arrived = 0, posted_recvs = 0;
    size_t posted_sends = 0;
    int rc;

    if (ctx == NULL) return EPD_ERR_INVALID_ARG;
    ops = ctx->ops;
    ctx->err[0] = '\0';
    if (send_counts == NULL || send_displs == NULL || recv_counts == NULL || recv_displs == NULL ||
        item_bytes == 0) {
        snprintf(ctx->err, EPD_ERR_LEN, "mpi-staged transport: missing counts or a zero item size");
        return EPD_ERR_INVALID_ARG;
    }
    sbytes = calloc((size_t)ctx->world * 2, sizeof *sbytes);
    if (sbytes == NULL) return no_memory(ctx, "peer sizes");
    rbytes = sbytes + ctx->world;

    for (int p = 0; p < ctx->world; p++) {
        CHECK_GOTO(peer_bytes(ctx, "send", p, send_counts[p], send_displs[p], item_bytes, &sbytes[p]),
                   out);
        CHECK_GOTO(peer_bytes(ctx, "recv", p, recv_counts[p], recv_displs[p], item_bytes, &rbytes[p]),
                   out);
        if (p == me) continue;
        ctx->send_host_off[p] = total_s;
        ctx->recv_host_off[p] = total_r;
        total_s += sbytes[p];
        total_r += rbytes[p];
    }
    if (sbytes[me] != rbytes[me]) {
        snprintf(ctx->err, EPD_ERR_LEN,
                 "mpi-staged transport: rank %d sends itself %zu bytes but expects %zu", me,
                 sbytes[me], rbytes[me]);
        status = EPD_ERR_INVALID_ARG;
        goto out;
    }
    if ((total_s > 0 || sbytes[me] > 0) && send == NULL) {
        snprintf(ctx->err, EPD_ERR_LEN, "mpi-staged transport: NULL send buffer");
        status = EPD_ERR_INVALID_ARG;
        goto out;
    }
    if ((total_r > 0 || rbytes[me] > 0) && recv == NULL) {
        snprintf(ctx->err, EPD_ERR_LEN, "mpi-staged transport: NULL receive buffer");
        status = EPD_ERR_INVALID_ARG;
        goto out;
    }

    /* room for this call's chunks, requests and events */
    n_sends = count_chunks(sbytes, ctx->world, me, ctx->chunk_bytes);
    n_recvs = count_chunks(rbytes, ctx->world, me, ctx->chunk_bytes);
    if (n_sends > INT_MAX || n_recvs > INT_MAX) {
        snprintf(ctx->err, EPD_ERR_LEN, "mpi-staged transport: too many chunks (%zu, %zu)", n_sends,
                 n_recvs);
        status = EPD_ERR_INVALID_ARG;
        goto out;
    }
    {
        size_t cap = ctx->sends_cap;
        if (!grow((void **)&ctx->sends, &cap, n_sends, sizeof *ctx->sends)) goto err_memory;
        cap = ctx->sends_cap;
        if (!grow((void **)&ctx->send_reqs, &cap, n_sends, sizeof *ctx->send_reqs)) goto err_memory;
        cap = ctx->sends_cap;
        if (!grow((void **)&ctx->events, &cap, n_sends, sizeof *ctx->events)) goto err_memory;
        ctx->sends_cap = cap;
        cap = ctx->recvs_cap;
        if (!grow((void **)&ctx->recvs, &cap, n_recvs, sizeof *ctx->recvs)) goto err_memory;
        cap = ctx->recvs_cap;
        if (!grow((void **)&ctx->recv_reqs, &cap, n_recvs, sizeof *ctx->recv_reqs)) goto err_memory;
        cap = ctx->recvs_cap;
        if (!grow((void **)&ctx->done_idx, &cap, n_recvs, sizeof *ctx->done_idx)) goto err_memory;
        ctx->recvs_cap = cap;
    }
    while (ctx->n_events < n_sends) {
        status = ops->event_create(ctx->ops_ctx, &ctx->events[ctx->n_events]);
        if (status != EPD_OK) {
            ops_fail(ctx, "event_create", status);
            goto out;
        }
        ctx->n_events++;
    }
    CHECK_GOTO(grow_host(ctx, &ctx->host_send, &ctx->host_send_cap, total_s), out);
    CHECK_GOTO(grow_host(ctx, &ctx->host_recv, &ctx->host_recv_cap, total_r), out);
    list_chunks(ctx, sbytes, ctx->send_host_off, send_displs, item_bytes, ctx->sends);
    list_chunks(ctx, rbytes, ctx->recv_host_off, recv_displs, item_bytes, ctx->recvs);

    /* the send buffer is final once the ops' stream is (the async copies do not wait for it) */
    status = ops->sync(ctx->ops_ctx);
    if (status != EPD_OK) {
        ops_fail(ctx, "sync before staging", status);
        goto out;
    }

    /* receives first, so early chunks find them posted */
    for (; posted_recvs < n_recvs; posted_recvs++) {
        const chunk_t *c = &ctx->recvs[posted_recvs];
        rc = MPI_Irecv(ctx->host_recv + c->host_off, c->bytes, MPI_BYTE, c->peer, c->tag, ctx->comm,
                       &ctx->recv_reqs[posted_recvs]);
        if (rc != MPI_SUCCESS) {
            status = mpi_fail(ctx, "MPI_Irecv", rc);
            goto err_requests;
        }
    }
    /* every device -> host copy queued at once (they run back to back), each with its event */
    for (size_t i = 0; i < n_sends; i++) {
        const chunk_t *c = &ctx->sends[i];
        status = ops->copy_to_host_async(ctx->ops_ctx, ctx->host_send + c->host_off,
                                         (const uint8_t *)send + c->ops_off, (size_t)c->bytes,
                                         ctx->events[i]);
        if (status != EPD_OK) {
            ops_fail(ctx, "copy_to_host_async", status);
            goto err_requests;
        }
    }
    if (sbytes[me] > 0) {
        status = ops->copy_ops_to_ops_async(ctx->ops_ctx,
                                            (uint8_t *)recv + (size_t)recv_displs[me] * item_bytes,
                                            (const uint8_t *)send + (size_t)send_displs[me] * item_bytes,
                                            sbytes[me], NULL);
        if (status != EPD_OK) {
            ops_fail(ctx, "copy_ops_to_ops_async (self block)", status);
            goto err_requests;
        }
    }

    /* send each chunk once its copy is done (in order: one copy queue), start the copy of each
     * chunk that arrives */
    while (sent < n_sends || arrived < n_recvs) {
        size_t progress = sent + arrived;
        while (sent < n_sends) {
            status = ops->event_query(ctx->ops_ctx, ctx->events[sent]);
            if (status == EPD_ERR_AGAIN) break;
            if (status != EPD_OK) {
                ops_fail(ctx, "event_query", status);
                goto err_requests;
            }
            const chunk_t *c = &ctx->sends[sent];
            rc = MPI_Isend(ctx->host_send + c->host_off, c->bytes, MPI_BYTE, c->peer, c->tag,
                           ctx->comm, &ctx->send_reqs[sent]);
            if (rc != MPI_SUCCESS) {
                status = mpi_fail(ctx, "MPI_Isend", rc);
                goto err_requests;
            }
            sent++;
            posted_sends = sent;
        }
        status = EPD_OK;
        if (arrived < n_recvs) {
            int n_done = 0;
            rc = MPI_Testsome((int)n_recvs, ctx->recv_reqs, &n_done, ctx->done_idx,
                              MPI_STATUSES_IGNORE);
            if (rc != MPI_SUCCESS) {
                status = mpi_fail(ctx, "MPI_Testsome", rc);
                goto err_requests;
            }
            for (int j = 0; j < n_done && n_done != MPI_UNDEFINED; j++) {
                const chunk_t *c = &ctx->recvs[ctx->done_idx[j]];
                status = ops->copy_to_ops_async(ctx->ops_ctx, (uint8_t *)recv + c->ops_off,
                                                ctx->host_recv + c->host_off, (size_t)c->bytes,
                                                NULL);
                if (status != EPD_OK) {
                    ops_fail(ctx, "copy_to_ops_async", status);
                    goto err_requests;
                }
                arrived++;
            }
        }
        /* nothing moved: let a peer or the copy engine's completion thread run (oversubscribed
         * ranks otherwise spin against each other) */
        if (sent + arrived == progress) sched_yield();
    }
    rc = MPI_Waitall((int)n_sends, ctx->send_reqs, MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) {
        status = mpi_fail(ctx, "MPI_Waitall of the sends", rc);
        goto out;
    }
    /* the host -> device copies and the self copy share one queue: an event after them all */
    status = ops->copy_ops_to_ops_async(ctx->ops_ctx, NULL, NULL, 0, ctx->up_done);
    if (status == EPD_OK) status = ops->event_wait(ctx->ops_ctx, ctx->up_done);
    if (status != EPD_OK) ops_fail(ctx, "waiting for the host to device copies", status);
    goto out;

err_requests:
    /* The job aborts on a transport error (DESIGN.md section 8); still, leave no request behind
     * pointing into buffers the caller may free. */
    for (size_t i = 0; i < posted_recvs; i++) {
        if (ctx->recv_reqs[i] != MPI_REQUEST_NULL) {
            MPI_Cancel(&ctx->recv_reqs[i]);
            MPI_Request_free(&ctx->recv_reqs[i]);
        }
    }
    for (size_t i = 0; i < posted_sends; i++)
        if (ctx->send_reqs[i] != MPI_REQUEST_NULL) MPI_Request_free(&ctx->send_reqs[i]);
    goto out;
err_memory:
    status = no_memory(ctx, "chunk lists");
out:
    free(sbytes);
    return status;
}

const epd_transport_t epd_transport_mpi_staged = {
    .name = "mpi-staged",
    .kind = EPD_TRANSPORT_MPI,
    .mpi_on_ops_memory = false,
    .raw_baseline = NULL,
    .can_use = staged_can_use,
    .init = staged_init,
    .fini = staged_fini,
    .alltoallv = staged_alltoallv,
    .last_error = staged_last_error,
};
