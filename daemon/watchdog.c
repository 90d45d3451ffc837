/* The stall watchdog (daemon/watchdog.h). It ticks a few times per stall_warn_ms; a tick much
 * later than due means this process itself was not running (SIGSTOP, a starved machine), and that
 * time is not held against the other ranks. MPI_Abort is called from the loop thread while the
 * engine's worker is inside MPI (MPI_THREAD_SERIALIZED does not allow that in general), but a job
 * that aborts because a collective never completes has nothing left to keep consistent, and Open
 * MPI's abort tears the job down from any thread. */
#include "daemon/watchdog.h"

#include <inttypes.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <event2/event.h>

#include "common/clock.h"
#include "daemon/log.h"

#define WATCHDOG_TICK_MAX_MS 250 /* the longest time between two looks */
#define WATCHDOG_LATE_MS 500     /* a tick this late: the process was not running meanwhile */

struct epd_watchdog {
    const epd_config_t *cfg;
    epd_engine_t *engine;
    epd_server_stats_t *stats;
    int rank;
    struct event *tick;
    uint64_t tick_ns;     /* the period */
    uint64_t last_tick;   /* when the previous tick ran */
    uint64_t since_ns;    /* the wait being watched began (0: none) */
    uint64_t discount_ns; /* time this process itself did not run during that wait */
    bool warned;          /* the stall of this wait is logged */
    const char *phase;    /* what waits (while warned) */
    uint64_t waited_ms;   /* how long, at the last tick */
};

static void watchdog_arm(epd_watchdog_t *wd)
{
    struct timeval tv = {(time_t)(wd->tick_ns / 1000000000u),
                         (suseconds_t)(wd->tick_ns % 1000000000u / 1000u)};
    evtimer_add(wd->tick, &tv);
}

static void watchdog_tick_cb(evutil_socket_t fd, short what, void *arg)
{
    epd_watchdog_t *wd = arg;
    const epd_config_t *cfg = wd->cfg;
    uint64_t since = 0;
    const char *phase = epd_engine_activity(wd->engine, &since);
    /* read after the activity: the worker may have begun a new one since, never after now */
    uint64_t now = epd_now_ns();
    uint64_t late = now - wd->last_tick;

    /* an agreement or a step waits for every rank; idle and stopped wait for nobody */
    if (strcmp(phase, "agreement") != 0 && strcmp(phase, "step") != 0) phase = NULL;

    wd->last_tick = now;
    if (phase == NULL || since != wd->since_ns) {
        if (wd->warned)
            epd_log_warn("the stall is over: the %s went on after about %" PRIu64 " ms",
                         wd->phase, wd->waited_ms);
        wd->since_ns = phase != NULL ? since : 0;
        wd->discount_ns = 0;
        wd->warned = false;
        wd->stats->stalled_phase = NULL;
        wd->stats->stalled_ms = 0;
    } else if (late > wd->tick_ns + (uint64_t)WATCHDOG_LATE_MS * 1000000u) {
        wd->discount_ns += late - wd->tick_ns;
    }
    if (phase != NULL) {
        uint64_t held = now > since ? now - since : 0;
        uint64_t waited_ms = (held > wd->discount_ns ? held - wd->discount_ns : 0) / 1000000u;
        if (waited_ms >= cfg->dispatch.stall_warn_ms) {
            wd->stats->stalled_phase = phase;
            wd->stats->stalled_ms = waited_ms;
            wd->phase = phase;
            wd->waited_ms = waited_ms;
            if (!wd->warned) {
                wd->stats->stalls++;
                epd_log_warn("stalled: the %s has waited %" PRIu64 " ms for the other ranks "
                             "(dispatch.stall_warn_ms = %" PRIu32 "); a rank is stopped, dead or "
                             "its GPU hung", phase, waited_ms, cfg->dispatch.stall_warn_ms);
                wd->warned = true;
            }
        }
        if (cfg->dispatch.step_timeout_ms != 0 && waited_ms >= cfg->dispatch.step_timeout_ms) {
            epd_log_error("aborting the job: the %s has waited %" PRIu64 " ms for the other ranks "
                          "(dispatch.step_timeout_ms = %" PRIu32 ")", phase, waited_ms,
                          cfg->dispatch.step_timeout_ms);
            MPI_Abort(MPI_COMM_WORLD, EPD_WATCHDOG_ABORT_CODE);
            _exit(EPD_WATCHDOG_ABORT_CODE); /* MPI_Abort does not return */
        }
    }
    watchdog_arm(wd);
}

epd_status_t epd_watchdog_create(const epd_config_t *cfg, struct event_base *base,
                                 epd_engine_t *engine, epd_server_stats_t *stats, int rank,
                                 epd_watchdog_t **watchdog_p, char err[EPD_ERR_LEN])
{
    epd_watchdog_t *wd = calloc(1, sizeof(*wd));
    uint64_t tick_ms = cfg->dispatch.stall_warn_ms / 4;

    *watchdog_p = NULL;
    if (wd == NULL) goto out_nomem;
    wd->cfg = cfg;
    wd->engine = engine;
    wd->stats = stats;
    wd->rank = rank;
    if (tick_ms > WATCHDOG_TICK_MAX_MS) tick_ms = WATCHDOG_TICK_MAX_MS;
    if (tick_ms == 0) tick_ms = 1;
    wd->tick_ns = tick_ms * 1000000u;
    wd->tick = evtimer_new(base, watchdog_tick_cb, wd);
    if (wd->tick == NULL) goto out_free;
    wd->last_tick = epd_now_ns();
    watchdog_arm(wd);
    *watchdog_p = wd;
    return EPD_OK;

out_free:
    free(wd);
out_nomem:
    snprintf(err, EPD_ERR_LEN, "out of memory creating the stall watchdog");
    return EPD_ERR_NO_MEMORY;
}

void epd_watchdog_free(epd_watchdog_t *watchdog)
{
    if (watchdog == NULL) return;
    event_free(watchdog->tick);
    free(watchdog);
}
