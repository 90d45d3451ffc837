/* Unit tests of gpu/ffn_gemm_wgmma_layout.h, the Hopper ffn GEMM kernel's shared-memory layout, on
 * the CPU: the TMA's 128-byte swizzle as the producer's copies write it (every byte of a tile
 * once), the wgmma matrix descriptor's fields where the PTX ISA puts them, and an emulation of
 * one stage: a shared window filled by the producer's model (epd_wgmma_tile_off at each slot's
 * tile, tagged with the operand row and K byte each byte holds), read back through the
 * descriptors the consumers build, at the addresses the PTX ISA's canonical K-major 128B-swizzle
 * layout gives (epd_wgmma_desc_addr): each wgmma must read row m (A) / n (B) at the K bytes of
 * its step, every (row, K byte) of the stage exactly once. Then the accumulator fragment (every
 * D element once), the row tile choice and the rows the epilogue writes. Last, whole launches
 * emulated on the CPU (producer, consumers, mbarriers, TMA and wgmma modelled; the kernel's own
 * index arithmetic from the layout header): every output right and written once, no hang, and
 * the emulation's negative controls. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/ffn_gemm_layout.h"
#include "gpu/ffn_gemm_wgmma_layout.h"
#include "gpu/fp8.h"

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
            uint64_t da = epd_wgmma_desc_step(base + w_tile_at + h * 64u * RB, kk);
            uint64_t db = epd_wgmma_desc_step(base + x_tile_at, kk);
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
    assert_int_equal(epd_wgmma_pick_row_tile(1, c, 32), 192); /* FP8: 192 at most */
    for (int i = 0; i < 32; i++) c[i] = 140;
    assert_int_equal(epd_wgmma_pick_row_tile(0, c, 32), 160); /* one tile each, the least waste */
    assert_int_equal(epd_wgmma_pick_row_tile(1, c, 32), 160); /* FP8 too */
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

/* A work item's rows (epd_wgmma_tile_rows): an expert's tiles cover its rows once, in order,
 * none empty, each at most the row tile, all but the last a multiple of 16 (so that the last
 * one's rows rounded up to 8 stay its own), and what an item computes (its rows rounded up to
 * 16) within the expert's padded rows; past the tiles, no rows. The activation boxes of an item
 * (epd_wgmma_x_box) cover its rows once, 64-row boxes first, then at most one of 32 and one of
 * 16, and the stage's bytes count them. */
static void test_ffn_gemm_wgmma_layout__tile_rows__cover_each_row_once(void **state)
{
    (void)state;
    for (uint32_t i = 0; i < EPD_WGMMA_TILES; i++) {
        const uint32_t t = epd_wgmma_tile_at(i);
        for (uint32_t c = 0; c <= 1100; c++) {
            const uint32_t tiles = (c + t - 1) / t, padded = (c + 15) / 16 * 16;
            uint32_t end = 0, row0, rows;
            for (uint32_t rt = 0; rt < tiles; rt++) {
                epd_wgmma_tile_rows(c, t, rt, &row0, &rows);
                const uint32_t n = epd_wgmma_item_n(rows);
                assert_int_equal(row0, end);
                assert_true(rows >= 1 && rows <= t);
                assert_true(n % 16 == 0 && n >= rows && n <= t && row0 + n <= padded);
                assert_true(epd_wgmma_item_written(rows) >= rows &&
                            epd_wgmma_item_written(rows) <= n);
                if (rt + 1 < tiles) assert_int_equal(rows % 16, 0);
                end = row0 + rows;
            }
            assert_int_equal(end, c);
            epd_wgmma_tile_rows(c, t, tiles, &row0, &rows);
            assert_int_equal(rows, 0);
        }
    }
    for (uint32_t n = 16; n <= EPD_WGMMA_TILE_MAX; n += 16) {
        uint32_t end = 0, r, rows;
        for (uint32_t b = 0; b < epd_wgmma_x_boxes(n); b++) {
            epd_wgmma_x_box(n, b, &r, &rows);
            assert_int_equal(r, end);
            assert_true(rows == EPD_WGMMA_X_BIG || rows == EPD_WGMMA_X_MID ||
                        rows == EPD_WGMMA_X_BOX);
            if (rows != EPD_WGMMA_X_BIG) assert_true(n - r < EPD_WGMMA_X_BIG);
            if (rows == EPD_WGMMA_X_BOX) assert_true(n - r == EPD_WGMMA_X_BOX);
            end = r + rows;
        }
        assert_int_equal(end, n);
        assert_true(epd_wgmma_x_boxes(n) <= n / EPD_WGMMA_X_BIG + 2);
        assert_int_equal(epd_wgmma_stage_bytes(0, n), EPD_WGMMA_W_TILE + n * EPD_WGMMA_ROW_BYTES);
        assert_int_equal(epd_wgmma_stage_bytes(1, n),
                         EPD_WGMMA_W_TILE + n * EPD_WGMMA_ROW_BYTES + n * 4u);
    }
}

