/* Unit tests of gpu/fp8.h and gpu/quant_host.c: e4m3fn decode and encode checked exhaustively
 * against independent slow references, bf16 rounding, the scale rules, quantization and
 * dequantization on hand-computed rows, requantization, non-finite detection, argument checks and
 * the CUDA launch-parameter table. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "gpu/fp8.h"
#include "gpu/quant.h"

/* ---- independent references (double arithmetic, no bit tricks shared with fp8.h) ---- */

/* e4m3fn value of a code: sign * 2^(e-7) * (1 + m/8), subnormals 2^-6 * m/8; NaN for 0x7f/0xff. */
static double ref_e4m3_value(unsigned c)
{
    unsigned e = (c >> 3) & 15, m = c & 7;
    double sign = (c & 0x80) ? -1.0 : 1.0;
    if (e == 15 && m == 7) return NAN;
    if (e == 0) return sign * ldexp(1.0, -6) * (m / 8.0);
    return sign * ldexp(1.0, (int)e - 7) * (1.0 + m / 8.0);
}

/* Nearest e4m3 code by search over all finite non-negative codes; ties to the even code (the even
 * mantissa); clamp to 448 first; NaN -> 0x7f; the sign is kept (also for zero). */
static unsigned ref_e4m3_encode(double x)
{
    if (isnan(x)) return 0x7f;
    unsigned sign = signbit(x) ? 0x80 : 0;
    double a = fabs(x);
    if (a >= 448.0) return sign | 0x7e;
    unsigned best = 0;
    double best_d = INFINITY;
    for (unsigned c = 0; c <= 0x7e; c++) {
        double d = fabs(a - ref_e4m3_value(c));
        if (d < best_d || (d == best_d && (c & 1) == 0)) {
            best = c;
            best_d = d;
        }
    }
    return sign | best;
}

/* Nearest bf16 of a finite float, ties to even, by comparing the two neighbours in double. */
static uint16_t ref_bf16_round(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t lo = (uint16_t)(u >> 16);
    if ((u & 0xffff) == 0) return lo;
    uint16_t hi = (uint16_t)(lo + 1); /* next bf16 away from zero (may become Inf) */
    double vl = epd_bf16_to_f32(lo), vh;
    if ((hi & 0x7fff) == 0x7f80) {
        vh = ldexp(1.0, 128) * (signbit(f) ? -1.0 : 1.0); /* the rounding boundary at Inf */
    } else {
        vh = epd_bf16_to_f32(hi);
    }
    double dl = fabs((double)f - vl), dh = fabs((double)f - vh);
    if (dl < dh) return lo;
    if (dh < dl) return hi;
    return (lo & 1) ? hi : lo;
}

static uint32_t rng_state = 12345;
static uint32_t rng_next(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 17;
    rng_state ^= rng_state << 5;
    return rng_state;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static uint16_t bf16_of(float f)
{
    return epd_f32_to_bf16(f);
}

/* ---- e4m3 ---- */

static void test_quant__e4m3_decode__all_256_codes_match_reference(void **state)
{
    (void)state;
    for (unsigned c = 0; c < 256; c++) {
        float got = epd_e4m3_to_f32((uint8_t)c);
        double want = ref_e4m3_value(c);
        if (isnan(want)) {
            assert_true(isnan(got));
            continue;
        }
        if ((double)got != want) fail_msg("code 0x%02x decodes to %.9g, want %.9g", c, got, want);
        assert_int_equal(!!signbit(got), !!(c & 0x80)); /* -0 for 0x80 */
    }
    assert_true(epd_e4m3_to_f32(0x7e) == 448.0f);
    assert_true(epd_e4m3_to_f32(0x01) == ldexpf(1.0f, -9));
    assert_true(epd_e4m3_to_f32(0x08) == ldexpf(1.0f, -6));
}

static void test_quant__e4m3_encode__every_bf16_pattern_matches_reference(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = epd_bf16_to_f32((uint16_t)h);
        unsigned got = epd_e4m3_from_f32(f), want = ref_e4m3_encode((double)f);
        if (got != want) fail_msg("bf16 0x%04x (%.9g) encodes to 0x%02x, want 0x%02x", h, f, got, want);
    }
}

static void test_quant__e4m3_encode__random_fp32_match_reference(void **state)
{
    (void)state;
    for (int i = 0; i < 200000; i++) {
        uint32_t u = rng_next();
        /* half the draws in the interesting range 2^-12 .. 2^10 */
        if (i & 1) u = (u & 0x807fffffu) | ((uint32_t)(115 + u % 23) << 23);
        float f = bits_f32(u);
        unsigned got = epd_e4m3_from_f32(f), want = ref_e4m3_encode((double)f);
        if (got != want) fail_msg("fp32 0x%08x (%.9g) encodes to 0x%02x, want 0x%02x", u, f, got, want);
    }
}

