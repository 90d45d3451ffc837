/* libepd: the C client of epd, the expert-parallel MoE dispatch daemon (wire protocol v1 over a
 * local Unix socket). Self-contained public header: link with -lepd (pkg-config epd). */
#ifndef EPD_H
#define EPD_H

/* A client is one connection. Clients share nothing, so one client per thread is safe; one client
 * must not be used by two threads at once. Every call returns an epd_client_rc_t; on failure
 * epd_client_last_error() gives a snake_case code (the daemon's code, e.g. "bad_tensor", or a local
 * one: "connect", "timeout", "closed", "protocol", "io", "invalid_argument", "no_memory") and
 * epd_client_last_message() a sentence. Arrays travel as little-endian bytes (the host order on
 * x86-64 and aarch64). */

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define EPD_CLIENT_API __attribute__((visibility("default")))
#else
#define EPD_CLIENT_API
#endif

#define EPD_CLIENT_DEFAULT_SOCKET "/run/epd/epd-0.sock"
#define EPD_CLIENT_CODE_LEN 32
#define EPD_CLIENT_MESSAGE_LEN 512

typedef enum {
    EPD_CLIENT_OK = 0,
    EPD_CLIENT_ERR_DAEMON,      /* the daemon answered ERROR (its code in last_error) */
    EPD_CLIENT_ERR_CONNECT,     /* cannot connect (the message names the path and the errno text) */
    EPD_CLIENT_ERR_TIMEOUT,     /* no answer within the timeout */
    EPD_CLIENT_ERR_CLOSED,      /* the daemon closed the connection, or it is not connected */
    EPD_CLIENT_ERR_PROTOCOL,    /* the daemon sent something that is not valid protocol v1 */
    EPD_CLIENT_ERR_IO,          /* a socket call failed */
    EPD_CLIENT_ERR_INVALID_ARG, /* a bad argument to a libepd call */
    EPD_CLIENT_ERR_NO_MEMORY,
    EPD_CLIENT_AGAIN,           /* non-blocking calls: nothing yet, or output left to write */
} epd_client_rc_t;

typedef struct epd_client epd_client_t;

/* One batch of tokens for one MoE layer call. The arrays are read, never kept. */
typedef struct epd_client_batch {
    uint64_t id;                /* chosen by the caller; replies carry it back */
    uint32_t n_tokens;          /* N >= 1 */
    uint32_t hidden;            /* H, must equal the daemon's model.hidden */
    uint32_t topk;              /* K, must equal the daemon's model.topk */
    const uint16_t *x;          /* bf16 bit patterns [N, H] */
    const int32_t *topk_ids;    /* [N, K], each in [0, E) or -1 (empty slot) */
    const float *topk_weights;  /* [N, K] */
} epd_client_batch_t;

/* One answer: a RESULT (status EPD_CLIENT_OK, y set) or an ERROR (status EPD_CLIENT_ERR_DAEMON,
 * code and message set). Release with epd_client_reply_free. */
typedef struct epd_client_reply {
    uint64_t id;
    int has_id;                 /* 0: an ERROR about no particular request (connection-level) */
    int status;                 /* EPD_CLIENT_OK or EPD_CLIENT_ERR_DAEMON */
    char code[EPD_CLIENT_CODE_LEN];
    char message[EPD_CLIENT_MESSAGE_LEN];
    uint64_t step;              /* the daemon's step that produced y */
    uint32_t n_tokens;
    uint32_t hidden;
    const uint16_t *y;          /* bf16 [n_tokens, hidden], owned by the reply; NULL on error and
                                 * when the daemon wrote y into a region (y_region != 0) */
    void *storage;              /* private */
    uint32_t y_region;          /* the region y was written into, 0 when y is above */
    uint64_t y_offset;
} epd_client_reply_t;

/* Where one tensor of a request is: in the frame (region 0: data is read and sent) or in a
 * region registered on this client's connection, at a byte offset (a multiple of 16). */
