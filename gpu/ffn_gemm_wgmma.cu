/* The ffn experts' GEMM on Hopper (gpu/ffn_gemm.h, epd_ffn_wgmma_*): one launch per projection
 * over the row tiles of every expert with rows, D[row][n] = sum_k X[row][k] W[n][k], with
 * warpgroup MMAs (wgmma.mma_async m64nNk16 BF16, m64nNk32 e4m3; fp32 accumulation) on shared
 * memory operands that the TMA (cp.async.bulk.tensor, 128-byte swizzle) fills.
 *
 * As in gpu/ffn_gemm.cu the operands are swapped: the wgmma's M is the weights' output features
 * (a CTA's 128, one FP8 scale block, as two m64 halves), its N a work item's rows of the expert
 * rounded up to 16 (an expert's rows shared evenly over its tiles of at most args.row_tile, 32 ..
 * 256), so a decode step's few rows cost no padded M. A CTA is three warpgroups: the first a
 * producer (one thread issues the TMA copies of a stage: 128 weight rows and the item's N
 * activation rows of 128 K bytes, FP8: their activation scales by a bulk copy), the other two
 * consumers (each one m64 half of the features against every row of the item). The stages go
 * round a ring of full/empty mbarriers: the producer waits for a slot's empty barrier, arms its
 * full barrier with the bytes the copies bring, the consumers wait for it, run the stage's 4
 * wgmmas (K 16 or 32 each) and arrive on the empty barrier once those wgmmas are done (BF16:
 * one wgmma group stays in flight, the previous stage's slot is released after
 * wgmma.wait_group 1; FP8: each stage's products are summed in a fresh fragment, waited for,
 * then promoted into the accumulators as acc = fma(part, w_scale[n block][k block] *
 * x_scale[row][k block], acc), DeepGEMM's promotion once per 128-K block).
 *
 * The kernel is persistent: the launch gives one CTA an SM (one an item where there are fewer
 * items), and each CTA goes through the work items (feature block, row tile, K range) blockIdx.x,
 * + gridDim.x, ..., its ring running on from one item to the next: the producer loads the next
 * item's first stages while the consumers finish this one and write its D. Where its buffer
 * fits beside the ring (tile_cfg::EPI: row tiles 32 and 96) a consumer writes BF16 D, or h with
 * SwiGLU fused, through shared memory in wide stores (wg_store_staged).
 *
 * In pairs (epd_ffn_gemm_args_t.pair; a cluster of two CTAs, where the feature blocks pair up):
 * CTAs 2c and 2c + 1 take items w and w ^ 1 at each step, neighbouring feature blocks of one row
 * tile and K range, and each producer brings every other activation box of a stage into both
 * CTAs with one multicast copy, so that the activations, which every feature block of a row tile
 * reads again from L2 (as many bytes as the weights at 128 rows), are read once a pair. A slot is
 * then free once both CTAs' consumers are done with it (their empty mbarriers count a lane of
 * each of the other CTA's consumer warps too). The sums are the same bits as alone.
 *
 * Split-K (a short grid) as in gpu/ffn_gemm.cu: each K range's fp32 sums to a workspace, then
 * one more launch adds them in range order: the same bits run to run.
 *
 * sm_90a only (wgmma, setmaxnreg); the compute_90 PTX of the same source compiles the
 * kernels as traps (the host refuses them there: epd_ffn_wgmma_supported). The tensor maps come
 * from the driver's cuTensorMapEncodeTiled through cudaGetDriverEntryPointByVersion: no -lcuda. */
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "gpu/ffn_gemm.h"
#include "gpu/ffn_gemm_layout.h"
#include "gpu/ffn_gemm_wgmma_layout.h"
#include "gpu/ffn_gemm_wgmma_mma.cuh"
#include "gpu/fp8.h"

#define WG_THREADS 128u
#define THREADS (3u * WG_THREADS) /* producer, two consumers */
#define BM EPD_FFN_GEMM_BN        /* features a CTA */
#define W_TILE EPD_WGMMA_W_TILE
#define REDUCE_THREADS 256u
/* an mbarrier wait longer than this is a bug (a copy that never lands): said, then a trap */
#define WAIT_TIMEOUT_NS 2000000000ull

static_assert(BM == 2u * 64u && BM == EPD_WGMMA_FEATURES, "two consumer warpgroups of m64 each");
static_assert(EPD_WGMMA_CONSUMERS == 2u * WG_THREADS, "each consumer thread arrives on empty");
static_assert(W_TILE % EPD_WGMMA_ATOM_BYTES == 0, "weight tiles keep the swizzle atoms aligned");

/* the pipeline of a row tile (gpu/ffn_gemm_wgmma_layout.h: EPD_WGMMA_STAGES, EPD_WGMMA_SMEM) */
template <uint32_t BN> struct tile_cfg {
    static constexpr uint32_t X_TILE = BN * EPD_WGMMA_ROW_BYTES;
    static constexpr uint32_t SCALES = BN * 4; /* a stage's FP8 activation scales */
    static constexpr uint32_t STAGES = EPD_WGMMA_STAGES(BN);
    /* the staged epilogue's buffer (wg_store_staged) where it fits; 0: the epilogue stores from
     * the registers */
    static constexpr uint32_t EPI = EPD_WGMMA_EPI(BN);
    static constexpr uint32_t SMEM = EPD_WGMMA_SMEM(BN) + EPI;
    static_assert(SMEM <= EPD_WGMMA_SMEM_OPTIN, "within the 227 KB a CTA may opt into");
    static_assert(X_TILE % EPD_WGMMA_ATOM_BYTES == 0, "activation tiles aligned");
    static_assert(STAGES >= 3, "a pipeline");
    static_assert((SCALES * STAGES) % 16 == 0, "the mbarriers 8-byte aligned after the scales");
};

struct wg_params {
    const float *w_scale, *x_scale;
    const uint32_t *row_base, *counts, *tile_base;
    void *d;
    float *part;        /* split-K: [K range][total_rows][n] fp32; NULL: D directly */
    size_t part_stride; /* elements of one K range's sums */
    uint32_t n, k, n_experts, w_scale_ld, row_tile;
    uint32_t n_tiles, splits; /* the work items: (feature block, row tile, K range) */
    int out_bf16;
    uint32_t launch; /* this launch's number (never 0): its waits give up once one of its own has */
    uint16_t *h;     /* SwiGLU fused (BF16 gate/up; the weight map tw is then the 5-d view of
                      * epd_wgmma_fused_row): [rows][n / 2] bf16(silu(gate) * up), D not
                      * written; NULL: D */
};

/* ---- device helpers (sm_90a) ------------------------------------------------------------- */

/* the first mbarrier wait that timed out (mbar_wait): [0] its launch's number (0: none), then
 * CTA x, y, z, thread, stage, parity, bytes expected a stage */
__device__ uint32_t wg_hang[8];

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_ARCH 1
#else
#define WG_ARCH 0
#endif

#if WG_ARCH
__device__ static __forceinline__ uint32_t smem_u32(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ static __forceinline__ void mbar_init(uint32_t bar, uint32_t count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ static __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}

__device__ static __forceinline__ void mbar_arrive(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

__device__ static __forceinline__ uint32_t mbar_try(uint32_t bar, uint32_t parity)
{
    uint32_t ok;
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(ok)
                 : "r"(bar), "r"(parity)
                 : "memory");
    return ok;
}

__device__ static __forceinline__ uint64_t globaltimer(void)
{
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}

/* records the first timed-out wait of launch `launch` in wg_hang (its number, CTA, thread, stage,
 * parity, bytes expected a stage) */
__device__ static __forceinline__ void hang_record(uint32_t stage, uint32_t parity,
                                                   uint32_t expect, uint32_t launch)
{
    if (atomicCAS(&wg_hang[0], 0u, launch) == 0) {
        wg_hang[1] = blockIdx.x;
        wg_hang[2] = blockIdx.y;
        wg_hang[3] = blockIdx.z;
        wg_hang[4] = threadIdx.x;
        wg_hang[5] = stage;
        wg_hang[6] = parity;
        wg_hang[7] = expect;
        __threadfence();
    }
}

/* waits for the phase of parity `parity` of the mbarrier at bar. A wait longer than
 * WAIT_TIMEOUT_NS (a copy that never lands: a wrong byte count or coordinate) records itself in
 * wg_hang (hang_record) and gives up, and so do the launch's later waits once one of it has: the
 * launch ends with wrong results instead of hanging, and epd_ffn_wgmma_hang says where. (No
 * printf and no trap: a function call in the kernel serializes its wgmmas.) */
__device__ static __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity, uint32_t stage,
                                                 uint32_t expect, uint32_t launch)
{
    if (mbar_try(bar, parity)) return;
    const uint64_t t0 = globaltimer();
    for (uint32_t spins = 1;; spins++) {
        if (mbar_try(bar, parity)) return;
        if ((spins & 1023u) == 0) {
            if (*(volatile uint32_t *)&wg_hang[0] == launch) return;
            if (globaltimer() - t0 > WAIT_TIMEOUT_NS) {
                hang_record(stage, parity, expect, launch);
                return;
            }
        }
    }
}

