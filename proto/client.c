/* libepd: one client = one Unix socket connection to the daemon. Blocking calls with a deadline
 * (poll), a queue of answers that arrived before they were asked for (pipelining, errors that
 * overtake results), and per-client error reporting. No global state. */

#include "proto/epd.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <sched.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/status.h"
#include "proto/base64.h"
#include "proto/frame.h"
#include "proto/json_build.h"

#ifndef EPD_VERSION
#define EPD_VERSION "0"
#endif

/* Largest RESULT/REPLY payload the client accepts (the daemon's own limit is its config). */
#define CLIENT_MAX_PAYLOAD ((uint64_t)1 << 36)
#define CLIENT_READ_CHUNK (256u * 1024u)
#define CLIENT_SNDBUF_BYTES (4 * 1024 * 1024)
#define SUBMIT_META_CAP 1024 /* a SUBMIT's meta: four tensors of fixed names, ~600 bytes at most */

typedef struct queued_frame {
    epd_frame_t frame;
    uint64_t read_ns; /* the recv that completed it returned */
    struct queued_frame *next;
} queued_frame_t;

struct epd_client {
    int fd;
    int timeout_ms;
    uint64_t spin_ns; /* epd_client_set_spin */
    uint64_t read_ns; /* the last recv(2) that returned bytes */
    uint64_t taken_read_ns; /* read_ns of the last frame client_take returned */
    epd_decoder_t dec;
    uint8_t *rbuf;           /* bytes read but not yet fed to the decoder */
    size_t roff;
    size_t rlen;
    queued_frame_t *head;    /* frames received before anyone asked for them */
    queued_frame_t *tail;
    uint64_t in_flight;
    bool hung_up;            /* the daemon closed the connection (not epd_client_close) */
    uint8_t *obuf;           /* queued output of the non-blocking calls, [ooff, olen) unsent */
    size_t ooff, olen, ocap;
    struct client_region *regions; /* host regions created here */
    /* epd_client_serve_experts: the worker's callback and regions; serving: inside it */
    epd_client_experts_fn experts_fn;
    void *experts_arg;
    uint32_t experts_in, experts_out;
    bool serving;
    char code[EPD_CLIENT_CODE_LEN];
    char message[EPD_CLIENT_MESSAGE_LEN];
};

static const char *const rc_names[] = {
    [EPD_CLIENT_OK] = "ok",
    [EPD_CLIENT_ERR_DAEMON] = "daemon",
    [EPD_CLIENT_ERR_CONNECT] = "connect",
    [EPD_CLIENT_ERR_TIMEOUT] = "timeout",
    [EPD_CLIENT_ERR_CLOSED] = "closed",
    [EPD_CLIENT_ERR_PROTOCOL] = "protocol",
    [EPD_CLIENT_ERR_IO] = "io",
    [EPD_CLIENT_ERR_INVALID_ARG] = "invalid_argument",
    [EPD_CLIENT_ERR_NO_MEMORY] = "no_memory",
    [EPD_CLIENT_AGAIN] = "again",
};

EPD_CLIENT_API const char *epd_client_rc_name(int rc)
{
    if (rc < 0 || (size_t)rc >= EPD_ARRAY_SIZE(rc_names)) return "unknown";
    return rc_names[rc];
}

EPD_CLIENT_API const char *epd_client_version(void)
{
    return EPD_VERSION;
}

/* Records a failure (code = the rc's name unless given) and returns rc. */
static int client_fail(epd_client_t *c, int rc, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int client_fail(epd_client_t *c, int rc, const char *code, const char *fmt, ...)
{
    va_list ap;
    snprintf(c->code, sizeof(c->code), "%s", code ? code : epd_client_rc_name(rc));
    va_start(ap, fmt);
    vsnprintf(c->message, sizeof(c->message), fmt, ap);
    va_end(ap);
    return rc;
}

static void client_ok(epd_client_t *c)
{
    c->code[0] = '\0';
    c->message[0] = '\0';
}

/* strerror for threads: each client call may run on its own thread. */
static const char *errno_text(int err, char *buf, size_t len)
{
    return strerror_r(err, buf, len); /* GNU variant (_GNU_SOURCE): returns the text */
}

static int64_t now_ms(void)
{
    return (int64_t)(epd_now_ns() / 1000000u);
}

static int64_t deadline_after(int timeout_ms)
{
    return timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
}

/* Milliseconds left before deadline, for poll (-1: none). */
static int ms_left(int64_t deadline)
{
    if (deadline < 0) return -1;
    int64_t left = deadline - now_ms();
    if (left <= 0) return 0;
    return left > INT32_MAX ? INT32_MAX : (int)left;
}

/* The default spin (epd_client_set_spin): EPD_CLIENT_DEFAULT_SPIN_US where this process may use
 * at least EPD_CLIENT_SPIN_MIN_CPUS cores, else 0. */
static uint64_t client_default_spin_ns(void)
{
    cpu_set_t set;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) < cpus) cpus = CPU_COUNT(&set);
    return cpus >= EPD_CLIENT_SPIN_MIN_CPUS ? (uint64_t)EPD_CLIENT_DEFAULT_SPIN_US * 1000u : 0;
}

EPD_CLIENT_API epd_client_t *epd_client_create(void)
{
    epd_client_t *c = calloc(1, sizeof(*c));
    if (c == NULL) return NULL;
    c->rbuf = malloc(CLIENT_READ_CHUNK);
    if (c->rbuf == NULL) {
        free(c);
        return NULL;
    }
    c->fd = -1;
    c->timeout_ms = 30000;
    c->spin_ns = client_default_spin_ns();
    epd_decoder_init(&c->dec, CLIENT_MAX_PAYLOAD, EPD_FRAME_MAX_META);
    return c;
}

static void queue_clear(epd_client_t *c)
{
    while (c->head != NULL) {
        queued_frame_t *q = c->head;
        c->head = q->next;
        epd_frame_free(&q->frame);
        free(q);
    }
    c->tail = NULL;
}

/* Closes the socket but keeps the answers already queued (they can still be collected). */
static void client_disconnect(epd_client_t *c)
{
    if (c->fd >= 0) c->hung_up = true;
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    epd_decoder_reset(&c->dec);
    c->roff = c->rlen = 0;
}

static void regions_unmap(epd_client_t *c);

EPD_CLIENT_API void epd_client_close(epd_client_t *c)
{
    if (c == NULL) return;
    regions_unmap(c);
    c->ooff = c->olen = 0;
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    queue_clear(c);
    epd_decoder_reset(&c->dec);
    c->roff = c->rlen = 0;
    c->in_flight = 0;
    c->hung_up = false;
}

EPD_CLIENT_API void epd_client_destroy(epd_client_t *c)
{
    if (c == NULL) return;
    epd_client_close(c);
    epd_decoder_free(&c->dec);
    free(c->rbuf);
    free(c->obuf);
    free(c);
}

EPD_CLIENT_API void epd_client_set_timeout(epd_client_t *c, int timeout_ms)
{
    if (c != NULL) c->timeout_ms = timeout_ms;
}

EPD_CLIENT_API uint64_t epd_client_last_read_ns(const epd_client_t *c)
{
    return c != NULL ? c->taken_read_ns : 0;
}

EPD_CLIENT_API void epd_client_set_spin(epd_client_t *c, unsigned spin_us)
{
    if (c != NULL) c->spin_ns = (uint64_t)spin_us * 1000u;
}

EPD_CLIENT_API const char *epd_client_last_error(const epd_client_t *c)
{
    return c ? c->code : "invalid_argument";
}

EPD_CLIENT_API const char *epd_client_last_message(const epd_client_t *c)
{
    return c ? c->message : "no client";
}

EPD_CLIENT_API uint64_t epd_client_in_flight(const epd_client_t *c)
{
    return c ? c->in_flight : 0;
}

