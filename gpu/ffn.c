/* The ffn expert kind: loading one rank's experts of every MoE layer from safetensors (or making
 * them up for the benchmark), and the host arithmetic of one expert. See gpu/ffn.h. */
#include "gpu/ffn.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "gpu/fp8.h"
#include "gpu/safetensors.h"

/* snprintf into err; messages are cut at EPD_ERR_LEN on purpose (paths can be long). */
__attribute__((format(printf, 2, 3))) static void errf(char err[EPD_ERR_LEN], const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, EPD_ERR_LEN, fmt, ap);
    va_end(ap);
}

#define NAME_LEN 160
#define LAYER_FMT "model.layers.%u.mlp.experts.%u.%s"
static const char *const proj_names[3] = {"gate_proj", "up_proj", "down_proj"};

const char *epd_ffn_format_name(epd_ffn_format_t format)
{
    return format == EPD_FFN_FP8_BLOCK ? "fp8-block" : "bf16";
}

static size_t ceil_div(size_t a, size_t b)
{
    return (a + b - 1) / b;
}

/* Element and scale counts of one expert's matrices. */
static size_t gate_up_elems(const epd_ffn_weights_t *w)
{
    return 2 * (size_t)w->intermediate * w->hidden;
}
static size_t gate_up_scales(const epd_ffn_weights_t *w)
{
    return 2 * ((size_t)w->intermediate / EPD_FFN_BLOCK) * (w->hidden / EPD_FFN_BLOCK);
}
static size_t elem_bytes(const epd_ffn_weights_t *w)
{
    return w->format == EPD_FFN_FP8_BLOCK ? 1 : 2;
}

static void *alloc64(size_t bytes)
{
    size_t rounded = (bytes + 63) / 64 * 64;
    return aligned_alloc(64, rounded == 0 ? 64 : rounded);
}

void epd_ffn_free(epd_ffn_weights_t *w)
{
    if (w == NULL) return;
    for (uint32_t i = 0; i < w->n_layers; i++) {
        free(w->layers[i].gate_up);
        free(w->layers[i].down);
        free(w->layers[i].gate_up_scale);
        free(w->layers[i].down_scale);
        free(w->layers[i].input_scale);
    }
    free(w->layers);
    free(w);
}

void epd_ffn_drop_host(epd_ffn_weights_t *w)
{
    if (w == NULL) return;
    for (uint32_t i = 0; i < w->n_layers; i++) {
        epd_ffn_layer_t *l = &w->layers[i];
        free(l->gate_up);
        free(l->down);
        free(l->gate_up_scale);
        free(l->down_scale);
        free(l->input_scale);
        l->gate_up = l->down = NULL;
        l->gate_up_scale = l->down_scale = l->input_scale = NULL;
    }
}

/* Allocates the arrays of every layer of w (n_layers, format and sizes set). */
static epd_status_t alloc_layers(epd_ffn_weights_t *w, bool input_scale, char err[EPD_ERR_LEN])
{
    size_t gu = gate_up_elems(w) * elem_bytes(w) * w->n_local;
    size_t dn = gate_up_elems(w) / 2 * elem_bytes(w) * w->n_local;
    size_t gus = gate_up_scales(w) * sizeof(float) * w->n_local;
    size_t dns = gus / 2;
    bool fp8 = w->format == EPD_FFN_FP8_BLOCK;

    w->layers = calloc(w->n_layers ? w->n_layers : 1, sizeof *w->layers);
    if (w->layers == NULL) goto no_memory;
    for (uint32_t i = 0; i < w->n_layers; i++) {
        epd_ffn_layer_t *l = &w->layers[i];
        l->gate_up = alloc64(gu);
        l->down = alloc64(dn);
        if (l->gate_up == NULL || l->down == NULL) goto no_memory;
        if (fp8) {
            l->gate_up_scale = alloc64(gus);
            l->down_scale = alloc64(dns);
            if (l->gate_up_scale == NULL || l->down_scale == NULL) goto no_memory;
        }
        if (input_scale) {
            l->input_scale = alloc64(2 * sizeof(float) * w->n_local);
            if (l->input_scale == NULL) goto no_memory;
        }
    }
    w->local_bytes = (uint64_t)w->n_layers * (gu + dn + (fp8 ? gus + dns : 0));
    return EPD_OK;

no_memory:
    errf(err,
             "ffn experts: out of host memory for %u layers of %u experts (%zu bytes a layer)",
             w->n_layers, w->n_local, gu + dn + (fp8 ? gus + dns : 0));
    return EPD_ERR_NO_MEMORY;
}