/* mbar_wait for a consumer warp that has wgmmas in flight: its lanes try together and leave
 * together; a wait longer than limit_ns returns true (the caller records it with hang_record
 * once its wgmmas are done, and passes 0 for the waits after it, which then give up at once).
 * ptxas serializes a warpgroup's wgmmas when a wait between their issue and their wait_group can
 * be left by lanes apart, or through a path with global memory operations, or is branched
 * around (C7518, "program dependence on compiler-inserted WG.DP in divergent path"); this loop
 * has none of that. */
__device__ static __forceinline__ bool mbar_wait_warp(uint32_t bar, uint32_t parity,
                                                      uint64_t limit_ns)
{
    const uint64_t t0 = globaltimer();
    for (uint32_t spins = 0;; spins++) {
        if (__all_sync(0xffffffffu, mbar_try(bar, parity))) return false;
        if ((spins & 1023u) == 0 && __any_sync(0xffffffffu, globaltimer() - t0 >= limit_ns))
            return true;
    }
}

/* box {128 bytes of K from element k0, rows from row0} of map into dst, counted on bar */
__device__ static __forceinline__ void tma_load(uint32_t dst, const CUtensorMap *map, int32_t k0,
                                                int32_t row0, uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
                 "l"((uint64_t)map), "r"(k0), "r"(row0), "r"(bar)
                 : "memory");
}

/* CTAs in pairs (a cluster of two): tma_load's box brought into the same shared address of both
 * CTAs and counted on the mbarrier at the same address in each (multicast, CTA mask 3) */
__device__ static __forceinline__ void tma_load_pair(uint32_t dst, const CUtensorMap *map,
                                                     int32_t k0, int32_t row0, uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
                 "l"((uint64_t)map), "r"(k0), "r"(row0), "r"(bar), "h"((uint16_t)3)
                 : "memory");
}

/* this CTA's rank in its cluster, and the address in the cluster's shared window of the other
 * CTA's (rank peer) byte at this CTA's shared address addr */
__device__ static __forceinline__ uint32_t cluster_rank(void)
{
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}

__device__ static __forceinline__ uint32_t peer_addr(uint32_t addr, uint32_t peer)
{
    uint32_t r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(peer));
    return r;
}

/* lane 0 of the warp arrives on the other CTA's mbarrier at remote (peer_addr): predicated, not
 * branched around, so that it may sit between a wgmma group's issue and its wait */
__device__ static __forceinline__ void mbar_arrive_peer(uint32_t remote, uint32_t lane)
{
    asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, %1, 0;\n"
                 "@p mbarrier.arrive.shared::cluster.b64 _, [%0];\n}\n" ::"r"(remote),
                 "r"(lane)
                 : "memory");
}

/* in pairs, before a thread leaves: the other CTA's arrives on this CTA's mbarriers are done
 * (its last copies into this CTA were waited for by this CTA's consumers). The producer's idle
 * threads have left by then: threads that exited do not hold up a cluster barrier */
__device__ static __forceinline__ void cluster_leave(void)
{
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

/* SwiGLU fused: box {128 bytes of K from element k0, 8 rows, gate and up, 8 groups of 8 from
 * group g0, expert e} of the 5-d weight map into dst (the 128 tile rows, epd_wgmma_fused_row) */
__device__ static __forceinline__ void tma_load_fused(uint32_t dst, const CUtensorMap *map,
                                                      int32_t k0, int32_t g0, int32_t e,
                                                      uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n" ::"r"(dst),
                 "l"((uint64_t)map), "r"(k0), "r"(0), "r"(0), "r"(g0), "r"(e), "r"(bar)
                 : "memory");
}

/* bytes (a multiple of 16) from src (16-byte aligned) into dst, counted on bar */
__device__ static __forceinline__ void bulk_load(uint32_t dst, const void *src, uint32_t bytes,
                                                 uint32_t bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], "
                 "%2, [%3];\n" ::"r"(dst),
                 "l"(__cvta_generic_to_global(src)), "r"(bytes), "r"(bar)
                 : "memory");
}

