/* MPI test program for tests/integration/engine_np.sh (np = 2, and np = 1: a rank alone agrees
 * without MPI): the engine (daemon/engine.c) without sockets, on a real event loop. Run 1:
 * requests queued on every rank, the queue limit (busy) and bad requests, shutdown asked on the
 * last rank only: every accepted request is answered with the reference's bytes, submits after
 * the agreement get shutting_down, the ranks stop after the same number of steps. The worker
 * steps as soon as it agrees, so at np 2 the last rank holds its worker inside the first step's
 * exchange (a gated transport) while it fills the queue to the limit and asks the shutdown: the
 * queue then moves by this thread's submits only, and busy is checked without a race. Run 2: an
 * idle engine does not spin a core, then (np 2: a rank alone sends nothing through its
 * transport) a transport that fails: its requests and the queued ones are answered `internal`, a
 * submit after the failure is refused, and the engine reports the failure; alone, the engine is
 * destroyed while its worker waits hot. Throughout, the worker never calls wake once the engine
 * has stopped (the daemon frees the server then). */
#include <event2/event.h>
#include <event2/thread.h>
#include <mpi.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "comm/transport_mpi.h"
#include "common/rng.h"
#include "daemon/engine.h"
#include "gpu/fp8.h"
#include "gpu/ops.h"

#define HIDDEN   256
#define TOPK     4
#define EXPERTS  16
#define MAX_REQS 16

static int rank, world, failures;
static pthread_t main_thread;
static atomic_int late_wakes; /* worker wakes that came after the loop saw the engine stopped */
static atomic_bool loop_saw_stopped;

