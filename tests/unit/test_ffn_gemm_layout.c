/* Unit tests of gpu/ffn_gemm_layout.h, the ffn GEMM kernel's own index arithmetic, on the CPU:
 * the shared tiles' swizzle (every chunk once, no bank conflict for the kernel's copies and
 * fragment reads), and an emulation of one stage of one CTA (the kernel's copy loops and fragment
 * reads, the PTX ISA's m16n8k16 / m16n8k32 fragment layouts in bytes, its epilogue's indices)
 * proving that every mma multiplies a weight byte with the activation byte of the same k, that
 * each (feature, row, k) of the stage is multiplied exactly once, and that each sum lands on its
 * (feature, row); the rows the epilogue writes against epd_ffn_gemm_written_rows (the split-K
 * reduce's), the K ranges, and the auto split's choices. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/ffn_gemm.h"
#include "gpu/ffn_gemm_layout.h"

#define BN EPD_FFN_GEMM_BN
#define ROW_TILE EPD_FFN_GEMM_ROW_TILE
#define SB EPD_FFN_GEMM_STAGE_BYTES
#define THREADS (EPD_FFN_GEMM_WARPS * 32u)
#define NT_W (EPD_FFN_GEMM_WARP_ROWS / 8u)
#define NONE 0xffffffffu

/* a byte of a shared tile: which row of its operand and which k byte of the stage it holds */
static uint32_t tag(uint32_t row, uint32_t kbyte)
{
    return row << 8 | kbyte;
}

/* the 16-byte bank group (of 8 in 128 bytes) of a shared offset */
static uint32_t bank_group(uint32_t off)
{
    return off / 16 % 8;
}

static void test_ffn_gemm_layout__tile_off__every_chunk_once_16_byte_aligned(void **state)
{
    static uint8_t seen[BN * SB / 16];
    (void)state;
    memset(seen, 0, sizeof seen);
    for (uint32_t r = 0; r < BN; r++)
        for (uint32_t q = 0; q < 8; q++) {
            uint32_t off = epd_ffn_gemm_tile_off(r, q);
            assert_int_equal(off % 16, 0);
            assert_true(off >= r * SB && off < (r + 1) * SB); /* within its row */
            seen[off / 16]++;
        }
    for (uint32_t i = 0; i < sizeof seen; i++) assert_int_equal(seen[i], 1);
}

/* The kernel's copies (thread i of a warp copies chunk i % 8 of row i / 8 of its 4 rows) and its
 * fragment reads (lane g, t: chunk 4c + t of rows a_row / b_row of g): the 8 lanes of each
 * quarter warp in 8 distinct bank groups. */
static void test_ffn_gemm_layout__tile_off__quarter_warps_conflict_free(void **state)
{
    (void)state;
    /* copies: the weights' stage (every thread, W_STAGE / 16 / THREADS rounds) */
    for (uint32_t k = 0; k < BN * SB / 16 / THREADS; k++)
        for (uint32_t warp = 0; warp < EPD_FFN_GEMM_WARPS; warp++)
            for (uint32_t qw = 0; qw < 4; qw++) {
                uint32_t used = 0;
                for (uint32_t l = qw * 8; l < qw * 8 + 8; l++) {
                    uint32_t i = warp * 32 + l + k * THREADS;
                    used |= 1u << bank_group(epd_ffn_gemm_tile_off(i >> 3, i & 7));
                }
                assert_int_equal(used, 0xff);
            }
    /* fragment reads */
    for (uint32_t c = 0; c < 2; c++)
        for (uint32_t qw = 0; qw < 4; qw++) {
            for (uint32_t fg = 0; fg < EPD_FFN_GEMM_FEATURE_GROUPS; fg++)
                for (uint32_t mt = 0; mt < 2; mt++)
                    for (uint32_t h = 0; h < 2; h++) {
                        uint32_t used = 0;
                        for (uint32_t l = qw * 8; l < qw * 8 + 8; l++)
                            used |= 1u << bank_group(epd_ffn_gemm_tile_off(
                                        epd_ffn_gemm_a_row(fg, mt, h, l >> 2), c * 4 + (l & 3)));
                        assert_int_equal(used, 0xff);
                    }
            for (uint32_t rh = 0; rh < ROW_TILE / EPD_FFN_GEMM_WARP_ROWS; rh++)
                for (uint32_t j = 0; j < NT_W; j++) {
                    uint32_t used = 0;
                    for (uint32_t l = qw * 8; l < qw * 8 + 8; l++)
                        used |= 1u << bank_group(epd_ffn_gemm_tile_off(
                                    epd_ffn_gemm_b_row(rh, j, l >> 2), c * 4 + (l & 3)));
                    assert_int_equal(used, 0xff);
                }
        }
}

