/* Unit tests of daemon/conn.c: one connection over a socketpair on a real event loop, with the
 * engine replaced by a stub (epd_engine_submit refuses, as an engine that is shutting down does).
 * They guard issue 20's connection items: the budget of all connections together
 * (socket.max_buffered_bytes), the idle and frame timeouts, the drain answering what was already
 * read, and answers thrown away at a close counted as discarded, not sent. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <event2/event.h>

#include "common/clock.h"
#include "daemon/bulk.h"
#include "daemon/conn.h"
#include "daemon/log.h"
#include "daemon/pinned.h"

#define HIDDEN 128
#define TOPK 2
#define EXPERTS 4

/* ---- the engine, stubbed ---- */

static epd_status_t stub_submit_status = EPD_ERR_SHUTTING_DOWN;

/* With stub_keep set, accepted requests are kept here (EPD_OK) for the test to look at. */
#define STUB_KEPT_MAX 16
static bool stub_keep;
static epd_request_t *stub_kept[STUB_KEPT_MAX];
static int stub_n_kept;

epd_status_t epd_engine_submit(epd_engine_t *engine, epd_request_t *req)
{
    (void)engine;
    if (stub_keep && stub_n_kept < STUB_KEPT_MAX) {
        stub_kept[stub_n_kept++] = req;
        return EPD_OK;
    }
    return stub_submit_status;
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
    if (req->storage_release != NULL)
        req->storage_release(req->storage);
    else
        free(req->storage);
    free(req);
}

/* No pool: payloads come from malloc, through the pool's headers all the same. */
epd_pinned_pool_t *epd_engine_pinned(epd_engine_t *engine)
{
    (void)engine;
    return NULL;
}

/* Never hot: a streaming payload read may spin (conn_read_payload). */
bool epd_engine_hot(epd_engine_t *engine)
{
    (void)engine;
    return false;
}

/* No device: ops with no entries (a host region is mapped, not page-locked). */
void epd_engine_ops(epd_engine_t *engine, const epd_ops_t **ops_p, epd_ops_ctx_t **ops_ctx_p)
{
    static const epd_ops_t no_ops;
    (void)engine;
    *ops_p = &no_ops;
    *ops_ctx_p = NULL;
}

/* ---- a connection on a socketpair ---- */

typedef struct {
    struct event_base *base;
    epd_config_t cfg;
    epd_submit_limits_t limits;
    epd_server_stats_t stats;
    epd_conn_ctx_t ctx;
    int closed;
} fixture_t;

/* Every test runs twice: all I/O on the loop thread, then every payload (socket.io_offload_bytes
 * 1) and every RESULT copied by this many socket copy threads (daemon/bulk.h). */
static unsigned fx_io_threads;

static epd_status_t fx_control(void *arg, const char *op, char **meta_p, char **payload_p,
                               size_t *payload_len_p, char err[EPD_ERR_LEN])
{
    (void)arg;
    (void)op;
    (void)err;
    *meta_p = strdup("{\"status\":\"ok\"}");
    *payload_p = NULL;
    *payload_len_p = 0;
    return EPD_OK;
}

static void fx_accepted(void *arg)
{
    (void)arg;
}

static void fx_closed(void *arg, epd_conn_t *conn)
{
    (void)conn;
    ((fixture_t *)arg)->closed++;
}

static fixture_t *fx_new(void)
{
    fixture_t *fx = calloc(1, sizeof(*fx));
    assert_non_null(fx);
    fx->base = event_base_new();
    assert_non_null(fx->base);
    fx->cfg.socket.max_frame_bytes = 1u << 20;
    fx->cfg.socket.max_output_bytes = 65536;
    fx->cfg.socket.max_buffered_bytes = 1u << 30;
    fx->cfg.model.hidden = HIDDEN;
    fx->cfg.model.topk = TOPK;
    fx->cfg.model.num_experts = EXPERTS;
    fx->limits = (epd_submit_limits_t){.hidden = HIDDEN, .topk = TOPK, .num_experts = EXPERTS,
                                       .max_tokens = 4096};
    fx->ctx = (epd_conn_ctx_t){.cfg = &fx->cfg, .limits = &fx->limits, .base = fx->base,
                               .stats = &fx->stats, .arg = fx, .request_accepted = fx_accepted,
                               .control = fx_control, .closed = fx_closed};
    stub_submit_status = EPD_ERR_SHUTTING_DOWN;
    stub_keep = false;
    stub_n_kept = 0;
    if (fx_io_threads > 0) {
        char err[EPD_ERR_LEN];
        fx->cfg.socket.io_threads = fx_io_threads;
        fx->cfg.socket.io_offload_bytes = 1;
        assert_int_equal(epd_bulk_create(fx->base, fx_io_threads, 500, &fx->ctx.bulk, err),
                         EPD_OK);
    }
    return fx;
}

