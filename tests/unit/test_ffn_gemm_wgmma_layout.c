/* Unit tests of gpu/ffn_gemm_wgmma_layout.h, the Hopper ffn GEMM kernel's shared-memory layout, on
 * the CPU: the TMA's 128-byte swizzle as the producer's copies write it (every byte of a tile
 * once), the wgmma matrix descriptor's fields where the PTX ISA puts them, and an emulation of
 * one stage: a shared window filled by the producer's model (epd_wgmma_tile_off at each slot's
 * tile, tagged with the operand row and K byte each byte holds), read back through the
 * descriptors the consumers build, at the addresses the PTX ISA's canonical K-major 128B-swizzle
 * layout gives (epd_wgmma_desc_addr): each wgmma must read row m (A) / n (B) at the K bytes of
 * its step, every (row, K byte) of the stage exactly once. Then the accumulator fragment (every
 * D element once), the row tile choice and the rows the epilogue writes. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "gpu/ffn_gemm_layout.h"
#include "gpu/ffn_gemm_wgmma_layout.h"

#define RB EPD_WGMMA_ROW_BYTES
#define STEPS (RB / EPD_WGMMA_K_BYTES) /* wgmmas a stage */
#define NONE 0xffffffffu

static void test_ffn_gemm_wgmma_layout__swizzle__every_byte_once(void **state)
{
    (void)state;
    for (uint32_t rows = 8; rows <= 256; rows *= 2) {
        uint8_t *seen = calloc((size_t)rows * RB, 1);
        assert_non_null(seen);
        for (uint32_t r = 0; r < rows; r++)
            for (uint32_t b = 0; b < RB; b++) {
                uint32_t off = epd_wgmma_tile_off(r, b);
                assert_true(off < rows * RB);
                /* a row stays in its 128 bytes, a 16-byte chunk stays whole */
                assert_int_equal(off / RB, r);
                assert_int_equal(off % 16, b % 16);
                seen[off]++;
            }
        for (uint32_t i = 0; i < rows * RB; i++) assert_int_equal(seen[i], 1);
        free(seen);
    }
    /* rows 0 and 8 are unswizzled; row 1's chunk 0 is at chunk 1, row 7's chunk 2 at chunk 5 */
    assert_int_equal(epd_wgmma_tile_off(0, 37), 37);
    assert_int_equal(epd_wgmma_tile_off(8, 37), 8 * RB + 37);
    assert_int_equal(epd_wgmma_tile_off(1, 3), RB + 16 + 3);
    assert_int_equal(epd_wgmma_tile_off(7, 2 * 16 + 9), 7 * RB + 5 * 16 + 9);
}

static void test_ffn_gemm_wgmma_layout__descriptor__fields_per_ptx_isa(void **state)
{
    (void)state;
    static const uint32_t addrs[] = {0, 1024, 0x8000 + 32, 0x37c00 + 96, 0x3ffe0};
    for (size_t i = 0; i < sizeof addrs / sizeof addrs[0]; i++) {
        uint64_t d = epd_wgmma_desc(addrs[i]);
        assert_int_equal(d & 0x3fff, addrs[i] >> 4);           /* bits 0-13: start >> 4 */
        assert_int_equal((d >> 14) & 3, 0);
        assert_int_equal((d >> 16) & 0x3fff, 1);                /* 16-29: LBO 16 bytes */
        assert_int_equal((d >> 30) & 3, 0);
        assert_int_equal((d >> 32) & 0x3fff, 1024 >> 4);        /* 32-45: SBO 1024 bytes */
        assert_int_equal((d >> 46) & 0xffff, 0);                /* 46-61: base offset 0, rest 0 */
        assert_int_equal(d >> 62, 1);                           /* 62-63: 128-byte swizzle */
    }
    /* the model refuses what it does not model */
    assert_int_equal(epd_wgmma_desc_addr(epd_wgmma_desc(0) & ~(3ull << 62), 0, 0), NONE);
    assert_int_equal(epd_wgmma_desc_addr(epd_wgmma_desc(0) | (1ull << 49), 0, 0), NONE);
}

/* One stage of one CTA: weights (128 rows) and activations (bn rows) at their slot's tiles in a
 * shared window from `base`, each byte tagged (row << 8 | K byte) by the producer's model; the
 * consumers' descriptors read back through the PTX ISA's model. Returns the mismatches. */
