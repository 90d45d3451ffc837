/* External experts on the device (gpu/external.h): the records' ids to the host (strided
 * copies), the gather of the worker's input rows and the partials from its BF16 outputs, as
 * kernels on the caller's stream. They give the bytes of the host twins in gpu/external_host.c:
 * the same IEEE operations (--fmad=false), the same rounding helpers (common/bf16.h, gpu/fp8.h). */
#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>

#include "common/bf16.h"
extern "C" {
#include "gpu/ops.h" /* a C header without its own guard */
}
#include "gpu/external.h"
#include "gpu/fp8.h"
#include "gpu/partial_dev.cuh"
#include "gpu/quant.h"
#include "gpu/quant_dev.cuh"

#define EXT_THREADS 256 /* whole warps: a group of 128 is 8 consecutive lanes */
#define EXT_CHUNK 16    /* elements per thread */

/* The plan's segments as the kernels see them: record j is in the segment whose range holds it. */
struct ext_segments {
    const uint8_t *records[EPD_EXTERNAL_SEGMENTS];
    uint8_t *partials[EPD_EXTERNAL_SEGMENTS];
    uint32_t first[EPD_EXTERNAL_SEGMENTS];
    uint32_t count[EPD_EXTERNAL_SEGMENTS];
};

struct ext_args {
    ext_segments seg;
    const int32_t *row_of;
    uint32_t n_records, k_count, hidden, h16;
    uint32_t rec_size, rec_scales, rec_weights;
    uint32_t part_size;
    uint32_t n_scales_in;  /* scales per row of the input (fp8_group128) */
    bool per_token;        /* the records' FP8 scales: one a token */
    bool ue8m0;            /* quantizing a BF16 wire: the scale format */
    uint8_t *x_out;
    float *scales_out;
    const uint16_t *y;
    bool zero_only;
};

static bool ext_fail(char err[EPD_ERR_LEN], cudaError_t rc, const char *what)
{
    if (rc == cudaSuccess) return false;
    snprintf(err, EPD_ERR_LEN, "external experts: %s: %s", what, cudaGetErrorString(rc));
    return true;
}

static ext_args ext_make(const epd_moe_shape_t *shape, const epd_external_plan_t *plan)
{
    epd_record_layout_t rec;
    epd_partial_layout_t pl;
    ext_args a;

    memset(&a, 0, sizeof a);
    epd_record_layout(shape, &rec);
    epd_partial_layout(shape, &pl);
    uint32_t at = 0;
    for (uint32_t s = 0; s < EPD_EXTERNAL_SEGMENTS; s++) {
        bool have = s < plan->n_segments;
        a.seg.records[s] = have ? (const uint8_t *)plan->segments[s].records : NULL;
        a.seg.partials[s] = have ? (uint8_t *)plan->segments[s].partials : NULL;
        a.seg.first[s] = at;
        a.seg.count[s] = have ? plan->segments[s].count : 0;
        at += a.seg.count[s];
    }
    a.row_of = plan->row_of;
    a.n_records = plan->n_records;
    a.k_count = shape->topk;
    a.hidden = shape->hidden;
    a.h16 = shape->hidden / EXT_CHUNK;
    a.rec_size = (uint32_t)rec.size;
    a.rec_scales = (uint32_t)rec.scales;
    a.rec_weights = (uint32_t)rec.weights;
    a.part_size = (uint32_t)pl.size;
    a.n_scales_in = epd_quant_n_scales(shape->hidden, epd_external_scale_kind(shape));
    a.per_token = shape->dtype == EPD_WIRE_FP8 && shape->scale == EPD_SCALE_PER_TOKEN;
    a.ue8m0 = shape->scale_format == EPD_SCALE_FMT_UE8M0;
    return a;
}

static unsigned ext_blocks(uint64_t items)
{
    uint64_t b = (items + EXT_THREADS - 1) / EXT_THREADS;
    return (unsigned)(b > 65535u * 16u ? 65535u * 16u : (b ? b : 1));
}