static void fx_free(fixture_t *fx)
{
    epd_bulk_free(fx->ctx.bulk);
    event_base_free(fx->base);
    free(fx);
}

static int last_conn_fd; /* the daemon's end of the latest fx_conn */

/* A connection whose peer end is returned in *peer_p (non-blocking). */
static epd_conn_t *fx_conn(fixture_t *fx, uint64_t id, int *peer_p)
{
    int sv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv), 0);
    epd_conn_t *c = epd_conn_create(&fx->ctx, sv[0], id, getuid(), getpid());
    assert_non_null(c);
    last_conn_fd = sv[0];
    *peer_p = sv[1];
    return c;
}

/* Runs the loop for about ms milliseconds (or until fx->closed reaches until_closed). */
static void fx_run(fixture_t *fx, int ms, int until_closed)
{
    uint64_t end = epd_now_ns() + (uint64_t)ms * 1000000u;
    while (epd_now_ns() < end && fx->closed < until_closed) {
        struct timeval tv = {0, 5000};
        event_base_loopexit(fx->base, &tv);
        event_base_dispatch(fx->base);
    }
}

static void send_all(int fd, const void *buf, size_t len)
{
    const uint8_t *p = buf;
    while (len > 0) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
            struct pollfd pfd = {.fd = fd, .events = POLLOUT};
            poll(&pfd, 1, 100);
            continue;
        }
        assert_true(n > 0);
        p += n;
        len -= (size_t)n;
    }
}

/* The value of x[i] in the SUBMITs of submit_bytes: finite bf16, different for each id. */
static uint16_t x_value(uint64_t id, size_t i)
{
    return (uint16_t)(0x3c00 + (id * 131 + i * 7) % 0x0800);
}

/* The bytes of one SUBMIT of n tokens (malloc'ed, *len_p set). */
static uint8_t *submit_bytes(uint64_t id, uint32_t n, size_t *len_p)
{
    uint16_t *x = calloc((size_t)n * HIDDEN, 2);
    int32_t *ids = calloc((size_t)n * TOPK, sizeof(int32_t));
    float *w = calloc((size_t)n * TOPK, sizeof(float));
    epd_frame_out_t out;
    char err[EPD_ERR_LEN];
    uint8_t *buf;

    for (size_t i = 0; i < (size_t)n * HIDDEN; i++) x[i] = x_value(id, i);
    for (size_t t = 0; t < n; t++)
        for (size_t k = 0; k < TOPK; k++) {
            ids[t * TOPK + k] = (int32_t)((t + k) % EXPERTS);
            w[t * TOPK + k] = 0.5f + (float)k;
        }
    assert_int_equal(epd_frame_encode_submit(id, n, HIDDEN, TOPK, x, ids, w, &out, err), EPD_OK);
    assert_int_equal(epd_frame_out_flatten(&out, &buf, len_p, err), EPD_OK);
    epd_frame_out_free(&out);
    free(x);
    free(ids);
    free(w);
    return buf;
}

/* Reads every frame available on fd within ms (until EOF when to_eof); counts them by type and
 * ERROR code into the arrays (may be NULL); returns the number of frames. */
typedef struct {
    int frames;
    int by_type[8];
    int by_code[EPD_STATUS_MAX];
    uint64_t last_error_id;
    uint64_t next_result; /* the id the next RESULT should have (results 0, 1, 2, ... in order) */
    int results_out_of_order;
    int want; /* > 0: stop once this many frames were seen */
    bool eof;
} peer_seen_t;

/* Runs the loop until n results count as sent. With socket copy threads the peer can read a frame
 * before the loop has taken the write job back, and only then is the answer counted. */
static void fx_run_until_sent(fixture_t *fx, uint64_t n, int ms)
{
    uint64_t end = epd_now_ns() + (uint64_t)ms * 1000000u;
    while (fx->stats.results_sent < n && epd_now_ns() < end) fx_run(fx, 1, 1 << 30);
}

