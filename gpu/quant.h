/* FP8 quantization API (DESIGN.md section 3): host reference implementations (gpu/quant_host.c,
 * also the CPU fallback), and the CUDA kernels' launchers (gpu/quant.cu) when built with CUDA.
 * The element helpers live in gpu/fp8.h. Both give the same bytes for the same input.
 *
 * Layouts (all row-major, dense unless a stride is given):
 *   x       bf16 bit patterns [rows][hidden]
 *   q       e4m3 codes [rows][hidden]
 *   scales  fp32 [rows][n_scales], n_scales = hidden/128 (group128) or 1 (per_token)
 *   expert-grouped (requant): q [n_experts][capacity][hidden], scales [n_experts][capacity]
 *   [n_scales], int32 counts[n_experts] live rows per expert (rows >= count are ignored), like a
 *   DeepEP low-latency receive buffer.
 * hidden must be a positive multiple of 128; there is no other upper limit. */
#ifndef EPD_GPU_QUANT_H
#define EPD_GPU_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "gpu/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Number of fp32 scales of one row: H/128 for group128, 1 for per_token. */
uint32_t epd_quant_n_scales(uint32_t hidden, epd_scale_kind_t kind);

/* Quantizes one row of `hidden` bf16 values (bit patterns) to e4m3 bytes q[hidden] and its scales. */
void epd_quant_row_host(const uint16_t *x, uint32_t hidden, epd_scale_kind_t kind,
                        epd_scale_fmt_t fmt, uint8_t *q, float *scales);

/* Quantizes one row of `hidden` fp32 values (an expert partial) like epd_quant_row_host: the
 * same amax floor, scale rule and rounding, with no BF16 rounding first. */
void epd_quant_row_f32_host(const float *x, uint32_t hidden, epd_scale_kind_t kind,
                            epd_scale_fmt_t fmt, uint8_t *q, float *scales);

/* Dequantizes one row: out[i] = (float)q[i] * scale of i's group (or the token). */
void epd_dequant_row_host(const uint8_t *q, const float *scales, uint32_t hidden,
                          epd_scale_kind_t kind, float *out);

/* Checks that hidden is a positive multiple of 128 and kind/fmt are known values; EPD_OK or
 * EPD_ERR_INVALID_ARG with a message in err. */
epd_status_t epd_quant_check(uint32_t hidden, epd_scale_kind_t kind, epd_scale_fmt_t fmt,
                             char err[EPD_ERR_LEN]);

/* Host, many rows: quantizes x [rows][hidden] into q [rows][hidden] and scales [rows][n_scales].
 * Returns EPD_ERR_INVALID_ARG (err filled) on a bad shape or NULL pointer; rows = 0 is a no-op. */
epd_status_t epd_quant_host(const uint16_t *x, uint32_t rows, uint32_t hidden,
                            epd_scale_kind_t kind, epd_scale_fmt_t fmt, uint8_t *q, float *scales,
                            char err[EPD_ERR_LEN]);

/* Dequantizes one row to bf16: out[i] = bf16_rne((float)q[i] * scale). */
void epd_dequant_row_bf16_host(const uint8_t *q, const float *scales, uint32_t hidden,
                               epd_scale_kind_t kind, uint16_t *out);

/* Host, many rows: dequantizes q/scales [rows] to fp32 (out_f32) or bf16 (out_bf16) [rows][hidden]. */
epd_status_t epd_dequant_host(const uint8_t *q, const float *scales, uint32_t rows, uint32_t hidden,
                              epd_scale_kind_t kind, float *out_f32, char err[EPD_ERR_LEN]);
epd_status_t epd_dequant_bf16_host(const uint8_t *q, const float *scales, uint32_t rows,
                                   uint32_t hidden, epd_scale_kind_t kind, uint16_t *out_bf16,
                                   char err[EPD_ERR_LEN]);

/* The per-step tensor scale: the largest scale of any live row of the expert-grouped layout (0
 * when no row is live). EPD_ERR_INVALID_ARG when a count is < 0 or > capacity. */
epd_status_t epd_requant_step_scale_host(const float *scales, const int32_t *counts,
                                         uint32_t n_experts, uint32_t capacity, uint32_t hidden,
                                         epd_scale_kind_t kind, float *scale_p,
                                         char err[EPD_ERR_LEN]);

