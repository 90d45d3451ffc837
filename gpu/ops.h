/* Device operations behind one interface (DESIGN.md section 1): a host implementation (the
 * reference and the CPU fallback, the .c files of gpu/) and a CUDA one (its .cu files) that
 * give identical bytes.
 * Nothing outside gpu/ includes a CUDA header; the engine sees only this table.
 *
 * Memory: every pointer an op takes is "ops memory" (device memory for cuda, host memory for
 * host) unless its name ends in _host. Ops are asynchronous on the implementation's stream;
 * epd_ops_t.sync waits for them. */
#ifndef EPD_GPU_OPS_H
#define EPD_GPU_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "gpu/ffn.h"
#include "gpu/types.h"

/* The shape of one MoE layer as the step sees it. */
typedef struct epd_moe_shape {
    uint32_t hidden;      /* H, multiple of 128 */
    uint32_t topk;        /* K */
    uint32_t num_experts; /* E */
    uint32_t world;       /* W ranks; rank r owns experts [r*E/W, (r+1)*E/W) */
    uint32_t rank;
    epd_wire_dtype_t dtype;
    epd_scale_kind_t scale;
    epd_scale_fmt_t scale_format;
    epd_expert_kind_t expert_kind;
    /* combine.dtype: BF16 partials, or FP8 with group128 fp32 scales (DESIGN.md section 3) */
    epd_combine_dtype_t combine_dtype;
    /* telemetry.quant_error: pack and the FP8 partials sum their quantization error into the
     * context (quant_error_take); false costs nothing */
    bool quant_error;
    uint32_t layer;       /* the MoE layer of the step being run (DESIGN.md section 5): set by
                           * epd_step_set_layer, 0 until then; the experts of that layer run */
} epd_moe_shape_t;

/* The sharding rule (DESIGN.md section 2 step 3), the one place it is checked: E experts split
 * evenly over W ranks (W > 0, E % W == 0). EPD_OK, or EPD_ERR_INVALID_ARG with "num_experts = E
 * is not a multiple of the W ranks (each rank owns E/W experts)" in err. */
epd_status_t epd_moe_experts_check(uint32_t num_experts, uint32_t world, char err[EPD_ERR_LEN]);

/* Checks what every op and the step rely on: hidden a positive multiple of 128, topk and experts
 * positive, rank < world, epd_moe_experts_check, and dtype, scales and expert kind known values.
 * EPD_OK, or EPD_ERR_INVALID_ARG with a sentence in err. */
epd_status_t epd_moe_shape_check(const epd_moe_shape_t *shape, char err[EPD_ERR_LEN]);

/* An expert kind (experts.kind, DESIGN.md section 9) on the host: what expert e does to a row.
 * The host ops and epd_moe_reference both go through it; the CUDA ops keep a twin table of
 * kernels (gpu/ops_cuda.cu) with the same names. A new kind is one entry in each. */
typedef struct epd_expert_ops {
    const char *name; /* experts.kind's value: "identity", "scale", "ffn", "external" */
    epd_expert_kind_t kind;
    /* The kind's experts are weights (epd_ffn_weights_t) given to the ops by experts_load, per
     * layer; accumulate and element are NULL: the ops run the kind's own arithmetic (gpu/ffn.h). */
    bool weights;
    /* The kind's experts run outside the daemon, in a frontend's worker (experts.kind external,
     * daemon/external.h): the step hands its records to a hook instead of the experts op, and
     * accumulate and element are NULL. */
    bool external;
    /* acc[i] = acc[i] + w * expert_e(x)[i] for i < shape->hidden, in fp32: a multiply, then an
     * add, never fused. x and acc are host memory of hidden floats. */
    void (*accumulate)(const epd_moe_shape_t *shape, int32_t e, float w, const float *x,
                       float *acc);
    /* expert_e(x)[i] of one element, for the reference's element-by-element formulation; the
     * same fp32 operations as accumulate's, so the two agree bit for bit. */
    float (*element)(const epd_moe_shape_t *shape, int32_t e, float x);
} epd_expert_ops_t;

