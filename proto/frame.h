/* Wire protocol v1 (DESIGN.md section 4): the 24-byte frame header, an incremental decoder that
 * turns any split of a byte stream into whole frames, safetensors-style tensor descriptors, full
 * validation of SUBMIT frames, and encoders for every frame type. Shared by the daemon and libepd;
 * a leaf module: it never logs, it returns a status and fills err[EPD_ERR_LEN]. */
#ifndef EPD_PROTO_FRAME_H
#define EPD_PROTO_FRAME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/status.h"

#define EPD_FRAME_MAGIC "EPD1"
#define EPD_FRAME_VERSION 1
#define EPD_FRAME_HEADER_LEN 24
#define EPD_FRAME_MAX_META 65536u /* the protocol's bound on meta_len */

typedef enum {
    EPD_FRAME_SUBMIT = 1,
    EPD_FRAME_RESULT = 2,
    EPD_FRAME_ERROR = 3,
    EPD_FRAME_CONTROL = 4,
    EPD_FRAME_REPLY = 5,
    EPD_FRAME_EXPERTS = 6,      /* daemon -> external expert worker (DESIGN.md section 9) */
    EPD_FRAME_EXPERTS_DONE = 7, /* worker -> daemon */
} epd_frame_type_t;

/* "submit", "result", ...; "unknown" for anything else. */
const char *epd_frame_type_name(int type);

/* The header fields as they travel (little-endian on the wire). */
typedef struct epd_frame_header {
    uint16_t version;
    uint16_t type;
    uint32_t meta_len;
    uint32_t reserved;
    uint64_t payload_len;
} epd_frame_header_t;

/* Writes the 24 header bytes (magic, version 1, reserved 0). */
void epd_frame_header_encode(epd_frame_type_t type, uint32_t meta_len, uint64_t payload_len,
                             uint8_t out[EPD_FRAME_HEADER_LEN]);

/* Checks 24 header bytes in this order: magic (bad_magic), version (bad_version), type in 1..7
 * (bad_type), reserved == 0 (bad_header), meta_len <= max_meta (frame_too_large), meta_len >= 2
 * (bad_json: meta must be a JSON object), payload_len <= max_payload (frame_too_large).
 * Nothing is allocated. */
epd_status_t epd_frame_header_decode(const uint8_t in[EPD_FRAME_HEADER_LEN], uint64_t max_payload,
                                     uint32_t max_meta, epd_frame_header_t *header_p,
                                     char err[EPD_ERR_LEN]);

/* What the decoder found under the meta's top-level "id" key. The id is read from the JSON text
 * itself, so every uint64 is exact (a double would lose ids above 2^53). */
typedef enum {
    EPD_FRAME_ID_ABSENT = 0, /* no "id" key */
    EPD_FRAME_ID_NULL,       /* "id": null (ERROR frames about no request) */
    EPD_FRAME_ID_VALID,      /* a JSON integer literal in [0, 2^64) */
    EPD_FRAME_ID_INVALID,    /* anything else: negative, fraction, exponent, string, ... */
} epd_frame_id_kind_t;

/* One decoded frame. meta and payload are owned by the frame; release with epd_frame_free.
 * payload comes from malloc, or from the decoder's allocator (epd_decoder_set_alloc) when it has
 * one (16-byte aligned either way), and is NULL when payload_len is 0; a caller may take it over
 * by setting frame->payload = NULL before epd_frame_free, and then releases it with
 * payload_release (free when NULL). */
typedef struct epd_frame {
    epd_frame_type_t type;
    uint32_t meta_len;
    uint64_t payload_len;
    cJSON *meta;  /* a JSON object; NULL for the types kept as text (epd_decoder_keep_text) */
    bool meta_arena; /* meta is the decoder's one-block tree (epd_json_build_arena): read it, add
                      * nothing to it; epd_frame_free frees it */
    char *meta_text; /* those types' meta, checked strict JSON, NUL-terminated (meta_len bytes) */
    uint8_t *payload;
    epd_frame_id_kind_t id_kind;
    uint64_t id;  /* meaningful when id_kind == EPD_FRAME_ID_VALID */
    bool dropped; /* the decoder's admit callback refused it: payload read and thrown away */
    void (*payload_release)(void *payload); /* how payload is given back; NULL: free */
} epd_frame_t;

