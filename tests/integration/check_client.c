/* Integration-test client: connects several clients to each rank's socket, pipelines random SUBMITs
 * and checks every RESULT against epd_moe_reference bit for bit. The shape, dtype and experts come
 * from the daemon's own `config` and `health` replies. Exit 0 when every answer is right.
 *   check_client --socket PATH [--socket PATH]... [--seed S] [--clients C] [--requests R]
 *                [--max-tokens N] [--window W] [--empty-slots] [--hold-ms MS]
 *                [--expect-clients N] [--retry-busy] [--until-closed] [--quiet] [--layers LIST]
 *                [--tolerance REL] [--trickle-us US]
 * --layers LIST: each request names one of these layers (chosen at random, so one connection
 * interleaves them), e.g. "1,2,3"; with ffn experts the reference loads every expert of the
 * daemon's experts.weights itself. --tolerance REL: instead of bit for bit, each token's relative
 * L2 error against the reference must be at most REL (the CUDA ffn experts, DESIGN.md section 9).
 * --expect-clients N: after every client has connected, a control connection checks that the
 * first socket's rank counts at least N clients (concurrency). --hold-ms: every client waits this
 * long after its last request before closing (keeps them concurrent). --retry-busy: a request
 * answered `busy` is sent again. --until-closed: the daemon is being stopped; requests answered
 * `shutting_down` are fine, and so is the daemon closing the connection (every answer that did
 * come must still be right). --trickle-us US: a slow client both ways (sends in 64 KiB pieces
 * this far apart, sleeps this long before every recv). */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/bf16.h"
#include "common/parse.h"
#include "common/rng.h"
#include "gpu/ops.h"
#include "proto/frame.h"

#define MAX_SOCKETS 16

typedef struct client_io {
    int fd;
    epd_decoder_t dec;
    uint8_t buf[65536];
    size_t have;
    size_t off;
} client_io_t;

typedef struct target {
    const char *path;
    epd_moe_shape_t shape;
    uint32_t max_tokens; /* dispatch.max_tokens_per_request */
    int rank;
} target_t;

typedef struct options {
    const char *sockets[MAX_SOCKETS];
    int n_sockets;
    uint64_t seed;
    uint32_t clients;
    uint32_t requests;
    uint32_t max_tokens;
    uint32_t window;
    bool empty_slots;
    uint32_t hold_ms;
    uint32_t expect_clients;
    bool retry_busy;
    bool until_closed;
    bool quiet;
    uint32_t layers[64]; /* --layers; n_layers 0: no "layer" in SUBMIT */
    size_t n_layers;
    double tolerance; /* 0: bit for bit */
} options_t;

/* ffn experts: every expert of every served layer, for the reference (NULL for toy kinds) */
static epd_ffn_weights_t *ffn_all;

typedef struct worker {
    pthread_t thread;
    const options_t *opt;
    const target_t *target;
    uint32_t index;
    uint64_t seed;
    pthread_barrier_t *connected;
    /* results */
    uint64_t verified;
    uint64_t tokens;
    uint64_t busy_retries;
    uint64_t shutting_down;
    uint64_t unanswered;
    char failure[512];
} worker_t;

static atomic_int failures;

static void io_init(client_io_t *io, int fd)
{
    io->fd = fd;
    io->have = io->off = 0;
    epd_decoder_init(&io->dec, UINT64_C(1) << 36, EPD_FRAME_MAX_META);
}

static int connect_to(const char *path)
{
    struct sockaddr_un addr;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    memset(&addr, 0, sizeof(addr));
    addr.sun_family = AF_UNIX;
    snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path);
    if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* --trickle-us: sends go out in pieces of TRICKLE_BYTES with this long a sleep between them,
 * and every recv waits as long first (a slow client, both ways). 0: at full speed. */
#define TRICKLE_BYTES 65536
static uint32_t trickle_us;