EPD_CLIENT_API int epd_client_connect(epd_client_t *c, const char *path, int timeout_ms)
{
    struct sockaddr_un addr;
    int64_t deadline = deadline_after(timeout_ms);
    char ebuf[128];
    int fd, rc;

    if (c == NULL) return EPD_CLIENT_ERR_INVALID_ARG;
    if (path == NULL || *path == '\0') {
        return client_fail(c, EPD_CLIENT_ERR_INVALID_ARG, NULL, "no socket path given");
    }
    if (strlen(path) >= sizeof(addr.sun_path)) {
        return client_fail(c, EPD_CLIENT_ERR_CONNECT, NULL,
                           "cannot connect to %.200s: the path is longer than %zu bytes", path,
                           sizeof(addr.sun_path) - 1);
    }
    epd_client_close(c);
    c->timeout_ms = timeout_ms;
    memset(&addr, 0, sizeof(addr));
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path, path, strlen(path) + 1);
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        return client_fail(c, EPD_CLIENT_ERR_CONNECT, NULL, "cannot connect to %.200s: socket: %s",
                           path, errno_text(errno, ebuf, sizeof(ebuf)));
    }
    /* A Unix stream socket holds at most the sender's SO_SNDBUF in flight (208 KiB by default):
     * a few MiB lets a request's payload go in one or two writes and reads instead of ~9 each
     * (best effort; the kernel caps it at net.core.wmem_max). */
    int sndbuf = CLIENT_SNDBUF_BYTES;
    (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
    for (;;) {
        rc = connect(fd, (struct sockaddr *)&addr, sizeof(addr));
        if (rc == 0) break;
        if (errno == EINTR) continue;
        if (errno == EINPROGRESS) {
            struct pollfd pfd = {.fd = fd, .events = POLLOUT};
            int err = 0;
            socklen_t len = sizeof(err);
            int n = poll(&pfd, 1, ms_left(deadline));
            if (n == 0) {
                close(fd);
                return client_fail(c, EPD_CLIENT_ERR_TIMEOUT, NULL,
                                   "cannot connect to %.200s: no answer within %d ms", path,
                                   timeout_ms);
            }
            if (n < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
            if (err == 0) break;
            errno = err;
        }
        /* a full accept queue answers EAGAIN on a non-blocking Unix socket: retry until the end */
        if (errno == EAGAIN && ms_left(deadline) != 0) {
            struct timespec pause = {.tv_sec = 0, .tv_nsec = 5 * 1000 * 1000};
            nanosleep(&pause, NULL);
            continue;
        }
        int saved = errno;
        close(fd);
        if (saved == EAGAIN) {
            return client_fail(c, EPD_CLIENT_ERR_TIMEOUT, NULL,
                               "cannot connect to %.200s: the daemon's accept queue stayed full "
                               "for %d ms", path, timeout_ms);
        }
        return client_fail(c, EPD_CLIENT_ERR_CONNECT, NULL, "cannot connect to %.200s: %s", path,
                           errno_text(saved, ebuf, sizeof(ebuf)));
    }
    c->fd = fd;
    client_ok(c);
    return EPD_CLIENT_OK;
}

/* ---- receiving ---- */

static void queue_push(epd_client_t *c, queued_frame_t *q)
{
    q->next = NULL;
    if (c->tail) c->tail->next = q;
    else c->head = q;
    c->tail = q;
}

/* Queues a whole frame for the callers that wait for it (takes it over). */
static int client_queue_frame(epd_client_t *c, epd_frame_t *frame)
{
    queued_frame_t *q = malloc(sizeof(*q));
    if (q == NULL) {
        epd_frame_free(frame);
        return client_fail(c, EPD_CLIENT_ERR_NO_MEMORY, NULL, "cannot queue a reply");
    }
    q->frame = *frame;
    q->read_ns = c->read_ns;
    queue_push(c, q);
    return EPD_CLIENT_OK;
}

/* Feeds buffered bytes to the decoder; on a whole frame, queues it and returns OK. AGAIN when the
 * buffered bytes ran out. */
static int client_decode_buffered(epd_client_t *c, bool *got_p)
{
    char err[EPD_ERR_LEN];
    *got_p = false;
    while (c->roff < c->rlen) {
        epd_frame_t frame;
        size_t used = 0;
        epd_status_t status =
            epd_decoder_feed(&c->dec, c->rbuf + c->roff, c->rlen - c->roff, &used, &frame, err);
        c->roff += used;
        if (status == EPD_ERR_AGAIN) break;
        if (status != EPD_OK) {
            client_disconnect(c);
            return client_fail(c, status == EPD_ERR_NO_MEMORY ? EPD_CLIENT_ERR_NO_MEMORY
                                                               : EPD_CLIENT_ERR_PROTOCOL,
                               NULL, "the daemon sent a bad frame (%s): %s",
                               epd_status_name(status), err);
        }
        int rc = client_queue_frame(c, &frame);
        if (rc != EPD_CLIENT_OK) return rc;
        *got_p = true;
        return EPD_CLIENT_OK;
    }
    c->roff = c->rlen = 0;
    return EPD_CLIENT_OK;
}

/* One read from the socket (rbuf drained by the caller), then decoding: into the payload of the
 * frame being collected when there is one (a RESULT's y is copied once, by the kernel), else into
 * rbuf; *read_p (may be NULL) says whether bytes came. */
static int client_read_bytes(epd_client_t *c, bool *read_p)
{
    char ebuf[128], err[EPD_ERR_LEN];
    void *window;
    size_t window_len;
    ssize_t n;
    bool got;

    if (read_p != NULL) *read_p = false;
    epd_status_t status = epd_decoder_payload_window(&c->dec, &window, &window_len, err);
    if (status != EPD_OK) {
        client_disconnect(c);
        return client_fail(c, status == EPD_ERR_NO_MEMORY ? EPD_CLIENT_ERR_NO_MEMORY
                                                           : EPD_CLIENT_ERR_PROTOCOL,
                           NULL, "reading a frame from the daemon (%s): %s",
                           epd_status_name(status), err);
    }
    do {
        n = window_len > 0 ? recv(c->fd, window, window_len, 0)
                           : recv(c->fd, c->rbuf, CLIENT_READ_CHUNK, 0);
    } while (n < 0 && errno == EINTR);
    if (n > 0) c->read_ns = epd_now_ns();
    if (n == 0) {
        bool idle = epd_decoder_idle(&c->dec);
        client_disconnect(c);
        return client_fail(c, EPD_CLIENT_ERR_CLOSED, NULL,
                           idle ? "the daemon closed the connection"
                                : "the daemon closed the connection in the middle of a frame");
    }
    if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return EPD_CLIENT_OK;
        if (errno == ECONNRESET) { /* it closed with our bytes unread */
            client_disconnect(c);
            return client_fail(c, EPD_CLIENT_ERR_CLOSED, NULL,
                               "the daemon closed the connection (reset)");
        }
        return client_fail(c, EPD_CLIENT_ERR_IO, NULL, "reading from the daemon: %s",
                           errno_text(errno, ebuf, sizeof(ebuf)));
    }
    if (read_p != NULL) *read_p = true;
    if (window_len > 0) {
        epd_frame_t frame;
        status = epd_decoder_payload_commit(&c->dec, (size_t)n, &frame, err);
        if (status == EPD_OK) return client_queue_frame(c, &frame);
        if (status == EPD_ERR_AGAIN) return EPD_CLIENT_OK;
        client_disconnect(c);
        return client_fail(c, EPD_CLIENT_ERR_PROTOCOL, NULL, "reading a frame from the daemon: %s",
                           err);
    }
    c->roff = 0;
    c->rlen = (size_t)n;
    /* decode every whole frame of this read into the queue */
    for (;;) {
        int rc = client_decode_buffered(c, &got);
        if (rc != EPD_CLIENT_OK) return rc;
        if (!got) return EPD_CLIENT_OK;
    }
}

static int client_read_some(epd_client_t *c)
{
    return client_read_bytes(c, NULL);
}

/* Reads without sleeping for up to the client's spin time (not past deadline): recv(2) straight
 * away, without a poll(2) before each, so bytes are seen one system call after they come.
 * *read_p says whether any came. */
static int client_spin_read(epd_client_t *c, int64_t deadline, bool *read_p)
{
    uint64_t now = epd_now_ns(), until = now + c->spin_ns;
    if (deadline >= 0 && (uint64_t)deadline * 1000000u < until)
        until = (uint64_t)deadline * 1000000u;
    do {
        int rc = client_read_bytes(c, read_p);
        if (rc != EPD_CLIENT_OK || *read_p) return rc;
    } while (epd_now_ns() < until);
    return EPD_CLIENT_OK;
}

static int client_require_connected(epd_client_t *c)
{
    if (c->fd < 0) {
        return client_fail(c, EPD_CLIENT_ERR_CLOSED, NULL,
                           c->hung_up ? "the daemon closed the connection" : "not connected");
    }
    return EPD_CLIENT_OK;
}

