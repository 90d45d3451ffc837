/* One client connection: an explicit state machine (memcached's conn_states / drive_machine) over a
 * bufferevent. Bytes go to the frame decoder as they arrive, a bounded number of frames per event;
 * a payload being collected is read straight into its buffer (one copy, the kernel's: page-locked
 * memory on a daemon with a pool), headers and meta through the input buffer; each whole frame
 * goes to daemon/conn_frames.c (SUBMIT validated and queued on the engine, CONTROL answered at
 * once). Framing errors are answered, then the connection closes once its output is flushed;
 * unsent output above socket.max_output_bytes pauses reading until the client catches up. A
 * frame whose payload would take all connections together over socket.max_buffered_bytes is
 * read, thrown away and answered busy; idle connections and frames that take too long are closed
 * (socket.idle_timeout_ms, socket.frame_timeout_ms). Answers count as sent once written whole,
 * as discarded otherwise. */
#include "daemon/conn_int.h"

#include <assert.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>

#include "common/clock.h"
#include "daemon/bulk.h"
#include "daemon/log.h"
#include "daemon/pinned.h"
#include "daemon/region.h"
#include "proto/frame.h"

/* How long a closing connection (framing error, daemon stopping) may take to read its answers. */
#define CONN_FLUSH_TIMEOUT_S 5

/* Connections closed by a timeout are logged at most this often (the others are counted). */
#define CONN_TIMEOUT_LOG_MS 1000

/* A timeout timer this late means the daemon itself did not run meanwhile (500 ms); the
 * connection then has as long again before its deadline is judged (conn_deadline_cb). */
#define CONN_LATE_NS (UINT64_C(500) * 1000000u)

/* Frames one connection handles per event before the others get their turn (memcached's
 * reqs_per_event): a client that pipelines a long burst does not hold up the loop, whose other
 * clients and collective agreements wait meanwhile. */
#define CONN_FRAMES_PER_EVENT 16

/* Bytes one read asks the socket for. */
#define CONN_READ_BYTES (256u * 1024u)

/* recvmsg calls one readable event may make into a payload while each fills its window (the
 * socket had more, or came while it was tried again): a large payload takes fewer loop rounds,
 * and other connections still get their turn. */
#define CONN_PAYLOAD_READS 8

/* After a read of at least CONN_SPIN_MIN_READ bytes into a payload, how long the socket is tried
 * again for the rest before the loop waits for it (conn_read_payload). */
#define CONN_SPIN_MIN_READ (64u * 1024u)
#define CONN_SPIN_NS (100u * 1000u)

static const char *const conn_state_names[CONN_STATE_MAX] = {
    [CONN_READING] = "reading",
    [CONN_YIELDED] = "yielded",
    [CONN_PAUSED] = "paused",
    [CONN_CLOSING] = "closing",
    [CONN_FLUSHING] = "flushing",
    [CONN_CLOSED] = "closed",
};

#define CONN_TO(state) (1u << (state))

/* The states each state may move to: closing only goes forward, nothing leaves closed. */
static const unsigned conn_next_states[CONN_STATE_MAX] = {
    [CONN_READING] = CONN_TO(CONN_YIELDED) | CONN_TO(CONN_PAUSED) | CONN_TO(CONN_CLOSING) |
                     CONN_TO(CONN_CLOSED),
    [CONN_YIELDED] = CONN_TO(CONN_READING) | CONN_TO(CONN_CLOSING) | CONN_TO(CONN_CLOSED),
    [CONN_PAUSED] = CONN_TO(CONN_READING) | CONN_TO(CONN_CLOSING) | CONN_TO(CONN_CLOSED),
    [CONN_CLOSING] = CONN_TO(CONN_FLUSHING) | CONN_TO(CONN_CLOSED),
    [CONN_FLUSHING] = CONN_TO(CONN_CLOSED),
    [CONN_CLOSED] = 0,
};

#define CONN_ANSWER_RESULT (UINT64_C(1) << 63)

/* Timeout closes logged since the last line (loop thread only, like every connection). */
static uint64_t conn_timeout_log_ns;
static uint64_t conn_timeout_unlogged;

static void conn_drive(epd_conn_t *c);
static void conn_arm_deadline(epd_conn_t *c, uint64_t now);
static void conn_bulk_write_end(epd_conn_t *c);

/* The one place a connection's state changes: asserts, traces and assigns; conn_drive does what
 * the new state needs. */
static void conn_set_state(epd_conn_t *c, conn_state_t state)
{
    assert(state < CONN_STATE_MAX);
    if (c->state == state) return;
    assert(conn_next_states[c->state] & CONN_TO(state));
    epd_log_debug("conn %" PRIu64 ": %s -> %s", c->id, conn_state_names[c->state],
                  conn_state_names[state]);
    c->state = state;
}

/* Turns reading from the socket on or off (nothing to do when it already is). */
static void conn_set_reading(epd_conn_t *c, bool on)
{
    if (c->bulk_reading) on = false; /* the pool reads the socket now */
    if (on && !c->reading) event_add(c->rev, NULL);
    else if (!on && c->reading) event_del(c->rev);
    c->reading = on;
}

/* Closing, flushing or closed: nothing more is read, what is left is the output. */
static bool conn_closing(const epd_conn_t *c)
{
    return c->state == CONN_CLOSING || c->state == CONN_FLUSHING || c->state == CONN_CLOSED;
}

/* Output not written yet: the output buffer's, and the write job's while it runs. */
static size_t conn_output_len(const epd_conn_t *c)
{
    return evbuffer_get_length(bufferevent_get_output(c->bev)) + c->bulk_out_left;
}

static bool conn_output_over_limit(const epd_conn_t *c)
{
    return conn_output_len(c) > c->ctx->cfg->socket.max_output_bytes;
}

/* Appends an encoded frame but for its first `written` bytes (sent already: they count as
 * queued and written); the head is copied, part 0 (if any) is referenced and released by
 * release(release_arg) once written (or when the connection goes). */