/* The layout of DESIGN.md section 2 step 3 computed on the host from host ids [n, K]: slot
 * [n * W] (host memory), per-destination counts and offsets and the record total, and, when
 * expert_counts is not NULL, the tokens naming each expert [E] (epd_step_layout_t's
 * expert_counts_host). The ops' layout op gives the same; the step uses this when the ids are on
 * the host already, sparing the device a layout and its read-back. EPD_ERR_EXPERT_OUT_OF_RANGE
 * (with err) for an id outside [-1, E). */
epd_status_t epd_layout_host(const epd_moe_shape_t *shape, uint32_t n, const int32_t *topk_ids,
                             int32_t *slot, uint32_t *send_counts, uint32_t *send_offsets,
                             uint32_t *expert_counts, uint32_t *n_send_p, char err[EPD_ERR_LEN]);

/* The host expert kinds, by kind value and by name; NULL when there is none. */
const epd_expert_ops_t *epd_expert_ops_find(epd_expert_kind_t kind);
const epd_expert_ops_t *epd_expert_ops_find_name(const char *name);

/* Byte offsets inside one dispatch record (DESIGN.md section 2 step 4). */
typedef struct epd_record_layout {
    size_t payload; /* H bytes of e4m3 or 2H bytes of BF16, at offset 0 */
    size_t scales;  /* fp32: H/128 (group128) or 1 (per_token) for FP8; none for BF16 */
    size_t ids;     /* K int32 top-k ids (-1 = empty slot) */
    size_t weights; /* K fp32 */
    size_t src;     /* uint32 token index in the source rank's step */
    size_t n_scales;
    size_t size;    /* whole record, a multiple of 16 */
} epd_record_layout_t;

void epd_record_layout(const epd_moe_shape_t *shape, epd_record_layout_t *layout_p);

/* Byte offsets inside one partial (a record of the combine, DESIGN.md section 2 step 6): 2H
 * bytes of BF16, or with combine.dtype fp8, H bytes of e4m3 then H/128 fp32 group scales; the
 * whole padded to 16 bytes. */
typedef struct epd_partial_layout {
    size_t payload; /* 0 */
    size_t scales;  /* FP8: H; BF16: 2H (none) */
    size_t n_scales;
    size_t size;    /* a multiple of 16 */
} epd_partial_layout_t;

void epd_partial_layout(const epd_moe_shape_t *shape, epd_partial_layout_t *layout_p);

/* One partial from its fp32 sum acc[H] (host memory) into out (a partial of
 * epd_partial_layout): bf16 nearest even, or FP8 quantized group128 with fp32 scales exactly as
 * dispatch quantizes a row. When error_p is not NULL, adds sum (acc - dequant)^2 to error_p[0]
 * and sum acc^2 to error_p[1] (FP8 only). Every host experts kind ends with it. */
void epd_partial_store_host(const epd_moe_shape_t *shape, const float *acc, uint8_t *out,
                            double *error_p);

/* Adds partial p (a partial of epd_partial_layout) to acc[H] in fp32: acc = acc + bf16 value, or
 * acc = acc + (float)q * s for FP8. */
void epd_partial_add_host(const epd_moe_shape_t *shape, const uint8_t *p, float *acc);

/* The quantization error telemetry (telemetry.quant_error) since the last quant_error_take: the
 * sums whose ratio is the relative RMS error, sqrt(err2 / ref2), of what a rank quantized. */
typedef struct epd_quant_error {
    double dispatch_err2; /* sum over the packed FP8 records of (x - dequant(q))^2 */
    double dispatch_ref2; /* ... of x^2 */
    double combine_err2;  /* the same over the FP8 partials the experts wrote */
    double combine_ref2;
} epd_quant_error_t;

/* The layout of one step on the source side: which ranks each token goes to, and where. */
typedef struct epd_step_layout {
    uint32_t n_tokens;
    uint32_t *send_counts_host; /* [W] records per destination rank */
    uint32_t *send_offsets_host;/* [W] first record of each destination (exclusive prefix sum) */
    uint32_t n_send;            /* total records */
    int32_t *slot;              /* ops memory, [N*W]: record index of (token, rank), or -1 */
    /* [E] host memory or NULL: tokens naming each expert, i.e. the rows each expert's owner will
     * run for this rank's records (ids distinct per token); valid with the counts
     * (layout_counts). They travel with the count exchange, so the experts op knows its rows
     * per expert without reading them back from the device. */
    uint32_t *expert_counts_host;
    /* [W] host memory (pinned for cuda) or NULL: with FP8, pack raises entry r to the largest
     * scale of the records it writes for rank r (the caller zeroes it first; cuda: the values
     * land with the ops' next sync). The step's scale exchange (DESIGN.md section 3). */
    float *scale_max_host;
    /* [N*W] alloc_host memory or NULL: slots made on the host (epd_layout_host) that pack reads
     * there instead of from slot, leaving a copy in slot for the ops after it (combine). Only
     * with epd_ops_t.pack_reads_host; it spares the step the slots' own upload. */
    const int32_t *slot_src_host;
} epd_step_layout_t;