/* Waits until the queue holds a frame that match() accepts and unlinks it into *frame_p. */
typedef bool (*frame_match_fn)(const epd_frame_t *frame, const void *arg);

static int client_serve_queued(epd_client_t *c);

static int client_take(epd_client_t *c, frame_match_fn match, const void *arg,
                       epd_frame_t *frame_p)
{
    int64_t deadline = deadline_after(c->timeout_ms);
    queued_frame_t *scanned = NULL; /* frames before this one were already rejected */
    char ebuf[128];
    int rc;

    for (;;) {
        /* a worker serves the EXPERTS that came meanwhile (its rank's step may hold the very
         * answer it waits for) */
        if (c->experts_fn != NULL && !c->serving) {
            rc = client_serve_queued(c);
            if (rc != EPD_CLIENT_OK) return rc;
            scanned = NULL;
        }
        queued_frame_t **link = scanned ? &scanned->next : &c->head;
        for (queued_frame_t *q = *link; q != NULL; link = &q->next, q = q->next) {
            if (match(&q->frame, arg)) {
                *link = q->next;
                if (c->tail == q) c->tail = scanned;
                *frame_p = q->frame;
                c->taken_read_ns = q->read_ns;
                free(q);
                return EPD_CLIENT_OK;
            }
            scanned = q;
        }
        rc = client_require_connected(c);
        if (rc != EPD_CLIENT_OK) return rc;
        if (c->spin_ns != 0) {
            bool read;
            rc = client_spin_read(c, deadline, &read);
            if (rc != EPD_CLIENT_OK) return rc;
            if (read) continue;
        }
        struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
        int n = poll(&pfd, 1, ms_left(deadline));
        if (n < 0 && errno != EINTR) {
            return client_fail(c, EPD_CLIENT_ERR_IO, NULL, "poll: %s",
                               errno_text(errno, ebuf, sizeof(ebuf)));
        }
        if (n == 0) {
            return client_fail(c, EPD_CLIENT_ERR_TIMEOUT, NULL,
                               "no answer from the daemon within %d ms", c->timeout_ms);
        }
        if (n > 0) {
            rc = client_read_some(c);
            if (rc != EPD_CLIENT_OK) return rc;
        }
    }
}

/* ---- sending ---- */

/* The daemon closed while we were sending: collect what it said before closing (an ERROR about
 * the connection, e.g. a framing error) so the failure names it; queued answers stay available. */
static int client_closed_on_send(epd_client_t *c)
{
    while (c->fd >= 0 && client_read_some(c) == EPD_CLIENT_OK) {
        struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
        if (poll(&pfd, 1, 0) <= 0) break;
    }
    client_disconnect(c);
    for (queued_frame_t *q = c->head; q != NULL; q = q->next) {
        if (q->frame.type == EPD_FRAME_ERROR && q->frame.id_kind != EPD_FRAME_ID_VALID) {
            const cJSON *code = cJSON_GetObjectItemCaseSensitive(q->frame.meta, "code");
            const cJSON *msg = cJSON_GetObjectItemCaseSensitive(q->frame.meta, "message");
            return client_fail(c, EPD_CLIENT_ERR_CLOSED, NULL,
                               "the daemon closed the connection after an error: %.31s: %.300s",
                               cJSON_IsString(code) ? code->valuestring : "?",
                               cJSON_IsString(msg) ? msg->valuestring : "");
        }
    }
    return client_fail(c, EPD_CLIENT_ERR_CLOSED, NULL, "the daemon closed the connection");
}

/* Writes a whole encoded frame; while the socket is full, reads answers into the queue. */
static int client_flush_blocking(epd_client_t *c);

static int client_send_out(epd_client_t *c, const epd_frame_out_t *out)
{
    struct iovec iov[1 + EPD_FRAME_OUT_PARTS];
    int n_iov = 0, first = 0;
    int64_t deadline = deadline_after(c->timeout_ms);
    char ebuf[128];
    int rc;

    rc = client_flush_blocking(c); /* what the non-blocking calls queued goes first */
    if (rc != EPD_CLIENT_OK) return rc;
    iov[n_iov].iov_base = out->head;
    iov[n_iov++].iov_len = out->head_len;
    for (size_t i = 0; i < out->n_parts; i++) {
        if (out->part_len[i] == 0) continue;
        iov[n_iov].iov_base = (void *)out->part[i];
        iov[n_iov++].iov_len = out->part_len[i];
    }
    while (first < n_iov) {
        struct msghdr msg = {.msg_iov = iov + first, .msg_iovlen = (size_t)(n_iov - first)};
        ssize_t n = sendmsg(c->fd, &msg, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EPIPE || errno == ECONNRESET) return client_closed_on_send(c);
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                return client_fail(c, EPD_CLIENT_ERR_IO, NULL, "writing to the daemon: %s",
                                   errno_text(errno, ebuf, sizeof(ebuf)));
            }
            struct pollfd pfd = {.fd = c->fd, .events = POLLOUT | POLLIN};
            int ready = poll(&pfd, 1, ms_left(deadline));
            if (ready < 0 && errno != EINTR) {
                return client_fail(c, EPD_CLIENT_ERR_IO, NULL, "poll: %s",
                                   errno_text(errno, ebuf, sizeof(ebuf)));
            }
            if (ready == 0) {
                return client_fail(c, EPD_CLIENT_ERR_TIMEOUT, NULL,
                                   "the daemon did not take a frame within %d ms",
                                   c->timeout_ms);
            }
            if (ready > 0 && (pfd.revents & (POLLIN | POLLHUP | POLLERR))) {
                rc = client_read_some(c);
                /* a hang-up seen here rather than as EPIPE: name the daemon's last ERROR too */
                if (rc == EPD_CLIENT_ERR_CLOSED) return client_closed_on_send(c);
                if (rc != EPD_CLIENT_OK) return rc;
            }
            continue;
        }
        size_t left = (size_t)n;
        while (first < n_iov && left >= iov[first].iov_len) {
            left -= iov[first].iov_len;
            first++;
        }
        if (first < n_iov) {
            iov[first].iov_base = (uint8_t *)iov[first].iov_base + left;
            iov[first].iov_len -= left;
        }
    }
    return EPD_CLIENT_OK;
}

/* ---- replies ---- */

EPD_CLIENT_API void epd_client_reply_free(epd_client_reply_t *reply)
{
    if (reply == NULL) return;
    free(reply->storage);
    memset(reply, 0, sizeof(*reply));
}

static void copy_str(char *dst, size_t len, const cJSON *item, const char *fallback)
{
    snprintf(dst, len, "%s", cJSON_IsString(item) ? item->valuestring : fallback);
}

