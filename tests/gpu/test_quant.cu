/* GPU test of gpu/quant.cu: every kernel against the host reference (gpu/quant_host.c), bit for
 * bit, on random rows with outliers, zero rows and subnormals; exhaustive checks of the hardware
 * e4m3/bf16 conversions against gpu/fp8.h; the expert-grouped requant layout with random live
 * counts; a self-check that the comparison finds an injected mismatch. One line per case, then
 * 'N passed, N failed'; exit 0 only if all pass, 77 without a GPU. The host numerics themselves
 * are checked against independent expectations by tests/unit/test_quant.c. */
#include <cuda_runtime.h>

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "gpu/fp8.h"
#include "gpu/quant.h"
#include "gpu/quant_dev.cuh"
#include "tests/gpu/cuda_check.cuh"
#include "tests/gpu/quant_sweep.h"

static int n_pass, n_fail;
static uint32_t sm_count; /* of device 0, for the launch picker */

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}
static float rnd_unit(void) { return (float)(rnd() % 2000001) / 1000000.0f - 1.0f; }

static void report(bool ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void report(bool ok, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("%s  ", ok ? "PASS" : "FAIL");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    fflush(stdout);
    if (ok) n_pass++;
    else n_fail++;
}

/* First differing byte of two buffers (row-major, row_bytes per row), described in msg. */
static size_t first_bad; /* byte index of the last mismatch same_bytes found */
static bool same_bytes(const void *want, const void *got, size_t n, size_t row_bytes, size_t elem,
                       char *msg, size_t len)
{
    const uint8_t *a = (const uint8_t *)want, *b = (const uint8_t *)got;
    for (size_t i = 0; i < n; i++) {
        if (a[i] == b[i]) continue;
        first_bad = i;
        size_t e = i / elem * elem;
        uint32_t wa = 0, wb = 0;
        memcpy(&wa, a + e, elem);
        memcpy(&wb, b + e, elem);
        snprintf(msg, len, "first mismatch at byte %zu (row %zu, element %zu): host 0x%0*x, device 0x%0*x",
                 i, i / row_bytes, (i % row_bytes) / elem, (int)elem * 2, wa, (int)elem * 2, wb);
        return false;
    }
    msg[0] = 0;
    return true;
}

/* Random bf16 rows: amplitudes 2^-20..2^20, 1% outliers up to 10^4x, some zero rows, some rows of
 * bf16 subnormals, exact ties. */
static void gen_rows(uint16_t *x, uint32_t rows, uint32_t hidden, size_t stride)
{
    for (uint32_t r = 0; r < rows; r++) {
        uint16_t *row = x + (size_t)r * stride;
        float amp = ldexpf(1.0f, (int)(rnd() % 41) - 20);
        int kind = r % 17 == 3 ? 0 : r % 13 == 5 ? 1 : 2;
        for (uint32_t i = 0; i < hidden; i++) {
            float v;
            if (kind == 0) v = 0.0f;
            else if (kind == 1) v = rnd_unit() * 1e-39f;
            else {
                v = rnd_unit() * amp;
                if (rnd() % 100 == 0) v *= (float)(1 + rnd() % 10000);
                if (rnd() % 50 == 0) v = amp * (1.0f + (float)(rnd() % 16) / 16.0f); /* ties */
            }
            row[i] = epd_f32_to_bf16(v);
        }
    }
}

/* ---- the implementation under test: the CUDA launchers ---- */

static void *dev_copy(const void *src, size_t bytes)
{
    void *p = NULL;
    CUDA_OK(cudaMalloc(&p, bytes ? bytes : 16));
    if (src) CUDA_OK(cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice));
    return p;
}

static void dev_back(void *dst, void *src, size_t bytes)
{
    CUDA_OK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaFree(src));
}

static epd_status_t impl_quant(const uint16_t *x, uint32_t rows, uint32_t hidden, size_t xs,
                               epd_scale_kind_t kind, epd_scale_fmt_t fmt, uint8_t *q, size_t qs,
                               float *s, size_t ss, const epd_quant_launch_t *l, char *err)
{
    size_t qb = (size_t)rows * qs, sb = (size_t)rows * ss * sizeof(float);
    void *dx = dev_copy(x, (size_t)rows * xs * 2), *dq = dev_copy(q, qb), *ds = dev_copy(s, sb);
    epd_status_t st = epd_quant_cuda((const uint16_t *)dx, rows, hidden, xs, kind, fmt,
                                     (uint8_t *)dq, qs, (float *)ds, ss, l, NULL, err);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaFree(dx));
    dev_back(q, dq, qb);
    dev_back(s, ds, sb);
    return st;
}

static epd_status_t impl_dequant(const uint8_t *q, const float *s, uint32_t rows, uint32_t hidden,
                                 epd_scale_kind_t kind, float *f, uint16_t *b,
                                 const epd_quant_launch_t *l, char *err)
{
    uint32_t ns = epd_quant_n_scales(hidden, kind);
    size_t n = (size_t)rows * hidden;
    void *dq = dev_copy(q, n), *ds = dev_copy(s, (size_t)rows * ns * 4);
    void *df = dev_copy(NULL, n * 4), *db = dev_copy(NULL, n * 2);
    epd_status_t st = epd_dequant_cuda((const uint8_t *)dq, (const float *)ds, rows, hidden, kind,
                                       (float *)df, l, NULL, err);
    if (st == EPD_OK)
        st = epd_dequant_bf16_cuda((const uint8_t *)dq, (const float *)ds, rows, hidden, kind,
                                   (uint16_t *)db, l, NULL, err);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaFree(dq));
    CUDA_OK(cudaFree(ds));
    dev_back(f, df, n * 4);
    dev_back(b, db, n * 2);
    return st;
}

/* Requant on (E, cap, H): q_out (prefilled by the caller, or NULL for in place into q). */
static epd_status_t impl_requant(uint8_t *q, const float *s, const int32_t *counts, uint32_t E,
                                 uint32_t cap, uint32_t hidden, epd_scale_kind_t kind, float static_s,
                                 uint8_t *q_out, float *big_s, const epd_quant_launch_t *l, char *err)
{
    uint32_t ns = epd_quant_n_scales(hidden, kind);
    size_t nq = (size_t)E * cap * hidden;
    void *dq = dev_copy(q, nq), *ds = dev_copy(s, (size_t)E * cap * ns * 4);
    void *dc = dev_copy(counts, E * sizeof(int32_t)), *dbig = dev_copy(NULL, 4);
    void *dout = q_out ? dev_copy(q_out, nq) : dq;
    CUDA_OK(cudaMemset(dbig, 0xff, 4));
    CUDA_OK(cudaDeviceSynchronize()); /* asynchronous, on the legacy stream */
    epd_status_t st = epd_requant_cuda((const uint8_t *)dq, (const float *)ds, (const int32_t *)dc,
                                       E, cap, hidden, kind, static_s, (uint8_t *)dout,
                                       (float *)dbig, l, NULL, err);
    CUDA_OK(cudaDeviceSynchronize());
    if (q_out) dev_back(q_out, dout, nq);
    dev_back(q, dq, nq);
    CUDA_OK(cudaFree(ds));
    CUDA_OK(cudaFree(dc));
    dev_back(big_s, dbig, 4);
    return st;
}

