/* Host FP8 quantization (DESIGN.md section 3): the reference every CUDA kernel is checked against
 * and the CPU fallback the daemon runs. Per-token and group-128 scales, fp32 and ue8m0 formats,
 * dequantization, requantization to one per-tensor scale, and the
 * launch-parameter table of the CUDA kernels (plain C, so it is testable without a GPU). */
#include "gpu/quant.h"

#include <math.h>
#include <stdio.h>

#include "gpu/fp8.h"

uint32_t epd_quant_n_scales(uint32_t hidden, epd_scale_kind_t kind)
{
    return kind == EPD_SCALE_PER_TOKEN ? 1u : hidden / EPD_QUANT_GROUP;
}

epd_status_t epd_quant_check(uint32_t hidden, epd_scale_kind_t kind, epd_scale_fmt_t fmt,
                             char err[EPD_ERR_LEN])
{
    if (hidden == 0 || hidden % EPD_QUANT_GROUP != 0) {
        snprintf(err, EPD_ERR_LEN, "hidden size %u is not a positive multiple of %d", hidden,
                 EPD_QUANT_GROUP);
        return EPD_ERR_INVALID_ARG;
    }
    if (kind != EPD_SCALE_GROUP128 && kind != EPD_SCALE_PER_TOKEN) {
        snprintf(err, EPD_ERR_LEN, "unknown scale kind %d (allowed: group128, per_token)", (int)kind);
        return EPD_ERR_INVALID_ARG;
    }
    if (fmt != EPD_SCALE_FMT_FP32 && fmt != EPD_SCALE_FMT_UE8M0) {
        snprintf(err, EPD_ERR_LEN, "unknown scale format %d (allowed: fp32, ue8m0)", (int)fmt);
        return EPD_ERR_INVALID_ARG;
    }
    return EPD_OK;
}

/* One scale group: amax, scale rule, then q = e4m3(x * mult). */
static float quant_group(const uint16_t *x, uint32_t n, int ue8m0, uint8_t *q)
{
    float amax = 0.0f, scale, mult;
    for (uint32_t i = 0; i < n; i++) {
        float a = fabsf(epd_bf16_to_f32(x[i]));
        if (a > amax) amax = a;
    }
    epd_quant_scale(amax, ue8m0, &scale, &mult);
    for (uint32_t i = 0; i < n; i++) q[i] = epd_e4m3_from_f32(epd_bf16_to_f32(x[i]) * mult);
    return scale;
}

/* The same for fp32 values (expert partials): no BF16 step in between. */
static float quant_group_f32(const float *x, uint32_t n, int ue8m0, uint8_t *q)
{
    float amax = 0.0f, scale, mult;
    for (uint32_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        if (a > amax) amax = a;
    }
    epd_quant_scale(amax, ue8m0, &scale, &mult);
    for (uint32_t i = 0; i < n; i++) q[i] = epd_e4m3_from_f32(x[i] * mult);
    return scale;
}

void epd_quant_row_f32_host(const float *x, uint32_t hidden, epd_scale_kind_t kind,
                            epd_scale_fmt_t fmt, uint8_t *q, float *scales)
{
    int ue8m0 = fmt == EPD_SCALE_FMT_UE8M0;
    if (kind == EPD_SCALE_PER_TOKEN) {
        scales[0] = quant_group_f32(x, hidden, ue8m0, q);
        return;
    }
    for (uint32_t g = 0; g < hidden / EPD_QUANT_GROUP; g++) {
        size_t off = (size_t)g * EPD_QUANT_GROUP;
        scales[g] = quant_group_f32(x + off, EPD_QUANT_GROUP, ue8m0, q + off);
    }
}

void epd_quant_row_host(const uint16_t *x, uint32_t hidden, epd_scale_kind_t kind,
                        epd_scale_fmt_t fmt, uint8_t *q, float *scales)
{
    int ue8m0 = fmt == EPD_SCALE_FMT_UE8M0;
    if (kind == EPD_SCALE_PER_TOKEN) {
        scales[0] = quant_group(x, hidden, ue8m0, q);
        return;
    }
    for (uint32_t g = 0; g < hidden / EPD_QUANT_GROUP; g++) {
        size_t off = (size_t)g * EPD_QUANT_GROUP;
        scales[g] = quant_group(x + off, EPD_QUANT_GROUP, ue8m0, q + off);
    }
}

