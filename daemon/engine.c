/* The engine (daemon/engine.h): the request queue, the collective agreement (DESIGN.md section 5)
 * and the steps themselves, both on one worker thread, so that after start-up only that thread
 * calls MPI. The loop thread queues requests (under the mutex, waking the worker when it sleeps
 * out a back-off) and takes results (woken by engine->wake). While any rank has seen work within
 * dispatch.hot_ms the worker runs agreements back to back and polls each one without sleeping;
 * after that it waits between agreements, doubling the wait up to dispatch.idle_backoff_us. */
#include <assert.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comm/step.h"
#include "common/clock.h"
#include "daemon/engine.h"
#include "daemon/log.h"
#include "daemon/pinned.h"

/* The largest y a lone request's step writes straight into page-locked host memory. */
#define ENGINE_Y_DIRECT_BYTES (256u * 1024u)

/* First wait after an agreement that found every rank idle; it doubles up to
 * dispatch.idle_backoff_us. */
#define POLL_FAST_US 20u

/* While an agreement waits for its peers it tests MPI_Test back to back when hot on a node with
 * a core per rank. Idle, or hot where ranks outnumber cores, it yields the core between the
 * first WAIT_SPINS tests and then sleeps between tests (a yielding thread still competes for the
 * core; a sleeping one leaves it to the loop threads and the clients). */
#define WAIT_SPINS 16u
#define IDLE_SLEEP_US 50u
#define CROWDED_SLEEP_US 10u

/* A rank alone agrees with itself: no MPI. While hot it waits for a submit on work_arrived (not
 * on the mutex the loop thread takes to submit) for at most SOLO_WAIT_US, then goes round again
 * (hot, shutdown and the queue looked at anew). */
#define SOLO_WAIT_US 200u

/* The contribution of a rank to an agreement, reduced with MPI_MAX. */
enum {
    AGREE_QUEUED = 0, /* tokens queued */
    AGREE_SHUTDOWN,   /* 1: shutdown wanted */
    AGREE_HOT,        /* 1: saw work within dispatch.hot_ms */
    AGREE_LAYER,      /* UINT64_MAX - (smallest layer with queued work), 0 when none */
    AGREE_N
};

/* What the worker is doing, for health and stall detection. */
static const char *const activity_names[EPD_ENGINE_ACTIVITY_MAX] = {
    [EPD_ENGINE_IDLE] = "idle",
    [EPD_ENGINE_AGREEING] = "agreement",
    [EPD_ENGINE_STEPPING] = "step",
    [EPD_ENGINE_STOPPED] = "stopped",
};

struct epd_engine {
    epd_config_t cfg;
    epd_moe_shape_t shape;
    MPI_Comm comm; /* a private duplicate: agreements and count exchanges */
    const epd_ops_t *ops;
    epd_ops_ctx_t *ops_ctx;
    const epd_transport_t *transport;
    epd_transport_ctx_t *transport_ctx;
    epd_step_t *step;
    /* Pinned host staging for one step (ops->alloc_host): the requests' ids, then their
     * weights, are gathered here and go to the device in one copy. */
    uint8_t *stage;
    epd_pinned_pool_t *pinned; /* payloads and results (socket.pinned_bytes) */

    epd_engine_wake_fn wake;
    void *wake_arg;
    bool oversubscribed; /* ranks on this node + the loop threads outnumber its cores */

    pthread_t worker;
    bool worker_started;
    bool worker_joined; /* by epd_engine_stopped or destroy (loop thread) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* under mu */
    epd_request_t *queue_head, *queue_tail;
    uint64_t queued_tokens, queued_requests;
    epd_result_t *results_head, *results_tail;
    /* a submit since the worker last looked: cut the back-off short (set and cleared under mu;
     * a lone rank's hot wait reads it without) */
    atomic_bool work_arrived;
    bool worker_exit;
    epd_engine_stats_t stats;
    epd_engine_step_observer_fn observe; /* set before the first step */
    void *observe_arg;
    uint64_t step_no;
    /* experts.kind external: the experts phase's hook (set once, before the first step) */
    epd_engine_experts_fn experts_fn;
    void *experts_arg;
    const char *(*experts_describe)(uint8_t failure);
    bool experts_external; /* the kind needs the hook */
    bool failed;
    char failure[EPD_ERR_LEN];

    /* worker only */
    uint64_t agree_buf[2 * AGREE_N]; /* sent, then received */
    uint32_t poll_us;

    atomic_int activity;           /* epd_engine_activity_t */
    atomic_uint_fast64_t activity_since_ns;
    atomic_uint_fast64_t last_work_ns; /* last submit accepted or step with work, this rank */
    atomic_bool exiting;           /* destroy wants the worker out, even mid-agreement */
    atomic_bool agreement_open;    /* an MPI_Iallreduce on agree_buf has not completed */
    bool solo;                     /* one rank: agreements without MPI */
    volatile sig_atomic_t shutdown_wanted;
    atomic_bool shutting_down;
    atomic_bool stopped;
};

static uint32_t poll_fast(const epd_engine_t *engine)
{
    uint32_t most = engine->cfg.dispatch.idle_backoff_us;
    return most < POLL_FAST_US ? most : POLL_FAST_US;
}

static void set_activity(epd_engine_t *engine, epd_engine_activity_t activity)
{
    atomic_store(&engine->activity_since_ns, epd_now_ns());
    atomic_store(&engine->activity, (int)activity);
}

