/* The per-rank server: creates and owns the listener (daemon/listener.h), the connection table
 * (daemon/conn_table.h), the CONTROL documents (daemon/control.h) and the context connections
 * run in; routes engine results to them; turns signals into the engine's shutdown and drains.
 * Everything runs on the event-loop thread except epd_server_wake (the engine's wake callback). */
#ifndef EPD_DAEMON_SERVER_H
#define EPD_DAEMON_SERVER_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"
#include "config/config.h"
#include "daemon/engine.h"

struct event_base;

typedef struct epd_server epd_server_t;

/* Creates the server on base (made with evthread support): the wake event, the signal events
 * (SIGTERM, SIGINT, SIGUSR1) and the counters. cfg must outlive the server. */
epd_status_t epd_server_create(const epd_config_t *cfg, struct event_base *base, int rank,
                               int world, epd_server_t **server_p, char err[EPD_ERR_LEN]);

/* Binds and listens on path (epd_listener_open says how the socket file is made). Connections
 * wait in the backlog until epd_server_start. */
epd_status_t epd_server_listen(epd_server_t *server, const char *path, char err[EPD_ERR_LEN]);

/* Opens the HTTP metrics endpoint of metrics.listen (nothing when it is "off") on the port plus
 * local_rank, so the ranks of one node do not collide. EPD_ERR_CONFIG or EPD_ERR_IO with err. */
epd_status_t epd_server_metrics_listen(epd_server_t *server, int local_rank,
                                       char err[EPD_ERR_LEN]);

/* The engine's wake callback (any thread): makes the loop collect results. arg is the server. */
void epd_server_wake(void *arg);

/* Attaches the engine (created with epd_server_wake) and starts accepting connections on the
 * socket of epd_server_listen. A signal that came earlier is passed on to the engine now. */
/* The layers a SUBMIT may name (unknown_layer otherwise): known(arg, layer) is asked for each;
 * without it every layer is served. Set before epd_server_start. */
void epd_server_set_layer_hook(epd_server_t *server, bool (*known)(void *arg, uint32_t layer),
                               void *arg);

epd_status_t epd_server_start(epd_server_t *server, epd_engine_t *engine, char err[EPD_ERR_LEN]);

struct epd_external;
/* The rank's external experts (experts.kind external): connections may then serve_experts and
 * send EXPERTS_DONE. Set before epd_server_start; it must outlive the server's connections. */
void epd_server_set_external(epd_server_t *server, struct epd_external *external);

/* Stops listening, closes every connection and unlinks the socket file. */
/* Runs the event loop until the server stops (or loopbreak): while the engine is hot
 * (epd_engine_hot) it polls without sleeping, so a SUBMIT or a finished step is seen within a
 * microsecond or two instead of a thread wake-up (about 10 us); otherwise it sleeps in epoll.
 * 0, or -1 when the loop failed. */
int epd_server_run(epd_server_t *server);

void epd_server_free(epd_server_t *server);

/* Results answered (or discarded) since the shutdown began; for the exit log. */
uint64_t epd_server_answered_in_drain(const epd_server_t *server);

#endif
