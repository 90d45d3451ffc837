/* The ffn experts on a CUDA device (gpu/ffn_cuda.h). One experts call:
 *   count   rows per local expert (a record with expert e among its top-k is one row of e), read
 *           back to the host (the one wait of the call), rows padded to 32 per expert;
 *   scatter each (record, k) with a local expert gets its row, grouped by expert;
 *   gather  the rows' activations as each GEMM reads them (BF16, or e4m3 + 1x128 scales stored
 *           M-major, as cuBLASLt's VEC128_32F mode takes them), quantizing or requantizing as the
 *           host arithmetic of gpu/ffn.c does;
 *   GEMMs   per expert with rows: gate and up as one [2I, H] GEMM, fp32 out;
 *   swiglu  h = silu(g) * u in fp32, rounded to BF16 or quantized group128 (one kernel);
 *   GEMMs   per expert: down, fp32 out;
 *   combine the weighted sum over ascending k (section 2 step 6, multiply then add) into the
 *           partials: BF16, or FP8 group128 with fp32 scales (combine.dtype fp8, the bytes of
 *           epd_partial_store_host, gpu/partial_dev.cuh).
 * cuBLASLt is column-major: a GEMM computes D[M_pad x N] = A^T B with A the activations
 * ([M_pad][K] row-major, "transposed"), B the weights ([N][K] row-major, DeepSeek's [out, in]) and
 * D stored N-major ([N][M_pad]); the kernels after each GEMM read it in tiles through shared
 * memory so their reads stay coalesced. */
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "gpu/ops.h"
}
#include "gpu/ffn_cuda.h"
#include "gpu/fp8.h"
#include "gpu/partial_dev.cuh"

#define ROW_ALIGN 32                  /* an expert's rows are padded to this (tiles, alignment) */
#define WORKSPACE_BYTES (32u << 20)   /* cuBLASLt workspace, allocated once */
#define PLAN_CACHE 64                 /* GEMM plans kept per projection (by padded rows) */
#define GROUP 128
#define HOST_SLOTS 4                  /* experts calls whose host counts may be in flight */

enum { PROJ_GATE_UP = 0, PROJ_DOWN = 1, N_PROJ };

typedef struct dev_layer {
    uint32_t layer;
    void *gate_up;     /* [n_local][2I][H] */
    void *down;        /* [n_local][H][I] */
    float *gate_up_scale;
    float *down_scale;
    float *input_scale; /* [n_local][2] or NULL */
} dev_layer_t;

typedef struct gemm_plan {
    uint32_t m_pad;
    bool valid;
    cublasLtMatrixLayout_t a, d;
    cublasLtMatmulAlgo_t algo;
} gemm_plan_t;

struct epd_ffn_cuda {
    epd_ffn_format_t format;
    uint32_t hidden, inter, n_local, first, n_layers;
    dev_layer_t *layers;
    uint64_t weight_bytes;
    cudaStream_t stream;
    cublasLtHandle_t lt;
    void *workspace;
    cublasLtMatmulDesc_t desc[N_PROJ];
    cublasLtMatrixLayout_t wdesc[N_PROJ];
    cublasLtMatmulPreference_t pref;
    gemm_plan_t plans[N_PROJ][PLAN_CACHE];
    /* GEMM outputs in BF16: where cuBLASLt has no fp32-out GEMM of the format (the intermediate
     * is then rounded once more, inside section 9's tolerance) */
    bool d_bf16[N_PROJ];
    uint32_t next_plan[N_PROJ];

    /* per-call buffers, grown on demand */
    uint32_t cap_pairs, cap_rows;
    uint32_t *counts_dev;   /* [2 n_local]: rows, then the scatter's cursors */
    uint32_t *row_base_dev; /* [n_local + 1] */
    /* pinned slots, used in turn: [n_local] rows per expert, [n_local + 1] row bases, copied to
     * the device by the call that filled them; a slot is refilled once its copy has run */
    uint32_t *host;         /* [HOST_SLOTS][2 n_local + 1] */
    cudaEvent_t host_done[HOST_SLOTS];
    uint32_t next_slot;
    int32_t *pair_row;      /* [cap_pairs] */
    int32_t *row_src;       /* [cap_rows] */
    void *act;              /* [cap_rows][H] bf16 or e4m3 */
    float *act_scale;       /* [cap_rows * H / 128] */
    void *gu;               /* [cap_rows * 2I] fp32 (or bf16, d_bf16) */
    void *h;                /* [cap_rows][I] bf16 or e4m3 */
    float *h_scale;         /* [cap_rows * I / 128] */
    void *y_t;              /* [cap_rows * H] fp32 (or bf16), N-major per expert */
    float *y;               /* [cap_rows][H] */
};

/* ---- errors ------------------------------------------------------------------------------ */

#define CU(call, what)                                                                   \
    do {                                                                                 \
        cudaError_t rc_ = (call);                                                        \
        if (rc_ != cudaSuccess) {                                                        \
            snprintf(err, EPD_ERR_LEN, "ffn experts: %s: %s", (what), cudaGetErrorString(rc_)); \
            return EPD_ERR_CUDA;                                                         \
        }                                                                                \
    } while (0)

#define LT(call, what)                                                                   \
    do {                                                                                 \
        cublasStatus_t st_ = (call);                                                     \
        if (st_ != CUBLAS_STATUS_SUCCESS) {                                              \
            snprintf(err, EPD_ERR_LEN, "ffn experts: %s: cuBLAS status %d", (what), (int)st_); \
            return EPD_ERR_CUDA;                                                         \
        }                                                                                \
    } while (0)

/* ---- device helpers ---------------------------------------------------------------------- */

