/* Unit tests of gpu/ffn_path.h on the CPU: which path an ffn experts call takes under a tuning
 * (the kernels' row limits, the mean over the experts with rows, kernel or wgmma first, the
 * cuBLASLt paths behind them) and where the default tuning sends each format's calls: FP8 block
 * weights to the Hopper kernel up to 192 rows per expert and to the mma.sync kernel up to 32 where
 * the Hopper kernel was refused, never to the per-expert cuBLASLt streams below that (their
 * ~100 launches a call were the whole phase there); BF16 weights to the Hopper kernel up to 64
 * rows, strided above (the mma.sync kernel up to 16 where the Hopper kernel was refused). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <string.h>

#include "gpu/ffn_path.h"

#define N_LOCAL 32

/* rows per expert: every expert `rows`, or with `every` > 1 only every every-th expert */
static void fill(uint32_t *counts, uint32_t rows, uint32_t every)
{
    for (uint32_t e = 0; e < N_LOCAL; e++) counts[e] = e % every == 0 ? rows : 0;
}

static epd_ffn_path_t path_at(const epd_ffn_cuda_tuning_t *t, bool fp8, uint32_t rows)
{
    uint32_t counts[N_LOCAL];
    fill(counts, rows, 1);
    return epd_ffn_path_choose(t, fp8, false, counts, N_LOCAL);
}

/* The default as epd_ffn_cuda_set_tuning leaves it for FP8 block weights on an H200 (cuBLASLt
 * has no strided block-scaled batch: strided cleared): the Hopper kernel up to 192 rows per
 * expert, the streams above. */
static void test_ffn_path__default_fp8__wgmma_up_to_192_rows_then_streams(void **state)
{
    epd_ffn_cuda_tuning_t t;
    (void)state;
    epd_ffn_default_tuning_fill(&t);
    t.strided = false;
    static const uint32_t wgmma_rows[] = {1,  2,  4,  8,  16,  17,  31,  32, 33,
                                          48, 63, 64, 65, 127, 128, 129, 192};
    for (size_t i = 0; i < sizeof wgmma_rows / sizeof wgmma_rows[0]; i++)
        assert_int_equal(path_at(&t, true, wgmma_rows[i]), EPD_FFN_PATH_WGMMA);
    static const uint32_t streams_rows[] = {193, 256, 512, 4096};
    for (size_t i = 0; i < sizeof streams_rows / sizeof streams_rows[0]; i++)
        assert_int_equal(path_at(&t, true, streams_rows[i]), EPD_FFN_PATH_STREAMS);
    /* where cuBLASLt does batch block scales (strided kept), strided above 192 */
    epd_ffn_default_tuning_fill(&t);
    assert_int_equal(path_at(&t, true, 192), EPD_FFN_PATH_WGMMA);
    assert_int_equal(path_at(&t, true, 193), EPD_FFN_PATH_STRIDED);
}

/* Where the Hopper kernel's check refused it (off sm_90a; set_tuning clears wgmma): the mma.sync
 * kernel up to 32 rows, the streams above. */
static void test_ffn_path__default_fp8_wgmma_refused__kernel_up_to_32_rows(void **state)
{
    epd_ffn_cuda_tuning_t t;
    (void)state;
    epd_ffn_default_tuning_fill(&t);
    t.strided = false;
    t.wgmma = false;
    for (uint32_t rows = 1; rows <= 32; rows++)
        assert_int_equal(path_at(&t, true, rows), EPD_FFN_PATH_KERNEL);
    assert_int_equal(path_at(&t, true, 33), EPD_FFN_PATH_STREAMS);
    assert_int_equal(path_at(&t, true, 64), EPD_FFN_PATH_STREAMS);
    /* and with neither kernel: the streams at every size */
    t.kernel = false;
    assert_int_equal(path_at(&t, true, 1), EPD_FFN_PATH_STREAMS);
}

/* BF16 weights: the Hopper kernel up to 64 rows per expert, strided above; where the Hopper
 * kernel's check refused it, the mma.sync kernel up to 16 rows, strided above. */
static void test_ffn_path__default_bf16__wgmma_up_to_64_rows_then_strided(void **state)
{
    epd_ffn_cuda_tuning_t t;
    (void)state;
    epd_ffn_default_tuning_fill(&t);
    for (uint32_t rows = 1; rows <= 64; rows++)
        assert_int_equal(path_at(&t, false, rows), EPD_FFN_PATH_WGMMA);
    static const uint32_t strided_rows[] = {65, 96, 128, 512};
    for (size_t i = 0; i < sizeof strided_rows / sizeof strided_rows[0]; i++)
        assert_int_equal(path_at(&t, false, strided_rows[i]), EPD_FFN_PATH_STRIDED);
    assert_int_equal(epd_ffn_path_limit(false, t.wgmma_max_rows, t.wgmma_fp8_max_rows), 64);
    assert_true(t.wgmma_swiglu); /* SwiGLU in the GEMM's epilogue where wgmma serves */
    assert_true(t.wgmma_pdl);
    assert_true(t.d_bf16);
    assert_true(t.wgmma_pair); /* BF16's Hopper GEMMs in pairs */
    t.wgmma = false;
    for (uint32_t rows = 1; rows <= 16; rows++)
        assert_int_equal(path_at(&t, false, rows), EPD_FFN_PATH_KERNEL);
    for (size_t i = 0; i < sizeof strided_rows / sizeof strided_rows[0]; i++)
        assert_int_equal(path_at(&t, false, strided_rows[i]), EPD_FFN_PATH_STRIDED);
    assert_int_equal(path_at(&t, false, 17), EPD_FFN_PATH_STRIDED);
}

