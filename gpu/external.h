/* External experts (experts.kind external, DESIGN.md section 9) on the device-ops side: the plan
 * of one step's rows (which received record and top-k slot becomes which row of the worker's
 * input, grouped by local expert), the gather of those rows into the worker's input in the
 * format experts.external_input names, and the weighted partials formed from the worker's BF16
 * outputs exactly as step 6 forms them for the built-in kinds. Host implementations here
 * (gpu/external_host.c); the CUDA ones behind the same plan (gpu/external_cuda.cu). A leaf
 * module: no logging, a status and err. */
#ifndef EPD_GPU_EXTERNAL_H
#define EPD_GPU_EXTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "gpu/ops.h"
#include "gpu/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One run of received records and where their partials go (ops memory): a step hands at most
 * three, in source-rank order (the ranks before this one, this rank's own records, the ranks
 * after it), so rows come in source-rank order, then record order. */
typedef struct epd_external_segment {
    const void *records; /* count records of epd_record_layout */
    uint32_t count;
    void *partials;      /* count partials of epd_partial_layout, one per record */
} epd_external_segment_t;

#define EPD_EXTERNAL_SEGMENTS 3

/* The rows of one step for this rank's worker. */
typedef struct epd_external_plan {
    epd_external_input_t input;
    epd_external_layout_t layout;
    uint32_t capacity;        /* masked: rows per local expert; packed: unused */
    uint32_t n_local;         /* E/W experts of this rank, from first_expert */
    uint32_t first_expert;
    epd_external_segment_t segments[EPD_EXTERNAL_SEGMENTS];
    uint32_t n_segments;
    uint32_t n_records;       /* over the segments */
    const uint32_t *expert_rows; /* [n_local] host: rows per local expert (the count exchange) */
    uint32_t *first_row;      /* [n_local] host, filled by epd_external_plan_rows */
    uint32_t n_rows;          /* rows of the input/output tensors: packed, the sum of
                               * expert_rows; masked, n_local * capacity */
    int32_t *row_of;          /* [n_records * K]: the row of (record j, slot k) in the input,
                               * -1 where the slot's expert is not this rank's (or empty) */
} epd_external_plan_t;

/* Fills plan->first_row and plan->n_rows from expert_rows and the layout. EPD_ERR_INVALID_ARG
 * (err names the expert) when a masked expert has more rows than the capacity. */
epd_status_t epd_external_plan_rows(epd_external_plan_t *plan, char err[EPD_ERR_LEN]);

/* Bytes of one input row's payload: H (FP8 formats) or 2H (bf16). */
size_t epd_external_row_bytes(const epd_moe_shape_t *shape, epd_external_input_t input);
/* fp32 scales per input row: the dispatch's (H/128 or 1) for fp8_group128 on an FP8 wire,
 * H/128 on a BF16 wire (quantized group128), 0 for the other formats. */
uint32_t epd_external_row_scales(const epd_moe_shape_t *shape, epd_external_input_t input);
/* The scale kind of the rows' scales before any requantization (as dispatched, or group128 for a
 * BF16 wire). */
epd_scale_kind_t epd_external_scale_kind(const epd_moe_shape_t *shape);

/* The top-k ids of the plan's records, [n_records][K] into ids (host memory), from records in
 * host memory. */
void epd_external_ids_host(const epd_moe_shape_t *shape, const epd_external_plan_t *plan,
                           int32_t *ids);

/* row_of [n_records][K] (host memory; plan->row_of may be its ops-memory copy) from the records'
 * ids: the row of each (record, slot) whose expert is local, in record order within each expert
 * from plan->first_row. EPD_ERR_INTERNAL (err) when the ids do not hold expert_rows' rows. */
epd_status_t epd_external_map(const epd_moe_shape_t *shape, const epd_external_plan_t *plan,
                              const int32_t *ids, int32_t *row_of, char err[EPD_ERR_LEN]);

/* Host: writes each planned row into x_out (host memory, n_rows * row_bytes; rows a masked
 * layout leaves empty are not touched): FP8 bytes, BF16, or FP8 to be requantized, and its
 * fp32 scales into scales_out (n_rows * epd_external_row_scales, or for fp8_per_tensor the
 * pre-requantization scales, H/128 or 1 a row: scratch for epd_requant_host). */
epd_status_t epd_external_gather_host(const epd_moe_shape_t *shape, const epd_external_plan_t *plan,
                                      void *x_out, float *scales_out, char err[EPD_ERR_LEN]);

/* Host: the partial of every record from the worker's outputs y bf16 [n_rows, H] (host memory):
 * acc = 0; for k ascending with a local expert, acc = acc + w_k * y[row_of(j, k)] in fp32 (a
 * multiply, then an add), stored by epd_partial_store_host. With zero_only (the worker failed),
 * every partial is the zero row instead and y is not read. */
epd_status_t epd_external_partials_host(const epd_moe_shape_t *shape,
                                        const epd_external_plan_t *plan, const uint16_t *y,
                                        bool zero_only, char err[EPD_ERR_LEN]);

#ifdef EPD_HAVE_CUDA
/* CUDA twins (gpu/external_cuda.cu): the plan's segments, row_of and every output are device
 * memory; stream is a cudaStream_t. ids and gather/partials only enqueue (the caller syncs);
 * they give the host functions' bytes. */
epd_status_t epd_external_ids_cuda(const epd_moe_shape_t *shape, const epd_external_plan_t *plan,
                                   int32_t *ids_host, void *stream, char err[EPD_ERR_LEN]);
epd_status_t epd_external_gather_cuda(const epd_moe_shape_t *shape,
                                      const epd_external_plan_t *plan, void *x_out,
                                      float *scales_out, void *stream, char err[EPD_ERR_LEN]);
epd_status_t epd_external_partials_cuda(const epd_moe_shape_t *shape,
                                        const epd_external_plan_t *plan, const uint16_t *y,
                                        bool zero_only, void *stream, char err[EPD_ERR_LEN]);
#endif

#ifdef __cplusplus
}
#endif

#endif