void epd_dequant_row_host(const uint8_t *q, const float *scales, uint32_t hidden,
                          epd_scale_kind_t kind, float *out)
{
    for (uint32_t i = 0; i < hidden; i++) {
        float s = kind == EPD_SCALE_PER_TOKEN ? scales[0] : scales[i / EPD_QUANT_GROUP];
        out[i] = epd_e4m3_to_f32(q[i]) * s;
    }
}

void epd_dequant_row_bf16_host(const uint8_t *q, const float *scales, uint32_t hidden,
                               epd_scale_kind_t kind, uint16_t *out)
{
    for (uint32_t i = 0; i < hidden; i++) {
        float s = kind == EPD_SCALE_PER_TOKEN ? scales[0] : scales[i / EPD_QUANT_GROUP];
        out[i] = epd_f32_to_bf16(epd_e4m3_to_f32(q[i]) * s);
    }
}

static epd_status_t check_ptrs(const void *a, const void *b, const void *c, const char *what,
                               char err[EPD_ERR_LEN])
{
    if (a == NULL || b == NULL || c == NULL) {
        snprintf(err, EPD_ERR_LEN, "%s: a NULL buffer", what);
        return EPD_ERR_INVALID_ARG;
    }
    return EPD_OK;
}

epd_status_t epd_quant_host(const uint16_t *x, uint32_t rows, uint32_t hidden,
                            epd_scale_kind_t kind, epd_scale_fmt_t fmt, uint8_t *q, float *scales,
                            char err[EPD_ERR_LEN])
{
    epd_status_t status;
    CHECK_GOTO(epd_quant_check(hidden, kind, fmt, err), out);
    if (rows == 0) return EPD_OK;
    CHECK_GOTO(check_ptrs(x, q, scales, "quantize", err), out);
    uint32_t ns = epd_quant_n_scales(hidden, kind);
    for (uint32_t r = 0; r < rows; r++)
        epd_quant_row_host(x + (size_t)r * hidden, hidden, kind, fmt, q + (size_t)r * hidden,
                           scales + (size_t)r * ns);
out:
    return status;
}

epd_status_t epd_dequant_host(const uint8_t *q, const float *scales, uint32_t rows, uint32_t hidden,
                              epd_scale_kind_t kind, float *out_f32, char err[EPD_ERR_LEN])
{
    epd_status_t status;
    CHECK_GOTO(epd_quant_check(hidden, kind, EPD_SCALE_FMT_FP32, err), out);
    if (rows == 0) return EPD_OK;
    CHECK_GOTO(check_ptrs(q, scales, out_f32, "dequantize", err), out);
    uint32_t ns = epd_quant_n_scales(hidden, kind);
    for (uint32_t r = 0; r < rows; r++)
        epd_dequant_row_host(q + (size_t)r * hidden, scales + (size_t)r * ns, hidden, kind,
                             out_f32 + (size_t)r * hidden);
out:
    return status;
}

epd_status_t epd_dequant_bf16_host(const uint8_t *q, const float *scales, uint32_t rows,
                                   uint32_t hidden, epd_scale_kind_t kind, uint16_t *out_bf16,
                                   char err[EPD_ERR_LEN])
{
    epd_status_t status;
    CHECK_GOTO(epd_quant_check(hidden, kind, EPD_SCALE_FMT_FP32, err), out);
    if (rows == 0) return EPD_OK;
    CHECK_GOTO(check_ptrs(q, scales, out_bf16, "dequantize", err), out);
    uint32_t ns = epd_quant_n_scales(hidden, kind);
    for (uint32_t r = 0; r < rows; r++)
        epd_dequant_row_bf16_host(q + (size_t)r * hidden, scales + (size_t)r * ns, hidden, kind,
                                  out_bf16 + (size_t)r * hidden);
out:
    return status;
}

static epd_status_t check_counts(const int32_t *counts, uint32_t n_experts, uint32_t capacity,
                                 char err[EPD_ERR_LEN])
{
    for (uint32_t e = 0; e < n_experts; e++) {
        if (counts[e] < 0 || (uint32_t)counts[e] > capacity) {
            snprintf(err, EPD_ERR_LEN, "expert %u has %d live rows (allowed: 0..%u)", e, counts[e],
                     capacity);
            return EPD_ERR_INVALID_ARG;
        }
    }
    return EPD_OK;
}

