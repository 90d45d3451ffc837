/* The CUDA external-experts kernels (gpu/external_cuda.cu) against their host twins
 * (gpu/external_host.c), byte for byte, on random records (any values, not only the exactly
 * representable ones the daemon tests use): the ids copy, the gather in every input format from
 * FP8 (group128 and per-token, fp32 and ue8m0 scales) and BF16 records, packed and masked, and
 * the partials (BF16 and FP8) from random BF16 outputs, over three segments.
 * Prints one line per case and 'N passed, N failed'; exit 77 with 'SKIP: no GPU' without one. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bf16.h"
#include "common/rng.h"
extern "C" {
#include "gpu/ops.h" /* a C header without its own guard */
}
#include "gpu/external.h"
#include "gpu/ops.h"
#include "gpu/quant.h"

static int passed, failed;

static void check(bool ok, const char *what)
{
    printf("%s  %s\n", ok ? "PASS" : "FAIL", what);
    if (ok) passed++;
    else failed++;
}

static void *dev_copy(const void *src, size_t bytes)
{
    void *d = NULL;
    if (cudaMalloc(&d, bytes ? bytes : 16) != cudaSuccess) abort();
    if (bytes && cudaMemcpy(d, src, bytes, cudaMemcpyHostToDevice) != cudaSuccess) abort();
    return d;
}

/* Random records of shape (the host ops' pack of random x), n tokens with K distinct ids. */
static void make_records(const epd_moe_shape_t *sh, uint32_t n, uint64_t *rng, uint8_t *rec,
                         int32_t *ids_out)
{
    epd_record_layout_t rl;
    epd_record_layout(sh, &rl);
    uint32_t H = sh->hidden, K = sh->topk;
    uint16_t *x = (uint16_t *)malloc((size_t)H * 2);
    uint8_t *q = (uint8_t *)malloc(H);
    float sc[64 * 4];
    memset(rec, 0, (size_t)n * rl.size);
    for (uint32_t t = 0; t < n; t++) {
        uint8_t *r = rec + (size_t)t * rl.size;
        for (uint32_t h = 0; h < H; h++)
            x[h] = epd_f32_to_bf16((epd_rng_unit_f32(rng) - 0.5f) * 8.0f *
                                   (h % 97 == 0 ? 30.0f : 1.0f));
        if (sh->dtype == EPD_WIRE_FP8) {
            epd_quant_row_host(x, H, sh->scale, sh->scale_format, q, sc);
            memcpy(r + rl.payload, q, H);
            memcpy(r + rl.scales, sc, rl.n_scales * sizeof(float));
        } else {
            memcpy(r + rl.payload, x, (size_t)H * 2);
        }
        for (uint32_t k = 0; k < K; k++) {
            int32_t e;
            bool dup;
            do {
                e = (int32_t)(epd_rng_next(rng) % sh->num_experts);
                dup = false;
                for (uint32_t j = 0; j < k; j++) dup |= ids_out[(size_t)t * K + j] == e;
            } while (dup);
            if (epd_rng_next(rng) % 7 == 0) e = -1;
            ids_out[(size_t)t * K + k] = e;
            float w = epd_rng_unit_f32(rng);
            memcpy(r + rl.ids + k * 4, &e, 4);
            memcpy(r + rl.weights + k * 4, &w, 4);
        }
    }
    free(x);
    free(q);
}

