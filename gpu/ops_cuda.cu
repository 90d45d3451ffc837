/* The CUDA implementation of the device ops (gpu/ops.h): one stream per context plus two copy
 * streams for the staged transport, and the step kernels (routing layout, pack fused with FP8
 * quantization, experts with one table entry per expert kind, combine). Every result equals gpu/ops_host.c byte for byte: the same
 * fp32 operations in the same order (__fmul_rn/__fadd_rn, --fmad=false), gpu/fp8.h's rules. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "gpu/ops.h"
#include "gpu/ffn_cuda.h"
}
#include "gpu/fp8.h"
#include "gpu/partial_dev.cuh"
#include "gpu/quant_dev.cuh"

#define LAYOUT_THREADS 256    /* tokens a layout block walks at a time */
#define LAYOUT_MAX_TILES 64   /* layout blocks; a tile is a multiple of LAYOUT_THREADS tokens */
#define LAYOUT_MAX_WORLD 1024 /* ranks the layout kernels' shared memory holds */
#define FLAT_THREADS 256      /* block size of the element-wise kernels */
#define INGEST_BLOCKS 512u    /* most blocks of the ingest kernel (and its result slots) */
#define INGEST_GRAPHS 8u      /* ingest launches kept as graphs, one per grid size */
/* A page-locked host x of at least this many bytes (128 tokens of H 7168: 1.8 MB) comes to the
 * device through the copy engine, then the ingest kernel scans the copy: a kernel reading host
 * memory over the bus moved it at about 0.8 of cudaMemcpy's rate (H200, session 6). Below it
 * the kernel reads x where it is: one launch instead of a copy and a launch. */
#define INGEST_COPY_ENGINE_BYTES (256u << 10)
/* Words of ids, weights and per-block results an ingest hands back as flagged pairs (see
 * ingest_kernel): 128 tokens of top-8 with 448 blocks take 2944. */
#define INGEST_LL_WORDS 8192u
#define CHUNK 16              /* elements per thread and vector step (32 bytes of bf16) */
#define TOKEN_MAX_THREADS 512 /* threads of one token in the per-token pack (registers: 128) */
#define PACK_MAX_THREADS 256  /* block of the row-per-block pack */
#define PACK_MAX_DESTS 1024   /* destination ranks of one token the row pack holds */
#define EXPERT_TABLE 1024     /* local experts whose factors the experts kernel tabulates */
#define EXPERT_MAX_K 64       /* top-k slots the experts kernel's mask holds */
#define SCALE_MAX_AT (2 * LAYOUT_MAX_WORLD + 2) /* in layout_dev */
#define QE_SLOTS EPD_QE_SLOTS
#define QE_SUMS EPD_QE_SUMS

/* ingest_kernel's arguments, in its order (all 8 bytes wide: no padding, compared whole) */
struct ingest_args {
    const uint8_t *a;
    size_t a_bytes;
    uint8_t *a_dst;
    const uint8_t *b;
    size_t b_bytes;
    uint8_t *b_dst;
    const uint16_t *x;
    uint64_t n;
    uint16_t *x_dst;
    unsigned long long *slots;
    unsigned *done;
    unsigned long long *ll;
};

struct epd_ops_ctx {
    int device;
    cudaStream_t stream; /* every op */
    cudaStream_t down;   /* copy_to_host_async */
    cudaStream_t up;     /* copy_to_ops_async, copy_ops_to_ops_async */
    uint32_t *layout_dev;  /* [2W + 2]: counts, offsets, records, tokens with bad ids; then at
                            * SCALE_MAX_AT [W]: the pack's scale maxima per destination */
    uint32_t *layout_host; /* pinned mirror, read back after the layout kernels */
    uint32_t *tile_counts; /* [LAYOUT_MAX_TILES][W] records per layout tile and rank */
    cudaEvent_t layout_done; /* the read-back of the last layout landed in layout_host */
    epd_ffn_cuda_t *ffn;     /* the ffn experts' device weights (experts_load), or NULL */
    uint32_t *expert_hist_dev;  /* [expert_hist_cap]: tokens per expert of the last layout */
    uint32_t *expert_hist_host; /* pinned mirror, read back with the layout counts */
    uint32_t expert_hist_cap;
    double *qe_dev;  /* [QE_SLOTS][QE_SUMS] telemetry sums since the last quant_error_take */
    double *qe_host; /* pinned mirror */
    bool qe_queued;  /* combine queued the read-back of qe_dev into qe_host (and its zeroing) */
    char err[EPD_ERR_LEN];
    /* ingest of device-region tensors (loop thread), made by its first call */
    bool ingest_ready;
    cudaStream_t ingest;
    unsigned long long *ingest_host; /* pinned, INGEST_BLOCKS slots: each block's least bad index */
    unsigned *ingest_done_host;      /* pinned, INGEST_BLOCKS: 1 once a block is done (cleared
                                      * by the host before each launch that reports) */
    unsigned long long *ingest_ll;   /* pinned, INGEST_LL_WORDS flagged pairs (ingest_kernel) */
    uint8_t *ingest_stage;           /* pinned staging of ids and weights read back */
    size_t ingest_stage_bytes;
    cudaMemPool_t ingest_pool;       /* device copies of host x made at ingest (NULL: none yet) */
    /* The ingest kernel as a one-node graph per grid size, its arguments set before a launch
     * only when they differ from the last launch's (a frontend that keeps its tensors in the
     * same buffers, as CUDA-graph frontends do, sends the same ones every time): a graph
     * launch costs the loop thread about 1.4 us less than a kernel launch on an H200 node, and
     * setting the arguments 0.8 us (.dbg probes, session 6). Filled as sizes come; past
     * INGEST_GRAPHS, or when a graph call fails, the kernel is launched as before. */
    struct {
        unsigned blocks; /* 0: unused */
        cudaGraph_t graph; /* kept: node is its node, which the exec's updates name */
        cudaGraphExec_t exec;
        cudaGraphNode_t node;
        struct ingest_args args; /* of its last launch */
    } ingest_graph[INGEST_GRAPHS];
    bool ingest_graph_off; /* a graph call failed once: plain launches from then on */
};

struct epd_ops_event {
    cudaEvent_t event;
};

/* ---- error handling ---------------------------------------------------------------------- */

static epd_status_t cuda_fail(epd_ops_ctx_t *ctx, cudaError_t rc, const char *what)
{
    snprintf(ctx->err, EPD_ERR_LEN, "cuda ops: %s: %s", what, cudaGetErrorString(rc));
    return EPD_ERR_CUDA;
}

#define CUDA_TRY(ctx, call, what)                                     \
    do {                                                              \
        cudaError_t rc_ = (call);                                     \
        if (rc_ != cudaSuccess) return cuda_fail((ctx), rc_, (what)); \
    } while (0)

static epd_status_t bad_arg(epd_ops_ctx_t *ctx, const char *what)
{
    snprintf(ctx->err, EPD_ERR_LEN, "cuda ops: %s", what);
    return EPD_ERR_INVALID_ARG;
}

/* Ops may be called from another thread than init's (the engine's worker): make the context's
 * device current first. Cheap when it already is. */
static epd_status_t enter(epd_ops_ctx_t *ctx)
{
    ctx->err[0] = '\0';
    CUDA_TRY(ctx, cudaSetDevice(ctx->device), "cudaSetDevice");
    return EPD_OK;
}

/* The shape check of the host ops (epd_moe_shape_check), plus the limits of these kernels; on a
 * bad shape ctx->err says why. */
static bool shape_fits(epd_ops_ctx_t *ctx, const epd_moe_shape_t *shape)
{
    char why[EPD_ERR_LEN];

    if (epd_moe_shape_check(shape, why) != EPD_OK) {
        snprintf(ctx->err, EPD_ERR_LEN, "cuda ops: %.240s", why);
        return false;
    }
    if (shape->world > LAYOUT_MAX_WORLD) {
        bad_arg(ctx, "more than 1024 ranks");
        return false;
    }
    return true;
}

static bool aligned16(const void *p)
{
    return ((uintptr_t)p & 15u) == 0;
}

/* Threads for one row of h16 16-element chunks: a multiple of 32 up to max that divides h16 when
 * one does (no lane idle in the last pass: 224 for H 7168), else the fewest passes. */
static uint32_t row_threads(uint32_t h16, uint32_t max)
{
    if (h16 <= 32) return 32;
    for (uint32_t t = max; t >= 128; t -= 32)
        if (h16 % t == 0) return t;
    uint32_t passes = (h16 + max - 1) / max;
    return ((h16 + passes - 1) / passes + 31) / 32 * 32;
}

static unsigned flat_blocks(uint64_t items)
{
    uint64_t blocks = (items + FLAT_THREADS - 1) / FLAT_THREADS;
    return (unsigned)(blocks > 0x7fffffffu ? 0x7fffffffu : blocks); /* the kernels grid-stride */
}

/* ---- element helpers ---------------------------------------------------------------------- */

/* (row, chunk) of a flat index over [rows][per_row]. 32-bit division whenever the index fits:
 * a 64-bit one is a long subroutine on the GPU, long enough to slow these memory-bound kernels
 * down (docs/notes/kernels.md). */
__device__ __forceinline__ void split_flat(uint64_t idx, uint32_t per_row, uint32_t *row, uint32_t *chunk)
{
    if (idx <= 0xffffffffull) {
        uint32_t i = (uint32_t)idx, r = i / per_row;
        *row = r;
        *chunk = i - r * per_row;
    } else {
        uint64_t r = idx / per_row;
        *row = (uint32_t)r;
        *chunk = (uint32_t)(idx - r * per_row);
    }
}

/* max |x| of 16 bf16 values as a bf16 bit pattern: for non-negative values (sign bit cleared)
 * the integer order is the float order, and NaN never reaches pack (rejected at ingest). */
__device__ __forceinline__ uint32_t amax16_bits(uint4 lo, uint4 hi)
{
    uint32_t m = __vmaxu2(__vmaxu2(lo.x & 0x7fff7fffu, lo.y & 0x7fff7fffu),
                          __vmaxu2(lo.z & 0x7fff7fffu, lo.w & 0x7fff7fffu));
    m = __vmaxu2(m, __vmaxu2(__vmaxu2(hi.x & 0x7fff7fffu, hi.y & 0x7fff7fffu),
                             __vmaxu2(hi.z & 0x7fff7fffu, hi.w & 0x7fff7fffu)));
    return max(m & 0xffffu, m >> 16);
}

/* Two bf16 (low half first in memory) times mult, to two e4m3 codes (low byte first). The
 * SATFINITE conversion is clamp to +-448 then round to nearest even, as epd_e4m3_from_f32. */
