/* The `nccl` transport (DESIGN.md section 7): the alltoallv as grouped ncclSend/ncclRecv on the
 * ops stream, its communicator bootstrapped over MPI. Linked only with NCCL=1 (EPD_HAVE_NCCL),
 * where the registry (comm/registry.c) lists it; the NCCL calls themselves live in
 * comm/nccl_boot.c, so this transport's own file includes no CUDA or NCCL header. */
#ifndef EPD_COMM_TRANSPORT_NCCL_H
#define EPD_COMM_TRANSPORT_NCCL_H

#include "comm/transport.h"

/* Serves device memory; needs device ops with a stream (ops->stream); init is collective over
 * comm. */
extern const epd_transport_t epd_transport_nccl;

#endif
