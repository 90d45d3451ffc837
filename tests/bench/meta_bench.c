/* The metas on a request's path, decoded alone (issue 25): a SUBMIT in device regions (1 and 128
 * tokens) and in the frame (128 tokens), a RESULT into a region, and an EXPERTS of 256 counts.
 * For each, per decode (median of the rounds, this machine's CPU):
 *   cjson       cJSON_ParseWithLength and cJSON_Delete, the baseline of every ratio;
 *   tree        the checks and the tree as the decoder built it before (the strict grammar,
 *               then epd_json_build: one allocation a node, a key and a string; cJSON_Delete);
 *   decoder     epd_decoder_feed of the whole frame, as the daemon and libepd decode it now
 *               (these compact metas in one pass that checks as it builds, epd_json_build_simple;
 *               others through the UTF-8 and strict checks and the tree in one block), and
 *               epd_frame_free;
 *   +validate   (SUBMITs) the decoder, then epd_submit_validate_regions with regions that
 *               resolve to host memory and a memcpy for the device fetch.
 * Under valgrind --tool=callgrind the same code counts instructions: --way W runs that way only
 * (and the checks' one decode each), e.g. --way decoder --rounds 1 --iters 1000; --case I
 * times the I-th meta of the table only (0: the 1-token SUBMIT).
 *   meta-bench [--iters N] [--rounds R] [--way cjson|tree|decoder|+validate] [--case I] */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/clock.h"
#include "proto/frame.h"
#include "proto/json_build.h"
#include "proto/json_strict.h"

#define HIDDEN 7168u
#define TOPK 8u
#define EXPERTS 256u

static uint8_t host[2u << 20]; /* where every region's tensors are */

static epd_status_t resolve(void *arg, uint32_t region, uint64_t begin, uint64_t end,
                            epd_region_span_t *span, char err[EPD_ERR_LEN])
{
    (void)arg;
    (void)region;
    (void)err;
    span->device = true;
    span->region = host;
    span->ptr = end <= sizeof host ? host + begin : host;
    return EPD_OK;
}

static epd_status_t fetch(void *arg, const void *a, size_t a_bytes, void *a_dst, const void *b,
                          size_t b_bytes, void *b_dst, const uint16_t *x, uint64_t x_n,
                          int64_t *x_bad_p, char err[EPD_ERR_LEN])
{
    (void)arg;
    (void)x;
    (void)x_n;
    (void)err;
    if (a_bytes > 0) memcpy(a_dst, a, a_bytes);
    if (b_bytes > 0) memcpy(b_dst, b, b_bytes);
    if (x_bad_p != NULL) *x_bad_p = -1;
    return EPD_OK;
}

typedef struct {
    const char *name;
    epd_frame_type_t type;
    char meta[4096];
    bool submit;
    uint32_t tokens;
} meta_case_t;

static double median(double *v, int n)
{
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && v[j - 1] > v[j]; j--) {
            double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return v[n / 2];
}

enum { WAY_CJSON, WAY_TREE, WAY_DECODER, WAY_VALIDATE, WAYS };
static const char *const way_names[WAYS] = {"cjson", "tree", "decoder", "+validate"};

/* One decode of c the given way; false on a failure (printed). */
static bool run_once(const meta_case_t *c, int way, const uint8_t *frame_bytes, size_t frame_len)
{
    char err[EPD_ERR_LEN];
    size_t len = strlen(c->meta);
    if (way == WAY_CJSON) {
        cJSON *t = cJSON_ParseWithLength(c->meta, len);
        if (t == NULL) return false;
        cJSON_Delete(t);
        return true;
    }
    if (way == WAY_TREE) {
        if (epd_json_strict_check(c->meta, len, err) != EPD_OK) return false;
        cJSON *t = epd_json_build(c->meta, len);
        if (t == NULL) return false;
        cJSON_Delete(t);
        return true;
    }
    epd_decoder_t dec;
    epd_decoder_init(&dec, 1u << 30, EPD_FRAME_MAX_META);
    epd_frame_t frame;
    size_t used = 0;
    epd_status_t st = epd_decoder_feed(&dec, frame_bytes, frame_len, &used, &frame, err);
    bool ok = st == EPD_OK;
    if (!ok) fprintf(stderr, "meta-bench: %s: decode: %s\n", c->name, err);
    if (ok && way == WAY_VALIDATE) {
        epd_submit_limits_t limits = {.hidden = HIDDEN, .topk = TOPK, .num_experts = EXPERTS,
                                      .max_tokens = 4096};
        epd_submit_regions_t regions;
        memset(&regions, 0, sizeof regions);
        regions.resolve = resolve;
        regions.device_fetch = fetch;
        epd_submit_view_t view;
        st = epd_submit_validate_regions(&frame, &limits, &regions, &view, err);
        ok = st == EPD_OK;
        if (!ok) fprintf(stderr, "meta-bench: %s: validate: %s\n", c->name, err);
        free(view.owned);
    }
    if (ok) epd_frame_free(&frame);
    epd_decoder_free(&dec);
    return ok;
}