typedef struct epd_ops_ctx epd_ops_ctx_t;
typedef struct epd_ops_event epd_ops_event_t; /* completion marker of async copies (optional hooks) */

typedef struct epd_ops {
    const char *name; /* "host" or "cuda" */
    /* Ops memory is device memory, not addressable by the host (false: plain host memory). */
    bool device_memory;
    /* pack accepts topk_ids, topk_weights and layout->slot_src_host in alloc_host memory (cuda:
     * page-locked and mapped, read over the bus by the pack kernel): the step's small inputs
     * then need no copies of their own, each of which costs a launch. */
    bool pack_reads_host;

    epd_status_t (*init)(int device_id, epd_ops_ctx_t **ctx_p, char err[EPD_ERR_LEN]);
    void (*fini)(epd_ops_ctx_t *ctx);

    /* Ops memory and pinned (page-locked) host memory; NULL on failure. */
    void *(*alloc)(epd_ops_ctx_t *ctx, size_t bytes);
    void (*free)(epd_ops_ctx_t *ctx, void *ptr);
    void *(*alloc_host)(epd_ops_ctx_t *ctx, size_t bytes);
    void (*free_host)(epd_ops_ctx_t *ctx, void *ptr);
    epd_status_t (*copy_to_ops)(epd_ops_ctx_t *ctx, void *dst, const void *src_host, size_t bytes);
    epd_status_t (*copy_to_host)(epd_ops_ctx_t *ctx, void *dst_host, const void *src, size_t bytes);
    epd_status_t (*sync)(epd_ops_ctx_t *ctx);

    /* Layout: from topk_ids [N,K] (ops memory) fills layout->slot, then the counts, offsets and
     * n_send on the host. A token goes once to each rank that owns one of its experts, in token
     * order within a rank. It may return before the host fields are filled (cuda queues its
     * kernels and the read-back of the counts): ops queued after it (pack) see the slots, and
     * layout_counts waits for the rest. So pack can run while the counts are exchanged. */
    epd_status_t (*layout)(epd_ops_ctx_t *ctx, const epd_moe_shape_t *shape, const int32_t *topk_ids,
                           epd_step_layout_t *layout);
    /* Completes the last layout: send_counts_host, send_offsets_host and n_send are valid when it
     * returns EPD_OK. Ids outside [-1, E) give EPD_ERR_EXPERT_OUT_OF_RANGE here (or from layout);
     * the slots are then all -1, so a pack queued in between wrote nothing. */
    epd_status_t (*layout_counts)(epd_ops_ctx_t *ctx, const epd_moe_shape_t *shape,
                                  epd_step_layout_t *layout);

    /* Pack (quantizing for FP8) x bf16 [N,H], ids, weights into records at send_buf, record index
     * from layout->slot (or layout->slot_src_host, see there). One pass over x. Needs
     * layout->n_tokens and slot, not the counts. With
     * shape->quant_error and FP8, the error of each record (a token once per destination) is
     * added to the context's sums (quant_error_take). */
    epd_status_t (*pack)(epd_ops_ctx_t *ctx, const epd_moe_shape_t *shape, const uint16_t *x,
                         const int32_t *topk_ids, const float *topk_weights,
                         const epd_step_layout_t *layout, void *send_buf);

    /* Experts of layer: for each of n_records received records, the fp32 sum over ascending k
     * with a local expert of w_k * expert(x') (no FMA), stored as a partial (epd_partial_layout:
     * bf16, or FP8 group128 with combine.dtype fp8) at partials + j * partial size. The toy kinds
     * ignore layer; ffn fails with EPD_ERR_INVALID_ARG on a layer experts_load did not give.
     * expert_rows_host: [E/W] rows per local expert among these records (from the count
     * exchange), or NULL: the op counts them itself (cuda then waits for a read-back). Counts
     * that disagree with the records are EPD_ERR_INTERNAL. With shape->quant_error and FP8
     * partials, their error is added to the context's sums (every kind, ffn included). */
    epd_status_t (*experts)(epd_ops_ctx_t *ctx, const epd_moe_shape_t *shape, uint32_t layer,
                            const void *recv_buf, uint32_t n_records,
                            const uint32_t *expert_rows_host, void *partials);
    /* Gives ctx the ffn weights of this rank's experts (all layers), checked against shape (H,
     * the rank's expert range). Host ops keep the pointer (the weights stay the caller's and must
     * outlive ctx's use of them); cuda copies them to the device, where EPD_ERR_NO_MEMORY names
     * the bytes short. Called once, before the first step. */
    epd_status_t (*experts_load)(epd_ops_ctx_t *ctx, const epd_moe_shape_t *shape,
                                 const epd_ffn_weights_t *weights, char err[EPD_ERR_LEN]);

    /* Combine: partials_back holds the partial of record slot[t*W+r] at that index; y[t] =
     * bf16(sum over ascending r of the partial, dequantized to fp32 when FP8), zeros for tokens
     * with no destination. */
    epd_status_t (*combine)(epd_ops_ctx_t *ctx, const epd_moe_shape_t *shape,
                            const epd_step_layout_t *layout, const void *partials_back,
                            uint16_t *y);

    /* The telemetry sums since the last call (waiting for the ops queued before it), then zeroes
     * them. All zero when nothing was quantized or shape->quant_error was off. */
    epd_status_t (*quant_error_take)(epd_ops_ctx_t *ctx, epd_quant_error_t *error_p);

    /* Optional hooks for transports (NULL where an implementation has none; callers check).
     * stream: the implementation's stream (a cudaStream_t as void *) for NCCL to enqueue on.
     * The async copies run on the implementation's copy queues, NOT ordered after work queued on
     * its stream (call sync first); when `done` is not NULL it is recorded after the copy, so
     * event_query/event_wait tell when that copy (and the earlier ones of its queue) finished.
     * copy_to_host_async: ops -> pinned host; copy_to_ops_async: pinned host -> ops;
     * copy_ops_to_ops_async: ops -> ops (same device). */
    void *(*stream)(epd_ops_ctx_t *ctx);
    epd_status_t (*event_create)(epd_ops_ctx_t *ctx, epd_ops_event_t **event_p);
    void (*event_destroy)(epd_ops_ctx_t *ctx, epd_ops_event_t *event);
    /* EPD_OK when the work before the event has finished, EPD_ERR_AGAIN while it has not. */
    epd_status_t (*event_query)(epd_ops_ctx_t *ctx, epd_ops_event_t *event);
    epd_status_t (*event_wait)(epd_ops_ctx_t *ctx, epd_ops_event_t *event);
    epd_status_t (*copy_to_host_async)(epd_ops_ctx_t *ctx, void *dst_host, const void *src,
                                       size_t bytes, epd_ops_event_t *done);
    epd_status_t (*copy_to_ops_async)(epd_ops_ctx_t *ctx, void *dst, const void *src_host,
                                      size_t bytes, epd_ops_event_t *done);
    epd_status_t (*copy_ops_to_ops_async)(epd_ops_ctx_t *ctx, void *dst, const void *src,
                                          size_t bytes, epd_ops_event_t *done);
    /* Optional: a sentence about the last failed op of ctx (e.g. the CUDA error string), "" when
     * none; owned by ctx, valid until its next op. For the daemon's abort message. */
    const char *(*last_error)(epd_ops_ctx_t *ctx);

    /* Optional stream-ordered copies (NULL: use copy_to_ops / copy_to_host): queued on the
     * stream with the ops, any direction (ops memory or host memory on either side), complete at
     * the next sync. The host side must stay unchanged (upload) or unread (download) until then;
     * pinned host memory makes them DMA. */
    epd_status_t (*copy_queued)(epd_ops_ctx_t *ctx, void *dst, const void *src, size_t bytes);

    /* Shared regions (DESIGN.md section 4b), optional: NULL where an implementation has none
     * (the host ops: host regions need no page-locking, device ones cannot be opened). Called
     * from the loop thread while a step may run; each says why it failed in err.
     * host_register page-locks host memory for DMA; ipc_open opens another process's device
     * allocation from its 64-byte cudaIpcMemHandle_t on this device (a handle of another device
     * is refused), giving its base and size (0 when unknown). */
    epd_status_t (*host_register)(epd_ops_ctx_t *ctx, void *ptr, size_t bytes,
                                  char err[EPD_ERR_LEN]);
    void (*host_unregister)(epd_ops_ctx_t *ctx, void *ptr);
    epd_status_t (*ipc_open)(epd_ops_ctx_t *ctx, const uint8_t handle[64], void **base_p,
                             uint64_t *size_p, char err[EPD_ERR_LEN]);
    void (*ipc_close)(epd_ops_ctx_t *ctx, void *base);
    /* Ingest of device tensors (loop thread, on a queue of its own, one round trip): copies
     * a_bytes at a and b_bytes at b (device memory; NULL: skipped) to a_dst and b_dst (host), and
     * when x is not NULL finds the first bf16 of x[x_n] that is Inf or NaN (*x_bad_p; -1: none). */
    epd_status_t (*ingest_fetch)(epd_ops_ctx_t *ctx, const void *a, size_t a_bytes, void *a_dst,
                                 const void *b, size_t b_bytes, void *b_dst, const uint16_t *x,
                                 uint64_t x_n, int64_t *x_bad_p, char err[EPD_ERR_LEN]);
    /* Optional (loop thread): scans bf16 x[x_n] in HOST memory for the first Inf or NaN
     * (*x_bad_p; -1: none) with the device, which reads it where it is, when x is page-locked
     * memory the device can map (a page-locked payload, a registered host region): one pass over
     * the bus instead of one on a CPU core. When x_copy_p is not NULL the same pass leaves a copy
     * of x in new ops memory, *x_copy_p (NULL when there was no memory for it: the scan still
     * holds), which the caller gives back with ingest_free once the step that reads it is done.
     * EPD_ERR_AGAIN when x is not such memory (scan it on the host), another code with err when
     * the device failed. */
    epd_status_t (*ingest_scan_host)(epd_ops_ctx_t *ctx, const uint16_t *x, uint64_t x_n,
                                     int64_t *x_bad_p, void **x_copy_p, char err[EPD_ERR_LEN]);
    /* Gives back a copy of ingest_scan_host (NULL: nothing); any thread. */
    void (*ingest_free)(epd_ops_ctx_t *ctx, void *copy);
    /* Optional: the address at which the ops' kernels read and write host memory `host` (bytes
     * of it), when it is page-locked and mapped (a pinned-pool block, a registered host region);
     * NULL when it is not, or the ops have no device. The step then writes y there directly. */
    void *(*host_mapped)(epd_ops_ctx_t *ctx, void *host, size_t bytes);
} epd_ops_t;