__device__ static __forceinline__ void wgmma_fence(void)
{
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ static __forceinline__ void wgmma_commit(void)
{
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int N> __device__ static __forceinline__ void wgmma_wait(void)
{
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* keeps the compiler from moving reads or writes of the registers across the asynchronous
 * wgmmas that own them */
template <uint32_t R> __device__ static __forceinline__ void fence_regs(float (&r)[R])
{
#pragma unroll
    for (uint32_t i = 0; i < R; i++) asm volatile("" : "+f"(r[i])::"memory");
}
#endif

/* the i with base[i] <= x < base[i + 1]: base ascending, [n + 1], base[0] <= x < base[n] */
__device__ static __forceinline__ uint32_t find_base(const uint32_t *base, uint32_t n, uint32_t x)
{
    uint32_t lo = 0, hi = n;
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        if (base[mid] <= x)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* Work item w of a launch: (feature block, row tile, K range), the feature block fastest as a
 * grid's CTAs would be, so that the CTAs at work together share a row tile's activations. */
struct wg_item {
    uint32_t fb, z;       /* feature block, K range */
    uint32_t e;           /* expert */
    uint32_t rb, mpad;    /* the expert's first row and padded rows */
    uint32_t row0, rows;  /* the tile's rows of the expert (epd_wgmma_tile_rows; 0: none) */
    uint32_t n;           /* the rows it computes: the wgmma's N (epd_wgmma_item_n) */
    uint32_t kb0, n_kb;   /* the K range's first stage and stages */
    uint32_t stage_bytes; /* the bytes a stage's copies bring */
};

template <bool FP8, uint32_t BN>
__device__ static __forceinline__ wg_item item_at(const wg_params &p, uint32_t w)
{
    wg_item it;
    const uint32_t n_fb = p.n / EPD_FFN_GEMM_BN, kstage = FP8 ? 128u : 64u;
    const uint32_t y = (w / n_fb) % p.n_tiles;
    it.fb = w % n_fb;
    it.z = w / (n_fb * p.n_tiles);
    it.e = find_base(p.tile_base, p.n_experts, y);
    it.rb = p.row_base[it.e];
    it.mpad = p.row_base[it.e + 1] - it.rb;
    /* rows past mpad are none of the expert's; counts that disagree with tile_base leave tiles
     * without rows (skipped) */
    epd_wgmma_tile_rows(min(p.counts[it.e], it.mpad), BN, y - p.tile_base[it.e], &it.row0,
                        &it.rows);
    it.n = epd_wgmma_item_n(it.rows);
    uint32_t kb1;
    epd_ffn_gemm_split_range(it.z, p.splits, p.k / kstage, &it.kb0, &kb1);
    it.n_kb = kb1 - it.kb0;
    it.stage_bytes = epd_wgmma_stage_bytes(FP8, it.n);
    return it;
}

/* The shared memory of a CTA's pipeline (the kernel's tile_cfg) and the ring's stages so far. */
struct wg_ring {
    uint32_t w_s, x_s, full, empty; /* [STAGES] weight tiles, activation tiles, mbarriers */
    const float *xsc;               /* FP8: [STAGES][BN] activation scales */
    uint32_t it;                    /* the stages of the items before this one */
    uint32_t peer_empty;            /* in pairs: the other CTA's empty mbarriers (peer_addr) */
};

/* A consumer warp frees a ring slot: each thread arrives on its CTA's empty mbarrier and, in
 * pairs, lane 0 on the other CTA's (whose producer brings half of this CTA's activations) */
template <bool PAIR>
__device__ static __forceinline__ void wg_release(const wg_ring &g, uint32_t slot, uint32_t lane)
{
#if WG_ARCH
    mbar_arrive(g.empty + 8 * slot);
    if constexpr (PAIR) mbar_arrive_peer(g.peer_empty + 8 * slot, lane);
#else
    (void)g;
    (void)slot;
    (void)lane;
#endif
}

/* A consumer's K loop over item I with N = I.n (the rows it computes), BF16: acc[0 .. N / 2) the
 * sums of its half of the features (zero before), one wgmma group left in flight, the previous
 * stage's slot released after wait_group 1. */
template <uint32_t BN, uint32_t N, bool PAIR>
__device__ static __forceinline__ void wg_mainloop_bf16(float (&acc)[BN / 2], const wg_params &p,
                                                        const wg_item &I, const wg_ring &g,
                                                        uint32_t half, uint32_t lane)
{
#if WG_ARCH
    using C = tile_cfg<BN>;
    uint32_t prev_slot = 0;
    for (uint32_t s = 0; s < I.n_kb; s++) {
        uint32_t slot, ph, empty_ph;
        epd_wgmma_ring(g.it + s, C::STAGES, &slot, &ph, &empty_ph);
        (void)empty_ph;
        mbar_wait(g.full + 8 * slot, ph, g.it + s, I.stage_bytes, p.launch);
        const uint32_t a0 = g.w_s + slot * W_TILE + half * 64u * EPD_WGMMA_ROW_BYTES;
        const uint32_t b0 = g.x_s + slot * C::X_TILE;
        fence_regs(acc);
        wgmma_fence();
#pragma unroll
        for (uint32_t kk = 0; kk < EPD_WGMMA_ROW_BYTES / EPD_WGMMA_K_BYTES; kk++)
            wgmma<false, N>(acc, epd_wgmma_desc_step(a0, kk), epd_wgmma_desc_step(b0, kk), 1);
        wgmma_commit();
        fence_regs(acc);
        /* the previous stage's wgmmas are done: its slot is free */
        if (s > 0) {
            wgmma_wait<1>();
            wg_release<PAIR>(g, prev_slot, lane);
        }
        prev_slot = slot;
    }
    wgmma_wait<0>();
    fence_regs(acc);
    if (I.n_kb > 0) wg_release<PAIR>(g, prev_slot, lane);
#else
    (void)acc;
    (void)p;
    (void)I;
    (void)g;
    (void)half;
    (void)lane;
#endif
}

#if WG_ARCH
/* FP8: waits for stage s's slot (mbar_wait_warp: true once a wait timed out, and every wait
 * after it returns at once) and issues its 4 wgmmas into part, a fresh fragment; the slot out */
template <uint32_t BN, uint32_t N>
__device__ static __forceinline__ void fp8_issue(float (&part)[N / 2], const wg_item &I,
                                                 const wg_ring &g, uint32_t s, uint32_t half,
                                                 uint32_t *slot_p, uint32_t *late_p)
{
    using C = tile_cfg<BN>;
    uint32_t slot, ph, empty_ph;
    epd_wgmma_ring(g.it + s, C::STAGES, &slot, &ph, &empty_ph);
    (void)empty_ph;
    const uint64_t limit = *late_p != 0 ? 0 : WAIT_TIMEOUT_NS;
    if (mbar_wait_warp(g.full + 8 * slot, ph, limit) && *late_p == 0) *late_p = s + 1;
    const uint32_t a0 = g.w_s + slot * W_TILE + half * 64u * EPD_WGMMA_ROW_BYTES;
    const uint32_t b0 = g.x_s + slot * C::X_TILE;
    wgmma_fence();
#pragma unroll
    for (uint32_t kk = 0; kk < EPD_WGMMA_ROW_BYTES / EPD_WGMMA_K_BYTES; kk++)
        wgmma<true, N>(part, epd_wgmma_desc_step(a0, kk), epd_wgmma_desc_step(b0, kk), kk > 0);
    wgmma_commit();
    *slot_p = slot;
}

/* FP8: promotes a finished stage's fragment into acc (DeepGEMM's promotion once per 128-K block:
 * acc = fma(part, w_scale * x_scale[row], acc)) and frees its slot. Registers 4q .. 4q + 3 hold
 * rows 8q + (lane % 4) * 2 + {0, 1} of features m and m + 8 (epd_wgmma_acc_pos): the two rows'
 * scales once, then one fused multiply-add a register. */
template <uint32_t BN, uint32_t N, bool PAIR>
__device__ static __forceinline__ void fp8_promote(float (&acc)[BN / 2], float (&part)[N / 2],
                                                   const wg_ring &g, uint32_t slot, float ws,
                                                   uint32_t lane)
{
    fence_regs(part);
    const float *sc = g.xsc + slot * BN;
#pragma unroll
    for (uint32_t q = 0; q < N / 8; q++) {
        const float2 s2 = *(const float2 *)(sc + q * 8 + (lane % 4) * 2);
        const float s0 = ws * s2.x, s1 = ws * s2.y;
        acc[4 * q + 0] = __fmaf_rn(part[4 * q + 0], s0, acc[4 * q + 0]);
        acc[4 * q + 1] = __fmaf_rn(part[4 * q + 1], s1, acc[4 * q + 1]);
        acc[4 * q + 2] = __fmaf_rn(part[4 * q + 2], s0, acc[4 * q + 2]);
        acc[4 * q + 3] = __fmaf_rn(part[4 * q + 3], s1, acc[4 * q + 3]);
    }
    wg_release<PAIR>(g, slot, lane);
}
#endif

/* The K loop over item I with N = I.n, FP8 block scales: each stage's products summed in a fresh
 * fragment, up to 128 rows two fragments in turn, so that stage s + 1's wgmmas run while stage s
 * is promoted (wait_group 1), above that one (EPD_WGMMA_FP8_DOUBLE). No branch between a group's
 * issue and its wait but the warp-uniform wait of mbar_wait_warp (the pairs' loop, then the last
 * one or two stages). A timed-out wait is recorded once the wgmmas are done. */
template <uint32_t BN, uint32_t N, bool PAIR>
__device__ static __forceinline__ void wg_mainloop_fp8(float (&acc)[BN / 2], const wg_params &p,
                                                       const wg_item &I, const wg_ring &g,
                                                       uint32_t half, uint32_t lane)
{
#if WG_ARCH
    if (I.n_kb == 0) return;
    const float *wsg = p.w_scale + epd_wgmma_w_scale_at(I.e, p.n, I.fb, p.w_scale_ld, I.kb0);
    uint32_t sa = 0, late = 0; /* late: the stage of the first timed-out wait, + 1 */
    float pa[N / 2];
    if constexpr (!EPD_WGMMA_FP8_DOUBLE(BN)) {
        /* one fragment (two do not fit the registers above 128 rows): each stage waited for and
         * promoted before the next is issued */
        for (uint32_t s = 0; s < I.n_kb; s++) {
            const float wa = __ldg(wsg + s);
            fp8_issue<BN, N>(pa, I, g, s, half, &sa, &late);
            wgmma_wait<0>();
            fp8_promote<BN, N, PAIR>(acc, pa, g, sa, wa, lane);
        }
    } else {
        float pb[N / 2];
        uint32_t sb = 0;
        fp8_issue<BN, N>(pa, I, g, 0, half, &sa, &late);
        uint32_t s = 0;
        for (; s + 2 < I.n_kb; s += 2) {
            const float wa = __ldg(wsg + s), wb = __ldg(wsg + s + 1);
            fp8_issue<BN, N>(pb, I, g, s + 1, half, &sb, &late);
            wgmma_wait<1>();
            fp8_promote<BN, N, PAIR>(acc, pa, g, sa, wa, lane);
            fp8_issue<BN, N>(pa, I, g, s + 2, half, &sa, &late);
            wgmma_wait<1>();
            fp8_promote<BN, N, PAIR>(acc, pb, g, sb, wb, lane);
        }
        const float wa = __ldg(wsg + s);
        if (s + 1 < I.n_kb) {
            const float wb = __ldg(wsg + s + 1);
            fp8_issue<BN, N>(pb, I, g, s + 1, half, &sb, &late);
            wgmma_wait<1>();
            fp8_promote<BN, N, PAIR>(acc, pa, g, sa, wa, lane);
            wgmma_wait<0>();
            fp8_promote<BN, N, PAIR>(acc, pb, g, sb, wb, lane);
        } else {
            wgmma_wait<0>();
            fp8_promote<BN, N, PAIR>(acc, pa, g, sa, wa, lane);
        }
    }
    if (late != 0) {
        uint32_t slot, ph, empty_ph;
        epd_wgmma_ring(g.it + late - 1, tile_cfg<BN>::STAGES, &slot, &ph, &empty_ph);
        hang_record(g.it + late - 1, ph, I.stage_bytes, p.launch);
    }
#else
    (void)acc;
    (void)p;
    (void)I;
    (void)g;
    (void)half;
    (void)lane;
#endif
}

/* wg_mainloop with N = I.n (a multiple of 16 up to BN): one instance for each */
template <bool FP8, uint32_t BN, bool PAIR, uint32_t N = 16u>
__device__ static __forceinline__ void wg_mainloop_n(float (&acc)[BN / 2], const wg_params &p,
                                                     const wg_item &I, const wg_ring &g,
                                                     uint32_t half, uint32_t lane)
{
    if constexpr (N < BN) {
        if (I.n > N) {
            wg_mainloop_n<FP8, BN, PAIR, N + 16u>(acc, p, I, g, half, lane);
            return;
        }
    }
    if constexpr (FP8)
        wg_mainloop_fp8<BN, N, PAIR>(acc, p, I, g, half, lane);
    else
        wg_mainloop_bf16<BN, N, PAIR>(acc, p, I, g, half, lane);
}

/* h = bf16(silu(g) * u) of a fused SwiGLU's gate and up sums, with the SwiGLU kernel's operations
 * (gpu/ffn_cuda.cu): both epilogues write it */
#if WG_ARCH
__device__ static __forceinline__ float wg_swiglu_f(float g, float u)
{
    const float silu = __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
    return __fmul_rn(silu, u);
}

__device__ static __forceinline__ uint16_t wg_swiglu(float g, float u)
{
    return epd_f32_to_bf16(wg_swiglu_f(g, u));
}
#endif

/* The epilogue through shared memory (tile_cfg::EPI != 0; BF16 out, no split-K): a consumer's
 * values (D's 64 features, or with SwiGLU fused h's 32: bf16(silu(gate) * up) as the register
 * epilogue computes them) to its half of the buffer at buf as [row][value] (the layout's
 * epd_wgmma_epi_*), then back in 8-byte chunks, consecutive threads along a row, to D or h: 6 to
 * 12 wide stores a thread where the register epilogue makes 12 to 24 four-byte ones, each warp's
 * writes a few whole lines. Named barrier 1 + half (the half's 128 threads) brackets the
 * buffer's use: before the writes (the previous item's reads done) and between writes and reads.
 * tests/unit/test_ffn_gemm_wgmma_layout.c emulates it. */
template <uint32_t BN>
__device__ static __forceinline__ void wg_store_staged(const float (&acc)[BN / 2],
                                                       const wg_params &p, const wg_item &I,
                                                       uint32_t buf, uint32_t half, uint32_t wt,
                                                       uint32_t wrows)
{
#if WG_ARCH
    constexpr uint32_t R = BN / 2;
    const uint32_t warp = wt / 32, lane = wt % 32;
    const bool fused = p.h != nullptr;
    asm volatile("bar.sync %0, 128;\n" ::"r"(1u + half) : "memory");
#pragma unroll
    for (uint32_t j = 0; j < R; j++) {
        uint32_t m, n;
        epd_wgmma_acc_pos(warp, lane, j, &m, &n);
        if (n >= wrows) continue;
        uint32_t c;
        uint16_t v;
        if (fused) {
            /* registers 4q, 4q + 1 gate, 4q + 2, 4q + 3 up (epd_wgmma_fused_row); the half's h
             * features are fb * 64 + half * 32 + c (epd_wgmma_fused_feature) */
            if ((j / 2) % 2 != 0) continue;
            v = wg_swiglu(acc[j], acc[j + 2]);
            c = epd_wgmma_epi_col(1, m);
        } else {
            v = epd_f32_to_bf16(acc[j]);
            c = epd_wgmma_epi_col(0, m);
        }
        const uint32_t addr = buf + epd_wgmma_epi_at(BN, 0, n, c);
        asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(addr), "h"(v) : "memory");
    }
    asm volatile("bar.sync %0, 128;\n" ::"r"(1u + half) : "memory");
    const uint32_t shift = epd_wgmma_epi_shift(fused), chunks = wrows << shift;
    const size_t row0 = (size_t)I.rb + I.row0;
    for (uint32_t i = wt; i < chunks; i += WG_THREADS) {
        const uint32_t n = i >> shift, c = i & ((1u << shift) - 1u);
        uint32_t x, y;
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n"
                     : "=r"(x), "=r"(y)
                     : "r"(buf + epd_wgmma_epi_at(BN, 0, n, 0) + c * 8u)
                     : "memory");
        uint16_t *dst = fused ? p.h + (row0 + n) * (p.n / 2) + I.fb * 64u + half * 32u + c * 4u
                              : (uint16_t *)p.d + (row0 + n) * p.n + epd_wgmma_feature(I.fb, half) +
                                    c * 4u;
        *(uint2 *)dst = make_uint2(x, y);
    }
#else
    (void)acc;
    (void)p;
    (void)I;
    (void)buf;
    (void)half;
    (void)wt;
    (void)wrows;
#endif
}

/* The epilogue from the registers (no staging buffer): a consumer thread's sums are, for each
 * chunk c of 8 rows (registers 4c .. 4c + 3, epd_wgmma_acc_pos), features m and m + 8 (m = warp *
 * 16 + lane / 4) of rows 8c + n0 and 8c + n0 + 1 (n0 = 2 (lane % 4)). A chunk is written whole or
 * not at all (wrows is a multiple of 8): one test a chunk, its addresses one pointer and fixed
 * offsets. Lanes l and l ^ 4 hold features m and m + 1 of the same rows: each gives the other one
 * value, so that the even one writes both features of row n, the odd one both of row n + 1, as
 * one word (two BF16, or with fp32 sums a float2). With SwiGLU fused only registers 4c, 4c + 1
 * are stored (bf16(silu(gate) * up), the gate in 4c, 4c + 1 and the up in 4c + 2, 4c + 3), to h's
 * feature fb * 64 + half * 32 + warp * 8 + lane / 4 (epd_wgmma_fused_feature): neighbours again
 * for lanes l and l ^ 4 (BF16 weights only). Every lane reaches every shuffle (the chunk test is
 * the warp's). */
template <bool FP8, uint32_t BN>
__device__ static __forceinline__ void wg_store_regs(const float (&acc)[BN / 2],
                                                     const wg_params &p, const wg_item &I,
                                                     uint32_t half, uint32_t warp, uint32_t lane,
                                                     uint32_t wrows)
{
#if WG_ARCH
    constexpr uint32_t R = BN / 2;
    const bool odd = (lane / 4u) % 2u != 0, fused = !FP8 && p.h != nullptr;
    const size_t row = (size_t)I.rb + I.row0 + (lane % 4u) * 2u + (odd ? 1u : 0u);
    const size_t ld = fused ? p.n / 2u : p.n;
    /* the first of the two features this lane writes, in row `row` (chunk 0) */
    const size_t at = row * ld +
                      (fused ? epd_wgmma_fused_feature(I.fb, half * 64u + warp * 16u + lane / 4u)
                             : epd_wgmma_feature(I.fb, half) + warp * 16u + lane / 4u) -
                      (odd ? 1u : 0u);
    const bool bf16 = fused || (p.part == nullptr && p.out_bf16 != 0);
    /* the lane's word of registers r0 (row n) and r1 (row n + 1) of feature m: the even lane
     * (r0, the odd's r0), the odd lane (the even's r1, r1) */
    auto pair = [&](float r0, float r1, float &lo, float &hi) {
        const float got = __shfl_xor_sync(0xffffffffu, odd ? r0 : r1, 4);
        lo = odd ? got : r0;
        hi = odd ? r1 : got;
    };
#pragma unroll
    for (uint32_t c = 0; c < R / 4u; c++) {
        if (8u * c >= wrows) break;
        const size_t i = at + (size_t)(8u * c) * ld;
        float lo, hi, lo8, hi8;
        if (fused) {
            const float h0 = wg_swiglu_f(acc[4 * c], acc[4 * c + 2]);
            pair(h0, wg_swiglu_f(acc[4 * c + 1], acc[4 * c + 3]), lo, hi);
            *(uint32_t *)(p.h + i) =
                (uint32_t)epd_f32_to_bf16(lo) | (uint32_t)epd_f32_to_bf16(hi) << 16;
            continue;
        }
        pair(acc[4 * c], acc[4 * c + 1], lo, hi);
        pair(acc[4 * c + 2], acc[4 * c + 3], lo8, hi8);
        if (bf16) {
            uint16_t *d = (uint16_t *)p.d + i;
            *(uint32_t *)d = (uint32_t)epd_f32_to_bf16(lo) | (uint32_t)epd_f32_to_bf16(hi) << 16;
            *(uint32_t *)(d + 8) =
                (uint32_t)epd_f32_to_bf16(lo8) | (uint32_t)epd_f32_to_bf16(hi8) << 16;
        } else {
            float *d = p.part != nullptr ? p.part + (size_t)I.z * p.part_stride + i
                                         : (float *)p.d + i;
            *(float2 *)d = make_float2(lo, hi);
            *(float2 *)(d + 8) = make_float2(lo8, hi8);
        }
    }
#else
    (void)acc;
    (void)p;
    (void)I;
    (void)half;
    (void)warp;
    (void)lane;
    (void)wrows;
#endif
}

/* ---- the kernels ------------------------------------------------------------------------- */

template <bool FP8, uint32_t BN, bool PAIR>
__global__ void __launch_bounds__(THREADS, 1)
    wgmma_kernel(const __grid_constant__ CUtensorMap tw, const __grid_constant__ CUtensorMap tx,
                 const __grid_constant__ CUtensorMap tx32, const __grid_constant__ CUtensorMap tx64,
                 wg_params p)
{
#if WG_ARCH
    using C = tile_cfg<BN>;
    constexpr uint32_t STAGES = C::STAGES;
    constexpr uint32_t R = BN / 2; /* accumulator registers a thread */
    static_assert(BN % 16 == 0, "work items compute multiples of 16 rows");
    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t base = (raw + EPD_WGMMA_ATOM_BYTES - 1) & ~(EPD_WGMMA_ATOM_BYTES - 1);
    const epd_wgmma_smem_t at = epd_wgmma_smem_at(BN);
    wg_ring g;
    g.w_s = base + at.w;
    g.x_s = base + at.x;
    const uint32_t sc_s = base + at.sc;
    g.xsc = (const float *)(smem_raw + (sc_s - raw));
    g.full = base + at.full;
    g.empty = base + at.empty;
    g.it = 0;

    const uint32_t tid = threadIdx.x, wg = tid / WG_THREADS;
    const uint32_t kstage = FP8 ? 128u : 64u; /* K elements a stage */
    const uint32_t items = p.n / BM * p.n_tiles * p.splits;

    /* the kernel launched behind this one (a programmatic dependent launch) may start its CTAs
     * as SMs free up: it waits for this grid's writes where it reads them */
    asm volatile("griddepcontrol.launch_dependents;");
    /* in pairs (a cluster of two CTAs, items w and w ^ 1: neighbouring feature blocks of one row
     * tile and K range), each CTA's producer brings every other activation box of a stage into
     * both CTAs (tma_load_pair), so the pair reads its activations from L2 once; a slot is then
     * free once both CTAs' consumers are done with it: the empty mbarrier counts this CTA's
     * consumer threads and a lane of each of the other CTA's 8 consumer warps */
    const uint32_t rank = PAIR ? cluster_rank() : 0u;
    g.peer_empty = PAIR ? peer_addr(g.empty, rank ^ 1u) : 0u;
    if (tid == 0) {
        for (uint32_t s = 0; s < STAGES; s++) {
            mbar_init(g.full + 8 * s, 1);
            mbar_init(g.empty + 8 * s, EPD_WGMMA_CONSUMERS + (PAIR ? 8u : 0u));
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    }
    /* in pairs, neither CTA's copies or arrives reach the other before its mbarriers exist */
    if constexpr (PAIR)
        asm volatile("barrier.cluster.arrive.release.aligned;\n"
                     "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    else
        __syncthreads();

    if (wg == 0) {
        /* FP8: the producer's registers to the consumers (two fragments and the sums: 192 at
         * 128 rows, one and the sums at 192); 128 x 40 + 256 x 232 is the 384 x 168 the launch
         * holds */
        if constexpr (FP8) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (tid != 0) return;
        asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&tw) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&tx) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&tx32) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&tx64) : "memory");
        /* launched behind the kernel that writes the activations (a programmatic dependent
         * launch): the first item's first ring of weight stages is asked for before
         * griddepcontrol.wait (the weights are the layer's, written long before), its
         * activations after (without that launch attribute the wait returns at once) */
        bool waited = false;
        for (uint32_t w = blockIdx.x; w < items; w += gridDim.x) {
            const wg_item I = item_at<FP8, BN>(p, w);
            if (I.rows == 0) continue;
            /* the weights as one box of 128 rows (the two consumers' halves one after the
             * other: 1-3% faster than a box a half, BF16): the item's 128 features, or with
             * SwiGLU fused h's features fb * 64 .. + 64, gate and up interleaved
             * (epd_wgmma_fused_row); the activations in the boxes of epd_wgmma_x_box */
            const bool fused = !FP8 && p.h != nullptr;
            const int32_t w_row0 = (int32_t)(I.e * p.n + epd_wgmma_feature(I.fb, 0));
            const int32_t x_row = (int32_t)(I.rb + I.row0);
            /* stage s's slot, armed with the stage's bytes, and its weights */
            auto weights = [&](uint32_t s) {
                uint32_t slot, ph, empty_ph;
                epd_wgmma_ring(g.it + s, STAGES, &slot, &ph, &empty_ph);
                (void)ph;
                mbar_wait(g.empty + 8 * slot, empty_ph, g.it + s, I.stage_bytes, p.launch);
                const uint32_t bar = g.full + 8 * slot;
                mbar_expect_tx(bar, I.stage_bytes);
                const int32_t k0 = (int32_t)((I.kb0 + s) * kstage);
                if (fused)
                    tma_load_fused(g.w_s + slot * W_TILE, &tw, k0,
                                   (int32_t)epd_wgmma_fused_group(I.fb), (int32_t)I.e, bar);
                else
                    tma_load(g.w_s + slot * W_TILE, &tw, k0, w_row0, bar);
            };
            uint32_t early = 0;
            if (!waited) {
                early = min(STAGES, I.n_kb);
                for (uint32_t s = 0; s < early; s++) weights(s);
                asm volatile("griddepcontrol.wait;" ::: "memory");
                waited = true;
            }
            for (uint32_t s = 0; s < I.n_kb; s++) {
                if (s >= early) weights(s);
                const uint32_t slot = (g.it + s) % STAGES, bar = g.full + 8 * slot;
                const int32_t k0 = (int32_t)((I.kb0 + s) * kstage);
                for (uint32_t b = 0; b < epd_wgmma_x_boxes(I.n); b++) {
                    /* in pairs the boxes taken in turn, starting with the other CTA's every
                     * other stage (a stage of one box is not always the same CTA's) */
                    if (PAIR && ((b ^ s ^ rank) & 1u) != 0) continue;
                    uint32_t r, rows;
                    epd_wgmma_x_box(I.n, b, &r, &rows);
                    const uint32_t dst = g.x_s + slot * C::X_TILE + r * EPD_WGMMA_ROW_BYTES;
                    const CUtensorMap *map = rows == EPD_WGMMA_X_BIG   ? &tx64
                                             : rows == EPD_WGMMA_X_MID ? &tx32
                                                                       : &tx;
                    if constexpr (PAIR)
                        tma_load_pair(dst, map, k0, x_row + (int32_t)r, bar);
                    else
                        tma_load(dst, map, k0, x_row + (int32_t)r, bar);
                }
                if (FP8)
                    bulk_load(sc_s + slot * C::SCALES,
                              p.x_scale +
                                  epd_wgmma_x_scale_at(I.rb, p.k, I.mpad, I.row0, I.kb0 + s),
                              I.n * 4, bar);
            }
            g.it += I.n_kb;
        }
        if constexpr (PAIR) cluster_leave();
        return;
    }

    if constexpr (FP8) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    /* a consumer: features (wg - 1) * 64 .. + 64 of the item's 128, every row of the tile */
    const uint32_t half = wg - 1, wt = tid % WG_THREADS, warp = wt / 32, lane = wt % 32;
    const uint32_t epi = (base + at.end + 15u) & ~15u; /* the staged epilogue's buffer */
    for (uint32_t w = blockIdx.x; w < items; w += gridDim.x) {
        const wg_item I = item_at<FP8, BN>(p, w);
        if (I.rows == 0) continue;
        float acc[R];
#pragma unroll
        for (uint32_t i = 0; i < R; i++) acc[i] = 0.0f;
        wg_mainloop_n<FP8, BN, PAIR>(acc, p, I, g, half, lane);
        g.it += I.n_kb;

        /* D[row][feature] for the rows the item writes (its rows rounded up to 8) */
        const uint32_t wrows = epd_wgmma_item_written(I.rows);
        if constexpr (C::EPI != 0) {
            if (p.part == nullptr && (p.h != nullptr ? !FP8 : p.out_bf16 != 0)) {
                wg_store_staged<BN>(acc, p, I, epi + epd_wgmma_epi_at(BN, half, 0, 0), half, wt,
                                    wrows);
                continue;
            }
        }
        wg_store_regs<FP8, BN>(acc, p, I, half, warp, lane, wrows);
    }
    if constexpr (PAIR) cluster_leave();