static uint32_t emulate_stage(uint32_t base, uint32_t w_tile_at, uint32_t x_tile_at, uint32_t bn)
{
    const uint32_t window = x_tile_at + bn * RB + 4096;
    uint32_t *tag = malloc((size_t)window * sizeof(uint32_t));
    uint8_t *w_read = calloc(128 * RB, 1), *x_read = calloc((size_t)bn * RB, 1);
    uint32_t bad = 0;
    for (uint32_t i = 0; i < window; i++) tag[i] = NONE;
    for (uint32_t r = 0; r < 128; r++)
        for (uint32_t b = 0; b < RB; b++) tag[w_tile_at + epd_wgmma_tile_off(r, b)] = r << 8 | b;
    for (uint32_t r = 0; r < bn; r++)
        for (uint32_t b = 0; b < RB; b++) tag[x_tile_at + epd_wgmma_tile_off(r, b)] = r << 8 | b;
    /* the kernel: consumer half h's A at w tile + h * 64 rows, B the whole x tile, step kk's K
     * bytes 32 kk on */
    for (uint32_t h = 0; h < 2; h++)
        for (uint32_t kk = 0; kk < STEPS; kk++) {
            uint64_t da = epd_wgmma_desc(base + w_tile_at + h * 64u * RB + kk * EPD_WGMMA_K_BYTES);
            uint64_t db = epd_wgmma_desc(base + x_tile_at + kk * EPD_WGMMA_K_BYTES);
            for (uint32_t kb = 0; kb < EPD_WGMMA_K_BYTES; kb++) {
                const uint32_t want_k = kk * EPD_WGMMA_K_BYTES + kb;
                for (uint32_t m = 0; m < 64; m++) {
                    uint32_t a = epd_wgmma_desc_addr(da, m, kb) - base;
                    uint32_t t = a < window ? tag[a] : NONE;
                    if (t != ((h * 64 + m) << 8 | want_k)) {
                        bad++;
                        continue;
                    }
                    w_read[(h * 64 + m) * RB + want_k]++;
                }
                for (uint32_t n = 0; n < bn; n++) {
                    uint32_t a = epd_wgmma_desc_addr(db, n, kb) - base;
                    uint32_t t = a < window ? tag[a] : NONE;
                    if (t != (n << 8 | want_k)) {
                        bad++;
                        continue;
                    }
                    if (h == 0) x_read[n * RB + want_k]++;
                }
            }
        }
    if (bad == 0) {
        for (uint32_t i = 0; i < 128 * RB; i++) bad += w_read[i] != 1;
        for (uint32_t i = 0; i < bn * RB; i++) bad += x_read[i] != 1;
    }
    free(tag);
    free(w_read);
    free(x_read);
    return bad;
}

static void test_ffn_gemm_wgmma_layout__stage__mma_reads_what_tma_wrote(void **state)
{
    (void)state;
    /* the kernel's slots: tiles 1024-aligned, shared windows at a few aligned bases, the
     * activation tiles after some stages of weight tiles */
    static const uint32_t bns[] = {32, 64, 96, 128, 160, 192, 256};
    static const uint32_t bases[] = {0, 1024, 0x4400};
    for (size_t i = 0; i < sizeof bns / sizeof bns[0]; i++)
        for (size_t j = 0; j < sizeof bases / sizeof bases[0]; j++)
            for (uint32_t slot = 0; slot < 3; slot++) {
                uint32_t w_at = slot * 128 * RB, x_at = 4 * 128 * RB + slot * bns[i] * RB;
                assert_int_equal(emulate_stage(bases[j], w_at, x_at, bns[i]), 0);
            }
    /* a tile off the 1024-byte atom (a base offset the descriptor does not say) reads wrong:
     * the emulation can fail */
    assert_true(emulate_stage(512, 0, 4 * 128 * RB, 32) > 0);
}