void epd_result_free(epd_result_t *result)
{
    if (result == NULL) return;
    epd_pinned_release(result->y);
    free(result);
}

void epd_request_free(epd_request_t *req)
{
    if (req == NULL) return;
    for (size_t i = 0; i < EPD_ARRAY_SIZE(req->regions); i++)
        if (req->regions[i] != NULL) req->unref(req->regions[i]);
    if (req->storage_release != NULL)
        req->storage_release(req->storage);
    else
        free(req->storage);
    free(req->owned);
    if (req->x_copy != NULL) req->x_copy_free(req->x_copy_arg, req->x_copy);
    free(req);
}

void epd_engine_ops(epd_engine_t *engine, const epd_ops_t **ops_p, epd_ops_ctx_t **ops_ctx_p)
{
    *ops_p = engine->ops;
    *ops_ctx_p = engine->ops_ctx;
}

/* ---- the worker ---- */

/* Answers every request of a list with an error (the list and its storage are freed). */
static void answer_error(epd_engine_t *engine, epd_request_t *reqs, epd_status_t code,
                         const char *message, epd_result_t **head_p, epd_result_t **tail_p)
{
    uint64_t now = epd_now_ns();

    while (reqs != NULL) {
        epd_request_t *req = reqs;
        epd_result_t *res = calloc(1, sizeof *res);
        reqs = req->next;
        if (res != NULL) {
            res->id = req->id;
            res->conn_id = req->conn_id;
            res->n_tokens = req->n_tokens;
            res->status = code;
            snprintf(res->message, EPD_ERR_LEN, "%s", message);
            res->latency_ns = now - req->enqueued_ns;
            if (*tail_p != NULL)
                (*tail_p)->next = res;
            else
                *head_p = res;
            *tail_p = res;
        }
        /* without memory for the answer the job is failing anyway: the daemon aborts */
        epd_request_free(req);
    }
}

/* Queues a copy on the ops' stream (complete at the step's next sync; host memory on either side
 * stays as it is until then), or copies at once where the ops have no queued copy. */
static epd_status_t copy_queued(epd_engine_t *engine, void *dst, const void *src, size_t bytes,
                                bool to_host)
{
    const epd_ops_t *ops = engine->ops;

    if (ops->copy_queued != NULL) return ops->copy_queued(engine->ops_ctx, dst, src, bytes);
    return to_host ? ops->copy_to_host(engine->ops_ctx, dst, src, bytes)
                   : ops->copy_to_ops(engine->ops_ctx, dst, src, bytes);
}

/* ---- the experts phase of external experts ---- */

/* The step's hook: the engine's with the step number its RESULTs will carry (worker thread). */
static epd_status_t engine_experts(void *arg, const epd_moe_shape_t *shape,
                                   const epd_step_experts_t *call, uint8_t *failure_p,
                                   char err[EPD_ERR_LEN])
{
    epd_engine_t *engine = arg;
    return engine->experts_fn(engine->experts_arg, engine->step_no + 1, shape, call, failure_p,
                              err);
}

void epd_engine_set_experts(epd_engine_t *engine, epd_engine_experts_fn fn, void *arg,
                            const char *(*describe)(uint8_t failure))
{
    pthread_mutex_lock(&engine->mu);
    engine->experts_fn = fn;
    engine->experts_arg = arg;
    engine->experts_describe = describe;
    epd_step_set_experts_hook(engine->step, fn != NULL ? engine_experts : NULL, engine);
    pthread_cond_broadcast(&engine->cv);
    pthread_mutex_unlock(&engine->mu);
}

/* An external kind's step waits for its hook (set right after create; every rank must call the
 * step's exchange of failures). False when destroy asked the worker to leave first. */
static bool experts_ready(epd_engine_t *engine)
{
    if (!engine->experts_external) return true;
    pthread_mutex_lock(&engine->mu);
    while (engine->experts_fn == NULL && !engine->worker_exit)
        pthread_cond_wait(&engine->cv, &engine->mu);
    bool ready = engine->experts_fn != NULL;
    pthread_mutex_unlock(&engine->mu);
    return ready;
}

/* The rank whose experts failed in the last step that req's tokens reached, or -1. */
static int experts_failed_rank(const epd_engine_t *engine, const epd_request_t *req)
{
    const uint8_t *failures = epd_step_experts_failures(engine->step);
    uint32_t per_rank = engine->shape.num_experts / engine->shape.world;
    size_t slots = (size_t)req->n_tokens * engine->shape.topk;

    for (size_t i = 0; i < slots; i++) {
        int32_t e = req->topk_ids[i];
        if (e >= 0 && failures[(uint32_t)e / per_rank] != 0) return (int)((uint32_t)e / per_rank);
    }
    return -1;
}

/* Runs one step on the taken requests (n tokens in all) and turns y into results. On failure
 * err says why and the requests are left to the caller. x goes to the step's input rows once per
 * request (host memory: payload or host region, pinned or not; a device region: a device copy),
 * or, for a step of one request in a device region, is read where it is; y likewise comes back
 * into each result or region once, or is written straight into the region. */