#else
    (void)tw;
    (void)tx;
    (void)tx32;
    (void)tx64;
    (void)p;
    __trap(); /* the host refuses the kernel where this is reached (epd_ffn_wgmma_supported) */
#endif
}

/* split-K's second pass: D[row][4 features] = the K ranges' sums added in range order, for the
 * rows the GEMM writes; grid (rows, N / (4 REDUCE_THREADS) up) */
__global__ void __launch_bounds__(REDUCE_THREADS) wg_reduce_kernel(wg_params p, uint32_t splits)
{
    const uint32_t row = blockIdx.x, col = (blockIdx.y * REDUCE_THREADS + threadIdx.x) * 4;
    if (col >= p.n) return;
    const uint32_t e = find_base(p.row_base, p.n_experts, row);
    const uint32_t rb = p.row_base[e], mpad = p.row_base[e + 1] - rb;
    const uint32_t tiles = p.tile_base[e + 1] - p.tile_base[e];
    if (row - rb >= epd_ffn_gemm_written_rows(p.counts[e], mpad, tiles, p.row_tile)) return;
    const size_t i = (size_t)row * p.n + col;
    float4 sum = *(const float4 *)(p.part + i);
    for (uint32_t s = 1; s < splits; s++) {
        const float4 v = *(const float4 *)(p.part + (size_t)s * p.part_stride + i);
        sum.x += v.x;
        sum.y += v.y;
        sum.z += v.z;
        sum.w += v.w;
    }
    if (p.out_bf16) {
        uint16_t *d = (uint16_t *)p.d + i;
        d[0] = epd_f32_to_bf16(sum.x);
        d[1] = epd_f32_to_bf16(sum.y);
        d[2] = epd_f32_to_bf16(sum.z);
        d[3] = epd_f32_to_bf16(sum.w);
    } else {
        *(float4 *)((float *)p.d + i) = sum;
    }
}