static bool send_all(int fd, const void *buf, size_t len)
{
    const uint8_t *p = buf;
    while (len > 0) {
        size_t piece = trickle_us > 0 && len > TRICKLE_BYTES ? TRICKLE_BYTES : len;
        if (trickle_us > 0 && p != buf) usleep(trickle_us);
        ssize_t n = send(fd, p, piece, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return false;
        p += n;
        len -= (size_t)n;
    }
    return true;
}

static bool send_frame(int fd, epd_frame_out_t *out)
{
    bool ok = send_all(fd, out->head, out->head_len);
    for (size_t i = 0; ok && i < out->n_parts; i++)
        ok = send_all(fd, out->part[i], out->part_len[i]);
    epd_frame_out_free(out);
    return ok;
}

/* Reads until one whole frame is decoded; false on EOF, error or a framing error. */
static bool recv_frame(client_io_t *io, epd_frame_t *frame, char err[EPD_ERR_LEN])
{
    for (;;) {
        if (io->off < io->have) {
            size_t used = 0;
            epd_status_t st = epd_decoder_feed(&io->dec, io->buf + io->off, io->have - io->off,
                                               &used, frame, err);
            io->off += used;
            if (st == EPD_OK) return true;
            if (st != EPD_ERR_AGAIN) return false;
        }
        if (trickle_us > 0) usleep(trickle_us);
        ssize_t n = recv(io->fd, io->buf, sizeof(io->buf), 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            snprintf(err, EPD_ERR_LEN, "%s", n == 0 ? "connection closed by the daemon"
                                                    : strerror(errno));
            return false;
        }
        io->have = (size_t)n;
        io->off = 0;
    }
}

/* CONTROL op -> REPLY meta (caller deletes), or NULL. */
static cJSON *control(client_io_t *io, const char *op, char err[EPD_ERR_LEN])
{
    epd_frame_out_t out;
    epd_frame_t frame;
    if (epd_frame_encode_control(op, &out, err) != EPD_OK) return NULL;
    if (!send_frame(io->fd, &out)) {
        snprintf(err, EPD_ERR_LEN, "send failed");
        return NULL;
    }
    if (!recv_frame(io, &frame, err)) return NULL;
    if (frame.type != EPD_FRAME_REPLY) {
        char *text = cJSON_PrintUnformatted(frame.meta);
        snprintf(err, EPD_ERR_LEN, "%s: expected REPLY, got %s %s", op,
                 epd_frame_type_name((int)frame.type), text ? text : "");
        free(text);
        epd_frame_free(&frame);
        return NULL;
    }
    cJSON *meta = epd_frame_take_meta(&frame);
    epd_frame_free(&frame);
    return meta;
}

static bool json_u32(const cJSON *doc, const char *key, uint32_t *out_p)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(doc, key);
    if (!cJSON_IsNumber(v) || v->valuedouble < 0) return false;
    *out_p = (uint32_t)v->valuedouble;
    return true;
}

static const char *json_str(const cJSON *doc, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(doc, key);
    return cJSON_IsString(v) ? v->valuestring : "";
}

