/* The CONTROL documents a client can ask for (DESIGN.md section 4): one table of ops, each a name
 * and the function that builds its REPLY from the configuration, the engine's stats and the
 * server's counters. Adding an op is one table entry plus its function. Loop thread only. */
#ifndef EPD_DAEMON_CONTROL_H
#define EPD_DAEMON_CONTROL_H

#include <stddef.h>

#include "common/status.h"
#include "config/config.h"
#include "daemon/engine.h"
#include "daemon/stats.h"

typedef struct epd_control epd_control_t;

/* Creates the documents' source: cfg (rendered once for `config`), the rank's place in the job,
 * and the server's counters, read at each query. cfg and stats must outlive it; the start time is
 * now. */
epd_status_t epd_control_create(const epd_config_t *cfg, int rank, int world,
                                const epd_server_stats_t *stats, epd_control_t **control_p,
                                char err[EPD_ERR_LEN]);

/* Gives the documents the engine whose stats they show (before the first query). */
void epd_control_attach(epd_control_t *control, epd_engine_t *engine);

/* Builds the answer to op (NULL: the CONTROL meta had no string "op"): REPLY meta JSON (*meta_p)
 * and an optional payload (*payload_p, *payload_len_p), both malloc'ed and owned by the caller.
 * EPD_ERR_UNKNOWN_OP (err names the ops there are) for a missing or unknown op;
 * EPD_ERR_NO_MEMORY. */
epd_status_t epd_control_answer(epd_control_t *control, const char *op, char **meta_p,
                                char **payload_p, size_t *payload_len_p, char err[EPD_ERR_LEN]);

/* Frees the documents' source (NULL is ignored). */
void epd_control_free(epd_control_t *control);

#endif