/* ---- loading -------------------------------------------------------------------------- */

/* Layer numbers L with a tensor model.layers.L.mlp.experts.*, ascending, distinct. */
static epd_status_t find_layers(const epd_st_model_t *st, uint32_t **layers_p, size_t *n_p,
                                char err[EPD_ERR_LEN])
{
    size_t n_names, n = 0;
    const char *const *names = epd_st_names(st, &n_names);
    uint32_t *layers = NULL;

    for (size_t i = 0; i < n_names; i++) {
        unsigned L;
        int end = 0;
        if (sscanf(names[i], "model.layers.%u.mlp.experts.%n", &L, &end) != 1 || end == 0)
            continue;
        bool seen = false;
        for (size_t j = 0; j < n && !seen; j++) seen = layers[j] == L;
        if (seen) continue;
        uint32_t *grown = realloc(layers, (n + 1) * sizeof *layers);
        if (grown == NULL) {
            free(layers);
            errf(err, "ffn experts: out of memory");
            return EPD_ERR_NO_MEMORY;
        }
        layers = grown;
        /* insertion keeps them ascending */
        size_t at = n;
        while (at > 0 && layers[at - 1] > L) {
            layers[at] = layers[at - 1];
            at--;
        }
        layers[at] = L;
        n++;
    }
    *layers_p = layers;
    *n_p = n;
    return EPD_OK;
}

/* Checks t against the expected dtype and shape; EPD_ERR_CONFIG naming file and tensor. */
static epd_status_t check_tensor(const epd_st_tensor_t *t, epd_st_dtype_t dtype, uint32_t n_dims,
                                 uint64_t d0, uint64_t d1, const char *what,
                                 char err[EPD_ERR_LEN])
{
    static const char *const dnames[] = {[EPD_ST_BF16] = "BF16", [EPD_ST_F8_E4M3] = "F8_E4M3",
                                         [EPD_ST_F32] = "F32", [EPD_ST_F16] = "F16",
                                         [EPD_ST_OTHER] = "?"};
    if (t->dtype != dtype) {
        errf(err, "%.100s: tensor %.100s has dtype %s, %s needs %s", t->file,
                 t->name, t->dtype_name, what, dnames[dtype]);
        return EPD_ERR_CONFIG;
    }
    bool ok = t->n_dims == n_dims;
    if (ok && n_dims >= 1) ok = t->shape[0] == d0;
    if (ok && n_dims >= 2) ok = t->shape[1] == d1;
    if (n_dims == 0 && t->n_dims == 1 && t->shape[0] == 1) ok = true; /* a scalar as [1] */
    if (!ok) {
        char got[64] = "";
        size_t used = 0;
        for (uint32_t i = 0; i < t->n_dims && used < sizeof got; i++)
            used += (size_t)snprintf(got + used, sizeof got - used, "%s%llu", i ? ", " : "",
                                     (unsigned long long)t->shape[i]);
        if (n_dims == 2)
            errf(err, "%.90s: tensor %.100s has shape [%s], %s needs [%llu, %llu]",
                     t->file, t->name, got, what, (unsigned long long)d0, (unsigned long long)d1);
        else
            errf(err, "%.90s: tensor %.100s has shape [%s], %s needs a scalar",
                     t->file, t->name, got, what);
        return EPD_ERR_CONFIG;
    }
    return EPD_OK;
}

static epd_status_t get_tensor(epd_st_model_t *st, const char *name, const epd_st_tensor_t **t_p,
                               char err[EPD_ERR_LEN])
{
    epd_status_t status = epd_st_get(st, name, t_p, err);
    /* a missing tensor is the checkpoint not matching the settings */
    return status == EPD_ERR_BAD_TENSOR && !epd_st_has(st, name) ? EPD_ERR_CONFIG : status;
}