/* ---- a CPU emulation of whole launches ------------------------------------------------------
 * The kernel's producer and two consumers run as three agents taking turns on modelled mbarriers
 * (init count, arrive, expect_tx, complete_tx, try_wait.parity: a phase completes when its
 * arrivals and its transaction bytes are both down to 0), through the layout header's
 * arithmetic as the kernel uses it (shared-memory layout, ring slots and parities, expect_tx
 * bytes, the weight boxes' features, the FP8 scales' indices, the descriptors, the accumulator
 * fragment in the epilogue, the staged epilogue's buffer (where the tile has one: every value
 * written once, each st.shared's lanes in distinct banks, read back once along the rows), the
 * written rows, split-K's ranges and the in-order reduce), against
 * models of the hardware that are this file's own: the TMA (a box of 128 bytes by rows, the
 * 128-byte swizzle on the shared address, rows past the tensor zero-filled and counted), the
 * bulk copy (16-byte aligned, exact bytes), the wgmma's operand reads (epd_wgmma_desc_addr, the
 * PTX ISA's canonical K-major layout) and its accumulator fragment (the ISA's figure, written
 * here again). A copy lands when issued and a BF16 wgmma group reads its operands only when
 * retired (wgmma.wait_group), so a slot refilled before its readers are done shows as wrong
 * sums; a byte count that disagrees with the copies hangs the ring (reported) or underflows.
 * Shared memory starts 0xff (NaN as BF16, e4m3 and fp32) and unaligned, so a read of bytes no
 * copy wrote, or a misplaced tile, shows. Small integers and power-of-two scales: exact sums. */

#define EMU_RAW 0x410u /* the dynamic shared memory's start: 16-byte aligned only */
#define WG 128u        /* a warpgroup's threads: each arrives on the empty mbarrier a stage */

typedef struct emu_bar {
    uint32_t count, pending, phase;
    int64_t tx;
    int bad; /* transaction bytes below 0 */
} emu_bar_t;

static void bar_init(emu_bar_t *b, uint32_t count)
{
    b->count = b->pending = count;
    b->phase = 0;
    b->tx = 0;
    b->bad = 0;
}

static void bar_check(emu_bar_t *b)
{
    if (b->tx < 0) b->bad = 1;
    if (b->pending == 0 && b->tx == 0) {
        b->phase ^= 1u;
        b->pending = b->count;
    }
}

static void bar_arrive(emu_bar_t *b)
{
    b->pending--;
    bar_check(b);
}

static void bar_expect_tx(emu_bar_t *b, uint32_t bytes)
{
    b->tx += bytes;
    bar_arrive(b);
}

static void bar_complete_tx(emu_bar_t *b, uint32_t bytes)
{
    b->tx -= bytes;
    bar_check(b);
}

/* mbarrier.try_wait.parity: the phase of that parity has completed (the current one is the other)
 */
static int bar_try(const emu_bar_t *b, uint32_t parity)
{
    return (b->phase & 1u) != parity;
}

/* the accumulator fragment of wgmma .m64nNk* with fp32 D, as the PTX ISA's figure draws it: warp
 * w of the warpgroup owns rows 16 w .. 16 w + 15; in each 8-column block c (registers 4 c .. 4 c +
 * 3) lane l holds columns 2 (l % 4) and 2 (l % 4) + 1 of row l / 4 (registers 4 c, 4 c + 1) and of
 * row l / 4 + 8 (registers 4 c + 2, 4 c + 3) */
static void isa_acc(uint32_t warp, uint32_t lane, uint32_t reg, uint32_t *row_p, uint32_t *col_p)
{
    uint32_t block = reg / 4, in = reg % 4;
    *row_p = 16 * warp + lane / 4 + (in >= 2 ? 8 : 0);
    *col_p = 8 * block + 2 * (lane % 4) + (in & 1);
}

typedef struct emu {
    /* the launch */
    int fp8, fused, out_bf16; /* out_bf16: D in BF16 (the staged epilogue's where it fits) */
    uint32_t n, k, n_exp, bn, splits;
    const uint32_t *counts;
    uint32_t row_base[9], tile_base[9], total, n_tiles;
    uint8_t *w, *x;           /* [n_exp * n][k] and [total][k] elements (BF16: 2 bytes) */
    float *w_scale, *x_scale; /* FP8 */
    uint32_t ld, x_scale_len;
    size_t outs; /* elements of D (h with SwiGLU fused) */
    /* results */
    double *d, *part, *h;
    uint8_t *written; /* per split (z) and element of D (or h) */
    /* one CTA's state */
    uint8_t *smem; /* [SMEM] from shared address EMU_RAW */
    uint32_t smem_len, base;
    epd_wgmma_smem_t at;
    emu_bar_t full[EPD_WGMMA_MAX_STAGES], empty[EPD_WGMMA_MAX_STAGES];
    char why[200];
    int failed;
    int fault; /* the negative controls: EMU_FAULT_* */
} emu_t;

/* faults the emulation must catch: expect_tx 16 bytes short or long, BF16 slots released as
 * soon as their wgmmas are issued (before wgmma.wait_group), the staged epilogue's rows 128 bytes
 * apart (its stores' lanes then share banks) */
enum {
    EMU_FAULT_NONE,
    EMU_FAULT_TX_SHORT,
    EMU_FAULT_TX_LONG,
    EMU_FAULT_EARLY_RELEASE,
    EMU_FAULT_EPI_ROW128
};

static void emu_fail(emu_t *m, const char *why)
{
    if (!m->failed) snprintf(m->why, sizeof m->why, "%s", why);
    m->failed = 1;
}

static uint8_t *sm(emu_t *m, uint32_t addr, uint32_t len)
{
    if (addr < EMU_RAW || addr + len > EMU_RAW + m->smem_len) {
        emu_fail(m, "a shared access outside the CTA's dynamic shared memory");
        return NULL;
    }
    return m->smem + (addr - EMU_RAW);
}

/* the TMA: box {128 bytes of K from element k0, box_rows rows from row0} of a [rows][k] tensor
 * into dst, 128-byte swizzled on the shared address; returns the bytes it counts (the whole box) */