typedef struct epd_client_tensor {
    uint32_t region;
    uint64_t offset;
    const void *data;
} epd_client_tensor_t;

/* A batch whose tensors may be in shared regions (DESIGN.md section 4b). */
typedef struct epd_client_request {
    uint64_t id;
    uint32_t n_tokens, hidden, topk;
    int32_t layer;                     /* the MoE layer; < 0: not sent (the daemon takes 0) */
    epd_client_tensor_t x;             /* bf16 [N, H] */
    epd_client_tensor_t topk_ids;      /* i32 [N, K], or i64 when ids_i64 (torch.topk's dtype) */
    int ids_i64;
    epd_client_tensor_t topk_weights;  /* f32 [N, K] */
    epd_client_tensor_t y;             /* region != 0: the daemon writes y there; 0: in the RESULT */
} epd_client_request_t;

/* The library's version, e.g. "0.1.0". */
EPD_CLIENT_API const char *epd_client_version(void);

/* A new, unconnected client (NULL when out of memory). Free with epd_client_destroy. */
EPD_CLIENT_API epd_client_t *epd_client_create(void);

/* Closes the connection (if any) and frees the client and any replies it still holds. */
EPD_CLIENT_API void epd_client_destroy(epd_client_t *client);

/* Connects to the daemon's Unix socket at path, waiting at most timeout_ms (< 0: no limit) while
 * the daemon's accept queue is full. The same timeout becomes the client's reply timeout. */
EPD_CLIENT_API int epd_client_connect(epd_client_t *client, const char *path, int timeout_ms);

/* Closes the connection; replies not yet received are lost. Connect may be called again. */
EPD_CLIENT_API void epd_client_close(epd_client_t *client);

/* How long a call waits for the daemon (sending or receiving), in ms; < 0: no limit. */
EPD_CLIENT_API void epd_client_set_timeout(epd_client_t *client, int timeout_ms);

/* While waiting for an answer, poll the socket without sleeping for up to spin_us microseconds
 * before sleeping in poll(2); 0: sleep at once. The default is EPD_CLIENT_DEFAULT_SPIN_US:
 * answers on a GPU node come within tens of microseconds, and a thread woken from poll(2) pays
 * about 10 us each time (on an H200 node: 1-token requests 70 us sleeping, 54 spinning), which
 * an MoE forward pays once a layer. The cost is a busy core for at most spin_us a wait, so
 * where the process may use fewer than EPD_CLIENT_SPIN_MIN_CPUS cores (a small CI machine, where
 * the daemon's ranks need them) the default is 0. */
#define EPD_CLIENT_DEFAULT_SPIN_US 200u
#define EPD_CLIENT_SPIN_MIN_CPUS 4
EPD_CLIENT_API void epd_client_set_spin(epd_client_t *client, unsigned spin_us);

/* CLOCK_MONOTONIC, in ns: when the recv(2) that completed the frame behind the last reply (or
 * EXPERTS) this client returned came back; 0 before any. With the caller's own clock around the
 * call it splits a wait into the socket's part and this library's decoding and queueing. */
EPD_CLIENT_API uint64_t epd_client_last_read_ns(const epd_client_t *client);

/* The last failure's snake_case code ("" after success) and its sentence. The strings belong to
 * the client and change with the next call. */
EPD_CLIENT_API const char *epd_client_last_error(const epd_client_t *client);
EPD_CLIENT_API const char *epd_client_last_message(const epd_client_t *client);

/* A short name of an rc ("ok", "daemon", "connect", ...). */
EPD_CLIENT_API const char *epd_client_rc_name(int rc);

/* Sends one batch and waits for its answer: y[N * H] receives the output (bf16) and *step_p (may
 * be NULL) the daemon's step. Replies to other pipelined ids that arrive meanwhile are kept for
 * epd_client_recv / epd_client_wait. EPD_CLIENT_ERR_DAEMON when the daemon rejected the batch. */
EPD_CLIENT_API int epd_client_submit(epd_client_t *client, const epd_client_batch_t *batch,
                                     uint16_t *y, uint64_t *step_p);

