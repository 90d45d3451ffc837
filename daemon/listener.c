/* The listening socket (daemon/listener.h): checking the socket's directory, preparing the socket
 * file, bind with the file's mode set through the umask, and accepting connections behind the uid
 * check and the client limit; refused clients are counted (over the limit, told busy) and logged
 * at most once a second with a count. */
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

#include "common/clock.h"
#include "daemon/log.h"
#include "proto/frame.h"

#define LISTENER_BACKLOG 1024
#define LISTENER_RETRY_MS 100 /* pause after accept() fails (e.g. out of descriptors) */
#define LISTENER_REFUSED_LOG_MS 1000 /* at most one line about refused peers this often */

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

    /* Refusals are logged at most once per LISTENER_REFUSED_LOG_MS: the first of a period says
     * who, the others are counted and summed up in one line when the period ends. */
    uint64_t refused_log_ns;      /* when the last refusal line was written (0: never) */
    uint64_t refused_unlogged;    /* refusals since then, not in any line yet */
    char refused_last[160];       /* the latest of those, for the summing-up line */
    struct event *refused_flush;  /* writes the summing-up line */
};

static void listener_retry_cb(evutil_socket_t fd, short what, void *arg);
static void listener_refused_flush_cb(evutil_socket_t fd, short what, void *arg);

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

/* Whoever may write the socket's directory may rename the socket away and listen in its place,
 * reading what clients send: the directory must be writable by nobody but root and the daemon's
 * user, unless it is sticky (like /tmp: others cannot rename or remove our file there) and owned
 * by root or the daemon's user. */