/* The local expert whose padded rows hold row r: row_base ascending, [n_local + 1]. */
__device__ static __forceinline__ uint32_t expert_of(const uint32_t *row_base, uint32_t n_local,
                                                     uint32_t r)
{
    uint32_t lo = 0, hi = n_local; /* row_base[lo] <= r < row_base[hi] */
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        if (row_base[mid] <= r)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* element i of a GEMM output, fp32 or bf16 */
__device__ static __forceinline__ float load_d(const void *d, size_t i, bool bf16)
{
    return bf16 ? epd_bf16_to_f32(((const uint16_t *)d)[i]) : ((const float *)d)[i];
}

/* max over the 128 threads of a block (4 warps) */
__device__ static float block_max128(float v, float *sh)
{
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    float m = fmaxf(fmaxf(sh[0], sh[1]), fmaxf(sh[2], sh[3]));
    __syncthreads();
    return m;
}

/* ---- kernels ----------------------------------------------------------------------------- */

struct rec_args {
    const uint8_t *recv;
    uint32_t n_records, rec_size, rec_ids, rec_weights, rec_scales, k_count;
    int32_t lo; /* this rank's first expert */
    uint32_t n_local;
};

__global__ void count_kernel(rec_args a, uint32_t *counts)
{
    uint64_t p = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= (uint64_t)a.n_records * a.k_count) return;
    uint32_t j = (uint32_t)(p / a.k_count), k = (uint32_t)(p % a.k_count);
    int32_t e = ((const int32_t *)(a.recv + (size_t)j * a.rec_size + a.rec_ids))[k];
    if (e >= a.lo && e < a.lo + (int32_t)a.n_local) atomicAdd(&counts[e - a.lo], 1u);
}

__global__ void scatter_kernel(rec_args a, const uint32_t *row_base, const uint32_t *rows,
                               uint32_t *cursor, int32_t *pair_row, int32_t *row_src)
{
    uint64_t p = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= (uint64_t)a.n_records * a.k_count) return;
    uint32_t j = (uint32_t)(p / a.k_count), k = (uint32_t)(p % a.k_count);
    int32_t e = ((const int32_t *)(a.recv + (size_t)j * a.rec_size + a.rec_ids))[k];
    if (e < a.lo || e >= a.lo + (int32_t)a.n_local) {
        pair_row[p] = -1;
        return;
    }
    uint32_t le = (uint32_t)(e - a.lo);
    uint32_t c = atomicAdd(&cursor[le], 1u);
    if (c >= rows[le]) {
        /* counts that disagree with the records (a caller's bug): never write past the rows */
        pair_row[p] = -1;
        return;
    }
    uint32_t pos = row_base[le] + c;
    pair_row[p] = (int32_t)pos;
    row_src[pos] = (int32_t)j;
}

struct gather_args {
    rec_args r;
    const int32_t *row_src;
    const uint32_t *row_base;
    uint32_t hidden;
    bool wire_fp8, per_token, weights_fp8;
    const float *input_scale; /* [n_local][2] or NULL */
    uint16_t *act_bf16;
    uint8_t *act_q;
    float *act_scale;
};

/* One block per (row, group of 128): the row's activation as its GEMM reads it. */
__global__ void __launch_bounds__(GROUP) gather_kernel(gather_args a)
{
    __shared__ float sh[4];
    uint32_t r = blockIdx.x, g = blockIdx.y, i = g * GROUP + threadIdx.x;
    uint32_t e = expert_of(a.row_base, a.r.n_local, r);
    uint32_t m = r - a.row_base[e], mpad = a.row_base[e + 1] - a.row_base[e];
    int32_t j = a.row_src[r];
    float v = 0.0f, s = 1.0f;
    uint8_t q = 0;

    if (j >= 0) {
        const uint8_t *rec = a.r.recv + (size_t)j * a.r.rec_size;
        if (a.wire_fp8) {
            const float *sc = (const float *)(rec + a.r.rec_scales);
            q = rec[i];
            s = a.per_token ? sc[0] : sc[g];
            v = __fmul_rn(epd_e4m3_to_f32(q), s);
        } else {
            v = epd_bf16_to_f32(((const uint16_t *)rec)[i]);
        }
    }
    if (!a.weights_fp8) {
        a.act_bf16[(size_t)r * a.hidden + i] = epd_f32_to_bf16(v);
        return;
    }
    if (!a.wire_fp8 || j < 0) {
        /* group128 with fp32 scales, as dispatch quantizes (gpu/ffn.c does the same) */
        float amax = block_max128(fabsf(v), sh);
        float mult;
        epd_quant_scale(amax, 0, &s, &mult);
        q = epd_e4m3_from_f32(__fmul_rn(v, mult));
    }
    if (a.input_scale != NULL) {
        float S = a.input_scale[2 * e];
        float back = __fmul_rn(epd_e4m3_to_f32(q), s);
        q = epd_e4m3_from_f32(__fmul_rn(back, __fdiv_rn(1.0f, S)));
        s = S;
    }
    a.act_q[(size_t)r * a.hidden + i] = q;
    if (threadIdx.x == 0)
        a.act_scale[(size_t)a.row_base[e] * (a.hidden / GROUP) + (size_t)g * mpad + m] = s;
}

struct swiglu_args {
    const void *gu; /* per expert [2I][mpad] at row_base[e] * 2I */
    bool gu_bf16;
    const uint32_t *row_base;
    uint32_t n_local, inter;
    bool fp8;
    const float *input_scale;
    uint16_t *h_bf16;
    uint8_t *h_q;
    float *h_scale;
};

#define TILE_ROWS 32
/* One block per (32 rows of one expert, group of 128 of I): g and u read in coalesced tiles
 * through shared memory, then each warp finishes 8 rows (each lane 4 elements of a row). */
