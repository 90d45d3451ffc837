/* The per-rank server (daemon/server.h): the glue between the listener, the connection table,
 * the CONTROL documents and the engine. It fills the context connections run in, routes the
 * engine's results, and drives the shutdown: a signal asks the engine to stop, the agreed drain
 * is announced (systemd STOPPING), and once the engine has stopped the connections flush and
 * close within a time limit. Event-loop thread only, except epd_server_wake. */
#include "daemon/server.h"

#include <inttypes.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <event2/event.h>

#include "daemon/conn.h"
#include "daemon/conn_table.h"
#include "daemon/control.h"
#include "daemon/external.h"
#include "daemon/http.h"
#include "daemon/listener.h"
#include "daemon/log.h"
#include "daemon/bulk.h"
#include "daemon/notify.h"
#include "daemon/stats.h"
#include "daemon/trace.h"
#include "daemon/trim.h"
#include "daemon/watchdog.h"
#include "common/clock.h"
#include "common/parse.h"
#include "proto/frame.h"

#define SERVER_DRAIN_TIMEOUT_S 5      /* how long clients get to read their last answers */
#define SERVER_HOUSEKEEPING_MS 250    /* notices a shutdown agreed on another rank */
/* How long a socket copy waits for its client to send (read) the next bytes of a payload before
 * it hands the rest back to the loop thread: a client streaming x has them microseconds away. */
#define SERVER_BULK_WAIT_US 500

static const int server_signals[] = {SIGTERM, SIGINT, SIGUSR1};

struct epd_server {
    const epd_config_t *cfg;
    struct event_base *base;
    epd_engine_t *engine;
    int rank;
    epd_submit_limits_t limits;
    epd_server_stats_t stats;

    epd_listener_t *listener;
    epd_conn_table_t *conns;
    epd_control_t *control;
    epd_external_t *external;     /* experts.kind external; NULL otherwise */
    epd_watchdog_t *watchdog;     /* stalls of the engine's agreements and steps */
    epd_trim_t trim;              /* memory back to the system after a burst */
    epd_http_t *http;             /* metrics.listen; NULL when off */
    epd_bulk_t *bulk;             /* socket.io_threads; NULL when 0 */
    epd_conn_ctx_t conn_ctx;      /* shared by every connection */
    uint64_t next_conn_id;
    uint64_t in_flight;           /* requests on the engine, all connections */

    struct event *wake_ev;
    /* The handover from the worker without libevent's lock while the loop spins (see
     * epd_server_wake): set by the worker, taken by the spinning loop. */
    atomic_bool wake_pending;
    atomic_bool spinning;
    bool loop_done; /* server_break: epd_server_run returns */
    struct event *housekeeping;
    struct event *signal_ev[EPD_ARRAY_SIZE(server_signals)];
    struct event *drain_timer;

    int signal_pending;           /* a signal that came before the engine was attached */
    bool shutdown_requested;      /* a signal reached this rank */
    bool draining;                /* the engine has agreed to shut down */
    bool stopping;                /* the engine has stopped: closing connections */
    uint64_t answered_in_drain;
    uint64_t answered_total;      /* results taken from the engine, delivered or discarded */
};

/* ---- what connections call back ---- */

static void server_request_accepted(void *arg)
{
    epd_server_t *server = arg;

    server->in_flight++;
    server->stats.requests_accepted++;
}

static epd_status_t server_control(void *arg, const char *op, char **meta_p, char **payload_p,
                                   size_t *payload_len_p, char err[EPD_ERR_LEN])
{
    epd_server_t *server = arg;
    return epd_control_answer(server->control, op, meta_p, payload_p, payload_len_p, err);
}

/* Ends epd_server_run. event_base_loopbreak alone is lost when it is called outside a loop
 * iteration (epd_server_run calls wake_cb directly while it spins, and libevent clears the flag
 * when the next iteration starts): the flag below is what epd_server_run looks at. */
static void server_break(epd_server_t *server)
{
    server->loop_done = true;
    event_base_loopbreak(server->base);
}