static void test_ffn_gemm_wgmma_layout__accumulator__every_element_once(void **state)
{
    (void)state;
    for (uint32_t i = 0; i < EPD_WGMMA_TILES; i++) {
        const uint32_t bn = epd_wgmma_tile_at(i);
        uint8_t *seen = calloc(64 * bn, 1);
        for (uint32_t w = 0; w < 4; w++)
            for (uint32_t lane = 0; lane < 32; lane++)
                for (uint32_t j = 0; j < bn / 2; j++) {
                    uint32_t m, n;
                    epd_wgmma_acc_pos(w, lane, j, &m, &n);
                    assert_true(m < 64 && n < bn);
                    seen[m * bn + n]++;
                }
        for (uint32_t x = 0; x < 64 * bn; x++) assert_int_equal(seen[x], 1);
        free(seen);
    }
    /* the PTX ISA's figure: lane 5 of warp 1, register 6: row 16 + 1 + 8, column 8 * 1 + 2 * 1 + 0 */
    uint32_t m, n;
    epd_wgmma_acc_pos(1, 5, 6, &m, &n);
    assert_int_equal(m, 25);
    assert_int_equal(n, 10);
}

static void test_ffn_gemm_wgmma_layout__row_tile__least_waste(void **state)
{
    (void)state;
    uint32_t c[32];
    for (int i = 0; i < 32; i++) c[i] = 16;
    assert_int_equal(epd_wgmma_pick_row_tile(0, c, 32), 32);
    c[3] = 0;
    c[4] = 32;
    assert_int_equal(epd_wgmma_pick_row_tile(1, c, 32), 32);
    for (int i = 0; i < 32; i++) c[i] = 512;
    assert_int_equal(epd_wgmma_pick_row_tile(0, c, 32), 256);
    assert_int_equal(epd_wgmma_pick_row_tile(1, c, 32), 128); /* FP8: 128 at most */
    for (int i = 0; i < 32; i++) c[i] = 140;
    assert_int_equal(epd_wgmma_pick_row_tile(0, c, 32), 160); /* one tile each, the least waste */
    assert_int_equal(epd_wgmma_pick_row_tile(1, c, 32), 96); /* FP8: two of 96 over two of 128 */
    c[0] = 70;
    assert_int_equal(epd_wgmma_pick_row_tile(0, c, 1), 96); /* 1 tile of 96 over 2 of 64 */
    c[0] = 40;
    assert_int_equal(epd_wgmma_pick_row_tile(0, c, 1), 64);
    assert_int_equal(epd_wgmma_pick_row_tile(0, c, 0), 32); /* no experts: the smallest */
    /* every expert's rows are covered by its tiles, whatever the tile */
    /* the tiles ascending, multiples of 32, indexed back */
    for (uint32_t i = 0; i < EPD_WGMMA_TILES; i++) {
        assert_int_equal(epd_wgmma_tile_at(i) % 32, 0);
        if (i > 0) assert_true(epd_wgmma_tile_at(i) > epd_wgmma_tile_at(i - 1));
        assert_int_equal(epd_wgmma_tile_index(epd_wgmma_tile_at(i)), i);
    }
    assert_int_equal(epd_wgmma_tile_at(EPD_WGMMA_TILES - 1), EPD_WGMMA_TILE_MAX);
    assert_int_equal(epd_wgmma_tile_at(EPD_WGMMA_TILES_FP8 - 1), EPD_WGMMA_TILE_MAX_FP8);
    assert_int_equal(epd_wgmma_tile_index(100), EPD_WGMMA_TILES);
    for (uint32_t i = 0; i < EPD_WGMMA_TILES; i++)
        for (uint32_t count = 0, t = epd_wgmma_tile_at(i); count <= 600; count++) {
            uint32_t mpad = (count + 15) / 16 * 16, tiles = (count + t - 1) / t;
            uint32_t w = epd_ffn_gemm_written_rows(count, mpad, tiles, t);
            assert_true(w >= count && w <= mpad && w <= tiles * t && w % 8 == 0);
        }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ffn_gemm_wgmma_layout__swizzle__every_byte_once),
        cmocka_unit_test(test_ffn_gemm_wgmma_layout__descriptor__fields_per_ptx_isa),
        cmocka_unit_test(test_ffn_gemm_wgmma_layout__stage__mma_reads_what_tma_wrote),
        cmocka_unit_test(test_ffn_gemm_wgmma_layout__accumulator__every_element_once),
        cmocka_unit_test(test_ffn_gemm_wgmma_layout__row_tile__least_waste),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
