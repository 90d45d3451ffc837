/* The server's counters, the metrics recorder (histograms and per-expert counters, fed by the
 * engine's step observer and the server's results), and the three documents built from them and
 * the engine's stats: the `health` and `stats` JSON replies and the `metrics` Prometheus text
 * exposition (served over CONTROL and HTTP, daemon/http.h). Leaf module: no logging, no I/O; each
 * builder returns a malloc'ed NUL-terminated string (NULL: no memory). */
#ifndef EPD_DAEMON_STATS_H
#define EPD_DAEMON_STATS_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"
#include "config/config.h"
#include "daemon/engine.h"

/* Histograms and per-expert counters, written from the engine's worker thread (steps) and the
 * loop thread (request latencies), read by the exposition; it has its own lock. */
typedef struct epd_metrics epd_metrics_t;

/* Creates an empty recorder for E experts; NULL when out of memory. */
epd_metrics_t *epd_metrics_create(uint32_t num_experts, uint32_t topk);
void epd_metrics_free(epd_metrics_t *metrics);

/* One answered request: latency from its frame being read to its result being queued. */
void epd_metrics_observe_request(epd_metrics_t *metrics, uint64_t latency_ns);

/* One step this rank took part in: its duration and phases, its tokens, and for each of its
 * tokens the top-k expert ids (host memory, [n_tokens, K], -1 = empty slot) of layer. The
 * signature is the engine's step observer (epd_engine_step_observer_fn); arg is the recorder. */
void epd_metrics_observe_step(void *arg, const epd_step_timing_t *timing, uint32_t layer,
                              const int32_t *topk_ids, uint32_t n_tokens);

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
    epd_metrics_t *metrics;           /* histograms and expert counters (NULL: none) */
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

/* Prometheus text exposition (version 0.0.4) with HELP and TYPE lines, every name ending in its
 * unit: counters (epd_steps_total, epd_tokens_total, epd_bytes_sent_total{dtype},
 * epd_step_phase_seconds_total{phase}, epd_errors_total{code}, ...), gauges (epd_queue_tokens,
 * epd_clients, ...) and, from view->server->metrics, the histograms
 * epd_request_latency_seconds, epd_step_duration_seconds, epd_step_phase_duration_seconds{phase},
 * epd_step_tokens and the counters epd_expert_routed_tokens_total{layer,expert}.
 * docs/operations.md lists each one. */
char *epd_stats_metrics(const epd_stats_view_t *view);

#endif