/* Frees meta and payload and zeroes the frame; safe on a zeroed frame and on NULL. */
void epd_frame_free(epd_frame_t *frame);

/* The frame's meta as a tree of the caller's (free it with cJSON_Delete), the frame left without
 * one; NULL when it had none or without memory (a decoder's tree is copied out of its block). */
cJSON *epd_frame_take_meta(epd_frame_t *frame);

/* Incremental decoder: one per connection. The struct is public so it can be embedded; touch it
 * only through the functions below. */
typedef enum {
    EPD_DECODER_HEADER = 0, /* collecting the 24 header bytes */
    EPD_DECODER_META,       /* collecting meta_len bytes of JSON */
    EPD_DECODER_PAYLOAD,    /* collecting payload_len bytes */
    EPD_DECODER_FAILED,     /* a framing error was found; sticky until reset */
} epd_decoder_state_t;

/* Asked once a frame's meta is parsed, before any payload byte is kept: false makes the decoder
 * read the payload and throw it away, then hand over the frame with payload NULL and dropped set
 * (e.g. the daemon's socket.max_buffered_bytes, all connections together). */
typedef bool (*epd_decoder_admit_fn)(void *arg, const epd_frame_header_t *header);

/* Where a decoder keeps payloads: resize is realloc's contract (p may be NULL; the first keep
 * bytes move; NULL without memory, p untouched), release gives a buffer back. */
typedef struct epd_payload_alloc {
    void *(*resize)(void *arg, void *p, size_t keep, size_t bytes);
    void (*release)(void *p);
    void *arg;
} epd_payload_alloc_t;

typedef struct epd_decoder {
    uint64_t max_payload;
    uint32_t max_meta;
    epd_decoder_state_t state;
    uint8_t head[EPD_FRAME_HEADER_LEN];
    size_t head_have;
    epd_frame_header_t header;
    char *meta_text;        /* meta_len + 1 bytes (NUL-terminated) while collecting */
    size_t meta_have;
    epd_frame_t frame;      /* the frame being built (meta parsed once its text is complete) */
    uint64_t payload_have;
    uint64_t payload_cap;   /* grows geometrically up to payload_len as bytes arrive */
    epd_status_t failure;   /* the sticky framing error in EPD_DECODER_FAILED */
    epd_decoder_admit_fn admit; /* NULL: every frame is admitted */
    void *admit_arg;
    const epd_payload_alloc_t *alloc; /* NULL: malloc */
    uint32_t text_types;    /* bit t: frames of type t keep their meta as text */
} epd_decoder_t;

/* Sets up a decoder. max_payload is socket.max_frame_bytes; max_meta is at most
 * EPD_FRAME_MAX_META (larger values are lowered to it). */
void epd_decoder_init(epd_decoder_t *dec, uint64_t max_payload, uint32_t max_meta);

/* Sets the admit callback (NULL: admit all); kept across epd_decoder_reset. */
void epd_decoder_set_admit(epd_decoder_t *dec, epd_decoder_admit_fn admit, void *arg);

/* Sets where payloads are kept (NULL: malloc); the table must outlive the decoder's frames.
 * Kept across epd_decoder_reset. */
void epd_decoder_set_alloc(epd_decoder_t *dec, const epd_payload_alloc_t *alloc);

/* Frames of the types in type_mask (bit t for type t) get their meta as text (frame->meta_text,
 * frame->meta NULL), checked exactly as the others, for a caller that reads it faster than
 * through the tree (libepd's EXPERTS). Kept across epd_decoder_reset. */
void epd_decoder_keep_text(epd_decoder_t *dec, uint32_t type_mask);

/* Frees any partial frame; the decoder can be initialized again or dropped. */
void epd_decoder_free(epd_decoder_t *dec);

/* Discards any partial frame and any failure, back to waiting for a header. */
void epd_decoder_reset(epd_decoder_t *dec);

/* Feeds len bytes of the stream (any split, one byte at a time included). Consumes bytes up to the
 * end of at most one frame and sets *used_p to how many it took. Returns:
 *   EPD_OK        a whole frame is in *frame_p (ownership passes to the caller; free it with
 *                 epd_frame_free); feed the remaining len - *used_p bytes again;
 *   EPD_ERR_AGAIN every byte was taken (*used_p == len) and no frame is complete yet;
 *   a framing error (bad_magic, bad_version, bad_type, bad_header, frame_too_large, bad_json) with
 *                 a sentence in err; the decoder stays failed and returns the same code until
 *                 reset. The header is checked before anything is allocated; meta is parsed (and
 *                 rejected) as soon as it is complete, before the payload arrives.
 *   EPD_ERR_NO_MEMORY when a buffer could not be allocated (the decoder is failed as well).
 * *frame_p is written only on EPD_OK. */
