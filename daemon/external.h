/* External experts (experts.kind external, DESIGN.md section 9): the rank's expert worker, one
 * connection that sent CONTROL serve_experts with an input and an output region. Each step the
 * engine's worker thread writes the rows of this rank's experts into the input region, hands
 * an EXPERTS frame to the loop thread (which owns the connection) and waits, up to
 * experts.external_timeout_ms, for the worker's EXPERTS_DONE; then it forms the partials from
 * the output region. No worker, a worker that leaves, or one that is late: the partials are
 * zero and the step reports a failure code (the requests whose tokens reached this rank's
 * experts get experts_unavailable), and the job goes on; a worker may attach again at any time.
 * Loop thread: attach, done, detach. Engine worker thread: epd_external_run. */
#ifndef EPD_DAEMON_EXTERNAL_H
#define EPD_DAEMON_EXTERNAL_H

#include <stdatomic.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "comm/step.h"
#include "common/status.h"
#include "config/config.h"
#include "daemon/conn.h"
#include "daemon/region.h"
#include "gpu/ops.h"
#include "proto/frame.h"

struct event_base;

/* Why a rank's experts did not run in a step (the failure codes the ranks exchange). */
enum {
    EPD_EXTERNAL_SERVED = 0,
    EPD_EXTERNAL_NO_WORKER,    /* no connection serves this rank's experts */
    EPD_EXTERNAL_LEFT,         /* the worker's connection closed during the step */
    EPD_EXTERNAL_TIMEOUT,      /* no EXPERTS_DONE within experts.external_timeout_ms */
    EPD_EXTERNAL_LATE,         /* the worker has not answered an earlier, timed-out step yet */
    EPD_EXTERNAL_TOO_SMALL,    /* the rows did not fit the worker's regions or the capacity */
    EPD_EXTERNAL_FAILED,       /* the daemon could not prepare the rows (see its log) */
    EPD_EXTERNAL_FAILURE_MAX
};

/* A phrase for a failure code: "has no expert worker", ... (for the requests' messages). */
static inline const char *epd_external_failure_text(uint8_t code)
{
    static const char *const texts[EPD_EXTERNAL_FAILURE_MAX] = {
        [EPD_EXTERNAL_SERVED] = "served its experts",
        [EPD_EXTERNAL_NO_WORKER] = "has no expert worker (CONTROL serve_experts)",
        [EPD_EXTERNAL_LEFT] = "lost its expert worker during the step",
        [EPD_EXTERNAL_TIMEOUT] = "got no EXPERTS_DONE within experts.external_timeout_ms",
        [EPD_EXTERNAL_LATE] = "still waits for its worker's answer to an earlier step",
        [EPD_EXTERNAL_TOO_SMALL] = "had more rows than its worker's regions or capacity hold",
        [EPD_EXTERNAL_FAILED] = "could not prepare its worker's rows",
    };
    return code < EPD_EXTERNAL_FAILURE_MAX ? texts[code] : "failed its experts";
}

typedef struct epd_external epd_external_t;

/* The external experts of rank `rank` of `world` (cfg->experts.kind must be external); the send
 * event lives on base (made with evthread support). ops are the engine's (what the step's
 * records are in). cfg must outlive it. */
epd_status_t epd_external_create(const epd_config_t *cfg, uint32_t world, uint32_t rank,
                                 struct event_base *base, const epd_ops_t *ops,
                                 epd_ops_ctx_t *ops_ctx, epd_external_t **ext_p,
                                 char err[EPD_ERR_LEN]);

/* Frees it (after the engine has stopped: no step runs). NULL is ignored. */
void epd_external_free(epd_external_t *ext);

/* The loop's spinning flag (daemon/server.c): while it is set the loop polls
 * epd_external_poll every iteration and the hand-over skips event_active (whose lock the
 * spinning loop holds). NULL: always event_active. */
void epd_external_set_loop(epd_external_t *ext, atomic_bool *spinning);

/* Loop thread, every iteration of a spinning loop: sends the EXPERTS handed over, if any. */
void epd_external_poll(epd_external_t *ext);

/* Loop thread. CONTROL serve_experts from conn with its regions in and out: EPD_OK and the REPLY
 * meta (malloc'ed) in *reply_p; EPD_ERR_BUSY when the rank has a worker already,
 * EPD_ERR_BAD_REGION for unusable regions or input_scale, with err. */
epd_status_t epd_external_attach(epd_external_t *ext, epd_conn_t *conn, epd_region_t *in,
                                 epd_region_t *out, const cJSON *meta, char **reply_p,
                                 char err[EPD_ERR_LEN]);

/* Loop thread. EXPERTS_DONE from conn: EPD_OK; EPD_ERR_BAD_TYPE (conn is not the worker) or
 * EPD_ERR_BAD_JSON (no step, or not the step it was given) with err: conn must be closed. */
epd_status_t epd_external_done(epd_external_t *ext, epd_conn_t *conn, const epd_frame_t *frame,
                               char err[EPD_ERR_LEN]);

/* Loop thread. conn is closing: when it is the worker, the rank has none from now on (a step
 * waiting for it goes on with zero partials). */
void epd_external_detach(epd_external_t *ext, epd_conn_t *conn);

/* Engine worker thread: the experts phase of step `step` (an epd_step_experts_fn with the step
 * number; arg is the epd_external_t). */
epd_status_t epd_external_run(void *arg, uint64_t step, const epd_moe_shape_t *shape,
                              const epd_step_experts_t *call, uint8_t *failure_p,
                              char err[EPD_ERR_LEN]);

#endif
