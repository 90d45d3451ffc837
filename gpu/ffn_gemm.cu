/* The ffn experts' GEMM kernel (gpu/ffn_gemm.h): one launch per projection over every local
 * expert with rows, for BF16 weights (mma.sync m16n8k16, fp32 accumulation) and FP8 block weights
 * (mma.sync m16n8k32 e4m3; each 128-wide K block summed in a fresh fp32 fragment, then folded in
 * as acc += part * w_scale[n block][k block] * x_scale[row][k block], DeepGEMM's promotion).
 *
 * Decode sizes are weight-read bound, so the operands are swapped: the mma's M is the weights' N
 * (16 output features per mma), its N the expert's token rows (8 per mma). A CTA of 4 warps owns
 * 128 output features (one FP8 scale block) of one expert and up to EPD_FFN_GEMM_ROW_TILE of its
 * rows; each warp 32 features (two m16 tiles) and all the tile's rows (up to 8 n8 tiles, only as
 * many as the rows need). The grid is (row tiles of the experts with rows, N / 128): experts
 * without rows cost nothing, and the row tiles of one expert (reading the same weights) are
 * adjacent CTAs.
 *
 * K goes in stages of 128 bytes (64 BF16 or 128 e4m3 elements). Weights go from global memory
 * straight into registers (each weight byte is read by one lane; no reuse across warps), one
 * stage ahead, and an L2 prefetch a few stages ahead (args.prefetch) keeps more bytes in flight;
 * the
 * activations of a stage go through shared memory (read by the 4 warps) in a STAGES-deep
 * cp.async ring. A dot product's K order is free, so within a stage the k positions are
 * permuted the same way for both operands such that each lane loads 16 contiguous bytes: lane
 * (g = lane / 4, t = lane % 4) loads bytes [c * 64 + 16 t, + 16) of its rows for the stage's two
 * 64-byte chunks c, and uses words 0, 1 of each 16 bytes as the mma's k bytes [4t, 4t + 4) and
 * [16 + 4t, 16 + 4t + 4) of one k step, words 2, 3 as those of the next (the PTX ISA's A
 * fragment holds rows g and g + 8 at those k bytes, B's holds column g at the same ones; the
 * same for both element types in bytes). The activations' shared tile swaps the two chunks of
 * odd rows, so that the 8 lanes of each quarter warp hit 8 distinct 16-byte bank groups. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "gpu/ffn_gemm.h"
#include "gpu/fp8.h"

#define THREADS 128
#define WARP_N 32                              /* output features per warp */
#define MT 2                                   /* m16 tiles per warp */
#define NT_MAX (EPD_FFN_GEMM_ROW_TILE / 8)     /* n8 tiles per CTA */
#define STAGE_BYTES 128                        /* K bytes per stage */
#define STAGES 4                               /* the activations' cp.async ring */

static_assert(THREADS / 32 * WARP_N == EPD_FFN_GEMM_BN, "the warps cover the CTA's features");
static_assert(MT * 16 == WARP_N, "the m16 tiles cover the warp's features");

/* the kernel's parameters (epd_ffn_gemm_args_t as the device uses them) */
struct gemm_params {
    const uint8_t *w;
    const float *w_scale;
    const uint8_t *x;
    const float *x_scale;
    const uint32_t *row_base, *counts, *tile_base;
    void *d;
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

/* 128 bytes from p (16-byte aligned) towards L2, not waited for */
__device__ static __forceinline__ void prefetch_l2_128(const void *p)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    size_t g = __cvta_generic_to_global(p);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], 128;\n" ::"l"(g));
#elif defined(__CUDA_ARCH__)
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
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