#define CHECK(cond, ...)                                          \
    do {                                                          \
        if (!(cond)) {                                            \
            fprintf(stderr, "rank %d: FAILED %s: ", rank, #cond); \
            fprintf(stderr, __VA_ARGS__);                         \
            fprintf(stderr, "\n");                                \
            failures++;                                           \
        }                                                         \
    } while (0)

/* A request as the server makes it: one malloc'ed storage block holding x, ids and weights. */
static epd_request_t *make_request(uint64_t id, uint32_t n, uint64_t *seed)
{
    size_t xb = (size_t)n * HIDDEN * 2, ib = (size_t)n * TOPK * 4;
    epd_request_t *req = calloc(1, sizeof *req);
    uint8_t *storage = malloc(xb + 2 * ib + 1);
    uint16_t *x = (uint16_t *)storage;
    int32_t *ids = (int32_t *)(storage + xb);
    float *w = (float *)(storage + xb + ib);

    if (req == NULL || storage == NULL) abort();
    for (size_t i = 0; i < (size_t)n * HIDDEN; i++)
        x[i] = epd_f32_to_bf16((float)((int64_t)(epd_rng_next(seed) % 2001) - 1000) / 300.0f);
    for (uint32_t t = 0; t < n; t++) {
        for (uint32_t k = 0; k < TOPK; k++) {
            /* distinct: one expert from each quarter of the experts, some slots empty */
            int32_t e = (int32_t)(k * (EXPERTS / TOPK) + epd_rng_next(seed) % (EXPERTS / TOPK));
            ids[(size_t)t * TOPK + k] = epd_rng_next(seed) % 9 == 0 ? -1 : e;
            w[(size_t)t * TOPK + k] = (float)(epd_rng_next(seed) % 1000 + 1) / 1000.0f;
        }
    }
    req->id = id;
    req->conn_id = 7;
    req->n_tokens = n;
    req->x = x;
    req->topk_ids = ids;
    req->topk_weights = w;
    req->storage = storage;
    return req;
}

/* What the test keeps of each accepted request, to check its result. */
typedef struct expected {
    uint64_t id;
    uint32_t n;
    uint32_t layer;
    uint16_t *y; /* the reference */
    bool answered;
} expected_t;

typedef struct run {
    struct event_base *base;
    struct event *wake_ev, *deadline;
    epd_engine_t *engine;
    epd_moe_shape_t shape;
    expected_t exp[MAX_REQS];
    int n_exp;
    int n_answered, n_errors;
    uint64_t last_step;
    uint32_t last_layer; /* of last_step */
    bool saw_shutting_down, refused_after_agreement, timed_out, tried_after_failure;
    epd_status_t want_status; /* EPD_OK, or EPD_ERR_INTERNAL for the failing transport */
} run_t;

static expected_t *expect(run_t *run, epd_request_t *req)
{
    expected_t *e = &run->exp[run->n_exp++];
    e->id = req->id;
    e->n = req->n_tokens;
    e->layer = req->layer;
    e->y = malloc((size_t)req->n_tokens * HIDDEN * 2);
    if (e->y == NULL || epd_moe_reference(&run->shape, req->n_tokens, req->x, req->topk_ids,
                                          req->topk_weights, e->y) != EPD_OK)
        abort();
    return e;
}

static void wake_fn(void *arg)
{
    run_t *run = arg;

    if (!pthread_equal(pthread_self(), main_thread)) {
        /* The worker: stall here as a descheduled thread would. The daemon frees what wake
         * touches once the engine has stopped, so no worker wake may come after the stop. */
        struct timespec pause = {0, 50 * 1000000};
        nanosleep(&pause, NULL);
        if (atomic_load(&loop_saw_stopped)) atomic_fetch_add(&late_wakes, 1);
    }
    event_active(run->wake_ev, EV_READ, 0);
}

static void wake_cb(evutil_socket_t fd, short what, void *arg)
{
    run_t *run = arg;
    epd_result_t *res = epd_engine_take_results(run->engine);

    while (res != NULL) {
        epd_result_t *next = res->next;
        expected_t *e = NULL;
        for (int i = 0; i < run->n_exp; i++)
            if (run->exp[i].id == res->id) e = &run->exp[i];
        CHECK(e != NULL && !e->answered, "result for an unknown or already answered id %llu",
              (unsigned long long)res->id);
        if (e != NULL && !e->answered) {
            e->answered = true;
            run->n_answered++;
            CHECK(res->status == run->want_status, "id %llu: status %s (%s)",
                  (unsigned long long)res->id, epd_status_name(res->status), res->message);
            if (res->status == EPD_OK) {
                CHECK(res->n_tokens == e->n && res->y != NULL &&
                          memcmp(res->y, e->y, (size_t)e->n * HIDDEN * 2) == 0,
                      "id %llu: y differs from the reference", (unsigned long long)res->id);
                CHECK(res->step >= 1 && res->step >= run->last_step,
                      "id %llu: step %llu after %llu", (unsigned long long)res->id,
                      (unsigned long long)res->step, (unsigned long long)run->last_step);
                /* a step serves one layer */
                CHECK(res->step != run->last_step || e->layer == run->last_layer,
                      "id %llu of layer %u shares step %llu with layer %u",
                      (unsigned long long)res->id, e->layer, (unsigned long long)res->step,
                      run->last_layer);
                run->last_step = res->step;
                run->last_layer = e->layer;
            } else {
                run->n_errors++;
                CHECK(res->message[0] != '\0', "an error result without a message");
            }
        }
        epd_result_free(res);
        res = next;
    }

    epd_engine_stats_t st;
    epd_engine_get_stats(run->engine, &st);
    if (st.shutting_down && !run->saw_shutting_down && run->want_status == EPD_OK) {
        /* the agreement has spread the shutdown: new submits are refused on every rank */
        uint64_t seed = 99;
        epd_request_t *late = make_request(1000, 2, &seed);
        epd_status_t s = epd_engine_submit(run->engine, late);
        CHECK(s == EPD_ERR_SHUTTING_DOWN, "submit after the agreed shutdown gave %s",
              epd_status_name(s));
        run->refused_after_agreement = s == EPD_ERR_SHUTTING_DOWN;
        if (s != EPD_OK) {
            free(late->storage);
            free(late);
        }
    }
    if (run->want_status == EPD_ERR_INTERNAL && !run->tried_after_failure &&
        epd_engine_failed(run->engine, NULL)) {
        /* the step failed (the loop may not have noticed yet): no step will run again, so a
         * submit now must be refused, not queued and never answered */
        uint64_t seed = 98;
        epd_request_t *late = make_request(1001, 2, &seed);
        bool stopped = epd_engine_stopped(run->engine);
        epd_status_t s = epd_engine_submit(run->engine, late);
        run->tried_after_failure = true;
        CHECK(s == EPD_ERR_SHUTTING_DOWN, "submit after a failed step (engine %s) gave %s",
              stopped ? "stopped" : "not stopped yet", epd_status_name(s));
        if (s != EPD_OK) {
            free(late->storage);
            free(late);
        }
    }
    run->saw_shutting_down |= st.shutting_down;
    if (epd_engine_stopped(run->engine)) {
        atomic_store(&loop_saw_stopped, true);
        event_base_loopbreak(run->base);
    }
}

static void deadline_cb(evutil_socket_t fd, short what, void *arg)
{
    run_t *run = arg;
    run->timed_out = true;
    event_base_loopbreak(run->base);
}

static void config_for_test(epd_config_t *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->model.hidden = HIDDEN;
    cfg->model.num_experts = EXPERTS;
    cfg->model.topk = TOPK;
    cfg->dispatch.dtype = EPD_WIRE_FP8;
    cfg->dispatch.scale = EPD_SCALE_GROUP128;
    cfg->dispatch.scale_format = EPD_SCALE_FMT_FP32;
    cfg->dispatch.max_tokens_per_step = 64;
    cfg->dispatch.max_tokens_per_request = 32;
    cfg->dispatch.max_queued_tokens = 96;
    cfg->dispatch.idle_backoff_us = 1000;
    cfg->experts.kind = EPD_EXPERTS_SCALE;
}

static void run_init(run_t *run, const epd_config_t *cfg, const epd_transport_t *transport,
                     epd_transport_ctx_t *tctx, epd_ops_ctx_t *octx)
{
    atomic_store(&loop_saw_stopped, false);
    char err[EPD_ERR_LEN];
    struct timeval limit = {30, 0};

    memset(run, 0, sizeof *run);
    run->shape = epd_moe_shape_from_config(cfg, (uint32_t)world, (uint32_t)rank);
    run->base = event_base_new();
    run->wake_ev = event_new(run->base, -1, 0, wake_cb, run);
    run->deadline = evtimer_new(run->base, deadline_cb, run);
    if (run->base == NULL || run->wake_ev == NULL || run->deadline == NULL) abort();
    evtimer_add(run->deadline, &limit);
    if (epd_engine_create(cfg, MPI_COMM_WORLD, &epd_ops_host, octx, transport, tctx, wake_fn,
                          run, &run->engine, err) != EPD_OK) {
        fprintf(stderr, "rank %d: engine: %s\n", rank, err);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
}

static void run_fini(run_t *run)
{
    epd_engine_destroy(run->engine);
    event_free(run->wake_ev);
    event_free(run->deadline);
    event_base_free(run->base);
    for (int i = 0; i < run->n_exp; i++) free(run->exp[i].y);
}

/* The gated transport: MPI's, whose first exchange waits until the test opens the gate. The
 * worker has taken its step's requests off the queue by then and agrees nothing until the step
 * ends, so while it waits the queue changes only by the test's submits. */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool armed, waiting, open;
} gate = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, false, false, false};