static uint32_t emu_tma(emu_t *m, uint32_t dst, const uint8_t *g, uint32_t rows, uint32_t k0,
                        uint32_t row0, uint32_t box_rows)
{
    const uint32_t es = m->fp8 ? 1 : 2, row_bytes = m->k * es;
    if (dst % EPD_WGMMA_ATOM_BYTES != 0) emu_fail(m, "a TMA destination off the 1024-byte atom");
    for (uint32_t r = 0; r < box_rows; r++)
        for (uint32_t b = 0; b < RB; b++) {
            uint32_t lin = dst + r * RB + b, addr = lin ^ (((lin >> 7) & 7u) << 4);
            uint64_t kb = (uint64_t)k0 * es + b;
            uint8_t v =
                row0 + r < rows && kb < row_bytes ? g[(uint64_t)(row0 + r) * row_bytes + kb] : 0;
            uint8_t *p = sm(m, addr, 1);
            if (p != NULL) *p = v;
        }
    return box_rows * RB;
}

/* cp.async.bulk of bytes from x_scale + at (floats) into dst: returns the bytes */
static uint32_t emu_bulk(emu_t *m, uint32_t dst, uint64_t at, uint32_t bytes)
{
    uint8_t *p = sm(m, dst, bytes);
    if (dst % 16 != 0 || at % 4 != 0 || bytes % 16 != 0 || bytes == 0)
        emu_fail(m, "a bulk copy not 16-byte aligned or sized");
    if (at + bytes / 4 > m->x_scale_len) emu_fail(m, "a bulk copy past the activation scales");
    if (p != NULL && !m->failed) memcpy(p, m->x_scale + at, bytes);
    return bytes;
}

static double elem(const emu_t *m, const uint8_t *p)
{
    if (m->fp8) return epd_e4m3_to_f32(p[0]);
    return epd_bf16_to_f32((uint16_t)(p[0] | p[1] << 8));
}

/* one stage's 4 wgmmas of consumer half h on the slot's tiles: d[reg] of each (warp, lane) +=
 * (or =, fresh) the products, read through the kernel's descriptors; only columns (tile rows)
 * below `cols` (the rest the epilogue never writes) */
static void emu_wgmma(emu_t *m, uint32_t h, uint32_t slot, double *d, int fresh, uint32_t cols)
{
    const uint32_t bn = m->bn, es = m->fp8 ? 1 : 2, per = RB / es;
    static double a[64][128], b[256][128];
    const uint32_t a0 = m->base + m->at.w + slot * EPD_WGMMA_W_TILE + h * 64u * RB;
    const uint32_t b0 = m->base + m->at.x + slot * bn * RB;
    for (uint32_t kk = 0; kk < STEPS; kk++) {
        uint64_t da = epd_wgmma_desc_step(a0, kk), db = epd_wgmma_desc_step(b0, kk);
        for (uint32_t i = 0; i < EPD_WGMMA_K_BYTES / es; i++) {
            const uint32_t kx = kk * EPD_WGMMA_K_BYTES / es + i;
            for (uint32_t r = 0; r < 64; r++) {
                const uint8_t *p = sm(m, epd_wgmma_desc_addr(da, r, i * es), es);
                a[r][kx] = p != NULL ? elem(m, p) : NAN;
            }
            for (uint32_t c = 0; c < cols; c++) {
                const uint8_t *p = sm(m, epd_wgmma_desc_addr(db, c, i * es), es);
                b[c][kx] = p != NULL ? elem(m, p) : NAN;
            }
        }
    }
    for (uint32_t warp = 0; warp < 4; warp++)
        for (uint32_t lane = 0; lane < 32; lane++)
            for (uint32_t j = 0; j < bn / 2; j++) {
                uint32_t row, col;
                isa_acc(warp, lane, j, &row, &col);
                double *acc = &d[(warp * 32 + lane) * (bn / 2) + j];
                if (col >= cols) continue;
                double s = 0;
                for (uint32_t kx = 0; kx < per; kx++) s += a[row][kx] * b[col][kx];
                *acc = fresh ? s : *acc + s;
            }
}

/* FP8: a finished stage's fragment part (slot `slot`) promoted into acc with the weight scale ws
 * and the slot's activation scales, read from the slot now (as the kernel does, before it frees
 * it); then the slot freed */
static void emu_promote(emu_t *m, uint32_t h, double *acc, const double *part, uint32_t slot,
                        double ws, uint32_t cols)
{
    const uint32_t bn = m->bn, regs = bn / 2;
    float sc[256];
    const uint8_t *p = sm(m, m->base + m->at.sc + slot * bn * 4, bn * 4);
    (void)h;
    if (p != NULL) memcpy(sc, p, bn * 4);
    for (uint32_t warp = 0; warp < 4; warp++)
        for (uint32_t lane = 0; lane < 32; lane++)
            for (uint32_t j = 0; j < regs; j++) {
                uint32_t fm, fn;
                epd_wgmma_acc_pos(warp, lane, j, &fm, &fn);
                if (fn >= cols) continue;
                const uint32_t i = (warp * 32 + lane) * regs + j;
                acc[i] += part[i] * (ws * sc[fn]);
            }
    for (uint32_t t = 0; t < WG; t++) bar_arrive(&m->empty[slot]);
}

/* byte (row n, column c) of half h's staged buffer: the layout's, or with EMU_FAULT_EPI_ROW128
 * rows of 128 bytes */
static uint32_t emu_epi_at(const emu_t *m, uint32_t h, uint32_t n, uint32_t c)
{
    if (m->fault == EMU_FAULT_EPI_ROW128) return (h * m->bn + n) * 128u + c * 2u;
    return epd_wgmma_epi_at(m->bn, h, n, c);
}

