/* External experts (daemon/external.h): the worker's attachment (loop thread), the hand-over of
 * each step's EXPERTS to the loop thread and the wait for EXPERTS_DONE (engine worker thread),
 * the rows and partials (gpu/external.h) on the host, staged through host memory when the ops'
 * memory is a device's. */
#include "daemon/external.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <event2/event.h>

#include "common/clock.h"
#include "daemon/log.h"
#include "gpu/external.h"
#include "gpu/quant.h"

/* A waiting step polls for the answer at least this long before it sleeps on the condition
 * variable (a worker that answers within it is seen without a wake-up), unless the process has
 * one core. While the loop thread spins (the daemon is hot on a node with a core per thread) and
 * the process may use three cores (the loop thread, this one, and one left for the worker), it
 * polls on for up to dispatch.hot_ms: a condition variable's wake-up is several microseconds. */
#define EXTERNAL_SPIN_NS 20000u
/* Failures of one kind are logged once, then at most once a second with a count. */
#define EXTERNAL_LOG_NS 1000000000u
/* The most experts a rank can own (model.num_experts' largest value). */
#define EXTERNAL_MAX_LOCAL 4096u
/* Latency samples kept for the summary logged at exit. */
#define EXTERNAL_SAMPLES 4096u

/* The legs of one exchange kept for the summary at exit (ns). */
enum {
    SAMPLE_SEEN,     /* EXPERTS written to the socket -> the worker read it */
    SAMPLE_RESUMED,  /* the worker sent EXPERTS_DONE -> the step resumed */
    SAMPLE_FORMED,   /* the worker sent EXPERTS_DONE -> partials formed (queued: combine starts) */
    SAMPLE_META,     /* rows written -> the EXPERTS meta built and handed to the loop thread */
    SAMPLE_HANDED,   /* handed to the loop thread -> written to the socket */
    SAMPLE_DONE_READ, /* the worker sent EXPERTS_DONE -> the loop thread read it */
    SAMPLE_MAX
};

/* Where the step stands with the worker (under mu). */
typedef enum {
    HANDOFF_NONE = 0, /* no EXPERTS outstanding */
    HANDOFF_TO_SEND,  /* meta ready, the loop thread is to send it */
    HANDOFF_SENT,     /* written to the worker, waiting for EXPERTS_DONE */
    HANDOFF_DONE,     /* EXPERTS_DONE for it came */
    HANDOFF_GONE,     /* the worker left (or could not be written to) */
    HANDOFF_MAX
} handoff_t;

/* Ops memory grown as needed. */
typedef struct scratch {
    void *ptr;
    size_t cap;
} scratch_t;

/* One input region's layout for n_rows rows (offsets from the region's start). */
typedef struct io_layout {
    size_t x_off, x_bytes;
    size_t scales_off, scales_bytes; /* fp8_group128's scales, or fp8_per_tensor's S (4 bytes) */
    size_t counts_off, counts_bytes;
    size_t in_bytes;                 /* the whole input */
    size_t out_bytes;                /* y bf16 [n_rows, H] */
} io_layout_t;

struct epd_external {
    const epd_config_t *cfg;
    epd_moe_shape_t shape; /* the layer is the step's */
    uint32_t rank, world, n_local, first_expert;
    uint32_t max_rows;     /* the most rows one step can have on this rank */
    const epd_ops_t *ops;
    epd_ops_ctx_t *ops_ctx;
    struct event *send_ev;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* under mu */
    epd_conn_t *worker;      /* loop thread dereferences it; NULL: none */
    uint64_t worker_gen;     /* counts attachments: a step's worker is the one it began with */
    pid_t worker_pid;
    epd_region_t *in, *out;  /* references held while attached */
    uint32_t in_id, out_id;
    float scale_all;         /* input_scale for every layer (0: the step scale) */
    uint32_t *scale_layers;  /* input_scale per layer (n_layer_scales) */
    float *scale_values;
    size_t n_layer_scales;
    handoff_t handoff;
    uint64_t pending_step;
    char *pending_meta;      /* without its closing brace: the loop thread adds sent_ns */
    uint64_t late_step;      /* a step that timed out and whose EXPERTS_DONE is still due */
    uint64_t sent_ns, done_read_ns, seen_ns, done_ns; /* the last exchange's times */
    atomic_int handoff_now;  /* handoff, for the waiting step's spin */
    atomic_bool send_pending; /* an EXPERTS to send: the spinning loop polls it */
    atomic_bool *loop_spinning; /* the server's flag, or NULL */
    uint64_t spin_ns;        /* EXTERNAL_SPIN_NS, or 0 on one core */
    bool spin_on;            /* the process may use 3 cores: spin while the loop spins */

    /* engine worker thread only: scratch grown as needed (host, or ops memory: _ops) */
    int32_t *ids; size_t ids_cap;                 /* the records' top-k ids (pinned) */
    int32_t *row_of; size_t row_of_cap;
    uint32_t *first_row;
    float *scales_stage; size_t scales_cap;       /* host fp8_per_tensor: the rows' own scales */
    scratch_t row_of_ops, in_ops, y_ops, scales_ops, one_ops; /* device ops */
    char *meta; size_t meta_cap;
    uint64_t log_ns[EPD_EXTERNAL_FAILURE_MAX];
    uint64_t unlogged[EPD_EXTERNAL_FAILURE_MAX];
    uint64_t samples[SAMPLE_MAX][EXTERNAL_SAMPLES]; /* ns */
    uint64_t n_samples;
};

static const char *const input_names[] = {[EPD_EXTERNAL_FP8_GROUP128] = "fp8_group128",
                                          [EPD_EXTERNAL_BF16] = "bf16",
                                          [EPD_EXTERNAL_FP8_PER_TENSOR] = "fp8_per_tensor"};

static void set_handoff(epd_external_t *ext, handoff_t h)
{
    ext->handoff = h;
    atomic_store(&ext->handoff_now, (int)h);
}

static size_t align16(size_t n)
{
    return (n + 15u) & ~(size_t)15u;
}

static void io_layout(const epd_external_t *ext, uint32_t n_rows, io_layout_t *l)
{
    const epd_config_t *cfg = ext->cfg;
    epd_external_input_t input = cfg->experts.external_input;
    size_t n_scales = epd_external_row_scales(&ext->shape, input);

    memset(l, 0, sizeof *l);
    l->x_bytes = (size_t)n_rows * epd_external_row_bytes(&ext->shape, input);
    l->scales_off = align16(l->x_bytes);
    l->scales_bytes = input == EPD_EXTERNAL_FP8_PER_TENSOR ? sizeof(float)
                                                            : (size_t)n_rows * n_scales * 4;
    l->counts_off = align16(l->scales_off + l->scales_bytes);
    l->counts_bytes = (size_t)ext->n_local * sizeof(int32_t);
    l->in_bytes = l->counts_off + l->counts_bytes;
    l->out_bytes = (size_t)n_rows * ext->shape.hidden * 2;
}