static epd_status_t gated_alltoallv(epd_transport_ctx_t *ctx, const void *send,
                                    const uint64_t *send_counts, const uint64_t *send_displs,
                                    void *recv, const uint64_t *recv_counts,
                                    const uint64_t *recv_displs, size_t item_bytes)
{
    pthread_mutex_lock(&gate.mu);
    if (gate.armed) {
        gate.waiting = true;
        pthread_cond_broadcast(&gate.cv);
        while (!gate.open) pthread_cond_wait(&gate.cv, &gate.mu);
        gate.armed = false;
    }
    pthread_mutex_unlock(&gate.mu);
    return epd_transport_mpi.alltoallv(ctx, send, send_counts, send_displs, recv, recv_counts,
                                       recv_displs, item_bytes);
}

/* Waits (at most 20 s) until the worker waits at the gate. */
static bool gate_wait_worker(void)
{
    struct timespec until;
    bool waiting;

    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 20;
    pthread_mutex_lock(&gate.mu);
    while (!gate.waiting && pthread_cond_timedwait(&gate.cv, &gate.mu, &until) == 0) {
    }
    waiting = gate.waiting;
    pthread_mutex_unlock(&gate.mu);
    return waiting;
}

static void gate_open(void)
{
    pthread_mutex_lock(&gate.mu);
    gate.open = true;
    pthread_cond_broadcast(&gate.cv);
    pthread_mutex_unlock(&gate.mu);
}

/* Submits a request of n tokens (the reference kept first: the engine owns it once accepted);
 * a refused one is dropped and forgotten. */
