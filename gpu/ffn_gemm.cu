/* The ffn experts' GEMM kernel (gpu/ffn_gemm.h): one launch per projection over every local
 * expert with rows, for BF16 weights (mma.sync m16n8k16, fp32 accumulation) and FP8 block weights
 * (mma.sync m16n8k32 e4m3; each 64-wide half of a 128-wide K block summed in a fresh fp32
 * fragment, then folded in as acc += part * w_scale[n block][k block] * x_scale[row][k block],
 * DeepGEMM's promotion, twice a block).
 *
 * Decode sizes are weight-read bound, so the operands are swapped: the mma's M is the weights' N
 * (16 output features per mma), its N the expert's token rows (8 per mma). A CTA of 8 warps owns
 * 128 output features (one FP8 scale block) of one expert and up to EPD_FFN_GEMM_ROW_TILE of its
 * rows: warp w features (w % 4) * 32 .. + 32 (two m16 tiles) and rows (w / 4) * 32 .. + 32 (up
 * to four n8 tiles, only as many as the rows need: at 32 rows or fewer the second four warps only
 * help with the copies). The grid is (row tiles of the experts with rows, N / 128, K ranges):
 * experts without rows cost nothing, and the row tiles of one expert (reading the same weights)
 * are adjacent CTAs.
 *
 * K goes in stages of 128 bytes (64 BF16 or 128 e4m3 elements). Both operands of a stage go
 * through shared memory in an EPD_FFN_GEMM_STAGES-deep cp.async ring (the weights' 16 KB a stage,
 * so three stages, 48 KB a CTA and two CTAs an SM, are in flight while one is computed: reading
 * the weights at the memory's rate needs that many bytes in flight, not more threads); an
 * optional L2 prefetch (args.prefetch) asks for longer runs of each weight row ahead. A dot
 * product's K order is free, so within a stage the k positions are permuted the same way for
 * both operands such that each lane reads 16 contiguous bytes: lane (g = lane / 4, t = lane % 4)
 * reads bytes [c * 64 + 16 t, + 16) of its rows for the stage's two 64-byte chunks c, and uses
 * words 0, 1 of each 16 bytes as the mma's k bytes [4t, 4t + 4) and [16 + 4t, 16 + 4t + 4) of one
 * k step, words 2, 3 as those of the next (the PTX ISA's A fragment holds rows g and g + 8 at
 * those k bytes, B's holds column g at the same ones; the same for both element types in bytes).
 * The shared tiles swap the two halves of odd rows (epd_ffn_gemm_tile_off of
 * gpu/ffn_gemm_layout.h), so that the 8 lanes of each quarter warp hit 8 distinct 16-byte bank
 * groups, reading and writing.
 *
 * Split-K (a short grid: few experts with rows): each K range writes its fp32 sums to a
 * workspace, and a second kernel adds the ranges in order into D: no atomics, the same bits run
 * to run. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "gpu/ffn_gemm.h"
#include "gpu/ffn_gemm_layout.h"
#include "gpu/fp8.h"

#define THREADS (EPD_FFN_GEMM_WARPS * 32)
#define MT 2                                   /* m16 tiles per warp */
#define NT_W (EPD_FFN_GEMM_WARP_ROWS / 8)      /* n8 tiles per warp */
#define STAGE_BYTES EPD_FFN_GEMM_STAGE_BYTES
#define STAGES EPD_FFN_GEMM_STAGES
#define W_STAGE (EPD_FFN_GEMM_BN * STAGE_BYTES)       /* a stage's weights */
#define X_STAGE (EPD_FFN_GEMM_ROW_TILE * STAGE_BYTES) /* a stage's activations */
#define XS_STAGE (EPD_FFN_GEMM_ROW_TILE * 4)          /* a stage's FP8 activation scales */
#define SMEM_BYTES (STAGES * (W_STAGE + X_STAGE + XS_STAGE))
#define REDUCE_THREADS 256

static_assert(EPD_FFN_GEMM_FEATURE_GROUPS * EPD_FFN_GEMM_WARP_FEATURES == EPD_FFN_GEMM_BN,
              "the warps cover the CTA's features");