static const char *kind_name(epd_scale_kind_t k) { return k == EPD_SCALE_PER_TOKEN ? "per_token" : "group128"; }
static const char *fmt_name(epd_scale_fmt_t f) { return f == EPD_SCALE_FMT_UE8M0 ? "ue8m0" : "fp32"; }

/* ---- cases ---- */

/* Quantize (strided when pad > 0) and dequantize, compare with the host reference. */
static void case_quant(uint32_t rows, uint32_t hidden, epd_scale_kind_t kind, epd_scale_fmt_t fmt,
                       uint32_t pad, const epd_quant_launch_t *l)
{
    uint32_t ns = epd_quant_n_scales(hidden, kind);
    size_t xs = hidden + pad * 8, qs = hidden + pad * 16, ss = ns + pad * 3;
    uint16_t *x = (uint16_t *)malloc((size_t)rows * xs * 2);
    uint8_t *qr = (uint8_t *)malloc((size_t)rows * qs), *qd = (uint8_t *)malloc((size_t)rows * qs);
    float *sr = (float *)malloc((size_t)rows * ss * 4), *sd = (float *)malloc((size_t)rows * ss * 4);
    char err[EPD_ERR_LEN] = "", msg[256] = "", lmsg[64] = "picked";
    gen_rows(x, rows, hidden, xs);
    memset(qr, 0xa5, (size_t)rows * qs);
    memset(qd, 0xa5, (size_t)rows * qs);
    memset(sr, 0xa5, (size_t)rows * ss * 4);
    memset(sd, 0xa5, (size_t)rows * ss * 4);
    for (uint32_t r = 0; r < rows; r++)
        epd_quant_row_host(x + r * xs, hidden, kind, fmt, qr + r * qs, sr + r * ss);
    epd_quant_launch_t used = l ? *l : epd_quant_launch_pick(kind == EPD_SCALE_PER_TOKEN ?
                                                             EPD_QK_QUANT_TOKEN : EPD_QK_QUANT_GROUP,
                                                             hidden, rows, sm_count);
    snprintf(lmsg, sizeof lmsg, "%s(threads %u vec %u rows %u)", l ? "given" : "picked",
             used.threads, used.vec, used.rows);
    epd_status_t st = impl_quant(x, rows, hidden, xs, kind, fmt, qd, qs, sd, ss, l, err);
    bool ok = st == EPD_OK;
    if (!ok) snprintf(msg, sizeof msg, "status %d: %s", (int)st, err);
    if (ok && !same_bytes(qr, qd, (size_t)rows * qs, qs, 1, msg, sizeof msg)) {
        ok = false;
        size_t r = first_bad / qs, c = first_bad % qs;
        if (c < hidden) {
            size_t len = strlen(msg);
            float sc = sr[r * ss + (kind == EPD_SCALE_PER_TOKEN ? 0 : c / 128)];
            snprintf(msg + len, sizeof msg - len, "; x %.9g (bf16 0x%04x), host scale %.9g",
                     epd_bf16_to_f32(x[r * xs + c]), x[r * xs + c], sc);
        }
    }
    if (ok && !same_bytes(sr, sd, (size_t)rows * ss * 4, ss * 4, 4, msg, sizeof msg)) {
        ok = false;
        strncat(msg, " [scales]", sizeof msg - strlen(msg) - 1);
    }
    report(ok, "quant %-9s %-5s M=%-5u H=%-5u %s%s %s", kind_name(kind), fmt_name(fmt), rows, hidden,
           pad ? "strided " : "", lmsg, msg);

    if (pad == 0 && l == NULL) {
        size_t n = (size_t)rows * hidden;
        float *fr = (float *)malloc(n * 4), *fd = (float *)malloc(n * 4);
        uint16_t *br = (uint16_t *)malloc(n * 2), *bd = (uint16_t *)malloc(n * 2);
        epd_dequant_host(qr, sr, rows, hidden, kind, fr, err);
        epd_dequant_bf16_host(qr, sr, rows, hidden, kind, br, err);
        st = impl_dequant(qr, sr, rows, hidden, kind, fd, bd, NULL, err);
        ok = st == EPD_OK;
        if (!ok) snprintf(msg, sizeof msg, "status %d: %s", (int)st, err);
        if (ok) ok = same_bytes(fr, fd, n * 4, (size_t)hidden * 4, 4, msg, sizeof msg);
        report(ok, "dequant fp32 %-9s M=%-5u H=%-5u %s", kind_name(kind), rows, hidden, msg);
        if (ok) ok = same_bytes(br, bd, n * 2, (size_t)hidden * 2, 2, msg, sizeof msg);
        report(ok, "dequant bf16 %-9s M=%-5u H=%-5u %s", kind_name(kind), rows, hidden, msg);
        free(fr);
        free(fd);
        free(br);
        free(bd);
    }
    free(x);
    free(qr);
    free(qd);
    free(sr);
    free(sd);
}

/* Requant of (E, cap, H): random live counts (0 and full included; with `wild`, counts outside
 * [0, cap] that the device clamps), dead rows full of garbage with huge scales. */