/* the 4 tags of word w (bytes 4w .. 4w + 3) of the 16 bytes at off of a tile */
static void word_tags(const uint32_t *tile, uint32_t off, uint32_t w, uint32_t out[4])
{
    for (uint32_t b = 0; b < 4; b++) out[b] = tile[off + 4 * w + b];
}

/* One stage of one CTA with nt n8 tiles of rows, emulated: the copies as the kernel's load(),
 * the fragments as its compute(), each mma.sync on the PTX ISA's layouts in bytes (A [16][32]
 * row-major: lane (g, t) holds rows g (a0, a2) and g + 8 (a1, a3) at k bytes [4t, 4t + 4) (a0,
 * a1) and [16 + 4t, + 4) (a2, a3); B column g at the same k bytes (b0, b1); D rows g, g + 8,
 * columns 2t, 2t + 1 in c0 .. c3), the sums' (feature, row) as the epilogue writes them. */
static void emulate_stage(uint32_t nt)
{
    static uint32_t w_s[BN * SB], x_s[ROW_TILE * SB];
    static uint8_t cover[BN][ROW_TILE][SB];
    memset(cover, 0, sizeof cover);
    for (uint32_t i = 0; i < BN * SB; i++) w_s[i] = NONE;
    for (uint32_t i = 0; i < ROW_TILE * SB; i++) x_s[i] = NONE;
    /* load(): weights, then nt * 8 rows of activations; source chunk q of row r holds the
     * stage's k bytes [16 q, 16 q + 16) */
    for (uint32_t tid = 0; tid < THREADS; tid++) {
        for (uint32_t k = 0; k < BN * SB / 16 / THREADS; k++) {
            /* the kernel's form: one swizzled offset of (tid / 8, tid % 8) plus k THREADS / 8
             * rows, from row tid / 8 + k THREADS / 8 of the source */
            uint32_t r = (tid >> 3) + k * (THREADS / 8), q = tid & 7;
            uint32_t off = epd_ffn_gemm_tile_off(tid >> 3, tid & 7) + k * (THREADS / 8) * SB;
            uint32_t i = tid + k * THREADS;
            assert_int_equal(off, epd_ffn_gemm_tile_off(i >> 3, i & 7));
            for (uint32_t b = 0; b < 16; b++) {
                assert_int_equal(w_s[off + b], NONE);
                w_s[off + b] = tag(r, q * 16 + b);
            }
        }
        for (uint32_t i = tid; i < nt * 64; i += THREADS) {
            uint32_t r = i >> 3, q = i & 7;
            uint32_t off = epd_ffn_gemm_tile_off(r, q);
            for (uint32_t b = 0; b < 16; b++) {
                assert_int_equal(x_s[off + b], NONE);
                x_s[off + b] = tag(r, q * 16 + b);
            }
        }
    }
    for (uint32_t i = 0; i < BN * SB; i++) assert_int_not_equal(w_s[i], NONE);
    for (uint32_t warp = 0; warp < EPD_FFN_GEMM_WARPS; warp++) {
        uint32_t fg = warp % EPD_FFN_GEMM_FEATURE_GROUPS, rh = warp / EPD_FFN_GEMM_FEATURE_GROUPS;
        uint32_t nt_w = epd_ffn_gemm_warp_nt(nt, rh);
        for (uint32_t mt = 0; mt < 2; mt++)
            for (uint32_t j = 0; j < nt_w; j++)
                for (uint32_t c = 0; c < 2; c++)
                    for (uint32_t sub = 0; sub < 2; sub++) {
                        /* A [16][32] and B [8][32] of this mma from the 32 lanes' registers */
                        uint32_t A[16][32], B[8][32];
                        for (uint32_t lane = 0; lane < 32; lane++) {
                            uint32_t g = lane >> 2, t = lane & 3;
                            uint32_t lo = epd_ffn_gemm_tile_off(epd_ffn_gemm_a_row(fg, mt, 0, g),
                                                                c * 4 + t);
                            uint32_t hi = epd_ffn_gemm_tile_off(epd_ffn_gemm_a_row(fg, mt, 1, g),
                                                                c * 4 + t);
                            uint32_t bo = epd_ffn_gemm_tile_off(epd_ffn_gemm_b_row(rh, j, g),
                                                                c * 4 + t);
                            /* the kernel's mma<FP8>(.., sub ? lo.z : lo.x, sub ? hi.z : hi.x,
                             * sub ? lo.w : lo.y, sub ? hi.w : hi.y, b0, b1) */
                            uint32_t w0 = sub ? 2 : 0, w1 = sub ? 3 : 1;
                            word_tags(w_s, lo, w0, &A[g][4 * t]);
                            word_tags(w_s, hi, w0, &A[g + 8][4 * t]);
                            word_tags(w_s, lo, w1, &A[g][16 + 4 * t]);
                            word_tags(w_s, hi, w1, &A[g + 8][16 + 4 * t]);
                            word_tags(x_s, bo, w0, &B[g][4 * t]);
                            word_tags(x_s, bo, w1, &B[g][16 + 4 * t]);
                        }
                        for (uint32_t m = 0; m < 16; m++)
                            for (uint32_t n = 0; n < 8; n++) {
                                /* D[m][n] is lane (m % 8) * 4 + n / 2's register (m / 8) * 2 +
                                 * n % 2; the epilogue's (feature, tile row) of it */
                                uint32_t g = m % 8, t = n / 2, reg = (m / 8) * 2 + n % 2;
                                uint32_t f = epd_ffn_gemm_a_row(fg, mt, 0, g) + (reg >= 2 ? 8 : 0);
                                uint32_t r = rh * EPD_FFN_GEMM_WARP_ROWS + j * 8 + 2 * t +
                                             (reg & 1);
                                for (uint32_t kb = 0; kb < 32; kb++) {
                                    uint32_t a = A[m][kb], b = B[n][kb];
                                    assert_int_not_equal(a, NONE);
                                    assert_int_not_equal(b, NONE);
                                    assert_int_equal(a & 0xff, b & 0xff); /* the same k byte */
                                    assert_int_equal(a >> 8, f);          /* its feature */
                                    assert_int_equal(b >> 8, r);          /* its row */
                                    cover[f][r][a & 0xff]++;
                                }
                            }
                    }
    }
    for (uint32_t f = 0; f < BN; f++)
        for (uint32_t r = 0; r < ROW_TILE; r++)
            for (uint32_t k = 0; k < SB; k++) assert_int_equal(cover[f][r][k], r < nt * 8 ? 1 : 0);
}