/* Requantizes the live rows of the expert-grouped layout to one per-tensor scale S:
 * q_out = e4m3(((float)q * s) * (1/S)), clamped to +-448 (never NaN). S = static_scale when it
 * is > 0 (the experts' calibrated input scale), else the step scale above. Dead rows of q_out are
 * left untouched; q_out may equal q. *scale_p receives S. static_scale must be 0 (none) or finite
 * and > 0: a negative or non-finite one is EPD_ERR_INVALID_ARG. */
epd_status_t epd_requant_host(const uint8_t *q, const float *scales, const int32_t *counts,
                              uint32_t n_experts, uint32_t capacity, uint32_t hidden,
                              epd_scale_kind_t kind, float static_scale, uint8_t *q_out,
                              float *scale_p, char err[EPD_ERR_LEN]);

/* Requantizes with S given (not reduced): the experts' static input scale, or the step scale
 * the count exchange delivered (epd_step_scale). The same bytes as epd_requant_host with
 * static_scale = scale. scale must be finite and > 0, or 0 when no row is live (the step scale
 * of a step that received nothing; nothing is written then). counts are host memory, each in
 * [0, capacity]. */
epd_status_t epd_requant_given_host(const uint8_t *q, const float *scales, const int32_t *counts,
                                    uint32_t n_experts, uint32_t capacity, uint32_t hidden,
                                    epd_scale_kind_t kind, float scale, uint8_t *q_out,
                                    char err[EPD_ERR_LEN]);

/* The most tiles one layout-aware requant launch holds (they travel in its parameters). */
#define EPD_REQUANT_LIVE_TILES 4096

/* The tiles of the layout-aware requant launch, made on the host from host counts: a tile is up
 * to rows_per_tile consecutive live rows of one expert, tiles in expert order. first[i] is the
 * tile's first row in the layout (e * capacity + r), rows[i] its rows. At most max_tiles tiles:
 * when the layout needs more, rows_per_tile is doubled until they fit (never above 65535); the
 * rows per tile used go to *rows_per_tile_p. *n_tiles_p and *live_rows_p receive the counts.
 * EPD_ERR_INVALID_ARG (err) on a count outside [0, capacity], experts x capacity >= 2^31, or
 * rows_per_tile 0, or when even 65535 rows a tile make more than max_tiles tiles. */
epd_status_t epd_requant_tiles_make(const int32_t *counts_host, uint32_t n_experts,
                                    uint32_t capacity, uint32_t rows_per_tile, uint32_t max_tiles,
                                    uint32_t *first, uint16_t *rows, uint32_t *n_tiles_p,
                                    uint32_t *rows_per_tile_p, uint64_t *live_rows_p,
                                    char err[EPD_ERR_LEN]);

/* Launch parameters of the CUDA kernels: chosen per shape and device by epd_quant_launch_pick
 * (keyed on hidden, rows and the SM count), or given explicitly (kbench sweeps them). Never baked
 * into kernels. */
typedef enum {
    EPD_QK_QUANT_TOKEN = 0, /* per-token quantization */
    EPD_QK_QUANT_GROUP,     /* group-128 quantization */
    EPD_QK_DEQUANT,         /* dequantization (fp32 or bf16 out) */
    EPD_QK_REQUANT,         /* requantization of the expert-grouped layout */
    EPD_QK_SCALE_MAX,       /* step-scale reduction over live rows */
    EPD_QK_REQUANT_LIVE,    /* layout-aware requantization: a grid of the live rows' tiles */
    EPD_QK_MAX
} epd_quant_kernel_t;

