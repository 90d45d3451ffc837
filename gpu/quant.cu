/* CUDA FP8 kernels (DESIGN.md section 3) and their C launchers (gpu/quant.h): per-token and
 * group-128 quantization, dequantization, the step-scale reduction and the requantization of an
 * expert-grouped receive buffer. Same IEEE operations as gpu/quant_host.c, so the same bytes;
 * memory-bound, so 16-byte loads and stores, rows held in registers, no shared-memory staging.
 * Tile and block sizes come from epd_quant_launch_t, never from constants in the kernels. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "gpu/fp8.h"
#include "gpu/quant.h"
#include "gpu/quant_dev.cuh"

#define EPD_REQUANT_MAX_EXPERTS 4096 /* the row prefix of the requant kernel lives in shared memory */

/* ---- per-token quantization ---- */

/* max over the `lanes` threads of one row (lanes: a power of two <= 32 or whole warps). Every
 * thread of the block must call it (it may synchronize). red holds one float per warp. */
__device__ __forceinline__ float row_max(float v, uint32_t lanes, float *red)
{
    uint32_t w = lanes < 32 ? lanes : 32;
    for (uint32_t off = w / 2; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    if (lanes <= 32) return v;
    uint32_t warp = threadIdx.x / 32, per_row = lanes / 32, first = warp / per_row * per_row;
    if ((threadIdx.x & 31) == 0) red[warp] = v;
    __syncthreads();
    float m = red[first];
    for (uint32_t k = 1; k < per_row; k++) m = fmaxf(m, red[first + k]);
    return m;
}

/* One row per `lanes` threads, blockDim.x / lanes rows per block. VPT > 0: the row is held in
 * registers (VPT 16-byte vectors per thread), read once. VPT == 0: any length, the second pass
 * rereads the row (from L2). */
template <int VPT>
__global__ void quant_token_kernel(const uint16_t *__restrict__ x, uint32_t rows, uint32_t nv,
                                   size_t x_stride, uint8_t *__restrict__ q, size_t q_stride,
                                   float *__restrict__ scales, size_t scale_stride, uint32_t lanes,
                                   int ue8m0)
{
    extern __shared__ float red[];
    const uint32_t lane = threadIdx.x % lanes;
    const uint64_t row = (uint64_t)blockIdx.x * (blockDim.x / lanes) + threadIdx.x / lanes;
    const bool live = row < rows;
    const uint4 *xr = reinterpret_cast<const uint4 *>(x + (live ? row : 0) * x_stride);
    uint2 *qr = reinterpret_cast<uint2 *>(q + (live ? row : 0) * q_stride);
    float amax = 0.0f;
    uint4 v[VPT > 0 ? VPT : 1];
    if (VPT > 0) {
#pragma unroll
        for (int j = 0; j < VPT; j++) {
            uint32_t c = lane + (uint32_t)j * lanes;
            if (live && c < nv) {
                v[j] = __ldg(xr + c);
                amax = epd_dev_amax8(v[j], amax);
            }
        }
    } else if (live) {
        for (uint32_t c = lane; c < nv; c += lanes) amax = epd_dev_amax8(__ldg(xr + c), amax);
    }
    amax = row_max(amax, lanes, red);
    if (!live) return;
    float s, mult;
    epd_quant_scale(amax, ue8m0, &s, &mult);
    if (lane == 0) scales[row * scale_stride] = s;
    if (VPT > 0) {
#pragma unroll
        for (int j = 0; j < VPT; j++) {
            uint32_t c = lane + (uint32_t)j * lanes;
            if (c < nv) qr[c] = epd_dev_quant8(v[j], mult);
        }
    } else {
        for (uint32_t c = lane; c < nv; c += lanes) qr[c] = epd_dev_quant8(__ldg(xr + c), mult);
    }
}

/* ---- group-128 quantization ---- */

/* 16 / VPT threads per group of 128 (256 bytes), each VPT consecutive 16-byte vectors; the group
 * amax by shuffles within those lanes. G groups a lane set (strided by the grid's lane sets, so
 * neighbouring sets still read neighbouring groups): all G groups' loads leave before the first
 * is used, and the grid is G times smaller (decode sizes: fewer blocks, one wave). */
template <int VPT, int G>
__global__ void quant_group_kernel(const uint16_t *__restrict__ x, uint32_t rows, uint32_t gpr,
                                   size_t x_stride, uint8_t *__restrict__ q, size_t q_stride,
                                   float *__restrict__ scales, size_t scale_stride, int ue8m0)
{
    constexpr uint32_t LANES = 16 / VPT;
    const uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t sets = (uint64_t)gridDim.x * blockDim.x / LANES;
    const uint32_t part = (uint32_t)(t % LANES);
    const uint64_t n_groups = (uint64_t)rows * gpr;
    uint64_t row[G];
    uint32_t gi[G];
    bool live[G];
    uint4 v[G][VPT];
    float amax[G];
#pragma unroll
    for (int k = 0; k < G; k++) {
        const uint64_t g = t / LANES + (uint64_t)k * sets;
        live[k] = g < n_groups;
        row[k] = 0;
        gi[k] = 0;
        amax[k] = 0.0f;
        if (live[k]) {
            if (n_groups <= 0xffffffffull) { /* 32-bit division when it fits (the common case) */
                row[k] = (uint32_t)g / gpr;
                gi[k] = (uint32_t)g - (uint32_t)row[k] * gpr;
            } else {
                row[k] = g / gpr;
                gi[k] = (uint32_t)(g - row[k] * gpr);
            }
            const size_t col = (size_t)gi[k] * EPD_QUANT_GROUP + (size_t)part * VPT * 8;
            const uint4 *src = reinterpret_cast<const uint4 *>(x + row[k] * x_stride + col);
#pragma unroll
            for (int j = 0; j < VPT; j++) v[k][j] = __ldg(src + j);
        }
    }
#pragma unroll
    for (int k = 0; k < G; k++) {
        if (live[k]) {
#pragma unroll
            for (int j = 0; j < VPT; j++) amax[k] = epd_dev_amax8(v[k][j], amax[k]);
        }
#pragma unroll
        for (uint32_t off = LANES / 2; off > 0; off >>= 1)
            amax[k] = fmaxf(amax[k], __shfl_xor_sync(0xffffffffu, amax[k], off));
        if (!live[k]) continue;
        float s, mult;
        epd_quant_scale(amax[k], ue8m0, &s, &mult);
        const size_t col = (size_t)gi[k] * EPD_QUANT_GROUP + (size_t)part * VPT * 8;
        uint8_t *dst = q + row[k] * q_stride + col;
        if (VPT == 1) {
            *reinterpret_cast<uint2 *>(dst) = epd_dev_quant8(v[k][0], mult);
        } else {
#pragma unroll
            for (int j = 0; j < VPT; j += 2) {
                uint2 a = epd_dev_quant8(v[k][j], mult), b = epd_dev_quant8(v[k][j + 1], mult);
                reinterpret_cast<uint4 *>(dst)[j / 2] = make_uint4(a.x, a.y, b.x, b.y);
            }
        }
        if (part == 0) scales[row[k] * scale_stride + gi[k]] = s;
    }
}

/* ---- dequantization ---- */

__device__ __forceinline__ void store16(float *dst, const float f[16])
{
    float4 *d = reinterpret_cast<float4 *>(dst);
#pragma unroll
    for (int k = 0; k < 4; k++) d[k] = make_float4(f[4 * k], f[4 * k + 1], f[4 * k + 2], f[4 * k + 3]);
}

__device__ __forceinline__ void store16(uint16_t *dst, const float f[16])
{
    uint4 *d = reinterpret_cast<uint4 *>(dst);
#pragma unroll
    for (int k = 0; k < 2; k++)
        d[k] = make_uint4(epd_dev_bf16x2(f[8 * k], f[8 * k + 1]), epd_dev_bf16x2(f[8 * k + 2], f[8 * k + 3]),
                          epd_dev_bf16x2(f[8 * k + 4], f[8 * k + 5]), epd_dev_bf16x2(f[8 * k + 6], f[8 * k + 7]));
}

/* Each thread: VPT vectors of 16 codes, strided by blockDim.x within the block's chunk. */
template <int VPT, typename Out>
__global__ void dequant_kernel(const uint8_t *__restrict__ q, const float *__restrict__ scales,
                               uint64_t n_vec, uint32_t nvr, uint32_t ns, int per_token,
                               Out *__restrict__ out)
{
    const uint64_t base = (uint64_t)blockIdx.x * blockDim.x * VPT + threadIdx.x;
    uint4 in[VPT];
    float sc[VPT];
#pragma unroll
    for (int j = 0; j < VPT; j++) {
        uint64_t v = base + (uint64_t)j * blockDim.x;
        if (v < n_vec) {
            uint64_t row = v / nvr;
            uint32_t c = (uint32_t)(v - row * nvr);
            in[j] = __ldg(reinterpret_cast<const uint4 *>(q) + v);
            sc[j] = __ldg(scales + (per_token ? row : row * ns + c / 8));
        }
    }
#pragma unroll
    for (int j = 0; j < VPT; j++) {
        uint64_t v = base + (uint64_t)j * blockDim.x;
        if (v < n_vec) {
            float f[16];
            epd_dev_dequant16(in[j], sc[j], f);
            store16(out + v * 16, f);
        }
    }
}

/* ---- step scale and requantization of the expert-grouped layout ---- */

__device__ __forceinline__ uint32_t live_rows(const int32_t *counts, uint32_t e, uint32_t capacity)
{
    int32_t c = counts[e];
    return c <= 0 ? 0u : ((uint32_t)c > capacity ? capacity : (uint32_t)c);
}

/* grid (blocks per expert, experts): max over the live rows' scales, LOADS independent loads a
 * thread in flight, then one atomicMax per block into *out (zeroed before; positive floats order
 * like their bits). The requant kernel behind it is a programmatic dependent launch: its blocks
 * start (the tile prefix) while this grid finishes, and wait for it before they read *out. */
template <int LOADS>
__global__ void scale_max_kernel(const float *__restrict__ scales, const int32_t *__restrict__ counts,
                                 uint32_t capacity, uint32_t ns, float *out)
{
    __shared__ float red[32];
    const uint32_t e = blockIdx.y;
    const uint64_t n = (uint64_t)live_rows(counts, e, capacity) * ns;
    const float *s = scales + (uint64_t)e * capacity * ns;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x * LOADS;
    float m = 0.0f;
    for (uint64_t i0 = (uint64_t)blockIdx.x * blockDim.x * LOADS + threadIdx.x; i0 < n;
         i0 += stride) {
        float v[LOADS];
#pragma unroll
        for (int j = 0; j < LOADS; j++) {
            const uint64_t i = i0 + (uint64_t)j * blockDim.x;
            v[j] = i < n ? __ldg(s + i) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < LOADS; j++) m = fmaxf(m, v[j]);
    }
    /* the requant grid may launch once every block is here (launched earlier, its blocks would
     * take SMs in the order this grid frees them, unevenly) */
    asm volatile("griddepcontrol.launch_dependents;");
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (uint32_t k = 1; k < blockDim.x / 32; k++) m = fmaxf(m, red[k]);
        if (m > 0.0f) atomicMax(reinterpret_cast<unsigned int *>(out), __float_as_uint(m));
    }
}