static void run_case(epd_wire_dtype_t dtype, epd_scale_kind_t scale, epd_scale_fmt_t fmt,
                     epd_external_input_t input, epd_external_layout_t layout,
                     epd_combine_dtype_t combine, uint64_t seed)
{
    epd_moe_shape_t sh;
    memset(&sh, 0, sizeof sh);
    sh.hidden = 1024;
    sh.topk = 6;
    sh.num_experts = 32;
    sh.world = 4;
    sh.rank = 1;
    sh.dtype = dtype;
    sh.scale = scale;
    sh.scale_format = fmt;
    sh.expert_kind = EPD_EXPERTS_EXTERNAL;
    sh.combine_dtype = combine;
    epd_record_layout_t rl;
    epd_partial_layout_t pl;
    epd_record_layout(&sh, &rl);
    epd_partial_layout(&sh, &pl);
    uint64_t rng = seed;
    const uint32_t n = 128, K = sh.topk, H = sh.hidden;
    uint8_t *rec = (uint8_t *)malloc((size_t)n * rl.size);
    int32_t *ids = (int32_t *)malloc((size_t)n * K * 4);
    make_records(&sh, n, &rng, rec, ids);
    /* keep the records that name a local expert (rank 1: experts 8..15), as the step would */
    epd_external_plan_t plan;
    memset(&plan, 0, sizeof plan);
    plan.input = input;
    plan.layout = layout;
    plan.capacity = 128;
    plan.n_local = sh.num_experts / sh.world;
    plan.first_expert = sh.rank * plan.n_local;
    uint32_t expert_rows[8] = {0}, first_row[8];
    plan.expert_rows = expert_rows;
    plan.first_row = first_row;
    uint32_t kept = 0;
    for (uint32_t t = 0; t < n; t++) {
        bool local = false;
        for (uint32_t k = 0; k < K; k++) {
            int32_t e = ids[(size_t)t * K + k];
            if (e >= (int32_t)plan.first_expert && e < (int32_t)(plan.first_expert + 8)) {
                local = true;
                expert_rows[e - plan.first_expert]++;
            }
        }
        if (local) memmove(rec + (size_t)kept++ * rl.size, rec + (size_t)t * rl.size, rl.size);
    }
    /* three segments as a step hands them: before this rank, its own (empty here), after it */
    uint32_t seg_n[3] = {kept < 37 ? kept : 37, 0, 0};
    seg_n[2] = kept - seg_n[0];
    plan.n_segments = 3;
    plan.n_records = kept;
    char err[EPD_ERR_LEN];
    if (epd_external_plan_rows(&plan, err) != EPD_OK) {
        check(false, err);
        return;
    }
    size_t n_ids = (size_t)kept * K, row_bytes = epd_external_row_bytes(&sh, input);
    uint32_t n_scales = epd_quant_n_scales(H, epd_external_scale_kind(&sh));
    size_t x_bytes = (size_t)plan.n_rows * row_bytes, s_bytes = (size_t)plan.n_rows * n_scales * 4;

    /* host */
    uint8_t *part_h = (uint8_t *)calloc(kept, pl.size);
    size_t at = 0;
    for (uint32_t s = 0; s < 3; s++) {
        plan.segments[s].records = rec + at * rl.size;
        plan.segments[s].partials = part_h + at * pl.size;
        plan.segments[s].count = seg_n[s];
        at += seg_n[s];
    }
    int32_t *ids_h = (int32_t *)malloc(n_ids * 4 + 4), *row_of = (int32_t *)malloc(n_ids * 4 + 4);
    epd_external_ids_host(&sh, &plan, ids_h);
    check(epd_external_map(&sh, &plan, ids_h, row_of, err) == EPD_OK, "map");
    plan.row_of = row_of;
    uint8_t *x_h = (uint8_t *)calloc(1, x_bytes + 16), *x_d_back = (uint8_t *)calloc(1, x_bytes + 16);
    float *s_h = (float *)calloc(1, s_bytes + 16), *s_d_back = (float *)calloc(1, s_bytes + 16);
    epd_external_gather_host(&sh, &plan, x_h, s_h, err);
    uint16_t *y = (uint16_t *)malloc((size_t)plan.n_rows * H * 2 + 16);
    for (size_t i = 0; i < (size_t)plan.n_rows * H; i++)
        y[i] = epd_f32_to_bf16((epd_rng_unit_f32(&rng) - 0.5f) * 3.0f);
    epd_external_partials_host(&sh, &plan, y, false, err);

    /* device */
    uint8_t *rec_d = (uint8_t *)dev_copy(rec, (size_t)kept * rl.size);
    uint8_t *part_d = NULL;
    if (cudaMalloc((void **)&part_d, (size_t)kept * pl.size + 16) != cudaSuccess) abort();
    epd_external_plan_t dplan = plan;
    at = 0;
    for (uint32_t s = 0; s < 3; s++) {
        dplan.segments[s].records = rec_d + at * rl.size;
        dplan.segments[s].partials = part_d + at * pl.size;
        at += seg_n[s];
    }
    int32_t *ids_back = (int32_t *)malloc(n_ids * 4 + 4);
    cudaStream_t st;
    cudaStreamCreate(&st);
    bool ok = epd_external_ids_cuda(&sh, &dplan, ids_back, st, err) == EPD_OK &&
              cudaStreamSynchronize(st) == cudaSuccess;
    check(ok && memcmp(ids_back, ids_h, n_ids * 4) == 0, "ids copy");
    dplan.row_of = (int32_t *)dev_copy(row_of, n_ids * 4);
    uint8_t *x_d = (uint8_t *)dev_copy(x_h, x_bytes + 16); /* masked rows left alone: same bytes */
    float *s_d = (float *)dev_copy(s_h, s_bytes + 16);
    cudaMemset(x_d, 0, x_bytes + 16);
    cudaMemset(s_d, 0, s_bytes + 16);
    cudaDeviceSynchronize(); /* the memsets are asynchronous, on a stream the ops' does not wait for */
    memset(x_h, 0, x_bytes + 16);
    memset(s_h, 0, s_bytes + 16);
    epd_external_gather_host(&sh, &plan, x_h, s_h, err);
    ok = epd_external_gather_cuda(&sh, &dplan, x_d, s_d, st, err) == EPD_OK &&
         cudaStreamSynchronize(st) == cudaSuccess;
    cudaMemcpy(x_d_back, x_d, x_bytes, cudaMemcpyDeviceToHost);
    cudaMemcpy(s_d_back, s_d, s_bytes, cudaMemcpyDeviceToHost);
    char what[160];
    snprintf(what, sizeof what, "gather: %s wire, %s, %s, input %d, %s", dtype ? "bf16" : "fp8",
             scale ? "per_token" : "group128", fmt ? "ue8m0" : "fp32", (int)input,
             layout ? "masked" : "packed");
    check(ok && memcmp(x_d_back, x_h, x_bytes) == 0 &&
              (input == EPD_EXTERNAL_BF16 || memcmp(s_d_back, s_h, s_bytes) == 0),
          what);
    uint16_t *y_d = (uint16_t *)dev_copy(y, (size_t)plan.n_rows * H * 2);
    ok = epd_external_partials_cuda(&sh, &dplan, y_d, false, st, err) == EPD_OK &&
         cudaStreamSynchronize(st) == cudaSuccess;
    uint8_t *part_back = (uint8_t *)malloc((size_t)kept * pl.size + 16);
    cudaMemcpy(part_back, part_d, (size_t)kept * pl.size, cudaMemcpyDeviceToHost);
    snprintf(what, sizeof what, "partials: %s, %u records", combine ? "fp8" : "bf16", kept);
    check(ok && memcmp(part_back, part_h, (size_t)kept * pl.size) == 0, what);
    epd_external_partials_host(&sh, &plan, NULL, true, err);
    ok = epd_external_partials_cuda(&sh, &dplan, NULL, true, st, err) == EPD_OK &&
         cudaStreamSynchronize(st) == cudaSuccess;
    cudaMemcpy(part_back, part_d, (size_t)kept * pl.size, cudaMemcpyDeviceToHost);
    check(ok && memcmp(part_back, part_h, (size_t)kept * pl.size) == 0, "zero partials");
    cudaStreamDestroy(st);
    cudaFree(rec_d);
    cudaFree(part_d);
    cudaFree((void *)dplan.row_of);
    cudaFree(x_d);
    cudaFree(s_d);
    cudaFree(y_d);
    free(rec);
    free(ids);
    free(part_h);
    free(ids_h);
    free(row_of);
    free(x_h);
    free(x_d_back);
    free(s_h);
    free(s_d_back);
    free(y);
    free(ids_back);
    free(part_back);
}

int main(void)
{
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        printf("SKIP: no GPU\n");
        return 77;
    }
    uint64_t seed = 11;
    const epd_external_input_t inputs[] = {EPD_EXTERNAL_FP8_GROUP128, EPD_EXTERNAL_BF16,
                                           EPD_EXTERNAL_FP8_PER_TENSOR};
    for (int w = 0; w < 2; w++)
        for (int sc = 0; sc < 2; sc++)
            for (int f = 0; f < 2; f++)
                for (int i = 0; i < 3; i++)
                    for (int l = 0; l < 2; l++) {
                        if (w == 1 && (sc == 1)) continue; /* a BF16 wire has no FP8 scales */
                        run_case((epd_wire_dtype_t)w, (epd_scale_kind_t)sc, (epd_scale_fmt_t)f,
                                 inputs[i], (epd_external_layout_t)l,
                                 (epd_combine_dtype_t)((i + l) % 2), seed++);
                    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