/* Grows *p to hold need bytes (contents not kept). */
static bool grow(void **p, size_t *cap, size_t need)
{
    if (need <= *cap) return true;
    void *q = malloc(need);
    if (q == NULL) return false;
    free(*p);
    *p = q;
    *cap = need;
    return true;
}

static void send_cb(evutil_socket_t fd, short what, void *arg);

epd_status_t epd_external_create(const epd_config_t *cfg, uint32_t world, uint32_t rank,
                                 struct event_base *base, const epd_ops_t *ops,
                                 epd_ops_ctx_t *ops_ctx, epd_external_t **ext_p,
                                 char err[EPD_ERR_LEN])
{
    epd_external_t *ext = calloc(1, sizeof *ext);

    *ext_p = NULL;
    if (ext == NULL) goto out_nomem;
    ext->cfg = cfg;
    ext->shape = epd_moe_shape_from_config(cfg, world, rank);
    ext->rank = rank;
    ext->world = world;
    ext->n_local = cfg->model.num_experts / world;
    ext->first_expert = rank * ext->n_local;
    {
        uint64_t per_record = cfg->model.topk < ext->n_local ? cfg->model.topk : ext->n_local;
        uint64_t rows = (uint64_t)cfg->dispatch.max_tokens_per_step * world * per_record;
        if (cfg->experts.external_layout == EPD_EXTERNAL_MASKED)
            rows = (uint64_t)ext->n_local * cfg->experts.external_capacity;
        ext->max_rows = rows > UINT32_MAX ? UINT32_MAX : (uint32_t)rows;
    }
    ext->ops = ops;
    ext->ops_ctx = ops_ctx;
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        int cores = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
        ext->spin_ns = cores < 2 ? 0 : EXTERNAL_SPIN_NS;
        ext->spin_on = cores >= 3;
    }
    ext->first_row = calloc(ext->n_local, sizeof *ext->first_row);
    if (ext->first_row == NULL) goto out_free;
    pthread_mutex_init(&ext->mu, NULL);
    {
        pthread_condattr_t attr;
        pthread_condattr_init(&attr);
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
        pthread_cond_init(&ext->cv, &attr);
        pthread_condattr_destroy(&attr);
    }
    atomic_init(&ext->handoff_now, HANDOFF_NONE);
    atomic_init(&ext->send_pending, false);
    ext->send_ev = event_new(base, -1, 0, send_cb, ext);
    if (ext->send_ev == NULL) {
        epd_external_free(ext);
        goto out_nomem;
    }
    *ext_p = ext;
    return EPD_OK;

out_free:
    free(ext);
out_nomem:
    snprintf(err, EPD_ERR_LEN, "external experts: out of memory");
    return EPD_ERR_NO_MEMORY;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* The median of the first n samples of one kind (sorted in place). */
static double p50_us(uint64_t *s, size_t n)
{
    qsort(s, n, sizeof *s, cmp_u64);
    return n ? (double)s[n / 2] / 1e3 : 0.0;
}

void epd_external_free(epd_external_t *ext)
{
    if (ext == NULL) return;
    size_t n = ext->n_samples < EXTERNAL_SAMPLES ? (size_t)ext->n_samples : EXTERNAL_SAMPLES;
    if (n > 0)
        epd_log_info("external experts: p50 over the last %zu exchanges: EXPERTS written -> "
                     "worker saw it %.1f us; worker sent EXPERTS_DONE -> step resumed %.1f us, "
                     "-> partials formed (combine starts) %.1f us; before the write: rows "
                     "written -> meta built and handed to the loop %.1f us -> written %.1f us; "
                     "EXPERTS_DONE sent -> read by the loop %.1f us", n,
                     p50_us(ext->samples[SAMPLE_SEEN], n), p50_us(ext->samples[SAMPLE_RESUMED], n),
                     p50_us(ext->samples[SAMPLE_FORMED], n), p50_us(ext->samples[SAMPLE_META], n),
                     p50_us(ext->samples[SAMPLE_HANDED], n),
                     p50_us(ext->samples[SAMPLE_DONE_READ], n));
    if (ext->send_ev != NULL) event_free(ext->send_ev);
    epd_region_unref(ext->in);
    epd_region_unref(ext->out);
    free(ext->pending_meta);
    free(ext->scale_layers);
    free(ext->scale_values);
    if (ext->ids != NULL) ext->ops->free_host(ext->ops_ctx, ext->ids);
    free(ext->row_of);
    free(ext->first_row);
    free(ext->scales_stage);
    scratch_t *ops_mem[] = {&ext->row_of_ops, &ext->in_ops, &ext->y_ops, &ext->scales_ops,
                            &ext->one_ops};
    for (size_t i = 0; i < EPD_ARRAY_SIZE(ops_mem); i++)
        if (ops_mem[i]->ptr != NULL) ext->ops->free(ext->ops_ctx, ops_mem[i]->ptr);
    free(ext->meta);
    pthread_cond_destroy(&ext->cv);
    pthread_mutex_destroy(&ext->mu);
    free(ext);
}

/* ---- loop thread -------------------------------------------------------------------------- */

/* A positive finite fp32 input_scale from a JSON number. */
static bool scale_of(const cJSON *v, float *s_p)
{
    if (!cJSON_IsNumber(v)) return false;
    float s = (float)v->valuedouble;
    if (!isfinite(s) || !(s > 0.0f)) return false;
    *s_p = s;
    return true;
}