static epd_status_t run_step(epd_engine_t *engine, epd_request_t *reqs, uint32_t n,
                             epd_result_t **head_p, epd_result_t **tail_p,
                             epd_step_timing_t *timing_p, char err[EPD_ERR_LEN])
{
    const epd_ops_t *ops = engine->ops;
    const epd_step_io_t *io = epd_step_io(engine->step);
    uint32_t hidden = engine->shape.hidden, topk = engine->shape.topk;
    size_t row = (size_t)hidden * 2;
    epd_result_t *head = NULL, *tail = NULL;
    epd_status_t status = EPD_OK;
    size_t at = 0;

    /* the results first: once the step ran, answering must not fail for want of memory */
    for (epd_request_t *req = reqs; req != NULL; req = req->next) {
        epd_result_t *res = calloc(1, sizeof *res);
        if (res != NULL && req->y_dst == NULL)
            res->y = epd_pinned_alloc(engine->pinned, (size_t)req->n_tokens * row);
        if (res == NULL || (req->y_dst == NULL && res->y == NULL)) {
            epd_result_free(res);
            snprintf(err, EPD_ERR_LEN, "engine: out of memory for the results of a step");
            status = EPD_ERR_NO_MEMORY;
            goto out_results;
        }
        if (tail != NULL)
            tail->next = res;
        else
            head = res;
        tail = res;
    }

    /* One request whose tensors are in device regions is read and written in place; a small y
     * in page-locked host memory (a host region, a pooled result) the step writes over the bus.
     * A large one is copied after the step: the combine writing 1.8 MB over the bus took as long
     * as the copy engine (H200, 128 tokens), and the copy saves only its fixed cost. */
    bool alone = reqs != NULL && reqs->next == NULL;
    const uint16_t *x = alone && reqs->x_device ? reqs->x : io->x;
    uint16_t *y = alone && reqs->y_dst != NULL && reqs->y_device ? reqs->y_dst : io->y;
    if (alone && y == io->y && ops->host_mapped != NULL && reqs->n_tokens > 0 &&
        (size_t)reqs->n_tokens * row <= ENGINE_Y_DIRECT_BYTES) {
        void *host = reqs->y_dst != NULL ? (void *)reqs->y_dst : head->y;
        uint16_t *mapped = ops->host_mapped(engine->ops_ctx, host, (size_t)reqs->n_tokens * row);
        if (mapped != NULL) y = mapped;
    }

    /* ids and weights (small, always on the host) gathered in pinned memory, the weights right
     * after the ids, and sent in one copy to the same layout on the device (epd_step_io_t) */
    int32_t *ids_stage = (int32_t *)engine->stage;
    float *w_stage = (float *)(ids_stage + (size_t)n * topk);
    float *w_dev = (float *)(io->topk_ids + (size_t)n * topk);
    for (epd_request_t *req = reqs; req != NULL; req = req->next) {
        size_t rows = req->n_tokens;
        memcpy(ids_stage + at * topk, req->topk_ids, rows * topk * sizeof(int32_t));
        memcpy(w_stage + at * topk, req->topk_weights, rows * topk * sizeof(float));
        /* queued on the stream, ahead of the step's kernels (the source stays as it is until
         * the step's last sync: the request holds it) */
        if (x == io->x)
            CHECK_GOTO(copy_queued(engine, io->x + at * hidden, req->x, rows * row, false),
                       out_copy);
        at += rows;
    }
    /* ops whose pack reads page-locked host memory take them from the stage (no copy, no
     * launch of one); the others get them in one copy */
    const int32_t *ids_step = ids_stage;
    const float *w_step = w_stage;
    if (!ops->pack_reads_host) {
        if (n > 0)
            CHECK_GOTO(copy_queued(engine, io->topk_ids, ids_stage,
                                   (size_t)n * topk * (sizeof(int32_t) + sizeof(float)), false),
                       out_copy);
        ids_step = io->topk_ids;
        w_step = w_dev;
    }
    /* the ids are on the host: the step lays the tokens out there */
    epd_step_set_host_ids(engine->step, ids_stage);
    uint64_t step_begin_ns = epd_now_ns();
    CHECK_GOTO(epd_step_run(engine->step, n, x, ids_step, w_step, y, timing_p, err), out_results);
    uint64_t step_end_ns = epd_now_ns();
    /* a step serves one layer: its requests' (none on a rank that only takes part) */
    pthread_mutex_lock(&engine->mu);
    epd_engine_step_observer_fn observe = engine->observe;
    void *observe_arg = engine->observe_arg;
    pthread_mutex_unlock(&engine->mu);
    if (observe != NULL)
        observe(observe_arg, timing_p, reqs != NULL ? reqs->layer : 0, ids_stage, n);

    /* y back, once per request, then one sync (a lone request's y may be written in place) */
    at = 0;
    bool copied = false;
    epd_result_t *res = head;
    for (epd_request_t *req = reqs; req != NULL; req = req->next, res = res->next) {
        size_t bytes = (size_t)req->n_tokens * row;
        const uint16_t *src = io->y + at * hidden;
        if (y == io->y) {
            uint16_t *dst = req->y_dst != NULL ? req->y_dst : res->y;
            CHECK_GOTO(copy_queued(engine, dst, src, bytes, !req->y_device), out_copy);
            copied = true;
        }
        at += req->n_tokens;
    }
    if (copied) CHECK_GOTO(ops->sync(engine->ops_ctx), out_copy);

    uint64_t now = epd_now_ns();
    res = head;
    for (epd_request_t *req = reqs; req != NULL; req = req->next, res = res->next) {
        res->id = req->id;
        res->conn_id = req->conn_id;
        res->n_tokens = req->n_tokens;
        res->status = EPD_OK;
        int failed_rank = engine->experts_fn != NULL ? experts_failed_rank(engine, req) : -1;
        if (failed_rank >= 0) {
            uint8_t code = epd_step_experts_failures(engine->step)[failed_rank];
            res->status = EPD_ERR_EXPERTS_UNAVAILABLE;
            snprintf(res->message, EPD_ERR_LEN,
                     "step %" PRIu64 ": rank %d, which owns experts of this request's tokens, %s",
                     engine->step_no + 1, failed_rank, engine->experts_describe(code));
        }
        res->latency_ns = now - req->enqueued_ns;
        res->arrived_ns = req->arrived_ns;
        res->decoded_ns = req->decoded_ns;
        res->read_ns = req->read_ns;
        res->ingest_ns = req->ingest_ns;
        res->enqueued_ns = req->enqueued_ns;
        res->taken_ns = req->taken_ns;
        res->done_ns = now;
        res->step_begin_ns = step_begin_ns;
        res->step_end_ns = step_end_ns;
        res->y_in_region = req->y_dst != NULL;
        res->y_region = req->y_region;
        res->y_offset = req->y_offset;
    }
    *head_p = head;
    *tail_p = tail;
    return EPD_OK;

out_copy:
    snprintf(err, EPD_ERR_LEN, "engine: copying a step's rows (%s ops) failed: %s%s%s", ops->name,
             epd_status_name(status),
             ops->last_error != NULL && ops->last_error(engine->ops_ctx)[0] ? ": " : "",
             ops->last_error != NULL ? ops->last_error(engine->ops_ctx) : "");
out_results:
    while (head != NULL) {
        epd_result_t *next = head->next;
        epd_result_free(head);
        head = next;
    }
    return status;
}