static void conn_queue_frame_rest(epd_conn_t *c, epd_frame_out_t *out,
                                  evbuffer_ref_cleanup_cb release, void *release_arg,
                                  size_t written)
{
    struct evbuffer *output = bufferevent_get_output(c->bev);
    bool released = false;
    size_t queued = written, skip = written;
    int rc = 0;

    if (skip < out->head_len) {
        rc = evbuffer_add(output, out->head + skip, out->head_len - skip);
        if (rc == 0) queued += out->head_len - skip;
        skip = 0;
    } else {
        skip -= out->head_len;
    }
    for (size_t i = 0; rc == 0 && i < out->n_parts; i++) {
        size_t len = out->part_len[i];
        if (len == 0) continue;
        if (skip >= len) { /* written whole: part 0 is released below */
            skip -= len;
            continue;
        }
        const uint8_t *from = (const uint8_t *)out->part[i] + skip;
        len -= skip;
        skip = 0;
        if (i == 0 && release != NULL) {
            rc = evbuffer_add_reference(output, from, len, release, release_arg);
            released = rc == 0;
        } else {
            rc = evbuffer_add(output, from, len);
        }
        if (rc == 0) queued += len;
    }
    c->ctx->stats->bytes_out += queued;
    c->out_queued += queued;
    if (rc != 0) {
        epd_log_error("conn %" PRIu64 ": out of memory queueing a reply; closing", c->id);
        conn_set_state(c, CONN_CLOSED);
    }
    if (!released && release != NULL) release(NULL, 0, release_arg);
    epd_frame_out_free(out);
}

/* Sends an encoded frame (as conn_queue_frame_rest): with nothing ahead of it in the output it is
 * written at once, in one sendmsg(2), and only what the socket did not take is queued. Queueing
 * it first would arm the bufferevent's write event and disarm it once drained: two epoll_ctl(2)
 * calls on the way of every answer, one of them before its bytes left. */
void epd_conn_send_frame(epd_conn_t *c, epd_frame_out_t *out, evbuffer_ref_cleanup_cb release,
                         void *release_arg)
{
    size_t written = 0;

    if (!c->bulk_writing && c->state != CONN_CLOSED && conn_output_len(c) == 0) {
        struct iovec iov[1 + EPD_FRAME_OUT_PARTS];
        size_t n_iov = 0;
        iov[n_iov++] = (struct iovec){.iov_base = out->head, .iov_len = out->head_len};
        for (size_t i = 0; i < out->n_parts; i++) {
            if (out->part_len[i] > 0)
                iov[n_iov++] = (struct iovec){.iov_base = (void *)out->part[i],
                                              .iov_len = out->part_len[i]};
        }
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = n_iov};
        ssize_t n;
        do {
            n = sendmsg(c->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        } while (n < 0 && errno == EINTR);
        /* the socket full, or failed: all of it queued, the bufferevent meets the error (if
         * any) as it would have */
        if (n > 0) written = (size_t)n;
    }
    conn_queue_frame_rest(c, out, release, release_arg, written);
}

/* Remembers that an answer to a request ends at the current end of the output. Without memory for
 * the entry the answer is taken as sent at once (only the counters are then off). */
static void conn_answer_queued(epd_conn_t *c, bool result)
{
    if (c->answers_count == c->answers_cap) {
        size_t cap = c->answers_cap ? 2 * c->answers_cap : 16;
        uint64_t *ring = malloc(cap * sizeof(*ring));
        if (ring == NULL) {
            if (result) c->ctx->stats->results_sent++;
            return;
        }
        for (size_t i = 0; i < c->answers_count; i++)
            ring[i] = c->answers[(c->answers_head + i) % c->answers_cap];
        free(c->answers);
        c->answers = ring;
        c->answers_cap = cap;
        c->answers_head = 0;
    }
    c->answers[(c->answers_head + c->answers_count) % c->answers_cap] =
        c->out_queued | (result ? CONN_ANSWER_RESULT : 0);
    c->answers_count++;
}

/* Answers written whole by now are sent; with discard_rest (the connection is going), the others
 * are discarded. Returns how many were discarded. */
static uint64_t conn_answers_settle(epd_conn_t *c, bool discard_rest)
{
    uint64_t written = c->out_queued - conn_output_len(c);
    uint64_t discarded = 0;

    while (c->answers_count > 0) {
        uint64_t entry = c->answers[c->answers_head];
        bool result = (entry & CONN_ANSWER_RESULT) != 0;
        if ((entry & ~CONN_ANSWER_RESULT) <= written) {
            if (result) c->ctx->stats->results_sent++;
        } else if (discard_rest) {
            c->ctx->stats->results_discarded++;
            discarded++;
        } else {
            return discarded;
        }
        c->answers_head = (c->answers_head + 1) % c->answers_cap;
        c->answers_count--;
    }
    return discarded;
}

/* Queues an ERROR frame and counts it by code. */
void epd_conn_send_error(epd_conn_t *c, bool has_id, uint64_t id, epd_status_t code,
                         const char *message)
{
    epd_frame_out_t out;
    char err[EPD_ERR_LEN];

    if (!epd_status_is_wire_code(code)) code = EPD_ERR_INTERNAL;
    if (epd_frame_encode_error(has_id, id, code, message, &out, err) != EPD_OK) {
        epd_log_error("conn %" PRIu64 ": cannot encode an ERROR frame: %s; closing", c->id, err);
        conn_set_state(c, CONN_CLOSED);
        return;
    }
    c->ctx->stats->errors[code]++;
    if (has_id)
        epd_log_debug("conn %" PRIu64 ": request %" PRIu64 ": %s: %s", c->id, id,
                      epd_status_name(code), message);
    else
        epd_log_debug("conn %" PRIu64 ": %s: %s", c->id, epd_status_name(code), message);
    epd_conn_send_frame(c, &out, NULL, NULL);
}

/* A framing error: answer it, then close once the answer is written. */
void epd_conn_fail_framing(epd_conn_t *c, bool has_id, uint64_t id, epd_status_t code,
                           const char *message)
{
    epd_log_info("conn %" PRIu64 " (pid %ld, uid %ld): %s: %s; closing", c->id, (long)c->pid,
                 (long)c->uid, epd_status_name(code), message);
    epd_conn_send_error(c, has_id, id, code, message);
    if (!conn_closing(c)) conn_set_state(c, CONN_CLOSING);
}

