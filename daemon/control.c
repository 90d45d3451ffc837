/* The CONTROL documents (daemon/control.h): the table of ops and the function behind each. The
 * documents themselves are rendered by daemon/stats.c from a view gathered here. */
#include "daemon/control.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"

struct epd_control {
    const epd_config_t *cfg;
    const epd_server_stats_t *stats;
    epd_engine_t *engine;
    int rank;
    int world;
    uint64_t started_ns;
    char *config_json; /* the `config` document, rendered once */
};

typedef struct control_op {
    const char *name;
    /* Fills *meta_p (and for some ops *payload_p, *payload_len_p) with malloc'ed text; NULL in
     * *meta_p or EPD_ERR_NO_MEMORY when out of memory. */
    epd_status_t (*answer)(epd_control_t *control, char **meta_p, char **payload_p,
                           size_t *payload_len_p);
} control_op_t;

static void control_view(epd_control_t *control, epd_engine_stats_t *es, epd_stats_view_t *view)
{
    epd_engine_get_stats(control->engine, es);
    view->rank = control->rank;
    view->world = control->world;
    view->uptime_s = (double)(epd_now_ns() - control->started_ns) / 1e9;
    view->dtype = control->cfg->dispatch.dtype;
    view->engine = es;
    view->server = control->stats;
}

static epd_status_t control_health(epd_control_t *control, char **meta_p, char **payload_p,
                                   size_t *payload_len_p)
{
    epd_engine_stats_t es;
    epd_stats_view_t view;

    control_view(control, &es, &view);
    *meta_p = epd_stats_health_json(&view);
    return EPD_OK;
}

static epd_status_t control_stats(epd_control_t *control, char **meta_p, char **payload_p,
                                  size_t *payload_len_p)
{
    epd_engine_stats_t es;
    epd_stats_view_t view;

    control_view(control, &es, &view);
    *meta_p = epd_stats_json(&view);
    return EPD_OK;
}

static epd_status_t control_config(epd_control_t *control, char **meta_p, char **payload_p,
                                   size_t *payload_len_p)
{
    *meta_p = strdup(control->config_json);
    return EPD_OK;
}

static epd_status_t control_metrics(epd_control_t *control, char **meta_p, char **payload_p,
                                    size_t *payload_len_p)
{
    epd_engine_stats_t es;
    epd_stats_view_t view;

    control_view(control, &es, &view);
    *payload_p = epd_stats_metrics(&view);
    if (*payload_p == NULL) return EPD_ERR_NO_MEMORY;
    *payload_len_p = strlen(*payload_p);
    *meta_p = strdup("{\"op\":\"metrics\",\"content_type\":\"text/plain; version=0.0.4; "
                     "charset=utf-8\"}");
    return EPD_OK;
}

/* Every op, in the order error messages list them. */
static const control_op_t control_ops[] = {
    {.name = "health", .answer = control_health},
    {.name = "stats", .answer = control_stats},
    {.name = "config", .answer = control_config},
    {.name = "metrics", .answer = control_metrics},
    /* Answered by the connection, which owns its regions (daemon/conn.c, daemon/region.c);
     * listed here so that every op is in one table and in the error messages. */
    {.name = "register", .answer = NULL},
    {.name = "unregister", .answer = NULL},
    /* the connection's too: it offers to run the rank's experts (daemon/external.c) */
    {.name = "serve_experts", .answer = NULL},
};

/* "a, b, c or d": the ops' names for error messages. */
static void control_op_names(char *buf, size_t len)
{
    size_t n = EPD_ARRAY_SIZE(control_ops), used = 0;

    buf[0] = '\0';
    for (size_t i = 0; i < n && used < len; i++) {
        const char *sep = i == 0 ? "" : i + 1 == n ? " or " : ", ";
        int w = snprintf(buf + used, len - used, "%s%s", sep, control_ops[i].name);
        if (w < 0) break;
        used += (size_t)w;
    }
}

epd_status_t epd_control_answer(epd_control_t *control, const char *op, char **meta_p,
                                char **payload_p, size_t *payload_len_p, char err[EPD_ERR_LEN])
{
    const control_op_t *found = NULL;
    char names[160];

    *meta_p = NULL;
    *payload_p = NULL;
    *payload_len_p = 0;
    for (size_t i = 0; op != NULL && i < EPD_ARRAY_SIZE(control_ops); i++)
        if (strcmp(op, control_ops[i].name) == 0) found = &control_ops[i];
    if (found == NULL) {
        control_op_names(names, sizeof(names));
        if (op == NULL)
            snprintf(err, EPD_ERR_LEN, "CONTROL meta needs a string \"op\": %s", names);
        else
            snprintf(err, EPD_ERR_LEN, "unknown op '%.64s': expected %s", op, names);
        return EPD_ERR_UNKNOWN_OP;
    }
    if (found->answer == NULL) {
        snprintf(err, EPD_ERR_LEN, "op '%s' is answered by the connection", op);
        return EPD_ERR_INTERNAL;
    }
    epd_status_t status = found->answer(control, meta_p, payload_p, payload_len_p);
    if (status == EPD_OK && *meta_p == NULL) status = EPD_ERR_NO_MEMORY;
    if (status != EPD_OK) {
        free(*meta_p);
        free(*payload_p);
        *meta_p = NULL;
        *payload_p = NULL;
        *payload_len_p = 0;
    }
    return status;
}

epd_status_t epd_control_create(const epd_config_t *cfg, int rank, int world,
                                const epd_server_stats_t *stats, epd_control_t **control_p,
                                char err[EPD_ERR_LEN])
{
    epd_control_t *control = calloc(1, sizeof(*control));
    size_t cap = 4096;

    *control_p = NULL;
    if (control == NULL) goto out_nomem;
    control->cfg = cfg;
    control->stats = stats;
    control->rank = rank;
    control->world = world;
    control->started_ns = epd_now_ns();
    for (;;) {
        control->config_json = malloc(cap);
        if (control->config_json == NULL) goto out_free;
        size_t need = epd_config_to_json(cfg, control->config_json, cap);
        if (need < cap) break;
        free(control->config_json);
        control->config_json = NULL;
        cap = need + 1;
    }
    *control_p = control;
    return EPD_OK;

out_free:
    free(control);
out_nomem:
    snprintf(err, EPD_ERR_LEN, "out of memory creating the server");
    return EPD_ERR_NO_MEMORY;
}

void epd_control_attach(epd_control_t *control, epd_engine_t *engine)
{
    control->engine = engine;
}

void epd_control_free(epd_control_t *control)
{
    if (control == NULL) return;
    free(control->config_json);
    free(control);
}