/* Turns a RESULT or ERROR frame into a reply (taking the frame's payload); frees the frame. */
static int reply_from_frame(epd_client_t *c, epd_frame_t *frame, epd_client_reply_t *r)
{
    char err[EPD_ERR_LEN];
    int rc = EPD_CLIENT_OK;

    memset(r, 0, sizeof(*r));
    r->has_id = frame->id_kind == EPD_FRAME_ID_VALID;
    r->id = frame->id;
    if (frame->type == EPD_FRAME_ERROR) {
        r->status = EPD_CLIENT_ERR_DAEMON;
        copy_str(r->code, sizeof(r->code), cJSON_GetObjectItemCaseSensitive(frame->meta, "code"),
                 "internal");
        copy_str(r->message, sizeof(r->message),
                 cJSON_GetObjectItemCaseSensitive(frame->meta, "message"), "(no message)");
        if (r->has_id) {
            client_fail(c, EPD_CLIENT_ERR_DAEMON, r->code, "request %" PRIu64 ": %s", r->id,
                        r->message);
        } else {
            client_fail(c, EPD_CLIENT_ERR_DAEMON, r->code, "%s", r->message);
        }
        rc = EPD_CLIENT_ERR_DAEMON;
        goto out;
    }
    if (frame->type != EPD_FRAME_RESULT || !r->has_id) {
        rc = client_fail(c, EPD_CLIENT_ERR_PROTOCOL, NULL,
                         "expected a RESULT or ERROR with an id, got a %s frame",
                         epd_frame_type_name(frame->type));
        goto out;
    }
    epd_tensor_t y;
    const cJSON *tensors = cJSON_GetObjectItemCaseSensitive(frame->meta, "tensors");
    const cJSON *step = cJSON_GetObjectItemCaseSensitive(frame->meta, "step");
    if (epd_tensor_parse(cJSON_GetObjectItemCaseSensitive(tensors, "y"), "y", frame->payload_len,
                         &y, err) != EPD_OK) {
        rc = client_fail(c, EPD_CLIENT_ERR_PROTOCOL, NULL, "bad RESULT %" PRIu64 ": %s", r->id,
                         err);
        goto out;
    }
    if (y.in_region && y.dtype == EPD_DTYPE_BF16 && y.ndim == 2 && frame->payload_len == 0 &&
        y.shape[0] <= UINT32_MAX && y.shape[1] <= UINT32_MAX) {
        /* the daemon wrote y into a region of this connection */
        r->status = EPD_CLIENT_OK;
        r->n_tokens = (uint32_t)y.shape[0];
        r->hidden = (uint32_t)y.shape[1];
        r->y_region = y.region;
        r->y_offset = y.begin;
        r->step = cJSON_IsNumber(step) && step->valuedouble >= 0 ? (uint64_t)step->valuedouble : 0;
        client_ok(c);
        goto out;
    }
    if (y.in_region || y.dtype != EPD_DTYPE_BF16 || y.ndim != 2 || y.begin != 0 ||
        y.end != frame->payload_len || y.shape[0] > UINT32_MAX || y.shape[1] > UINT32_MAX) {
        rc = client_fail(c, EPD_CLIENT_ERR_PROTOCOL, NULL,
                         "bad RESULT %" PRIu64 ": y must be bf16 [N, H] filling the payload",
                         r->id);
        goto out;
    }
    r->status = EPD_CLIENT_OK;
    r->n_tokens = (uint32_t)y.shape[0];
    r->hidden = (uint32_t)y.shape[1];
    r->step = cJSON_IsNumber(step) && step->valuedouble >= 0 ? (uint64_t)step->valuedouble : 0;
    r->storage = frame->payload;
    r->y = (const uint16_t *)(const void *)frame->payload;
    frame->payload = NULL;
    client_ok(c);
out:
    epd_frame_free(frame);
    return rc;
}

static bool match_answer(const epd_frame_t *f, const void *arg)
{
    (void)arg;
    return f->type == EPD_FRAME_RESULT || f->type == EPD_FRAME_ERROR;
}

typedef struct {
    uint64_t id;
} id_match_t;

static bool match_id(const epd_frame_t *f, const void *arg)
{
    const id_match_t *m = arg;
    if (f->type == EPD_FRAME_ERROR && f->id_kind != EPD_FRAME_ID_VALID) return true;
    return (f->type == EPD_FRAME_RESULT || f->type == EPD_FRAME_ERROR) &&
           f->id_kind == EPD_FRAME_ID_VALID && f->id == m->id;
}

static bool match_control(const epd_frame_t *f, const void *arg)
{
    (void)arg;
    return f->type == EPD_FRAME_REPLY ||
           (f->type == EPD_FRAME_ERROR && f->id_kind != EPD_FRAME_ID_VALID);
}

static int client_get_reply(epd_client_t *c, frame_match_fn match, const void *arg,
                            epd_client_reply_t *reply_p)
{
    epd_frame_t frame;
    int rc;

    memset(reply_p, 0, sizeof(*reply_p));
    rc = client_take(c, match, arg, &frame);
    if (rc != EPD_CLIENT_OK) return rc;
    rc = reply_from_frame(c, &frame, reply_p);
    if (reply_p->has_id && c->in_flight > 0) c->in_flight--;
    if (rc != EPD_CLIENT_OK && rc != EPD_CLIENT_ERR_DAEMON) epd_client_reply_free(reply_p);
    return rc;
}

EPD_CLIENT_API int epd_client_recv(epd_client_t *c, epd_client_reply_t *reply_p)
{
    if (c == NULL || reply_p == NULL) return EPD_CLIENT_ERR_INVALID_ARG;
    return client_get_reply(c, match_answer, NULL, reply_p);
}

EPD_CLIENT_API int epd_client_wait(epd_client_t *c, uint64_t id, epd_client_reply_t *reply_p)
{
    id_match_t m = {.id = id};
    if (c == NULL || reply_p == NULL) return EPD_CLIENT_ERR_INVALID_ARG;
    return client_get_reply(c, match_id, &m, reply_p);
}

EPD_CLIENT_API int epd_client_send(epd_client_t *c, const epd_client_batch_t *b)
{
    epd_frame_out_t out;
    char err[EPD_ERR_LEN];
    int rc;

    if (c == NULL) return EPD_CLIENT_ERR_INVALID_ARG;
    if (b == NULL || b->n_tokens == 0 || b->hidden == 0 || b->topk == 0 || b->x == NULL ||
        b->topk_ids == NULL || b->topk_weights == NULL) {
        return client_fail(c, EPD_CLIENT_ERR_INVALID_ARG, NULL,
                           "a batch needs N, H, K >= 1 and x, topk_ids, topk_weights");
    }
    rc = client_require_connected(c);
    if (rc != EPD_CLIENT_OK) return rc;
    epd_status_t status = epd_frame_encode_submit(b->id, b->n_tokens, b->hidden, b->topk, b->x,
                                                  b->topk_ids, b->topk_weights, &out, err);
    if (status != EPD_OK) {
        return client_fail(c, status == EPD_ERR_NO_MEMORY ? EPD_CLIENT_ERR_NO_MEMORY
                                                          : EPD_CLIENT_ERR_INVALID_ARG,
                           NULL, "cannot encode the batch: %s", err);
    }
    rc = client_send_out(c, &out);
    epd_frame_out_free(&out);
    if (rc != EPD_CLIENT_OK) return rc;
    c->in_flight++;
    client_ok(c);
    return EPD_CLIENT_OK;
}

EPD_CLIENT_API int epd_client_submit(epd_client_t *c, const epd_client_batch_t *b, uint16_t *y,
                                     uint64_t *step_p)
{
    epd_client_reply_t reply;
    int rc;

    if (c == NULL) return EPD_CLIENT_ERR_INVALID_ARG;
    if (y == NULL) return client_fail(c, EPD_CLIENT_ERR_INVALID_ARG, NULL, "y is NULL");
    rc = epd_client_send(c, b);
    if (rc != EPD_CLIENT_OK) return rc;
    rc = epd_client_wait(c, b->id, &reply);
    if (rc != EPD_CLIENT_OK) {
        epd_client_reply_free(&reply);
        return rc;
    }
    if (reply.n_tokens != b->n_tokens || reply.hidden != b->hidden) {
        rc = client_fail(c, EPD_CLIENT_ERR_PROTOCOL, NULL,
                         "RESULT %" PRIu64 " has y [%u, %u], the batch was [%u, %u]", b->id,
                         reply.n_tokens, reply.hidden, b->n_tokens, b->hidden);
    } else {
        memcpy(y, reply.y, (size_t)b->n_tokens * b->hidden * sizeof(uint16_t));
        if (step_p) *step_p = reply.step;
    }
    epd_client_reply_free(&reply);
    return rc;
}

EPD_CLIENT_API int epd_client_control(epd_client_t *c, const char *op, char **json_p,
                                      char **payload_p, size_t *payload_len_p)
{
    epd_frame_out_t out;
    epd_frame_t frame;
    char err[EPD_ERR_LEN];
    int rc;

    if (c == NULL) return EPD_CLIENT_ERR_INVALID_ARG;
    if (json_p == NULL) return client_fail(c, EPD_CLIENT_ERR_INVALID_ARG, NULL, "json_p is NULL");
    *json_p = NULL;
    if (payload_p) *payload_p = NULL;
    if (payload_len_p) *payload_len_p = 0;
    rc = client_require_connected(c);
    if (rc != EPD_CLIENT_OK) return rc;
    if (epd_frame_encode_control(op, &out, err) != EPD_OK) {
        return client_fail(c, EPD_CLIENT_ERR_INVALID_ARG, NULL, "%s", err);
    }
    rc = client_send_out(c, &out);
    epd_frame_out_free(&out);
    if (rc != EPD_CLIENT_OK) return rc;
    rc = client_take(c, match_control, NULL, &frame);
    if (rc != EPD_CLIENT_OK) return rc;
    if (frame.type == EPD_FRAME_ERROR) {
        epd_client_reply_t reply;
        rc = reply_from_frame(c, &frame, &reply); /* records code and message, frees the frame */
        epd_client_reply_free(&reply);
        return rc;
    }
    *json_p = cJSON_PrintUnformatted(frame.meta);
    if (*json_p == NULL) {
        epd_frame_free(&frame);
        return client_fail(c, EPD_CLIENT_ERR_NO_MEMORY, NULL, "cannot print the reply");
    }
    if (payload_p) {
        char *p = realloc(frame.payload, (size_t)frame.payload_len + 1);
        if (p == NULL) {
            epd_frame_free(&frame);
            free(*json_p);
            *json_p = NULL;
            return client_fail(c, EPD_CLIENT_ERR_NO_MEMORY, NULL, "cannot copy the payload");
        }
        p[frame.payload_len] = '\0';
        *payload_p = p;
        if (payload_len_p) *payload_len_p = (size_t)frame.payload_len;
        frame.payload = NULL;
    }
    epd_frame_free(&frame);
    client_ok(c);
    return EPD_CLIENT_OK;
}