static void *conn_payload_resize(void *pool, void *p, size_t keep, size_t bytes)
{
    return epd_pinned_resize(pool, p, keep, bytes);
}

/* The decoder's admit callback: reserves the frame's payload in the budget of all connections
 * together, or refuses it (the frame is then read, thrown away and answered busy). */
static bool conn_admit(void *arg, const epd_frame_header_t *header)
{
    epd_conn_t *c = arg;
    epd_server_stats_t *stats = c->ctx->stats;

    if (header->payload_len > c->ctx->cfg->socket.max_buffered_bytes - stats->buffered_bytes)
        return false;
    stats->buffered_bytes += header->payload_len;
    c->reserved = header->payload_len;
    return true;
}

static void conn_release_reserved(epd_conn_t *c)
{
    c->ctx->stats->buffered_bytes -= c->reserved;
    c->reserved = 0;
}

/* A whole frame was read: its reservation in the budget and its deadline end; answered or queued. */
static void conn_frame_read(epd_conn_t *c, epd_frame_t *frame)
{
    conn_release_reserved(c);
    c->frame_start_ns = 0;
    epd_conn_handle_frame(c, frame);
    epd_frame_free(frame);
}

/* The decoder failed (a framing error, or no memory for a buffer): answered, then closing. */
static void conn_fail_decoding(epd_conn_t *c, epd_status_t status, const char *err)
{
    if (status == EPD_ERR_NO_MEMORY) {
        epd_log_error("conn %" PRIu64 ": out of memory decoding a frame: %s", c->id, err);
        epd_conn_fail_framing(c, false, 0, EPD_ERR_INTERNAL, "out of memory decoding the frame");
        return;
    }
    epd_conn_fail_framing(c, false, 0, status, err);
}

/* Feeds the first contiguous piece of the buffered input to the decoder (what it used is drained
 * and counted): EPD_OK with a whole frame, EPD_ERR_AGAIN for more input, else the decoder's error.
 * The input must not be empty (libevent then always has a first piece: not finding one is an
 * internal error, not a wait that would never end). */
static epd_status_t conn_decode_some(epd_conn_t *c, epd_frame_t *frame, char *err)
{
    struct evbuffer_iovec vec;
    if (evbuffer_peek(c->input, -1, NULL, &vec, 1) < 1) {
        snprintf(err, EPD_ERR_LEN, "buffered input of %zu bytes has no first piece",
                 evbuffer_get_length(c->input));
        return EPD_ERR_INTERNAL;
    }
    size_t used = 0;
    epd_status_t status = epd_decoder_feed(&c->decoder, vec.iov_base, vec.iov_len, &used, frame,
                                           err);
    evbuffer_drain(c->input, used);
    c->ctx->stats->bytes_in += used;
    return status;
}

/* Feeds buffered input to the decoder and handles whole frames, until the input is used up, the
 * frame budget of this event is spent (yielded) or the state changes (output over the limit,
 * framing error). */
static void conn_read_frames(epd_conn_t *c)
{
    struct evbuffer *input = c->input;
    unsigned handled = 0;
    char err[EPD_ERR_LEN];

    while (c->state == CONN_READING && evbuffer_get_length(input) > 0) {
        if (handled == CONN_FRAMES_PER_EVENT) {
            conn_set_state(c, CONN_YIELDED);
            return;
        }
        if (conn_output_over_limit(c)) {
            conn_set_state(c, CONN_PAUSED);
            return;
        }
        epd_frame_t frame;
        epd_status_t status = conn_decode_some(c, &frame, err);
        if (status == EPD_ERR_AGAIN) continue;
        if (status == EPD_OK) {
            c->decoded_ns = epd_now_ns();
            conn_frame_read(c, &frame);
            handled++;
            continue;
        }
        conn_fail_decoding(c, status, err);
        return;
    }
}

/* The daemon is stopping: every whole frame left in the input is handled (the engine refuses
 * SUBMITs with shutting_down now); a partial frame at the end is not answered. */
static void conn_answer_read_input(epd_conn_t *c)
{
    struct evbuffer *input = c->input;
    char err[EPD_ERR_LEN];

    while (c->state == CONN_CLOSING && evbuffer_get_length(input) > 0) {
        epd_frame_t frame;
        epd_status_t status = conn_decode_some(c, &frame, err);
        if (status == EPD_ERR_AGAIN) continue;
        if (status != EPD_OK) {
            epd_conn_send_error(c, false, 0, epd_status_is_wire_code(status) ? status
                                                                         : EPD_ERR_INTERNAL, err);
            return;
        }
        conn_release_reserved(c);
        epd_conn_handle_frame(c, &frame);
        epd_frame_free(&frame);
    }
}

