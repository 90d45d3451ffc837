/* The engine: the queue of accepted requests, the collective step agreement (DESIGN.md section 5)
 * and the steps themselves (section 2), on a worker thread so the event loop keeps serving while a
 * step's communication is in flight. The server (event-loop thread) submits requests and collects
 * results; only the engine calls MPI after start-up, and never two threads at once. */
#ifndef EPD_DAEMON_ENGINE_H
#define EPD_DAEMON_ENGINE_H

#include <mpi.h>
#include <stdbool.h>
#include <stdint.h>

#include "comm/step.h"
#include "comm/transport.h"
#include "common/status.h"
#include "config/config.h"
#include "daemon/quant_stats.h"
#include "gpu/ops.h"

/* One accepted SUBMIT, validated at ingest. The engine owns it after a successful submit. */
typedef struct epd_request {
    uint64_t id;           /* the client's id */
    uint64_t conn_id;      /* the connection it came on (never reused within a run) */
    uint32_t n_tokens;
    uint32_t layer;        /* the MoE layer (SUBMIT "layer", default 0); a step serves one */
    const uint16_t *x;     /* bf16 [N,H]: host memory, or ops memory when x_device */
    bool x_device;         /* x is in a device region, or a device copy (x_copy) */
    const int32_t *topk_ids;     /* [N,K], host */
    const float *topk_weights;   /* [N,K], host */
    uint16_t *y_dst;       /* y is written here (a region), not into the result; or NULL */
    bool y_device;         /* y_dst is ops memory */
    uint32_t y_region;     /* for the RESULT meta when y_dst is set */
    uint64_t y_offset;
    void *storage;         /* owns what x, ids, weights point to in the payload */
    void (*storage_release)(void *storage); /* how storage is given back; NULL: free */
    void *owned;           /* more host memory behind ids/weights (may be NULL); free()d */
    /* A device copy of a host x made at ingest (x points to it, x_device is set), given back
     * with x_copy_free(x_copy_arg, x_copy) when the request is freed; NULL: none. */
    void *x_copy;
    void (*x_copy_free)(void *arg, void *copy);
    void *x_copy_arg;
    /* References on the regions the tensors are in, each dropped with unref when the request is
     * freed (after its answer is complete, y included). */
    void *regions[4];
    void (*unref)(void *region);
    uint64_t arrived_ns;   /* CLOCK_MONOTONIC when the recv(2) that completed its frame returned */
    uint64_t decoded_ns;   /* when the decoder returned its frame */
    uint64_t read_ns;      /* CLOCK_MONOTONIC when its frame was read (before validation) */
    uint64_t ingest_ns;    /* of its validation, the time the device took (ns; 0: none) */
    uint64_t enqueued_ns;  /* CLOCK_MONOTONIC when queued */
    uint64_t taken_ns;     /* when a step took it */
    struct epd_request *next;
} epd_request_t;

/* The answer to one request: y bf16 [N,H] (malloc'ed, owned by the result), or an error. */
typedef struct epd_result {
    uint64_t id;
    uint64_t conn_id;
    uint32_t n_tokens;
    uint16_t *y;           /* NULL when y went into a region (y_region, y_offset); from
                            * epd_pinned_alloc */
    bool y_in_region;
    uint32_t y_region;
    uint64_t y_offset;
    uint64_t step;         /* step number that produced it */
    epd_status_t status;   /* EPD_OK, or the code to send in an ERROR frame */
    char message[EPD_ERR_LEN];
    uint64_t latency_ns;   /* queued to answered */
    /* the request's times (daemon/trace.h): frame read, queued, taken, step done */
    uint64_t arrived_ns, decoded_ns, read_ns, enqueued_ns, taken_ns, done_ns;
    uint64_t ingest_ns;                  /* the request's device ingest (a duration) */
    uint64_t step_begin_ns, step_end_ns; /* epd_step_run called and returned */
    uint64_t handed_ns;                  /* queued for the loop thread */
    struct epd_result *next;
} epd_result_t;

#define EPD_ENGINE_STATS_LAYERS 64 /* DeepSeek-V3's MoE layers are 3..60 (61: its MTP layer) */

typedef struct epd_engine_stats {
    uint64_t steps;
    uint64_t tokens;                  /* tokens of this rank stepped */
    uint64_t requests;                /* requests answered with a result */
    uint64_t queued_tokens;           /* now */
    uint64_t queued_requests;         /* now */
    uint64_t bytes_sent[2];           /* dispatch bytes sent off this rank, [EPD_WIRE_FP8], [EPD_WIRE_BF16] */
    uint64_t bytes_combined;          /* combine bytes sent */
    uint64_t records_sent;
    uint64_t phase_ns[EPD_PHASE_MAX]; /* totals per epd_phase_t (comm/step.h) */
    uint64_t last_step_ns;
    /* tokens of this rank stepped per MoE layer; layers above the last slot count in it */
    uint64_t layer_tokens[EPD_ENGINE_STATS_LAYERS];
    bool shutting_down;
    epd_quant_stats_t quant_error; /* telemetry.quant_error (daemon/quant_stats.h) */
} epd_engine_stats_t;

typedef struct epd_engine epd_engine_t;

/* The MoE shape the configuration gives rank `rank` of `world`: hidden, topk and num_experts
 * from model.*, dtype and scales from dispatch.*, the expert kind from experts.kind, the
 * combine dtype and the telemetry switch. */
epd_moe_shape_t epd_moe_shape_from_config(const epd_config_t *cfg, uint32_t world, uint32_t rank);

