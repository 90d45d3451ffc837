/* The metrics endpoint (metrics.listen): `GET /metrics` over HTTP with libevent's evhttp, on the
 * rank's own event loop, answering with the Prometheus text exposition the caller renders (the
 * same text as CONTROL `metrics`). Another method is refused by evhttp (501), another path
 * answered 404. Loop thread only. */
#ifndef EPD_DAEMON_HTTP_H
#define EPD_DAEMON_HTTP_H

#include <stdint.h>

#include "common/status.h"

struct event_base;

typedef struct epd_http epd_http_t;

/* Renders the exposition: a malloc'ed NUL-terminated text the server frees, or NULL (answered
 * 500). */
typedef char *(*epd_http_render_fn)(void *arg);

/* Listens on host:port (port already offset by the local rank) on base. EPD_ERR_IO with the
 * address and the system's reason in err when it cannot bind (taken, not local, no permission). */
epd_status_t epd_http_open(struct event_base *base, const char *host, uint16_t port,
                           epd_http_render_fn render, void *arg, epd_http_t **http_p,
                           char err[EPD_ERR_LEN]);

/* Counters for the log at exit: scrapes answered, requests refused (404). */
uint64_t epd_http_scrapes(const epd_http_t *http);

/* Stops listening and closes every HTTP connection (NULL is ignored). */
void epd_http_free(epd_http_t *http);

#endif