/* By device: on an H100 SXM (its CUDA name) BF16's Hopper kernel up to 128 rows per expert,
 * strided above, FP8's up to 176 (the streams above); every other name (the H200, the H100's
 * other forms, none) the default above. */
static void test_ffn_path__default_by_device__h100_sxm_wgmma_up_to_128_rows_fp8_176(void **state)
{
    epd_ffn_cuda_tuning_t t, d;
    (void)state;
    epd_ffn_default_tuning_for(&t, "NVIDIA H100 80GB HBM3");
    static const uint32_t wgmma_rows[] = {1, 16, 17, 64, 65, 96, 127, 128};
    for (size_t i = 0; i < sizeof wgmma_rows / sizeof wgmma_rows[0]; i++)
        assert_int_equal(path_at(&t, false, wgmma_rows[i]), EPD_FFN_PATH_WGMMA);
    assert_int_equal(path_at(&t, false, 129), EPD_FFN_PATH_STRIDED);
    assert_int_equal(path_at(&t, false, 512), EPD_FFN_PATH_STRIDED);
    assert_int_equal(path_at(&t, true, 176), EPD_FFN_PATH_WGMMA);
    assert_int_equal(path_at(&t, true, 177), EPD_FFN_PATH_STRIDED);
    assert_int_equal(path_at(&t, true, 192), EPD_FFN_PATH_STRIDED);
    /* nothing else moved */
    epd_ffn_default_tuning_fill(&d);
    assert_int_equal(path_at(&d, true, 192), EPD_FFN_PATH_WGMMA);
    t.wgmma_max_rows = d.wgmma_max_rows;
    t.wgmma_fp8_max_rows = d.wgmma_fp8_max_rows;
    assert_memory_equal(&t, &d, sizeof t);
    static const char *const others[] = {"NVIDIA H200", "NVIDIA H100 PCIe", "NVIDIA H100 NVL",
                                         "NVIDIA H100 80GB HBM3 ", "", NULL};
    for (size_t i = 0; i < sizeof others / sizeof others[0]; i++) {
        epd_ffn_default_tuning_for(&t, others[i]);
        assert_memory_equal(&t, &d, sizeof t);
    }
}

/* The limits: 0 every call, the FP8 field over the common one (UINT32_MAX: every call),
 * EPD_FFN_ROWS_NONE none, an off kernel none. */
static void test_ffn_path__limit__fp8_field_sentinels(void **state)
{
    uint32_t counts[N_LOCAL];
    (void)state;
    assert_int_equal(epd_ffn_path_limit(false, 16, 64), 16);
    assert_int_equal(epd_ffn_path_limit(true, 16, 64), 64);
    assert_int_equal(epd_ffn_path_limit(true, 16, 0), 16);
    assert_int_equal(epd_ffn_path_limit(true, 16, UINT32_MAX), 0);
    assert_int_equal(epd_ffn_path_limit(true, EPD_FFN_ROWS_NONE, 0), EPD_FFN_ROWS_NONE);
    assert_int_equal(epd_ffn_path_limit(true, 0, EPD_FFN_ROWS_NONE), EPD_FFN_ROWS_NONE);
    fill(counts, 1u << 20, 1);
    assert_true(epd_ffn_path_takes(true, false, 0, 0, counts, N_LOCAL));
    assert_true(epd_ffn_path_takes(true, true, 16, UINT32_MAX, counts, N_LOCAL));
    assert_false(epd_ffn_path_takes(true, false, 1u << 19, 0, counts, N_LOCAL));
    fill(counts, 1, 1);
    assert_false(epd_ffn_path_takes(true, false, EPD_FFN_ROWS_NONE, 0, counts, N_LOCAL));
    assert_false(epd_ffn_path_takes(true, true, 0, EPD_FFN_ROWS_NONE, counts, N_LOCAL));
    assert_false(epd_ffn_path_takes(false, false, 0, 0, counts, N_LOCAL));
}

/* The mean is over the experts with rows (an expert without rows costs nothing), a call without
 * rows is taken, and the mean's edge is inclusive. */
