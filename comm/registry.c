/* The transport registry (the one place that knows which transports this build has) and the walk
 * that picks one for a rank's job: the settings are checked against what MPI says, then each
 * entry of the requested family is asked in turn. */
#include "comm/registry.h"

#include <stdio.h>
#include <string.h>

#include "comm/transport_mpi.h"
#include "comm/transport_nccl.h"
#include "comm/transport_staged.h"

const epd_transport_t *const epd_transports[] = {
    &epd_transport_mpi,
#ifdef EPD_HAVE_NCCL
    &epd_transport_nccl,
#endif
    &epd_transport_mpi_staged,
    NULL,
};

/* The dispatch.transport values, and for a family a build may lack, what it lacks and how to
 * build it in (for the error when it is asked for but not registered). */
static const struct family {
    const char *value;
    const char *library;
    const char *rebuild;
} families[] = {
    [EPD_TRANSPORT_AUTO] = {.value = "auto"},
    [EPD_TRANSPORT_MPI] = {.value = "mpi"},
    [EPD_TRANSPORT_NCCL] = {.value = "nccl",
                            .library = "NCCL",
                            .rebuild = "rebuild with NCCL=1 and nccl.h in CUDA_HOME/include"},
};

/* The settings of job against each other and against what MPI says. dispatch.mpi_cuda_aware only
 * matters for device memory. */
static epd_status_t job_check(const epd_transport_job_t *job, char err[EPD_ERR_LEN])
{
    if (job->device_memory) {
        if (job->mpi_cuda_aware != EPD_TRISTATE_AUTO && job->mpi_cuda_aware != EPD_TRISTATE_TRUE &&
            job->mpi_cuda_aware != EPD_TRISTATE_FALSE) {
            snprintf(err, EPD_ERR_LEN,
                     "dispatch.mpi_cuda_aware: unknown value %d (allowed: auto, true, false)",
                     (int)job->mpi_cuda_aware);
            return EPD_ERR_CONFIG;
        }
        if (job->mpi_cuda_aware == EPD_TRISTATE_TRUE && job->mpi_cuda == EPD_MPI_CUDA_NO) {
            snprintf(err, EPD_ERR_LEN,
                     "dispatch.mpi_cuda_aware = true, but this MPI is not CUDA-aware (%s); build "
                     "one with scripts/cuda-mpi.sh and make MPI_HOME=<its prefix>, or set auto",
                     epd_mpi_cuda_name(job->mpi_cuda));
            return EPD_ERR_CONFIG;
        }
    }
    if ((size_t)job->requested >= EPD_ARRAY_SIZE(families)) {
        snprintf(err, EPD_ERR_LEN,
                 "dispatch.transport: unknown value %d (allowed: auto, mpi, nccl)",
                 (int)job->requested);
        return EPD_ERR_CONFIG;
    }
    return EPD_OK;
}

/* The error when registry has no entry of the requested family. */
static void family_missing(const epd_transport_job_t *job, char err[EPD_ERR_LEN])
{
    const struct family *family = &families[job->requested];

    if (family->library == NULL)
        snprintf(err, EPD_ERR_LEN, "dispatch.transport = %s: this build has no such transport",
                 family->value);
    else if (job->device_memory)
        snprintf(err, EPD_ERR_LEN, "dispatch.transport = %s, but this build has no %s (%s), or use "
                 "auto or mpi", family->value, family->library, family->rebuild);
    else
        snprintf(err, EPD_ERR_LEN, "dispatch.transport = %s, but this build has no %s (and this "
                 "rank runs the CPU backend); use auto or mpi", family->value, family->library);
}

epd_status_t epd_transport_choose(const epd_transport_t *const *registry,
                                  const epd_transport_job_t *job, epd_transport_choice_t *choice_p,
                                  char err[EPD_ERR_LEN])
{
    char why[EPD_ERR_LEN] = "";
    bool asked = false;
    epd_status_t status;

    memset(choice_p, 0, sizeof *choice_p);
    status = job_check(job, err);
    if (status != EPD_OK) return status;
    for (size_t i = 0; registry[i] != NULL; i++) {
        const epd_transport_t *transport = registry[i];
        if (job->requested != EPD_TRANSPORT_AUTO && transport->kind != job->requested) continue;
        asked = true;
        if (transport->can_use(job, why)) {
            choice_p->transport = transport;
            snprintf(choice_p->reason, EPD_ERR_LEN, "%s", why);
            return EPD_OK;
        }
    }
    if (!asked)
        family_missing(job, err);
    else if (job->requested == EPD_TRANSPORT_AUTO)
        snprintf(err, EPD_ERR_LEN, "dispatch.transport = auto: no transport of this build can "
                 "serve this rank (the last one: %.160s)", why);
    else
        snprintf(err, EPD_ERR_LEN, "%s", why);
    return EPD_ERR_CONFIG;
}

epd_status_t epd_transport_select(const epd_config_t *cfg, const epd_ops_t *ops,
                                  epd_transport_choice_t *choice_p, char err[EPD_ERR_LEN])
{
    epd_transport_job_t job = {
        .requested = cfg->dispatch.transport,
        .mpi_cuda_aware = cfg->dispatch.mpi_cuda_aware,
        .device_memory = ops->device_memory,
        .mpi_cuda = epd_mpi_cuda_support(),
    };

    return epd_transport_choose(epd_transports, &job, choice_p, err);
}