/* The layout check (epd_ffn_wgmma_layout_check): one warpgroup, one stage. The TMA brings a
 * [64][128 bytes] and b [32][128 bytes] into 1024-aligned tiles (as the GEMM's producer does),
 * the tiles are dumped as they lie (dump_a, dump_b), then the 4 wgmmas of a stage (m64n32, the
 * GEMM's descriptors) give d [64][32] = a b^T. */
template <bool FP8>
__global__ void __launch_bounds__(WG_THREADS, 1)
    wg_layout_kernel(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,
                     uint8_t *dump_a, uint8_t *dump_b, float *d)
{
#if WG_ARCH
    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t base = (raw + EPD_WGMMA_ATOM_BYTES - 1) & ~(EPD_WGMMA_ATOM_BYTES - 1);
    const uint32_t a_s = base, b_s = base + 64 * EPD_WGMMA_ROW_BYTES;
    const uint32_t bar = b_s + 32 * EPD_WGMMA_ROW_BYTES;
    const uint8_t *gen = smem_raw + (base - raw);
    const uint32_t tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const uint32_t bytes = 96 * EPD_WGMMA_ROW_BYTES;
    if (tid == 0) {
        mbar_init(bar, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    }
    __syncthreads();
    if (tid == 0) {
        mbar_expect_tx(bar, bytes);
        tma_load(a_s, &ta, 0, 0, bar);
        tma_load(b_s, &tb, 0, 0, bar);
    }
    mbar_wait(bar, 0, 0, bytes, 0xffffffffu);
    for (uint32_t i = tid; i < 64 * EPD_WGMMA_ROW_BYTES; i += WG_THREADS) dump_a[i] = gen[i];
    for (uint32_t i = tid; i < 32 * EPD_WGMMA_ROW_BYTES; i += WG_THREADS)
        dump_b[i] = gen[64 * EPD_WGMMA_ROW_BYTES + i];
    float acc[16];
#pragma unroll
    for (uint32_t i = 0; i < 16; i++) acc[i] = 0.0f;
    fence_regs(acc);
    wgmma_fence();
#pragma unroll
    for (uint32_t kk = 0; kk < EPD_WGMMA_ROW_BYTES / EPD_WGMMA_K_BYTES; kk++)
        wgmma<FP8, 32>(acc, epd_wgmma_desc_step(a_s, kk), epd_wgmma_desc_step(b_s, kk), 1);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc);
#pragma unroll
    for (uint32_t j = 0; j < 16; j++) {
        uint32_t m, n;
        epd_wgmma_acc_pos(warp, lane, j, &m, &n);
        d[m * 32 + n] = acc[j];
    }
#else
    (void)ta;
    (void)tb;
    (void)dump_a;
    (void)dump_b;
    (void)d;
    __trap();
#endif
}