__device__ __forceinline__ uint32_t quant2(uint32_t w, float mult)
{
    float a = __fmul_rn(__uint_as_float(w << 16), mult);
    float b = __fmul_rn(__uint_as_float(w & 0xffff0000u), mult);
    return (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ uint32_t quant4(uint32_t w0, uint32_t w1, float mult)
{
    return quant2(w0, mult) | (quant2(w1, mult) << 16);
}

__device__ __forceinline__ uint4 quant16(uint4 lo, uint4 hi, float mult)
{
    return make_uint4(quant4(lo.x, lo.y, mult), quant4(lo.z, lo.w, mult),
                      quant4(hi.x, hi.y, mult), quant4(hi.z, hi.w, mult));
}

/* Four e4m3 codes (low byte first) to fp32, exactly (e4m3 -> f16 -> f32 are exact). */
__device__ __forceinline__ void e4m3x4_to_f32(uint32_t w, float *out)
{
    float2 a = epd_dev_dec2(w), b = epd_dev_dec2(w >> 16);
    out[0] = a.x;
    out[1] = a.y;
    out[2] = b.x;
    out[3] = b.y;
}

__device__ __forceinline__ void bf16x2_to_f32(uint32_t w, float *out)
{
    out[0] = __uint_as_float(w << 16);
    out[1] = __uint_as_float(w & 0xffff0000u);
}

/* 16 bf16 in two 16-byte vectors (lo first) to fp32, exactly. */
__device__ __forceinline__ void bf16x16_to_f32(uint4 lo, uint4 hi, float *out)
{
    bf16x2_to_f32(lo.x, out);
    bf16x2_to_f32(lo.y, out + 2);
    bf16x2_to_f32(lo.z, out + 4);
    bf16x2_to_f32(lo.w, out + 6);
    bf16x2_to_f32(hi.x, out + 8);
    bf16x2_to_f32(hi.y, out + 10);
    bf16x2_to_f32(hi.z, out + 12);
    bf16x2_to_f32(hi.w, out + 14);
}

__device__ __forceinline__ uint32_t f32x2_to_bf16(float a, float b)
{
    return (uint32_t)epd_f32_to_bf16(a) | ((uint32_t)epd_f32_to_bf16(b) << 16);
}

/* 16 fp32 values to 16 bf16 (nearest even, gpu/fp8.h's rule) in two 16-byte vectors. */
__device__ __forceinline__ void store_bf16x16(uint16_t *dst, const float *v)
{
    uint4 lo = make_uint4(f32x2_to_bf16(v[0], v[1]), f32x2_to_bf16(v[2], v[3]),
                          f32x2_to_bf16(v[4], v[5]), f32x2_to_bf16(v[6], v[7]));
    uint4 hi = make_uint4(f32x2_to_bf16(v[8], v[9]), f32x2_to_bf16(v[10], v[11]),
                          f32x2_to_bf16(v[12], v[13]), f32x2_to_bf16(v[14], v[15]));
    reinterpret_cast<uint4 *>(dst)[0] = lo;
    reinterpret_cast<uint4 *>(dst)[1] = hi;
}

/* ---- layout ------------------------------------------------------------------------------- */

/* Destination ranks [r0, r0+64) of one token as a bit mask; *bad_p set for an id outside
 * [-1, E). */
__device__ __forceinline__ uint64_t token_mask(const int32_t *ids, uint32_t k_count,
                                               uint32_t per_rank, uint32_t n_experts, uint32_t r0,
                                               bool *bad_p)
{
    uint64_t mask = 0;
    for (uint32_t k = 0; k < k_count; k++) {
        int32_t e = ids[k];
        if (e == -1) continue;
        if (e < -1 || (uint32_t)e >= n_experts) {
            *bad_p = true;
            continue;
        }
        uint32_t r = (uint32_t)e / per_rank;
        if (r >= r0 && r < r0 + 64) mask |= 1ull << (r - r0);
    }
    return mask;
}

/* The layout runs on up to LAYOUT_MAX_TILES blocks, each owning a tile of consecutive tokens
 * (a multiple of LAYOUT_THREADS, walked one token per thread at a time).
 * layout_count_kernel: each tile's records per destination rank into tile_counts[tile][W], and
 * the tokens with a bad id into out[2W + 1] (zeroed before). */
__global__ void __launch_bounds__(LAYOUT_THREADS)
layout_count_kernel(const int32_t *topk_ids, uint32_t n, uint32_t tile, uint32_t k_count,
                    uint32_t n_experts, uint32_t world, uint32_t *tile_counts, uint32_t *out)
{
    __shared__ uint32_t s_count[LAYOUT_MAX_WORLD];
    __shared__ uint32_t s_bad;
    const uint32_t tid = threadIdx.x, lane = tid & 31;
    const uint32_t per_rank = n_experts / world;
    const uint32_t begin = blockIdx.x * tile, end = min(n, begin + tile);

    for (uint32_t r = tid; r < world; r += blockDim.x) s_count[r] = 0;
    if (tid == 0) s_bad = 0;
    __syncthreads();
    for (uint32_t base = begin; base < end; base += blockDim.x) {
        uint32_t t = base + tid;
        bool active = t < end, bad = false;
        for (uint32_t r0 = 0; r0 < world; r0 += 64) {
            uint64_t mask = active ? token_mask(topk_ids + (size_t)t * k_count, k_count, per_rank,
                                                n_experts, r0, &bad)
                                   : 0;
            uint32_t nr = min(64u, world - r0);
            for (uint32_t j = 0; j < nr; j++) {
                uint32_t b = __ballot_sync(0xffffffffu, (mask >> j) & 1u);
                if (lane == 0 && b != 0) atomicAdd(&s_count[r0 + j], (uint32_t)__popc(b));
            }
        }
        if (bad) atomicAdd(&s_bad, 1u);
    }
    __syncthreads();
    for (uint32_t r = tid; r < world; r += blockDim.x)
        tile_counts[(size_t)blockIdx.x * world + r] = s_count[r];
    if (tid == 0 && s_bad != 0) atomicAdd(&out[2 * world + 1], s_bad);
}

/* v[0..n) (shared) replaced by its exclusive prefix sum; returns the total.
 * Every thread of the block calls it. */
__device__ uint32_t block_exclusive_scan(uint32_t *v, uint32_t n)
{
    __shared__ uint32_t s_warp_sum[LAYOUT_THREADS / 32];
    __shared__ uint32_t s_total;
    const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t per = (n + blockDim.x - 1) / blockDim.x;
    const uint32_t begin = min(n, tid * per), end = min(n, begin + per);
    uint32_t sum = 0;

    for (uint32_t i = begin; i < end; i++) sum += v[i];
    uint32_t incl = sum;
    for (uint32_t off = 1; off < 32; off <<= 1) {
        uint32_t o = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += o;
    }
    if (lane == 31) s_warp_sum[warp] = incl;
    __syncthreads();
    if (tid == 0) {
        uint32_t run = 0;
        for (uint32_t w = 0; w < (blockDim.x >> 5); w++) {
            uint32_t c = s_warp_sum[w];
            s_warp_sum[w] = run;
            run += c;
        }
        s_total = run;
    }
    __syncthreads();
    uint32_t run = s_warp_sum[warp] + incl - sum;
    for (uint32_t i = begin; i < end; i++) {
        uint32_t c = v[i];
        v[i] = run;
        run += c;
    }
    uint32_t total = s_total;
    __syncthreads();
    return total;
}

/* layout_slot_kernel: each tile's first record index per rank is the rank's offset (exclusive
 * prefix of the rank totals) + the rank's records in earlier tiles; then the tokens are walked
 * one per thread and each (token, rank) gets that carry + tokens before it in earlier warps
 * (warp prefix) + in earlier lanes (ballot). Token order within a rank, as the host does. Tile
 * 0 writes out: counts[W], offsets[W], total (out[2W + 1] holds the bad tokens). With bad ids
 * every slot is -1. */
__global__ void __launch_bounds__(LAYOUT_THREADS)
layout_slot_kernel(const int32_t *topk_ids, uint32_t n, uint32_t tile, uint32_t k_count,
                   uint32_t n_experts, uint32_t world, const uint32_t *tile_counts, int32_t *slot,
                   uint32_t *out)
{
    __shared__ uint32_t s_total[LAYOUT_MAX_WORLD];
    __shared__ uint32_t s_carry[LAYOUT_MAX_WORLD];
    __shared__ uint32_t s_warp[LAYOUT_THREADS / 32][64];
    const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t n_warps = blockDim.x >> 5;
    const uint32_t per_rank = n_experts / world;
    const uint32_t begin = blockIdx.x * tile, end = min(n, begin + tile);
    const bool bad_ids = out[2 * world + 1] != 0;

    for (uint32_t r = tid; r < world; r += blockDim.x) {
        uint32_t before = 0, total = 0;
        for (uint32_t b = 0; b < gridDim.x; b++) {
            uint32_t c = tile_counts[(size_t)b * world + r];
            if (b < blockIdx.x) before += c;
            total += c;
        }
        s_total[r] = total;
        s_carry[r] = before;
        if (blockIdx.x == 0) out[r] = total;
    }
    __syncthreads();
    uint32_t all = block_exclusive_scan(s_total, world);
    for (uint32_t r = tid; r < world; r += blockDim.x) {
        s_carry[r] += s_total[r];
        if (blockIdx.x == 0) out[world + r] = s_total[r];
    }
    if (blockIdx.x == 0 && tid == 0) out[2 * world] = all;
    __syncthreads();

    const uint32_t lanes_before = (1u << lane) - 1u;
    for (uint32_t base = begin; base < end; base += blockDim.x) {
        uint32_t t = base + tid;
        bool active = t < end, bad = false;
        for (uint32_t r0 = 0; r0 < world; r0 += 64) {
            uint64_t mask = active && !bad_ids
                                ? token_mask(topk_ids + (size_t)t * k_count, k_count, per_rank,
                                             n_experts, r0, &bad)
                                : 0;
            uint32_t nr = min(64u, world - r0);
            for (uint32_t j = 0; j < nr; j++) {
                uint32_t b = __ballot_sync(0xffffffffu, (mask >> j) & 1u);
                if (lane == 0) s_warp[warp][j] = (uint32_t)__popc(b);
            }
            __syncthreads();
            if (tid < nr) {
                uint32_t run = s_carry[r0 + tid];
                for (uint32_t w = 0; w < n_warps; w++) {
                    uint32_t c = s_warp[w][tid];
                    s_warp[w][tid] = run;
                    run += c;
                }
                s_carry[r0 + tid] = run;
            }
            __syncthreads();
            for (uint32_t j = 0; j < nr; j++) {
                uint32_t hit = (uint32_t)((mask >> j) & 1u);
                uint32_t b = __ballot_sync(0xffffffffu, hit);
                if (active)
                    slot[(size_t)t * world + r0 + j] =
                        hit ? (int32_t)(s_warp[warp][j] + (uint32_t)__popc(b & lanes_before)) : -1;
            }
            __syncthreads(); /* s_warp is rewritten by the next chunk or tile */
        }
    }
}

/* Launches kernel (FLAT_THREADS a block) behind the work queued on stream with programmatic
 * dependent launch: the grid may be scheduled while the kernel before it still runs, and waits
 * in cudaGridDependencySynchronize (its first statement: nothing is read or written before it)
 * for that kernel's end and its memory. The kernels before it let it be scheduled from their
 * start (cudaTriggerProgrammaticLaunchCompletion: the wait still waits for their end). The
 * step's kernels follow each other on one stream; this hides the launch gap between them. */
template <typename... Params, typename... Args>
static cudaError_t launch_after(void (*kernel)(Params...), unsigned blocks, cudaStream_t stream,
                                Args... args)
{
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(blocks);
    config.blockDim = dim3(FLAT_THREADS);
    config.stream = stream;
    config.attrs = &attr;
    config.numAttrs = 1;
    return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

/* ---- pack --------------------------------------------------------------------------------- */

struct pack_args {
    const uint16_t *x;
    const int32_t *ids;
    const float *weights;
    const int32_t *slot;  /* read; page-locked host memory when slot_copy is set */
    int32_t *slot_copy;   /* NULL, or the layout's slots on the device, written from slot */
    uint8_t *send;
    uint32_t n, hidden, h16, k_count, world;
    uint32_t rec_size, rec_scales, rec_ids;
    uint32_t tail_words; /* 4-byte words from rec_ids to the end: ids, weights, src, padding */
    int ue8m0;
    double *qe; /* telemetry sums (QE_SLOTS x QE_SUMS), NULL when off */
    uint32_t *smax; /* [world] largest scale (fp32 bits) of the records to each rank, or NULL */
};

/* Metadata word j of token t's records: ids, weights (bit copies), the source index, then zero
 * padding. */
__device__ __forceinline__ uint32_t tail_word(const pack_args &a, uint32_t t, uint32_t j)
{
    if (j < a.k_count) return (uint32_t)a.ids[(size_t)t * a.k_count + j];
    if (j < 2 * a.k_count)
        return __float_as_uint(a.weights[(size_t)t * a.k_count + (j - a.k_count)]);
    return j == 2 * a.k_count ? t : 0u;
}

/* The metadata words of token t handled by thread `part` of `parts`, to each of its n_dst
 * records dst[] (the row pack's compacted slots, in shared memory); first is word `part`,
 * loaded by the caller ahead of time (ids and weights may be host memory: a bus round trip). */
__device__ __forceinline__ void pack_tail_dsts(const pack_args &a, uint32_t t, const int32_t *dst,
                                               uint32_t n_dst, uint32_t part, uint32_t parts,
                                               uint32_t first)
{
    for (uint32_t j = part; j < a.tail_words; j += parts) {
        uint32_t v = j == part ? first : tail_word(a, t, j);
        for (uint32_t d = 0; d < n_dst; d++) {
            uint8_t *rec = a.send + (size_t)dst[d] * a.rec_size;
            *reinterpret_cast<uint32_t *>(rec + a.rec_ids + 4u * j) = v;
        }
    }
}

/* The same to every destination of the token, its slots read from a.slot. */
__device__ __forceinline__ void pack_tail(const pack_args &a, uint32_t t, uint32_t part,
                                          uint32_t parts)
{
    const int32_t *slot = a.slot + (size_t)t * a.world;
    for (uint32_t j = part; j < a.tail_words; j += parts) {
        uint32_t v = tail_word(a, t, j);
        for (uint32_t r = 0; r < a.world; r++) {
            int32_t s = slot[r];
            if (s >= 0)
                *reinterpret_cast<uint32_t *>(a.send + (size_t)s * a.rec_size + a.rec_ids + 4u * j) = v;
        }
    }
}

/* BF16 records, and FP8 with group-128 scales: one block per token (grid-strided), each thread
 * 16 elements per pass. The token's destination slots are read once into shared memory, so the
 * per-element work has no dependent global loads. A group is 8 consecutive threads (H/16 and the
 * block size are multiples of 8), reduced with shuffles; every lane runs every pass so the
 * shuffles see the whole warp. Each element is read once and written to each destination. */
template <bool FP8>
__global__ void __launch_bounds__(PACK_MAX_THREADS) pack_row_kernel(pack_args a, uint32_t passes)
{
    cudaTriggerProgrammaticLaunchCompletion(); /* the experts may be scheduled (launch_after) */
    __shared__ int32_t s_dst[PACK_MAX_DESTS], s_slot[PACK_MAX_DESTS];
    __shared__ uint16_t s_rank[PACK_MAX_DESTS];
    __shared__ float s_wmax[PACK_MAX_THREADS / 32];
    __shared__ uint32_t s_n;
    float qe_e2 = 0.0f, qe_r2 = 0.0f; /* telemetry of this thread's elements, records counted */
    for (uint32_t t = blockIdx.x; t < a.n; t += gridDim.x) {
        /* this thread's first metadata word, in flight with the slots' loads */
        const uint32_t tail_first = threadIdx.x < a.tail_words ? tail_word(a, t, threadIdx.x) : 0u;
        /* the token's W slots loaded side by side, then compacted in rank order by one thread */
        for (uint32_t r = threadIdx.x; r < a.world && r < PACK_MAX_DESTS; r += blockDim.x) {
            int32_t v = a.slot[(size_t)t * a.world + r];
            s_slot[r] = v;
            if (a.slot_copy != NULL) a.slot_copy[(size_t)t * a.world + r] = v;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            uint32_t n = 0;
            for (uint32_t r = 0; r < a.world && r < PACK_MAX_DESTS; r++) {
                if (s_slot[r] >= 0) {
                    s_rank[n] = (uint16_t)r;
                    s_dst[n++] = s_slot[r];
                }
            }
            s_n = n;
        }
        __syncthreads();
        const uint32_t n_dst = s_n;
        const uint16_t *row = a.x + (size_t)t * a.hidden;
        float tok_smax = 0.0f; /* the largest of this thread's group scales of the token */
        /* two passes at a time: both chunks' loads are in flight before either is used */
        for (uint32_t p = 0; p < passes; p += 2) {
            const bool second = p + 1 < passes; /* uniform over the block */
            uint4 lo[2], hi[2];
            uint32_t c[2];
            bool active[2];
#pragma unroll
            for (int k = 0; k < 2; k++) {
                c[k] = threadIdx.x + (p + (uint32_t)k) * blockDim.x;
                active[k] = (k == 0 || second) && c[k] < a.h16;
                lo[k] = hi[k] = make_uint4(0, 0, 0, 0);
                if (active[k]) {
                    const uint4 *src = reinterpret_cast<const uint4 *>(row + (size_t)c[k] * CHUNK);
                    lo[k] = src[0];
                    hi[k] = src[1];
                }
            }
#pragma unroll
            for (int k = 0; k < 2; k++) {
                if (k == 1 && !second) break;
                if (FP8) {
                    uint32_t m = amax16_bits(lo[k], hi[k]);
                    m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
                    m = max(m, __shfl_xor_sync(0xffffffffu, m, 2));
                    m = max(m, __shfl_xor_sync(0xffffffffu, m, 4));
                    if (!active[k]) continue;
                    float scale, mult;
                    epd_quant_scale(__uint_as_float(m << 16), a.ue8m0, &scale, &mult);
                    tok_smax = fmaxf(tok_smax, scale);
                    uint4 q = quant16(lo[k], hi[k], mult);
                    if (a.qe != NULL && n_dst > 0) {
                        float xv[CHUNK], e2 = 0.0f, r2 = 0.0f;
                        bf16x16_to_f32(lo[k], hi[k], xv);
                        epd_dev_qe_chunk(q, scale, xv, &e2, &r2);
                        qe_e2 += e2 * (float)n_dst;
                        qe_r2 += r2 * (float)n_dst;
                    }
                    for (uint32_t d = 0; d < n_dst; d++) {
                        uint8_t *rec = a.send + (size_t)s_dst[d] * a.rec_size;
                        *reinterpret_cast<uint4 *>(rec + (size_t)c[k] * CHUNK) = q;
                        if ((c[k] & 7u) == 0)
                            *reinterpret_cast<float *>(rec + a.rec_scales + 4u * (c[k] >> 3)) = scale;
                    }
                } else if (active[k]) {
                    for (uint32_t d = 0; d < n_dst; d++) {
                        uint4 *dst = reinterpret_cast<uint4 *>(a.send + (size_t)s_dst[d] * a.rec_size +
                                                               (size_t)c[k] * 2 * CHUNK);
                        dst[0] = lo[k];
                        dst[1] = hi[k];
                    }
                }
            }
        }
        if (FP8 && a.smax != NULL) {
            /* the token's largest scale to each of its ranks: a block max, then one atomic a
             * destination (positive floats order like their bits) */
            for (int off = 16; off > 0; off >>= 1)
                tok_smax = fmaxf(tok_smax, __shfl_xor_sync(0xffffffffu, tok_smax, off));
            if ((threadIdx.x & 31) == 0) s_wmax[threadIdx.x / 32] = tok_smax;
            __syncthreads();
            if (threadIdx.x == 0) {
                for (uint32_t w = 1; w < blockDim.x / 32; w++) tok_smax = fmaxf(tok_smax, s_wmax[w]);
                for (uint32_t d = 0; d < n_dst; d++)
                    atomicMax(a.smax + s_rank[d], __float_as_uint(tok_smax));
            }
        }
        pack_tail_dsts(a, t, s_dst, n_dst, threadIdx.x, blockDim.x, tail_first);
        __syncthreads(); /* s_dst is rewritten for the next token */
    }
    if (FP8 && a.qe != NULL) epd_dev_qe_block_add(a.qe, 0, qe_e2, qe_r2);
}

/* FP8 with one scale per token: tpt threads per token (a power of two <= 32, several tokens per
 * block; or a multiple of 32, one token per block), each reading 16 elements per iteration. The
 * row's amax is reduced over the token's threads before quantizing; the first iteration's
 * elements stay in registers, so for H <= 16 * tpt (H <= 8192) the row is read exactly once. */
__global__ void __launch_bounds__(TOKEN_MAX_THREADS) pack_token_kernel(pack_args a, uint32_t tpt, uint32_t iters)
{
    cudaTriggerProgrammaticLaunchCompletion(); /* the experts may be scheduled (launch_after) */
    __shared__ uint32_t s_max[32];
    const uint32_t lt = threadIdx.x % tpt;
    const uint32_t t = blockIdx.x * (blockDim.x / tpt) + threadIdx.x / tpt;
    const bool token = t < a.n;
    const uint16_t *row = a.x + (size_t)(token ? t : 0) * a.hidden;
    uint4 lo0 = make_uint4(0, 0, 0, 0), hi0 = lo0;
    uint32_t m = 0;

    for (uint32_t it = 0; it < iters; it++) {
        uint32_t c = lt + it * tpt;
        if (!token || c >= a.h16) continue;
        const uint4 *src = reinterpret_cast<const uint4 *>(row + (size_t)c * CHUNK);
        uint4 lo = src[0], hi = src[1];
        if (it == 0) {
            lo0 = lo;
            hi0 = hi;
        }
        m = max(m, amax16_bits(lo, hi));
    }
    if (tpt <= 32) {
        for (uint32_t off = tpt / 2; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, off));
    } else {
        for (uint32_t off = 16; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, off));
        if ((threadIdx.x & 31) == 0) s_max[threadIdx.x >> 5] = m;
        __syncthreads();
        m = 0;
        for (uint32_t w = 0; w < (blockDim.x >> 5); w++) m = max(m, s_max[w]);
    }
    float qe_e2 = 0.0f, qe_r2 = 0.0f; /* telemetry, records counted */
    if (token) {
        float scale, mult;
        epd_quant_scale(__uint_as_float(m << 16), a.ue8m0, &scale, &mult);
        const int32_t *slot = a.slot + (size_t)t * a.world;
        uint32_t n_dst = 0;
        if (a.qe != NULL)
            for (uint32_t r = 0; r < a.world; r++) n_dst += slot[r] >= 0;
        for (uint32_t it = 0; it < iters; it++) {
            uint32_t c = lt + it * tpt;
            if (c >= a.h16) break;
            uint4 lo = lo0, hi = hi0;
            if (it > 0) {
                const uint4 *src = reinterpret_cast<const uint4 *>(row + (size_t)c * CHUNK);
                lo = src[0];
                hi = src[1];
            }
            uint4 q = quant16(lo, hi, mult);
            if (n_dst > 0) {
                float xv[CHUNK], e2 = 0.0f, r2 = 0.0f;
                bf16x16_to_f32(lo, hi, xv);
                epd_dev_qe_chunk(q, scale, xv, &e2, &r2);
                qe_e2 += e2 * (float)n_dst;
                qe_r2 += r2 * (float)n_dst;
            }
            for (uint32_t r = 0; r < a.world; r++) {
                int32_t s = slot[r];
                if (s >= 0) *reinterpret_cast<uint4 *>(a.send + (size_t)s * a.rec_size + (size_t)c * CHUNK) = q;
            }
        }
        if (lt == 0) {
            for (uint32_t r = 0; r < a.world; r++) {
                int32_t s = slot[r];
                if (s >= 0) {
                    *reinterpret_cast<float *>(a.send + (size_t)s * a.rec_size + a.rec_scales) = scale;
                    if (a.smax != NULL) atomicMax(a.smax + r, __float_as_uint(scale));
                }
            }
        }
        pack_tail(a, t, lt, tpt);
    }
    /* every thread of the block, with a token or not, takes part in the reduction */
    if (a.qe != NULL) {
        __syncthreads(); /* s_max's last reads are done before qe_block_add's shared memory */
        epd_dev_qe_block_add(a.qe, 0, qe_e2, qe_r2);
    }
}

/* ---- experts ------------------------------------------------------------------------------ */

struct experts_args {
    const uint8_t *recv;
    uint8_t *partials; /* part_size bytes a record (epd_partial_layout) */
    uint32_t n_records, hidden, h16, k_count, n_experts;
    int32_t lo, hi; /* this rank's experts [lo, hi) */
    uint32_t rec_size, rec_scales, rec_ids, rec_weights;
    uint32_t part_size;
    int per_token;
    double *qe; /* telemetry sums of FP8 partials, NULL when off */
};

/* The elementwise expert kinds of the experts kernel, the device twins of gpu/ops_host.c's
 * tables (DESIGN.md section 9), given to it as a template parameter. A kind with a factor
 * computes y = x * f_e (the factors of the rank's experts tabulated once per block); one without
 * has y = x, and its kernel has neither the table nor the multiply. */
struct identity_expert {
    static constexpr bool has_factor = false;
    __device__ static __forceinline__ float factor(const experts_args &, int32_t) { return 1.0f; }
};

struct scale_expert {
    static constexpr bool has_factor = true;
    /* f_e = 1 + e/E in fp32 */
    __device__ static __forceinline__ float factor(const experts_args &a, int32_t e)
    {
        return __fadd_rn(1.0f, __fdiv_rn((float)e, (float)a.n_experts));
    }
};

/* 16 elements of a record as fp32: e4m3 codes times their scale, or widened bf16. */
template <bool FP8>
__device__ __forceinline__ void widen16(uint4 a, uint4 b, float s, float *x)
{
    if (FP8) {
        e4m3x4_to_f32(a.x, x);
        e4m3x4_to_f32(a.y, x + 4);
        e4m3x4_to_f32(a.z, x + 8);
        e4m3x4_to_f32(a.w, x + 12);
#pragma unroll
        for (int i = 0; i < CHUNK; i++) x[i] = __fmul_rn(x[i], s);
    } else {
        bf16x16_to_f32(a, b, x);
    }
}

/* 16 fp32 values to bf16 as store_bf16x16 does, with the hardware conversion (round to nearest
 * even; one instruction per pair) when all are finite. Their sum is finite only then; otherwise
 * (NaN, Inf, or a sum that overflows) the bit rule of gpu/fp8.h runs, so NaN bits never depend
 * on the hardware. */
__device__ __forceinline__ void store_bf16x16_fast(uint16_t *dst, const float *v)
{
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < CHUNK; i++) sum = __fadd_rn(sum, v[i]);
    if (!isfinite(sum)) {
        store_bf16x16(dst, v);
        return;
    }
    uint32_t w[CHUNK / 2];
#pragma unroll
    for (int p = 0; p < CHUNK / 2; p++) w[p] = epd_dev_bf16x2(v[2 * p], v[2 * p + 1]);
    reinterpret_cast<uint4 *>(dst)[0] = make_uint4(w[0], w[1], w[2], w[3]);
    reinterpret_cast<uint4 *>(dst)[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

/* Flat over (record, unit): a unit is UNITS chunks of 16 elements, chunks u and u + h16/UNITS
 * of the record so that each load instruction of a warp is contiguous; all of a unit's loads are
 * issued before any is used. The kernel is bound by instructions, not memory: the record's local
 * top-k slots become a bit mask once per unit, and each chunk then runs only its local slots,
 * acc = acc + w_k * expert_k(x) in ascending k from 0.0f, rounded to bf16. The ids and weights
 * are uniform loads (the threads of a record read the same 2K words, served by L1); the factors
 * of the local experts are tabulated once per block (table) when they fit. */
template <bool FP8, typename Expert>
__global__ void __launch_bounds__(FLAT_THREADS) experts_kernel(experts_args a)
{
    cudaGridDependencySynchronize(); /* launched early (launch_after): the pack's records first */
    cudaTriggerProgrammaticLaunchCompletion(); /* and the combine may be scheduled */
    constexpr uint32_t UNITS = 2;
    __shared__ float s_f[EXPERT_TABLE];
    const uint32_t per_rank = (uint32_t)(a.hi - a.lo);
    const bool table = Expert::has_factor && per_rank <= EXPERT_TABLE;
    if (table)
        for (uint32_t i = threadIdx.x; i < per_rank; i += blockDim.x)
            s_f[i] = Expert::factor(a, a.lo + (int32_t)i);
    __syncthreads();

    const uint32_t per_rec = a.h16 / UNITS; /* h16 is a multiple of 8 */
    const uint64_t total = (uint64_t)a.n_records * per_rec;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t idx = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        uint32_t j, u;
        split_flat(idx, per_rec, &j, &u);
        const uint8_t *rec = a.recv + (size_t)j * a.rec_size;
        const int32_t *ids = reinterpret_cast<const int32_t *>(rec + a.rec_ids);
        const float *wts = reinterpret_cast<const float *>(rec + a.rec_weights);
        uint4 ra[UNITS], rb[UNITS];
        float sc[UNITS];
#pragma unroll
        for (uint32_t i = 0; i < UNITS; i++) {
            const uint32_t c = u + i * per_rec;
            if (FP8) {
                ra[i] = __ldg(reinterpret_cast<const uint4 *>(rec + (size_t)c * CHUNK));
                rb[i] = make_uint4(0, 0, 0, 0);
                sc[i] = __ldg(reinterpret_cast<const float *>(rec + a.rec_scales +
                                                              (a.per_token ? 0u : 4u * (c >> 3))));
            } else {
                const uint4 *src = reinterpret_cast<const uint4 *>(rec + (size_t)c * 2 * CHUNK);
                ra[i] = __ldg(src);
                rb[i] = __ldg(src + 1);
                sc[i] = 1.0f;
            }
        }
        uint64_t local = 0; /* bit k: slot k's expert is on this rank (-1 is not) */
        for (uint32_t k = 0; k < a.k_count; k++) {
            const int32_t e = __ldg(ids + k);
            if (e >= a.lo && e < a.hi) local |= 1ull << k;
        }
#pragma unroll
        for (uint32_t i = 0; i < UNITS; i++) {
            float x[CHUNK], acc[CHUNK];
            widen16<FP8>(ra[i], rb[i], sc[i], x);
#pragma unroll
            for (int v = 0; v < CHUNK; v++) acc[v] = 0.0f;
            for (uint64_t m = local; m != 0; m &= m - 1) {
                const uint32_t k = (uint32_t)__ffsll((long long)m) - 1;
                const float w = __ldg(wts + k);
                if (Expert::has_factor) {
                    const int32_t e = __ldg(ids + k);
                    const float f = table ? s_f[e - a.lo] : Expert::factor(a, e);
#pragma unroll
                    for (int v = 0; v < CHUNK; v++) acc[v] = __fadd_rn(acc[v], __fmul_rn(w, __fmul_rn(x[v], f)));
                } else {
#pragma unroll
                    for (int v = 0; v < CHUNK; v++) acc[v] = __fadd_rn(acc[v], __fmul_rn(w, x[v]));
                }
            }
            store_bf16x16_fast(reinterpret_cast<uint16_t *>(a.partials + (size_t)j * a.part_size) +
                                   (size_t)(u + i * per_rec) * CHUNK,
                               acc);
        }
    }
}

/* An FP8 partial's 16 elements c of record j (gpu/partial_dev.cuh), with the telemetry when
 * a.qe is set. */
__device__ __forceinline__ void store_fp8_partial16(const experts_args &a, bool active, uint32_t j,
                                                    uint32_t c, const float *acc, float *e2,
                                                    float *r2)
{
    epd_dev_store_fp8_partial16(a.partials + (size_t)j * a.part_size, a.hidden, a.part_size,
                                active, c, acc, a.qe != NULL, e2, r2);
}

/* The experts with FP8 partials: the arithmetic of experts_kernel, one chunk of 16 elements a
 * thread so that a group of 128 is 8 consecutive lanes of one record (H/16 is a multiple of 8,
 * blocks are whole warps). The grid-stride loop advances whole blocks, so every lane of a warp
 * runs every iteration and the shuffles see all of it. */
template <bool FP8, typename Expert>
__global__ void __launch_bounds__(FLAT_THREADS) experts_fp8_partials_kernel(experts_args a)
{
    cudaGridDependencySynchronize(); /* launched early (launch_after): the pack's records first */
    cudaTriggerProgrammaticLaunchCompletion(); /* and the combine may be scheduled */
    __shared__ float s_f[EXPERT_TABLE];
    const uint32_t per_rank = (uint32_t)(a.hi - a.lo);
    const bool table = Expert::has_factor && per_rank <= EXPERT_TABLE;
    if (table)
        for (uint32_t i = threadIdx.x; i < per_rank; i += blockDim.x)
            s_f[i] = Expert::factor(a, a.lo + (int32_t)i);
    __syncthreads();

    const uint64_t total = (uint64_t)a.n_records * a.h16;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    float e2 = 0.0f, r2 = 0.0f;
    for (uint64_t base = (uint64_t)blockIdx.x * blockDim.x; base < total; base += stride) {
        const uint64_t idx = base + threadIdx.x;
        const bool active = idx < total;
        uint32_t j = 0, c = 0;
        if (active) split_flat(idx, a.h16, &j, &c);
        float acc[CHUNK];
#pragma unroll
        for (int v = 0; v < CHUNK; v++) acc[v] = 0.0f;
        if (active) {
            const uint8_t *rec = a.recv + (size_t)j * a.rec_size;
            const int32_t *ids = reinterpret_cast<const int32_t *>(rec + a.rec_ids);
            const float *wts = reinterpret_cast<const float *>(rec + a.rec_weights);
            uint4 ra, rb;
            float sc;
            if (FP8) {
                ra = __ldg(reinterpret_cast<const uint4 *>(rec + (size_t)c * CHUNK));
                rb = make_uint4(0, 0, 0, 0);
                sc = __ldg(reinterpret_cast<const float *>(rec + a.rec_scales +
                                                           (a.per_token ? 0u : 4u * (c >> 3))));
            } else {
                const uint4 *src = reinterpret_cast<const uint4 *>(rec + (size_t)c * 2 * CHUNK);
                ra = __ldg(src);
                rb = __ldg(src + 1);
                sc = 1.0f;
            }
            float x[CHUNK];
            widen16<FP8>(ra, rb, sc, x);
            for (uint32_t k = 0; k < a.k_count; k++) {
                const int32_t e = __ldg(ids + k);
                if (e < a.lo || e >= a.hi) continue; /* -1 is not local either */
                const float w = __ldg(wts + k);
                if (Expert::has_factor) {
                    const float f = table ? s_f[e - a.lo] : Expert::factor(a, e);
#pragma unroll
                    for (int v = 0; v < CHUNK; v++) acc[v] = __fadd_rn(acc[v], __fmul_rn(w, __fmul_rn(x[v], f)));
                } else {
#pragma unroll
                    for (int v = 0; v < CHUNK; v++) acc[v] = __fadd_rn(acc[v], __fmul_rn(w, x[v]));
                }
            }
        }
        store_fp8_partial16(a, active, j, c, acc, &e2, &r2);
    }
    if (a.qe != NULL) epd_dev_qe_block_add(a.qe, 2, e2, r2);
}

typedef void (*experts_kernel_fn)(experts_args);

/* A CUDA expert kind: the kind value of its host twin (epd_expert_ops_find gives the name), and
 * its kernels for FP8 and BF16 records, with BF16 partials and (_fp8p) FP8 partials. A new kind
 * is one entry of cuda_expert_kinds. */
struct cuda_expert_ops {
    epd_expert_kind_t kind;
    experts_kernel_fn kernel_fp8;
    experts_kernel_fn kernel_bf16;
    experts_kernel_fn kernel_fp8_fp8p;
    experts_kernel_fn kernel_bf16_fp8p;
};

static const cuda_expert_ops cuda_expert_kinds[] = {
    {
        .kind = EPD_EXPERTS_IDENTITY,
        .kernel_fp8 = experts_kernel<true, identity_expert>,
        .kernel_bf16 = experts_kernel<false, identity_expert>,
        .kernel_fp8_fp8p = experts_fp8_partials_kernel<true, identity_expert>,
        .kernel_bf16_fp8p = experts_fp8_partials_kernel<false, identity_expert>,
    },
    {
        .kind = EPD_EXPERTS_SCALE,
        .kernel_fp8 = experts_kernel<true, scale_expert>,
        .kernel_bf16 = experts_kernel<false, scale_expert>,
        .kernel_fp8_fp8p = experts_fp8_partials_kernel<true, scale_expert>,
        .kernel_bf16_fp8p = experts_fp8_partials_kernel<false, scale_expert>,
    },
};

/* The CUDA expert kind of a kind value; NULL when this implementation has none. */
static const cuda_expert_ops *cuda_expert_find(epd_expert_kind_t kind)
{
    for (size_t i = 0; i < EPD_ARRAY_SIZE(cuda_expert_kinds); i++)
        if (cuda_expert_kinds[i].kind == kind) return &cuda_expert_kinds[i];
    return NULL;
}

/* ---- combine ------------------------------------------------------------------------------ */

/* One thread per 16 elements of an output row: the partials of the token's records (part_size
 * bytes each; FP8P: e4m3 codes then group scales, dequantized (float)q * s) summed in ascending
 * rank order from 0.0f, rounded to bf16; zeros for a token without records. */
template <bool FP8P>
__global__ void __launch_bounds__(FLAT_THREADS)
combine_kernel(const int32_t *slot, const uint8_t *partials, uint16_t *y, uint32_t n,
               uint32_t hidden, uint32_t h16, uint32_t world, uint32_t part_size)
{
    cudaGridDependencySynchronize(); /* launched early (launch_after): the partials first */
    const uint64_t total = (uint64_t)n * h16;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t idx = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        uint32_t t, c;
        split_flat(idx, h16, &t, &c);
        float acc[CHUNK];
#pragma unroll
        for (int i = 0; i < CHUNK; i++) acc[i] = 0.0f;
        for (uint32_t r = 0; r < world; r++) {
            int32_t s = slot[(size_t)t * world + r];
            if (s < 0) continue;
            const uint8_t *part = partials + (size_t)s * part_size;
            float p[CHUNK];
            if (FP8P) {
                uint4 q = *reinterpret_cast<const uint4 *>(part + (size_t)c * CHUNK);
                float sc = *reinterpret_cast<const float *>(part + hidden + 4u * (c >> 3));
                epd_dev_dequant16(q, sc, p);
            } else {
                const uint4 *src = reinterpret_cast<const uint4 *>(part + (size_t)c * 2 * CHUNK);
                bf16x16_to_f32(src[0], src[1], p);
            }
#pragma unroll
            for (int i = 0; i < CHUNK; i++) acc[i] = __fadd_rn(acc[i], p[i]);
        }
        store_bf16x16(y + (size_t)t * hidden + (size_t)c * CHUNK, acc);
    }
}