/* the expert whose row tiles hold tile: tile_base ascending, [n + 1] */
__device__ static __forceinline__ uint32_t tile_expert(const uint32_t *tile_base, uint32_t n,
                                                       uint32_t tile)
{
    uint32_t lo = 0, hi = n; /* tile_base[lo] <= tile < tile_base[hi] */
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        if (tile_base[mid] <= tile)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* ---- the kernel -------------------------------------------------------------------------- */

template <bool FP8, bool OUT_BF16>
__global__ void __launch_bounds__(THREADS, 2) ffn_gemm_kernel(gemm_params p)
{
    __shared__ __align__(128) uint8_t xs[STAGES][EPD_FFN_GEMM_ROW_TILE * STAGE_BYTES];
    __shared__ __align__(16) float xsc[STAGES][EPD_FFN_GEMM_ROW_TILE];
    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const uint32_t e = tile_expert(p.tile_base, p.n_experts, blockIdx.x);
    const uint32_t rt = blockIdx.x - p.tile_base[e];
    const uint32_t rb = p.row_base[e], mpad = p.row_base[e + 1] - rb;
    const uint32_t count = min(p.counts[e], mpad);
    if (rt * EPD_FFN_GEMM_ROW_TILE >= count) return; /* counts that disagree with tile_base */
    const uint32_t rows = min(count - rt * EPD_FFN_GEMM_ROW_TILE, EPD_FFN_GEMM_ROW_TILE);
    const uint32_t nt = min((rows + 7) / 8, (mpad - rt * EPD_FFN_GEMM_ROW_TILE) / 8);
    const uint32_t kbytes = p.kbytes, n_kb = kbytes / STAGE_BYTES;
    const uint32_t f0 = blockIdx.y * EPD_FFN_GEMM_BN + warp * WARP_N; /* the warp's features */
    const size_t row16 = (size_t)16 * kbytes, row8 = (size_t)8 * kbytes;
    /* the lane's weight bytes: rows f0 + mt * 16 + h * 8 + g, columns c * 64 + 16 t of a stage */
    const uint8_t *wl = p.w + ((size_t)e * p.n + f0 + g) * kbytes + 16 * t;
    /* the row the lane prefetches: f0 + lane */
    const uint8_t *wp = p.w + ((size_t)e * p.n + f0 + lane) * kbytes;
    const uint8_t *xg = p.x + (size_t)(rb + rt * EPD_FFN_GEMM_ROW_TILE) * kbytes;
    const float *xsg = FP8 ? p.x_scale + (size_t)rb * (p.k / 128) + rt * EPD_FFN_GEMM_ROW_TILE
                           : nullptr;
    const float *wsg =
        FP8 ? p.w_scale + ((size_t)e * (p.n / 128) + blockIdx.y) * p.w_scale_ld : nullptr;

    float acc[MT][NT_MAX][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int j = 0; j < NT_MAX; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[mt][j][i] = 0.0f;

    /* the activations of stage kb (nt * 8 rows of 128 bytes; FP8: their scales) into slot */
    auto load_x = [&](uint32_t kb, uint32_t slot) {
        const uint8_t *src = xg + (size_t)kb * STAGE_BYTES;
        for (uint32_t i = tid; i < nt * 64; i += THREADS) {
            uint32_t r = i >> 3, q = i & 7;
            uint32_t off = r * STAGE_BYTES + ((((q >> 2) ^ (r & 1)) << 6) | ((q & 3) << 4));
            cp_async16(&xs[slot][off], src + (size_t)r * kbytes + q * 16);
        }
        if (FP8)
            for (uint32_t i = tid; i < nt * 2; i += THREADS)
                cp_async16(&xsc[slot][i * 4], xsg + (size_t)kb * mpad + i * 4);
    };
    /* the lane's weights of stage kb: [m tile][row g, g + 8][chunk] */
    auto load_w = [&](uint32_t kb, uint4 (&a)[MT][2][2]) {
        const uint8_t *src = wl + (size_t)kb * STAGE_BYTES;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int c = 0; c < 2; c++)
                    a[mt][h][c] = __ldg((const uint4 *)(src + mt * row16 + h * row8 + c * 64));
    };
    /* stage kb's products from slot with the lane's weights a */
    auto compute = [&](uint32_t kb, uint32_t slot, const uint4 (&a)[MT][2][2]) {
        const uint8_t *xsl = xs[slot];
        const float ws = FP8 ? __ldg(wsg + kb) : 1.0f;
#pragma unroll
        for (uint32_t j = 0; j < NT_MAX; j++) {
            if (j < nt) {
                float part[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
#pragma unroll
                    for (int i = 0; i < 4; i++) part[mt][i] = 0.0f;
#pragma unroll
                for (uint32_t c = 0; c < 2; c++) {
                    const uint4 b = *(const uint4 *)(xsl + (j * 8 + g) * STAGE_BYTES +
                                                     ((c ^ (g & 1)) << 6) + 16 * t);
#pragma unroll
                    for (int sub = 0; sub < 2; sub++) {
                        const uint32_t b0 = sub ? b.z : b.x, b1 = sub ? b.w : b.y;
#pragma unroll
                        for (int mt = 0; mt < MT; mt++) {
                            const uint4 lo = a[mt][0][c], hi = a[mt][1][c];
                            mma<FP8>(FP8 ? part[mt] : acc[mt][j], sub ? lo.z : lo.x,
                                     sub ? hi.z : hi.x, sub ? lo.w : lo.y, sub ? hi.w : hi.y, b0,
                                     b1);
                        }
                    }
                }
                if (FP8) {
                    /* c0, c2: row 2t of the n8 tile; c1, c3: row 2t + 1 */
                    const float s0 = ws * xsc[slot][j * 8 + 2 * t];
                    const float s1 = ws * xsc[slot][j * 8 + 2 * t + 1];
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
    /* one stage: its activations landed (and the slot the next load refills is free), the next
     * stage's weights and a later stage's activations and L2 prefetch issued, then the mmas */
    auto step = [&](uint32_t kb, const uint4 (&cur)[MT][2][2], uint4 (&nxt)[MT][2][2]) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        const uint32_t nk = kb + STAGES - 1;
        if (nk < n_kb) load_x(nk, nk % STAGES);
        cp_async_commit();
        if (kb + 1 < n_kb) load_w(kb + 1, nxt);
        if (p.prefetch > 0 && kb + p.prefetch < n_kb)
            prefetch_l2_128(wp + (size_t)(kb + p.prefetch) * STAGE_BYTES);
        compute(kb, kb % STAGES, cur);
    };

    uint4 wa[MT][2][2], wb[MT][2][2];
#pragma unroll
    for (uint32_t s = 0; s < STAGES - 1; s++) {
        if (s < n_kb) load_x(s, s);
        cp_async_commit();
    }
    for (uint32_t s = 1; s < p.prefetch && s < n_kb; s++)
        prefetch_l2_128(wp + (size_t)s * STAGE_BYTES);
    load_w(0, wa);
    for (uint32_t kb = 0; kb < n_kb; kb += 2) {
        step(kb, wa, wb);
        if (kb + 1 < n_kb) step(kb + 1, wb, wa);
    }

    /* D[row][feature]: c0 (feature g, row 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1) */
    const size_t row0 = (size_t)rb + rt * EPD_FFN_GEMM_ROW_TILE;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (uint32_t j = 0; j < NT_MAX; j++) {
            if (j >= nt) continue;
            const size_t f = f0 + mt * 16 + g, r = row0 + j * 8 + 2 * t;
            const size_t i0 = r * p.n + f, i1 = (r + 1) * p.n + f;
            if (OUT_BF16) {
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

extern "C" epd_status_t epd_ffn_gemm_supported(bool fp8, char err[EPD_ERR_LEN])
{
    int dev = 0, major = 0, minor = 0;
    cudaFuncAttributes fa;
    const int need = fp8 ? 89 : 80;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
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
    cudaError_t rc = fp8 ? cudaFuncGetAttributes(&fa, ffn_gemm_kernel<true, false>)
                         : cudaFuncGetAttributes(&fa, ffn_gemm_kernel<false, false>);
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

extern "C" epd_status_t epd_ffn_gemm_launch(const epd_ffn_gemm_args_t *a, void *stream,
                                            char err[EPD_ERR_LEN])
{
    gemm_params p;
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
    dim3 grid(a->n_tiles, a->n / EPD_FFN_GEMM_BN);
    cudaStream_t s = (cudaStream_t)stream;
    if (a->fp8 && a->out_bf16)
        ffn_gemm_kernel<true, true><<<grid, THREADS, 0, s>>>(p);
    else if (a->fp8)
        ffn_gemm_kernel<true, false><<<grid, THREADS, 0, s>>>(p);
    else if (a->out_bf16)
        ffn_gemm_kernel<false, true><<<grid, THREADS, 0, s>>>(p);
    else
        ffn_gemm_kernel<false, false><<<grid, THREADS, 0, s>>>(p);
    cudaError_t rc = cudaGetLastError();
    if (rc != cudaSuccess) {
        snprintf(err, EPD_ERR_LEN, "ffn GEMM kernel: launch (%u x %u CTAs): %s", a->n_tiles,
                 a->n / EPD_FFN_GEMM_BN, cudaGetErrorString(rc));
        return EPD_ERR_CUDA;
    }
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
