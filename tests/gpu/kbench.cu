/* kbench: speed of the FP8 kernels of gpu/quant.cu against a device-to-device copy measured in the
 * same run. Per kernel: median time of >= 20 timed runs after warm-up (cudaEvent), GB/s of bytes
 * read + written, and the ratio to cudaMemcpyAsync D2D of the kernel's input bytes (GB/s counted
 * as 2x bytes). Prints the launch parameters each kernel used. Each timed run starts behind a
 * 50 us device-side hold, so the events time the GPU's work and not the host's submission of it
 * (that cost, a few us a call for the copy and the kernels alike, is printed on its own at the
 * end).
 *   kbench [--runs N] [--sweep]    --sweep also times other launch parameters of each kernel */
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <vector>

#include "gpu/quant.h"
#include "tests/gpu/cuda_check.cuh"

static int runs = 30;
static cudaStream_t stream;

/* Spins for ns nanoseconds of the GPU's clock (one thread before each timed call; 2048 / 1024
 * blocks of 1024 an SM to hold every SM's threads in the copy-engine check). */
__global__ void __launch_bounds__(1024, 2) hold_kernel(unsigned long long ns)
{
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}

/* Median milliseconds of `runs` timed calls of f (after 5 warm-up calls), each queued behind a
 * 50 us hold so that its submission is done before the first event fires. */
template <typename F>
static double time_ms(F f)
{
    cudaEvent_t a, b;
    CUDA_OK(cudaEventCreate(&a));
    CUDA_OK(cudaEventCreate(&b));
    for (int i = 0; i < 5; i++) f();
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<float> t;
    for (int i = 0; i < runs; i++) {
        hold_kernel<<<1, 1, 0, stream>>>(50000);
        CUDA_OK(cudaEventRecord(a, stream));
        f();
        CUDA_OK(cudaEventRecord(b, stream));
        CUDA_OK(cudaEventSynchronize(b));
        float ms = 0;
        CUDA_OK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    CUDA_OK(cudaEventDestroy(a));
    CUDA_OK(cudaEventDestroy(b));
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

static void check(epd_status_t st, const char *err)
{
    if (st != EPD_OK) {
        fprintf(stderr, "kbench: launch failed: %s\n", err);
        exit(1);
    }
}

/* Deterministic bf16 test data (values of magnitude ~1 with outliers), made on the device. */
__global__ void fill_kernel(uint16_t *x, size_t n)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        uint32_t exp = 120 + (h % 11) + ((h >> 8) % 1000 == 0 ? 12 : 0);
        x[i] = (uint16_t)(((h >> 31) << 15) | (exp << 7) | ((h >> 4) & 0x7f));
    }
}

/* A plain copy kernel, for reference next to cudaMemcpy (whose own kernel is faster): each thread
 * moves 2 x 16 bytes a pass, grid-stride. Of the copy kernels tried on H200 (grid-stride with 1-8
 * vectors a thread and 2-16 blocks an SM, a slice a block, bulk async copies through shared
 * memory) none beat this shape: ~0.95 of cudaMemcpy at 58.7 MB, ~0.92 at 235 MB. */
__global__ void sm_copy_kernel(const uint4 *__restrict__ a, uint4 *__restrict__ b, size_t n)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x * 2;
    for (size_t i = (size_t)blockIdx.x * blockDim.x * 2 + threadIdx.x; i < n; i += stride) {
        const size_t j = i + blockDim.x;
        uint4 v0 = a[i], v1;
        if (j < n) v1 = a[j];
        b[i] = v0;
        if (j < n) b[j] = v1;
    }
}

static void *scratch_src, *scratch_dst; /* copy baseline buffers */

/* Copy baseline: D2D of `bytes`, GB/s counted as 2x bytes. */
static double copy_gbs(size_t bytes)
{
    double ms = time_ms([&] { CUDA_OK(cudaMemcpyAsync(scratch_dst, scratch_src, bytes, cudaMemcpyDeviceToDevice, stream)); });
    return 2.0 * (double)bytes / (ms * 1e6);
}

static void row(const char *name, const char *shape, const epd_quant_launch_t *l, double ms,
                double bytes, double copy)
{
    double gbs = bytes / (ms * 1e6);
    printf("%-22s %-26s %4u %3u %4u %3u %10.2f %9.1f %9.1f %7.3f\n", name, shape, l->threads,
           l->vec, l->rows, l->blocks, ms * 1e3, gbs, copy, gbs / copy);
    fflush(stdout);
}

