/* Integration-test client of libepd's expert worker (epd_client_serve_experts): ONE connection,
 * one thread, that serves its rank's experts (scale experts in C) and submits its own batches,
 * as a single-threaded frontend does; its submits must never deadlock with its own rank's step.
 * Every RESULT must equal epd_moe_reference with experts.kind = scale bit for bit (the inputs are
 * chosen so that x' * f_e is a BF16 number, see tests/python/test_external.py). The daemon must
 * be one rank with experts.kind = external; its shape comes from its config reply.
 *   external_check SOCKET [BATCHES]
 * Exit 0 when every answer is right.
 *   external_check SOCKET --latency TOKENS STEPS [host] [spin=US]
 * The hand-over latency with device regions (GPU 0, CUDA through proto/cuda_dl.c; `host`: host
 * regions, for CPU ranks): the worker's input and output regions and the request's x, ids,
 * weights and y in device memory, TOKENS
 * random tokens a step, STEPS steps; the worker answers at once (its outputs stay zero: the
 * exchange is timed, not experts). Prints the p50 and p90 of EXPERTS written (the daemon's
 * sent_ns) -> this client read it, and of the whole submit. spin=US: the client polls the socket
 * that long before it sleeps (epd_client_set_spin). */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/bf16.h"
#include "common/clock.h"
#include "common/rng.h"
#include "gpu/fp8.h"
#include "gpu/ops.h"
#include "proto/cuda_dl.h"
#include "proto/epd.h"

typedef struct worker {
    uint32_t num_experts;
    unsigned batches, rows;
} worker_t;

/* scale experts: y = bf16((x' as the format gives it) * (1 + e/E)) */
static int scale_worker(void *arg, const epd_client_experts_t *b)
{
    worker_t *w = arg;
    uint32_t H = b->hidden, at = 0;
    bool fp8 = strcmp(b->input, "bf16") != 0, per_tensor = strcmp(b->input, "fp8_per_tensor") == 0;

    if (b->x == NULL || b->y == NULL) return 1;
    for (uint32_t i = 0; i < b->n_experts; i++) {
        uint32_t first = b->masked ? i * b->capacity : at;
        float f = 1.0f + (float)(b->first_expert + i) / (float)w->num_experts;
        for (uint32_t r = first; r < first + b->counts[i]; r++) {
            for (uint32_t h = 0; h < H; h++) {
                float x;
                if (!fp8) {
                    x = epd_bf16_to_f32(((const uint16_t *)b->x)[(size_t)r * H + h]);
                } else {
                    float q = epd_e4m3_to_f32(((const uint8_t *)b->x)[(size_t)r * H + h]);
                    float s = per_tensor ? b->scale
                                         : b->scales[(size_t)r * b->scales_per_row +
                                                     h * b->scales_per_row / H];
                    x = q * s;
                }
                b->y[(size_t)r * H + h] = epd_f32_to_bf16(x * f);
            }
        }
        at += b->counts[i];
        w->rows += b->counts[i];
    }
    w->batches++;
    return 0;
}

static uint32_t cfg_u32(const cJSON *cfg, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, key);
    return cJSON_IsNumber(v) ? (uint32_t)v->valuedouble : 0;
}

static const char *cfg_str(const cJSON *cfg, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, key);
    return cJSON_IsString(v) ? v->valuestring : "";
}

static int fail(epd_client_t *c, const char *what)
{
    fprintf(stderr, "external_check: %s: %s: %s\n", what, epd_client_last_error(c),
            epd_client_last_message(c));
    return 1;
}

/* A random expert in [0, E) that is none of the token's first k ids. */
static int32_t distinct_expert(uint64_t *rng, const int32_t *row, uint32_t k, uint32_t E)
{
    for (;;) {
        int32_t e = (int32_t)(epd_rng_next(rng) % E);
        bool dup = false;
        for (uint32_t q = 0; q < k; q++) dup |= row[q] == e;
        if (!dup) return e;
    }
}

/* ---- --latency ---- */

typedef struct lat_worker {
    double *seen_us, *read_us; /* sent -> handed to the callback; sent -> its recv returned */
    unsigned n, cap;
} lat_worker_t;