epd_status_t epd_requant_step_scale_host(const float *scales, const int32_t *counts,
                                         uint32_t n_experts, uint32_t capacity, uint32_t hidden,
                                         epd_scale_kind_t kind, float *scale_p,
                                         char err[EPD_ERR_LEN])
{
    epd_status_t status;
    CHECK_GOTO(epd_quant_check(hidden, kind, EPD_SCALE_FMT_FP32, err), out);
    CHECK_GOTO(check_ptrs(scales, counts, scale_p, "step scale", err), out);
    CHECK_GOTO(check_counts(counts, n_experts, capacity, err), out);
    uint32_t ns = epd_quant_n_scales(hidden, kind);
    float smax = 0.0f;
    for (uint32_t e = 0; e < n_experts; e++) {
        const float *s = scales + (size_t)e * capacity * ns;
        for (size_t i = 0; i < (size_t)counts[e] * ns; i++)
            if (s[i] > smax) smax = s[i];
    }
    *scale_p = smax;
out:
    return status;
}

epd_status_t epd_requant_host(const uint8_t *q, const float *scales, const int32_t *counts,
                              uint32_t n_experts, uint32_t capacity, uint32_t hidden,
                              epd_scale_kind_t kind, float static_scale, uint8_t *q_out,
                              float *scale_p, char err[EPD_ERR_LEN])
{
    epd_status_t status;
    float big_s;
    if (!(static_scale >= 0.0f) || isinf(static_scale)) {
        snprintf(err, EPD_ERR_LEN, "static scale %g is not 0 (none) or a finite positive value",
                 (double)static_scale);
        return EPD_ERR_INVALID_ARG;
    }
    CHECK_GOTO(epd_quant_check(hidden, kind, EPD_SCALE_FMT_FP32, err), out);
    CHECK_GOTO(check_ptrs(q, scales, counts, "requantize", err), out);
    CHECK_GOTO(check_ptrs(q_out, scale_p, q, "requantize", err), out);
    CHECK_GOTO(check_counts(counts, n_experts, capacity, err), out);
    big_s = static_scale;
    if (big_s == 0.0f)
        CHECK_GOTO(epd_requant_step_scale_host(scales, counts, n_experts, capacity, hidden, kind,
                                               &big_s, err), out);
    *scale_p = big_s;
    float inv = big_s > 0.0f ? 1.0f / big_s : 0.0f; /* 0: no live row, nothing to do */
    uint32_t ns = epd_quant_n_scales(hidden, kind);
    for (uint32_t e = 0; e < n_experts; e++) {
        for (uint32_t r = 0; r < (uint32_t)counts[e]; r++) {
            size_t row = (size_t)e * capacity + r;
            const uint8_t *qr = q + row * hidden;
            const float *sr = scales + row * ns;
            uint8_t *qo = q_out + row * hidden;
            for (uint32_t i = 0; i < hidden; i++) {
                float s = kind == EPD_SCALE_PER_TOKEN ? sr[0] : sr[i / EPD_QUANT_GROUP];
                qo[i] = epd_e4m3_from_f32((epd_e4m3_to_f32(qr[i]) * s) * inv);
            }
        }
    }
out:
    return status;
}

epd_status_t epd_requant_given_host(const uint8_t *q, const float *scales, const int32_t *counts,
                                    uint32_t n_experts, uint32_t capacity, uint32_t hidden,
                                    epd_scale_kind_t kind, float scale, uint8_t *q_out,
                                    char err[EPD_ERR_LEN])
{
    epd_status_t status;
    float used;
    if (!(scale >= 0.0f) || isinf(scale)) {
        snprintf(err, EPD_ERR_LEN, "given scale %g is not a finite value >= 0", (double)scale);
        return EPD_ERR_INVALID_ARG;
    }
    CHECK_GOTO(epd_quant_check(hidden, kind, EPD_SCALE_FMT_FP32, err), out);
    CHECK_GOTO(check_ptrs(q, scales, counts, "requantize", err), out);
    CHECK_GOTO(check_counts(counts, n_experts, capacity, err), out);
    if (scale == 0.0f) {
        for (uint32_t e = 0; e < n_experts; e++) {
            if (counts[e] > 0) {
                snprintf(err, EPD_ERR_LEN,
                         "given scale 0 with live rows (expert %u has %d): S must be > 0", e,
                         counts[e]);
                return EPD_ERR_INVALID_ARG;
            }
        }
        return EPD_OK;
    }
    /* S given: the requant without its reduction, the same loop */
    status = epd_requant_host(q, scales, counts, n_experts, capacity, hidden, kind, scale, q_out,
                              &used, err);
out:
    return status;
}