static void case_requant(uint32_t E, uint32_t cap, uint32_t hidden, epd_scale_kind_t kind,
                         int s_mode, bool in_place, bool wild, const epd_quant_launch_t *l)
{
    uint32_t ns = epd_quant_n_scales(hidden, kind);
    size_t nq = (size_t)E * cap * hidden, nsc = (size_t)E * cap * ns;
    uint8_t *q = (uint8_t *)malloc(nq), *q2 = (uint8_t *)malloc(nq);
    uint8_t *ref = (uint8_t *)malloc(nq), *got = (uint8_t *)malloc(nq);
    float *s = (float *)malloc(nsc * 4);
    int32_t *counts = (int32_t *)malloc(E * 4 + 4), *clamped = (int32_t *)malloc(E * 4 + 4);
    uint16_t *x = (uint16_t *)malloc((size_t)hidden * 2);
    char err[EPD_ERR_LEN] = "", msg[256] = "";
    for (uint32_t e = 0; e < E; e++) {
        uint32_t pick = rnd() % 4;
        counts[e] = pick == 0 ? 0 : pick == 1 ? (int32_t)cap : (int32_t)(rnd() % (cap + 1));
        if (wild && e % 3 == 1) counts[e] = e % 2 ? -5 : (int32_t)cap + 7;
        clamped[e] = counts[e] < 0 ? 0 : counts[e] > (int32_t)cap ? (int32_t)cap : counts[e];
        for (uint32_t r = 0; r < cap; r++) {
            size_t row = (size_t)e * cap + r;
            if ((int32_t)r < clamped[e]) {
                gen_rows(x, 1, hidden, hidden);
                epd_quant_row_host(x, hidden, kind, EPD_SCALE_FMT_FP32, q + row * hidden, s + row * ns);
                if (row % 5 == 2) { /* the two NaN codes must come out as the host's 0x7f */
                    q[row * hidden + row % hidden] = 0xff;
                    q[row * hidden + (row + 1) % hidden] = 0x7f;
                }
            } else {
                for (uint32_t i = 0; i < hidden; i++) q[row * hidden + i] = (uint8_t)rnd();
                for (uint32_t k = 0; k < ns; k++) s[row * ns + k] = 1e30f;
            }
        }
    }
    float step = 0, static_s = 0, ref_s = -1, got_s = -1;
    epd_requant_step_scale_host(s, clamped, E, cap, hidden, kind, &step, err);
    if (s_mode == 1) static_s = step > 0 ? step / 4 : 1.0f; /* saturates */
    if (s_mode == 2) static_s = step > 0 ? step * 3 : 1.0f;
    memcpy(q2, q, nq);
    memset(ref, 0x5a, nq);
    memset(got, 0x5a, nq);
    if (in_place) {
        memcpy(ref, q, nq);
        memcpy(got, q, nq);
    }
    epd_status_t st = epd_requant_host(in_place ? ref : q, s, clamped, E, cap, hidden, kind,
                                       static_s, ref, &ref_s, err);
    bool ok = st == EPD_OK;
    if (!ok) snprintf(msg, sizeof msg, "host status %d: %s", (int)st, err);
    if (ok) {
        st = in_place ? impl_requant(got, s, counts, E, cap, hidden, kind, static_s, NULL, &got_s, l, err)
                      : impl_requant(q2, s, counts, E, cap, hidden, kind, static_s, got, &got_s, l, err);
        ok = st == EPD_OK;
        if (!ok) snprintf(msg, sizeof msg, "status %d: %s", (int)st, err);
    }
    if (ok) ok = same_bytes(ref, got, nq, hidden, 1, msg, sizeof msg);
    if (ok && memcmp(&ref_s, &got_s, 4) != 0) {
        ok = false;
        snprintf(msg, sizeof msg, "S: host %.9g (0x%08x), device %.9g (0x%08x)", ref_s,
                 epd_f32_bits(ref_s), got_s, epd_f32_bits(got_s));
    }
    if (ok && !in_place && memcmp(q, q2, nq) != 0) {
        ok = false;
        snprintf(msg, sizeof msg, "the input q was modified");
    }
    uint64_t live = 0;
    for (uint32_t e = 0; e < E; e++) live += (uint64_t)clamped[e];
    epd_quant_launch_t used = l ? *l : epd_quant_launch_pick(EPD_QK_REQUANT, hidden, cap, sm_count);
    report(ok, "requant %-9s E=%-3u cap=%-4u H=%-5u live=%-6llu S=%s%s%s (threads %u vec %u rows %u) %s",
           kind_name(kind), E, cap, hidden, (unsigned long long)live,
           s_mode == 0 ? "step" : s_mode == 1 ? "static-small" : "static-large",
           in_place ? " in-place" : "", wild ? " wild-counts" : "", used.threads, used.vec,
           used.rows, msg);
    free(q);
    free(q2);
    free(ref);
    free(got);
    free(s);
    free(counts);
    free(clamped);
    free(x);
}

/* The layout-aware requant (epd_requant_given_cuda, epd_requant_step_cuda) on (E, cap, H) with
 * counts `live` per expert (live < 0: random in [0, -live]), against the host: S given (mode 0:
 * the host step scale, i.e. what the count exchange delivers; 1: a quarter of it, saturating;
 * 2: three times it) or reduced on the device (mode 3). Dead rows hold garbage with huge scales
 * and must come out untouched. */
static void case_requant_live(uint32_t E, uint32_t cap, uint32_t hidden, epd_scale_kind_t kind,
                              int live, int s_mode, bool in_place, const epd_quant_launch_t *l)
{
    uint32_t ns = epd_quant_n_scales(hidden, kind);
    size_t nq = (size_t)E * cap * hidden, nsc = (size_t)E * cap * ns;
    /* (+16: never a NULL buffer, also for no expert) */
    uint8_t *q = (uint8_t *)malloc(nq + 16), *ref = (uint8_t *)malloc(nq + 16);
    uint8_t *got = (uint8_t *)malloc(nq + 16);
    float *s = (float *)malloc(nsc * 4 + 16);
    int32_t *counts = (int32_t *)malloc(E * 4 + 4);
    uint16_t *x = (uint16_t *)malloc((size_t)hidden * 2);
    char err[EPD_ERR_LEN] = "", msg[256] = "";
    uint64_t live_rows = 0;
    for (uint32_t e = 0; e < E; e++) {
        counts[e] = live >= 0 ? live : (int32_t)(rnd() % (uint32_t)(1 - live));
        live_rows += (uint64_t)counts[e];
        for (uint32_t r = 0; r < cap; r++) {
            size_t row = (size_t)e * cap + r;
            if ((int32_t)r < counts[e]) {
                gen_rows(x, 1, hidden, hidden);
                epd_quant_row_host(x, hidden, kind, EPD_SCALE_FMT_FP32, q + row * hidden, s + row * ns);
                if (row % 5 == 2) {
                    q[row * hidden + row % hidden] = 0xff;
                    q[row * hidden + (row + 1) % hidden] = 0x7f;
                }
            } else {
                const uint32_t g = rnd();
                for (uint32_t i = 0; i < hidden; i++) q[row * hidden + i] = (uint8_t)(g + i * 131u);
                for (uint32_t k = 0; k < ns; k++) s[row * ns + k] = 1e30f;
            }
        }
    }
    float step = 0, given = 0, ref_s = -1, got_s = -1;
    epd_requant_step_scale_host(s, counts, E, cap, hidden, kind, &step, err);
    given = s_mode == 0 ? step : s_mode == 1 ? step / 4 : s_mode == 2 ? step * 3 : 0.0f;
    memset(ref, 0x5a, nq);
    memset(got, 0x5a, nq);
    if (in_place) {
        memcpy(ref, q, nq);
        memcpy(got, q, nq);
    }
    epd_status_t st = s_mode == 3 ? epd_requant_host(in_place ? ref : q, s, counts, E, cap, hidden,
                                                     kind, 0.0f, ref, &ref_s, err)
                                  : epd_requant_given_host(in_place ? ref : q, s, counts, E, cap,
                                                           hidden, kind, given, ref, err);
    bool ok = st == EPD_OK;
    if (!ok) snprintf(msg, sizeof msg, "host status %d: %s", (int)st, err);
    if (ok) {
        void *dq = dev_copy(q, nq), *ds = dev_copy(s, nsc * 4), *dbig = dev_copy(NULL, 4);
        void *dout = in_place ? dq : dev_copy(got, nq);
        CUDA_OK(cudaMemset(dbig, 0xff, 4));
        CUDA_OK(cudaDeviceSynchronize()); /* asynchronous, on the legacy stream */
        st = s_mode == 3 ? epd_requant_step_cuda((const uint8_t *)dq, (const float *)ds, counts, E,
                                                 cap, hidden, kind, (uint8_t *)dout, (float *)dbig,
                                                 l, NULL, err)
                         : epd_requant_given_cuda((const uint8_t *)dq, (const float *)ds, counts, E,
                                                  cap, hidden, kind, given, (uint8_t *)dout, l,
                                                  NULL, err);
        CUDA_OK(cudaDeviceSynchronize());
        if (!in_place) {
            uint8_t *q_back = (uint8_t *)malloc(nq);
            CUDA_OK(cudaMemcpy(q_back, dq, nq, cudaMemcpyDeviceToHost));
            if (memcmp(q_back, q, nq) != 0 && st == EPD_OK) {
                st = EPD_ERR_INTERNAL;
                snprintf(err, sizeof err, "the input q was modified");
            }
            free(q_back);
            dev_back(got, dout, nq);
            CUDA_OK(cudaFree(dq));
        } else {
            dev_back(got, dq, nq);
        }
        CUDA_OK(cudaFree(ds));
        dev_back(&got_s, dbig, 4);
        ok = st == EPD_OK;
        if (!ok) snprintf(msg, sizeof msg, "status %d: %s", (int)st, err);
    }
    if (ok) ok = same_bytes(ref, got, nq, hidden, 1, msg, sizeof msg);
    if (ok && s_mode == 3 && memcmp(&ref_s, &got_s, 4) != 0) {
        ok = false;
        snprintf(msg, sizeof msg, "S: host %.9g (0x%08x), device %.9g (0x%08x)", ref_s,
                 epd_f32_bits(ref_s), got_s, epd_f32_bits(got_s));
    }
    epd_quant_launch_t used = l ? *l : epd_quant_launch_pick(EPD_QK_REQUANT_LIVE, hidden,
                                                             (uint32_t)live_rows, sm_count);
    static const char *const mode_names[] = {"given-step", "given-small", "given-large", "step-device"};
    report(ok, "requant_live %-9s E=%-3u cap=%-4u H=%-5u live=%-6llu S=%s%s (%s %s) %s",
           kind_name(kind), E, cap, hidden, (unsigned long long)live_rows, mode_names[s_mode],
           in_place ? " in-place" : "", l ? "given" : "picked", epd_geom_str(used).c_str(), msg);
    free(q);
    free(ref);
    free(got);
    free(s);
    free(counts);
    free(x);
}