/* The staged epilogue (wg_store_staged) of an item whose first row is `row`, cols rows written:
 * each half's values (D's, or h = silu(g) * u with SwiGLU fused) into its buffer after the
 * ring's mbarriers, one st.shared a register a warp, whose lanes must reach distinct banks (or
 * one word); then read back in 8-byte chunks along the rows, 128 threads a half, to D or h. Each
 * buffer value written once before it is read, each read once. acc[h]: (warp * 32 + lane) *
 * regs + j. */
static void emu_staged(emu_t *m, const double (*acc)[128 * 128], uint32_t fb, uint32_t row,
                       uint32_t cols,
                       int fused)
{
    const uint32_t bn = m->bn, regs = bn / 2, np = m->n;
    const uint32_t buf = (m->base + m->at.end + 15u) & ~15u;
    const size_t slots = (size_t)m->smem_len / 2 + 1;
    double *val = calloc(slots, sizeof *val);
    uint8_t *wrote = calloc(slots, 1), *read = calloc(slots, 1);
    if (buf % 16 != 0) emu_fail(m, "the staged buffer not 16-byte aligned");
    for (uint32_t h = 0; h < 2 && !m->failed; h++)
        for (uint32_t warp = 0; warp < 4; warp++)
            for (uint32_t j = 0; j < regs; j++) {
                if (fused && (j / 2) % 2 != 0) continue; /* up registers: no store */
                uint32_t word_of_bank[32];
                memset(word_of_bank, 0xff, sizeof word_of_bank);
                for (uint32_t lane = 0; lane < 32; lane++) {
                    uint32_t fm, fn;
                    epd_wgmma_acc_pos(warp, lane, j, &fm, &fn);
                    if (fn >= cols) continue;
                    const uint32_t c = epd_wgmma_epi_col(fused, fm);
                    const uint32_t addr = buf + emu_epi_at(m, h, fn, c);
                    if (c >= (fused ? 32u : 64u)) emu_fail(m, "a staged column past the half's");
                    if (sm(m, addr, 2) == NULL) break;
                    const uint32_t bank = (addr / 4) % 32;
                    if (word_of_bank[bank] != UINT32_MAX && word_of_bank[bank] != addr / 4)
                        emu_fail(m, "a staged store's lanes in one bank");
                    word_of_bank[bank] = addr / 4;
                    const double *a = acc[h] + (warp * 32 + lane) * regs;
                    const double g = a[j];
                    const size_t at = (addr - EMU_RAW) / 2;
                    val[at] = fused ? g / (1.0 + exp(-g)) * a[j + 2] : g;
                    if (wrote[at]++ != 0) emu_fail(m, "a staged value written twice");
                }
            }
    const uint32_t shift = epd_wgmma_epi_shift(fused), nf = fused ? np / 2 : np;
    for (uint32_t h = 0; h < 2 && !m->failed; h++)
        for (uint32_t wt = 0; wt < WG; wt++)
            for (uint32_t i = wt; i < cols << shift && !m->failed; i += WG) {
                const uint32_t n = i >> shift, c = i & ((1u << shift) - 1u);
                const uint32_t f0 =
                    fused ? fb * 64u + h * 32u + c * 4u : epd_wgmma_feature(fb, h) + c * 4u;
                for (uint32_t q = 0; q < 4; q++) {
                    const uint32_t addr = buf + emu_epi_at(m, h, n, c * 4u + q);
                    if (sm(m, addr, 2) == NULL) break;
                    const size_t at = (addr - EMU_RAW) / 2, o = (size_t)(row + n) * nf + f0 + q;
                    if (wrote[at] != 1 || read[at]++ != 0) {
                        emu_fail(m, "a staged value read that was not written once, or twice");
                        break;
                    }
                    if (f0 + q >= nf || o >= m->outs) {
                        emu_fail(m, "a staged write past its row or D");
                        break;
                    }
                    if (fused)
                        m->h[o] = val[at];
                    else
                        m->d[o] = val[at];
                    m->written[o]++;
                }
            }
    for (size_t i = 0; i < slots && !m->failed; i++)
        if (wrote[i] && !read[i]) emu_fail(m, "a staged value never read back");
    free(val);
    free(wrote);
    free(read);
}