static_assert(EPD_FFN_GEMM_FEATURE_GROUPS * (EPD_FFN_GEMM_ROW_TILE / EPD_FFN_GEMM_WARP_ROWS) ==
                  EPD_FFN_GEMM_WARPS,
              "the warps cover the CTA's rows");
static_assert(MT * 16 == EPD_FFN_GEMM_WARP_FEATURES, "the m16 tiles cover the warp's features");
static_assert(W_STAGE % (THREADS * 16) == 0, "the threads copy a stage's weights evenly");
static_assert((STAGES & (STAGES - 1)) == 0 && STAGES >= 2, "a power-of-two ring");

/* the kernel's parameters (epd_ffn_gemm_args_t as the device uses them) */
struct gemm_params {
    const uint8_t *w;
    const float *w_scale;
    const uint8_t *x;
    const float *x_scale;
    const uint32_t *row_base, *counts, *tile_base;
    void *d;
    float *part;        /* split-K: [K range][total_rows][n] fp32; NULL: D directly */
    size_t part_stride; /* elements of one K range's sums */
    uint32_t n, k, kbytes, n_experts, w_scale_ld, prefetch;
};

/* ---- device helpers ---------------------------------------------------------------------- */

__device__ static __forceinline__ void cp_async16(void *smem, const void *gmem)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    size_t g = __cvta_generic_to_global(gmem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(g) : "memory");
#else
    __trap();
#endif
}

__device__ static __forceinline__ void cp_async_commit()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

/* waits until at most n of this thread's cp.async groups are pending */
template <int N> __device__ static __forceinline__ void cp_async_wait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

/* bytes (a multiple of 128) from p (128-byte aligned) towards L2 as one request, not waited for */
__device__ static __forceinline__ void prefetch_l2(const uint8_t *p, uint32_t bytes)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    size_t g = __cvta_generic_to_global(p);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(g), "r"(bytes));
#elif defined(__CUDA_ARCH__)
    for (uint32_t i = 0; i < bytes; i += 128) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p + i));
#endif
}

/* d += A B for one m16n8 tile: BF16 m16n8k16 or e4m3 m16n8k32, fp32 accumulation */
template <bool FP8>
__device__ static __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                           uint32_t a3, uint32_t b0, uint32_t b1)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    if (FP8) {
        asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
        return;
    }
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if (!FP8) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
        return;
    }
#endif
    __trap(); /* the host refuses the kernel where this is reached (epd_ffn_gemm_supported) */
}

