/* What a connection does with each frame it reads (daemon/conn.c reads them): a SUBMIT validated
 * at ingest and handed to the engine, a CONTROL answered at once (register and unregister of
 * regions, serve_experts, the server's documents), EXPERTS_DONE to the experts; anything else
 * is a framing error. */
#include "daemon/conn_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "daemon/log.h"
#include "daemon/region.h"
#include "proto/base64.h"

static void region_unref_cb(void *region)
{
    epd_region_unref(region);
}

/* The device scans a large host x, and leaves a copy of it in device memory for the step
 * (c->x_copy, taken by the request or given back by conn_handle_submit). */
static epd_status_t conn_host_scan(void *arg, const uint16_t *x, uint64_t x_n, int64_t *x_bad_p,
                                   char err[EPD_ERR_LEN])
{
    epd_conn_t *c = arg;
    const epd_ops_t *ops;
    epd_ops_ctx_t *ops_ctx;
    epd_engine_ops(c->ctx->engine, &ops, &ops_ctx);
    uint64_t start = epd_now_ns();
    epd_status_t status = ops->ingest_scan_host(ops_ctx, x, x_n, x_bad_p, &c->x_copy, err);
    c->scan_ns += epd_now_ns() - start;
    return status;
}

static void conn_x_copy_free(void *arg, void *copy)
{
    const epd_ops_t *ops;
    epd_ops_ctx_t *ops_ctx;
    epd_engine_ops(arg, &ops, &ops_ctx);
    ops->ingest_free(ops_ctx, copy);
}

/* SUBMIT: full validation by the codec (one pass: shapes, dtypes, regions, ids, weights, x
 * finite), then the engine. The request keeps the frame's payload as its storage (no copy) and a
 * reference on each region it names. */
static void conn_handle_submit(epd_conn_t *c, epd_frame_t *frame)
{
    epd_submit_view_t view;
    epd_submit_regions_t hooks;
    char err[EPD_ERR_LEN];
    epd_status_t status;
    uint64_t read_ns = epd_now_ns();

    memset(&view, 0, sizeof(view));
    memset(&hooks, 0, sizeof(hooks));
    if (c->regions != NULL) epd_region_submit_hooks(c->regions, &hooks);
    /* a large x in page-locked memory (a pooled payload, a host region) is scanned by the device */
    const epd_ops_t *ops = NULL;
    epd_ops_ctx_t *ops_ctx;
    if (c->ctx->engine != NULL) epd_engine_ops(c->ctx->engine, &ops, &ops_ctx);
    if (ops != NULL && ops->ingest_scan_host != NULL) {
        hooks.host_scan = conn_host_scan;
        hooks.scan_arg = c;
    }
    c->x_copy = NULL;
    c->scan_ns = 0;
    status = epd_submit_validate_regions(frame, c->ctx->limits, &hooks, &view, err);
    void *x_copy = c->x_copy;
    c->x_copy = NULL;
    uint64_t ingest_ns = c->scan_ns + (c->regions != NULL ? epd_region_take_fetch_ns(c->regions) : 0);
    bool has_id = frame->id_kind == EPD_FRAME_ID_VALID;
    if (status != EPD_OK && x_copy != NULL) conn_x_copy_free(c->ctx->engine, x_copy);
    if (status != EPD_OK) {
        free(view.owned);
        if (epd_status_is_framing(status) || !epd_status_is_wire_code(status))
            epd_conn_fail_framing(c, has_id, frame->id, status, err);
        else
            epd_conn_send_error(c, has_id, frame->id, status, err);
        return;
    }

    epd_request_t *req = calloc(1, sizeof(*req));
    if (req == NULL) {
        if (x_copy != NULL) conn_x_copy_free(c->ctx->engine, x_copy);
        free(view.owned);
        epd_conn_send_error(c, true, view.id, EPD_ERR_INTERNAL, "out of memory");
        return;
    }
    req->id = view.id;
    req->conn_id = c->id;
    req->n_tokens = view.n_tokens;
    req->layer = view.layer;
    req->x = x_copy != NULL ? x_copy : view.x;
    req->x_device = view.x_device || x_copy != NULL;
    req->x_copy = x_copy;
    req->x_copy_free = conn_x_copy_free;
    req->x_copy_arg = c->ctx->engine;
    req->topk_ids = view.topk_ids;
    req->topk_weights = view.topk_weights;
    req->y_dst = view.y;
    req->y_device = view.y_device;
    req->y_region = view.y_region;
    req->y_offset = view.y_offset;
    req->storage = frame->payload;
    req->storage_release = frame->payload_release;
    req->owned = view.owned;
    req->unref = region_unref_cb;
    for (int k = 0; k < EPD_SUBMIT_TENSORS; k++) {
        req->regions[k] = view.regions[k];
        if (view.regions[k] != NULL) epd_region_ref(view.regions[k]);
    }
    req->arrived_ns = c->recv_ns;
    req->decoded_ns = c->decoded_ns;
    req->read_ns = read_ns;
    req->ingest_ns = ingest_ns;
    req->enqueued_ns = epd_now_ns();
    frame->payload = NULL; /* the request owns it now */

    status = epd_engine_submit(c->ctx->engine, req);
    if (status != EPD_OK) {
        const char *why = status == EPD_ERR_BUSY
                              ? "the queue is full (dispatch.max_queued_tokens); retry later"
                          : status == EPD_ERR_SHUTTING_DOWN ? "the daemon is shutting down"
                                                            : "the engine refused the request";
        epd_conn_send_error(c, true, view.id, status, why);
        epd_request_free(req);
        return;
    }
    c->in_flight++;
    c->ctx->request_accepted(c->ctx->arg);
}

