/* The ffn expert kind's weights and host arithmetic (DESIGN.md section 9): SwiGLU experts
 * y = down(silu(gate(x)) * up(x)) of every MoE layer, loaded from a safetensors checkpoint with
 * DeepSeek-V3's tensor names (or made up for the benchmark), only this rank's experts. The host
 * arithmetic here is the reference: fp32 values, products and sums in fp64. */
#ifndef EPD_GPU_FFN_H
#define EPD_GPU_FFN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "gpu/types.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EPD_FFN_BLOCK 128 /* the 128 x 128 weight blocks of weight_scale_inv */

typedef enum {
    EPD_FFN_BF16 = 0,  /* BF16 weights */
    EPD_FFN_FP8_BLOCK, /* e4m3 weights, fp32 scale per 128 x 128 block (weight_scale_inv) */
} epd_ffn_format_t;

/* One layer's weights of this rank's experts, host memory, 64-byte aligned:
 *   gate_up  [n_local][2I][H]: expert e's gate_proj rows, then its up_proj rows ([out, in]);
 *   down     [n_local][H][I];
 *   for FP8, gate_up_scale [n_local][2I/128][H/128] and down_scale [n_local][H/128][I/128];
 *   input_scale [n_local][2] (the gate/up and down input_scale), or NULL when the checkpoint
 *   has none: with one, the expert's activation is requantized to that static per-tensor scale
 *   (DESIGN.md section 3) before its GEMM. */
typedef struct epd_ffn_layer {
    uint32_t layer;
    void *gate_up;
    void *down;
    float *gate_up_scale;
    float *down_scale;
    float *input_scale;
} epd_ffn_layer_t;

typedef struct epd_ffn_weights {
    epd_ffn_format_t format;
    uint32_t hidden;       /* H */
    uint32_t intermediate; /* I, a multiple of 128 */
    uint32_t num_experts;  /* E of the model */
    uint32_t first_expert; /* this rank's experts: [first_expert, first_expert + n_local) */
    uint32_t n_local;
    uint32_t n_layers;
    epd_ffn_layer_t *layers; /* ascending layer number */
    uint64_t local_bytes;    /* weight and scale bytes of this rank's experts, all layers */
} epd_ffn_weights_t;

/* What to load. */
typedef struct epd_ffn_spec {
    const char *path;       /* experts.weights: a .safetensors file or a directory with an index */
    const uint32_t *layers; /* experts.layers, ascending; n_layers 0: every layer the file has */
    size_t n_layers;
    uint32_t hidden;       /* model.hidden */
    uint32_t intermediate; /* model.intermediate; 0: take it from the file */
    uint32_t num_experts;  /* model.num_experts */
    uint32_t first_expert;
    uint32_t n_local;
} epd_ffn_spec_t;

/* Loads this rank's experts of every layer (spec->layers, or all the file has): maps the files,
 * copies only the rank's tensors, checks each one's dtype and shape against H and I (gate/up
 * [I,H], down [H,I]; BF16, or F8_E4M3 with F32 weight_scale_inv [ceil(out/128), ceil(in/128)]),
 * and that every layer and expert has the same format. EPD_ERR_CONFIG for a missing, mis-shaped or
 * wrongly typed tensor or a layer that is not there, EPD_ERR_IO / EPD_ERR_BAD_TENSOR for an
 * unreadable file, each naming the file and tensor in err; EPD_ERR_NO_MEMORY naming the bytes.
 * Free with epd_ffn_free. */
epd_status_t epd_ffn_load(const epd_ffn_spec_t *spec, epd_ffn_weights_t **weights_p,
                          char err[EPD_ERR_LEN]);

/* Synthetic weights for the benchmark: n_layers layers (0, 1, ...) of n_local experts, values
 * from a fixed-seed generator with the spread of a trained layer (|w| about 1/sqrt(in)). */
epd_status_t epd_ffn_random(epd_ffn_format_t format, uint32_t hidden, uint32_t intermediate,
                            uint32_t num_experts, uint32_t first_expert, uint32_t n_local,
                            uint32_t n_layers, uint64_t seed, epd_ffn_weights_t **weights_p,
                            char err[EPD_ERR_LEN]);

void epd_ffn_free(epd_ffn_weights_t *weights);

/* Frees the host copies of the weights and scales (the arrays of every layer become NULL; the
 * layer numbers, shapes and local_bytes stay), once device ops hold their own copy: a rank of a
 * large model keeps no second copy in host memory. The host ops cannot use them after this. */
void epd_ffn_drop_host(epd_ffn_weights_t *weights);

/* The layer, or NULL when it was not loaded. */
const epd_ffn_layer_t *epd_ffn_find_layer(const epd_ffn_weights_t *weights, uint32_t layer);

/* The name of a format for logs: "bf16", "fp8-block". */
const char *epd_ffn_format_name(epd_ffn_format_t format);

/* One row as an expert sees it (section 9): for BF16 weights, x holds H fp32 values that are
 * BF16 numbers; for FP8 weights, q holds H e4m3 bytes and scales their H/128 group scales. */
typedef struct epd_ffn_row {
    const float *x;
    const uint8_t *q;
    const float *scales;
} epd_ffn_row_t;

/* Scratch of one epd_ffn_expert_host call, sized by epd_ffn_scratch_floats (fp32 count). */
size_t epd_ffn_scratch_floats(const epd_ffn_weights_t *weights);

/* y[H] = expert(x) of local expert e (0-based on this rank) of layer: gate and up in fp32 from
 * fp64 sums over fp32 (dequantized) products, h = silu(g) * u in fp32, rounded to BF16 (BF16
 * weights) or quantized group128 (FP8 down proj: e4m3 with the fp32 scale rule of section 3), then
 * down the same way. scratch: epd_ffn_scratch_floats floats. */
void epd_ffn_expert_host(const epd_ffn_weights_t *weights, const epd_ffn_layer_t *layer,
                         uint32_t e, const epd_ffn_row_t *row, float *scratch, float *y);

/* Quantizes n fp32 values (n a multiple of 128) to e4m3 with one fp32 scale per 128, by section
 * 3's rule (amax floor 1e-4, q = e4m3(v * (448 / amax)), s = amax / 448). */
void epd_ffn_quant_f32_host(const float *v, uint32_t n, uint8_t *q, float *scales);

#ifdef __cplusplus
}
#endif

#endif