/* Work proportional to live rows. The live rows, expert after expert, form one sequence; a tile
 * is rows_per_tile consecutive rows of it, and block b walks tiles b, b + gridDim.x, ... Dead rows
 * cost nothing, and the tiles are balanced whatever the counts: tiles of one expert each would
 * leave a part-filled last round when the experts' tile counts add up badly. A tile that crosses
 * experts is done as one contiguous segment per expert. S = static_s (> 0) or *s_dev.
 * The prefix of live rows per expert is on every block's way to its first load: the counts are
 * read one a thread (their loads leave together), then warp 0 builds the prefix and notes the
 * expert of the block's first row, so that its first tile needs no search (a scan by one warp
 * has fewer barriers than one over the whole block, which was slower; docs/notes/kernels.md). */
template <int VPT>
__global__ void requant_kernel(const uint4 *q, const float *__restrict__ scales,
                               const int32_t *__restrict__ counts, uint32_t n_experts,
                               uint32_t capacity, uint32_t nvr, epd_fast_div row_of,
                               uint32_t ns, int per_token, uint32_t rows_per_tile,
                               float static_s, const float *s_dev, float *s_out, uint4 *q_out)
{
    extern __shared__ uint32_t row_start[]; /* [n_experts + 1]: live rows before expert e */
    __shared__ uint32_t first_expert;
    const uint32_t my_row = blockIdx.x * rows_per_tile;
    for (uint32_t e = threadIdx.x; e < n_experts; e += blockDim.x)
        row_start[e] = live_rows(counts, e, capacity);
    __syncthreads();
    if (threadIdx.x < 32) {
        const uint32_t lane = threadIdx.x, chunk = (n_experts + 31) / 32;
        const uint32_t begin = min(lane * chunk, n_experts), end = min(begin + chunk, n_experts);
        uint32_t sum = 0;
        for (uint32_t e = begin; e < end; e++) sum += row_start[e];
        uint32_t incl = sum;
        for (uint32_t off = 1; off < 32; off <<= 1) {
            uint32_t y = __shfl_up_sync(0xffffffffu, incl, off);
            if (lane >= off) incl += y;
        }
        uint32_t run = incl - sum;
        for (uint32_t e = begin; e < end; e++) {
            const uint32_t live = row_start[e];
            row_start[e] = run;
            if (run <= my_row && my_row - run < live) first_expert = e;
            run += live;
        }
        if (lane == 31) row_start[n_experts] = incl;
    }
    __syncthreads();
    const uint32_t total = row_start[n_experts];
    float big_s = static_s;
    if (s_dev != nullptr) {
        /* launched right behind the step scale's kernel (programmatic dependent launch): the
         * prologue above overlapped it; S is read once that grid is complete */
        asm volatile("griddepcontrol.wait;" ::: "memory");
        big_s = total > 0 ? *s_dev : 0.0f;
    }
    if (static_s > 0.0f && s_out != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *s_out = static_s;
    const float inv = __fdiv_rn(1.0f, big_s);
    uint32_t e = my_row < total ? first_expert : 0;
    /* no overflow: the launcher keeps n_experts x capacity below 2^31 */
    for (uint32_t r0 = my_row; r0 < total; r0 += gridDim.x * rows_per_tile) {
        const uint32_t r1 = min(r0 + rows_per_tile, total);
        for (uint32_t r = r0; r < r1;) {
            if (row_start[e + 1] <= r) { /* the largest e with row_start[e] <= r, after this one */
                uint32_t hi = n_experts - 1;
                while (e < hi) {
                    uint32_t mid = (e + hi + 1) / 2;
                    if (row_start[mid] <= r) e = mid;
                    else hi = mid - 1;
                }
            }
            /* rows r .. seg_end - 1 are contiguous rows of expert e: vector f of the segment is
             * vector v0 + f of the expert's, whose scale is (v0 + f) / 8 (group-128: 8 vectors
             * a scale) or (v0 + f) / nvr */
            const uint32_t seg_end = min(r1, row_start[e + 1]);
            const uint32_t v0 = (r - row_start[e]) * nvr, n_vec = (seg_end - r) * nvr;
            const uint64_t first = (uint64_t)e * capacity * nvr + v0;
            const float *sc_expert = scales + (uint64_t)e * capacity * ns;
            for (uint32_t f0 = 0; f0 < n_vec; f0 += blockDim.x * VPT) {
                uint4 in[VPT];
                float sc[VPT];
#pragma unroll
                for (int j = 0; j < VPT; j++) {
                    const uint32_t f = f0 + (uint32_t)j * blockDim.x + threadIdx.x;
                    if (f < n_vec) {
                        in[j] = q[first + f];
                        sc[j] = sc_expert[per_token ? epd_fast_div_of(v0 + f, row_of) : (v0 + f) / 8];
                    }
                }
#pragma unroll
                for (int j = 0; j < VPT; j++) {
                    const uint32_t f = f0 + (uint32_t)j * blockDim.x + threadIdx.x;
                    if (f < n_vec) q_out[first + f] = epd_dev_requant16(in[j], sc[j], inv);
                }
            }
            r = seg_end;
        }
    }
}

/* ---- layout-aware requantization: tiles of live rows made on the host ---- */

/* The tiles of one launch, in its parameters (constant memory, read with the launch): tile i is
 * rows consecutive rows of one expert from row `first` of the layout, packed in one word as
 * first << rbits | (rows - 1) (rbits: the bits of rows per tile - 1, a launch argument). TABLE is
 * the most a launch holds; sizes from 64 to 4096 tiles, so a launch carries at most twice the
 * bytes its tiles need: without a graph the parameters travel with the launch, and each KB of
 * them cost the event-timed launch about 0.1 us (docs/notes/kernels.md). */
template <int TABLE>
struct requant_tiles {
    uint32_t tile[TABLE];
};

/* S over the tiles' scales: one atomicMax a block into *out (zeroed before). The requant kernel
 * behind it is a programmatic dependent launch, released once every block has loaded. */
template <int TABLE>
__global__ void scale_max_tiles_kernel(const float *__restrict__ scales, uint32_t n_tiles,
                                       uint32_t ns, uint32_t rbits, float *out,
                                       const __grid_constant__ requant_tiles<TABLE> tiles)
{
    __shared__ float red[32];
    const uint32_t rmask = (1u << rbits) - 1u;
    float m = 0.0f;
    for (uint32_t t = blockIdx.x; t < n_tiles; t += gridDim.x) {
        const uint32_t word = tiles.tile[t];
        const float *s = scales + (uint64_t)(word >> rbits) * ns;
        const uint32_t n = ((word & rmask) + 1u) * ns;
        for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, __ldg(s + i));
    }
    asm volatile("griddepcontrol.launch_dependents;");
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (uint32_t k = 1; k < blockDim.x / 32; k++) m = fmaxf(m, red[k]);
        if (m > 0.0f) atomicMax(reinterpret_cast<unsigned int *>(out), __float_as_uint(m));
    }
}

/* Block b does tiles b, b + gridDim.x, ...; a tile's rows are one contiguous run of one expert,
 * so vector f of it has the scale f / 8 (group-128: 8 vectors a scale) or f / nvr of the tile's
 * first scale. Nothing is read before the first loads of the data: the tile comes with the
 * launch, and so does 1/S when S is given (given_inv: the host's IEEE division, the same bits as
 * __fdiv_rn). STEP: S is the reduction's, read from *s_dev after the first pass's loads are
 * issued (griddepcontrol.wait: the reduction grid is complete). */
template <int VPT, int TABLE, bool STEP>
__global__ void requant_live_kernel(const uint4 *q, const float *__restrict__ scales,
                                    uint32_t n_tiles, uint32_t nvr, epd_fast_div row_of,
                                    uint32_t ns, int per_token, uint32_t rbits, float given_inv,
                                    const float *s_dev, uint4 *q_out,
                                    const __grid_constant__ requant_tiles<TABLE> tiles)
{
    const uint32_t rmask = (1u << rbits) - 1u;
    float inv = given_inv;
    bool have_s = !STEP;
    for (uint32_t t = blockIdx.x; t < n_tiles; t += gridDim.x) {
        const uint32_t word = tiles.tile[t], row0 = word >> rbits;
        const uint64_t first = (uint64_t)row0 * nvr;
        const uint32_t n_vec = ((word & rmask) + 1u) * nvr;
        const float *sc_tile = scales + (uint64_t)row0 * ns;
        for (uint32_t f0 = 0; f0 < n_vec; f0 += blockDim.x * VPT) {
            uint4 in[VPT];
            float sc[VPT];
#pragma unroll
            for (int j = 0; j < VPT; j++) {
                const uint32_t f = f0 + (uint32_t)j * blockDim.x + threadIdx.x;
                if (f < n_vec) {
                    in[j] = q[first + f];
                    sc[j] = sc_tile[per_token ? epd_fast_div_of(f, row_of) : f / 8];
                }
            }
            if (STEP && !have_s) {
                asm volatile("griddepcontrol.wait;" ::: "memory");
                const float big_s = *s_dev;
                inv = big_s > 0.0f ? __fdiv_rn(1.0f, big_s) : 0.0f; /* as the host's */
                have_s = true;
            }
#pragma unroll
            for (int j = 0; j < VPT; j++) {
                const uint32_t f = f0 + (uint32_t)j * blockDim.x + threadIdx.x;
                if (f < n_vec) q_out[first + f] = epd_dev_requant16(in[j], sc[j], inv);
            }
        }
    }
}

/* ---- layout-aware requantization, the part kernel (split tiles, variants) ---- */