/* one CTA (feature block fb, grid row y, K range z) as the kernel runs it */
static void emu_cta(emu_t *m, uint32_t fb, uint32_t y, uint32_t z)
{
    const uint32_t bn = m->bn, stages = EPD_WGMMA_STAGES(bn);
    uint32_t e = 0;
    while (e + 1 < m->n_exp && m->tile_base[e + 1] <= y) e++;
    const uint32_t rt = y - m->tile_base[e], rb = m->row_base[e];
    const uint32_t mpad = m->row_base[e + 1] - rb;
    const uint32_t count = m->counts[e] < mpad ? m->counts[e] : mpad;
    uint32_t row0, rows;
    epd_wgmma_tile_rows(count, bn, rt, &row0, &rows);
    if (rows == 0) return;
    const uint32_t nn = epd_wgmma_item_n(rows); /* the rows the item computes */
    if (nn > bn || row0 + nn > mpad) emu_fail(m, "an item's rows past its tile or its expert");
    const uint32_t kstage = m->fp8 ? 128u : 64u, regs = bn / 2;
    uint32_t kb0, kb1;
    epd_ffn_gemm_split_range(z, m->splits, m->k / kstage, &kb0, &kb1);
    const uint32_t n_kb = kb1 - kb0;
    const uint32_t cols = epd_wgmma_item_written(rows); /* the rows the item writes */
    const uint32_t stage_bytes = epd_wgmma_stage_bytes(m->fp8, nn);
    const int fused = !m->fp8 && m->fused;

    memset(m->smem, 0xff, m->smem_len);
    m->base = (EMU_RAW + EPD_WGMMA_ATOM_BYTES - 1) & ~(EPD_WGMMA_ATOM_BYTES - 1);
    m->at = epd_wgmma_smem_at(bn);
    if (m->base + m->at.end > EMU_RAW + m->smem_len)
        emu_fail(m, "the pipeline past the shared memory asked for");
    if ((m->base + m->at.full) % 8 != 0) emu_fail(m, "mbarriers not 8-byte aligned");
    for (uint32_t s = 0; s < stages; s++) {
        bar_init(&m->full[s], 1);
        bar_init(&m->empty[s], EPD_WGMMA_CONSUMERS);
    }

    /* the agents: producer, consumer halves 0 and 1 */
    uint32_t ps = 0, cs[2] = {0, 0}, done[2] = {0, 0};
    uint32_t pending[2] = {0, 0}, has_pending[2] = {0, 0};
    static double acc[2][128 * 128], part[2][2][128 * 128]; /* FP8: [half][fragment] */
    for (uint32_t i = 0; i < 128 * regs; i++) acc[0][i] = acc[1][i] = 0;
    for (uint32_t rounds = 0; !m->failed; rounds++) {
        int moved = 0;
        for (uint32_t h = 0; h < 2 && !m->failed; h++) {
            /* the producer: as far as the empty slots let it (before each consumer's turn) */
            while (ps < n_kb && !m->failed) {
                uint32_t slot, fp, ep;
                epd_wgmma_ring(ps, stages, &slot, &fp, &ep);
                if (!bar_try(&m->empty[slot], ep)) break;
                emu_bar_t *bar = &m->full[slot];
                bar_expect_tx(bar, stage_bytes - (m->fault == EMU_FAULT_TX_SHORT ? 16u : 0u) +
                                       (m->fault == EMU_FAULT_TX_LONG ? 16u : 0u));
                const uint32_t k0 = (kb0 + ps) * kstage, wr = e * m->n;
                const uint32_t wall = m->n_exp * m->n;
                uint32_t got = 0;
                const uint32_t wt = m->base + m->at.w + slot * EPD_WGMMA_W_TILE;
                if (fused) {
                    /* the 5-d map's box, as the 8-row runs it brings */
                    for (uint32_t t = 0; t < EPD_WGMMA_FEATURES; t += 8)
                        got += emu_tma(m, wt + t * RB, m->w, wall, k0,
                                       wr + epd_wgmma_fused_row(m->n, fb, t), 8);
                } else {
                    /* one box of the block's 128 rows */
                    got += emu_tma(m, wt, m->w, wall, k0, wr + epd_wgmma_feature(fb, 0),
                                   EPD_WGMMA_FEATURES);
                }
                for (uint32_t b = 0; b < epd_wgmma_x_boxes(nn); b++) {
                    uint32_t xr, xrows;
                    epd_wgmma_x_box(nn, b, &xr, &xrows);
                    got += emu_tma(m, m->base + m->at.x + slot * bn * RB + xr * RB, m->x,
                                   m->total, k0, rb + row0 + xr, xrows);
                }
                if (m->fp8)
                    got += emu_bulk(m, m->base + m->at.sc + slot * bn * 4,
                                    epd_wgmma_x_scale_at(rb, m->k, mpad, row0, kb0 + ps), nn * 4);
                bar_complete_tx(bar, got);
                if (bar->bad) emu_fail(m, "a stage's copies brought more bytes than its expect_tx");
                ps++;
                moved = 1;
            }
            /* consumer h: a stage */
            if (done[h]) continue;
            if (cs[h] < n_kb) {
                uint32_t slot, fp, ep;
                epd_wgmma_ring(cs[h], stages, &slot, &fp, &ep);
                if (!bar_try(&m->full[slot], fp)) continue;
                if (!m->fp8) {
                    /* issued now, read when retired: after the next stage's issue (wait_group 1) */
                    if (has_pending[h]) {
                        emu_wgmma(m, h, pending[h], acc[h], 0, cols);
                        for (uint32_t t = 0; m->fault != EMU_FAULT_EARLY_RELEASE && t < WG; t++)
                            bar_arrive(&m->empty[pending[h]]);
                    }
                    pending[h] = slot;
                    has_pending[h] = 1;
                    if (m->fault == EMU_FAULT_EARLY_RELEASE)
                        for (uint32_t t = 0; t < WG; t++) bar_arrive(&m->empty[slot]);
                } else if (!EPD_WGMMA_FP8_DOUBLE(bn)) {
                    /* one fragment: issued, waited for, promoted and its slot freed */
                    emu_wgmma(m, h, slot, part[h][0], 1, cols);
                    emu_promote(m, h, acc[h], part[h][0], slot,
                                m->w_scale[epd_wgmma_w_scale_at(e, m->n, fb, m->ld, kb0) + cs[h]],
                                cols);
                } else {
                    /* issued into the stage's fragment (two in turn); the previous stage, done
                     * now (wait_group 1), promoted and its slot freed */
                    emu_wgmma(m, h, slot, part[h][cs[h] & 1], 1, cols);
                    if (has_pending[h])
                        emu_promote(m, h, acc[h], part[h][(cs[h] - 1) & 1], pending[h],
                                    m->w_scale[epd_wgmma_w_scale_at(e, m->n, fb, m->ld, kb0) +
                                               cs[h] - 1],
                                    cols);
                    pending[h] = slot;
                    has_pending[h] = 1;
                }
                cs[h]++;
                moved = 1;
                continue;
            }
            if (has_pending[h] && m->fp8) {
                emu_promote(m, h, acc[h], part[h][(cs[h] - 1) & 1], pending[h],
                            m->w_scale[epd_wgmma_w_scale_at(e, m->n, fb, m->ld, kb0) + cs[h] - 1],
                            cols);
                has_pending[h] = 0;
            } else if (has_pending[h]) {
                emu_wgmma(m, h, pending[h], acc[h], 0, cols);
                for (uint32_t t = 0; m->fault != EMU_FAULT_EARLY_RELEASE && t < WG; t++)
                    bar_arrive(&m->empty[pending[h]]);
                has_pending[h] = 0;
            }
            done[h] = 1;
            moved = 1;
        }
        if (done[0] && done[1]) break;
        if (!moved) {
            snprintf(m->why, sizeof m->why,
                     "the ring hangs: producer at stage %u, consumers at %u and %u of %u", ps,
                     cs[0], cs[1], n_kb);
            m->failed = 1;
        }
    }
    if (m->failed) return;

    /* the epilogue, as the kernel writes it */
    const uint32_t np = m->n;
    if (EPD_WGMMA_EPI(bn) != 0 && m->splits == 1 && (fused || m->out_bf16)) {
        emu_staged(m, acc, fb, rb + row0, cols, fused);
        return;
    }
    if (fused) {
        /* registers 4q, 4q + 1 (gate) with 4q + 2, 4q + 3 (up) of the same thread */
        for (uint32_t h = 0; h < 2; h++)
            for (uint32_t warp = 0; warp < 4; warp++)
                for (uint32_t lane = 0; lane < 32; lane++)
                    for (uint32_t j = 0; j < regs; j++) {
                        if ((j / 2) % 2 != 0) continue;
                        uint32_t fm, fn, um, un;
                        epd_wgmma_acc_pos(warp, lane, j, &fm, &fn);
                        epd_wgmma_acc_pos(warp, lane, j + 2, &um, &un);
                        if (um != fm + 8 || un != fn) emu_fail(m, "gate and up apart");
                        if (fn >= cols) continue;
                        const uint32_t r = row0 + fn;
                        const uint32_t f = epd_wgmma_fused_feature(fb, h * 64 + fm);
                        const double *a = acc[h] + (warp * 32 + lane) * regs;
                        const double g = a[j], u = a[j + 2];
                        const size_t i = (size_t)(rb + r) * (np / 2) + f;
                        if (f >= np / 2 || i >= m->outs) {
                            emu_fail(m, "an h write past its row or h");
                            return;
                        }
                        m->h[i] = g / (1.0 + exp(-g)) * u;
                        m->written[i]++;
                    }
        return;
    }
    for (uint32_t h = 0; h < 2; h++) {
        const size_t f0 = epd_wgmma_feature(fb, h);
        for (uint32_t warp = 0; warp < 4; warp++)
            for (uint32_t lane = 0; lane < 32; lane++)
                for (uint32_t j = 0; j < regs; j++) {
                    uint32_t fm, fn;
                    epd_wgmma_acc_pos(warp, lane, j, &fm, &fn);
                    if (fn >= cols) continue;
                    const uint32_t r = row0 + fn;
                    const size_t i = (size_t)(rb + r) * np + f0 + fm;
                    if (f0 + fm >= np || i >= m->outs) {
                        emu_fail(m, "a D write past its row or D");
                        return;
                    }
                    const double v = acc[h][(warp * 32 + lane) * regs + j];
                    const size_t stride = (size_t)m->total * np;
                    if (m->splits > 1) {
                        m->part[(size_t)z * stride + i] = v;
                        m->written[(size_t)z * stride + i]++;
                    } else {
                        m->d[i] = v;
                        m->written[i]++;
                    }
                }
    }
}