static void test_quant__e4m3_encode__boundaries_ties_and_specials(void **state)
{
    (void)state;
    assert_int_equal(epd_e4m3_from_f32(448.0f), 0x7e);
    assert_int_equal(epd_e4m3_from_f32(449.0f), 0x7e);
    assert_int_equal(epd_e4m3_from_f32(464.0f), 0x7e); /* clamp first: never 480 or NaN */
    assert_int_equal(epd_e4m3_from_f32(480.0f), 0x7e);
    assert_int_equal(epd_e4m3_from_f32(1e30f), 0x7e);
    assert_int_equal(epd_e4m3_from_f32(-500.0f), 0xfe);
    assert_int_equal(epd_e4m3_from_f32(INFINITY), 0x7e);
    assert_int_equal(epd_e4m3_from_f32(-INFINITY), 0xfe);
    assert_int_equal(epd_e4m3_from_f32(NAN), 0x7f);
    assert_int_equal(epd_e4m3_from_f32(-NAN), 0x7f);
    assert_int_equal(epd_e4m3_from_f32(0.0f), 0x00);
    assert_int_equal(epd_e4m3_from_f32(-0.0f), 0x80);
    assert_int_equal(epd_e4m3_from_f32(416.0f), 0x7d);   /* 1.625 * 2^8, exact */
    assert_int_equal(epd_e4m3_from_f32(432.0f), 0x7e);   /* tie 416|448 -> 448 (even mantissa 6) */
    assert_int_equal(epd_e4m3_from_f32(400.0f), 0x7c);   /* tie 384|416 -> 384 (even mantissa 4) */
    assert_int_equal(epd_e4m3_from_f32(447.99f), 0x7e);
    assert_int_equal(epd_e4m3_from_f32(1.0625f), 0x38);  /* tie 1|1.125 -> 1 (even) */
    assert_int_equal(epd_e4m3_from_f32(1.1875f), 0x3a);  /* tie 1.125|1.25 -> 1.25 (even) */
    assert_int_equal(epd_e4m3_from_f32(ldexpf(1.0f, -10)), 0x00);      /* tie 0|2^-9 -> 0 */
    assert_int_equal(epd_e4m3_from_f32(-ldexpf(1.0f, -10)), 0x80);
    assert_int_equal(epd_e4m3_from_f32(ldexpf(1.0f, -10) * 1.0001f), 0x01);
    assert_int_equal(epd_e4m3_from_f32(ldexpf(3.0f, -10)), 0x02);      /* tie 1|2 sub -> 2 */
    assert_int_equal(epd_e4m3_from_f32(ldexpf(15.0f, -10)), 0x08);     /* tie 7 sub|min normal */
    assert_int_equal(epd_e4m3_from_f32(ldexpf(1.0f, -6)), 0x08);
    assert_int_equal(epd_e4m3_from_f32(ldexpf(1.0f, -9)), 0x01);
    assert_int_equal(epd_e4m3_from_f32(1e-40f), 0x00);                 /* fp32 subnormal */
}

/* ---- bf16 ---- */

static void test_quant__bf16__rounds_to_nearest_even_and_keeps_nan(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        if ((h & 0x7fff) > 0x7f80) continue;
        assert_int_equal(epd_f32_to_bf16(epd_bf16_to_f32((uint16_t)h)), h);
    }
    assert_int_equal(bf16_of(1.0f + ldexpf(1.0f, -8)), 0x3f80);       /* tie -> even 1.0 */
    assert_int_equal(bf16_of(1.0f + 3 * ldexpf(1.0f, -8)), 0x3f82);   /* tie -> even up */
    assert_int_equal(bf16_of(3.4028235e38f), 0x7f80);                 /* FLT_MAX -> Inf */
    assert_int_equal(bf16_of(-INFINITY), 0xff80);
    uint16_t n = bf16_of(NAN);
    assert_true((n & 0x7f80) == 0x7f80 && (n & 0x7f) != 0);
    n = bf16_of(bits_f32(0x7f800001u)); /* NaN whose payload sits below bf16: must not become Inf */
    assert_true((n & 0x7f80) == 0x7f80 && (n & 0x7f) != 0);
    for (int i = 0; i < 200000; i++) {
        uint32_t u = rng_next();
        if ((u & 0x7f800000u) == 0x7f800000u) continue;
        float f = bits_f32(u);
        uint16_t got = epd_f32_to_bf16(f), want = ref_bf16_round(f);
        if (got != want) fail_msg("fp32 0x%08x -> bf16 0x%04x, want 0x%04x", u, got, want);
    }
}

/* ---- scale rules, quantization, dequantization ---- */

static void fill_row(uint16_t *x, uint32_t n, float amp)
{
    for (uint32_t i = 0; i < n; i++) {
        float v = ((float)(rng_next() % 20001) - 10000.0f) / 10000.0f * amp;
        x[i] = bf16_of(v);
    }
}

