/* gemmbench: the ffn experts' Hopper GEMM kernel (gpu/ffn_gemm_wgmma.cu) alone, over E experts
 * of the same rows each, both projections of a DeepSeek-V3 expert (gate/up: N 2I, K H; down: N H,
 * K I; BF16 D), against a device read of the same weight bytes in the same run: how far the
 * kernel is from the weight read that bounds it at decode sizes, without the rest of the experts
 * phase (gather, SwiGLU, combine) or the random routing of `epd --bench`.
 *   gemmbench [--fp8] [--rows R,R,...] [--tile T,T,...] [--experts E] [--hidden H] [--inter I]
 *             [--iters N] [--routed] [--f32] [--check] [--pair]
 * --tile 0 (the default) lets the launch pick the row tile as the daemon does, a list times each;
 * --routed gives the experts rows as `epd --bench` routes them (R x E rows, each to an expert drawn
 * at random, fixed seed) instead of R each; --f32 writes D in fp32 as the daemon does (else BF16);
 * --check compares experts 0 and E-1 of each launch with a direct fp64 sum on the GPU (prints OK
 * or BAD, exit 1 on BAD); --pair times each launch alone and then with its CTAs in pairs (the
 * activations brought by multicast, ffn_gemm.h's pair), one after the other. One line a
 * projection and a total a row count and tile: the median µs of 5 runs of N launches, the read's,
 * their ratio, TFLOP/s. Needs an sm_90a device (exit 77 without one).
 *   gemmbench --weight-order [--fp8] [--experts E] [--hidden H] [--inter I]
 * streams the gate/up weights without any math, three ways, against the plain read of the same
 * bytes: in the GEMM's order (a CTA an SM, 128-row feature blocks, 2-d TMA boxes of 128 K bytes
 * x 128 rows into a ring of 16 KB stages, as the kernel's producer asks for them), and as if laid
 * out tiled (each stage's 16 KB, or 64 KB, contiguous: one 1-d bulk copy a stage). What the
 * weights' order costs the GEMM's reading, apart from the GEMM. */
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include "gpu/ffn_gemm.h"
#include "gpu/ffn_gemm_wgmma_layout.h"
#include "tests/gpu/cuda_check.cuh"

/* deterministic small values: e4m3 codes of magnitude 2^-3 .. 2^2, or BF16 near +-1 */
__global__ void fill_elems(uint8_t *p, size_t n, uint32_t seed, int fp8)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed * 97u;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        if (fp8)
            p[i] = (uint8_t)((h & 0x80u) | (0x20u + (h >> 8) % 0x30u));
        else /* the high byte of a BF16 keeps the exponent near 1, the low byte is any mantissa */
            p[i] = (i & 1) ? (uint8_t)((0x3cu + ((h >> 8) & 1u)) | (h & 0x80u)) : (uint8_t)h;
    }
}

/* scales that differ by index (a wrong scale index shows in --check) */
__global__ void fill_scales(float *p, size_t n, float v)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        p[i] = v * (1.0f + (float)(i % 7) / 8.0f);
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

__device__ static double e4m3_value(uint8_t c)
{
    const uint32_t ex = (c >> 3) & 15u, m = c & 7u;
    const double v = ex == 0 ? ldexp((double)m, -9) : ldexp((double)(8 + m), (int)ex - 10);
    return (c & 0x80u) ? -v : v;
}

__device__ static double bf16_value(const uint8_t *p)
{
    return (double)__uint_as_float(((uint32_t)p[0] | (uint32_t)p[1] << 8) << 16);
}

/* ---- --weight-order: the weights streamed without math ---------------------------------- */

__device__ static __forceinline__ void wo_wait(uint32_t bar, uint32_t parity)
{
    uint32_t ok = 0;
    while (!ok)
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(ok)
                     : "r"(bar), "r"(parity)
                     : "memory");
}

/* One CTA an SM over items of 128 weight rows (all of K): thread 0 asks for each stage (TILED:
 * STAGE contiguous bytes of the tiled layout by one bulk copy; else 2-d boxes of 128 K bytes x
 * 128 rows, STAGE / 16 KB of them along K), lane 0 of warp 1 waits for it and frees its slot. */