/* small integers, BF16 or e4m3 (exact in both) */
static uint8_t *fill_elems(int fp8, size_t count, uint32_t seed)
{
    const size_t es = fp8 ? 1 : 2;
    uint8_t *p = malloc(count * es);
    for (size_t i = 0; i < count; i++) {
        uint32_t h = (uint32_t)(i * 2654435761u) ^ seed;
        h ^= h >> 13;
        h *= 0x5bd1e995u;
        h ^= h >> 15;
        float v = (float)((int)(h % 9u) - 4);
        if (fp8) {
            p[i] = epd_e4m3_from_f32(v);
        } else {
            uint16_t b = epd_f32_to_bf16(v);
            p[2 * i] = (uint8_t)b;
            p[2 * i + 1] = (uint8_t)(b >> 8);
        }
    }
    return p;
}

/* Emulates the launch over experts with counts[e] rows (rows padded to 16), N n, K k, row tile bn,
 * splits K ranges (1: none; any count, empty ranges too), SwiGLU fused (BF16); compares D (or h)
 * of every row below the counts with a direct sum, and checks that each written element is
 * written once per K range, within the rows the kernel writes. Returns 0, or 1 with *why. */
static int emulate_launch_f(int fp8, int fused, int out_bf16, uint32_t n, uint32_t k,
                            const uint32_t *counts, uint32_t n_exp, uint32_t bn, uint32_t splits,
                            int fault, char *why, size_t why_len)
{
    emu_t m;
    memset(&m, 0, sizeof m);
    m.fault = fault;
    m.fp8 = fp8;
    m.fused = fused;
    m.out_bf16 = out_bf16;
    m.n = n;
    m.k = k;
    m.n_exp = n_exp;
    m.bn = bn;
    m.splits = splits;
    m.counts = counts;
    for (uint32_t e = 0; e < n_exp; e++) {
        m.row_base[e + 1] = m.row_base[e] + (counts[e] + 15) / 16 * 16;
        m.tile_base[e + 1] = m.tile_base[e] + (counts[e] + bn - 1) / bn;
    }
    m.total = m.row_base[n_exp];
    m.n_tiles = m.tile_base[n_exp];
    const uint32_t kb = k / 128, es = fp8 ? 1 : 2;
    m.ld = (kb + 3) / 4 * 4;
    m.w = fill_elems(fp8, (size_t)n_exp * n * k, 0x1234u + bn);
    m.x = fill_elems(fp8, (size_t)(m.total ? m.total : 1) * k, 0x9876u + splits);
    if (fp8) {
        m.w_scale = malloc((size_t)n_exp * (n / 128) * m.ld * sizeof(float));
        for (size_t i = 0; i < (size_t)n_exp * (n / 128) * m.ld; i++)
            m.w_scale[i] = ldexpf(1.0f, (int)(i % 5) - 2);
        m.x_scale_len = (m.total ? m.total : 1) * kb;
        m.x_scale = malloc((size_t)m.x_scale_len * sizeof(float));
        for (size_t i = 0; i < m.x_scale_len; i++) m.x_scale[i] = ldexpf(1.0f, (int)(i % 7) - 3);
    }
    const size_t outs = (size_t)(m.total ? m.total : 1) * (fused ? n / 2 : n);
    m.outs = outs;
    m.d = calloc(outs, sizeof(double));
    m.h = calloc(outs, sizeof(double));
    m.part = calloc(outs * (splits > 1 ? splits : 1), sizeof(double));
    m.written = calloc(outs * (splits > 1 ? splits : 1), 1);
    m.smem_len = EPD_WGMMA_SMEM(bn) + EPD_WGMMA_EPI(bn);
    m.smem = malloc(m.smem_len);
    if (m.smem_len > EPD_WGMMA_SMEM_OPTIN) emu_fail(&m, "the shared memory above 227 KB");

    const uint32_t fbs = n / EPD_WGMMA_FEATURES;
    for (uint32_t z = 0; z < splits && !m.failed; z++)
        for (uint32_t y = 0; y < m.n_tiles && !m.failed; y++)
            for (uint32_t fb = 0; fb < fbs && !m.failed; fb++) emu_cta(&m, fb, y, z);

    /* split-K's reduce: the rows the kernel writes, the K ranges' sums in range order */
    for (uint32_t e = 0; e < n_exp && !m.failed && splits > 1 && !fused; e++) {
        const uint32_t mpad = m.row_base[e + 1] - m.row_base[e];
        const uint32_t w =
            epd_ffn_gemm_written_rows(counts[e], mpad, m.tile_base[e + 1] - m.tile_base[e], bn);
        for (size_t i = (size_t)m.row_base[e] * n; i < ((size_t)m.row_base[e] + w) * n; i++) {
            double s = 0;
            for (uint32_t z = 0; z < splits; z++) {
                if (m.written[(size_t)z * outs + i] != 1)
                    emu_fail(&m, "the reduce reads a partial sum not written once");
                s += m.part[(size_t)z * outs + i];
            }
            m.d[i] = s;
        }
    }
    /* every element: written once within the written rows, none after; the sums right */
    for (uint32_t e = 0; e < n_exp && !m.failed; e++) {
        const uint32_t mpad = m.row_base[e + 1] - m.row_base[e];
        const uint32_t w =
            epd_ffn_gemm_written_rows(counts[e], mpad, m.tile_base[e + 1] - m.tile_base[e], bn);
        const uint32_t nf = fused ? n / 2 : n;
        for (uint32_t r = 0; r < mpad && !m.failed; r++)
            for (uint32_t f = 0; f < nf && !m.failed; f++) {
                const size_t row = m.row_base[e] + r, i = row * nf + f;
                for (uint32_t z = 0; z < (splits > 1 && !fused ? splits : 1); z++)
                    if (m.written[(size_t)z * outs + i] != (r < w ? 1 : 0)) {
                        snprintf(m.why, sizeof m.why,
                                 "expert %u row %u feature %u (K range %u) written %u times", e, r,
                                 f, z, m.written[(size_t)z * outs + i]);
                        m.failed = 1;
                    }
                if (r >= counts[e] || m.failed) continue;
                double want = 0, up = 0;
                for (uint32_t c = 0; c < k; c++) {
                    const double xv = elem(&m, m.x + (row * k + c) * es);
                    /* the requant's layout: row_base * K / 128, then [K block][mpad] */
                    const double sc =
                        fp8 ? m.x_scale[(size_t)m.row_base[e] * kb + (size_t)(c / 128) * mpad + r] *
                                  m.w_scale[((size_t)e * (n / 128) + f / 128) * m.ld + c / 128]
                            : 1.0;
                    want += elem(&m, m.w + (((size_t)e * n + f) * k + c) * es) * xv * sc;
                    if (fused)
                        up += elem(&m, m.w + (((size_t)e * n + n / 2 + f) * k + c) * es) * xv;
                }
                const double got = fused ? m.h[i] : m.d[i];
                if (fused) want = want / (1.0 + exp(-want)) * up;
                if (!(fabs(got - want) <= (fused ? 1e-6 * fabs(want) : 0.0))) {
                    snprintf(m.why, sizeof m.why,
                             "expert %u row %u feature %u = %.9g, want %.9g (row tile %u)", e, r, f,
                             got, want, r / bn);
                    m.failed = 1;
                }
            }
    }
    if (m.failed) snprintf(why, why_len, "%s", m.why);
    free(m.w);
    free(m.x);
    free(m.w_scale);
    free(m.x_scale);
    free(m.d);
    free(m.h);
    free(m.part);
    free(m.written);
    free(m.smem);
    return m.failed;
}