epd_status_t epd_requant_tiles_make(const int32_t *counts_host, uint32_t n_experts,
                                    uint32_t capacity, uint32_t rows_per_tile, uint32_t max_tiles,
                                    uint32_t *first, uint16_t *rows, uint32_t *n_tiles_p,
                                    uint32_t *rows_per_tile_p, uint64_t *live_rows_p,
                                    char err[EPD_ERR_LEN])
{
    epd_status_t status;
    uint64_t live = 0, tiles;
    uint32_t r = rows_per_tile;

    if (counts_host == NULL || (max_tiles > 0 && (first == NULL || rows == NULL))) {
        snprintf(err, EPD_ERR_LEN, "requant tiles: a NULL buffer");
        return EPD_ERR_INVALID_ARG;
    }
    if (rows_per_tile == 0 || rows_per_tile > 65535) {
        snprintf(err, EPD_ERR_LEN, "requant tiles: %u rows a tile (allowed: 1..65535)",
                 rows_per_tile);
        return EPD_ERR_INVALID_ARG;
    }
    if ((uint64_t)n_experts * capacity > 0x7fffffffull) {
        snprintf(err, EPD_ERR_LEN, "requant tiles: experts x capacity too large (2^31 rows)");
        return EPD_ERR_INVALID_ARG;
    }
    CHECK_GOTO(check_counts(counts_host, n_experts, capacity, err), out);
    for (;;) {
        tiles = 0;
        for (uint32_t e = 0; e < n_experts; e++) tiles += ((uint64_t)counts_host[e] + r - 1) / r;
        if (tiles <= max_tiles) break;
        if (r == 65535) {
            snprintf(err, EPD_ERR_LEN,
                     "requant tiles: the layout needs %llu tiles of 65535 rows (allowed: %u)",
                     (unsigned long long)tiles, max_tiles);
            return EPD_ERR_INVALID_ARG;
        }
        r = r > 65535 / 2 ? 65535 : r * 2;
    }
    tiles = 0;
    for (uint32_t e = 0; e < n_experts; e++) {
        for (uint32_t k = 0; k < (uint32_t)counts_host[e]; k += r) {
            uint32_t left = (uint32_t)counts_host[e] - k;
            first[tiles] = e * capacity + k;
            rows[tiles] = (uint16_t)(left < r ? left : r);
            tiles++;
        }
        live += (uint64_t)counts_host[e];
    }
    *n_tiles_p = (uint32_t)tiles;
    *rows_per_tile_p = r;
    *live_rows_p = live;
out:
    return status;
}

/* ---- launch parameters of the CUDA kernels ---- */

static const char *const kernel_names[EPD_QK_MAX] = {
    [EPD_QK_QUANT_TOKEN] = "quant_token", [EPD_QK_QUANT_GROUP] = "quant_group",
    [EPD_QK_DEQUANT] = "dequant",         [EPD_QK_REQUANT] = "requant",
    [EPD_QK_SCALE_MAX] = "scale_max",     [EPD_QK_REQUANT_LIVE] = "requant_live",
};

const char *epd_quant_kernel_name(epd_quant_kernel_t kernel)
{
    return (unsigned)kernel < EPD_QK_MAX ? kernel_names[kernel] : "unknown";
}

/* Threads per row of the per-token kernel: a power of two up to a warp, else whole warps. */
static uint32_t token_lanes(uint32_t want)
{
    if (want > 32) return (want + 31) / 32 * 32;
    uint32_t t = 1;
    while (t < want) t <<= 1;
    return t;
}