static void server_conn_closed(void *arg, epd_conn_t *conn)
{
    epd_server_t *server = arg;

    if (server->external != NULL) epd_external_detach(server->external, conn);

    epd_conn_table_remove(server->conns, conn);
    if (server->stopping && epd_conn_table_count(server->conns) == 0)
        server_break(server);
}

static epd_status_t server_serve_experts(void *arg, epd_conn_t *conn, epd_region_t *in,
                                         epd_region_t *out, const cJSON *meta, char **meta_p,
                                         char err[EPD_ERR_LEN])
{
    epd_server_t *server = arg;
    return epd_external_attach(server->external, conn, in, out, meta, meta_p, err);
}

static epd_status_t server_experts_done(void *arg, epd_conn_t *conn, const epd_frame_t *frame,
                                        char err[EPD_ERR_LEN])
{
    epd_server_t *server = arg;
    return epd_external_done(server->external, conn, frame, err);
}

void epd_server_set_external(epd_server_t *server, epd_external_t *external)
{
    server->external = external;
    if (external != NULL) epd_external_set_loop(external, &server->spinning);
    server->conn_ctx.serve_experts = external != NULL ? server_serve_experts : NULL;
    server->conn_ctx.experts_done = external != NULL ? server_experts_done : NULL;
}

/* The listener accepted fd: it becomes a connection in the table. */
static void server_accept(void *arg, int fd, uid_t uid, pid_t pid)
{
    epd_server_t *server = arg;
    uint64_t id = server->next_conn_id++;
    epd_conn_t *conn = epd_conn_create(&server->conn_ctx, fd, id, uid, pid);

    if (conn == NULL) {
        epd_log_error("refused a connection: out of memory");
        return;
    }
    if (epd_conn_table_add(server->conns, conn) != EPD_OK) {
        epd_log_error("refused a connection: out of memory");
        epd_conn_abort(conn);
        return;
    }
    epd_log_debug("conn %" PRIu64 " accepted (pid %ld, uid %ld), %" PRIu64 " clients", id,
                  (long)pid, (long)uid, epd_conn_table_count(server->conns));
}

/* ---- results, shutdown ---- */

static void server_notify(epd_server_t *server, const char *state)
{
    char err[EPD_ERR_LEN];
    bool sent;

    if (server->rank != 0) return;
    if (epd_notify_send(getenv("NOTIFY_SOCKET"), state, &sent, err) != EPD_OK)
        epd_log_warn("systemd notify: %s", err);
}

static void drain_timeout_cb(evutil_socket_t fd, short what, void *arg)
{
    epd_server_t *server = arg;

    epd_log_warn("%zu clients did not read their last answers within %d s; closing them",
                 (size_t)epd_conn_table_count(server->conns), SERVER_DRAIN_TIMEOUT_S);
    epd_conn_table_each(server->conns, epd_conn_abort);
    server_break(server);
}

/* The engine has stopped: every accepted request is answered. Stop accepting, flush, close. */
static void server_stop(epd_server_t *server)
{
    server->stopping = true;
    epd_trace_report();
    epd_log_info("drained: answered %" PRIu64 " requests, exiting (since start: accepted %" PRIu64
                 ", answered %" PRIu64 ", results discarded %" PRIu64 ")",
                 server->answered_in_drain, server->stats.requests_accepted,
                 server->answered_total, server->stats.results_discarded);
    if (server->answered_total != server->stats.requests_accepted)
        epd_log_error("%" PRIu64 " accepted requests were never answered",
                      server->stats.requests_accepted - server->answered_total);
    epd_listener_free(server->listener);
    server->listener = NULL;
    epd_watchdog_free(server->watchdog);
    server->watchdog = NULL;
    if (server->housekeeping != NULL) event_del(server->housekeeping);

    epd_conn_table_each(server->conns, epd_conn_shutdown);
    if (epd_conn_table_count(server->conns) == 0) {
        server_break(server);
        return;
    }
    struct timeval tv = {SERVER_DRAIN_TIMEOUT_S, 0};
    evtimer_add(server->drain_timer, &tv);
}