/* D in BF16 (as the daemon's default writes the experts' outputs): the staged epilogue where
 * it fits */
static int emulate_launch(int fp8, int fused, uint32_t n, uint32_t k, const uint32_t *counts,
                          uint32_t n_exp, uint32_t bn, uint32_t splits, char *why, size_t why_len)
{
    return emulate_launch_f(fp8, fused, 1, n, k, counts, n_exp, bn, splits, EMU_FAULT_NONE, why,
                            why_len);
}

/* One launch a row tile, BF16 and FP8: K long enough that the ring wraps (more stages than
 * slots, twice for most tiles), experts of 0, 1, 33 and 9 rows (empty, within a tile, across two
 * of 32, the last tile's activation box past the tensor's end); split-K at 3 ranges; SwiGLU
 * fused; two feature blocks; a K range with no stage. */
static void test_ffn_gemm_wgmma_layout__launch__emulated_sums_right(void **state)
{
    (void)state;
    static const uint32_t counts[] = {0, 1, 33, 9};
    char why[200] = "";
    for (uint32_t i = 0; i < EPD_WGMMA_TILES; i++) {
        const uint32_t bn = epd_wgmma_tile_at(i);
        for (int fp8 = 0; fp8 < 2; fp8++) {
            if (i >= epd_wgmma_tile_count(fp8)) continue;
            const uint32_t k = fp8 ? 1408 : 768; /* 11, 12 stages: more than the slots */
            for (uint32_t splits = 1; splits <= 3; splits += 2) {
                int bad = emulate_launch(fp8, 0, 128, k, counts, 4, bn, splits, why, sizeof why);
                if (bad)
                    fail_msg("%s, row tile %u, split %u: %s", fp8 ? "FP8" : "BF16", bn, splits,
                             why);
            }
            /* fp32 D: the registers' epilogue at every tile */
            if (emulate_launch_f(fp8, 0, 0, 128, k, counts, 4, bn, 1, EMU_FAULT_NONE, why,
                                 sizeof why))
                fail_msg("%s, fp32 D, row tile %u: %s", fp8 ? "FP8" : "BF16", bn, why);
            if (!fp8 && emulate_launch(0, 1, 128, k, counts, 4, bn, 1, why, sizeof why))
                fail_msg("BF16 SwiGLU fused, row tile %u: %s", bn, why);
        }
    }
    for (int fp8 = 0; fp8 < 2; fp8++) {
        if (emulate_launch(fp8, 0, 256, 384, counts, 4, 64, 1, why, sizeof why))
            fail_msg("%s, N 256: %s", fp8 ? "FP8" : "BF16", why);
        /* K 128: BF16 2 stages, FP8 1, in 3 ranges: one (FP8: two) with none */
        if (emulate_launch(fp8, 0, 128, 128, counts, 4, 32, 3, why, sizeof why))
            fail_msg("%s, a K range with no stage: %s", fp8 ? "FP8" : "BF16", why);
    }
    for (uint32_t n = 256; n <= 512; n *= 2) /* two and four feature blocks */
        if (emulate_launch(0, 1, n, 384, counts, 4, 96, 1, why, sizeof why))
            fail_msg("BF16 SwiGLU fused, N %u: %s", n, why);
    /* experts of several tiles with their rows shared unevenly (140 rows in tiles of 32: four
     * of 32 and one of 12; of 64: 48, 48, 44; 70 in tiles of 32: 32, 32, 6) */
    static const uint32_t many[] = {140, 70, 0, 17};
    for (uint32_t bn = 32; bn <= 64; bn += 32)
        for (int fp8 = 0; fp8 < 2; fp8++)
            if (emulate_launch(fp8, 0, 128, fp8 ? 768 : 384, many, 4, bn, 1, why, sizeof why))
                fail_msg("%s, rows 140/70/0/17, row tile %u: %s", fp8 ? "FP8" : "BF16", bn, why);
}

