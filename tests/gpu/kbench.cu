/* kbench: speed of the FP8 kernels of gpu/quant.cu against copies of the same bytes measured in
 * the same run: cudaMemcpyAsync D2D (ratio `memcpy`) and a plain grid-stride copy kernel on the
 * SMs (`copyk`, and the difference `d_us` = kernel - copy kernel). Two timing modes, both printed:
 *   event  median of >= 20 calls, each behind a 50 us device-side hold and timed by two events
 *          (GPU time; the host's submission, a few us a call, is printed on its own at the end)
 *   graph  20 calls captured in one CUDA graph, the graph timed the same way, divided by 20: no
 *          per-call event cost, so microsecond kernels are timed as they run back to back
 * Every measured line is printed twice: in a table for people, and as one `R` line for scripts
 * (tests/gpu/quant_gpu.sh): R section kernel layout mode geometry time_us copyk_us memcpy_us
 * rows (rows: the live rows of a requant layout, M of a quantize shape).
 *   kbench [--runs N] [--mode event|graph|both] [--parts quant,requant,long,host]
 *          [--quant-geom K:T:V:R,...] [--requant-geom T:V:R:B[:S[:F]],...] [--sweep]
 * The requant layouts time the pick and every --requant-geom with S given and with the step
 * scale of the count exchange, and the pick also with the step scale reduced on the device.
 * --quant-geom adds launch geometries for the quantize kernels (K = group or token, T threads,
 * V vec, R rows: see epd_quant_launch_t), --requant-geom for the layout-aware requant (T threads,
 * V vectors a pass, R rows a tile, B blocks an SM at most, 0 = as many as fit, S parts a tile, F
 * variant bits: tests/gpu/quant_sweep.h); the picked geometry is always measured. --sweep adds a
 * built-in list of both (the requant's is EPD_REQUANT_SWEEP, which test_quant checks). Parts:
 * quant (decode sizes and M=4096), requant (the decode layouts), long (the long requant layouts),
 * host (submission cost and where cudaMemcpy runs). */
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <string>
#include <unistd.h>
#include <vector>

#include "gpu/quant.h"
#include "tests/gpu/cuda_check.cuh"
#include "tests/gpu/quant_sweep.h"

static int runs = 30;
static bool mode_event = true, mode_graph = true;
static cudaStream_t stream;
static const int GRAPH_CALLS = 20;

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

/* Median milliseconds of `runs` timed runs of g (after 3 warm-up runs), each queued behind a
 * 50 us hold so that its submission is done before the first event fires; divided by per. */