/* Called on the engine thread whenever results are ready or the engine has stopped; it must only
 * wake the loop (e.g. event_active on an event made with evthread support). */
typedef void (*epd_engine_wake_fn)(void *arg);

/* Creates the engine for this rank (collective over comm): buffers sized from cfg and the worker
 * thread, which runs the agreements and the steps and from then on is the only caller of MPI.
 * ops/ops_ctx and transport/transport_ctx stay owned by the caller. */
epd_status_t epd_engine_create(const epd_config_t *cfg, MPI_Comm comm, const epd_ops_t *ops,
                               epd_ops_ctx_t *ops_ctx, const epd_transport_t *transport,
                               epd_transport_ctx_t *transport_ctx, epd_engine_wake_fn wake,
                               void *wake_arg, epd_engine_t **engine_p, char err[EPD_ERR_LEN]);

/* Queues a request (loop thread). EPD_OK: the engine owns req. EPD_ERR_BUSY (queue holds
 * dispatch.max_queued_tokens), EPD_ERR_SHUTTING_DOWN (agreed shutdown, or a step failed): the
 * caller keeps req and answers the error. */
epd_status_t epd_engine_submit(epd_engine_t *engine, epd_request_t *req);

/* Frees a request that is not the engine's (refused by submit), dropping its region references. */
void epd_request_free(epd_request_t *req);

/* Takes every finished result, oldest first (loop thread); the caller frees each with
 * epd_result_free. */
epd_result_t *epd_engine_take_results(epd_engine_t *engine);
void epd_result_free(epd_result_t *result);

/* Asks for a graceful stop (async-signal-safe: it only sets a flag). Once all ranks agree, new
 * submits get EPD_ERR_SHUTTING_DOWN, steps run until every accepted request is answered, and then
 * epd_engine_stopped turns true. Once it has returned true on the loop thread, the worker has
 * left and calls wake no more (it waits for that), so the loop may free what wake touches. */
void epd_engine_request_shutdown(epd_engine_t *engine);
bool epd_engine_stopped(epd_engine_t *engine);

/* True while this rank saw work (a submit accepted or a step with tokens) within
 * dispatch.hot_ms and its node has a core for every thread that would spin: the loop thread may
 * poll its sockets without sleeping then, as the worker polls its agreements. */
bool epd_engine_hot(epd_engine_t *engine);

/* The engine's pool of page-locked buffers (socket.pinned_bytes) for payloads and results. */
struct epd_pinned_pool *epd_engine_pinned(epd_engine_t *engine);

/* True when a step failed (a transport, MPI or device error): the requests it held and every
 * queued one were answered with EPD_ERR_INTERNAL, and the engine stopped. The ranks are out of
 * step then, so the daemon must end the job with MPI_Abort (DESIGN.md section 8) rather than exit
 * as after a drain. err (may be NULL) receives the step's message. Any thread. */
bool epd_engine_failed(epd_engine_t *engine, char err[EPD_ERR_LEN]);

void epd_engine_get_stats(epd_engine_t *engine, epd_engine_stats_t *stats_p);

/* Called on the worker thread after each step that succeeded, with its timing, its layer, and the
 * step's top-k ids on the host ([n_tokens, K], valid only during the call). */
typedef void (*epd_engine_step_observer_fn)(void *arg, const epd_step_timing_t *timing,
                                            uint32_t layer, const int32_t *topk_ids,
                                            uint32_t n_tokens);

/* Sets the step observer (any thread; the steps after it call it; NULL: none). */
void epd_engine_set_step_observer(epd_engine_t *engine, epd_engine_step_observer_fn fn, void *arg);

/* The experts phase of an expert kind that runs outside the ops (experts.kind external): the
 * step's hook (comm/step.h epd_step_experts_fn) with the number the step's RESULTs will carry. */
typedef epd_status_t (*epd_engine_experts_fn)(void *arg, uint64_t step,
                                              const epd_moe_shape_t *shape,
                                              const epd_step_experts_t *call, uint8_t *failure_p,
                                              char err[EPD_ERR_LEN]);

/* Sets the experts hook (loop thread, right after create: a step of an external kind waits for
 * it). The requests whose tokens reached a rank whose hook reported a failure are answered
 * EPD_ERR_EXPERTS_UNAVAILABLE (describe gives the failure's phrase); the others as usual. */
void epd_engine_set_experts(epd_engine_t *engine, epd_engine_experts_fn fn, void *arg,
                            const char *(*describe)(uint8_t failure));

/* The device operations the engine runs its steps with (shared regions page-lock and open device
 * memory through them). */
void epd_engine_ops(epd_engine_t *engine, const epd_ops_t **ops_p, epd_ops_ctx_t **ops_ctx_p);

/* What the worker is doing now, and since when (CLOCK_MONOTONIC ns): for health and stall
 * detection. */
typedef enum {
    EPD_ENGINE_IDLE = 0, /* waiting out the back-off before the next agreement */
    EPD_ENGINE_AGREEING, /* in an agreement: waiting for every rank to join */
    EPD_ENGINE_STEPPING, /* running a step */
    EPD_ENGINE_STOPPED,
    EPD_ENGINE_ACTIVITY_MAX
} epd_engine_activity_t;

/* The name ("idle", "agreement", "step", "stopped"); since_ns_p (may be NULL) gets when it began.
 * Any thread. */
const char *epd_engine_activity(epd_engine_t *engine, uint64_t *since_ns_p);

/* Joins the worker and frees everything; results not taken are freed. */
void epd_engine_destroy(epd_engine_t *engine);

#endif