EPD_CLIENT_API void epd_client_free(void *ptr)
{
    free(ptr);
}

/* ---- shared regions and requests by region ---- */

/* A host region this client created: its mapping here, unmapped by unregister or close. */
typedef struct client_region {
    uint32_t id;
    void *map;
    size_t bytes;
    struct client_region *next;
} client_region_t;

/* Appends `"name":{"dtype":…,"shape":[rows,cols],…}` (with a leading comma unless first) at
 * *at in buf (SUBMIT_META_CAP bytes; *at goes past it when it did not fit): the tensor in its
 * region, or its byte range in the payload, which then grows by bytes. Written with snprintf:
 * cJSON's printer formats every number as a double and reads it back, which cost 23 us a
 * SUBMIT on a slow core (the daemon's validation of the same SUBMIT takes 2). */
static void put_place(char *buf, size_t *at, bool first, const char *name, const char *dtype,
                      uint64_t rows, uint64_t cols, const epd_client_tensor_t *t,
                      uint64_t *payload_at, uint64_t bytes)
{
    size_t cap = SUBMIT_META_CAP;
    int n;

    if (*at >= cap) return;
    if (t->region != 0) {
        n = snprintf(buf + *at, cap - *at,
                     "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[%" PRIu64 ",%" PRIu64
                     "],\"region\":%" PRIu32 ",\"offset\":%" PRIu64 "}",
                     first ? "" : ",", name, dtype, rows, cols, t->region, t->offset);
    } else {
        n = snprintf(buf + *at, cap - *at,
                     "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[%" PRIu64 ",%" PRIu64
                     "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}",
                     first ? "" : ",", name, dtype, rows, cols, *payload_at, *payload_at + bytes);
        *payload_at += bytes;
    }
    *at = n < 0 ? cap : *at + (size_t)n;
}

/* Encodes a SUBMIT of req: tensors in regions are named, the others travel in the payload. */
static int encode_request(epd_client_t *c, const epd_client_request_t *r, epd_frame_out_t *out)
{
    uint64_t nk = (uint64_t)r->n_tokens * r->topk;
    uint64_t x_bytes = (uint64_t)r->n_tokens * r->hidden * 2;
    uint64_t id_bytes = nk * (r->ids_i64 ? 8 : 4), w_bytes = nk * 4, at = 0;

    if (r->n_tokens == 0 || r->hidden == 0 || r->topk == 0 ||
        (r->x.region == 0 && r->x.data == NULL) ||
        (r->topk_ids.region == 0 && r->topk_ids.data == NULL) ||
        (r->topk_weights.region == 0 && r->topk_weights.data == NULL)) {
        return client_fail(c, EPD_CLIENT_ERR_INVALID_ARG, NULL,
                           "a request needs N, H, K >= 1 and x, topk_ids, topk_weights in a "
                           "region or in memory");
    }
    char text[SUBMIT_META_CAP];
    size_t meta_len = 0;
    int n = r->layer >= 0 ? snprintf(text, sizeof text, "{\"id\":%" PRIu64 ",\"layer\":%d,"
                                                       "\"tensors\":{", r->id, r->layer)
                          : snprintf(text, sizeof text, "{\"id\":%" PRIu64 ",\"tensors\":{",
                                     r->id);
    meta_len = n < 0 ? sizeof text : (size_t)n;
    /* payload order: ids, weights, x (as epd_frame_encode_submit) */
    put_place(text, &meta_len, true, "topk_ids", r->ids_i64 ? "i64" : "i32", r->n_tokens, r->topk,
              &r->topk_ids, &at, id_bytes);
    put_place(text, &meta_len, false, "topk_weights", "f32", r->n_tokens, r->topk,
              &r->topk_weights, &at, w_bytes);
    put_place(text, &meta_len, false, "x", "bf16", r->n_tokens, r->hidden, &r->x, &at, x_bytes);
    if (r->y.region != 0)
        put_place(text, &meta_len, false, "y", "bf16", r->n_tokens, r->hidden, &r->y, &at,
                  x_bytes);
    if (meta_len + 3 > sizeof text)
        return client_fail(c, EPD_CLIENT_ERR_INVALID_ARG, NULL, "request meta too large");
    memcpy(text + meta_len, "}}", 3);
    meta_len += 2;
    memset(out, 0, sizeof *out);
    out->head = malloc(EPD_FRAME_HEADER_LEN + meta_len);
    if (out->head == NULL) return client_fail(c, EPD_CLIENT_ERR_NO_MEMORY, NULL, "out of memory");
    epd_frame_header_encode(EPD_FRAME_SUBMIT, (uint32_t)meta_len, at, out->head);
    memcpy(out->head + EPD_FRAME_HEADER_LEN, text, meta_len);
    out->head_len = EPD_FRAME_HEADER_LEN + meta_len;
    if (r->topk_ids.region == 0) {
        out->part[out->n_parts] = r->topk_ids.data;
        out->part_len[out->n_parts++] = (size_t)id_bytes;
    }
    if (r->topk_weights.region == 0) {
        out->part[out->n_parts] = r->topk_weights.data;
        out->part_len[out->n_parts++] = (size_t)w_bytes;
    }
    if (r->x.region == 0) {
        out->part[out->n_parts] = r->x.data;
        out->part_len[out->n_parts++] = (size_t)x_bytes;
    }
    out->payload_len = at;
    return EPD_CLIENT_OK;
}

EPD_CLIENT_API int epd_client_send_request(epd_client_t *c, const epd_client_request_t *r)
{
    epd_frame_out_t out;
    int rc;

    if (c == NULL || r == NULL) return EPD_CLIENT_ERR_INVALID_ARG;
    rc = client_require_connected(c);
    if (rc != EPD_CLIENT_OK) return rc;
    rc = encode_request(c, r, &out);
    if (rc != EPD_CLIENT_OK) return rc;
    rc = client_send_out(c, &out);
    epd_frame_out_free(&out);
    if (rc != EPD_CLIENT_OK) return rc;
    c->in_flight++;
    client_ok(c);
    return EPD_CLIENT_OK;
}

EPD_CLIENT_API int epd_client_submit_request(epd_client_t *c, const epd_client_request_t *r,
                                             uint16_t *y_out, uint64_t *step_p)
{
    epd_client_reply_t reply;
    int rc = epd_client_send_request(c, r);

    if (rc != EPD_CLIENT_OK) return rc;
    rc = epd_client_wait(c, r->id, &reply);
    if (rc == EPD_CLIENT_OK) {
        if (reply.y != NULL && y_out != NULL)
            memcpy(y_out, reply.y, (size_t)reply.n_tokens * reply.hidden * sizeof(uint16_t));
        if (step_p) *step_p = reply.step;
    }
    epd_client_reply_free(&reply);
    return rc;
}

/* A CONTROL register/unregister: meta text sent (with fd in SCM_RIGHTS when fd >= 0), the REPLY's
 * "region" in *region_p. */