/* Takes the queued requests of `layer`, oldest first, whole, up to max_tokens_per_step tokens;
 * requests of other layers keep their places (under mu). *n_p receives the tokens taken. */
static epd_request_t *take_layer(epd_engine_t *engine, uint32_t layer, uint32_t *n_p,
                                 uint32_t *n_reqs_p)
{
    uint32_t max_tokens = engine->cfg.dispatch.max_tokens_per_step;
    epd_request_t *taken = NULL, **taken_tail = &taken;
    epd_request_t **link = &engine->queue_head, *last_kept = NULL;
    uint32_t n = 0, n_reqs = 0;

    while (*link != NULL) {
        epd_request_t *req = *link;
        if (req->layer != layer) {
            last_kept = req;
            link = &req->next;
            continue;
        }
        if (n + req->n_tokens > max_tokens) break;
        *link = req->next;
        req->next = NULL;
        *taken_tail = req;
        taken_tail = &req->next;
        n += req->n_tokens;
        n_reqs++;
    }
    if (*link == NULL) engine->queue_tail = last_kept;
    engine->queued_tokens -= n;
    engine->queued_requests -= n_reqs;
    *n_p = n;
    *n_reqs_p = n_reqs;
    return taken;
}

/* The smallest layer with queued work (under mu; the queue is not empty). */
static uint32_t queued_min_layer(const epd_engine_t *engine)
{
    uint32_t layer = UINT32_MAX;

    for (const epd_request_t *req = engine->queue_head; req != NULL; req = req->next)
        if (req->layer < layer) layer = req->layer;
    return layer;
}

/* Runs the agreed step for `layer` on this rank's queued requests of that layer (maybe none) and
 * queues the answers. False when the step failed: everything accepted was answered internal. */
static bool step_layer(epd_engine_t *engine, uint32_t layer)
{
    pthread_mutex_lock(&engine->mu);
    uint32_t n, n_reqs;
    epd_request_t *taken = take_layer(engine, layer, &n, &n_reqs);
    pthread_mutex_unlock(&engine->mu);
    uint64_t taken_ns = epd_now_ns();
    for (epd_request_t *req = taken; req != NULL; req = req->next) req->taken_ns = taken_ns;

    epd_result_t *head = NULL, *tail = NULL;
    epd_step_timing_t tm;
    char err[EPD_ERR_LEN] = "";
    set_activity(engine, EPD_ENGINE_STEPPING);
    epd_step_set_layer(engine->step, layer);
    epd_status_t status = EPD_ERR_SHUTTING_DOWN;
    if (experts_ready(engine))
        status = run_step(engine, taken, n, &head, &tail, &tm, err);
    else
        snprintf(err, EPD_ERR_LEN, "engine: stopped before the experts hook was set");

    pthread_mutex_lock(&engine->mu);
    if (status == EPD_OK) {
        engine->step_no++;
        for (epd_result_t *res = head; res != NULL; res = res->next) res->step = engine->step_no;
        epd_engine_stats_t *st = &engine->stats;
        st->steps++;
        st->tokens += n;
        st->layer_tokens[layer < EPD_ENGINE_STATS_LAYERS ? layer
                                                         : EPD_ENGINE_STATS_LAYERS - 1] += n;
        st->requests += n_reqs;
        st->bytes_sent[engine->shape.dtype] += tm.dispatch_bytes_off_rank;
        st->bytes_combined += tm.combine_bytes_off_rank;
        st->records_sent += tm.records_sent_off_rank;
        for (int p = 0; p < EPD_PHASE_MAX; p++) st->phase_ns[p] += tm.phase_ns[p];
        st->last_step_ns = tm.total_ns;
        epd_quant_stats_add(&st->quant_error, &tm.quant_error);
    } else {
        /* The ranks are out of step now: answer everything accepted, then report the failure
         * (the daemon aborts the job, DESIGN.md section 8). */
        engine->failed = true;
        snprintf(engine->failure, EPD_ERR_LEN, "%s", err);
        answer_error(engine, taken, EPD_ERR_INTERNAL, err, &head, &tail);
        answer_error(engine, engine->queue_head, EPD_ERR_INTERNAL,
                     "the engine stopped after a failed step", &head, &tail);
        engine->queue_head = engine->queue_tail = NULL;
        engine->queued_tokens = engine->queued_requests = 0;
    }
    if (head != NULL) {
        uint64_t handed_ns = epd_now_ns();
        for (epd_result_t *res = head; res != NULL; res = res->next) res->handed_ns = handed_ns;
        if (engine->results_tail != NULL)
            engine->results_tail->next = head;
        else
            engine->results_head = head;
        engine->results_tail = tail;
    }
    pthread_mutex_unlock(&engine->mu);
    if (head != NULL) engine->wake(engine->wake_arg);
    /* the answers are on their way: the requests (payloads, region references) go after */
    if (status == EPD_OK) {
        for (epd_request_t *req = taken; req != NULL;) {
            epd_request_t *next = req->next;
            epd_request_free(req);
            req = next;
        }
    }
    return status == EPD_OK;
}