epd_status_t epd_decoder_feed(epd_decoder_t *dec, const void *data, size_t len, size_t *used_p,
                              epd_frame_t *frame_p, char err[EPD_ERR_LEN]);

/* The direct read of a payload (one copy: socket -> payload, not socket -> buffer -> payload).
 * While the decoder collects the payload of an admitted frame (its header and meta taken, not
 * dropped), sets *ptr_p to where the payload's next byte goes and *len_p to how many bytes fit
 * there, at most the rest of the payload; the caller reads into it and accounts what it read with
 * epd_decoder_payload_commit. The buffer is allocated or grown as epd_decoder_feed grows it:
 * whole at once for payloads up to 4 MiB, else from 64 KiB doubling as bytes arrive (a peer that
 * claims a large payload and sends little holds little), so a window can be smaller than the rest
 * of the payload. Anywhere else (between frames, in a header or meta, a dropped frame) *len_p is 0
 * and *ptr_p NULL: feed the bytes instead. Feeding and windows mix freely within a frame.
 * Returns EPD_OK, the sticky failure of a failed decoder (as feed does), or EPD_ERR_NO_MEMORY
 * when the buffer could not be grown (the decoder is failed then). */
epd_status_t epd_decoder_payload_window(epd_decoder_t *dec, void **ptr_p, size_t *len_p,
                                        char err[EPD_ERR_LEN]);

/* Accounts got bytes read into the window the last epd_decoder_payload_window gave (got at most
 * its len; 0 is allowed). Returns EPD_OK when that completes the payload: the whole frame is in
 * *frame_p, as epd_decoder_feed hands it out, and the decoder waits for the next header;
 * EPD_ERR_AGAIN when more payload is due; EPD_ERR_INVALID_ARG (decoder unchanged) when there is no
 * window or got exceeds it. *frame_p is written only on EPD_OK. */
epd_status_t epd_decoder_payload_commit(epd_decoder_t *dec, size_t got, epd_frame_t *frame_p,
                                        char err[EPD_ERR_LEN]);

/* True between frames (no partial frame held): a peer that closes now closed cleanly. */
bool epd_decoder_idle(const epd_decoder_t *dec);

/* Decodes exactly one whole frame from buf[len] (convenience around the decoder). Returns the
 * decoder's codes; a buffer that ends early is bad_json ("truncated"), extra bytes after the frame
 * are bad_header. */
epd_status_t epd_frame_decode(const void *buf, size_t len, uint64_t max_payload,
                              epd_frame_t *frame_p, char err[EPD_ERR_LEN]);

/* Strict UTF-8 (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF): the offset
 * of the first byte that is not part of a valid sequence, or len when all of s[len] is valid. */
size_t epd_utf8_check(const uint8_t *s, size_t len);

/* ---- tensors (safetensors-style descriptors) ---- */

typedef enum {
    EPD_DTYPE_UNKNOWN = 0,
    EPD_DTYPE_BOOL, EPD_DTYPE_U8, EPD_DTYPE_I8, EPD_DTYPE_F8_E4M3, EPD_DTYPE_F8_E5M2,
    EPD_DTYPE_U16, EPD_DTYPE_I16, EPD_DTYPE_F16, EPD_DTYPE_BF16,
    EPD_DTYPE_U32, EPD_DTYPE_I32, EPD_DTYPE_F32,
    EPD_DTYPE_U64, EPD_DTYPE_I64, EPD_DTYPE_F64,
    EPD_DTYPE_MAX
} epd_dtype_t;

/* Parses a safetensors dtype name, case-insensitive ("bf16", "BF16", "f8_e4m3", ...);
 * EPD_DTYPE_UNKNOWN for anything else. */
epd_dtype_t epd_dtype_from_name(const char *name);
/* The lowercase name ("bf16"); "unknown" out of range. */
const char *epd_dtype_name(epd_dtype_t dtype);
/* Bytes per element; 0 for EPD_DTYPE_UNKNOWN. */
size_t epd_dtype_size(epd_dtype_t dtype);