static void test_quant__per_token__hand_computed_row(void **state)
{
    (void)state;
    uint16_t x[128] = {0};
    uint8_t q[128];
    float s;
    x[0] = bf16_of(1.0f);
    x[1] = bf16_of(-2.0f);
    x[2] = bf16_of(0.5f);
    x[3] = bf16_of(-0.0f);
    epd_quant_row_host(x, 128, EPD_SCALE_PER_TOKEN, EPD_SCALE_FMT_FP32, q, &s);
    /* amax 2: mult 224, s = 2 * fl(1/448) */
    assert_true(s == (float)(2.0 * (double)(float)(1.0 / 448.0)));
    assert_int_equal(q[0], 0x76); /* 224 = 1.75 * 2^7 */
    assert_int_equal(q[1], 0xfe); /* -448 */
    assert_int_equal(q[2], 0x6e); /* 112 */
    assert_int_equal(q[3], 0x80);
    for (int i = 4; i < 128; i++) assert_int_equal(q[i], 0);

    epd_quant_row_host(x, 128, EPD_SCALE_PER_TOKEN, EPD_SCALE_FMT_UE8M0, q, &s);
    assert_true(s == 0.0078125f); /* 2/448 = 0.00446 -> 2^-7, mult 128 */
    assert_int_equal(q[0], 0x70); /* 128 */
    assert_int_equal(q[1], 0xf8); /* -256 */
    assert_int_equal(q[2], 0x68); /* 64 */

    float out[128];
    epd_dequant_row_host(q, &s, 128, EPD_SCALE_PER_TOKEN, out);
    assert_true(out[0] == 1.0f && out[1] == -2.0f && out[2] == 0.5f && out[5] == 0.0f);
}

static void test_quant__zero_row__uses_amax_floor(void **state)
{
    (void)state;
    uint16_t x[256] = {0};
    uint8_t q[256];
    float s[2];
    epd_quant_row_host(x, 256, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, q, s);
    assert_true(s[0] == 1e-4f * (1.0f / 448.0f) && s[1] == s[0]);
    for (int i = 0; i < 256; i++) assert_int_equal(q[i], 0);
    epd_quant_row_host(x, 256, EPD_SCALE_GROUP128, EPD_SCALE_FMT_UE8M0, q, s);
    assert_true(s[0] == ldexpf(1.0f, -22)); /* 2.23e-7 -> 2^-22 = 2.38e-7 */
}

static void test_quant__group128_vs_per_token__outlier_only_hurts_per_token(void **state)
{
    (void)state;
    enum { H = 512 };
    uint16_t x[H];
    uint8_t qg[H], qt[H];
    float sg[H / 128], st, dg[H], dt[H];
    fill_row(x, H, 0.01f);
    x[300] = bf16_of(10000.0f); /* outlier in group 2 */
    epd_quant_row_host(x, H, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, qg, sg);
    epd_quant_row_host(x, H, EPD_SCALE_PER_TOKEN, EPD_SCALE_FMT_FP32, qt, &st);
    assert_int_equal(epd_quant_n_scales(H, EPD_SCALE_GROUP128), 4);
    assert_int_equal(epd_quant_n_scales(H, EPD_SCALE_PER_TOKEN), 1);
    assert_true(sg[2] == st);
    assert_true(sg[0] < st / 1000.0f);
    epd_dequant_row_host(qg, sg, H, EPD_SCALE_GROUP128, dg);
    epd_dequant_row_host(qt, &st, H, EPD_SCALE_PER_TOKEN, dt);
    double err_g = 0, err_t = 0;
    for (int i = 0; i < 128; i++) {
        double v = epd_bf16_to_f32(x[i]);
        err_g += fabs(dg[i] - v);
        err_t += fabs(dt[i] - v);
    }
    assert_true(err_g * 10 < err_t); /* group 0 keeps its precision only with group scales */
    double big = epd_bf16_to_f32(x[300]);
    assert_true(fabs(dg[300] - big) < big / 16 && fabs(dt[300] - big) < big / 16);
}

static void test_quant__round_trip__error_within_e4m3_precision(void **state)
{
    (void)state;
    enum { H = 1024 };
    uint16_t x[H], back[H];
    uint8_t q[H];
    float s[H / 128], d[H];
    for (int fmt = 0; fmt < 2; fmt++) {
        for (int kind = 0; kind < 2; kind++) {
            fill_row(x, H, 3.0f);
            epd_quant_row_host(x, H, (epd_scale_kind_t)kind, (epd_scale_fmt_t)fmt, q, s);
            epd_dequant_row_host(q, s, H, (epd_scale_kind_t)kind, d);
            epd_dequant_row_bf16_host(q, s, H, (epd_scale_kind_t)kind, back);
            for (int i = 0; i < H; i++) {
                float sc = kind == EPD_SCALE_PER_TOKEN ? s[0] : s[i / 128];
                double v = epd_bf16_to_f32(x[i]);
                double bound = fmax(fabs(v) / 16.0, sc * ldexp(1.0, -10)) * 1.000001;
                if (fabs(d[i] - v) > bound)
                    fail_msg("fmt %d kind %d i %d: x %.9g back %.9g", fmt, kind, i, v, d[i]);
                assert_true(q[i] != 0x7f && q[i] != 0xff);
                assert_int_equal(back[i], bf16_of(d[i]));
            }
        }
    }
}

static void test_quant__ue8m0__scales_are_powers_of_two_at_least_fp32(void **state)
{
    (void)state;
    enum { H = 1024 };
    uint16_t x[H];
    uint8_t q[H];
    float s32[H / 128], s8[H / 128];
    for (int t = 0; t < 200; t++) {
        fill_row(x, H, ldexpf(1.0f, (int)(rng_next() % 60) - 30));
        epd_quant_row_host(x, H, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, q, s32);
        epd_quant_row_host(x, H, EPD_SCALE_GROUP128, EPD_SCALE_FMT_UE8M0, q, s8);
        for (int g = 0; g < H / 128; g++) {
            assert_int_equal(f32_bits(s8[g]) & 0x807fffffu, 0); /* positive power of two */
            assert_true(s8[g] >= s32[g] && s8[g] < 2.0f * s32[g]);
        }
    }
    assert_true(epd_ue8m0_ceil(1.0f) == 1.0f);
    assert_true(epd_ue8m0_ceil(1.0000001f) == 2.0f);
    assert_true(epd_ue8m0_ceil(0.75f) == 1.0f);
    assert_true(epd_ue8m0_ceil(bits_f32(3)) == bits_f32(4)); /* fp32 subnormal */
}

