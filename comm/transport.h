/* Transports behind one interface (DESIGN.md section 7): the alltoallv of records between ranks,
 * on ops memory. `mpi` (direct on device buffers when MPI is CUDA-aware, pinned-host staging
 * otherwise) and `nccl` (grouped ncclSend/ncclRecv). The count exchange is not a transport's job:
 * the step engine does it with MPI_Alltoall before calling alltoallv. */
#ifndef EPD_COMM_TRANSPORT_H
#define EPD_COMM_TRANSPORT_H

#include <mpi.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "gpu/ops.h"

typedef struct epd_transport_ctx epd_transport_ctx_t;

typedef struct epd_transport {
    const char *name; /* "mpi", "mpi-staged", "nccl" */

    epd_status_t (*init)(MPI_Comm comm, const epd_ops_t *ops, epd_ops_ctx_t *ops_ctx,
                         epd_transport_ctx_t **ctx_p, char err[EPD_ERR_LEN]);
    void (*fini)(epd_transport_ctx_t *ctx);

    /* All ranks of comm call it together. Counts and displacements are in items of item_bytes;
     * send and recv are ops memory. Returns when recv is complete and send may be reused. */
    epd_status_t (*alltoallv)(epd_transport_ctx_t *ctx, const void *send, const uint64_t *send_counts,
                              const uint64_t *send_displs, void *recv, const uint64_t *recv_counts,
                              const uint64_t *recv_displs, size_t item_bytes);
} epd_transport_t;

#endif