/* Pipelining: sends one batch without waiting for its answer. While the socket is full, answers
 * that arrive are read and kept, so sending many batches never deadlocks with the daemon. */
EPD_CLIENT_API int epd_client_send(epd_client_t *client, const epd_client_batch_t *batch);

/* The next answer, in arrival order (errors can overtake results). Returns reply->status, or a
 * local failure (timeout, closed, ...) with *reply_p zeroed. */
EPD_CLIENT_API int epd_client_recv(epd_client_t *client, epd_client_reply_t *reply_p);

/* The answer to one id; other answers that arrive first are kept for later calls. An ERROR with
 * no id (the daemon is closing the connection) also ends the wait. Returns as epd_client_recv. */
EPD_CLIENT_API int epd_client_wait(epd_client_t *client, uint64_t id,
                                   epd_client_reply_t *reply_p);

/* Batches sent whose answer has not been returned yet. */
EPD_CLIENT_API uint64_t epd_client_in_flight(const epd_client_t *client);

EPD_CLIENT_API void epd_client_reply_free(epd_client_reply_t *reply);

/* A control query: op is "health", "stats", "config" or "metrics". *json_p receives the REPLY's
 * JSON text; *payload_p (when not NULL) its payload (the Prometheus text of "metrics"), NUL
 * terminated, with *payload_len_p its length. Free both with epd_client_free. Pipelined results
 * that arrive meanwhile are kept. An unknown op is EPD_CLIENT_ERR_DAEMON ("unknown_op"). */
EPD_CLIENT_API int epd_client_control(epd_client_t *client, const char *op, char **json_p,
                                      char **payload_p, size_t *payload_len_p);

/* Frees a string returned by epd_client_control. */
EPD_CLIENT_API void epd_client_free(void *ptr);

/* ---- shared regions (DESIGN.md section 4b) ---- */

/* Creates `bytes` of shared memory (a memfd), maps it here, and registers it with the daemon
 * (the fd travels in SCM_RIGHTS). *region_p receives its id, *ptr_p this process's mapping, where
 * the caller puts x, ids and weights and finds y. It stays until unregister or close. */
EPD_CLIENT_API int epd_client_register_host(epd_client_t *client, uint64_t bytes,
                                            uint32_t *region_p, void **ptr_p);

/* Registers `bytes` at `offset` into a CUDA allocation of this process, given its 64-byte
 * cudaIpcMemHandle_t (cudaIpcGetMemHandle, or the last 64 bytes of what torch's
 * untyped_storage()._share_cuda_() gives). The daemon's rank must run on the same GPU. */
EPD_CLIENT_API int epd_client_register_cuda(epd_client_t *client, const uint8_t handle[64],
                                            uint64_t offset, uint64_t bytes, uint32_t *region_p);

/* Releases a region (the daemon drops it once the requests using it are answered); a host
 * region's mapping here is unmapped. */
EPD_CLIENT_API int epd_client_unregister(epd_client_t *client, uint32_t region);

/* Sends one request (blocking, like epd_client_send); tensors by region or in the frame. */
EPD_CLIENT_API int epd_client_send_request(epd_client_t *client, const epd_client_request_t *req);

/* Sends a request and waits for its answer; a y in the frame is copied to y_out (may be NULL when
 * y is in a region). */
EPD_CLIENT_API int epd_client_submit_request(epd_client_t *client, const epd_client_request_t *req,
                                             uint16_t *y_out, uint64_t *step_p);

/* ---- non-blocking use from an event loop (a router polling many sockets) ---- */

/* The connection's socket, to watch for POLLIN (answers) and, while epd_client_pending_output is
 * not 0, POLLOUT. -1 when not connected. */
EPD_CLIENT_API int epd_client_fd(const epd_client_t *client);

/* Queues a request (its bytes are copied) and writes what the socket takes without blocking:
 * EPD_CLIENT_OK when all was written, EPD_CLIENT_AGAIN when some is left for epd_client_flush. */