/* The format and I of the checkpoint, from the first expert of this rank in the first layer. */
static epd_status_t probe(epd_st_model_t *st, uint32_t layer, uint32_t e, uint32_t hidden,
                          epd_ffn_format_t *format_p, uint32_t *intermediate_p,
                          char err[EPD_ERR_LEN])
{
    char name[NAME_LEN];
    const epd_st_tensor_t *t;
    epd_status_t status;

    snprintf(name, sizeof name, LAYER_FMT ".weight", layer, e, "gate_proj");
    CHECK_GOTO(get_tensor(st, name, &t, err), out);
    if (t->dtype == EPD_ST_BF16) {
        *format_p = EPD_FFN_BF16;
    } else if (t->dtype == EPD_ST_F8_E4M3) {
        *format_p = EPD_FFN_FP8_BLOCK;
    } else {
        errf(err,
                 "%.100s: tensor %.100s has dtype %s; ffn experts take BF16 or F8_E4M3", t->file,
                 t->name, t->dtype_name);
        return EPD_ERR_CONFIG;
    }
    if (t->n_dims != 2 || t->shape[1] != hidden || t->shape[0] == 0 ||
        t->shape[0] % EPD_FFN_BLOCK != 0 || t->shape[0] > UINT32_MAX) {
        errf(err,
                 "%.100s: tensor %.100s is not [I, %u] with I a positive multiple of %d "
                 "(model.hidden = %u)",
                 t->file, t->name, hidden, EPD_FFN_BLOCK, hidden);
        return EPD_ERR_CONFIG;
    }
    *intermediate_p = (uint32_t)t->shape[0];
    status = EPD_OK;
out:
    return status;
}

/* Loads projection p of expert e (global id) of layer into its slot of l. */
static epd_status_t load_proj(epd_st_model_t *st, epd_ffn_weights_t *w, epd_ffn_layer_t *l,
                              uint32_t e, int p, char err[EPD_ERR_LEN])
{
    char name[NAME_LEN];
    const epd_st_tensor_t *t;
    epd_status_t status;
    uint32_t le = e - w->first_expert, H = w->hidden, I = w->intermediate;
    uint64_t rows = p == 2 ? H : I, cols = p == 2 ? I : H;
    bool fp8 = w->format == EPD_FFN_FP8_BLOCK;
    size_t eb = elem_bytes(w), n = (size_t)rows * cols;
    uint8_t *dst;
    float *sdst = NULL;
    const char *what = p == 2 ? "a down projection" : "a gate/up projection";

    if (p == 2) {
        dst = (uint8_t *)l->down + (size_t)le * n * eb;
        if (fp8) sdst = l->down_scale + (size_t)le * (rows / 128) * (cols / 128);
    } else {
        dst = (uint8_t *)l->gate_up + ((size_t)le * 2 + (size_t)p) * n * eb;
        if (fp8)
            sdst = l->gate_up_scale + ((size_t)le * 2 + (size_t)p) * (rows / 128) * (cols / 128);
    }
    snprintf(name, sizeof name, LAYER_FMT ".weight", l->layer, e, proj_names[p]);
    CHECK_GOTO(get_tensor(st, name, &t, err), out);
    CHECK_GOTO(check_tensor(t, fp8 ? EPD_ST_F8_E4M3 : EPD_ST_BF16, 2, rows, cols, what, err), out);
    memcpy(dst, t->data, n * eb);
    if (fp8) {
        snprintf(name, sizeof name, LAYER_FMT ".weight_scale_inv", l->layer, e, proj_names[p]);
        CHECK_GOTO(get_tensor(st, name, &t, err), out);
        CHECK_GOTO(check_tensor(t, EPD_ST_F32, 2, ceil_div(rows, 128), ceil_div(cols, 128),
                                "a 128x128 block scale", err), out);
        memcpy(sdst, t->data, (size_t)(rows / 128) * (cols / 128) * sizeof(float));
        for (size_t i = 0; i < (rows / 128) * (cols / 128); i++) {
            if (!(sdst[i] > 0.0f) || !isfinite(sdst[i])) {
                errf(err, "%.100s: tensor %.100s has a scale that is not a "
                         "positive finite number (block %zu)", t->file, t->name, i);
                return EPD_ERR_CONFIG;
            }
        }
    }
    if (l->input_scale != NULL && p != 1) {
        /* the gate's input_scale serves the fused gate/up GEMM; up_proj's must agree */
        float s[2];
        for (int q = 0; q < (p == 0 ? 2 : 1); q++) {
            snprintf(name, sizeof name, LAYER_FMT ".input_scale", l->layer, e, proj_names[p + q]);
            CHECK_GOTO(get_tensor(st, name, &t, err), out);
            CHECK_GOTO(check_tensor(t, EPD_ST_F32, 0, 0, 0, "an input scale", err), out);
            memcpy(&s[q], t->data, sizeof(float));
            if (!(s[q] > 0.0f) || !isfinite(s[q])) {
                errf(err,
                         "%.100s: tensor %.100s is not a positive finite number", t->file,
                         t->name);
                return EPD_ERR_CONFIG;
            }
        }
        if (p == 0 && s[0] != s[1]) {
            errf(err,
                     "%.80s: layer %u expert %u: gate_proj and up_proj input_scale differ (%g, "
                     "%g); they share one activation",
                     t->file, l->layer, e, (double)s[0], (double)s[1]);
            return EPD_ERR_CONFIG;
        }
        l->input_scale[(size_t)le * 2 + (p == 2)] = s[0];
    }
    status = EPD_OK;
out:
    return status;
}

