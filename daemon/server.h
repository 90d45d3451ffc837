/* The per-rank server: the Unix socket (stale-file handling, mode), the libevent
 * listener with the client limit and SO_PEERCRED check, the table of connections by id, the
 * routing of engine results to them, signals, CONTROL documents, and the graceful drain.
 * Everything runs on the event-loop thread except epd_server_wake (the engine's wake callback). */
#ifndef EPD_DAEMON_SERVER_H
#define EPD_DAEMON_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "config/config.h"
#include "daemon/conn.h"
#include "daemon/engine.h"
#include "daemon/stats.h"
#include "proto/frame.h"

struct event_base;

typedef struct epd_server epd_server_t;

/* Creates the server on base (made with evthread support): the wake event, the signal events
 * (SIGTERM, SIGINT, SIGUSR1) and the counters. cfg must outlive the server. */
epd_status_t epd_server_create(const epd_config_t *cfg, struct event_base *base, int rank,
                               int world, epd_server_t **server_p, char err[EPD_ERR_LEN]);

/* Binds and listens on path: the parent directory must exist; an old socket file is unlinked only
 * when nothing answers on it; any other file there is an error. The file gets socket.mode (umask
 * around bind, then chmod). Connections wait in the backlog until epd_server_start. */
epd_status_t epd_server_listen(epd_server_t *server, const char *path, char err[EPD_ERR_LEN]);

/* The engine's wake callback (any thread): makes the loop collect results. arg is the server. */
void epd_server_wake(void *arg);

/* Attaches the engine (created with epd_server_wake) and starts accepting connections. A signal
 * that came earlier is passed on to the engine now. */
epd_status_t epd_server_start(epd_server_t *server, epd_engine_t *engine, char err[EPD_ERR_LEN]);

/* Stops listening, closes every connection and unlinks the socket file. */
void epd_server_free(epd_server_t *server);

/* Results answered (or discarded) since the shutdown began; for the exit log. */
uint64_t epd_server_answered_in_drain(const epd_server_t *server);

/* ---- for conn.c ---- */

const epd_config_t *epd_server_config(const epd_server_t *server);
const epd_submit_limits_t *epd_server_limits(const epd_server_t *server);
epd_engine_t *epd_server_engine(epd_server_t *server);
epd_server_stats_t *epd_server_stats(epd_server_t *server);
int epd_server_rank(const epd_server_t *server);
struct event_base *epd_server_base(epd_server_t *server);

/* A request of this connection went to the engine. */
void epd_server_request_accepted(epd_server_t *server);

/* Builds the answer to a CONTROL op: REPLY meta JSON (*meta_p) and an optional payload
 * (*payload_p, *payload_len_p), both malloc'ed and owned by the caller. EPD_ERR_UNKNOWN_OP for an
 * op that is not health, stats, config or metrics; EPD_ERR_NO_MEMORY. */
epd_status_t epd_server_control(epd_server_t *server, const char *op, char **meta_p,
                                char **payload_p, size_t *payload_len_p);

/* The connection is going away (called from the connection's own free). */
void epd_server_conn_closed(epd_server_t *server, epd_conn_t *conn);

#endif