/* the i with base[i] <= x < base[i + 1]: base ascending, [n + 1], base[0] <= x < base[n] */
__device__ static __forceinline__ uint32_t find_base(const uint32_t *base, uint32_t n, uint32_t x)
{
    uint32_t lo = 0, hi = n; /* base[lo] <= x < base[hi] */
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        if (base[mid] <= x)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* find_base by a whole warp (every lane calling, converged): the count of i in [1, n] with
 * base[i] <= x, 32 of them a load (one dependent load for 32 experts, not a binary search's
 * five) */
__device__ static __forceinline__ uint32_t find_base_warp(const uint32_t *base, uint32_t n,
                                                          uint32_t x, uint32_t lane)
{
    uint32_t found = 0;
    for (uint32_t first = 1; first <= n; first += 32) {
        const uint32_t i = first + lane;
        const uint32_t m = __ballot_sync(0xffffffffu, i <= n && __ldg(base + i) <= x);
        found += __popc(m);
        if (m != 0xffffffffu) break; /* ascending: the rest are above x */
    }
    return found;
}

/* ---- the kernels ------------------------------------------------------------------------- */

template <bool FP8, bool OUT_BF16>
__global__ void __launch_bounds__(THREADS, 2) ffn_gemm_kernel(gemm_params p)
{
    extern __shared__ __align__(128) uint8_t smem[];
    uint8_t *const w_s = smem;                                  /* [STAGES][BN][128] */
    uint8_t *const x_s = smem + STAGES * W_STAGE;               /* [STAGES][ROW_TILE][128] */
    float *const xsc_s = (float *)(x_s + STAGES * X_STAGE);     /* [STAGES][ROW_TILE] */
    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const uint32_t fg = warp % EPD_FFN_GEMM_FEATURE_GROUPS, rh = warp / EPD_FFN_GEMM_FEATURE_GROUPS;
    const uint32_t e = find_base_warp(p.tile_base, p.n_experts, blockIdx.x, lane);
    const uint32_t rt = blockIdx.x - p.tile_base[e];
    const uint32_t rb = p.row_base[e], mpad = p.row_base[e + 1] - rb;
    const uint32_t count = min(p.counts[e], mpad);
    if (rt * EPD_FFN_GEMM_ROW_TILE >= count) return; /* counts that disagree with tile_base */
    const uint32_t rows = min(count - rt * EPD_FFN_GEMM_ROW_TILE, EPD_FFN_GEMM_ROW_TILE);
    const uint32_t nt = min((rows + 7) / 8, (mpad - rt * EPD_FFN_GEMM_ROW_TILE) / 8);
    const uint32_t nt_w = epd_ffn_gemm_warp_nt(nt, rh); /* warp-uniform */
    const uint32_t kbytes = p.kbytes;
    uint32_t kb0, kb1;
    epd_ffn_gemm_split_range(blockIdx.z, gridDim.z, kbytes / STAGE_BYTES, &kb0, &kb1);
    const uint32_t n_kb = kb1 - kb0;
    /* the CTA's 128 weight rows (contiguous), its row tile's activations, from stage kb0 */
    const uint8_t *wg = p.w + ((size_t)e * p.n + (size_t)blockIdx.y * EPD_FFN_GEMM_BN) * kbytes +
                        (size_t)kb0 * STAGE_BYTES;
    const uint8_t *xg = p.x + (size_t)(rb + rt * EPD_FFN_GEMM_ROW_TILE) * kbytes +
                        (size_t)kb0 * STAGE_BYTES;
    const float *xsg = FP8 ? p.x_scale + (size_t)rb * (p.k / 128) + rt * EPD_FFN_GEMM_ROW_TILE +
                                 (size_t)kb0 * mpad
                           : nullptr;
    const float *wsg =
        FP8 ? p.w_scale + ((size_t)e * (p.n / 128) + blockIdx.y) * p.w_scale_ld + kb0 : nullptr;

    float acc[MT][NT_W][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int j = 0; j < NT_W; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[mt][j][i] = 0.0f;

    /* stage s of the range (its 128 weight rows, nt * 8 activation rows; FP8: their scales) into
     * slot */
    /* the thread's weight copies: chunk tid % 8 of rows tid / 8 + k THREADS / 8 (k in
     * [0, W_STAGE / 16 / THREADS)); rows THREADS / 8 apart keep the row's parity, so one
     * swizzled offset plus a multiple of THREADS / 8 rows */
    const uint8_t *w_thread = wg + (size_t)(tid >> 3) * kbytes + (tid & 7) * 16;
    const size_t w_step = (size_t)(THREADS / 8) * kbytes;
    const uint32_t w_off = epd_ffn_gemm_tile_off(tid >> 3, tid & 7);
    static_assert((THREADS / 8) % 2 == 0, "the copies' rows keep their parity");
    auto load = [&](uint32_t s, uint32_t slot) {
        const uint8_t *wsrc = w_thread + (size_t)s * STAGE_BYTES;
        uint8_t *wdst = w_s + slot * W_STAGE + w_off;
#pragma unroll
        for (uint32_t k = 0; k < W_STAGE / 16 / THREADS; k++)
            cp_async16(wdst + k * (THREADS / 8) * STAGE_BYTES, wsrc + k * w_step);
        const uint8_t *xsrc = xg + (size_t)s * STAGE_BYTES;
        uint8_t *xdst = x_s + slot * X_STAGE;
        for (uint32_t i = tid; i < nt * 64; i += THREADS) {
            const uint32_t r = i >> 3, q = i & 7;
            cp_async16(xdst + epd_ffn_gemm_tile_off(r, q), xsrc + (size_t)r * kbytes + q * 16);
        }
        if (FP8)
            for (uint32_t i = tid; i < nt * 2; i += THREADS)
                cp_async16(&xsc_s[slot * EPD_FFN_GEMM_ROW_TILE + i * 4],
                           xsg + (size_t)s * mpad + i * 4);
    };
    /* a stage's products from slot (FP8: ws its weights' scale): the warp's two m16 tiles by its
     * nt_w n8 tiles */
    auto compute = [&](uint32_t slot, float ws) {
        if (nt_w == 0) return;
        const uint8_t *wsl = w_s + slot * W_STAGE, *xsl = x_s + slot * X_STAGE;
        /* chunk by chunk (half the registers for the weights' fragments; FP8: each chunk's sums
         * promoted on their own, half a scale block each) */
#pragma unroll
        for (uint32_t c = 0; c < 2; c++) {
            /* a[mt][h]: rows g (h 0) and g + 8 (h 1) of m16 tile mt, chunk c's 16 bytes */
            uint4 a[MT][2];
#pragma unroll
            for (uint32_t mt = 0; mt < MT; mt++)
#pragma unroll
                for (uint32_t h = 0; h < 2; h++)
                    a[mt][h] = *(const uint4 *)(wsl + epd_ffn_gemm_tile_off(
                                                          epd_ffn_gemm_a_row(fg, mt, h, g),
                                                          c * 4 + t));
#pragma unroll
            for (uint32_t j = 0; j < NT_W; j++) {
                if (j >= nt_w) continue;
                float part[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
#pragma unroll
                    for (int i = 0; i < 4; i++) part[mt][i] = 0.0f;
                const uint4 b = *(const uint4 *)(xsl + epd_ffn_gemm_tile_off(
                                                           epd_ffn_gemm_b_row(rh, j, g), c * 4 + t));
#pragma unroll
                for (int sub = 0; sub < 2; sub++) {
                    const uint32_t b0 = sub ? b.z : b.x, b1 = sub ? b.w : b.y;
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        const uint4 lo = a[mt][0], hi = a[mt][1];
                        mma<FP8>(FP8 ? part[mt] : acc[mt][j], sub ? lo.z : lo.x, sub ? hi.z : hi.x,
                                 sub ? lo.w : lo.y, sub ? hi.w : hi.y, b0, b1);
                    }
                }
                if (FP8) {
                    /* c0, c2: row 2t of the n8 tile; c1, c3: row 2t + 1 */
                    const uint32_t r0 = rh * EPD_FFN_GEMM_WARP_ROWS + j * 8 + 2 * t;
                    const float s0 = ws * xsc_s[slot * EPD_FFN_GEMM_ROW_TILE + r0];
                    const float s1 = ws * xsc_s[slot * EPD_FFN_GEMM_ROW_TILE + r0 + 1];
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        acc[mt][j][0] += part[mt][0] * s0;
                        acc[mt][j][1] += part[mt][1] * s1;
                        acc[mt][j][2] += part[mt][2] * s0;
                        acc[mt][j][3] += part[mt][3] * s1;
                    }
                }
            }
        }
    };

#pragma unroll
    for (uint32_t s = 0; s < STAGES - 1; s++) {
        if (s < n_kb) load(s, s);
        cp_async_commit();
    }
    /* FP8: the weights' scale of the stage, read a stage ahead (off the mmas' path) */
    float ws_next = FP8 && nt_w > 0 ? __ldg(wsg) : 1.0f;
    for (uint32_t s = 0; s < n_kb; s++) {
        const float ws = ws_next;
        if (FP8 && nt_w > 0 && s + 1 < n_kb) ws_next = __ldg(wsg + s + 1);
        /* stage s landed (this thread's copies, then everybody's), and the slot the load below
         * refills was computed by every warp in the previous iteration */
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        const uint32_t ns = s + STAGES - 1;
        if (ns < n_kb) load(ns, ns % STAGES);
        cp_async_commit();
        /* the L2 prefetch: every prefetch stages, one request per weight row for the next
         * prefetch stages from prefetch stages beyond the copies' front (longer runs of a row
         * for the memory than the copies' 128 bytes) */
        if (p.prefetch > 0 && tid < EPD_FFN_GEMM_BN && s % p.prefetch == 0) {
            const uint32_t from = s + STAGES - 1 + p.prefetch;
            if (from < n_kb)
                prefetch_l2(wg + (size_t)tid * kbytes + (size_t)from * STAGE_BYTES,
                            min(p.prefetch, n_kb - from) * STAGE_BYTES);
        }
        compute(s % STAGES, ws);
    }
    if (nt_w == 0) return;

    /* D[row][feature]: c0 (feature g, row 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1) */
    const size_t row0 = (size_t)rb + rt * EPD_FFN_GEMM_ROW_TILE + rh * EPD_FFN_GEMM_WARP_ROWS;
#pragma unroll
    for (uint32_t mt = 0; mt < MT; mt++) {
#pragma unroll
        for (uint32_t j = 0; j < NT_W; j++) {
            if (j >= nt_w) continue;
            const size_t f = (size_t)blockIdx.y * EPD_FFN_GEMM_BN + epd_ffn_gemm_a_row(fg, mt, 0, g);
            const size_t r = row0 + j * 8 + 2 * t;
            const size_t i0 = r * p.n + f, i1 = (r + 1) * p.n + f;
            if (p.part != nullptr) {
                float *d = p.part + (size_t)blockIdx.z * p.part_stride;
                d[i0] = acc[mt][j][0];
                d[i1] = acc[mt][j][1];
                d[i0 + 8] = acc[mt][j][2];
                d[i1 + 8] = acc[mt][j][3];
            } else if (OUT_BF16) {
                uint16_t *d = (uint16_t *)p.d;
                d[i0] = epd_f32_to_bf16(acc[mt][j][0]);
                d[i1] = epd_f32_to_bf16(acc[mt][j][1]);
                d[i0 + 8] = epd_f32_to_bf16(acc[mt][j][2]);
                d[i1 + 8] = epd_f32_to_bf16(acc[mt][j][3]);
            } else {
                float *d = (float *)p.d;
                d[i0] = acc[mt][j][0];
                d[i1] = acc[mt][j][1];
                d[i0 + 8] = acc[mt][j][2];
                d[i1 + 8] = acc[mt][j][3];
            }
        }
    }
}

/* split-K's second pass: D[row][4 features] = the K ranges' sums added in range order, for the
 * rows the GEMM writes (epd_ffn_gemm_written_rows); grid (rows, N / (4 REDUCE_THREADS) up) */
template <bool OUT_BF16>
__global__ void __launch_bounds__(REDUCE_THREADS) split_reduce_kernel(gemm_params p,
                                                                      uint32_t splits)
{
    const uint32_t row = blockIdx.x, col = (blockIdx.y * REDUCE_THREADS + threadIdx.x) * 4;
    if (col >= p.n) return;
    const uint32_t e = find_base(p.row_base, p.n_experts, row);
    const uint32_t rb = p.row_base[e], mpad = p.row_base[e + 1] - rb;
    const uint32_t tiles = p.tile_base[e + 1] - p.tile_base[e];
    if (row - rb >= epd_ffn_gemm_written_rows(p.counts[e], mpad, tiles, EPD_FFN_GEMM_ROW_TILE))
        return;
    const size_t i = (size_t)row * p.n + col;
    float4 sum = *(const float4 *)(p.part + i);
    for (uint32_t s = 1; s < splits; s++) {
        const float4 v = *(const float4 *)(p.part + (size_t)s * p.part_stride + i);
        sum.x += v.x;
        sum.y += v.y;
        sum.z += v.z;
        sum.w += v.w;
    }
    if (OUT_BF16) {
        uint16_t *d = (uint16_t *)p.d + i;
        d[0] = epd_f32_to_bf16(sum.x);
        d[1] = epd_f32_to_bf16(sum.y);
        d[2] = epd_f32_to_bf16(sum.z);
        d[3] = epd_f32_to_bf16(sum.w);
    } else {
        *(float4 *)((float *)p.d + i) = sum;
    }
}

/* One mma on the PTX ISA's fragment layouts (epd_ffn_gemm_mma_check): A row g at k bytes
 * [4t, 4t + 4) (register 0) and [16 + 4t, 16 + 4t + 4) (register 2), row g + 8 the same
 * (registers 1, 3); B column g at the same k bytes (registers 0, 1); D rows g, g + 8, columns
 * 2t, 2t + 1. a: [16][8 words], b: [8][8 words], d: [16][8]. */
template <bool FP8> __global__ void mma_check_kernel(const uint32_t *a, const uint32_t *b, float *d)
{
    const uint32_t lane = threadIdx.x, g = lane >> 2, t = lane & 3;
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    mma<FP8>(c, a[g * 8 + t], a[(g + 8) * 8 + t], a[g * 8 + 4 + t], a[(g + 8) * 8 + 4 + t],
             b[g * 8 + t], b[g * 8 + 4 + t]);
    d[g * 8 + 2 * t] = c[0];
    d[g * 8 + 2 * t + 1] = c[1];
    d[(g + 8) * 8 + 2 * t] = c[2];
    d[(g + 8) * 8 + 2 * t + 1] = c[3];
}

/* ---- host -------------------------------------------------------------------------------- */

/* the GEMM kernel of a format, and its shared memory allowed (more than the default 48 KB, and
 * the carveout preferring shared memory so that two CTAs fit an SM) */
typedef void (*gemm_kernel_t)(gemm_params);

static gemm_kernel_t gemm_kernel(bool fp8, bool out_bf16)
{
    if (fp8) return out_bf16 ? ffn_gemm_kernel<true, true> : ffn_gemm_kernel<true, false>;
    return out_bf16 ? ffn_gemm_kernel<false, true> : ffn_gemm_kernel<false, false>;
}

/* The kernel configured for the current device (once a device and kernel: the attributes, then
 * the CTAs the device runs at a time, SMs times CTAs per SM, in *slots_p; 0 where unknown). */
#define CONFIG_DEVICES 64
static uint64_t configured_slots[4][CONFIG_DEVICES];

static cudaError_t gemm_configure(bool fp8, bool out_bf16, uint64_t *slots_p)
{
    gemm_kernel_t k = gemm_kernel(fp8, out_bf16);
    uint64_t *cache = NULL;
    int dev = 0, sms = 0, per_sm = 0;
    cudaError_t rc = cudaGetDevice(&dev);
    *slots_p = 0;
    if (rc != cudaSuccess) return rc;
    if (dev >= 0 && dev < CONFIG_DEVICES) cache = &configured_slots[fp8 * 2 + out_bf16][dev];
    if (cache != NULL && *cache != 0) {
        *slots_p = *cache;
        return cudaSuccess;
    }
    rc = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM_BYTES);
    if (rc == cudaSuccess)
        rc = cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout,
                                  (int)cudaSharedmemCarveoutMaxShared);
    if (rc != cudaSuccess) return rc;
    /* the occupancy after the attributes: it counts the shared memory allowed */
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, THREADS, SMEM_BYTES) !=
            cudaSuccess) {
        cudaGetLastError();
        return cudaSuccess; /* no auto split, the kernel still runs */
    }
    *slots_p = (uint64_t)(sms > 0 ? sms : 0) * (uint64_t)(per_sm > 0 ? per_sm : 0);
    if (cache != NULL) *cache = *slots_p;
    return cudaSuccess;
}