/* ---- the ops table ------------------------------------------------------------------------ */

static epd_status_t cuda_init(int device_id, epd_ops_ctx_t **ctx_p, char err[EPD_ERR_LEN])
{
    epd_ops_ctx_t *ctx;
    cudaError_t rc;
    const char *what = "";

    *ctx_p = NULL;
    if (device_id < 0) {
        snprintf(err, EPD_ERR_LEN, "cuda ops: bad device id %d", device_id);
        return EPD_ERR_INVALID_ARG;
    }
    ctx = (epd_ops_ctx_t *)calloc(1, sizeof *ctx);
    if (ctx == NULL) {
        snprintf(err, EPD_ERR_LEN, "cuda ops: out of memory");
        return EPD_ERR_NO_MEMORY;
    }
    ctx->device = device_id;
    if ((rc = cudaSetDevice(device_id)) != cudaSuccess) {
        what = "cudaSetDevice";
        goto err_free;
    }
    if ((rc = cudaStreamCreateWithFlags(&ctx->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        what = "cudaStreamCreateWithFlags";
        goto err_free;
    }
    if ((rc = cudaStreamCreateWithFlags(&ctx->down, cudaStreamNonBlocking)) != cudaSuccess) {
        what = "cudaStreamCreateWithFlags";
        goto err_stream;
    }
    if ((rc = cudaStreamCreateWithFlags(&ctx->up, cudaStreamNonBlocking)) != cudaSuccess) {
        what = "cudaStreamCreateWithFlags";
        goto err_down;
    }
    if ((rc = cudaMalloc(&ctx->layout_dev, (SCALE_MAX_AT + LAYOUT_MAX_WORLD) * sizeof(uint32_t))) !=
        cudaSuccess) {
        what = "cudaMalloc";
        goto err_up;
    }
    if ((rc = cudaMallocHost(&ctx->layout_host, (2 * LAYOUT_MAX_WORLD + 2) * sizeof(uint32_t))) != cudaSuccess) {
        what = "cudaMallocHost";
        goto err_layout_dev;
    }
    if ((rc = cudaMalloc(&ctx->tile_counts, (size_t)LAYOUT_MAX_TILES * LAYOUT_MAX_WORLD * sizeof(uint32_t))) !=
        cudaSuccess) {
        what = "cudaMalloc";
        goto err_layout_host;
    }
    if ((rc = cudaEventCreateWithFlags(&ctx->layout_done, cudaEventDisableTiming)) != cudaSuccess) {
        what = "cudaEventCreateWithFlags";
        goto err_tile_counts;
    }
    if ((rc = cudaMalloc(&ctx->qe_dev, QE_SLOTS * QE_SUMS * sizeof(double))) != cudaSuccess) {
        what = "cudaMalloc";
        goto err_event;
    }
    if ((rc = cudaMallocHost(&ctx->qe_host, QE_SLOTS * QE_SUMS * sizeof(double))) != cudaSuccess) {
        what = "cudaMallocHost";
        goto err_qe_dev;
    }
    /* on the ops stream, which does not wait for the legacy one */
    if ((rc = cudaMemsetAsync(ctx->qe_dev, 0, QE_SLOTS * QE_SUMS * sizeof(double), ctx->stream)) !=
            cudaSuccess ||
        (rc = cudaStreamSynchronize(ctx->stream)) != cudaSuccess) {
        what = "zeroing the telemetry sums";
        goto err_qe_host;
    }
    *ctx_p = ctx;
    return EPD_OK;

err_qe_host:
    cudaFreeHost(ctx->qe_host);
err_qe_dev:
    cudaFree(ctx->qe_dev);
err_event:
    cudaEventDestroy(ctx->layout_done);
err_tile_counts:
    cudaFree(ctx->tile_counts);
err_layout_host:
    cudaFreeHost(ctx->layout_host);
err_layout_dev:
    cudaFree(ctx->layout_dev);
err_up:
    cudaStreamDestroy(ctx->up);
err_down:
    cudaStreamDestroy(ctx->down);
err_stream:
    cudaStreamDestroy(ctx->stream);
err_free:
    snprintf(err, EPD_ERR_LEN, "cuda ops on device %d: %s: %s", device_id, what, cudaGetErrorString(rc));
    free(ctx);
    return EPD_ERR_CUDA;
}

static void cuda_fini(epd_ops_ctx_t *ctx)
{
    if (ctx == NULL) return;
    if (cudaSetDevice(ctx->device) == cudaSuccess) {
        epd_ffn_cuda_destroy(ctx->ffn);
        cudaFree(ctx->expert_hist_dev);
        cudaFreeHost(ctx->expert_hist_host);
        cudaStreamSynchronize(ctx->stream);
        cudaStreamSynchronize(ctx->down);
        cudaStreamSynchronize(ctx->up);
        if (ctx->ingest_ready) {
            cudaStreamSynchronize(ctx->ingest);
            for (unsigned g = 0; g < INGEST_GRAPHS; g++)
                if (ctx->ingest_graph[g].blocks != 0) {
                    cudaGraphExecDestroy(ctx->ingest_graph[g].exec);
                    cudaGraphDestroy(ctx->ingest_graph[g].graph);
                }
            if (ctx->ingest_pool != NULL) cudaMemPoolDestroy(ctx->ingest_pool);
            cudaFreeHost(ctx->ingest_host);
            cudaFreeHost(ctx->ingest_done_host);
            cudaFreeHost(ctx->ingest_ll);
            if (ctx->ingest_stage != NULL) cudaFreeHost(ctx->ingest_stage);
            cudaStreamDestroy(ctx->ingest);
        }
        cudaFreeHost(ctx->qe_host);
        cudaFree(ctx->qe_dev);
        cudaEventDestroy(ctx->layout_done);
        cudaFree(ctx->tile_counts);
        cudaFreeHost(ctx->layout_host);
        cudaFree(ctx->layout_dev);
        cudaStreamDestroy(ctx->up);
        cudaStreamDestroy(ctx->down);
        cudaStreamDestroy(ctx->stream);
    }
    free(ctx);
}

/* At least 256 bytes, so an empty buffer is still a valid pointer (as the host ops give). */
static void *cuda_alloc(epd_ops_ctx_t *ctx, size_t bytes)
{
    void *ptr = NULL;
    cudaError_t rc;

    if (enter(ctx) != EPD_OK) return NULL;
    rc = cudaMalloc(&ptr, bytes < 256 ? 256 : bytes);
    if (rc != cudaSuccess) {
        cuda_fail(ctx, rc, "cudaMalloc");
        return NULL;
    }
    return ptr;
}

static void cuda_free(epd_ops_ctx_t *ctx, void *ptr)
{
    if (ptr == NULL || enter(ctx) != EPD_OK) return;
    cudaFree(ptr);
}

static void *cuda_alloc_host(epd_ops_ctx_t *ctx, size_t bytes)
{
    void *ptr = NULL;
    cudaError_t rc;

    if (enter(ctx) != EPD_OK) return NULL;
    rc = cudaMallocHost(&ptr, bytes < 256 ? 256 : bytes);
    if (rc != cudaSuccess) {
        cuda_fail(ctx, rc, "cudaMallocHost");
        return NULL;
    }
    return ptr;
}

static void cuda_free_host(epd_ops_ctx_t *ctx, void *ptr)
{
    if (ptr == NULL || enter(ctx) != EPD_OK) return;
    cudaFreeHost(ptr);
}

/* Both copies are complete when they return (in stream order after earlier ops), so the host
 * side may be reused or read at once, whether it is pinned or not. */
static epd_status_t cuda_copy(epd_ops_ctx_t *ctx, void *dst, const void *src, size_t bytes,
                              cudaMemcpyKind kind)
{
    epd_status_t status;

    CHECK_GOTO(enter(ctx), out);
    if (bytes == 0) return EPD_OK;
    if (dst == NULL || src == NULL) return bad_arg(ctx, "copy with a NULL pointer");
    CUDA_TRY(ctx, cudaMemcpyAsync(dst, src, bytes, kind, ctx->stream), "cudaMemcpyAsync");
    CUDA_TRY(ctx, cudaStreamSynchronize(ctx->stream), "cudaStreamSynchronize after a copy");
out:
    return status;
}

static epd_status_t cuda_copy_to_ops(epd_ops_ctx_t *ctx, void *dst, const void *src_host, size_t bytes)
{
    return cuda_copy(ctx, dst, src_host, bytes, cudaMemcpyHostToDevice);
}

static epd_status_t cuda_copy_to_host(epd_ops_ctx_t *ctx, void *dst_host, const void *src, size_t bytes)
{
    return cuda_copy(ctx, dst_host, src, bytes, cudaMemcpyDeviceToHost);
}

static epd_status_t cuda_copy_queued(epd_ops_ctx_t *ctx, void *dst, const void *src, size_t bytes)
{
    epd_status_t status;

    CHECK_GOTO(enter(ctx), out);
    if (bytes > 0)
        CUDA_TRY(ctx, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, ctx->stream),
                 "cudaMemcpyAsync");
out:
    return status;
}

static epd_status_t cuda_sync(epd_ops_ctx_t *ctx)
{
    epd_status_t status;

    CHECK_GOTO(enter(ctx), out);
    CUDA_TRY(ctx, cudaStreamSynchronize(ctx->stream), "cudaStreamSynchronize");
out:
    return status;
}

/* tokens per expert (ids distinct per token; -1 and out-of-range ids are the layout's to refuse) */
__global__ void expert_hist_kernel(const int32_t *topk_ids, uint64_t n_ids, uint32_t n_experts,
                                   uint32_t *hist)
{
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n_ids;
         i += (uint64_t)gridDim.x * blockDim.x) {
        int32_t e = topk_ids[i];
        if (e >= 0 && (uint32_t)e < n_experts) atomicAdd(&hist[e], 1u);
    }
}