/* Notices the agreed shutdown (whichever rank asked for it) and the engine's stop. */
static void server_check_engine(epd_server_t *server)
{
    epd_engine_stats_t es;

    if (server->engine == NULL || server->stopping) return;
    if (!server->draining) {
        epd_engine_get_stats(server->engine, &es);
        if (es.shutting_down) {
            server->draining = true;
            epd_log_info("draining: %" PRIu64 " requests queued (%" PRIu64 " tokens), %" PRIu64
                         " in flight from %" PRIu64 " clients", es.queued_requests,
                         es.queued_tokens, server->in_flight,
                         epd_conn_table_count(server->conns));
            server_notify(server, "STOPPING=1\nSTATUS=draining");
        }
    }
    if (epd_engine_stopped(server->engine)) {
        char err[EPD_ERR_LEN];
        if (epd_engine_failed(server->engine, err))
            epd_log_error("a step failed: %s; its requests were answered 'internal', the job will "
                          "abort once they are sent", err);
        server->draining = true;
        server_stop(server);
    }
}

static void wake_cb(evutil_socket_t fd, short what, void *arg)
{
    epd_server_t *server = arg;
    epd_result_t *results = server->engine ? epd_engine_take_results(server->engine) : NULL;

    while (results != NULL) {
        epd_result_t *result = results;
        results = result->next;
        result->next = NULL;
        if (server->in_flight > 0) server->in_flight--;
        server->answered_total++;
        if (server->draining || server->shutdown_requested) server->answered_in_drain++;
        if (result->status == EPD_OK)
            epd_metrics_observe_request(server->stats.metrics, result->latency_ns);
        if (epd_trace_on()) {
            epd_result_t copy = *result; /* delivered results are freed or kept by the conn */
            uint64_t delivered_ns = epd_now_ns();
            epd_conn_table_deliver(server->conns, result);
            epd_trace_result(&copy, delivered_ns, epd_now_ns());
            continue;
        }
        epd_conn_table_deliver(server->conns, result);
    }
    server_check_engine(server);
}

static void housekeeping_cb(evutil_socket_t fd, short what, void *arg)
{
    epd_server_t *server = arg;

    server_check_engine(server);
    if (server->engine != NULL && !server->stopping)
        epd_trim_tick(&server->trim, server->stats.bytes_in + server->stats.bytes_out,
                      server->in_flight > 0 || server->stats.buffered_bytes > 0);
}

int epd_server_run(epd_server_t *server)
{
    for (;;) {
        bool hot = server->engine != NULL && !server->stopping && epd_engine_hot(server->engine);
        /* spinning is cleared before pending is looked at, and the worker sets pending before
         * it looks at spinning: one of the two sees the other (both seq_cst) */
        atomic_store(&server->spinning, hot);
        if (atomic_exchange(&server->wake_pending, false)) wake_cb(-1, 0, server);
        if (server->external != NULL) epd_external_poll(server->external);
        if (server->loop_done) return 0;
        int rc = event_base_loop(server->base, hot ? EVLOOP_NONBLOCK : EVLOOP_ONCE);
        if (rc < 0) return -1;
        if (rc == 1 || server->loop_done || event_base_got_break(server->base) ||
            event_base_got_exit(server->base))
            return 0;
    }
}

/* From the worker. While the loop spins it finds wake_pending within an iteration; event_active
 * would take libevent's lock, which the spinning loop holds but for its epoll_wait calls (the
 * handover then took about 8 us on an H200 node). */
void epd_server_wake(void *arg)
{
    epd_server_t *server = arg;
    atomic_store(&server->wake_pending, true);
    if (!atomic_load(&server->spinning)) event_active(server->wake_ev, EV_READ, 0);
}

