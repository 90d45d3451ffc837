/* The engine (daemon/engine.h): the request queue, the collective agreement driven by a timer on
 * the event loop (DESIGN.md section 5), and the steps themselves on a worker thread. MPI is called
 * by one thread at a time: the loop thread while an agreement is open, the worker while it runs a
 * step; the hand-over goes through the mutex (loop -> worker) and an eventfd read under the same
 * mutex (worker -> loop), which gives MPI_THREAD_SERIALIZED its happens-before edges. */
#include <assert.h>
#include <errno.h>
#include <event2/event.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "comm/step.h"
#include "common/clock.h"
#include "daemon/engine.h"
#include "daemon/log.h"

/* Fastest agreement poll; it doubles while every rank is idle, up to dispatch.idle_backoff_us. */
#define POLL_FAST_US 20u

/* Where the agreement of this rank stands (loop thread only). */
typedef enum {
    AGREE_WAITING = 0, /* the timer is armed; the next agreement starts when it fires */
    AGREE_OPEN,        /* MPI_Iallreduce in flight; the timer polls MPI_Test */
    AGREE_STEPPING,    /* the worker runs a step; the eventfd tells when it is done */
    AGREE_STOPPED,     /* stopped (drained, or a step failed): nothing more */
    AGREE_STATE_MAX
} agree_state_t;

static const char *const agree_state_names[AGREE_STATE_MAX] = {
    [AGREE_WAITING] = "waiting",
    [AGREE_OPEN] = "open",
    [AGREE_STEPPING] = "stepping",
    [AGREE_STOPPED] = "stopped",
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
    /* Pinned host staging for one step (ops->alloc_host): the requests' x, ids and weights are
     * gathered here and go to the device in one copy each; y comes back into the x part. */
    uint8_t *stage;

    struct event_base *base;
    struct event *timer;
    struct event *done_ev;
    int done_fd;
    epd_engine_wake_fn wake;
    void *wake_arg;

    pthread_t worker;
    bool worker_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* under mu */
    epd_request_t *queue_head, *queue_tail;
    uint64_t queued_tokens, queued_requests;
    epd_result_t *results_head, *results_tail;
    bool step_ordered; /* loop -> worker: run one step */
    bool step_running; /* from the order until the worker is done */
    bool worker_exit;
    epd_engine_stats_t stats;
    uint64_t step_no;
    bool failed;
    char failure[EPD_ERR_LEN];

    /* loop thread only */
    agree_state_t state;
    uint64_t state_since_ns; /* when state was entered (epd_engine_waiting) */
    MPI_Request agree_req;
    uint64_t *agree_buf;       /* [0..1] sent, [2..3] received; heap (see epd_engine_destroy) */
    bool agree_after_shutdown; /* the open agreement began after shutting_down was set */
    uint32_t poll_us;

    volatile sig_atomic_t shutdown_wanted;
    atomic_bool shutting_down;
    atomic_bool stopped;
};

static uint32_t poll_fast(const epd_engine_t *engine)
{
    uint32_t most = engine->cfg.dispatch.idle_backoff_us;
    return most < POLL_FAST_US ? most : POLL_FAST_US;
}

static void arm_timer(epd_engine_t *engine, uint32_t us)
{
    struct timeval tv = {.tv_sec = us / 1000000u, .tv_usec = us % 1000000u};
    evtimer_add(engine->timer, &tv);
}

void epd_result_free(epd_result_t *result)
{
    if (result == NULL) return;
    free(result->y);
    free(result);
}

static void request_free(epd_request_t *req)
{
    free(req->storage);
    free(req);
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
        request_free(req);
    }
}

/* Runs one step on the taken requests (n tokens in all) and turns y into results. On failure
 * err says why and the requests are left to the caller. */