static void test_ffn_gemm_layout__one_stage__every_product_once_where_written(void **state)
{
    (void)state;
    for (uint32_t nt = 1; nt <= ROW_TILE / 8; nt++) emulate_stage(nt);
}

/* The rows the kernel's epilogue writes (each row tile rt below the count: its nt n8 tiles, each
 * warp its row half's) are [0, epd_ffn_gemm_written_rows) of the expert, for counts around the
 * row tiles' and the padding's edges and padded rows of 16 and more. */
static void test_ffn_gemm_layout__written_rows__match_the_epilogue(void **state)
{
    static uint8_t written[1024];
    (void)state;
    for (uint32_t count = 0; count <= 300; count++)
        for (uint32_t extra = 0; extra <= 32; extra += 16) {
            uint32_t mpad = (count + 15) / 16 * 16 + extra;
            uint32_t tiles = (count + ROW_TILE - 1) / ROW_TILE;
            memset(written, 0, sizeof written);
            for (uint32_t rt = 0; rt < tiles; rt++) {
                if (rt * ROW_TILE >= count) continue;
                uint32_t rows = count - rt * ROW_TILE < ROW_TILE ? count - rt * ROW_TILE : ROW_TILE;
                uint32_t nt = (rows + 7) / 8, lim = (mpad - rt * ROW_TILE) / 8;
                if (nt > lim) nt = lim;
                for (uint32_t rh = 0; rh < ROW_TILE / EPD_FFN_GEMM_WARP_ROWS; rh++)
                    for (uint32_t r = 0; r < epd_ffn_gemm_warp_nt(nt, rh) * 8; r++)
                        written[rt * ROW_TILE + rh * EPD_FFN_GEMM_WARP_ROWS + r]++;
            }
            uint32_t want = epd_ffn_gemm_written_rows(count, mpad, tiles, ROW_TILE);
            assert_true(want >= count && want <= mpad);
            for (uint32_t r = 0; r < mpad; r++) assert_int_equal(written[r], r < want ? 1 : 0);
        }
}