/* ---- requantization ---- */

static void test_quant__requant__step_scale_and_dead_rows(void **state)
{
    (void)state;
    enum { E = 2, CAP = 3, H = 128 };
    uint8_t q[E * CAP * H], out[E * CAP * H];
    float scales[E * CAP] = {1.0f, 2.0f, 100.0f, 0.5f, 77.0f, 99.0f};
    int32_t counts[E] = {2, 1};
    char err[EPD_ERR_LEN];
    float big_s = -1;
    for (size_t i = 0; i < sizeof q; i++) q[i] = (uint8_t)(i % 0x7e);
    memset(out, 0xaa, sizeof out);
    assert_int_equal(epd_requant_host(q, scales, counts, E, CAP, H, EPD_SCALE_PER_TOKEN, 0.0f, out,
                                      &big_s, err), EPD_OK);
    assert_true(big_s == 2.0f); /* rows with 100, 77, 99 are dead */
    for (int i = 0; i < H; i++) {
        /* row (0,1) has the scale S itself: codes come back unchanged */
        assert_int_equal(out[1 * H + i], q[1 * H + i]);
        /* row (0,0): half, exactly representable for normal codes */
        assert_int_equal(out[i], ref_e4m3_encode(ref_e4m3_value(q[i]) * 0.5));
        assert_int_equal(out[3 * H + i], ref_e4m3_encode(ref_e4m3_value(q[3 * H + i]) * 0.25));
        assert_int_equal(out[2 * H + i], 0xaa); /* dead rows untouched */
        assert_int_equal(out[4 * H + i], 0xaa);
        assert_int_equal(out[5 * H + i], 0xaa);
    }
    /* in place gives the same bytes */
    uint8_t inplace[E * CAP * H];
    memcpy(inplace, q, sizeof q);
    assert_int_equal(epd_requant_host(inplace, scales, counts, E, CAP, H, EPD_SCALE_PER_TOKEN, 0.0f,
                                      inplace, &big_s, err), EPD_OK);
    assert_memory_equal(inplace, out, 2 * H);
    assert_memory_equal(inplace + 3 * H, out + 3 * H, H);
}

static void test_quant__requant__small_static_scale_saturates_never_nan(void **state)
{
    (void)state;
    enum { H = 256 };
    uint16_t x[H];
    uint8_t q[H], out[H];
    float s[H / 128], big_s;
    int32_t count = 1;
    char err[EPD_ERR_LEN];
    fill_row(x, H, 50.0f);
    epd_quant_row_host(x, H, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, q, s);
    assert_int_equal(epd_requant_host(q, s, &count, 1, 1, H, EPD_SCALE_GROUP128, s[0] / 8, out,
                                      &big_s, err), EPD_OK);
    assert_true(big_s == s[0] / 8);
    int saturated = 0;
    for (int i = 0; i < H; i++) {
        assert_true(out[i] != 0x7f && out[i] != 0xff);
        float want = (epd_e4m3_to_f32(q[i]) * s[i / 128]) * (1.0f / big_s);
        assert_int_equal(out[i], ref_e4m3_encode(want));
        if ((out[i] & 0x7f) == 0x7e) saturated++;
    }
    assert_true(saturated > 10);
}

static void test_quant__requant__group_scales_match_formula(void **state)
{
    (void)state;
    enum { E = 3, CAP = 4, H = 384 };
    uint16_t x[H];
    uint8_t q[E * CAP * H], out[E * CAP * H];
    float s[E * CAP * 3], step = 0, big_s;
    int32_t counts[E] = {4, 0, 3};
    char err[EPD_ERR_LEN];
    for (int r = 0; r < E * CAP; r++) {
        fill_row(x, H, (float)(r + 1));
        epd_quant_row_host(x, H, EPD_SCALE_GROUP128, EPD_SCALE_FMT_UE8M0, q + r * H, s + r * 3);
    }
    assert_int_equal(epd_requant_step_scale_host(s, counts, E, CAP, H, EPD_SCALE_GROUP128, &step,
                                                 err), EPD_OK);
    float want_step = 0;
    for (int e = 0; e < E; e++)
        for (int i = 0; i < counts[e] * 3; i++) want_step = fmaxf(want_step, s[(e * CAP) * 3 + i]);
    assert_true(step == want_step && step > 0);
    assert_int_equal(epd_requant_host(q, s, counts, E, CAP, H, EPD_SCALE_GROUP128, 0.0f, out, &big_s,
                                      err), EPD_OK);
    assert_true(big_s == step);
    for (int e = 0; e < E; e++)
        for (int r = 0; r < counts[e]; r++)
            for (int i = 0; i < H; i++) {
                size_t k = ((size_t)e * CAP + r) * H + i;
                float v = (epd_e4m3_to_f32(q[k]) * s[((size_t)e * CAP + r) * 3 + i / 128]) * (1.0f / step);
                assert_int_equal(out[k], ref_e4m3_encode(v));
            }
}