template <bool TILED, uint32_t STAGE, uint32_t RING>
__global__ void __launch_bounds__(64, 1)
    wo_stream_kernel(const __grid_constant__ CUtensorMap map, const uint8_t *w, uint32_t items,
                     uint32_t row_bytes)
{
    extern __shared__ uint8_t smem_raw[];
    const uint32_t base = ((uint32_t)__cvta_generic_to_shared(smem_raw) + 1023u) & ~1023u;
    const uint32_t full = base + RING * STAGE, empty = full + 8 * RING;
    const uint32_t stages = row_bytes * 128u / STAGE, boxes = STAGE / 16384u;
    if (threadIdx.x == 0) {
        for (uint32_t s = 0; s < RING; s++) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(full + 8 * s) : "memory");
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(empty + 8 * s) : "memory");
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x != 0 && threadIdx.x != 32) return;
    uint32_t it = 0;
    for (uint32_t item = blockIdx.x; item < items; item += gridDim.x)
        for (uint32_t s = 0; s < stages; s++, it++) {
            const uint32_t slot = it % RING, parity = (it / RING) & 1u, bar = full + 8 * slot;
            if (threadIdx.x == 32) {
                wo_wait(bar, parity);
                asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(empty + 8 * slot)
                             : "memory");
                continue;
            }
            wo_wait(empty + 8 * slot, parity ^ 1u);
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                         "r"(STAGE)
                         : "memory");
            const uint32_t dst = base + slot * STAGE;
            if (TILED) {
                const uint8_t *src = w + ((size_t)item * stages + s) * STAGE;
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                             "[%0], [%1], %2, [%3];" ::"r"(dst),
                             "l"(__cvta_generic_to_global(src)), "r"(STAGE), "r"(bar)
                             : "memory");
            } else {
                for (uint32_t b = 0; b < boxes; b++)
                    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::"
                                 "complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
                                     dst + b * 16384u),
                                 "l"((uint64_t)&map), "r"((int)((s * boxes + b) * 128u)),
                                 "r"((int)(item * 128u)), "r"(bar)
                                 : "memory");
            }
        }
}

typedef CUresult (*wo_encode_t)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/* the median of 7 runs of launch, in µs */
template <typename F> static float wo_time(F launch)
{
    cudaEvent_t a, b;
    std::vector<float> v;
    CUDA_OK(cudaEventCreate(&a));
    CUDA_OK(cudaEventCreate(&b));
    for (int r = 0; r < 7; r++) {
        CUDA_OK(cudaEventRecord(a));
        launch();
        CUDA_OK(cudaGetLastError());
        CUDA_OK(cudaEventRecord(b));
        CUDA_OK(cudaEventSynchronize(b));
        float ms = 0;
        CUDA_OK(cudaEventElapsedTime(&ms, a, b));
        v.push_back(ms * 1000.0f);
    }
    CUDA_OK(cudaEventDestroy(a));
    CUDA_OK(cudaEventDestroy(b));
    std::sort(v.begin(), v.end());
    return v[3];
}

/* the gate/up weights ([n_exp x 2I rows][H] of es bytes) streamed three ways against the read:
 * 0 on success, 1 when the driver cannot make the tensor map */