/* The expert histogram of a layout that asks for one (expert_counts_host), queued on the stream
 * before the layout's read-back event. */
static epd_status_t queue_expert_hist(epd_ops_ctx_t *ctx, const epd_moe_shape_t *shape,
                                      const int32_t *topk_ids, uint32_t n)
{
    uint32_t e = shape->num_experts;

    if (ctx->expert_hist_cap < e) {
        cudaFree(ctx->expert_hist_dev);
        cudaFreeHost(ctx->expert_hist_host);
        ctx->expert_hist_dev = NULL;
        ctx->expert_hist_host = NULL;
        ctx->expert_hist_cap = 0;
        CUDA_TRY(ctx, cudaMalloc(&ctx->expert_hist_dev, e * sizeof(uint32_t)), "cudaMalloc");
        CUDA_TRY(ctx, cudaMallocHost(&ctx->expert_hist_host, e * sizeof(uint32_t)),
                 "cudaMallocHost");
        ctx->expert_hist_cap = e;
    }
    CUDA_TRY(ctx, cudaMemsetAsync(ctx->expert_hist_dev, 0, e * sizeof(uint32_t), ctx->stream),
             "cudaMemsetAsync of the expert counts");
    if (n > 0) {
        uint64_t n_ids = (uint64_t)n * shape->topk;
        uint64_t blocks = (n_ids + 255) / 256;
        expert_hist_kernel<<<(unsigned)(blocks < 1024 ? blocks : 1024), 256, 0, ctx->stream>>>(
            topk_ids, n_ids, e, ctx->expert_hist_dev);
        CUDA_TRY(ctx, cudaGetLastError(), "expert count kernel launch");
    }
    CUDA_TRY(ctx, cudaMemcpyAsync(ctx->expert_hist_host, ctx->expert_hist_dev, e * sizeof(uint32_t),
                                  cudaMemcpyDeviceToHost, ctx->stream),
             "cudaMemcpyAsync of the expert counts");
    return EPD_OK;
}