static int lat_worker(void *arg, const epd_client_experts_t *b)
{
    lat_worker_t *w = arg;
    if (w->n < w->cap && b->sent_ns != 0) {
        w->read_us[w->n] = (double)(int64_t)(b->read_ns - b->sent_ns) / 1e3;
        w->seen_us[w->n++] = (double)(b->seen_ns - b->sent_ns) / 1e3;
    }
    return 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* p-th fraction of v[n] (sorted in place) */
static double pct(double *v, unsigned n, double p)
{
    qsort(v, n, sizeof *v, cmp_double);
    return n ? v[(unsigned)(p * (n - 1))] : 0.0;
}

/* The request: x random bf16, ids distinct, weights (y after them) into req. */
static void latency_request(uint8_t *req, uint32_t n, uint32_t H, uint32_t K, uint32_t E)
{
    size_t x_bytes = (size_t)n * H * 2, ids_bytes = (size_t)n * K * 4;
    uint64_t rng = 7;
    uint16_t *x = (uint16_t *)req;
    int32_t *ids = (int32_t *)(req + x_bytes);
    float *w = (float *)(req + x_bytes + ids_bytes);
    for (size_t i = 0; i < (size_t)n * H; i++) x[i] = epd_f32_to_bf16(epd_rng_unit_f32(&rng) - 0.5f);
    for (uint32_t t = 0; t < n; t++)
        for (uint32_t k = 0; k < K; k++) {
            ids[(size_t)t * K + k] = distinct_expert(&rng, ids + (size_t)t * K, k, E);
            w[(size_t)t * K + k] = 1.0f / (float)K;
        }
}

/* The worker's and the request's regions in GPU 0's memory (registered as device regions). */
static int latency_regions_cuda(epd_client_t *c, uint32_t n, uint32_t H, uint32_t K, uint32_t E,
                                uint64_t in_bytes, uint64_t out_bytes, size_t req_bytes,
                                uint32_t *r_in, uint32_t *r_out, uint32_t *r_req)
{
    epd_cuda_dl_t cu;
    char err[256];
    if (!epd_cuda_dl_open(&cu, err, sizeof err)) {
        printf("SKIP: %s\n", err);
        return 77;
    }
    void *in_d = NULL, *out_d = NULL, *req_d = NULL;
    uint8_t h_in[64], h_out[64], h_req[64];
    int cr = cu.set_device(0);
    if (cr == 0) cr = cu.malloc(&in_d, in_bytes);
    if (cr == 0) cr = cu.malloc(&out_d, out_bytes);
    if (cr == 0) cr = cu.malloc(&req_d, req_bytes);
    if (cr == 0) cr = cu.ipc_get_mem_handle(h_in, in_d);
    if (cr == 0) cr = cu.ipc_get_mem_handle(h_out, out_d);
    if (cr == 0) cr = cu.ipc_get_mem_handle(h_req, req_d);
    if (cr != 0) {
        fprintf(stderr, "external_check: cuda: %s\n", cu.error_string(cr));
        return 1;
    }
    /* zero outputs, the request */
    uint8_t *zero = calloc(1, out_bytes > req_bytes ? out_bytes : req_bytes);
    uint8_t *req = calloc(1, req_bytes);
    latency_request(req, n, H, K, E);
    cu.memcpy(out_d, zero, out_bytes, 1);
    cu.memcpy(req_d, req, req_bytes, 1);
    cu.device_synchronize();
    free(zero);
    free(req);
    if (epd_client_register_cuda(c, h_in, 0, in_bytes, r_in) != EPD_CLIENT_OK ||
        epd_client_register_cuda(c, h_out, 0, out_bytes, r_out) != EPD_CLIENT_OK ||
        epd_client_register_cuda(c, h_req, 0, req_bytes, r_req) != EPD_CLIENT_OK)
        return fail(c, "register cuda");
    return 0;
}

/* The same in host regions (memfds), for a daemon on CPU ranks. */
static int latency_regions_host(epd_client_t *c, uint32_t n, uint32_t H, uint32_t K, uint32_t E,
                                uint64_t in_bytes, uint64_t out_bytes, size_t req_bytes,
                                uint32_t *r_in, uint32_t *r_out, uint32_t *r_req)
{
    void *in_map, *out_map, *req_map;
    if (epd_client_register_host(c, in_bytes, r_in, &in_map) != EPD_CLIENT_OK ||
        epd_client_register_host(c, out_bytes, r_out, &out_map) != EPD_CLIENT_OK ||
        epd_client_register_host(c, req_bytes, r_req, &req_map) != EPD_CLIENT_OK)
        return fail(c, "register host");
    latency_request(req_map, n, H, K, E);
    return 0;
}

static int latency(epd_client_t *c, uint32_t H, uint32_t K, uint32_t E, uint32_t n,
                   unsigned steps, bool host, unsigned spin_us, uint64_t in_bytes,
                   uint64_t out_bytes)
{
    size_t x_bytes = (size_t)n * H * 2, ids_bytes = (size_t)n * K * 4;
    size_t req_bytes = 2 * x_bytes + 2 * ids_bytes + 64;
    uint32_t r_in, r_out, r_req;
    int rc = host ? latency_regions_host(c, n, H, K, E, in_bytes, out_bytes, req_bytes, &r_in,
                                         &r_out, &r_req)
                  : latency_regions_cuda(c, n, H, K, E, in_bytes, out_bytes, req_bytes, &r_in,
                                         &r_out, &r_req);
    if (rc != 0) return rc;
    epd_client_set_spin(c, spin_us);
    lat_worker_t lw = {.seen_us = calloc(steps, sizeof(double)),
                       .read_us = calloc(steps, sizeof(double)), .cap = steps};
    double *call_us = calloc(steps, sizeof(double));
    if (epd_client_serve_experts(c, r_in, r_out, lat_worker, &lw, NULL) != EPD_CLIENT_OK)
        return fail(c, "serve_experts");
    uint64_t y_off = (x_bytes + 2 * ids_bytes + 15) / 16 * 16;
    epd_client_request_t r = {.n_tokens = n, .hidden = H, .topk = K, .layer = -1,
                              .x = {.region = r_req, .offset = 0},
                              .topk_ids = {.region = r_req, .offset = x_bytes},
                              .topk_weights = {.region = r_req, .offset = x_bytes + ids_bytes},
                              .y = {.region = r_req, .offset = y_off}};
    for (unsigned i = 0; i < steps; i++) {
        r.id = i + 1;
        uint64_t t0 = epd_now_ns();
        if (epd_client_submit_request(c, &r, NULL, NULL) != EPD_CLIENT_OK)
            return fail(c, "submit");
        call_us[i] = (double)(epd_now_ns() - t0) / 1e3;
    }
    unsigned skip = steps / 10, m = lw.n > skip ? lw.n - skip : 0;
    printf("tokens %u, rows %u a step, %u steps (C worker, %s regions, spin %u us): EXPERTS "
           "written -> worker read it p50 %.1f us p90 %.1f us (of which -> the recv that "
           "completed it returned: p50 %.1f us); whole submit p50 %.1f us\n", n,
           n * K, steps, host ? "host" : "device", spin_us, pct(lw.seen_us + skip, m, 0.5),
           pct(lw.seen_us + skip, m, 0.9), pct(lw.read_us + skip, m, 0.5),
           pct(call_us + skip, steps - skip, 0.5));
    free(lw.seen_us);
    free(lw.read_us);
    free(call_us);
    epd_client_destroy(c);
    return m > 0 ? 0 : 1;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: external_check SOCKET [BATCHES]\n");
        return 2;
    }
    unsigned n_batches = argc > 2 ? (unsigned)strtoul(argv[2], NULL, 10) : 24;
    epd_client_t *c = epd_client_create();
    char *json = NULL;
    if (c == NULL || epd_client_connect(c, argv[1], 10000) != EPD_CLIENT_OK)
        return fail(c, "connect");
    if (epd_client_control(c, "config", &json, NULL, NULL) != EPD_CLIENT_OK)
        return fail(c, "config");
    cJSON *cfg = cJSON_Parse(json);
    epd_client_free(json);
    epd_moe_shape_t shape;
    memset(&shape, 0, sizeof shape);
    shape.hidden = cfg_u32(cfg, "model.hidden");
    shape.topk = cfg_u32(cfg, "model.topk");
    shape.num_experts = cfg_u32(cfg, "model.num_experts");
    shape.world = 1;
    shape.dtype = strcmp(cfg_str(cfg, "dispatch.dtype"), "bf16") == 0 ? EPD_WIRE_BF16 : EPD_WIRE_FP8;
    shape.scale = strcmp(cfg_str(cfg, "dispatch.scale"), "per_token") == 0 ? EPD_SCALE_PER_TOKEN
                                                                           : EPD_SCALE_GROUP128;
    shape.scale_format = strcmp(cfg_str(cfg, "dispatch.scale_format"), "ue8m0") == 0
                             ? EPD_SCALE_FMT_UE8M0
                             : EPD_SCALE_FMT_FP32;
    shape.expert_kind = EPD_EXPERTS_SCALE;
    shape.combine_dtype = strcmp(cfg_str(cfg, "combine.dtype"), "fp8") == 0 ? EPD_COMBINE_FP8
                                                                           : EPD_COMBINE_BF16;
    uint32_t max_n = cfg_u32(cfg, "dispatch.max_tokens_per_request");
    uint32_t H = shape.hidden, K = shape.topk, E = shape.num_experts;
    uint64_t in_bytes = 64u << 20, out_bytes = 64u << 20;
    cJSON_Delete(cfg);
    if (argc >= 5 && strcmp(argv[2], "--latency") == 0) {
        uint32_t n = (uint32_t)strtoul(argv[3], NULL, 10);
        uint64_t rows = (uint64_t)n * K;
        bool host = false;
        unsigned spin_us = 0;
        for (int a = 5; a < argc; a++) {
            if (strcmp(argv[a], "host") == 0) host = true;
            else if (strncmp(argv[a], "spin=", 5) == 0) spin_us = (unsigned)strtoul(argv[a] + 5, NULL, 10);
            else {
                fprintf(stderr, "external_check: --latency: unknown option %s\n", argv[a]);
                return 2;
            }
        }
        /* x and fp32 group scales (the largest format), counts: rounded up */
        return latency(c, H, K, E, n, (unsigned)strtoul(argv[4], NULL, 10), host, spin_us,
                       rows * H * 2 + rows * (H / 128) * 4 + 4096 + 64 * (uint64_t)E,
                       rows * H * 2 + 256);
    }

    uint32_t in_id, out_id;
    void *in_map, *out_map;
    if (epd_client_register_host(c, in_bytes, &in_id, &in_map) != EPD_CLIENT_OK ||
        epd_client_register_host(c, out_bytes, &out_id, &out_map) != EPD_CLIENT_OK)
        return fail(c, "register");
    worker_t w = {.num_experts = E};
    char *reply = NULL;
    if (epd_client_serve_experts(c, in_id, out_id, scale_worker, &w, &reply) != EPD_CLIENT_OK)
        return fail(c, "serve_experts");
    printf("serve_experts: %s\n", reply);
    epd_client_free(reply);

    uint64_t rng = 2026;
    uint16_t *x = malloc((size_t)max_n * H * 2), *y = malloc((size_t)max_n * H * 2);
    uint16_t *ref = malloc((size_t)max_n * H * 2);
    int32_t *ids = malloc((size_t)max_n * K * 4);
    float *wt = malloc((size_t)max_n * K * 4);
    int bad = 0;
    for (unsigned i = 0; i < n_batches && !bad; i++) {
        uint32_t n = 1 + (uint32_t)(epd_rng_next(&rng) % max_n);
        for (uint32_t t = 0; t < n; t++) {
            for (uint32_t g = 0; g < H / 128; g++) {
                int j = (int)(epd_rng_next(&rng) % 5) - 2;
                float amax = ldexpf(1.75f, j);
                for (uint32_t h = g * 128; h < (g + 1) * 128; h++) {
                    float m = (float)(8 + epd_rng_next(&rng) % 8) / 8.0f;
                    float v = ldexpf(m, j - (int)(epd_rng_next(&rng) % 6));
                    if (v > amax) v = amax;
                    x[(size_t)t * H + h] = epd_f32_to_bf16(epd_rng_next(&rng) & 1 ? -v : v);
                }
                x[(size_t)t * H + g * 128 + epd_rng_next(&rng) % 128] = epd_f32_to_bf16(amax);
            }
            for (uint32_t k = 0; k < K; k++) {
                int32_t e = distinct_expert(&rng, ids + (size_t)t * K, k, E);
                ids[(size_t)t * K + k] = epd_rng_next(&rng) % 8 == 0 ? -1 : e;
                wt[(size_t)t * K + k] = (float)(epd_rng_next(&rng) % 1000) / 997.0f;
            }
        }
        epd_client_batch_t batch = {.id = i + 1, .n_tokens = n, .hidden = H, .topk = K,
                                    .x = x, .topk_ids = ids, .topk_weights = wt};
        if (epd_client_submit(c, &batch, y, NULL) != EPD_CLIENT_OK) return fail(c, "submit");
        if (epd_moe_reference(&shape, n, x, ids, wt, ref) != EPD_OK) {
            fprintf(stderr, "external_check: the reference failed\n");
            return 1;
        }
        for (size_t v = 0; v < (size_t)n * H && !bad; v++) {
            if (y[v] != ref[v]) {
                fprintf(stderr, "external_check: batch %u token %zu column %zu: 0x%04x, scale "
                        "gives 0x%04x\n", i, v / H, v % H, y[v], ref[v]);
                bad = 1;
            }
        }
    }
    if (!bad && w.batches == 0) {
        fprintf(stderr, "external_check: the worker was never called\n");
        bad = 1;
    }
    if (!bad)
        printf("PASS: %u batches on one connection that submits and serves (%u EXPERTS, %u rows) "
               "equal scale experts bit for bit\n", n_batches, w.batches, w.rows);
    free(x);
    free(y);
    free(ref);
    free(ids);
    free(wt);
    epd_client_destroy(c);
    return bad;
}
