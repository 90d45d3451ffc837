/* Start-up and shutdown of one daemon rank (DESIGN.md sections 5 and 8): configuration checked
 * identical on every rank, device ops and transport chosen, the socket bound, READY=1 once every
 * rank serves, the event loop, the drain, and the teardown. */
#ifndef EPD_DAEMON_DAEMON_H
#define EPD_DAEMON_DAEMON_H

#include <mpi.h>

#include "common/status.h"
#include "config/config.h"
#include "gpu/ops.h"
#include "comm/transport.h"

/* Loads and validates the configuration from the command line and the process environment (the
 * precedence of DESIGN.md section 6). Warnings go to warn (may be NULL). Returns EPD_ERR_CONFIG
 * with a sentence in err on failure; free the state with epd_config_state_free. */
epd_status_t epd_daemon_load_config(const epd_args_t *args, epd_config_warn_fn warn, void *warn_arg,
                                    epd_config_state_t **state_p, char err[EPD_ERR_LEN]);

/* Where a rank runs: device ops and transport, initialized (the one place that chooses both). */
typedef struct epd_backend {
    const epd_ops_t *ops;
    epd_ops_ctx_t *ops_ctx;
    int device_id;
    const epd_transport_t *transport;
    epd_transport_ctx_t *transport_ctx;
    char device_reason[EPD_ERR_LEN];
    char transport_reason[EPD_ERR_LEN];
} epd_rank_backend_t;

/* Chooses and initializes the device ops (device.backend, device.id) and then the transport
 * (dispatch.transport) for this rank; collective over comm (transport init). On failure err says
 * which setting and why; nothing stays initialized. */
epd_status_t epd_daemon_backend_open(const epd_config_t *cfg, MPI_Comm comm, int local_rank,
                                     int local_size, epd_rank_backend_t *backend_p,
                                     char err[EPD_ERR_LEN]);
void epd_daemon_backend_close(epd_rank_backend_t *backend);

/* Runs the daemon on this rank; MPI is initialized with MPI_THREAD_SERIALIZED. Returns the exit
 * code (0 after a graceful stop). A start-up error on any rank is logged and ends the whole job
 * with MPI_Abort. The caller calls MPI_Finalize. */
int epd_daemon_run(const epd_args_t *args);

#endif