epd_status_t epd_ffn_load(const epd_ffn_spec_t *spec, epd_ffn_weights_t **weights_p,
                          char err[EPD_ERR_LEN])
{
    epd_st_model_t *st = NULL;
    epd_ffn_weights_t *w = NULL;
    uint32_t *found = NULL, intermediate = 0;
    size_t n_found = 0;
    epd_ffn_format_t format;
    epd_status_t status;
    char name[NAME_LEN];

    *weights_p = NULL;
    if (spec == NULL || spec->path == NULL || spec->path[0] == '\0') {
        errf(err, "ffn experts need experts.weights (a safetensors file or "
                 "directory)");
        return EPD_ERR_CONFIG;
    }
    if (spec->n_local == 0 || spec->first_expert + spec->n_local > spec->num_experts ||
        spec->hidden == 0 || spec->hidden % EPD_FFN_BLOCK != 0) {
        errf(err, "ffn experts: a shape they cannot serve");
        return EPD_ERR_INVALID_ARG;
    }
    CHECK_GOTO(epd_st_open(spec->path, &st, err), out);
    CHECK_GOTO(find_layers(st, &found, &n_found, err), out);
    if (n_found == 0) {
        errf(err, "%.160s: no tensor model.layers.*.mlp.experts.* (not a MoE "
                 "checkpoint with DeepSeek-V3 names)", spec->path);
        status = EPD_ERR_CONFIG;
        goto out;
    }
    const uint32_t *layers = spec->n_layers > 0 ? spec->layers : found;
    size_t n_layers = spec->n_layers > 0 ? spec->n_layers : n_found;
    for (size_t i = 0; i < n_layers; i++) {
        bool have = false;
        for (size_t j = 0; j < n_found; j++) have = have || found[j] == layers[i];
        if (!have) {
            errf(err, "%.160s: experts.layers names layer %u, which has no "
                     "experts in the checkpoint", spec->path, layers[i]);
            status = EPD_ERR_CONFIG;
            goto out;
        }
        /* the checkpoint has exactly model.num_experts experts in each layer served */
        snprintf(name, sizeof name, LAYER_FMT ".weight", layers[i], spec->num_experts - 1,
                 "gate_proj");
        if (!epd_st_has(st, name)) {
            errf(err, "%.120s: no tensor %.110s (model.num_experts = %u)",
                     spec->path, name, spec->num_experts);
            status = EPD_ERR_CONFIG;
            goto out;
        }
        snprintf(name, sizeof name, LAYER_FMT ".weight", layers[i], spec->num_experts,
                 "gate_proj");
        if (epd_st_has(st, name)) {
            errf(err, "%.120s: has %.110s, more experts than model.num_experts "
                     "= %u", spec->path, name, spec->num_experts);
            status = EPD_ERR_CONFIG;
            goto out;
        }
    }
    CHECK_GOTO(probe(st, layers[0], spec->first_expert, spec->hidden, &format, &intermediate,
                     err), out);
    if (spec->intermediate != 0 && spec->intermediate != intermediate) {
        errf(err, "%.120s: the experts' intermediate size is %u but "
                 "model.intermediate = %u", spec->path, intermediate, spec->intermediate);
        status = EPD_ERR_CONFIG;
        goto out;
    }
    snprintf(name, sizeof name, LAYER_FMT ".input_scale", layers[0], spec->first_expert,
             "gate_proj");
    bool input_scale = epd_st_has(st, name);
    if (input_scale && format != EPD_FFN_FP8_BLOCK) {
        errf(err, "%.120s: %.100s: input_scale with BF16 weights", spec->path,
                 name);
        status = EPD_ERR_CONFIG;
        goto out;
    }

    w = calloc(1, sizeof *w);
    if (w == NULL) {
        errf(err, "ffn experts: out of memory");
        status = EPD_ERR_NO_MEMORY;
        goto out;
    }
    w->format = format;
    w->hidden = spec->hidden;
    w->intermediate = intermediate;
    w->num_experts = spec->num_experts;
    w->first_expert = spec->first_expert;
    w->n_local = spec->n_local;
    w->n_layers = (uint32_t)n_layers;
    CHECK_GOTO(alloc_layers(w, input_scale, err), out);
    for (size_t i = 0; i < n_layers; i++) {
        w->layers[i].layer = layers[i];
        for (uint32_t e = w->first_expert; e < w->first_expert + w->n_local; e++)
            for (int p = 0; p < 3; p++) CHECK_GOTO(load_proj(st, w, &w->layers[i], e, p, err), out);
    }
    *weights_p = w;
    w = NULL;
    status = EPD_OK;
out:
    epd_ffn_free(w);
    free(found);
    epd_st_close(st);
    return status;
}