/* q loads and q_out stores of the part kernel: plain, or (nc) through the read-only path without
 * L1 allocation (never in place: the launcher clears the bit when q_out == q), (cs) streaming. */
__device__ __forceinline__ uint4 part_load(const uint4 *p, bool nc)
{
    uint4 v;
    if (nc)
        asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
            : "l"(p));
    else
        v = *p;
    return v;
}

__device__ __forceinline__ void part_store(uint4 *p, uint4 v, bool cs)
{
    if (cs)
        asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
                     "r"(v.z), "r"(v.w)
                     : "memory");
    else
        *p = v;
}

/* The items of a part-kernel launch: tiles are in the table in order of their parts, most first,
 * and items start[p] .. start[p + 1] - 1 are part p (rows p x rows_per_part ..) of tiles 0 ..
 * start[p + 1] - start[p] - 1: every item has rows, whatever the counts (a short tile has fewer
 * parts, and no block is given an empty one). */
struct requant_parts {
    uint32_t start[EPD_REQUANT_MAX_PARTS + 1];
};

/* Where a block is in its work: item `item` (of part `part`), its vectors first .. first + n_vec,
 * the pass at f0. */
struct part_cursor {
    uint32_t item, part, f0, n_vec;
    uint64_t first;
    const float *sc; /* the scales of the part's first row */
};

/* The part kernel: block b does items b, b + gridDim.x, ... (requant_parts), pass after pass
 * of blockDim.x x VPT vectors; a part is whole rows, so vector f of it has the scale
 * f / 8 (group-128) or f / nvr of its first row, as in requant_live_kernel. PIPE: the loads of
 * the block's next pass (of this part or its next one) leave before this pass's math and stores,
 * so a thread keeps 2 x VPT loads in flight while it works. STEP as requant_live_kernel. */
template <int VPT, int TABLE, bool STEP, bool PIPE>
__global__ void requant_part_kernel(const uint4 *q, const float *__restrict__ scales,
                                    uint32_t n_items, uint32_t n_parts, uint32_t rows_per_part,
                                    uint32_t nvr, epd_fast_div row_of, uint32_t ns, int per_token,
                                    uint32_t rbits, float given_inv, const float *s_dev,
                                    uint4 *q_out, uint32_t flags,
                                    const __grid_constant__ requant_parts parts,
                                    const __grid_constant__ requant_tiles<TABLE> tiles)
{
    const uint32_t rmask = (1u << rbits) - 1u, pass = blockDim.x * VPT;
    const bool nc = (flags & EPD_QL_NC) != 0, cs = (flags & EPD_QL_CS) != 0;
    /* item `it` (false: past the last); its part p: the largest with start[p] <= it, searched
     * from c.part on (a block's items only go up), the part after it tried first */
    auto find = [&](part_cursor &c, uint32_t it) -> bool {
        if (it >= n_items) return false;
        uint32_t p = c.part, hi = n_parts - 1;
        if (p < hi && parts.start[p + 1] > it) hi = p;
        while (p < hi) {
            const uint32_t mid = (p + hi + 1) / 2;
            if (parts.start[mid] <= it) p = mid;
            else hi = mid - 1;
        }
        const uint32_t word = tiles.tile[it - parts.start[p]], rows = (word & rmask) + 1u;
        const uint32_t r0 = p * rows_per_part, r1 = min(r0 + rows_per_part, rows);
        const uint32_t row = (word >> rbits) + r0;
        c.item = it;
        c.part = p;
        c.f0 = 0;
        c.n_vec = (r1 - r0) * nvr;
        c.first = (uint64_t)row * nvr;
        c.sc = scales + (uint64_t)row * ns;
        return true;
    };
    /* (one branch a pass on nc, not one a vector, so that the pass's loads leave together) */
    auto load = [&](const part_cursor &c, uint4 *in, float *sc) {
        const uint32_t f0 = c.f0 + threadIdx.x;
        if (nc) {
#pragma unroll
            for (int j = 0; j < VPT; j++)
                if (f0 + (uint32_t)j * blockDim.x < c.n_vec)
                    in[j] = part_load(q + c.first + f0 + (uint32_t)j * blockDim.x, true);
        } else {
#pragma unroll
            for (int j = 0; j < VPT; j++)
                if (f0 + (uint32_t)j * blockDim.x < c.n_vec)
                    in[j] = part_load(q + c.first + f0 + (uint32_t)j * blockDim.x, false);
        }
#pragma unroll
        for (int j = 0; j < VPT; j++) {
            const uint32_t f = f0 + (uint32_t)j * blockDim.x;
            if (f < c.n_vec) sc[j] = __ldg(c.sc + (per_token ? epd_fast_div_of(f, row_of) : f / 8));
        }
    };
    part_cursor c;
    c.part = 0;
    if (!find(c, blockIdx.x)) return;
    uint4 in[VPT], in2[VPT];
    float sc[VPT], sc2[VPT];
    float inv = given_inv;
    load(c, in, sc);
    if (STEP) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        const float big_s = *s_dev;
        inv = big_s > 0.0f ? __fdiv_rn(1.0f, big_s) : 0.0f; /* as the host's */
    }
    for (;;) {
        part_cursor d = c;
        d.f0 += pass;
        const bool more = d.f0 < d.n_vec || find(d, d.item + gridDim.x);
        if (PIPE && more) load(d, in2, sc2);
        const uint32_t f0 = c.f0 + threadIdx.x;
#pragma unroll
        for (int j = 0; j < VPT; j++)
            if (f0 + (uint32_t)j * blockDim.x < c.n_vec)
                in[j] = epd_dev_requant16(in[j], sc[j], inv);
        if (cs) {
#pragma unroll
            for (int j = 0; j < VPT; j++)
                if (f0 + (uint32_t)j * blockDim.x < c.n_vec)
                    part_store(q_out + c.first + f0 + (uint32_t)j * blockDim.x, in[j], true);
        } else {
#pragma unroll
            for (int j = 0; j < VPT; j++)
                if (f0 + (uint32_t)j * blockDim.x < c.n_vec)
                    part_store(q_out + c.first + f0 + (uint32_t)j * blockDim.x, in[j], false);
        }
        if (!more) break;
        if (PIPE) {
#pragma unroll
            for (int j = 0; j < VPT; j++) {
                in[j] = in2[j];
                sc[j] = sc2[j];
            }
        } else {
            load(d, in, sc);
        }
        c = d;
    }
}

/* ---- layout-aware requantization, the stream kernel (EPD_QL_STREAM) ---- */

/* The live rows per expert of a stream launch, in its parameters: end[e] = live rows of experts
 * 0 .. e together (expert e's live rows are rows end[e - 1] .. end[e] - 1 of the sequence of live
 * rows, expert after expert; end[-1] = 0). One word an expert, tables of 64 to 4096 words. */
template <int TABLE>
struct requant_ends {
    uint32_t end[TABLE];
};

/* Where a block of the stream kernel is: the pass at f0 of the run of expert e that ends (for
 * this block) at `end`; flat vector f of that run is vector f of qs and its scale is
 * sc[f / 8] (group-128) or sc[f / nvr] (per token): qs and sc are the expert's q and scales moved
 * back by the live rows before it, so that the flat index (live rows before it included) needs no
 * subtraction. */
struct stream_cursor {
    uint32_t f0, end, e;
    const uint4 *qs;
    uint4 *qo;
    const float *sc;
};

/* The stream kernel: the live rows' vectors, expert after expert, are one flat sequence (a live
 * row is nvr vectors; group-128 has a scale every 8 vectors, nvr a multiple of 8), and block b
 * does the contiguous chunk b x chunk .. (b + 1) x chunk - 1 of it: every block the same bytes
 * whatever the counts, a grid of the blocks that are resident at once (no second round, no tail
 * of short blocks), and no table entry a block: the block finds its first expert from the
 * experts' ends before the first loads. A run of one expert is one contiguous range of q,
 * walked in passes of blockDim.x x VPT vectors (all VPT loads of a thread leave before the
 * first is used). PIPE: the next pass's loads leave before this pass's math and stores (2 x VPT
 * in flight a thread). flags: EPD_QL_NC, EPD_QL_CS as in the part kernel. STEP as
 * requant_live_kernel. */
