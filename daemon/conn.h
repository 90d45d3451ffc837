/* One client connection of the server: its state machine (STYLE.md "Connection handling"), the
 * frame decoder fed as bytes arrive, and the answers it gets: SUBMIT validated at ingest and
 * handed to the engine, CONTROL answered at once, RESULT/ERROR frames queued in order. What it
 * needs from the server comes in a context (epd_conn_ctx_t). Loop thread only. */
#ifndef EPD_DAEMON_CONN_H
#define EPD_DAEMON_CONN_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/status.h"
#include "config/config.h"
#include "daemon/engine.h"
#include "daemon/region.h"
#include "daemon/stats.h"
#include "proto/frame.h"

struct event_base;
struct epd_bulk;

typedef struct epd_conn epd_conn_t;

/* Everything a connection uses that is not its own, filled by the server that owns the
 * connections; it must outlive every one of them. */
typedef struct epd_conn_ctx {
    const epd_config_t *cfg;
    const epd_submit_limits_t *limits; /* what a SUBMIT is validated against */
    struct event_base *base;
    epd_engine_t *engine;              /* set before the first connection is accepted */
    struct epd_bulk *bulk;             /* socket copies of large payloads off the loop thread
                                        * (socket.io_threads); NULL: all on the loop thread */
    epd_server_stats_t *stats;         /* the counters connections move: frames and bytes in,
                                        * bytes out, errors by code, replies, results */
    void *arg;                         /* the first argument of the callbacks below */
    /* A request of this connection went to the engine. */
    void (*request_accepted)(void *arg);
    /* Answers CONTROL op (NULL: no string "op"), as epd_control_answer. */
    epd_status_t (*control)(void *arg, const char *op, char **meta_p, char **payload_p,
                            size_t *payload_len_p, char err[EPD_ERR_LEN]);
    /* conn is being freed (called from its own free). */
    void (*closed)(void *arg, epd_conn_t *conn);
    /* CONTROL serve_experts (DESIGN.md section 9): conn offers to run this rank's experts with
     * its regions in and out (NULL when not registered on it); meta is the CONTROL's. EPD_OK
     * with the REPLY meta JSON in *meta_p (malloc'ed), or a code with err. NULL: unknown_op. */
    epd_status_t (*serve_experts)(void *arg, epd_conn_t *conn, epd_region_t *in,
                                  epd_region_t *out, const cJSON *meta, char **meta_p,
                                  char err[EPD_ERR_LEN]);
    /* EXPERTS_DONE read from conn: EPD_OK, or a framing code with err (conn is then answered
     * and closed). NULL: the frame is bad_type. */
    epd_status_t (*experts_done)(void *arg, epd_conn_t *conn, const epd_frame_t *frame,
                                 char err[EPD_ERR_LEN]);
} epd_conn_ctx_t;

/* Takes over the connected socket fd (non-blocking) and starts reading. conn_id is never reused
 * within a run. Returns NULL (fd closed) when out of memory. */
epd_conn_t *epd_conn_create(const epd_conn_ctx_t *ctx, int fd, uint64_t conn_id, uid_t uid,
                            pid_t pid);

/* The id the connection was created with. */
uint64_t epd_conn_id(const epd_conn_t *conn);

/* Requests accepted on this connection and not answered yet. */
uint64_t epd_conn_in_flight(const epd_conn_t *conn);

/* Queues the answer to one of this connection's requests (RESULT, or ERROR with the result's
 * code); takes ownership of result. May pause reads (output limit), and frees conn if it was
 * already closed: look it up by id again before the next use. */
void epd_conn_deliver(epd_conn_t *conn, epd_result_t *result);

/* The peer's pid (SO_PEERCRED), for logs. */
pid_t epd_conn_pid(const epd_conn_t *conn);

/* Queues a frame with meta_json and no payload (EXPERTS to an expert worker) and writes what
 * the socket takes at once, so it does not wait for the loop's next turn. EPD_ERR_IO when the
 * connection is closing or gone (nothing queued). May free conn (out of memory). */
epd_status_t epd_conn_send_text(epd_conn_t *conn, epd_frame_type_t type, const char *meta_json);

/* The daemon is stopping: stop reading, flush what is queued, then close. May free conn. */
void epd_conn_shutdown(epd_conn_t *conn);

/* Closes at once, dropping unsent output (the drain's time limit ran out). Frees conn, or (a
 * socket copy of it still running on ctx->bulk) takes it out of the server at once and frees it
 * when the copy is back. */
void epd_conn_abort(epd_conn_t *conn);

#endif