/* "input_scale": a number for every layer, or {"<layer>": number, ...}; absent: the step scale. */
static epd_status_t parse_input_scale(const cJSON *v, float *all_p, uint32_t **layers_p,
                                      float **values_p, size_t *n_p, char err[EPD_ERR_LEN])
{
    *all_p = 0.0f;
    *layers_p = NULL;
    *values_p = NULL;
    *n_p = 0;
    if (v == NULL) return EPD_OK;
    if (cJSON_IsNumber(v)) {
        if (scale_of(v, all_p)) return EPD_OK;
    } else if (cJSON_IsObject(v)) {
        size_t n = (size_t)cJSON_GetArraySize(v);
        uint32_t *layers = calloc(n ? n : 1, sizeof *layers);
        float *values = calloc(n ? n : 1, sizeof *values);
        size_t i = 0;
        bool ok = layers != NULL && values != NULL;
        for (const cJSON *item = v->child; ok && item != NULL; item = item->next, i++) {
            char *end = NULL;
            errno = 0;
            unsigned long layer = strtoul(item->string, &end, 10);
            ok = item->string[0] >= '0' && item->string[0] <= '9' && *end == '\0' &&
                 errno == 0 && layer <= UINT32_MAX && scale_of(item, &values[i]);
            layers[i] = (uint32_t)layer;
        }
        if (ok) {
            *layers_p = layers;
            *values_p = values;
            *n_p = n;
            return EPD_OK;
        }
        free(layers);
        free(values);
    }
    snprintf(err, EPD_ERR_LEN, "serve_experts: \"input_scale\" must be a positive finite number "
             "(every layer's S) or an object {\"<layer>\": S, ...}");
    return EPD_ERR_BAD_REGION;
}

epd_status_t epd_external_attach(epd_external_t *ext, epd_conn_t *conn, epd_region_t *in,
                                 epd_region_t *out, const cJSON *meta, char **reply_p,
                                 char err[EPD_ERR_LEN])
{
    const epd_config_t *cfg = ext->cfg;
    uint64_t in_id = 0, out_id = 0;
    float all;
    uint32_t *layers;
    float *values;
    size_t n;
    io_layout_t max;

    if (in == out) {
        snprintf(err, EPD_ERR_LEN, "serve_experts: the input and the output must be two regions");
        return EPD_ERR_BAD_REGION;
    }
    if ((epd_region_device(in) || epd_region_device(out)) && !ext->ops->device_memory) {
        snprintf(err, EPD_ERR_LEN, "serve_experts: device regions need a CUDA daemon");
        return EPD_ERR_BAD_REGION;
    }
    epd_status_t status = parse_input_scale(cJSON_GetObjectItemCaseSensitive(meta, "input_scale"),
                                            &all, &layers, &values, &n, err);
    if (status != EPD_OK) return status;
    if (cfg->experts.external_input != EPD_EXTERNAL_FP8_PER_TENSOR && (all > 0.0f || n > 0)) {
        free(layers);
        free(values);
        snprintf(err, EPD_ERR_LEN, "serve_experts: \"input_scale\" is for experts.external_input "
                 "= fp8_per_tensor (this daemon's is %s)", input_names[cfg->experts.external_input]);
        return EPD_ERR_BAD_REGION;
    }
    (void)epd_json_to_u64(cJSON_GetObjectItemCaseSensitive(meta, "input"), &in_id);
    (void)epd_json_to_u64(cJSON_GetObjectItemCaseSensitive(meta, "output"), &out_id);

    pthread_mutex_lock(&ext->mu);
    if (ext->worker != NULL) {
        epd_conn_t *have = ext->worker;
        pid_t pid = ext->worker_pid;
        pthread_mutex_unlock(&ext->mu);
        free(layers);
        free(values);
        snprintf(err, EPD_ERR_LEN, "rank %u already has an expert worker (conn %" PRIu64
                 ", pid %ld); a rank serves one: retry once it has gone", ext->rank,
                 epd_conn_id(have), (long)pid);
        return EPD_ERR_BUSY;
    }
    epd_region_ref(in);
    epd_region_ref(out);
    ext->worker = conn;
    ext->worker_gen++;
    ext->worker_pid = epd_conn_pid(conn);
    ext->in = in;
    ext->out = out;
    ext->in_id = (uint32_t)in_id;
    ext->out_id = (uint32_t)out_id;
    ext->scale_all = all;
    free(ext->scale_layers);
    free(ext->scale_values);
    ext->scale_layers = layers;
    ext->scale_values = values;
    ext->n_layer_scales = n;
    ext->late_step = 0;
    pthread_mutex_unlock(&ext->mu);

    io_layout(ext, ext->max_rows, &max);
    char text[768];
    snprintf(text, sizeof text,
             "{\"rank\":%u,\"first_expert\":%u,\"experts\":%u,\"hidden\":%u,\"input\":\"%s\","
             "\"layout\":\"%s\",\"capacity\":%u,\"max_rows\":%u,\"input_bytes\":%zu,"
             "\"output_bytes\":%zu,\"timeout_ms\":%u}",
             ext->rank, ext->first_expert, ext->n_local, cfg->model.hidden,
             input_names[cfg->experts.external_input],
             cfg->experts.external_layout == EPD_EXTERNAL_MASKED ? "masked" : "packed",
             cfg->experts.external_capacity, ext->max_rows, max.in_bytes, max.out_bytes,
             cfg->experts.external_timeout_ms);
    epd_log_info("rank %u: expert worker attached (conn %" PRIu64 ", pid %ld): input region %"
                 PRIu64 " (%" PRIu64 " bytes, %s), output region %" PRIu64 " (%" PRIu64
                 " bytes, %s); a step needs up to %zu and %zu", ext->rank, epd_conn_id(conn),
                 (long)ext->worker_pid, in_id, epd_region_bytes(in),
                 epd_region_device(in) ? "device" : "host", out_id, epd_region_bytes(out),
                 epd_region_device(out) ? "device" : "host", max.in_bytes, max.out_bytes);
    *reply_p = strdup(text);
    if (*reply_p == NULL) {
        snprintf(err, EPD_ERR_LEN, "out of memory");
        return EPD_ERR_INTERNAL;
    }
    return EPD_OK;
}

void epd_external_detach(epd_external_t *ext, epd_conn_t *conn)
{
    pthread_mutex_lock(&ext->mu);
    if (ext->worker != conn) {
        pthread_mutex_unlock(&ext->mu);
        return;
    }
    epd_region_t *in = ext->in, *out = ext->out;
    bool waiting = ext->handoff == HANDOFF_TO_SEND || ext->handoff == HANDOFF_SENT;
    uint64_t step = ext->pending_step;
    ext->worker = NULL;
    ext->in = ext->out = NULL;
    ext->late_step = 0;
    if (waiting) {
        set_handoff(ext, HANDOFF_GONE);
        pthread_cond_signal(&ext->cv);
    }
    pthread_mutex_unlock(&ext->mu);
    if (waiting)
        epd_log_warn("rank %u: the expert worker (conn %" PRIu64 ") left during step %" PRIu64
                     ": its partials are zero, its requests get experts_unavailable", ext->rank,
                     epd_conn_id(conn), step);
    else
        epd_log_info("rank %u: the expert worker (conn %" PRIu64 ") left; a new one may attach",
                     ext->rank, epd_conn_id(conn));
    /* a step using them holds its own references */
    epd_region_unref(in);
    epd_region_unref(out);
}