/* Queues the two layout kernels and the read-back of the counts (layout_done marks it) and
 * returns: cuda_layout_counts waits for the counts, while pack, queued next, already runs. */
static epd_status_t cuda_layout(epd_ops_ctx_t *ctx, const epd_moe_shape_t *shape,
                                const int32_t *topk_ids, epd_step_layout_t *layout)
{
    epd_status_t status;
    uint32_t world, n, tile, tiles;

    CHECK_GOTO(enter(ctx), out);
    if (!shape_fits(ctx, shape)) return EPD_ERR_INVALID_ARG;
    if (layout == NULL || layout->send_counts_host == NULL || layout->send_offsets_host == NULL)
        return bad_arg(ctx, "layout without its count arrays");
    world = shape->world;
    n = layout->n_tokens;
    if (n > 0 && (topk_ids == NULL || layout->slot == NULL)) return bad_arg(ctx, "layout with a NULL buffer");
    layout->n_send = 0;

    CUDA_TRY(ctx, cudaMemsetAsync(ctx->layout_dev, 0, (2 * world + 2) * sizeof(uint32_t), ctx->stream),
             "cudaMemsetAsync of the layout counts");
    if (n > 0) {
        /* LAYOUT_THREADS-token steps, spread over at most LAYOUT_MAX_TILES blocks */
        uint32_t steps = (n + LAYOUT_THREADS - 1) / LAYOUT_THREADS;
        tile = (steps + LAYOUT_MAX_TILES - 1) / LAYOUT_MAX_TILES * LAYOUT_THREADS;
        tiles = (n + tile - 1) / tile;
        layout_count_kernel<<<tiles, LAYOUT_THREADS, 0, ctx->stream>>>(
            topk_ids, n, tile, shape->topk, shape->num_experts, world, ctx->tile_counts, ctx->layout_dev);
        CUDA_TRY(ctx, cudaGetLastError(), "layout count kernel launch");
        layout_slot_kernel<<<tiles, LAYOUT_THREADS, 0, ctx->stream>>>(
            topk_ids, n, tile, shape->topk, shape->num_experts, world, ctx->tile_counts, layout->slot,
            ctx->layout_dev);
        CUDA_TRY(ctx, cudaGetLastError(), "layout slot kernel launch");
    }
    CUDA_TRY(ctx, cudaMemcpyAsync(ctx->layout_host, ctx->layout_dev, (2 * world + 2) * sizeof(uint32_t),
                                  cudaMemcpyDeviceToHost, ctx->stream),
             "cudaMemcpyAsync of the layout counts");
    if (layout->expert_counts_host != NULL)
        CHECK_GOTO(queue_expert_hist(ctx, shape, topk_ids, n), out);
    CUDA_TRY(ctx, cudaEventRecord(ctx->layout_done, ctx->stream), "cudaEventRecord after the layout");
out:
    return status;
}

static epd_status_t cuda_layout_counts(epd_ops_ctx_t *ctx, const epd_moe_shape_t *shape,
                                       epd_step_layout_t *layout)
{
    epd_status_t status;
    uint32_t world;

    CHECK_GOTO(enter(ctx), out);
    if (!shape_fits(ctx, shape)) return EPD_ERR_INVALID_ARG;
    if (layout == NULL || layout->send_counts_host == NULL || layout->send_offsets_host == NULL)
        return bad_arg(ctx, "layout_counts without the count arrays");
    world = shape->world;
    CUDA_TRY(ctx, cudaEventSynchronize(ctx->layout_done), "layout");
    if (ctx->layout_host[2 * world + 1] != 0) {
        snprintf(ctx->err, EPD_ERR_LEN, "cuda ops: %u tokens have an expert id outside [-1, %u)",
                 ctx->layout_host[2 * world + 1], shape->num_experts);
        return EPD_ERR_EXPERT_OUT_OF_RANGE;
    }
    memcpy(layout->send_counts_host, ctx->layout_host, world * sizeof(uint32_t));
    memcpy(layout->send_offsets_host, ctx->layout_host + world, world * sizeof(uint32_t));
    layout->n_send = ctx->layout_host[2 * world];
    if (layout->expert_counts_host != NULL)
        memcpy(layout->expert_counts_host, ctx->expert_hist_host,
               shape->num_experts * sizeof(uint32_t));
out:
    return status;
}

static epd_status_t cuda_pack(epd_ops_ctx_t *ctx, const epd_moe_shape_t *shape, const uint16_t *x,
                              const int32_t *topk_ids, const float *topk_weights,
                              const epd_step_layout_t *layout, void *send_buf)
{
    epd_status_t status;
    epd_record_layout_t rec;
    pack_args a;
    bool row_kernel;

    CHECK_GOTO(enter(ctx), out);
    if (!shape_fits(ctx, shape)) return EPD_ERR_INVALID_ARG;
    if (layout == NULL) return bad_arg(ctx, "pack without a layout");
    if (layout->n_tokens == 0) return EPD_OK; /* n_send may not be known yet (cuda_layout) */
    if (x == NULL || topk_ids == NULL || topk_weights == NULL || layout->slot == NULL || send_buf == NULL)
        return bad_arg(ctx, "pack with a NULL buffer");
    if (!aligned16(x) || !aligned16(send_buf))
        return bad_arg(ctx, "pack: x and the send buffer must be 16-byte aligned");
    epd_record_layout(shape, &rec);

    memset(&a, 0, sizeof a);
    a.x = x;
    a.ids = topk_ids;
    a.weights = topk_weights;
    a.slot = layout->slot;
    a.send = (uint8_t *)send_buf;
    row_kernel = shape->dtype == EPD_WIRE_BF16 || shape->scale == EPD_SCALE_GROUP128;
    if (layout->slot_src_host != NULL) {
        /* the row pack reads the host's slots once a token over the bus and leaves them in
         * layout->slot; the token pack reads its slots in every thread: those are copied */
        if (row_kernel) {
            a.slot = layout->slot_src_host;
            a.slot_copy = layout->slot;
        } else {
            CUDA_TRY(ctx, cudaMemcpyAsync(layout->slot, layout->slot_src_host,
                                          (size_t)layout->n_tokens * shape->world * sizeof(int32_t),
                                          cudaMemcpyHostToDevice, ctx->stream),
                     "cudaMemcpyAsync of the slots");
        }
    }
    a.n = layout->n_tokens;
    a.hidden = shape->hidden;
    a.h16 = shape->hidden / CHUNK;
    a.k_count = shape->topk;
    a.world = shape->world;
    a.rec_size = (uint32_t)rec.size;
    a.rec_scales = (uint32_t)rec.scales;
    a.rec_ids = (uint32_t)rec.ids;
    a.tail_words = (uint32_t)((rec.size - rec.ids) / 4);
    a.ue8m0 = shape->scale_format == EPD_SCALE_FMT_UE8M0;
    a.qe = shape->quant_error && shape->dtype == EPD_WIRE_FP8 ? ctx->qe_dev : NULL;
    if (layout->scale_max_host != NULL && shape->dtype == EPD_WIRE_FP8) {
        a.smax = ctx->layout_dev + SCALE_MAX_AT;
        CUDA_TRY(ctx, cudaMemsetAsync(a.smax, 0, shape->world * sizeof(uint32_t), ctx->stream),
                 "cudaMemsetAsync of the scale maxima");
    }

    if (row_kernel) {
        uint32_t threads = row_threads(a.h16, PACK_MAX_THREADS);
        uint32_t passes = (a.h16 + threads - 1) / threads;
        uint32_t blocks = a.n < 0x7fffffffu ? a.n : 0x7fffffffu;
        if (shape->dtype == EPD_WIRE_BF16)
            pack_row_kernel<false><<<blocks, threads, 0, ctx->stream>>>(a, passes);
        else
            pack_row_kernel<true><<<blocks, threads, 0, ctx->stream>>>(a, passes);
    } else {
        uint32_t tpt, per_block;
        if (a.h16 <= 32) {
            tpt = 8; /* h16 is a multiple of 8 */
            while (tpt < a.h16) tpt <<= 1;
            per_block = FLAT_THREADS / tpt;
        } else {
            tpt = a.h16 > TOKEN_MAX_THREADS ? TOKEN_MAX_THREADS : (a.h16 + 31) / 32 * 32;
            per_block = 1;
        }
        uint32_t iters = (a.h16 + tpt - 1) / tpt;
        uint32_t blocks = (a.n + per_block - 1) / per_block;
        pack_token_kernel<<<blocks, tpt * per_block, 0, ctx->stream>>>(a, tpt, iters);
    }
    CUDA_TRY(ctx, cudaGetLastError(), "pack kernel launch");
    if (a.smax != NULL)
        CUDA_TRY(ctx, cudaMemcpyAsync(layout->scale_max_host, a.smax, shape->world * sizeof(float),
                                      cudaMemcpyDeviceToHost, ctx->stream),
                 "cudaMemcpyAsync of the scale maxima");
out:
    return status;
}