extern const epd_ops_t epd_ops_host;
#ifdef EPD_HAVE_CUDA
extern const epd_ops_t epd_ops_cuda;
#endif

/* The single-process reference of DESIGN.md section 2 on host memory: what W ranks produce for
 * x [N,H], ids and weights [N,K] (FP8 combine included: each owner rank's partial quantized and
 * dequantized). y is bf16 [N,H]. For the toy kinds only (ffn: the next). */
epd_status_t epd_moe_reference(const epd_moe_shape_t *shape, uint32_t n_tokens, const uint16_t *x,
                               const int32_t *topk_ids, const float *topk_weights, uint16_t *y);

/* The same for every kind: ffn experts of layer from weights, which hold ALL E experts
 * (first_expert 0, n_local E) whatever shape->world is; weights NULL for the toy kinds. Each
 * owner rank's partial uses the ffn host arithmetic (the ops' own: exact equality holds from the
 * expert outputs onward, DESIGN.md section 2). EPD_ERR_INVALID_ARG for a layer weights lack. */
epd_status_t epd_moe_reference_layer(const epd_moe_shape_t *shape, const epd_ffn_weights_t *weights,
                                     uint32_t layer, uint32_t n_tokens, const uint16_t *x,
                                     const int32_t *topk_ids, const float *topk_weights,
                                     uint16_t *y);

#endif
