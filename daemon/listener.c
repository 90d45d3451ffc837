/* The listening socket (daemon/listener.h): preparing the socket file, bind and listen with the
 * file's mode, and accepting connections behind the uid check and the client limit; refused
 * clients are counted (and, over the limit, told busy). */
#include "daemon/listener.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdbool.h>
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
#include "proto/frame.h"

#define LISTENER_BACKLOG 1024
#define LISTENER_RETRY_MS 100 /* pause after accept() fails (e.g. out of descriptors) */

struct epd_listener {
    const epd_config_t *cfg;
    struct event_base *base;
    epd_server_stats_t *stats;
    epd_listener_accept_cb_t accept;
    void *arg;

    int fd;                       /* listening; owned by evl once started */
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    dev_t bound_dev;              /* the socket file this listener made */
    ino_t bound_ino;
    struct evconnlistener *evl;
    struct event *retry;          /* re-enables accepting after an accept() failure */
    time_t last_error_log;
};

static void listener_retry_cb(evutil_socket_t fd, short what, void *arg);

/* ---- the socket file ---- */

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

epd_status_t epd_listener_open(const epd_config_t *cfg, struct event_base *base,
                               epd_server_stats_t *stats, const char *path,
                               epd_listener_accept_cb_t accept, void *arg,
                               epd_listener_t **listener_p, char err[EPD_ERR_LEN])
{
    mode_t mode = (mode_t)(cfg->socket.mode & 07777);
    epd_listener_t *listener;
    struct sockaddr_un addr;
    struct stat st;
    epd_status_t status;
    int fd;

    *listener_p = NULL;
    if (strlen(path) >= sizeof(addr.sun_path)) {
        set_err(err, "socket.path '%s' is longer than a Unix socket address allows "
                 "(%zu bytes)", path, sizeof(addr.sun_path) - 1);
        return EPD_ERR_CONFIG;
    }
    listener = calloc(1, sizeof(*listener));
    if (listener == NULL) goto out_nomem;
    listener->retry = evtimer_new(base, listener_retry_cb, listener);
    if (listener->retry == NULL) goto out_free_nomem;
    CHECK_GOTO(socket_file_prepare(path, err), out_free);

    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        set_err(err, "socket(): %s", strerror(errno));
        status = EPD_ERR_IO;
        goto out_free;
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
    if (listen(fd, LISTENER_BACKLOG) != 0) {
        set_err(err, "socket.path '%s': listen(): %s", path, strerror(errno));
        status = EPD_ERR_IO;
        goto out_unlink;
    }
    listener->cfg = cfg;
    listener->base = base;
    listener->stats = stats;
    listener->accept = accept;
    listener->arg = arg;
    snprintf(listener->path, sizeof(listener->path), "%s", path);
    listener->fd = fd;
    listener->bound_dev = st.st_dev;
    listener->bound_ino = st.st_ino;
    *listener_p = listener;
    return EPD_OK;

out_unlink:
    unlink(path);
out_close:
    close(fd);
out_free:
    event_free(listener->retry);
    free(listener);
    return status;
out_free_nomem:
    free(listener);
out_nomem:
    set_err(err, "out of memory creating the server");
    return EPD_ERR_NO_MEMORY;
}

/* Removes the socket file if it is still the one this listener bound. */
static void listener_unlink(const epd_listener_t *listener)
{
    struct stat st;

    if (lstat(listener->path, &st) == 0 && st.st_dev == listener->bound_dev &&
        st.st_ino == listener->bound_ino)
        unlink(listener->path);
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

/* Every refusal ends here: counted, and the connection closed. */
static void listener_refuse(epd_listener_t *listener, int fd)
{
    listener->stats->clients_refused++;
    close(fd);
}

/* Over socket.max_clients: the client is told busy before it is closed. */
static void listener_refuse_busy(epd_listener_t *listener, int fd, pid_t pid)
{
    char message[160];
    char err[EPD_ERR_LEN];
    epd_frame_out_t out;
    uint8_t *buf = NULL;
    size_t len = 0;

    snprintf(message, sizeof(message), "too many clients: this rank serves at most %" PRIu32
             " (socket.max_clients)", listener->cfg->socket.max_clients);
    if (epd_frame_encode_error(false, 0, EPD_ERR_BUSY, message, &out, err) == EPD_OK) {
        if (epd_frame_out_flatten(&out, &buf, &len, err) == EPD_OK) {
            /* A fresh socket's buffer takes this small frame whole; if not, the client gets EOF. */
            ssize_t n = send(fd, buf, len, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (n > 0) listener->stats->bytes_out += (uint64_t)n;
            free(buf);
        }
        epd_frame_out_free(&out);
    }
    listener->stats->errors[EPD_ERR_BUSY]++;
    epd_log_info("refused a connection from pid %ld: %" PRIu64
                 " clients already (socket.max_clients)", (long)pid, listener->stats->clients);
    listener_refuse(listener, fd);
}

static void listener_accept_cb(struct evconnlistener *evl, evutil_socket_t fd,
                               struct sockaddr *addr, int socklen, void *arg)
{
    epd_listener_t *listener = arg;
    struct ucred cred = {.pid = 0, .uid = (uid_t)-1, .gid = (gid_t)-1};
    socklen_t cred_len = sizeof(cred);

    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) != 0) {
        epd_log_warn("refused a connection: SO_PEERCRED failed: %s", strerror(errno));
        listener_refuse(listener, fd);
        return;
    }
    if (!uid_allowed(listener->cfg, cred.uid)) {
        epd_log_warn("refused a connection from uid %ld (pid %ld): not in socket.allow_uids",
                     (long)cred.uid, (long)cred.pid);
        listener_refuse(listener, fd);
        return;
    }
    if (listener->stats->clients >= listener->cfg->socket.max_clients) {
        listener_refuse_busy(listener, fd, cred.pid);
        return;
    }
    listener->accept(listener->arg, fd, cred.uid, cred.pid);
}

static void listener_retry_cb(evutil_socket_t fd, short what, void *arg)
{
    epd_listener_t *listener = arg;
    if (listener->evl != NULL) evconnlistener_enable(listener->evl);
}

static void listener_error_cb(struct evconnlistener *evl, void *arg)
{
    epd_listener_t *listener = arg;
    int saved = errno;
    time_t now = time(NULL);

    if (now != listener->last_error_log) {
        epd_log_warn("accept() failed: %s; pausing new connections for %d ms", strerror(saved),
                     LISTENER_RETRY_MS);
        listener->last_error_log = now;
    }
    /* Out of descriptors would fail again at once: wait instead of spinning. */
    evconnlistener_disable(evl);
    struct timeval tv = {0, LISTENER_RETRY_MS * 1000};
    evtimer_add(listener->retry, &tv);
}

epd_status_t epd_listener_start(epd_listener_t *listener, char err[EPD_ERR_LEN])
{
    listener->evl = evconnlistener_new(listener->base, listener_accept_cb, listener,
                                       LEV_OPT_CLOSE_ON_FREE, 0 /* already listening */,
                                       listener->fd);
    if (listener->evl == NULL) {
        set_err(err, "cannot watch the listening socket %s", listener->path);
        return EPD_ERR_IO;
    }
    evconnlistener_set_error_cb(listener->evl, listener_error_cb);
    return EPD_OK;
}

void epd_listener_free(epd_listener_t *listener)
{
    if (listener == NULL) return;
    if (listener->evl != NULL) evconnlistener_free(listener->evl);
    else close(listener->fd);
    listener_unlink(listener);
    event_free(listener->retry);
    free(listener);
}