static int control_region(epd_client_t *c, const char *meta_text, int fd, uint32_t *region_p)
{
    epd_frame_out_t out;
    epd_frame_t frame;
    size_t meta_len = strlen(meta_text);
    char ebuf[128];
    int rc = client_require_connected(c);

    if (rc != EPD_CLIENT_OK) return rc;
    memset(&out, 0, sizeof out);
    out.head = malloc(EPD_FRAME_HEADER_LEN + meta_len);
    if (out.head == NULL) return client_fail(c, EPD_CLIENT_ERR_NO_MEMORY, NULL, "out of memory");
    epd_frame_header_encode(EPD_FRAME_CONTROL, (uint32_t)meta_len, 0, out.head);
    memcpy(out.head + EPD_FRAME_HEADER_LEN, meta_text, meta_len);
    out.head_len = EPD_FRAME_HEADER_LEN + meta_len;
    if (fd >= 0) {
        /* the fd goes with the frame's first byte; the rest follows as usual */
        rc = client_flush_blocking(c);
        if (rc != EPD_CLIENT_OK) {
            epd_frame_out_free(&out);
            return rc;
        }
        union {
            char buf[CMSG_SPACE(sizeof(int))];
            struct cmsghdr align;
        } control;
        struct iovec iov = {.iov_base = out.head, .iov_len = 1};
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                             .msg_controllen = sizeof control.buf};
        struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &fd, sizeof fd);
        ssize_t n;
        for (;;) {
            n = sendmsg(c->fd, &msg, MSG_NOSIGNAL);
            if (n >= 0 || errno != EINTR) break;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            struct pollfd pfd = {.fd = c->fd, .events = POLLOUT};
            poll(&pfd, 1, c->timeout_ms);
            n = sendmsg(c->fd, &msg, MSG_NOSIGNAL);
        }
        if (n != 1) {
            epd_frame_out_free(&out);
            if (n < 0 && (errno == EPIPE || errno == ECONNRESET)) return client_closed_on_send(c);
            return client_fail(c, EPD_CLIENT_ERR_IO, NULL, "sending the region's fd: %s",
                               n < 0 ? errno_text(errno, ebuf, sizeof ebuf) : "short write");
        }
        memmove(out.head, out.head + 1, out.head_len - 1);
        out.head_len--;
    }
    rc = client_send_out(c, &out);
    epd_frame_out_free(&out);
    if (rc != EPD_CLIENT_OK) return rc;
    rc = client_take(c, match_control, NULL, &frame);
    if (rc != EPD_CLIENT_OK) return rc;
    if (frame.type == EPD_FRAME_ERROR) {
        epd_client_reply_t reply;
        rc = reply_from_frame(c, &frame, &reply);
        epd_client_reply_free(&reply);
        return rc;
    }
    const cJSON *region = cJSON_GetObjectItemCaseSensitive(frame.meta, "region");
    if (!cJSON_IsNumber(region) || region->valuedouble < 1 || region->valuedouble > UINT32_MAX) {
        epd_frame_free(&frame);
        return client_fail(c, EPD_CLIENT_ERR_PROTOCOL, NULL, "REPLY to a region op has no region");
    }
    if (region_p != NULL) *region_p = (uint32_t)region->valuedouble;
    epd_frame_free(&frame);
    client_ok(c);
    return EPD_CLIENT_OK;
}

EPD_CLIENT_API int epd_client_register_host(epd_client_t *c, uint64_t bytes, uint32_t *region_p,
                                            void **ptr_p)
{
    char ebuf[128], meta[128];
    uint32_t id = 0;

    if (c == NULL || region_p == NULL || ptr_p == NULL) return EPD_CLIENT_ERR_INVALID_ARG;
    if (bytes == 0 || bytes > SIZE_MAX)
        return client_fail(c, EPD_CLIENT_ERR_INVALID_ARG, NULL, "a region needs bytes >= 1");
    client_region_t *cr = calloc(1, sizeof *cr);
    if (cr == NULL) return client_fail(c, EPD_CLIENT_ERR_NO_MEMORY, NULL, "out of memory");
    int fd = memfd_create("epd-region", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)bytes) != 0) {
        int saved = errno;
        if (fd >= 0) close(fd);
        free(cr);
        return client_fail(c, EPD_CLIENT_ERR_IO, NULL, "cannot create %" PRIu64
                           " bytes of shared memory: %s", bytes, errno_text(saved, ebuf, sizeof ebuf));
    }
    void *map = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
        int saved = errno;
        close(fd);
        free(cr);
        return client_fail(c, EPD_CLIENT_ERR_IO, NULL, "cannot map the region: %s",
                           errno_text(saved, ebuf, sizeof ebuf));
    }
    snprintf(meta, sizeof meta, "{\"op\":\"register\",\"kind\":\"host\",\"bytes\":%" PRIu64 "}",
             bytes);
    int rc = control_region(c, meta, fd, &id);
    close(fd); /* the daemon has its own now (or refused it) */
    if (rc != EPD_CLIENT_OK) {
        munmap(map, (size_t)bytes);
        free(cr);
        return rc;
    }
    cr->id = id;
    cr->map = map;
    cr->bytes = (size_t)bytes;
    cr->next = c->regions;
    c->regions = cr;
    *region_p = id;
    *ptr_p = map;
    return EPD_CLIENT_OK;
}

EPD_CLIENT_API int epd_client_register_cuda(epd_client_t *c, const uint8_t handle[64],
                                            uint64_t offset, uint64_t bytes, uint32_t *region_p)
{
    char b64[EPD_BASE64_LEN(64) + 1], meta[256];

    if (c == NULL || handle == NULL || region_p == NULL) return EPD_CLIENT_ERR_INVALID_ARG;
    epd_base64_encode(handle, 64, b64);
    snprintf(meta, sizeof meta,
             "{\"op\":\"register\",\"kind\":\"cuda\",\"handle\":\"%s\",\"offset\":%" PRIu64
             ",\"bytes\":%" PRIu64 "}", b64, offset, bytes);
    return control_region(c, meta, -1, region_p);
}

EPD_CLIENT_API int epd_client_unregister(epd_client_t *c, uint32_t region)
{
    char meta[96];

    if (c == NULL) return EPD_CLIENT_ERR_INVALID_ARG;
    snprintf(meta, sizeof meta, "{\"op\":\"unregister\",\"region\":%" PRIu32 "}", region);
    int rc = control_region(c, meta, -1, NULL);
    for (client_region_t **link = &c->regions; *link != NULL; link = &(*link)->next) {
        if ((*link)->id != region) continue;
        client_region_t *cr = *link;
        *link = cr->next;
        munmap(cr->map, cr->bytes);
        free(cr);
        break;
    }
    return rc;
}

/* ---- non-blocking use ---- */

EPD_CLIENT_API int epd_client_fd(const epd_client_t *c)
{
    return c != NULL ? c->fd : -1;
}

EPD_CLIENT_API size_t epd_client_pending_output(const epd_client_t *c)
{
    return c != NULL ? c->olen - c->ooff : 0;
}

EPD_CLIENT_API int epd_client_flush(epd_client_t *c)
{
    char ebuf[128];

    if (c == NULL) return EPD_CLIENT_ERR_INVALID_ARG;
    while (c->ooff < c->olen) {
        int rc = client_require_connected(c);
        if (rc != EPD_CLIENT_OK) return rc;
        ssize_t n = send(c->fd, c->obuf + c->ooff, c->olen - c->ooff, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return EPD_CLIENT_AGAIN;
            if (errno == EPIPE || errno == ECONNRESET) return client_closed_on_send(c);
            return client_fail(c, EPD_CLIENT_ERR_IO, NULL, "writing to the daemon: %s",
                               errno_text(errno, ebuf, sizeof ebuf));
        }
        c->ooff += (size_t)n;
    }
    c->ooff = c->olen = 0;
    return EPD_CLIENT_OK;
}

EPD_CLIENT_API int epd_client_queue_request(epd_client_t *c, const epd_client_request_t *r)
{
    epd_frame_out_t out;
    uint8_t *flat;
    size_t len;
    char err[EPD_ERR_LEN];

    if (c == NULL || r == NULL) return EPD_CLIENT_ERR_INVALID_ARG;
    int rc = client_require_connected(c);
    if (rc != EPD_CLIENT_OK) return rc;
    rc = encode_request(c, r, &out);
    if (rc != EPD_CLIENT_OK) return rc;
    epd_status_t status = epd_frame_out_flatten(&out, &flat, &len, err);
    epd_frame_out_free(&out);
    if (status != EPD_OK) return client_fail(c, EPD_CLIENT_ERR_NO_MEMORY, NULL, "%s", err);
    if (c->olen + len > c->ocap) {
        size_t cap = c->ocap ? c->ocap : 4096;
        while (cap < c->olen + len) cap *= 2;
        uint8_t *p = realloc(c->obuf, cap);
        if (p == NULL) {
            free(flat);
            return client_fail(c, EPD_CLIENT_ERR_NO_MEMORY, NULL, "out of memory");
        }
        c->obuf = p;
        c->ocap = cap;
    }
    memcpy(c->obuf + c->olen, flat, len);
    c->olen += len;
    free(flat);
    c->in_flight++;
    rc = epd_client_flush(c);
    if (rc == EPD_CLIENT_OK || rc == EPD_CLIENT_AGAIN) client_ok(c);
    return rc;
}