typedef struct epd_quant_launch {
    uint32_t threads; /* threads per block (multiple of 32, <= 1024) */
    uint32_t vec;     /* work each thread keeps in flight: 16-byte vectors per row (per_token:
                         1|2|4|8|16|32, or 0 = two-pass kernel that rereads the row from L2), per
                         group (group128: 1|2|4, i.e. 16, 8 or 4 lanes a group), per pass (dequant
                         and requant: 1|2|4); scale_max: floats per thread per pass (1..16) */
    uint32_t rows;    /* per_token: rows per block (threads/rows lanes a row; 32 lanes = a row a
                         warp); group128: groups a thread's lanes do, loads all in flight first
                         (1|2|4); requant: rows per tile (consecutive live rows, expert after
                         expert); requant_live: rows per tile (of one expert; EPD_QL_STREAM:
                         the least passes a block); unused by others */
    uint32_t blocks;  /* requant, requant_live: at most this many blocks per SM (0: as many as
                         fit); requant_live's grid is the tiles, or fewer (then blocks stride over
                         them); unused by the others */
    uint32_t split;   /* requant_live: parts a tile is cut into, one block's item each (0 or 1: a
                         tile is an item; at most EPD_REQUANT_MAX_PARTS): the launch carries
                         rows-row tiles (fewer words) while blocks work on ceil(rows / split) rows
                         at a time, the parts of short tiles left out; unused by the others */
    uint32_t flags;   /* requant_live: EPD_QL_* bits (0: none); unused by the others */
} epd_quant_launch_t;

/* The most parts a tile of the layout-aware requant is cut into. */
#define EPD_REQUANT_MAX_PARTS 32

/* requant_live variants (epd_quant_launch_t.flags); EPD_QL_GRID selects the grid kernel,
 * EPD_QL_STREAM the stream kernel, any other bit set (or split > 1) the part kernel; all give
 * the same bytes. */
#define EPD_QL_PIPE 1u    /* the next pass's loads are issued before this pass's math and stores */
#define EPD_QL_NC 2u      /* q read through the read-only path without L1 allocation (ignored in
                             place, q_out == q) */
#define EPD_QL_CS 4u      /* q_out written with streaming stores (st.global.cs) */
#define EPD_QL_BALANCE 8u /* grid cut to an equal number of items a block (no short last round),
                             when that keeps 7/8 of the blocks that fit */
#define EPD_QL_STREAM 16u /* the stream kernel: the live rows' vectors as one flat sequence cut into
                             one contiguous chunk a block, a grid of the blocks that fit at once;
                             rows is then the least passes a block (fewer blocks when the vectors
                             are fewer) and the step reduction's tile rows, split and
                             EPD_QL_BALANCE are unused; the PIPE, NC and CS bits apply. More
                             than 4096 experts, or 2^31 live vectors: the other kernels */
#define EPD_QL_GRID 32u  /* the grid kernel: the copy kernel's shape over the live vectors (a
                             thread vec vectors blockDim.x apart a pass, the grid's passes one
                             window after the next), up to 1024 experts with rows and a layout
                             of fewer than 2^31 vectors (else the kernels above); rows is then
                             only the step reduction's tile rows; split, EPD_QL_BALANCE,
                             EPD_QL_PIPE and EPD_QL_STREAM are unused; NC and CS apply */
#define EPD_QL_ALL 63u

/* Name of a kernel kind ("quant_token", ...). */
const char *epd_quant_kernel_name(epd_quant_kernel_t kernel);

/* Launch parameters for a kernel on rows x hidden (rows = capacity for requant, all the live
 * rows together for requant_live) on a device of sm_count SMs (cudaDevAttrMultiProcessorCount,
 * read from the device; 0 is taken as 1). */
epd_quant_launch_t epd_quant_launch_pick(epd_quant_kernel_t kernel, uint32_t hidden, uint32_t rows,
                                         uint32_t sm_count);

/* Checks explicit launch parameters for a kernel and hidden size; EPD_ERR_INVALID_ARG with err. */
epd_status_t epd_quant_launch_check(epd_quant_kernel_t kernel, uint32_t hidden,
                                    const epd_quant_launch_t *launch, char err[EPD_ERR_LEN]);

#ifdef EPD_HAVE_CUDA
/* CUDA launchers. Pointers are device memory (16-byte aligned for x, q, out); stream is a
 * cudaStream_t (NULL = default stream). They only enqueue work: the results are ready once the
 * stream is synchronized. launch NULL = epd_quant_launch_pick for the current device. They return EPD_ERR_INVALID_ARG on
 * a bad shape, pointer or launch parameter and EPD_ERR_CUDA when the launch fails (err filled).
 * Each gives the same bytes as its _host twin. */