__global__ void __launch_bounds__(GROUP) swiglu_kernel(swiglu_args a)
{
    __shared__ float tg[GROUP][TILE_ROWS + 1], tu[GROUP][TILE_ROWS + 1];
    uint32_t r0 = blockIdx.x * TILE_ROWS, g0 = blockIdx.y * GROUP;
    uint32_t e = expert_of(a.row_base, a.n_local, r0);
    uint32_t m0 = r0 - a.row_base[e], mpad = a.row_base[e + 1] - a.row_base[e];
    size_t base = (size_t)a.row_base[e] * 2 * a.inter;

    for (uint32_t idx = threadIdx.x; idx < GROUP * TILE_ROWS; idx += GROUP) {
        uint32_t ii = idx / TILE_ROWS, mm = idx % TILE_ROWS;
        tg[ii][mm] = load_d(a.gu, base + (size_t)(g0 + ii) * mpad + m0 + mm, a.gu_bf16);
        tu[ii][mm] = load_d(a.gu, base + (size_t)(a.inter + g0 + ii) * mpad + m0 + mm, a.gu_bf16);
    }
    __syncthreads();
    uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (uint32_t w = 0; w < TILE_ROWS / 4; w++) {
        uint32_t mm = warp * (TILE_ROWS / 4) + w;
        uint32_t r = r0 + mm;
        float h[4], amax = 0.0f;
        for (int c = 0; c < 4; c++) {
            uint32_t ii = lane + 32 * c;
            float gv = tg[ii][mm], uv = tu[ii][mm];
            float silu = __fdiv_rn(gv, __fadd_rn(1.0f, expf(-gv)));
            h[c] = __fmul_rn(silu, uv);
            amax = fmaxf(amax, fabsf(h[c]));
        }
        if (!a.fp8) {
            for (int c = 0; c < 4; c++)
                a.h_bf16[(size_t)r * a.inter + g0 + lane + 32 * c] = epd_f32_to_bf16(h[c]);
            continue;
        }
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        float s, mult;
        epd_quant_scale(amax, 0, &s, &mult);
        float S = a.input_scale != NULL ? a.input_scale[2 * e + 1] : 0.0f;
        for (int c = 0; c < 4; c++) {
            uint8_t q = epd_e4m3_from_f32(__fmul_rn(h[c], mult));
            if (a.input_scale != NULL)
                q = epd_e4m3_from_f32(
                    __fmul_rn(__fmul_rn(epd_e4m3_to_f32(q), s), __fdiv_rn(1.0f, S)));
            a.h_q[(size_t)r * a.inter + g0 + lane + 32 * c] = q;
        }
        if (lane == 0)
            a.h_scale[(size_t)a.row_base[e] * (a.inter / GROUP) + (size_t)(g0 / GROUP) * mpad +
                      m0 + mm] = a.input_scale != NULL ? S : s;
    }
}

/* y_t (per expert [H][mpad]) -> y [rows][H], 32 x 32 tiles. */
__global__ void transpose_kernel(const void *y_t, bool y_bf16, const uint32_t *row_base,
                                 uint32_t n_local, uint32_t hidden, float *y)
{
    __shared__ float t[32][33];
    uint32_t r0 = blockIdx.x * 32, h0 = blockIdx.y * 32;
    uint32_t e = expert_of(row_base, n_local, r0);
    uint32_t m0 = r0 - row_base[e], mpad = row_base[e + 1] - row_base[e];
    size_t base = (size_t)row_base[e] * hidden;
    for (uint32_t yy = threadIdx.y; yy < 32; yy += blockDim.y)
        t[yy][threadIdx.x] =
            load_d(y_t, base + (size_t)(h0 + yy) * mpad + m0 + threadIdx.x, y_bf16);
    __syncthreads();
    for (uint32_t yy = threadIdx.y; yy < 32; yy += blockDim.y)
        y[(size_t)(r0 + yy) * hidden + h0 + threadIdx.x] = t[threadIdx.x][yy];
}

/* partial[j][i] = bf16(sum over ascending k with a local expert of w_k * y[row(j, k)][i]) */
__global__ void combine_kernel(rec_args a, const int32_t *pair_row, const float *y,
                               uint32_t hidden, uint16_t *partials)
{
    uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (uint64_t)a.n_records * hidden) return;
    uint32_t j = (uint32_t)(t / hidden), i = (uint32_t)(t % hidden);
    const float *w = (const float *)(a.recv + (size_t)j * a.rec_size + a.rec_weights);
    float acc = 0.0f;
    for (uint32_t k = 0; k < a.k_count; k++) {
        int32_t pos = pair_row[(size_t)j * a.k_count + k];
        if (pos < 0) continue;
        acc = __fadd_rn(acc, __fmul_rn(w[k], y[(size_t)pos * hidden + i]));
    }
    partials[t] = epd_f32_to_bf16(acc);
}

/* The same sums stored as FP8 partials (part_size bytes each, epd_partial_layout): one thread
 * per 16 elements, so that a group of 128 is 8 consecutive lanes of one record (H/16 is a
 * multiple of 8, blocks are whole warps); every lane reaches the shuffles of the store, active
 * or not. pair_row NULL: no record has a row here (all sums 0). With qe, the partials' error is
 * added to the telemetry sums 2 and 3 (gpu/partial_dev.cuh). */
__global__ void combine_fp8_kernel(rec_args a, const int32_t *pair_row, const float *y,
                                   uint32_t hidden, uint8_t *partials, uint32_t part_size,
                                   double *qe)
{
    const uint32_t h16 = hidden / 16;
    const uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const bool active = t < (uint64_t)a.n_records * h16;
    const uint32_t j = active ? (uint32_t)(t / h16) : 0, c = active ? (uint32_t)(t % h16) : 0;
    float acc[16], e2 = 0.0f, r2 = 0.0f;
#pragma unroll
    for (int v = 0; v < 16; v++) acc[v] = 0.0f;
    if (active && pair_row != NULL) {
        const float *w = (const float *)(a.recv + (size_t)j * a.rec_size + a.rec_weights);
        for (uint32_t k = 0; k < a.k_count; k++) {
            int32_t pos = pair_row[(size_t)j * a.k_count + k];
            if (pos < 0) continue;
            const float *yr = y + (size_t)pos * hidden + (size_t)c * 16;
#pragma unroll
            for (int v = 0; v < 16; v++) acc[v] = __fadd_rn(acc[v], __fmul_rn(w[k], yr[v]));
        }
    }
    epd_dev_store_fp8_partial16(partials + (size_t)j * part_size, hidden, part_size, active, c,
                                acc, qe != NULL, &e2, &r2);
    if (qe != NULL) epd_dev_qe_block_add(qe, 2, e2, r2);
}

/* ---- cuBLASLt ---------------------------------------------------------------------------- */

static void proj_dims(const epd_ffn_cuda_t *f, int proj, uint32_t *n_p, uint32_t *k_p)
{
    *n_p = proj == PROJ_GATE_UP ? 2 * f->inter : f->hidden;
    *k_p = proj == PROJ_GATE_UP ? f->hidden : f->inter;
}