/* The one place that moves a connection along and does its I/O; may free c. */
static void conn_drive(epd_conn_t *c)
{
    if (c->driving) return;
    c->driving = true;
    for (;;) {
        switch (c->state) {
        case CONN_READING:
            conn_set_reading(c, true);
            if (conn_output_over_limit(c)) {
                conn_set_state(c, CONN_PAUSED);
                continue;
            }
            conn_read_frames(c);
            if (c->state != CONN_READING) continue;
            if (c->frame_start_ns == 0 && !epd_decoder_idle(&c->decoder)) {
                uint64_t now = epd_now_ns();
                c->frame_start_ns = now;
                conn_arm_deadline(c, now);
            }
            c->driving = false; /* input used up: wait for more */
            return;
        case CONN_YIELDED: {
            /* Nothing more is read from the socket until the input already here is handled; the
             * resume timer fires once the loop has polled, so other connections go first. */
            conn_set_reading(c, false);
            struct timeval now = {0, 0};
            evtimer_add(c->resume, &now);
            c->driving = false;
            return;
        }
        case CONN_PAUSED:
            conn_set_reading(c, false);
            if (!conn_output_over_limit(c)) {
                /* Back under the limit: read again, starting with what is already buffered. The
                 * time paused was the client's not reading, not its frame being slow. */
                uint64_t now = epd_now_ns();
                if (c->frame_start_ns != 0) c->frame_start_ns = now;
                c->active_ns = now;
                conn_arm_deadline(c, now);
                conn_set_state(c, CONN_READING);
                continue;
            }
            c->driving = false; /* the write callback brings us back */
            return;
        case CONN_CLOSING: {
            conn_set_reading(c, false);
            if (c->deadline != NULL) evtimer_del(c->deadline);
            c->deadline_ns = 0;
            /* Stopping: whole frames already read are answered (SUBMITs get shutting_down,
             * DESIGN.md section 5). After a framing error the rest of the stream is not. */
            if (c->answer_input) conn_answer_read_input(c);
            evbuffer_drain(c->input, evbuffer_get_length(c->input));
            /* Be told when the output is completely written, and give up after a while. */
            bufferevent_setwatermark(c->bev, EV_WRITE, 0, 0);
            struct timeval tv = {CONN_FLUSH_TIMEOUT_S, 0};
            bufferevent_set_timeouts(c->bev, NULL, &tv);
            if (c->bulk_writing && !c->wjob_busy) event_add(c->wev, &tv);
            conn_set_state(c, CONN_FLUSHING);
            continue;
        }
        case CONN_FLUSHING:
            if (conn_output_len(c) == 0) {
                conn_set_state(c, CONN_CLOSED);
                continue;
            }
            c->driving = false;
            return;
        case CONN_CLOSED:
        case CONN_STATE_MAX:
        default:
            /* Answers are counted sent or discarded once no write job is on the pool: one that
             * runs at the close may still finish its frame, which then reaches the client. */
            if (!c->settled && !c->wjob_busy) {
                uint64_t unwritten = conn_answers_settle(c, true);
                if (unwritten > 0)
                    epd_log_info("conn %" PRIu64 " closed with %" PRIu64 " requests in flight to "
                                 "it: answered, not written whole; discarded", c->id, unwritten);
                c->settled = true;
            }
            if (!c->closed_told) {
                conn_set_reading(c, false);
                bufferevent_disable(c->bev, EV_READ | EV_WRITE);
                if (c->deadline != NULL) evtimer_del(c->deadline);
                evtimer_del(c->resume);
                conn_release_reserved(c);
                c->closed_told = true;
                c->ctx->closed(c->ctx->arg, c);
            }
            if (c->bulk_writing && !c->wjob_busy) conn_bulk_write_end(c);
            if (c->bulk_reading || c->wjob_busy) {
                c->driving = false; /* freed when the socket copies are back (they use fd) */
                return;
            }
            if (c->wev != NULL) event_free(c->wev);
            evbuffer_remove_cb_entry(bufferevent_get_output(c->bev), c->output_cb);
            epd_decoder_free(&c->decoder);
            free(c->answers);
            if (c->deadline != NULL) event_free(c->deadline);
            event_free(c->resume);
            event_free(c->rev);
            evbuffer_free(c->input);
            for (unsigned i = 0; i < c->n_fds; i++) close(c->fds[i]);
            /* regions still used by requests in flight go when those are answered */
            epd_region_table_free(c->regions);
            bufferevent_free(c->bev);
            free(c);
            return;
        }
    }
}

/* Arms the timer for the earliest deadline of this connection if it is not armed for one at
 * least as early: the frame being read (frame_timeout_ms after its first byte), or the idle
 * limit (idle_timeout_ms after the last activity). The timer re-checks when it fires. */
static void conn_arm_deadline(epd_conn_t *c, uint64_t now)
{
    const epd_config_t *cfg = c->ctx->cfg;
    uint64_t due = 0;

    if (c->deadline == NULL || conn_closing(c)) return;
    if (cfg->socket.frame_timeout_ms != 0 && c->frame_start_ns != 0)
        due = c->frame_start_ns + (uint64_t)cfg->socket.frame_timeout_ms * 1000000u;
    if (cfg->socket.idle_timeout_ms != 0) {
        uint64_t idle_due = c->active_ns + (uint64_t)cfg->socket.idle_timeout_ms * 1000000u;
        if (due == 0 || idle_due < due) due = idle_due;
    }
    if (due == 0 || (c->deadline_ns != 0 && c->deadline_ns <= due)) return;
    uint64_t wait_us = due > now ? (due - now) / 1000u : 0;
    struct timeval tv = {(time_t)(wait_us / 1000000u), (suseconds_t)(wait_us % 1000000u)};
    c->deadline_ns = due;
    evtimer_add(c->deadline, &tv);
}

/* Closes c for a timeout: counted, logged (at most once a second, the others summed up). */
static void conn_time_out(epd_conn_t *c, bool idle, uint64_t waited_ns)
{
    const epd_config_t *cfg = c->ctx->cfg;
    uint64_t now = epd_now_ns();

    if (idle)
        c->ctx->stats->closed_idle++;
    else
        c->ctx->stats->closed_frame_timeout++;
    if (conn_timeout_log_ns == 0 || now - conn_timeout_log_ns >= CONN_TIMEOUT_LOG_MS * 1000000ull) {
        char more[96] = "";
        if (conn_timeout_unlogged > 0)
            snprintf(more, sizeof(more), " (and %" PRIu64 " more closed by a timeout since the "
                     "last such line)", conn_timeout_unlogged);
        if (idle)
            epd_log_info("conn %" PRIu64 " (pid %ld): idle for %" PRIu64 " ms "
                         "(socket.idle_timeout_ms = %" PRIu32 "); closing%s", c->id, (long)c->pid,
                         waited_ns / 1000000u, cfg->socket.idle_timeout_ms, more);
        else
            epd_log_info("conn %" PRIu64 " (pid %ld): a frame not complete after %" PRIu64 " ms "
                         "(socket.frame_timeout_ms = %" PRIu32 "); closing%s", c->id, (long)c->pid,
                         waited_ns / 1000000u, cfg->socket.frame_timeout_ms, more);
        conn_timeout_log_ns = now;
        conn_timeout_unlogged = 0;
    } else {
        conn_timeout_unlogged++;
    }
    /* What is queued still goes out (answers to earlier requests); nothing more is read. */
    conn_set_state(c, CONN_CLOSING);
    conn_drive(c);
}

