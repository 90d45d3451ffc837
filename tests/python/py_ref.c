/* py_ref: what the C side says for one batch, for the Python client's tests. Reads a batch from
 * a file, sends it through libepd to the rank at SOCKET, and writes libepd's y and the host
 * reference's y (epd_moe_reference, shaped by the daemon's own config and health replies).
 *   py_ref SOCKET IN OUT
 *   py_ref - IN OUT WORLD EXPERTS DTYPE SCALE FORMAT KIND COMBINE   the reference alone, for
 *          that shape (DTYPE bf16|fp8, SCALE group128|per_token, FORMAT fp32|ue8m0,
 *          KIND identity|scale, COMBINE bf16|fp8); OUT then holds the reference's y twice
 * IN: u32 N, H, K, then x bf16 [N,H], topk_ids i32 [N,K], topk_weights f32 [N,K] (little-endian).
 * OUT: y of libepd bf16 [N,H], then y of the reference bf16 [N,H]. Exit 0 ok, 1 on any failure
 * (the reason on stderr). */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "gpu/ops.h"
#include "proto/epd.h"

static int fail(const char *what, epd_client_t *c)
{
    fprintf(stderr, "py_ref: %s%s%s%s%s\n", what, c ? ": " : "", c ? epd_client_last_error(c) : "",
            c ? " " : "", c ? epd_client_last_message(c) : "");
    return 1;
}

/* The reply of op as a cJSON object (NULL on failure). */
static cJSON *control(epd_client_t *c, const char *op)
{
    char *json = NULL;
    cJSON *obj;
    if (epd_client_control(c, op, &json, NULL, NULL) != EPD_CLIENT_OK) return NULL;
    obj = cJSON_Parse(json);
    epd_client_free(json);
    return obj;
}

static const char *str_of(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : "";
}

static uint32_t u32_of(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) && v->valuedouble >= 0 ? (uint32_t)v->valuedouble : 0;
}

static int read_all(FILE *f, void *buf, size_t bytes)
{
    return fread(buf, 1, bytes, f) == bytes ? 0 : -1;
}

int main(int argc, char **argv)
{
    uint32_t head[3];
    FILE *in, *out;
    epd_client_t *c;
    cJSON *cfg, *health;
    epd_moe_shape_t shape;
    int rc = 1;

    bool ref_only = argc == 11 && strcmp(argv[1], "-") == 0;
    if (argc != 4 && !ref_only) {
        fprintf(stderr, "usage: py_ref SOCKET IN OUT | py_ref - IN OUT WORLD EXPERTS DTYPE SCALE "
                        "FORMAT KIND COMBINE\n");
        return 2;
    }
    in = fopen(argv[2], "rb");
    if (in == NULL || read_all(in, head, sizeof head) != 0) return fail("cannot read IN", NULL);
    size_t nh = (size_t)head[0] * head[1], nk = (size_t)head[0] * head[2];
    uint16_t *x = malloc(nh * 2), *y = malloc(nh * 2), *ref = malloc(nh * 2);
    int32_t *ids = malloc(nk * 4);
    float *w = malloc(nk * 4);
    if (x == NULL || y == NULL || ref == NULL || ids == NULL || w == NULL)
        return fail("out of memory", NULL);
    if (read_all(in, x, nh * 2) || read_all(in, ids, nk * 4) || read_all(in, w, nk * 4))
        return fail("IN is shorter than its header says", NULL);
    fclose(in);

    if (ref_only) {
        memset(&shape, 0, sizeof shape);
        shape.hidden = head[1];
        shape.topk = head[2];
        shape.world = (uint32_t)strtoul(argv[4], NULL, 10);
        shape.num_experts = (uint32_t)strtoul(argv[5], NULL, 10);
        shape.dtype = strcmp(argv[6], "bf16") == 0 ? EPD_WIRE_BF16 : EPD_WIRE_FP8;
        shape.scale = strcmp(argv[7], "per_token") == 0 ? EPD_SCALE_PER_TOKEN : EPD_SCALE_GROUP128;
        shape.scale_format =
            strcmp(argv[8], "ue8m0") == 0 ? EPD_SCALE_FMT_UE8M0 : EPD_SCALE_FMT_FP32;
        shape.expert_kind = strcmp(argv[9], "identity") == 0 ? EPD_EXPERTS_IDENTITY
                                                              : EPD_EXPERTS_SCALE;
        shape.combine_dtype = strcmp(argv[10], "fp8") == 0 ? EPD_COMBINE_FP8 : EPD_COMBINE_BF16;
        if (epd_moe_reference(&shape, head[0], x, ids, w, ref) != EPD_OK)
            return fail("epd_moe_reference failed", NULL);
        out = fopen(argv[3], "wb");
        if (out == NULL || fwrite(ref, 2, nh, out) != nh || fwrite(ref, 2, nh, out) != nh ||
            fclose(out) != 0)
            return fail("cannot write OUT", NULL);
        return 0;
    }
    c = epd_client_create();
    if (c == NULL || epd_client_connect(c, argv[1], 10000) != EPD_CLIENT_OK)
        return fail("connect", c);
    cfg = control(c, "config");
    health = control(c, "health");
    if (cfg == NULL || health == NULL) return fail("config/health", c);
    memset(&shape, 0, sizeof shape);
    shape.hidden = u32_of(cfg, "model.hidden");
    shape.topk = u32_of(cfg, "model.topk");
    shape.num_experts = u32_of(cfg, "model.num_experts");
    shape.world = u32_of(health, "world");
    shape.rank = u32_of(health, "rank");
    shape.dtype = strcmp(str_of(cfg, "dispatch.dtype"), "bf16") == 0 ? EPD_WIRE_BF16 : EPD_WIRE_FP8;
    shape.scale = strcmp(str_of(cfg, "dispatch.scale"), "per_token") == 0 ? EPD_SCALE_PER_TOKEN
                                                                          : EPD_SCALE_GROUP128;
    shape.scale_format = strcmp(str_of(cfg, "dispatch.scale_format"), "ue8m0") == 0
                             ? EPD_SCALE_FMT_UE8M0
                             : EPD_SCALE_FMT_FP32;
    shape.expert_kind = strcmp(str_of(cfg, "experts.kind"), "identity") == 0 ? EPD_EXPERTS_IDENTITY
                                                                             : EPD_EXPERTS_SCALE;
    shape.combine_dtype = strcmp(str_of(cfg, "combine.dtype"), "fp8") == 0 ? EPD_COMBINE_FP8
                                                                          : EPD_COMBINE_BF16;
    epd_client_batch_t batch = {.id = 1, .n_tokens = head[0], .hidden = head[1], .topk = head[2],
                                .x = x, .topk_ids = ids, .topk_weights = w};
    if (epd_client_submit(c, &batch, y, NULL) != EPD_CLIENT_OK) return fail("submit", c);
    if (epd_moe_reference(&shape, head[0], x, ids, w, ref) != EPD_OK)
        return fail("epd_moe_reference failed", NULL);
    out = fopen(argv[3], "wb");
    if (out != NULL && fwrite(y, 2, nh, out) == nh && fwrite(ref, 2, nh, out) == nh) rc = 0;
    if (out == NULL || fclose(out) != 0) rc = 1;
    if (rc != 0) fprintf(stderr, "py_ref: cannot write OUT\n");
    cJSON_Delete(cfg);
    cJSON_Delete(health);
    epd_client_destroy(c);
    free(x);
    free(y);
    free(ref);
    free(ids);
    free(w);
    return rc;
}