/* Asks the rank behind path for its configuration and world size. */
static bool describe_target(target_t *t, char err[EPD_ERR_LEN])
{
    client_io_t *io = malloc(sizeof(*io));
    int fd = connect_to(t->path);
    bool ok = false;
    if (io == NULL) return false;
    if (fd < 0) {
        snprintf(err, EPD_ERR_LEN, "connect %s: %s", t->path, strerror(errno));
        free(io);
        return false;
    }
    io_init(io, fd);
    cJSON *cfg = control(io, "config", err);
    cJSON *health = cfg ? control(io, "health", err) : NULL;
    if (cfg != NULL && health != NULL) {
        uint32_t world = 0, rank = 0;
        memset(&t->shape, 0, sizeof(t->shape));
        ok = json_u32(cfg, "model.hidden", &t->shape.hidden) &&
             json_u32(cfg, "model.topk", &t->shape.topk) &&
             json_u32(cfg, "model.num_experts", &t->shape.num_experts) &&
             json_u32(cfg, "dispatch.max_tokens_per_request", &t->max_tokens) &&
             json_u32(health, "world", &world) && json_u32(health, "rank", &rank);
        t->shape.world = world;
        t->shape.rank = rank;
        t->rank = (int)rank;
        t->shape.dtype = strcmp(json_str(cfg, "dispatch.dtype"), "bf16") == 0 ? EPD_WIRE_BF16
                                                                              : EPD_WIRE_FP8;
        t->shape.scale = strcmp(json_str(cfg, "dispatch.scale"), "per_token") == 0
                             ? EPD_SCALE_PER_TOKEN : EPD_SCALE_GROUP128;
        t->shape.scale_format = strcmp(json_str(cfg, "dispatch.scale_format"), "ue8m0") == 0
                                    ? EPD_SCALE_FMT_UE8M0 : EPD_SCALE_FMT_FP32;
        const char *kind = json_str(cfg, "experts.kind");
        t->shape.expert_kind = strcmp(kind, "identity") == 0 ? EPD_EXPERTS_IDENTITY
                               : strcmp(kind, "ffn") == 0    ? EPD_EXPERTS_FFN
                                                             : EPD_EXPERTS_SCALE;
        t->shape.combine_dtype = strcmp(json_str(cfg, "combine.dtype"), "fp8") == 0
                                     ? EPD_COMBINE_FP8 : EPD_COMBINE_BF16;
        if (t->shape.expert_kind == EPD_EXPERTS_FFN && ffn_all == NULL && ok) {
            /* the daemon's own checkpoint, all E experts, the layers it serves */
            uint32_t layers[1024];
            size_t n_layers = 0;
            uint32_t intermediate = 0;
            json_u32(cfg, "model.intermediate", &intermediate);
            epd_ffn_spec_t spec = {.path = json_str(cfg, "experts.weights"), .layers = layers,
                                   .hidden = t->shape.hidden, .intermediate = intermediate,
                                   .num_experts = t->shape.num_experts,
                                   .n_local = t->shape.num_experts};
            ok = epd_parse_u32_list(json_str(cfg, "experts.layers"), 4095, layers, 1024,
                                    &n_layers, err) == EPD_OK;
            spec.n_layers = n_layers;
            if (ok && epd_ffn_load(&spec, &ffn_all, err) != EPD_OK) {
                cJSON_Delete(cfg);
                cJSON_Delete(health);
                epd_decoder_free(&io->dec);
                close(fd);
                free(io);
                return false;
            }
        }
        if (!ok)
            snprintf(err, EPD_ERR_LEN, "%s: config/health replies lack expected keys", t->path);
    }
    cJSON_Delete(cfg);
    cJSON_Delete(health);
    epd_decoder_free(&io->dec);
    close(fd);
    free(io);
    return ok;
}

typedef struct request {
    uint64_t id;
    uint32_t n;
    uint32_t layer;
    uint16_t *x;
    int32_t *ids;
    float *w;
} request_t;

static void request_free(request_t *r)
{
    free(r->x);
    free(r->ids);
    free(r->w);
    memset(r, 0, sizeof(*r));
}

static bool request_make(request_t *r, uint64_t id, const target_t *t, const options_t *opt,
                         uint64_t *rng)
{
    const epd_moe_shape_t *s = &t->shape;
    uint32_t max_n = opt->max_tokens < t->max_tokens ? opt->max_tokens : t->max_tokens;
    r->id = id;
    r->n = 1 + (uint32_t)(epd_rng_next(rng) % max_n);
    r->layer = opt->n_layers > 0 ? opt->layers[epd_rng_next(rng) % opt->n_layers] : 0;
    r->x = malloc((size_t)r->n * s->hidden * sizeof(uint16_t));
    r->ids = malloc((size_t)r->n * s->topk * sizeof(int32_t));
    r->w = malloc((size_t)r->n * s->topk * sizeof(float));
    if (!r->x || !r->ids || !r->w) return false;
    /* Rows of different magnitudes so FP8 scales differ, some exact zeros. */
    for (uint32_t i = 0; i < r->n; i++) {
        float mag = 0.01f + 8.0f * epd_rng_unit_f32(rng);
        for (uint32_t h = 0; h < s->hidden; h++) {
            float v = (epd_rng_unit_f32(rng) * 2.0f - 1.0f) * mag;
            if ((epd_rng_next(rng) & 63) == 0) v = 0.0f;
            r->x[(size_t)i * s->hidden + h] = epd_f32_to_bf16(v);
        }
        for (uint32_t k = 0; k < s->topk; k++) {
            int32_t e;
            bool dup;
            do {
                e = (int32_t)(epd_rng_next(rng) % s->num_experts);
                dup = false;
                for (uint32_t j = 0; j < k; j++) dup = dup || r->ids[(size_t)i * s->topk + j] == e;
            } while (dup);
            if (opt->empty_slots && (epd_rng_next(rng) % 5) == 0) e = -1;
            r->ids[(size_t)i * s->topk + k] = e;
            r->w[(size_t)i * s->topk + k] = epd_rng_unit_f32(rng);
        }
    }
    return true;
}

