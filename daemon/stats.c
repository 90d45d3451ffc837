/* Builds the health/stats JSON and the Prometheus metrics text from the server's counters and the
 * engine's stats (see stats.h). Counters are printed as exact integers, not through doubles. */
#include "daemon/stats.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "comm/step.h"

#ifndef EPD_VERSION
#define EPD_VERSION "unknown"
#endif

/* open_memstream gives a growing malloc'ed string; NULL when out of memory. */
static char *doc_finish(FILE *f, char **buf_p)
{
    bool bad = ferror(f) != 0;
    /* fclose sets *buf_p to the final buffer. */
    if (fclose(f) != 0) bad = true;
    if (bad) {
        free(*buf_p);
        return NULL;
    }
    return *buf_p;
}

static double ns_to_s(uint64_t ns)
{
    return (double)ns / 1e9;
}

static double bytes_per_token(const epd_stats_view_t *view)
{
    const epd_engine_stats_t *e = view->engine;
    uint64_t bytes = e->bytes_sent[EPD_WIRE_FP8] + e->bytes_sent[EPD_WIRE_BF16];
    return e->tokens ? (double)bytes / (double)e->tokens : 0.0;
}

char *epd_stats_health_json(const epd_stats_view_t *view)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (f == NULL) return NULL;
    const epd_server_stats_t *s = view->server;
    if (s->stalled_phase != NULL)
        fprintf(f, "{\"status\":\"stalled\",\"stalled_phase\":\"%s\",\"stalled_ms\":%" PRIu64 ",",
                s->stalled_phase, s->stalled_ms);
    else
        fprintf(f, "{\"status\":\"ok\",");
    fprintf(f,
            "\"rank\":%d,\"world\":%d,\"pid\":%ld,\"shutting_down\":%s,"
            "\"version\":\"%s\",\"uptime_s\":%.3f,\"clients\":%" PRIu64
            ",\"queued_tokens\":%" PRIu64 ",\"queued_requests\":%" PRIu64 ",\"steps\":%" PRIu64 "}",
            view->rank, view->world, (long)getpid(),
            view->engine->shutting_down ? "true" : "false", EPD_VERSION, view->uptime_s,
            view->server->clients, view->engine->queued_tokens,
            view->engine->queued_requests, view->engine->steps);
    return doc_finish(f, &buf);
}

char *epd_stats_json(const epd_stats_view_t *view)
{
    const epd_engine_stats_t *e = view->engine;
    const epd_server_stats_t *s = view->server;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (f == NULL) return NULL;

    fprintf(f, "{\"rank\":%d,\"world\":%d,\"uptime_s\":%.3f,\"dtype\":\"%s\","
               "\"bytes_per_token\":%.3f,",
            view->rank, view->world, view->uptime_s,
            epd_config_enum_name("dispatch.dtype", view->dtype), bytes_per_token(view));
    fprintf(f,
            "\"engine\":{\"steps\":%" PRIu64 ",\"tokens\":%" PRIu64 ",\"requests\":%" PRIu64
            ",\"queued_tokens\":%" PRIu64 ",\"queued_requests\":%" PRIu64
            ",\"bytes_sent\":{\"fp8\":%" PRIu64 ",\"bf16\":%" PRIu64 "},\"bytes_combined\":%" PRIu64
            ",\"records_sent\":%" PRIu64 ",\"last_step_s\":%.9f,\"shutting_down\":%s,"
            "\"phase_seconds\":{",
            e->steps, e->tokens, e->requests, e->queued_tokens, e->queued_requests,
            e->bytes_sent[EPD_WIRE_FP8], e->bytes_sent[EPD_WIRE_BF16], e->bytes_combined,
            e->records_sent, ns_to_s(e->last_step_ns), e->shutting_down ? "true" : "false");
    for (int p = 0; p < EPD_PHASE_MAX; p++)
        fprintf(f, "%s\"%s\":%.9f", p ? "," : "", epd_phase_names[p], ns_to_s(e->phase_ns[p]));
    fprintf(f, "}},");

    fprintf(f,
            "\"server\":{\"clients\":%" PRIu64 ",\"clients_total\":%" PRIu64
            ",\"clients_refused\":%" PRIu64 ",\"requests_accepted\":%" PRIu64
            ",\"results_sent\":%" PRIu64 ",\"results_discarded\":%" PRIu64
            ",\"control_requests\":%" PRIu64 ",\"frames_in\":%" PRIu64 ",\"bytes_in\":%" PRIu64
            ",\"bytes_out\":%" PRIu64 ",\"buffered_bytes\":%" PRIu64 ",\"closed_idle\":%" PRIu64
            ",\"closed_frame_timeout\":%" PRIu64 ",\"stalls\":%" PRIu64 ",\"errors\":{",
            s->clients, s->clients_total, s->clients_refused, s->requests_accepted, s->results_sent,
            s->results_discarded, s->control_requests, s->frames_in, s->bytes_in, s->bytes_out,
            s->buffered_bytes, s->closed_idle, s->closed_frame_timeout, s->stalls);
    bool first = true;
    for (int c = 0; c < EPD_STATUS_MAX; c++) {
        if (!epd_status_is_wire_code((epd_status_t)c)) continue;
        fprintf(f, "%s\"%s\":%" PRIu64, first ? "" : ",", epd_status_name((epd_status_t)c),
                s->errors[c]);
        first = false;
    }
    fprintf(f, "}}}");
    return doc_finish(f, &buf);
}