/* The layout-aware launchers' own argument checks. */
static void case_requant_live_args(void)
{
    char err[EPD_ERR_LEN] = "";
    uint8_t *dq;
    float *ds;
    CUDA_OK(cudaMalloc(&dq, 4096));
    CUDA_OK(cudaMalloc(&ds, 4096));
    int32_t one[2] = {1, 0}, none[2] = {0, 0}, bad[2] = {3, 0};
    epd_quant_launch_t badl = {224, 3, 1, 0}, badf = {224, 2, 1, 0, 0, EPD_QL_ALL + 1},
                       bads = {224, 2, 1, 0, EPD_REQUANT_MAX_PARTS + 1, 0};
    bool ok = epd_requant_given_cuda(dq, ds, one, 2, 2, 128, EPD_SCALE_GROUP128, 0.0f, dq, NULL,
                                     NULL, err) == EPD_ERR_INVALID_ARG &&
              epd_requant_given_cuda(dq, ds, none, 2, 2, 128, EPD_SCALE_GROUP128, 0.0f, dq, NULL,
                                     NULL, err) == EPD_OK &&
              epd_requant_given_cuda(dq, ds, one, 2, 2, 128, EPD_SCALE_GROUP128, -1.0f, dq, NULL,
                                     NULL, err) == EPD_ERR_INVALID_ARG &&
              epd_requant_given_cuda(dq, ds, one, 2, 2, 128, EPD_SCALE_GROUP128, INFINITY, dq,
                                     NULL, NULL, err) == EPD_ERR_INVALID_ARG &&
              epd_requant_given_cuda(dq, ds, bad, 2, 2, 128, EPD_SCALE_GROUP128, 1.0f, dq, NULL,
                                     NULL, err) == EPD_ERR_INVALID_ARG &&
              epd_requant_given_cuda(dq + 1, ds, one, 2, 2, 128, EPD_SCALE_GROUP128, 1.0f, dq,
                                     NULL, NULL, err) == EPD_ERR_INVALID_ARG &&
              epd_requant_given_cuda(dq, ds, NULL, 2, 2, 128, EPD_SCALE_GROUP128, 1.0f, dq, NULL,
                                     NULL, err) == EPD_ERR_INVALID_ARG &&
              epd_requant_given_cuda(dq, ds, one, 2, 2, 100, EPD_SCALE_GROUP128, 1.0f, dq, NULL,
                                     NULL, err) == EPD_ERR_INVALID_ARG &&
              epd_requant_given_cuda(dq, ds, one, 2, 2, 128, EPD_SCALE_GROUP128, 1.0f, dq, &badl,
                                     NULL, err) == EPD_ERR_INVALID_ARG &&
              epd_requant_given_cuda(dq, ds, one, 2, 2, 128, EPD_SCALE_GROUP128, 1.0f, dq, &badf,
                                     NULL, err) == EPD_ERR_INVALID_ARG &&
              epd_requant_given_cuda(dq, ds, one, 2, 2, 128, EPD_SCALE_GROUP128, 1.0f, dq, &bads,
                                     NULL, err) == EPD_ERR_INVALID_ARG &&
              epd_requant_step_cuda(dq, ds, one, 2, 2, 128, EPD_SCALE_GROUP128, dq, NULL, NULL,
                                    NULL, err) == EPD_ERR_INVALID_ARG;
    CUDA_OK(cudaDeviceSynchronize());
    /* a layout whose rows and rows a tile do not fit the 32-bit tile word: an error, no launch
     * (4095 x 2^19 rows, 8-row tiles; all counts 0, so no buffer is read) */
    {
        std::vector<int32_t> zeros(4095, 0);
        epd_quant_launch_t eight = {224, 2, 8, 4};
        ok = ok && epd_requant_given_cuda(dq, ds, zeros.data(), 4095, 1u << 19, 128,
                                          EPD_SCALE_GROUP128, 1.0f, dq, &eight, NULL,
                                          err) == EPD_ERR_INVALID_ARG;
    }
    /* no live row: the step scale is 0 and nothing runs */
    float got = -1.0f;
    ok = ok && epd_requant_step_cuda(dq, ds, none, 2, 2, 128, EPD_SCALE_GROUP128, dq, ds, NULL,
                                     NULL, err) == EPD_OK;
    CUDA_OK(cudaMemcpy(&got, ds, 4, cudaMemcpyDeviceToHost));
    ok = ok && got == 0.0f;
    report(ok, "layout-aware requant rejects S <= 0 with live rows, non-finite S, bad counts, "
               "alignment, NULL counts, bad H, launch, variant bits and parts, a layout too large for a tile word; S = 0 "
               "with no live row (last: %s)", err);
    CUDA_OK(cudaFree(dq));
    CUDA_OK(cudaFree(ds));
}