/* CONTROL register (DESIGN.md section 4b): a host region from the oldest file descriptor that
 * came with the input, or a device region from a CUDA IPC handle. The REPLY meta in *reply_p. */
static epd_status_t conn_register(epd_conn_t *c, const cJSON *meta, char **reply_p,
                                  char err[EPD_ERR_LEN])
{
    const cJSON *kind = cJSON_GetObjectItemCaseSensitive(meta, "kind");
    uint64_t bytes = 0, offset = 0;
    uint32_t id = 0;
    epd_status_t status;

    bool host = cJSON_IsString(kind) && strcmp(kind->valuestring, "host") == 0;
    bool cuda = cJSON_IsString(kind) && strcmp(kind->valuestring, "cuda") == 0;
    if (!host && !cuda) {
        snprintf(err, EPD_ERR_LEN, "register needs \"kind\": \"host\" or \"cuda\"");
        return EPD_ERR_BAD_REGION;
    }
    if (!epd_json_to_u64(cJSON_GetObjectItemCaseSensitive(meta, "bytes"), &bytes) || bytes == 0) {
        snprintf(err, EPD_ERR_LEN, "register needs \"bytes\", an integer >= 1");
        return EPD_ERR_BAD_REGION;
    }
    if (c->ctx->cfg->socket.max_regions == 0) {
        snprintf(err, EPD_ERR_LEN, "regions are off on this daemon (socket.max_regions = 0)");
        return EPD_ERR_BAD_REGION;
    }
    if (c->regions == NULL) {
        const epd_ops_t *ops;
        epd_ops_ctx_t *ops_ctx;
        epd_engine_ops(c->ctx->engine, &ops, &ops_ctx);
        c->regions = epd_region_table_create(c->ctx->cfg->socket.max_regions, ops, ops_ctx);
        if (c->regions == NULL) {
            snprintf(err, EPD_ERR_LEN, "out of memory");
            return EPD_ERR_INTERNAL;
        }
    }
    if (host) {
        if (c->n_fds == 0) {
            snprintf(err, EPD_ERR_LEN,
                     "a host region needs a file descriptor (a memfd) in the SCM_RIGHTS data of "
                     "the frame's first byte; none came");
            return EPD_ERR_BAD_REGION;
        }
        int fd = c->fds[0];
        memmove(c->fds, c->fds + 1, (c->n_fds - 1) * sizeof c->fds[0]);
        c->n_fds--;
        status = epd_region_register_host(c->regions, fd, bytes, &id, err);
    } else {
        const cJSON *handle = cJSON_GetObjectItemCaseSensitive(meta, "handle");
        const cJSON *off = cJSON_GetObjectItemCaseSensitive(meta, "offset");
        uint8_t raw[64];
        if (!cJSON_IsString(handle) || !epd_base64_decode(handle->valuestring, raw, sizeof raw)) {
            snprintf(err, EPD_ERR_LEN,
                     "a cuda region needs \"handle\": the base64 of the 64-byte "
                     "cudaIpcMemHandle_t");
            return EPD_ERR_BAD_REGION;
        }
        if (off != NULL && !epd_json_to_u64(off, &offset)) {
            snprintf(err, EPD_ERR_LEN, "\"offset\" must be a non-negative integer");
            return EPD_ERR_BAD_REGION;
        }
        status = epd_region_register_cuda(c->regions, raw, offset, bytes, &id, err);
    }
    if (status != EPD_OK) return status;
    char text[160];
    snprintf(text, sizeof text, "{\"region\":%" PRIu32 ",\"kind\":\"%s\",\"bytes\":%" PRIu64 "}",
             id, host ? "host" : "cuda", bytes);
    epd_log_debug("conn %" PRIu64 ": region %" PRIu32 ": %s, %" PRIu64 " bytes", c->id, id,
                  host ? "host" : "cuda", bytes);
    *reply_p = strdup(text);
    return *reply_p != NULL ? EPD_OK : EPD_ERR_INTERNAL;
}