/* Quantizes x [rows][hidden] to q and scales. x_stride (elements), q_stride (bytes) and
 * scale_stride (floats) are row strides; 0 = dense. x_stride*2 and q_stride must be multiples of 16. */
epd_status_t epd_quant_cuda(const uint16_t *x, uint32_t rows, uint32_t hidden, size_t x_stride,
                            epd_scale_kind_t kind, epd_scale_fmt_t fmt, uint8_t *q, size_t q_stride,
                            float *scales, size_t scale_stride, const epd_quant_launch_t *launch,
                            void *stream, char err[EPD_ERR_LEN]);

/* Dequantizes dense q/scales [rows][hidden] into fp32 (out_f32) or bf16 (out_bf16). */
epd_status_t epd_dequant_cuda(const uint8_t *q, const float *scales, uint32_t rows, uint32_t hidden,
                              epd_scale_kind_t kind, float *out_f32,
                              const epd_quant_launch_t *launch, void *stream, char err[EPD_ERR_LEN]);
epd_status_t epd_dequant_bf16_cuda(const uint8_t *q, const float *scales, uint32_t rows,
                                   uint32_t hidden, epd_scale_kind_t kind, uint16_t *out_bf16,
                                   const epd_quant_launch_t *launch, void *stream,
                                   char err[EPD_ERR_LEN]);

/* Writes the step scale (max scale over live rows, 0 when none) to *scale_dev (device memory).
 * counts are device memory; a count < 0 counts as 0, one > capacity as capacity. */
epd_status_t epd_requant_step_scale_cuda(const float *scales, const int32_t *counts,
                                         uint32_t n_experts, uint32_t capacity, uint32_t hidden,
                                         epd_scale_kind_t kind, float *scale_dev,
                                         const epd_quant_launch_t *launch, void *stream,
                                         char err[EPD_ERR_LEN]);

/* Requantizes the live rows (work proportional to live rows, not capacity) like
 * epd_requant_host. static_scale > 0: S = static_scale; 0: S = the step scale, reduced first.
 * S is written to *scale_dev (device memory; required when static_scale == 0, else may be NULL).
 * counts as for epd_requant_step_scale_cuda. q_out may equal q. launch is for the requant kernel;
 * the reduction picks its own. With the step scale the requant kernel is a programmatic dependent
 * launch behind the reduction's kernel (its prefix of live rows overlaps the reduction's tail). */
epd_status_t epd_requant_cuda(const uint8_t *q, const float *scales, const int32_t *counts,
                              uint32_t n_experts, uint32_t capacity, uint32_t hidden,
                              epd_scale_kind_t kind, float static_scale, uint8_t *q_out,
                              float *scale_dev, const epd_quant_launch_t *launch, void *stream,
                              char err[EPD_ERR_LEN]);

/* Layout-aware requantization with S given (as epd_requant_given_host): counts_host are host
 * memory (the step's rows per local expert from the count exchange, say), so the tiles of live
 * rows are made on the host and travel in the launch itself: the grid is sized to them, no
 * counts are read on the device, no block scans a prefix. Same bytes as epd_requant_host;
 * launch is for EPD_QK_REQUANT_LIVE (NULL = picked for the live rows). counts_host may change
 * once the call returns. */
epd_status_t epd_requant_given_cuda(const uint8_t *q, const float *scales,
                                    const int32_t *counts_host, uint32_t n_experts,
                                    uint32_t capacity, uint32_t hidden, epd_scale_kind_t kind,
                                    float scale, uint8_t *q_out, const epd_quant_launch_t *launch,
                                    void *stream, char err[EPD_ERR_LEN]);

/* The same with the step scale reduced on the device over the live tiles (for a caller that has
 * no S from a count exchange): S is written to *scale_dev (device memory), the requant is a
 * programmatic dependent launch behind the reduction (its first loads overlap it). */
epd_status_t epd_requant_step_cuda(const uint8_t *q, const float *scales,
                                   const int32_t *counts_host, uint32_t n_experts,
                                   uint32_t capacity, uint32_t hidden, epd_scale_kind_t kind,
                                   uint8_t *q_out, float *scale_dev,
                                   const epd_quant_launch_t *launch, void *stream,
                                   char err[EPD_ERR_LEN]);
#endif

#ifdef __cplusplus
}
#endif

#endif