/* The plan (layouts and algorithm) of a projection at m_pad rows, from the cache or made. */
static epd_status_t get_plan(epd_ffn_cuda_t *f, int proj, uint32_t m_pad, gemm_plan_t **plan_p,
                             char err[EPD_ERR_LEN])
{
    bool fp8 = f->format == EPD_FFN_FP8_BLOCK;
    uint32_t n, k;
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;

    for (uint32_t i = 0; i < PLAN_CACHE; i++) {
        if (f->plans[proj][i].valid && f->plans[proj][i].m_pad == m_pad) {
            *plan_p = &f->plans[proj][i];
            return EPD_OK;
        }
    }
    gemm_plan_t *p = &f->plans[proj][f->next_plan[proj]++ % PLAN_CACHE];
    if (p->valid) {
        cublasLtMatrixLayoutDestroy(p->a);
        cublasLtMatrixLayoutDestroy(p->d);
        p->valid = false;
    }
    proj_dims(f, proj, &n, &k);
    LT(cublasLtMatrixLayoutCreate(&p->a, fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF, k, m_pad, k),
       "activation layout");
    LT(cublasLtMatrixLayoutCreate(&p->d, f->d_bf16[proj] ? CUDA_R_16BF : CUDA_R_32F, m_pad, n,
                                  m_pad), "output layout");
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(f->lt, f->desc[proj], p->a, f->wdesc[proj],
                                                       p->d, p->d, f->pref, 1, &result, &found);
    if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED) {
        cublasLtMatrixLayoutDestroy(p->a);
        cublasLtMatrixLayoutDestroy(p->d);
        snprintf(err, EPD_ERR_LEN, "ffn experts: cublasLtMatmulAlgoGetHeuristic: cuBLAS status %d",
                 (int)st);
        return EPD_ERR_CUDA;
    }
    if (st == CUBLAS_STATUS_NOT_SUPPORTED || found == 0) {
        cublasLtMatrixLayoutDestroy(p->a);
        cublasLtMatrixLayoutDestroy(p->d);
        snprintf(err, EPD_ERR_LEN,
                 "ffn experts: cuBLASLt has no %s GEMM (%s out) for M %u, N %u, K %u on this "
                 "device",
                 fp8 ? "FP8 block-scaled" : "BF16", f->d_bf16[proj] ? "BF16" : "fp32", m_pad, n, k);
        return EPD_ERR_UNSUPPORTED;
    }
    p->algo = result.algo;
    p->m_pad = m_pad;
    p->valid = true;
    *plan_p = p;
    return EPD_OK;
}

/* D (fp32, [N][m_pad]) = act rows [row0, row0 + m_pad) of expert e times its weights. */
static epd_status_t gemm(epd_ffn_cuda_t *f, int proj, const dev_layer_t *l, uint32_t e,
                         uint32_t row0, uint32_t m_pad, const void *act, const float *act_scale,
                         void *d, char err[EPD_ERR_LEN])
{
    bool fp8 = f->format == EPD_FFN_FP8_BLOCK;
    size_t es = fp8 ? 1 : 2;
    uint32_t n, k;
    gemm_plan_t *plan;
    epd_status_t status;
    const float one = 1.0f, zero = 0.0f;

    proj_dims(f, proj, &n, &k);
    status = get_plan(f, proj, m_pad, &plan, err);
    if (status != EPD_OK) return status;
    const uint8_t *w = (const uint8_t *)(proj == PROJ_GATE_UP ? l->gate_up : l->down) +
                       (size_t)e * n * k * es;
    const uint8_t *a = (const uint8_t *)act + (size_t)row0 * k * es;
    void *out = (uint8_t *)d + (size_t)row0 * n * (f->d_bf16[proj] ? 2 : 4);
    if (fp8) {
        const float *as = act_scale + (size_t)row0 * (k / GROUP);
        const float *ws = (proj == PROJ_GATE_UP ? l->gate_up_scale : l->down_scale) +
                          (size_t)e * (n / GROUP) * (k / GROUP);
        LT(cublasLtMatmulDescSetAttribute(f->desc[proj], CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &as,
                                          sizeof as), "A scale pointer");
        LT(cublasLtMatmulDescSetAttribute(f->desc[proj], CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &ws,
                                          sizeof ws), "B scale pointer");
    }
    LT(cublasLtMatmul(f->lt, f->desc[proj], &one, a, plan->a, w, f->wdesc[proj], &zero, out,
                      plan->d, out, plan->d, &plan->algo, f->workspace, WORKSPACE_BYTES,
                      f->stream),
       "cublasLtMatmul");
    return EPD_OK;
}

/* ---- create / destroy -------------------------------------------------------------------- */

static void *dalloc(size_t bytes)
{
    void *p = NULL;
    return cudaMalloc(&p, bytes == 0 ? 16 : bytes) == cudaSuccess ? p : NULL;
}

extern "C" void epd_ffn_cuda_destroy(epd_ffn_cuda_t *f)
{
    if (f == NULL) return;
    cudaStreamSynchronize(f->stream);
    for (uint32_t i = 0; f->layers != NULL && i < f->n_layers; i++) {
        cudaFree(f->layers[i].gate_up);
        cudaFree(f->layers[i].down);
        cudaFree(f->layers[i].gate_up_scale);
        cudaFree(f->layers[i].down_scale);
        cudaFree(f->layers[i].input_scale);
    }
    free(f->layers);
    for (int p = 0; p < N_PROJ; p++) {
        for (uint32_t i = 0; i < PLAN_CACHE; i++) {
            if (!f->plans[p][i].valid) continue;
            cublasLtMatrixLayoutDestroy(f->plans[p][i].a);
            cublasLtMatrixLayoutDestroy(f->plans[p][i].d);
        }
        if (f->desc[p] != NULL) cublasLtMatmulDescDestroy(f->desc[p]);
        if (f->wdesc[p] != NULL) cublasLtMatrixLayoutDestroy(f->wdesc[p]);
    }
    if (f->pref != NULL) cublasLtMatmulPreferenceDestroy(f->pref);
    if (f->lt != NULL) cublasLtDestroy(f->lt);
    void *bufs[] = {f->workspace, f->counts_dev, f->row_base_dev, f->pair_row, f->row_src, f->act,
                    f->act_scale, f->gu, f->h, f->h_scale, f->y_t, f->y};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cudaFree(bufs[i]);
    cudaFreeHost(f->host);
    for (int i = 0; i < HOST_SLOTS; i++)
        if (f->host_done[i] != NULL) cudaEventDestroy(f->host_done[i]);
    free(f);
}