void epd_external_set_loop(epd_external_t *ext, atomic_bool *spinning)
{
    ext->loop_spinning = spinning;
}

void epd_external_poll(epd_external_t *ext)
{
    if (atomic_load(&ext->send_pending)) send_cb(-1, 0, ext);
}

/* The EXPERTS of the waiting step go to the worker (activated by the engine's worker thread, or
 * found by the spinning loop). */
static void send_cb(evutil_socket_t fd, short what, void *arg)
{
    epd_external_t *ext = arg;
    char tail[48];

    if (!atomic_exchange(&ext->send_pending, false)) return;

    pthread_mutex_lock(&ext->mu);
    if (ext->handoff != HANDOFF_TO_SEND) {
        pthread_mutex_unlock(&ext->mu);
        return;
    }
    epd_conn_t *conn = ext->worker;
    char *meta = ext->pending_meta;
    ext->pending_meta = NULL;
    if (conn == NULL) {
        set_handoff(ext, HANDOFF_GONE);
        pthread_cond_signal(&ext->cv);
        pthread_mutex_unlock(&ext->mu);
        free(meta);
        return;
    }
    set_handoff(ext, HANDOFF_SENT);
    /* taken before the write (the answer may come before this thread runs again) */
    uint64_t now = epd_now_ns();
    ext->sent_ns = now;
    pthread_mutex_unlock(&ext->mu);

    snprintf(tail, sizeof tail, ",\"sent_ns\":%" PRIu64 "}", now);
    strcat(meta, tail); /* room was made for it */
    epd_status_t status = epd_conn_send_text(conn, EPD_FRAME_EXPERTS, meta);
    free(meta);
    pthread_mutex_lock(&ext->mu);
    if (status != EPD_OK && ext->handoff == HANDOFF_SENT) {
        /* the connection is closing: it will detach; the step need not wait for that */
        set_handoff(ext, HANDOFF_GONE);
        pthread_cond_signal(&ext->cv);
    }
    pthread_mutex_unlock(&ext->mu);
}

/* An optional exact integer of a meta (0 when absent or not one). */
static uint64_t meta_u64(const cJSON *meta, const char *key)
{
    uint64_t v = 0;
    return epd_json_to_u64(cJSON_GetObjectItemCaseSensitive(meta, key), &v) ? v : 0;
}

epd_status_t epd_external_done(epd_external_t *ext, epd_conn_t *conn, const epd_frame_t *frame,
                               char err[EPD_ERR_LEN])
{
    uint64_t now = epd_now_ns();
    uint64_t step;

    if (!epd_json_to_u64(cJSON_GetObjectItemCaseSensitive(frame->meta, "step"), &step)) {
        snprintf(err, EPD_ERR_LEN, "EXPERTS_DONE needs \"step\", the step of the EXPERTS it "
                 "answers");
        return EPD_ERR_BAD_JSON;
    }
    pthread_mutex_lock(&ext->mu);
    if (ext->worker != conn) {
        pthread_mutex_unlock(&ext->mu);
        snprintf(err, EPD_ERR_LEN, "EXPERTS_DONE from a connection that does not serve this "
                 "rank's experts (CONTROL serve_experts first)");
        return EPD_ERR_BAD_TYPE;
    }
    if (ext->handoff == HANDOFF_SENT && step == ext->pending_step) {
        ext->done_read_ns = now;
        ext->seen_ns = meta_u64(frame->meta, "seen_ns");
        ext->done_ns = meta_u64(frame->meta, "done_ns");
        set_handoff(ext, HANDOFF_DONE);
        pthread_cond_signal(&ext->cv);
        pthread_mutex_unlock(&ext->mu);
        return EPD_OK;
    }
    if (ext->late_step != 0 && step == ext->late_step) {
        ext->late_step = 0;
        pthread_mutex_unlock(&ext->mu);
        epd_log_info("rank %u: the expert worker answered step %" PRIu64 " late; it serves the "
                     "next steps again", ext->rank, step);
        return EPD_OK;
    }
    uint64_t given = ext->handoff == HANDOFF_SENT ? ext->pending_step : ext->late_step;
    pthread_mutex_unlock(&ext->mu);
    if (given != 0)
        snprintf(err, EPD_ERR_LEN, "EXPERTS_DONE for step %" PRIu64 ", but the worker was "
                 "given step %" PRIu64, step, given);
    else
        snprintf(err, EPD_ERR_LEN, "EXPERTS_DONE for step %" PRIu64 ", but no EXPERTS is "
                 "outstanding", step);
    return EPD_ERR_BAD_JSON;
}

/* ---- engine worker thread ----------------------------------------------------------------- */

/* Logs a failure of the rank in step `step` (the first of each kind, then once a second). */
static void log_failure(epd_external_t *ext, uint8_t code, uint64_t step, const char *detail)
{
    uint64_t now = epd_now_ns();

    if (ext->log_ns[code] != 0 && now - ext->log_ns[code] < EXTERNAL_LOG_NS) {
        ext->unlogged[code]++;
        return;
    }
    char more[96] = "";
    if (ext->unlogged[code] > 0)
        snprintf(more, sizeof more, " (and %" PRIu64 " earlier steps since the last such line)",
                 ext->unlogged[code]);
    epd_log_warn("rank %u step %" PRIu64 ": %s%s%s: its partials are zero and the requests whose "
                 "tokens reached its experts get experts_unavailable%s", ext->rank, step,
                 epd_external_failure_text(code), detail[0] ? ": " : "", detail, more);
    ext->log_ns[code] = now;
    ext->unlogged[code] = 0;
}

/* The static S of layer, or 0 (the step scale). */
static float static_scale(const epd_external_t *ext, uint32_t layer)
{
    for (size_t i = 0; i < ext->n_layer_scales; i++)
        if (ext->scale_layers[i] == layer) return ext->scale_values[i];
    return ext->scale_all;
}

/* S of a step's fp8_per_tensor rows, the one place it is decided: the worker's static scale of
 * the layer, else the step scale (the largest scale of the records this rank received), which
 * the count exchange carries (step_scale, the engine turns the exchange on for this input).
 * 0 where neither is known (a BF16 wire sends no scales): the requantization then reduces it
 * over the rows itself (host: epd_requant_step_scale_host, CUDA: epd_requant_cuda's). */