/* The ffn weights to the device, once. */
static epd_status_t cuda_experts_load(epd_ops_ctx_t *ctx, const epd_moe_shape_t *shape,
                                      const epd_ffn_weights_t *weights, char err[EPD_ERR_LEN])
{
    epd_status_t status;
    uint32_t per_rank;

    err[0] = '\0';
    CHECK_GOTO(enter(ctx), out);
    if (!shape_fits(ctx, shape) || weights == NULL) {
        snprintf(err, EPD_ERR_LEN, "%s", ctx->err[0] ? ctx->err : "cuda ops: no weights");
        return EPD_ERR_INVALID_ARG;
    }
    per_rank = shape->num_experts / shape->world;
    if (weights->hidden != shape->hidden || weights->first_expert > shape->rank * per_rank ||
        weights->first_expert + weights->n_local < (shape->rank + 1) * per_rank) {
        snprintf(err, EPD_ERR_LEN, "cuda ops: the ffn weights do not hold rank %u's experts",
                 shape->rank);
        return EPD_ERR_INVALID_ARG;
    }
    if (ctx->ffn != NULL) {
        snprintf(err, EPD_ERR_LEN, "cuda ops: ffn weights are already loaded");
        return EPD_ERR_INVALID_ARG;
    }
    status = epd_ffn_cuda_create(weights, ctx->stream, &ctx->ffn, err);
out:
    if (status != EPD_OK && err[0] == '\0') snprintf(err, EPD_ERR_LEN, "%s", ctx->err);
    return status;
}

static epd_status_t cuda_experts(epd_ops_ctx_t *ctx, const epd_moe_shape_t *shape, uint32_t layer,
                                 const void *recv_buf, uint32_t n_records,
                                 const uint32_t *expert_rows_host, void *partials)
{
    epd_status_t status;
    epd_record_layout_t rec;
    epd_partial_layout_t pl;
    const cuda_expert_ops *experts;
    experts_args a;
    uint32_t per_rank;

    CHECK_GOTO(enter(ctx), out);
    if (!shape_fits(ctx, shape)) return EPD_ERR_INVALID_ARG;
    if (epd_expert_ops_find(shape->expert_kind)->weights) {
        if (ctx->ffn == NULL) return bad_arg(ctx, "experts: ffn weights were not loaded");
        if (recv_buf == NULL || (n_records > 0 && partials == NULL))
            return bad_arg(ctx, "experts with a NULL buffer");
        if (shape->combine_dtype == EPD_COMBINE_FP8 && !aligned16(partials))
            return bad_arg(ctx, "experts: FP8 partials must be 16-byte aligned");
        return epd_ffn_cuda_experts(ctx->ffn, shape, layer, recv_buf, n_records,
                                    expert_rows_host, partials,
                                    shape->quant_error ? ctx->qe_dev : NULL, ctx->err);
    }
    experts = cuda_expert_find(shape->expert_kind);
    if (experts == NULL) return bad_arg(ctx, "experts: an expert kind without CUDA kernels");
    if (n_records == 0) return EPD_OK;
    if (recv_buf == NULL || partials == NULL) return bad_arg(ctx, "experts with a NULL buffer");
    if (!aligned16(recv_buf) || !aligned16(partials))
        return bad_arg(ctx, "experts: buffers must be 16-byte aligned");
    epd_record_layout(shape, &rec);
    epd_partial_layout(shape, &pl);

    per_rank = shape->num_experts / shape->world;
    memset(&a, 0, sizeof a);
    a.recv = (const uint8_t *)recv_buf;
    a.partials = (uint8_t *)partials;
    a.part_size = (uint32_t)pl.size;
    a.n_records = n_records;
    a.hidden = shape->hidden;
    a.h16 = shape->hidden / CHUNK;
    a.k_count = shape->topk;
    a.n_experts = shape->num_experts;
    a.lo = (int32_t)(shape->rank * per_rank);
    a.hi = (int32_t)((shape->rank + 1) * per_rank);
    a.rec_size = (uint32_t)rec.size;
    a.rec_scales = (uint32_t)rec.scales;
    a.rec_ids = (uint32_t)rec.ids;
    a.rec_weights = (uint32_t)rec.weights;
    a.per_token = shape->scale == EPD_SCALE_PER_TOKEN;
    if (shape->topk > EXPERT_MAX_K) return bad_arg(ctx, "experts: top-k above 64");
    if (shape->combine_dtype == EPD_COMBINE_FP8) {
        a.qe = shape->quant_error ? ctx->qe_dev : NULL;
        experts_kernel_fn kernel =
            shape->dtype == EPD_WIRE_FP8 ? experts->kernel_fp8_fp8p : experts->kernel_bf16_fp8p;
        CUDA_TRY(ctx,
                 launch_after(kernel, flat_blocks((uint64_t)n_records * a.h16), ctx->stream, a),
                 "experts kernel launch");
    } else {
        uint64_t units = (uint64_t)n_records * (a.h16 / 2);
        experts_kernel_fn kernel =
            shape->dtype == EPD_WIRE_FP8 ? experts->kernel_fp8 : experts->kernel_bf16;
        CUDA_TRY(ctx, launch_after(kernel, flat_blocks(units), ctx->stream, a),
                 "experts kernel launch");
    }
out:
    return status;
}

/* Queues the copy of the telemetry sums to the pinned mirror and their zeroing, on the stream. */
static cudaError_t qe_queue_readback(epd_ops_ctx_t *ctx)
{
    const size_t bytes = QE_SLOTS * QE_SUMS * sizeof(double);
    cudaError_t rc = cudaMemcpyAsync(ctx->qe_host, ctx->qe_dev, bytes, cudaMemcpyDeviceToHost,
                                     ctx->stream);
    return rc != cudaSuccess ? rc : cudaMemsetAsync(ctx->qe_dev, 0, bytes, ctx->stream);
}

static epd_status_t cuda_combine(epd_ops_ctx_t *ctx, const epd_moe_shape_t *shape,
                                 const epd_step_layout_t *layout, const void *partials_back,
                                 uint16_t *y)
{
    epd_status_t status;

    CHECK_GOTO(enter(ctx), out);
    if (!shape_fits(ctx, shape)) return EPD_ERR_INVALID_ARG;
    if (layout == NULL) return bad_arg(ctx, "combine without a layout");
    if (layout->n_tokens == 0) return EPD_OK;
    if (y == NULL || layout->slot == NULL || (layout->n_send > 0 && partials_back == NULL))
        return bad_arg(ctx, "combine with a NULL buffer");
    if (!aligned16(y) || (partials_back != NULL && !aligned16(partials_back)))
        return bad_arg(ctx, "combine: buffers must be 16-byte aligned");
    {
        uint32_t h16 = shape->hidden / CHUNK;
        epd_partial_layout_t pl;
        epd_partial_layout(shape, &pl);
        unsigned blocks = flat_blocks((uint64_t)layout->n_tokens * h16);
        const uint8_t *parts = (const uint8_t *)partials_back;
        CUDA_TRY(ctx,
                 launch_after(shape->combine_dtype == EPD_COMBINE_FP8 ? combine_kernel<true>
                                                                     : combine_kernel<false>,
                              blocks, ctx->stream, (const int32_t *)layout->slot, parts, y,
                              layout->n_tokens, shape->hidden, h16, shape->world,
                              (uint32_t)pl.size),
                 "combine kernel launch");
    }
    if (shape->quant_error && !ctx->qe_queued) {
        /* the step's telemetry comes back with the step: quant_error_take after the step's last
         * sync then costs no round trip of its own (one read-back pending at a time: what is
         * summed after it stays on the device for the next take) */
        CUDA_TRY(ctx, qe_queue_readback(ctx), "telemetry read-back");
        ctx->qe_queued = true;
    }
out:
    return status;
}

/* The telemetry sums, read back in stream order after the ops queued before (by the last
 * combine when it ran with shape->quant_error, else here), zeroed, added up over the slots. */
static epd_status_t cuda_quant_error_take(epd_ops_ctx_t *ctx, epd_quant_error_t *error_p)
{
    epd_status_t status;
    double sums[QE_SUMS] = {0.0, 0.0, 0.0, 0.0};

    CHECK_GOTO(enter(ctx), out);
    if (error_p == NULL) return bad_arg(ctx, "quant_error_take without an output");
    /* sums added after a pending read-back (a later pack or experts) stay on the device, zeroed
     * only by a later read-back: the next take has them */
    if (!ctx->qe_queued) CUDA_TRY(ctx, qe_queue_readback(ctx), "telemetry read-back");
    ctx->qe_queued = false;
    /* the step has synchronized already: the stream is idle and this returns at once */
    CUDA_TRY(ctx, cudaStreamSynchronize(ctx->stream), "cudaStreamSynchronize after the telemetry");
    for (uint32_t s = 0; s < QE_SLOTS; s++)
        for (uint32_t k = 0; k < QE_SUMS; k++) sums[k] += ctx->qe_host[s * QE_SUMS + k];
    error_p->dispatch_err2 = sums[0];
    error_p->dispatch_ref2 = sums[1];
    error_p->combine_err2 = sums[2];
    error_p->combine_ref2 = sums[3];
out:
    return status;
}

/* ---- transport hooks ---------------------------------------------------------------------- */

static void *cuda_stream(epd_ops_ctx_t *ctx)
{
    return (void *)ctx->stream;
}

static epd_status_t cuda_event_create(epd_ops_ctx_t *ctx, epd_ops_event_t **event_p)
{
    epd_status_t status;
    epd_ops_event_t *event;
    cudaError_t rc;

    *event_p = NULL;
    CHECK_GOTO(enter(ctx), out);
    event = (epd_ops_event_t *)calloc(1, sizeof *event);
    if (event == NULL) {
        snprintf(ctx->err, EPD_ERR_LEN, "cuda ops: out of memory for an event");
        return EPD_ERR_NO_MEMORY;
    }
    rc = cudaEventCreateWithFlags(&event->event, cudaEventDisableTiming);
    if (rc != cudaSuccess) {
        free(event);
        return cuda_fail(ctx, rc, "cudaEventCreateWithFlags");
    }
    *event_p = event;
out:
    return status;
}

static void cuda_event_destroy(epd_ops_ctx_t *ctx, epd_ops_event_t *event)
{
    if (event == NULL) return;
    if (enter(ctx) == EPD_OK) cudaEventDestroy(event->event);
    free(event);
}

static epd_status_t cuda_event_query(epd_ops_ctx_t *ctx, epd_ops_event_t *event)
{
    cudaError_t rc;

    if (event == NULL) return bad_arg(ctx, "event_query of NULL");
    rc = cudaEventQuery(event->event);
    if (rc == cudaSuccess) return EPD_OK;
    if (rc == cudaErrorNotReady) return EPD_ERR_AGAIN;
    return cuda_fail(ctx, rc, "cudaEventQuery");
}

static epd_status_t cuda_event_wait(epd_ops_ctx_t *ctx, epd_ops_event_t *event)
{
    if (event == NULL) return bad_arg(ctx, "event_wait of NULL");
    CUDA_TRY(ctx, cudaEventSynchronize(event->event), "cudaEventSynchronize");
    return EPD_OK;
}

static epd_status_t copy_async(epd_ops_ctx_t *ctx, cudaStream_t stream, void *dst, const void *src,
                               size_t bytes, cudaMemcpyKind kind, epd_ops_event_t *done)
{
    epd_status_t status;

    CHECK_GOTO(enter(ctx), out);
    if (bytes > 0) {
        if (dst == NULL || src == NULL) return bad_arg(ctx, "async copy with a NULL pointer");
        CUDA_TRY(ctx, cudaMemcpyAsync(dst, src, bytes, kind, stream), "cudaMemcpyAsync");
    }
    if (done != NULL) CUDA_TRY(ctx, cudaEventRecord(done->event, stream), "cudaEventRecord");
out:
    return status;
}

static epd_status_t cuda_copy_to_host_async(epd_ops_ctx_t *ctx, void *dst_host, const void *src,
                                            size_t bytes, epd_ops_event_t *done)
{
    return copy_async(ctx, ctx->down, dst_host, src, bytes, cudaMemcpyDeviceToHost, done);
}

static epd_status_t cuda_copy_to_ops_async(epd_ops_ctx_t *ctx, void *dst, const void *src_host,
                                           size_t bytes, epd_ops_event_t *done)
{
    return copy_async(ctx, ctx->up, dst, src_host, bytes, cudaMemcpyHostToDevice, done);
}