static epd_status_t conn_unregister(epd_conn_t *c, const cJSON *meta, char **reply_p,
                                    char err[EPD_ERR_LEN])
{
    uint64_t id;

    const cJSON *region = cJSON_GetObjectItemCaseSensitive(meta, "region");
    if (!epd_json_to_u64(region, &id) || id > UINT32_MAX) {
        snprintf(err, EPD_ERR_LEN, "unregister needs \"region\", a region id");
        return EPD_ERR_BAD_REGION;
    }
    if (c->regions == NULL) {
        snprintf(err, EPD_ERR_LEN, "region %" PRIu64 " is not registered on this connection", id);
        return EPD_ERR_BAD_REGION;
    }
    epd_status_t status = epd_region_unregister(c->regions, (uint32_t)id, err);
    if (status != EPD_OK) return status;
    char text[64];
    snprintf(text, sizeof text, "{\"region\":%" PRIu64 "}", id);
    *reply_p = strdup(text);
    return *reply_p != NULL ? EPD_OK : EPD_ERR_INTERNAL;
}

/* CONTROL serve_experts (DESIGN.md section 9): the regions named "input" and "output" must be
 * this connection's; the rest is the experts' (ctx->serve_experts). */
static epd_status_t conn_serve_experts(epd_conn_t *c, const cJSON *meta, char **reply_p,
                                       char err[EPD_ERR_LEN])
{
    const char *keys[2] = {"input", "output"};
    epd_region_t *regions[2] = {NULL, NULL};

    for (int i = 0; i < 2; i++) {
        uint64_t id;
        if (!epd_json_to_u64(cJSON_GetObjectItemCaseSensitive(meta, keys[i]), &id) ||
            id > UINT32_MAX) {
            snprintf(err, EPD_ERR_LEN, "serve_experts needs \"input\" and \"output\": the ids "
                     "of two regions registered on this connection");
            return EPD_ERR_BAD_REGION;
        }
        regions[i] = epd_region_find(c->regions, (uint32_t)id);
        if (regions[i] == NULL) {
            snprintf(err, EPD_ERR_LEN, "serve_experts: %s region %" PRIu64 " is not registered "
                     "on this connection", keys[i], id);
            return EPD_ERR_BAD_REGION;
        }
    }
    return c->ctx->serve_experts(c->ctx->arg, c, regions[0], regions[1], meta, reply_p, err);
}

/* The reply meta with the CONTROL's "id" put first, when it had one (DESIGN.md section 4). */
static char *meta_with_id(char *meta, bool has_id, uint64_t id)
{
    if (!has_id || meta == NULL || meta[0] != '{') return meta;
    size_t len = strlen(meta);
    char *out = malloc(len + 32);
    if (out == NULL) {
        free(meta);
        return NULL;
    }
    snprintf(out, len + 32, "{\"id\":%" PRIu64 "%s%s", id, meta[1] == '}' ? "" : ",", meta + 1);
    free(meta);
    return out;
}

