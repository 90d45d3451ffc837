/* What the transports share about the job they are asked to serve: this MPI's answer about device
 * buffers, how a sentence names it, and whether MPI is handed the job's device buffers directly
 * (the rule of dispatch.mpi_cuda_aware). Pure apart from the MPI query; log-free. */
#include "comm/transport.h"

#include <stdio.h>

#if defined(__has_include)
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif
#endif

epd_mpi_cuda_t epd_mpi_cuda_support(void)
{
#if defined(MPIX_CUDA_AWARE_SUPPORT)
    return MPIX_Query_cuda_support() ? EPD_MPI_CUDA_YES : EPD_MPI_CUDA_NO;
#else
    return EPD_MPI_CUDA_UNKNOWN;
#endif
}

const char *epd_mpi_cuda_name(epd_mpi_cuda_t mpi_cuda)
{
    switch (mpi_cuda) {
    case EPD_MPI_CUDA_YES: return "MPIX_Query_cuda_support() = 1";
    case EPD_MPI_CUDA_NO: return "MPIX_Query_cuda_support() = 0";
    default: return "this MPI has no MPIX_Query_cuda_support()";
    }
}

bool epd_mpi_cuda_direct(const epd_transport_job_t *job, char why[EPD_ERR_LEN])
{
    switch (job->mpi_cuda_aware) {
    case EPD_TRISTATE_TRUE:
        snprintf(why, EPD_ERR_LEN, "dispatch.mpi_cuda_aware = true; %s",
                 epd_mpi_cuda_name(job->mpi_cuda));
        return true;
    case EPD_TRISTATE_FALSE:
        snprintf(why, EPD_ERR_LEN, "dispatch.mpi_cuda_aware = false");
        return false;
    case EPD_TRISTATE_AUTO:
        snprintf(why, EPD_ERR_LEN, "%s", epd_mpi_cuda_name(job->mpi_cuda));
        return job->mpi_cuda == EPD_MPI_CUDA_YES;
    }
    snprintf(why, EPD_ERR_LEN, "dispatch.mpi_cuda_aware: unknown value %d",
             (int)job->mpi_cuda_aware);
    return false;
}