static float per_tensor_scale(const epd_external_t *ext, uint32_t layer, float step_scale)
{
    float s = static_scale(ext, layer);
    return s > 0.0f ? s : step_scale;
}

#ifdef EPD_HAVE_CUDA
/* Grows ops memory to need bytes (contents not kept). */
static bool grow_ops(epd_external_t *ext, scratch_t *m, size_t need)
{
    if (need <= m->cap) return true;
    if (m->ptr != NULL) ext->ops->free(ext->ops_ctx, m->ptr);
    m->ptr = ext->ops->alloc(ext->ops_ctx, need);
    m->cap = m->ptr != NULL ? need : 0;
    return m->ptr != NULL;
}
#endif

/* Host ops: writes the planned rows in the configured format into in (host memory laid out as
 * l), with the fp8 formats' scales or S and the counts. *s_p gets S (fp8_per_tensor). */
static epd_status_t write_input_host(epd_external_t *ext, const epd_external_plan_t *plan,
                                     float known_s, const io_layout_t *l, uint8_t *in,
                                     float *s_p, char err[EPD_ERR_LEN])
{
    const epd_moe_shape_t *shape = &ext->shape;
    epd_external_input_t input = ext->cfg->experts.external_input;
    int32_t *counts = (int32_t *)(in + l->counts_off);
    epd_status_t status;

    for (uint32_t e = 0; e < plan->n_local; e++) counts[e] = (int32_t)plan->expert_rows[e];
    if (input != EPD_EXTERNAL_FP8_PER_TENSOR)
        return epd_external_gather_host(shape, plan, in + l->x_off,
                                        (float *)(in + l->scales_off), err);

    /* fp8_per_tensor: the rows as dispatched, then requantized in place to S */
    epd_scale_kind_t kind = epd_external_scale_kind(shape);
    size_t n_scales = epd_quant_n_scales(shape->hidden, kind);
    if (!grow((void **)&ext->scales_stage, &ext->scales_cap,
              (size_t)plan->n_rows * n_scales * sizeof(float) + 16)) {
        snprintf(err, EPD_ERR_LEN, "external experts: out of host memory");
        return EPD_ERR_NO_MEMORY;
    }
    status = epd_external_gather_host(shape, plan, in + l->x_off, ext->scales_stage, err);
    if (status != EPD_OK) return status;
    /* packed: one run of every row; masked: the experts' blocks of capacity rows */
    bool masked = plan->layout == EPD_EXTERNAL_MASKED;
    int32_t all = (int32_t)plan->n_rows;
    status = epd_requant_host(in + l->x_off, ext->scales_stage, masked ? counts : &all,
                              masked ? plan->n_local : 1, masked ? plan->capacity : plan->n_rows,
                              shape->hidden, kind, known_s, in + l->x_off, s_p, err);
    if (status != EPD_OK) return status;
    memcpy(in + l->scales_off, s_p, sizeof *s_p);
    return EPD_OK;
}

#ifdef EPD_HAVE_CUDA
/* Device ops: the same into in (device memory laid out as l), on the ops' stream, complete on
 * return (the EXPERTS follows). */
static epd_status_t write_input_cuda(epd_external_t *ext, const epd_external_plan_t *plan,
                                     float known_s, const io_layout_t *l, uint8_t *in,
                                     float *s_p, char err[EPD_ERR_LEN])
{
    const epd_moe_shape_t *shape = &ext->shape;
    epd_external_input_t input = ext->cfg->experts.external_input;
    void *stream = ext->ops->stream(ext->ops_ctx);
    int32_t counts[EXTERNAL_MAX_LOCAL];
    epd_status_t status;

    for (uint32_t e = 0; e < plan->n_local; e++) counts[e] = (int32_t)plan->expert_rows[e];
    CHECK_GOTO(ext->ops->copy_to_ops(ext->ops_ctx, in + l->counts_off, counts,
                                     plan->n_local * sizeof(int32_t)), copy_failed);
    if (input != EPD_EXTERNAL_FP8_PER_TENSOR) {
        status = epd_external_gather_cuda(shape, plan, in + l->x_off,
                                          (float *)(in + l->scales_off), stream, err);
        if (status != EPD_OK) return status;
        return ext->ops->sync(ext->ops_ctx);
    }
    epd_scale_kind_t kind = epd_external_scale_kind(shape);
    size_t n_scales = epd_quant_n_scales(shape->hidden, kind);
    if (!grow_ops(ext, &ext->scales_ops, (size_t)plan->n_rows * n_scales * sizeof(float) + 16) ||
        !grow_ops(ext, &ext->one_ops, 16)) {
        snprintf(err, EPD_ERR_LEN, "external experts: out of device memory");
        return EPD_ERR_NO_MEMORY;
    }
    status = epd_external_gather_cuda(shape, plan, in + l->x_off, ext->scales_ops.ptr, stream,
                                      err);
    if (status != EPD_OK) return status;
    bool masked = plan->layout == EPD_EXTERNAL_MASKED;
    int32_t all = (int32_t)plan->n_rows;
    if (known_s > 0.0f) {
        /* S known: the layout-aware requant, its live rows from the host counts (no reduction,
         * no counts read on the device), and S into the region behind it */
        status = epd_requant_given_cuda(in + l->x_off, ext->scales_ops.ptr, masked ? counts : &all,
                                        masked ? plan->n_local : 1,
                                        masked ? plan->capacity : plan->n_rows, shape->hidden,
                                        kind, known_s, in + l->x_off, NULL, stream, err);
        if (status != EPD_OK) return status;
        CHECK_GOTO(ext->ops->copy_queued != NULL
                       ? ext->ops->copy_queued(ext->ops_ctx, in + l->scales_off, &known_s,
                                               sizeof known_s)
                       : ext->ops->copy_to_ops(ext->ops_ctx, in + l->scales_off, &known_s,
                                               sizeof known_s),
                   copy_failed);
        CHECK_GOTO(ext->ops->sync(ext->ops_ctx), copy_failed);
        *s_p = known_s;
        return EPD_OK;
    }
    if (!masked)
        CHECK_GOTO(ext->ops->copy_to_ops(ext->ops_ctx, ext->one_ops.ptr, &all, sizeof all),
                   copy_failed);
    /* S unknown (a BF16 wire): reduced over the rows on the device, then the requant */
    const int32_t *live = masked ? (const int32_t *)(in + l->counts_off) : ext->one_ops.ptr;
    status = epd_requant_cuda(in + l->x_off, ext->scales_ops.ptr, live, masked ? plan->n_local : 1,
                              masked ? plan->capacity : plan->n_rows, shape->hidden, kind, 0.0f,
                              in + l->x_off, (float *)(in + l->scales_off), NULL, stream, err);
    if (status != EPD_OK) return status;
    CHECK_GOTO(ext->ops->sync(ext->ops_ctx), copy_failed);
    CHECK_GOTO(ext->ops->copy_to_host(ext->ops_ctx, s_p, in + l->scales_off, sizeof *s_p),
               copy_failed);
    return EPD_OK;
copy_failed:
    snprintf(err, EPD_ERR_LEN, "external experts: a device copy failed: %s",
             ext->ops->last_error != NULL ? ext->ops->last_error(ext->ops_ctx) : "");
    return status;
}
#endif

