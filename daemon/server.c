/* The per-rank server: the Unix socket file (template, stale check, mode), the listener with the
 * client limit and SO_PEERCRED check, the table of live connections by id, engine results routed
 * to them (or discarded and counted when their client is gone), signals, the CONTROL documents,
 * and the graceful drain. Event-loop thread only, except epd_server_wake. */
#include "daemon/server.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <event2/event.h>
#include <event2/listener.h>

#include "daemon/log.h"
#include "daemon/notify.h"

#define SERVER_BUCKETS 1024           /* connection table, a power of two */
#define SERVER_DRAIN_TIMEOUT_S 5      /* how long clients get to read their last answers */
#define SERVER_LISTEN_BACKLOG 1024
#define SERVER_HOUSEKEEPING_MS 250    /* notices a shutdown agreed on another rank */
#define SERVER_ACCEPT_RETRY_MS 100    /* pause after accept() fails (e.g. out of descriptors) */

static const int server_signals[] = {SIGTERM, SIGINT, SIGUSR1};

typedef struct conn_node {
    uint64_t id;
    epd_conn_t *conn;
    struct conn_node *next;
} conn_node_t;

struct epd_server {
    const epd_config_t *cfg;
    struct event_base *base;
    epd_engine_t *engine;
    int rank;
    int world;
    epd_submit_limits_t limits;
    char *config_json;

    int listen_fd;
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    bool bound;
    dev_t bound_dev;
    ino_t bound_ino;
    struct evconnlistener *listener;
    struct event *accept_retry;

    struct event *wake_ev;
    struct event *housekeeping;
    struct event *signal_ev[EPD_ARRAY_SIZE(server_signals)];
    struct event *drain_timer;

    conn_node_t *buckets[SERVER_BUCKETS];
    uint64_t next_conn_id;
    uint64_t in_flight;           /* requests on the engine, all connections */
    epd_server_stats_t stats;
    struct timespec started;

    int signal_pending;           /* a signal that came before the engine was attached */
    bool shutdown_requested;      /* a signal reached this rank */
    bool draining;                /* the engine has agreed to shut down */
    bool stopping;                /* the engine has stopped: closing connections */
    uint64_t answered_in_drain;
    uint64_t answered_total;      /* results taken from the engine, delivered or discarded */
    time_t last_accept_error_log;
};

/* ---- socket file ---- */

/* snprintf into err; messages with paths may be cut at EPD_ERR_LEN, which is fine. */
static void __attribute__((format(printf, 2, 3)))
set_err(char err[EPD_ERR_LEN], const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, EPD_ERR_LEN, fmt, ap);
    va_end(ap);
}

static void addr_of(const char *path, struct sockaddr_un *addr_p)
{
    memset(addr_p, 0, sizeof(*addr_p));
    addr_p->sun_family = AF_UNIX;
    snprintf(addr_p->sun_path, sizeof(addr_p->sun_path), "%s", path);
}

/* The directory must exist; an existing socket file nobody answers on is removed; anything else
 * at the path is an error. */
static epd_status_t socket_file_prepare(const char *path, char err[EPD_ERR_LEN])
{
    char dir[PATH_MAX];
    struct stat st;

    snprintf(dir, sizeof(dir), "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash == NULL) snprintf(dir, sizeof(dir), ".");
    else if (slash == dir) dir[1] = '\0';
    else *slash = '\0';
    if (stat(dir, &st) != 0) {
        set_err(err, "socket.path '%s': directory '%s' %s (create it first; "
                 "under systemd, RuntimeDirectory=epd provides /run/epd)", path, dir,
                 errno == ENOENT ? "does not exist" : strerror(errno));
        return EPD_ERR_CONFIG;
    }
    if (!S_ISDIR(st.st_mode)) {
        set_err(err, "socket.path '%s': '%s' is not a directory", path, dir);
        return EPD_ERR_CONFIG;
    }

    if (lstat(path, &st) != 0) {
        if (errno == ENOENT) return EPD_OK;
        set_err(err, "socket.path '%s': %s", path, strerror(errno));
        return EPD_ERR_IO;
    }
    if (!S_ISSOCK(st.st_mode)) {
        set_err(err, "socket.path '%s' exists and is not a socket; refusing to "
                 "replace it", path);
        return EPD_ERR_CONFIG;
    }

    /* A socket file: stale only if nothing answers on it. */
    struct sockaddr_un addr;
    addr_of(path, &addr);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        set_err(err, "socket(): %s", strerror(errno));
        return EPD_ERR_IO;
    }
    int rc = connect(fd, (struct sockaddr *)&addr, sizeof(addr));
    int saved = errno;
    close(fd);
    if (rc == 0 || saved == EAGAIN || saved == EINPROGRESS) {
        set_err(err, "socket.path '%s': another process is already listening there (ranks "
                "sharing a host need %%r or %%l in socket.path)", path);
        return EPD_ERR_CONFIG;
    }
    if (saved != ECONNREFUSED) {
        set_err(err, "socket.path '%s': cannot tell whether it is in use: %s", path,
                 strerror(saved));
        return EPD_ERR_IO;
    }
    if (unlink(path) != 0 && errno != ENOENT) {
        set_err(err, "socket.path '%s': cannot remove the stale socket: %s", path,
                 strerror(errno));
        return EPD_ERR_IO;
    }
    epd_log_info("removed stale socket %s (nothing was listening on it)", path);
    return EPD_OK;
}