__device__ __forceinline__ uint32_t ext_segment(const ext_segments &s, uint32_t j)
{
    return j < s.first[1] ? 0u : j < s.first[2] ? 1u : 2u;
}

__device__ __forceinline__ const uint8_t *ext_record(const ext_args &a, uint32_t j)
{
    const uint32_t s = ext_segment(a.seg, j);
    return a.seg.records[s] + (size_t)(j - a.seg.first[s]) * a.rec_size;
}

/* 16 fp32 -> 16 bf16 with the host's rule (epd_f32_to_bf16), two 16-byte stores. */
__device__ __forceinline__ void ext_store_bf16x16(uint16_t *dst, const float *v)
{
    uint32_t w[8];
#pragma unroll
    for (int p = 0; p < 8; p++)
        w[p] = (uint32_t)epd_f32_to_bf16(v[2 * p]) | ((uint32_t)epd_f32_to_bf16(v[2 * p + 1]) << 16);
    reinterpret_cast<uint4 *>(dst)[0] = make_uint4(w[0], w[1], w[2], w[3]);
    reinterpret_cast<uint4 *>(dst)[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

/* The rows: flat over (record, slot, chunk of 16 elements); a (record, slot) whose expert is not
 * local (row -1) writes nothing. FP8 wire: the codes (and the group's or token's scale) as they
 * are, or (bf16 input) bf16((float)q * s). BF16 wire: the bf16 as it is, or (FP8 formats)
 * quantized group128 exactly as the pack does (the group's amax over its 8 lanes). The loop
 * advances whole blocks so every lane takes part in the shuffles. */
template <bool FP8_WIRE, bool BF16_OUT>
__global__ void __launch_bounds__(EXT_THREADS) ext_gather_kernel(ext_args a)
{
    const uint64_t total = (uint64_t)a.n_records * a.k_count * a.h16;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t base = (uint64_t)blockIdx.x * blockDim.x; base < total; base += stride) {
        const uint64_t idx = base + threadIdx.x;
        bool active = idx < total;
        const uint32_t entry = active ? (uint32_t)(idx / a.h16) : 0u;
        const uint32_t c = active ? (uint32_t)(idx % a.h16) : 0u;
        const int32_t row = active ? a.row_of[entry] : -1;
        active = active && row >= 0;
        const uint8_t *rec = active ? ext_record(a, entry / a.k_count) : NULL;
        if (FP8_WIRE) {
            if (!active) continue;
            const uint4 q = *reinterpret_cast<const uint4 *>(rec + (size_t)c * EXT_CHUNK);
            const float s = *reinterpret_cast<const float *>(
                rec + a.rec_scales + (a.per_token ? 0u : 4u * (c >> 3)));
            if (BF16_OUT) {
                float v[EXT_CHUNK];
                epd_dev_dequant16(q, s, v);
                ext_store_bf16x16(reinterpret_cast<uint16_t *>(a.x_out) +
                                      (size_t)row * a.hidden + (size_t)c * EXT_CHUNK,
                                  v);
            } else {
                *reinterpret_cast<uint4 *>(a.x_out + (size_t)row * a.hidden +
                                           (size_t)c * EXT_CHUNK) = q;
                if (a.per_token ? c == 0 : (c & 7u) == 0)
                    a.scales_out[(size_t)row * a.n_scales_in + (a.per_token ? 0u : c >> 3)] = s;
            }
        } else {
            uint4 v0 = make_uint4(0, 0, 0, 0), v1 = v0;
            if (active) {
                const uint4 *src = reinterpret_cast<const uint4 *>(rec + (size_t)c * 2 * EXT_CHUNK);
                v0 = src[0];
                v1 = src[1];
            }
            if (BF16_OUT) {
                if (!active) continue;
                uint4 *dst = reinterpret_cast<uint4 *>(reinterpret_cast<uint16_t *>(a.x_out) +
                                                      (size_t)row * a.hidden +
                                                      (size_t)c * EXT_CHUNK);
                dst[0] = v0;
                dst[1] = v1;
            } else {
                /* the 8 chunks of a group are 8 consecutive lanes of one entry (h16 is a multiple
                 * of 8 and so is every entry's first index) */
                float m = epd_dev_amax8(v1, epd_dev_amax8(v0, 0.0f));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
                if (!active) continue;
                float scale, mult;
                epd_quant_scale(m, a.ue8m0 ? 1 : 0, &scale, &mult);
                const uint2 lo = epd_dev_quant8(v0, mult), hi = epd_dev_quant8(v1, mult);
                *reinterpret_cast<uint4 *>(a.x_out + (size_t)row * a.hidden +
                                           (size_t)c * EXT_CHUNK) = make_uint4(lo.x, lo.y, hi.x,
                                                                               hi.y);
                if ((c & 7u) == 0) a.scales_out[(size_t)row * a.n_scales_in + (c >> 3)] = scale;
            }
        }
    }
}

/* The partials: flat over (record, chunk): acc = 0; for k ascending with a row, acc = acc +
 * w_k * y[row] (fp32, no FMA); stored as bf16 (the host's rounding) or, FP8_PART, quantized
 * group128 by the shared helper (8 lanes a group, every lane of the warp in the shuffles). */
template <bool FP8_PART>
__global__ void __launch_bounds__(EXT_THREADS) ext_partials_kernel(ext_args a)
{
    const uint64_t total = (uint64_t)a.n_records * a.h16;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    float e2 = 0.0f, r2 = 0.0f;
    for (uint64_t base = (uint64_t)blockIdx.x * blockDim.x; base < total; base += stride) {
        const uint64_t idx = base + threadIdx.x;
        const bool active = idx < total;
        const uint32_t j = active ? (uint32_t)(idx / a.h16) : 0u;
        const uint32_t c = active ? (uint32_t)(idx % a.h16) : 0u;
        float acc[EXT_CHUNK];
#pragma unroll
        for (int v = 0; v < EXT_CHUNK; v++) acc[v] = 0.0f;
        const uint32_t s = ext_segment(a.seg, j);
        if (active && !a.zero_only) {
            const uint8_t *rec = a.seg.records[s] + (size_t)(j - a.seg.first[s]) * a.rec_size;
            const float *wts = reinterpret_cast<const float *>(rec + a.rec_weights);
            for (uint32_t k = 0; k < a.k_count; k++) {
                const int32_t row = a.row_of[(size_t)j * a.k_count + k];
                if (row < 0) continue;
                const float w = wts[k];
                const uint4 *src = reinterpret_cast<const uint4 *>(
                    a.y + (size_t)row * a.hidden + (size_t)c * EXT_CHUNK);
                const uint4 p0 = src[0], p1 = src[1];
                const uint32_t wv[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
#pragma unroll
                for (int v = 0; v < 8; v++) {
                    acc[2 * v] = __fadd_rn(acc[2 * v], __fmul_rn(w, epd_dev_bf16_lo(wv[v])));
                    acc[2 * v + 1] =
                        __fadd_rn(acc[2 * v + 1], __fmul_rn(w, epd_dev_bf16_hi(wv[v])));
                }
            }
        }
        uint8_t *part = active ? a.seg.partials[s] + (size_t)(j - a.seg.first[s]) * a.part_size
                               : NULL;
        if (FP8_PART) {
            epd_dev_store_fp8_partial16(part, a.hidden, a.part_size, active, c, acc, false, &e2,
                                        &r2);
        } else if (active) {
            ext_store_bf16x16(reinterpret_cast<uint16_t *>(part) + (size_t)c * EXT_CHUNK, acc);
        }
    }
}

extern "C" epd_status_t epd_external_ids_cuda(const epd_moe_shape_t *shape,
                                              const epd_external_plan_t *plan, int32_t *ids_host,
                                              void *stream, char err[EPD_ERR_LEN])
{
    epd_record_layout_t rec;
    size_t at = 0;

    epd_record_layout(shape, &rec);
    for (uint32_t s = 0; s < plan->n_segments; s++) {
        const epd_external_segment_t *seg = &plan->segments[s];
        if (seg->count == 0) continue;
        size_t width = (size_t)shape->topk * sizeof(int32_t);
        cudaError_t rc = cudaMemcpy2DAsync(ids_host + at * shape->topk, width,
                                           (const uint8_t *)seg->records + rec.ids, rec.size,
                                           width, seg->count, cudaMemcpyDeviceToHost,
                                           (cudaStream_t)stream);
        if (ext_fail(err, rc, "copying the records' ids")) return EPD_ERR_CUDA;
        at += seg->count;
    }
    return EPD_OK;
}

extern "C" epd_status_t epd_external_gather_cuda(const epd_moe_shape_t *shape,
                                                 const epd_external_plan_t *plan, void *x_out,
                                                 float *scales_out, void *stream,
                                                 char err[EPD_ERR_LEN])
{
    ext_args a = ext_make(shape, plan);
    a.x_out = (uint8_t *)x_out;
    a.scales_out = scales_out;
    bool fp8_wire = shape->dtype == EPD_WIRE_FP8, bf16_out = plan->input == EPD_EXTERNAL_BF16;
    uint64_t items = (uint64_t)a.n_records * a.k_count * a.h16;
    if (items == 0) return EPD_OK;
    if (((uintptr_t)x_out & 15u) != 0) {
        snprintf(err, EPD_ERR_LEN, "external experts: the input rows must be 16-byte aligned");
        return EPD_ERR_INVALID_ARG;
    }
    dim3 grid(ext_blocks(items)), block(EXT_THREADS);
    cudaStream_t st = (cudaStream_t)stream;
    if (fp8_wire && bf16_out)
        ext_gather_kernel<true, true><<<grid, block, 0, st>>>(a);
    else if (fp8_wire)
        ext_gather_kernel<true, false><<<grid, block, 0, st>>>(a);
    else if (bf16_out)
        ext_gather_kernel<false, true><<<grid, block, 0, st>>>(a);
    else
        ext_gather_kernel<false, false><<<grid, block, 0, st>>>(a);
    return ext_fail(err, cudaGetLastError(), "gather kernel launch") ? EPD_ERR_CUDA : EPD_OK;
}

extern "C" epd_status_t epd_external_partials_cuda(const epd_moe_shape_t *shape,
                                                   const epd_external_plan_t *plan,
                                                   const uint16_t *y, bool zero_only,
                                                   void *stream, char err[EPD_ERR_LEN])
{
    ext_args a = ext_make(shape, plan);
    a.y = y;
    a.zero_only = zero_only;
    uint64_t items = (uint64_t)a.n_records * a.h16;
    if (items == 0) return EPD_OK;
    if (!zero_only && ((uintptr_t)y & 15u) != 0) {
        snprintf(err, EPD_ERR_LEN, "external experts: the worker's outputs must be 16-byte "
                 "aligned");
        return EPD_ERR_INVALID_ARG;
    }
    dim3 grid(ext_blocks(items)), block(EXT_THREADS);
    if (shape->combine_dtype == EPD_COMBINE_FP8)
        ext_partials_kernel<true><<<grid, block, 0, (cudaStream_t)stream>>>(a);
    else
        ext_partials_kernel<false><<<grid, block, 0, (cudaStream_t)stream>>>(a);
    return ext_fail(err, cudaGetLastError(), "partials kernel launch") ? EPD_ERR_CUDA : EPD_OK;
}
