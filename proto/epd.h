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
    const uint16_t *y;          /* bf16 [n_tokens, hidden], owned by the reply; NULL on error */
    void *storage;              /* private */
} epd_client_reply_t;

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

#ifdef __cplusplus
}
#endif

#endif