/* A JSON number that is an exact integer in [0, 2^53] (every such double is exact): *out_p. */
bool epd_json_to_u64(const cJSON *item, uint64_t *out_p);

#define EPD_TENSOR_MAX_DIMS 8

/* One parsed descriptor. In the payload, [begin, end) are payload offsets; in a shared region
 * (DESIGN.md section 4b), [begin, end) are offsets into region `region`. */
typedef struct epd_tensor {
    epd_dtype_t dtype;
    uint32_t ndim;
    uint64_t shape[EPD_TENSOR_MAX_DIMS];
    uint64_t begin;
    uint64_t end;
    bool in_region;
    uint32_t region;
} epd_tensor_t;

/* Region tensors start at a multiple of this many bytes (kernels read rows with 16-byte loads). */
#define EPD_REGION_ALIGN 16u

/* Parses and checks one descriptor {"dtype", "shape", "data_offsets"} named `name` (for messages)
 * against a payload of payload_len bytes: known dtype, shape a list of at most
 * EPD_TENSOR_MAX_DIMS non-negative integers, data_offsets [begin, end] integers with
 * begin <= end <= payload_len, begin aligned to the dtype size, product(shape) * size == end-begin.
 * Or a region descriptor {"dtype", "shape", "region": R (u32), "offset": o (default 0)}: begin = o,
 * end = o + product(shape) * size (no overflow); whether the region holds it is the caller's
 * (bad_region). Both "region" and "data_offsets" is bad_tensor. Any failure is bad_tensor. An
 * unknown dtype name is bad_tensor; a known but unexpected one is the caller's
 * unsupported_dtype. */
epd_status_t epd_tensor_parse(const cJSON *desc, const char *name, uint64_t payload_len,
                              epd_tensor_t *tensor_p, char err[EPD_ERR_LEN]);

/* ---- SUBMIT validation ---- */

typedef struct epd_submit_limits {
    uint32_t hidden;      /* H: model.hidden */
    uint32_t topk;        /* K: model.topk */
    uint32_t num_experts; /* E: model.num_experts */
    uint32_t max_tokens;  /* dispatch.max_tokens_per_request */
    /* Whether the daemon serves `layer` (ffn experts serve the layers they loaded); NULL: every
     * layer is served (the toy expert kinds). */
    bool (*layer_known)(void *arg, uint32_t layer);
    void *layer_arg;
} epd_submit_limits_t;

/* What a region tensor resolves to (the daemon's region table fills it). */
typedef struct epd_region_span {
    void *ptr;    /* the tensor's first byte: host memory, or device memory when device */
    bool device;
    void *region; /* the region (opaque here): the caller takes a reference for the request */
} epd_region_span_t;

/* A connection's shared regions, for SUBMITs that name them (DESIGN.md section 4b). */
typedef struct epd_submit_regions {
    void *arg;
    /* Resolves bytes [begin, end) of region `id`: EPD_OK, or bad_region with a sentence (unknown
     * or released region, out of its bounds). */
    epd_status_t (*resolve)(void *arg, uint32_t id, uint64_t begin, uint64_t end,
                            epd_region_span_t *span_p, char err[EPD_ERR_LEN]);
    /* Device tensors, in one round trip: copies ids_bytes at ids and w_bytes at w (device
     * memory; a NULL source is skipped) to ids_dst and w_dst on the host, and, when x is not
     * NULL, finds the first bf16 of x[x_n] that is Inf or NaN (*x_bad_p, -1: none). NULL where
     * there is no device. */
    epd_status_t (*device_fetch)(void *arg, const void *ids, size_t ids_bytes, void *ids_dst,
                                 const void *w, size_t w_bytes, void *w_dst, const uint16_t *x,
                                 uint64_t x_n, int64_t *x_bad_p, char err[EPD_ERR_LEN]);
    /* A host x (in the payload or a host region) of at least EPD_SUBMIT_DEVICE_SCAN_BYTES,
     * scanned for Inf and NaN by the device (*x_bad_p, -1: none) where it is page-locked:
     * EPD_ERR_AGAIN when it is not, another code with err when the device failed; the codec
     * scans x itself after any code but EPD_OK. NULL: the codec scans every host x. Called with
     * scan_arg. */
    epd_status_t (*host_scan)(void *scan_arg, const uint16_t *x, uint64_t x_n, int64_t *x_bad_p,
                              char err[EPD_ERR_LEN]);
    void *scan_arg;
} epd_submit_regions_t;

