/* Unit tests of the ffn expert kind: the safetensors reader (gpu/safetensors.c) on files this
 * test writes, good and broken (truncated, lying offsets, overlaps, duplicate names, missing
 * shards); the weights loader (gpu/ffn.c) refusing wrong dtypes, shapes, layers and sizes with
 * the file and tensor named; and the host ffn experts op through a simulated world of W ranks
 * against a straightforward fp64 computation written here. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/rng.h"
#include "gpu/ffn.h"
#include "gpu/fp8.h"
#include "gpu/ops.h"
#include "gpu/quant.h"
#include "gpu/safetensors.h"

/* ---- writing safetensors files --------------------------------------------------------- */

typedef struct st_spec {
    const char *name;
    const char *dtype;
    uint32_t n_dims;
    uint64_t shape[2];
    size_t bytes; /* data bytes; the element count times the dtype size for a good file */
} st_spec_t;

static char tmpdir[] = "/tmp/epd-test-ffn-XXXXXX";

static char *tmp_path(const char *name)
{
    static char buf[8][512];
    static int next;
    char *p = buf[next++ % 8];
    snprintf(p, 512, "%s/%s", tmpdir, name);
    return p;
}

/* Writes header text and data bytes as a safetensors file (8-byte length, header, data). */
static void write_raw(const char *path, const char *header, const void *data, size_t bytes,
                      size_t cut)
{
    FILE *f = fopen(path, "wb");
    uint64_t n = strlen(header);
    uint8_t len[8];

    assert_non_null(f);
    for (int i = 0; i < 8; i++) len[i] = (uint8_t)(n >> (8 * i));
    assert_int_equal(fwrite(len, 1, 8, f), 8);
    assert_int_equal(fwrite(header, 1, n, f), n);
    if (bytes > cut) bytes -= cut;
    if (bytes > 0) assert_int_equal(fwrite(data, 1, bytes, f), bytes);
    fclose(f);
}

