/* Builds the health/stats JSON and the Prometheus metrics text from the server's counters and the
 * engine's stats (see stats.h). Counters are printed as exact integers, not through doubles. */
#include "daemon/stats.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm/step.h"

#ifndef EPD_VERSION
#define EPD_VERSION "unknown"
#endif

/* ---- the metrics recorder ---- */

#define HIST_MAX_BUCKETS 24
#define METRICS_MAX_LAYERS 1024 /* distinct layers with expert counters; more are only summed */

/* Upper bounds (the `le` labels), ascending; +Inf is implicit. */
static const double latency_bounds[] = {0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                        0.01,    0.025,  0.05,    0.1,    0.25,  0.5,    1,
                                        2.5,     5,      10};
static const double phase_bounds[] = {0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005,
                                      0.001,   0.0025,   0.005,   0.01,   0.025,   0.05,
                                      0.1,     0.25,     0.5,     1};
static const double token_bounds[] = {0,    1,    2,     4,     8,     16,     32,     64,
                                      128,  256,  512,   1024,  2048,  4096,   8192,   16384,
                                      32768, 65536, 131072, 262144, 524288, 1048576};

typedef struct histogram {
    const double *bounds;
    size_t n_bounds;
    uint64_t counts[HIST_MAX_BUCKETS + 1]; /* per bucket, not cumulative; [n_bounds] is +Inf */
    double sum;
    uint64_t count;
} histogram_t;

typedef struct layer_counts {
    uint32_t layer;
    uint64_t *tokens; /* [2E]: routed by this rank's clients to expert e, then rows this rank's
                       * experts ran at E + e (nonzero for its own experts only) */
} layer_counts_t;

struct epd_metrics {
    pthread_mutex_t mu;
    uint32_t num_experts;
    uint32_t topk;
    histogram_t request_latency;
    histogram_t step_duration;
    histogram_t phase_duration[EPD_PHASE_MAX];
    histogram_t step_tokens;
    layer_counts_t *layers; /* sorted by layer */
    size_t n_layers;
    uint64_t untracked_tokens; /* routed tokens of layers beyond METRICS_MAX_LAYERS */
    uint32_t local_first, n_local; /* this rank's experts (from the steps) */
};

#define HIST_INIT(h, b) \
    do {                                           \
        (h)->bounds = (b);                         \
        (h)->n_bounds = EPD_ARRAY_SIZE(b);         \
    } while (0)

_Static_assert(EPD_ARRAY_SIZE(token_bounds) <= HIST_MAX_BUCKETS, "histogram too wide");
_Static_assert(EPD_ARRAY_SIZE(latency_bounds) <= HIST_MAX_BUCKETS, "histogram too wide");

epd_metrics_t *epd_metrics_create(uint32_t num_experts, uint32_t topk)
{
    epd_metrics_t *m = calloc(1, sizeof(*m));

    if (m == NULL) return NULL;
    pthread_mutex_init(&m->mu, NULL);
    m->num_experts = num_experts;
    m->topk = topk;
    HIST_INIT(&m->request_latency, latency_bounds);
    HIST_INIT(&m->step_duration, latency_bounds);
    for (int p = 0; p < EPD_PHASE_MAX; p++) HIST_INIT(&m->phase_duration[p], phase_bounds);
    HIST_INIT(&m->step_tokens, token_bounds);
    return m;
}

void epd_metrics_free(epd_metrics_t *m)
{
    if (m == NULL) return;
    for (size_t i = 0; i < m->n_layers; i++) free(m->layers[i].tokens);
    free(m->layers);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

static void hist_observe(histogram_t *h, double v)
{
    size_t i = 0;
    while (i < h->n_bounds && v > h->bounds[i]) i++;
    h->counts[i]++;
    h->sum += v;
    h->count++;
}

void epd_metrics_observe_request(epd_metrics_t *m, uint64_t latency_ns)
{
    if (m == NULL) return;
    pthread_mutex_lock(&m->mu);
    hist_observe(&m->request_latency, (double)latency_ns / 1e9);
    pthread_mutex_unlock(&m->mu);
}

/* The counters of layer, added in order when first seen; NULL when there is no room. Under mu. */
static uint64_t *layer_tokens(epd_metrics_t *m, uint32_t layer)
{
    size_t lo = 0, hi = m->n_layers;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (m->layers[mid].layer == layer) return m->layers[mid].tokens;
        if (m->layers[mid].layer < layer) lo = mid + 1; else hi = mid;
    }
    if (m->n_layers == METRICS_MAX_LAYERS) return NULL;
    uint64_t *tokens = calloc(2 * (size_t)m->num_experts, sizeof(*tokens));
    layer_counts_t *grown = realloc(m->layers, (m->n_layers + 1) * sizeof(*grown));
    if (tokens == NULL || grown == NULL) {
        free(tokens);
        if (grown != NULL) m->layers = grown;
        return NULL;
    }
    m->layers = grown;
    memmove(&grown[lo + 1], &grown[lo], (m->n_layers - lo) * sizeof(*grown));
    grown[lo] = (layer_counts_t){.layer = layer, .tokens = tokens};
    m->n_layers++;
    return tokens;
}