static void test_ffn_path__takes__mean_over_experts_with_rows(void **state)
{
    uint32_t counts[N_LOCAL];
    (void)state;
    fill(counts, 64, 4); /* 8 experts of 64 rows, 24 of none: mean 64, not 16 */
    assert_true(epd_ffn_path_takes(true, true, 0, 64, counts, N_LOCAL));
    assert_false(epd_ffn_path_takes(true, true, 0, 63, counts, N_LOCAL));
    fill(counts, 0, 1);
    assert_true(epd_ffn_path_takes(true, true, 0, 1, counts, N_LOCAL));
    fill(counts, 0, 1);
    counts[0] = 65;
    counts[1] = 63; /* mean 64 */
    assert_true(epd_ffn_path_takes(true, false, 64, 0, counts, N_LOCAL));
    counts[1] = 64; /* mean 64.5 */
    assert_false(epd_ffn_path_takes(true, false, 64, 0, counts, N_LOCAL));
    /* sums beyond 32 bits */
    fill(counts, UINT32_MAX / 2, 1);
    assert_false(epd_ffn_path_takes(true, false, 64, 0, counts, N_LOCAL));
    assert_true(epd_ffn_path_takes(true, false, UINT32_MAX / 2, 0, counts, N_LOCAL));
}

/* Kernel first unless wgmma_first; each serves the calls within its rows the other does not take;
 * the cuBLAS paths behind them in their order (strided, grouped with libcublas only and BF16
 * only, batched BF16 only, the streams). */
static void test_ffn_path__choose__precedence(void **state)
{
    epd_ffn_cuda_tuning_t t;
    uint32_t counts[N_LOCAL];
    (void)state;
    /* the sweep's kernel,upto=16,wgmma */
    memset(&t, 0, sizeof t);
    t.streams = 4;
    t.kernel = true;
    t.kernel_max_rows = 16;
    t.kernel_fp8_max_rows = 16;
    t.wgmma = true;
    assert_int_equal(path_at(&t, true, 16), EPD_FFN_PATH_KERNEL);
    assert_int_equal(path_at(&t, true, 17), EPD_FFN_PATH_WGMMA);
    assert_int_equal(path_at(&t, false, 600), EPD_FFN_PATH_WGMMA);
    t.wgmma_first = true;
    assert_int_equal(path_at(&t, true, 16), EPD_FFN_PATH_WGMMA);
    assert_int_equal(path_at(&t, false, 1), EPD_FFN_PATH_WGMMA);
    /* wgmma first but out of its rows: the kernel within its own */
    t.wgmma_max_rows = 8;
    assert_int_equal(path_at(&t, false, 8), EPD_FFN_PATH_WGMMA);
    assert_int_equal(path_at(&t, false, 9), EPD_FFN_PATH_KERNEL);
    assert_int_equal(path_at(&t, false, 17), EPD_FFN_PATH_STREAMS);
    /* the cuBLAS paths */
    memset(&t, 0, sizeof t);
    t.streams = 1;
    t.grouped = true;
    t.batched = true;
    fill(counts, 40, 1);
    assert_int_equal(epd_ffn_path_choose(&t, false, true, counts, N_LOCAL), EPD_FFN_PATH_GROUPED);
    assert_int_equal(epd_ffn_path_choose(&t, false, false, counts, N_LOCAL),
                     EPD_FFN_PATH_BATCHED);
    assert_int_equal(epd_ffn_path_choose(&t, true, true, counts, N_LOCAL), EPD_FFN_PATH_STREAMS);
    t.strided = true;
    assert_int_equal(epd_ffn_path_choose(&t, false, true, counts, N_LOCAL), EPD_FFN_PATH_STRIDED);
    assert_int_equal(epd_ffn_path_choose(&t, true, true, counts, N_LOCAL), EPD_FFN_PATH_STRIDED);
}

/* Every path has its own name (the benchmark prints it); anything else is "none". */
static void test_ffn_path__name__distinct(void **state)
{
    (void)state;
    for (int a = 0; a < EPD_FFN_PATH_MAX; a++) {
        assert_string_not_equal(epd_ffn_path_name((epd_ffn_path_t)a), "none");
        for (int b = a + 1; b < EPD_FFN_PATH_MAX; b++)
            assert_string_not_equal(epd_ffn_path_name((epd_ffn_path_t)a),
                                    epd_ffn_path_name((epd_ffn_path_t)b));
    }
    assert_string_equal(epd_ffn_path_name(EPD_FFN_PATH_MAX), "none");
    assert_string_equal(epd_ffn_path_name(EPD_FFN_PATH_STREAMS), "streams");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ffn_path__default_fp8__wgmma_up_to_192_rows_then_streams),
        cmocka_unit_test(test_ffn_path__default_fp8_wgmma_refused__kernel_up_to_32_rows),
        cmocka_unit_test(test_ffn_path__default_bf16__wgmma_up_to_64_rows_then_strided),
        cmocka_unit_test(test_ffn_path__default_by_device__h100_sxm_wgmma_up_to_128_rows_fp8_176),
        cmocka_unit_test(test_ffn_path__limit__fp8_field_sentinels),
        cmocka_unit_test(test_ffn_path__takes__mean_over_experts_with_rows),
        cmocka_unit_test(test_ffn_path__choose__precedence),
        cmocka_unit_test(test_ffn_path__name__distinct),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