/* The layout-aware requant's launch by live rows (all experts together) at H 7168: the first row
 * whose max_rows holds them. The rows are the sweep's "suggested requant_live_picks" of one H200
 * (kbench --sweep, S given, group128, the best of event and graph timing; docs/results.md, issue
 * 18, session 12): every row is within 1.6% of the best launch measured for its layouts. Flags:
 * 9 = balanced grid and pipelined; 32 the grid kernel, 36 = that with streaming stores (it is
 * the best from 1980 live rows up, but for the 8192-row layouts, where the part kernel stays).
 * The stream kernel (EPD_QL_STREAM) is in the sweep but was the best nowhere. At most 8 blocks
 * an SM. tests/gpu/quant_gpu.sh prints this table from a sweep. */
#define REQUANT_LIVE_PICK_HIDDEN 7168u
static const struct requant_live_pick {
    uint32_t max_rows;    /* live rows, at most */
    epd_quant_launch_t l; /* threads, vec, rows (a tile), blocks (an SM), split, flags */
} requant_live_picks[] = {
    {16, {448, 1, 1, 4, 0, 0}},
    {32, {224, 1, 8, 8, 0, EPD_QL_GRID}},
    {64, {448, 1, 1, 4, 0, 0}},
    {128, {224, 2, 1, 4, 0, 0}},
    {512, {448, 2, 2, 4, 0, 0}},
    {1024, {448, 4, 4, 4, 0, 0}},
    {1980, {448, 1, 8, 4, 0, EPD_QL_GRID | EPD_QL_CS}},
    {2048, {224, 1, 8, 8, 0, EPD_QL_GRID | EPD_QL_CS}},
    {4096, {448, 1, 8, 4, 0, EPD_QL_GRID | EPD_QL_CS}},
    {8192, {224, 2, 32, 4, 8, EPD_QL_BALANCE | EPD_QL_PIPE}},
    {UINT32_MAX, {448, 1, 8, 4, 0, EPD_QL_GRID | EPD_QL_CS}}, /* the last row takes every count */
};