void epd_metrics_observe_step(void *arg, const epd_step_timing_t *timing, uint32_t layer,
                              const int32_t *topk_ids, uint32_t n_tokens)
{
    epd_metrics_t *m = arg;

    if (m == NULL) return;
    pthread_mutex_lock(&m->mu);
    hist_observe(&m->step_duration, (double)timing->total_ns / 1e9);
    for (int p = 0; p < EPD_PHASE_MAX; p++)
        hist_observe(&m->phase_duration[p], (double)timing->phase_ns[p] / 1e9);
    hist_observe(&m->step_tokens, (double)n_tokens);
    if (n_tokens > 0 && timing->expert_tokens != NULL) {
        /* the layout's counts: E additions rather than an increment per id (1024 at 128
         * tokens, top-8) */
        uint64_t *tokens = layer_tokens(m, layer);
        if (tokens != NULL) {
            for (uint32_t e = 0; e < m->num_experts; e++) tokens[e] += timing->expert_tokens[e];
        } else {
            for (uint32_t e = 0; e < m->num_experts; e++)
                m->untracked_tokens += timing->expert_tokens[e];
        }
    } else if (n_tokens > 0 && topk_ids != NULL) {
        uint64_t *tokens = layer_tokens(m, layer);
        size_t n = (size_t)n_tokens * m->topk;
        for (size_t i = 0; i < n; i++) {
            int32_t e = topk_ids[i];
            if (e < 0 || (uint32_t)e >= m->num_experts) continue; /* empty slot */
            if (tokens != NULL)
                tokens[e]++;
            else
                m->untracked_tokens++;
        }
    }
    if (timing->local_expert_rows != NULL && timing->n_local > 0 &&
        timing->local_first + timing->n_local <= m->num_experts) {
        m->local_first = timing->local_first;
        m->n_local = timing->n_local;
        uint64_t *tokens = NULL;
        for (uint32_t e = 0; e < timing->n_local; e++) {
            if (timing->local_expert_rows[e] == 0) continue;
            if (tokens == NULL && (tokens = layer_tokens(m, layer)) == NULL) break;
            tokens[m->num_experts + timing->local_first + e] += timing->local_expert_rows[e];
        }
    }
    pthread_mutex_unlock(&m->mu);
}

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
    /* tokens per layer, the layers that saw any, ascending */
    fprintf(f, "},\"layer_tokens\":[");
    for (int l = 0, n = 0; l < EPD_ENGINE_STATS_LAYERS; l++)
        if (e->layer_tokens[l] != 0)
            fprintf(f, "%s{\"layer\":%d,\"tokens\":%" PRIu64 "}", n++ ? "," : "", l,
                    e->layer_tokens[l]);
    fprintf(f, "],");
    epd_quant_stats_json(f, &e->quant_error);
    fprintf(f, "},");

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

/* The buckets (cumulative), sum and count of h; labels is "" or `name="value",`. */
static void hist_write(FILE *f, const char *name, const char *labels, const histogram_t *h)
{
    uint64_t cumulative = 0;
    size_t len = strlen(labels);
    /* the sum and count lines take the labels without the trailing comma */
    int bare = len > 0 ? (int)len - 1 : 0;

    for (size_t i = 0; i <= h->n_bounds; i++) {
        cumulative += h->counts[i];
        if (i < h->n_bounds)
            fprintf(f, "%s_bucket{%sle=\"%g\"} %" PRIu64 "\n", name, labels, h->bounds[i],
                    cumulative);
        else
            fprintf(f, "%s_bucket{%sle=\"+Inf\"} %" PRIu64 "\n", name, labels, cumulative);
    }
    if (bare > 0) {
        fprintf(f, "%s_sum{%.*s} %.9g\n", name, bare, labels, h->sum);
        fprintf(f, "%s_count{%.*s} %" PRIu64 "\n", name, bare, labels, h->count);
    } else {
        fprintf(f, "%s_sum %.9g\n", name, h->sum);
        fprintf(f, "%s_count %" PRIu64 "\n", name, h->count);
    }
}

/* The recorder's histograms and expert counters. They are copied under its lock and formatted
 * after, so a scrape holds the step thread up for a copy, not for the text. False when out of
 * memory (f is left as it was). */
