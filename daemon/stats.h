/* The server's counters and the three documents built from them and the engine's stats: the
 * `health` and `stats` JSON replies and the `metrics` Prometheus text exposition. Leaf module:
 * no logging, no I/O; each builder returns a malloc'ed NUL-terminated string (NULL: no memory). */
#ifndef EPD_DAEMON_STATS_H
#define EPD_DAEMON_STATS_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"
#include "config/config.h"
#include "daemon/engine.h"

/* Counters kept by the server on its event-loop thread. */
typedef struct epd_server_stats {
    uint64_t clients;                 /* connected now */
    uint64_t clients_total;           /* accepted since start */
    uint64_t clients_refused;         /* turned away: too many clients, or uid not allowed */
    uint64_t requests_accepted;       /* SUBMITs handed to the engine */
    uint64_t results_sent;            /* RESULT frames written to clients (whole) */
    uint64_t results_discarded;       /* results and errors whose client had gone */
    uint64_t errors[EPD_STATUS_MAX];  /* ERROR frames sent, by wire code */
    uint64_t control_requests;        /* CONTROL frames answered */
    uint64_t frames_in;               /* whole frames decoded */
    uint64_t bytes_in;                /* bytes read from clients */
    uint64_t bytes_out;               /* bytes queued to clients */
    uint64_t buffered_bytes;          /* now: payload bytes reserved by unfinished frames, all
                                       * connections (socket.max_buffered_bytes) */
    uint64_t closed_idle;             /* connections closed by socket.idle_timeout_ms */
    uint64_t closed_frame_timeout;    /* connections closed by socket.frame_timeout_ms */
    const char *stalled_phase;        /* now: what has waited for the other ranks longer than
                                       * dispatch.stall_warn_ms ("agreement", "step"), or NULL */
    uint64_t stalled_ms;              /* how long it has waited (when stalled_phase is set) */
    uint64_t stalls;                  /* stalls seen since start (daemon/watchdog.c) */
} epd_server_stats_t;

/* Everything a document describes, gathered by the caller. */
typedef struct epd_stats_view {
    int rank;
    int world;
    double uptime_s;
    epd_wire_dtype_t dtype;            /* the configured dispatch dtype */
    const epd_engine_stats_t *engine;
    const epd_server_stats_t *server;
} epd_stats_view_t;

/* {"status":"ok" (or "stalled", then also "stalled_phase" and "stalled_ms"),
 *  "rank":R,"world":W,"pid":P,"shutting_down":bool,"version":..,"uptime_s":..,
 *  "clients":..,"queued_tokens":..,"queued_requests":..,"steps":..} */
char *epd_stats_health_json(const epd_stats_view_t *view);

/* The `stats` reply: rank, world, uptime, dtype, bytes_per_token, an "engine" object (steps,
 * tokens, requests, queue, bytes sent by dtype, phase seconds...) and a "server" object (clients
 * now/total/refused, requests accepted, results sent/discarded, errors by code, bytes in/out). */
char *epd_stats_json(const epd_stats_view_t *view);

/* Prometheus text exposition (version 0.0.4) with HELP and TYPE lines: epd_steps_total,
 * epd_tokens_total, epd_bytes_sent_total{dtype}, epd_step_phase_seconds_total{phase},
 * epd_queue_tokens, epd_errors_total{code}, epd_clients, epd_requests_total,
 * epd_results_discarded_total and a few more. */
char *epd_stats_metrics(const epd_stats_view_t *view);

#endif
