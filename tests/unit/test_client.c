/* Unit tests of libepd against a tiny in-process fake daemon (a thread on a temporary Unix
 * socket that speaks protocol v1 with the real codec): blocking submit, pipelining with answers
 * out of order, error mapping, control queries, timeouts, connection failures. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "proto/epd.h"
#include "proto/frame.h"

typedef enum {
    FAKE_ECHO,        /* answer each SUBMIT at once: y = x, step = id + 1000 */
    FAKE_REVERSE,     /* collect `batch` SUBMITs, answer them last first */
    FAKE_SILENT,      /* read everything, answer nothing */
    FAKE_FRAMING,     /* answer the first frame with ERROR id null bad_json, then close */
    FAKE_HANGUP,      /* on the first bytes: ERROR id null bad_magic, close with input unread */
    FAKE_EXPERTS,     /* answer serve_experts, send the EXPERTS of experts_cases, close after
                       * their EXPERTS_DONE (steps 1, 2, ... in order) */
} fake_mode_t;

/* EXPERTS metas with their counts written in several ways, and the counts the worker must see
 * (what the meta's tree says: numbers that are not non-negative integers count 0). */
#define EXPERTS_TENSORS                                                                      \
    "\"tensors\":{\"x\":{\"dtype\":\"bf16\",\"shape\":[1,64],\"region\":1,\"offset\":0},"      \
    "\"counts\":{\"dtype\":\"i32\",\"shape\":[3],\"region\":1,\"offset\":128},"                \
    "\"y\":{\"dtype\":\"bf16\",\"shape\":[1,64],\"region\":2,\"offset\":0}}"
#define EXPERTS_HEAD "\"layer\":3,\"first_expert\":8,\"input\":\"bf16\",\"layout\":\"packed\",\"rows\":1"
static const struct {
    const char *counts; /* NULL: 256 counts e * 7 % 1000 */
    bool counts_last;   /* after "tensors" (whose own "counts" tensor must not be taken) */
    uint32_t n;
    uint32_t want[6];
} experts_cases[] = {
    {"[3,0,12]", false, 3, {3, 0, 12}},
    {"[ 1 , 2 ,\n3\t]", false, 3, {1, 2, 3}},
    {"[]", false, 0, {0}},
    {"[4294967295,0]", true, 2, {4294967295u, 0}},
    {"[1.0,2.5,-1,1e1,7,\"x\"]", false, 6, {1, 2, 0, 10, 7, 0}},
    {NULL, false, 256, {0}},
};

typedef struct {
    fake_mode_t mode;
    int batch;
    epd_submit_limits_t limits;
    char path[108];
    int listen_fd;
    pthread_t thread;
} fake_t;

typedef struct pending {
    epd_frame_out_t out;
    epd_frame_t frame; /* keeps y alive until sent */
} pending_t;