static epd_status_t socket_dir_check(const char *path, const char *dir, const struct stat *st,
                                     char err[EPD_ERR_LEN])
{
    uid_t me = geteuid();
    bool owner_ok = st->st_uid == 0 || st->st_uid == me;
    bool others_write = (st->st_mode & (S_IWGRP | S_IWOTH)) != 0;

    if (owner_ok && (!others_write || (st->st_mode & S_ISVTX) != 0)) return EPD_OK;
    if (!owner_ok)
        set_err(err, "socket.path '%s': directory '%s' belongs to uid %ld, not to root or the "
                "daemon's user (uid %ld): its owner could replace the socket", path, dir,
                (long)st->st_uid, (long)me);
    else
        set_err(err, "socket.path '%s': directory '%s' (mode %04o) is writable by other users "
                "and not sticky: they could replace the socket (chmod go-w it, or use a "
                "directory like /run/epd)", path, dir, (unsigned)(st->st_mode & 07777));
    return EPD_ERR_CONFIG;
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
    epd_status_t status = socket_dir_check(path, dir, &st, err);
    if (status != EPD_OK) return status;

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
    listener->refused_flush = evtimer_new(base, listener_refused_flush_cb, listener);
    if (listener->retry == NULL || listener->refused_flush == NULL) goto out_free_nomem;
    CHECK_GOTO(socket_file_prepare(path, err), out_free);

    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        set_err(err, "socket(): %s", strerror(errno));
        status = EPD_ERR_IO;
        goto out_free;
    }
    addr_of(path, &addr);
    /* The file is created with its mode (the umask masks bind's 0777), never chmod'ed by path
     * afterwards: a path can be swapped for a symlink between bind and a chmod. */
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
    if (lstat(path, &st) != 0) {
        set_err(err, "socket.path '%s': stat after bind: %s", path, strerror(errno));
        status = EPD_ERR_IO;
        goto out_unlink;
    }
    if (!S_ISSOCK(st.st_mode) || (st.st_mode & 0777) != mode) {
        set_err(err, "socket.path '%s': the bound socket has mode %04o, not socket.mode %04o",
                path, (unsigned)(st.st_mode & 07777), (unsigned)mode);
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
    event_free(listener->refused_flush);
    event_free(listener->retry);
    free(listener);
    return status;
out_free_nomem:
    if (listener->retry != NULL) event_free(listener->retry);
    if (listener->refused_flush != NULL) event_free(listener->refused_flush);
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

static void listener_refused_flush_cb(evutil_socket_t fd, short what, void *arg)
{
    epd_listener_t *listener = arg;

    if (listener->refused_unlogged == 0) return;
    epd_log_warn("refused %" PRIu64 " more connections in the last %d ms (the latest: %s); "
                 "%" PRIu64 " refused since start", listener->refused_unlogged,
                 LISTENER_REFUSED_LOG_MS, listener->refused_last, listener->stats->clients_refused);
    listener->refused_unlogged = 0;
    listener->refused_log_ns = epd_now_ns();
}

/* Every refusal ends here: counted, logged (at most once a second, the rest summed up), and the
 * connection closed. why says who was refused and why. */
static void listener_refuse(epd_listener_t *listener, int fd, const char *why)
{
    uint64_t now = epd_now_ns();

    listener->stats->clients_refused++;
    close(fd);
    if (listener->refused_log_ns == 0 ||
        now - listener->refused_log_ns >= (uint64_t)LISTENER_REFUSED_LOG_MS * 1000000u) {
        if (listener->refused_unlogged > 0) listener_refused_flush_cb(-1, 0, listener);
        epd_log_warn("refused a connection %s", why);
        listener->refused_log_ns = now;
        return;
    }
    if (listener->refused_unlogged++ == 0) {
        uint64_t period_ns = (uint64_t)LISTENER_REFUSED_LOG_MS * 1000000u;
        uint64_t left_us = (period_ns - (now - listener->refused_log_ns)) / 1000u;
        struct timeval tv = {(time_t)(left_us / 1000000u), (suseconds_t)(left_us % 1000000u)};
        evtimer_add(listener->refused_flush, &tv);
    }
    snprintf(listener->refused_last, sizeof(listener->refused_last), "%s", why);
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
    snprintf(message, sizeof(message), "from pid %ld: %" PRIu64
             " clients already (socket.max_clients)", (long)pid, listener->stats->clients);
    listener_refuse(listener, fd, message);
}

static void listener_accept_cb(struct evconnlistener *evl, evutil_socket_t fd,
                               struct sockaddr *addr, int socklen, void *arg)
{
    epd_listener_t *listener = arg;
    struct ucred cred = {.pid = 0, .uid = (uid_t)-1, .gid = (gid_t)-1};
    socklen_t cred_len = sizeof(cred);

    char why[160];

    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) != 0) {
        snprintf(why, sizeof(why), "(SO_PEERCRED failed: %s)", strerror(errno));
        listener_refuse(listener, fd, why);
        return;
    }
    if (!uid_allowed(listener->cfg, cred.uid)) {
        snprintf(why, sizeof(why), "from uid %ld (pid %ld): not in socket.allow_uids",
                 (long)cred.uid, (long)cred.pid);
        listener_refuse(listener, fd, why);
        return;
    }
    if (listener->stats->clients >= listener->cfg->socket.max_clients) {
        listener_refuse_busy(listener, fd, cred.pid);
        return;
    }
    /* A Unix stream socket holds at most the sender's SO_SNDBUF in flight (208 KiB by
     * default): with a few MiB a RESULT's y goes out in one write rather than ~9, each waiting
     * for the client to read and the loop to be woken for writing again (libepd asks the same
     * for its SUBMITs). Best effort: the kernel caps it at net.core.wmem_max. */
    int sndbuf = (int)listener->cfg->socket.sndbuf_bytes;
    if (sndbuf > 0) {
        int got = 0;
        socklen_t got_len = sizeof got;
        (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
        if (getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &got, &got_len) == 0)
            epd_log_debug("connection of pid %ld: SO_SNDBUF %d bytes (socket.sndbuf_bytes %d; "
                          "Linux doubles it, up to net.core.wmem_max)",
                          (long)cred.pid, got, sndbuf);
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
    listener_refused_flush_cb(-1, 0, listener);
    event_free(listener->refused_flush);
    event_free(listener->retry);
    free(listener);
}