static void peer_read(fixture_t *fx, int fd, int ms, bool to_eof, peer_seen_t *seen)
{
    epd_decoder_t dec;
    uint8_t buf[65536];
    char err[EPD_ERR_LEN];
    uint64_t end = epd_now_ns() + (uint64_t)ms * 1000000u;

    epd_decoder_init(&dec, 1u << 30, EPD_FRAME_MAX_META);
    while (epd_now_ns() < end && (seen->want == 0 || seen->frames < seen->want)) {
        ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (n == 0) {
            seen->eof = true;
            break;
        }
        if (n < 0) {
            assert_true(errno == EAGAIN || errno == ECONNRESET);
            if (errno == ECONNRESET) {
                seen->eof = true;
                break;
            }
            if (fx != NULL) fx_run(fx, 5, 1 << 30);
            else usleep(2000);
            if (!to_eof && fx == NULL) break;
            continue;
        }
        size_t at = 0;
        while (at < (size_t)n) {
            size_t used = 0;
            epd_frame_t frame;
            epd_status_t status = epd_decoder_feed(&dec, buf + at, (size_t)n - at, &used, &frame,
                                                   err);
            at += used;
            if (status == EPD_ERR_AGAIN) continue;
            if (status != EPD_OK) fail_msg("peer: %s", err);
            seen->frames++;
            seen->by_type[frame.type & 7]++;
            if (frame.type == EPD_FRAME_RESULT) {
                if (frame.id != seen->next_result) seen->results_out_of_order++;
                seen->next_result = frame.id + 1;
            }
            if (frame.type == EPD_FRAME_ERROR) {
                const cJSON *code = cJSON_GetObjectItemCaseSensitive(frame.meta, "code");
                for (int c = 0; c < EPD_STATUS_MAX; c++)
                    if (cJSON_IsString(code) &&
                        strcmp(code->valuestring, epd_status_name((epd_status_t)c)) == 0)
                        seen->by_code[c]++;
                seen->last_error_id = frame.id;
            }
            epd_frame_free(&frame);
        }
    }
    epd_decoder_free(&dec);
}

/* ---- the tests ---- */

/* Issue 20 item 8: SUBMITs already read from a connection that closes for the shutdown are each
 * answered shutting_down (they used to be dropped with the unread input). The way it happens in a
 * drain: SUBMITs answered at once (shutting_down) fill the output of a client that does not read,
 * the connection pauses in the middle of a chunk it has read, and then the drain closes it. */
static void test_conn__shutdown_with_frames_read__answers_each_shutting_down(void **state)
{
    (void)state;
    fixture_t *fx = fx_new();
    int peer;
    epd_conn_t *c = fx_conn(fx, 1, &peer);
    enum { FRAMES = 7 }; /* all in libevent's first 4 KB read */
    size_t len = 0, total = 0, filled = 0;
    uint8_t *all = NULL, junk[4096];

    /* the socket towards the client is full, and any unsent byte pauses reading */
    fx->cfg.socket.max_output_bytes = 0;
    memset(junk, 0, sizeof(junk));
    for (;;) {
        ssize_t n = send(last_conn_fd, junk, sizeof(junk), MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n <= 0) break;
        filled += (size_t)n;
    }
    for (;;) {
        ssize_t n = send(last_conn_fd, junk, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n <= 0) break;
        filled += (size_t)n;
    }

    for (int i = 0; i < FRAMES; i++) {
        uint8_t *one = submit_bytes((uint64_t)i + 100, 1, &len);
        all = realloc(all, total + len);
        memcpy(all + total, one, len);
        total += len;
        free(one);
    }
    assert_true(total <= 4096);
    send_all(peer, all, total);
    free(all);
    /* the connection reads the chunk, answers the first SUBMIT, and pauses with the rest read */
    fx_run(fx, 100, 1);
    assert_int_equal(fx->stats.frames_in, 1);
    epd_conn_shutdown(c);
    /* the client reads now: first the bytes that filled the socket */
    while (filled > 0) {
        ssize_t n = recv(peer, junk, filled < sizeof(junk) ? filled : sizeof(junk), 0);
        if (n < 0 && errno == EAGAIN) {
            fx_run(fx, 5, 1 << 30);
            continue;
        }
        assert_true(n > 0);
        filled -= (size_t)n;
    }
    peer_seen_t seen = {0};
    peer_read(fx, peer, 2000, true, &seen);
    fx_run(fx, 50, 1);
    assert_true(seen.eof);
    assert_int_equal(fx->closed, 1);
    assert_int_equal(seen.by_code[EPD_ERR_SHUTTING_DOWN], FRAMES);
    assert_int_equal(fx->stats.frames_in, FRAMES);
    close(peer);
    fx_free(fx);
}

/* A RESULT of tokens rows of zeros for request id on connection 1. */
static epd_result_t *result_new(uint64_t id, uint32_t tokens)
{
    epd_result_t *r = calloc(1, sizeof(*r));
    assert_non_null(r);
    r->id = id;
    r->conn_id = 1;
    r->n_tokens = tokens;
    r->y = epd_pinned_alloc(NULL, (size_t)tokens * HIDDEN * 2);
    assert_non_null(r->y);
    memset(r->y, 0, (size_t)tokens * HIDDEN * 2);
    r->status = EPD_OK;
    return r;
}