EPD_CLIENT_API int epd_client_try_recv(epd_client_t *c, epd_client_reply_t *reply_p)
{
    if (c == NULL || reply_p == NULL) return EPD_CLIENT_ERR_INVALID_ARG;
    memset(reply_p, 0, sizeof *reply_p);
    if (c->experts_fn != NULL && !c->serving && c->fd >= 0) {
        int rc = client_read_some(c);
        if (rc == EPD_CLIENT_OK) rc = client_serve_queued(c);
        if (rc != EPD_CLIENT_OK) return rc;
    }
    for (queued_frame_t *q = c->head; q != NULL; q = q->next)
        if (match_answer(&q->frame, NULL)) return client_get_reply(c, match_answer, NULL, reply_p);
    if (c->fd >= 0) {
        int rc = client_read_some(c); /* the socket is non-blocking: AGAIN reads nothing */
        if (rc != EPD_CLIENT_OK) return rc;
    }
    for (queued_frame_t *q = c->head; q != NULL; q = q->next)
        if (match_answer(&q->frame, NULL)) return client_get_reply(c, match_answer, NULL, reply_p);
    if (c->fd < 0) return client_require_connected(c);
    return EPD_CLIENT_AGAIN;
}

/* Writes the queued output, waiting while the socket is full (answers are read meanwhile). */
static int client_flush_blocking(epd_client_t *c)
{
    int64_t deadline = deadline_after(c->timeout_ms);

    for (;;) {
        int rc = epd_client_flush(c);
        if (rc != EPD_CLIENT_AGAIN) return rc;
        struct pollfd pfd = {.fd = c->fd, .events = POLLOUT | POLLIN};
        int ready = poll(&pfd, 1, ms_left(deadline));
        if (ready == 0)
            return client_fail(c, EPD_CLIENT_ERR_TIMEOUT, NULL,
                               "the daemon did not take queued output within %d ms",
                               c->timeout_ms);
        if (ready > 0 && (pfd.revents & (POLLIN | POLLHUP | POLLERR))) {
            rc = client_read_some(c);
            if (rc != EPD_CLIENT_OK) return rc;
        }
    }
}

static void regions_unmap(epd_client_t *c)
{
    while (c->regions != NULL) {
        client_region_t *cr = c->regions;
        c->regions = cr->next;
        munmap(cr->map, cr->bytes);
        free(cr);
    }
}

/* ---- external experts (DESIGN.md section 9, docs/protocol.md section 16) ---- */

/* This process's address of [offset, offset + bytes) in a host region created here, or NULL. */
static void *region_ptr(const epd_client_t *c, uint32_t id, uint64_t offset, uint64_t bytes)
{
    for (const client_region_t *cr = c->regions; cr != NULL; cr = cr->next)
        if (cr->id == id && offset <= cr->bytes && bytes <= cr->bytes - offset)
            return (uint8_t *)cr->map + offset;
    return NULL;
}

/* One tensor of an EXPERTS meta: region, offset and bytes; false when malformed. */
static bool experts_tensor(const cJSON *tensors, const char *name, uint32_t *region_p,
                           uint64_t *offset_p, uint64_t *bytes_p)
{
    epd_tensor_t t;
    char err[EPD_ERR_LEN];
    const cJSON *d = cJSON_GetObjectItemCaseSensitive(tensors, name);
    if (d == NULL || epd_tensor_parse(d, name, 0, &t, err) != EPD_OK || !t.in_region) return false;
    *region_p = t.region;
    *offset_p = t.begin;
    *bytes_p = t.end - t.begin;
    return true;
}

static uint64_t meta_u64_or(const cJSON *meta, const char *key, uint64_t fallback)
{
    uint64_t v;
    return epd_json_to_u64(cJSON_GetObjectItemCaseSensitive(meta, key), &v) ? v : fallback;
}

/* The counts of an EXPERTS meta from their JSON text (strict-checked): plain integers are read
 * here, anything else through the tree (numbers that are not non-negative integers count 0, as
 * before). *n_p gets how many; the array (malloc'ed, one element at least) is the caller's. */
static uint32_t *experts_counts(const char *text, size_t len, uint32_t *n_p)
{
    uint32_t *rows = malloc((len / 2 + 1) * sizeof *rows); /* a digit and a comma each */
    uint32_t n = 0;
    size_t at = 1; /* past '[' */

    *n_p = 0;
    if (rows == NULL) return NULL;
#define WS(i) ((i) < len && (text[i] == ' ' || text[i] == '\t' || text[i] == '\n' || text[i] == '\r'))
    while (WS(at)) at++;
    if (at < len && text[at] == ']') return rows;
    for (;;) {
        while (WS(at)) at++;
        uint64_t v = 0;
        size_t digits = 0;
        while (at < len && text[at] >= '0' && text[at] <= '9' && digits < 11) {
            v = v * 10u + (uint64_t)(text[at++] - '0');
            digits++;
        }
        if (digits == 0 || digits > 10 || v > UINT32_MAX) break;
        while (WS(at)) at++;
        rows[n++] = (uint32_t)v;
        if (at < len && text[at] == ',') {
            at++;
            continue;
        }
        if (at < len && text[at] == ']') {
            *n_p = n;
            return rows;
        }
        break;
    }
#undef WS
    /* a fraction, an exponent, a sign, not a number: the tree's reading */
    free(rows);
    cJSON *counts = epd_json_build(text, len);
    if (!cJSON_IsArray(counts)) {
        cJSON_Delete(counts);
        return NULL;
    }
    n = (uint32_t)cJSON_GetArraySize(counts);
    rows = calloc(n ? n : 1, sizeof *rows);
    if (rows != NULL) {
        uint32_t i = 0;
        for (const cJSON *v = counts->child; v != NULL; v = v->next, i++)
            rows[i] = cJSON_IsNumber(v) && v->valuedouble >= 0 ? (uint32_t)v->valuedouble : 0;
        *n_p = n;
    }
    cJSON_Delete(counts);
    return rows;
}

/* Runs the worker's callback on one EXPERTS frame (freed here) and answers EXPERTS_DONE. The
 * decoder gave its meta as text (epd_decoder_keep_text): the tree is built without the counts,
 * which are read straight from the text (for 256 experts the tree's numbers were most of the
 * frame's decoding). */
