/* One client connection of the server: its state machine (STYLE.md "Connection handling"), the
 * frame decoder fed as bytes arrive, and the answers it gets: SUBMIT validated at ingest and
 * handed to the engine, CONTROL answered at once, RESULT/ERROR frames queued in order. Loop
 * thread only. */
#ifndef EPD_DAEMON_CONN_H
#define EPD_DAEMON_CONN_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/status.h"
#include "daemon/engine.h"

struct epd_server;

typedef struct epd_conn epd_conn_t;

/* Takes over the connected socket fd (non-blocking) and starts reading. conn_id is never reused
 * within a run. Returns NULL (fd closed) when out of memory. */
epd_conn_t *epd_conn_create(struct epd_server *server, int fd, uint64_t conn_id, uid_t uid,
                            pid_t pid);

uint64_t epd_conn_id(const epd_conn_t *conn);

/* Requests accepted on this connection and not answered yet. */
uint64_t epd_conn_in_flight(const epd_conn_t *conn);

/* Queues the answer to one of this connection's requests (RESULT, or ERROR with the result's
 * code); takes ownership of result. May pause reads (output limit), and frees conn if it was
 * already closed: look it up by id again before the next use. */
void epd_conn_deliver(epd_conn_t *conn, epd_result_t *result);

/* The daemon is stopping: stop reading, flush what is queued, then close. May free conn. */
void epd_conn_shutdown(epd_conn_t *conn);

/* Closes at once, dropping unsent output (the drain's time limit ran out). Frees conn. */
void epd_conn_abort(epd_conn_t *conn);

/* Encodes an ERROR frame (id may be absent) into one malloc'ed buffer; used for connections that
 * are refused before a conn exists. */
epd_status_t epd_conn_encode_error(bool has_id, uint64_t id, epd_status_t code, const char *message,
                                   uint8_t **buf_p, size_t *len_p);

#endif