static epd_status_t cuda_copy_ops_to_ops_async(epd_ops_ctx_t *ctx, void *dst, const void *src,
                                               size_t bytes, epd_ops_event_t *done)
{
    return copy_async(ctx, ctx->up, dst, src, bytes, cudaMemcpyDeviceToDevice, done);
}

static const char *cuda_last_error(epd_ops_ctx_t *ctx)
{
    return ctx->err;
}

/* ---- shared regions and the ingest of device tensors (loop thread) ------------------------ */

static epd_status_t region_fail(char err[EPD_ERR_LEN], cudaError_t rc, const char *what)
{
    snprintf(err, EPD_ERR_LEN, "%s: %s", what, cudaGetErrorString(rc));
    cudaGetLastError(); /* these errors are not sticky: clear them for the step's next check */
    return EPD_ERR_CUDA;
}

static epd_status_t cuda_host_register(epd_ops_ctx_t *ctx, void *ptr, size_t bytes,
                                       char err[EPD_ERR_LEN])
{
    cudaError_t rc = cudaSetDevice(ctx->device);
    if (rc == cudaSuccess) rc = cudaHostRegister(ptr, bytes, cudaHostRegisterDefault);
    return rc == cudaSuccess ? EPD_OK : region_fail(err, rc, "cudaHostRegister");
}

static void cuda_host_unregister(epd_ops_ctx_t *ctx, void *ptr)
{
    if (cudaSetDevice(ctx->device) == cudaSuccess) cudaHostUnregister(ptr);
}

static epd_status_t cuda_ipc_open(epd_ops_ctx_t *ctx, const uint8_t handle[64], void **base_p,
                                  uint64_t *size_p, char err[EPD_ERR_LEN])
{
    cudaIpcMemHandle_t h;
    cudaPointerAttributes attr;
    void *base = NULL;

    static_assert(sizeof h == 64, "cudaIpcMemHandle_t is 64 bytes");
    memcpy(&h, handle, sizeof h);
    cudaError_t rc = cudaSetDevice(ctx->device);
    if (rc == cudaSuccess) rc = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
    if (rc != cudaSuccess) return region_fail(err, rc, "cudaIpcOpenMemHandle");
    rc = cudaPointerGetAttributes(&attr, base);
    if (rc != cudaSuccess || attr.device != ctx->device) {
        cudaIpcCloseMemHandle(base);
        if (rc != cudaSuccess) return region_fail(err, rc, "cudaPointerGetAttributes");
        snprintf(err, EPD_ERR_LEN,
                 "the memory is on device %d, this rank runs on device %d: register it with the "
                 "rank of its own GPU", attr.device, ctx->device);
        return EPD_ERR_BAD_REGION;
    }
    /* The allocation's size, to check offset + bytes against it: a region past its end would
     * have the kernels read or write memory that is not the client's. The driver's
     * cuMemGetAddressRange, reached through the runtime (no link to libcuda). */
    typedef int (*address_range_fn)(unsigned long long *base, size_t *size, unsigned long long p);
    void *fn = NULL;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    unsigned long long alloc_base = 0;
    size_t alloc_size = 0;
    rc = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                          &found);
    if (rc != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == NULL ||
        ((address_range_fn)fn)(&alloc_base, &alloc_size, (unsigned long long)(uintptr_t)base) !=
            0) {
        cudaIpcCloseMemHandle(base);
        cudaGetLastError();
        snprintf(err, EPD_ERR_LEN, "cannot tell the size of the opened allocation "
                                   "(cuMemGetAddressRange)");
        return EPD_ERR_BAD_REGION;
    }
    *size_p = alloc_size - (size_t)((unsigned long long)(uintptr_t)base - alloc_base);
    *base_p = base;
    return EPD_OK;
}

static void cuda_ipc_close(epd_ops_ctx_t *ctx, void *base)
{
    if (cudaSetDevice(ctx->device) == cudaSuccess) cudaIpcCloseMemHandle(base);
}

static epd_status_t ingest_setup(epd_ops_ctx_t *ctx, char err[EPD_ERR_LEN])
{
    cudaError_t rc = cudaSetDevice(ctx->device);
    if (rc != cudaSuccess) return region_fail(err, rc, "cudaSetDevice");
    if (ctx->ingest_ready) return EPD_OK;
    if ((rc = cudaStreamCreateWithFlags(&ctx->ingest, cudaStreamNonBlocking)) != cudaSuccess)
        return region_fail(err, rc, "cudaStreamCreateWithFlags");
    if ((rc = cudaMallocHost(&ctx->ingest_host, INGEST_BLOCKS * sizeof *ctx->ingest_host)) !=
        cudaSuccess) {
        cudaStreamDestroy(ctx->ingest);
        return region_fail(err, rc, "cudaMallocHost");
    }
    rc = cudaMallocHost(&ctx->ingest_done_host, INGEST_BLOCKS * sizeof *ctx->ingest_done_host);
    if (rc == cudaSuccess) {
        rc = cudaMallocHost(&ctx->ingest_ll, INGEST_LL_WORDS * sizeof *ctx->ingest_ll);
        if (rc != cudaSuccess) cudaFreeHost(ctx->ingest_done_host);
    }
    if (rc != cudaSuccess) {
        cudaFreeHost(ctx->ingest_host);
        cudaStreamDestroy(ctx->ingest);
        return region_fail(err, rc, "cudaMallocHost");
    }
    memset(ctx->ingest_done_host, 0, INGEST_BLOCKS * sizeof *ctx->ingest_done_host);
    ctx->ingest_ready = true;
    return EPD_OK;
}

/* The whole ingest of a request in device regions in one launch, so that it costs one kernel
 * and one sync rather than two copies, a memset, a kernel and a copy (about 20 us on an H200).
 * The blocks copy a and b into the pinned stage (host memory the device writes directly: with
 * unified addressing cudaMallocHost memory is mapped), word by word when both ends allow it,
 * and scan x[n] for a bf16 whose exponent is all ones; block j writes the least such index it
 * saw, or ~0, into slots[j] (every slot of the launch is written: nothing to clear first), and
 * then, when done is not NULL, 1 into done[j] (which the host cleared) once everything it wrote
 * is visible to the host: the loop thread waits for those words rather than for the stream,
 * which reports a kernel's end several microseconds later. No argument changes from one launch
 * to the next of the same tensors, so a graph launch needs no update.
 * With ll (a and b whole words, done and slots unused) everything goes back as flagged pairs
 * instead, as NCCL's LL protocol does: word i of a then b, and then block j's least index as two
 * words, each one 8-byte store of (1 << 32 | word) into ll[], which the host cleared. A pair is
 * seen whole or not at all, so no system fence has to drain the stores before a done word: the
 * host reads each value as soon as its flag is there. */
__global__ void ingest_kernel(const uint8_t *__restrict__ a, size_t a_bytes,
                              uint8_t *__restrict__ a_dst, const uint8_t *__restrict__ b,
                              size_t b_bytes, uint8_t *__restrict__ b_dst,
                              const uint16_t *__restrict__ x, uint64_t n,
                              uint16_t *__restrict__ x_dst, unsigned long long *__restrict__ slots,
                              unsigned *done, unsigned long long *ll)
{
    __shared__ unsigned long long least;
    uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    uint64_t stride = (uint64_t)gridDim.x * blockDim.x;

    if (threadIdx.x == 0) least = ~0ull;
    const uint8_t *src[2] = {a, b};
    uint8_t *dst[2] = {a_dst, b_dst};
    size_t bytes[2] = {a_bytes, b_bytes};
    bool staged = false; /* this thread wrote to the pinned stage */
    const uint64_t ll_words = (a_bytes + b_bytes) / 4;
    if (ll != NULL) {
        const uint32_t *sa = (const uint32_t *)a, *sb = (const uint32_t *)b;
        for (uint64_t i = tid; i < ll_words; i += stride) {
            uint32_t v = i < a_bytes / 4 ? sa[i] : sb[i - a_bytes / 4];
            *(volatile unsigned long long *)(ll + i) = 1ull << 32 | v;
        }
    }
    for (int t = 0; t < 2 && ll == NULL; t++) {
        if (bytes[t] == 0) continue;
        if ((((uintptr_t)src[t] | (uintptr_t)dst[t] | bytes[t]) & 3u) == 0) {
            const uint32_t *s = (const uint32_t *)src[t];
            uint32_t *d = (uint32_t *)dst[t];
            for (uint64_t i = tid; i < bytes[t] / 4; i += stride) d[i] = s[i];
            staged |= tid < bytes[t] / 4;
        } else {
            for (uint64_t i = tid; i < bytes[t]; i += stride) dst[t][i] = src[t][i];
            staged |= tid < bytes[t];
        }
    }
    __syncthreads();
    /* x in 16-byte loads when it is aligned (host memory read over the bus wants wide reads),
     * the tail and an unaligned x one value at a time; a thread's elements grow with i. With
     * x_dst the values are copied there too (up to a non-finite one: that request is refused). */
    uint64_t n_vec = (((uintptr_t)x | (uintptr_t)x_dst) & 15u) == 0 ? n / 8 : 0;
    const uint4 *xv = (const uint4 *)x;
    for (uint64_t i = tid; i < n_vec; i += stride) {
        uint4 v = xv[i];
        if (x_dst != NULL) ((uint4 *)x_dst)[i] = v;
        uint32_t w[4] = {v.x, v.y, v.z, v.w};
        int lane = -1;
        for (int k = 7; k >= 0; k--) {
            uint32_t h = (w[k / 2] >> (16 * (k % 2))) & 0xffffu;
            if ((h & 0x7f80u) == 0x7f80u) lane = k;
        }
        if (lane >= 0) {
            atomicMin(&least, (unsigned long long)(i * 8 + (uint64_t)lane));
            break;
        }
    }
    for (uint64_t i = n_vec * 8 + tid; i < n; i += stride) {
        if (x_dst != NULL) x_dst[i] = x[i];
        if ((x[i] & 0x7f80u) == 0x7f80u) {
            atomicMin(&least, (unsigned long long)i);
            break; /* this thread's later elements are larger */
        }
    }
    __syncthreads();
    if (ll != NULL) {
        if (threadIdx.x == 0) {
            volatile unsigned long long *at = ll + ll_words + 2 * (uint64_t)blockIdx.x;
            at[0] = 1ull << 32 | (uint32_t)least;
            at[1] = 1ull << 32 | (uint32_t)(least >> 32);
        }
        return;
    }
    if (threadIdx.x == 0) slots[blockIdx.x] = least;
    if (done != NULL) {
        /* the staged ids and weights and the slot visible before the block's word: a system
         * fence in each thread that wrote them (not in all: a fence of the whole grid costs
         * microseconds at 128 tokens' 448 blocks), the barrier, then the word (one fence on
         * thread 0's way, not two) */
        if (staged || threadIdx.x == 0) __threadfence_system();
        __syncthreads();
        if (threadIdx.x == 0) *(volatile unsigned *)(done + blockIdx.x) = 1u;
    }
}

/* Waits until the blocks of the ingest launch have reported in done[] (see ingest_kernel), or
 * the stream says the kernel ended (then its words are visible) or failed. */
