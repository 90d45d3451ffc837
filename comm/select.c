/* The transport choice: host ops always use the mpi transport on host buffers; device ops are
 * handed to the CUDA selection (comm/select_cuda.c), which knows about CUDA-aware MPI, staging and
 * NCCL. */
#include <stdio.h>
#include <string.h>

#include "comm/select.h"
#include "comm/transport_mpi.h"

#ifdef EPD_HAVE_CUDA
#pragma weak epd_transport_select_cuda
#endif

epd_status_t epd_transport_select(const epd_config_t *cfg, const epd_ops_t *ops,
                                  epd_transport_choice_t *choice_p, char err[EPD_ERR_LEN])
{
    bool host = ops == &epd_ops_host;

    memset(choice_p, 0, sizeof *choice_p);
    if (!host) {
#ifdef EPD_HAVE_CUDA
        if (epd_transport_select_cuda != NULL)
            return epd_transport_select_cuda(cfg, ops, choice_p, err);
#endif
        snprintf(err, EPD_ERR_LEN,
                 "dispatch.transport: no transport is built for the %s device ops in this build",
                 ops->name);
        return EPD_ERR_CONFIG;
    }

    switch (cfg->dispatch.transport) {
    case EPD_TRANSPORT_AUTO:
        choice_p->transport = &epd_transport_mpi;
        snprintf(choice_p->reason, EPD_ERR_LEN,
                 "mpi: host buffers (CPU backend; dispatch.transport = auto)");
        return EPD_OK;
    case EPD_TRANSPORT_MPI:
        choice_p->transport = &epd_transport_mpi;
        snprintf(choice_p->reason, EPD_ERR_LEN, "mpi: host buffers (CPU backend)");
        return EPD_OK;
    case EPD_TRANSPORT_NCCL:
#ifdef EPD_HAVE_NCCL
        snprintf(err, EPD_ERR_LEN,
                 "dispatch.transport = nccl needs GPU buffers, but this rank runs the CPU backend; "
                 "use auto or mpi, or device.backend = cuda");
#else
        snprintf(
            err, EPD_ERR_LEN,
            "dispatch.transport = nccl, but this build has no NCCL (and this rank runs the CPU "
            "backend); use auto or mpi");
#endif
        return EPD_ERR_CONFIG;
    }
    snprintf(err, EPD_ERR_LEN, "dispatch.transport: unknown value %d (allowed: auto, mpi, nccl)",
             (int)cfg->dispatch.transport);
    return EPD_ERR_CONFIG;
}