static void conn_deadline_cb(evutil_socket_t fd, short what, void *arg)
{
    epd_conn_t *c = arg;
    const epd_config_t *cfg = c->ctx->cfg;
    uint64_t now = epd_now_ns();
    uint64_t due = c->deadline_ns;

    c->deadline_ns = 0;
    /* Much later than due: this process was not running (stopped, starved). What the client
     * sent meanwhile waits in the socket, and this timer may run before the read that would take
     * it: the deadlines move to CONN_LATE_NS from now, so that it is read before they are judged
     * (or a whole window where that is shorter; then a frame it completes is not timed out, and
     * a client still slow or idle is closed). Moved on only by the lateness, they would expire
     * here: their window had passed by due. */
    if (due != 0 && now > due + CONN_LATE_NS) {
        const uint64_t grace_due = now + CONN_LATE_NS;
        const uint64_t frame_ns = (uint64_t)cfg->socket.frame_timeout_ms * 1000000u;
        const uint64_t idle_ns = (uint64_t)cfg->socket.idle_timeout_ms * 1000000u;
        if (c->frame_start_ns != 0 && c->frame_start_ns + frame_ns < grace_due)
            c->frame_start_ns = grace_due - frame_ns < now ? grace_due - frame_ns : now;
        if (c->active_ns + idle_ns < grace_due)
            c->active_ns = grace_due - idle_ns < now ? grace_due - idle_ns : now;
    }
    /* Paused or yielded: the daemon, not the client, holds the bytes up; re-armed on reading. */
    if (c->state != CONN_READING) {
        if (c->state == CONN_YIELDED) conn_arm_deadline(c, now);
        return;
    }
    if (cfg->socket.frame_timeout_ms != 0 && c->frame_start_ns != 0 &&
        now - c->frame_start_ns >= (uint64_t)cfg->socket.frame_timeout_ms * 1000000u) {
        conn_time_out(c, false, now - c->frame_start_ns);
        return;
    }
    /* A connection that registered regions holds them open: closing it would release them under
     * a client that merely has nothing to submit now. */
    bool idle = c->in_flight == 0 && conn_output_len(c) == 0 && epd_decoder_idle(&c->decoder) &&
                c->regions == NULL;
    if (cfg->socket.idle_timeout_ms != 0 && idle &&
        now - c->active_ns >= (uint64_t)cfg->socket.idle_timeout_ms * 1000000u) {
        conn_time_out(c, true, now - c->active_ns);
        return;
    }
    /* Not idle (answers due, output unsent): it counts as active until then. */
    if (!idle) c->active_ns = now;
    conn_arm_deadline(c, now);
}

static void conn_resume_cb(evutil_socket_t fd, short what, void *arg)
{
    epd_conn_t *c = arg;

    if (c->state == CONN_YIELDED) conn_set_state(c, CONN_READING);
    conn_drive(c);
}

/* Keeps the file descriptors of one SCM_RIGHTS message (closing those over CONN_MAX_FDS). */
static void conn_take_fds(epd_conn_t *c, struct msghdr *msg)
{
    unsigned closed = epd_bulk_take_fds(msg, c->fds, &c->n_fds, CONN_MAX_FDS);
    if (closed > 0)
        epd_log_info("conn %" PRIu64 ": more than %d unclaimed file descriptors; %u closed",
                     c->id, CONN_MAX_FDS, closed);
}

/* One recvmsg into iov[n_iov], keeping the file descriptors that came with it (SCM_RIGHTS may
 * ride on any byte). Returns the bytes read; 0 when there is nothing to read now; -1 when the
 * connection is over (peer closed, read error), its state closed. */
static ssize_t conn_recv(epd_conn_t *c, struct iovec *iov, size_t n_iov)
{
    union {
        char buf[CMSG_SPACE(CONN_MAX_FDS * sizeof(int))];
        struct cmsghdr align;
    } control;
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = n_iov,
                         .msg_control = control.buf, .msg_controllen = sizeof control.buf};

    ssize_t got = recvmsg(c->fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    int saved = errno;
    /* after a failed recvmsg msg_controllen is what we passed in: nothing came */
    if (got >= 0) conn_take_fds(c, &msg);
    if (got > 0) c->recv_ns = epd_now_ns();
    if (got < 0) {
        if (saved == EAGAIN || saved == EWOULDBLOCK || saved == EINTR) return 0;
        epd_log_debug("conn %" PRIu64 ": read: %s; closing", c->id, strerror(saved));
        conn_set_state(c, CONN_CLOSED);
        return -1;
    }
    if (got == 0) {
        epd_log_debug("conn %" PRIu64 ": peer closed%s", c->id,
                      epd_decoder_idle(&c->decoder) ? "" : " in the middle of a frame");
        /* A client that closes its end is gone: answers still due to it are discarded. */
        conn_set_state(c, CONN_CLOSED);
        return -1;
    }
    if (msg.msg_flags & MSG_CTRUNC)
        epd_log_info("conn %" PRIu64 ": file descriptors beyond %d in one message were dropped",
                     c->id, CONN_MAX_FDS);
    return got;
}

/* Reads the payload of the frame being collected straight into its buffer (the decoder's window,
 * page-locked memory on a daemon with a pool): its bytes are copied once, by the kernel. A client
 * that streams a payload (reads of CONN_SPIN_MIN_READ bytes and more) has its next bytes a few
 * microseconds away: while no other connection is in the middle of a frame and the engine is
 * not hot (the loop would sleep), the socket is tried again for up to CONN_SPIN_NS before the
 * loop goes back to waiting, since a sleep and a wake-up on both sides cost more than that
 * (tests/bench/read_bench.c measures it). At most
 * CONN_PAYLOAD_READS reads per event, then the loop's other work goes first; a frame it completes
 * is handled as conn_read_frames handles one. */