/* The rows, into the input region: the records' ids to the host, the row of each (record,
 * slot), then the rows themselves in the configured format (through device staging when the
 * ops are a device's and the region is host memory). *s_p gets S. */
static epd_status_t write_input(epd_external_t *ext, epd_external_plan_t *plan,
                                const epd_moe_shape_t *shape, epd_region_t *in, float known_s,
                                const io_layout_t *l, float *s_p, char err[EPD_ERR_LEN])
{
    size_t n_ids = (size_t)plan->n_records * shape->topk;
    epd_status_t status;

    if (n_ids * sizeof(int32_t) > ext->ids_cap) {
        if (ext->ids != NULL) ext->ops->free_host(ext->ops_ctx, ext->ids);
        ext->ids = ext->ops->alloc_host(ext->ops_ctx, n_ids * sizeof(int32_t));
        ext->ids_cap = ext->ids != NULL ? n_ids * sizeof(int32_t) : 0;
    }
    if (ext->ids == NULL ||
        !grow((void **)&ext->row_of, &ext->row_of_cap, n_ids * sizeof(int32_t))) {
        snprintf(err, EPD_ERR_LEN, "external experts: out of host memory");
        return EPD_ERR_NO_MEMORY;
    }
    if (!ext->ops->device_memory) {
        epd_external_ids_host(shape, plan, ext->ids);
        status = epd_external_map(shape, plan, ext->ids, ext->row_of, err);
        if (status != EPD_OK) return status;
        plan->row_of = ext->row_of;
        return write_input_host(ext, plan, known_s, l, epd_region_base(in), s_p, err);
    }
#ifdef EPD_HAVE_CUDA
    status = epd_external_ids_cuda(shape, plan, ext->ids, ext->ops->stream(ext->ops_ctx), err);
    if (status == EPD_OK) status = ext->ops->sync(ext->ops_ctx);
    if (status == EPD_OK) status = epd_external_map(shape, plan, ext->ids, ext->row_of, err);
    if (status != EPD_OK) return status;
    if (!grow_ops(ext, &ext->row_of_ops, n_ids * sizeof(int32_t) + 16) ||
        ext->ops->copy_to_ops(ext->ops_ctx, ext->row_of_ops.ptr, ext->row_of,
                              n_ids * sizeof(int32_t)) != EPD_OK) {
        snprintf(err, EPD_ERR_LEN, "external experts: the rows' map to the device failed");
        return EPD_ERR_CUDA;
    }
    plan->row_of = ext->row_of_ops.ptr;
    bool staged = !epd_region_device(in);
    if (staged && !grow_ops(ext, &ext->in_ops, l->in_bytes + 16)) {
        snprintf(err, EPD_ERR_LEN, "external experts: out of device memory to stage %zu bytes",
                 l->in_bytes);
        return EPD_ERR_NO_MEMORY;
    }
    uint8_t *dst = staged ? ext->in_ops.ptr : epd_region_base(in);
    status = write_input_cuda(ext, plan, known_s, l, dst, s_p, err);
    if (status == EPD_OK && staged)
        status = ext->ops->copy_to_host(ext->ops_ctx, epd_region_base(in), dst, l->in_bytes);
    return status;
#else
    snprintf(err, EPD_ERR_LEN, "external experts: device ops in a build without CUDA");
    return EPD_ERR_UNSUPPORTED;
#endif
}

/* Every record's partial from the worker's outputs in region out (zero_only: zeros, out may be
 * NULL): on the host, or queued on the device ops' stream (the step syncs before the combine
 * moves them). */
static epd_status_t form_partials(epd_external_t *ext, const epd_external_plan_t *plan,
                                  const epd_moe_shape_t *shape, epd_region_t *out,
                                  const io_layout_t *l, bool zero_only, char err[EPD_ERR_LEN])
{
    const uint16_t *y = out != NULL ? (const uint16_t *)epd_region_base(out) : NULL;

    if (!ext->ops->device_memory) return epd_external_partials_host(shape, plan, y, zero_only, err);
#ifdef EPD_HAVE_CUDA
    if (!zero_only && !epd_region_device(out)) {
        if (!grow_ops(ext, &ext->y_ops, l->out_bytes + 16) ||
            ext->ops->copy_to_ops(ext->ops_ctx, ext->y_ops.ptr, y, l->out_bytes) != EPD_OK) {
            snprintf(err, EPD_ERR_LEN, "external experts: the outputs to the device failed");
            return EPD_ERR_CUDA;
        }
        y = ext->y_ops.ptr;
    }
    return epd_external_partials_cuda(shape, plan, y, zero_only, ext->ops->stream(ext->ops_ctx),
                                      err);
#else
    snprintf(err, EPD_ERR_LEN, "external experts: device ops in a build without CUDA");
    return EPD_ERR_UNSUPPORTED;
#endif
}

/* The EXPERTS meta is written by hand into a buffer sized for it (build_meta): one snprintf a
 * count made the counts of 256 experts most of the hand-over's time. These return the end of
 * what they wrote. */
static char *put_text(char *p, const char *text)
{
    size_t n = strlen(text);
    memcpy(p, text, n);
    return p + n;
}

static char *put_u64(char *p, uint64_t v)
{
    char digits[20];
    int d = 0;
    do {
        digits[d++] = (char)('0' + v % 10u);
        v /= 10u;
    } while (v != 0);
    while (d > 0) *p++ = digits[--d];
    return p;
}

/* ,"name":{"dtype":"dtype","shape":[lead..., last],"region":region,"offset":offset} (no comma
 * before the first tensor: first). */