static epd_status_t submit_expected(run_t *run, uint64_t id, uint32_t n, uint32_t layer,
                                    uint64_t *seed)
{
    epd_request_t *req = make_request(id, n, seed);
    epd_status_t s;

    req->layer = layer;
    expect(run, req);
    s = epd_engine_submit(run->engine, req);
    if (s != EPD_OK) {
        free(run->exp[--run->n_exp].y);
        free(req->storage);
        free(req);
    }
    return s;
}

/* Run 1: results, busy, bad requests, shutdown from the last rank only, work queued on all. */
static uint64_t run_shutdown(epd_ops_ctx_t *octx, epd_transport_ctx_t *tctx)
{
    epd_config_t cfg;
    run_t run;
    uint64_t seed = 1234 + (uint64_t)rank * 77, id = 1, steps;
    /* Rank 0 queues 32 tokens (one step, then N = 0 in the next); rank 1 queues 95 of the 96 the
     * queue holds (two steps of at most 64) and, once its worker waits at the gate, fills the
     * queue again to one token below the limit. */
    static const uint32_t sizes[2][4] = {{20, 12, 0, 0}, {32, 32, 31, 0}};
    bool gated = world > 1 && rank == world - 1;
    epd_transport_t gated_mpi = epd_transport_mpi;
    uint32_t queued = 0;
    epd_status_t s;

    gated_mpi.alltoallv = gated_alltoallv;
    gate.armed = gated; /* the worker does not exist yet */
    gate.waiting = gate.open = false;
    config_for_test(&cfg);
    run_init(&run, &cfg, gated ? &gated_mpi : &epd_transport_mpi, tctx, octx);
    for (int i = 0; i < 4 && sizes[rank % 2][i] > 0; i++) {
        /* layers 0, 7 and 14 mixed in one queue */
        s = submit_expected(&run, id, sizes[rank % 2][i], (uint32_t)(id % 3) * 7, &seed);
        id++;
        CHECK(s == EPD_OK, "submit %d gave %s", i, epd_status_name(s));
        queued += sizes[rank % 2][i];
    }
    if (gated) {
        /* the first step has taken its requests and waits at the gate: until it is opened, the
         * queue changes by this thread's submits only */
        CHECK(gate_wait_worker(), "the worker did not reach its first step's exchange in 20 s");
        epd_engine_stats_t st;
        epd_engine_get_stats(run.engine, &st);
        for (uint64_t q = st.queued_tokens; q < 95;) {
            uint32_t n = 95 - q < 32 ? (uint32_t)(95 - q) : 32;
            s = submit_expected(&run, id, n, (uint32_t)(id % 3) * 7, &seed);
            id++;
            CHECK(s == EPD_OK, "%u tokens with %llu of 96 queued gave %s", n,
                  (unsigned long long)q, epd_status_name(s));
            q += n;
        }
        /* one token more than the queue holds: busy, and the caller keeps the request */
        epd_request_t *extra = make_request(500, 2, &seed);
        s = epd_engine_submit(run.engine, extra);
        CHECK(s == EPD_ERR_BUSY, "a submit past dispatch.max_queued_tokens gave %s",
              epd_status_name(s));
        free(extra->storage);
        free(extra);
    }
    epd_request_t *big = make_request(501, 33, &seed);
    s = epd_engine_submit(run.engine, big);
    CHECK(s == EPD_ERR_TOO_MANY_TOKENS, "33 tokens > max_tokens_per_request gave %s",
          epd_status_name(s));
    big->n_tokens = 0;
    s = epd_engine_submit(run.engine, big);
    CHECK(s == EPD_ERR_BAD_TENSOR, "0 tokens gave %s", epd_status_name(s));
    free(big->storage);
    free(big);

    if (rank == world - 1) {
        /* the shutdown is asked on the last rank only: only a flag until the next agreement */
        epd_engine_request_shutdown(run.engine);
        if (gated) {
            /* the worker waits mid-step, so no agreement can spread the shutdown yet: the
             * token the queue still holds is accepted */
            s = submit_expected(&run, id++, 1, 0, &seed);
            CHECK(s == EPD_OK, "a submit before the agreement gave %s", epd_status_name(s));
            gate_open();
        } else {
            /* a submit is still accepted (fits the queue), unless the worker agreed the
             * shutdown in between (a lone rank agrees at once): then it is refused as after
             * any agreement, and the caller keeps it; up to one request's 32 tokens */
            uint32_t n = 96 - queued < 32 ? 96 - queued : 32;
            s = submit_expected(&run, id++, n, 0, &seed);
            if (s == EPD_ERR_SHUTTING_DOWN) {
                epd_engine_stats_t st;
                epd_engine_get_stats(run.engine, &st);
                CHECK(st.shutting_down, "a submit was refused as shutting_down before the "
                                        "shutdown was agreed");
            } else {
                CHECK(s == EPD_OK, "a submit before the agreement gave %s", epd_status_name(s));
            }
        }
    }
    event_base_dispatch(run.base);

    CHECK(!run.timed_out, "the engine did not stop within 30 s");
    CHECK(epd_engine_stopped(run.engine), "the loop ended but the engine is not stopped");
    CHECK(!epd_engine_failed(run.engine, NULL), "the engine reports a failure");
    CHECK(run.n_answered == run.n_exp, "%d of %d accepted requests answered", run.n_answered,
          run.n_exp);
    CHECK(run.n_errors == 0, "%d requests answered with an error", run.n_errors);
    CHECK(run.saw_shutting_down && run.refused_after_agreement, "shutting_down was not seen");
    epd_engine_stats_t st;
    epd_engine_get_stats(run.engine, &st);
    CHECK(st.queued_tokens == 0 && st.queued_requests == 0, "queue not empty after the drain");
    CHECK(st.requests == (uint64_t)run.n_exp, "stats count %llu requests, %d accepted",
          (unsigned long long)st.requests, run.n_exp);
    /* bytes sent to other ranks: none when alone */
    CHECK(world == 1 ? st.bytes_sent[EPD_WIRE_FP8] == 0
                     : st.bytes_sent[EPD_WIRE_FP8] > 0 && st.bytes_sent[EPD_WIRE_BF16] == 0,
          "FP8 bytes %llu, BF16 bytes %llu", (unsigned long long)st.bytes_sent[EPD_WIRE_FP8],
          (unsigned long long)st.bytes_sent[EPD_WIRE_BF16]);
    CHECK(st.steps >= 2, "only %llu steps for more tokens than one step holds",
          (unsigned long long)st.steps);
    steps = st.steps;
    printf("rank %d: run 1: %d requests answered in %llu steps, last step %llu\n", rank,
           run.n_answered, (unsigned long long)st.steps, (unsigned long long)run.last_step);
    run_fini(&run);
    return steps;
}