static void conn_read_payload(epd_conn_t *c, void *window, size_t len)
{
    char err[EPD_ERR_LEN];
    epd_status_t status;
    uint64_t spin_until = 0;
    int reads = 0;

    while (len > 0 && reads < CONN_PAYLOAD_READS) {
        struct iovec iov = {.iov_base = window, .iov_len = len};
        ssize_t got = conn_recv(c, &iov, 1);
        if (got < 0) return;
        if (got == 0) {
            if (spin_until == 0 || epd_now_ns() >= spin_until) return;
            continue;
        }
        reads++;
        uint64_t now = epd_now_ns();
        c->active_ns = now;
        c->ctx->stats->bytes_in += (uint64_t)got;
        epd_frame_t frame;
        status = epd_decoder_payload_commit(&c->decoder, (size_t)got, &frame, err);
        if (status == EPD_OK) {
            /* as inside conn_drive: callbacks the frame sets off only mark work */
            c->driving = true;
            conn_frame_read(c, &frame);
            c->driving = false;
            return;
        }
        if (status != EPD_ERR_AGAIN) {
            conn_fail_decoding(c, status, err);
            return;
        }
        /* buffered_bytes holds every connection's frame in progress: only ours, nobody waits.
         * Not while the engine is hot: the loop spins then (no sleep, no wake-up to save), and
         * results waiting for it to write them must not wait for this socket. */
        bool streaming = (size_t)got >= CONN_SPIN_MIN_READ &&
                         c->ctx->stats->buffered_bytes == c->reserved &&
                         (c->ctx->engine == NULL || !epd_engine_hot(c->ctx->engine));
        spin_until = streaming ? now + CONN_SPIN_NS : 0;
        if (!streaming && (size_t)got < len) return; /* the socket is empty for now */
        status = epd_decoder_payload_window(&c->decoder, &window, &len, err);
        if (status != EPD_OK) {
            conn_fail_decoding(c, status, err);
            return;
        }
    }
}

/* A read job is back (loop thread): its bytes go to the decoder as one read's would, unless the
 * connection is closing; the file descriptors that came with them are kept. */
static void conn_bulk_read_done(epd_bulk_job_t *job)
{
    epd_conn_t *c = job->arg;
    char err[EPD_ERR_LEN];

    c->bulk_reading = false;
    for (unsigned i = 0; i < job->n_fds; i++) {
        if (c->n_fds < CONN_MAX_FDS && c->state != CONN_CLOSED) {
            c->fds[c->n_fds++] = job->fds[i];
        } else {
            close(job->fds[i]);
            job->fds_dropped++;
        }
    }
    if (job->fds_dropped > 0)
        epd_log_info("conn %" PRIu64 ": more than %d unclaimed file descriptors; %u closed",
                     c->id, CONN_MAX_FDS, job->fds_dropped);
    if (!conn_closing(c) && job->moved > 0) {
        if (job->n_iov > 0) /* the window is not full: the client is slower than the wait */
            epd_log_debug("conn %" PRIu64 ": read job read %zu bytes; the rest on the next "
                          "readable event", c->id, job->moved);
        c->active_ns = c->recv_ns = epd_now_ns();
        c->ctx->stats->bytes_in += job->moved;
        epd_frame_t frame;
        epd_status_t status = epd_decoder_payload_commit(&c->decoder, job->moved, &frame, err);
        if (status == EPD_OK) {
            c->decoded_ns = epd_now_ns();
            c->driving = true; /* as inside conn_drive: callbacks only mark work */
            conn_frame_read(c, &frame);
            c->driving = false;
        } else if (status != EPD_ERR_AGAIN) {
            conn_fail_decoding(c, status, err);
        }
    }
    if (c->state != CONN_CLOSED && (job->eof || job->error != 0)) {
        if (job->eof)
            epd_log_debug("conn %" PRIu64 ": peer closed in the middle of a frame", c->id);
        else
            epd_log_debug("conn %" PRIu64 ": read: %s; closing", c->id, strerror(job->error));
        conn_set_state(c, CONN_CLOSED);
    }
    conn_drive(c); /* reads on again (the next readable event goes on with the payload) */
}

/* A payload window of at least socket.io_offload_bytes is read by the pool while the loop goes
 * on; reads of this socket stay off until the job is back. false: read it here. */
static bool conn_bulk_read(epd_conn_t *c, void *window, size_t len)
{
    const epd_conn_ctx_t *ctx = c->ctx;

    if (ctx->bulk == NULL || c->bulk_reading || len < ctx->cfg->socket.io_offload_bytes)
        return false;
    epd_bulk_job_t *job = &c->rjob;
    job->kind = EPD_BULK_READ;
    job->fd = c->fd;
    job->iov[0] = (struct iovec){.iov_base = window, .iov_len = len};
    job->n_iov = 1;
    job->done = conn_bulk_read_done;
    job->arg = c;
    c->bulk_reading = true;
    conn_set_reading(c, false);
    epd_bulk_submit(ctx->bulk, job);
    return true;
}

/* The socket is readable: into the payload being collected when no input is buffered ahead of it
 * (conn_bulk_read, else conn_read_payload), else one recvmsg into the input; then drive. */
static void conn_read_ev(evutil_socket_t fd, short what, void *arg)
{
    epd_conn_t *c = arg;
    struct evbuffer_iovec vec[2];
    char err[EPD_ERR_LEN];

    if (c->state == CONN_READING && evbuffer_get_length(c->input) == 0 &&
        !conn_output_over_limit(c)) {
        void *window;
        size_t len;
        epd_status_t status = epd_decoder_payload_window(&c->decoder, &window, &len, err);
        if (status != EPD_OK) {
            conn_fail_decoding(c, status, err);
            conn_drive(c);
            return;
        }
        if (len > 0) {
            if (!conn_bulk_read(c, window, len)) conn_read_payload(c, window, len);
            conn_drive(c);
            return;
        }
    }
    int n_vec = evbuffer_reserve_space(c->input, CONN_READ_BYTES, vec, 2);
    if (n_vec < 1) {
        epd_log_error("conn %" PRIu64 ": out of memory reading; closing", c->id);
        conn_set_state(c, CONN_CLOSED);
        conn_drive(c);
        return;
    }
    struct iovec iov[2];
    for (int i = 0; i < n_vec; i++) {
        iov[i].iov_base = vec[i].iov_base;
        iov[i].iov_len = vec[i].iov_len;
    }
    ssize_t got = conn_recv(c, iov, (size_t)n_vec);
    if (got <= 0) {
        evbuffer_commit_space(c->input, vec, 0);
    } else {
        size_t left = (size_t)got;
        for (int i = 0; i < n_vec; i++) {
            size_t take = left < vec[i].iov_len ? left : vec[i].iov_len;
            vec[i].iov_len = take;
            left -= take;
        }
        evbuffer_commit_space(c->input, vec, n_vec);
        c->active_ns = epd_now_ns();
    }
    conn_drive(c);
}

