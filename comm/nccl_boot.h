/* Plain-C glue around NCCL for comm/transport_nccl.c (DESIGN.md section 7): a communicator
 * bootstrapped over MPI and the grouped ncclSend/ncclRecv alltoallv on a stream of its own. Built
 * only with NCCL=1 (EPD_HAVE_NCCL); this header shows no NCCL or CUDA type to its callers. */
#ifndef EPD_COMM_NCCL_BOOT_H
#define EPD_COMM_NCCL_BOOT_H

#include <mpi.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct epd_nccl epd_nccl_t;

/* Creates an NCCL communicator over the ranks of comm (collective over comm): rank 0 makes the
 * ncclUniqueId, MPI_Bcast shares it, every rank joins on the device of `stream` (a cudaStream_t
 * as void *, the ops stream) and enqueues on a high-priority stream of its own there, so the
 * ops stream's kernels may run beside the transfers. Free with epd_nccl_destroy. */
epd_status_t epd_nccl_create(MPI_Comm comm, void *stream, epd_nccl_t **nccl_p,
                             char err[EPD_ERR_LEN]);

/* Alltoallv of bytes on device buffers: counts and displacements in items of item_bytes, one
 * ncclSend/ncclRecv pair per peer in one group, then waits for the stream, so recv is complete
 * and send may be reused when it returns. All ranks call it together. */
epd_status_t epd_nccl_alltoallv(epd_nccl_t *nccl, const void *send, const uint64_t *send_counts,
                                const uint64_t *send_displs, void *recv,
                                const uint64_t *recv_counts, const uint64_t *recv_displs,
                                size_t item_bytes, char err[EPD_ERR_LEN]);

/* Finalizes and destroys the communicator. NCCL makes this a collective among the ranks of a
 * node: every rank calls it at shutdown, after its last alltoallv. NULL is a no-op. */
void epd_nccl_destroy(epd_nccl_t *nccl);

#endif