/* ---- synthetic weights ---------------------------------------------------------------- */

epd_status_t epd_ffn_random(epd_ffn_format_t format, uint32_t hidden, uint32_t intermediate,
                            uint32_t num_experts, uint32_t first_expert, uint32_t n_local,
                            uint32_t n_layers, uint64_t seed, epd_ffn_weights_t **weights_p,
                            char err[EPD_ERR_LEN])
{
    epd_ffn_weights_t *w;
    epd_status_t status;

    *weights_p = NULL;
    if (hidden == 0 || hidden % EPD_FFN_BLOCK != 0 || intermediate == 0 ||
        intermediate % EPD_FFN_BLOCK != 0 || n_local == 0 || n_layers == 0 ||
        first_expert + n_local > num_experts) {
        errf(err, "ffn random weights: H and I must be multiples of 128");
        return EPD_ERR_INVALID_ARG;
    }
    w = calloc(1, sizeof *w);
    if (w == NULL) {
        errf(err, "ffn experts: out of memory");
        return EPD_ERR_NO_MEMORY;
    }
    w->format = format;
    w->hidden = hidden;
    w->intermediate = intermediate;
    w->num_experts = num_experts;
    w->first_expert = first_expert;
    w->n_local = n_local;
    w->n_layers = n_layers;
    status = alloc_layers(w, false, err);
    if (status != EPD_OK) {
        epd_ffn_free(w);
        return status;
    }
    for (uint32_t i = 0; i < n_layers; i++) {
        epd_ffn_layer_t *l = &w->layers[i];
        l->layer = i;
        size_t n[2] = {gate_up_elems(w) * n_local, gate_up_elems(w) / 2 * n_local};
        uint32_t in[2] = {hidden, intermediate};
        void *dst[2] = {l->gate_up, l->down};
        float *sdst[2] = {l->gate_up_scale, l->down_scale};
        for (int m = 0; m < 2; m++) {
            /* uniform in +-sqrt(3/in): variance 1/in, so each projection keeps x's spread */
            float bound = sqrtf(3.0f / (float)in[m]);
            uint64_t s = epd_rng_hash(seed ^ ((uint64_t)i << 32) ^ (uint64_t)m);
            if (format == EPD_FFN_BF16) {
                uint16_t *d = dst[m];
                for (size_t j = 0; j < n[m]; j++)
                    d[j] = epd_f32_to_bf16((2.0f * epd_rng_unit_f32(&s) - 1.0f) * bound);
            } else {
                /* e4m3 codes over the whole range, blocks scaled so |w| <= bound */
                uint8_t *d = dst[m];
                for (size_t j = 0; j < n[m]; j++) {
                    d[j] = epd_e4m3_from_f32((2.0f * epd_rng_unit_f32(&s) - 1.0f) * 448.0f);
                }
                size_t ns = (m == 0 ? gate_up_scales(w) : gate_up_scales(w) / 2) * n_local;
                for (size_t j = 0; j < ns; j++)
                    sdst[m][j] = bound / 448.0f * (0.75f + 0.5f * epd_rng_unit_f32(&s));
            }
        }
    }
    *weights_p = w;
    return EPD_OK;
}

