/* The listening Unix socket of a rank: the socket file (parent directory, stale file, mode), the
 * libevent listener, and the checks at accept (SO_PEERCRED against socket.allow_uids, the
 * socket.max_clients limit) with their refusals, logged at most once a second with a count.
 * Accepted connections go to a callback. Loop thread only. */
#ifndef EPD_DAEMON_LISTENER_H
#define EPD_DAEMON_LISTENER_H

#include <sys/types.h>

#include "common/status.h"
#include "config/config.h"
#include "daemon/stats.h"

struct event_base;

typedef struct epd_listener epd_listener_t;

/* A connection passed the checks: the callee takes over fd (non-blocking). */
typedef void (*epd_listener_accept_cb_t)(void *arg, int fd, uid_t uid, pid_t pid);

/* Binds and listens on path: the parent directory must exist and be writable by nobody but root
 * and the daemon's user (unless sticky and owned by one of them); an old socket file is unlinked
 * only when nothing answers on it; any other file there is an error. The file gets socket.mode
 * through the umask around bind (never a chmod of the path). Connections wait in the backlog
 * until epd_listener_start. stats is read for the client count and counts refusals; cfg, base
 * and stats must outlive the listener. */
epd_status_t epd_listener_open(const epd_config_t *cfg, struct event_base *base,
                               epd_server_stats_t *stats, const char *path,
                               epd_listener_accept_cb_t accept, void *arg,
                               epd_listener_t **listener_p, char err[EPD_ERR_LEN]);

/* Starts accepting: each connection that passes the checks goes to the accept callback. */
epd_status_t epd_listener_start(epd_listener_t *listener, char err[EPD_ERR_LEN]);

/* Stops listening and removes the socket file if it is still the one this listener bound. */
void epd_listener_free(epd_listener_t *listener);

#endif