static int weight_order(uint32_t n_exp, uint32_t hidden, uint32_t inter, uint32_t es, int sms,
                        unsigned *sink)
{
    const uint64_t rows = (uint64_t)n_exp * 2 * inter, row_bytes = (uint64_t)hidden * es;
    const size_t bytes = rows * row_bytes;
    uint8_t *w;
    CUDA_OK(cudaMalloc(&w, bytes));
    CUDA_OK(cudaMemset(w, 1, bytes));
    void *fn = NULL;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    CUtensorMap map;
    cuuint64_t dims[2] = {row_bytes, rows}, strides[1] = {row_bytes};
    cuuint32_t box[2] = {128, 128}, estr[2] = {1, 1};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess ||
        ((wo_encode_t)fn)(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, w, dims, strides, box, estr,
                          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
        printf("weight-order: no tensor map from the driver\n");
        cudaFree(w);
        return 1;
    }
    const uint32_t items = (uint32_t)(rows / 128);
    auto gemm_order = wo_stream_kernel<false, 16384u, 8>;
    auto tiled16 = wo_stream_kernel<true, 16384u, 8>;
    auto tiled64 = wo_stream_kernel<true, 65536u, 3>;
    const int smem16 = 8 * 16384 + 2048, smem64 = 3 * 65536 + 2048;
    CUDA_OK(cudaFuncSetAttribute(gemm_order, cudaFuncAttributeMaxDynamicSharedMemorySize, smem16));
    CUDA_OK(cudaFuncSetAttribute(tiled16, cudaFuncAttributeMaxDynamicSharedMemorySize, smem16));
    CUDA_OK(cudaFuncSetAttribute(tiled64, cudaFuncAttributeMaxDynamicSharedMemorySize, smem64));
    const uint32_t rb = (uint32_t)row_bytes;
    const float read =
        wo_time([&] { read_kernel<<<sms * 4, 1024>>>((const uint4 *)w, bytes / 16, sink); });
    const float t_gemm = wo_time([&] { gemm_order<<<sms, 64, smem16>>>(map, w, items, rb); });
    const float t_16 = wo_time([&] { tiled16<<<sms, 64, smem16>>>(map, w, items, rb); });
    /* 0 where an item's bytes are no multiple of 64 KB */
    const float t_64 = (row_bytes * 128) % 65536 == 0
                           ? wo_time([&] { tiled64<<<sms, 64, smem64>>>(map, w, items, rb); })
                           : 0.0f;
    printf("weight-order: %.2f GB of gate/up weights: read %.1f us (%.0f GB/s); the GEMM's order "
           "(2-d boxes, 16 KB stages) %.1f us (%.3f of the read); tiled, a 16 KB bulk copy a "
           "stage %.1f (%.3f); tiled, 64 KB a stage %.1f (%.3f)\n",
           bytes / 1e9, read, bytes / read / 1e3, t_gemm, t_gemm / read, t_16, t_16 / read, t_64,
           t_64 / read);
    CUDA_OK(cudaFree(w));
    return 0;
}

/* ref[r][f] = D of expert e's row r, feature f, summed in fp64 (one thread an element) */
__global__ void ref_kernel(epd_ffn_gemm_args_t a, uint32_t e, uint32_t rb, uint32_t mpad,
                           uint32_t rows, double *ref)
{
    const uint32_t f = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
    if (f >= a.n || r >= rows) return;
    const uint8_t *w = (const uint8_t *)a.w, *x = (const uint8_t *)a.x;
    double sum = 0;
    for (uint32_t kb = 0; kb < a.k / 128; kb++) {
        double part = 0;
        for (uint32_t kk = kb * 128; kk < kb * 128 + 128; kk++) {
            const size_t wi = ((size_t)e * a.n + f) * a.k + kk, xi = (size_t)(rb + r) * a.k + kk;
            part += a.fp8 ? e4m3_value(w[wi]) * e4m3_value(x[xi])
                          : bf16_value(w + 2 * wi) * bf16_value(x + 2 * xi);
        }
        if (a.fp8)
            part *= (double)a.w_scale[((size_t)e * (a.n / 128) + f / 128) * a.w_scale_ld + kb] *
                    (double)a.x_scale[(size_t)rb * (a.k / 128) + (size_t)kb * mpad + r];
        sum += part;
    }
    ref[(size_t)r * a.n + f] = sum;
}

static int iters = 10;

/* median over 5 runs of `iters` calls, µs a call */
template <typename F> static double time_us(cudaStream_t s, F call)
{
    cudaEvent_t a, b;
    std::vector<double> t;
    CUDA_OK(cudaEventCreate(&a));
    CUDA_OK(cudaEventCreate(&b));
    for (int i = 0; i < 3; i++) call();
    for (int r = 0; r < 5; r++) {
        CUDA_OK(cudaEventRecord(a, s));
        for (int i = 0; i < iters; i++) call();
        CUDA_OK(cudaEventRecord(b, s));
        CUDA_OK(cudaEventSynchronize(b));
        float ms = 0;
        CUDA_OK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms * 1000.0 / iters);
    }
    std::sort(t.begin(), t.end());
    CUDA_OK(cudaEventDestroy(a));
    CUDA_OK(cudaEventDestroy(b));
    return t[2];
}