static void conn_write_cb(struct bufferevent *bev, void *arg)
{
    epd_conn_t *c = arg;

    c->active_ns = epd_now_ns();
    conn_drive(c);
}

/* The output changed: what was written counts as sent as soon as it is (the write callback only
 * runs below the output limit). */
static void conn_output_cb(struct evbuffer *output, const struct evbuffer_cb_info *info,
                           void *arg)
{
    if (info->n_deleted > 0) (void)conn_answers_settle(arg, false);
}

static void conn_event_cb(struct bufferevent *bev, short what, void *arg)
{
    epd_conn_t *c = arg;

    if (what & BEV_EVENT_TIMEOUT) {
        epd_log_warn("conn %" PRIu64 " (pid %ld): did not read its answers within %d s; closing",
                     c->id, (long)c->pid, CONN_FLUSH_TIMEOUT_S);
    } else if (what & BEV_EVENT_ERROR) {
        epd_log_debug("conn %" PRIu64 ": socket error; closing", c->id);
    }
    /* A client that closes its end is gone: answers still due to it are discarded (counted). */
    if (c->state != CONN_CLOSED) conn_set_state(c, CONN_CLOSED);
    conn_drive(c);
}

epd_conn_t *epd_conn_create(const epd_conn_ctx_t *ctx, int fd, uint64_t conn_id, uid_t uid,
                            pid_t pid)
{
    const epd_config_t *cfg = ctx->cfg;
    epd_conn_t *c = calloc(1, sizeof(*c));
    if (c == NULL) goto out_close;
    c->resume = evtimer_new(ctx->base, conn_resume_cb, c);
    if (c->resume == NULL) goto out_free;
    if (cfg->socket.idle_timeout_ms != 0 || cfg->socket.frame_timeout_ms != 0) {
        c->deadline = evtimer_new(ctx->base, conn_deadline_cb, c);
        if (c->deadline == NULL) goto out_free_resume;
    }
    c->input = evbuffer_new();
    if (c->input == NULL) goto out_free_resume;
    c->rev = event_new(ctx->base, fd, EV_READ | EV_PERSIST, conn_read_ev, c);
    if (c->rev == NULL) goto out_free_input;
    c->bev = bufferevent_socket_new(ctx->base, fd, BEV_OPT_CLOSE_ON_FREE);
    if (c->bev == NULL) goto out_free_rev;
    c->fd = fd;
    c->id = conn_id;
    c->ctx = ctx;
    c->uid = uid;
    c->pid = pid;
    c->state = CONN_READING;
    epd_decoder_init(&c->decoder, cfg->socket.max_frame_bytes, EPD_FRAME_MAX_META);
    epd_decoder_set_admit(&c->decoder, conn_admit, c);
    if (ctx->engine != NULL) {
        c->payload_alloc = (epd_payload_alloc_t){.resize = conn_payload_resize,
                                                 .release = epd_pinned_release,
                                                 .arg = epd_engine_pinned(ctx->engine)};
        epd_decoder_set_alloc(&c->decoder, &c->payload_alloc);
    }
    c->active_ns = epd_now_ns();
    conn_arm_deadline(c, c->active_ns);
    /* Told whenever a write leaves the output at or under the limit (to resume a paused reader). */
    bufferevent_setwatermark(c->bev, EV_WRITE, cfg->socket.max_output_bytes, 0);
    c->output_cb = evbuffer_add_cb(bufferevent_get_output(c->bev), conn_output_cb, c);
    if (c->output_cb == NULL) goto out_free_bev;
    bufferevent_setcb(c->bev, NULL, conn_write_cb, conn_event_cb, c);
    bufferevent_enable(c->bev, EV_WRITE);
    conn_set_reading(c, true);
    return c;

out_free_bev:
    bufferevent_free(c->bev);
    fd = -1; /* closed with the bufferevent */

out_free_rev:
    event_free(c->rev);
out_free_input:
    evbuffer_free(c->input);
out_free_resume:
    if (c->deadline != NULL) event_free(c->deadline);
    event_free(c->resume);
out_free:
    free(c);
out_close:
    if (fd >= 0) close(fd);
    return NULL;
}

uint64_t epd_conn_id(const epd_conn_t *conn)
{
    return conn->id;
}

uint64_t epd_conn_in_flight(const epd_conn_t *conn)
{
    return conn->in_flight;
}

static void result_release(const void *data, size_t len, void *arg)
{
    epd_result_free(arg);
}

/* The write job's frame is written whole, or the connection is closed: the output is let go. */
static void conn_bulk_write_end(epd_conn_t *c)
{
    event_del(c->wev);
    free(c->bulk_head);
    c->bulk_head = NULL;
    epd_result_free(c->bulk_result);
    c->bulk_result = NULL;
    c->bulk_out_left = 0;
    c->bulk_writing = false;
    if (c->state != CONN_CLOSED) bufferevent_enable(c->bev, EV_WRITE);
}

/* A write job is back (loop thread). Written whole: what was queued behind it goes out next. Else
 * it goes back to the pool once the socket takes more (the client reads slowly). */
static void conn_bulk_write_done(epd_bulk_job_t *job)
{
    epd_conn_t *c = job->arg;

    c->wjob_busy = false;
    c->bulk_out_left -= job->moved;
    if (job->moved > 0) c->active_ns = epd_now_ns();
    if (c->state != CONN_CLOSED && job->error != 0) {
        epd_log_debug("conn %" PRIu64 ": write: %s; closing", c->id, strerror(job->error));
        conn_set_state(c, CONN_CLOSED);
    }
    if (c->state == CONN_CLOSED) {
        conn_drive(c);
        return;
    }
    (void)conn_answers_settle(c, false);
    if (job->n_iov > 0) {
        epd_log_debug("conn %" PRIu64 ": write job has %" PRIu64 " bytes left; waiting for the "
                      "socket", c->id, c->bulk_out_left);
        struct timeval tv = {CONN_FLUSH_TIMEOUT_S, 0};
        event_add(c->wev, conn_closing(c) ? &tv : NULL);
    } else {
        conn_bulk_write_end(c); /* what was queued behind it: the bufferevent writes it */
    }
    conn_drive(c);
}