/* Sleeps out the wait before the next agreement: at most poll_us, cut short by a submit, a
 * shutdown request or destroy. A lone rank has no other rank whose work the agreement could
 * bring, so it waits for one of those three alone: no timer, no wake-ups while idle. */
static void wait_before_agreement(epd_engine_t *engine)
{
    /* the condition variable runs on CLOCK_MONOTONIC, as epd_now_ns */
    uint64_t deadline = epd_now_ns() + (uint64_t)engine->poll_us * 1000u;
    struct timespec ts = {.tv_sec = (time_t)(deadline / 1000000000u),
                          .tv_nsec = (long)(deadline % 1000000000u)};

    pthread_mutex_lock(&engine->mu);
    while (!atomic_load(&engine->work_arrived) && !engine->worker_exit &&
           !engine->shutdown_wanted && (engine->solo || epd_now_ns() < deadline)) {
        if (engine->solo)
            pthread_cond_wait(&engine->cv, &engine->mu);
        else if (pthread_cond_timedwait(&engine->cv, &engine->mu, &ts) == ETIMEDOUT)
            break;
    }
    pthread_mutex_unlock(&engine->mu);
}

/* Waits for the open agreement (see WAIT_SPINS). False when destroy asked the worker to leave
 * first. */
static bool wait_agreement(epd_engine_t *engine, MPI_Request *req, bool hot)
{
    struct timespec nap = {0, (long)(hot ? CROWDED_SLEEP_US : IDLE_SLEEP_US) * 1000};
    int done = 0;

    for (unsigned tests = 0;; tests++) {
        MPI_Test(req, &done, MPI_STATUS_IGNORE);
        if (done) return true;
        if (atomic_load(&engine->exiting)) return false;
        if (hot && !engine->oversubscribed) continue;
        if (tests < WAIT_SPINS)
            sched_yield();
        else
            nanosleep(&nap, NULL);
    }
}

/* The wait of a lone rank's hot agreement: until a request was queued since the worker last
 * read the queue, shutdown or destroy is asked, or SOLO_WAIT_US have passed. It spins where the
 * node has a core for it, and yields, then naps, where it has not (as wait_agreement). */
static void solo_wait(epd_engine_t *engine)
{
    struct timespec nap = {0, (long)CROWDED_SLEEP_US * 1000};
    uint64_t until = epd_now_ns() + SOLO_WAIT_US * 1000u;

    for (unsigned tests = 0; !atomic_load(&engine->work_arrived) &&
                             !engine->shutdown_wanted && !atomic_load(&engine->exiting) &&
                             epd_now_ns() < until;
         tests++) {
        if (!engine->oversubscribed) {
            /* a spin-wait hint: the core's other hardware thread (the loop thread, maybe)
             * keeps its share of the pipeline */
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#elif defined(__aarch64__)
            __asm__ __volatile__("yield");
#endif
            continue;
        }
        if (tests < WAIT_SPINS)
            sched_yield();
        else
            nanosleep(&nap, NULL);
    }
}

static void engine_stop(epd_engine_t *engine)
{
    set_activity(engine, EPD_ENGINE_STOPPED);
    atomic_store(&engine->stopped, true);
    engine->wake(engine->wake_arg);
}

/* The worker: agreement, then (when any rank has work) a step, again and again until the drain
 * is agreed complete, a step fails, or destroy. */