/* the emulation catches a wrong byte count (a hang, or more bytes than expected) and a slot
 * refilled while its wgmmas may still read it */
static void test_ffn_gemm_wgmma_layout__launch__emulation_catches_faults(void **state)
{
    (void)state;
    static const uint32_t counts[] = {0, 1, 33, 9};
    char why[200] = "";
    assert_int_equal(emulate_launch_f(0, 0, 1, 128, 1408, counts, 4, 64, 1, EMU_FAULT_TX_LONG, why,
                                      sizeof why),
                     1);
    assert_non_null(strstr(why, "hangs"));
    assert_int_equal(emulate_launch_f(1, 0, 1, 128, 1408, counts, 4, 64, 1, EMU_FAULT_TX_SHORT, why,
                                      sizeof why),
                     1);
    assert_non_null(strstr(why, "more bytes"));
    assert_int_equal(emulate_launch_f(0, 0, 1, 128, 1408, counts, 4, 64, 1,
                                      EMU_FAULT_EARLY_RELEASE, why, sizeof why),
                     1);
    assert_non_null(strstr(why, "want"));
    /* the staged epilogue (row tile 96) with rows 128 bytes apart: D and h */
    for (int fused = 0; fused < 2; fused++) {
        assert_int_equal(emulate_launch_f(0, fused, 1, 128, 768, counts, 4, 96, 1,
                                          EMU_FAULT_EPI_ROW128, why, sizeof why),
                         1);
        assert_non_null(strstr(why, "one bank"));
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
        cmocka_unit_test(test_ffn_gemm_wgmma_layout__tile_rows__cover_each_row_once),
        cmocka_unit_test(test_ffn_gemm_wgmma_layout__launch__emulated_sums_right),
        cmocka_unit_test(test_ffn_gemm_wgmma_layout__launch__emulation_catches_faults),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