template <typename G>
static double time_runs(G g, int per)
{
    cudaEvent_t a, b;
    CUDA_OK(cudaEventCreate(&a));
    CUDA_OK(cudaEventCreate(&b));
    for (int i = 0; i < 3; i++) g();
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<float> t;
    for (int i = 0; i < runs; i++) {
        hold_kernel<<<1, 1, 0, stream>>>(50000);
        CUDA_OK(cudaEventRecord(a, stream));
        g();
        CUDA_OK(cudaEventRecord(b, stream));
        CUDA_OK(cudaEventSynchronize(b));
        float ms = 0;
        CUDA_OK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    CUDA_OK(cudaEventDestroy(a));
    CUDA_OK(cudaEventDestroy(b));
    std::sort(t.begin(), t.end());
    return t[t.size() / 2] / per;
}

/* Milliseconds of one call of f in event mode (graph = false) or graph mode. */
template <typename F>
static double time_ms(F f, bool graph)
{
    if (!graph) return time_runs(f, 1);
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
    for (int i = 0; i < GRAPH_CALLS; i++) f();
    CUDA_OK(cudaStreamEndCapture(stream, &g));
    CUDA_OK(cudaGraphInstantiate(&ge, g, 0));
    double ms = time_runs([&] { CUDA_OK(cudaGraphLaunch(ge, stream)); }, GRAPH_CALLS);
    CUDA_OK(cudaGraphExecDestroy(ge));
    CUDA_OK(cudaGraphDestroy(g));
    return ms;
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
static int sm_count;

/* The two baselines of `bytes` in one mode: copy kernel and cudaMemcpy, ms. The copy kernel's
 * grid: 4 blocks of 224 an SM, or fewer when the bytes are fewer than one pass. */
static void baselines(size_t bytes, bool graph, double *copyk_p, double *memcpy_p)
{
    const size_t n = bytes / 16;
    size_t blocks = (n + 2 * 224 - 1) / (2 * 224);
    if (blocks > (size_t)sm_count * 4) blocks = (size_t)sm_count * 4;
    if (blocks == 0) blocks = 1;
    *copyk_p = time_ms([&] {
        sm_copy_kernel<<<(unsigned)blocks, 224, 0, stream>>>((const uint4 *)scratch_src,
                                                              (uint4 *)scratch_dst, n);
    }, graph);
    *memcpy_p = time_ms([&] {
        CUDA_OK(cudaMemcpyAsync(scratch_dst, scratch_src, bytes, cudaMemcpyDeviceToDevice, stream));
    }, graph);
}

static const char *mode_name(bool graph) { return graph ? "graph" : "event"; }


static void header(void)
{
    printf("%-8s %-20s %-22s %-5s %-13s %9s %9s %7s %7s %7s\n", "section", "kernel", "layout",
           "mode", "thr:vec:row:blk", "time_us", "copyk_us", "d_us", "/copyk", "/memcpy");
}

/* One measurement: a table line and an R line. */
static void row(const char *section, const char *kernel, const char *layout, bool graph,
                const std::string &geom, double ms, double copyk, double mc, uint64_t rows)
{
    double us = ms * 1e3, cu = copyk * 1e3, mu = mc * 1e3;
    printf("%-8s %-20s %-22s %-5s %-13s %9.2f %9.2f %7.2f %7.3f %7.3f\n", section, kernel, layout,
           mode_name(graph), geom.c_str(), us, cu, us - cu, cu / us, mu / us);
    printf("R %s %s %s %s %s %.3f %.3f %.3f %llu\n", section, kernel, layout, mode_name(graph),
           geom.c_str(), us, cu, mu, (unsigned long long)rows);
    fflush(stdout);
}

struct layout_t {
    uint32_t E, cap, live; /* live = 0: random counts in [0, 16] */
};

static void layout_name(const layout_t &lay, char *b, size_t n)
{
    if (lay.live == 0) snprintf(b, n, "E%u_cap%u_rand16", lay.E, lay.cap);
    else snprintf(b, n, "E%u_cap%u_live%u", lay.E, lay.cap, lay.live);
}

int main(int argc, char **argv)
{
    bool sweep = false, p_quant = true, p_requant = true, p_long = true, p_host = true;
    std::vector<std::pair<int, epd_quant_launch_t>> qgeoms, rgeoms;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--sweep")) sweep = true;
        else if (!strcmp(argv[i], "--runs") && i + 1 < argc) runs = std::max(20, atoi(argv[++i]));
        else if (!strcmp(argv[i], "--mode") && i + 1 < argc) {
            const char *m = argv[++i];
            mode_event = !strcmp(m, "event") || !strcmp(m, "both");
            mode_graph = !strcmp(m, "graph") || !strcmp(m, "both");
            if (!mode_event && !mode_graph) goto usage;
        } else if (!strcmp(argv[i], "--parts") && i + 1 < argc) {
            const std::string p = "," + std::string(argv[++i]) + ",";
            p_quant = p.find(",quant,") != std::string::npos;
            p_requant = p.find(",requant,") != std::string::npos;
            p_long = p.find(",long,") != std::string::npos;
            p_host = p.find(",host,") != std::string::npos;
        } else if (!strcmp(argv[i], "--quant-geom") && i + 1 < argc) {
            if (!epd_parse_geoms(argv[++i], true, &qgeoms)) goto usage;
        } else if (!strcmp(argv[i], "--requant-geom") && i + 1 < argc) {
            if (!epd_parse_geoms(argv[++i], false, &rgeoms)) goto usage;
        } else
            goto usage;
    }
    if (sweep) {
        /* group: 448 x 2, 896 x 1 and 224 x 4 are a row of H 7168 a block (M blocks, one wave
         * at decode sizes); token: 32 lanes a row is a row a warp */
        epd_parse_geoms("group:448:2:1,group:896:1:1,group:224:4:1,group:128:2:1,group:512:2:1,"
                    "group:256:2:2,group:128:2:2,group:256:4:1,group:128:4:1,group:256:1:1,"
                    "group:128:4:2,group:64:2:1,group:256:2:4,"
                    "token:32:32:1,token:64:32:2,token:128:32:4,token:64:16:1,token:128:16:2,"
                    "token:128:8:1,token:256:4:1,token:448:2:1,token:896:1:1",
                    true, &qgeoms);
        epd_parse_geoms(EPD_REQUANT_SWEEP, false, &rgeoms);
    }
    {
        int n_dev = 0;
        if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
            printf("SKIP: no GPU\n");
            return 77;
        }
    }
    {
    cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    sm_count = prop.multiProcessorCount;
    const uint32_t sms = (uint32_t)prop.multiProcessorCount; /* for the launch picker */
    printf("device: %s, %d SMs, %.0f MB L2; median of %d runs; graph mode: %d calls a graph\n",
           prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6, runs, GRAPH_CALLS);
    CUDA_OK(cudaStreamCreate(&stream));
    char err[EPD_ERR_LEN] = "";
    const uint32_t H = 7168, M_MAX = 32768;
    const size_t n_max = (size_t)M_MAX * H;
    uint16_t *x;
    uint8_t *q, *q2;
    float *s, *big_s;
    CUDA_OK(cudaMalloc(&x, n_max * 2));
    CUDA_OK(cudaMalloc(&q, n_max));
    CUDA_OK(cudaMalloc(&q2, n_max));
    CUDA_OK(cudaMalloc(&s, (size_t)M_MAX * (H / 128) * 4));
    CUDA_OK(cudaMalloc(&big_s, 4));
    CUDA_OK(cudaMalloc(&scratch_src, n_max * 2));
    CUDA_OK(cudaMalloc(&scratch_dst, n_max * 2));
    fill_kernel<<<4096, 256, 0, stream>>>(x, n_max);
    CUDA_OK(cudaMemsetAsync(scratch_src, 1, n_max * 2, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<bool> modes;
    if (mode_event) modes.push_back(false);
    if (mode_graph) modes.push_back(true);

    header();
    /* ---- quantize: decode sizes, and one long size for regressions. Baseline: copies of the
     * input bytes (2 x M x H). ---- */
    if (p_quant) {
        const uint32_t ms_list[] = {32, 64, 128, 256, 4096};
        for (uint32_t M : ms_list) {
            size_t n = (size_t)M * H;
            char shape[64];
            snprintf(shape, sizeof shape, "M%u_H%u", M, H);
            for (bool graph : modes) {
                double ck, mc;
                baselines(n * 2, graph, &ck, &mc);
                for (int kind = 0; kind < 2; kind++) {
                    for (int fmt = 0; fmt < 2; fmt++) {
                        epd_scale_kind_t k = (epd_scale_kind_t)kind;
                        epd_scale_fmt_t fm = (epd_scale_fmt_t)fmt;
                        epd_quant_kernel_t kk = k == EPD_SCALE_PER_TOKEN ? EPD_QK_QUANT_TOKEN : EPD_QK_QUANT_GROUP;
                        char name[64];
                        snprintf(name, sizeof name, "quant_%s_%s", k == EPD_SCALE_PER_TOKEN ? "token" : "group",
                                 fm == EPD_SCALE_FMT_UE8M0 ? "ue8m0" : "fp32");
                        std::vector<epd_quant_launch_t> ls = {epd_quant_launch_pick(kk, H, M, sms)};
                        for (auto &g : qgeoms)
                            if (g.first == kind && epd_quant_launch_check(kk, H, &g.second, err) == EPD_OK)
                                ls.push_back(g.second);
                        for (size_t i = 0; i < ls.size(); i++) {
                            epd_quant_launch_t l = ls[i];
                            double t = time_ms([&] { check(epd_quant_cuda(x, M, H, 0, k, fm, q, 0, s, 0, &l, stream, err), err); }, graph);
                            row("quant", name, shape, graph, (i == 0 ? "pick=" : "") + epd_geom_str(l), t, ck, mc, M);
                        }
                    }
                }
            }
        }
    }

    /* ---- requant on the expert-grouped layout: q and scales of every row from a group128
     * (or per-token) quantization; uniform live counts (the issue's layouts), and one random. ---- */
    int32_t *counts;
    CUDA_OK(cudaMalloc(&counts, 256 * 4));
    std::vector<layout_t> lays;
    if (p_requant) {
        lays.insert(lays.end(), {{256, 128, 1}, {256, 128, 8}, {256, 128, 32}, {256, 128, 0}});
        for (uint32_t E : {16u, 32u, 64u})
            for (uint32_t live : {1u, 4u, 8u, 16u, 32u}) lays.push_back({E, 128, live});
    }
    if (p_long)
        lays.insert(lays.end(), {{32, 128, 128}, {128, 256, 64}, {128, 256, 256}, {1, 32768, 32768}});
    uint64_t lcg = 12345;
    for (int kind = 0; kind < 2 && !lays.empty(); kind++) {
        epd_scale_kind_t k = (epd_scale_kind_t)kind;
        check(epd_quant_cuda(x, M_MAX, H, 0, k, EPD_SCALE_FMT_FP32, q, 0, s, 0, NULL, stream, err), err);
        CUDA_OK(cudaStreamSynchronize(stream));
        const char *kn = kind == 0 ? "group" : "token";
        for (const layout_t &lay : lays) {
            if (kind == 1 && lay.live != 8 && lay.live != 32 && lay.E != 128) continue; /* per-token: a few */
            std::vector<int32_t> c(lay.E);
            for (uint32_t e = 0; e < lay.E; e++) {
                lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
                c[e] = lay.live ? (int32_t)lay.live : (int32_t)((lcg >> 33) % 17);
            }
            uint64_t live_rows = 0;
            for (int32_t v : c) live_rows += (uint64_t)v;
            CUDA_OK(cudaMemcpy(counts, c.data(), lay.E * 4, cudaMemcpyHostToDevice));
            const size_t live_n = (size_t)live_rows * H;
            char lname[64];
            layout_name(lay, lname, sizeof lname);
            const char *section = lay.live != 0 && lay.live >= 32 ? "long" : "decode";
            if (lay.live == 32) section = "decode32"; /* both: <= 32 and >= 32 rows */
            for (bool graph : modes) {
                double ck, mc;
                baselines(live_n, graph, &ck, &mc);
                std::string kname;
                /* the kernel before this issue: counts on the device, a prefix in every block */
                if (kind == 0) {
                    epd_quant_launch_t l = epd_quant_launch_pick(EPD_QK_REQUANT, H, lay.cap, sms);
                    double t = time_ms([&] {
                        check(epd_requant_cuda(q, s, counts, lay.E, lay.cap, H, k, 0.01f, q2, big_s, &l, stream, err), err);
                    }, graph);
                    row(section, "old_static_group", lname, graph, "pick=" + epd_geom_str(l), t, ck, mc, live_rows);
                    t = time_ms([&] {
                        check(epd_requant_cuda(q, s, counts, lay.E, lay.cap, H, k, 0.0f, q2, big_s, &l, stream, err), err);
                    }, graph);
                    row(section, "old_stepdev_group", lname, graph, "pick=" + epd_geom_str(l), t, ck, mc, live_rows);
                }
                /* the pick, then the sweep's geometries (S given and the exchange's step scale;
                 * the device reduction, for callers without the exchange, with the pick only) */
                std::vector<epd_quant_launch_t> ls = {
                    epd_quant_launch_pick(EPD_QK_REQUANT_LIVE, H, (uint32_t)live_rows, sms)};
                for (auto &g : rgeoms)
                    if (epd_quant_launch_check(EPD_QK_REQUANT_LIVE, H, &g.second, err) == EPD_OK)
                        ls.push_back(g.second);
                for (size_t i = 0; i < ls.size(); i++) {
                    epd_quant_launch_t l = ls[i];
                    std::string gs = (i == 0 ? "pick=" : "") + epd_geom_str(l);
                    /* a geometry the device refuses (registers) is reported and left out, so
                     * that one does not end the sweep */
                    {
                        const epd_status_t st = epd_requant_given_cuda(
                            q, s, c.data(), lay.E, lay.cap, H, k, 0.01f, q2, &l, stream, err);
                        const cudaError_t rc = st == EPD_OK ? cudaStreamSynchronize(stream)
                                                            : cudaSuccess;
                        if (st != EPD_OK || rc != cudaSuccess) {
                            printf("kbench: %s %s %s left out: %s\n", lname, kn, gs.c_str(),
                                   st != EPD_OK ? err : cudaGetErrorString(rc));
                            (void)cudaGetLastError();
                            continue;
                        }
                    }
                    /* S given: a static scale */
                    kname = std::string("given_") + kn;
                    double t = time_ms([&] {
                        check(epd_requant_given_cuda(q, s, c.data(), lay.E, lay.cap, H, k, 0.01f, q2, &l, stream, err), err);
                    }, graph);
                    row(section, kname.c_str(), lname, graph, gs, t, ck, mc, live_rows);
                    /* the step scale from the count exchange: S = max of 8 senders' maxima on
                     * the host (what epd_step_scale does), then the same launch */
                    kname = std::string("stepexch_") + kn;
                    float senders[8] = {0.004f, 0.009f, 0.002f, 0.011f, 0.007f, 0.003f, 0.010f, 0.005f};
                    t = time_ms([&] {
                        float big = 0.0f;
                        for (float v : senders) big = v > big ? v : big;
                        check(epd_requant_given_cuda(q, s, c.data(), lay.E, lay.cap, H, k, big, q2, &l, stream, err), err);
                    }, graph);
                    row(section, kname.c_str(), lname, graph, gs, t, ck, mc, live_rows);
                    if (i > 0) continue;
                    /* the step scale reduced on the device (no count exchange) */
                    kname = std::string("stepdev_") + kn;
                    t = time_ms([&] {
                        check(epd_requant_step_cuda(q, s, c.data(), lay.E, lay.cap, H, k, q2, big_s, &l, stream, err), err);
                    }, graph);
                    row(section, kname.c_str(), lname, graph, gs, t, ck, mc, live_rows);
                }
            }
        }
    }

    if (p_host) {
        /* Host cost of a call (not in the times above): wall clock of 500 submissions, with no
         * live rows so that the GPU keeps up. */
        std::vector<int32_t> none(256, 0), eight(256, 8);
        CUDA_OK(cudaMemcpy(counts, none.data(), 256 * 4, cudaMemcpyHostToDevice));
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
        double rg = per_call_us([&] {
            check(epd_requant_given_cuda(q, s, eight.data(), 256, 128, H, EPD_SCALE_GROUP128, 0.01f, q2,
                                         NULL, stream, err), err);
        });
        printf("host submission per call: cudaMemcpyAsync %.2f us, requant static %.2f us, requant "
               "step %.2f us, requant given (E=256 x 8 live, tiles made on the host) %.2f us\n",
               c, rs, rd, rg);
        /* Where the baseline copy runs: a cudaMemcpy queued while another stream's kernel holds
         * every thread of every SM, and a one-block kernel queued behind it (which must wait: the
         * check of the hold). A copy that finishes long before the hold ends ran on the copy
         * engines; one that waits for it is a kernel of the driver's, so the baseline then
         * competes for the SMs like the kernels it is compared with (docs/notes/kernels.md). */
        const unsigned long long hold_ns = 400000;
        const size_t bytes = (size_t)8192 * H;
        cudaStream_t other;
        cudaEvent_t a, b, ce;
        CUDA_OK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
        CUDA_OK(cudaEventCreate(&a));
        CUDA_OK(cudaEventCreate(&b));
        CUDA_OK(cudaEventCreate(&ce));
        const int per_sm = prop.maxThreadsPerMultiProcessor / 1024;
        double alone = 1e3 * time_ms([&] {
            CUDA_OK(cudaMemcpyAsync(scratch_dst, scratch_src, bytes, cudaMemcpyDeviceToDevice, stream));
        }, false);
        hold_kernel<<<prop.multiProcessorCount * (per_sm > 0 ? per_sm : 1), 1024, 0, other>>>(hold_ns);
        usleep(50); /* (no kernel can mark the hold's start on `stream`: it would wait for it) */
        CUDA_OK(cudaEventRecord(a, stream));
        CUDA_OK(cudaMemcpyAsync(scratch_dst, scratch_src, bytes, cudaMemcpyDeviceToDevice, stream));
        CUDA_OK(cudaEventRecord(b, stream));
        hold_kernel<<<1, 1, 0, stream>>>(0);
        CUDA_OK(cudaEventRecord(ce, stream));
        CUDA_OK(cudaDeviceSynchronize());
        float copy_ms = 0, kernel_ms = 0;
        CUDA_OK(cudaEventElapsedTime(&copy_ms, a, b));
        CUDA_OK(cudaEventElapsedTime(&kernel_ms, a, ce));
        const bool held = kernel_ms * 1e6 > hold_ns / 2, waited = copy_ms * 1e6 > hold_ns / 2;
        printf("cudaMemcpy D2D of %.1f MB while every SM is held %.0f us: %.1f us (alone %.1f us); a "
               "1-block kernel behind it ended after %.1f us: the copy baseline runs on %s\n",
               bytes / 1e6, hold_ns / 1e3, copy_ms * 1e3, alone, kernel_ms * 1e3,
               !held    ? "? (the hold did not hold)"
               : waited ? "the SMs (it waited for them)"
                        : "the copy engines (it did not wait for the SMs)");
        CUDA_OK(cudaEventDestroy(a));
        CUDA_OK(cudaEventDestroy(b));
        CUDA_OK(cudaEventDestroy(ce));
        CUDA_OK(cudaStreamDestroy(other));
    }
    CUDA_OK(cudaStreamSynchronize(stream));
    printf("done\n");
    return 0;
    }
usage:
    fprintf(stderr, "usage: kbench [--runs N (>= 20)] [--mode event|graph|both] "
                    "[--parts quant,requant,long,host] [--quant-geom group|token:T:V:R,...] "
                    "[--requant-geom T:V:R:B[:S[:F]],...] [--sweep]\n");
    return 2;
}