epd_quant_launch_t epd_quant_launch_pick(epd_quant_kernel_t kernel, uint32_t hidden, uint32_t rows,
                                         uint32_t sm_count)
{
    epd_quant_launch_t l = {.threads = 256, .vec = 2, .rows = 1};
    uint32_t nv = hidden / 8; /* 16-byte vectors of a bf16 row */
    switch (kernel) {
    case EPD_QK_QUANT_TOKEN: {
        /* the whole row in registers, as few vectors per thread as keep a row within 256 lanes */
        uint32_t lanes = 0;
        l.vec = 0;
        for (uint32_t v = 1; v <= 8; v <<= 1) {
            lanes = token_lanes((nv + v - 1) / v);
            if (lanes <= 256) {
                l.vec = v;
                break;
            }
        }
        if (l.vec == 0) {
            lanes = token_lanes((nv + 7) / 8);
            l.vec = 8;
            if (lanes > 1024) { /* too long for registers: two passes, the second from L2 */
                l.vec = 0;
                lanes = 512;
            }
        }
        l.rows = lanes >= 256 ? 1 : 256 / lanes;
        /* fewer rows than SMs x rows per block: fewer rows per block, so more SMs get one */
        const uint64_t sms = sm_count > 0 ? sm_count : 1;
        while (l.rows > 1 && lanes * l.rows > 32 && (uint64_t)rows < sms * l.rows) l.rows >>= 1;
        l.threads = lanes * l.rows;
        break;
    }
    case EPD_QK_QUANT_GROUP:
        l.threads = 256;
        l.vec = 2; /* 8 lanes per group, 32 bytes in, one 16-byte store out */
        break;
    case EPD_QK_DEQUANT:
        l.threads = 256;
        l.vec = 2;
        break;
    case EPD_QK_REQUANT: {
        uint32_t nvr = hidden / 16; /* 16-byte vectors of an e4m3 row */
        /* A tile (rows x nvr vectors) that is a whole number of block-wide passes leaves no lane
         * idle in its last pass. First choice, the best of a kbench --sweep at H 7168
         * (docs/notes/kernels.md): 2 vectors a thread with a row a whole number of passes (224
         * threads at H 7168), 4 rows a tile, at most 4 blocks an SM (more in flight was slower).
         * Else the smallest tile of whole passes, wider vectors first. */
        l.threads = 0;
        l.blocks = 4;
        for (uint32_t t = 512; t >= 128 && l.threads == 0; t -= 32) {
            if (nvr && nvr % (t * 2) == 0) {
                l.threads = t;
                l.vec = 2;
                l.rows = 4;
            }
        }
        for (uint32_t v = 4; v >= 2 && l.threads == 0; v >>= 1) {
            for (uint32_t r = 1; r <= 16 && l.threads == 0; r++) {
                for (uint32_t t = 512; t >= 128; t -= 32) {
                    if (nvr && (r * nvr) % (t * v) == 0) {
                        l.threads = t;
                        l.vec = v;
                        l.rows = r;
                        break;
                    }
                }
            }
        }
        if (l.threads == 0) { /* short rows: one pass of 128 x 4 vectors over whole rows */
            l.threads = 128;
            l.vec = 4;
            l.rows = nvr ? (l.threads * l.vec) / nvr : 1;
            if (l.rows < 1) l.rows = 1;
            if (l.rows > 64) l.rows = 64;
        }
        break;
    }
    case EPD_QK_SCALE_MAX:
        l.threads = 256;
        l.vec = 8; /* independent loads in flight a thread */
        break;
    case EPD_QK_REQUANT_LIVE: {
        /* rows = the live rows: the first row of requant_live_picks that holds them. At H 7168
         * its launch as it stands; other hidden sizes keep its vectors a thread, rows a tile,
         * parts, blocks and variant bits, with the threads that make a row a whole number of
         * passes, or 256/128 threads. */
        const struct requant_live_pick *p = requant_live_picks;
        while (rows > p->max_rows) p++;
        if (hidden == REQUANT_LIVE_PICK_HIDDEN) {
            l = p->l;
            break;
        }
        const uint32_t nvr = hidden / 16;
        const uint32_t vec = p->l.vec;
        l = p->l;
        l.threads = 0;
        for (uint32_t t = 512; t >= 128 && l.threads == 0; t -= 32)
            if (nvr && nvr % (t * vec) == 0 && (vec != 1 || t >= 256)) l.threads = t;
        if (vec == 4 && l.threads == 0) /* two rows a pass (H 7168: 224 threads) */
            for (uint32_t t = 512; t >= 128 && l.threads == 0; t -= 32)
                if (nvr && (2 * nvr) % (t * vec) == 0) l.threads = t;
        if (l.threads == 0) {
            l.threads = nvr >= 256 ? 256 : 128;
            l.vec = nvr >= 512 ? 2 : 1;
        }
        /* at least the rows of a pass a tile (the stream kernel's rows are passes a block) */
        if (vec == 4 && l.vec == 4 && (l.flags & EPD_QL_STREAM) == 0) {
            const uint32_t pass = l.threads * l.vec; /* vectors a pass */
            const uint32_t pass_rows = pass >= nvr ? pass / nvr : 1;
            if (l.rows < pass_rows) l.rows = pass_rows;
        }
        break;
    }
    default:
        break;
    }
    return l;
}

