/* The metrics endpoint (daemon/http.h): evhttp bound to metrics.listen, one handler for /metrics.
 * Headers, bodies and idle connections are bounded so a scraper cannot hold the loop. */
#include "daemon/http.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>

#define HTTP_MAX_HEADERS_BYTES 8192
#define HTTP_MAX_BODY_BYTES 0    /* a scrape has no body */
#define HTTP_TIMEOUT_S 10        /* a connection that sends nothing is closed */
#define METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

struct epd_http {
    struct evhttp *http;
    epd_http_render_fn render;
    void *arg;
    uint64_t scrapes;
};

static void text_free(const void *data, size_t len, void *arg)
{
    free((void *)data);
}

static void metrics_cb(struct evhttp_request *req, void *arg)
{
    epd_http_t *h = arg;
    char *text = h->render(h->arg);

    if (text == NULL) {
        evhttp_send_error(req, HTTP_INTERNAL, "out of memory rendering the metrics");
        return;
    }
    struct evbuffer *body = evbuffer_new();
    if (body == NULL || evbuffer_add_reference(body, text, strlen(text),
                                               text_free, NULL) != 0) {
        free(text);
        if (body != NULL) evbuffer_free(body);
        evhttp_send_error(req, HTTP_INTERNAL, "out of memory sending the metrics");
        return;
    }
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type",
                      METRICS_CONTENT_TYPE);
    h->scrapes++;
    evhttp_send_reply(req, HTTP_OK, "OK", body);
    evbuffer_free(body);
}

static void other_cb(struct evhttp_request *req, void *arg)
{
    evhttp_send_error(req, HTTP_NOTFOUND, "epd serves only /metrics");
}

epd_status_t epd_http_open(struct event_base *base, const char *host, uint16_t port,
                           epd_http_render_fn render, void *arg, epd_http_t **http_p,
                           char err[EPD_ERR_LEN])
{
    epd_http_t *h = calloc(1, sizeof(*h));

    *http_p = NULL;
    if (h == NULL || (h->http = evhttp_new(base)) == NULL) {
        free(h);
        snprintf(err, EPD_ERR_LEN, "metrics.listen: out of memory creating the HTTP server");
        return EPD_ERR_NO_MEMORY;
    }
    h->render = render;
    h->arg = arg;
    evhttp_set_allowed_methods(h->http, EVHTTP_REQ_GET);
    evhttp_set_max_headers_size(h->http, HTTP_MAX_HEADERS_BYTES);
    evhttp_set_max_body_size(h->http, HTTP_MAX_BODY_BYTES);
    evhttp_set_timeout(h->http, HTTP_TIMEOUT_S);
    if (evhttp_set_cb(h->http, "/metrics", metrics_cb, h) != 0) {
        snprintf(err, EPD_ERR_LEN, "metrics.listen: cannot register /metrics");
        epd_http_free(h);
        return EPD_ERR_INTERNAL;
    }
    evhttp_set_gencb(h->http, other_cb, h);
    errno = 0;
    if (evhttp_bind_socket_with_handle(h->http, host, port) == NULL) {
        int e = errno;
        snprintf(err, EPD_ERR_LEN,
                 "metrics.listen: cannot listen on %s port %u: %s (port = the configured port + "
                 "the local rank; is it taken, or is the host not an address of this node?)",
                 host, (unsigned)port, e ? strerror(e) : "bind failed");
        epd_http_free(h);
        return EPD_ERR_IO;
    }
    *http_p = h;
    return EPD_OK;
}

uint64_t epd_http_scrapes(const epd_http_t *h)
{
    return h == NULL ? 0 : h->scrapes;
}

void epd_http_free(epd_http_t *h)
{
    if (h == NULL) return;
    if (h->http != NULL) evhttp_free(h->http);
    free(h);
}