int main(int argc, char **argv)
{
    int iters = 20000, rounds = 7, only = -1, only_case = -1;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc)
            iters = atoi(argv[++i]);
        else if (strcmp(argv[i], "--way") == 0 && i + 1 < argc) {
            i++;
            for (int w = 0; w < WAYS; w++)
                if (strcmp(argv[i], way_names[w]) == 0) only = w;
            if (only < 0) {
                fprintf(stderr, "meta-bench: --way %s: not cjson, tree, decoder or +validate\n", argv[i]);
                return 2;
            }
        }
        else if (strcmp(argv[i], "--rounds") == 0 && i + 1 < argc)
            rounds = atoi(argv[++i]);
        else if (strcmp(argv[i], "--case") == 0 && i + 1 < argc)
            only_case = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: meta-bench [--iters N] [--rounds R] [--way W] [--case I]\n");
            return 2;
        }
    }
    if (iters < 1 || rounds < 1 || rounds > 99) return 2;
    /* ids distinct within a token, in range; weights finite */
    int32_t *ids = (int32_t *)(void *)host;
    float *w = (float *)(void *)(host + 128 * TOPK * 4);
    for (uint32_t t = 0; t < 128; t++)
        for (uint32_t k = 0; k < TOPK; k++) {
            ids[t * TOPK + k] = (int32_t)((t * 37 + k * 29) % EXPERTS);
            w[t * TOPK + k] = 0.125f;
        }

    meta_case_t cases[5];
    memset(cases, 0, sizeof cases);
    int n = 0;
    for (int k = 0; k < 2; k++) {
        uint32_t tokens = k == 0 ? 1 : 128;
        meta_case_t *c = &cases[n++];
        c->name = k == 0 ? "SUBMIT, device regions, 1 token" : "SUBMIT, device regions, 128 tokens";
        c->type = EPD_FRAME_SUBMIT;
        c->submit = true;
        c->tokens = tokens;
        snprintf(c->meta, sizeof c->meta,
                 "{\"id\":1099511627776,\"layer\":3,\"tensors\":{"
                 "\"topk_ids\":{\"dtype\":\"i32\",\"shape\":[%u,%u],\"region\":1,\"offset\":0},"
                 "\"topk_weights\":{\"dtype\":\"f32\",\"shape\":[%u,%u],\"region\":1,\"offset\":4096},"
                 "\"x\":{\"dtype\":\"bf16\",\"shape\":[%u,%u],\"region\":1,\"offset\":8192},"
                 "\"y\":{\"dtype\":\"bf16\",\"shape\":[%u,%u],\"region\":1,\"offset\":1843200}}}",
                 tokens, TOPK, tokens, TOPK, tokens, HIDDEN, tokens, HIDDEN);
    }
    meta_case_t *r = &cases[n++];
    r->name = "RESULT, y in a region, 128 tokens";
    r->type = EPD_FRAME_RESULT;
    snprintf(r->meta, sizeof r->meta,
             "{\"id\":1099511627776,\"step\":123456,\"tensors\":{\"y\":{\"dtype\":\"bf16\","
             "\"shape\":[128,%u],\"region\":1,\"offset\":1843200}}}",
             HIDDEN);
    meta_case_t *e = &cases[n++];
    e->name = "EXPERTS, 256 counts (a tree)";
    e->type = EPD_FRAME_EXPERTS;
    char *p = e->meta;
    p += sprintf(p, "{\"step\":12345,\"layer\":0,\"first_expert\":0,\"input\":\"fp8_group128\","
                    "\"layout\":\"packed\",\"rows\":16384,\"counts\":[");
    for (int i = 0; i < 256; i++) p += sprintf(p, "%s%d", i ? "," : "", 40 + i % 50);
    sprintf(p, "],\"tensors\":{\"x\":{\"dtype\":\"f8_e4m3\",\"shape\":[16384,7168],\"region\":1,"
               "\"offset\":0},\"y\":{\"dtype\":\"bf16\",\"shape\":[16384,7168],\"region\":2,"
               "\"offset\":0}},\"sent_ns\":81236417223054}");

    printf("meta-bench: ns per decode, median of %d rounds of %d (ratio: cjson's time over the "
           "way's, same run)\n", rounds, iters);
    printf("%-36s %6s %10s %10s %10s %10s\n", "meta", "bytes", way_names[0], way_names[1],
           way_names[2], way_names[3]);
    int rc = 0;
    for (int i = 0; i < n; i++) {
        if (only_case >= 0 && i != only_case) continue;
        const meta_case_t *c = &cases[i];
        epd_frame_out_t out;
        char err[EPD_ERR_LEN];
        if (epd_frame_encode_text(c->type, c->meta, &out, err) != EPD_OK) {
            fprintf(stderr, "meta-bench: %s: %s\n", c->name, err);
            return 1;
        }
        double ns[WAYS] = {0};
        for (int way = 0; way < WAYS; way++) {
            if (way == WAY_VALIDATE && !c->submit) continue;
            if (only >= 0 && way != only) continue;
            double t[99];
            for (int round = 0; round < rounds; round++) {
                uint64_t t0 = epd_now_ns();
                for (int it = 0; it < iters; it++)
                    if (!run_once(c, way, out.head, out.head_len)) return 1;
                t[round] = (double)(epd_now_ns() - t0) / iters;
            }
            ns[way] = median(t, rounds);
        }
        printf("%-36s %6zu %10.0f %10.0f %10.0f", c->name, strlen(c->meta), ns[0], ns[1], ns[2]);
        if (c->submit) printf(" %10.0f", ns[3]);
        printf("\n%-36s %6s %10s %9.2fx %9.2fx\n", "", "", "1.00x", ns[0] / ns[1], ns[0] / ns[2]);
        epd_frame_out_free(&out);
    }
    return rc;
}
