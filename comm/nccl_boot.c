/* NCCL glue (comm/nccl_boot.h): communicator bootstrap over MPI, the grouped send/recv
 * alltoallv on a stream of its own, teardown. The only file of epd that includes nccl.h, and the
 * only one outside gpu/ that includes a CUDA header (NCCL's API takes a cudaStream_t). */
#include "comm/nccl_boot.h"
#include "common/mpi_error.h"

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

struct epd_nccl {
    ncclComm_t comm;
    /* The transfers run on their own stream, of the highest priority, on the ops stream's
     * device: kernels the caller queued on the ops stream (the step's experts on its own records)
     * run beside them instead of delaying them. Callers make the send buffer complete first. */
    cudaStream_t stream;
    int device;
    int rank;
    int world;
};

static epd_status_t cuda_status(cudaError_t rc, const char *what, char err[EPD_ERR_LEN])
{
    if (rc == cudaSuccess) return EPD_OK;
    snprintf(err, EPD_ERR_LEN, "%s: %s", what, cudaGetErrorString(rc));
    return EPD_ERR_CUDA;
}

static epd_status_t nccl_status(ncclResult_t rc, const char *what, char err[EPD_ERR_LEN])
{
    if (rc == ncclSuccess) return EPD_OK;
    snprintf(err, EPD_ERR_LEN, "%s: %s", what, ncclGetErrorString(rc));
    return EPD_ERR_NCCL;
}

static epd_status_t mpi_status(int rc, const char *what, char err[EPD_ERR_LEN])
{
    char msg[MPI_MAX_ERROR_STRING];

    if (rc == MPI_SUCCESS) return EPD_OK;
    snprintf(err, EPD_ERR_LEN, "%s: %.200s", what, epd_mpi_error_text(rc, msg));
    return EPD_ERR_MPI;
}

epd_status_t epd_nccl_create(MPI_Comm comm, void *stream, epd_nccl_t **nccl_p,
                             char err[EPD_ERR_LEN])
{
    epd_status_t status;
    ncclUniqueId id;
    epd_nccl_t *nccl;

    *nccl_p = NULL;
    nccl = calloc(1, sizeof *nccl);
    if (nccl == NULL) {
        snprintf(err, EPD_ERR_LEN, "out of memory for the NCCL context");
        return EPD_ERR_NO_MEMORY;
    }
    CHECK_GOTO(mpi_status(MPI_Comm_rank(comm, &nccl->rank), "MPI_Comm_rank", err), err_free);
    CHECK_GOTO(mpi_status(MPI_Comm_size(comm, &nccl->world), "MPI_Comm_size", err), err_free);
    CHECK_GOTO(cuda_status(cudaStreamGetDevice((cudaStream_t)stream, &nccl->device),
                           "cudaStreamGetDevice of the ops stream", err), err_free);
    CHECK_GOTO(cuda_status(cudaSetDevice(nccl->device), "cudaSetDevice", err), err_free);
    int least = 0, greatest = 0;
    CHECK_GOTO(cuda_status(cudaDeviceGetStreamPriorityRange(&least, &greatest),
                           "cudaDeviceGetStreamPriorityRange", err), err_free);
    CHECK_GOTO(cuda_status(cudaStreamCreateWithPriority(&nccl->stream, cudaStreamNonBlocking,
                                                        greatest),
                           "cudaStreamCreateWithPriority", err), err_free);

    /* Every rank reaches the MPI_Bcast even when rank 0's ncclGetUniqueId failed, so nobody
     * hangs: rank 0 then sends a zeroed id and a flag. */
    struct {
        ncclUniqueId id;
        int ok;
    } boot = { .ok = 1 };
    char id_err[EPD_ERR_LEN] = "";
    if (nccl->rank == 0 && nccl_status(ncclGetUniqueId(&boot.id), "ncclGetUniqueId", id_err) != EPD_OK)
        boot.ok = 0;
    CHECK_GOTO(mpi_status(MPI_Bcast(&boot, (int)sizeof boot, MPI_BYTE, 0, comm),
                          "MPI_Bcast of the NCCL unique id", err), err_free);
    if (!boot.ok) {
        if (nccl->rank == 0)
            snprintf(err, EPD_ERR_LEN, "%.250s", id_err);
        else
            snprintf(err, EPD_ERR_LEN, "rank 0 could not create the NCCL unique id");
        status = EPD_ERR_NCCL;
        goto err_free;
    }
    id = boot.id;
    CHECK_GOTO(nccl_status(ncclCommInitRank(&nccl->comm, nccl->world, id, nccl->rank),
                           "ncclCommInitRank", err), err_free);
    *nccl_p = nccl;
    return EPD_OK;

err_free:
    if (nccl->stream != NULL) cudaStreamDestroy(nccl->stream);
    free(nccl);
    return status;
}