epd_status_t epd_server_listen(epd_server_t *server, const char *path, char err[EPD_ERR_LEN])
{
    const epd_config_t *cfg = server->cfg;
    mode_t mode = (mode_t)(cfg->socket.mode & 07777);
    struct sockaddr_un addr;
    struct stat st;
    epd_status_t status;
    int fd;

    if (strlen(path) >= sizeof(addr.sun_path)) {
        set_err(err, "socket.path '%s' is longer than a Unix socket address allows "
                 "(%zu bytes)", path, sizeof(addr.sun_path) - 1);
        return EPD_ERR_CONFIG;
    }
    CHECK_GOTO(socket_file_prepare(path, err), out);

    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        set_err(err, "socket(): %s", strerror(errno));
        status = EPD_ERR_IO;
        goto out;
    }
    addr_of(path, &addr);
    /* The file is created with the right mode from the start (no window where it is wider). */
    mode_t old_umask = umask((mode_t)(~mode & 0777));
    int rc = bind(fd, (struct sockaddr *)&addr, sizeof(addr));
    int saved = errno;
    umask(old_umask);
    if (rc != 0) {
        set_err(err, "socket.path '%s': bind(): %s%s", path, strerror(saved),
                saved == EADDRINUSE ? " (ranks sharing a host need %r or %l in socket.path)" : "");
        status = EPD_ERR_IO;
        goto out_close;
    }
    if (chmod(path, mode) != 0 || lstat(path, &st) != 0) {
        set_err(err, "socket.path '%s': chmod %04o: %s", path, (unsigned)mode,
                 strerror(errno));
        status = EPD_ERR_IO;
        goto out_unlink;
    }
    if (listen(fd, SERVER_LISTEN_BACKLOG) != 0) {
        set_err(err, "socket.path '%s': listen(): %s", path, strerror(errno));
        status = EPD_ERR_IO;
        goto out_unlink;
    }
    snprintf(server->path, sizeof(server->path), "%s", path);
    server->listen_fd = fd;
    server->bound = true;
    server->bound_dev = st.st_dev;
    server->bound_ino = st.st_ino;
    return EPD_OK;

out_unlink:
    unlink(path);
out_close:
    close(fd);
out:
    return status;
}

/* Removes the socket file if it is still the one this server bound. */
static void server_unlink(epd_server_t *server)
{
    struct stat st;

    if (!server->bound) return;
    if (lstat(server->path, &st) == 0 && st.st_dev == server->bound_dev &&
        st.st_ino == server->bound_ino)
        unlink(server->path);
    server->bound = false;
}

/* ---- connection table ---- */

static conn_node_t **table_slot(epd_server_t *server, uint64_t id)
{
    conn_node_t **slot = &server->buckets[id & (SERVER_BUCKETS - 1)];
    while (*slot != NULL && (*slot)->id != id) slot = &(*slot)->next;
    return slot;
}

static epd_conn_t *table_find(epd_server_t *server, uint64_t id)
{
    conn_node_t *node = *table_slot(server, id);
    return node ? node->conn : NULL;
}

/* The ids of every live connection (malloc'ed), so callers can act on each while the table
 * changes under them. */
static uint64_t *table_ids(epd_server_t *server, size_t *n_p)
{
    size_t n = 0;
    uint64_t *ids = malloc((server->stats.clients + 1) * sizeof(*ids));
    if (ids == NULL) {
        *n_p = 0;
        return NULL;
    }
    for (size_t b = 0; b < SERVER_BUCKETS; b++)
        for (conn_node_t *node = server->buckets[b]; node != NULL && n < server->stats.clients + 1;
             node = node->next)
            ids[n++] = node->id;
    *n_p = n;
    return ids;
}