const epd_ffn_layer_t *epd_ffn_find_layer(const epd_ffn_weights_t *w, uint32_t layer)
{
    if (w == NULL) return NULL;
    for (uint32_t i = 0; i < w->n_layers; i++)
        if (w->layers[i].layer == layer) return &w->layers[i];
    return NULL;
}

/* ---- host arithmetic ------------------------------------------------------------------ */

void epd_ffn_quant_f32_host(const float *v, uint32_t n, uint8_t *q, float *scales)
{
    for (uint32_t g = 0; g < n / EPD_QUANT_GROUP; g++) {
        const float *x = v + (size_t)g * EPD_QUANT_GROUP;
        float amax = 0.0f, s, mult;
        for (int i = 0; i < EPD_QUANT_GROUP; i++) {
            float a = fabsf(x[i]);
            if (a > amax) amax = a;
        }
        epd_quant_scale(amax, 0, &s, &mult);
        for (int i = 0; i < EPD_QUANT_GROUP; i++)
            q[(size_t)g * EPD_QUANT_GROUP + i] = epd_e4m3_from_f32(x[i] * mult);
        scales[g] = s;
    }
}

size_t epd_ffn_scratch_floats(const epd_ffn_weights_t *w)
{
    /* gate/up outputs (2I), the activation dequantized (max(H, I)), h's bytes and scales */
    size_t big = w->hidden > w->intermediate ? w->hidden : w->intermediate;
    return 2 * (size_t)w->intermediate + big + big / 4 + big / EPD_QUANT_GROUP + 16;
}

/* The fp32 value of every e4m3 code, filled on first use (a matvec reads one per weight). */
static float e4m3_values[256];
static pthread_once_t e4m3_once = PTHREAD_ONCE_INIT;

static void e4m3_fill(void)
{
    for (int c = 0; c < 256; c++) e4m3_values[c] = epd_e4m3_to_f32((uint8_t)c);
}

/* out[r] = (float) sum_c (double)a[c] * (double)W[r][c], rows [0, rows) of a [rows, cols] matrix
 * of bf16 (scale NULL) or e4m3 with 128x128 block scales (w = (float)q * scale in fp32). The sum
 * runs in four fp64 lanes (c mod 4), added at the end: a fixed order, so every call with the same
 * operands gives the same bits, and four times the throughput of one dependent chain. */