static void test_ffn_gemm_layout__split_range__covers_k_in_order_none_empty(void **state)
{
    (void)state;
    for (uint32_t n_kb = 1; n_kb <= 130; n_kb++)
        for (uint32_t splits = 1; splits <= EPD_FFN_GEMM_MAX_SPLIT && splits <= n_kb; splits++) {
            uint32_t next = 0;
            for (uint32_t s = 0; s < splits; s++) {
                uint32_t kb0, kb1;
                epd_ffn_gemm_split_range(s, splits, n_kb, &kb0, &kb1);
                assert_int_equal(kb0, next);
                assert_true(kb1 > kb0);
                next = kb1;
            }
            assert_int_equal(next, n_kb);
        }
}

/* the auto split on an H200's 132 SMs of 2 CTAs: the bench's shapes (gate/up 32 blocks of 128
 * features over 112 stages of BF16, 56 of FP8; down 56 over 32 and 16) */
static void test_ffn_gemm_layout__auto_split__splits_short_grids_only(void **state)
{
    const uint64_t slots = 264;
    (void)state;
    /* 32 experts of one row tile: 4 waves or nearly, no split */
    assert_int_equal(epd_ffn_gemm_auto_split(32 * 32, 112, slots, 8), 1);
    assert_int_equal(epd_ffn_gemm_auto_split(32 * 56, 32, slots, 8), 1);
    /* 20 experts (1 row each of 4 tokens): 2.4 waves of gate/up, 2 ranges make 4.8 */
    assert_int_equal(epd_ffn_gemm_auto_split(20 * 32, 112, slots, 8), 2);
    /* 3 experts: well short of a wave, split as far as allowed */
    uint32_t s = epd_ffn_gemm_auto_split(3 * 32, 112, slots, 8);
    assert_true(s >= 4 && s <= EPD_FFN_GEMM_MAX_SPLIT);
    /* bounded by the workspace and by K (FP8 down: 16 stages, ranges of 8 at least) */
    assert_int_equal(epd_ffn_gemm_auto_split(3 * 32, 112, slots, 1), 1);
    assert_true(epd_ffn_gemm_auto_split(3 * 32, 112, slots, 3) <= 3);
    assert_true(epd_ffn_gemm_auto_split(3 * 56, 16, slots, 8) <= 2);
    assert_int_equal(epd_ffn_gemm_auto_split(3 * 56, 15, slots, 8), 1);
    for (uint64_t ctas = 1; ctas < 8 * slots; ctas += 7)
        for (uint32_t n_kb = 1; n_kb <= 112; n_kb += 5) {
            s = epd_ffn_gemm_auto_split(ctas, n_kb, slots, 8);
            assert_true(s >= 1 && s <= EPD_FFN_GEMM_MAX_SPLIT);
            if (s > 1) assert_true(n_kb / s >= EPD_FFN_GEMM_SPLIT_MIN_STAGES && ctas < 4 * slots);
        }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ffn_gemm_layout__tile_off__every_chunk_once_16_byte_aligned),
        cmocka_unit_test(test_ffn_gemm_layout__tile_off__quarter_warps_conflict_free),
        cmocka_unit_test(test_ffn_gemm_layout__one_stage__every_product_once_where_written),
        cmocka_unit_test(test_ffn_gemm_layout__written_rows__match_the_epilogue),
        cmocka_unit_test(test_ffn_gemm_layout__split_range__covers_k_in_order_none_empty),
        cmocka_unit_test(test_ffn_gemm_layout__auto_split__splits_short_grids_only),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