/* Issue 20 item 10: answers still unwritten when a connection is closed at once (the drain's
 * flush timeout) are counted discarded; only those written whole count as sent. */
static void test_conn__results_unwritten_at_abort__counted_discarded_not_sent(void **state)
{
    (void)state;
    fixture_t *fx = fx_new();
    int peer;
    epd_conn_t *c = fx_conn(fx, 1, &peer);
    enum { RESULTS = 100, TOKENS = 64 };
    int small = 4096;

    setsockopt(peer, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
    for (int i = 0; i < RESULTS; i++) epd_conn_deliver(c, result_new((uint64_t)i, TOKENS));
    fx_run(fx, 100, 1); /* writes what the socket takes */
    assert_true(fx->stats.results_sent < RESULTS);
    epd_conn_abort(c);
    assert_int_equal(fx->closed, 1);
    peer_seen_t seen = {0};
    peer_read(fx, peer, 2000, true, &seen);
    assert_true(seen.eof);
    assert_int_equal(fx->stats.results_sent, (uint64_t)seen.by_type[EPD_FRAME_RESULT]);
    assert_int_equal(fx->stats.results_sent + fx->stats.results_discarded, RESULTS);
    assert_true(fx->stats.results_discarded > 0);
    close(peer);
    fx_free(fx);
}

/* Issue 25: an answer with nothing ahead of it is on the socket when deliver returns, not on
 * the loop's next turn (libevent does not let evbuffer_write drain a bufferevent's output: the
 * daemon's "write now" had been writing nothing), and counts as sent; the write jobs of socket
 * copy threads write it from their thread, so there it comes once the loop runs. */
static void test_conn__result_with_nothing_ahead__on_the_socket_at_once(void **state)
{
    (void)state;
    fixture_t *fx = fx_new();
    int peer;
    epd_conn_t *c = fx_conn(fx, 1, &peer);

    epd_conn_deliver(c, result_new(0, 1));
    peer_seen_t seen = {0};
    if (fx_io_threads == 0) {
        peer_read(NULL, peer, 100, false, &seen); /* what is there now: no loop turn */
        assert_int_equal(seen.by_type[EPD_FRAME_RESULT], 1);
        assert_int_equal(fx->stats.results_sent, 1);
    }
    seen.want = 1;
    if (seen.frames == 0) peer_read(fx, peer, 5000, false, &seen);
    assert_int_equal(seen.by_type[EPD_FRAME_RESULT], 1);
    fx_run_until_sent(fx, 1, 5000);
    assert_int_equal(fx->stats.results_sent, 1);
    close(peer);
    fx_run(fx, 1000, 1);
    assert_int_equal(fx->closed, 1);
    fx_free(fx);
}

/* A connection closed at once while its write job is done on the pool but not yet back on the
 * loop: the frame reached the client, so it counts sent, not discarded (the answers are counted
 * once the job is back). Without socket copy threads it is written in deliver and counted there. */
static void test_conn__write_job_not_back_at_abort__its_frame_counted_sent(void **state)
{
    (void)state;
    fixture_t *fx = fx_new();
    int peer;
    epd_conn_t *c = fx_conn(fx, 1, &peer);

    epd_conn_deliver(c, result_new(7, 16));
    peer_seen_t seen = {.want = 1};
    uint64_t end = epd_now_ns() + 5000000000u;
    while (seen.frames == 0 && epd_now_ns() < end) /* no loop turn: the job stays out */
        peer_read(NULL, peer, 100, false, &seen);
    assert_int_equal(seen.by_type[EPD_FRAME_RESULT], 1);
    epd_conn_abort(c);
    assert_int_equal(fx->closed, 1);
    fx_run(fx, 200, 1 << 30); /* the job comes back, the connection is freed */
    assert_int_equal(fx->stats.results_sent, 1);
    assert_int_equal(fx->stats.results_discarded, 0);
    close(peer);
    fx_free(fx);
}

/* Issue 25: answers delivered faster than the peer reads (the socket full, part of a frame
 * written at once and the rest queued) reach it whole, once each and in order. */
static void test_conn__results_past_the_socket_buffer__whole_and_in_order(void **state)
{
    (void)state;
    fixture_t *fx = fx_new();
    int peer;
    epd_conn_t *c = fx_conn(fx, 1, &peer);
    enum { RESULTS = 40, TOKENS = 64 }; /* 16 KB each, 640 KB in all */
    int small = 4096;

    fx->cfg.socket.max_output_bytes = 1u << 30;
    setsockopt(peer, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
    setsockopt(last_conn_fd, SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
    for (int i = 0; i < RESULTS; i++) epd_conn_deliver(c, result_new((uint64_t)i, TOKENS));
    peer_seen_t seen = {.want = RESULTS};
    peer_read(fx, peer, 5000, false, &seen);
    assert_int_equal(seen.by_type[EPD_FRAME_RESULT], RESULTS);
    assert_int_equal(seen.results_out_of_order, 0);
    fx_run_until_sent(fx, RESULTS, 5000);
    assert_int_equal(fx->stats.results_sent, RESULTS);
    close(peer);
    fx_run(fx, 1000, 1);
    assert_int_equal(fx->closed, 1);
    fx_free(fx);
}

/* Issue 20 item 3: a frame whose payload would take all connections together over
 * socket.max_buffered_bytes is read, thrown away and answered busy with its id; the connection
 * stays open, and once the budget is back the same frame is taken. */
static void test_conn__frame_over_buffer_budget__answered_busy_and_conn_stays(void **state)
{
    (void)state;
    fixture_t *fx = fx_new();
    int peer_a, peer_b;
    epd_conn_t *a = fx_conn(fx, 1, &peer_a);
    epd_conn_t *b = fx_conn(fx, 2, &peer_b);
    size_t len_a, len_b;
    uint8_t *frame_a = submit_bytes(7, 220, &len_a);
    uint8_t *frame_b = submit_bytes(8, 220, &len_b);

    (void)a;
    (void)b;
    fx->cfg.socket.max_buffered_bytes = 100000; /* one 60 KB payload fits, two do not */
    send_all(peer_a, frame_a, len_a / 2); /* A holds its reservation, half sent */
    fx_run(fx, 50, 1);
    assert_true(fx->stats.buffered_bytes > 50000);
    send_all(peer_b, frame_b, len_b);
    peer_seen_t seen = {0};
    peer_read(fx, peer_b, 300, false, &seen);
    assert_int_equal(seen.by_code[EPD_ERR_BUSY], 1);
    assert_int_equal(seen.last_error_id, 8);
    assert_false(seen.eof);

    /* A completes: the budget is free again, and B's frame now reaches the engine */
    send_all(peer_a, frame_a + len_a / 2, len_a - len_a / 2);
    fx_run(fx, 50, 1);
    assert_int_equal(fx->stats.buffered_bytes, 0);
    send_all(peer_b, frame_b, len_b);
    memset(&seen, 0, sizeof(seen));
    peer_read(fx, peer_b, 300, false, &seen);
    assert_int_equal(seen.by_code[EPD_ERR_BUSY], 0);
    assert_int_equal(seen.by_code[EPD_ERR_SHUTTING_DOWN], 1); /* the stub engine's answer */
    assert_int_equal(fx->stats.buffered_bytes, 0);
    assert_int_equal(fx->closed, 0);
    free(frame_a);
    free(frame_b);
    close(peer_a);
    close(peer_b);
    fx_run(fx, 100, 2);
    assert_int_equal(fx->closed, 2);
    fx_free(fx);
}

/* Issue 20 item 4: a connection with nothing in flight and no bytes for socket.idle_timeout_ms
 * is closed and counted; one that keeps talking is not. */
static void test_conn__idle_past_idle_timeout__closed_and_counted(void **state)
{
    (void)state;
    fixture_t *fx = fx_new();
    int idle_peer, busy_peer;
    epd_frame_out_t out;
    char err[EPD_ERR_LEN];
    uint8_t *health;
    size_t health_len;

    fx->cfg.socket.idle_timeout_ms = 600; /* six times the busy client's pace */
    (void)fx_conn(fx, 1, &idle_peer);
    (void)fx_conn(fx, 2, &busy_peer);
    assert_int_equal(epd_frame_encode_control("health", &out, err), EPD_OK);
    assert_int_equal(epd_frame_out_flatten(&out, &health, &health_len, err), EPD_OK);
    epd_frame_out_free(&out);
    for (int i = 0; i < 15; i++) { /* 1.5 s, a health query every 100 ms on the busy one */
        send_all(busy_peer, health, health_len);
        fx_run(fx, 100, 2);
        peer_seen_t seen = {0};
        peer_read(NULL, busy_peer, 0, false, &seen);
    }
    assert_int_equal(fx->closed, 1);
    assert_int_equal(fx->stats.closed_idle, 1);
    peer_seen_t seen = {0};
    peer_read(NULL, idle_peer, 500, true, &seen);
    assert_true(seen.eof);
    free(health);
    close(idle_peer);
    close(busy_peer);
    fx_run(fx, 100, 2);
    fx_free(fx);
}

/* Issue 20 item 4: a frame not complete socket.frame_timeout_ms after its first byte closes the
 * connection (slowloris: a byte every 50 ms never counts as progress), counted. */
static void test_conn__frame_incomplete_past_frame_timeout__closed_and_counted(void **state)
{
    (void)state;
    fixture_t *fx = fx_new();
    int peer;
    size_t len;
    uint8_t *frame = submit_bytes(1, 4, &len);

    fx->cfg.socket.frame_timeout_ms = 300;
    fx->cfg.socket.idle_timeout_ms = 0;
    (void)fx_conn(fx, 1, &peer);
    uint64_t start = epd_now_ns();
    for (size_t i = 0; i < len - 1 && fx->closed == 0 &&
                       epd_now_ns() - start < UINT64_C(3000000000); i++) {
        if (send(peer, frame + i, 1, MSG_NOSIGNAL) != 1) break;
        fx_run(fx, 50, 1);
    }
    uint64_t took_ms = (epd_now_ns() - start) / 1000000u;
    assert_int_equal(fx->closed, 1);
    assert_int_equal(fx->stats.closed_frame_timeout, 1);
    assert_true(took_ms >= 250 && took_ms < 3000);
    free(frame);
    close(peer);
    fx_free(fx);
}

/* A loop that did not run past a connection's deadline (the process stopped or starved, as by
 * SIGSTOP) does not close it before reading what the client sent meanwhile: a frame completed
 * then is not timed out. Moved on only by the timer's lateness, both deadlines expired anyway
 * (the whole window had passed by them), and the soak saw good clients reset after a rank's
 * SIGSTOP. The idle one is still closed, soon after (CONN_LATE_NS). */
static void test_conn__loop_stopped_past_deadlines__reads_before_judging(void **state)
{
    (void)state;
    fixture_t *fx = fx_new();
    int frame_peer, idle_peer;
    size_t len;
    uint8_t *frame = submit_bytes(1, 4, &len);

    fx->cfg.socket.frame_timeout_ms = 300;
    fx->cfg.socket.idle_timeout_ms = 300;
    (void)fx_conn(fx, 1, &frame_peer);
    (void)fx_conn(fx, 2, &idle_peer);
    send_all(frame_peer, frame, len / 2);
    fx_run(fx, 50, 1); /* the first half read: the frame's clock runs */
    usleep(1000 * 1000); /* the loop stopped past both deadlines, by more than CONN_LATE_NS */
    fx_run(fx, 50, 1);   /* the late timers fire before the rest of the frame comes */
    assert_int_equal(fx->closed, 0);
    send_all(frame_peer, frame + len / 2, len - len / 2);
    fx_run(fx, 100, 1);
    assert_int_equal(fx->closed, 0);
    assert_int_equal(fx->stats.closed_frame_timeout, 0);
    assert_int_equal(fx->stats.closed_idle, 0);
    fx_run(fx, 1000, 2); /* the idle one, still idle, goes */
    assert_true(fx->stats.closed_idle >= 1);
    peer_seen_t seen = {0};
    peer_read(NULL, idle_peer, 500, true, &seen);
    assert_true(seen.eof);
    free(frame);
    close(frame_peer);
    close(idle_peer);
    fx_run(fx, 100, 2);
    fx_free(fx);
}

/* ---- payloads read straight into their buffer (issue 25) ---- */

/* Sends buf[len] in chunks of random size (as much of each as the socket takes), running the
 * loop between them, so the connection sees every kind of split. */
static void pump(fixture_t *fx, int fd, const uint8_t *buf, size_t len, uint32_t *rng)
{
    uint64_t end = epd_now_ns() + UINT64_C(20000000000);
    while (len > 0) {
        assert_true(epd_now_ns() < end);
        *rng = *rng * 1664525u + 1013904223u;
        size_t chunk = 1 + (*rng >> 8) % (*rng & 1 ? 300000u : 2000u);
        if (chunk > len) chunk = len;
        ssize_t n = send(fd, buf, chunk, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n < 0) {
            assert_true(errno == EAGAIN || errno == EINTR);
            n = 0;
        }
        buf += n;
        len -= (size_t)n;
        fx_run(fx, 1, 1 << 30);
    }
}

/* Runs the loop until the connection has taken `bytes` bytes (or ms pass). */
static void fx_run_until_read(fixture_t *fx, uint64_t bytes, int ms)
{
    uint64_t end = epd_now_ns() + (uint64_t)ms * 1000000u;
    while (fx->stats.bytes_in < bytes && epd_now_ns() < end) fx_run(fx, 1, 1 << 30);
}

static void assert_kept_request(const epd_request_t *req, uint64_t id, uint32_t n)
{
    assert_non_null(req);
    assert_true(req->id == id);
    assert_int_equal(req->n_tokens, n);
    for (size_t i = 0; i < (size_t)n * HIDDEN; i++)
        if (req->x[i] != x_value(id, i)) fail_msg("request %d: x[%zu] differs", (int)id, i);
    for (size_t t = 0; t < n; t++)
        for (size_t k = 0; k < TOPK; k++) {
            assert_int_equal(req->topk_ids[t * TOPK + k], (int32_t)((t + k) % EXPERTS));
            assert_true(req->topk_weights[t * TOPK + k] == 0.5f + (float)k);
        }
}

static void stub_kept_free(void)
{
    for (int i = 0; i < stub_n_kept; i++) {
        free(stub_kept[i]->owned);
        epd_request_free(stub_kept[i]);
    }
    stub_n_kept = 0;
}

/* Pipelined SUBMITs of a few bytes to 6 MB (above the whole-at-once cap: a buffer that grows
 * while it is read) and a CONTROL between them, sent in random splits: every request reaches the
 * engine with exactly the bytes sent, every byte is counted in bytes_in, the CONTROL is answered
 * and the budget of unfinished frames is back to zero. */
static void test_conn__large_payloads_in_random_splits__reach_the_engine_exact(void **state)
{
    (void)state;
    fixture_t *fx = fx_new();
    static const uint32_t tokens[] = {1, 8000, 0, 24000, 3};
    enum { FRAMES = sizeof(tokens) / sizeof(tokens[0]) };
    uint8_t *stream = NULL;
    size_t total = 0;
    uint32_t rng = 12345;
    int peer;

    fx->cfg.socket.max_frame_bytes = 32u << 20;
    fx->limits.max_tokens = 40000;
    stub_keep = true;
    (void)fx_conn(fx, 1, &peer);
    for (int i = 0; i < FRAMES; i++) {
        size_t len;
        uint8_t *one;
        if (tokens[i] == 0) {
            epd_frame_out_t out;
            char err[EPD_ERR_LEN];
            assert_int_equal(epd_frame_encode_control("health", &out, err), EPD_OK);
            assert_int_equal(epd_frame_out_flatten(&out, &one, &len, err), EPD_OK);
            epd_frame_out_free(&out);
        } else {
            one = submit_bytes((uint64_t)i + 1, tokens[i], &len);
        }
        stream = realloc(stream, total + len);
        assert_non_null(stream);
        memcpy(stream + total, one, len);
        total += len;
        free(one);
    }
    pump(fx, peer, stream, total, &rng);
    fx_run_until_read(fx, total, 10000);
    peer_seen_t seen = {0};
    peer_read(fx, peer, 200, false, &seen);
    assert_int_equal(seen.by_type[EPD_FRAME_REPLY], 1);
    assert_int_equal(seen.by_type[EPD_FRAME_ERROR], 0);
    assert_int_equal(fx->stats.frames_in, FRAMES);
    assert_true(fx->stats.bytes_in == total);
    assert_int_equal(fx->stats.buffered_bytes, 0);
    assert_int_equal(stub_n_kept, FRAMES - 1);
    for (int i = 0, k = 0; i < FRAMES; i++)
        if (tokens[i] != 0) assert_kept_request(stub_kept[k++], (uint64_t)i + 1, tokens[i]);
    stub_kept_free();
    free(stream);
    close(peer);
    fx_run(fx, 200, 1);
    assert_int_equal(fx->closed, 1);
    fx_free(fx);
}

/* A file descriptor may ride on any byte (DESIGN.md section 4b): one sent with a byte in the
 * middle of a payload, while the connection reads that payload straight into its buffer, is kept
 * for the next register; a register with none left is bad_region. */
static void test_conn__fd_on_a_payload_byte__kept_for_the_next_register(void **state)
{
    (void)state;
    fixture_t *fx = fx_new();
    size_t len, reg_len;
    uint8_t *frame = submit_bytes(5, 2000, &len); /* a 512 KB payload */
    uint8_t *reg;
    uint32_t rng = 99;
    epd_frame_out_t out;
    char err[EPD_ERR_LEN];
    int peer;

    fx->cfg.socket.max_regions = 4;
    stub_keep = true;
    (void)fx_conn(fx, 1, &peer);
    assert_int_equal(epd_frame_encode_text(EPD_FRAME_CONTROL,
                                           "{\"op\":\"register\",\"kind\":\"host\",\"bytes\":4096}",
                                           &out, err), EPD_OK);
    assert_int_equal(epd_frame_out_flatten(&out, &reg, &reg_len, err), EPD_OK);
    epd_frame_out_free(&out);
    int memfd = memfd_create("test_conn", MFD_CLOEXEC);
    assert_true(memfd >= 0);
    assert_int_equal(ftruncate(memfd, 4096), 0);

    /* the header, the meta and part of the payload, all read: the payload is being collected */
    size_t first = len / 3;
    pump(fx, peer, frame, first, &rng);
    fx_run_until_read(fx, first, 5000);
    assert_true(fx->stats.bytes_in == first);
    /* 1000 payload bytes with the descriptor */
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } control;
    memset(&control, 0, sizeof control);
    struct iovec iov = {.iov_base = frame + first, .iov_len = 1000};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                         .msg_controllen = sizeof control.buf};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &memfd, sizeof(int));
    assert_int_equal(sendmsg(peer, &msg, MSG_NOSIGNAL), 1000);
    close(memfd);
    fx_run_until_read(fx, first + 1000, 5000);
    pump(fx, peer, frame + first + 1000, len - first - 1000, &rng);
    pump(fx, peer, reg, reg_len, &rng); /* takes the descriptor */
    pump(fx, peer, reg, reg_len, &rng); /* none left */
    fx_run_until_read(fx, len + 2 * reg_len, 5000);
    peer_seen_t seen = {0};
    peer_read(fx, peer, 200, false, &seen);
    assert_int_equal(seen.by_type[EPD_FRAME_REPLY], 1);
    assert_int_equal(seen.by_type[EPD_FRAME_ERROR], 1);
    assert_int_equal(seen.by_code[EPD_ERR_BAD_REGION], 1);
    assert_int_equal(stub_n_kept, 1);
    assert_kept_request(stub_kept[0], 5, 2000);
    stub_kept_free();
    free(frame);
    free(reg);
    close(peer);
    fx_run(fx, 200, 1);
    assert_int_equal(fx->closed, 1);
    fx_free(fx);
}