static bool metrics_recorded(FILE *f, epd_metrics_t *m)
{
    char labels[64];
    histogram_t latency, duration, phases[EPD_PHASE_MAX], tokens;
    uint32_t *layer_ids = NULL;
    uint64_t *counts = NULL, untracked;
    size_t n_layers, n_experts = m->num_experts;

    pthread_mutex_lock(&m->mu);
    n_layers = m->n_layers;
    if (n_layers > 0) {
        layer_ids = malloc(n_layers * sizeof(*layer_ids));
        counts = malloc(n_layers * 2 * n_experts * sizeof(*counts));
        if (layer_ids == NULL || counts == NULL) {
            pthread_mutex_unlock(&m->mu);
            free(layer_ids);
            free(counts);
            return false;
        }
        for (size_t i = 0; i < n_layers; i++) {
            layer_ids[i] = m->layers[i].layer;
            memcpy(counts + i * 2 * n_experts, m->layers[i].tokens,
                   2 * n_experts * sizeof(*counts));
        }
    }
    latency = m->request_latency;
    duration = m->step_duration;
    memcpy(phases, m->phase_duration, sizeof(phases));
    tokens = m->step_tokens;
    untracked = m->untracked_tokens;
    uint32_t local_first = m->local_first, n_local = m->n_local;
    pthread_mutex_unlock(&m->mu);

    metric_head(f, "epd_request_latency_seconds", "histogram",
                "Time from a SUBMIT frame being read to its result being queued for the client.");
    hist_write(f, "epd_request_latency_seconds", "", &latency);
    metric_head(f, "epd_step_duration_seconds", "histogram",
                "Duration of each step this rank took part in.");
    hist_write(f, "epd_step_duration_seconds", "", &duration);
    metric_head(f, "epd_step_phase_duration_seconds", "histogram",
                "Duration of each phase of the steps.");
    for (int p = 0; p < EPD_PHASE_MAX; p++) {
        snprintf(labels, sizeof(labels), "phase=\"%s\",", epd_phase_names[p]);
        hist_write(f, "epd_step_phase_duration_seconds", labels, &phases[p]);
    }
    metric_head(f, "epd_step_tokens", "histogram",
                "Tokens of this rank's requests in each step (0: the rank only took part).");
    hist_write(f, "epd_step_tokens", "", &tokens);
    metric_head(f, "epd_expert_routed_tokens_total", "counter",
                "Tokens this rank's clients routed to each expert (global id), by layer; the sum "
                "over ranks is the expert's load.");
    for (size_t i = 0; i < n_layers; i++)
        for (size_t e = 0; e < n_experts; e++)
            fprintf(f, "epd_expert_routed_tokens_total{layer=\"%" PRIu32 "\",expert=\"%zu\"} %"
                       PRIu64 "\n", layer_ids[i], e, counts[i * 2 * n_experts + e]);
    metric_head(f, "epd_expert_tokens_total", "counter",
                "Tokens this rank's own experts ran (each a row of the expert's GEMMs), by layer "
                "and expert (global id): the expert's load, one rank each.");
    for (size_t i = 0; i < n_layers; i++)
        for (size_t e = local_first; e < (size_t)local_first + n_local; e++)
            fprintf(f, "epd_expert_tokens_total{layer=\"%" PRIu32 "\",expert=\"%zu\"} %" PRIu64
                       "\n", layer_ids[i], e, counts[i * 2 * n_experts + n_experts + e]);
    metric_u64(f, "epd_expert_untracked_tokens_total", "counter",
               "Routed tokens of layers beyond the 1024 tracked per expert (counted only here).",
               untracked);
    free(layer_ids);
    free(counts);
    return true;
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
               "Combine bytes (partials, BF16 or FP8) sent off this rank.", e->bytes_combined);
    metric_u64(f, "epd_records_sent_total", "counter", "Dispatch records sent off this rank.",
               e->records_sent);
    metric_head(f, "epd_step_phase_seconds_total", "counter",
                "Time spent in each phase of the steps.");
    for (int p = 0; p < EPD_PHASE_MAX; p++)
        fprintf(f, "epd_step_phase_seconds_total{phase=\"%s\"} %.9f\n", epd_phase_names[p],
                ns_to_s(e->phase_ns[p]));
    metric_seconds(f, "epd_last_step_seconds", "Duration of the most recent step.",
                   ns_to_s(e->last_step_ns));
    epd_quant_stats_metrics(f, &e->quant_error);
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
    metric_u64(f, "epd_stalls_total", "counter",
               "Agreements or steps that waited dispatch.stall_warn_ms for the other ranks.",
               s->stalls);
    metric_u64(f, "epd_stalled", "gauge",
               "1 while an agreement or step has waited dispatch.stall_warn_ms or longer.",
               s->stalled_phase != NULL ? 1 : 0);
    metric_head(f, "epd_connections_timed_out_total", "counter",
                "Connections closed by socket.idle_timeout_ms (idle) or frame_timeout_ms (frame).");
    fprintf(f, "epd_connections_timed_out_total{reason=\"idle\"} %" PRIu64 "\n", s->closed_idle);
    fprintf(f, "epd_connections_timed_out_total{reason=\"frame\"} %" PRIu64 "\n",
            s->closed_frame_timeout);
    metric_u64(f, "epd_received_bytes_total", "counter", "Bytes read from clients.", s->bytes_in);
    metric_u64(f, "epd_transmitted_bytes_total", "counter", "Bytes queued to clients.",
               s->bytes_out);
    if (s->metrics != NULL && !metrics_recorded(f, s->metrics)) {
        fclose(f);
        free(buf);
        return NULL;
    }
    return doc_finish(f, &buf);
}