static void *worker_main(void *arg)
{
    epd_engine_t *engine = arg;
    uint64_t *sent = engine->agree_buf, *got = engine->agree_buf + AGREE_N;
    uint64_t hot_ns = (uint64_t)engine->cfg.dispatch.hot_ms * 1000000u;
    bool hot = true; /* the first agreement starts at once */
    bool idle = false; /* the last agreement found nothing queued */

    for (;;) {
        if (!hot) {
            set_activity(engine, EPD_ENGINE_IDLE);
            wait_before_agreement(engine);
        } else if (engine->solo && idle) {
            set_activity(engine, EPD_ENGINE_AGREEING);
            solo_wait(engine);
        }
        pthread_mutex_lock(&engine->mu);
        if (engine->worker_exit) {
            pthread_mutex_unlock(&engine->mu);
            break;
        }
        atomic_store(&engine->work_arrived, false);
        sent[AGREE_QUEUED] = engine->queued_tokens;
        sent[AGREE_LAYER] = engine->queue_head != NULL ? UINT64_MAX - queued_min_layer(engine) : 0;
        pthread_mutex_unlock(&engine->mu);
        uint64_t now = epd_now_ns();
        sent[AGREE_SHUTDOWN] = engine->shutdown_wanted ? 1 : 0;
        sent[AGREE_HOT] = now - atomic_load(&engine->last_work_ns) < hot_ns ? 1 : 0;
        bool after_shutdown = atomic_load(&engine->shutting_down);

        if (engine->solo) {
            memcpy(got, sent, AGREE_N * sizeof *got);
        } else {
            set_activity(engine, EPD_ENGINE_AGREEING);
            MPI_Request req;
            atomic_store(&engine->agreement_open, true);
            MPI_Iallreduce(sent, got, AGREE_N, MPI_UINT64_T, MPI_MAX, engine->comm, &req);
            if (!wait_agreement(engine, &req, hot)) return NULL; /* destroy; got stays MPI's */
            atomic_store(&engine->agreement_open, false);
        }
        idle = got[AGREE_QUEUED] == 0;

        if (got[AGREE_SHUTDOWN] != 0 && !atomic_load(&engine->shutting_down)) {
            atomic_store(&engine->shutting_down, true);
            engine->wake(engine->wake_arg); /* the server logs the drain */
        }
        if (got[AGREE_QUEUED] > 0) {
            atomic_store(&engine->last_work_ns, epd_now_ns());
            engine->poll_us = poll_fast(engine);
            hot = true;
            if (!step_layer(engine, (uint32_t)(UINT64_MAX - got[AGREE_LAYER]))) {
                atomic_store(&engine->shutting_down, true);
                engine_stop(engine);
                break;
            }
            continue;
        }
        /* Nothing queued anywhere. Stop only on an agreement that began after every rank set
         * shutting_down: no rank can have accepted a request since its contribution. */
        if (after_shutdown) {
            engine_stop(engine);
            break;
        }
        hot = got[AGREE_HOT] != 0 || atomic_load(&engine->shutting_down);
        if (!hot) {
            uint32_t most = engine->cfg.dispatch.idle_backoff_us;
            engine->poll_us = engine->poll_us >= most / 2 ? most : engine->poll_us * 2;
            if (engine->poll_us == 0 && most > 0) engine->poll_us = 1;
        }
    }
    return NULL;
}

/* ---- the API ---- */

/* True when a spinning worker would take the core its own loop thread or another rank needs:
 * the process may run on one core only (mpirun binds each rank to a core by default for up to
 * two ranks), or the ranks of this node with their two threads each outnumber its cores
 * (collective over comm). *why gets a sentence for the log. */
static bool node_oversubscribed(MPI_Comm comm, char why[EPD_ERR_LEN])
{
    MPI_Comm node;
    int local_size = 1;
    cpu_set_t set;
    int mine = 0, online = (int)sysconf(_SC_NPROCESSORS_ONLN);

    if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
        MPI_Comm_size(node, &local_size);
        MPI_Comm_free(&node);
    }
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) == 0) mine = CPU_COUNT(&set);
    if (mine <= 0) mine = online;
    if (mine < 2) {
        snprintf(why, EPD_ERR_LEN,
                 "this rank may run on %d core only (bound by mpirun?): the worker and the event "
                 "loop share it, so hot agreements sleep between tests instead of spinning; for "
                 "the lowest latency start mpirun with --bind-to none (or :PE=2 or more)", mine);
        return true;
    }
    if (2 * local_size > online) {
        snprintf(why, EPD_ERR_LEN,
                 "%d ranks with 2 threads each on %d cores: hot agreements sleep between tests "
                 "instead of spinning", local_size, online);
        return true;
    }
    return false;
}

epd_moe_shape_t epd_moe_shape_from_config(const epd_config_t *cfg, uint32_t world, uint32_t rank)
{
    return (epd_moe_shape_t){
        .hidden = cfg->model.hidden,
        .topk = cfg->model.topk,
        .num_experts = cfg->model.num_experts,
        .world = world,
        .rank = rank,
        .dtype = cfg->dispatch.dtype,
        .scale = cfg->dispatch.scale,
        .scale_format = cfg->dispatch.scale_format,
        .expert_kind = cfg->experts.kind,
        .combine_dtype = cfg->combine.dtype,
        .quant_error = cfg->telemetry.quant_error == EPD_SWITCH_ON,
    };
}