void epd_server_conn_closed(epd_server_t *server, epd_conn_t *conn)
{
    conn_node_t **slot = table_slot(server, epd_conn_id(conn));
    conn_node_t *node = *slot;

    if (node == NULL) return;
    *slot = node->next;
    free(node);
    server->stats.clients--;
    uint64_t pending = epd_conn_in_flight(conn);
    if (pending > 0)
        epd_log_info("conn %" PRIu64 " closed with %" PRIu64 " requests in flight; their results "
                     "will be discarded", epd_conn_id(conn), pending);
    else
        epd_log_debug("conn %" PRIu64 " closed", epd_conn_id(conn));
    if (server->stopping && server->stats.clients == 0) event_base_loopbreak(server->base);
}

/* ---- accepting ---- */

static bool uid_allowed(const epd_config_t *cfg, uid_t uid)
{
    /* root and the daemon's own user can reach the ranks' memory anyway: never refused. */
    if (cfg->socket.n_allow_uids == 0 || uid == 0 || uid == geteuid()) return true;
    for (uint32_t i = 0; i < cfg->socket.n_allow_uids; i++)
        if (cfg->socket.allow_uids[i] == (uint32_t)uid) return true;
    return false;
}

static void refuse_busy(epd_server_t *server, int fd, pid_t pid)
{
    uint8_t *buf = NULL;
    size_t len = 0;
    char message[160];

    snprintf(message, sizeof(message), "too many clients: this rank serves at most %" PRIu32
             " (socket.max_clients)", server->cfg->socket.max_clients);
    if (epd_conn_encode_error(false, 0, EPD_ERR_BUSY, message, &buf, &len) == EPD_OK) {
        /* A fresh socket's buffer takes this small frame whole; if not, the client gets EOF. */
        ssize_t n = send(fd, buf, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) server->stats.bytes_out += (uint64_t)n;
        free(buf);
    }
    server->stats.errors[EPD_ERR_BUSY]++;
    server->stats.clients_refused++;
    epd_log_info("refused a connection from pid %ld: %" PRIu64
                 " clients already (socket.max_clients)", (long)pid, server->stats.clients);
    close(fd);
}

static void accept_cb(struct evconnlistener *listener, evutil_socket_t fd, struct sockaddr *addr,
                      int socklen, void *arg)
{
    epd_server_t *server = arg;
    struct ucred cred = {.pid = 0, .uid = (uid_t)-1, .gid = (gid_t)-1};
    socklen_t cred_len = sizeof(cred);

    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) != 0) {
        epd_log_warn("refused a connection: SO_PEERCRED failed: %s", strerror(errno));
        server->stats.clients_refused++;
        close(fd);
        return;
    }
    if (!uid_allowed(server->cfg, cred.uid)) {
        epd_log_warn("refused a connection from uid %ld (pid %ld): not in socket.allow_uids",
                     (long)cred.uid, (long)cred.pid);
        server->stats.clients_refused++;
        close(fd);
        return;
    }
    if (server->stats.clients >= server->cfg->socket.max_clients) {
        refuse_busy(server, fd, cred.pid);
        return;
    }
    uint64_t id = server->next_conn_id++;
    conn_node_t *node = malloc(sizeof(*node));
    if (node == NULL) {
        epd_log_error("refused a connection: out of memory");
        close(fd);
        return;
    }
    epd_conn_t *conn = epd_conn_create(server, fd, id, cred.uid, cred.pid);
    if (conn == NULL) {
        epd_log_error("refused a connection: out of memory");
        free(node);
        return;
    }
    node->id = id;
    node->conn = conn;
    conn_node_t **slot = table_slot(server, id);
    node->next = NULL;
    *slot = node;
    server->stats.clients++;
    server->stats.clients_total++;
    epd_log_debug("conn %" PRIu64 " accepted (pid %ld, uid %ld), %" PRIu64 " clients", id,
                  (long)cred.pid, (long)cred.uid, server->stats.clients);
}

static void accept_retry_cb(evutil_socket_t fd, short what, void *arg)
{
    epd_server_t *server = arg;
    if (server->listener != NULL) evconnlistener_enable(server->listener);
}

static void accept_error_cb(struct evconnlistener *listener, void *arg)
{
    epd_server_t *server = arg;
    int saved = errno;
    time_t now = time(NULL);

    if (now != server->last_accept_error_log) {
        epd_log_warn("accept() failed: %s; pausing new connections for %d ms", strerror(saved),
                     SERVER_ACCEPT_RETRY_MS);
        server->last_accept_error_log = now;
    }
    /* Out of descriptors would fail again at once: wait instead of spinning. */
    evconnlistener_disable(listener);
    struct timeval tv = {0, SERVER_ACCEPT_RETRY_MS * 1000};
    evtimer_add(server->accept_retry, &tv);
}