/* The socket takes more of the write job's frame (or, closing, the client did not read it in
 * time). */
static void conn_writable_cb(evutil_socket_t fd, short what, void *arg)
{
    epd_conn_t *c = arg;

    if (what & EV_TIMEOUT) {
        epd_log_warn("conn %" PRIu64 " (pid %ld): did not read its answers within %d s; closing",
                     c->id, (long)c->pid, CONN_FLUSH_TIMEOUT_S);
        conn_set_state(c, CONN_CLOSED);
        conn_drive(c);
        return;
    }
    c->wjob_busy = true;
    epd_bulk_submit(c->ctx->bulk, &c->wjob);
}

/* A RESULT whose y is at least socket.io_offload_bytes, with nothing ahead of it in the output,
 * is written by the pool while the loop goes on; the output is held back until the job is back.
 * Takes out's head and result when it returns true. */
static bool conn_bulk_write(epd_conn_t *c, epd_frame_out_t *out, epd_result_t *result)
{
    const epd_conn_ctx_t *ctx = c->ctx;

    if (ctx->bulk == NULL || c->bulk_writing || c->state == CONN_CLOSED || out->n_parts != 1 ||
        out->part_len[0] < ctx->cfg->socket.io_offload_bytes || conn_output_len(c) != 0)
        return false;
    if (c->wev == NULL) {
        c->wev = event_new(ctx->base, c->fd, EV_WRITE, conn_writable_cb, c);
        if (c->wev == NULL) return false;
    }
    epd_bulk_job_t *job = &c->wjob;
    job->kind = EPD_BULK_WRITE;
    job->fd = c->fd;
    job->iov[0] = (struct iovec){.iov_base = out->head, .iov_len = out->head_len};
    job->iov[1] = (struct iovec){.iov_base = (void *)out->part[0], .iov_len = out->part_len[0]};
    job->n_iov = 2;
    job->done = conn_bulk_write_done;
    job->arg = c;
    c->bulk_head = out->head;
    c->bulk_result = result;
    out->head = NULL;
    uint64_t total = out->head_len + out->part_len[0];
    c->bulk_out_left = total;
    c->out_queued += total;
    ctx->stats->bytes_out += total;
    c->bulk_writing = true;
    c->wjob_busy = true;
    bufferevent_disable(c->bev, EV_WRITE);
    epd_frame_out_free(out);
    epd_bulk_submit(ctx->bulk, job);
    return true;
}

void epd_conn_deliver(epd_conn_t *c, epd_result_t *result)
{
    const epd_config_t *cfg = c->ctx->cfg;
    char err[EPD_ERR_LEN];

    if (c->in_flight > 0) c->in_flight--;
    if (c->state == CONN_CLOSED) {
        c->ctx->stats->results_discarded++;
        epd_result_free(result);
        conn_drive(c);
        return;
    }
    c->active_ns = epd_now_ns();
    if (result->status != EPD_OK) {
        epd_conn_send_error(c, true, result->id, result->status, result->message);
        conn_answer_queued(c, false);
        epd_result_free(result);
    } else {
        epd_frame_out_t out;
        epd_status_t status =
            result->y_in_region
                ? epd_frame_encode_result_region(result->id, result->step, result->n_tokens,
                                                 cfg->model.hidden, result->y_region,
                                                 result->y_offset, &out, err)
                : epd_frame_encode_result(result->id, result->step, result->n_tokens,
                                          cfg->model.hidden, result->y, &out, err);
        if (status != EPD_OK) {
            epd_conn_send_error(c, true, result->id, EPD_ERR_INTERNAL, err);
            conn_answer_queued(c, false);
            epd_result_free(result);
        } else {
            /* nothing ahead of it: written now rather than on the loop's next turn (a write
             * event and its epoll round); what the socket does not take the bufferevent writes
             * later */
            if (!conn_bulk_write(c, &out, result))
                epd_conn_send_frame(c, &out, result_release, result);
            conn_answer_queued(c, true);
        }
    }
    /* written whole at once: the output never held it, so it counts as sent here */
    (void)conn_answers_settle(c, false);
    /* Pauses reads if the client is now too far behind (or frees c if queueing failed). */
    conn_drive(c);
}

pid_t epd_conn_pid(const epd_conn_t *c)
{
    return c->pid;
}

epd_status_t epd_conn_send_text(epd_conn_t *c, epd_frame_type_t type, const char *meta_json)
{
    epd_frame_out_t out;
    char err[EPD_ERR_LEN];

    if (conn_closing(c)) return EPD_ERR_IO;
    if (epd_frame_encode_text(type, meta_json, &out, err) != EPD_OK) {
        epd_log_error("conn %" PRIu64 ": cannot encode a %s frame: %s", c->id,
                      epd_frame_type_name((int)type), err);
        return EPD_ERR_INTERNAL;
    }
    /* Latency: written now rather than on the loop's next turn (the bufferevent writes the
     * rest, if any). Only when nothing else was queued, so the stream's order stays as queued. */
    epd_conn_send_frame(c, &out, NULL, NULL);
    if (c->state == CONN_CLOSED) {
        conn_drive(c);
        return EPD_ERR_IO;
    }
    c->active_ns = epd_now_ns();
    return EPD_OK;
}

void epd_conn_shutdown(epd_conn_t *c)
{
    if (!conn_closing(c)) {
        c->answer_input = true;
        conn_set_state(c, CONN_CLOSING);
    }
    conn_drive(c);
}

void epd_conn_abort(epd_conn_t *c)
{
    if (c->state != CONN_CLOSED) conn_set_state(c, CONN_CLOSED);
    conn_drive(c);
}