/* A host x smaller than this is scanned by the codec whatever host_scan says: a device round trip
 * costs about what a core takes for 256 KiB. */
#define EPD_SUBMIT_DEVICE_SCAN_BYTES (256u * 1024u)

/* The tensors of a SUBMIT, in epd_submit_view_t.regions order. */
enum { EPD_SUBMIT_X = 0, EPD_SUBMIT_IDS, EPD_SUBMIT_WEIGHTS, EPD_SUBMIT_Y, EPD_SUBMIT_TENSORS };

/* Views into a validated SUBMIT: into the frame's payload (borrowed: they live as long as
 * frame->payload; it is malloc'ed and offsets are aligned to their dtype), into shared regions,
 * or into `owned`. */
typedef struct epd_submit_view {
    uint64_t id;
    uint32_t layer;               /* "layer", 0 when absent */
    uint32_t n_tokens;
    uint32_t hidden;
    uint32_t topk;
    const uint16_t *x;            /* bf16 bit patterns [N, H]; device memory when x_device */
    bool x_device;
    const int32_t *topk_ids;      /* [N, K], host (i64 ids narrowed, device ones read, in owned) */
    const float *topk_weights;    /* [N, K], host */
    uint16_t *y;                  /* bf16 [N, H] in a region, or NULL: y goes in the RESULT */
    bool y_device;
    uint32_t y_region;
    uint64_t y_offset;
    void *regions[EPD_SUBMIT_TENSORS]; /* each tensor's region (span.region), NULL in the payload */
    void *owned;                  /* malloc'ed host copies behind ids/weights, or NULL: the
                                   * caller frees it (also after an error) */
} epd_submit_view_t;

/* Validates a SUBMIT frame completely and fills *view_p. Codes (the first failing check wins;
 * descriptors, then layout, then shapes, then contents):
 *   bad_json            meta schema: "id" missing or not a non-negative integer, "tensors"
 *                       missing or not an object, "layer" present but not an integer in
 *                       [0, 2^31);
 *   unknown_layer       limits->layer_known says the daemon does not serve that layer;
 *   bad_tensor          a tensor missing, unknown name, malformed descriptor, unknown dtype name,
 *                       ndim != 2, offsets out of the payload / misaligned / overlapping, bytes of
 *                       the payload that no tensor describes, N = 0;
 *   unsupported_dtype   a known dtype that is not the expected one (x bf16, topk_ids i32,
 *                       topk_weights f32);
 *   shape_mismatch      the three tensors disagree on N, or H / K differ from the limits;
 *   too_many_tokens     N > limits->max_tokens;
 *   expert_out_of_range an id not in [0, E) and not -1;
 *   invalid_topk        a token with the same expert id twice (-1 may repeat);
 *   non_finite_input    a weight that is Inf or NaN (every slot, -1 slots included), then a
 *                       value of x that is Inf or NaN (bf16 exponent all ones).
 * Whenever the frame's id is valid, view_p->id holds it (also on errors), so the caller can answer
 * ERROR with that id. EPD_ERR_INVALID_ARG if the frame is not a SUBMIT (or H or K is 0);
 * EPD_ERR_NO_MEMORY if the duplicate check's bitmap (E > 4096 bits) cannot be allocated. */
epd_status_t epd_submit_validate(const epd_frame_t *frame, const epd_submit_limits_t *limits,
                                 epd_submit_view_t *view_p, char err[EPD_ERR_LEN]);

/* The same with tensors in shared regions allowed (regions NULL: a region tensor is bad_region).
 * A region tensor must start at a multiple of EPD_REGION_ALIGN bytes and lie inside its region
 * (bad_region); "y" (bf16 [N, H]) may only be a region tensor; topk_ids may be i64 (each value in
 * [0, E) or -1, else expert_out_of_range). Payload tensors must tile the payload as before, and
 * with every tensor in regions the payload is empty. Device tensors are checked like host ones:
 * ids and weights are read to the host (into owned), x is scanned on the device. */