static cudaError_t ingest_wait(epd_ops_ctx_t *ctx, uint64_t blocks)
{
    const volatile unsigned *done = ctx->ingest_done_host;
    uint64_t j = 0;
    for (uint32_t spins = 1;; spins++) {
        while (j < blocks && done[j] != 0) j++;
        if (j == blocks) break;
        if ((spins & 255u) == 0) {
            cudaError_t rc = cudaStreamQuery(ctx->ingest);
            if (rc == cudaSuccess) {
                while (j < blocks && done[j] != 0) j++;
                if (j == blocks) break;
                return cudaErrorUnknown; /* ended without reporting: not this kernel */
            }
            if (rc != cudaErrorNotReady) return rc;
        }
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the stage and slots are read after the words */
    return cudaSuccess;
}

/* Waits until the first `words` pairs of ctx->ingest_ll carry their flag (see ingest_kernel),
 * or the stream says the kernel ended or failed. */
static cudaError_t ingest_wait_ll(epd_ops_ctx_t *ctx, uint64_t words)
{
    const volatile unsigned long long *ll = ctx->ingest_ll;
    uint64_t j = 0;
    for (uint32_t spins = 1;; spins++) {
        while (j < words && ll[j] >> 32 != 0) j++;
        if (j == words) break;
        if ((spins & 255u) == 0) {
            cudaError_t rc = cudaStreamQuery(ctx->ingest);
            if (rc == cudaSuccess) {
                while (j < words && ll[j] >> 32 != 0) j++;
                if (j == words) break;
                return cudaErrorUnknown; /* ended without reporting: not this kernel */
            }
            if (rc != cudaErrorNotReady) return rc;
        }
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the values are read again after their flags */
    return cudaSuccess;
}

/* Queues the ingest kernel on the ingest stream as the graph of its grid size with these
 * arguments, making that graph the first time. An error: nothing was queued, launch the kernel
 * instead (graphs stay off after the first failure). */
static cudaError_t ingest_graph_launch(epd_ops_ctx_t *ctx, unsigned blocks,
                                       struct ingest_args *a)
{
    if (ctx->ingest_graph_off) return cudaErrorNotSupported;
    void *args[] = {&a->a, &a->a_bytes, &a->a_dst, &a->b, &a->b_bytes, &a->b_dst,
                    &a->x, &a->n, &a->x_dst, &a->slots, &a->done, &a->ll};
    cudaKernelNodeParams params = {};
    params.func = (void *)ingest_kernel;
    params.gridDim = dim3(blocks);
    params.blockDim = dim3(FLAT_THREADS);
    params.kernelParams = args;
    unsigned g = 0;
    while (g < INGEST_GRAPHS && ctx->ingest_graph[g].blocks != 0 &&
           ctx->ingest_graph[g].blocks != blocks)
        g++;
    if (g == INGEST_GRAPHS) return cudaErrorNotSupported; /* sizes beyond the cache: launched */
    cudaError_t rc;
    if (ctx->ingest_graph[g].blocks == 0) {
        cudaGraph_t graph;
        cudaGraphNode_t node;
        cudaGraphExec_t exec;
        if ((rc = cudaGraphCreate(&graph, 0)) != cudaSuccess) goto off;
        rc = cudaGraphAddKernelNode(&node, graph, NULL, 0, &params);
        if (rc == cudaSuccess) rc = cudaGraphInstantiate(&exec, graph, 0);
        if (rc != cudaSuccess) {
            cudaGraphDestroy(graph);
            goto off;
        }
        ctx->ingest_graph[g].blocks = blocks;
        ctx->ingest_graph[g].graph = graph;
        ctx->ingest_graph[g].exec = exec;
        ctx->ingest_graph[g].node = node;
        ctx->ingest_graph[g].args = *a;
    } else if (memcmp(&ctx->ingest_graph[g].args, a, sizeof *a) != 0) {
        rc = cudaGraphExecKernelNodeSetParams(ctx->ingest_graph[g].exec,
                                              ctx->ingest_graph[g].node, &params);
        if (rc != cudaSuccess) goto off;
        ctx->ingest_graph[g].args = *a;
    }
    if ((rc = cudaGraphLaunch(ctx->ingest_graph[g].exec, ctx->ingest)) == cudaSuccess)
        return cudaSuccess;
off:
    cudaGetLastError();
    ctx->ingest_graph_off = true;
    return rc;
}

/* Grows the pinned staging of the ingest to at least bytes. */
static epd_status_t ingest_stage(epd_ops_ctx_t *ctx, size_t bytes, char err[EPD_ERR_LEN])
{
    if (bytes <= ctx->ingest_stage_bytes) return EPD_OK;
    size_t cap = ctx->ingest_stage_bytes ? ctx->ingest_stage_bytes : 4096;
    while (cap < bytes) cap *= 2;
    void *p = NULL;
    cudaError_t rc = cudaMallocHost(&p, cap);
    if (rc != cudaSuccess) return region_fail(err, rc, "cudaMallocHost for the ingest");
    if (ctx->ingest_stage != NULL) cudaFreeHost(ctx->ingest_stage);
    ctx->ingest_stage = (uint8_t *)p;
    ctx->ingest_stage_bytes = cap;
    return EPD_OK;
}

static epd_status_t ingest_run(epd_ops_ctx_t *ctx, const void *a, size_t a_bytes, void *a_dst,
                               const void *b, size_t b_bytes, void *b_dst, const uint16_t *x,
                               uint64_t x_n, uint16_t *x_dst, int64_t *x_bad_p,
                               char err[EPD_ERR_LEN])
{
    epd_status_t status = ingest_setup(ctx, err);
    if (status != EPD_OK) return status;
    size_t a_at = 0, b_at = (a_bytes + 15) & ~(size_t)15;
    if (a == NULL) a_bytes = 0;
    if (b == NULL) b_bytes = 0;
    status = ingest_stage(ctx, b_at + b_bytes, err);
    if (status != EPD_OK) return status;
    if (x == NULL) x_n = 0;
    uint64_t x_items = (((uintptr_t)x | (uintptr_t)x_dst) & 15u) == 0 ? x_n / 8 : x_n;
    uint64_t items = x_items > (a_bytes + b_bytes) / 4 ? x_items : (a_bytes + b_bytes) / 4;
    uint64_t blocks = (items + FLAT_THREADS - 1) / FLAT_THREADS;
    if (blocks > INGEST_BLOCKS) blocks = INGEST_BLOCKS;
    if (blocks == 0) blocks = 1;
    /* Without a device copy of x the loop thread waits for the blocks' words; a device copy is
     * read by the step's stream next, so the whole kernel must have finished: a stream sync. */
    const bool report = x_dst == NULL;
    /* ids and weights of whole words, with the blocks' results, few enough: flagged pairs */
    const uint64_t ll_words = (a_bytes + b_bytes) / 4 + 2 * blocks;
    const bool ll = report && ll_words <= INGEST_LL_WORDS &&
                    (((uintptr_t)a | (uintptr_t)b | a_bytes | b_bytes) & 3u) == 0;
    /* the words of the last launch were all seen (or its stream had ended) before this one */
    if (ll)
        memset(ctx->ingest_ll, 0, ll_words * sizeof *ctx->ingest_ll);
    else if (report)
        memset(ctx->ingest_done_host, 0, blocks * sizeof *ctx->ingest_done_host);
    struct ingest_args args;
    memset(&args, 0, sizeof args);
    args.a = (const uint8_t *)a;
    args.a_bytes = a_bytes;
    args.a_dst = ctx->ingest_stage + a_at;
    args.b = (const uint8_t *)b;
    args.b_bytes = b_bytes;
    args.b_dst = ctx->ingest_stage + b_at;
    args.x = x;
    args.n = x_n;
    args.x_dst = x_dst;
    args.slots = ll ? NULL : ctx->ingest_host;
    args.done = report && !ll ? ctx->ingest_done_host : NULL;
    args.ll = ll ? ctx->ingest_ll : NULL;
    cudaError_t rc = ingest_graph_launch(ctx, (unsigned)blocks, &args);
    if (rc != cudaSuccess) {
        ingest_kernel<<<(unsigned)blocks, FLAT_THREADS, 0, ctx->ingest>>>(
            args.a, args.a_bytes, args.a_dst, args.b, args.b_bytes, args.b_dst, args.x, args.n,
            args.x_dst, args.slots, args.done, args.ll);
        rc = cudaGetLastError();
    }
    if (rc == cudaSuccess) {
        rc = ll       ? ingest_wait_ll(ctx, ll_words)
             : report ? ingest_wait(ctx, blocks)
                      : cudaStreamSynchronize(ctx->ingest);
    }
    if (rc != cudaSuccess) return region_fail(err, rc, "reading device tensors");
    unsigned long long least = ~0ull;
    if (ll) {
        const unsigned long long *pair = ctx->ingest_ll;
        for (uint64_t i = 0; i < a_bytes / 4; i++) {
            uint32_t v = (uint32_t)pair[i];
            memcpy((uint8_t *)a_dst + 4 * i, &v, 4);
        }
        pair += a_bytes / 4;
        for (uint64_t i = 0; i < b_bytes / 4; i++) {
            uint32_t v = (uint32_t)pair[i];
            memcpy((uint8_t *)b_dst + 4 * i, &v, 4);
        }
        pair += b_bytes / 4;
        for (uint64_t j = 0; j < blocks; j++) {
            unsigned long long v = (uint32_t)pair[2 * j];
            v |= (unsigned long long)pair[2 * j + 1] << 32; /* the flag shifted out */
            if (v < least) least = v;
        }
    } else {
        if (a_bytes > 0) memcpy(a_dst, ctx->ingest_stage + a_at, a_bytes);
        if (b_bytes > 0) memcpy(b_dst, ctx->ingest_stage + b_at, b_bytes);
        for (uint64_t j = 0; j < blocks; j++)
            if (ctx->ingest_host[j] < least) least = ctx->ingest_host[j];
    }
    if (x != NULL && x_bad_p != NULL) *x_bad_p = least == ~0ull ? -1 : (int64_t)least;
    return EPD_OK;
}

static epd_status_t cuda_ingest_fetch(epd_ops_ctx_t *ctx, const void *a, size_t a_bytes,
                                      void *a_dst, const void *b, size_t b_bytes, void *b_dst,
                                      const uint16_t *x, uint64_t x_n, int64_t *x_bad_p,
                                      char err[EPD_ERR_LEN])
{
    return ingest_run(ctx, a, a_bytes, a_dst, b, b_bytes, b_dst, x, x_n, NULL, x_bad_p, err);
}

/* The device copies of host x come from a pool of their own, used on the ingest stream only
 * (allocated there, freed there once their step is done), kept rather than given back to the
 * driver between requests (cudaMalloc costs far more than the copy). */
static cudaError_t ingest_pool_setup(epd_ops_ctx_t *ctx)
{
    if (ctx->ingest_pool != NULL) return cudaSuccess;
    cudaMemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = ctx->device;
    cudaMemPool_t pool;
    cudaError_t rc = cudaMemPoolCreate(&pool, &props);
    if (rc != cudaSuccess) return rc;
    uint64_t keep = UINT64_MAX;
    int no = 0;
    rc = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
    /* never make the ingest stream wait for another stream's work to reuse memory */
    if (rc == cudaSuccess)
        rc = cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies, &no);
    if (rc != cudaSuccess) {
        cudaMemPoolDestroy(pool);
        return rc;
    }
    ctx->ingest_pool = pool;
    return cudaSuccess;
}

/* Where the device reads and writes page-locked host memory [host, host + bytes), or NULL. */
static void *cuda_host_mapped(epd_ops_ctx_t *ctx, void *host, size_t bytes)
{
    cudaPointerAttributes first, last;
    if (host == NULL || bytes == 0 || cudaSetDevice(ctx->device) != cudaSuccess) return NULL;
    /* both ends in page-locked memory of one mapping (a block, a registered range) */
    if (cudaPointerGetAttributes(&first, host) != cudaSuccess ||
        cudaPointerGetAttributes(&last, (uint8_t *)host + bytes - 1) != cudaSuccess) {
        cudaGetLastError();
        return NULL;
    }
    if (first.type != cudaMemoryTypeHost || last.type != cudaMemoryTypeHost ||
        first.devicePointer == NULL ||
        (uint8_t *)last.devicePointer != (uint8_t *)first.devicePointer + bytes - 1)
        return NULL;
    return first.devicePointer;
}

/* A host x the device can read where it is (page-locked, mapped: with unified addressing every
 * cudaMallocHost block and registered range is) goes through the ingest kernel at its device
 * address; pageable memory is the host's to scan. A large x wanted on the device is copied
 * there by the copy engine first and the kernel scans the copy (INGEST_COPY_ENGINE_BYTES). */
static epd_status_t cuda_ingest_scan_host(epd_ops_ctx_t *ctx, const uint16_t *x, uint64_t x_n,
                                          int64_t *x_bad_p, void **x_copy_p,
                                          char err[EPD_ERR_LEN])
{
    const uint16_t *mapped =
        (const uint16_t *)cuda_host_mapped(ctx, (void *)x, (size_t)x_n * sizeof(uint16_t));
    if (mapped == NULL) return EPD_ERR_AGAIN;
    epd_status_t status = ingest_setup(ctx, err);
    if (status != EPD_OK) return status;
    void *copy = NULL;
    if (x_copy_p != NULL) {
        *x_copy_p = NULL;
        /* no memory for a copy: the scan alone (the step copies x itself) */
        if (ingest_pool_setup(ctx) != cudaSuccess ||
            cudaMallocFromPoolAsync(&copy, (size_t)x_n * sizeof(uint16_t), ctx->ingest_pool,
                                    ctx->ingest) != cudaSuccess) {
            cudaGetLastError();
            copy = NULL;
        }
    }
    size_t x_bytes = (size_t)x_n * sizeof(uint16_t);
    if (copy != NULL && x_bytes >= INGEST_COPY_ENGINE_BYTES) {
        /* the copy and then the scan, in the ingest stream's order: once the scan's blocks
         * have reported, the copy the step reads next is complete */
        cudaError_t rc = cudaMemcpyAsync(copy, x, x_bytes, cudaMemcpyHostToDevice,
                                         ctx->ingest);
        if (rc == cudaSuccess) {
            status = ingest_run(ctx, NULL, 0, NULL, NULL, 0, NULL, (const uint16_t *)copy, x_n,
                                NULL, x_bad_p, err);
        } else {
            status = region_fail(err, rc, "copying x to the device");
        }
    } else {
        status = ingest_run(ctx, NULL, 0, NULL, NULL, 0, NULL, mapped, x_n, (uint16_t *)copy,
                            x_bad_p, err);
    }
    if (status != EPD_OK || *x_bad_p >= 0) {
        if (copy != NULL) cudaFreeAsync(copy, ctx->ingest);
        copy = NULL;
    }
    if (x_copy_p != NULL) *x_copy_p = copy;
    return status;
}

static void cuda_ingest_free(epd_ops_ctx_t *ctx, void *copy)
{
    if (copy != NULL && cudaSetDevice(ctx->device) == cudaSuccess) cudaFreeAsync(copy, ctx->ingest);
}

extern "C" const epd_ops_t epd_ops_cuda = {
    .name = "cuda",
    .device_memory = true,
    .pack_reads_host = true,
    .init = cuda_init,
    .fini = cuda_fini,
    .alloc = cuda_alloc,
    .free = cuda_free,
    .alloc_host = cuda_alloc_host,
    .free_host = cuda_free_host,
    .copy_to_ops = cuda_copy_to_ops,
    .copy_to_host = cuda_copy_to_host,
    .sync = cuda_sync,
    .layout = cuda_layout,
    .layout_counts = cuda_layout_counts,
    .pack = cuda_pack,
    .experts = cuda_experts,
    .experts_load = cuda_experts_load,
    .combine = cuda_combine,
    .quant_error_take = cuda_quant_error_take,
    .stream = cuda_stream,
    .event_create = cuda_event_create,
    .event_destroy = cuda_event_destroy,
    .event_query = cuda_event_query,
    .event_wait = cuda_event_wait,
    .copy_to_host_async = cuda_copy_to_host_async,
    .copy_to_ops_async = cuda_copy_to_ops_async,
    .copy_ops_to_ops_async = cuda_copy_ops_to_ops_async,
    .last_error = cuda_last_error,
    .copy_queued = cuda_copy_queued,
    .host_register = cuda_host_register,
    .host_unregister = cuda_host_unregister,
    .ipc_open = cuda_ipc_open,
    .ipc_close = cuda_ipc_close,
    .ingest_fetch = cuda_ingest_fetch,
    .ingest_scan_host = cuda_ingest_scan_host,
    .ingest_free = cuda_ingest_free,
    .host_mapped = cuda_host_mapped,
};
