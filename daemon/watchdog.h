/* The stall watchdog of a rank (DESIGN.md section 8): a timer on the event loop that watches what
 * the engine waits on the other ranks for (an agreement, a step). Past dispatch.stall_warn_ms the
 * rank is stalled: logged once, and `health` says `stalled` naming the phase (through the server
 * counters); past dispatch.step_timeout_ms the job is aborted (MPI_Abort) with a message naming
 * the phase, so systemd can restart it. Loop thread only. */
#ifndef EPD_DAEMON_WATCHDOG_H
#define EPD_DAEMON_WATCHDOG_H

#include "common/status.h"
#include "config/config.h"
#include "daemon/engine.h"
#include "daemon/stats.h"

struct event_base;

typedef struct epd_watchdog epd_watchdog_t;

/* The MPI_Abort code after dispatch.step_timeout_ms. */
#define EPD_WATCHDOG_ABORT_CODE 4

/* Starts watching engine on base; the verdict goes to stats->stalled_phase / stalled_ms (and
 * stats->stalls counts stalls). cfg, base, engine and stats must outlive the watchdog. */
epd_status_t epd_watchdog_create(const epd_config_t *cfg, struct event_base *base,
                                 epd_engine_t *engine, epd_server_stats_t *stats, int rank,
                                 epd_watchdog_t **watchdog_p, char err[EPD_ERR_LEN]);

/* Stops watching (no-op on NULL). */
void epd_watchdog_free(epd_watchdog_t *watchdog);

#endif