/* The fake daemon runs on its own thread, where cmocka's asserts must not be used. */
#define FAKE_CHECK(cond)                                                           \
    do {                                                                           \
        if (!(cond)) {                                                             \
            fprintf(stderr, "fake daemon: %s failed at line %d\n", #cond, __LINE__); \
            abort();                                                               \
        }                                                                          \
    } while (0)

static int write_all(int fd, const void *buf, size_t len)
{
    const uint8_t *p = buf;
    while (len > 0) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static int send_out(int fd, epd_frame_out_t *out)
{
    int rc = write_all(fd, out->head, out->head_len);
    for (size_t i = 0; rc == 0 && i < out->n_parts; i++) {
        rc = write_all(fd, out->part[i], out->part_len[i]);
    }
    epd_frame_out_free(out);
    return rc;
}

/* The answer to one SUBMIT: RESULT y = x, or ERROR with the validation code. */
static void answer_submit(fake_t *f, epd_frame_t *frame, pending_t *p)
{
    epd_submit_view_t view;
    char err[EPD_ERR_LEN];
    epd_status_t status = epd_submit_validate(frame, &f->limits, &view, err);
    memset(p, 0, sizeof(*p));
    if (status != EPD_OK) {
        FAKE_CHECK(epd_frame_encode_error(frame->id_kind == EPD_FRAME_ID_VALID, frame->id,
                                          status, err, &p->out, err) == EPD_OK);
        epd_frame_free(frame);
        return;
    }
    FAKE_CHECK(epd_frame_encode_result(view.id, view.id + 1000, view.n_tokens, view.hidden,
                                       view.x, &p->out, err) == EPD_OK);
    p->frame = *frame; /* y points into its payload */
}

static void answer_control(int fd, epd_frame_t *frame)
{
    const cJSON *op = cJSON_GetObjectItemCaseSensitive(frame->meta, "op");
    static const char prom[] = "# TYPE epd_requests_total counter\nepd_requests_total 7\n";
    epd_frame_out_t out;
    char err[EPD_ERR_LEN];
    const char *name = cJSON_IsString(op) ? op->valuestring : "";
    if (strcmp(name, "health") == 0) {
        FAKE_CHECK(epd_frame_encode_reply("{\"status\":\"ok\",\"rank\":0}", NULL, 0, &out,
                                          err) == EPD_OK);
    } else if (strcmp(name, "config") == 0) {
        FAKE_CHECK(epd_frame_encode_reply("{\"model.hidden\":64,\"model.topk\":4,"
                                          "\"model.num_experts\":16}", NULL, 0, &out,
                                          err) == EPD_OK);
    } else if (strcmp(name, "metrics") == 0) {
        FAKE_CHECK(epd_frame_encode_reply("{}", prom, strlen(prom), &out, err) == EPD_OK);
    } else {
        FAKE_CHECK(epd_frame_encode_error(false, 0, EPD_ERR_UNKNOWN_OP, "unknown control op",
                                          &out, err) == EPD_OK);
    }
    send_out(fd, &out);
}

/* FAKE_EXPERTS: the EXPERTS of experts_cases (steps 1, 2, ...). */
static void send_experts_cases(int fd)
{
    static char meta[8192];
    for (size_t i = 0; i < EPD_ARRAY_SIZE(experts_cases); i++) {
        char counts[4096];
        size_t n = 0;
        if (experts_cases[i].counts != NULL) {
            snprintf(counts, sizeof counts, "%s", experts_cases[i].counts);
        } else {
            n += (size_t)snprintf(counts, sizeof counts, "[");
            for (int e = 0; e < 256; e++)
                n += (size_t)snprintf(counts + n, sizeof counts - n, "%s%d", e ? "," : "", e * 7 % 1000);
            snprintf(counts + n, sizeof counts - n, "]");
        }
        if (experts_cases[i].counts_last)
            snprintf(meta, sizeof meta, "{\"step\":%zu," EXPERTS_HEAD "," EXPERTS_TENSORS
                     ",\"counts\":%s,\"sent_ns\":5}", i + 1, counts);
        else
            snprintf(meta, sizeof meta, "{\"step\":%zu," EXPERTS_HEAD ",\"counts\":%s,"
                     EXPERTS_TENSORS ",\"sent_ns\":5}", i + 1, counts);
        epd_frame_out_t out;
        char err[EPD_ERR_LEN];
        FAKE_CHECK(epd_frame_encode_text(EPD_FRAME_EXPERTS, meta, &out, err) == EPD_OK);
        FAKE_CHECK(send_out(fd, &out) == 0);
    }
}

static void *fake_main(void *arg)
{
    fake_t *f = arg;
    epd_decoder_t dec;
    uint8_t buf[65536];
    pending_t *held = calloc((size_t)(f->batch > 0 ? f->batch : 1), sizeof(*held));
    int n_held = 0;
    uint64_t next_done = 1;
    int fd = accept(f->listen_fd, NULL, NULL);
    if (fd < 0 || held == NULL) goto out;
    epd_decoder_init(&dec, 1u << 30, EPD_FRAME_MAX_META);
    for (;;) {
        ssize_t n = recv(fd, buf, sizeof(buf), 0);
        if (n <= 0) break;
        if (f->mode == FAKE_HANGUP) {
            epd_frame_out_t out;
            char err[EPD_ERR_LEN];
            epd_frame_encode_error(false, 0, EPD_ERR_BAD_MAGIC, "not a frame", &out, err);
            send_out(fd, &out);
            goto close_fd;
        }
        size_t off = 0;
        while (off < (size_t)n) {
            epd_frame_t frame;
            size_t used;
            char err[EPD_ERR_LEN];
            epd_status_t status = epd_decoder_feed(&dec, buf + off, (size_t)n - off, &used, &frame,
                                                   err);
            off += used;
            if (status == EPD_ERR_AGAIN) break;
            if (status != EPD_OK || f->mode == FAKE_FRAMING) {
                epd_frame_out_t out;
                if (status == EPD_OK) epd_frame_free(&frame);
                epd_frame_encode_error(false, 0, EPD_ERR_BAD_JSON, "meta is not valid JSON", &out,
                                       err);
                send_out(fd, &out);
                goto close_fd;
            }
            if (f->mode == FAKE_SILENT) {
                epd_frame_free(&frame);
            } else if (f->mode == FAKE_EXPERTS && frame.type == EPD_FRAME_CONTROL) {
                epd_frame_out_t out;
                FAKE_CHECK(epd_frame_encode_reply("{\"rank\":0}", NULL, 0, &out, err) == EPD_OK);
                FAKE_CHECK(send_out(fd, &out) == 0);
                epd_frame_free(&frame);
                send_experts_cases(fd);
            } else if (f->mode == FAKE_EXPERTS) {
                uint64_t step = 0;
                FAKE_CHECK(frame.type == EPD_FRAME_EXPERTS_DONE);
                FAKE_CHECK(epd_json_to_u64(cJSON_GetObjectItemCaseSensitive(frame.meta, "step"),
                                           &step));
                FAKE_CHECK(step == next_done);
                epd_frame_free(&frame);
                if (next_done++ == EPD_ARRAY_SIZE(experts_cases)) goto close_fd;
            } else if (frame.type == EPD_FRAME_CONTROL) {
                answer_control(fd, &frame);
                epd_frame_free(&frame);
            } else if (f->mode == FAKE_ECHO) {
                pending_t p;
                answer_submit(f, &frame, &p);
                send_out(fd, &p.out);
                epd_frame_free(&p.frame);
            } else {
                answer_submit(f, &frame, &held[n_held++]);
                if (n_held == f->batch) {
                    for (int i = n_held - 1; i >= 0; i--) {
                        send_out(fd, &held[i].out);
                        epd_frame_free(&held[i].frame);
                    }
                    n_held = 0;
                }
            }
        }
    }
close_fd:
    epd_decoder_free(&dec);
    for (int i = 0; i < n_held; i++) {
        epd_frame_out_free(&held[i].out);
        epd_frame_free(&held[i].frame);
    }
    close(fd);
out:
    free(held);
    return NULL;
}

static void fake_start(fake_t *f, fake_mode_t mode, int batch, uint32_t hidden)
{
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    static int seq;
    memset(f, 0, sizeof(*f));
    f->mode = mode;
    f->batch = batch;
    f->limits = (epd_submit_limits_t){.hidden = hidden, .topk = 4, .num_experts = 16,
                                      .max_tokens = 4096};
    snprintf(f->path, sizeof(f->path), "/tmp/epd-test-client-%d-%d.sock", (int)getpid(), seq++);
    unlink(f->path);
    f->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(f->listen_fd >= 0);
    memcpy(addr.sun_path, f->path, strlen(f->path) + 1);
    assert_int_equal(bind(f->listen_fd, (struct sockaddr *)&addr, sizeof(addr)), 0);
    assert_int_equal(listen(f->listen_fd, 4), 0);
    assert_int_equal(pthread_create(&f->thread, NULL, fake_main, f), 0);
}

static void fake_stop(fake_t *f)
{
    pthread_join(f->thread, NULL);
    close(f->listen_fd);
    unlink(f->path);
}

/* A batch of n tokens with H 64, K 4 and distinct ids; `bad` puts expert 99 in token 0. */
typedef struct {
    uint16_t *x;
    int32_t *ids;
    float *w;
    epd_client_batch_t b;
} batch_t;

static void batch_make(batch_t *bt, uint64_t id, uint32_t n, uint32_t hidden, bool bad)
{
    bt->x = malloc((size_t)n * hidden * 2);
    bt->ids = malloc((size_t)n * 4 * 4);
    bt->w = malloc((size_t)n * 4 * 4);
    assert_non_null(bt->x);
    /* any bit pattern with exponent bit 14 clear: finite, as the fake's validation wants */
    for (size_t i = 0; i < (size_t)n * hidden; i++)
        bt->x[i] = (uint16_t)((id * 31 + i * 7) & 0xbfffu);
    for (uint32_t t = 0; t < n; t++) {
        for (int k = 0; k < 4; k++) {
            bt->ids[t * 4 + k] = (int32_t)((t + (uint32_t)k * 3) % 16);
            bt->w[t * 4 + k] = 0.25f;
        }
    }
    if (bad) bt->ids[0] = 99;
    bt->b = (epd_client_batch_t){.id = id, .n_tokens = n, .hidden = hidden, .topk = 4,
                                 .x = bt->x, .topk_ids = bt->ids, .topk_weights = bt->w};
}

static void batch_free(batch_t *bt)
{
    free(bt->x);
    free(bt->ids);
    free(bt->w);
}

static epd_client_t *connect_to(fake_t *f)
{
    epd_client_t *c = epd_client_create();
    assert_non_null(c);
    assert_int_equal(epd_client_connect(c, f->path, 5000), EPD_CLIENT_OK);
    return c;
}

/* A listener that keeps every byte of its one connection (for the exact text of SUBMITs). */
typedef struct {
    int lfd;
    char path[108];
    uint8_t *got;
    size_t len, cap;
    pthread_t thread;
} sink_t;

static void *sink_main(void *arg)
{
    sink_t *s = arg;
    int fd = accept(s->lfd, NULL, NULL);
    if (fd < 0) return NULL;
    for (;;) {
        if (s->cap - s->len < 65536) {
            s->cap = s->cap * 2 + 65536;
            s->got = realloc(s->got, s->cap);
            if (s->got == NULL) break;
        }
        ssize_t n = read(fd, s->got + s->len, s->cap - s->len);
        if (n <= 0) break;
        s->len += (size_t)n;
    }
    close(fd);
    return NULL;
}

static void test_client__submit_meta__bytes_as_printf_wrote_them(void **state)
{
    (void)state;
    sink_t s = {0};
    snprintf(s.path, sizeof s.path, "/tmp/epd-test-sink.%ld.sock", (long)getpid());
    unlink(s.path);
    s.lfd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", s.path);
    assert_int_equal(bind(s.lfd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(s.lfd, 1), 0);
    assert_int_equal(pthread_create(&s.thread, NULL, sink_main, &s), 0);
    epd_client_t *c = epd_client_create();
    assert_non_null(c);
    assert_int_equal(epd_client_connect(c, s.path, 5000), EPD_CLIENT_OK);

    static uint16_t x[3 * 8];
    static int64_t ids[3 * 2];
    static float w[3 * 2];
    enum { CASES = 4 };
    char want[CASES][1024];
    for (int i = 0; i < CASES; i++) {
        epd_client_request_t r = {.id = i == 3 ? UINT64_MAX : 1099511627776ull + (uint64_t)i,
                                  .n_tokens = 3, .hidden = 8, .topk = 2,
                                  .layer = i == 0 ? -1 : i == 1 ? 0 : INT32_MAX};
        r.ids_i64 = i == 2;
        bool regions = i % 2 == 0;
        if (regions) {
            r.x = (epd_client_tensor_t){.region = 1, .offset = 4096};
            r.topk_ids = (epd_client_tensor_t){.region = UINT32_MAX, .offset = 0};
            r.topk_weights = (epd_client_tensor_t){.region = 1, .offset = UINT64_MAX - 15};
            r.y = (epd_client_tensor_t){.region = 2, .offset = 10};
        } else {
            r.x = (epd_client_tensor_t){.data = x};
            r.topk_ids = (epd_client_tensor_t){.data = ids};
            r.topk_weights = (epd_client_tensor_t){.data = w};
        }
        assert_int_equal(epd_client_send_request(c, &r), EPD_CLIENT_OK);
        int n = snprintf(want[i], sizeof want[i], "{\"id\":%llu", (unsigned long long)r.id);
        if (r.layer >= 0) n += snprintf(want[i] + n, sizeof want[i] - n, ",\"layer\":%d", r.layer);
        const char *idt = r.ids_i64 ? "i64" : "i32";
        if (regions)
            snprintf(want[i] + n, sizeof want[i] - n,
                     ",\"tensors\":{\"topk_ids\":{\"dtype\":\"%s\",\"shape\":[3,2],\"region\":%u,"
                     "\"offset\":0},\"topk_weights\":{\"dtype\":\"f32\",\"shape\":[3,2],\"region\":1,"
                     "\"offset\":%llu},\"x\":{\"dtype\":\"bf16\",\"shape\":[3,8],\"region\":1,"
                     "\"offset\":4096},\"y\":{\"dtype\":\"bf16\",\"shape\":[3,8],\"region\":2,"
                     "\"offset\":10}}}",
                     idt, UINT32_MAX, (unsigned long long)(UINT64_MAX - 15));
        else
            snprintf(want[i] + n, sizeof want[i] - n,
                     ",\"tensors\":{\"topk_ids\":{\"dtype\":\"%s\",\"shape\":[3,2],"
                     "\"data_offsets\":[0,%d]},\"topk_weights\":{\"dtype\":\"f32\",\"shape\":[3,2],"
                     "\"data_offsets\":[%d,%d]},\"x\":{\"dtype\":\"bf16\",\"shape\":[3,8],"
                     "\"data_offsets\":[%d,%d]}}}",
                     idt, r.ids_i64 ? 48 : 24, r.ids_i64 ? 48 : 24, r.ids_i64 ? 72 : 48,
                     r.ids_i64 ? 72 : 48, (r.ids_i64 ? 72 : 48) + 48);
    }
    epd_client_destroy(c);
    pthread_join(s.thread, NULL);
    close(s.lfd);
    unlink(s.path);
    size_t at = 0;
    for (int i = 0; i < CASES; i++) {
        epd_frame_header_t h;
        char err[EPD_ERR_LEN];
        assert_true(s.len - at >= EPD_FRAME_HEADER_LEN);
        assert_int_equal(epd_frame_header_decode(s.got + at, UINT64_MAX, UINT32_MAX, &h, err),
                         EPD_OK);
        at += EPD_FRAME_HEADER_LEN;
        assert_true(s.len - at >= h.meta_len + h.payload_len);
        char *meta = strndup((const char *)s.got + at, h.meta_len);
        assert_string_equal(meta, want[i]);
        free(meta);
        at += h.meta_len + h.payload_len;
    }
    assert_int_equal(at, s.len);
    free(s.got);
}

static void test_client__submit__returns_y_and_step(void **state)
{
    fake_t f;
    batch_t bt;
    uint16_t y[3 * 64];
    uint64_t step = 0;
    (void)state;
    fake_start(&f, FAKE_ECHO, 0, 64);
    epd_client_t *c = connect_to(&f);
    batch_make(&bt, 5, 3, 64, false);
    assert_int_equal(epd_client_submit(c, &bt.b, y, &step), EPD_CLIENT_OK);
    assert_memory_equal(y, bt.x, sizeof(y));
    assert_int_equal(step, 1005);
    /* the same answer when the client spins on recv instead of sleeping in poll */
    epd_client_set_spin(c, 1000000);
    memset(y, 0, sizeof y);
    assert_int_equal(epd_client_submit(c, &bt.b, y, &step), EPD_CLIENT_OK);
    assert_memory_equal(y, bt.x, sizeof(y));
    assert_int_equal(step, 1005);
    epd_client_set_spin(c, 0);
    assert_string_equal(epd_client_last_error(c), "");
    assert_int_equal(epd_client_in_flight(c), 0);
    epd_client_destroy(c);
    batch_free(&bt);
    fake_stop(&f);
}

static void test_client__rejected_batch__maps_daemon_code(void **state)
{
    fake_t f;
    batch_t bt;
    uint16_t y[2 * 64];
    (void)state;
    fake_start(&f, FAKE_ECHO, 0, 64);
    epd_client_t *c = connect_to(&f);
    batch_make(&bt, 6, 2, 64, true);
    assert_int_equal(epd_client_submit(c, &bt.b, y, NULL), EPD_CLIENT_ERR_DAEMON);
    assert_string_equal(epd_client_last_error(c), "expert_out_of_range");
    assert_non_null(strstr(epd_client_last_message(c), "99"));
    /* the connection stays usable after a request-level error */
    batch_free(&bt);
    batch_make(&bt, 7, 2, 64, false);
    assert_int_equal(epd_client_submit(c, &bt.b, y, NULL), EPD_CLIENT_OK);
    /* a wrong hidden size is the daemon's shape_mismatch */
    batch_free(&bt);
    batch_make(&bt, 8, 2, 32, false);
    assert_int_equal(epd_client_submit(c, &bt.b, y, NULL), EPD_CLIENT_ERR_DAEMON);
    assert_string_equal(epd_client_last_error(c), "shape_mismatch");
    epd_client_destroy(c);
    batch_free(&bt);
    fake_stop(&f);
}

static void test_client__pipeline__collects_out_of_order_by_id(void **state)
{
    enum { N_REQ = 8 };
    fake_t f;
    batch_t bt[N_REQ];
    epd_client_reply_t r;
    (void)state;
    fake_start(&f, FAKE_REVERSE, N_REQ, 64);
    epd_client_t *c = connect_to(&f);
    for (int i = 0; i < N_REQ; i++) {
        batch_make(&bt[i], 100 + (uint64_t)i, 1 + (uint32_t)i, 64, i == 2);
        assert_int_equal(epd_client_send(c, &bt[i].b), EPD_CLIENT_OK);
    }
    assert_int_equal(epd_client_in_flight(c), N_REQ);
    /* the daemon answers 107 first; asking for 100 keeps the others queued */
    for (int i = 0; i < N_REQ; i++) {
        int rc = epd_client_wait(c, 100 + (uint64_t)i, &r);
        assert_true(r.has_id);
        assert_int_equal(r.id, 100 + i);
        if (i == 2) {
            assert_int_equal(rc, EPD_CLIENT_ERR_DAEMON);
            assert_string_equal(r.code, "expert_out_of_range");
            assert_null(r.y);
        } else {
            assert_int_equal(rc, EPD_CLIENT_OK);
            assert_int_equal(r.n_tokens, 1 + i);
            assert_memory_equal(r.y, bt[i].x, (size_t)(1 + i) * 64 * 2);
            assert_int_equal(r.step, 1100 + i);
        }
        epd_client_reply_free(&r);
    }
    assert_int_equal(epd_client_in_flight(c), 0);

    /* second round, collected in arrival order: last sent arrives first */
    for (int i = 0; i < N_REQ; i++) assert_int_equal(epd_client_send(c, &bt[i].b), EPD_CLIENT_OK);
    for (int i = N_REQ - 1; i >= 0; i--) {
        int rc = epd_client_recv(c, &r);
        assert_int_equal(r.id, 100 + i);
        assert_int_equal(rc, i == 2 ? EPD_CLIENT_ERR_DAEMON : EPD_CLIENT_OK);
        epd_client_reply_free(&r);
    }
    epd_client_destroy(c);
    for (int i = 0; i < N_REQ; i++) batch_free(&bt[i]);
    fake_stop(&f);
}

static void test_client__many_large_sends__do_not_deadlock(void **state)
{
    enum { N_REQ = 24, N_TOK = 128, H = 1024 };
    fake_t f;
    batch_t bt;
    epd_client_reply_t r;
    (void)state;
    fake_start(&f, FAKE_ECHO, 0, H);
    epd_client_t *c = connect_to(&f);
    batch_make(&bt, 0, N_TOK, H, false);
    /* 24 x 256 KiB sent without reading: the echoes fill our socket while we send */
    for (int i = 0; i < N_REQ; i++) {
        bt.b.id = (uint64_t)i;
        assert_int_equal(epd_client_send(c, &bt.b), EPD_CLIENT_OK);
    }
    for (int i = 0; i < N_REQ; i++) {
        assert_int_equal(epd_client_recv(c, &r), EPD_CLIENT_OK);
        assert_int_equal(r.id, i);
        assert_memory_equal(r.y, bt.x, (size_t)N_TOK * H * 2);
        epd_client_reply_free(&r);
    }
    epd_client_destroy(c);
    batch_free(&bt);
    fake_stop(&f);
}

/* RESULTs of 5.7 MB (H 7168, 400 tokens: above the 4 MiB a payload is allocated whole at, so the
 * buffer they are read into also grows) arrive whole and exact, pipelined three deep. */
static void test_client__large_results__arrive_exact(void **state)
{
    enum { N_REQ = 3, N_TOK = 400, H = 7168 };
    fake_t f;
    batch_t bt[N_REQ];
    epd_client_reply_t r;
    (void)state;
    fake_start(&f, FAKE_ECHO, 0, H);
    epd_client_t *c = connect_to(&f);
    for (int i = 0; i < N_REQ; i++) {
        batch_make(&bt[i], 200 + (uint64_t)i, N_TOK, H, false);
        assert_int_equal(epd_client_send(c, &bt[i].b), EPD_CLIENT_OK);
    }
    for (int i = 0; i < N_REQ; i++) {
        assert_int_equal(epd_client_wait(c, 200 + (uint64_t)i, &r), EPD_CLIENT_OK);
        assert_int_equal(r.n_tokens, N_TOK);
        assert_memory_equal(r.y, bt[i].x, (size_t)N_TOK * H * 2);
        epd_client_reply_free(&r);
    }
    epd_client_destroy(c);
    for (int i = 0; i < N_REQ; i++) batch_free(&bt[i]);
    fake_stop(&f);
}

static void test_client__control__returns_json_and_payload(void **state)
{
    fake_t f;
    char *json = NULL, *payload = NULL;
    size_t len = 0;
    (void)state;
    fake_start(&f, FAKE_ECHO, 0, 64);
    epd_client_t *c = connect_to(&f);
    assert_int_equal(epd_client_control(c, "health", &json, NULL, NULL), EPD_CLIENT_OK);
    assert_non_null(strstr(json, "\"status\":\"ok\""));
    epd_client_free(json);
    assert_int_equal(epd_client_control(c, "metrics", &json, &payload, &len), EPD_CLIENT_OK);
    assert_string_equal(json, "{}");
    assert_int_equal(len, strlen(payload));
    assert_non_null(strstr(payload, "epd_requests_total 7\n"));
    epd_client_free(json);
    epd_client_free(payload);
    assert_int_equal(epd_client_control(c, "reboot", &json, NULL, NULL), EPD_CLIENT_ERR_DAEMON);
    assert_null(json);
    assert_string_equal(epd_client_last_error(c), "unknown_op");
    assert_int_equal(epd_client_control(c, "", &json, NULL, NULL), EPD_CLIENT_ERR_INVALID_ARG);
    epd_client_destroy(c);
    fake_stop(&f);
}

static void test_client__framing_error__ends_wait_then_closed(void **state)
{
    fake_t f;
    batch_t bt;
    uint16_t y[64];
    (void)state;
    fake_start(&f, FAKE_FRAMING, 0, 64);
    epd_client_t *c = connect_to(&f);
    batch_make(&bt, 1, 1, 64, false);
    assert_int_equal(epd_client_submit(c, &bt.b, y, NULL), EPD_CLIENT_ERR_DAEMON);
    assert_string_equal(epd_client_last_error(c), "bad_json");
    /* the daemon closed after its ERROR: the next call says so (EOF or EPIPE) */
    int rc = epd_client_submit(c, &bt.b, y, NULL);
    if (rc != EPD_CLIENT_ERR_CLOSED) fail_msg("rc %d: %s", rc, epd_client_last_message(c));
    assert_string_equal(epd_client_last_error(c), "closed");
    epd_client_destroy(c);
    batch_free(&bt);
    fake_stop(&f);
}

static void test_client__hangup_while_sending__is_closed_naming_the_error(void **state)
{
    fake_t f;
    batch_t bt;
    epd_client_reply_t r;
    (void)state;
    fake_start(&f, FAKE_HANGUP, 0, 4096);
    epd_client_t *c = connect_to(&f);
    /* 16 MiB: far more than the socket buffers (libepd asks for 4 MiB, the kernel doubles it) */
    batch_make(&bt, 1, 2048, 4096, false);
    assert_int_equal(epd_client_send(c, &bt.b), EPD_CLIENT_ERR_CLOSED);
    assert_non_null(strstr(epd_client_last_message(c), "bad_magic"));
    /* the daemon's last word is still there to collect, then the connection is gone */
    assert_int_equal(epd_client_recv(c, &r), EPD_CLIENT_ERR_DAEMON);
    assert_false(r.has_id);
    assert_string_equal(r.code, "bad_magic");
    epd_client_reply_free(&r);
    assert_int_equal(epd_client_recv(c, &r), EPD_CLIENT_ERR_CLOSED);
    epd_client_destroy(c);
    batch_free(&bt);
    fake_stop(&f);
}

static void test_client__silent_daemon__times_out(void **state)
{
    fake_t f;
    batch_t bt;
    uint16_t y[64];
    struct timespec t0, t1;
    (void)state;
    fake_start(&f, FAKE_SILENT, 0, 64);
    epd_client_t *c = connect_to(&f);
    epd_client_set_timeout(c, 150);
    batch_make(&bt, 1, 1, 64, false);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    assert_int_equal(epd_client_submit(c, &bt.b, y, NULL), EPD_CLIENT_ERR_TIMEOUT);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double took = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    assert_true(took >= 0.14);
    assert_string_equal(epd_client_last_error(c), "timeout");
    /* a client that spins (far longer than its timeout) still keeps the timeout */
    epd_client_set_spin(c, 60u * 1000000u);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    assert_int_equal(epd_client_submit(c, &bt.b, y, NULL), EPD_CLIENT_ERR_TIMEOUT);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    took = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    assert_true(took >= 0.14 && took < 30.0);
    epd_client_destroy(c); /* closing lets the fake daemon's read end */
    batch_free(&bt);
    fake_stop(&f);
}

typedef struct {
    size_t calls;
    bool ok;
} experts_seen_t;

static int experts_record(void *arg, const epd_client_experts_t *b)
{
    experts_seen_t *seen = arg;
    size_t i = seen->calls++;
    bool ok = i < EPD_ARRAY_SIZE(experts_cases) && b->step == i + 1 && b->layer == 3 &&
              b->first_expert == 8 && b->n_experts == experts_cases[i].n && b->hidden == 64 &&
              b->input_region == 1 && b->output_region == 2 && b->sent_ns == 5 &&
              strcmp(b->input, "bf16") == 0 && !b->masked;
    for (uint32_t e = 0; ok && e < b->n_experts; e++)
        ok = b->counts[e] == (experts_cases[i].counts != NULL ? experts_cases[i].want[e]
                                                              : e * 7 % 1000);
    if (!ok) fprintf(stderr, "EXPERTS case %zu: the worker saw the wrong batch\n", i);
    seen->ok = seen->ok && ok;
    return 0;
}

static void test_client__experts__counts_read_as_the_tree_gives_them(void **state)
{
    (void)state;
    /* sleeping in poll, and spinning on recv (epd_client_set_spin) */
    for (unsigned spin_us = 0; spin_us <= 1000000; spin_us += 1000000) {
        fake_t f;
        experts_seen_t seen = {.calls = 0, .ok = true};
        fake_start(&f, FAKE_EXPERTS, 0, 64);
        epd_client_t *c = connect_to(&f);
        epd_client_set_spin(c, spin_us);
        assert_int_equal(epd_client_serve_experts(c, 1, 2, experts_record, &seen, NULL),
                         EPD_CLIENT_OK);
        /* the fake closes once it has every EXPERTS_DONE */
        assert_int_equal(epd_client_serve(c, 5000), EPD_CLIENT_ERR_CLOSED);
        assert_int_equal(seen.calls, EPD_ARRAY_SIZE(experts_cases));
        assert_true(seen.ok);
        epd_client_destroy(c);
        fake_stop(&f);
    }
}

static void test_client__no_daemon__is_connect_error_naming_path(void **state)
{
    char *json = NULL;
    char path[200];
    (void)state;
    epd_client_t *c = epd_client_create();
    assert_non_null(c);
    assert_int_equal(epd_client_connect(c, "/tmp/epd-test-no-such-dir/epd.sock", 100),
                     EPD_CLIENT_ERR_CONNECT);
    assert_string_equal(epd_client_last_error(c), "connect");
    assert_non_null(strstr(epd_client_last_message(c), "/tmp/epd-test-no-such-dir/epd.sock"));
    assert_non_null(strstr(epd_client_last_message(c), "No such file"));
    /* a regular file is not a daemon */
    snprintf(path, sizeof(path), "/tmp/epd-test-client-file-%d", (int)getpid());
    FILE *fp = fopen(path, "w");
    assert_non_null(fp);
    fclose(fp);
    assert_int_equal(epd_client_connect(c, path, 100), EPD_CLIENT_ERR_CONNECT);
    assert_non_null(strstr(epd_client_last_message(c), "refused"));
    unlink(path);
    /* a path longer than sun_path */
    memset(path, 'a', sizeof(path) - 1);
    path[0] = '/';
    path[sizeof(path) - 1] = '\0';
    assert_int_equal(epd_client_connect(c, path, 100), EPD_CLIENT_ERR_CONNECT);
    /* calls on an unconnected client fail cleanly */
    assert_int_equal(epd_client_control(c, "health", &json, NULL, NULL), EPD_CLIENT_ERR_CLOSED);
    assert_int_equal(epd_client_connect(c, NULL, 100), EPD_CLIENT_ERR_INVALID_ARG);
    assert_string_equal(epd_client_rc_name(EPD_CLIENT_ERR_TIMEOUT), "timeout");
    epd_client_destroy(c);
    epd_client_destroy(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_client__submit__returns_y_and_step),
        cmocka_unit_test(test_client__submit_meta__bytes_as_printf_wrote_them),
        cmocka_unit_test(test_client__rejected_batch__maps_daemon_code),
        cmocka_unit_test(test_client__pipeline__collects_out_of_order_by_id),
        cmocka_unit_test(test_client__many_large_sends__do_not_deadlock),
        cmocka_unit_test(test_client__large_results__arrive_exact),
        cmocka_unit_test(test_client__control__returns_json_and_payload),
        cmocka_unit_test(test_client__framing_error__ends_wait_then_closed),
        cmocka_unit_test(test_client__hangup_while_sending__is_closed_naming_the_error),
        cmocka_unit_test(test_client__silent_daemon__times_out),
        cmocka_unit_test(test_client__no_daemon__is_connect_error_naming_path),
        cmocka_unit_test(test_client__experts__counts_read_as_the_tree_gives_them),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
