/* Transports behind one interface (DESIGN.md section 7): the alltoallv of records between ranks,
 * on ops memory, and the job each transport is asked about. `mpi` (direct on device buffers when
 * MPI is CUDA-aware, pinned-host staging otherwise) and `nccl` (grouped ncclSend/ncclRecv). The
 * count exchange is not a transport's job: the step engine does it with MPI_Alltoall before
 * calling alltoallv. A new transport is one epd_transport_t in its own comm/transport_<name>.c and
 * one entry in epd_transports[] (comm/registry.c), the registry `auto` walks. */
#ifndef EPD_COMM_TRANSPORT_H
#define EPD_COMM_TRANSPORT_H

#include <mpi.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "config/config.h"
#include "gpu/ops.h"

/* What MPI says about device buffers: MPIX_Query_cuda_support() where the MPI has it. */
typedef enum {
    EPD_MPI_CUDA_UNKNOWN = -1, /* no MPIX_Query_cuda_support in this MPI */
    EPD_MPI_CUDA_NO = 0,
    EPD_MPI_CUDA_YES = 1,
} epd_mpi_cuda_t;

/* What a rank runs, as a transport needs to know it to say whether it can serve the rank. */
typedef struct epd_transport_job {
    epd_transport_kind_t requested; /* dispatch.transport */
    epd_tristate_t mpi_cuda_aware;  /* dispatch.mpi_cuda_aware */
    bool device_memory;             /* the ops' memory is device memory (epd_ops_t.device_memory) */
    epd_mpi_cuda_t mpi_cuda;        /* what this MPI says about device buffers */
} epd_transport_job_t;

typedef struct epd_transport_ctx epd_transport_ctx_t;

typedef struct epd_transport {
    const char *name;          /* "mpi", "mpi-staged", "nccl" */
    epd_transport_kind_t kind; /* the dispatch.transport value that picks it: mpi or nccl */
    /* MPI is handed the ops buffers as they are: wherever this transport serves, a plain
     * MPI_Alltoallv may run on the step's own buffers. */
    bool mpi_on_ops_memory;
    /* When the transport's alltoallv is itself the raw library exchange a benchmark compares
     * against (DESIGN.md section 10), what that exchange is, as a phrase; NULL when the raw
     * baseline is a plain MPI_Alltoallv. */
    const char *raw_baseline;

    /* Whether it can serve job. Pure (no MPI, no device). why receives a sentence: the reason
     * it serves (the choice's reason) when true, why it cannot when false. */
    bool (*can_use)(const epd_transport_job_t *job, char why[EPD_ERR_LEN]);

    epd_status_t (*init)(MPI_Comm comm, const epd_ops_t *ops, epd_ops_ctx_t *ops_ctx,
                         epd_transport_ctx_t **ctx_p, char err[EPD_ERR_LEN]);
    void (*fini)(epd_transport_ctx_t *ctx);

    /* All ranks of comm call it together. Counts and displacements are in items of item_bytes;
     * send and recv are ops memory. Returns when recv is complete and send may be reused; on
     * failure last_error says why. */
    epd_status_t (*alltoallv)(epd_transport_ctx_t *ctx, const void *send, const uint64_t *send_counts,
                              const uint64_t *send_displs, void *recv, const uint64_t *recv_counts,
                              const uint64_t *recv_displs, size_t item_bytes);

    /* The sentence of the last failed call of ctx ("" when none, and for a NULL ctx); owned by
     * ctx, valid until its next call. */
    const char *(*last_error)(const epd_transport_ctx_t *ctx);
} epd_transport_t;

/* This MPI's answer (compile-time extension check, then the run-time query). */
epd_mpi_cuda_t epd_mpi_cuda_support(void);

/* How a sentence names that answer, e.g. "MPIX_Query_cuda_support() = 0". Static storage. */
const char *epd_mpi_cuda_name(epd_mpi_cuda_t mpi_cuda);

/* Whether MPI is handed this job's device buffers directly: dispatch.mpi_cuda_aware = true, or
 * auto and MPI says it is CUDA-aware. why receives the grounds (e.g. "dispatch.mpi_cuda_aware =
 * false", "MPIX_Query_cuda_support() = 1"). Pure. */
bool epd_mpi_cuda_direct(const epd_transport_job_t *job, char why[EPD_ERR_LEN]);

#endif