EPD_CLIENT_API int epd_client_queue_request(epd_client_t *client,
                                            const epd_client_request_t *req);

/* Writes queued output without blocking: OK when none is left, AGAIN when the socket is full. */
EPD_CLIENT_API int epd_client_flush(epd_client_t *client);

/* Bytes queued and not written yet. */
EPD_CLIENT_API size_t epd_client_pending_output(const epd_client_t *client);

/* The next answer if one has arrived (reading what the socket has, without blocking), as
 * epd_client_recv; EPD_CLIENT_AGAIN when there is none yet. */
EPD_CLIENT_API int epd_client_try_recv(epd_client_t *client, epd_client_reply_t *reply_p);

/* ---- external experts (experts.kind external; docs/protocol.md section 16) ---- */

/* One EXPERTS frame: the rows of this rank's experts for one step, in the worker's regions.
 * Pointers are this process's addresses when the regions are host regions created by this client
 * (epd_client_register_host), else NULL: then use the offsets into the worker's own allocations
 * (device regions). Valid during the callback only. */
typedef struct epd_client_experts {
    uint64_t step;              /* the step (its RESULTs carry the same number) */
    uint32_t layer;
    uint32_t first_expert;      /* counts[i] rows belong to expert first_expert + i */
    uint32_t n_experts;
    const uint32_t *counts;
    uint32_t rows;              /* rows of x and y: packed, the sum of counts; masked,
                                 * n_experts * capacity */
    int masked;                 /* x [n_experts][capacity][H]; else [rows][H] */
    uint32_t capacity;
    uint32_t hidden;
    const char *input;          /* "fp8_group128", "bf16" or "fp8_per_tensor" */
    const void *x;              /* e4m3 bytes, or bf16 bit patterns */
    const float *scales;        /* fp8_group128: [rows][scales_per_row]; else NULL */
    uint32_t scales_per_row;
    float scale;                /* fp8_per_tensor: S (x' = e4m3 value * S); else 0 */
    uint16_t *y;                /* bf16 [rows][H] to fill (masked: [n_experts][capacity][H]) */
    uint32_t input_region, output_region;
    uint64_t x_offset, scales_offset, y_offset;
    uint64_t sent_ns, seen_ns;  /* CLOCK_MONOTONIC: the daemon wrote it; this client read it */
    const char *meta_json;      /* reserved (NULL) */
    uint64_t read_ns;           /* CLOCK_MONOTONIC: the recv(2) that completed the frame returned
                                 * (seen_ns - read_ns: this library's decoding and queueing) */
} epd_client_experts_t;

/* The worker's function: fills batch->y (or the device memory at y_offset, stream synchronized)
 * and returns 0; EXPERTS_DONE is then sent. Nonzero: no answer (the daemon's step times out and
 * its requests get experts_unavailable). It must not call this client. */
typedef int (*epd_client_experts_fn)(void *arg, const epd_client_experts_t *batch);

/* Makes this connection its rank's expert worker (CONTROL serve_experts) with two regions
 * registered on it. From then on every call of this client that waits (submit, wait, recv,
 * control, serve, try_recv) serves EXPERTS with fn, so one thread can submit and serve on one
 * connection. *reply_json_p (may be NULL) receives the REPLY (free with epd_client_free). A second
 * worker on a rank is EPD_CLIENT_ERR_DAEMON "busy". */
EPD_CLIENT_API int epd_client_serve_experts(epd_client_t *client, uint32_t input_region,
                                            uint32_t output_region, epd_client_experts_fn fn,
                                            void *arg, char **reply_json_p);

/* Serves EXPERTS for timeout_ms (< 0: until the daemon closes the connection): OK when the time
 * is up, EPD_CLIENT_ERR_CLOSED when the connection ended. Answers that arrive are kept. */
EPD_CLIENT_API int epd_client_serve(epd_client_t *client, int timeout_ms);

#ifdef __cplusplus
}
#endif

#endif