static int client_serve_one(epd_client_t *c, epd_frame_t *frame, uint64_t read_ns,
                            uint64_t seen_ns)
{
    const char *counts_text = NULL;
    size_t counts_len = 0;
    cJSON *built = NULL;
    if (frame->meta_text != NULL) {
        built = epd_json_build_except(frame->meta_text, frame->meta_len, "counts", &counts_text,
                                      &counts_len);
        if (built == NULL) {
            epd_frame_free(frame);
            return client_fail(c, EPD_CLIENT_ERR_NO_MEMORY, NULL, "out of memory");
        }
    }
    const cJSON *meta = built != NULL ? built : frame->meta;
    const cJSON *tensors = cJSON_GetObjectItemCaseSensitive(meta, "tensors");
    const cJSON *counts = cJSON_GetObjectItemCaseSensitive(meta, "counts");
    bool have_counts = built != NULL ? counts_text != NULL && counts_text[0] == '['
                                     : cJSON_IsArray(counts);
    const cJSON *input = cJSON_GetObjectItemCaseSensitive(meta, "input");
    const cJSON *layout = cJSON_GetObjectItemCaseSensitive(meta, "layout");
    const cJSON *scale = cJSON_GetObjectItemCaseSensitive(meta, "scale");
    epd_client_experts_t b;
    uint64_t bytes, step;
    int rc;

    memset(&b, 0, sizeof b);
    if (!epd_json_to_u64(cJSON_GetObjectItemCaseSensitive(meta, "step"), &step) ||
        !have_counts || !cJSON_IsString(input) || !cJSON_IsString(layout) ||
        !experts_tensor(tensors, "x", &b.input_region, &b.x_offset, &bytes) ||
        !experts_tensor(tensors, "y", &b.output_region, &b.y_offset, &bytes)) {
        cJSON_Delete(built);
        epd_frame_free(frame);
        client_disconnect(c);
        return client_fail(c, EPD_CLIENT_ERR_PROTOCOL, NULL, "an EXPERTS frame without step, "
                           "counts, input, layout or the x and y tensors");
    }
    b.step = step;
    b.layer = (uint32_t)meta_u64_or(meta, "layer", 0);
    b.first_expert = (uint32_t)meta_u64_or(meta, "first_expert", 0);
    b.rows = (uint32_t)meta_u64_or(meta, "rows", 0);
    b.sent_ns = meta_u64_or(meta, "sent_ns", 0);
    b.seen_ns = seen_ns;
    b.read_ns = read_ns;
    b.input = input->valuestring;
    b.masked = strcmp(layout->valuestring, "masked") == 0;
    b.meta_json = NULL;
    uint32_t *rows;
    if (built != NULL) {
        rows = experts_counts(counts_text, counts_len, &b.n_experts);
    } else {
        b.n_experts = (uint32_t)cJSON_GetArraySize(counts);
        rows = calloc(b.n_experts ? b.n_experts : 1, sizeof *rows);
        uint32_t i = 0;
        for (const cJSON *n = counts->child; rows != NULL && n != NULL; n = n->next, i++)
            rows[i] = cJSON_IsNumber(n) && n->valuedouble >= 0 ? (uint32_t)n->valuedouble : 0;
    }
    if (rows == NULL) {
        cJSON_Delete(built);
        epd_frame_free(frame);
        return client_fail(c, EPD_CLIENT_ERR_NO_MEMORY, NULL, "out of memory");
    }
    b.counts = rows;
    b.scale = cJSON_IsNumber(scale) ? (float)scale->valuedouble : 0.0f;
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(tensors, "x");
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(x, "shape");
    int nd = cJSON_GetArraySize(shape);
    b.hidden = nd > 0 ? (uint32_t)cJSON_GetArrayItem(shape, nd - 1)->valuedouble : 0;
    b.capacity = b.masked && nd == 3 ? (uint32_t)cJSON_GetArrayItem(shape, 1)->valuedouble : 0;
    uint64_t x_bytes = 0, y_bytes = 0, s_bytes = 0;
    uint32_t r;
    (void)experts_tensor(tensors, "x", &r, &b.x_offset, &x_bytes);
    (void)experts_tensor(tensors, "y", &r, &b.y_offset, &y_bytes);
    b.x = region_ptr(c, b.input_region, b.x_offset, x_bytes);
    b.y = region_ptr(c, b.output_region, b.y_offset, y_bytes);
    if (experts_tensor(tensors, "scales", &r, &b.scales_offset, &s_bytes)) {
        b.scales = region_ptr(c, b.input_region, b.scales_offset, s_bytes);
        const cJSON *st = cJSON_GetObjectItemCaseSensitive(tensors, "scales");
        const cJSON *ss = cJSON_GetObjectItemCaseSensitive(st, "shape");
        int snd = cJSON_GetArraySize(ss);
        b.scales_per_row = snd > 0 ? (uint32_t)cJSON_GetArrayItem(ss, snd - 1)->valuedouble : 0;
    }

    c->serving = true;
    int answer = c->experts_fn(c->experts_arg, &b);
    c->serving = false;
    free(rows);
    cJSON_Delete(built);
    epd_frame_free(frame);
    if (answer != 0) {
        /* the worker gave up on this batch: no answer (the rank's step times out) */
        client_ok(c);
        return EPD_CLIENT_OK;
    }
    char done[128];
    snprintf(done, sizeof done, "{\"step\":%" PRIu64 ",\"seen_ns\":%" PRIu64 ",\"done_ns\":%" PRIu64
             "}", step, seen_ns, epd_now_ns());
    epd_frame_out_t out;
    char err[EPD_ERR_LEN];
    if (epd_frame_encode_text(EPD_FRAME_EXPERTS_DONE, done, &out, err) != EPD_OK)
        return client_fail(c, EPD_CLIENT_ERR_NO_MEMORY, NULL, "%s", err);
    rc = client_send_out(c, &out);
    epd_frame_out_free(&out);
    return rc;
}

/* Serves every EXPERTS frame in the queue, oldest first. */
static int client_serve_queued(epd_client_t *c)
{
    for (;;) {
        queued_frame_t **link = &c->head, *prev = NULL, *q = c->head;
        while (q != NULL && q->frame.type != EPD_FRAME_EXPERTS) {
            prev = q;
            link = &q->next;
            q = q->next;
        }
        if (q == NULL) return EPD_CLIENT_OK;
        *link = q->next;
        if (c->tail == q) c->tail = prev;
        epd_frame_t frame = q->frame;
        uint64_t read_ns = q->read_ns;
        c->taken_read_ns = read_ns;
        free(q);
        int rc = client_serve_one(c, &frame, read_ns, epd_now_ns());
        if (rc != EPD_CLIENT_OK) return rc;
    }
}

EPD_CLIENT_API int epd_client_serve_experts(epd_client_t *c, uint32_t input_region,
                                            uint32_t output_region, epd_client_experts_fn fn,
                                            void *arg, char **reply_json_p)
{
    epd_frame_out_t out;
    epd_frame_t frame;
    char err[EPD_ERR_LEN], meta[160];
    int rc;

    if (c == NULL) return EPD_CLIENT_ERR_INVALID_ARG;
    if (reply_json_p != NULL) *reply_json_p = NULL;
    if (fn == NULL || c->experts_fn != NULL)
        return client_fail(c, EPD_CLIENT_ERR_INVALID_ARG, NULL,
                           fn == NULL ? "serve_experts needs a callback"
                                      : "this client serves experts already");
    rc = client_require_connected(c);
    if (rc != EPD_CLIENT_OK) return rc;
    snprintf(meta, sizeof meta, "{\"op\":\"serve_experts\",\"input\":%" PRIu32 ",\"output\":%"
             PRIu32 "}", input_region, output_region);
    if (epd_frame_encode_text(EPD_FRAME_CONTROL, meta, &out, err) != EPD_OK)
        return client_fail(c, EPD_CLIENT_ERR_NO_MEMORY, NULL, "%s", err);
    /* set before the REPLY comes: an EXPERTS may follow it at once */
    epd_decoder_keep_text(&c->dec, 1u << EPD_FRAME_EXPERTS);
    c->experts_fn = fn;
    c->experts_arg = arg;
    c->experts_in = input_region;
    c->experts_out = output_region;
    rc = client_send_out(c, &out);
    epd_frame_out_free(&out);
    if (rc == EPD_CLIENT_OK) rc = client_take(c, match_control, NULL, &frame);
    if (rc != EPD_CLIENT_OK) {
        c->experts_fn = NULL;
        epd_decoder_keep_text(&c->dec, 0);
        return rc;
    }
    if (frame.type == EPD_FRAME_ERROR) {
        epd_client_reply_t reply;
        c->experts_fn = NULL;
        epd_decoder_keep_text(&c->dec, 0);
        rc = reply_from_frame(c, &frame, &reply);
        epd_client_reply_free(&reply);
        return rc;
    }
    if (reply_json_p != NULL) *reply_json_p = cJSON_PrintUnformatted(frame.meta);
    epd_frame_free(&frame);
    client_ok(c);
    return EPD_CLIENT_OK;
}

static bool match_nothing(const epd_frame_t *f, const void *arg)
{
    (void)f;
    (void)arg;
    return false;
}

EPD_CLIENT_API int epd_client_serve(epd_client_t *c, int timeout_ms)
{
    epd_frame_t frame;

    if (c == NULL) return EPD_CLIENT_ERR_INVALID_ARG;
    if (c->experts_fn == NULL)
        return client_fail(c, EPD_CLIENT_ERR_INVALID_ARG, NULL,
                           "serve: this client does not serve experts (epd_client_serve_experts)");
    int saved = c->timeout_ms;
    c->timeout_ms = timeout_ms;
    int rc = client_take(c, match_nothing, NULL, &frame);
    c->timeout_ms = saved;
    if (rc == EPD_CLIENT_ERR_TIMEOUT) {
        client_ok(c);
        return EPD_CLIENT_OK;
    }
    return rc;
}