static epd_status_t upload(void **dst, const void *src, size_t bytes, uint64_t *total,
                           char err[EPD_ERR_LEN])
{
    size_t free_b = 0, total_b = 0;
    *dst = dalloc(bytes);
    if (*dst == NULL) {
        cudaGetLastError();
        cudaMemGetInfo(&free_b, &total_b);
        snprintf(err, EPD_ERR_LEN,
                 "ffn experts: the device cannot hold the weights: %zu more bytes needed (%llu "
                 "copied so far), %zu free of %zu",
                 bytes, (unsigned long long)*total, free_b, total_b);
        return EPD_ERR_NO_MEMORY;
    }
    CU(cudaMemcpy(*dst, src, bytes, cudaMemcpyHostToDevice), "copying the weights");
    *total += bytes;
    return EPD_OK;
}

extern "C" epd_status_t epd_ffn_cuda_create(const epd_ffn_weights_t *w, void *stream,
                                            epd_ffn_cuda_t **ffn_p, char err[EPD_ERR_LEN])
{
    epd_ffn_cuda_t *f;
    epd_status_t status = EPD_OK;
    bool fp8 = w->format == EPD_FFN_FP8_BLOCK;
    size_t es = fp8 ? 1 : 2;

    *ffn_p = NULL;
    if (w->hidden % GROUP != 0 || w->intermediate % GROUP != 0) {
        snprintf(err, EPD_ERR_LEN, "ffn experts: H and I must be multiples of 128");
        return EPD_ERR_INVALID_ARG;
    }
    f = (epd_ffn_cuda_t *)calloc(1, sizeof *f);
    if (f == NULL) {
        snprintf(err, EPD_ERR_LEN, "ffn experts: out of memory");
        return EPD_ERR_NO_MEMORY;
    }
    f->format = w->format;
    f->hidden = w->hidden;
    f->inter = w->intermediate;
    f->n_local = w->n_local;
    f->first = w->first_expert;
    f->stream = (cudaStream_t)stream;
    f->layers = (dev_layer_t *)calloc(w->n_layers, sizeof *f->layers);
    if (f->layers == NULL) {
        free(f);
        snprintf(err, EPD_ERR_LEN, "ffn experts: out of memory");
        return EPD_ERR_NO_MEMORY;
    }
    f->n_layers = w->n_layers;
    size_t gu = (size_t)w->n_local * 2 * w->intermediate * w->hidden;
    size_t gus = gu / (GROUP * GROUP);
    for (uint32_t i = 0; i < w->n_layers && status == EPD_OK; i++) {
        const epd_ffn_layer_t *src = &w->layers[i];
        dev_layer_t *l = &f->layers[i];
        l->layer = src->layer;
        status = upload(&l->gate_up, src->gate_up, gu * es, &f->weight_bytes, err);
        if (status == EPD_OK)
            status = upload(&l->down, src->down, gu / 2 * es, &f->weight_bytes, err);
        if (status == EPD_OK && fp8)
            status = upload((void **)&l->gate_up_scale, src->gate_up_scale, gus * 4,
                            &f->weight_bytes, err);
        if (status == EPD_OK && fp8)
            status = upload((void **)&l->down_scale, src->down_scale, gus / 2 * 4,
                            &f->weight_bytes, err);
        if (status == EPD_OK && src->input_scale != NULL)
            status = upload((void **)&l->input_scale, src->input_scale,
                            (size_t)w->n_local * 2 * sizeof(float), &f->weight_bytes, err);
    }
    if (status != EPD_OK) goto fail;

    if (cublasLtCreate(&f->lt) != CUBLAS_STATUS_SUCCESS) {
        snprintf(err, EPD_ERR_LEN, "ffn experts: cublasLtCreate failed");
        status = EPD_ERR_CUDA;
        goto fail;
    }
    f->workspace = dalloc(WORKSPACE_BYTES);
    f->counts_dev = (uint32_t *)dalloc(2 * (size_t)w->n_local * sizeof(uint32_t));
    f->row_base_dev = (uint32_t *)dalloc(((size_t)w->n_local + 1) * sizeof(uint32_t));
    if (f->workspace == NULL || f->counts_dev == NULL || f->row_base_dev == NULL ||
        cudaMallocHost((void **)&f->host,
                       HOST_SLOTS * (2 * (size_t)w->n_local + 1) * sizeof(uint32_t)) !=
            cudaSuccess) {
        cudaGetLastError();
        snprintf(err, EPD_ERR_LEN, "ffn experts: cannot allocate the %u-byte workspace",
                 WORKSPACE_BYTES);
        status = EPD_ERR_NO_MEMORY;
        goto fail;
    }
    {
        cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
        uint64_t ws = WORKSPACE_BYTES;
        if (cublasLtMatmulPreferenceCreate(&f->pref) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulPreferenceSetAttribute(f->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                 &ws, sizeof ws) != CUBLAS_STATUS_SUCCESS) {
            snprintf(err, EPD_ERR_LEN, "ffn experts: cuBLASLt preference");
            status = EPD_ERR_CUDA;
            goto fail;
        }
        for (int p = 0; p < N_PROJ; p++) {
            uint32_t n, k;
            proj_dims(f, p, &n, &k);
            bool ok = cublasLtMatmulDescCreate(&f->desc[p], CUBLAS_COMPUTE_32F, CUDA_R_32F) ==
                          CUBLAS_STATUS_SUCCESS &&
                      cublasLtMatmulDescSetAttribute(f->desc[p], CUBLASLT_MATMUL_DESC_TRANSA, &ta,
                                                     sizeof ta) == CUBLAS_STATUS_SUCCESS &&
                      cublasLtMatmulDescSetAttribute(f->desc[p], CUBLASLT_MATMUL_DESC_TRANSB, &tb,
                                                     sizeof tb) == CUBLAS_STATUS_SUCCESS &&
                      cublasLtMatrixLayoutCreate(&f->wdesc[p], fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF,
                                                 k, n, k) == CUBLAS_STATUS_SUCCESS;
            if (ok && fp8) {
                cublasLtMatmulMatrixScale_t am = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
                cublasLtMatmulMatrixScale_t bm = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
                /* The heuristic refuses block scale modes (status 7, invalid value) until the
                 * scale pointers are set (seen on an H200, cuBLASLt 13.1): any device pointer
                 * here; each GEMM sets the real ones before it runs. */
                void *placeholder = f->workspace;
                ok = cublasLtMatmulDescSetAttribute(f->desc[p], CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                                    &am, sizeof am) == CUBLAS_STATUS_SUCCESS &&
                     cublasLtMatmulDescSetAttribute(f->desc[p], CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                                                    &bm, sizeof bm) == CUBLAS_STATUS_SUCCESS &&
                     cublasLtMatmulDescSetAttribute(f->desc[p],
                                                    CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                    &placeholder, sizeof placeholder) ==
                         CUBLAS_STATUS_SUCCESS &&
                     cublasLtMatmulDescSetAttribute(f->desc[p],
                                                    CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                    &placeholder, sizeof placeholder) ==
                         CUBLAS_STATUS_SUCCESS;
            }
            if (!ok) {
                snprintf(err, EPD_ERR_LEN, "ffn experts: cuBLASLt descriptors");
                status = EPD_ERR_CUDA;
                goto fail;
            }
            /* a GEMM this device cannot run is a start-up error, not a step's; fp32 out first */
            gemm_plan_t *plan;
            status = get_plan(f, p, ROW_ALIGN, &plan, err);
            if (status == EPD_ERR_UNSUPPORTED) {
                f->d_bf16[p] = true;
                status = get_plan(f, p, ROW_ALIGN, &plan, err);
            }
            if (status != EPD_OK) goto fail;
        }
    }
    *ffn_p = f;
    return EPD_OK;
fail:
    epd_ffn_cuda_destroy(f);
    return status;
}