template <int VPT, int TABLE, bool STEP, bool PIPE>
__global__ void requant_stream_kernel(const uint4 *q, const float *__restrict__ scales,
                                      uint32_t n_experts, uint32_t capacity, uint32_t total_vec,
                                      uint32_t chunk, uint32_t nvr, epd_fast_div row_of,
                                      uint32_t ns, int per_token, float given_inv,
                                      const float *s_dev, uint4 *q_out, uint32_t flags,
                                      const __grid_constant__ requant_ends<TABLE> ends)
{
    const uint32_t x0 = blockIdx.x * chunk; /* the launcher keeps grid x chunk below 2^32 */
    if (x0 >= total_vec) return;
    const uint32_t x1 = min(x0 + chunk, total_vec), pass = blockDim.x * VPT;
    const bool nc = (flags & EPD_QL_NC) != 0, cs = (flags & EPD_QL_CS) != 0;
    /* the run of expert e from flat vector `from` (< its end): pointers moved back by the live
     * rows before it (start <= e x capacity, so they stay within the layout's rows) */
    auto enter = [&](stream_cursor &c, uint32_t e, uint32_t from) {
        const uint32_t start = e > 0 ? ends.end[e - 1] : 0u;
        const uint64_t back = (uint64_t)e * capacity - start; /* rows */
        c.e = e;
        c.f0 = from;
        c.end = min(x1, ends.end[e] * nvr);
        c.qs = q + back * nvr;
        c.qo = q_out + back * nvr;
        c.sc = scales + back * ns;
    };
    /* the next pass: on in this run, else the next expert with live rows (false: chunk done) */
    auto next = [&](stream_cursor &c) -> bool {
        const uint32_t f = c.f0 + pass;
        if (f < c.end) {
            c.f0 = f;
            return true;
        }
        if (c.end >= x1) return false;
        uint32_t e = c.e + 1;
        while (ends.end[e] * nvr <= c.end) e++; /* experts without live rows */
        enter(c, e, c.end);
        return true;
    };
    auto load = [&](const stream_cursor &c, uint4 *in, float *sc) {
        const uint32_t f0 = c.f0 + threadIdx.x;
        if (nc) {
#pragma unroll
            for (int j = 0; j < VPT; j++)
                if (f0 + (uint32_t)j * blockDim.x < c.end)
                    in[j] = part_load(c.qs + f0 + (uint32_t)j * blockDim.x, true);
        } else {
#pragma unroll
            for (int j = 0; j < VPT; j++)
                if (f0 + (uint32_t)j * blockDim.x < c.end)
                    in[j] = part_load(c.qs + f0 + (uint32_t)j * blockDim.x, false);
        }
#pragma unroll
        for (int j = 0; j < VPT; j++) {
            const uint32_t f = f0 + (uint32_t)j * blockDim.x;
            if (f < c.end) sc[j] = __ldg(c.sc + (per_token ? epd_fast_div_of(f, row_of) : f >> 3));
        }
    };
    /* the expert of x0: the first e whose end is past x0's row, i.e. the number of experts whose
     * end is not (the ends only go up). Up to 8 x blockDim.x experts, counted a word a thread:
     * their loads leave together (one miss of the constant cache's lines, not one a step of a
     * binary search, ~log2(experts) dependent misses before the first data load), and the table
     * is then in the cache for the runs after; more experts: a binary search. */
    const uint32_t row0 = epd_fast_div_of(x0, row_of);
    const uint32_t rounds = (n_experts + blockDim.x - 1) / blockDim.x;
    uint32_t lo = 0;
    if (rounds <= 8) {
        for (uint32_t r = 0; r < rounds; r++) {
            const uint32_t k = r * blockDim.x + threadIdx.x;
            lo += (uint32_t)__syncthreads_count(k < n_experts && ends.end[k] <= row0);
        }
    } else {
        uint32_t hi = n_experts - 1;
        while (lo < hi) {
            const uint32_t mid = (lo + hi) / 2;
            if (ends.end[mid] > row0) hi = mid;
            else lo = mid + 1;
        }
    }
    stream_cursor c;
    enter(c, lo, x0);
    uint4 in[VPT], in2[VPT];
    float sc[VPT], sc2[VPT];
    float inv = given_inv;
    load(c, in, sc);
    if (STEP) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        const float big_s = *s_dev;
        inv = big_s > 0.0f ? __fdiv_rn(1.0f, big_s) : 0.0f; /* as the host's */
    }
    for (;;) {
        stream_cursor d = c;
        const bool more = next(d);
        if (PIPE && more) load(d, in2, sc2);
        const uint32_t f0 = c.f0 + threadIdx.x;
#pragma unroll
        for (int j = 0; j < VPT; j++) {
            if (f0 + (uint32_t)j * blockDim.x < c.end)
                in[j] = epd_dev_requant16(in[j], sc[j], inv);
        }
        if (cs) {
#pragma unroll
            for (int j = 0; j < VPT; j++)
                if (f0 + (uint32_t)j * blockDim.x < c.end)
                    part_store(c.qo + f0 + (uint32_t)j * blockDim.x, in[j], true);
        } else {
#pragma unroll
            for (int j = 0; j < VPT; j++)
                if (f0 + (uint32_t)j * blockDim.x < c.end)
                    part_store(c.qo + f0 + (uint32_t)j * blockDim.x, in[j], false);
        }
        if (!more) break;
        if (PIPE) {
#pragma unroll
            for (int j = 0; j < VPT; j++) {
                in[j] = in2[j];
                sc[j] = sc2[j];
            }
        } else {
            load(d, in, sc);
        }
        c = d;
    }
}

/* ---- layout-aware requantization, the grid kernel (EPD_QL_GRID) ---- */

/* The live rows of a grid launch as runs: the experts with live rows, in order. Flat vectors
 * end[k - 1] .. end[k] - 1 of the sequence of live vectors (end[-1] = 0) are run k's, and flat
 * vector f of run k lies at vector f + back[k] of the layout (back[k]: the layout's vectors
 * before the run's expert's first row, less the live vectors before the run). first[b] is the
 * run of flat vector b << shift, so that a vector's run is a table look-up and a step or two
 * on. RUNS is the most a launch holds, RUNS buckets too (10 bytes a run: the parameters travel
 * with each launch). */
template <int RUNS>
struct requant_runs {
    uint32_t end[RUNS];
    uint32_t back[RUNS];
    uint16_t first[RUNS];
};

/* The grid kernel: the copy kernel's shape over the live vectors. Thread t of block b does flat
 * vectors (b x blockDim.x x VPT + t) + j x blockDim.x for j < VPT, then the same a grid further
 * on: at any moment the grid works on one dense window of the live vectors, every block the same
 * number of vectors. Each vector's address comes from its run (requant_runs); a pass's VPT loads
 * (indices clamped to the last vector, so that none waits on a branch) leave before the first
 * is used; the stores of the clamped ones are skipped. Group-128 scale of layout vector a:
 * scales[a / 8] (a row is ns x 8 vectors); per token: scales[a / nvr]. flags: EPD_QL_NC,
 * EPD_QL_CS as in the part kernel. STEP as requant_live_kernel. */
template <int VPT, int RUNS, bool STEP>
__global__ void requant_grid_kernel(const uint4 *q, const float *__restrict__ scales,
                                    uint32_t total_vec, uint32_t shift, epd_fast_div row_of,
                                    int per_token, float given_inv, const float *s_dev,
                                    uint4 *q_out, uint32_t flags, uint32_t keep,
                                    const __grid_constant__ requant_runs<RUNS> runs)
{
    const uint32_t pass = gridDim.x * blockDim.x * VPT; /* < 2^31 (the launcher) */
    const bool nc = (flags & EPD_QL_NC) != 0, cs = (flags & EPD_QL_CS) != 0;
    float inv = given_inv;
    bool have_s = !STEP;
    for (uint32_t i0 = blockIdx.x * blockDim.x * VPT + threadIdx.x; i0 < total_vec; i0 += pass) {
        uint32_t at[VPT];
#pragma unroll
        for (int j = 0; j < VPT; j++) {
            uint32_t f = i0 + (uint32_t)j * blockDim.x;
            f = f < total_vec ? f : total_vec - 1u;
            uint32_t k = runs.first[f >> shift];
            while (runs.end[k] <= f) k++;
            at[j] = f + runs.back[k];
        }
        uint4 in[VPT];
        float sc[VPT];
        if (nc) {
#pragma unroll
            for (int j = 0; j < VPT; j++) in[j] = part_load(q + at[j], true);
        } else {
#pragma unroll
            for (int j = 0; j < VPT; j++) in[j] = part_load(q + at[j], false);
        }
#pragma unroll
        for (int j = 0; j < VPT; j++)
            sc[j] = __ldg(scales + (per_token ? epd_fast_div_of(at[j], row_of) : at[j] >> 3));
        /* Left alone, ptxas issues the later loads after the first vector's math (a load's
         * latency a vector, measured). The first vector's word and scale take a byte permute with
         * each later load whose selector, keep = 0x3210 from the launch, keeps their own bytes:
         * no change, but ptxas cannot see that, so every load leaves before any math. */
#pragma unroll
        for (int j = 1; j < VPT; j++) {
            in[0].x = __byte_perm(in[0].x, in[j].x, keep);
            sc[0] = __uint_as_float(
                __byte_perm(__float_as_uint(sc[0]), __float_as_uint(sc[j]), keep));
        }
        if (STEP && !have_s) {
            asm volatile("griddepcontrol.wait;" ::: "memory");
            const float big_s = *s_dev;
            inv = big_s > 0.0f ? __fdiv_rn(1.0f, big_s) : 0.0f; /* as the host's */
            have_s = true;
        }
#pragma unroll
        for (int j = 0; j < VPT; j++) in[j] = epd_dev_requant16(in[j], sc[j], inv);
        if (cs) {
#pragma unroll
            for (int j = 0; j < VPT; j++)
                if (i0 + (uint32_t)j * blockDim.x < total_vec)
                    part_store(q_out + at[j], in[j], true);
        } else {
#pragma unroll
            for (int j = 0; j < VPT; j++)
                if (i0 + (uint32_t)j * blockDim.x < total_vec)
                    part_store(q_out + at[j], in[j], false);
        }
    }
}

/* ---- launchers ---- */

static epd_status_t launch_result(const char *what, char err[EPD_ERR_LEN])
{
    cudaError_t rc = cudaGetLastError();
    if (rc == cudaSuccess) return EPD_OK;
    snprintf(err, EPD_ERR_LEN, "%s: kernel launch failed: %s", what, cudaGetErrorString(rc));
    return EPD_ERR_CUDA;
}

static epd_status_t bad_arg(char err[EPD_ERR_LEN], const char *msg)
{
    snprintf(err, EPD_ERR_LEN, "%s", msg);
    return EPD_ERR_INVALID_ARG;
}

static bool aligned16(const void *p)
{
    return ((uintptr_t)p & 15u) == 0;
}

/* The SM count of the current device, read from it (the launch picker and grid sizes use it). */
static epd_status_t device_sms(uint32_t *sms_p, char err[EPD_ERR_LEN])
{
    int dev = 0, sms = 0;
    cudaError_t rc = cudaGetDevice(&dev);
    if (rc == cudaSuccess) rc = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (rc != cudaSuccess) {
        snprintf(err, EPD_ERR_LEN, "querying the device: %s", cudaGetErrorString(rc));
        return EPD_ERR_CUDA;
    }
    *sms_p = (uint32_t)sms;
    return EPD_OK;
}

static epd_status_t pick_launch(epd_quant_kernel_t kernel, uint32_t hidden, uint32_t rows,
                                const epd_quant_launch_t *given, epd_quant_launch_t *l,
                                char err[EPD_ERR_LEN])
{
    if (given != NULL) {
        *l = *given;
    } else {
        uint32_t sms = 0;
        epd_status_t status = device_sms(&sms, err);
        if (status != EPD_OK) return status;
        *l = epd_quant_launch_pick(kernel, hidden, rows, sms);
    }
    return epd_quant_launch_check(kernel, hidden, l, err);
}

/* Blocks of `kernel` the whole device holds at once (a grid-stride kernel's grid), at most
 * max_per_sm on each SM (0: no limit). */