/* ---- exhaustive conversion checks (GPU only) ---- */

struct cvt_stats {
    unsigned long long bad_finite, bad_nan, first_finite, first_nan;
    unsigned long long bad_bf16, first_bf16;
};

/* epd_dev_cvt4 takes results of multiplies: a NaN input is passed through one (by `one`, a
 * kernel argument, so that the compiler cannot drop it), any other value as it is. */
__global__ void cvt_all_kernel(cvt_stats *st, float one)
{
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (1ull << 30); i += stride) {
        uint32_t base = (uint32_t)(i * 4);
        float f[4], g[4];
        for (int k = 0; k < 4; k++) {
            f[k] = __uint_as_float(base + (uint32_t)k);
            g[k] = isnan(f[k]) ? __fmul_rn(f[k], one) : f[k];
        }
        uint32_t w = epd_dev_cvt4(g[0], g[1], g[2], g[3]);
        uint32_t b01 = epd_dev_bf16x2(f[0], f[1]), b23 = epd_dev_bf16x2(f[2], f[3]);
        uint16_t bh[4] = {(uint16_t)b01, (uint16_t)(b01 >> 16), (uint16_t)b23, (uint16_t)(b23 >> 16)};
        for (int k = 0; k < 4; k++) {
            uint32_t bits = base + (uint32_t)k;
            bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
            if (((w >> (8 * k)) & 0xffu) != epd_e4m3_from_f32(f[k])) {
                atomicAdd(nan ? &st->bad_nan : &st->bad_finite, 1ull);
                atomicMin(nan ? &st->first_nan : &st->first_finite, (unsigned long long)bits);
            }
            if (!nan && bh[k] != epd_f32_to_bf16(f[k])) {
                atomicAdd(&st->bad_bf16, 1ull);
                atomicMin(&st->first_bf16, (unsigned long long)bits);
            }
        }
    }
}

__global__ void decode_all_kernel(uint32_t *bad)
{
    uint32_t c = threadIdx.x;
    float2 f = epd_dev_dec2(c | ((c ^ 0x55u) << 8));
    float want0 = epd_e4m3_to_f32((uint8_t)c), want1 = epd_e4m3_to_f32((uint8_t)(c ^ 0x55u));
    bool ok0 = isnan(want0) ? isnan(f.x) : __float_as_uint(f.x) == __float_as_uint(want0);
    bool ok1 = isnan(want1) ? isnan(f.y) : __float_as_uint(f.y) == __float_as_uint(want1);
    if (!ok0 || !ok1) atomicMin(bad, c);
}

/* epd_dev_requant4 (every requant kernel's math, through epd_dev_requant16) against the
 * formula, e4m3(((float)q * s) * inv), on every code (words of 4) for one (s, inv) pair a
 * thread: random fp32 bit patterns without NaNs or infinities (subnormal, tiny and huge values,
 * so that products overflow, underflow and saturate), pairs of the requant's own range (1/S
 * near 1/s) and a few fixed ones. *bad counts the mismatching codes, *first the first thread. */
__global__ void requant4_kernel(unsigned long long *bad, unsigned int *first)
{
    const uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
    auto finite = [](uint32_t h) {
        h &= 0x7fffffffu;
        return __uint_as_float((h >> 23) == 0xffu ? h & ~0x00800000u : h);
    };
    uint32_t h1 = t * 2654435761u + 0x9e3779b9u, h2 = (t ^ 0x5bd1e995u) * 2246822519u;
    h1 ^= h1 >> 15;
    h2 ^= h2 >> 13;
    float s = finite(h1 * 0x27d4eb2du), inv = finite(h2 * 0x165667b1u);
    if (t & 1) { /* the requant's own regime: s of 2^-40 .. 2^10, 1/S near 1/s */
        s = __uint_as_float((87u + h1 % 50u) << 23 | (h1 >> 9 & 0x7fffffu));
        inv = __fdiv_rn(1.0f, __fmul_rn(s, 0.25f + (float)(h2 % 4096u) / 1024.0f));
    }
    if (t < 4) { /* ordinary scales; one that saturates; 1/S of a denormal-range S */
        const float ss[4] = {1.0f, 0.0123f, 3.5f, 1e-30f}, is[4] = {1.0f, 37.2f, 1e6f, 1e30f};
        s = ss[t];
        inv = is[t];
    }
    for (uint32_t c = 0; c < 256; c += 4) {
        const uint32_t w = c | (c + 1) << 8 | (c + 2) << 16 | (c + 3) << 24;
        const uint32_t got = epd_dev_requant4(w, s, inv);
        for (uint32_t k = 0; k < 4; k++) {
            const uint8_t want =
                epd_e4m3_from_f32(__fmul_rn(__fmul_rn(epd_e4m3_to_f32((uint8_t)(c + k)), s), inv));
            if (((got >> (8 * k)) & 0xffu) != want) {
                atomicAdd(bad, 1ull);
                atomicMin(first, t);
            }
        }
    }
}

__global__ void nan_probe_kernel(uint32_t *out)
{
    out[0] = __nv_cvt_float2_to_fp8x2(make_float2(__uint_as_float(0xffc00000u), -0.0f),
                                      __NV_SATFINITE, __NV_E4M3);
    out[1] = __nv_cvt_float2_to_fp8x2(make_float2(__uint_as_float(0x7fc00000u), -1e-30f),
                                      __NV_SATFINITE, __NV_E4M3);
}