epd_status_t epd_engine_create(const epd_config_t *cfg, MPI_Comm comm, const epd_ops_t *ops,
                               epd_ops_ctx_t *ops_ctx, const epd_transport_t *transport,
                               epd_transport_ctx_t *transport_ctx, epd_engine_wake_fn wake, void *wake_arg, epd_engine_t **engine_p,
                               char err[EPD_ERR_LEN])
{
    epd_engine_t *engine;
    epd_status_t status;
    int rank, world, rc;
    char why[EPD_ERR_LEN];

    if (cfg == NULL || ops == NULL || transport == NULL || wake == NULL || engine_p == NULL) {
        snprintf(err, EPD_ERR_LEN, "engine: missing configuration, ops, transport or wake");
        return EPD_ERR_INVALID_ARG;
    }
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &world);
    if (epd_moe_experts_check(cfg->model.num_experts, (uint32_t)world, why) != EPD_OK) {
        snprintf(err, EPD_ERR_LEN, "model.%.240s", why); /* why: "num_experts = ..." */
        return EPD_ERR_CONFIG;
    }
    if (cfg->dispatch.max_tokens_per_step == 0) {
        snprintf(err, EPD_ERR_LEN, "dispatch.max_tokens_per_step must be at least 1");
        return EPD_ERR_CONFIG;
    }

    engine = calloc(1, sizeof *engine);
    if (engine == NULL) {
        snprintf(err, EPD_ERR_LEN, "engine: out of memory");
        return EPD_ERR_NO_MEMORY;
    }
    engine->cfg = *cfg;
    engine->shape = epd_moe_shape_from_config(cfg, (uint32_t)world, (uint32_t)rank);
    engine->ops = ops;
    engine->ops_ctx = ops_ctx;
    engine->transport = transport;
    engine->transport_ctx = transport_ctx;
    engine->wake = wake;
    engine->wake_arg = wake_arg;
    engine->comm = MPI_COMM_NULL;
    engine->poll_us = poll_fast(engine);
    {
        const epd_expert_ops_t *kind = epd_expert_ops_find(cfg->experts.kind);
        engine->experts_external = kind != NULL && kind->external;
    }
    atomic_init(&engine->shutting_down, false);
    atomic_init(&engine->stopped, false);
    atomic_init(&engine->exiting, false);
    atomic_init(&engine->agreement_open, false);
    atomic_init(&engine->activity, EPD_ENGINE_IDLE);
    atomic_init(&engine->activity_since_ns, epd_now_ns());
    atomic_init(&engine->last_work_ns, 0);
    atomic_init(&engine->work_arrived, false);
    pthread_mutex_init(&engine->mu, NULL);
    {
        pthread_condattr_t attr;
        pthread_condattr_init(&attr);
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
        pthread_cond_init(&engine->cv, &attr);
        pthread_condattr_destroy(&attr);
    }

    rc = MPI_Comm_dup(comm, &engine->comm);
    if (rc != MPI_SUCCESS) {
        engine->comm = MPI_COMM_NULL;
        snprintf(err, EPD_ERR_LEN, "engine: MPI_Comm_dup failed (code %d)", rc);
        status = EPD_ERR_MPI;
        goto out_free;
    }
    engine->oversubscribed = node_oversubscribed(comm, why);
    engine->solo = world == 1;
    if (engine->oversubscribed) epd_log_info("engine: %s", why);
    CHECK_GOTO(epd_step_create(&engine->shape, cfg->dispatch.max_tokens_per_step, ops, ops_ctx,
                               transport, transport_ctx, engine->comm, &engine->step, err),
               out_free);
    /* external experts fed FP8 at one scale: the senders' scale maxima travel with the counts,
     * so S is known before the rows are written (no reduction over them; the price is that the
     * count exchange waits for the pack instead of overlapping it). Every rank has the same
     * config, so all agree on the count exchange's size; a worker's static input scale still
     * takes precedence (external.c). */
    epd_step_set_scale_exchange(engine->step,
                                engine->experts_external &&
                                    cfg->experts.external_input == EPD_EXTERNAL_FP8_PER_TENSOR);
    {
        size_t per_token = (size_t)engine->shape.topk * (sizeof(int32_t) + sizeof(float));
        size_t bytes = (size_t)cfg->dispatch.max_tokens_per_step * per_token;
        engine->stage = ops->alloc_host(ops_ctx, bytes);
        if (engine->stage == NULL) {
            snprintf(err, EPD_ERR_LEN,
                     "engine: cannot allocate %zu bytes of pinned host memory to stage %u tokens "
                     "(lower dispatch.max_tokens_per_step)",
                     bytes, cfg->dispatch.max_tokens_per_step);
            status = EPD_ERR_NO_MEMORY;
            goto out_free;
        }
    }
    engine->pinned = epd_pinned_pool_create(ops, ops_ctx, cfg->socket.pinned_bytes);
    if (engine->pinned == NULL) {
        snprintf(err, EPD_ERR_LEN, "engine: out of memory");
        status = EPD_ERR_NO_MEMORY;
        goto out_free;
    }
    rc = pthread_create(&engine->worker, NULL, worker_main, engine);
    if (rc != 0) {
        snprintf(err, EPD_ERR_LEN, "engine: cannot start the worker thread: %s", strerror(rc));
        status = EPD_ERR_INTERNAL;
        goto out_free;
    }
    engine->worker_started = true;
    *engine_p = engine;
    return EPD_OK;

out_free:
    epd_engine_destroy(engine);
    return status;
}

epd_status_t epd_engine_submit(epd_engine_t *engine, epd_request_t *req)
{
    uint32_t per_request = engine->cfg.dispatch.max_tokens_per_request;
    uint32_t per_step = engine->cfg.dispatch.max_tokens_per_step;

    if (req == NULL || (req->n_tokens > 0 &&
                        (req->x == NULL || req->topk_ids == NULL || req->topk_weights == NULL)))
        return EPD_ERR_INVALID_ARG;
    if (atomic_load(&engine->shutting_down)) return EPD_ERR_SHUTTING_DOWN;
    if (req->n_tokens == 0) return EPD_ERR_BAD_TENSOR;
    if (req->n_tokens > per_request || req->n_tokens > per_step) return EPD_ERR_TOO_MANY_TOKENS;

    pthread_mutex_lock(&engine->mu);
    if (engine->failed) {
        /* the worker already answered the queue and no step will run: it would never be answered */
        pthread_mutex_unlock(&engine->mu);
        return EPD_ERR_SHUTTING_DOWN;
    }
    if (engine->queued_tokens + req->n_tokens > engine->cfg.dispatch.max_queued_tokens) {
        pthread_mutex_unlock(&engine->mu);
        return EPD_ERR_BUSY;
    }
    if (req->enqueued_ns == 0) req->enqueued_ns = epd_now_ns();
    req->next = NULL;
    if (engine->queue_tail != NULL)
        engine->queue_tail->next = req;
    else
        engine->queue_head = req;
    engine->queue_tail = req;
    engine->queued_tokens += req->n_tokens;
    engine->queued_requests++;
    /* work arrived: the worker does not sleep out a long back-off */
    atomic_store(&engine->work_arrived, true);
    pthread_cond_signal(&engine->cv);
    pthread_mutex_unlock(&engine->mu);
    atomic_store(&engine->last_work_ns, epd_now_ns());
    return EPD_OK;
}