static epd_status_t failing_alltoallv(epd_transport_ctx_t *ctx, const void *send,
                                      const uint64_t *send_counts, const uint64_t *send_displs,
                                      void *recv, const uint64_t *recv_counts,
                                      const uint64_t *recv_displs, size_t item_bytes)
{
    return EPD_ERR_MPI;
}

static const char *failing_last_error(const epd_transport_ctx_t *ctx)
{
    return "failing transport: down on purpose";
}

static double cpu_seconds(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec / 1e6;
}

static void idle_stop_cb(evutil_socket_t fd, short what, void *arg)
{
    event_base_loopbreak(arg);
}

/* Run 2: idle back-off, then a failing transport. */
static void run_failure(epd_ops_ctx_t *octx)
{
    epd_config_t cfg;
    run_t run;
    uint64_t seed = 777 + (uint64_t)rank;
    epd_transport_t failing = {
        .name = "failing",
        .alltoallv = failing_alltoallv,
        .last_error = failing_last_error,
    };
    struct timespec t0, t1;
    struct timeval idle = {0, 400000};
    char err[EPD_ERR_LEN] = "";

    config_for_test(&cfg);
    run_init(&run, &cfg, &failing, NULL, octx);
    run.want_status = EPD_ERR_INTERNAL;

    /* 0.4 s with nothing to do: agreements back off to idle_backoff_us (1 ms), no busy loop;
     * a lone rank has no agreement to poll */
    struct event *stop = evtimer_new(run.base, idle_stop_cb, run.base);
    evtimer_add(stop, &idle);
    double c0 = cpu_seconds();
    clock_gettime(CLOCK_MONOTONIC, &t0);
    event_base_dispatch(run.base);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double wall = (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
    double cpu = cpu_seconds() - c0;
    event_free(stop);
    printf("rank %d: idle: %.0f%% of a core over %.2f s\n", rank, 100.0 * cpu / wall, wall);
    CHECK(cpu < 0.5 * wall, "an idle engine used %.0f%% of a core", 100.0 * cpu / wall);
    /* alone, the worker waits for a submit, a shutdown or destroy, not for a timer */
    CHECK(world > 1 || cpu < 0.01 * wall, "a lone idle rank used %.1f%% of a core",
          100.0 * cpu / wall);

    if (world == 1) {
        /* one request, answered; then destroy while the worker waits hot for the next */
        epd_request_t *req = make_request(100, 30, &seed);
        run.want_status = EPD_OK;
        expect(&run, req);
        CHECK(epd_engine_submit(run.engine, req) == EPD_OK, "submit refused");
        struct timeval soon = {0, 200000};
        stop = evtimer_new(run.base, idle_stop_cb, run.base);
        evtimer_add(stop, &soon);
        event_base_dispatch(run.base);
        event_free(stop);
        CHECK(run.n_answered == 1 && run.n_errors == 0, "%d answered, %d errors", run.n_answered,
              run.n_errors);
        CHECK(!epd_engine_stopped(run.engine), "the engine stopped by itself");
        printf("rank %d: run 2: alone, the failing transport is never called (its part runs at "
               "np 2); destroyed hot\n", rank);
        run_fini(&run);
        return;
    }
    for (int i = 0; i < 3; i++) {
        epd_request_t *req = make_request(100 + (uint64_t)i, 30, &seed);
        expect(&run, req);
        CHECK(epd_engine_submit(run.engine, req) == EPD_OK, "submit %d refused", i);
    }
    event_base_dispatch(run.base);
    CHECK(!run.timed_out, "the engine did not stop after the failed step");
    CHECK(epd_engine_stopped(run.engine), "the engine did not stop after the failed step");
    CHECK(epd_engine_failed(run.engine, err), "epd_engine_failed is false after a failed step");
    CHECK(strstr(err, "failing") != NULL, "failure message '%s' does not name the transport", err);
    CHECK(strstr(err, "down on purpose") != NULL,
          "failure message '%s' lacks the transport's own sentence", err);
    CHECK(run.tried_after_failure, "no submit was tried after the failed step");
    CHECK(run.n_answered == run.n_exp && run.n_errors == run.n_exp,
          "%d answered, %d errors, %d accepted", run.n_answered, run.n_errors, run.n_exp);
    printf("rank %d: run 2: failed step reported: %s\n", rank, err);
    run_fini(&run);
}

int main(int argc, char **argv)
{
    int provided, all = 0;
    epd_ops_ctx_t *octx = NULL;
    epd_transport_ctx_t *tctx = NULL;
    char err[EPD_ERR_LEN];
    uint64_t steps, steps_min, steps_max;

    main_thread = pthread_self();
    MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (provided < MPI_THREAD_SERIALIZED) {
        if (rank == 0)
            printf("SKIP: MPI gives thread level %d, not MPI_THREAD_SERIALIZED\n", provided);
        MPI_Finalize();
        return 77;
    }
    if (EXPERTS % world != 0) {
        if (rank == 0) printf("SKIP: %d ranks do not divide %d experts\n", world, EXPERTS);
        MPI_Finalize();
        return 77;
    }
    evthread_use_pthreads();
    if (epd_ops_host.init(-1, &octx, err) != EPD_OK ||
        epd_transport_mpi.init(MPI_COMM_WORLD, &epd_ops_host, octx, &tctx, err) != EPD_OK) {
        fprintf(stderr, "rank %d: %s\n", rank, err);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }

    steps = run_shutdown(octx, tctx);
    /* the engines are stopped: MPI is this thread's again */
    MPI_Allreduce(&steps, &steps_min, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(&steps, &steps_max, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
    CHECK(steps_min == steps_max, "ranks ran different step counts (%llu..%llu)",
          (unsigned long long)steps_min, (unsigned long long)steps_max);
    run_failure(octx);
    CHECK(atomic_load(&late_wakes) == 0,
          "the worker called wake %d times after the engine had stopped (use after free in the "
          "daemon)", atomic_load(&late_wakes));

    MPI_Allreduce(&failures, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    epd_transport_mpi.fini(tctx);
    epd_ops_host.fini(octx);
    printf("rank %d: %s (%d failures here, %d on all ranks)\n", rank, all ? "FAIL" : "ok", failures,
           all);
    MPI_Finalize();
    return all == 0 ? 0 : 1;
}
