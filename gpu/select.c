/* Device selection: which ops table (host or CUDA) and which GPU a rank uses, from
 * device.backend and device.id and what the build and the node offer. */
#include "gpu/select.h"

#include <stdio.h>
#include <string.h>

#ifdef EPD_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

static void choose_host(epd_device_choice_t *choice_p)
{
    choice_p->ops = &epd_ops_host;
    choice_p->device_id = -1;
}

/* Picks the GPU of a cuda choice; fails when the node has too few. */
static epd_status_t choose_gpu(int32_t device_id, const epd_device_facts_t *facts,
                               epd_device_choice_t *choice_p, char err[EPD_ERR_LEN])
{
    if (device_id >= 0) {
        if (device_id >= facts->n_gpus) {
            snprintf(err, EPD_ERR_LEN, "device.id = %d but this node has only %d GPU%s (ids 0..%d)",
                     (int)device_id, facts->n_gpus, facts->n_gpus == 1 ? "" : "s",
                     facts->n_gpus - 1);
            return EPD_ERR_CONFIG;
        }
        choice_p->device_id = (int)device_id;
        return EPD_OK;
    }
    if (facts->local_rank < 0 || facts->local_size < 1 || facts->local_rank >= facts->local_size) {
        snprintf(err, EPD_ERR_LEN, "bad node placement: local rank %d of %d", facts->local_rank,
                 facts->local_size);
        return EPD_ERR_INVALID_ARG;
    }
    if (facts->local_size > facts->n_gpus) {
        snprintf(err, EPD_ERR_LEN,
                 "%d ranks on this node but only %d GPU%s: run one rank per GPU, or set device.id "
                 "to share one", facts->local_size, facts->n_gpus, facts->n_gpus == 1 ? "" : "s");
        return EPD_ERR_CONFIG;
    }
    choice_p->device_id = facts->local_rank;
    return EPD_OK;
}

epd_status_t epd_device_decide(epd_backend_t backend, int32_t device_id,
                               const epd_device_facts_t *facts, epd_device_choice_t *choice_p,
                               char err[EPD_ERR_LEN])
{
    epd_status_t status;
    const char *why = facts->no_gpu != NULL ? facts->no_gpu : "no CUDA device found";

    memset(choice_p, 0, sizeof *choice_p);
    switch (backend) {
    case EPD_BACKEND_CPU:
        choose_host(choice_p);
        snprintf(choice_p->reason, EPD_ERR_LEN, "device.backend = cpu: running on the host%s",
                 device_id >= 0 ? " (device.id is ignored)" : "");
        return EPD_OK;
    case EPD_BACKEND_AUTO:
        if (!facts->cuda_built || facts->n_gpus <= 0) {
            choose_host(choice_p);
            if (!facts->cuda_built)
                snprintf(choice_p->reason, EPD_ERR_LEN,
                         "device.backend = auto: epd was built without CUDA, running on the host");
            else
                snprintf(choice_p->reason, EPD_ERR_LEN,
                         "device.backend = auto: no usable GPU (%s), running on the host", why);
            return EPD_OK;
        }
        break;
    case EPD_BACKEND_CUDA:
        if (!facts->cuda_built) {
            snprintf(err, EPD_ERR_LEN,
                     "device.backend = cuda but epd was built without CUDA (rebuild with CUDA=1 "
                     "and nvcc in CUDA_HOME, or set device.backend = cpu)");
            return EPD_ERR_CONFIG;
        }
        if (facts->n_gpus <= 0) {
            snprintf(err, EPD_ERR_LEN, "device.backend = cuda but no GPU is usable: %s", why);
            return EPD_ERR_CONFIG;
        }
        break;
    default:
        snprintf(err, EPD_ERR_LEN, "unknown device.backend %d", (int)backend);
        return EPD_ERR_INVALID_ARG;
    }

#ifdef EPD_HAVE_CUDA
    CHECK_GOTO(choose_gpu(device_id, facts, choice_p, err), out);
    choice_p->ops = &epd_ops_cuda;
    snprintf(choice_p->reason, EPD_ERR_LEN, "device.backend = %s: CUDA device %d of %d (%s)",
             backend == EPD_BACKEND_AUTO ? "auto" : "cuda", choice_p->device_id, facts->n_gpus,
             device_id >= 0 ? "device.id" : "the local rank");
    return EPD_OK;
out:
    memset(choice_p, 0, sizeof *choice_p);
    return status;
#else
    /* facts claim a CUDA build that this object does not have */
    (void)status;
    (void)choose_gpu;
    snprintf(err, EPD_ERR_LEN, "device.backend needs CUDA but this build has no CUDA ops");
    return EPD_ERR_UNSUPPORTED;
#endif
}

epd_status_t epd_device_select(epd_backend_t backend, int32_t device_id, int local_rank,
                               int local_size, epd_device_choice_t *choice_p,
                               char err[EPD_ERR_LEN])
{
    epd_device_facts_t facts = {
        .cuda_built = false, .n_gpus = 0, .no_gpu = NULL,
        .local_rank = local_rank, .local_size = local_size,
    };
#ifdef EPD_HAVE_CUDA
    facts.cuda_built = true;
    if (backend != EPD_BACKEND_CPU) {
        int count = 0;
        cudaError_t rc = cudaGetDeviceCount(&count);
        if (rc != cudaSuccess) {
            facts.no_gpu = cudaGetErrorString(rc);
            count = 0;
        }
        facts.n_gpus = count;
    }
#endif
    return epd_device_decide(backend, device_id, &facts, choice_p, err);
}