/* worst |D - ref| over max |ref| of experts 0 and E-1 (D in BF16, or fp32 without a.out_bf16) */
static double check(const epd_ffn_gemm_args_t &a, const std::vector<uint32_t> &row_base,
                    const std::vector<uint32_t> &counts, cudaStream_t s)
{
    const size_t es = a.out_bf16 ? 2 : 4;
    double worst = 0;
    double *ref;
    CUDA_OK(cudaMalloc(&ref, (size_t)row_base[a.n_experts] * a.n * sizeof(double)));
    for (uint32_t e : {0u, a.n_experts - 1}) {
        const uint32_t mpad = row_base[e + 1] - row_base[e], rows = counts[e];
        if (rows == 0) continue;
        ref_kernel<<<dim3((a.n + 127) / 128, rows), 128, 0, s>>>(a, e, row_base[e], mpad, rows,
                                                                  ref);
        CUDA_OK(cudaGetLastError());
        std::vector<double> want((size_t)rows * a.n);
        std::vector<uint8_t> got((size_t)rows * a.n * es);
        CUDA_OK(cudaMemcpy(want.data(), ref, want.size() * sizeof(double),
                              cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(got.data(), (const uint8_t *)a.d + (size_t)row_base[e] * a.n * es,
                              got.size(), cudaMemcpyDeviceToHost));
        double top = 0, err = 0;
        for (size_t i = 0; i < want.size(); i++) {
            float g;
            if (es == 2) {
                const uint32_t bits = (uint32_t)(got[2 * i] | got[2 * i + 1] << 8) << 16;
                memcpy(&g, &bits, 4);
            } else {
                memcpy(&g, &got[4 * i], 4);
            }
            top = fmax(top, fabs(want[i]));
            const double d = fabs((double)g - want[i]);
            if (!(d <= err)) err = d; /* NaN wins */
        }
        const double rel = top > 0 ? err / top : err;
        if (!(rel <= worst)) worst = rel;
    }
    CUDA_OK(cudaFree(ref));
    return worst;
}

/* "a,b,c" into out (each 0 .. max, zero only with zero_ok); false on a bad list */
static bool parse_list(const char *v, uint32_t max, bool zero_ok, std::vector<uint32_t> &out)
{
    out.clear();
    for (const char *p = v; *p != '\0';) {
        char *end;
        unsigned long r = strtoul(p, &end, 10);
        if (end == p || (r == 0 && !zero_ok) || r > max || (*end != ',' && *end != '\0'))
            return false;
        out.push_back((uint32_t)r);
        p = *end == ',' ? end + 1 : end;
    }
    return !out.empty();
}

/* rows x n_exp rows, each to an expert drawn from a fixed-seed xorshift (as random routing
 * spreads them), or rows each */
static std::vector<uint32_t> make_counts(uint32_t rows, uint32_t n_exp, bool routed)
{
    std::vector<uint32_t> counts(n_exp, routed ? 0 : rows);
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (uint64_t i = 0; routed && i < (uint64_t)rows * n_exp; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        counts[(x >> 11) % n_exp]++;
    }
    return counts;
}

int main(int argc, char **argv)
{
    bool fp8 = false, do_check = false, routed = false, f32 = false, order = false;
    std::vector<bool> pair_list = {false};
    uint32_t n_exp = 32, hidden = 7168, inter = 2048;
    std::vector<uint32_t> row_list = {16, 32, 64, 128}, tile_list = {0};
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(argv[i], "--fp8") == 0) {
            fp8 = true;
        } else if (strcmp(argv[i], "--check") == 0) {
            do_check = true;
        } else if (strcmp(argv[i], "--routed") == 0) {
            routed = true;
        } else if (strcmp(argv[i], "--f32") == 0) {
            f32 = true;
        } else if (strcmp(argv[i], "--pair") == 0) {
            pair_list = {false, true};
        } else if (strcmp(argv[i], "--weight-order") == 0) {
            order = true;
        } else if (strcmp(argv[i], "--rows") == 0 && v != NULL) {
            if (!parse_list(v, 65536, false, row_list)) {
                fprintf(stderr, "gemmbench: bad --rows '%s'\n", v);
                return 2;
            }
            i++;
        } else if (strcmp(argv[i], "--tile") == 0 && v != NULL) {
            if (!parse_list(v, 256, true, tile_list)) {
                fprintf(stderr, "gemmbench: bad --tile '%s'\n", v);
                return 2;
            }
            i++;
        } else if (strcmp(argv[i], "--experts") == 0 && v != NULL) {
            n_exp = (uint32_t)atoi(v), i++;
        } else if (strcmp(argv[i], "--hidden") == 0 && v != NULL) {
            hidden = (uint32_t)atoi(v), i++;
        } else if (strcmp(argv[i], "--inter") == 0 && v != NULL) {
            inter = (uint32_t)atoi(v), i++;
        } else if (strcmp(argv[i], "--iters") == 0 && v != NULL) {
            iters = atoi(v), i++;
        } else {
            fprintf(stderr,
                    "usage: gemmbench [--fp8] [--rows R,R,...] [--tile T,T,...] [--experts E] "
                    "[--hidden H] [--inter I] [--iters N] [--routed] [--f32] [--check] [--pair]\n"
                    "       gemmbench --weight-order [--fp8] [--experts E] [--hidden H] "
                    "[--inter I]\n");
            return 2;
        }
    }
    if (n_exp == 0 || hidden == 0 || inter == 0 || hidden % 128 || inter % 128 || iters < 1) {
        fprintf(stderr, "gemmbench: experts >= 1, hidden and inter multiples of 128, iters >= 1\n");
        return 2;
    }
    char why[EPD_ERR_LEN];
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        printf("SKIP: no GPU\n");
        return 77;
    }
    if (epd_ffn_wgmma_supported(fp8, why) != EPD_OK) {
        printf("SKIP: %s\n", why);
        return 77;
    }
    cudaStream_t s;
    int sms = 0;
    unsigned *sink;
    CUDA_OK(cudaStreamCreate(&s));
    CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CUDA_OK(cudaMalloc(&sink, sizeof *sink));
    const uint32_t es = fp8 ? 1 : 2, ds = f32 ? 4 : 2;
    if (order) return weight_order(n_exp, hidden, inter, es, sms, sink);
    bool bad = false;
    printf("gemmbench: %s, %u experts, H %u, I %u, %s D, rows %s, %d launches a run\n",
           fp8 ? "FP8 block weights" : "BF16 weights", n_exp, hidden, inter, f32 ? "fp32" : "BF16",
           routed ? "routed at random (the mean given)" : "the same for each expert", iters);
    for (uint32_t rows : row_list) {
        const std::vector<uint32_t> counts = make_counts(rows, n_exp, routed);
        std::vector<uint32_t> row_base(n_exp + 1), tile_base(n_exp + 1);
        uint32_t most = 0;
        for (uint32_t e = 0; e < n_exp; e++) {
            /* the daemon's padding (gpu/ffn_cuda.cu pad_rows) */
            const uint32_t c = counts[e], step = c <= 128 ? 16 : c <= 512 ? 32 : 64;
            row_base[e + 1] = row_base[e] + (c + step - 1) / step * step;
            most = std::max(most, c);
        }
        if (routed) printf("rows %u: the most an expert got %u\n", rows, most);
        const size_t total = row_base[n_exp];
        for (size_t tp = 0; tp < tile_list.size() * pair_list.size(); tp++) {
            const uint32_t tile = tile_list[tp / pair_list.size()];
            const bool pair = pair_list[tp % pair_list.size()];
            const uint32_t rt =
                tile != 0 ? tile : epd_ffn_wgmma_row_tile(fp8, counts.data(), n_exp);
            if (fp8 && rt > EPD_WGMMA_TILE_MAX_FP8) continue;
            for (uint32_t e = 0; e < n_exp; e++)
                tile_base[e + 1] = tile_base[e] + (counts[e] + rt - 1) / rt;
            double sum_us = 0, sum_read = 0;
            for (int proj = 0; proj < 2; proj++) {
                const uint32_t n = proj == 0 ? 2 * inter : hidden, k = proj == 0 ? hidden : inter;
                const uint32_t ld = (k / 128 + 3) / 4 * 4;
                const size_t w_bytes = (size_t)n_exp * n * k * es;
                epd_ffn_gemm_args_t a;
                memset(&a, 0, sizeof a);
                uint32_t *dev_u32;
                void *w, *x, *d;
                float *ws = NULL, *xs = NULL;
                CUDA_OK(cudaMalloc(&w, w_bytes));
                CUDA_OK(cudaMalloc(&x, total * k * es));
                CUDA_OK(cudaMalloc(&d, total * n * ds));
                CUDA_OK(cudaMalloc(&dev_u32, (3 * (size_t)n_exp + 2) * sizeof(uint32_t)));
                fill_elems<<<1024, 256, 0, s>>>((uint8_t *)w, w_bytes, 1, fp8);
                fill_elems<<<1024, 256, 0, s>>>((uint8_t *)x, total * k * es, 2, fp8);
                if (fp8) {
                    CUDA_OK(cudaMalloc(&ws, (size_t)n_exp * (n / 128) * ld * sizeof(float)));
                    CUDA_OK(cudaMalloc(&xs, total * (k / 128) * sizeof(float)));
                    fill_scales<<<256, 256, 0, s>>>(ws, (size_t)n_exp * (n / 128) * ld, 0.01f);
                    fill_scales<<<256, 256, 0, s>>>(xs, total * (k / 128), 0.02f);
                }
                CUDA_OK(cudaGetLastError());
                CUDA_OK(cudaMemcpy(dev_u32, row_base.data(), (n_exp + 1) * sizeof(uint32_t),
                                   cudaMemcpyHostToDevice));
                CUDA_OK(cudaMemcpy(dev_u32 + n_exp + 1, tile_base.data(),
                                   (n_exp + 1) * sizeof(uint32_t), cudaMemcpyHostToDevice));
                CUDA_OK(cudaMemcpy(dev_u32 + 2 * (n_exp + 1), counts.data(),
                                   n_exp * sizeof(uint32_t), cudaMemcpyHostToDevice));
                a.fp8 = fp8;
                a.out_bf16 = !f32;
                a.n = n;
                a.k = k;
                a.n_experts = n_exp;
                a.w = w;
                a.w_scale = ws;
                a.w_scale_ld = fp8 ? ld : 0;
                a.x = x;
                a.x_scale = xs;
                a.row_base = dev_u32;
                a.tile_base = dev_u32 + n_exp + 1;
                a.counts = dev_u32 + 2 * (n_exp + 1);
                a.n_tiles = tile_base[n_exp];
                a.d = d;
                a.split_k = 1;
                a.total_rows = (uint32_t)total;
                a.row_tile = rt;
                a.pair = pair;
                bool paired = false;
                a.pair_used_p = &paired;
                const double us = time_us(s, [&] {
                    char err[EPD_ERR_LEN];
                    if (epd_ffn_wgmma_launch(&a, s, err) != EPD_OK) {
                        fprintf(stderr, "gemmbench: %s\n", err);
                        exit(1);
                    }
                });
                const double read = time_us(s, [&] {
                    read_kernel<<<(unsigned)sms * 4, 512, 0, s>>>((const uint4 *)w, w_bytes / 16,
                                                                  sink);
                });
                if (epd_ffn_wgmma_hang(why, sizeof why)) {
                    printf("FAIL  %s\n", why);
                    bad = true;
                }
                const double flop = 2.0 * n_exp * rows * (double)n * k;
                printf("%s %-7s rows %4u tile %3u%s: %8.1f us, read %7.1f us (%.2f of the "
                       "read), %4.0f TFLOP/s\n",
                       fp8 ? "fp8 " : "bf16", proj == 0 ? "gate/up" : "down", rows, rt,
                       paired ? " pair" : "", us, read, us / read, flop / us * 1e-6);
                if (pair && !paired) printf("     (asked in pairs, the launch went alone)\n");
                if (do_check) {
                    /* BF16 D: 2^-8 of the largest element, and a bit */
                    const double worst = check(a, row_base, counts, s);
                    const bool ok = worst < 1e-2;
                    printf("     check: worst |D - fp64| / max |fp64| %.2e %s\n", worst,
                           ok ? "OK" : "BAD");
                    bad = bad || !ok;
                }
                sum_us += us;
                sum_read += read;
                cudaFree(w);
                cudaFree(x);
                cudaFree(d);
                cudaFree(ws);
                cudaFree(xs);
                cudaFree(dev_u32);
            }
            printf("%s both    rows %4u tile %3u%s: %8.1f us, read %7.1f us (%.2f of the read)\n",
                   fp8 ? "fp8 " : "bf16", rows, rt, pair ? " pair" : "", sum_us, sum_read,
                   sum_us / sum_read);
        }
    }
    cudaFree(sink);
    return bad ? 1 : 0;
}
