/* The `nccl` transport: a thin epd_transport_t over comm/nccl_boot.h (communicator per transport
 * context, alltoallv that returns complete). */
#include "comm/transport_nccl.h"

#include <stdio.h>
#include <stdlib.h>

#include "comm/nccl_boot.h"

struct epd_transport_ctx {
    epd_nccl_t *nccl;
    char err[EPD_ERR_LEN];
};

/* Device buffers only (NCCL cannot move host memory). */
static bool nccl_can_use(const epd_transport_job_t *job, char why[EPD_ERR_LEN])
{
    char grounds[EPD_ERR_LEN];

    if (!job->device_memory) {
        snprintf(why, EPD_ERR_LEN,
                 "dispatch.transport = nccl needs GPU buffers, but this rank runs the CPU backend; "
                 "use auto or mpi, or device.backend = cuda");
        return false;
    }
    if (job->requested != EPD_TRANSPORT_AUTO) {
        snprintf(why, EPD_ERR_LEN,
                 "nccl: grouped ncclSend/ncclRecv on device buffers (dispatch.transport = nccl)");
        return true;
    }
    bool direct = epd_mpi_cuda_direct(job, grounds);
    snprintf(why, EPD_ERR_LEN,
             "nccl: grouped ncclSend/ncclRecv on device buffers (dispatch.transport = auto, "
             "MPI %s: %.80s)",
             direct ? "CUDA-aware" : "not CUDA-aware", grounds);
    return true;
}

static const char *nccl_last_error(const epd_transport_ctx_t *ctx)
{
    return ctx == NULL ? "" : ctx->err;
}

/* Collective over comm. */
static epd_status_t nccl_init(MPI_Comm comm, const epd_ops_t *ops, epd_ops_ctx_t *ops_ctx,
                              epd_transport_ctx_t **ctx_p, char err[EPD_ERR_LEN])
{
    epd_status_t status;
    epd_transport_ctx_t *ctx;
    void *stream;

    *ctx_p = NULL;
    stream = ops != NULL && ops->stream != NULL ? ops->stream(ops_ctx) : NULL;
    if (stream == NULL) {
        /* every rank of a job runs the same ops, so all of them fail here together */
        snprintf(err, EPD_ERR_LEN, "nccl transport: the %s ops have no device stream (NCCL needs "
                 "device.backend = cuda)", ops == NULL ? "(none)" : ops->name);
        return EPD_ERR_UNSUPPORTED;
    }
    ctx = calloc(1, sizeof *ctx);
    if (ctx == NULL) {
        snprintf(err, EPD_ERR_LEN, "nccl transport: out of memory");
        return EPD_ERR_NO_MEMORY;
    }
    CHECK_GOTO(epd_nccl_create(comm, stream, &ctx->nccl, err), err_ctx);
    *ctx_p = ctx;
    return EPD_OK;

err_ctx:
    free(ctx);
    return status;
}

static void nccl_fini(epd_transport_ctx_t *ctx)
{
    if (ctx == NULL) return;
    epd_nccl_destroy(ctx->nccl);
    free(ctx);
}

static epd_status_t nccl_alltoallv(epd_transport_ctx_t *ctx, const void *send,
                                   const uint64_t *send_counts, const uint64_t *send_displs,
                                   void *recv, const uint64_t *recv_counts,
                                   const uint64_t *recv_displs, size_t item_bytes)
{
    if (ctx == NULL) return EPD_ERR_INVALID_ARG;
    ctx->err[0] = '\0';
    if (send_counts == NULL || send_displs == NULL || recv_counts == NULL || recv_displs == NULL ||
        item_bytes == 0) {
        snprintf(ctx->err, EPD_ERR_LEN, "nccl transport: missing counts or a zero item size");
        return EPD_ERR_INVALID_ARG;
    }
    return epd_nccl_alltoallv(ctx->nccl, send, send_counts, send_displs, recv, recv_counts,
                              recv_displs, item_bytes, ctx->err);
}

const epd_transport_t epd_transport_nccl = {
    .name = "nccl",
    .kind = EPD_TRANSPORT_NCCL,
    .mpi_on_ops_memory = false,
    .raw_baseline = "NCCL grouped ncclSend/ncclRecv on the device buffers",
    .can_use = nccl_can_use,
    .init = nccl_init,
    .fini = nccl_fini,
    .alltoallv = nccl_alltoallv,
    .last_error = nccl_last_error,
};