extern "C" uint64_t epd_ffn_cuda_weight_bytes(const epd_ffn_cuda_t *f)
{
    return f->weight_bytes;
}

/* Grows the per-call buffers to pairs and rows. */
static epd_status_t reserve(epd_ffn_cuda_t *f, uint32_t pairs, uint32_t rows, char err[EPD_ERR_LEN])
{
    size_t H = f->hidden, I = f->inter, es = f->format == EPD_FFN_FP8_BLOCK ? 1 : 2;

    if (pairs > f->cap_pairs) {
        cudaFree(f->pair_row);
        f->pair_row = (int32_t *)dalloc((size_t)pairs * sizeof(int32_t));
        f->cap_pairs = f->pair_row != NULL ? pairs : 0;
        if (f->pair_row == NULL) goto no_memory;
    }
    if (rows > f->cap_rows) {
        void **bufs[] = {(void **)&f->row_src, &f->act, (void **)&f->act_scale, (void **)&f->gu,
                         &f->h, (void **)&f->h_scale, (void **)&f->y_t, (void **)&f->y};
        size_t sizes[] = {rows * sizeof(int32_t), rows * H * es, rows * H / GROUP * 4,
                          rows * 2 * I * 4,        rows * I * es, rows * I / GROUP * 4,
                          rows * H * 4,            rows * H * 4};
        cudaStreamSynchronize(f->stream);
        f->cap_rows = 0;
        for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
            cudaFree(*bufs[i]);
            *bufs[i] = dalloc(sizes[i]);
        }
        for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
            if (*bufs[i] == NULL) goto no_memory;
        f->cap_rows = rows;
    }
    return EPD_OK;
no_memory:
    cudaGetLastError();
    snprintf(err, EPD_ERR_LEN, "ffn experts: out of device memory for %u rows (%u pairs)", rows,
             pairs);
    return EPD_ERR_NO_MEMORY;
}

static uint32_t blocks_for(uint64_t threads, uint32_t per_block)
{
    return (uint32_t)((threads + per_block - 1) / per_block);
}

/* The partials of one call, on the stream: BF16 (combine_kernel; no row here: zeros, the BF16
 * of a zero sum), or with combine.dtype fp8 the FP8 partials of epd_partial_layout
 * (combine_fp8_kernel, the host's bytes whether or not a row is here). pair_row NULL: no record
 * has a row here. */
static epd_status_t queue_partials(epd_ffn_cuda_t *f, const epd_moe_shape_t *shape,
                                   const rec_args &ra, const int32_t *pair_row, void *partials,
                                   double *qe, char err[EPD_ERR_LEN])
{
    if (shape->combine_dtype == EPD_COMBINE_FP8) {
        epd_partial_layout_t pl;
        epd_partial_layout(shape, &pl);
        combine_fp8_kernel<<<blocks_for((uint64_t)ra.n_records * (f->hidden / 16), 256), 256, 0,
                             f->stream>>>(ra, pair_row, f->y, f->hidden, (uint8_t *)partials,
                                          (uint32_t)pl.size, qe);
        CU(cudaGetLastError(), "combine kernel (FP8 partials)");
        return EPD_OK;
    }
    if (pair_row == NULL) {
        CU(cudaMemsetAsync(partials, 0, (size_t)ra.n_records * f->hidden * 2, f->stream),
           "cudaMemsetAsync");
        return EPD_OK;
    }
    combine_kernel<<<blocks_for((uint64_t)ra.n_records * f->hidden, 256), 256, 0, f->stream>>>(
        ra, pair_row, f->y, f->hidden, (uint16_t *)partials);
    CU(cudaGetLastError(), "combine kernel");
    return EPD_OK;
}

