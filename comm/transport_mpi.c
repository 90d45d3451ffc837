/* The `mpi` transport: one MPI_Alltoallv on the buffers as they are (ops memory), on a private
 * duplicate of the step's communicator. Counts travel in items of a contiguous datatype of
 * item_bytes (cached per size), so a step of more than 2^31 bytes still has int counts. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/transport_mpi.h"
#include "common/mpi_error.h"

#define TYPE_CACHE 8

struct epd_transport_ctx {
    MPI_Comm comm;
    int world;
    int *counts[4]; /* send counts, send displs, recv counts, recv displs as ints */
    struct {
        size_t item_bytes;
        MPI_Datatype type;
    } types[TYPE_CACHE];
    int n_types;
    char err[EPD_ERR_LEN];
};

epd_status_t epd_mpi_counts_to_int(const uint64_t *counts, const uint64_t *displs, int n,
                                   int *counts_out, int *displs_out, char err[EPD_ERR_LEN])
{
    for (int r = 0; r < n; r++) {
        if (counts[r] > (uint64_t)INT_MAX) {
            snprintf(
                err, EPD_ERR_LEN,
                "alltoallv: %llu items for rank %d do not fit in an MPI int count (at most %d)",
                (unsigned long long)counts[r], r, INT_MAX);
            return EPD_ERR_INVALID_ARG;
        }
        if (displs[r] > (uint64_t)INT_MAX) {
            snprintf(err, EPD_ERR_LEN,
                     "alltoallv: displacement %llu items for rank %d does not fit in an MPI int "
                     "(at most %d)",
                     (unsigned long long)displs[r], r, INT_MAX);
            return EPD_ERR_INVALID_ARG;
        }
        counts_out[r] = (int)counts[r];
        displs_out[r] = (int)displs[r];
    }
    return EPD_OK;
}

/* Host buffers always; device buffers when MPI is handed them directly. */
static bool mpi_can_use(const epd_transport_job_t *job, char why[EPD_ERR_LEN])
{
    char grounds[EPD_ERR_LEN];

    if (!job->device_memory) {
        snprintf(why, EPD_ERR_LEN, "mpi: host buffers (CPU backend%s)",
                 job->requested == EPD_TRANSPORT_AUTO ? "; dispatch.transport = auto" : "");
        return true;
    }
    if (epd_mpi_cuda_direct(job, grounds)) {
        snprintf(why, EPD_ERR_LEN, "mpi: MPI_Alltoallv directly on device buffers (%.80s)",
                 grounds);
        return true;
    }
    snprintf(why, EPD_ERR_LEN, "mpi: no MPI_Alltoallv directly on device buffers (%.80s)", grounds);
    return false;
}

static const char *mpi_last_error(const epd_transport_ctx_t *ctx)
{
    return ctx == NULL ? "" : ctx->err;
}

static void mpi_error(epd_transport_ctx_t *ctx, const char *what, int rc)
{
    char text[MPI_MAX_ERROR_STRING];

    snprintf(ctx->err, EPD_ERR_LEN, "mpi transport: %s failed: %.200s", what,
             epd_mpi_error_text(rc, text));
}

static void mpi_fini(epd_transport_ctx_t *ctx)
{
    if (ctx == NULL) return;
    for (int i = 0; i < ctx->n_types; i++) MPI_Type_free(&ctx->types[i].type);
    if (ctx->comm != MPI_COMM_NULL) MPI_Comm_free(&ctx->comm);
    for (int i = 0; i < 4; i++) free(ctx->counts[i]);
    free(ctx);
}