static void header(void)
{
    printf("%-22s %-26s %4s %3s %4s %3s %10s %9s %9s %7s\n", "kernel", "shape", "thr", "vec",
           "rows", "blk", "time_us", "GB/s", "copyGB/s", "ratio");
}

int main(int argc, char **argv)
{
    bool sweep = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--sweep")) sweep = true;
        else if (!strcmp(argv[i], "--runs") && i + 1 < argc) runs = std::max(20, atoi(argv[++i]));
        else {
            fprintf(stderr, "usage: kbench [--runs N (>= 20)] [--sweep]\n");
            return 2;
        }
    }
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        printf("SKIP: no GPU\n");
        return 77;
    }
    cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    const uint32_t sms = (uint32_t)prop.multiProcessorCount; /* for the launch picker */
    printf("device: %s, %d SMs, %.0f MB L2; median of %d runs\n", prop.name, prop.multiProcessorCount,
           prop.l2CacheSize / 1e6, runs);
    CUDA_OK(cudaStreamCreate(&stream));
    char err[EPD_ERR_LEN] = "";
    const uint32_t H = 7168, M_MAX = 32768;
    const size_t n_max = (size_t)M_MAX * H;
    uint16_t *x;
    uint8_t *q, *q2;
    float *s, *f32, *big_s;
    uint16_t *bf;
    CUDA_OK(cudaMalloc(&x, n_max * 2));
    CUDA_OK(cudaMalloc(&q, n_max));
    CUDA_OK(cudaMalloc(&q2, n_max));
    CUDA_OK(cudaMalloc(&s, (size_t)M_MAX * (H / 128) * 4));
    CUDA_OK(cudaMalloc(&f32, n_max * 4));
    CUDA_OK(cudaMalloc(&bf, n_max * 2));
    CUDA_OK(cudaMalloc(&big_s, 4));
    CUDA_OK(cudaMalloc(&scratch_src, n_max * 2));
    CUDA_OK(cudaMalloc(&scratch_dst, n_max * 2));
    fill_kernel<<<4096, 256, 0, stream>>>(x, n_max);
    CUDA_OK(cudaMemsetAsync(scratch_src, 1, n_max * 2, stream));
    CUDA_OK(cudaStreamSynchronize(stream));

    header();
    const uint32_t ms_list[] = {128, 4096, 32768};
    for (uint32_t M : ms_list) {
        size_t n = (size_t)M * H;
        char shape[64];
        snprintf(shape, sizeof shape, "M=%u H=%u", M, H);
        for (int kind = 0; kind < 2; kind++) {
            for (int fmt = 0; fmt < 2; fmt++) {
                epd_scale_kind_t k = (epd_scale_kind_t)kind;
                epd_scale_fmt_t fm = (epd_scale_fmt_t)fmt;
                epd_quant_kernel_t kk = k == EPD_SCALE_PER_TOKEN ? EPD_QK_QUANT_TOKEN : EPD_QK_QUANT_GROUP;
                uint32_t ns = epd_quant_n_scales(H, k);
                double bytes = (double)n * 2 + (double)n + (double)M * ns * 4;
                double copy = copy_gbs(n * 2);
                char name[64];
                snprintf(name, sizeof name, "quant_%s_%s", k == EPD_SCALE_PER_TOKEN ? "token" : "group",
                         fm == EPD_SCALE_FMT_UE8M0 ? "ue8m0" : "fp32");
                epd_quant_launch_t l = epd_quant_launch_pick(kk, H, M, sms);
                double ms = time_ms([&] { check(epd_quant_cuda(x, M, H, 0, k, fm, q, 0, s, 0, &l, stream, err), err); });
                row(name, shape, &l, ms, bytes, copy);
                if (sweep && fm == EPD_SCALE_FMT_FP32) {
                    std::vector<epd_quant_launch_t> vs;
                    if (k == EPD_SCALE_PER_TOKEN) {
                        for (uint32_t v : {1u, 2u, 4u, 8u}) {
                            uint32_t lanes = ((H / 8 + v - 1) / v + 31) / 32 * 32;
                            if (lanes <= 1024) vs.push_back({lanes, v, 1});
                        }
                        vs.push_back({256, 0, 1});
                        vs.push_back({512, 0, 1});
                    } else {
                        for (uint32_t v : {1u, 2u, 4u})
                            for (uint32_t t : {128u, 256u, 512u}) vs.push_back({t, v, 1});
                    }
                    for (const epd_quant_launch_t &lv : vs) {
                        if (epd_quant_launch_check(kk, H, &lv, err) != EPD_OK) continue;
                        double t = time_ms([&] { check(epd_quant_cuda(x, M, H, 0, k, fm, q, 0, s, 0, &lv, stream, err), err); });
                        row("  sweep", shape, &lv, t, bytes, copy);
                    }
                }
            }
        }
        CUDA_OK(epd_quant_cuda(x, M, H, 0, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, q, 0, s, 0, NULL,
                               stream, err) == EPD_OK ? cudaSuccess : cudaErrorUnknown);
        {
            epd_quant_launch_t l = epd_quant_launch_pick(EPD_QK_DEQUANT, H, M, sms);
            double copy = copy_gbs(n);
            double ms = time_ms([&] { check(epd_dequant_cuda(q, s, M, H, EPD_SCALE_GROUP128, f32, &l, stream, err), err); });
            row("dequant_group_f32", shape, &l, ms, (double)n * 5 + (double)M * 56 * 4, copy);
            ms = time_ms([&] { check(epd_dequant_bf16_cuda(q, s, M, H, EPD_SCALE_GROUP128, bf, &l, stream, err), err); });
            row("dequant_group_bf16", shape, &l, ms, (double)n * 3 + (double)M * 56 * 4, copy);
        }
    }

    /* requant on the expert-grouped layout: q and scales of all rows come from a group128 quant */
    CUDA_OK(epd_quant_cuda(x, M_MAX, H, 0, EPD_SCALE_GROUP128, EPD_SCALE_FMT_FP32, q, 0, s, 0, NULL,
                           stream, err) == EPD_OK ? cudaSuccess : cudaErrorUnknown);
    struct { uint32_t E, cap, live; } layouts[] = {{128, 256, 256}, {128, 256, 64}, {1, 32768, 32768}};
    int32_t *counts;
    CUDA_OK(cudaMalloc(&counts, 128 * 4));
    for (auto &lay : layouts) {
        std::vector<int32_t> c(lay.E, (int32_t)lay.live);
        CUDA_OK(cudaMemcpy(counts, c.data(), lay.E * 4, cudaMemcpyHostToDevice));
        size_t live_n = (size_t)lay.E * lay.live * H;
        double sc_bytes = (double)lay.E * lay.live * (H / 128) * 4;
        double copy = copy_gbs(live_n);
        char shape[64];
        snprintf(shape, sizeof shape, "E=%u cap=%u live=%u", lay.E, lay.cap, lay.live);
        for (int mode = 0; mode < 2; mode++) {
            epd_quant_launch_t l = epd_quant_launch_pick(EPD_QK_REQUANT, H, lay.cap, sms);
            float static_s = mode == 0 ? 0.01f : 0.0f;
            double ms = time_ms([&] {
                check(epd_requant_cuda(q, s, counts, lay.E, lay.cap, H, EPD_SCALE_GROUP128, static_s,
                                       q2, big_s, &l, stream, err), err);
            });
            /* the step variant also reads the scales once more for the reduction */
            row(mode == 0 ? "requant_group_static" : "requant_group_step", shape, &l, ms,
                2.0 * (double)live_n + sc_bytes * (mode == 0 ? 1 : 2), copy);
            if (sweep && mode == 0) {
                for (uint32_t v : {1u, 2u, 4u})
                    for (uint32_t t : {224u, 256u, 448u, 512u})
                        for (uint32_t r : {1u, 2u, 4u})
                            for (uint32_t b : {0u, 3u, 4u, 6u}) {
                                epd_quant_launch_t lv = {t, v, r, b};
                                double tv = time_ms([&] {
                                    check(epd_requant_cuda(q, s, counts, lay.E, lay.cap, H,
                                                           EPD_SCALE_GROUP128, static_s, q2, big_s,
                                                           &lv, stream, err),
                                          err);
                                });
                                row("  sweep", shape, &lv, tv, 2.0 * (double)live_n + sc_bytes,
                                    copy);
                            }
            }
        }
        epd_quant_launch_t l = epd_quant_launch_pick(EPD_QK_REQUANT, H, lay.cap, sms);
        double ms = time_ms([&] {
            check(epd_requant_cuda(q, s, counts, lay.E, lay.cap, H, EPD_SCALE_PER_TOKEN, 0.0f, q2,
                                   big_s, &l, stream, err), err);
        });
        row("requant_token_step", shape, &l, ms, 2.0 * (double)live_n + 2.0 * lay.E * lay.live * 4, copy);
        /* what a plain SM kernel gets on the same bytes (not a requant: the reference line) */
        epd_quant_launch_t cl = {224, 2, 0, 4};
        ms = time_ms([&] {
            sm_copy_kernel<<<prop.multiProcessorCount * 4, 224, 0, stream>>>(
                (const uint4 *)scratch_src, (uint4 *)scratch_dst, live_n / 16);
        });
        row("(copy kernel, SMs)", shape, &cl, ms, 2.0 * (double)live_n, copy);
    }
    /* Host cost of a call (not in the times above): wall clock of 500 submissions, with no live
     * rows so that the GPU keeps up. */
    {
        std::vector<int32_t> none(128, 0);
        CUDA_OK(cudaMemcpy(counts, none.data(), 128 * 4, cudaMemcpyHostToDevice));
        auto per_call_us = [&](auto f) {
            for (int i = 0; i < 50; i++) f();
            CUDA_OK(cudaStreamSynchronize(stream));
            auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; i < 500; i++) f();
            auto t1 = std::chrono::steady_clock::now();
            CUDA_OK(cudaStreamSynchronize(stream));
            return std::chrono::duration<double, std::micro>(t1 - t0).count() / 500;
        };
        double c = per_call_us([&] {
            CUDA_OK(cudaMemcpyAsync(scratch_dst, scratch_src, 16, cudaMemcpyDeviceToDevice, stream));
        });
        double rs = per_call_us([&] {
            check(epd_requant_cuda(q, s, counts, 128, 256, H, EPD_SCALE_GROUP128, 0.01f, q2, big_s,
                                   NULL, stream, err), err);
        });
        double rd = per_call_us([&] {
            check(epd_requant_cuda(q, s, counts, 128, 256, H, EPD_SCALE_GROUP128, 0.0f, q2, big_s,
                                   NULL, stream, err), err);
        });
        printf("host submission per call: cudaMemcpyAsync %.2f us, requant static %.2f us, requant "
               "step %.2f us\n", c, rs, rd);
    }
    /* Where the baseline copy runs: a cudaMemcpy queued while another stream's kernel holds every
     * thread of every SM, and a one-block kernel queued behind it (which must wait: the check of
     * the hold). A copy that finishes long before the hold ends ran on the copy engines; one that
     * waits for it is a kernel of the driver's, so the baseline then competes for the SMs like the
     * kernels it is compared with (what was seen is in docs/notes/kernels.md). */
    {
        const unsigned long long hold_ns = 400000;
        const size_t bytes = (size_t)8192 * H;
        cudaStream_t other;
        cudaEvent_t a, b, c;
        CUDA_OK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
        CUDA_OK(cudaEventCreate(&a));
        CUDA_OK(cudaEventCreate(&b));
        CUDA_OK(cudaEventCreate(&c));
        const int per_sm = prop.maxThreadsPerMultiProcessor / 1024;
        double alone = 1e3 * time_ms([&] {
            CUDA_OK(cudaMemcpyAsync(scratch_dst, scratch_src, bytes, cudaMemcpyDeviceToDevice, stream));
        });
        hold_kernel<<<prop.multiProcessorCount * (per_sm > 0 ? per_sm : 1), 1024, 0, other>>>(hold_ns);
        usleep(50); /* (no kernel can mark the hold's start on `stream`: it would wait for it) */
        CUDA_OK(cudaEventRecord(a, stream));
        CUDA_OK(cudaMemcpyAsync(scratch_dst, scratch_src, bytes, cudaMemcpyDeviceToDevice, stream));
        CUDA_OK(cudaEventRecord(b, stream));
        hold_kernel<<<1, 1, 0, stream>>>(0);
        CUDA_OK(cudaEventRecord(c, stream));
        CUDA_OK(cudaDeviceSynchronize());
        float copy_ms = 0, kernel_ms = 0;
        CUDA_OK(cudaEventElapsedTime(&copy_ms, a, b));
        CUDA_OK(cudaEventElapsedTime(&kernel_ms, a, c));
        const bool held = kernel_ms * 1e6 > hold_ns / 2, waited = copy_ms * 1e6 > hold_ns / 2;
        printf("cudaMemcpy D2D of %.1f MB while every SM is held %.0f us: %.1f us (alone %.1f us); a "
               "1-block kernel behind it ended after %.1f us: the copy baseline runs on %s\n",
               bytes / 1e6, hold_ns / 1e3, copy_ms * 1e3, alone, kernel_ms * 1e3,
               !held    ? "? (the hold did not hold)"
               : waited ? "the SMs (it waited for them)"
                        : "the copy engines (it did not wait for the SMs)");
        CUDA_OK(cudaEventDestroy(a));
        CUDA_OK(cudaEventDestroy(b));
        CUDA_OK(cudaEventDestroy(c));
        CUDA_OK(cudaStreamDestroy(other));
    }
    CUDA_OK(cudaStreamSynchronize(stream));
    printf("done\n");
    return 0;
}