extern "C" epd_status_t epd_ffn_gemm_supported(bool fp8, char err[EPD_ERR_LEN])
{
    int dev = 0, major = 0, minor = 0, optin = 0;
    cudaFuncAttributes fa;
    const int need = fp8 ? 89 : 80;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
            cudaSuccess) {
        cudaGetLastError();
        snprintf(err, EPD_ERR_LEN, "ffn GEMM kernel: cannot read the device's compute capability");
        return EPD_ERR_UNSUPPORTED;
    }
    if (major * 10 + minor < need) {
        snprintf(err, EPD_ERR_LEN,
                 "ffn GEMM kernel: %s needs compute capability %d.%d, the device has %d.%d",
                 fp8 ? "the FP8 mma (e4m3 m16n8k32)" : "the BF16 mma (m16n8k16)", need / 10,
                 need % 10, major, minor);
        return EPD_ERR_UNSUPPORTED;
    }
    if (optin < (int)SMEM_BYTES) {
        snprintf(err, EPD_ERR_LEN,
                 "ffn GEMM kernel: its pipeline needs %u bytes of shared memory a CTA, the device "
                 "allows %d",
                 (unsigned)SMEM_BYTES, optin);
        return EPD_ERR_UNSUPPORTED;
    }
    cudaError_t rc = cudaFuncGetAttributes(&fa, gemm_kernel(fp8, false));
    if (rc != cudaSuccess) {
        cudaGetLastError();
        snprintf(err, EPD_ERR_LEN, "ffn GEMM kernel: no code for this device: %s",
                 cudaGetErrorString(rc));
        return EPD_ERR_UNSUPPORTED;
    }
    if (fa.ptxVersion < need) {
        snprintf(err, EPD_ERR_LEN,
                 "ffn GEMM kernel: built for compute %d, %s needs %d (the Makefile's -gencode)",
                 fa.ptxVersion, fp8 ? "FP8" : "BF16", need);
        return EPD_ERR_UNSUPPORTED;
    }
    return EPD_OK;
}