static epd_status_t device_blocks(const void *kernel, uint32_t threads, size_t smem,
                                  uint32_t max_per_sm, uint32_t *blocks_p, char err[EPD_ERR_LEN])
{
    uint32_t sms = 0;
    int per_sm = 0;
    epd_status_t status = device_sms(&sms, err);
    if (status != EPD_OK) return status;
    cudaError_t rc = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, (int)threads, smem);
    if (rc != cudaSuccess) {
        snprintf(err, EPD_ERR_LEN, "querying the device: %s", cudaGetErrorString(rc));
        return EPD_ERR_CUDA;
    }
    if (per_sm == 0) {
        snprintf(err, EPD_ERR_LEN, "%u threads a block do not fit an SM with this kernel's "
                 "registers (fewer threads, or fewer vectors a thread)", threads);
        return EPD_ERR_INVALID_ARG;
    }
    if (max_per_sm != 0 && (uint32_t)per_sm > max_per_sm) per_sm = (int)max_per_sm;
    *blocks_p = sms * (uint32_t)per_sm;
    return EPD_OK;
}

/* The launch of a requant kernel on st: grid x threads blocks, smem bytes of dynamic shared
 * memory, and, when behind (the step scale's reduction was queued just before it), a programmatic
 * dependent launch: its blocks start while the reduction ends and wait for it where they read S.
 * cfg points into the object, so it is made where it is used and never copied. */
struct requant_launch {
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute attr[1];
    requant_launch(uint32_t grid, uint32_t threads, size_t smem, cudaStream_t st, bool behind)
        : cfg(), attr()
    {
        cfg.gridDim = dim3(grid);
        cfg.blockDim = dim3(threads);
        cfg.dynamicSmemBytes = smem;
        cfg.stream = st;
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = behind ? 1 : 0;
    }
    requant_launch(const requant_launch &) = delete;
    requant_launch &operator=(const requant_launch &) = delete;
};

extern "C" epd_status_t epd_quant_cuda(const uint16_t *x, uint32_t rows, uint32_t hidden,
                                       size_t x_stride, epd_scale_kind_t kind, epd_scale_fmt_t fmt,
                                       uint8_t *q, size_t q_stride, float *scales,
                                       size_t scale_stride, const epd_quant_launch_t *launch,
                                       void *stream, char err[EPD_ERR_LEN])
{
    epd_status_t status;
    epd_quant_launch_t l;
    cudaStream_t st = (cudaStream_t)stream;
    CHECK_GOTO(epd_quant_check(hidden, kind, fmt, err), out);
    if (rows == 0) return EPD_OK;
    if (x_stride == 0) x_stride = hidden;
    if (q_stride == 0) q_stride = hidden;
    if (scale_stride == 0) scale_stride = epd_quant_n_scales(hidden, kind);
    if (!x || !q || !scales) return bad_arg(err, "quantize: a NULL buffer");
    if (!aligned16(x) || !aligned16(q) || (x_stride * 2) % 16 || q_stride % 16)
        return bad_arg(err, "quantize: x, q and their row strides must be 16-byte aligned");
    if (x_stride < hidden || q_stride < hidden || scale_stride < epd_quant_n_scales(hidden, kind))
        return bad_arg(err, "quantize: a row stride is shorter than a row");
    {
        const int ue8m0 = fmt == EPD_SCALE_FMT_UE8M0;
        if (kind == EPD_SCALE_PER_TOKEN) {
            CHECK_GOTO(pick_launch(EPD_QK_QUANT_TOKEN, hidden, rows, launch, &l, err), out);
            const uint32_t lanes = l.threads / l.rows, nv = hidden / 8;
            const uint32_t blocks = (uint32_t)(((uint64_t)rows + l.rows - 1) / l.rows);
            const size_t smem = l.threads / 32 * sizeof(float);
#define EPD_TOKEN_CASE(V)                                                                         \
    case V:                                                                                       \
        quant_token_kernel<V><<<blocks, l.threads, smem, st>>>(x, rows, nv, x_stride, q, q_stride, \
                                                               scales, scale_stride, lanes, ue8m0); \
        break
            switch (l.vec) {
                EPD_TOKEN_CASE(0);
                EPD_TOKEN_CASE(1);
                EPD_TOKEN_CASE(2);
                EPD_TOKEN_CASE(4);
                EPD_TOKEN_CASE(8);
                EPD_TOKEN_CASE(16);
                EPD_TOKEN_CASE(32);
            }
#undef EPD_TOKEN_CASE
        } else {
            CHECK_GOTO(pick_launch(EPD_QK_QUANT_GROUP, hidden, rows, launch, &l, err), out);
            const uint32_t gpr = hidden / EPD_QUANT_GROUP, g = l.rows > 1 ? l.rows : 1;
            const uint64_t n_sets = ((uint64_t)rows * gpr + g - 1) / g;
            const uint64_t blocks = (n_sets * (16 / l.vec) + l.threads - 1) / l.threads;
            if (blocks > 0x7fffffffull) return bad_arg(err, "quantize: too many rows for one launch");
#define EPD_GROUP_CASE(V, G)                                                                  \
    case V * 8 + G:                                                                           \
        quant_group_kernel<V, G><<<(unsigned)blocks, l.threads, 0, st>>>(                     \
            x, rows, gpr, x_stride, q, q_stride, scales, scale_stride, ue8m0);                \
        break
            switch (l.vec * 8 + g) {
                EPD_GROUP_CASE(1, 1);
                EPD_GROUP_CASE(1, 2);
                EPD_GROUP_CASE(1, 4);
                EPD_GROUP_CASE(2, 1);
                EPD_GROUP_CASE(2, 2);
                EPD_GROUP_CASE(2, 4);
                EPD_GROUP_CASE(4, 1);
                EPD_GROUP_CASE(4, 2);
                EPD_GROUP_CASE(4, 4);
            }
#undef EPD_GROUP_CASE
        }
    }
    return launch_result("quantize", err);
out:
    return status;
}

template <typename Out>
static epd_status_t dequant_launch(const uint8_t *q, const float *scales, uint32_t rows,
                                   uint32_t hidden, epd_scale_kind_t kind, Out *out,
                                   const epd_quant_launch_t *launch, void *stream,
                                   char err[EPD_ERR_LEN])
{
    epd_status_t status;
    epd_quant_launch_t l;
    CHECK_GOTO(epd_quant_check(hidden, kind, EPD_SCALE_FMT_FP32, err), out_label);
    if (rows == 0) return EPD_OK;
    if (!q || !scales || !out) return bad_arg(err, "dequantize: a NULL buffer");
    if (!aligned16(q) || !aligned16(out)) return bad_arg(err, "dequantize: q and out must be 16-byte aligned");
    CHECK_GOTO(pick_launch(EPD_QK_DEQUANT, hidden, rows, launch, &l, err), out_label);
    {
        const uint64_t n_vec = (uint64_t)rows * (hidden / 16);
        const uint64_t per_block = (uint64_t)l.threads * l.vec;
        const uint64_t blocks = (n_vec + per_block - 1) / per_block;
        const uint32_t ns = epd_quant_n_scales(hidden, kind);
        const int per_token = kind == EPD_SCALE_PER_TOKEN;
        cudaStream_t st = (cudaStream_t)stream;
        if (blocks > 0x7fffffffull) return bad_arg(err, "dequantize: too many rows for one launch");
        switch (l.vec) {
        case 1:
            dequant_kernel<1, Out><<<(unsigned)blocks, l.threads, 0, st>>>(q, scales, n_vec,
                                                                            hidden / 16, ns,
                                                                            per_token, out);
            break;
        case 2:
            dequant_kernel<2, Out><<<(unsigned)blocks, l.threads, 0, st>>>(q, scales, n_vec,
                                                                            hidden / 16, ns,
                                                                            per_token, out);
            break;
        case 4:
            dequant_kernel<4, Out><<<(unsigned)blocks, l.threads, 0, st>>>(q, scales, n_vec,
                                                                            hidden / 16, ns,
                                                                            per_token, out);
            break;
        }
    }
    return launch_result("dequantize", err);
out_label:
    return status;
}

extern "C" epd_status_t epd_dequant_cuda(const uint8_t *q, const float *scales, uint32_t rows,
                                         uint32_t hidden, epd_scale_kind_t kind, float *out_f32,
                                         const epd_quant_launch_t *launch, void *stream,
                                         char err[EPD_ERR_LEN])
{
    return dequant_launch<float>(q, scales, rows, hidden, kind, out_f32, launch, stream, err);
}

extern "C" epd_status_t epd_dequant_bf16_cuda(const uint8_t *q, const float *scales, uint32_t rows,
                                              uint32_t hidden, epd_scale_kind_t kind,
                                              uint16_t *out_bf16, const epd_quant_launch_t *launch,
                                              void *stream, char err[EPD_ERR_LEN])
{
    return dequant_launch<uint16_t>(q, scales, rows, hidden, kind, out_bf16, launch, stream, err);
}

static epd_status_t check_grouped(const void *q, const float *scales, const int32_t *counts,
                                  uint32_t n_experts, uint32_t hidden, epd_scale_kind_t kind,
                                  char err[EPD_ERR_LEN])
{
    epd_status_t status = epd_quant_check(hidden, kind, EPD_SCALE_FMT_FP32, err);
    if (status != EPD_OK) return status;
    if (n_experts > EPD_REQUANT_MAX_EXPERTS) {
        snprintf(err, EPD_ERR_LEN, "%u local experts (allowed: up to %d)", n_experts,
                 EPD_REQUANT_MAX_EXPERTS);
        return EPD_ERR_INVALID_ARG;
    }
    if (!q || !scales || !counts) return bad_arg(err, "requantize: a NULL buffer");
    return EPD_OK;
}

extern "C" epd_status_t epd_requant_step_scale_cuda(const float *scales, const int32_t *counts,
                                                    uint32_t n_experts, uint32_t capacity,
                                                    uint32_t hidden, epd_scale_kind_t kind,
                                                    float *scale_dev,
                                                    const epd_quant_launch_t *launch, void *stream,
                                                    char err[EPD_ERR_LEN])
{
    epd_status_t status;
    epd_quant_launch_t l;
    cudaStream_t st = (cudaStream_t)stream;
    CHECK_GOTO(check_grouped(scales, scales, counts, n_experts, hidden, kind, err), out);
    if (!scale_dev) return bad_arg(err, "step scale: NULL output");
    CHECK_GOTO(pick_launch(EPD_QK_SCALE_MAX, hidden, capacity, launch, &l, err), out);
    {
        cudaError_t rc = cudaMemsetAsync(scale_dev, 0, sizeof(float), st);
        if (rc != cudaSuccess) {
            snprintf(err, EPD_ERR_LEN, "step scale: %s", cudaGetErrorString(rc));
            return EPD_ERR_CUDA;
        }
        if (n_experts == 0 || capacity == 0) return EPD_OK;
        const uint32_t ns = epd_quant_n_scales(hidden, kind);
        /* vec (1..16) loads in flight a thread, rounded down to a power of two */
        const uint32_t loads = l.vec >= 16 ? 16 : l.vec >= 8 ? 8 : l.vec >= 4 ? 4 : l.vec >= 2 ? 2 : 1;
        void (*kernel)(const float *, const int32_t *, uint32_t, uint32_t, float *) =
            loads == 16  ? scale_max_kernel<16>
            : loads == 8 ? scale_max_kernel<8>
            : loads == 4 ? scale_max_kernel<4>
            : loads == 2 ? scale_max_kernel<2>
                         : scale_max_kernel<1>;
        const uint64_t per_expert = (uint64_t)capacity * ns, per_block = (uint64_t)l.threads * loads;
        uint64_t bx = (per_expert + per_block - 1) / per_block;
        if (bx > 65535) bx = 65535; /* the kernel strides over the rest */
        kernel<<<dim3((unsigned)bx, n_experts), l.threads, 0, st>>>(scales, counts, capacity, ns,
                                                                    scale_dev);
    }
    return launch_result("step scale", err);
out:
    return status;
}