static void test_quant__requant__bad_arguments__rejected(void **state)
{
    (void)state;
    uint8_t q[128] = {0}, out[128];
    float s = 1, big_s;
    int32_t count = 2, neg = -1, ok = 1;
    char err[EPD_ERR_LEN] = "";
    assert_int_equal(epd_requant_host(q, &s, &count, 1, 1, 128, EPD_SCALE_PER_TOKEN, 0, out, &big_s,
                                      err), EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(err, "live rows"));
    assert_int_equal(epd_requant_host(q, &s, &neg, 1, 1, 128, EPD_SCALE_PER_TOKEN, 0, out, &big_s,
                                      err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_requant_host(q, &s, &ok, 1, 1, 128, EPD_SCALE_PER_TOKEN, -1.0f, out, &big_s,
                                      err), EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(err, "static scale"));
    assert_int_equal(epd_requant_host(q, &s, &ok, 1, 1, 128, EPD_SCALE_PER_TOKEN, NAN, out, &big_s,
                                      err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_requant_host(q, &s, &ok, 1, 1, 128, EPD_SCALE_PER_TOKEN, INFINITY, out,
                                      &big_s, err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_requant_host(q, &s, &ok, 1, 1, 100, EPD_SCALE_PER_TOKEN, 0, out, &big_s,
                                      err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_requant_host(NULL, &s, &ok, 1, 1, 128, EPD_SCALE_PER_TOKEN, 0, out, &big_s,
                                      err), EPD_ERR_INVALID_ARG);
    /* no live rows: S = 0 and nothing written */
    int32_t zero = 0;
    memset(out, 0x55, sizeof out);
    assert_int_equal(epd_requant_host(q, &s, &zero, 1, 1, 128, EPD_SCALE_PER_TOKEN, 0, out, &big_s,
                                      err), EPD_OK);
    assert_true(big_s == 0.0f && out[0] == 0x55);
}

static void test_quant__requant_given__same_bytes_as_static_and_zero_only_without_rows(void **state)
{
    (void)state;
    enum { E = 3, CAP = 4, H = 256 };
    uint16_t x[H];
    uint8_t q[E * CAP * H], a[E * CAP * H], b[E * CAP * H];
    float s[E * CAP * 2], step = 0, big_s = 0;
    int32_t counts[E] = {4, 0, 2}, none[E] = {0, 0, 0};
    char err[EPD_ERR_LEN] = "";
    for (int r = 0; r < E * CAP; r++) {
        fill_row(x, H, (float)(r + 2));
        epd_quant_row_host(x, H, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, q + r * H, s + r * 2);
    }
    assert_int_equal(epd_requant_step_scale_host(s, counts, E, CAP, H, EPD_SCALE_GROUP128, &step,
                                                 err), EPD_OK);
    /* S given = the step scale (what the count exchange delivers): the reduced requant's bytes */
    memset(a, 0x33, sizeof a);
    memset(b, 0x33, sizeof b);
    assert_int_equal(epd_requant_host(q, s, counts, E, CAP, H, EPD_SCALE_GROUP128, 0.0f, a, &big_s,
                                      err), EPD_OK);
    assert_int_equal(epd_requant_given_host(q, s, counts, E, CAP, H, EPD_SCALE_GROUP128, step, b,
                                            err), EPD_OK);
    assert_true(big_s == step);
    assert_memory_equal(a, b, sizeof a);
    /* a static S: the static requant's bytes */
    assert_int_equal(epd_requant_host(q, s, counts, E, CAP, H, EPD_SCALE_GROUP128, step / 3, a,
                                      &big_s, err), EPD_OK);
    assert_int_equal(epd_requant_given_host(q, s, counts, E, CAP, H, EPD_SCALE_GROUP128, step / 3,
                                            b, err), EPD_OK);
    assert_memory_equal(a, b, sizeof a);
    /* S = 0: only for a step with no live row, which writes nothing */
    assert_int_equal(epd_requant_given_host(q, s, counts, E, CAP, H, EPD_SCALE_GROUP128, 0.0f, b,
                                            err), EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(err, "S must be > 0"));
    memset(b, 0x44, sizeof b);
    assert_int_equal(epd_requant_given_host(q, s, none, E, CAP, H, EPD_SCALE_GROUP128, 0.0f, b,
                                            err), EPD_OK);
    assert_int_equal(b[0], 0x44);
    assert_int_equal(epd_requant_given_host(q, s, counts, E, CAP, H, EPD_SCALE_GROUP128, -1.0f, b,
                                            err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_requant_given_host(q, s, counts, E, CAP, H, EPD_SCALE_GROUP128, NAN, b,
                                            err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_requant_given_host(q, s, counts, E, CAP, H, EPD_SCALE_GROUP128, INFINITY,
                                            b, err), EPD_ERR_INVALID_ARG);
    counts[1] = CAP + 1;
    assert_int_equal(epd_requant_given_host(q, s, counts, E, CAP, H, EPD_SCALE_GROUP128, step, b,
                                            err), EPD_ERR_INVALID_ARG);
}

static void test_quant__requant_tiles__one_expert_each_and_doubled_when_too_many(void **state)
{
    (void)state;
    enum { E = 4, CAP = 10 };
    int32_t counts[E] = {7, 0, 1, 10};
    uint32_t first[16], n_tiles = 0, r = 0;
    uint16_t rows[16];
    uint64_t live = 0;
    char err[EPD_ERR_LEN] = "";
    /* 3 rows a tile: 7 -> 3+3+1, 1 -> 1, 10 -> 3+3+3+1 */
    assert_int_equal(epd_requant_tiles_make(counts, E, CAP, 3, 16, first, rows, &n_tiles, &r,
                                            &live, err), EPD_OK);
    const uint32_t want_first[] = {0, 3, 6, 20, 30, 33, 36, 39};
    const uint16_t want_rows[] = {3, 3, 1, 1, 3, 3, 3, 1};
    assert_int_equal(n_tiles, 8);
    assert_int_equal(r, 3);
    assert_int_equal(live, 18);
    assert_memory_equal(first, want_first, sizeof want_first);
    assert_memory_equal(rows, want_rows, sizeof want_rows);
    /* at most 4 tiles: 3 -> 6 -> 12 rows a tile (2 at 6 rows does not fit: 2 + 1 + 2 = 5) */
    assert_int_equal(epd_requant_tiles_make(counts, E, CAP, 3, 4, first, rows, &n_tiles, &r,
                                            &live, err), EPD_OK);
    assert_int_equal(r, 12);
    assert_int_equal(n_tiles, 3);
    assert_int_equal(first[2], 30);
    assert_int_equal(rows[2], 10);
    /* 3 experts with rows cannot fit in 2 tiles at any size */
    assert_int_equal(epd_requant_tiles_make(counts, E, CAP, 3, 2, first, rows, &n_tiles, &r,
                                            &live, err), EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(err, "tiles"));
    counts[1] = -1;
    assert_int_equal(epd_requant_tiles_make(counts, E, CAP, 3, 16, first, rows, &n_tiles, &r,
                                            &live, err), EPD_ERR_INVALID_ARG);
    counts[1] = 0;
    assert_int_equal(epd_requant_tiles_make(counts, E, CAP, 0, 16, first, rows, &n_tiles, &r,
                                            &live, err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_requant_tiles_make(counts, 4096, 1u << 20, 1, 16, first, rows, &n_tiles,
                                            &r, &live, err), EPD_ERR_INVALID_ARG);
    /* no live row: no tile */
    int32_t none[E] = {0, 0, 0, 0};
    assert_int_equal(epd_requant_tiles_make(none, E, CAP, 1, 16, first, rows, &n_tiles, &r, &live,
                                            err), EPD_OK);
    assert_int_equal(n_tiles, 0);
    assert_int_equal(live, 0);
}

/* The layout-aware requant's pick (gpu/quant_host.c's requant_live_picks, set from a kbench
 * --sweep): at H 7168 every class of live rows that the tile or part kernels serve gets passes
 * of whole rows (no lane idle in a row's last pass; the grid kernel's passes run over the live
 * vectors, rows or not); every pick at every hidden size is a valid launch. */
static void test_quant__launch_pick__requant_live_by_live_rows(void **state)
{
    (void)state;
    const uint32_t classes[] = {1,    16,   17,   32,   33,    128,   129,  512,
                                513,  1024, 1025, 2048, 2049,  4096,  4097, 8192,
                                8193, 16384, 32768, 0xffffffffu};
    for (size_t k = 0; k < sizeof classes / sizeof classes[0]; k++) {
        epd_quant_launch_t l = epd_quant_launch_pick(EPD_QK_REQUANT_LIVE, 7168, classes[k], 132);
        if ((l.flags & EPD_QL_GRID) == 0)
            assert_int_equal(l.threads * l.vec % 448, 0); /* a 7168-byte row is 448 vectors */
    }
    char err[EPD_ERR_LEN] = "";
    const uint32_t hs[] = {128, 256, 896, 2048, 4096, 5120, 7168};
    const uint32_t rows[] = {1, 16, 17, 32, 33, 128, 129, 512, 513, 1024, 1025, 2048, 2049, 4096,
                             4097, 8192, 8193, 32768};
    for (size_t i = 0; i < sizeof hs / sizeof hs[0]; i++)
        for (size_t k = 0; k < sizeof rows / sizeof rows[0]; k++) {
            epd_quant_launch_t l = epd_quant_launch_pick(EPD_QK_REQUANT_LIVE, hs[i], rows[k], 132);
            assert_int_equal(epd_quant_launch_check(EPD_QK_REQUANT_LIVE, hs[i], &l, err), EPD_OK);
        }
}

/* ---- argument checks, many rows ---- */

static void test_quant__bad_shapes__rejected_with_message(void **state)
{
    (void)state;
    char err[EPD_ERR_LEN] = "";
    uint16_t x[256] = {0};
    uint8_t q[256];
    float s[2], f[256];
    assert_int_equal(epd_quant_check(0, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, err),
                     EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_quant_check(129, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, err),
                     EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(err, "129"));
    assert_int_equal(epd_quant_check(7168, (epd_scale_kind_t)7, EPD_SCALE_FMT_FP32, err),
                     EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_quant_check(7168, EPD_SCALE_GROUP128, (epd_scale_fmt_t)9, err),
                     EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_quant_check(1u << 20, EPD_SCALE_PER_TOKEN, EPD_SCALE_FMT_UE8M0, err), EPD_OK);
    assert_int_equal(epd_quant_host(x, 1, 100, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, q, s, err),
                     EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_quant_host(NULL, 1, 128, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, q, s, err),
                     EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_quant_host(NULL, 0, 128, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, q, s, err),
                     EPD_OK);
    assert_int_equal(epd_dequant_host(q, NULL, 1, 128, EPD_SCALE_GROUP128, f, err),
                     EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_dequant_bf16_host(q, s, 1, 96, EPD_SCALE_GROUP128, x, err),
                     EPD_ERR_INVALID_ARG);
}

static void test_quant__many_rows__same_as_row_function(void **state)
{
    (void)state;
    enum { M = 5, H = 640 };
    uint16_t *x = malloc(sizeof(uint16_t) * M * H), *xb = malloc(sizeof(uint16_t) * M * H);
    uint8_t *q = malloc(M * H), qr[H];
    float *s = malloc(sizeof(float) * M * 5), sr[5], *f = malloc(sizeof(float) * M * H), fr[H];
    char err[EPD_ERR_LEN];
    assert_non_null(x);
    assert_non_null(xb);
    assert_non_null(q);
    assert_non_null(s);
    assert_non_null(f);
    fill_row(x, M * H, 7.0f);
    for (int kind = 0; kind < 2; kind++) {
        uint32_t ns = epd_quant_n_scales(H, (epd_scale_kind_t)kind);
        assert_int_equal(epd_quant_host(x, M, H, (epd_scale_kind_t)kind, EPD_SCALE_FMT_UE8M0, q, s,
                                        err), EPD_OK);
        assert_int_equal(epd_dequant_host(q, s, M, H, (epd_scale_kind_t)kind, f, err), EPD_OK);
        assert_int_equal(epd_dequant_bf16_host(q, s, M, H, (epd_scale_kind_t)kind, xb, err), EPD_OK);
        for (int r = 0; r < M; r++) {
            epd_quant_row_host(x + r * H, H, (epd_scale_kind_t)kind, EPD_SCALE_FMT_UE8M0, qr, sr);
            assert_memory_equal(qr, q + r * H, H);
            assert_memory_equal(sr, s + r * ns, ns * sizeof(float));
            epd_dequant_row_host(qr, sr, H, (epd_scale_kind_t)kind, fr);
            assert_memory_equal(fr, f + r * H, H * sizeof(float));
            for (int i = 0; i < H; i++) assert_int_equal(xb[r * H + i], bf16_of(fr[i]));
        }
    }
    free(f);
    free(s);
    free(q);
    free(xb);
    free(x);
}

static void test_quant__launch_pick__valid_for_every_hidden(void **state)
{
    (void)state;
    char err[EPD_ERR_LEN];
    const uint32_t rows[] = {1, 7, 128, 4096, 32768};
    const uint32_t sms[] = {0, 1, 132, 1000}; /* 0: an unknown count, taken as 1 */
    for (uint32_t h = 128; h <= 131072; h += (h < 20000 ? 128 : 8192)) {
        for (int k = 0; k < EPD_QK_MAX; k++) {
            for (size_t r = 0; r < EPD_ARRAY_SIZE(rows); r++) {
                for (size_t m = 0; m < EPD_ARRAY_SIZE(sms); m++) {
                    epd_quant_launch_t l =
                        epd_quant_launch_pick((epd_quant_kernel_t)k, h, rows[r], sms[m]);
                    if (epd_quant_launch_check((epd_quant_kernel_t)k, h, &l, err) != EPD_OK)
                        fail_msg("hidden %u kernel %s rows %u, %u SMs: %s", h,
                                 epd_quant_kernel_name((epd_quant_kernel_t)k), rows[r], sms[m],
                                 err);
                }
            }
        }
    }
    epd_quant_launch_t l = epd_quant_launch_pick(EPD_QK_QUANT_TOKEN, 7168, 4096, 132);
    assert_true(l.vec > 0 && l.threads / l.rows * l.vec * 8 >= 7168); /* the row fits registers */
    l = epd_quant_launch_pick(EPD_QK_QUANT_TOKEN, 1u << 20, 16, 132);
    assert_int_equal(l.vec, 0); /* two-pass beyond registers */
}

static void test_quant__launch_pick__fewer_rows_than_sms__fewer_rows_per_block(void **state)
{
    (void)state;
    /* H 896: 112 vectors a row, 128 lanes, 2 rows a block while the rows fill every SM */
    epd_quant_launch_t many = epd_quant_launch_pick(EPD_QK_QUANT_TOKEN, 896, 4096, 132);
    epd_quant_launch_t few = epd_quant_launch_pick(EPD_QK_QUANT_TOKEN, 896, 200, 132);
    epd_quant_launch_t small_gpu = epd_quant_launch_pick(EPD_QK_QUANT_TOKEN, 896, 200, 16);

    assert_int_equal(many.rows, 2);
    assert_int_equal(few.rows, 1);
    assert_int_equal(small_gpu.rows, 2);
}

static void test_quant__launch_check__bad_parameters_rejected(void **state)
{
    (void)state;
    char err[EPD_ERR_LEN];
    epd_quant_launch_t l = {.threads = 100, .vec = 2, .rows = 1};
    assert_int_equal(epd_quant_launch_check(EPD_QK_QUANT_GROUP, 7168, &l, err), EPD_ERR_INVALID_ARG);
    l = (epd_quant_launch_t){.threads = 256, .vec = 3, .rows = 1};
    assert_int_equal(epd_quant_launch_check(EPD_QK_QUANT_GROUP, 7168, &l, err), EPD_ERR_INVALID_ARG);
    l = (epd_quant_launch_t){.threads = 128, .vec = 4, .rows = 1};
    assert_int_equal(epd_quant_launch_check(EPD_QK_QUANT_TOKEN, 7168, &l, err), EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(err, "row has 7168"));
    l = (epd_quant_launch_t){.threads = 96, .vec = 8, .rows = 2};
    assert_int_equal(epd_quant_launch_check(EPD_QK_QUANT_TOKEN, 128, &l, err), EPD_ERR_INVALID_ARG);
    l = (epd_quant_launch_t){.threads = 256, .vec = 4, .rows = 0};
    assert_int_equal(epd_quant_launch_check(EPD_QK_REQUANT, 7168, &l, err), EPD_ERR_INVALID_ARG);
    l = (epd_quant_launch_t){.threads = 256, .vec = 4, .rows = 2, .blocks = 33};
    assert_int_equal(epd_quant_launch_check(EPD_QK_REQUANT, 7168, &l, err), EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(err, "blocks per SM"));
    l = (epd_quant_launch_t){.threads = 256, .vec = 4, .rows = 4};
    assert_int_equal(epd_quant_launch_check(EPD_QK_MAX, 7168, &l, err), EPD_ERR_INVALID_ARG);
    /* parts and variant bits: requant_live only, within their ranges */
    l = (epd_quant_launch_t){.threads = 224, .vec = 4, .rows = 32, .blocks = 4, .split = 16,
                             .flags = EPD_QL_ALL};
    assert_int_equal(epd_quant_launch_check(EPD_QK_REQUANT_LIVE, 7168, &l, err), EPD_OK);
    l.flags = EPD_QL_ALL + 1;
    assert_int_equal(epd_quant_launch_check(EPD_QK_REQUANT_LIVE, 7168, &l, err), EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(err, "flags"));
    l.flags = 0;
    l.split = EPD_REQUANT_MAX_PARTS + 1;
    assert_int_equal(epd_quant_launch_check(EPD_QK_REQUANT_LIVE, 7168, &l, err), EPD_ERR_INVALID_ARG);
    l = (epd_quant_launch_t){.threads = 224, .vec = 2, .rows = 4, .blocks = 4, .flags = EPD_QL_PIPE};
    assert_int_equal(epd_quant_launch_check(EPD_QK_REQUANT, 7168, &l, err), EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(err, "requant_live only"));
    l = (epd_quant_launch_t){.threads = 256, .vec = 2, .rows = 1, .split = 2};
    assert_int_equal(epd_quant_launch_check(EPD_QK_QUANT_GROUP, 7168, &l, err), EPD_ERR_INVALID_ARG);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_quant__e4m3_decode__all_256_codes_match_reference),
        cmocka_unit_test(test_quant__e4m3_encode__every_bf16_pattern_matches_reference),
        cmocka_unit_test(test_quant__e4m3_encode__random_fp32_match_reference),
        cmocka_unit_test(test_quant__e4m3_encode__boundaries_ties_and_specials),
        cmocka_unit_test(test_quant__bf16__rounds_to_nearest_even_and_keeps_nan),
        cmocka_unit_test(test_quant__per_token__hand_computed_row),
        cmocka_unit_test(test_quant__zero_row__uses_amax_floor),
        cmocka_unit_test(test_quant__group128_vs_per_token__outlier_only_hurts_per_token),
        cmocka_unit_test(test_quant__round_trip__error_within_e4m3_precision),
        cmocka_unit_test(test_quant__ue8m0__scales_are_powers_of_two_at_least_fp32),
        cmocka_unit_test(test_quant__requant__step_scale_and_dead_rows),
        cmocka_unit_test(test_quant__requant__small_static_scale_saturates_never_nan),
        cmocka_unit_test(test_quant__requant__group_scales_match_formula),
        cmocka_unit_test(test_quant__requant__bad_arguments__rejected),
        cmocka_unit_test(test_quant__requant_given__same_bytes_as_static_and_zero_only_without_rows),
        cmocka_unit_test(test_quant__requant_tiles__one_expert_each_and_doubled_when_too_many),
        cmocka_unit_test(test_quant__launch_pick__requant_live_by_live_rows),
        cmocka_unit_test(test_quant__bad_shapes__rejected_with_message),
        cmocka_unit_test(test_quant__many_rows__same_as_row_function),
        cmocka_unit_test(test_quant__launch_pick__valid_for_every_hidden),
        cmocka_unit_test(test_quant__launch_pick__fewer_rows_than_sms__fewer_rows_per_block),
        cmocka_unit_test(test_quant__launch_check__bad_parameters_rejected),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