/* The K ranges of a launch of ctas CTAs over n_kb stages: the request (auto: by the waves on
 * slots CTAs at a time), at most n_kb, and as many as the workspace holds (ws_range bytes a
 * range). */
static uint32_t pick_split(const epd_ffn_gemm_args_t *a, uint64_t slots, uint64_t ctas,
                           uint32_t n_kb, size_t ws_range)
{
    uint64_t by_ws = a->split_ws == NULL || ws_range == 0 ? 1 : a->split_ws_bytes / ws_range;
    uint32_t max_by_ws = by_ws > EPD_FFN_GEMM_MAX_SPLIT ? EPD_FFN_GEMM_MAX_SPLIT : (uint32_t)by_ws;
    uint32_t splits = a->split_k;
    if (max_by_ws < 2 || splits == 1) return 1;
    if (splits == EPD_FFN_GEMM_SPLIT_AUTO)
        return epd_ffn_gemm_auto_split(ctas, n_kb, slots, max_by_ws);
    if (splits > max_by_ws) splits = max_by_ws;
    if (splits > n_kb) splits = n_kb;
    return splits < 1 ? 1 : splits;
}

extern "C" epd_status_t epd_ffn_gemm_launch(const epd_ffn_gemm_args_t *a, void *stream,
                                            char err[EPD_ERR_LEN])
{
    gemm_params p;
    if (a->split_used_p != NULL) *a->split_used_p = 1;
    if (a->n_tiles == 0) return EPD_OK;
    if (a->n == 0 || a->k == 0 || a->n % 128 != 0 || a->k % 128 != 0 ||
        a->n / EPD_FFN_GEMM_BN > 65535 || a->n_experts == 0 || a->w == NULL || a->x == NULL ||
        a->d == NULL || a->row_base == NULL || a->counts == NULL || a->tile_base == NULL ||
        (a->fp8 && (a->w_scale == NULL || a->x_scale == NULL || a->w_scale_ld < a->k / 128))) {
        snprintf(err, EPD_ERR_LEN,
                 "ffn GEMM kernel: bad arguments (N %u, K %u, %u experts; N and K must be "
                 "multiples of 128, FP8 needs both scales)",
                 a->n, a->k, a->n_experts);
        return EPD_ERR_INVALID_ARG;
    }
    memset(&p, 0, sizeof p);
    p.w = (const uint8_t *)a->w;
    p.w_scale = a->w_scale;
    p.x = (const uint8_t *)a->x;
    p.x_scale = a->x_scale;
    p.row_base = a->row_base;
    p.counts = a->counts;
    p.tile_base = a->tile_base;
    p.d = a->d;
    p.n = a->n;
    p.k = a->k;
    p.kbytes = a->k * (a->fp8 ? 1u : 2u);
    p.n_experts = a->n_experts;
    p.w_scale_ld = a->w_scale_ld;
    p.prefetch = a->prefetch;
    gemm_kernel_t k = gemm_kernel(a->fp8, a->out_bf16);
    uint64_t slots = 0;
    cudaError_t rc = gemm_configure(a->fp8, a->out_bf16, &slots);
    const uint32_t n_kb = p.kbytes / STAGE_BYTES;
    const size_t ws_range = (size_t)a->total_rows * a->n * sizeof(float);
    const uint32_t splits =
        pick_split(a, slots, (uint64_t)a->n_tiles * (a->n / EPD_FFN_GEMM_BN), n_kb, ws_range);
    if (splits > 1) {
        p.part = (float *)a->split_ws;
        p.part_stride = (size_t)a->total_rows * a->n;
    }
    dim3 grid(a->n_tiles, a->n / EPD_FFN_GEMM_BN, splits);
    cudaStream_t s = (cudaStream_t)stream;
    if (rc == cudaSuccess) {
        k<<<grid, THREADS, SMEM_BYTES, s>>>(p);
        rc = cudaGetLastError();
    }
    if (rc == cudaSuccess && splits > 1) {
        dim3 rgrid(a->total_rows, (a->n / 4 + REDUCE_THREADS - 1) / REDUCE_THREADS);
        if (a->out_bf16)
            split_reduce_kernel<true><<<rgrid, REDUCE_THREADS, 0, s>>>(p, splits);
        else
            split_reduce_kernel<false><<<rgrid, REDUCE_THREADS, 0, s>>>(p, splits);
        rc = cudaGetLastError();
    }
    if (rc != cudaSuccess) {
        snprintf(err, EPD_ERR_LEN, "ffn GEMM kernel: launch (%u x %u x %u CTAs): %s", a->n_tiles,
                 a->n / EPD_FFN_GEMM_BN, splits, cudaGetErrorString(rc));
        return EPD_ERR_CUDA;
    }
    if (a->split_used_p != NULL) *a->split_used_p = splits;
    return EPD_OK;
}