static void signal_cb(evutil_socket_t signum, short what, void *arg)
{
    epd_server_t *server = arg;
    const char *name = signum == SIGTERM ? "SIGTERM" : signum == SIGINT ? "SIGINT" : "SIGUSR1";

    if (server->shutdown_requested || server->signal_pending) {
        epd_log_info("%s received again; already shutting down", name);
        return;
    }
    if (server->engine == NULL) {
        server->signal_pending = (int)signum;
        epd_log_info("shutdown requested by %s (during start-up)", name);
        return;
    }
    server->shutdown_requested = true;
    epd_log_info("shutdown requested by %s", name);
    epd_engine_request_shutdown(server->engine);
}

/* ---- life cycle ---- */

void epd_server_set_layer_hook(epd_server_t *server, bool (*known)(void *arg, uint32_t layer),
                               void *arg)
{
    server->limits.layer_known = known;
    server->limits.layer_arg = arg;
}

epd_status_t epd_server_create(const epd_config_t *cfg, struct event_base *base, int rank,
                               int world, epd_server_t **server_p, char err[EPD_ERR_LEN])
{
    epd_status_t status = EPD_ERR_NO_MEMORY;
    epd_server_t *server = calloc(1, sizeof(*server));

    *server_p = NULL;
    if (server == NULL) goto out_nomem;
    server->cfg = cfg;
    server->base = base;
    server->rank = rank;
    server->next_conn_id = 1;
    server->limits.hidden = cfg->model.hidden;
    server->limits.topk = cfg->model.topk;
    server->limits.num_experts = cfg->model.num_experts;
    server->limits.max_tokens = cfg->dispatch.max_tokens_per_request;
    server->conn_ctx = (epd_conn_ctx_t){
        .cfg = cfg,
        .limits = &server->limits,
        .base = base,
        .stats = &server->stats,
        .arg = server,
        .request_accepted = server_request_accepted,
        .control = server_control,
        .closed = server_conn_closed,
    };

    server->stats.metrics = epd_metrics_create(cfg->model.num_experts, cfg->model.topk);
    if (server->stats.metrics == NULL) goto out_free;
    server->conns = epd_conn_table_create(&server->stats);
    if (server->conns == NULL) goto out_free;
    if (cfg->socket.io_threads > 0) {
        status = epd_bulk_create(base, cfg->socket.io_threads, SERVER_BULK_WAIT_US, &server->bulk,
                                 err);
        if (status != EPD_OK) goto out_free;
        server->conn_ctx.bulk = server->bulk;
        status = EPD_ERR_NO_MEMORY; /* what the failures below are */
    }
    CHECK_GOTO(epd_control_create(cfg, rank, world, &server->stats, &server->control, err),
               out_free);
    server->wake_ev = event_new(base, -1, 0, wake_cb, server);
    server->housekeeping = event_new(base, -1, EV_PERSIST, housekeeping_cb, server);
    server->drain_timer = evtimer_new(base, drain_timeout_cb, server);
    if (!server->wake_ev || !server->housekeeping || !server->drain_timer) goto out_free;
    for (size_t i = 0; i < EPD_ARRAY_SIZE(server_signals); i++) {
        /* Installed now so a stop during start-up is remembered, not fatal. libevent restores
         * the disposition it found when the event is freed: ignoring it first means a late copy
         * of the signal (mpirun forwards one to every rank; a fast drain can end before it
         * arrives) finds the rank exiting, not killed by the default action. */
        signal(server_signals[i], SIG_IGN);
        server->signal_ev[i] = evsignal_new(base, server_signals[i], signal_cb, server);
        if (server->signal_ev[i] == NULL || evsignal_add(server->signal_ev[i], NULL) != 0) {
            snprintf(err, EPD_ERR_LEN, "cannot install the handler of signal %d",
                     server_signals[i]);
            status = EPD_ERR_IO;
            goto out_free;
        }
    }
    *server_p = server;
    return EPD_OK;

out_free:
    epd_server_free(server);
out_nomem:
    if (status == EPD_ERR_NO_MEMORY)
        snprintf(err, EPD_ERR_LEN, "out of memory creating the server");
    return status;
}