/* A peer that closes in the middle of a payload being read into its buffer: the connection
 * closes, the partial payload and its share of socket.max_buffered_bytes are given back, and
 * nothing reaches the engine. */
static void test_conn__peer_closes_in_a_payload__closed_and_budget_released(void **state)
{
    (void)state;
    fixture_t *fx = fx_new();
    size_t len;
    uint8_t *frame = submit_bytes(6, 8000, &len); /* a 2 MB payload */
    uint32_t rng = 7;
    int peer;

    fx->cfg.socket.max_frame_bytes = 4u << 20;
    fx->limits.max_tokens = 8000;
    stub_keep = true;
    (void)fx_conn(fx, 1, &peer);
    pump(fx, peer, frame, len / 2, &rng);
    fx_run_until_read(fx, len / 2, 5000);
    assert_true(fx->stats.bytes_in == len / 2);
    assert_true(fx->stats.buffered_bytes > len / 2);
    close(peer);
    fx_run(fx, 1000, 1);
    assert_int_equal(fx->closed, 1);
    assert_int_equal(fx->stats.buffered_bytes, 0);
    assert_int_equal(fx->stats.frames_in, 0);
    assert_int_equal(stub_n_kept, 0);
    free(frame);
    fx_free(fx);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_conn__shutdown_with_frames_read__answers_each_shutting_down),
        cmocka_unit_test(test_conn__results_unwritten_at_abort__counted_discarded_not_sent),
        cmocka_unit_test(test_conn__result_with_nothing_ahead__on_the_socket_at_once),
        cmocka_unit_test(test_conn__write_job_not_back_at_abort__its_frame_counted_sent),
        cmocka_unit_test(test_conn__results_past_the_socket_buffer__whole_and_in_order),
        cmocka_unit_test(test_conn__frame_over_buffer_budget__answered_busy_and_conn_stays),
        cmocka_unit_test(test_conn__idle_past_idle_timeout__closed_and_counted),
        cmocka_unit_test(test_conn__frame_incomplete_past_frame_timeout__closed_and_counted),
        cmocka_unit_test(test_conn__loop_stopped_past_deadlines__reads_before_judging),
        cmocka_unit_test(test_conn__large_payloads_in_random_splits__reach_the_engine_exact),
        cmocka_unit_test(test_conn__fd_on_a_payload_byte__kept_for_the_next_register),
        cmocka_unit_test(test_conn__peer_closes_in_a_payload__closed_and_budget_released),
    };
    epd_log_init(-1, EPD_LOG_WARN);
    int failed = cmocka_run_group_tests_name("loop thread I/O", tests, NULL, NULL);
    fx_io_threads = 2;
    failed += cmocka_run_group_tests_name("socket copy threads", tests, NULL, NULL);
    return failed;
}