static void matvec(const void *wmat, const float *scale, uint32_t rows, uint32_t cols,
                   const float *a, float *out)
{
    size_t bcols = cols / EPD_FFN_BLOCK;

    pthread_once(&e4m3_once, e4m3_fill);
    for (uint32_t r = 0; r < rows; r++) {
        double acc[4] = {0.0, 0.0, 0.0, 0.0};
        if (scale == NULL) {
            const uint16_t *wr = (const uint16_t *)wmat + (size_t)r * cols;
            for (uint32_t c = 0; c < cols; c += 4)
                for (int l = 0; l < 4; l++)
                    acc[l] += (double)a[c + l] * (double)epd_bf16_to_f32(wr[c + l]);
        } else {
            const uint8_t *wr = (const uint8_t *)wmat + (size_t)r * cols;
            const float *sr = scale + (size_t)(r / EPD_FFN_BLOCK) * bcols;
            for (uint32_t c = 0; c < cols; c += 4) {
                float sc = sr[c / EPD_FFN_BLOCK];
                for (int l = 0; l < 4; l++)
                    acc[l] += (double)a[c + l] * (double)(e4m3_values[wr[c + l]] * sc);
            }
        }
        out[r] = (float)((acc[0] + acc[1]) + (acc[2] + acc[3]));
    }
}

/* The activation of an FP8 GEMM dequantized: with a static scale S, first requantized to it
 * (q' = e4m3(x * (1/S)), x' = q' * S: section 3's requantization); else q * group scale. */
static void fp8_activation(const uint8_t *q, const float *scales, uint32_t n, const float *input_s,
                           float *out)
{
    for (uint32_t i = 0; i < n; i++) {
        float v = epd_e4m3_to_f32(q[i]) * scales[i / EPD_QUANT_GROUP];
        if (input_s != NULL)
            v = epd_e4m3_to_f32(epd_e4m3_from_f32(v * (1.0f / *input_s))) * *input_s;
        out[i] = v;
    }
}

void epd_ffn_expert_host(const epd_ffn_weights_t *w, const epd_ffn_layer_t *l, uint32_t e,
                         const epd_ffn_row_t *row, float *scratch, float *y)
{
    uint32_t H = w->hidden, I = w->intermediate;
    bool fp8 = w->format == EPD_FFN_FP8_BLOCK;
    size_t big = H > I ? H : I;
    float *gu = scratch;             /* [2I]: gate, then up */
    float *act = scratch + 2 * (size_t)I; /* [big] */
    uint8_t *hq = (uint8_t *)(act + big); /* [big] bytes */
    float *hs = act + big + big / 4;      /* [big / 128] */
    const float *in_s = l->input_scale != NULL ? &l->input_scale[(size_t)e * 2] : NULL;
    const float *down_s = l->input_scale != NULL ? &l->input_scale[(size_t)e * 2 + 1] : NULL;
    size_t gu_elems = 2 * (size_t)I * H;

    if (fp8) {
        const uint8_t *wgu = (const uint8_t *)l->gate_up + (size_t)e * gu_elems;
        const float *sgu = l->gate_up_scale + (size_t)e * gate_up_scales(w);
        fp8_activation(row->q, row->scales, H, in_s, act);
        matvec(wgu, sgu, 2 * I, H, act, gu);
    } else {
        const uint16_t *wgu = (const uint16_t *)l->gate_up + (size_t)e * gu_elems;
        matvec(wgu, NULL, 2 * I, H, row->x, gu);
    }
    /* h = silu(g) * u in fp32, then what the down GEMM reads */
    for (uint32_t i = 0; i < I; i++) {
        float g = gu[i], u = gu[I + i];
        float silu = g / (1.0f + expf(-g));
        act[i] = silu * u;
    }
    if (fp8) {
        const uint8_t *wd = (const uint8_t *)l->down + (size_t)e * gu_elems / 2;
        const float *sd = l->down_scale + (size_t)e * gate_up_scales(w) / 2;
        epd_ffn_quant_f32_host(act, I, hq, hs);
        fp8_activation(hq, hs, I, down_s, act);
        matvec(wd, sd, H, I, act, y);
    } else {
        const uint16_t *wd = (const uint16_t *)l->down + (size_t)e * gu_elems / 2;
        for (uint32_t i = 0; i < I; i++) act[i] = epd_bf16_to_f32(epd_f32_to_bf16(act[i]));
        matvec(wd, NULL, H, I, act, y);
    }
}
