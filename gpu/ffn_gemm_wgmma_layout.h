/* The shared-memory layout of the Hopper ffn GEMM kernel (gpu/ffn_gemm_wgmma.cu): where the TMA's
 * 128-byte swizzle puts a byte of a stage tile, the wgmma matrix descriptor of a K-major operand
 * in such a tile, the accumulator fragment, the row tile a launch takes, and (for
 * tests/unit/test_ffn_gemm_wgmma_layout.c) the address the tensor cores read for an (m or n, k)
 * element through a descriptor, as the PTX ISA defines it. Plain C, host and device. */
#ifndef EPD_GPU_FFN_GEMM_WGMMA_LAYOUT_H
#define EPD_GPU_FFN_GEMM_WGMMA_LAYOUT_H

#include <stdint.h>

#ifdef __CUDACC__
#define EPD_WGMMA_HD __host__ __device__
#else
#define EPD_WGMMA_HD
#endif

/* a stage tile is [rows][128 bytes of K] (64 BF16 or 128 e4m3), rows in swizzle atoms of 8 rows
 * (1024 bytes); a tile starts 1024-byte aligned */
#define EPD_WGMMA_ROW_BYTES 128u
#define EPD_WGMMA_ATOM_BYTES 1024u
/* the K bytes of one wgmma: k16 BF16 or k32 e4m3, 4 of them a stage */
#define EPD_WGMMA_K_BYTES 32u
/* the descriptor's swizzle mode field (bits 62-63): 1 is the 128-byte swizzle */
#define EPD_WGMMA_SWIZZLE_128B 1u

/* Byte offset in a stage tile of byte b (0..127) of row r as the TMA writes it with
 * CU_TENSOR_MAP_SWIZZLE_128B and a box 128 bytes wide: the 16-byte chunk b / 16 of row r goes to
 * chunk (b / 16) ^ (r % 8) of that row. */
EPD_WGMMA_HD static inline uint32_t epd_wgmma_tile_off(uint32_t r, uint32_t b)
{
    return r * EPD_WGMMA_ROW_BYTES + ((((b >> 4) ^ (r & 7u)) << 4) | (b & 15u));
}

/* The wgmma matrix descriptor of a K-major operand whose rows (M of A, N of B) lie 128 bytes
 * apart in 128-byte-swizzled atoms of 8 rows, the first of its K bytes at shared address addr
 * (the tile's start plus the wgmma's K offset, 32 bytes a step): start address (addr >> 4) in
 * bits 0-13, leading byte offset (unused with this swizzle for K-major: 16 bytes, encoded 1) in
 * 16-29, stride byte offset (8-row atom to the next: 1024 bytes) in 32-45, base offset 0 (the
 * tile 1024-byte aligned) in 49-51, swizzle mode in 62-63. */
EPD_WGMMA_HD static inline uint64_t epd_wgmma_desc(uint32_t addr)
{
    return (uint64_t)((addr & 0x3ffffu) >> 4) | ((uint64_t)(16u >> 4) << 16) |
           ((uint64_t)(EPD_WGMMA_ATOM_BYTES >> 4) << 32) |
           ((uint64_t)EPD_WGMMA_SWIZZLE_128B << 62);
}

/* The shared address the tensor cores read for row i (0 .. M or N) and K byte kb (0 .. 31) of a
 * K-major operand through descriptor desc, by the PTX ISA's canonical layouts: with the 128-byte
 * swizzle the operand is (8 rows of 128 bytes) atoms, row i % 8 of an atom 128 bytes on from its
 * start, atoms SBO apart, K bytes in order within a row; the swizzle then XORs the address's
 * bits 4-6 (the 16-byte chunk) with its bits 7-9 (the row within the 1024-byte atom). The unit
 * test's model of the hardware; 0xffffffff for a descriptor mode it does not model. */