static char *put_tensor(char *p, bool first, const char *name, const char *dtype,
                        const uint32_t *lead, int n_lead, uint64_t last, uint32_t region,
                        uint64_t offset)
{
    p = put_text(p, first ? "\"" : ",\"");
    p = put_text(p, name);
    p = put_text(p, "\":{\"dtype\":\"");
    p = put_text(p, dtype);
    p = put_text(p, "\",\"shape\":[");
    for (int i = 0; i < n_lead; i++) {
        p = put_u64(p, lead[i]);
        *p++ = ',';
    }
    p = put_u64(p, last);
    p = put_text(p, "],\"region\":");
    p = put_u64(p, region);
    p = put_text(p, ",\"offset\":");
    p = put_u64(p, offset);
    *p++ = '}';
    return p;
}

/* The EXPERTS meta, without its closing brace (the loop thread appends sent_ns). */
static bool build_meta(epd_external_t *ext, uint64_t step, uint32_t layer,
                       const epd_external_plan_t *plan, const io_layout_t *l, float s,
                       uint32_t in_id, uint32_t out_id)
{
    const epd_config_t *cfg = ext->cfg;
    epd_external_input_t input = cfg->experts.external_input;
    bool masked = plan->layout == EPD_EXTERNAL_MASKED;
    uint32_t H = ext->shape.hidden;
    /* the fixed text and its numbers, then at most 10 digits and a comma per count */
    size_t need = 1024 + (size_t)plan->n_local * 11;
    /* the rows' leading dimensions: [rows] packed, [experts, capacity] masked */
    uint32_t lead[2] = {masked ? plan->n_local : plan->n_rows, plan->capacity};
    int n_lead = masked ? 2 : 1;

    if (!grow((void **)&ext->meta, &ext->meta_cap, need)) return false;
    char *p = ext->meta;
    p = put_text(p, "{\"step\":");
    p = put_u64(p, step);
    p = put_text(p, ",\"layer\":");
    p = put_u64(p, layer);
    p = put_text(p, ",\"first_expert\":");
    p = put_u64(p, plan->first_expert);
    p = put_text(p, ",\"input\":\"");
    p = put_text(p, input_names[input]);
    p = put_text(p, masked ? "\",\"layout\":\"masked\",\"rows\":"
                           : "\",\"layout\":\"packed\",\"rows\":");
    p = put_u64(p, plan->n_rows);
    p = put_text(p, ",\"counts\":[");
    for (uint32_t e = 0; e < plan->n_local; e++) {
        if (e > 0) *p++ = ',';
        p = put_u64(p, plan->expert_rows[e]);
    }
    p = put_text(p, "],");
    if (input == EPD_EXTERNAL_FP8_PER_TENSOR)
        p += snprintf(p, 48, "\"scale\":%.9g,", (double)s); /* %.9g: the float exactly */
    p = put_text(p, "\"tensors\":{");
    p = put_tensor(p, true, "x", input == EPD_EXTERNAL_BF16 ? "bf16" : "f8_e4m3", lead, n_lead, H,
                   in_id, l->x_off);
    if (input == EPD_EXTERNAL_FP8_GROUP128)
        p = put_tensor(p, false, "scales", "f32", lead, n_lead,
                       epd_external_row_scales(&ext->shape, input), in_id, l->scales_off);
    else if (input == EPD_EXTERNAL_FP8_PER_TENSOR)
        p = put_tensor(p, false, "scale", "f32", NULL, 0, 1, in_id, l->scales_off);
    p = put_tensor(p, false, "counts", "i32", NULL, 0, plan->n_local, in_id, l->counts_off);
    p = put_tensor(p, false, "y", "bf16", lead, n_lead, H, out_id, 0);
    *p++ = '}';
    *p = '\0';
    return (size_t)(p - ext->meta) + 48 < need;
}

/* Waits for the answer to the step handed over (mu held on entry and return): DONE, GONE, or
 * NONE after a timeout (the step is then late). */
static handoff_t wait_answer(epd_external_t *ext)
{
    uint64_t start = epd_now_ns();
    uint64_t timeout_ns = (uint64_t)ext->cfg->experts.external_timeout_ms * 1000000u;
    uint64_t hot_ns = (uint64_t)ext->cfg->dispatch.hot_ms * 1000000u;

    /* spin first (see EXTERNAL_SPIN_NS): an answer within it is seen without a wake-up */
    pthread_mutex_unlock(&ext->mu);
    for (;;) {
        int h = atomic_load(&ext->handoff_now);
        if (h == HANDOFF_DONE || h == HANDOFF_GONE) break;
        uint64_t waited = epd_now_ns() - start;
        if (waited >= timeout_ns) break;
        if (waited < ext->spin_ns) continue;
        if (ext->spin_on && waited < hot_ns && ext->loop_spinning != NULL &&
            atomic_load(ext->loop_spinning))
            continue;
        break;
    }
    pthread_mutex_lock(&ext->mu);
    uint64_t due = start + timeout_ns;
    struct timespec ts = {(time_t)(due / 1000000000u), (long)(due % 1000000000u)};
    while (ext->handoff == HANDOFF_TO_SEND || ext->handoff == HANDOFF_SENT) {
        if (pthread_cond_timedwait(&ext->cv, &ext->mu, &ts) == ETIMEDOUT) {
            if (ext->handoff == HANDOFF_TO_SEND || ext->handoff == HANDOFF_SENT) {
                free(ext->pending_meta);
                ext->pending_meta = NULL;
                set_handoff(ext, HANDOFF_NONE);
                ext->late_step = ext->pending_step;
                return HANDOFF_NONE;
            }
        }
    }
    return ext->handoff;
}

/* Keeps one exchange's legs (SAMPLE_*, ns). */
static void keep_sample(epd_external_t *ext, const uint64_t legs[SAMPLE_MAX])
{
    size_t i = (size_t)(ext->n_samples++ % EXTERNAL_SAMPLES);
    for (size_t k = 0; k < SAMPLE_MAX; k++) ext->samples[k][i] = legs[k];
}

