/* The `nccl` transport (DESIGN.md section 7): the alltoallv as grouped ncclSend/ncclRecv on the
 * ops stream, its communicator bootstrapped over MPI. Built only with NCCL=1 (EPD_HAVE_NCCL); the
 * NCCL calls themselves live in comm/nccl_boot.c, so this file and its .c include no CUDA or
 * NCCL header. */
#ifndef EPD_COMM_TRANSPORT_NCCL_H
#define EPD_COMM_TRANSPORT_NCCL_H

#include "comm/transport.h"

#ifdef EPD_HAVE_NCCL
/* Needs device ops with a stream (ops->stream); init is collective over comm. */
extern const epd_transport_t epd_transport_nccl;

/* The message of the last failure of an nccl transport context ("" when none). */
const char *epd_transport_nccl_last_error(const epd_transport_ctx_t *ctx);
#endif

#endif