/* ---- results, shutdown ---- */

static uint64_t server_in_flight_total(epd_server_t *server)
{
    return server->in_flight;
}

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
    size_t n = 0;
    uint64_t *ids = table_ids(server, &n);

    epd_log_warn("%zu clients did not read their last answers within %d s; closing them", n,
                 SERVER_DRAIN_TIMEOUT_S);
    for (size_t i = 0; i < n; i++) {
        epd_conn_t *conn = table_find(server, ids[i]);
        if (conn != NULL) epd_conn_abort(conn);
    }
    free(ids);
    event_base_loopbreak(server->base);
}

/* The engine has stopped: every accepted request is answered. Stop accepting, flush, close. */
static void server_stop(epd_server_t *server)
{
    size_t n = 0;
    uint64_t *ids;

    server->stopping = true;
    epd_log_info("drained: answered %" PRIu64 " requests, exiting (since start: accepted %" PRIu64
                 ", answered %" PRIu64 ", results discarded %" PRIu64 ")",
                 server->answered_in_drain, server->stats.requests_accepted,
                 server->answered_total, server->stats.results_discarded);
    if (server->answered_total != server->stats.requests_accepted)
        epd_log_error("%" PRIu64 " accepted requests were never answered",
                      server->stats.requests_accepted - server->answered_total);
    if (server->listener != NULL) {
        evconnlistener_free(server->listener);
        server->listener = NULL;
        server->listen_fd = -1;
    }
    server_unlink(server);
    if (server->housekeeping != NULL) event_del(server->housekeeping);

    ids = table_ids(server, &n);
    for (size_t i = 0; i < n; i++) {
        epd_conn_t *conn = table_find(server, ids[i]);
        if (conn != NULL) epd_conn_shutdown(conn);
    }
    free(ids);
    if (server->stats.clients == 0) {
        event_base_loopbreak(server->base);
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
                         es.queued_tokens, server_in_flight_total(server), server->stats.clients);
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
        epd_conn_t *conn = table_find(server, result->conn_id);
        if (conn != NULL) {
            epd_conn_deliver(conn, result);
        } else {
            server->stats.results_discarded++;
            epd_log_debug("result of request %" PRIu64 " discarded: conn %" PRIu64 " is gone",
                          result->id, result->conn_id);
            epd_result_free(result);
        }
    }
    server_check_engine(server);
}

static void housekeeping_cb(evutil_socket_t fd, short what, void *arg)
{
    server_check_engine(arg);
}

