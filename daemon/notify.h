/* systemd's notify protocol without libsystemd: one datagram of "KEY=VALUE\n..." lines sent to
 * the socket named by $NOTIFY_SOCKET (a path, or an abstract name written with a leading '@'). */
#ifndef EPD_DAEMON_NOTIFY_H
#define EPD_DAEMON_NOTIFY_H

#include <stdbool.h>

#include "common/status.h"

/* Sends state (e.g. "READY=1\nSTATUS=serving") to the socket named by socket_name. A NULL or empty
 * name is not an error (not started by systemd): nothing is sent and *sent_p is false.
 * Returns EPD_ERR_INVALID_ARG for a name that does not fit a Unix socket address, EPD_ERR_IO when
 * the datagram cannot be sent; err says why. */
epd_status_t epd_notify_send(const char *socket_name, const char *state, bool *sent_p,
                             char err[EPD_ERR_LEN]);

#endif