epd_status_t epd_quant_launch_check(epd_quant_kernel_t kernel, uint32_t hidden,
                                    const epd_quant_launch_t *l, char err[EPD_ERR_LEN])
{
    const char *name = epd_quant_kernel_name(kernel);
    if ((unsigned)kernel >= EPD_QK_MAX) {
        snprintf(err, EPD_ERR_LEN, "unknown kernel %d", (int)kernel);
        return EPD_ERR_INVALID_ARG;
    }
    if (l->threads < 32 || l->threads > 1024 || l->threads % 32 != 0) {
        snprintf(err, EPD_ERR_LEN, "%s: %u threads per block (allowed: a multiple of 32, 32..1024)",
                 name, l->threads);
        return EPD_ERR_INVALID_ARG;
    }
    uint32_t v = l->vec;
    if (kernel != EPD_QK_REQUANT_LIVE && (l->split != 0 || l->flags != 0)) {
        snprintf(err, EPD_ERR_LEN,
                 "%s: parts %u and flags 0x%x are for requant_live only (allowed: 0)", name,
                 l->split, l->flags);
        return EPD_ERR_INVALID_ARG;
    }
    switch (kernel) {
    case EPD_QK_QUANT_TOKEN: {
        if (v != 0 && v != 1 && v != 2 && v != 4 && v != 8 && v != 16 && v != 32) {
            snprintf(err, EPD_ERR_LEN, "%s: vec %u (allowed: 0 two-pass, 1, 2, 4, 8, 16, 32)",
                     name, v);
            return EPD_ERR_INVALID_ARG;
        }
        if (l->rows < 1 || l->threads % l->rows != 0) {
            snprintf(err, EPD_ERR_LEN, "%s: %u rows per block do not divide %u threads", name,
                     l->rows, l->threads);
            return EPD_ERR_INVALID_ARG;
        }
        uint32_t lanes = l->threads / l->rows;
        if (lanes > 32 ? lanes % 32 != 0 : (lanes & (lanes - 1)) != 0) {
            snprintf(err, EPD_ERR_LEN,
                     "%s: %u threads per row (allowed: a power of two up to 32, or whole warps)",
                     name, lanes);
            return EPD_ERR_INVALID_ARG;
        }
        if (v != 0 && (uint64_t)lanes * v * 8 < hidden) {
            snprintf(err, EPD_ERR_LEN, "%s: %u threads x %u vectors hold %u values, row has %u",
                     name, lanes, v, lanes * v * 8, hidden);
            return EPD_ERR_INVALID_ARG;
        }
        return EPD_OK;
    }
    case EPD_QK_QUANT_GROUP:
    case EPD_QK_DEQUANT:
    case EPD_QK_REQUANT:
    case EPD_QK_REQUANT_LIVE:
        if (v != 1 && v != 2 && v != 4) {
            snprintf(err, EPD_ERR_LEN, "%s: vec %u (allowed: 1, 2, 4)", name, v);
            return EPD_ERR_INVALID_ARG;
        }
        if (kernel == EPD_QK_QUANT_GROUP && l->rows != 0 && l->rows != 1 && l->rows != 2 &&
            l->rows != 4) {
            snprintf(err, EPD_ERR_LEN, "%s: %u groups a thread (allowed: 1, 2, 4; 0 = 1)", name,
                     l->rows);
            return EPD_ERR_INVALID_ARG;
        }
        if (kernel == EPD_QK_REQUANT_LIVE && (l->rows < 1 || l->rows > 65535 || l->blocks > 32)) {
            snprintf(err, EPD_ERR_LEN,
                     "%s: %u rows a tile, %u blocks per SM (allowed: 1..65535 rows, 0..32 blocks)",
                     name, l->rows, l->blocks);
            return EPD_ERR_INVALID_ARG;
        }
        if (kernel == EPD_QK_REQUANT && (l->rows < 1 || l->rows > 65535)) {
            snprintf(err, EPD_ERR_LEN, "%s: %u rows per block (allowed: 1..65535)", name, l->rows);
            return EPD_ERR_INVALID_ARG;
        }
        if (kernel == EPD_QK_REQUANT_LIVE &&
            (l->split > EPD_REQUANT_MAX_PARTS || (l->flags & ~EPD_QL_ALL) != 0)) {
            snprintf(err, EPD_ERR_LEN, "%s: %u parts a tile, flags 0x%x (allowed: 0..%d parts, "
                     "flags within 0x%x)", name, l->split, l->flags, EPD_REQUANT_MAX_PARTS,
                     EPD_QL_ALL);
            return EPD_ERR_INVALID_ARG;
        }
        if (kernel == EPD_QK_REQUANT && l->blocks > 32) {
            snprintf(err, EPD_ERR_LEN, "%s: %u blocks per SM (allowed: 0 = as many as fit, 1..32)",
                     name, l->blocks);
            return EPD_ERR_INVALID_ARG;
        }
        return EPD_OK;
    case EPD_QK_SCALE_MAX:
        if (v < 1 || v > 16) {
            snprintf(err, EPD_ERR_LEN, "%s: vec %u (allowed: 1..16)", name, v);
            return EPD_ERR_INVALID_ARG;
        }
        return EPD_OK;
    default:
        return EPD_OK;
    }
}