epd_status_t epd_external_run(void *arg, uint64_t step, const epd_moe_shape_t *shape,
                              const epd_step_experts_t *call, uint8_t *failure_p,
                              char err[EPD_ERR_LEN])
{
    epd_external_t *ext = arg;
    const epd_config_t *cfg = ext->cfg;
    epd_external_plan_t plan;
    io_layout_t l = {0};
    uint8_t failure = EPD_EXTERNAL_SERVED;
    char detail[EPD_ERR_LEN] = "";
    epd_status_t status = EPD_OK;
    epd_region_t *in = NULL, *out = NULL;

    *failure_p = EPD_EXTERNAL_SERVED;
    /* no record reached this rank: nothing for the worker (no EXPERTS is sent) */
    if (call->n_records == 0) return EPD_OK;
    ext->shape.layer = shape->layer;

    memset(&plan, 0, sizeof plan);
    plan.input = cfg->experts.external_input;
    plan.layout = cfg->experts.external_layout;
    plan.capacity = cfg->experts.external_capacity;
    plan.n_local = ext->n_local;
    plan.first_expert = ext->first_expert;
    plan.n_segments = call->n_segments;
    memcpy(plan.segments, call->segments, sizeof plan.segments);
    plan.n_records = call->n_records;
    plan.expert_rows = call->expert_rows;
    plan.first_row = ext->first_row;

    if (epd_external_plan_rows(&plan, detail) != EPD_OK) {
        failure = EPD_EXTERNAL_TOO_SMALL;
        goto zero;
    }
    io_layout(ext, plan.n_rows, &l);

    pthread_mutex_lock(&ext->mu);
    uint64_t gen = ext->worker_gen;
    float known_s = per_tensor_scale(ext, shape->layer, call->scale);
    uint32_t in_id = ext->in_id, out_id = ext->out_id;
    if (ext->worker == NULL) {
        failure = EPD_EXTERNAL_NO_WORKER;
    } else if (ext->late_step != 0) {
        failure = EPD_EXTERNAL_LATE;
        snprintf(detail, sizeof detail, "step %" PRIu64, ext->late_step);
    } else {
        in = ext->in;
        out = ext->out;
        epd_region_ref(in);
        epd_region_ref(out);
    }
    pthread_mutex_unlock(&ext->mu);
    if (failure != EPD_EXTERNAL_SERVED) goto zero;
    if (epd_region_bytes(in) < l.in_bytes || epd_region_bytes(out) < l.out_bytes) {
        failure = EPD_EXTERNAL_TOO_SMALL;
        snprintf(detail, sizeof detail, "%u rows need %zu input and %zu output bytes, the "
                 "regions hold %" PRIu64 " and %" PRIu64, plan.n_rows, l.in_bytes, l.out_bytes,
                 epd_region_bytes(in), epd_region_bytes(out));
        goto zero;
    }

    /* the rows, into the input region */
    float s = 0.0f;
    status = write_input(ext, &plan, shape, in, known_s, &l, &s, detail);
    if (status == EPD_ERR_CUDA) {
        snprintf(err, EPD_ERR_LEN, "%s", detail); /* the device failed: the step fails */
        goto out;
    }
    if (status != EPD_OK) {
        status = EPD_OK;
        failure = EPD_EXTERNAL_FAILED;
        goto zero;
    }
    uint64_t rows_ns = epd_now_ns();
    if (!build_meta(ext, step, shape->layer, &plan, &l, s, in_id, out_id)) {
        failure = EPD_EXTERNAL_FAILED;
        snprintf(detail, sizeof detail, "out of host memory");
        goto zero;
    }

    /* hand it to the loop thread and wait */
    pthread_mutex_lock(&ext->mu);
    if (ext->worker == NULL || ext->worker_gen != gen) {
        pthread_mutex_unlock(&ext->mu);
        failure = EPD_EXTERNAL_LEFT;
        goto zero;
    }
    ext->pending_step = step;
    free(ext->pending_meta);
    ext->pending_meta = malloc(strlen(ext->meta) + 48);
    if (ext->pending_meta == NULL) {
        pthread_mutex_unlock(&ext->mu);
        failure = EPD_EXTERNAL_FAILED;
        snprintf(detail, sizeof detail, "out of host memory");
        goto zero;
    }
    strcpy(ext->pending_meta, ext->meta);
    set_handoff(ext, HANDOFF_TO_SEND);
    /* pending before spinning is looked at; the loop clears spinning before it polls (both
     * seq_cst, as the server's own wake): one of the two sees the other */
    atomic_store(&ext->send_pending, true);
    uint64_t handed_ns = epd_now_ns();
    if (ext->loop_spinning == NULL || !atomic_load(ext->loop_spinning))
        event_active(ext->send_ev, EV_READ, 0);
    handoff_t got = wait_answer(ext);
    uint64_t sent_ns = ext->sent_ns, seen_ns = ext->seen_ns, done_ns = ext->done_ns;
    uint64_t read_ns = ext->done_read_ns;
    if (got != HANDOFF_NONE) set_handoff(ext, HANDOFF_NONE);
    pthread_mutex_unlock(&ext->mu);
    uint64_t woke_ns = epd_now_ns();
    if (got == HANDOFF_GONE) {
        failure = EPD_EXTERNAL_LEFT;
        goto zero;
    }
    if (got == HANDOFF_NONE) {
        failure = EPD_EXTERNAL_TIMEOUT;
        snprintf(detail, sizeof detail, "%u ms; its answer to this step is still due, until "
                 "then the rank's steps go without it", cfg->experts.external_timeout_ms);
        goto zero;
    }

    /* the partials from the worker's outputs (queued, with device ops: the combine starts) */
    CHECK_GOTO(form_partials(ext, &plan, shape, out, &l, false, err), out);
    uint64_t formed_ns = epd_now_ns();
    if (seen_ns != 0 && done_ns != 0) {
        uint64_t legs[SAMPLE_MAX] = {
            [SAMPLE_SEEN] = seen_ns - sent_ns,       [SAMPLE_RESUMED] = woke_ns - done_ns,
            [SAMPLE_FORMED] = formed_ns - done_ns,   [SAMPLE_META] = handed_ns - rows_ns,
            [SAMPLE_HANDED] = sent_ns - handed_ns,   [SAMPLE_DONE_READ] = read_ns - done_ns};
        keep_sample(ext, legs);
        epd_log_debug("external: rank %u step %" PRIu64 " layer %u: %u rows; EXPERTS written -> "
                      "worker saw it %.1f us, worker ran %.1f us, EXPERTS_DONE sent -> read "
                      "%.1f us -> step resumed %.1f us -> partials %s %.1f us", ext->rank,
                      step, shape->layer, plan.n_rows, (double)(seen_ns - sent_ns) / 1e3,
                      (double)(done_ns - seen_ns) / 1e3, (double)(read_ns - done_ns) / 1e3,
                      (double)(woke_ns - read_ns) / 1e3,
                      ext->ops->device_memory ? "queued" : "formed",
                      (double)(formed_ns - woke_ns) / 1e3);
    }
    goto out;

zero:
    log_failure(ext, failure, step, detail);
    *failure_p = failure;
    status = form_partials(ext, &plan, shape, NULL, &l, true, err);
out:
    epd_region_unref(in);
    epd_region_unref(out);
    return status;
}
