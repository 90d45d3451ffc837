/* The CUDA half of the transport choice (DESIGN.md section 7), split into a pure decision that
 * tests can drive without a GPU or a CUDA-aware MPI. epd_transport_select_cuda itself is declared
 * in comm/select.h, whose epd_transport_select calls it for device ops. */
#ifndef EPD_COMM_SELECT_CUDA_H
#define EPD_COMM_SELECT_CUDA_H

#include <stdbool.h>

#include "comm/select.h"

/* What MPI says about device buffers: MPIX_Query_cuda_support() where the MPI has it. */
typedef enum {
    EPD_MPI_CUDA_UNKNOWN = -1, /* no MPIX_Query_cuda_support in this MPI */
    EPD_MPI_CUDA_NO = 0,
    EPD_MPI_CUDA_YES = 1,
} epd_mpi_cuda_t;

/* This MPI's answer (compile-time extension check, then the run-time query). */
epd_mpi_cuda_t epd_mpi_cuda_support(void);

/* The decision for device ops:
 *   direct mpi when MPI says it is CUDA-aware (auto) or dispatch.mpi_cuda_aware = true;
 *   transport auto: direct mpi, else nccl when built with NCCL, else staged mpi;
 *   transport mpi: direct, else staged; transport nccl: nccl.
 * Staged choices explain in the reason that staging is ~100x slower than the direct path on
 * NVLink and point to scripts/cuda-mpi.sh. EPD_ERR_CONFIG: nccl asked but not built;
 * mpi_cuda_aware = true on an MPI that says it is not CUDA-aware. */
epd_status_t epd_transport_decide_cuda(epd_transport_kind_t kind, epd_tristate_t cuda_aware,
                                       epd_mpi_cuda_t mpi_cuda, bool nccl_built,
                                       epd_transport_choice_t *choice_p, char err[EPD_ERR_LEN]);

/* As declared in comm/select.h (there only under EPD_HAVE_CUDA): the decision above with this
 * configuration, this MPI's answer and this build's NCCL. EPD_ERR_INVALID_ARG for the host ops. */
epd_status_t epd_transport_select_cuda(const epd_config_t *cfg, const epd_ops_t *ops,
                                       epd_transport_choice_t *choice_p, char err[EPD_ERR_LEN]);

#endif