extern "C" epd_status_t epd_requant_cuda(const uint8_t *q, const float *scales,
                                         const int32_t *counts, uint32_t n_experts,
                                         uint32_t capacity, uint32_t hidden, epd_scale_kind_t kind,
                                         float static_scale, uint8_t *q_out, float *scale_dev,
                                         const epd_quant_launch_t *launch, void *stream,
                                         char err[EPD_ERR_LEN])
{
    epd_status_t status;
    epd_quant_launch_t l;
    cudaStream_t st = (cudaStream_t)stream;
    if (!(static_scale >= 0.0f) || isinf(static_scale)) {
        snprintf(err, EPD_ERR_LEN, "static scale %g is not 0 (none) or a finite positive value",
                 (double)static_scale);
        return EPD_ERR_INVALID_ARG;
    }
    CHECK_GOTO(check_grouped(q, scales, counts, n_experts, hidden, kind, err), out);
    if (!q_out) return bad_arg(err, "requantize: NULL output");
    if (!aligned16(q) || !aligned16(q_out)) return bad_arg(err, "requantize: q and q_out must be 16-byte aligned");
    if (static_scale == 0.0f && !scale_dev)
        return bad_arg(err, "requantize: the step scale needs a device scale output");
    CHECK_GOTO(pick_launch(EPD_QK_REQUANT, hidden, capacity, launch, &l, err), out);
    if ((uint64_t)l.rows * (hidden / 16) > 0x7fffffffull)
        return bad_arg(err, "requantize: rows per tile x hidden too large for one tile");
    if ((uint64_t)capacity * (hidden / 16) > 0xffffffffull)
        return bad_arg(err, "requantize: capacity x hidden too large (64 GiB per expert)");
    if ((uint64_t)n_experts * capacity > 0x7fffffffull)
        return bad_arg(err, "requantize: experts x capacity too large (2^31 rows)");
    if (static_scale == 0.0f)
        CHECK_GOTO(epd_requant_step_scale_cuda(scales, counts, n_experts, capacity, hidden, kind,
                                               scale_dev, NULL, stream, err), out);
    {
        const size_t smem = ((size_t)n_experts + 1) * sizeof(uint32_t);
        const uint32_t ns = epd_quant_n_scales(hidden, kind);
        const int per_token = kind == EPD_SCALE_PER_TOKEN;
        const float *s_dev = static_scale > 0.0f ? nullptr : scale_dev;
        void (*kernel)(const uint4 *, const float *, const int32_t *, uint32_t, uint32_t, uint32_t,
                       epd_fast_div, uint32_t, int, uint32_t, float, const float *, float *,
                       uint4 *) =
            l.vec == 1   ? requant_kernel<1>
            : l.vec == 2 ? requant_kernel<2>
                         : requant_kernel<4>;
        uint32_t resident;
        CHECK_GOTO(device_blocks((const void *)kernel, l.threads, smem, l.blocks, &resident, err), out);
        const uint64_t max_tiles = ((uint64_t)n_experts * capacity + l.rows - 1) / l.rows;
        const uint32_t grid = (uint32_t)(max_tiles < resident ? (max_tiles ? max_tiles : 1)
                                                               : resident);
        requant_launch rl(grid, l.threads, smem, st, s_dev != nullptr); /* behind the step scale */
        /* a failed launch is also the last error, which launch_result reports and clears */
        (void)cudaLaunchKernelEx(&rl.cfg, kernel, reinterpret_cast<const uint4 *>(q), scales,
                                 counts, n_experts, capacity, hidden / 16,
                                 epd_fast_div_make(hidden / 16), ns, per_token, l.rows,
                                 static_scale, s_dev, scale_dev, reinterpret_cast<uint4 *>(q_out));
    }
    return launch_result("requantize", err);
out:
    return status;
}

/* The kernel of a layout-aware launch: vec x table size x step scale. */
template <int TABLE>
static void (*live_kernel(uint32_t vec, bool step))(const uint4 *, const float *, uint32_t, uint32_t,
                                                    epd_fast_div, uint32_t, int, uint32_t, float,
                                                    const float *, uint4 *,
                                                    const requant_tiles<TABLE>)
{
    if (step)
        return vec == 1 ? requant_live_kernel<1, TABLE, true>
             : vec == 2 ? requant_live_kernel<2, TABLE, true>
                        : requant_live_kernel<4, TABLE, true>;
    return vec == 1 ? requant_live_kernel<1, TABLE, false>
         : vec == 2 ? requant_live_kernel<2, TABLE, false>
                    : requant_live_kernel<4, TABLE, false>;
}

/* The part kernel of a launch: vec x table size x step scale x pipelined. */
template <int TABLE>
static void (*part_kernel(uint32_t vec, bool step, bool pipe))(
    const uint4 *, const float *, uint32_t, uint32_t, uint32_t, uint32_t, epd_fast_div, uint32_t,
    int, uint32_t, float, const float *, uint4 *, uint32_t, const requant_parts,
    const requant_tiles<TABLE>)
{
#define EPD_PART_KERNEL(S, P)                                                                  \
    return vec == 1 ? requant_part_kernel<1, TABLE, S, P>                                       \
         : vec == 2 ? requant_part_kernel<2, TABLE, S, P>                                       \
                    : requant_part_kernel<4, TABLE, S, P>
    if (step && pipe) EPD_PART_KERNEL(true, true);
    if (step) EPD_PART_KERNEL(true, false);
    if (pipe) EPD_PART_KERNEL(false, true);
    EPD_PART_KERNEL(false, false);
#undef EPD_PART_KERNEL
}

/* The tiles of a layout as made by epd_requant_tiles_make, before they are packed. */
struct requant_tile_list {
    uint32_t first[EPD_REQUANT_LIVE_TILES];
    uint16_t rows[EPD_REQUANT_LIVE_TILES];
};

/* Queues the step scale's reduction over the packed tiles (rbits bits for rows - 1) into
 * *scale_dev, which it zeroes first. */
template <int TABLE>
static epd_status_t step_reduce(const requant_tiles<TABLE> &tiles, uint32_t n_tiles,
                                uint32_t rbits, const float *scales, uint32_t ns, float *scale_dev,
                                cudaStream_t st, char err[EPD_ERR_LEN])
{
    uint32_t sms = 0;
    epd_status_t status = device_sms(&sms, err);
    if (status != EPD_OK) return status;
    cudaError_t rc = cudaMemsetAsync(scale_dev, 0, sizeof(float), st);
    if (rc != cudaSuccess) {
        snprintf(err, EPD_ERR_LEN, "step scale: %s", cudaGetErrorString(rc));
        return EPD_ERR_CUDA;
    }
    /* a block a tile up to 8 an SM: each reads its tiles' scales once */
    const uint32_t grid = n_tiles < sms * 8 ? n_tiles : sms * 8;
    scale_max_tiles_kernel<TABLE><<<grid, 128, 0, st>>>(scales, n_tiles, ns, rbits, scale_dev,
                                                        tiles);
    return launch_result("step scale", err);
}

/* Queues the reduction (step) and the requant of the n_tiles tiles of all (TABLE >= n_tiles),
 * packed with rbits bits for rows - 1, tiles of up to rows_per_tile rows. The part kernel when
 * l asks for parts or a variant (l.split > 1 or l.flags), else requant_live_kernel. */