/* Collective over comm (it duplicates it). */
static epd_status_t mpi_init(MPI_Comm comm, const epd_ops_t *ops, epd_ops_ctx_t *ops_ctx,
                             epd_transport_ctx_t **ctx_p, char err[EPD_ERR_LEN])
{
    epd_transport_ctx_t *ctx = calloc(1, sizeof *ctx);
    int rc;

    if (ctx == NULL) {
        snprintf(err, EPD_ERR_LEN, "mpi transport: out of memory");
        return EPD_ERR_NO_MEMORY;
    }
    ctx->comm = MPI_COMM_NULL;
    rc = MPI_Comm_dup(comm, &ctx->comm);
    if (rc != MPI_SUCCESS) {
        ctx->comm = MPI_COMM_NULL;
        mpi_error(ctx, "MPI_Comm_dup", rc);
        snprintf(err, EPD_ERR_LEN, "%s", ctx->err);
        mpi_fini(ctx);
        return EPD_ERR_MPI;
    }
    MPI_Comm_size(ctx->comm, &ctx->world);
    for (int i = 0; i < 4; i++) {
        ctx->counts[i] = calloc((size_t)ctx->world, sizeof(int));
        if (ctx->counts[i] == NULL) {
            snprintf(err, EPD_ERR_LEN, "mpi transport: out of memory");
            mpi_fini(ctx);
            return EPD_ERR_NO_MEMORY;
        }
    }
    *ctx_p = ctx;
    return EPD_OK;
}

/* The committed contiguous type of item_bytes bytes, made once per size. */
static epd_status_t item_type(epd_transport_ctx_t *ctx, size_t item_bytes, MPI_Datatype *type_p)
{
    MPI_Datatype type;
    int rc;

    for (int i = 0; i < ctx->n_types; i++) {
        if (ctx->types[i].item_bytes == item_bytes) {
            *type_p = ctx->types[i].type;
            return EPD_OK;
        }
    }
    if (item_bytes == 0 || item_bytes > (size_t)INT_MAX) {
        snprintf(ctx->err, EPD_ERR_LEN, "mpi transport: item of %zu bytes is not in [1, %d]",
                 item_bytes, INT_MAX);
        return EPD_ERR_INVALID_ARG;
    }
    rc = MPI_Type_contiguous((int)item_bytes, MPI_BYTE, &type);
    if (rc == MPI_SUCCESS) rc = MPI_Type_commit(&type);
    if (rc != MPI_SUCCESS) {
        mpi_error(ctx, "MPI_Type_contiguous", rc);
        return EPD_ERR_MPI;
    }
    if (ctx->n_types == TYPE_CACHE) {
        /* a step uses two sizes (records, partials); evict the oldest beyond a handful */
        MPI_Type_free(&ctx->types[0].type);
        memmove(&ctx->types[0], &ctx->types[1], (TYPE_CACHE - 1) * sizeof ctx->types[0]);
        ctx->n_types--;
    }
    ctx->types[ctx->n_types].item_bytes = item_bytes;
    ctx->types[ctx->n_types].type = type;
    ctx->n_types++;
    *type_p = type;
    return EPD_OK;
}

static epd_status_t mpi_alltoallv(epd_transport_ctx_t *ctx, const void *send,
                                  const uint64_t *send_counts, const uint64_t *send_displs,
                                  void *recv, const uint64_t *recv_counts,
                                  const uint64_t *recv_displs, size_t item_bytes)
{
    MPI_Datatype type;
    epd_status_t status = EPD_OK;
    int rc;

    if (ctx == NULL || send_counts == NULL || send_displs == NULL || recv_counts == NULL ||
        recv_displs == NULL)
        return EPD_ERR_INVALID_ARG;
    ctx->err[0] = '\0';
    CHECK_GOTO(item_type(ctx, item_bytes, &type), out);
    CHECK_GOTO(epd_mpi_counts_to_int(send_counts, send_displs, ctx->world, ctx->counts[0],
                                     ctx->counts[1], ctx->err),
               out);
    CHECK_GOTO(epd_mpi_counts_to_int(recv_counts, recv_displs, ctx->world, ctx->counts[2],
                                     ctx->counts[3], ctx->err),
               out);
    rc = MPI_Alltoallv(send, ctx->counts[0], ctx->counts[1], type, recv, ctx->counts[2],
                       ctx->counts[3], type, ctx->comm);
    if (rc != MPI_SUCCESS) {
        mpi_error(ctx, "MPI_Alltoallv", rc);
        status = EPD_ERR_MPI;
    }
out:
    return status;
}

const epd_transport_t epd_transport_mpi = {
    .name = "mpi",
    .kind = EPD_TRANSPORT_MPI,
    .mpi_on_ops_memory = true,
    .raw_baseline = NULL,
    .can_use = mpi_can_use,
    .init = mpi_init,
    .fini = mpi_fini,
    .alltoallv = mpi_alltoallv,
    .last_error = mpi_last_error,
};
