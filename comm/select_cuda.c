/* Transport choice for device (CUDA) ops: direct MPI on device buffers, NCCL, or staged MPI
 * through pinned host memory, from dispatch.transport, dispatch.mpi_cuda_aware, what the MPI
 * library reports and whether NCCL was built. Log-free: the reason sentence is for the caller. */
#include "comm/select_cuda.h"

#include <stdio.h>
#include <string.h>

#include <mpi.h>
#if defined(__has_include)
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif
#endif

#include "comm/transport_mpi.h"
#include "comm/transport_nccl.h"
#include "comm/transport_staged.h"

/* The staged path works everywhere but costs dearly on NVLink machines: say so and how to fix. */
#define STAGED_WHY                                                                       \
    "staging through pinned host memory, ~100x slower than direct on NVLink; for the "   \
    "direct path build a CUDA-aware MPI: scripts/cuda-mpi.sh, make MPI_HOME=<prefix>"
#define WHY_LEN 80

epd_mpi_cuda_t epd_mpi_cuda_support(void)
{
#if defined(MPIX_CUDA_AWARE_SUPPORT)
    return MPIX_Query_cuda_support() ? EPD_MPI_CUDA_YES : EPD_MPI_CUDA_NO;
#else
    return EPD_MPI_CUDA_UNKNOWN;
#endif
}

static const char *mpi_cuda_name(epd_mpi_cuda_t mpi_cuda)
{
    switch (mpi_cuda) {
    case EPD_MPI_CUDA_YES: return "MPIX_Query_cuda_support() = 1";
    case EPD_MPI_CUDA_NO: return "MPIX_Query_cuda_support() = 0";
    default: return "this MPI has no MPIX_Query_cuda_support()";
    }
}

static void choose_direct(epd_transport_choice_t *choice_p, const char *why)
{
    choice_p->transport = &epd_transport_mpi;
    snprintf(choice_p->reason, EPD_ERR_LEN, "mpi: MPI_Alltoallv directly on device buffers (%.80s)",
             why);
}

static void choose_staged(epd_transport_choice_t *choice_p, const char *why)
{
    choice_p->transport = &epd_transport_mpi_staged;
    snprintf(choice_p->reason, EPD_ERR_LEN, "mpi-staged (%.80s): " STAGED_WHY, why);
}

epd_status_t epd_transport_decide_cuda(epd_transport_kind_t kind, epd_tristate_t cuda_aware,
                                       epd_mpi_cuda_t mpi_cuda, bool nccl_built,
                                       epd_transport_choice_t *choice_p, char err[EPD_ERR_LEN])
{
    bool direct;
    char why[WHY_LEN + 1];

    memset(choice_p, 0, sizeof *choice_p);
    switch (cuda_aware) {
    case EPD_TRISTATE_TRUE:
        if (mpi_cuda == EPD_MPI_CUDA_NO) {
            snprintf(err, EPD_ERR_LEN,
                     "dispatch.mpi_cuda_aware = true, but this MPI is not CUDA-aware (%s); build "
                     "one with scripts/cuda-mpi.sh and make MPI_HOME=<its prefix>, or set auto",
                     mpi_cuda_name(mpi_cuda));
            return EPD_ERR_CONFIG;
        }
        direct = true;
        snprintf(why, sizeof why, "dispatch.mpi_cuda_aware = true; %s", mpi_cuda_name(mpi_cuda));
        break;
    case EPD_TRISTATE_FALSE:
        direct = false;
        snprintf(why, sizeof why, "dispatch.mpi_cuda_aware = false");
        break;
    case EPD_TRISTATE_AUTO:
        direct = mpi_cuda == EPD_MPI_CUDA_YES;
        snprintf(why, sizeof why, "%s", mpi_cuda_name(mpi_cuda));
        break;
    default:
        snprintf(err, EPD_ERR_LEN, "dispatch.mpi_cuda_aware: unknown value %d (allowed: auto, true, "
                 "false)", (int)cuda_aware);
        return EPD_ERR_CONFIG;
    }

    switch (kind) {
    case EPD_TRANSPORT_AUTO:
        if (direct) {
            choose_direct(choice_p, why);
            return EPD_OK;
        }
#ifdef EPD_HAVE_NCCL
        if (nccl_built) {
            choice_p->transport = &epd_transport_nccl;
            snprintf(choice_p->reason, EPD_ERR_LEN,
                     "nccl: grouped ncclSend/ncclRecv on device buffers (dispatch.transport = auto, "
                     "MPI not CUDA-aware: %.80s)", why);
            return EPD_OK;
        }
#endif
        choose_staged(choice_p, why);
        return EPD_OK;
    case EPD_TRANSPORT_MPI:
        if (direct)
            choose_direct(choice_p, why);
        else
            choose_staged(choice_p, why);
        return EPD_OK;
    case EPD_TRANSPORT_NCCL:
#ifdef EPD_HAVE_NCCL
        if (nccl_built) {
            choice_p->transport = &epd_transport_nccl;
            snprintf(choice_p->reason, EPD_ERR_LEN,
                     "nccl: grouped ncclSend/ncclRecv on device buffers (dispatch.transport = nccl)");
            return EPD_OK;
        }
#endif
        snprintf(err, EPD_ERR_LEN,
                 "dispatch.transport = nccl, but this build has no NCCL (rebuild with NCCL=1 and "
                 "nccl.h in CUDA_HOME/include), or use auto or mpi");
        return EPD_ERR_CONFIG;
    }
    snprintf(err, EPD_ERR_LEN, "dispatch.transport: unknown value %d (allowed: auto, mpi, nccl)",
             (int)kind);
    return EPD_ERR_CONFIG;
}

epd_status_t epd_transport_select_cuda(const epd_config_t *cfg, const epd_ops_t *ops,
                                       epd_transport_choice_t *choice_p, char err[EPD_ERR_LEN])
{
    bool nccl_built = false;

#ifdef EPD_HAVE_NCCL
    nccl_built = true;
#endif
    if (ops == NULL || ops == &epd_ops_host) {
        /* comm/select.c chooses for the host ops itself */
        snprintf(err, EPD_ERR_LEN, "epd_transport_select_cuda: called for the %s ops",
                 ops == NULL ? "(no)" : ops->name);
        return EPD_ERR_INVALID_ARG;
    }
    return epd_transport_decide_cuda(cfg->dispatch.transport, cfg->dispatch.mpi_cuda_aware,
                                     epd_mpi_cuda_support(), nccl_built, choice_p, err);
}
