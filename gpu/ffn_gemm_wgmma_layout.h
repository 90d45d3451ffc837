/* The shared-memory layout of the Hopper ffn GEMM kernel (gpu/ffn_gemm_wgmma.cu): where the TMA's
 * 128-byte swizzle puts a byte of a stage tile, the wgmma matrix descriptor of a K-major operand
 * in such a tile, the accumulator fragment, the pipeline's shared memory, ring and byte counts,
 * the features and FP8 scales a CTA reads, the row tile a launch takes, and (for
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

/* The descriptor of wgmma step kk (0 .. 3) of a stage tile at shared address tile (1024-aligned):
 * the tile's start advanced by the step's K bytes (32 a step, within the first 128-byte row of
 * the swizzle atom, the base offset staying 0: the tensor cores swizzle the address they form,
 * so the advanced start reads the step's 16-byte chunks of each row wherever the TMA put them). */
EPD_WGMMA_HD static inline uint64_t epd_wgmma_desc_step(uint32_t tile, uint32_t kk)
{
    return epd_wgmma_desc(tile + kk * EPD_WGMMA_K_BYTES);
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

/* The pipeline of a row tile of bn rows (the kernel's tile_cfg): a stage is a weight tile (the
 * CTA's 128 features), an activation tile (bn rows) and bn fp32 FP8 activation scales; as many
 * stages as the 227 KB a CTA may opt into hold beside 2 KB (the alignment slack, the mbarriers),
 * at most 10; the shared memory asked for is the 1024 bytes of slack to align the tiles, the
 * stages and 2 mbarriers a stage (full, empty). */
#define EPD_WGMMA_FEATURES 128u
#define EPD_WGMMA_W_TILE (EPD_WGMMA_FEATURES * EPD_WGMMA_ROW_BYTES)
#define EPD_WGMMA_SMEM_OPTIN 232448u
#define EPD_WGMMA_MAX_STAGES 10u
#define EPD_WGMMA_STAGE_SET(bn) (EPD_WGMMA_W_TILE + (bn) * EPD_WGMMA_ROW_BYTES + (bn) * 4u)
#define EPD_WGMMA_FIT(bn) ((EPD_WGMMA_SMEM_OPTIN - 2048u) / EPD_WGMMA_STAGE_SET(bn))
#define EPD_WGMMA_STAGES(bn)                                                                    \
    (EPD_WGMMA_FIT(bn) > EPD_WGMMA_MAX_STAGES ? EPD_WGMMA_MAX_STAGES : EPD_WGMMA_FIT(bn))
#define EPD_WGMMA_SMEM(bn)                                                                      \
    (EPD_WGMMA_ATOM_BYTES + EPD_WGMMA_STAGES(bn) * EPD_WGMMA_STAGE_SET(bn) +                     \
     2u * EPD_WGMMA_STAGES(bn) * 8u)

/* Where the pipeline's parts lie, in bytes from the 1024-aligned base: [stages] weight tiles,
 * [stages] activation tiles, [stages][bn] fp32 scales, [stages] full then [stages] empty
 * mbarriers (8 bytes each); end: the first byte after them. */
typedef struct epd_wgmma_smem {
    uint32_t w, x, sc, full, empty, end;
} epd_wgmma_smem_t;

EPD_WGMMA_HD static inline epd_wgmma_smem_t epd_wgmma_smem_at(uint32_t bn)
{
    epd_wgmma_smem_t s;
    const uint32_t stages = EPD_WGMMA_STAGES(bn);
    s.w = 0;
    s.x = s.w + stages * EPD_WGMMA_W_TILE;
    s.sc = s.x + stages * bn * EPD_WGMMA_ROW_BYTES;
    s.full = s.sc + stages * bn * 4u;
    s.empty = s.full + stages * 8u;
    s.end = s.empty + stages * 8u;
    return s;
}

/* The staged epilogue (gpu/ffn_gemm_wgmma.cu, wg_store_staged): each consumer half's BF16 values
 * as [row][value] in a buffer after the ring's mbarriers (its start epd_wgmma_smem_t.end rounded
 * up to 16), rows EPD_WGMMA_EPI_ROW bytes apart: 64 values and 8 bytes, so that the 4 rows one
 * st.shared of a warp reaches fall in distinct banks (rows 34 words apart: 8 banks between the
 * rows 2 apart). Only the row tiles where 2 x bn such rows fit beside the pipeline within the
 * opt-in have it: EPD_WGMMA_EPI(bn) bytes (16 of them the alignment's), 0 where they do not. */
#define EPD_WGMMA_EPI_ROW 136u
#define EPD_WGMMA_EPI_WANT(bn) (2u * (bn) * EPD_WGMMA_EPI_ROW + 16u)
#define EPD_WGMMA_EPI(bn)                                                                       \
    (EPD_WGMMA_SMEM(bn) + EPD_WGMMA_EPI_WANT(bn) <= EPD_WGMMA_SMEM_OPTIN ? EPD_WGMMA_EPI_WANT(bn) \
                                                                          : 0u)

/* The buffer's column of the value of accumulator tile row m (0 .. 63 of a half): D's feature m,
 * or with SwiGLU fused h's feature (m / 16) * 8 + m % 8 of the half's 32 (m a gate row:
 * epd_wgmma_fused_feature); and the byte of (row n, column c) of half h from the buffer's start */
EPD_WGMMA_HD static inline uint32_t epd_wgmma_epi_col(int fused, uint32_t m)
{
    return fused ? (m / 16u) * 8u + m % 8u : m;
}

EPD_WGMMA_HD static inline uint32_t epd_wgmma_epi_at(uint32_t bn, uint32_t h, uint32_t n,
                                                     uint32_t c)
{
    return h * bn * EPD_WGMMA_EPI_ROW + n * EPD_WGMMA_EPI_ROW + c * 2u;
}

/* The read-back's 8-byte chunks (4 values), consecutive along a row: log2 of a row's chunks (16
 * of D's 64 values, 8 of h's 32) */
EPD_WGMMA_HD static inline uint32_t epd_wgmma_epi_shift(int fused)
{
    return fused ? 3u : 4u;
}

/* Stage s of the ring of `stages` slots: its slot, the parity of the slot's full-mbarrier phase
 * the consumers wait for, and that of its empty-mbarrier phase the producer waits for before
 * refilling it (the other one: a fresh mbarrier's phase of parity 1 counts as complete, so the
 * ring's first round does not wait). The empty mbarriers count EPD_WGMMA_CONSUMERS arrivals a
 * phase (each consumer thread once a stage), the full ones 1 (the producer's expect_tx). */
#define EPD_WGMMA_CONSUMERS 256u
EPD_WGMMA_HD static inline void epd_wgmma_ring(uint32_t s, uint32_t stages, uint32_t *slot_p,
                                               uint32_t *full_parity_p, uint32_t *empty_parity_p)
{
    *slot_p = s % stages;
    *full_parity_p = (s / stages) & 1u;
    *empty_parity_p = *full_parity_p ^ 1u;
}

/* A stage's activation rows of a work item of n rows (a multiple of 16) come in boxes of
 * EPD_WGMMA_X_BIG rows, then at most one of EPD_WGMMA_X_MID and one of EPD_WGMMA_X_BOX for the
 * rest (three tensor maps: at most 2 + n / 64 copies a stage). epd_wgmma_x_boxes: how many;
 * epd_wgmma_x_box: box i's first row (from the item's first) and rows. */
#define EPD_WGMMA_X_BOX 16u
#define EPD_WGMMA_X_MID 32u
#define EPD_WGMMA_X_BIG 64u
EPD_WGMMA_HD static inline uint32_t epd_wgmma_x_boxes(uint32_t n)
{
    return n / EPD_WGMMA_X_BIG + (n % EPD_WGMMA_X_BIG) / EPD_WGMMA_X_MID +
           (n % EPD_WGMMA_X_MID) / EPD_WGMMA_X_BOX;
}

EPD_WGMMA_HD static inline void epd_wgmma_x_box(uint32_t n, uint32_t i, uint32_t *row_p,
                                                uint32_t *rows_p)
{
    const uint32_t big = n / EPD_WGMMA_X_BIG, mid = (n % EPD_WGMMA_X_BIG) / EPD_WGMMA_X_MID;
    if (i < big) {
        *row_p = i * EPD_WGMMA_X_BIG;
        *rows_p = EPD_WGMMA_X_BIG;
    } else if (i < big + mid) {
        *row_p = big * EPD_WGMMA_X_BIG;
        *rows_p = EPD_WGMMA_X_MID;
    } else {
        *row_p = n - EPD_WGMMA_X_BOX;
        *rows_p = EPD_WGMMA_X_BOX;
    }
}

/* The bytes a stage's copies bring (its full mbarrier's expect_tx) for a work item of n rows (its
 * rows rounded up to 16, epd_wgmma_item_n): the weight box and n activation rows (the boxes
 * of epd_wgmma_x_box, within the expert's padded rows), FP8 the n rows' activation scales. */
EPD_WGMMA_HD static inline uint32_t epd_wgmma_stage_bytes(int fp8, uint32_t n)
{
    return EPD_WGMMA_W_TILE + n * EPD_WGMMA_ROW_BYTES + (fp8 ? n * 4u : 0u);
}

/* Row tile rt of an expert of c rows in tiles of at most bn rows (bn a multiple of 16): the tiles
 * share the rows evenly, each but the last `chunk` rows (ceil(c / tiles) rounded up to 16, at
 * most bn), the last the rest. Its rows are [*row0_p, *row0_p + *rows_p) (0 rows: a tile past
 * the count). The tiles are always ceil(c / bn). */
EPD_WGMMA_HD static inline void epd_wgmma_tile_rows(uint32_t c, uint32_t bn, uint32_t rt,
                                                    uint32_t *row0_p, uint32_t *rows_p)
{
    const uint32_t tiles = (c + bn - 1u) / bn;
    const uint32_t chunk = tiles == 0 ? 0 : ((c + tiles - 1u) / tiles + 15u) / 16u * 16u;
    const uint32_t r0 = rt * chunk;
    *row0_p = r0;
    *rows_p = r0 < c ? (c - r0 < chunk ? c - r0 : chunk) : 0u;
}

/* The rows a work item of `rows` rows computes (the wgmma's N: rounded up to 16) and writes (the
 * rows rounded up to 8: the expert's padding rows up to that are written too) */
EPD_WGMMA_HD static inline uint32_t epd_wgmma_item_n(uint32_t rows)
{
    return (rows + 15u) / 16u * 16u;
}

EPD_WGMMA_HD static inline uint32_t epd_wgmma_item_written(uint32_t rows)
{
    return (rows + 7u) / 8u * 8u;
}

/* The feature (row of the expert's [n][k] weights, and D's column) of row 0 of consumer half
 * `half` (0, 1: 64 rows each) of feature block fb: the block's 128 features. */
EPD_WGMMA_HD static inline uint32_t epd_wgmma_feature(uint32_t fb, uint32_t half)
{
    return fb * EPD_WGMMA_FEATURES + half * 64u;
}

/* With SwiGLU fused (BF16 gate/up: the expert's weights [n][k] are the n / 2 gate features, then
 * their n / 2 up features), feature block fb is h's features fb * 64 .. + 64, and its 128 weight
 * rows interleave gate and up in groups of 8: tile row m (0 .. 127) is the gate (m / 8 even) or
 * the up (odd) row of h feature fb * 64 + (m / 16) * 8 + m % 8. So a consumer thread's
 * accumulators 4q, 4q + 1 (tile row m, epd_wgmma_acc_pos) and 4q + 2, 4q + 3 (row m + 8) are the
 * gate and up sums of one feature and the same two rows: SwiGLU in registers. The TMA brings the
 * block's 128 rows as one box of a 5-d view of the weights (k, 8 rows, gate/up, groups of 8,
 * experts): epd_wgmma_fused_group is the box's group coordinate. */
EPD_WGMMA_HD static inline uint32_t epd_wgmma_fused_row(uint32_t n, uint32_t fb, uint32_t m)
{
    return ((m / 8u) % 2u) * (n / 2u) + fb * 64u + (m / 16u) * 8u + m % 8u;
}

EPD_WGMMA_HD static inline uint32_t epd_wgmma_fused_feature(uint32_t fb, uint32_t m)
{
    return fb * 64u + (m / 16u) * 8u + m % 8u;
}

EPD_WGMMA_HD static inline uint32_t epd_wgmma_fused_group(uint32_t fb)
{
    return fb * 8u;
}

/* FP8: the index in x_scale (per expert [k / 128][mpad] fp32 from row_base * k / 128, the
 * requant's layout) of the first of K block kb's scales of the rows from row0 of the expert
 * whose rows start at rb, and the index in w_scale ([n_experts][n / 128][ld]) of expert e's
 * feature block fb at K block kb. */
EPD_WGMMA_HD static inline uint64_t epd_wgmma_x_scale_at(uint32_t rb, uint32_t k, uint32_t mpad,
                                                         uint32_t row0, uint32_t kb)
{
    return (uint64_t)rb * (k / 128u) + (uint64_t)kb * mpad + row0;
}

EPD_WGMMA_HD static inline uint64_t epd_wgmma_w_scale_at(uint32_t e, uint32_t n, uint32_t fb,
                                                         uint32_t ld, uint32_t kb)
{
    return ((uint64_t)e * (n / 128u) + fb) * ld + kb;
}

/* the row tiles of the kernel (the wgmma's N: the expert's rows one CTA computes): 32, 64, 96,
 * 128, 160, 192, 256 (tile i, epd_wgmma_tile_at); FP8 keeps fp32 fragments for the block scales'
 * promotion besides its sums, so at most 192 there (its first 6) */
#define EPD_WGMMA_TILE_MIN 32u
#define EPD_WGMMA_TILE_MAX 256u
#define EPD_WGMMA_TILE_MAX_FP8 192u
#define EPD_WGMMA_TILES 7u
#define EPD_WGMMA_TILES_FP8 6u

/* FP8: whether a row tile's consumers keep two fragments (stage s + 1's wgmmas in flight while
 * stage s is promoted: 3 x bn / 2 registers a thread, up to 128 rows) or one (each stage promoted
 * as soon as its wgmmas are done: bn registers, the tiles above 128) */
#define EPD_WGMMA_FP8_DOUBLE(bn) ((bn) <= 128u)

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
 * the tile above 32 (FP8: up to 192) with the least sum over the experts of the rows their work
 * items compute (epd_wgmma_tile_rows, each rounded up to 16) plus EPD_WGMMA_TILE_COST a tile,
 * ties to the smaller tile (its ring has more stages: tile_cfg). */
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
        for (uint32_t e = 0; e < n; e++) {
            const uint32_t tiles = (counts[e] + t - 1u) / t;
            for (uint32_t rt = 0; rt < tiles; rt++) {
                uint32_t row0, rows;
                epd_wgmma_tile_rows(counts[e], t, rt, &row0, &rows);
                cost += epd_wgmma_item_n(rows) + EPD_WGMMA_TILE_COST;
            }
        }
        if (best == 0 || cost <= best_cost) {
            best = t;
            best_cost = cost;
        }
    }
    return best;
}

#endif