static inline uint32_t epd_wgmma_desc_addr(uint64_t desc, uint32_t i, uint32_t kb)
{
    uint32_t start = (uint32_t)(desc & 0x3fffu) << 4;
    uint32_t sbo = (uint32_t)((desc >> 32) & 0x3fffu) << 4;
    uint32_t base_offset = (uint32_t)((desc >> 49) & 7u);
    uint32_t mode = (uint32_t)(desc >> 62);
    if (mode != EPD_WGMMA_SWIZZLE_128B || base_offset != 0) return 0xffffffffu;
    uint32_t linear = start + (i / 8u) * sbo + (i % 8u) * EPD_WGMMA_ROW_BYTES + kb;
    return linear ^ (((linear >> 7) & 7u) << 4);
}

/* The accumulator fragment of wgmma m64nNk* (fp32 D, N / 2 registers a thread): register j of
 * lane `lane` of warp `warp` (0..3) of the warpgroup holds D[*m_p][*n_p]. */
EPD_WGMMA_HD static inline void epd_wgmma_acc_pos(uint32_t warp, uint32_t lane, uint32_t j,
                                                  uint32_t *m_p, uint32_t *n_p)
{
    *m_p = warp * 16u + lane / 4u + 8u * ((j / 2u) % 2u);
    *n_p = (j / 4u) * 8u + (lane % 4u) * 2u + (j % 2u);
}

/* the row tiles of the kernel (the wgmma's N: the expert's rows one CTA computes): 32, 64, 96,
 * 128, 160, 192, 256 (tile i, epd_wgmma_tile_at); FP8 keeps a second fp32 fragment for the block
 * scales' promotion, so at most 128 there (its first 4) */
#define EPD_WGMMA_TILE_MIN 32u
#define EPD_WGMMA_TILE_MAX 256u
#define EPD_WGMMA_TILE_MAX_FP8 128u
#define EPD_WGMMA_TILES 7u
#define EPD_WGMMA_TILES_FP8 4u

/* tile i of EPD_WGMMA_TILES, ascending */
EPD_WGMMA_HD static inline uint32_t epd_wgmma_tile_at(uint32_t i)
{
    return i < 6u ? 32u * (i + 1u) : EPD_WGMMA_TILE_MAX;
}

/* the tiles of a format */
EPD_WGMMA_HD static inline uint32_t epd_wgmma_tile_count(int fp8)
{
    return fp8 ? EPD_WGMMA_TILES_FP8 : EPD_WGMMA_TILES;
}

/* the index of tile t, EPD_WGMMA_TILES when t is none of them */
EPD_WGMMA_HD static inline uint32_t epd_wgmma_tile_index(uint32_t t)
{
    for (uint32_t i = 0; i < EPD_WGMMA_TILES; i++)
        if (epd_wgmma_tile_at(i) == t) return i;
    return EPD_WGMMA_TILES;
}
/* a tile's fixed cost in rows: its weights read again (from L2 mostly) and its pipeline's fill */
#define EPD_WGMMA_TILE_COST 48u

/* The row tile for a launch over n experts with counts[e] rows: 32 when no expert has more, else
 * the tile above 32 (FP8: up to 128) with the least sum over the experts of their tiles times
 * (tile + EPD_WGMMA_TILE_COST) (rows computed in vain against tiles), ties to the larger tile. */
EPD_WGMMA_HD static inline uint32_t epd_wgmma_pick_row_tile(int fp8, const uint32_t *counts,
                                                          uint32_t n)
{
    uint32_t max_rows = 0, best = 0;
    uint64_t best_cost = 0;
    for (uint32_t e = 0; e < n; e++)
        if (counts[e] > max_rows) max_rows = counts[e];
    if (max_rows <= EPD_WGMMA_TILE_MIN) return EPD_WGMMA_TILE_MIN;
    for (uint32_t i = epd_wgmma_tile_count(fp8); i-- > 1;) {
        const uint32_t t = epd_wgmma_tile_at(i);
        uint64_t cost = 0;
        for (uint32_t e = 0; e < n; e++)
            cost += (uint64_t)((counts[e] + t - 1u) / t) * (t + EPD_WGMMA_TILE_COST);
        if (best == 0 || cost < best_cost) {
            best = t;
            best_cost = cost;
        }
    }
    return best;
}

#endif