template <int TABLE>
static epd_status_t live_queue(const requant_tile_list &all, uint32_t n_tiles, uint32_t rbits,
                               uint32_t rows_per_tile, const uint8_t *q, const float *scales,
                               uint32_t hidden, epd_scale_kind_t kind, float scale,
                               uint8_t *q_out, float *scale_dev, const epd_quant_launch_t &l,
                               cudaStream_t st, char err[EPD_ERR_LEN])
{
    epd_status_t status;
    requant_tiles<TABLE> tiles;
    const bool step = scale_dev != nullptr;
    const uint32_t ns = epd_quant_n_scales(hidden, kind), nvr = hidden / 16;
    const bool part = l.split > 1 || l.flags != 0;
    requant_parts parts = {};
    uint32_t n_parts = 1, rows_per_part = rows_per_tile;
    if (part) {
        /* parts of ceil(l.rows / split) rows, as many a tile as its rows need (more rows a part
         * when epd_requant_tiles_make made the tiles longer to fit the table) */
        const uint32_t want = l.split > 1 ? l.split : 1;
        rows_per_part = (l.rows + want - 1) / want;
        n_parts = (rows_per_tile + rows_per_part - 1) / rows_per_part;
        if (n_parts > EPD_REQUANT_MAX_PARTS) {
            rows_per_part = (rows_per_tile + EPD_REQUANT_MAX_PARTS - 1) / EPD_REQUANT_MAX_PARTS;
            n_parts = (rows_per_tile + rows_per_part - 1) / rows_per_part;
        }
        /* the tiles in order of their parts, most first (a counting sort), and where each
         * part's items start */
        uint32_t count[EPD_REQUANT_MAX_PARTS + 1] = {0}, at[EPD_REQUANT_MAX_PARTS + 1];
        for (uint32_t i = 0; i < n_tiles; i++)
            count[(all.rows[i] + rows_per_part - 1) / rows_per_part]++;
        at[n_parts] = 0;
        for (uint32_t k = n_parts; k > 1; k--) at[k - 1] = at[k] + count[k];
        for (uint32_t i = 0; i < n_tiles; i++)
            tiles.tile[at[(all.rows[i] + rows_per_part - 1) / rows_per_part]++] =
                all.first[i] << rbits | (all.rows[i] - 1u);
        uint32_t with = n_tiles; /* tiles with more than p parts */
        for (uint32_t p = 0; p < n_parts; p++) {
            parts.start[p + 1] = parts.start[p] + with;
            with -= count[p + 1];
        }
    } else {
        for (uint32_t i = 0; i < n_tiles; i++)
            tiles.tile[i] = all.first[i] << rbits | (all.rows[i] - 1u);
    }
    for (uint32_t i = n_tiles; i < (uint32_t)TABLE; i++) tiles.tile[i] = 0; /* never read */
    if (step)
        CHECK_GOTO(step_reduce<TABLE>(tiles, n_tiles, rbits, scales, ns, scale_dev, st, err), out);
    if (part) {
        const uint32_t n_items = parts.start[n_parts]; /* <= 4096 x 32 */
        const uint32_t flags = q == q_out ? l.flags & ~EPD_QL_NC : l.flags;
        auto kernel = part_kernel<TABLE>(l.vec, step, (flags & EPD_QL_PIPE) != 0);
        uint32_t resident;
        CHECK_GOTO(device_blocks((const void *)kernel, l.threads, 0, l.blocks, &resident, err),
                   out);
        uint32_t grid = n_items < resident ? n_items : resident;
        if (flags & EPD_QL_BALANCE) {
            /* every block the same number of items, unless that leaves more than an eighth of
             * the blocks that fit unused (few rounds: then the short last round costs less) */
            const uint32_t rounds = (n_items + grid - 1) / grid;
            const uint32_t even = (n_items + rounds - 1) / rounds;
            if (even >= grid - grid / 8) grid = even;
        }
        requant_launch rl(grid, l.threads, 0, st, step); /* behind the reduction's kernel */
        (void)cudaLaunchKernelEx(&rl.cfg, kernel, reinterpret_cast<const uint4 *>(q), scales,
                                 n_items, n_parts, rows_per_part, nvr, epd_fast_div_make(nvr), ns,
                                 kind == EPD_SCALE_PER_TOKEN ? 1 : 0, rbits,
                                 step ? 0.0f : 1.0f / scale, (const float *)scale_dev,
                                 reinterpret_cast<uint4 *>(q_out), flags, parts, tiles);
    } else {
        auto kernel = live_kernel<TABLE>(l.vec, step);
        uint32_t resident;
        CHECK_GOTO(device_blocks((const void *)kernel, l.threads, 0, l.blocks, &resident, err), out);
        requant_launch rl(n_tiles < resident ? n_tiles : resident, l.threads, 0, st, step);
        /* a failed launch is also the last error, which launch_result reports and clears */
        (void)cudaLaunchKernelEx(&rl.cfg, kernel, reinterpret_cast<const uint4 *>(q), scales,
                                 n_tiles, nvr, epd_fast_div_make(nvr), ns,
                                 kind == EPD_SCALE_PER_TOKEN ? 1 : 0, rbits,
                                 step ? 0.0f : 1.0f / scale, /* scale > 0 when given */
                                 (const float *)scale_dev, reinterpret_cast<uint4 *>(q_out), tiles);
    }
    return launch_result("requantize", err);
out:
    return status;
}

/* The stream kernel of a launch: vec x table size x step scale x pipelined. */
template <int TABLE>
static void (*stream_kernel(uint32_t vec, bool step, bool pipe))(
    const uint4 *, const float *, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, epd_fast_div,
    uint32_t, int, float, const float *, uint4 *, uint32_t, const requant_ends<TABLE>)
{
#define EPD_STREAM_KERNEL(S, P)                                                                \
    return vec == 1 ? requant_stream_kernel<1, TABLE, S, P>                                     \
         : vec == 2 ? requant_stream_kernel<2, TABLE, S, P>                                     \
                    : requant_stream_kernel<4, TABLE, S, P>
    if (step && pipe) EPD_STREAM_KERNEL(true, true);
    if (step) EPD_STREAM_KERNEL(true, false);
    if (pipe) EPD_STREAM_KERNEL(false, true);
    EPD_STREAM_KERNEL(false, false);
#undef EPD_STREAM_KERNEL
}

/* Queues the step scale's reduction over the n_tiles tiles of all (packed with rbits bits for
 * rows - 1) in the smallest tile table that holds them. */
static epd_status_t step_reduce_tiles(const requant_tile_list &all, uint32_t n_tiles,
                                      uint32_t rbits, const float *scales, uint32_t ns,
                                      float *scale_dev, cudaStream_t st, char err[EPD_ERR_LEN])
{
#define EPD_STEP_REDUCE(T)                                                                      \
    if (n_tiles <= (T)) {                                                                       \
        requant_tiles<(T)> tiles;                                                               \
        for (uint32_t i = 0; i < (uint32_t)(T); i++)                                            \
            tiles.tile[i] = i < n_tiles ? all.first[i] << rbits | (all.rows[i] - 1u) : 0u;      \
        return step_reduce<(T)>(tiles, n_tiles, rbits, scales, ns, scale_dev, st, err);         \
    }
    EPD_STEP_REDUCE(64);
    EPD_STEP_REDUCE(256);
    EPD_STEP_REDUCE(1024);
#undef EPD_STEP_REDUCE
    requant_tiles<EPD_REQUANT_LIVE_TILES> tiles;
    for (uint32_t i = 0; i < (uint32_t)EPD_REQUANT_LIVE_TILES; i++)
        tiles.tile[i] = i < n_tiles ? all.first[i] << rbits | (all.rows[i] - 1u) : 0u;
    return step_reduce<EPD_REQUANT_LIVE_TILES>(tiles, n_tiles, rbits, scales, ns, scale_dev, st,
                                               err);
}

/* Queues the reduction (step: over the tiles of all) and the stream kernel over the live rows
 * of counts_host (n_experts <= TABLE, live x hidden / 16 < 2^31: the caller checks). The grid:
 * the blocks that fit at once (at most l.blocks an SM), fewer when the vectors make fewer than
 * l.rows passes a block; the chunks a multiple of 8 vectors (128 bytes). */
template <int TABLE>
static epd_status_t stream_queue(const int32_t *counts_host, uint32_t n_experts, uint32_t capacity,
                                 uint64_t live, const requant_tile_list &all, uint32_t n_tiles,
                                 uint32_t rbits, const uint8_t *q, const float *scales,
                                 uint32_t hidden, epd_scale_kind_t kind, float scale,
                                 uint8_t *q_out, float *scale_dev, const epd_quant_launch_t &l,
                                 cudaStream_t st, char err[EPD_ERR_LEN])
{
    epd_status_t status;
    requant_ends<TABLE> ends;
    const bool step = scale_dev != nullptr;
    const uint32_t ns = epd_quant_n_scales(hidden, kind), nvr = hidden / 16;
    const uint32_t total_vec = (uint32_t)(live * nvr);
    uint32_t run = 0;
    for (uint32_t e = 0; e < n_experts; e++) {
        run += counts_host[e] > 0 ? (uint32_t)counts_host[e] : 0u;
        ends.end[e] = run;
    }
    for (uint32_t e = n_experts; e < (uint32_t)TABLE; e++) ends.end[e] = run; /* never read */
    if (step)
        CHECK_GOTO(step_reduce_tiles(all, n_tiles, rbits, scales, ns, scale_dev, st, err), out);
    {
        const uint32_t flags = q == q_out ? l.flags & ~EPD_QL_NC : l.flags;
        auto kernel = stream_kernel<TABLE>(l.vec, step, (flags & EPD_QL_PIPE) != 0);
        uint32_t resident;
        CHECK_GOTO(device_blocks((const void *)kernel, l.threads, 0, l.blocks, &resident, err),
                   out);
        const uint64_t per_block = (uint64_t)l.threads * l.vec * (l.rows > 1 ? l.rows : 1);
        const uint64_t want = (total_vec + per_block - 1) / per_block;
        uint32_t grid = want < resident ? (uint32_t)want : resident;
        if (grid == 0) grid = 1;
        const uint32_t chunk = (total_vec / grid + (total_vec % grid != 0) + 7u) & ~7u;
        grid = (total_vec + chunk - 1) / chunk;
        requant_launch rl(grid, l.threads, 0, st, step); /* behind the reduction's kernel */
        (void)cudaLaunchKernelEx(&rl.cfg, kernel, reinterpret_cast<const uint4 *>(q), scales,
                                 n_experts, capacity, total_vec, chunk, nvr,
                                 epd_fast_div_make(nvr), ns, kind == EPD_SCALE_PER_TOKEN ? 1 : 0,
                                 step ? 0.0f : 1.0f / scale, (const float *)scale_dev,
                                 reinterpret_cast<uint4 *>(q_out), flags, ends);
    }
    return launch_result("requantize", err);
out:
    return status;
}

/* The grid kernel of a launch: vec x runs table x step scale. */
template <int RUNS>
static void (*grid_kernel(uint32_t vec, bool step))(const uint4 *, const float *, uint32_t,
                                                    uint32_t, epd_fast_div, int, float,
                                                    const float *, uint4 *, uint32_t, uint32_t,
                                                    const requant_runs<RUNS>)
{
    if (step)
        return vec == 1 ? requant_grid_kernel<1, RUNS, true>
             : vec == 2 ? requant_grid_kernel<2, RUNS, true>
                        : requant_grid_kernel<4, RUNS, true>;
    return vec == 1 ? requant_grid_kernel<1, RUNS, false>
         : vec == 2 ? requant_grid_kernel<2, RUNS, false>
                    : requant_grid_kernel<4, RUNS, false>;
}

/* Queues the reduction (step: over the tiles of all) and the grid kernel over the live rows of
 * counts_host, n_runs of them (experts with live rows, n_runs <= RUNS; the layout's vectors and
 * the live ones < 2^31: the caller checks). The grid: a pass of threads x vec vectors a block
 * over all the live vectors, at most the blocks that fit at once (at most l.blocks an SM). */