void epd_server_wake(void *arg)
{
    epd_server_t *server = arg;
    event_active(server->wake_ev, EV_READ, 0);
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

/* ---- CONTROL documents ---- */

static void server_view(epd_server_t *server, epd_engine_stats_t *es, epd_stats_view_t *view)
{
    struct timespec now;

    clock_gettime(CLOCK_MONOTONIC, &now);
    epd_engine_get_stats(server->engine, es);
    view->rank = server->rank;
    view->world = server->world;
    view->uptime_s = (double)(now.tv_sec - server->started.tv_sec) +
                     (double)(now.tv_nsec - server->started.tv_nsec) / 1e9;
    view->dtype = server->cfg->dispatch.dtype;
    view->engine = es;
    view->server = &server->stats;
}

epd_status_t epd_server_control(epd_server_t *server, const char *op, char **meta_p,
                                char **payload_p, size_t *payload_len_p)
{
    epd_engine_stats_t es;
    epd_stats_view_t view;

    *meta_p = NULL;
    *payload_p = NULL;
    *payload_len_p = 0;
    if (strcmp(op, "config") == 0) {
        *meta_p = strdup(server->config_json);
    } else if (strcmp(op, "health") == 0) {
        server_view(server, &es, &view);
        *meta_p = epd_stats_health_json(&view);
    } else if (strcmp(op, "stats") == 0) {
        server_view(server, &es, &view);
        *meta_p = epd_stats_json(&view);
    } else if (strcmp(op, "metrics") == 0) {
        server_view(server, &es, &view);
        *payload_p = epd_stats_metrics(&view);
        if (*payload_p == NULL) return EPD_ERR_NO_MEMORY;
        *payload_len_p = strlen(*payload_p);
        *meta_p = strdup("{\"op\":\"metrics\",\"content_type\":\"text/plain; version=0.0.4; "
                         "charset=utf-8\"}");
    } else {
        return EPD_ERR_UNKNOWN_OP;
    }
    if (*meta_p == NULL) {
        free(*payload_p);
        *payload_p = NULL;
        return EPD_ERR_NO_MEMORY;
    }
    return EPD_OK;
}

/* ---- life cycle ---- */

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
    server->world = world;
    server->listen_fd = -1;
    server->next_conn_id = 1;
    server->limits.hidden = cfg->model.hidden;
    server->limits.topk = cfg->model.topk;
    server->limits.num_experts = cfg->model.num_experts;
    server->limits.max_tokens = cfg->dispatch.max_tokens_per_request;
    clock_gettime(CLOCK_MONOTONIC, &server->started);

    size_t cap = 4096;
    for (;;) {
        server->config_json = malloc(cap);
        if (server->config_json == NULL) goto out_free;
        size_t need = epd_config_to_json(cfg, server->config_json, cap);
        if (need < cap) break;
        free(server->config_json);
        server->config_json = NULL;
        cap = need + 1;
    }

    server->wake_ev = event_new(base, -1, 0, wake_cb, server);
    server->housekeeping = event_new(base, -1, EV_PERSIST, housekeeping_cb, server);
    server->drain_timer = evtimer_new(base, drain_timeout_cb, server);
    server->accept_retry = evtimer_new(base, accept_retry_cb, server);
    if (!server->wake_ev || !server->housekeeping || !server->drain_timer || !server->accept_retry)
        goto out_free;
    for (size_t i = 0; i < EPD_ARRAY_SIZE(server_signals); i++) {
        /* Installed now so a stop during start-up is remembered, not fatal. */
        server->signal_ev[i] = evsignal_new(base, server_signals[i], signal_cb, server);
        if (server->signal_ev[i] == NULL || evsignal_add(server->signal_ev[i], NULL) != 0) {
            set_err(err, "cannot install the handler of signal %d",
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
    if (status == EPD_ERR_NO_MEMORY) set_err(err, "out of memory creating the server");
    return status;
}

epd_status_t epd_server_start(epd_server_t *server, epd_engine_t *engine, char err[EPD_ERR_LEN])
{
    server->engine = engine;
    server->listener = evconnlistener_new(server->base, accept_cb, server, LEV_OPT_CLOSE_ON_FREE,
                                          0 /* already listening */, server->listen_fd);
    if (server->listener == NULL) {
        set_err(err, "cannot watch the listening socket %s", server->path);
        return EPD_ERR_IO;
    }
    evconnlistener_set_error_cb(server->listener, accept_error_cb);
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
    size_t n = 0;
    uint64_t *ids;

    if (server == NULL) return;
    server->stopping = false; /* no loopbreak from here */
    ids = table_ids(server, &n);
    for (size_t i = 0; i < n; i++) {
        epd_conn_t *conn = table_find(server, ids[i]);
        if (conn != NULL) epd_conn_abort(conn);
    }
    free(ids);
    if (server->listener != NULL) evconnlistener_free(server->listener);
    else if (server->listen_fd >= 0) close(server->listen_fd);
    server_unlink(server);
    for (size_t i = 0; i < EPD_ARRAY_SIZE(server_signals); i++)
        if (server->signal_ev[i] != NULL) event_free(server->signal_ev[i]);
    if (server->accept_retry != NULL) event_free(server->accept_retry);
    if (server->drain_timer != NULL) event_free(server->drain_timer);
    if (server->housekeeping != NULL) event_free(server->housekeeping);
    if (server->wake_ev != NULL) event_free(server->wake_ev);
    free(server->config_json);
    free(server);
}

uint64_t epd_server_answered_in_drain(const epd_server_t *server)
{
    return server->answered_in_drain;
}

const epd_config_t *epd_server_config(const epd_server_t *server)
{
    return server->cfg;
}

const epd_submit_limits_t *epd_server_limits(const epd_server_t *server)
{
    return &server->limits;
}

epd_engine_t *epd_server_engine(epd_server_t *server)
{
    return server->engine;
}

epd_server_stats_t *epd_server_stats(epd_server_t *server)
{
    return &server->stats;
}

int epd_server_rank(const epd_server_t *server)
{
    return server->rank;
}

struct event_base *epd_server_base(epd_server_t *server)
{
    return server->base;
}

void epd_server_request_accepted(epd_server_t *server)
{
    server->in_flight++;
    server->stats.requests_accepted++;
}