static void case_conversions(void)
{
    cvt_stats h = {0, 0, ~0ull, ~0ull, 0, ~0ull}, *d;
    CUDA_OK(cudaMalloc(&d, sizeof h));
    CUDA_OK(cudaMemcpy(d, &h, sizeof h, cudaMemcpyHostToDevice));
    cvt_all_kernel<<<4096, 256>>>(d, 1.0f);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaFree(d));
    report(h.bad_finite == 0, "e4m3 encode, all 2^32 non-NaN fp32: %llu mismatches%s%08llx", h.bad_finite,
           h.bad_finite ? ", first input 0x" : "", h.bad_finite ? h.first_finite : 0ull);
    report(h.bad_nan == 0, "e4m3 encode, all NaN fp32 times 1 -> 0x7f: %llu mismatches%s%08llx", h.bad_nan,
           h.bad_nan ? ", first input 0x" : "", h.bad_nan ? h.first_nan : 0ull);
    report(h.bad_bf16 == 0, "bf16 round, all 2^32 non-NaN fp32: %llu mismatches%s%08llx", h.bad_bf16,
           h.bad_bf16 ? ", first input 0x" : "", h.bad_bf16 ? h.first_bf16 : 0ull);

    uint32_t bad = 0xffffffffu, *db;
    CUDA_OK(cudaMalloc(&db, 8));
    CUDA_OK(cudaMemcpy(db, &bad, 4, cudaMemcpyHostToDevice));
    decode_all_kernel<<<1, 256>>>(db);
    CUDA_OK(cudaMemcpy(&bad, db, 4, cudaMemcpyDeviceToHost));
    report(bad == 0xffffffffu, "e4m3 decode, all 256 codes%s%02x", bad == 0xffffffffu ? "" : ": first bad code 0x",
           bad == 0xffffffffu ? 0u : bad);
    uint32_t probe[2];
    nan_probe_kernel<<<1, 1>>>(db);
    CUDA_OK(cudaMemcpy(probe, db, 8, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaFree(db));
    printf("INFO  raw hardware SATFINITE: (-NaN, -0) -> 0x%04x, (+NaN, -1e-30) -> 0x%04x "
           "(the kernels only convert products, whose NaN is positive)\n", probe[0], probe[1]);

    unsigned long long n_bad = 0, *dbad;
    unsigned int first = 0xffffffffu, *dfirst;
    CUDA_OK(cudaMalloc(&dbad, sizeof n_bad));
    CUDA_OK(cudaMalloc(&dfirst, sizeof first));
    CUDA_OK(cudaMemcpy(dbad, &n_bad, sizeof n_bad, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dfirst, &first, sizeof first, cudaMemcpyHostToDevice));
    requant4_kernel<<<64, 256>>>(dbad, dfirst);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpy(&n_bad, dbad, sizeof n_bad, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(&first, dfirst, sizeof first, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaFree(dbad));
    CUDA_OK(cudaFree(dfirst));
    report(n_bad == 0,
           "requant4 (the requant kernels' math), 256 codes x 16384 (s, 1/S) pairs: %llu "
           "mismatches%s%u", n_bad, n_bad ? ", first pair " : "", n_bad ? first : 0u);
}

/* ---- argument checks (no kernel runs) ---- */

static void case_bad_args(void)
{
    char err[EPD_ERR_LEN] = "";
    uint8_t *dq;
    float *ds;
    uint16_t *dx;
    CUDA_OK(cudaMalloc(&dq, 4096));
    CUDA_OK(cudaMalloc(&ds, 4096));
    CUDA_OK(cudaMalloc(&dx, 8192));
    epd_quant_launch_t bad = {100, 2, 1};
    bool ok = epd_quant_cuda(dx, 1, 100, 0, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, dq, 0, ds, 0,
                             NULL, NULL, err) == EPD_ERR_INVALID_ARG &&
              epd_quant_cuda(dx + 1, 1, 128, 0, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, dq, 0, ds, 0,
                             NULL, NULL, err) == EPD_ERR_INVALID_ARG &&
              epd_quant_cuda(dx, 1, 128, 0, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, dq, 0, ds, 0,
                             &bad, NULL, err) == EPD_ERR_INVALID_ARG &&
              epd_quant_cuda(NULL, 1, 128, 0, EPD_SCALE_PER_TOKEN, EPD_SCALE_FMT_FP32, dq, 0, ds, 0,
                             NULL, NULL, err) == EPD_ERR_INVALID_ARG &&
              epd_requant_cuda(dq, ds, (const int32_t *)ds, 1, 1, 128, EPD_SCALE_PER_TOKEN, 0.0f, dq,
                               NULL, NULL, NULL, err) == EPD_ERR_INVALID_ARG &&
              epd_requant_cuda(dq, ds, (const int32_t *)ds, 1, 1, 128, EPD_SCALE_PER_TOKEN, -2.0f, dq,
                               ds, NULL, NULL, err) == EPD_ERR_INVALID_ARG &&
              epd_requant_cuda(dq, ds, (const int32_t *)ds, 5000, 1, 128, EPD_SCALE_PER_TOKEN, 1.0f,
                               dq, ds, NULL, NULL, err) == EPD_ERR_INVALID_ARG &&
              epd_dequant_cuda(dq + 4, ds, 1, 128, EPD_SCALE_PER_TOKEN, (float *)ds, NULL, NULL,
                               err) == EPD_ERR_INVALID_ARG;
    report(ok, "launchers reject bad shapes, pointers, alignment, scales and launch parameters (last: %s)", err);
    /* the requant's row indices are 32-bit: at most 2^31 rows of experts x capacity */
    ok = epd_requant_cuda(dq, ds, (const int32_t *)ds, 4096, 1u << 20, 128, EPD_SCALE_PER_TOKEN,
                          1.0f, dq, ds, NULL, NULL, err) == EPD_ERR_INVALID_ARG &&
         strstr(err, "2^31 rows") != NULL;
    report(ok, "requant rejects 4096 experts x 2^20 rows (%s)", err);
    CUDA_OK(cudaFree(dq));
    CUDA_OK(cudaFree(ds));
    CUDA_OK(cudaFree(dx));
}

/* Every launch variant of every kernel on one shape. */
static void case_launch_variants(uint32_t hidden)
{
    const uint32_t rows = 67;
    uint32_t nv = hidden / 8;
    for (uint32_t v = 0; v <= 8; v = v ? v * 2 : 1) {
        uint32_t want = v ? (nv + v - 1) / v : 64, lanes = 1;
        if (want > 32) lanes = (want + 31) / 32 * 32;
        else
            while (lanes < want) lanes <<= 1;
        if (lanes > 1024) continue;
        epd_quant_launch_t l = {lanes < 32 ? 32 : lanes, v, lanes < 32 ? 32 / lanes : 1};
        case_quant(rows, hidden, EPD_SCALE_PER_TOKEN, EPD_SCALE_FMT_FP32, 0, &l);
        if (lanes <= 256 && lanes >= 32) { /* several rows per block */
            epd_quant_launch_t l2 = {lanes * 2 <= 1024 ? lanes * 2 : lanes, v, lanes * 2 <= 1024 ? 2u : 1u};
            case_quant(rows, hidden, EPD_SCALE_PER_TOKEN, EPD_SCALE_FMT_UE8M0, 0, &l2);
        }
    }
    /* decode shapes: a row a warp (16 or 32 vectors a lane), several groups a lane set */
    for (uint32_t v = 16; v <= 32; v *= 2) {
        if (32 * v * 8 < hidden) continue;
        for (uint32_t r = 1; r <= 4; r *= 2) {
            epd_quant_launch_t l = {32 * r, v, r};
            case_quant(rows, hidden, EPD_SCALE_PER_TOKEN, r == 2 ? EPD_SCALE_FMT_UE8M0 : EPD_SCALE_FMT_FP32, 0, &l);
        }
    }
    for (uint32_t v = 1; v <= 4; v *= 2)
        for (uint32_t gr = 2; gr <= 4; gr *= 2) {
            epd_quant_launch_t l = {v == 1 ? 64u : 256u, v, gr};
            case_quant(rows, hidden, EPD_SCALE_GROUP128, gr == 2 ? EPD_SCALE_FMT_FP32 : EPD_SCALE_FMT_UE8M0, 0, &l);
            case_quant(128, hidden, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, 1, &l);
        }
    for (uint32_t v = 1; v <= 4; v *= 2) {
        epd_quant_launch_t l = {v == 2 ? 512u : 128u, v, 1};
        case_quant(rows, hidden, EPD_SCALE_GROUP128, EPD_SCALE_FMT_UE8M0, 0, &l);
        epd_quant_launch_t r = {v == 1 ? 1024u : 64u, v, v == 4 ? 3u : 64u};
        case_requant(5, 40, hidden, EPD_SCALE_GROUP128, 0, false, false, &r);
        epd_quant_launch_t r1 = {96, v, 1, v}; /* at most v blocks per SM */
        case_requant(3, 9, hidden, EPD_SCALE_PER_TOKEN, 1, true, false, &r1);
    }
}

/* epd_fast_div_of (the requant kernel's division by hidden / 16 and by the rows of a tile) against
 * `/` on the host, which runs the same integer steps as the device: every divisor up to 70000 and
 * the largest ones, with the numerators around each multiple that matter and pseudo-random ones. */
static void case_fast_div(void)
{
    uint64_t checked = 0, wrong = 0;
    uint32_t bad_n = 0, bad_d = 0, x = 12345;
    auto check = [&](uint32_t n, uint32_t d, epd_fast_div f) {
        checked++;
        if (epd_fast_div_of(n, f) != n / d && wrong++ == 0) {
            bad_n = n;
            bad_d = d;
        }
    };
    const uint32_t big[] = {0x7fffffffu, 0x80000000u, 0x80000001u, 0xfffffffeu, 0xffffffffu};
    for (uint32_t i = 0; i < 70000 + 5; i++) {
        const uint32_t d = i < 70000 ? i + 2 : big[i - 70000];
        const epd_fast_div f = epd_fast_div_make(d);
        const uint32_t top = 0xffffffffu - 0xffffffffu % d; /* the largest multiple of d */
        const uint32_t edge[] = {0, 1, d - 1, d, d + 1, 2 * d - 1, top - 1, top, 0xffffffffu};
        for (uint32_t n : edge) check(n, d, f);
        for (int k = 0; k < 100; k++) {
            x = x * 1664525u + 1013904223u;
            check(x, d, f);
            check(x % 70000, d, f);
        }
    }
    report(wrong == 0, "fast division: %llu quotients equal n / d (%llu differ; first n=%u d=%u)",
           (unsigned long long)checked, (unsigned long long)wrong, bad_n, bad_d);
}

/* Self-check of the comparison itself: a corrupted byte must be found and located. */
static void case_harness_detects_mismatch(void)
{
    uint8_t a[300], b[300];
    char msg[256];
    for (int i = 0; i < 300; i++) a[i] = b[i] = (uint8_t)i;
    b[217] ^= 0x10;
    bool found = !same_bytes(a, b, 300, 100, 1, msg, sizeof msg) && strstr(msg, "row 2, element 17");
    report(found, "harness reports an injected mismatch (%s)", msg);
}

int main(void)
{
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        printf("SKIP: no GPU\n");
        return 77;
    }
    cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor,
           prop.multiProcessorCount);
    sm_count = (uint32_t)prop.multiProcessorCount;
    case_harness_detects_mismatch();
    case_conversions();
    case_bad_args();
    case_fast_div();
    const uint32_t ms[] = {1, 7, 128, 4096}, hs[] = {128, 896, 7168};
    for (uint32_t hi = 0; hi < 3; hi++)
        for (uint32_t mi = 0; mi < 4; mi++)
            for (int kind = 0; kind < 2; kind++)
                for (int fmt = 0; fmt < 2; fmt++)
                    case_quant(ms[mi], hs[hi], (epd_scale_kind_t)kind, (epd_scale_fmt_t)fmt, 0, NULL);
    case_quant(33, 7168, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, 1, NULL);
    case_quant(33, 896, EPD_SCALE_PER_TOKEN, EPD_SCALE_FMT_UE8M0, 2, NULL);
    case_quant(3, 16384, EPD_SCALE_PER_TOKEN, EPD_SCALE_FMT_FP32, 0, NULL);
    case_quant(2, 81920, EPD_SCALE_PER_TOKEN, EPD_SCALE_FMT_FP32, 0, NULL); /* two-pass kernel */
    for (uint32_t hi = 0; hi < 3; hi++) case_launch_variants(hs[hi]);
    for (int kind = 0; kind < 2; kind++) {
        for (int s_mode = 0; s_mode < 3; s_mode++) {
            case_requant(16, 128, 7168, (epd_scale_kind_t)kind, s_mode, false, false, NULL);
            case_requant(33, 7, 128, (epd_scale_kind_t)kind, s_mode, s_mode == 1, false, NULL);
            case_requant(1, 2048, 896, (epd_scale_kind_t)kind, s_mode, s_mode == 2, false, NULL);
        }
        case_requant(9, 50, 896, (epd_scale_kind_t)kind, 0, false, true, NULL);
        case_requant(4, 64, 7168, (epd_scale_kind_t)kind, 0, true, false, NULL);
        case_requant(0, 64, 7168, (epd_scale_kind_t)kind, 2, false, false, NULL);
        case_requant(0, 64, 7168, (epd_scale_kind_t)kind, 0, false, false, NULL);
        /* more experts than the prefix has lanes or threads: each adds up several */
        epd_quant_launch_t few = {64, 2, 1};
        case_requant(300, 5, 128, (epd_scale_kind_t)kind, 0, false, true, &few);
        case_requant(4096, 2, 256, (epd_scale_kind_t)kind, kind == 0 ? 0 : 1, false, false, NULL);
    }
    /* the layout-aware requant on kbench's layouts (H 7168; decode, random, long) */
    case_requant_live_args();
    {
        const struct { uint32_t E, cap; int live; } lays[] = {
            {256, 128, 1}, {256, 128, 8}, {256, 128, 32}, {256, 128, -16}, {16, 128, 1},
            {16, 128, 4},  {16, 128, 8},  {16, 128, 16},  {16, 128, 32},   {32, 128, 1},
            {32, 128, 4},  {32, 128, 8},  {32, 128, 16},  {32, 128, 32},   {64, 128, 1},
            {64, 128, 4},  {64, 128, 8},  {64, 128, 16},  {64, 128, 32},   {32, 128, 128},
            {128, 256, 64}, {1, 4096, 4096}};
        int i = 0;
        for (const auto &lay : lays) {
            for (int kind = 0; kind < 2; kind++) {
                const int mode = i++ % 4; /* every S mode over the list, both kinds */
                case_requant_live(lay.E, lay.cap, 7168, (epd_scale_kind_t)kind, lay.live, mode,
                                  i % 7 == 3, NULL);
                if (lay.E == 256 && lay.live == 8)
                    case_requant_live(lay.E, lay.cap, 7168, (epd_scale_kind_t)kind, lay.live,
                                      (mode + 3) % 4, false, NULL);
            }
        }
        /* every geometry kbench --sweep times (tests/gpu/quant_sweep.h), each on a random layout
         * at H 7168 and at H 896, S modes, kinds and in place in turn; then the edges of the
         * part kernel: parts that are not whole passes, more parts asked than rows, idle lanes,
         * one warp a block, the read-only loads asked for in place (the launcher drops them). */
        std::vector<std::pair<int, epd_quant_launch_t>> sweep;
        if (!epd_parse_geoms(EPD_REQUANT_SWEEP, false, &sweep))
            report(false, "EPD_REQUANT_SWEEP parses");
        const epd_quant_launch_t edges[] = {{32, 1, 3, 1},         {1024, 4, 1, 2},
                                            {224, 2, 1, 8},        {128, 4, 1, 0},
                                            {96, 4, 5, 0, 2, 15},  {224, 2, 3, 4, 7, 9},
                                            {1024, 1, 64, 1, 32, 1}, {32, 4, 16, 2, 3, 9},
                                            {448, 1, 8, 4, 8, 2},  {224, 4, 32, 4, 16, 6}};
        for (const epd_quant_launch_t &l : edges) sweep.push_back({0, l});
        int g = 0;
        for (const auto &item : sweep) {
            const epd_quant_launch_t &l = item.second;
            case_requant_live(16, 40, 7168, (epd_scale_kind_t)(g % 2), -20, g % 4,
                              g % 5 == 1 || (l.flags & EPD_QL_NC) != 0, &l);
            case_requant_live(9, 33, 896, (epd_scale_kind_t)((g + 1) % 2), -33, (g + 2) % 4,
                              g % 3 == 2, &l);
            g++;
        }
        /* the part kernel on kbench's uniform layouts, and with tiles made longer to fit the
         * table (4096 experts x 2 rows) */
        const epd_quant_launch_t parts[] = {{224, 4, 32, 4, 16, 9}, {224, 2, 32, 4, 16, 15},
                                            {448, 1, 8, 4, 8, 8}};
        for (int k = 0; k < 3; k++) {
            case_requant_live(64, 128, 7168, (epd_scale_kind_t)(k % 2), 32, k, false, &parts[k]);
            case_requant_live(256, 128, 7168, EPD_SCALE_GROUP128, 8, (k + 1) % 4, k == 1,
                              &parts[k]);
        }
        /* the stream kernel: chunks across many experts with 0-1 live rows (many empty), one
         * warp a block, a pass of 96 x 4 vectors (not a multiple of a row or of 8), every bit,
         * the largest table (4096 experts), more experts than its table (the part kernel then),
         * more passes a block than the layout has (one block), kbench's uniform layouts */
        const epd_quant_launch_t streams[] = {{32, 1, 1, 1, 0, 16}, {96, 4, 3, 0, 0, 31},
                                              {224, 4, 1, 4, 0, 17}, {1024, 2, 1, 0, 0, 21},
                                              {224, 2, 64, 4, 0, 19}};
        for (int k = 0; k < 5; k++) {
            case_requant_live(300, 3, 896, (epd_scale_kind_t)(k % 2), -1, k % 4, k == 2,
                              &streams[k]);
            case_requant_live(64, 128, 7168, (epd_scale_kind_t)((k + 1) % 2), 32, (k + 1) % 4,
                              false, &streams[k]);
        }
        case_requant_live(256, 128, 7168, EPD_SCALE_GROUP128, 32, 0, false, &streams[2]);
        case_requant_live(128, 256, 7168, EPD_SCALE_PER_TOKEN, 64, 3, false, &streams[2]);
        case_requant_live(4096, 2, 256, EPD_SCALE_GROUP128, -2, 3, false, &streams[2]);
        case_requant_live(4096, 2, 128, EPD_SCALE_PER_TOKEN, -2, 0, true, &streams[3]);
        case_requant_live(5000, 2, 128, EPD_SCALE_GROUP128, -1, 3, false, &streams[2]);
        case_requant_live(5000, 2, 128, EPD_SCALE_PER_TOKEN, -1, 1, false, &streams[0]);
        /* the grid kernel: many experts with 0-1 live rows (runs that start inside a bucket, a
         * bucket table longer than the runs), one warp a block, a pass of 96 x 4 vectors with
         * every other bit (read-only loads dropped in place), H 128 (a row is 8 vectors), the
         * largest runs table (1024 experts with rows) and more (the tile kernels then), the
         * step scale on the device, kbench's uniform layouts */
        const epd_quant_launch_t grids[] = {{32, 1, 1, 1, 0, 32}, {96, 4, 3, 0, 0, 63},
                                            {224, 2, 8, 4, 0, 32}, {448, 4, 8, 2, 0, 38},
                                            {1024, 1, 2, 0, 0, 34}};
        for (int k = 0; k < 5; k++) {
            case_requant_live(300, 3, 896, (epd_scale_kind_t)(k % 2), -1, k % 4, k == 1,
                              &grids[k]);
            case_requant_live(64, 128, 7168, (epd_scale_kind_t)((k + 1) % 2), 32, (k + 1) % 4,
                              k == 3, &grids[k]);
            case_requant_live(40, 6, 128, (epd_scale_kind_t)(k % 2), -6, (k + 2) % 4, k == 4,
                              &grids[k]);
        }
        case_requant_live(256, 128, 7168, EPD_SCALE_GROUP128, 32, 2, false, &grids[2]);
        case_requant_live(128, 256, 7168, EPD_SCALE_PER_TOKEN, 64, 3, true, &grids[2]);
        case_requant_live(1024, 2, 256, EPD_SCALE_GROUP128, 1, 1, false, &grids[2]);
        case_requant_live(1025, 2, 128, EPD_SCALE_PER_TOKEN, 1, 0, false, &grids[0]);
        case_requant_live(4096, 2, 128, EPD_SCALE_GROUP128, -2, 3, true, &grids[3]);
        const epd_quant_launch_t doubled = {128, 1, 1, 0, 0, 9};
        case_requant_live(4096, 2, 256, EPD_SCALE_GROUP128, -2, 3, false, &doubled);
        case_requant_live(4096, 2, 256, EPD_SCALE_PER_TOKEN, -2, 0, true, &doubled);
        epd_quant_launch_t one = {224, 2, 1, 4};
        case_requant_live(256, 128, 7168, EPD_SCALE_GROUP128, 32, 3, false, &one);
        case_requant_live(300, 5, 128, EPD_SCALE_PER_TOKEN, -5, 0, false, NULL);
        case_requant_live(4096, 2, 256, EPD_SCALE_GROUP128, -2, 3, false, NULL); /* > 256 tiles */
        case_requant_live(0, 64, 7168, EPD_SCALE_GROUP128, 0, 3, false, NULL);
    }
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail == 0 ? 0 : 1;
}