template <int RUNS>
static epd_status_t grid_queue(const int32_t *counts_host, uint32_t n_experts, uint32_t capacity,
                               uint64_t live, const requant_tile_list &all, uint32_t n_tiles,
                               uint32_t rbits, const uint8_t *q, const float *scales,
                               uint32_t hidden, epd_scale_kind_t kind, float scale,
                               uint8_t *q_out, float *scale_dev, const epd_quant_launch_t &l,
                               cudaStream_t st, char err[EPD_ERR_LEN])
{
    epd_status_t status;
    requant_runs<RUNS> runs;
    const bool step = scale_dev != nullptr;
    const uint32_t ns = epd_quant_n_scales(hidden, kind), nvr = hidden / 16;
    const uint32_t total_vec = (uint32_t)(live * nvr);
    uint32_t n_runs = 0, done = 0; /* live vectors before the run */
    for (uint32_t e = 0; e < n_experts; e++) {
        if (counts_host[e] <= 0) continue;
        runs.back[n_runs] = e * capacity * nvr - done;
        done += (uint32_t)counts_host[e] * nvr;
        runs.end[n_runs++] = done;
    }
    for (uint32_t k = n_runs; k < (uint32_t)RUNS; k++) {
        runs.end[k] = total_vec; /* never passed: every vector is below */
        runs.back[k] = 0;
    }
    uint32_t shift = 0;
    while (((total_vec - 1u) >> shift) >= (uint32_t)RUNS) shift++;
    for (uint32_t b = 0, k = 0; b < (uint32_t)RUNS; b++) {
        const uint64_t f = (uint64_t)b << shift;
        while (k + 1 < n_runs && runs.end[k] <= f) k++;
        runs.first[b] = (uint16_t)k;
    }
    if (step)
        CHECK_GOTO(step_reduce_tiles(all, n_tiles, rbits, scales, ns, scale_dev, st, err), out);
    {
        const uint32_t flags = q == q_out ? l.flags & ~EPD_QL_NC : l.flags;
        auto kernel = grid_kernel<RUNS>(l.vec, step);
        uint32_t resident;
        CHECK_GOTO(device_blocks((const void *)kernel, l.threads, 0, l.blocks, &resident, err),
                   out);
        const uint64_t per_block = (uint64_t)l.threads * l.vec;
        const uint64_t want = (total_vec + per_block - 1) / per_block;
        const uint32_t grid = want < resident ? (uint32_t)want : resident;
        requant_launch rl(grid, l.threads, 0, st, step); /* behind the reduction's kernel */
        (void)cudaLaunchKernelEx(&rl.cfg, kernel, reinterpret_cast<const uint4 *>(q), scales,
                                 total_vec, shift, epd_fast_div_make(nvr),
                                 kind == EPD_SCALE_PER_TOKEN ? 1 : 0, step ? 0.0f : 1.0f / scale,
                                 (const float *)scale_dev, reinterpret_cast<uint4 *>(q_out), flags,
                                 0x3210u, runs);
    }
    return launch_result("requantize", err);
out:
    return status;
}

/* The layout-aware requant: tiles on the host, then live_queue with the smallest table that
 * holds them. scale_dev != NULL: the step scale reduced on the device (scale ignored). */
static epd_status_t requant_live(const uint8_t *q, const float *scales, const int32_t *counts_host,
                                 uint32_t n_experts, uint32_t capacity, uint32_t hidden,
                                 epd_scale_kind_t kind, float scale, uint8_t *q_out,
                                 float *scale_dev, const epd_quant_launch_t *launch, void *stream,
                                 char err[EPD_ERR_LEN])
{
    epd_status_t status;
    epd_quant_launch_t l;
    cudaStream_t st = (cudaStream_t)stream;
    static thread_local requant_tile_list all; /* 24 KB: not on the stack */
    uint32_t n_tiles = 0, rows_per_tile = 0, rbits = 0;
    uint64_t live = 0;

    CHECK_GOTO(epd_quant_check(hidden, kind, EPD_SCALE_FMT_FP32, err), out);
    if (!q || !scales || !counts_host || !q_out) return bad_arg(err, "requantize: a NULL buffer");
    if (!aligned16(q) || !aligned16(q_out))
        return bad_arg(err, "requantize: q and q_out must be 16-byte aligned");
    if ((uint64_t)capacity * (hidden / 16) > 0xffffffffull)
        return bad_arg(err, "requantize: capacity x hidden too large (64 GiB per expert)");
    for (uint32_t e = 0; e < n_experts; e++) live += counts_host[e] > 0 ? (uint64_t)counts_host[e] : 0;
    CHECK_GOTO(pick_launch(EPD_QK_REQUANT_LIVE, hidden, live > 0xffffffffull ? 0xffffffffu : (uint32_t)live,
                           launch, &l, err), out);
    CHECK_GOTO(epd_requant_tiles_make(counts_host, n_experts, capacity, l.rows,
                                      EPD_REQUANT_LIVE_TILES, all.first, all.rows, &n_tiles,
                                      &rows_per_tile, &live, err), out);
    /* (a pass past a tile's last vector must not wrap the kernels' 32-bit vector index) */
    if ((uint64_t)rows_per_tile * (hidden / 16) + (uint64_t)l.threads * l.vec > 0xffffffffull)
        return bad_arg(err, "requantize: rows per tile x hidden too large for one tile");
    while (rbits < 16 && (1u << rbits) < rows_per_tile) rbits++;
    if (n_experts > 0 && ((uint64_t)n_experts * capacity - 1) >> (32 - rbits) != 0) {
        snprintf(err, EPD_ERR_LEN,
                 "requantize: %u experts x capacity %u with %u rows a tile do not fit a tile word "
                 "(experts x capacity x rows a tile must stay below 2^32)",
                 n_experts, capacity, rows_per_tile);
        return EPD_ERR_INVALID_ARG;
    }
    if (scale_dev == nullptr && scale == 0.0f && n_tiles > 0)
        return bad_arg(err, "requantize: given scale 0 with live rows (S must be > 0)");
    if (n_tiles == 0) {
        if (scale_dev == nullptr) return EPD_OK;
        cudaError_t rc = cudaMemsetAsync(scale_dev, 0, sizeof(float), st);
        if (rc != cudaSuccess) {
            snprintf(err, EPD_ERR_LEN, "step scale: %s", cudaGetErrorString(rc));
            return EPD_ERR_CUDA;
        }
        return EPD_OK;
    }
    /* the grid kernel, where its table holds the experts with rows and a 32-bit index every
     * vector of the layout (else the stream, tile or part kernel: the bit is a launch hint) */
    if ((l.flags & EPD_QL_GRID) != 0 &&
        (uint64_t)n_experts * capacity * (hidden / 16) < 0x80000000ull) {
        uint32_t n_runs = 0;
        for (uint32_t e = 0; e < n_experts; e++) n_runs += counts_host[e] > 0;
#define EPD_GRID_QUEUE(T)                                                                       \
    if (n_runs <= (T))                                                                          \
        return grid_queue<(T)>(counts_host, n_experts, capacity, live, all, n_tiles, rbits, q,  \
                               scales, hidden, kind, scale, q_out, scale_dev, l, st, err)
        EPD_GRID_QUEUE(16);
        EPD_GRID_QUEUE(64);
        EPD_GRID_QUEUE(256);
        EPD_GRID_QUEUE(1024);
#undef EPD_GRID_QUEUE
    }
    l.flags &= ~EPD_QL_GRID;
    /* the stream kernel, where its table holds the experts and its flat index the vectors
     * (else the same bytes from the tile or part kernel: the bit is a launch hint) */
    if ((l.flags & EPD_QL_STREAM) != 0 && n_experts <= EPD_REQUANT_LIVE_TILES &&
        live * (hidden / 16) < 0x80000000ull) {
#define EPD_STREAM_QUEUE(T)                                                                     \
    if (n_experts <= (T))                                                                       \
        return stream_queue<(T)>(counts_host, n_experts, capacity, live, all, n_tiles, rbits, q, \
                                 scales, hidden, kind, scale, q_out, scale_dev, l, st, err)
        EPD_STREAM_QUEUE(64);
        EPD_STREAM_QUEUE(256);
        EPD_STREAM_QUEUE(1024);
#undef EPD_STREAM_QUEUE
        return stream_queue<EPD_REQUANT_LIVE_TILES>(counts_host, n_experts, capacity, live, all,
                                                    n_tiles, rbits, q, scales, hidden, kind,
                                                    scale, q_out, scale_dev, l, st, err);
    }
    l.flags &= ~EPD_QL_STREAM;
#define EPD_LIVE_QUEUE(T)                                                                       \
    if (n_tiles <= (T))                                                                         \
        return live_queue<(T)>(all, n_tiles, rbits, rows_per_tile, q, scales, hidden, kind,     \
                               scale, q_out, scale_dev, l, st, err)
    EPD_LIVE_QUEUE(64);
    EPD_LIVE_QUEUE(128);
    EPD_LIVE_QUEUE(256);
    EPD_LIVE_QUEUE(512);
    EPD_LIVE_QUEUE(1024);
    EPD_LIVE_QUEUE(2048);
#undef EPD_LIVE_QUEUE
    return live_queue<EPD_REQUANT_LIVE_TILES>(all, n_tiles, rbits, rows_per_tile, q, scales,
                                              hidden, kind, scale, q_out, scale_dev, l, st, err);
out:
    return status;
}

extern "C" epd_status_t epd_requant_given_cuda(const uint8_t *q, const float *scales,
                                               const int32_t *counts_host, uint32_t n_experts,
                                               uint32_t capacity, uint32_t hidden,
                                               epd_scale_kind_t kind, float scale, uint8_t *q_out,
                                               const epd_quant_launch_t *launch, void *stream,
                                               char err[EPD_ERR_LEN])
{
    if (!(scale >= 0.0f) || isinf(scale)) {
        snprintf(err, EPD_ERR_LEN, "given scale %g is not a finite value >= 0", (double)scale);
        return EPD_ERR_INVALID_ARG;
    }
    return requant_live(q, scales, counts_host, n_experts, capacity, hidden, kind, scale, q_out,
                        nullptr, launch, stream, err);
}

extern "C" epd_status_t epd_requant_step_cuda(const uint8_t *q, const float *scales,
                                              const int32_t *counts_host, uint32_t n_experts,
                                              uint32_t capacity, uint32_t hidden,
                                              epd_scale_kind_t kind, uint8_t *q_out,
                                              float *scale_dev, const epd_quant_launch_t *launch,
                                              void *stream, char err[EPD_ERR_LEN])
{
    if (!scale_dev) return bad_arg(err, "requantize: the step scale needs a device scale output");
    return requant_live(q, scales, counts_host, n_experts, capacity, hidden, kind, 0.0f, q_out,
                        scale_dev, launch, stream, err);
}