extern "C" epd_status_t epd_ffn_cuda_experts(epd_ffn_cuda_t *f, const epd_moe_shape_t *shape,
                                             uint32_t layer, const void *recv_buf,
                                             uint32_t n_records, const uint32_t *expert_rows_host,
                                             void *partials, double *qe, char err[EPD_ERR_LEN])
{
    const dev_layer_t *l = NULL;
    epd_record_layout_t rec;
    rec_args ra;
    uint32_t per_rank = shape->num_experts / shape->world;
    bool fp8 = f->format == EPD_FFN_FP8_BLOCK;
    epd_status_t status;

    for (uint32_t i = 0; i < f->n_layers; i++)
        if (f->layers[i].layer == layer) l = &f->layers[i];
    if (l == NULL) {
        snprintf(err, EPD_ERR_LEN, "ffn experts: layer %u was not loaded", layer);
        return EPD_ERR_INVALID_ARG;
    }
    if (shape->hidden != f->hidden || shape->rank * per_rank < f->first ||
        (shape->rank + 1) * per_rank > f->first + f->n_local) {
        snprintf(err, EPD_ERR_LEN, "ffn experts: the weights do not fit rank %u's shape",
                 shape->rank);
        return EPD_ERR_INVALID_ARG;
    }
    if (n_records == 0) return EPD_OK;
    epd_record_layout(shape, &rec);
    ra.recv = (const uint8_t *)recv_buf;
    ra.n_records = n_records;
    ra.rec_size = (uint32_t)rec.size;
    ra.rec_ids = (uint32_t)rec.ids;
    ra.rec_weights = (uint32_t)rec.weights;
    ra.rec_scales = (uint32_t)rec.scales;
    ra.k_count = shape->topk;
    ra.lo = (int32_t)f->first;
    ra.n_local = f->n_local;
    uint64_t pairs = (uint64_t)n_records * shape->topk;
    if (pairs > UINT32_MAX / 2) {
        snprintf(err, EPD_ERR_LEN, "ffn experts: %u records are too many", n_records);
        return EPD_ERR_INVALID_ARG;
    }

    /* rows per expert: from the count exchange when the caller has them (and the weights are
     * exactly this rank's experts), else counted here and read back (a wait) */
    uint32_t slot = f->next_slot++ % HOST_SLOTS;
    uint32_t *counts = f->host + (size_t)slot * (2 * (size_t)f->n_local + 1);
    uint32_t *row_base = counts + f->n_local, total = 0;
    if (f->host_done[slot] == NULL)
        CU(cudaEventCreateWithFlags(&f->host_done[slot], cudaEventDisableTiming),
           "cudaEventCreate");
    CU(cudaEventSynchronize(f->host_done[slot]), "waiting for a host slot");
    CU(cudaMemsetAsync(f->counts_dev, 0, 2 * (size_t)f->n_local * sizeof(uint32_t), f->stream),
       "cudaMemsetAsync");
    if (expert_rows_host != NULL && f->n_local == per_rank && f->first == shape->rank * per_rank) {
        memcpy(counts, expert_rows_host, (size_t)f->n_local * sizeof(uint32_t));
        CU(cudaMemcpyAsync(f->counts_dev, counts, (size_t)f->n_local * sizeof(uint32_t),
                           cudaMemcpyHostToDevice, f->stream), "copying the row counts");
    } else {
        count_kernel<<<blocks_for(pairs, 256), 256, 0, f->stream>>>(ra, f->counts_dev);
        CU(cudaGetLastError(), "count kernel");
        CU(cudaMemcpyAsync(counts, f->counts_dev, (size_t)f->n_local * sizeof(uint32_t),
                           cudaMemcpyDeviceToHost, f->stream), "reading the row counts");
        CU(cudaStreamSynchronize(f->stream), "waiting for the row counts");
    }
    for (uint32_t e = 0; e < f->n_local; e++) {
        row_base[e] = total;
        total += (counts[e] + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN;
    }
    row_base[f->n_local] = total;
    if (total == 0) return queue_partials(f, shape, ra, NULL, partials, qe, err);
    status = reserve(f, (uint32_t)pairs, total, err);
    if (status != EPD_OK) return status;
    CU(cudaMemcpyAsync(f->row_base_dev, row_base, ((size_t)f->n_local + 1) * sizeof(uint32_t),
                       cudaMemcpyHostToDevice, f->stream), "cudaMemcpyAsync");
    CU(cudaEventRecord(f->host_done[slot], f->stream), "cudaEventRecord");
    CU(cudaMemsetAsync(f->row_src, 0xff, (size_t)total * sizeof(int32_t), f->stream),
       "cudaMemsetAsync");
    scatter_kernel<<<blocks_for(pairs, 256), 256, 0, f->stream>>>(
        ra, f->row_base_dev, f->counts_dev, f->counts_dev + f->n_local, f->pair_row, f->row_src);
    CU(cudaGetLastError(), "scatter kernel");

    gather_args ga;
    ga.r = ra;
    ga.row_src = f->row_src;
    ga.row_base = f->row_base_dev;
    ga.hidden = f->hidden;
    ga.wire_fp8 = shape->dtype == EPD_WIRE_FP8;
    ga.per_token = shape->scale == EPD_SCALE_PER_TOKEN;
    ga.weights_fp8 = fp8;
    ga.input_scale = l->input_scale;
    ga.act_bf16 = (uint16_t *)f->act;
    ga.act_q = (uint8_t *)f->act;
    ga.act_scale = f->act_scale;
    gather_kernel<<<dim3(total, f->hidden / GROUP), GROUP, 0, f->stream>>>(ga);
    CU(cudaGetLastError(), "gather kernel");

    for (uint32_t e = 0; e < f->n_local; e++) {
        uint32_t m_pad = row_base[e + 1] - row_base[e];
        if (m_pad == 0) continue;
        status = gemm(f, PROJ_GATE_UP, l, e, row_base[e], m_pad, f->act, f->act_scale, f->gu, err);
        if (status != EPD_OK) return status;
    }
    swiglu_args sa;
    sa.gu = f->gu;
    sa.gu_bf16 = f->d_bf16[PROJ_GATE_UP];
    sa.row_base = f->row_base_dev;
    sa.n_local = f->n_local;
    sa.inter = f->inter;
    sa.fp8 = fp8;
    sa.input_scale = l->input_scale;
    sa.h_bf16 = (uint16_t *)f->h;
    sa.h_q = (uint8_t *)f->h;
    sa.h_scale = f->h_scale;
    swiglu_kernel<<<dim3(total / TILE_ROWS, f->inter / GROUP), GROUP, 0, f->stream>>>(sa);
    CU(cudaGetLastError(), "swiglu kernel");
    for (uint32_t e = 0; e < f->n_local; e++) {
        uint32_t m_pad = row_base[e + 1] - row_base[e];
        if (m_pad == 0) continue;
        status = gemm(f, PROJ_DOWN, l, e, row_base[e], m_pad, f->h, f->h_scale, f->y_t, err);
        if (status != EPD_OK) return status;
    }
    transpose_kernel<<<dim3(total / 32, f->hidden / 32), dim3(32, 8), 0, f->stream>>>(
        f->y_t, f->d_bf16[PROJ_DOWN], f->row_base_dev, f->n_local, f->hidden, f->y);
    CU(cudaGetLastError(), "transpose kernel");
    return queue_partials(f, shape, ra, f->pair_row, partials, qe, err);
}

/* ---- benchmark baselines ----------------------------------------------------------------- */

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Times launch() iters times (after two warm-ups) with events on stream; median in *us_p. */
template <typename F>
static epd_status_t time_median(cudaStream_t stream, uint32_t iters, F launch, double *us_p,
                                char err[EPD_ERR_LEN])
{
    cudaEvent_t a, b;
    double *t = (double *)calloc(iters ? iters : 1, sizeof *t);
    if (t == NULL) {
        snprintf(err, EPD_ERR_LEN, "out of memory");
        return EPD_ERR_NO_MEMORY;
    }
    CU(cudaEventCreate(&a), "cudaEventCreate");
    CU(cudaEventCreate(&b), "cudaEventCreate");
    for (uint32_t i = 0; i < iters + 2; i++) {
        CU(cudaEventRecord(a, stream), "cudaEventRecord");
        epd_status_t st = launch();
        if (st != EPD_OK) {
            free(t);
            return st;
        }
        CU(cudaEventRecord(b, stream), "cudaEventRecord");
        CU(cudaEventSynchronize(b), "cudaEventSynchronize");
        float ms = 0;
        CU(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
        if (i >= 2) t[i - 2] = (double)ms * 1e3;
    }
    qsort(t, iters, sizeof *t, cmp_double);
    *us_p = t[iters / 2];
    free(t);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return EPD_OK;
}

extern "C" epd_status_t epd_ffn_cuda_bench_gemm(uint32_t m, uint32_t n, uint32_t k, uint32_t iters,
                                                double *us_p, char err[EPD_ERR_LEN])
{
    cudaStream_t stream;
    cublasLtHandle_t lt;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    void *a = NULL, *b = NULL, *d = NULL, *ws = NULL;
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    uint64_t ws_bytes = WORKSPACE_BYTES;
    const float one = 1.0f, zero = 0.0f;
    epd_status_t status;

    CU(cudaStreamCreate(&stream), "cudaStreamCreate");
    a = dalloc((size_t)m * k * 2);
    b = dalloc((size_t)n * k * 2);
    d = dalloc((size_t)m * n * 2);
    ws = dalloc(WORKSPACE_BYTES);
    if (a == NULL || b == NULL || d == NULL || ws == NULL) {
        cudaGetLastError();
        snprintf(err, EPD_ERR_LEN, "dense GEMM baseline: out of device memory");
        return EPD_ERR_NO_MEMORY;
    }
    CU(cudaMemset(a, 0x3c, (size_t)m * k * 2), "cudaMemset");
    CU(cudaMemset(b, 0x3c, (size_t)n * k * 2), "cudaMemset");
    LT(cublasLtCreate(&lt), "cublasLtCreate");
    LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), "transa");
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), "transb");
    LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, k, m, k), "layout");
    LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, n, k), "layout");
    LT(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, m, n, m), "layout");
    LT(cublasLtMatmulPreferenceCreate(&pref), "preference");
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                            &ws_bytes, sizeof ws_bytes), "preference");
    LT(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 1, &result, &found),
       "heuristic");
    if (found == 0) {
        snprintf(err, EPD_ERR_LEN, "dense GEMM baseline: no BF16 algorithm");
        return EPD_ERR_UNSUPPORTED;
    }
    status = time_median(
        stream, iters,
        [&]() -> epd_status_t {
            return cublasLtMatmul(lt, desc, &one, a, la, b, lb, &zero, d, ld, d, ld, &result.algo,
                                  ws, WORKSPACE_BYTES, stream) == CUBLAS_STATUS_SUCCESS
                       ? EPD_OK
                       : EPD_ERR_CUDA;
        },
        us_p, err);
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
    cublasLtDestroy(lt);
    cudaFree(a);
    cudaFree(b);
    cudaFree(d);
    cudaFree(ws);
    cudaStreamDestroy(stream);
    if (status == EPD_ERR_CUDA && err[0] == '\0')
        snprintf(err, EPD_ERR_LEN, "dense GEMM baseline: cublasLtMatmul failed");
    return status;
}

