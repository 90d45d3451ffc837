/* The transport registry and the choice of a rank's transport (DESIGN.md section 7): each entry
 * says itself whether it can serve the rank's job; `auto` takes the first that can, an explicit
 * dispatch.transport the first of its family. Log-free: it returns the choice and one sentence
 * saying why, which the caller logs. */
#ifndef EPD_COMM_REGISTRY_H
#define EPD_COMM_REGISTRY_H

#include "comm/transport.h"
#include "common/status.h"
#include "config/config.h"
#include "gpu/ops.h"

typedef struct epd_transport_choice {
    const epd_transport_t *transport;
    char reason[EPD_ERR_LEN]; /* e.g. "mpi: host buffers (CPU backend)" */
} epd_transport_choice_t;

/* This build's transports in the order `auto` walks them, NULL-terminated: direct mpi, nccl
 * (when built with NCCL), staged mpi. */
extern const epd_transport_t *const epd_transports[];

/* The choice for job among registry (NULL-terminated, in walking order): the first entry of the
 * requested family (every entry for auto) whose can_use says yes, with its sentence as the
 * reason. Pure (no MPI, no device). EPD_ERR_CONFIG with a sentence in err: an unknown
 * dispatch.transport or dispatch.mpi_cuda_aware value; dispatch.mpi_cuda_aware = true on device
 * memory where MPI says it is not CUDA-aware; no entry of the requested family in registry; or
 * none that can serve (err is the last one's why-not). */
epd_status_t epd_transport_choose(const epd_transport_t *const *registry,
                                  const epd_transport_job_t *job, epd_transport_choice_t *choice_p,
                                  char err[EPD_ERR_LEN]);

/* The choice for this rank: the job made of cfg's dispatch.transport and dispatch.mpi_cuda_aware,
 * the memory of ops (the table the rank runs on) and this MPI's answer, walked over
 * epd_transports. Errors as epd_transport_choose. */
epd_status_t epd_transport_select(const epd_config_t *cfg, const epd_ops_t *ops,
                                  epd_transport_choice_t *choice_p, char err[EPD_ERR_LEN]);

#endif