/* ---- host -------------------------------------------------------------------------------- */

typedef void (*wg_kernel_t)(const CUtensorMap, const CUtensorMap, const CUtensorMap,
                            const CUtensorMap, wg_params);

/* the kernel of a format and row tile, alone or in pairs, and its shared memory; NULL for a tile
 * it lacks */
static wg_kernel_t wg_kernel(bool fp8, uint32_t row_tile, bool pair, uint32_t *smem_p)
{
#define WG_CASE(F, T)                                                                          \
    if (fp8 == F && row_tile == T) {                                                           \
        *smem_p = tile_cfg<T>::SMEM;                                                           \
        return pair ? wgmma_kernel<F, T, true> : wgmma_kernel<F, T, false>;                    \
    }
    WG_CASE(false, 32)
    WG_CASE(false, 64)
    WG_CASE(false, 96)
    WG_CASE(false, 128)
    WG_CASE(false, 160)
    WG_CASE(false, 192)
    WG_CASE(false, 256)
    WG_CASE(true, 32)
    WG_CASE(true, 64)
    WG_CASE(true, 96)
    WG_CASE(true, 128)
    WG_CASE(true, 160)
    WG_CASE(true, 192)
#undef WG_CASE
    *smem_p = 0;
    return NULL;
}

typedef CUresult (*encode_tiled_t)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                   const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                   const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/* the driver's cuTensorMapEncodeTiled (once; NULL when the driver has none) */
static encode_tiled_t encode_tiled(void)
{
    static encode_tiled_t fn;
    static bool tried;
    if (!tried) {
        void *p = NULL;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                             cudaEnableDefault, &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = (encode_tiled_t)p;
        else
            cudaGetLastError();
        tried = true;
    }
    return fn;
}

/* The tensor map of a [rows][k] K-major operand (BF16 or bytes) read in boxes of 128 K bytes by
 * box_rows rows, 128-byte swizzled (epd_wgmma_tile_off); rows past the end read as zeros. */
static epd_status_t make_map(CUtensorMap *map, const void *ptr, bool fp8, uint64_t rows,
                             uint32_t k, uint32_t box_rows, const char *what,
                             char err[EPD_ERR_LEN])
{
    encode_tiled_t enc = encode_tiled();
    const uint32_t es = fp8 ? 1 : 2;
    cuuint64_t dims[2] = {k, rows}, strides[1] = {(cuuint64_t)k * es};
    cuuint32_t box[2] = {EPD_WGMMA_ROW_BYTES / es, box_rows}, estr[2] = {1, 1};
    if (enc == NULL) {
        snprintf(err, EPD_ERR_LEN, "ffn wgmma kernel: the driver has no cuTensorMapEncodeTiled");
        return EPD_ERR_UNSUPPORTED;
    }
    CUresult r = enc(map, fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
                     (void *)ptr, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                     CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        snprintf(err, EPD_ERR_LEN,
                 "ffn wgmma kernel: cuTensorMapEncodeTiled (%s: %llu rows, K %u, box %u x %u) "
                 "failed: CUresult %d",
                 what, (unsigned long long)rows, k, box[0], box[1], (int)r);
        return EPD_ERR_INVALID_ARG;
    }
    return EPD_OK;
}

/* SwiGLU fused: the BF16 gate/up weights [n_experts][n][k] (n / 2 gate rows, then their n / 2 up
 * rows) as a 5-d tensor (k, 8 rows, gate or up, n / 16 groups of 8, experts) read in boxes of
 * 128 K bytes x 8 x 2 x 8 x 1: a feature block's 128 tile rows, gate and up interleaved in
 * groups of 8 (epd_wgmma_fused_row), 128-byte swizzled as make_map's. */
static epd_status_t make_fused_map(CUtensorMap *map, const void *ptr, uint32_t n_experts,
                                   uint32_t n, uint32_t k, char err[EPD_ERR_LEN])
{
    encode_tiled_t enc = encode_tiled();
    const cuuint64_t row = (cuuint64_t)k * 2;
    cuuint64_t dims[5] = {k, 8, 2, n / 16, n_experts};
    cuuint64_t strides[4] = {row, row * (n / 2), row * 8, row * n};
    cuuint32_t box[5] = {EPD_WGMMA_ROW_BYTES / 2, 8, 2, BM / 16, 1}, estr[5] = {1, 1, 1, 1, 1};
    if (enc == NULL) {
        snprintf(err, EPD_ERR_LEN, "ffn wgmma kernel: the driver has no cuTensorMapEncodeTiled");
        return EPD_ERR_UNSUPPORTED;
    }
    CUresult r = enc(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 5, (void *)ptr, dims, strides, box,
                     estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                     CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        snprintf(err, EPD_ERR_LEN,
                 "ffn wgmma kernel: cuTensorMapEncodeTiled (gate/up interleaved: %u experts, N "
                 "%u, K %u) failed: CUresult %d",
                 n_experts, n, k, (int)r);
        return EPD_ERR_INVALID_ARG;
    }
    return EPD_OK;
}