static void metric_head(FILE *f, const char *name, const char *type, const char *help)
{
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* One metric without labels. */
static void metric_u64(FILE *f, const char *name, const char *type, const char *help, uint64_t v)
{
    metric_head(f, name, type, help);
    fprintf(f, "%s %" PRIu64 "\n", name, v);
}

static void metric_seconds(FILE *f, const char *name, const char *help, double v)
{
    metric_head(f, name, "gauge", help);
    fprintf(f, "%s %.9f\n", name, v);
}

char *epd_stats_metrics(const epd_stats_view_t *view)
{
    const epd_engine_stats_t *e = view->engine;
    const epd_server_stats_t *s = view->server;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (f == NULL) return NULL;

    metric_head(f, "epd_info", "gauge", "Constant 1, labelled with this rank's identity.");
    fprintf(f, "epd_info{rank=\"%d\",world=\"%d\",version=\"%s\",dtype=\"%s\"} 1\n", view->rank,
            view->world, EPD_VERSION, epd_config_enum_name("dispatch.dtype", view->dtype));
    metric_seconds(f, "epd_uptime_seconds", "Seconds since this rank started serving.",
                   view->uptime_s);
    metric_u64(f, "epd_steps_total", "counter", "Steps this rank has taken part in.", e->steps);
    metric_u64(f, "epd_tokens_total", "counter",
               "Tokens of this rank's requests that went through a step.", e->tokens);
    metric_head(f, "epd_bytes_sent_total", "counter",
                "Dispatch bytes sent off this rank, by wire dtype.");
    fprintf(f, "epd_bytes_sent_total{dtype=\"fp8\"} %" PRIu64 "\n", e->bytes_sent[EPD_WIRE_FP8]);
    fprintf(f, "epd_bytes_sent_total{dtype=\"bf16\"} %" PRIu64 "\n", e->bytes_sent[EPD_WIRE_BF16]);
    metric_u64(f, "epd_bytes_combined_total", "counter",
               "Combine bytes (BF16 partials) sent off this rank.", e->bytes_combined);
    metric_u64(f, "epd_records_sent_total", "counter", "Dispatch records sent off this rank.",
               e->records_sent);
    metric_head(f, "epd_step_phase_seconds_total", "counter",
                "Time spent in each phase of the steps.");
    for (int p = 0; p < EPD_PHASE_MAX; p++)
        fprintf(f, "epd_step_phase_seconds_total{phase=\"%s\"} %.9f\n", epd_phase_names[p],
                ns_to_s(e->phase_ns[p]));
    metric_seconds(f, "epd_last_step_seconds", "Duration of the most recent step.",
                   ns_to_s(e->last_step_ns));
    metric_u64(f, "epd_queue_tokens", "gauge", "Tokens queued on this rank, waiting for a step.",
               e->queued_tokens);
    metric_u64(f, "epd_queue_requests", "gauge",
               "Requests queued on this rank, waiting for a step.", e->queued_requests);
    metric_u64(f, "epd_shutting_down", "gauge", "1 once a graceful stop has been agreed.",
               e->shutting_down ? 1 : 0);
    metric_head(f, "epd_errors_total", "counter", "ERROR frames sent to clients, by code.");
    for (int c = 0; c < EPD_STATUS_MAX; c++) {
        if (!epd_status_is_wire_code((epd_status_t)c)) continue;
        fprintf(f, "epd_errors_total{code=\"%s\"} %" PRIu64 "\n", epd_status_name((epd_status_t)c),
                s->errors[c]);
    }
    metric_u64(f, "epd_clients", "gauge", "Clients connected now.", s->clients);
    metric_u64(f, "epd_clients_total", "counter", "Clients accepted since start.",
               s->clients_total);
    metric_u64(f, "epd_clients_refused_total", "counter",
               "Connections turned away (too many clients or uid not allowed).",
               s->clients_refused);
    metric_u64(f, "epd_requests_total", "counter", "SUBMIT requests accepted into the queue.",
               s->requests_accepted);
    metric_u64(f, "epd_results_total", "counter", "RESULT frames written whole to clients.",
               s->results_sent);
    metric_u64(f, "epd_results_discarded_total", "counter",
               "Answers dropped because their client had disconnected.", s->results_discarded);
    metric_u64(f, "epd_buffered_bytes", "gauge",
               "Payload bytes held by unfinished frames, all connections.", s->buffered_bytes);
    metric_head(f, "epd_connections_timed_out_total", "counter",
                "Connections closed by socket.idle_timeout_ms (idle) or frame_timeout_ms (frame).");
    fprintf(f, "epd_connections_timed_out_total{reason=\"idle\"} %" PRIu64 "\n", s->closed_idle);
    fprintf(f, "epd_connections_timed_out_total{reason=\"frame\"} %" PRIu64 "\n",
            s->closed_frame_timeout);
    metric_u64(f, "epd_received_bytes_total", "counter", "Bytes read from clients.", s->bytes_in);
    metric_u64(f, "epd_transmitted_bytes_total", "counter", "Bytes queued to clients.",
               s->bytes_out);
    return doc_finish(f, &buf);
}