epd_result_t *epd_engine_take_results(epd_engine_t *engine)
{
    epd_result_t *head;

    pthread_mutex_lock(&engine->mu);
    head = engine->results_head;
    engine->results_head = engine->results_tail = NULL;
    pthread_mutex_unlock(&engine->mu);
    return head;
}

void epd_engine_request_shutdown(epd_engine_t *engine)
{
    /* from the loop thread (a libevent signal callback), never a signal handler: the worker
     * waiting out a back-off is woken, not left to its timer */
    pthread_mutex_lock(&engine->mu);
    engine->shutdown_wanted = 1;
    pthread_cond_signal(&engine->cv);
    pthread_mutex_unlock(&engine->mu);
}

bool epd_engine_stopped(epd_engine_t *engine)
{
    if (!atomic_load(&engine->stopped)) return false;
    /* The worker set stopped and is about to wake the loop one last time: once the loop has seen
     * stopped it may free what wake touches, so it first waits for the worker to be gone. */
    if (engine->worker_started && !pthread_equal(pthread_self(), engine->worker) &&
        !engine->worker_joined) {
        pthread_join(engine->worker, NULL);
        engine->worker_joined = true;
    }
    return true;
}

bool epd_engine_failed(epd_engine_t *engine, char err[EPD_ERR_LEN])
{
    bool failed;

    pthread_mutex_lock(&engine->mu);
    failed = engine->failed;
    if (failed && err != NULL) snprintf(err, EPD_ERR_LEN, "%s", engine->failure);
    pthread_mutex_unlock(&engine->mu);
    return failed;
}

void epd_engine_get_stats(epd_engine_t *engine, epd_engine_stats_t *stats_p)
{
    pthread_mutex_lock(&engine->mu);
    *stats_p = engine->stats;
    stats_p->queued_tokens = engine->queued_tokens;
    stats_p->queued_requests = engine->queued_requests;
    pthread_mutex_unlock(&engine->mu);
    stats_p->shutting_down = atomic_load(&engine->shutting_down);
}

void epd_engine_set_step_observer(epd_engine_t *engine, epd_engine_step_observer_fn fn, void *arg)
{
    pthread_mutex_lock(&engine->mu);
    engine->observe = fn;
    engine->observe_arg = arg;
    pthread_mutex_unlock(&engine->mu);
}

epd_pinned_pool_t *epd_engine_pinned(epd_engine_t *engine)
{
    return engine->pinned;
}

bool epd_engine_hot(epd_engine_t *engine)
{
    uint64_t hot_ns = (uint64_t)engine->cfg.dispatch.hot_ms * 1000000u;
    return !engine->oversubscribed && hot_ns != 0 &&
           epd_now_ns() - atomic_load(&engine->last_work_ns) < hot_ns;
}

const char *epd_engine_activity(epd_engine_t *engine, uint64_t *since_ns_p)
{
    int activity = atomic_load(&engine->activity);

    if (since_ns_p != NULL) *since_ns_p = atomic_load(&engine->activity_since_ns);
    return activity >= 0 && activity < EPD_ENGINE_ACTIVITY_MAX ? activity_names[activity] : "?";
}

void epd_engine_destroy(epd_engine_t *engine)
{
    bool worker_left = true;

    if (engine == NULL) return;
    if (engine->worker_started) {
        pthread_mutex_lock(&engine->mu);
        engine->worker_exit = true;
        pthread_cond_signal(&engine->cv);
        pthread_mutex_unlock(&engine->mu);
        /* An agreement still open cannot be cancelled (MPI forbids it for collectives): the
         * worker leaves it, and its buffers, to MPI. Only an aborting daemon gets here with an
         * engine that has not stopped. */
        atomic_store(&engine->exiting, true);
        if (!engine->worker_joined) pthread_join(engine->worker, NULL);
        worker_left = !atomic_load(&engine->agreement_open);
    }
    while (engine->queue_head != NULL) {
        epd_request_t *next = engine->queue_head->next;
        epd_request_free(engine->queue_head);
        engine->queue_head = next;
    }
    while (engine->results_head != NULL) {
        epd_result_t *next = engine->results_head->next;
        epd_result_free(engine->results_head);
        engine->results_head = next;
    }
    epd_step_destroy(engine->step);
    if (engine->stage != NULL) engine->ops->free_host(engine->ops_ctx, engine->stage);
    epd_pinned_pool_free(engine->pinned);
    if (engine->comm != MPI_COMM_NULL && worker_left) MPI_Comm_free(&engine->comm);
    pthread_cond_destroy(&engine->cv);
    pthread_mutex_destroy(&engine->mu);
    if (worker_left) free(engine); /* else an open agreement may still write agree_buf */
}