/* Writes tensors with the given data (concatenated in order); cut bytes are left off the end. */
static void write_st(const char *path, const st_spec_t *t, size_t n, const void *data,
                     size_t cut)
{
    char *header = malloc(1 << 20);
    size_t used = 0, off = 0;

    assert_non_null(header);
    used += (size_t)snprintf(header + used, (1 << 20) - used,
                             "{\"__metadata__\":{\"format\":\"pt\"}");
    for (size_t i = 0; i < n; i++) {
        used += (size_t)snprintf(header + used, (1 << 20) - used,
                                 ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", t[i].name, t[i].dtype);
        for (uint32_t d = 0; d < t[i].n_dims; d++)
            used += (size_t)snprintf(header + used, (1 << 20) - used, "%s%llu", d ? "," : "",
                                     (unsigned long long)t[i].shape[d]);
        used += (size_t)snprintf(header + used, (1 << 20) - used,
                                 "],\"data_offsets\":[%zu,%zu]}", off, off + t[i].bytes);
        off += t[i].bytes;
    }
    snprintf(header + used, (1 << 20) - used, "}");
    write_raw(path, header, data, off, cut);
    free(header);
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static int setup_dir(void **state)
{
    (void)state;
    return mkdtemp(tmpdir) == NULL ? -1 : 0;
}

static int teardown_dir(void **state)
{
    char cmd[600];
    (void)state;
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    return system(cmd) == 0 ? 0 : -1;
}

/* err contains every needle */
static void assert_says(const char *err, const char *a, const char *b)
{
    if (strstr(err, a) == NULL || (b != NULL && strstr(err, b) == NULL))
        fail_msg("error '%s' does not name '%s' and '%s'", err, a, b ? b : "");
}

/* ---- the reader ------------------------------------------------------------------------ */

static void test_ffn__st_good_file__tensors_served(void **state)
{
    (void)state;
    uint16_t data[4 + 6];
    for (int i = 0; i < 10; i++) data[i] = (uint16_t)(i * 7);
    st_spec_t t[] = {{"a", "BF16", 2, {2, 2}, 8}, {"b.c", "BF16", 1, {6}, 12}};
    char err[EPD_ERR_LEN];
    epd_st_model_t *m;
    const epd_st_tensor_t *x;
    size_t n;

    write_st(tmp_path("good.safetensors"), t, 2, data, 0);
    assert_int_equal(epd_st_open(tmp_path("good.safetensors"), &m, err), EPD_OK);
    epd_st_names(m, &n);
    assert_int_equal(n, 2);
    assert_true(epd_st_has(m, "b.c"));
    assert_false(epd_st_has(m, "__metadata__"));
    assert_int_equal(epd_st_get(m, "b.c", &x, err), EPD_OK);
    assert_int_equal(x->dtype, EPD_ST_BF16);
    assert_int_equal(x->n_dims, 1);
    assert_int_equal(x->shape[0], 6);
    assert_memory_equal(x->data, data + 4, 12);
    assert_int_equal(epd_st_get(m, "zz", &x, err), EPD_ERR_BAD_TENSOR);
    assert_says(err, "good.safetensors", "zz");
    epd_st_close(m);
}

static void test_ffn__st_broken_files__error_names_file_and_tensor(void **state)
{
    (void)state;
    uint8_t data[64] = {0};
    char err[EPD_ERR_LEN];
    epd_st_model_t *m = NULL;
    const char *p = tmp_path("bad.safetensors");
    st_spec_t t[] = {{"w.first", "BF16", 2, {2, 2}, 8}, {"w.second", "F32", 1, {4}, 16}};

    /* truncated: the last tensor's bytes are cut short */
    write_st(p, t, 2, data, 5);
    assert_int_equal(epd_st_open(p, &m, err), EPD_ERR_BAD_TENSOR);
    assert_says(err, "bad.safetensors", "w.second");
    assert_null(m);
    /* truncated inside the 8-byte length */
    write_text(p, "abc");
    assert_int_equal(epd_st_open(p, &m, err), EPD_ERR_BAD_TENSOR);
    assert_says(err, "bad.safetensors", "truncated");
    /* a header length past the end of the file */
    write_raw(p, "{}", NULL, 0, 0);
    {
        FILE *f = fopen(p, "r+b");
        uint8_t len[8] = {0xff, 0xff, 0, 0, 0, 0, 0, 0};
        assert_non_null(f);
        fwrite(len, 1, 8, f);
        fclose(f);
    }
    assert_int_equal(epd_st_open(p, &m, err), EPD_ERR_BAD_TENSOR);
    assert_says(err, "bad.safetensors", "header length");
    /* the header lies: offsets past the data */
    write_raw(p, "{\"w.x\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[0,4000]}}", data, 4,
              0);
    assert_int_equal(epd_st_open(p, &m, err), EPD_ERR_BAD_TENSOR);
    assert_says(err, "bad.safetensors", "w.x");
    /* the header lies: offsets that do not hold dtype x shape */
    write_raw(p, "{\"w.y\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[0,4]}}", data, 4, 0);
    assert_int_equal(epd_st_open(p, &m, err), EPD_ERR_BAD_TENSOR);
    assert_says(err, "w.y", "need 6");
    /* two tensors on the same bytes */
    write_raw(p,
              "{\"w.a\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[0,4]},"
              "\"w.b\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[2,6]}}",
              data, 6, 0);
    assert_int_equal(epd_st_open(p, &m, err), EPD_ERR_BAD_TENSOR);
    assert_says(err, "w.a", "overlap");
    /* one name twice */
    write_raw(p,
              "{\"w.d\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[0,4]},"
              "\"w.d\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[4,8]}}",
              data, 8, 0);
    assert_int_equal(epd_st_open(p, &m, err), EPD_ERR_BAD_TENSOR);
    assert_says(err, "w.d", "twice");
    /* an unknown dtype, a negative dimension, not JSON */
    write_raw(p, "{\"w.e\":{\"dtype\":\"Q4\",\"shape\":[2],\"data_offsets\":[0,4]}}", data, 4, 0);
    assert_int_equal(epd_st_open(p, &m, err), EPD_ERR_BAD_TENSOR);
    assert_says(err, "w.e", "Q4");
    write_raw(p, "{\"w.f\":{\"dtype\":\"BF16\",\"shape\":[-2],\"data_offsets\":[0,4]}}", data, 4,
              0);
    assert_int_equal(epd_st_open(p, &m, err), EPD_ERR_BAD_TENSOR);
    assert_says(err, "w.f", "shape");
    write_raw(p, "{\"w.g\":", data, 4, 0);
    assert_int_equal(epd_st_open(p, &m, err), EPD_ERR_BAD_TENSOR);
    assert_says(err, "bad.safetensors", "JSON");
    /* no such file */
    assert_int_equal(epd_st_open(tmp_path("none.safetensors"), &m, err), EPD_ERR_IO);
    assert_says(err, "none.safetensors", NULL);
}

static void test_ffn__st_sharded__index_checked_against_shards(void **state)
{
    (void)state;
    uint8_t data[16] = {1, 2, 3, 4, 5, 6, 7, 8};
    char err[EPD_ERR_LEN], dir[600];
    epd_st_model_t *m;
    const epd_st_tensor_t *x;
    st_spec_t a[] = {{"t.a", "BF16", 1, {2}, 4}};
    st_spec_t b[] = {{"t.b", "BF16", 1, {2}, 4}, {"t.a", "BF16", 1, {2}, 4}};

    snprintf(dir, sizeof dir, "%s/sharded", tmpdir);
    assert_int_equal(mkdir(dir, 0700), 0);
    write_st(tmp_path("sharded/s1.safetensors"), a, 1, data, 0);
    write_st(tmp_path("sharded/s2.safetensors"), b, 1, data, 0);
    write_text(tmp_path("sharded/model.safetensors.index.json"),
               "{\"metadata\":{},\"weight_map\":{\"t.a\":\"s1.safetensors\","
               "\"t.b\":\"s2.safetensors\",\"t.c\":\"s3.safetensors\"}}");
    assert_int_equal(epd_st_open(dir, &m, err), EPD_OK);
    assert_int_equal(epd_st_mapped_bytes(m), 0); /* shards open on first use */
    assert_int_equal(epd_st_get(m, "t.b", &x, err), EPD_OK);
    assert_memory_equal(x->data, data, 4);
    /* the missing shard is named with the tensor that needed it */
    assert_int_equal(epd_st_get(m, "t.c", &x, err), EPD_ERR_IO);
    assert_says(err, "s3.safetensors", "t.c");
    epd_st_close(m);

    /* a name in two shards: the one the index does not name says so */
    write_st(tmp_path("sharded/s2.safetensors"), b, 2, data, 0);
    assert_int_equal(epd_st_open(dir, &m, err), EPD_OK);
    assert_int_equal(epd_st_get(m, "t.b", &x, err), EPD_ERR_BAD_TENSOR);
    assert_says(err, "s2.safetensors", "t.a");
    assert_says(err, "duplicate", NULL);
    epd_st_close(m);

    /* the index names a tensor its shard does not have */
    write_text(tmp_path("sharded/model.safetensors.index.json"),
               "{\"weight_map\":{\"t.a\":\"s1.safetensors\",\"t.z\":\"s1.safetensors\"}}");
    assert_int_equal(epd_st_open(dir, &m, err), EPD_OK);
    assert_int_equal(epd_st_get(m, "t.a", &x, err), EPD_ERR_BAD_TENSOR);
    assert_says(err, "s1.safetensors", "t.z");
    epd_st_close(m);

    /* a name twice in the index, and a shard outside the directory */
    write_text(tmp_path("sharded/model.safetensors.index.json"),
               "{\"weight_map\":{\"t.a\":\"s1.safetensors\",\"t.a\":\"s2.safetensors\"}}");
    assert_int_equal(epd_st_open(dir, &m, err), EPD_ERR_BAD_TENSOR);
    assert_says(err, "t.a", "twice");
    write_text(tmp_path("sharded/model.safetensors.index.json"),
               "{\"weight_map\":{\"t.a\":\"../s1.safetensors\"}}");
    assert_int_equal(epd_st_open(dir, &m, err), EPD_ERR_BAD_TENSOR);
    assert_says(err, "t.a", "file name");
    write_text(tmp_path("sharded/model.safetensors.index.json"), "{\"nothing\":1}");
    assert_int_equal(epd_st_open(dir, &m, err), EPD_ERR_BAD_TENSOR);
    assert_says(err, "weight_map", NULL);
}

/* ---- the weights loader ---------------------------------------------------------------- */

#define LH 128 /* hidden of the loader's tiny checkpoints */
#define LI 128

/* A checkpoint of n_layers x n_experts BF16 (or FP8) experts at H = I = 128, written with the
 * given dtype and shape for one tensor (bad_name) to break it. */
static void write_model(const char *path, uint32_t n_layers, uint32_t n_experts, bool fp8,
                        const char *bad_name, const char *bad_dtype, uint64_t bad_rows)
{
    size_t n = (size_t)n_layers * n_experts * (fp8 ? 6 : 3), i = 0;
    st_spec_t *t = calloc(n, sizeof *t);
    char (*names)[96] = calloc(n, sizeof *names);
    size_t total = 0;

    assert_non_null(t);
    assert_non_null(names);
    for (uint32_t L = 0; L < n_layers; L++) {
        for (uint32_t e = 0; e < n_experts; e++) {
            static const char *const proj[3] = {"gate_proj", "up_proj", "down_proj"};
            for (int p = 0; p < 3; p++) {
                for (int sc = 0; sc < (fp8 ? 2 : 1); sc++) {
                    snprintf(names[i], 96, "model.layers.%u.mlp.experts.%u.%s.%s", L + 1, e,
                             proj[p], sc ? "weight_scale_inv" : "weight");
                    t[i].name = names[i];
                    t[i].dtype = sc ? "F32" : fp8 ? "F8_E4M3" : "BF16";
                    t[i].n_dims = 2;
                    t[i].shape[0] = sc ? 1 : LI;
                    t[i].shape[1] = sc ? 1 : LH;
                    if (bad_name != NULL && strcmp(names[i], bad_name) == 0) {
                        if (bad_dtype != NULL) t[i].dtype = bad_dtype;
                        if (bad_rows != 0) t[i].shape[0] = bad_rows;
                    }
                    size_t es = strcmp(t[i].dtype, "F8_E4M3") == 0 ? 1
                                : strcmp(t[i].dtype, "F32") == 0     ? 4
                                                                     : 2;
                    t[i].bytes = (size_t)t[i].shape[0] * t[i].shape[1] * es;
                    total += t[i].bytes;
                    i++;
                }
            }
        }
    }
    /* scales of 1.0f, weights of small numbers: fine for loading */
    uint8_t *data = calloc(total, 1);
    assert_non_null(data);
    size_t off = 0;
    for (size_t j = 0; j < n; j++) {
        if (strcmp(t[j].dtype, "F32") == 0) {
            float one = 1.0f;
            for (size_t k = 0; k < t[j].bytes / 4; k++) memcpy(data + off + 4 * k, &one, 4);
        }
        off += t[j].bytes;
    }
    write_st(path, t, n, data, 0);
    free(data);
    free(names);
    free(t);
}

static epd_status_t load(const char *path, uint32_t n_experts, uint32_t intermediate,
                         const uint32_t *layers, size_t n_layers, epd_ffn_weights_t **w,
                         char err[EPD_ERR_LEN])
{
    epd_ffn_spec_t spec = {
        .path = path,
        .layers = layers,
        .n_layers = n_layers,
        .hidden = LH,
        .intermediate = intermediate,
        .num_experts = n_experts,
        .first_expert = n_experts / 2,
        .n_local = n_experts / 2,
    };
    return epd_ffn_load(&spec, w, err);
}

static void test_ffn__load__layers_and_format_from_the_file(void **state)
{
    (void)state;
    char err[EPD_ERR_LEN];
    epd_ffn_weights_t *w;
    const char *p = tmp_path("m.safetensors");
    uint32_t two[] = {2}, nine[] = {9};

    write_model(p, 3, 4, false, NULL, NULL, 0);
    assert_int_equal(load(p, 4, 0, NULL, 0, &w, err), EPD_OK);
    assert_int_equal(w->format, EPD_FFN_BF16);
    assert_int_equal(w->intermediate, LI);
    assert_int_equal(w->n_layers, 3);
    assert_int_equal(w->layers[0].layer, 1);
    assert_int_equal(w->layers[2].layer, 3);
    assert_int_equal(w->local_bytes, 3ull * 2 * 3 * LI * LH * 2);
    assert_non_null(epd_ffn_find_layer(w, 3));
    assert_null(epd_ffn_find_layer(w, 0));
    epd_ffn_free(w);
    assert_int_equal(load(p, 4, 0, two, 1, &w, err), EPD_OK);
    assert_int_equal(w->n_layers, 1);
    assert_null(epd_ffn_find_layer(w, 1));
    epd_ffn_free(w);
    /* a layer the file does not have, a wrong intermediate, too few or too many experts */
    assert_int_equal(load(p, 4, 0, nine, 1, &w, err), EPD_ERR_CONFIG);
    assert_says(err, "m.safetensors", "layer 9");
    assert_int_equal(load(p, 4, 256, NULL, 0, &w, err), EPD_ERR_CONFIG);
    assert_says(err, "model.intermediate = 256", NULL);
    assert_int_equal(load(p, 8, 0, NULL, 0, &w, err), EPD_ERR_CONFIG);
    assert_says(err, "model.layers.1.mlp.experts.7.gate_proj.weight", "num_experts");
    assert_int_equal(load(p, 2, 0, NULL, 0, &w, err), EPD_ERR_CONFIG);
    assert_says(err, "experts.2.gate_proj", "more experts");

    write_model(p, 1, 2, true, NULL, NULL, 0);
    assert_int_equal(load(p, 2, 128, NULL, 0, &w, err), EPD_OK);
    assert_int_equal(w->format, EPD_FFN_FP8_BLOCK);
    assert_float_equal(w->layers[0].down_scale[0], 1.0f, 0.0f);
    epd_ffn_free(w);
}

static void test_ffn__load__wrong_dtype_or_shape_names_the_tensor(void **state)
{
    (void)state;
    char err[EPD_ERR_LEN];
    epd_ffn_weights_t *w = NULL;
    const char *p = tmp_path("bad-model.safetensors");

    /* only this rank's experts (2, 3) are read: a bad tensor of expert 0 does not matter */
    write_model(p, 1, 4, false, "model.layers.1.mlp.experts.0.up_proj.weight", "F16", 0);
    assert_int_equal(load(p, 4, 0, NULL, 0, &w, err), EPD_OK);
    epd_ffn_free(w);
    write_model(p, 1, 4, false, "model.layers.1.mlp.experts.3.up_proj.weight", "F16", 0);
    assert_int_equal(load(p, 4, 0, NULL, 0, &w, err), EPD_ERR_CONFIG);
    assert_says(err, "bad-model.safetensors", "experts.3.up_proj.weight has dtype F16");
    write_model(p, 1, 4, false, "model.layers.1.mlp.experts.2.gate_proj.weight", "I16", 0);
    assert_int_equal(load(p, 4, 0, NULL, 0, &w, err), EPD_ERR_CONFIG);
    assert_says(err, "experts.2.gate_proj.weight", "BF16 or F8_E4M3");
    write_model(p, 1, 4, false, "model.layers.1.mlp.experts.3.down_proj.weight", NULL, 256);
    assert_int_equal(load(p, 4, 0, NULL, 0, &w, err), EPD_ERR_CONFIG);
    assert_says(err, "experts.3.down_proj.weight has shape [256, 128]", "[128, 128]");
    write_model(p, 1, 4, true, "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv", NULL,
                2);
    assert_int_equal(load(p, 4, 0, NULL, 0, &w, err), EPD_ERR_CONFIG);
    assert_says(err, "down_proj.weight_scale_inv has shape [2, 1]", "[1, 1]");
    write_model(p, 1, 4, true, "model.layers.1.mlp.experts.3.gate_proj.weight", "BF16", 0);
    assert_int_equal(load(p, 4, 0, NULL, 0, &w, err), EPD_ERR_CONFIG);
    assert_says(err, "experts.3.gate_proj.weight has dtype BF16", "F8_E4M3");
    write_text(p, "x");
    assert_int_equal(load(p, 4, 0, NULL, 0, &w, err), EPD_ERR_BAD_TENSOR);
    assert_says(err, "bad-model.safetensors", NULL);
}

/* ---- the host ffn experts against fp64 -------------------------------------------------- */

/* What an expert sees of token t (section 9), recomputed here: x' as doubles. */
static void seen_input(const epd_moe_shape_t *s, const epd_ffn_weights_t *w, const uint16_t *row,
                       double *xd)
{
    uint32_t H = s->hidden, ng = H / 128;
    uint8_t q[4096];
    float sc[64];

    if (s->dtype == EPD_WIRE_FP8)
        epd_quant_row_host(row, H, s->scale, s->scale_format, q, sc);
    if (w->format == EPD_FFN_BF16) {
        for (uint32_t i = 0; i < H; i++) {
            uint32_t g = s->scale == EPD_SCALE_PER_TOKEN ? 0 : i / 128;
            float v = s->dtype == EPD_WIRE_FP8 ? epd_e4m3_to_f32(q[i]) * sc[g]
                                               : epd_bf16_to_f32(row[i]);
            xd[i] = epd_bf16_to_f32(epd_f32_to_bf16(v));
        }
        return;
    }
    if (s->dtype != EPD_WIRE_FP8)
        epd_quant_row_host(row, H, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, q, sc);
    for (uint32_t i = 0; i < H; i++) {
        bool one = s->dtype == EPD_WIRE_FP8 && s->scale == EPD_SCALE_PER_TOKEN;
        xd[i] = (double)epd_e4m3_to_f32(q[i]) * (double)sc[one ? 0 : i / 128];
    }
    (void)ng;
}

/* Weight (r, c) of matrix m (0 gate, 1 up, 2 down) of expert e, dequantized, in fp64. */
static double weight(const epd_ffn_weights_t *w, const epd_ffn_layer_t *l, uint32_t e, int m,
                     uint32_t r, uint32_t c)
{
    uint32_t H = w->hidden, I = w->intermediate;
    size_t base = m == 2 ? (size_t)e * H * I : ((size_t)e * 2 + (size_t)m) * I * H;
    uint32_t cols = m == 2 ? I : H;
    if (w->format == EPD_FFN_BF16)
        return epd_bf16_to_f32(
            ((const uint16_t *)(m == 2 ? l->down : l->gate_up))[base + (size_t)r * cols + c]);
    const uint8_t *q = (const uint8_t *)(m == 2 ? l->down : l->gate_up);
    size_t blocks = (size_t)(I / 128) * (H / 128);
    const float *sc = m == 2 ? l->down_scale + (size_t)e * blocks
                             : l->gate_up_scale + ((size_t)e * 2 + (size_t)m) * blocks;
    return (double)epd_e4m3_to_f32(q[base + (size_t)r * cols + c]) *
           (double)sc[(r / 128) * (cols / 128) + c / 128];
}

/* y = sum_k w_k down(quantized(silu(gate x) * up x)) in fp64; the intermediate rounded as
 * section 9 says (BF16, or e4m3 group128), nothing else. */
static void expected_token(const epd_moe_shape_t *s, const epd_ffn_weights_t *w,
                           const epd_ffn_layer_t *l, const double *xd, const int32_t *ids,
                           const float *kw, double *y)
{
    uint32_t H = w->hidden, I = w->intermediate;
    double *h = calloc(I, sizeof *h);
    assert_non_null(h);
    for (uint32_t i = 0; i < H; i++) y[i] = 0;
    for (uint32_t k = 0; k < s->topk; k++) {
        if (ids[k] < 0) continue;
        uint32_t e = (uint32_t)ids[k];
        for (uint32_t i = 0; i < I; i++) {
            double g = 0, u = 0;
            for (uint32_t j = 0; j < H; j++) {
                g += weight(w, l, e, 0, i, j) * xd[j];
                u += weight(w, l, e, 1, i, j) * xd[j];
            }
            h[i] = g / (1 + exp(-g)) * u;
        }
        if (w->format == EPD_FFN_BF16) {
            for (uint32_t i = 0; i < I; i++) h[i] = epd_bf16_to_f32(epd_f32_to_bf16((float)h[i]));
        } else {
            for (uint32_t g0 = 0; g0 < I; g0 += 128) {
                double amax = 0;
                for (uint32_t i = g0; i < g0 + 128; i++) amax = fmax(amax, fabs(h[i]));
                double a = fmax(amax, 1e-4), scale = a / 448.0;
                for (uint32_t i = g0; i < g0 + 128; i++)
                    h[i] = epd_e4m3_to_f32(epd_e4m3_from_f32((float)(h[i] * (448.0 / a)))) * scale;
            }
        }
        for (uint32_t i = 0; i < H; i++) {
            double acc = 0;
            for (uint32_t j = 0; j < I; j++) acc += weight(w, l, e, 2, i, j) * h[j];
            y[i] += (double)kw[k] * acc;
        }
    }
    free(h);
}

/* Runs layout, pack, the experts of every rank (shape.rank = r on its records) and combine on
 * host memory, as W ranks would, then checks every token against expected_token. The partials
 * are combine.dtype's (BF16, or FP8 group128: their telemetry is then checked to be fed). */
static void run_world(epd_moe_shape_t s, const epd_ffn_weights_t *w, uint32_t layer, uint32_t n,
                      const uint16_t *x, const int32_t *ids, const float *kw, double tol)
{
    const epd_ops_t *ops = &epd_ops_host;
    epd_ops_ctx_t *ctx;
    char err[EPD_ERR_LEN];
    epd_record_layout_t rec;
    epd_partial_layout_t pl;
    epd_step_layout_t lay = {0};
    epd_quant_error_t qe;
    uint32_t H = s.hidden;

    assert_int_equal(ops->init(-1, &ctx, err), EPD_OK);
    epd_record_layout(&s, &rec);
    epd_partial_layout(&s, &pl);
    lay.n_tokens = n;
    lay.send_counts_host = calloc(s.world, sizeof(uint32_t));
    lay.send_offsets_host = calloc(s.world, sizeof(uint32_t));
    lay.slot = calloc((size_t)n * s.world, sizeof(int32_t));
    lay.expert_counts_host = calloc(s.num_experts, sizeof(uint32_t));
    uint8_t *records = calloc((size_t)n * s.world, rec.size);
    uint8_t *partials = calloc((size_t)n * s.world, pl.size);
    uint16_t *y = calloc((size_t)n * H, 2), *ref = calloc((size_t)n * H, 2);
    double *xd = calloc(H, sizeof *xd), *yd = calloc(H, sizeof *yd);
    assert_non_null(records);
    assert_non_null(y);

    assert_int_equal(ops->experts_load(ctx, &s, w, err), EPD_OK);
    assert_int_equal(ops->layout(ctx, &s, ids, &lay), EPD_OK);
    assert_int_equal(ops->pack(ctx, &s, x, ids, kw, &lay, records), EPD_OK);
    for (uint32_t r = 0; r < s.world; r++) {
        epd_moe_shape_t sr = s;
        sr.rank = r;
        size_t first = lay.send_offsets_host[r];
        /* the rows per expert as the count exchange brings them: the layout's counts */
        const uint32_t *rows = lay.expert_counts_host + (size_t)r * (s.num_experts / s.world);
        assert_int_equal(ops->experts(ctx, &sr, layer, records + first * rec.size,
                                      lay.send_counts_host[r], rows,
                                      partials + first * pl.size),
                         EPD_OK);
    }
    /* the quantization telemetry: fed by the FP8 partials (and FP8 records), nothing else */
    assert_int_equal(ops->quant_error_take(ctx, &qe), EPD_OK);
    if (s.quant_error && s.combine_dtype == EPD_COMBINE_FP8 && lay.n_send > 0) {
        assert_true(qe.combine_ref2 > 0 && qe.combine_err2 > 0);
        assert_true(qe.combine_err2 < 1e-2 * qe.combine_ref2);
    } else {
        assert_true(qe.combine_ref2 == 0 && qe.combine_err2 == 0);
    }
    assert_int_equal(ops->combine(ctx, &s, &lay, partials, y), EPD_OK);
    /* the single-process reference gives the same bytes */
    assert_int_equal(epd_moe_reference_layer(&s, w, layer, n, x, ids, kw, ref), EPD_OK);
    assert_memory_equal(y, ref, (size_t)n * H * 2);

    const epd_ffn_layer_t *l = epd_ffn_find_layer(w, layer);
    double worst = 0;
    for (uint32_t t = 0; t < n; t++) {
        double num = 0, den = 0;
        seen_input(&s, w, x + (size_t)t * H, xd);
        expected_token(&s, w, l, xd, ids + (size_t)t * s.topk, kw + (size_t)t * s.topk, yd);
        for (uint32_t i = 0; i < H; i++) {
            double d = epd_bf16_to_f32(y[(size_t)t * H + i]) - yd[i];
            num += d * d;
            den += yd[i] * yd[i];
        }
        if (den == 0) {
            assert_true(num == 0); /* all slots empty: zeros */
            continue;
        }
        double rel = sqrt(num / den);
        if (rel > worst) worst = rel;
        if (rel > tol) fail_msg("token %u: relative L2 error %.3g above %.3g", t, rel, tol);
    }
    print_message("    %s weights, %s wire, %s combine, W %u: worst token relative L2 %.2e\n",
                  epd_ffn_format_name(w->format), s.dtype == EPD_WIRE_FP8 ? "fp8" : "bf16",
                  s.combine_dtype == EPD_COMBINE_FP8 ? "fp8" : "bf16", s.world, worst);
    /* a layer that was not loaded is refused */
    assert_int_equal(ops->experts(ctx, &s, 99, records, 1, NULL, partials), EPD_ERR_INVALID_ARG);
    /* counts that disagree with the records are refused */
    if (lay.send_counts_host[0] > 0) {
        uint32_t *wrong = calloc(s.num_experts, sizeof(uint32_t));
        memcpy(wrong, lay.expert_counts_host, s.num_experts / s.world * sizeof(uint32_t));
        wrong[0]++;
        assert_int_equal(ops->experts(ctx, &s, layer, records, lay.send_counts_host[0], wrong,
                                      partials),
                         EPD_ERR_INTERNAL);
        free(wrong);
    }
    ops->fini(ctx);
    free(lay.send_counts_host);
    free(lay.send_offsets_host);
    free(lay.slot);
    free(lay.expert_counts_host);
    free(records);
    free(partials);
    free(y);
    free(ref);
    free(xd);
    free(yd);
}

static void test_ffn__host_experts__match_fp64_on_every_world(void **state)
{
    (void)state;
    enum { H = 256, I = 128, E = 16, K = 8, N = 12 };
    uint16_t x[N * H];
    int32_t ids[N * K];
    float kw[N * K];
    uint64_t r = 42;
    char err[EPD_ERR_LEN];

    for (size_t i = 0; i < N * H; i++) x[i] = epd_f32_to_bf16(2.0f * epd_rng_unit_f32(&r) - 1.0f);
    for (uint32_t t = 0; t < N; t++) {
        for (uint32_t k = 0; k < K; k++) {
            /* token 0: experts 0, 2, ..., 14, one on each of 8 ranks; token 1: all slots empty;
             * the others: a few experts of the low half, some slots -1 (the high half gets no
             * rows at all) */
            int32_t e = t == 0 ? (int32_t)(2 * k) : t == 1 ? -1 : (int32_t)((t + 3 * k) % 8);
            if (t > 1 && (t + k) % 3 == 0) e = -1;
            if (t > 1 && k >= 4) e = -1;
            ids[t * K + k] = e;
            kw[t * K + k] = 0.05f + 0.1f * (float)k;
        }
    }
    for (int f = 0; f < 2; f++) {
        epd_ffn_weights_t *w;
        assert_int_equal(epd_ffn_random(f ? EPD_FFN_FP8_BLOCK : EPD_FFN_BF16, H, I, E, 0, E, 2, 7,
                                        &w, err), EPD_OK);
        /* fp32 arithmetic with fp64 sums and BF16 partials and outputs against fp64: far inside
         * section 9's 1e-2 / 3e-2; FP8 partials (e4m3, 3 mantissa bits) add their own error */
        static const struct {
            epd_wire_dtype_t dtype;
            epd_scale_kind_t scale;
            uint32_t world;
            epd_combine_dtype_t combine;
        } cases[] = {{EPD_WIRE_BF16, EPD_SCALE_GROUP128, 1, EPD_COMBINE_BF16},
                     {EPD_WIRE_FP8, EPD_SCALE_GROUP128, 8, EPD_COMBINE_BF16},
                     {EPD_WIRE_FP8, EPD_SCALE_PER_TOKEN, 2, EPD_COMBINE_BF16},
                     {EPD_WIRE_BF16, EPD_SCALE_GROUP128, 8, EPD_COMBINE_BF16},
                     {EPD_WIRE_FP8, EPD_SCALE_GROUP128, 8, EPD_COMBINE_FP8},
                     {EPD_WIRE_BF16, EPD_SCALE_GROUP128, 2, EPD_COMBINE_FP8}};
        for (size_t c = 0; c < EPD_ARRAY_SIZE(cases); c++) {
            epd_moe_shape_t s = {.hidden = H, .topk = K, .num_experts = E, .world = cases[c].world,
                                 .dtype = cases[c].dtype, .scale = cases[c].scale,
                                 .expert_kind = EPD_EXPERTS_FFN,
                                 .combine_dtype = cases[c].combine, .quant_error = true};
            run_world(s, w, 1, N, x, ids, kw,
                      cases[c].combine == EPD_COMBINE_FP8 ? 6e-2 : 6e-3);
        }
        epd_ffn_free(w);
    }
}

static void test_ffn__host_experts__without_weights_refused(void **state)
{
    (void)state;
    epd_moe_shape_t s = {.hidden = 128, .topk = 2, .num_experts = 4, .world = 2,
                         .dtype = EPD_WIRE_BF16, .expert_kind = EPD_EXPERTS_FFN};
    epd_ops_ctx_t *ctx;
    epd_ffn_weights_t *w;
    char err[EPD_ERR_LEN];
    uint8_t rec[1024] = {0};
    uint16_t part[128];

    assert_int_equal(epd_ops_host.init(-1, &ctx, err), EPD_OK);
    assert_int_equal(epd_ops_host.experts(ctx, &s, 0, rec, 1, NULL, part), EPD_ERR_INVALID_ARG);
    /* weights of experts [0, 2) cannot serve rank 1 */
    assert_int_equal(epd_ffn_random(EPD_FFN_BF16, 128, 128, 4, 0, 2, 1, 1, &w, err), EPD_OK);
    s.rank = 1;
    assert_int_equal(epd_ops_host.experts_load(ctx, &s, w, err), EPD_ERR_INVALID_ARG);
    assert_says(err, "rank 1", NULL);
    s.rank = 0;
    assert_int_equal(epd_ops_host.experts_load(ctx, &s, w, err), EPD_OK);
    epd_ops_host.fini(ctx);
    epd_ffn_free(w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ffn__st_good_file__tensors_served),
        cmocka_unit_test(test_ffn__st_broken_files__error_names_file_and_tensor),
        cmocka_unit_test(test_ffn__st_sharded__index_checked_against_shards),
        cmocka_unit_test(test_ffn__load__layers_and_format_from_the_file),
        cmocka_unit_test(test_ffn__load__wrong_dtype_or_shape_names_the_tensor),
        cmocka_unit_test(test_ffn__host_experts__match_fp64_on_every_world),
        cmocka_unit_test(test_ffn__host_experts__without_weights_refused),
    };
    return cmocka_run_group_tests(tests, setup_dir, teardown_dir);
}
