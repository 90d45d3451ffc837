/* The value types gpu/ owns: wire and combine dtypes, scale kind and format, expert kind and
 * device backend.
 * config/ stores values of these types (config/config.h includes this header); gpu/ takes them
 * as plain values and never includes config/. */
#ifndef EPD_GPU_TYPES_H
#define EPD_GPU_TYPES_H

typedef enum { EPD_WIRE_FP8 = 0, EPD_WIRE_BF16 } epd_wire_dtype_t;
/* combine.dtype: the partials' wire format (BF16 first, so a zeroed shape combines in BF16) */
typedef enum { EPD_COMBINE_BF16 = 0, EPD_COMBINE_FP8 } epd_combine_dtype_t;
typedef enum { EPD_SCALE_GROUP128 = 0, EPD_SCALE_PER_TOKEN } epd_scale_kind_t;
typedef enum { EPD_SCALE_FMT_FP32 = 0, EPD_SCALE_FMT_UE8M0 } epd_scale_fmt_t;
typedef enum {
    EPD_EXPERTS_IDENTITY = 0,
    EPD_EXPERTS_SCALE,
    EPD_EXPERTS_FFN,
    EPD_EXPERTS_EXTERNAL /* a frontend's worker runs them (daemon/external.h) */
} epd_expert_kind_t;
/* experts.external_input: what the external worker's input region holds (DESIGN.md section 9) */
typedef enum {
    EPD_EXTERNAL_FP8_GROUP128 = 0, /* e4m3 bytes + the dispatch's fp32 scales */
    EPD_EXTERNAL_BF16,             /* bf16 rows (FP8 dequantized and rounded to BF16) */
    EPD_EXTERNAL_FP8_PER_TENSOR    /* e4m3 requantized to one scale S */
} epd_external_input_t;
/* experts.external_layout: rows of one expert back to back, or a fixed capacity per expert */
typedef enum { EPD_EXTERNAL_PACKED = 0, EPD_EXTERNAL_MASKED } epd_external_layout_t;
typedef enum { EPD_BACKEND_AUTO = 0, EPD_BACKEND_CUDA, EPD_BACKEND_CPU } epd_backend_t;

#endif