static void fail(worker_t *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(worker_t *w, const char *fmt, ...)
{
    va_list ap;
    if (w->failure[0] != '\0') return;
    va_start(ap, fmt);
    vsnprintf(w->failure, sizeof(w->failure), fmt, ap);
    va_end(ap);
    atomic_fetch_add(&failures, 1);
}

/* Checks one RESULT against the reference. */
static void verify(worker_t *w, const request_t *r, const epd_frame_t *frame)
{
    const epd_moe_shape_t *s = &w->target->shape;
    const cJSON *tensors = cJSON_GetObjectItemCaseSensitive(frame->meta, "tensors");
    const cJSON *y_desc = cJSON_GetObjectItemCaseSensitive(tensors, "y");
    epd_tensor_t y;
    char err[EPD_ERR_LEN];
    if (epd_tensor_parse(y_desc, "y", frame->payload_len, &y, err) != EPD_OK) {
        fail(w, "request %" PRIu64 ": bad RESULT tensor: %s", r->id, err);
        return;
    }
    size_t bytes = (size_t)r->n * s->hidden * sizeof(uint16_t);
    if (y.dtype != EPD_DTYPE_BF16 || y.ndim != 2 || y.shape[0] != r->n || y.shape[1] != s->hidden ||
        y.end - y.begin != bytes) {
        fail(w, "request %" PRIu64 ": RESULT y has the wrong dtype or shape", r->id);
        return;
    }
    uint16_t *ref = malloc(bytes);
    if (ref == NULL ||
        epd_moe_reference_layer(s, ffn_all, r->layer, r->n, r->x, r->ids, r->w, ref) != EPD_OK) {
        fail(w, "request %" PRIu64 ": reference failed", r->id);
        free(ref);
        return;
    }
    const uint16_t *got = (const uint16_t *)(frame->payload + y.begin);
    if (w->opt->tolerance > 0) {
        for (uint32_t t = 0; t < r->n; t++) {
            double num = 0, den = 0;
            for (uint32_t i = 0; i < s->hidden; i++) {
                double a = epd_bf16_to_f32(got[(size_t)t * s->hidden + i]);
                double b = epd_bf16_to_f32(ref[(size_t)t * s->hidden + i]);
                num += (a - b) * (a - b);
                den += b * b;
            }
            double rel = den > 0 ? sqrt(num / den) : sqrt(num);
            if (!(rel <= w->opt->tolerance)) {
                fail(w, "request %" PRIu64 " (N=%u, layer %u): token %u relative L2 error %.3g "
                     "above %.3g", r->id, r->n, r->layer, t, rel, w->opt->tolerance);
                free(ref);
                return;
            }
        }
        w->verified++;
        w->tokens += r->n;
    } else if (memcmp(ref, got, bytes) != 0) {
        size_t i = 0;
        while (got[i] == ref[i]) i++;
        fail(w, "request %" PRIu64 " (N=%u): y[%zu][%zu] = 0x%04x, reference 0x%04x", r->id, r->n,
             i / s->hidden, i % s->hidden, got[i], ref[i]);
    } else {
        w->verified++;
        w->tokens += r->n;
    }
    free(ref);
}

/* A SUBMIT with "layer" in its meta: ids, weights, x in one payload, as epd_frame_encode_submit
 * lays them out. */
static bool encode_submit_layer(const target_t *t, const request_t *r, epd_frame_out_t *out,
                                uint8_t **payload_p, char err[EPD_ERR_LEN])
{
    size_t nk = (size_t)r->n * t->shape.topk * 4, xb = (size_t)r->n * t->shape.hidden * 2;
    uint8_t *payload = malloc(2 * nk + xb);
    char meta_text[1024];
    cJSON *meta;
    epd_status_t status;

    if (payload == NULL) return false;
    memcpy(payload, r->ids, nk);
    memcpy(payload + nk, r->w, nk);
    memcpy(payload + 2 * nk, r->x, xb);
    snprintf(meta_text, sizeof meta_text,
             "{\"layer\":%u,\"tensors\":{"
             "\"topk_ids\":{\"dtype\":\"i32\",\"shape\":[%u,%u],\"data_offsets\":[0,%zu]},"
             "\"topk_weights\":{\"dtype\":\"f32\",\"shape\":[%u,%u],\"data_offsets\":[%zu,%zu]},"
             "\"x\":{\"dtype\":\"bf16\",\"shape\":[%u,%u],\"data_offsets\":[%zu,%zu]}}}",
             r->layer, r->n, t->shape.topk, nk, r->n, t->shape.topk, nk, 2 * nk, r->n,
             t->shape.hidden, 2 * nk, 2 * nk + xb);
    meta = cJSON_Parse(meta_text);
    /* the id as a raw literal: a double would not hold every u64 */
    char id_text[24];
    snprintf(id_text, sizeof id_text, "%" PRIu64, r->id);
    if (meta != NULL && cJSON_AddRawToObject(meta, "id", id_text) == NULL) {
        cJSON_Delete(meta);
        meta = NULL;
    }
    status = meta == NULL ? EPD_ERR_NO_MEMORY
                          : epd_frame_encode_json(EPD_FRAME_SUBMIT, meta, payload, 2 * nk + xb,
                                                  out, err);
    cJSON_Delete(meta);
    if (status != EPD_OK) {
        free(payload);
        return false;
    }
    *payload_p = payload;
    return true;
}

static bool send_request(worker_t *w, int fd, const request_t *r, char err[EPD_ERR_LEN])
{
    epd_frame_out_t out;
    if (w->opt->n_layers > 0) {
        uint8_t *payload = NULL;
        err[0] = '\0';
        bool ok = encode_submit_layer(w->target, r, &out, &payload, err) && send_frame(fd, &out);
        if (!ok && err[0] == '\0') snprintf(err, EPD_ERR_LEN, "send failed: %s", strerror(errno));
        free(payload);
        return ok;
    }
    if (epd_frame_encode_submit(r->id, r->n, w->target->shape.hidden, w->target->shape.topk, r->x,
                                r->ids, r->w, &out, err) != EPD_OK)
        return false;
    if (!send_frame(fd, &out)) {
        snprintf(err, EPD_ERR_LEN, "send failed: %s", strerror(errno));
        return false;
    }
    return true;
}

static void *worker_main(void *arg)
{
    worker_t *w = arg;
    const options_t *opt = w->opt;
    client_io_t *io = malloc(sizeof(*io));
    request_t *pending = calloc(opt->requests, sizeof(*pending));
    uint64_t rng = w->seed | 1;
    char err[EPD_ERR_LEN];
    uint32_t sent = 0, answered = 0;

    int fd = connect_to(w->target->path);
    if (io == NULL || pending == NULL || fd < 0) {
        fail(w, "client %u: cannot connect to %s: %s", w->index, w->target->path, strerror(errno));
        pthread_barrier_wait(w->connected);
        free(io);
        free(pending);
        if (fd >= 0) close(fd);
        return NULL;
    }
    io_init(io, fd);
    pthread_barrier_wait(w->connected);

    bool can_send = true;
    while (answered < sent || (can_send && sent < opt->requests)) {
        if (w->failure[0] != '\0') break;
        /* Keep up to `window` requests in flight; ids are distinct per client. */
        while (can_send && sent < opt->requests && sent - answered < opt->window) {
            request_t *r = &pending[sent];
            uint64_t id = ((uint64_t)w->index << 32) | sent;
            if (!request_make(r, id, w->target, opt, &rng)) {
                fail(w, "out of memory");
                break;
            }
            if (!send_request(w, fd, r, err)) {
                request_free(r);
                if (opt->until_closed) {
                    can_send = false; /* the daemon is closing: read what is still coming */
                    break;
                }
                fail(w, "client %u: %s", w->index, err);
                break;
            }
            sent++;
        }
        if (w->failure[0] != '\0' || answered == sent) break;
        epd_frame_t frame;
        if (!recv_frame(io, &frame, err)) {
            if (opt->until_closed) {
                w->unanswered += sent - answered;
                break;
            }
            fail(w, "client %u: %s", w->index, err);
            break;
        }
        if (frame.id_kind != EPD_FRAME_ID_VALID) {
            char *text = cJSON_PrintUnformatted(frame.meta);
            fail(w, "client %u: reply without an id: %s %s", w->index,
                 epd_frame_type_name((int)frame.type), text ? text : "");
            free(text);
            epd_frame_free(&frame);
            break;
        }
        uint32_t seq = (uint32_t)(frame.id & 0xffffffffu);
        bool mine = (frame.id >> 32) == w->index;
        if (!mine || seq >= sent || pending[seq].x == NULL) {
            fail(w, "client %u: reply for an unknown or already answered id %" PRIu64, w->index,
                 frame.id);
            epd_frame_free(&frame);
            break;
        }
        if (frame.type == EPD_FRAME_RESULT) {
            verify(w, &pending[seq], &frame);
        } else {
            const char *code = json_str(frame.meta, "code");
            if (frame.type == EPD_FRAME_ERROR && opt->retry_busy && strcmp(code, "busy") == 0) {
                w->busy_retries++;
                epd_frame_free(&frame);
                usleep(1000);
                if (!send_request(w, fd, &pending[seq], err)) {
                    if (opt->until_closed) {
                        can_send = false;
                        continue;
                    }
                    fail(w, "client %u: %s", w->index, err);
                    break;
                }
                continue;
            }
            if (frame.type == EPD_FRAME_ERROR && opt->until_closed &&
                strcmp(code, "shutting_down") == 0) {
                w->shutting_down++;
            } else {
                char *text = cJSON_PrintUnformatted(frame.meta);
                fail(w, "client %u: request %" PRIu64 " answered %s %s", w->index, frame.id,
                     epd_frame_type_name((int)frame.type), text ? text : "");
                free(text);
            }
        }
        request_free(&pending[seq]);
        answered++;
        epd_frame_free(&frame);
    }
    if (opt->hold_ms > 0) usleep(opt->hold_ms * 1000u);
    for (uint32_t i = 0; i < opt->requests; i++) request_free(&pending[i]);
    free(pending);
    epd_decoder_free(&io->dec);
    free(io);
    close(fd);
    return NULL;
}

static void usage(void)
{
    fprintf(stderr, "usage: check_client --socket PATH [--socket PATH]... [--seed S] [--clients C] "
                    "[--requests R] [--max-tokens N] [--window W] [--empty-slots] [--hold-ms MS] "
                    "[--expect-clients N] [--retry-busy] [--until-closed] [--quiet] "
                    "[--layers LIST] "
                    "[--tolerance REL] [--trickle-us US]\n");
    exit(2);
}

static uint32_t parse_u32_arg(const char *text, const char *name, uint32_t min, uint32_t max)
{
    uint64_t v;
    char err[EPD_ERR_LEN];
    if (epd_parse_u64(text, 10, min, max, &v, err) != EPD_OK) {
        fprintf(stderr, "check_client: %s: %s\n", name, err);
        exit(2);
    }
    return (uint32_t)v;
}

int main(int argc, char **argv)
{
    options_t opt = {.seed = 1, .clients = 2, .requests = 20, .max_tokens = 48, .window = 4};
    static const struct option longopts[] = {
        {"socket", required_argument, NULL, 's'},   {"seed", required_argument, NULL, 'S'},
        {"clients", required_argument, NULL, 'c'},  {"requests", required_argument, NULL, 'r'},
        {"max-tokens", required_argument, NULL, 'n'}, {"window", required_argument, NULL, 'w'},
        {"empty-slots", no_argument, NULL, 'e'},    {"hold-ms", required_argument, NULL, 'H'},
        {"expect-clients", required_argument, NULL, 'E'}, {"quiet", no_argument, NULL, 'q'},
        {"retry-busy", no_argument, NULL, 'B'},     {"until-closed", no_argument, NULL, 'U'},
        {"layers", required_argument, NULL, 'L'},
        {"tolerance", required_argument, NULL, 'T'},
        {"trickle-us", required_argument, NULL, 't'},
        {NULL, 0, NULL, 0},
    };
    int c;
    char err[EPD_ERR_LEN];
    uint64_t v;

    while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        switch (c) {
        case 's':
            if (opt.n_sockets == MAX_SOCKETS) usage();
            opt.sockets[opt.n_sockets++] = optarg;
            break;
        case 'S':
            if (epd_parse_u64(optarg, 0, 0, UINT64_MAX, &v, err) != EPD_OK) usage();
            opt.seed = v;
            break;
        case 'c': opt.clients = parse_u32_arg(optarg, "--clients", 1, 4096); break;
        case 'r': opt.requests = parse_u32_arg(optarg, "--requests", 1, 1000000); break;
        case 'n': opt.max_tokens = parse_u32_arg(optarg, "--max-tokens", 1, 1 << 20); break;
        case 'w': opt.window = parse_u32_arg(optarg, "--window", 1, 1 << 20); break;
        case 'e': opt.empty_slots = true; break;
        case 'H': opt.hold_ms = parse_u32_arg(optarg, "--hold-ms", 0, 600000); break;
        case 'E': opt.expect_clients = parse_u32_arg(optarg, "--expect-clients", 0, 1 << 20); break;
        case 'q': opt.quiet = true; break;
        case 'B': opt.retry_busy = true; break;
        case 'U': opt.until_closed = true; break;
        case 't': trickle_us = parse_u32_arg(optarg, "--trickle-us", 0, 1000000); break;
        case 'T':
            if (epd_parse_double(optarg, 1e-9, 1.0, &opt.tolerance, err) != EPD_OK) {
                fprintf(stderr, "check_client: --tolerance: %s\n", err);
                exit(2);
            }
            break;
        case 'L':
            if (epd_parse_u32_list(optarg, 4095, opt.layers, EPD_ARRAY_SIZE(opt.layers),
                                   &opt.n_layers, err) != EPD_OK || opt.n_layers == 0) {
                fprintf(stderr, "check_client: --layers: %s\n", err);
                exit(2);
            }
            break;
        default: usage();
        }
    }
    if (opt.n_sockets == 0 || optind != argc) usage();

    target_t targets[MAX_SOCKETS];
    for (int s = 0; s < opt.n_sockets; s++) {
        targets[s].path = opt.sockets[s];
        if (!describe_target(&targets[s], err)) {
            fprintf(stderr, "check_client: %s\n", err);
            return 1;
        }
    }

    size_t n_workers = (size_t)opt.n_sockets * opt.clients;
    worker_t *workers = calloc(n_workers, sizeof(*workers));
    pthread_barrier_t connected;
    if (workers == NULL) return 1;
    pthread_barrier_init(&connected, NULL, (unsigned)n_workers + 1);
    for (size_t i = 0; i < n_workers; i++) {
        worker_t *w = &workers[i];
        w->opt = &opt;
        w->target = &targets[i / opt.clients];
        /* Bit 30 of the id's high word marks this tool's ids; the rest is the worker index. */
        w->index = (uint32_t)i | (1u << 30);
        w->seed = opt.seed * 0x9E3779B97F4A7C15ull + i * 0xD1B54A32D192ED03ull;
        w->connected = &connected;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        if (pthread_create(&w->thread, &attr, worker_main, w) != 0) {
            fprintf(stderr, "check_client: cannot start thread %zu\n", i);
            return 1;
        }
        pthread_attr_destroy(&attr);
    }
    pthread_barrier_wait(&connected);
    int rc = 0;
    if (opt.expect_clients > 0) {
        /* Every worker is connected now (some may have failed, which they report). */
        client_io_t *io = malloc(sizeof(*io));
        int fd = connect_to(targets[0].path);
        cJSON *health = NULL;
        if (io != NULL && fd >= 0) {
            io_init(io, fd);
            health = control(io, "health", err);
            epd_decoder_free(&io->dec);
        }
        uint32_t clients = 0;
        if (health == NULL || !json_u32(health, "clients", &clients)) {
            fprintf(stderr, "check_client: health on %s failed: %s\n", targets[0].path, err);
            rc = 1;
        } else if (clients < opt.expect_clients) {
            fprintf(stderr, "check_client: rank %d counts %u clients, expected at least %u\n",
                    targets[0].rank, clients, opt.expect_clients);
            rc = 1;
        } else if (!opt.quiet) {
            printf("check_client: rank %d served %u clients at once\n", targets[0].rank, clients);
        }
        cJSON_Delete(health);
        if (fd >= 0) close(fd);
        free(io);
    }

    uint64_t verified = 0, tokens = 0, retries = 0, shutting = 0, unanswered = 0;
    for (size_t i = 0; i < n_workers; i++) {
        pthread_join(workers[i].thread, NULL);
        verified += workers[i].verified;
        tokens += workers[i].tokens;
        retries += workers[i].busy_retries;
        shutting += workers[i].shutting_down;
        unanswered += workers[i].unanswered;
        if (workers[i].failure[0] != '\0') {
            fprintf(stderr, "check_client: FAIL: %s\n", workers[i].failure);
            rc = 1;
        }
    }
    const epd_moe_shape_t *s = &targets[0].shape;
    bool bf16 = s->dtype == EPD_WIRE_BF16;
    printf("check_client: %" PRIu64 " of %zu requests (%" PRIu64 " tokens) equal the reference %s"
           "; %d sockets x %u clients, world %u, H %u, K %u, E %u, %s%s%s, experts %s\n",
           verified, n_workers * opt.requests, tokens,
           opt.tolerance > 0 ? "within the tolerance" : "bit for bit", opt.n_sockets, opt.clients,
           s->world,
           s->hidden, s->topk, s->num_experts, bf16 ? "bf16" : "fp8",
           bf16 ? "" : (s->scale == EPD_SCALE_PER_TOKEN ? " per_token" : " group128"),
           bf16 ? "" : (s->scale_format == EPD_SCALE_FMT_UE8M0 ? " ue8m0" : " fp32"),
           s->expert_kind == EPD_EXPERTS_IDENTITY ? "identity"
           : s->expert_kind == EPD_EXPERTS_FFN    ? "ffn"
                                                  : "scale");
    if (opt.n_layers > 0) printf("check_client: requests spread over %zu layers\n", opt.n_layers);
    epd_ffn_free(ffn_all);
    if (opt.retry_busy || opt.until_closed)
        printf("check_client: %" PRIu64 " busy answers retried, %" PRIu64
               " answered shutting_down, %" PRIu64 " sent but unanswered when the daemon closed\n",
               retries, shutting, unanswered);
    if (!opt.until_closed && verified != n_workers * opt.requests) rc = 1;
    if (opt.until_closed && verified == 0) {
        fprintf(stderr, "check_client: no request was answered before the daemon closed\n");
        rc = 1;
    }
    pthread_barrier_destroy(&connected);
    free(workers);
    return rc;
}