/* Waits for the stream while watching the communicator: a peer's failure shows as an async
 * NCCL error instead of a hang in cudaStreamSynchronize. */
static epd_status_t stream_wait(epd_nccl_t *nccl, char err[EPD_ERR_LEN])
{
    for (;;) {
        cudaError_t rc = cudaStreamQuery(nccl->stream);
        if (rc == cudaSuccess) return EPD_OK;
        if (rc != cudaErrorNotReady) return cuda_status(rc, "waiting for the NCCL alltoallv", err);
        ncclResult_t async_rc = ncclSuccess;
        epd_status_t status = nccl_status(ncclCommGetAsyncError(nccl->comm, &async_rc),
                                          "ncclCommGetAsyncError", err);
        if (status != EPD_OK) return status;
        if (async_rc != ncclSuccess && async_rc != ncclInProgress)
            return nccl_status(async_rc, "NCCL alltoallv failed", err);
        sched_yield();
    }
}

epd_status_t epd_nccl_alltoallv(epd_nccl_t *nccl, const void *send, const uint64_t *send_counts,
                                const uint64_t *send_displs, void *recv,
                                const uint64_t *recv_counts, const uint64_t *recv_displs,
                                size_t item_bytes, char err[EPD_ERR_LEN])
{
    epd_status_t status = EPD_OK;
    epd_status_t end_status;
    char end_err[EPD_ERR_LEN];
    const char *sbase = send;
    char *rbase = recv;
    int me = nccl->rank;

    for (int p = 0; p < nccl->world; p++) {
        if (send_counts[p] > SIZE_MAX / item_bytes || recv_counts[p] > SIZE_MAX / item_bytes ||
            send_displs[p] > SIZE_MAX / item_bytes || recv_displs[p] > SIZE_MAX / item_bytes) {
            snprintf(err, EPD_ERR_LEN, "alltoallv: counts for rank %d overflow (item %zu bytes)", p,
                     item_bytes);
            return EPD_ERR_INVALID_ARG;
        }
    }
    CHECK_GOTO(cuda_status(cudaSetDevice(nccl->device), "cudaSetDevice", err), out);
    /* The self block is a device copy on the same stream; NCCL moves the others. */
    if (send_counts[me] != recv_counts[me]) {
        snprintf(err, EPD_ERR_LEN, "alltoallv: rank %d sends itself %llu items but expects %llu",
                 me, (unsigned long long)send_counts[me], (unsigned long long)recv_counts[me]);
        return EPD_ERR_INVALID_ARG;
    }
    if (send_counts[me] > 0)
        CHECK_GOTO(cuda_status(cudaMemcpyAsync(rbase + recv_displs[me] * item_bytes,
                                               sbase + send_displs[me] * item_bytes,
                                               send_counts[me] * item_bytes,
                                               cudaMemcpyDeviceToDevice, nccl->stream),
                               "cudaMemcpyAsync (self block)", err), out);

    CHECK_GOTO(nccl_status(ncclGroupStart(), "ncclGroupStart", err), out);
    for (int i = 1; i < nccl->world && status == EPD_OK; i++) {
        /* peers in a ring order starting after me, so rank pairs meet evenly */
        int to = (me + i) % nccl->world, from = (me - i + nccl->world) % nccl->world;
        if (send_counts[to] > 0)
            status = nccl_status(ncclSend(sbase + send_displs[to] * item_bytes,
                                          send_counts[to] * item_bytes, ncclUint8, to, nccl->comm,
                                          nccl->stream), "ncclSend", err);
        if (status == EPD_OK && recv_counts[from] > 0)
            status = nccl_status(ncclRecv(rbase + recv_displs[from] * item_bytes,
                                          recv_counts[from] * item_bytes, ncclUint8, from,
                                          nccl->comm, nccl->stream), "ncclRecv", err);
    }
    /* the group is always closed, also after a failed enqueue (whose message is kept) */
    end_status = nccl_status(ncclGroupEnd(), "ncclGroupEnd", status == EPD_OK ? err : end_err);
    if (status == EPD_OK) status = end_status;
    if (status != EPD_OK) goto out;
    CHECK_GOTO(stream_wait(nccl, err), out);
out:
    return status;
}

void epd_nccl_destroy(epd_nccl_t *nccl)
{
    if (nccl == NULL) return;
    if (cudaSetDevice(nccl->device) == cudaSuccess) {
        if (nccl->comm != NULL) {
            if (ncclCommFinalize(nccl->comm) == ncclSuccess) {
                ncclCommDestroy(nccl->comm);
            } else {
                ncclCommAbort(nccl->comm);
            }
        }
        if (nccl->stream != NULL) cudaStreamDestroy(nccl->stream);
    }
    free(nccl);
}