epd_status_t epd_server_listen(epd_server_t *server, const char *path, char err[EPD_ERR_LEN])
{
    return epd_listener_open(server->cfg, server->base, &server->stats, path, server_accept, server,
                             &server->listener, err);
}

/* The exposition for HTTP: the same text as CONTROL `metrics`. */
static char *server_render_metrics(void *arg)
{
    epd_server_t *server = arg;
    char *meta = NULL, *payload = NULL, err[EPD_ERR_LEN];
    size_t len = 0;

    if (epd_control_answer(server->control, "metrics", &meta, &payload, &len, err) != EPD_OK)
        return NULL;
    free(meta);
    return payload;
}

epd_status_t epd_server_metrics_listen(epd_server_t *server, int local_rank,
                                       char err[EPD_ERR_LEN])
{
    char host[EPD_CONFIG_STR_LEN], why[EPD_ERR_LEN];
    uint16_t port;

    if (strcmp(server->cfg->metrics.listen, "off") == 0) return EPD_OK;
    if (epd_parse_host_port(server->cfg->metrics.listen, host, sizeof(host), &port, why) !=
        EPD_OK) {
        snprintf(err, EPD_ERR_LEN, "metrics.listen: %.200s", why);
        return EPD_ERR_CONFIG;
    }
    if ((unsigned)port + (unsigned)local_rank > 65535) {
        snprintf(err, EPD_ERR_LEN, "metrics.listen: port %u + local rank %d is above 65535",
                 (unsigned)port, local_rank);
        return EPD_ERR_CONFIG;
    }
    port = (uint16_t)(port + local_rank);
    epd_status_t status = epd_http_open(server->base, host, port, server_render_metrics, server,
                                        &server->http, err);
    if (status == EPD_OK)
        epd_log_info("metrics on http://%s%s%s:%u/metrics", strchr(host, ':') ? "[" : "", host,
                     strchr(host, ':') ? "]" : "", (unsigned)port);
    return status;
}

epd_status_t epd_server_start(epd_server_t *server, epd_engine_t *engine, char err[EPD_ERR_LEN])
{
    server->engine = engine;
    server->conn_ctx.engine = engine;
    epd_control_attach(server->control, engine);
    epd_engine_set_step_observer(engine, epd_metrics_observe_step, server->stats.metrics);
    epd_status_t status = epd_listener_start(server->listener, err);
    if (status != EPD_OK) return status;
    status = epd_watchdog_create(server->cfg, server->base, engine, &server->stats, server->rank,
                                 &server->watchdog, err);
    if (status != EPD_OK) return status;
    struct timeval tv = {0, SERVER_HOUSEKEEPING_MS * 1000};
    event_add(server->housekeeping, &tv);
    if (server->signal_pending) {
        server->shutdown_requested = true;
        epd_engine_request_shutdown(engine);
    }
    return EPD_OK;
}

void epd_server_free(epd_server_t *server)
{
    if (server == NULL) return;
    server->stopping = false; /* no loopbreak from here */
    if (server->conns != NULL) epd_conn_table_each(server->conns, epd_conn_abort);
    epd_bulk_free(server->bulk); /* after the aborts: frees the connections whose copies ran */
    epd_listener_free(server->listener);
    epd_watchdog_free(server->watchdog);
    for (size_t i = 0; i < EPD_ARRAY_SIZE(server_signals); i++)
        if (server->signal_ev[i] != NULL) event_free(server->signal_ev[i]);
    if (server->drain_timer != NULL) event_free(server->drain_timer);
    if (server->housekeeping != NULL) event_free(server->housekeeping);
    if (server->wake_ev != NULL) event_free(server->wake_ev);
    epd_http_free(server->http);
    epd_control_free(server->control);
    epd_conn_table_free(server->conns);
    epd_metrics_free(server->stats.metrics);
    free(server);
}

uint64_t epd_server_answered_in_drain(const epd_server_t *server)
{
    return server->answered_in_drain;
}
