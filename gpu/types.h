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
typedef enum { EPD_EXPERTS_IDENTITY = 0, EPD_EXPERTS_SCALE } epd_expert_kind_t;
typedef enum { EPD_BACKEND_AUTO = 0, EPD_BACKEND_CUDA, EPD_BACKEND_CPU } epd_backend_t;

#endif