static epd_status_t run_step(epd_engine_t *engine, epd_request_t *reqs, uint32_t n,
                             epd_result_t **head_p, epd_result_t **tail_p,
                             epd_step_timing_t *timing_p, char err[EPD_ERR_LEN])
{
    const epd_ops_t *ops = engine->ops;
    const epd_step_io_t *io = epd_step_io(engine->step);
    uint32_t hidden = engine->shape.hidden, topk = engine->shape.topk;
    epd_result_t *head = NULL, *tail = NULL;
    epd_status_t status = EPD_OK;
    size_t at = 0;

    /* the results first: once the step ran, answering must not fail for want of memory */
    for (epd_request_t *req = reqs; req != NULL; req = req->next) {
        epd_result_t *res = calloc(1, sizeof *res);
        if (res != NULL) res->y = malloc((size_t)req->n_tokens * hidden * 2);
        if (res == NULL || res->y == NULL) {
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

    /* gathered in pinned memory, then one copy per tensor for the whole step */
    size_t max_tokens = engine->cfg.dispatch.max_tokens_per_step;
    uint16_t *x_stage = (uint16_t *)engine->stage;
    int32_t *ids_stage = (int32_t *)(x_stage + max_tokens * hidden);
    float *w_stage = (float *)(ids_stage + max_tokens * topk);
    for (epd_request_t *req = reqs; req != NULL; req = req->next) {
        size_t rows = req->n_tokens;
        memcpy(x_stage + at * hidden, req->x, rows * hidden * 2);
        memcpy(ids_stage + at * topk, req->topk_ids, rows * topk * sizeof(int32_t));
        memcpy(w_stage + at * topk, req->topk_weights, rows * topk * sizeof(float));
        at += rows;
    }
    if (n > 0) {
        CHECK_GOTO(ops->copy_to_ops(engine->ops_ctx, io->x, x_stage, (size_t)n * hidden * 2),
                   out_copy);
        CHECK_GOTO(ops->copy_to_ops(engine->ops_ctx, io->topk_ids, ids_stage,
                                    (size_t)n * topk * sizeof(int32_t)),
                   out_copy);
        CHECK_GOTO(ops->copy_to_ops(engine->ops_ctx, io->topk_weights, w_stage,
                                    (size_t)n * topk * sizeof(float)),
                   out_copy);
    }
    CHECK_GOTO(
        epd_step_run(engine->step, n, io->x, io->topk_ids, io->topk_weights, io->y, timing_p, err),
        out_results);

    /* y back in one copy (complete when copy_to_host returns), then split per request */
    if (n > 0)
        CHECK_GOTO(ops->copy_to_host(engine->ops_ctx, x_stage, io->y, (size_t)n * hidden * 2),
                   out_copy);
    at = 0;
    epd_result_t *res = head;
    for (epd_request_t *req = reqs; req != NULL; req = req->next, res = res->next) {
        memcpy(res->y, x_stage + at * hidden, (size_t)req->n_tokens * hidden * 2);
        at += req->n_tokens;
    }

    uint64_t now = epd_now_ns();
    res = head;
    for (epd_request_t *req = reqs; req != NULL; req = req->next, res = res->next) {
        res->id = req->id;
        res->conn_id = req->conn_id;
        res->n_tokens = req->n_tokens;
        res->status = EPD_OK;
        res->latency_ns = now - req->enqueued_ns;
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

static void *worker_main(void *arg)
{
    epd_engine_t *engine = arg;
    uint32_t max_tokens = engine->cfg.dispatch.max_tokens_per_step;

    pthread_mutex_lock(&engine->mu);
    for (;;) {
        while (!engine->step_ordered && !engine->worker_exit)
            pthread_cond_wait(&engine->cv, &engine->mu);
        if (engine->worker_exit) break;
        engine->step_ordered = false;

        /* whole requests, oldest first, up to max_tokens_per_step */
        epd_request_t *taken = NULL, *taken_tail = NULL;
        uint32_t n = 0, n_reqs = 0;
        while (engine->queue_head != NULL && n + engine->queue_head->n_tokens <= max_tokens) {
            epd_request_t *req = engine->queue_head;
            engine->queue_head = req->next;
            if (engine->queue_head == NULL) engine->queue_tail = NULL;
            req->next = NULL;
            if (taken_tail != NULL)
                taken_tail->next = req;
            else
                taken = req;
            taken_tail = req;
            n += req->n_tokens;
            n_reqs++;
        }
        engine->queued_tokens -= n;
        engine->queued_requests -= n_reqs;
        pthread_mutex_unlock(&engine->mu);

        epd_result_t *head = NULL, *tail = NULL;
        epd_step_timing_t tm;
        char err[EPD_ERR_LEN] = "";
        epd_status_t status = run_step(engine, taken, n, &head, &tail, &tm, err);

        pthread_mutex_lock(&engine->mu);
        if (status == EPD_OK) {
            engine->step_no++;
            for (epd_result_t *res = head; res != NULL; res = res->next)
                res->step = engine->step_no;
            for (epd_request_t *req = taken; req != NULL;) {
                epd_request_t *next = req->next;
                request_free(req);
                req = next;
            }
            epd_engine_stats_t *st = &engine->stats;
            st->steps++;
            st->tokens += n;
            st->requests += n_reqs;
            st->bytes_sent[engine->shape.dtype] += tm.dispatch_bytes_off_rank;
            st->bytes_combined += tm.combine_bytes_off_rank;
            st->records_sent += tm.records_sent_off_rank;
            for (int p = 0; p < EPD_PHASE_MAX; p++) st->phase_ns[p] += tm.phase_ns[p];
            st->last_step_ns = tm.total_ns;
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
            if (engine->results_tail != NULL)
                engine->results_tail->next = head;
            else
                engine->results_head = head;
            engine->results_tail = tail;
        }
        engine->step_running = false;
        /* once epd_engine_destroy has begun, whatever wake touches may be gone */
        bool wake = head != NULL && !engine->worker_exit;
        pthread_mutex_unlock(&engine->mu);

        /* Wake before the eventfd: once done_cb has it, the loop may agree to stop, leave its
         * loop and free what wake touches (the daemon frees the server before the engine). */
        if (wake) engine->wake(engine->wake_arg);
        uint64_t one = 1;
        if (write(engine->done_fd, &one, sizeof one) != (ssize_t)sizeof one) {
            /* cannot happen with an eventfd below its maximum; the loop would stall, so say it */
            fprintf(stderr, "epd engine: eventfd write failed: %s\n", strerror(errno));
        }
        pthread_mutex_lock(&engine->mu);
    }
    pthread_mutex_unlock(&engine->mu);
    return NULL;
}

/* ---- the agreement (loop thread) ---- */

/* The one place the agreement state changes: asserts, traces and assigns. */
static void agree_set_state(epd_engine_t *engine, agree_state_t state)
{
    assert(state < AGREE_STATE_MAX);
    /* Nothing comes back from stopped. */
    assert(engine->state != AGREE_STOPPED);
    if (engine->state == state) return;
    /* The waiting <-> open cycle of an idle daemon repeats every dispatch.idle_backoff_us and
     * would drown the log: only the other transitions are traced. */
    bool poll_cycle = (engine->state == AGREE_WAITING && state == AGREE_OPEN) ||
                      (engine->state == AGREE_OPEN && state == AGREE_WAITING);
    if (!poll_cycle)
        epd_log_debug("agreement: %s -> %s", agree_state_names[engine->state],
                      agree_state_names[state]);
    engine->state = state;
    engine->state_since_ns = epd_now_ns();
}

static void agreement_start(epd_engine_t *engine)
{
    pthread_mutex_lock(&engine->mu);
    engine->agree_buf[0] = engine->queued_tokens;
    pthread_mutex_unlock(&engine->mu);
    engine->agree_buf[1] = engine->shutdown_wanted ? 1 : 0;
    engine->agree_after_shutdown = atomic_load(&engine->shutting_down);
    MPI_Iallreduce(engine->agree_buf, engine->agree_buf + 2, 2, MPI_UINT64_T, MPI_MAX, engine->comm,
                   &engine->agree_req);
    agree_set_state(engine, AGREE_OPEN);
}

static void engine_stop(epd_engine_t *engine)
{
    agree_set_state(engine, AGREE_STOPPED);
    atomic_store(&engine->stopped, true);
    engine->wake(engine->wake_arg);
}

/* What every rank does with the agreed {max queued tokens, any shutdown wanted}. */
static void agreement_done(epd_engine_t *engine)
{
    uint64_t max_queued = engine->agree_buf[2];
    bool shutdown = engine->agree_buf[3] != 0;

    if (shutdown && !atomic_load(&engine->shutting_down)) {
        atomic_store(&engine->shutting_down, true);
        /* let the server see shutting_down (it logs the drain) */
        engine->wake(engine->wake_arg);
    }
    if (max_queued > 0) {
        agree_set_state(engine, AGREE_STEPPING);
        engine->poll_us = poll_fast(engine);
        pthread_mutex_lock(&engine->mu);
        engine->step_ordered = true;
        engine->step_running = true;
        pthread_cond_signal(&engine->cv);
        pthread_mutex_unlock(&engine->mu);
        return;
    }
    /* Nothing queued anywhere. Stop only on an agreement that began after every rank set
     * shutting_down: no rank can have accepted a request since its contribution. */
    if (engine->agree_after_shutdown) {
        engine_stop(engine);
        return;
    }
    agree_set_state(engine, AGREE_WAITING);
    if (atomic_load(&engine->shutting_down)) {
        arm_timer(engine, 0);
        return;
    }
    uint32_t most = engine->cfg.dispatch.idle_backoff_us;
    engine->poll_us = engine->poll_us >= most / 2 ? most : engine->poll_us * 2;
    if (engine->poll_us == 0 && most > 0) engine->poll_us = 1;
    arm_timer(engine, engine->poll_us);
}

static void agreement_poll(epd_engine_t *engine)
{
    int done = 0;

    MPI_Test(&engine->agree_req, &done, MPI_STATUS_IGNORE);
    if (done)
        agreement_done(engine);
    else
        arm_timer(engine, engine->poll_us);
}

static void timer_cb(evutil_socket_t fd, short what, void *arg)
{
    epd_engine_t *engine = arg;

    switch (engine->state) {
    case AGREE_WAITING:
        agreement_start(engine);
        agreement_poll(engine);
        break;
    case AGREE_OPEN:
        agreement_poll(engine);
        break;
    case AGREE_STEPPING:
    case AGREE_STOPPED:
    case AGREE_STATE_MAX:
        break;
    }
}

/* The worker finished a step: the loop thread owns MPI again. */
static void done_cb(evutil_socket_t fd, short what, void *arg)
{
    epd_engine_t *engine = arg;
    uint64_t count;
    bool running, failed;

    if (read(engine->done_fd, &count, sizeof count) < 0 && errno != EAGAIN) return;
    pthread_mutex_lock(&engine->mu);
    running = engine->step_running;
    failed = engine->failed;
    pthread_mutex_unlock(&engine->mu);
    if (running || engine->state != AGREE_STEPPING) return;
    if (failed) {
        atomic_store(&engine->shutting_down, true);
        engine_stop(engine);
        return;
    }
    engine->poll_us = poll_fast(engine);
    agreement_start(engine);
    agreement_poll(engine);
}

/* ---- the API ---- */

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
    };
}

epd_status_t epd_engine_create(const epd_config_t *cfg, MPI_Comm comm, const epd_ops_t *ops,
                               epd_ops_ctx_t *ops_ctx, const epd_transport_t *transport,
                               epd_transport_ctx_t *transport_ctx, struct event_base *base,
                               epd_engine_wake_fn wake, void *wake_arg, epd_engine_t **engine_p,
                               char err[EPD_ERR_LEN])
{
    epd_engine_t *engine;
    epd_status_t status;
    int rank, world, rc;
    char why[EPD_ERR_LEN];

    if (cfg == NULL || ops == NULL || transport == NULL || base == NULL || wake == NULL ||
        engine_p == NULL) {
        snprintf(err, EPD_ERR_LEN,
                 "engine: missing configuration, ops, transport, event base or wake");
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
    engine->base = base;
    engine->wake = wake;
    engine->wake_arg = wake_arg;
    engine->comm = MPI_COMM_NULL;
    engine->done_fd = -1;
    engine->poll_us = poll_fast(engine);
    atomic_init(&engine->shutting_down, false);
    atomic_init(&engine->stopped, false);
    pthread_mutex_init(&engine->mu, NULL);
    pthread_cond_init(&engine->cv, NULL);

    rc = MPI_Comm_dup(comm, &engine->comm);
    if (rc != MPI_SUCCESS) {
        engine->comm = MPI_COMM_NULL;
        snprintf(err, EPD_ERR_LEN, "engine: MPI_Comm_dup failed (code %d)", rc);
        status = EPD_ERR_MPI;
        goto out_free;
    }
    engine->agree_buf = calloc(4, sizeof(uint64_t));
    if (engine->agree_buf == NULL) {
        snprintf(err, EPD_ERR_LEN, "engine: out of memory");
        status = EPD_ERR_NO_MEMORY;
        goto out_free;
    }
    CHECK_GOTO(epd_step_create(&engine->shape, cfg->dispatch.max_tokens_per_step, ops, ops_ctx,
                               transport, transport_ctx, engine->comm, &engine->step, err),
               out_free);
    {
        size_t per_token = (size_t)engine->shape.hidden * 2 +
                           (size_t)engine->shape.topk * (sizeof(int32_t) + sizeof(float));
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
    engine->done_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (engine->done_fd < 0) {
        snprintf(err, EPD_ERR_LEN, "engine: eventfd: %s", strerror(errno));
        status = EPD_ERR_IO;
        goto out_free;
    }
    engine->timer = evtimer_new(base, timer_cb, engine);
    engine->done_ev = event_new(base, engine->done_fd, EV_READ | EV_PERSIST, done_cb, engine);
    if (engine->timer == NULL || engine->done_ev == NULL || event_add(engine->done_ev, NULL) != 0) {
        snprintf(err, EPD_ERR_LEN, "engine: cannot create its events on the event base");
        status = EPD_ERR_INTERNAL;
        goto out_free;
    }
    rc = pthread_create(&engine->worker, NULL, worker_main, engine);
    if (rc != 0) {
        snprintf(err, EPD_ERR_LEN, "engine: cannot start the worker thread: %s", strerror(rc));
        status = EPD_ERR_INTERNAL;
        goto out_free;
    }
    engine->worker_started = true;
    /* the first agreement starts as soon as the loop runs */
    agree_set_state(engine, AGREE_WAITING);
    arm_timer(engine, 0);
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
    pthread_mutex_unlock(&engine->mu);

    /* work arrived: poll fast again, and do not sleep out a long idle back-off */
    engine->poll_us = poll_fast(engine);
    if (engine->state == AGREE_WAITING || engine->state == AGREE_OPEN)
        arm_timer(engine, engine->poll_us);
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
    engine->shutdown_wanted = 1;
}

bool epd_engine_stopped(const epd_engine_t *engine)
{
    return atomic_load(&((epd_engine_t *)engine)->stopped);
}

const char *epd_engine_waiting(const epd_engine_t *engine, uint64_t *since_ns_p)
{
    *since_ns_p = engine->state_since_ns;
    switch (engine->state) {
    case AGREE_OPEN:
        return "agreement";
    case AGREE_STEPPING:
        return "step";
    case AGREE_WAITING:
    case AGREE_STOPPED:
    case AGREE_STATE_MAX:
    default:
        return NULL;
    }
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

void epd_engine_destroy(epd_engine_t *engine)
{
    if (engine == NULL) return;
    if (engine->timer != NULL) event_free(engine->timer);
    if (engine->done_ev != NULL) event_free(engine->done_ev);
    if (engine->worker_started) {
        pthread_mutex_lock(&engine->mu);
        engine->worker_exit = true;
        pthread_cond_signal(&engine->cv);
        pthread_mutex_unlock(&engine->mu);
        pthread_join(engine->worker, NULL);
    }
    /* An agreement still open cannot be cancelled (MPI forbids it for collectives): its buffer is
     * left to MPI rather than freed under it. Only an aborting daemon destroys an engine that has
     * not stopped. */
    if (engine->state != AGREE_OPEN) free(engine->agree_buf);
    while (engine->queue_head != NULL) {
        epd_request_t *next = engine->queue_head->next;
        request_free(engine->queue_head);
        engine->queue_head = next;
    }
    while (engine->results_head != NULL) {
        epd_result_t *next = engine->results_head->next;
        epd_result_free(engine->results_head);
        engine->results_head = next;
    }
    epd_step_destroy(engine->step);
    if (engine->stage != NULL) engine->ops->free_host(engine->ops_ctx, engine->stage);
    if (engine->done_fd >= 0) close(engine->done_fd);
    if (engine->comm != MPI_COMM_NULL) MPI_Comm_free(&engine->comm);
    pthread_cond_destroy(&engine->cv);
    pthread_mutex_destroy(&engine->mu);
    free(engine);
}