/* the SMs of the current device (once per device; 0 where unknown) and the kernels' shared
 * memory attribute set (once per kernel and device) */
#define CONFIG_DEVICES 64
static bool configured[2][2][EPD_WGMMA_TILES][CONFIG_DEVICES];
/* in pairs: the clusters of two that fit at once (0: not asked yet; -1: none) */
static int pair_clusters[2][EPD_WGMMA_TILES][CONFIG_DEVICES];

static cudaError_t wg_configure(bool fp8, uint32_t row_tile, bool pair, wg_kernel_t k,
                                uint32_t smem, uint64_t *sms_p)
{
    int dev = 0, sms = 0;
    cudaError_t rc = cudaGetDevice(&dev);
    *sms_p = 0;
    if (rc != cudaSuccess) return rc;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && sms > 0)
        *sms_p = (uint64_t)sms;
    else
        cudaGetLastError();
    bool *done = dev >= 0 && dev < CONFIG_DEVICES
                     ? &configured[fp8][pair][epd_wgmma_tile_index(row_tile)][dev]
                     : NULL;
    if (done != NULL && *done) return cudaSuccess;
    rc = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (rc == cudaSuccess && done != NULL) *done = true;
    return rc;
}

/* The CTAs a launch in pairs may have at once: twice the clusters of two that fit (asked once
 * per kernel and device); 0 where none fits or the question fails (the launch then goes alone) */
static uint64_t wg_pair_ctas(bool fp8, uint32_t row_tile, wg_kernel_t k, uint32_t smem)
{
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= CONFIG_DEVICES) {
        cudaGetLastError();
        return 0;
    }
    int *known = &pair_clusters[fp8][epd_wgmma_tile_index(row_tile)][dev];
    if (*known == 0) {
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute attr[1] = {};
        cfg.gridDim = dim3(2);
        cfg.blockDim = dim3(THREADS);
        cfg.dynamicSmemBytes = smem;
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = 2;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        if (cudaOccupancyMaxActiveClusters(&n, (const void *)k, &cfg) != cudaSuccess || n <= 0) {
            cudaGetLastError();
            n = -1;
        }
        *known = n;
    }
    return *known > 0 ? 2u * (uint64_t)*known : 0;
}

extern "C" epd_status_t epd_ffn_wgmma_supported(bool fp8, char err[EPD_ERR_LEN])
{
    int dev = 0, major = 0, minor = 0, optin = 0;
    uint32_t smem = 0;
    cudaFuncAttributes fa;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
            cudaSuccess) {
        cudaGetLastError();
        snprintf(err, EPD_ERR_LEN, "ffn wgmma kernel: cannot read the device's compute capability");
        return EPD_ERR_UNSUPPORTED;
    }
    if (major != 9 || minor != 0) {
        snprintf(err, EPD_ERR_LEN,
                 "ffn wgmma kernel: wgmma is sm_90a code (compute capability 9.0), the device "
                 "has %d.%d",
                 major, minor);
        return EPD_ERR_UNSUPPORTED;
    }
    wg_kernel_t k = wg_kernel(fp8, EPD_WGMMA_TILE_MIN, false, &smem);
    uint32_t most = 0;
    for (uint32_t i = 0; i < epd_wgmma_tile_count(fp8); i++) {
        uint32_t s = 0;
        if (wg_kernel(fp8, epd_wgmma_tile_at(i), false, &s) != NULL && s > most) most = s;
    }
    if (optin < (int)most) {
        snprintf(err, EPD_ERR_LEN,
                 "ffn wgmma kernel: its pipelines need %u bytes of shared memory a CTA, the "
                 "device allows %d",
                 most, optin);
        return EPD_ERR_UNSUPPORTED;
    }
    cudaError_t rc = cudaFuncGetAttributes(&fa, k);
    if (rc != cudaSuccess) {
        cudaGetLastError();
        snprintf(err, EPD_ERR_LEN, "ffn wgmma kernel: no code for this device: %s",
                 cudaGetErrorString(rc));
        return EPD_ERR_UNSUPPORTED;
    }
    if (fa.binaryVersion < 90) {
        snprintf(err, EPD_ERR_LEN,
                 "ffn wgmma kernel: no sm_90a code in this build (binary version %d; the "
                 "Makefile's -gencode arch=compute_90a,code=sm_90a)",
                 fa.binaryVersion);
        return EPD_ERR_UNSUPPORTED;
    }
    if (encode_tiled() == NULL) {
        snprintf(err, EPD_ERR_LEN,
                 "ffn wgmma kernel: the driver has no cuTensorMapEncodeTiled (CUDA 12 driver)");
        return EPD_ERR_UNSUPPORTED;
    }
    return EPD_OK;
}

extern "C" epd_status_t epd_ffn_wgmma_layout_check(bool fp8, const void *a_host,
                                                   const void *b_host, void *dump_a_host,
                                                   void *dump_b_host, float *d_host,
                                                   char err[EPD_ERR_LEN])
{
    epd_status_t status = epd_ffn_wgmma_supported(fp8, err);
    const size_t a_bytes = 64 * EPD_WGMMA_ROW_BYTES, b_bytes = 32 * EPD_WGMMA_ROW_BYTES;
    const uint32_t smem = EPD_WGMMA_ATOM_BYTES + (uint32_t)(a_bytes + b_bytes) + 16;
    uint8_t *a = NULL, *b = NULL, *da = NULL, *db = NULL;
    float *d = NULL;
    CUtensorMap ta, tb;
    cudaError_t rc;
    if (status != EPD_OK) return status;
    rc = cudaMalloc((void **)&a, a_bytes);
    if (rc == cudaSuccess) rc = cudaMalloc((void **)&b, b_bytes);
    if (rc == cudaSuccess) rc = cudaMalloc((void **)&da, a_bytes);
    if (rc == cudaSuccess) rc = cudaMalloc((void **)&db, b_bytes);
    if (rc == cudaSuccess) rc = cudaMalloc((void **)&d, 64 * 32 * sizeof(float));
    if (rc == cudaSuccess) rc = cudaMemcpy(a, a_host, a_bytes, cudaMemcpyHostToDevice);
    if (rc == cudaSuccess) rc = cudaMemcpy(b, b_host, b_bytes, cudaMemcpyHostToDevice);
    if (rc == cudaSuccess) {
        const uint32_t k = EPD_WGMMA_ROW_BYTES / (fp8 ? 1 : 2);
        status = make_map(&ta, a, fp8, 64, k, 64, "layout check a", err);
        if (status == EPD_OK) status = make_map(&tb, b, fp8, 32, k, 32, "layout check b", err);
    }
    if (rc == cudaSuccess && status == EPD_OK) {
        void (*kern)(const CUtensorMap, const CUtensorMap, uint8_t *, uint8_t *, float *) =
            fp8 ? wg_layout_kernel<true> : wg_layout_kernel<false>;
        rc = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (rc == cudaSuccess) {
            kern<<<1, WG_THREADS, smem>>>(ta, tb, da, db, d);
            rc = cudaGetLastError();
        }
        if (rc == cudaSuccess) rc = cudaDeviceSynchronize();
        if (rc == cudaSuccess) rc = cudaMemcpy(dump_a_host, da, a_bytes, cudaMemcpyDeviceToHost);
        if (rc == cudaSuccess) rc = cudaMemcpy(dump_b_host, db, b_bytes, cudaMemcpyDeviceToHost);
        if (rc == cudaSuccess)
            rc = cudaMemcpy(d_host, d, 64 * 32 * sizeof(float), cudaMemcpyDeviceToHost);
    }
    if (rc != cudaSuccess) {
        snprintf(err, EPD_ERR_LEN, "ffn wgmma layout check: %s", cudaGetErrorString(rc));
        status = EPD_ERR_CUDA;
    }
    cudaFree(a);
    cudaFree(b);
    cudaFree(da);
    cudaFree(db);
    cudaFree(d);
    return status;
}

extern "C" bool epd_ffn_wgmma_hang(char *text, size_t len)
{
    uint32_t h[8], zero[8] = {0};
    if (cudaMemcpyFromSymbol(h, wg_hang, sizeof h) != cudaSuccess) {
        cudaGetLastError();
        snprintf(text, len, "ffn wgmma kernel: its wait record cannot be read");
        return true;
    }
    if (h[0] == 0) return false;
    snprintf(text, len,
             "ffn wgmma kernel: an mbarrier wait timed out: CTA %u (persistent: work items "
             "%u, + the grid's CTAs, ...) thread %u (%s), ring stage %u (counted over the "
             "CTA's items), parity %u, %u bytes expected a stage",
             h[1], h[1], h[4], h[4] < WG_THREADS ? "the producer, on an empty slot"
                                                 : "a consumer, on a full slot",
             h[5], h[6], h[7]);
    if (cudaMemcpyToSymbol(wg_hang, zero, sizeof zero) != cudaSuccess) cudaGetLastError();
    return true;
}