epd_status_t epd_submit_validate_regions(const epd_frame_t *frame,
                                         const epd_submit_limits_t *limits,
                                         const epd_submit_regions_t *regions,
                                         epd_submit_view_t *view_p, char err[EPD_ERR_LEN]);

/* ---- encoders ---- */

/* An encoded frame ready to send: head (header + meta JSON) is owned (malloc'ed); the payload is
 * up to EPD_FRAME_OUT_PARTS borrowed pieces that follow it on the wire in this order. Release with
 * epd_frame_out_free (frees head only). */
#define EPD_FRAME_OUT_PARTS 3
typedef struct epd_frame_out {
    uint8_t *head;
    size_t head_len;
    const void *part[EPD_FRAME_OUT_PARTS];
    size_t part_len[EPD_FRAME_OUT_PARTS];
    size_t n_parts;
    uint64_t payload_len;  /* sum of part_len */
} epd_frame_out_t;

void epd_frame_out_free(epd_frame_out_t *out);

/* Copies the whole frame (head then parts) into one new malloc'ed buffer. */
epd_status_t epd_frame_out_flatten(const epd_frame_out_t *out, uint8_t **buf_p, size_t *len_p,
                                   char err[EPD_ERR_LEN]);

/* SUBMIT: meta {"id", "tensors": {topk_ids i32 [N,K], topk_weights f32 [N,K], x bf16 [N,H]}}.
 * Payload order is ids, weights, x (each offset naturally aligned, no gaps). Borrows the arrays. */
epd_status_t epd_frame_encode_submit(uint64_t id, uint32_t n_tokens, uint32_t hidden,
                                     uint32_t topk, const uint16_t *x, const int32_t *topk_ids,
                                     const float *topk_weights, epd_frame_out_t *out_p,
                                     char err[EPD_ERR_LEN]);

/* RESULT: meta {"id", "tensors": {"y": bf16 [N,H] at [0, 2NH]}, "step"}. Borrows y. */
epd_status_t epd_frame_encode_result(uint64_t id, uint64_t step, uint32_t n_tokens,
                                     uint32_t hidden, const uint16_t *y, epd_frame_out_t *out_p,
                                     char err[EPD_ERR_LEN]);

/* ERROR: meta {"id": id or null, "code": epd_status_name(code), "message"}. code must be a wire
 * code (epd_status_is_wire_code), else EPD_ERR_INVALID_ARG. A message longer than the meta bound
 * allows is cut. */
/* RESULT whose y the daemon wrote into a region: meta names it, the payload is empty. */
epd_status_t epd_frame_encode_result_region(uint64_t id, uint64_t step, uint32_t n_tokens,
                                            uint32_t hidden, uint32_t region, uint64_t offset,
                                            epd_frame_out_t *out_p, char err[EPD_ERR_LEN]);

epd_status_t epd_frame_encode_error(bool has_id, uint64_t id, epd_status_t code,
                                    const char *message, epd_frame_out_t *out_p,
                                    char err[EPD_ERR_LEN]);

/* CONTROL: meta {"op": op}. */
epd_status_t epd_frame_encode_control(const char *op, epd_frame_out_t *out_p,
                                      char err[EPD_ERR_LEN]);

/* REPLY: meta_json is the JSON text of an object (checked, sent as is; at most
 * EPD_FRAME_MAX_META bytes); payload (may be NULL when payload_len is 0) is borrowed, e.g. the
 * Prometheus text of `metrics`. */
epd_status_t epd_frame_encode_reply(const char *meta_json, const void *payload, size_t payload_len,
                                    epd_frame_out_t *out_p, char err[EPD_ERR_LEN]);

/* A frame with no payload whose meta is meta_json, sent as it is (the caller's own JSON text of
 * one object: not checked, the hot path of EXPERTS and EXPERTS_DONE). */
epd_status_t epd_frame_encode_text(epd_frame_type_t type, const char *meta_json,
                                   epd_frame_out_t *out_p, char err[EPD_ERR_LEN]);

/* Encodes a frame from a cJSON meta object (not consumed) and one borrowed payload piece; the
 * general form behind the encoders above, for tests and tools. */
epd_status_t epd_frame_encode_json(epd_frame_type_t type, const cJSON *meta, const void *payload,
                                   size_t payload_len, epd_frame_out_t *out_p,
                                   char err[EPD_ERR_LEN]);

#endif
