/* Choosing the device ops of a rank (DESIGN.md sections 1 and 9): device.backend auto | cuda | cpu
 * and device.id, checked against the CUDA build and the GPUs this node has. Plain C; the caller
 * logs the reason sentence. */
#ifndef EPD_GPU_SELECT_H
#define EPD_GPU_SELECT_H

#include <stdbool.h>

#include "common/status.h"
#include "gpu/ops.h"
#include "gpu/types.h"

/* What a rank runs on. */
typedef struct epd_device_choice {
    const epd_ops_t *ops;     /* &epd_ops_host or &epd_ops_cuda */
    int device_id;            /* CUDA device for ops->init; -1 for the host ops */
    char reason[EPD_ERR_LEN]; /* one sentence saying what was chosen and why, for the log */
} epd_device_choice_t;

/* What the decision depends on, so it can be tested without a GPU. */
typedef struct epd_device_facts {
    bool cuda_built;    /* compiled with EPD_HAVE_CUDA */
    int n_gpus;         /* cudaGetDeviceCount; 0 when none or when the query failed */
    const char *no_gpu; /* why n_gpus is 0 (the CUDA error string), or NULL */
    int local_rank;     /* this rank's index among the ranks of its node */
    int local_size;     /* ranks on this node */
} epd_device_facts_t;

/* The decision itself (pure): auto -> cuda when built with CUDA and a GPU is present, else cpu
 * with a reason; cuda without a CUDA build or without a GPU, more ranks on the node than GPUs
 * (device.id = -1), or a device.id >= the GPU count -> EPD_ERR_CONFIG with a sentence in err.
 * The device is the local rank unless device.id >= 0. */
epd_status_t epd_device_decide(epd_backend_t backend, int32_t device_id,
                               const epd_device_facts_t *facts, epd_device_choice_t *choice_p,
                               char err[EPD_ERR_LEN]);

/* Queries the CUDA build and device count, then decides as epd_device_decide does for backend
 * and device_id (device.backend and device.id). local_rank and local_size describe this rank's
 * node (e.g. from MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)). */
epd_status_t epd_device_select(epd_backend_t backend, int32_t device_id, int local_rank,
                               int local_size, epd_device_choice_t *choice_p,
                               char err[EPD_ERR_LEN]);

#endif