extern "C" uint32_t epd_ffn_wgmma_row_tile(bool fp8, const uint32_t *counts, uint32_t n_experts)
{
    return epd_wgmma_pick_row_tile(fp8, counts, n_experts);
}

extern "C" epd_status_t epd_ffn_wgmma_launch(const epd_ffn_gemm_args_t *a, void *stream,
                                             char err[EPD_ERR_LEN])
{
    wg_params p;
    uint32_t smem = 0;
    if (a->split_used_p != NULL) *a->split_used_p = 1;
    if (a->pair_used_p != NULL) *a->pair_used_p = false;
    if (a->n_tiles == 0) return EPD_OK;
    const uint32_t es = a->fp8 ? 1 : 2;
    /* in pairs where asked and the feature blocks pair up (items w, w ^ 1 of one row tile) */
    bool pair = a->pair && (a->n / BM) % 2 == 0;
    wg_kernel_t k = wg_kernel(a->fp8, a->row_tile, pair, &smem);
    if (k == NULL || a->n == 0 || a->k == 0 || a->n % 128 != 0 || a->k % 128 != 0 ||
        a->n_tiles > 65535 || a->n_experts == 0 || a->w == NULL || a->x == NULL || a->d == NULL ||
        a->row_base == NULL || a->counts == NULL || a->tile_base == NULL || a->total_rows == 0 ||
        ((uintptr_t)a->w | (uintptr_t)a->x) % 16 != 0 ||
        (uint64_t)a->n_experts * a->n > INT32_MAX || a->total_rows > INT32_MAX ||
        (a->fp8 && (a->w_scale == NULL || a->x_scale == NULL || a->w_scale_ld < a->k / 128 ||
                    (uintptr_t)a->x_scale % 16 != 0))) {
        snprintf(err, EPD_ERR_LEN,
                 "ffn wgmma kernel: bad arguments (N %u, K %u, %u experts, %u rows, row tile %u; "
                 "N and K multiples of 128, at most 65535 row tiles, the row tile 32, 64, 96, 128, "
                 "160, 192 or 256 (FP8: up to 192), "
                 "operands 16-byte aligned, FP8 needs both scales)",
                 a->n, a->k, a->n_experts, a->total_rows, a->row_tile);
        return EPD_ERR_INVALID_ARG;
    }
    CUtensorMap tw, tx, tx32, tx64;
    epd_status_t status =
        make_map(&tx, a->x, a->fp8, a->total_rows, a->k, EPD_WGMMA_X_BOX, "activations", err);
    if (status == EPD_OK)
        status = make_map(&tx32, a->x, a->fp8, a->total_rows, a->k, EPD_WGMMA_X_MID,
                          "activations", err);
    if (status == EPD_OK)
        status = make_map(&tx64, a->x, a->fp8, a->total_rows, a->k, EPD_WGMMA_X_BIG,
                          "activations", err);
    if (status != EPD_OK) return status;

    memset(&p, 0, sizeof p);
    p.w_scale = a->w_scale;
    p.x_scale = a->x_scale;
    p.row_base = a->row_base;
    p.counts = a->counts;
    p.tile_base = a->tile_base;
    p.d = a->d;
    p.n = a->n;
    p.k = a->k;
    p.n_experts = a->n_experts;
    p.w_scale_ld = a->w_scale_ld;
    p.row_tile = a->row_tile;
    p.out_bf16 = a->out_bf16;
    /* the launches' numbers: 1 .. 0xfffffffe, the layout check's 0xffffffff */
    static uint32_t launches;
    launches = launches % 0xfffffffeu + 1;
    p.launch = launches;
    uint64_t sms = 0;
    cudaError_t rc = wg_configure(a->fp8, a->row_tile, pair, k, smem, &sms);
    uint64_t pair_ctas = 0;
    if (rc == cudaSuccess && pair) {
        pair_ctas = wg_pair_ctas(a->fp8, a->row_tile, k, smem);
        if (pair_ctas == 0) {
            /* no cluster of two fits: alone */
            pair = false;
            k = wg_kernel(a->fp8, a->row_tile, false, &smem);
            rc = wg_configure(a->fp8, a->row_tile, false, k, smem, &sms);
        }
    }
    const uint32_t n_kb = a->k * es / EPD_WGMMA_ROW_BYTES;
    const size_t ws_range = (size_t)a->total_rows * a->n * sizeof(float);
    /* one CTA an SM: the slots are the SMs */
    uint64_t by_ws = a->split_ws == NULL ? 1 : a->split_ws_bytes / ws_range;
    uint32_t max_by_ws = by_ws > EPD_FFN_GEMM_MAX_SPLIT ? EPD_FFN_GEMM_MAX_SPLIT : (uint32_t)by_ws;
    uint32_t splits = a->split_k;
    const uint64_t ctas = (uint64_t)a->n_tiles * (a->n / BM);
    if (max_by_ws < 2 || splits == 1)
        splits = 1;
    else if (splits == EPD_FFN_GEMM_SPLIT_AUTO)
        splits = epd_ffn_gemm_auto_split(ctas, n_kb, sms, max_by_ws);
    else {
        if (splits > max_by_ws) splits = max_by_ws;
        if (splits > n_kb) splits = n_kb;
    }
    if (splits > 1) {
        p.part = (float *)a->split_ws;
        p.part_stride = (size_t)a->total_rows * a->n;
    }
    /* SwiGLU fused where asked and possible: BF16, no split (the sums whole in one CTA); the
     * weights then through the interleaving 5-d map */
    const bool fuse = a->swiglu_h != NULL && !a->fp8 && splits == 1;
    if (fuse) p.h = (uint16_t *)a->swiglu_h;
    status = fuse ? make_fused_map(&tw, a->w, a->n_experts, a->n, a->k, err)
                  : make_map(&tw, a->w, a->fp8, (uint64_t)a->n_experts * a->n, a->k, BM,
                             "weights", err);
    if (status != EPD_OK) return status;
    if (a->swiglu_done_p != NULL) *a->swiglu_done_p = false;
    p.n_tiles = a->n_tiles;
    p.splits = splits;
    const uint64_t items = (uint64_t)(a->n / BM) * a->n_tiles * splits;
    /* persistent: one CTA an SM going through the items (its ring runs on from one item to the
     * next: the next item's loads go out during this one's last stages and its epilogue) */
    uint64_t slots = pair ? pair_ctas : sms;
    if (pair && sms > 0 && slots > sms) slots = sms & ~(uint64_t)1;
    /* in pairs the items (an even number) and the grid both even: CTAs 2c and 2c + 1 (a
     * cluster) take items w and w ^ 1 at each step */
    dim3 grid((unsigned)(slots > 0 && items > slots ? slots : items));
    cudaStream_t s = (cudaStream_t)stream;
    if (rc == cudaSuccess) {
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute attr[2] = {};
        unsigned n_attr = 0;
        cfg.gridDim = grid;
        cfg.blockDim = dim3(THREADS);
        cfg.dynamicSmemBytes = smem;
        cfg.stream = s;
        if (a->pdl) {
            attr[n_attr].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            attr[n_attr++].val.programmaticStreamSerializationAllowed = 1;
        }
        if (pair) {
            attr[n_attr].id = cudaLaunchAttributeClusterDimension;
            attr[n_attr].val.clusterDim.x = 2;
            attr[n_attr].val.clusterDim.y = 1;
            attr[n_attr++].val.clusterDim.z = 1;
        }
        cfg.attrs = attr;
        cfg.numAttrs = n_attr;
        rc = cudaLaunchKernelEx(&cfg, k, tw, tx, tx32, tx64, p);
    }
    if (rc == cudaSuccess && splits > 1) {
        dim3 rgrid(a->total_rows, (a->n / 4 + REDUCE_THREADS - 1) / REDUCE_THREADS);
        wg_reduce_kernel<<<rgrid, REDUCE_THREADS, 0, s>>>(p, splits);
        rc = cudaGetLastError();
    }
    if (rc != cudaSuccess) {
        snprintf(err, EPD_ERR_LEN,
                 "ffn wgmma kernel: launch (%u x %u x %u items, row tile %u, %u bytes of shared "
                 "memory%s): %s",
                 a->n / BM, a->n_tiles, splits, a->row_tile, smem,
                 pair ? ", CTAs in pairs" : "", cudaGetErrorString(rc));
        return EPD_ERR_CUDA;
    }
    if (a->split_used_p != NULL) *a->split_used_p = splits;
    if (a->swiglu_done_p != NULL) *a->swiglu_done_p = fuse;
    if (a->pair_used_p != NULL) *a->pair_used_p = pair;
    return EPD_OK;
}