__global__ void read_kernel(const uint4 *p, size_t n, unsigned *sink)
{
    unsigned acc = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = p[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) *sink = acc; /* practically never: keeps the loads */
}

extern "C" epd_status_t epd_ffn_cuda_bench_read(uint64_t bytes, uint32_t iters, double *us_p,
                                                char err[EPD_ERR_LEN])
{
    cudaStream_t stream;
    int dev = 0, sms = 0;
    void *buf;
    unsigned *sink;
    epd_status_t status;
    size_t n = (size_t)(bytes / 16);

    CU(cudaGetDevice(&dev), "cudaGetDevice");
    CU(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "SM count");
    CU(cudaStreamCreate(&stream), "cudaStreamCreate");
    buf = dalloc(n * 16);
    sink = (unsigned *)dalloc(sizeof *sink);
    if (buf == NULL || sink == NULL) {
        cudaGetLastError();
        snprintf(err, EPD_ERR_LEN, "read baseline: out of device memory for %llu bytes",
                 (unsigned long long)bytes);
        return EPD_ERR_NO_MEMORY;
    }
    CU(cudaMemset(buf, 1, n * 16), "cudaMemset");
    /* 4 blocks of 512 an SM keep enough loads in flight to reach the DRAM bandwidth */
    status = time_median(
        stream, iters,
        [&]() -> epd_status_t {
            read_kernel<<<(unsigned)sms * 4, 512, 0, stream>>>((const uint4 *)buf, n, sink);
            return cudaGetLastError() == cudaSuccess ? EPD_OK : EPD_ERR_CUDA;
        },
        us_p, err);
    cudaFree(buf);
    cudaFree(sink);
    cudaStreamDestroy(stream);
    return status;
}