extern "C" epd_status_t epd_ffn_gemm_mma_check(bool fp8, const void *a_host, const void *b_host,
                                               float *d_host, char err[EPD_ERR_LEN])
{
    epd_status_t status = epd_ffn_gemm_supported(fp8, err);
    uint32_t *a = NULL, *b = NULL;
    float *d = NULL;
    cudaError_t rc;
    if (status != EPD_OK) return status;
    rc = cudaMalloc((void **)&a, 16 * 32);
    if (rc == cudaSuccess) rc = cudaMalloc((void **)&b, 8 * 32);
    if (rc == cudaSuccess) rc = cudaMalloc((void **)&d, 16 * 8 * sizeof(float));
    if (rc == cudaSuccess) rc = cudaMemcpy(a, a_host, 16 * 32, cudaMemcpyHostToDevice);
    if (rc == cudaSuccess) rc = cudaMemcpy(b, b_host, 8 * 32, cudaMemcpyHostToDevice);
    if (rc == cudaSuccess) {
        if (fp8)
            mma_check_kernel<true><<<1, 32>>>(a, b, d);
        else
            mma_check_kernel<false><<<1, 32>>>(a, b, d);
        rc = cudaGetLastError();
    }
    if (rc == cudaSuccess) rc = cudaMemcpy(d_host, d, 16 * 8 * sizeof(float), cudaMemcpyDeviceToHost);
    if (rc != cudaSuccess) {
        snprintf(err, EPD_ERR_LEN, "ffn GEMM mma check: %s", cudaGetErrorString(rc));
        status = EPD_ERR_CUDA;
    }
    cudaFree(a);
    cudaFree(b);
    cudaFree(d);
    return status;
}
