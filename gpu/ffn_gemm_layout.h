/* The index arithmetic of the ffn GEMM kernel (gpu/ffn_gemm.cu) that is not the PTX ISA's: where
 * a 16-byte chunk of a stage's row lies in shared memory, which rows and features each warp owns,
 * how K is split over the grid's z and when it is. Plain C, host and device, so that
 * tests/unit/test_ffn_gemm_layout.c checks it on the CPU (bijective, conflict-free, covering). */
#ifndef EPD_GPU_FFN_GEMM_LAYOUT_H
#define EPD_GPU_FFN_GEMM_LAYOUT_H

#include <stdint.h>

#ifdef __CUDACC__
#define EPD_FFN_HD __host__ __device__
#else
#define EPD_FFN_HD
#endif

/* K bytes of one pipeline stage: a row of a stage is 8 chunks of 16 bytes */
#define EPD_FFN_GEMM_STAGE_BYTES 128u
/* the CTA: 8 warps, warp w owns features (w % 4) * 32 .. + 32 of the CTA's 128 and rows
 * (w / 4) * 32 .. + 32 of its row tile (two m16 tiles by up to four n8 tiles) */
#define EPD_FFN_GEMM_WARPS 8u
#define EPD_FFN_GEMM_WARP_FEATURES 32u
#define EPD_FFN_GEMM_WARP_ROWS 32u
#define EPD_FFN_GEMM_FEATURE_GROUPS 4u
/* split-K: at most this many K ranges, each at least EPD_FFN_GEMM_SPLIT_MIN_STAGES stages (the
 * pipeline's fill is paid once per range) */
#define EPD_FFN_GEMM_MAX_SPLIT 8u
#define EPD_FFN_GEMM_SPLIT_MIN_STAGES 8u

/* Byte offset in a stage tile ([rows][128 bytes]) of chunk q (0..7) of row r: odd rows have their
 * two 64-byte halves swapped, so the 8 lanes of a quarter warp (rows g, g + 1 of an even g, chunks
 * 4c + t, t 0..3) read 8 distinct 16-byte bank groups, and the 8 chunks of one row written by 8
 * lanes too. */
EPD_FFN_HD static inline uint32_t epd_ffn_gemm_tile_off(uint32_t r, uint32_t q)
{
    return r * EPD_FFN_GEMM_STAGE_BYTES + ((q ^ ((r & 1u) << 2)) << 4);
}

/* The CTA feature (weights' row in the stage tile) of lane g's A fragment rows: feature group fg,
 * m16 tile mt, half h (rows g and g + 8 of the mma) */
EPD_FFN_HD static inline uint32_t epd_ffn_gemm_a_row(uint32_t fg, uint32_t mt, uint32_t h,
                                                     uint32_t g)
{
    return fg * EPD_FFN_GEMM_WARP_FEATURES + mt * 16u + h * 8u + g;
}

/* The tile row (activations' row in the stage tile) of lane g's B fragment: row half rh, n8 tile j */
EPD_FFN_HD static inline uint32_t epd_ffn_gemm_b_row(uint32_t rh, uint32_t j, uint32_t g)
{
    return rh * EPD_FFN_GEMM_WARP_ROWS + j * 8u + g;
}

/* The n8 tiles of row half rh when the CTA computes nt of them */
EPD_FFN_HD static inline uint32_t epd_ffn_gemm_warp_nt(uint32_t nt, uint32_t rh)
{
    uint32_t first = rh * (EPD_FFN_GEMM_WARP_ROWS / 8u), per = EPD_FFN_GEMM_WARP_ROWS / 8u;
    return nt <= first ? 0u : (nt - first < per ? nt - first : per);
}

/* Split s of splits of n_kb stages: [*kb0_p, *kb1_p) (splits <= n_kb: none empty) */
EPD_FFN_HD static inline void epd_ffn_gemm_split_range(uint32_t s, uint32_t splits, uint32_t n_kb,
                                                       uint32_t *kb0_p, uint32_t *kb1_p)
{
    *kb0_p = (uint32_t)((uint64_t)s * n_kb / splits);
    *kb1_p = (uint32_t)((uint64_t)(s + 1) * n_kb / splits);
}

/* The rows of an expert that the kernel writes (the rest of its padded rows it leaves): its
 * count (at most its padded rows mpad, a multiple of 16) rounded up to 8, within its row tiles
 * (tiles of row_tile rows) */
EPD_FFN_HD static inline uint32_t epd_ffn_gemm_written_rows(uint32_t count, uint32_t mpad,
                                                            uint32_t tiles, uint32_t row_tile)
{
    uint32_t c = count < mpad ? count : mpad;
    uint32_t w = (c + 7u) / 8u * 8u;
    if (w > mpad) w = mpad;
    if ((uint64_t)tiles * row_tile < w) w = tiles * row_tile;
    return w;
}

/* Split-K for a launch of ctas CTAs (without the split) over n_kb stages on slots CTAs at a time
 * (SMs times CTAs per SM): 1 when the grid fills 4 waves or more, else the count of K ranges in
 * [2, EPD_FFN_GEMM_MAX_SPLIT] (each at least EPD_FFN_GEMM_SPLIT_MIN_STAGES stages, at most
 * max_by_ws for the workspace) with the least time in a model of waves (rounded up) times a CTA's
 * stages plus EPD_FFN_GEMM_SPLIT_FILL_STAGES for its pipeline's fill, when that is 10% below the
 * unsplit grid's (the tail of a short grid); ties to the fewest ranges. */
#define EPD_FFN_GEMM_SPLIT_FILL_STAGES 3u
static inline uint32_t epd_ffn_gemm_auto_split(uint64_t ctas, uint32_t n_kb, uint64_t slots,
                                               uint32_t max_by_ws)
{
    if (ctas == 0 || slots == 0 || ctas >= 4 * slots) return 1;
    const double fill = EPD_FFN_GEMM_SPLIT_FILL_STAGES;
    double unsplit = (double)((ctas + slots - 1) / slots) * (n_kb + fill);
    double best = unsplit;
    uint32_t pick = 1;
    for (uint32_t s = 2; s <= EPD_FFN_GEMM_MAX_SPLIT; s++) {
        if (s > max_by_ws || n_kb / s < EPD_FFN_GEMM_SPLIT_MIN_STAGES) break;
        double cost = (double)((ctas * s + slots - 1) / slots) * ((double)n_kb / s + fill);
        if (cost < 0.9 * unsplit && cost < best - 1e-9) {
            best = cost;
            pick = s;
        }
    }
    return pick;
}

#endif
