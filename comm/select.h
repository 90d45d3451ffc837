/* Choosing the transport of a rank (DESIGN.md section 7) from dispatch.transport, the device ops
 * in use and what this build has. Log-free: it returns the choice and one sentence saying why,
 * which the caller logs. */
#ifndef EPD_COMM_SELECT_H
#define EPD_COMM_SELECT_H

#include "comm/transport.h"
#include "common/status.h"
#include "config/config.h"
#include "gpu/ops.h"

typedef struct epd_transport_choice {
    const epd_transport_t *transport;
    char reason[EPD_ERR_LEN]; /* e.g. "mpi: host buffers (CPU backend)" */
} epd_transport_choice_t;

/* Picks the transport for ops (the table the rank runs on). Host ops: auto and mpi -> the mpi
 * transport on host buffers; nccl -> EPD_ERR_CONFIG (NCCL needs GPU buffers, or the build has no
 * NCCL). Device ops: delegated to epd_transport_select_cuda (comm/select_cuda.c) when the build
 * has it. Errors name dispatch.transport and what is allowed. */
epd_status_t epd_transport_select(const epd_config_t *cfg, const epd_ops_t *ops,
                                  epd_transport_choice_t *choice_p, char err[EPD_ERR_LEN]);

#ifdef EPD_HAVE_CUDA
/* The CUDA half of the choice (staged mpi, direct mpi, nccl), for ops that are not the host's;
 * provided by comm/select_cuda.c. Declared weak in select.c so that a build without it still
 * links and reports the missing piece at start-up. */
epd_status_t epd_transport_select_cuda(const epd_config_t *cfg, const epd_ops_t *ops,
                                       epd_transport_choice_t *choice_p, char err[EPD_ERR_LEN]);
#endif

#endif