/* CONTROL: answered at once, in order with the other replies of this connection. */
static void conn_handle_control(epd_conn_t *c, const epd_frame_t *frame)
{
    const cJSON *op = cJSON_GetObjectItemCaseSensitive(frame->meta, "op");
    const char *name = cJSON_IsString(op) ? op->valuestring : NULL;
    bool has_id = frame->id_kind == EPD_FRAME_ID_VALID;
    char *meta = NULL, *payload = NULL;
    size_t payload_len = 0;
    char err[EPD_ERR_LEN];
    epd_frame_out_t out;
    epd_status_t status;

    if (name != NULL && (strcmp(name, "register") == 0 || strcmp(name, "unregister") == 0)) {
        status = name[0] == 'r' ? conn_register(c, frame->meta, &meta, err)
                                : conn_unregister(c, frame->meta, &meta, err);
        if (status != EPD_OK) {
            epd_conn_send_error(c, has_id, frame->id, status, err);
            return;
        }
    } else if (name != NULL && strcmp(name, "serve_experts") == 0) {
        if (c->ctx->serve_experts == NULL) {
            snprintf(err, sizeof err, "serve_experts needs experts.kind = external (this "
                     "daemon runs its own experts)");
            epd_conn_send_error(c, has_id, frame->id, EPD_ERR_UNKNOWN_OP, err);
            return;
        }
        status = conn_serve_experts(c, frame->meta, &meta, err);
        if (status != EPD_OK) {
            epd_conn_send_error(c, has_id, frame->id, status, err);
            return;
        }
    } else {
        status = c->ctx->control(c->ctx->arg, name, &meta, &payload, &payload_len, err);
        if (status == EPD_ERR_UNKNOWN_OP) {
            epd_conn_send_error(c, has_id, frame->id, status, err);
            return;
        }
        if (status != EPD_OK) {
            epd_conn_send_error(c, has_id, frame->id, EPD_ERR_INTERNAL,
                            "out of memory building the reply");
            return;
        }
    }
    meta = meta_with_id(meta, has_id, frame->id);
    if (meta == NULL) {
        free(payload);
        epd_conn_send_error(c, has_id, frame->id, EPD_ERR_INTERNAL, "out of memory building the reply");
        return;
    }
    status = epd_frame_encode_reply(meta, payload, payload_len, &out, err);
    free(meta);
    if (status != EPD_OK) {
        free(payload);
        epd_conn_send_error(c, has_id, frame->id, EPD_ERR_INTERNAL, err);
        return;
    }
    c->ctx->stats->control_requests++;
    /* The copy of what the socket does not take is fine: replies are small. */
    epd_conn_send_frame(c, &out, NULL, NULL);
    free(payload);
}

void epd_conn_handle_frame(epd_conn_t *c, epd_frame_t *frame)
{
    char err[EPD_ERR_LEN];

    c->ctx->stats->frames_in++;
    if (frame->dropped && (frame->type == EPD_FRAME_SUBMIT || frame->type == EPD_FRAME_CONTROL)) {
        snprintf(err, sizeof(err), "the daemon holds too many unfinished frames (a payload of %"
                 PRIu64 " bytes would take all connections over socket.max_buffered_bytes = %"
                 PRIu64 "); retry later", frame->payload_len, c->ctx->cfg->socket.max_buffered_bytes);
        epd_conn_send_error(c, frame->id_kind == EPD_FRAME_ID_VALID, frame->id, EPD_ERR_BUSY, err);
        return;
    }
    switch (frame->type) {
    case EPD_FRAME_SUBMIT:
        conn_handle_submit(c, frame);
        break;
    case EPD_FRAME_CONTROL:
        conn_handle_control(c, frame);
        break;
    case EPD_FRAME_EXPERTS_DONE:
        if (c->ctx->experts_done != NULL) {
            epd_status_t status = c->ctx->experts_done(c->ctx->arg, c, frame, err);
            if (status != EPD_OK)
                epd_conn_fail_framing(c, false, 0, epd_status_is_wire_code(status) ? status
                                                                           : EPD_ERR_INTERNAL,
                                  err);
            break;
        }
        epd_conn_fail_framing(c, false, 0, EPD_ERR_BAD_TYPE,
                          "EXPERTS_DONE from a connection that serves no experts (this daemon's "
                          "experts.kind is not external)");
        break;
    case EPD_FRAME_RESULT:
    case EPD_FRAME_ERROR:
    case EPD_FRAME_REPLY:
    default:
        snprintf(err, sizeof(err), "a client may send SUBMIT, CONTROL or EXPERTS_DONE frames, "
                 "not %s", epd_frame_type_name((int)frame->type));
        epd_conn_fail_framing(c, frame->id_kind == EPD_FRAME_ID_VALID, frame->id, EPD_ERR_BAD_TYPE,
                          err);
        break;
    }
}
