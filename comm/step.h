/* The collective step (DESIGN.md section 2, steps 3-7): layout -> pack, with the MPI_Alltoall of
 * record counts while the pack runs -> transport alltoallv of the records for other ranks ->
 * experts on them -> reverse alltoallv of their partials (BF16, or FP8 with combine.dtype fp8),
 * while the experts run on this rank's own records (which never pass through the transport) ->
 * combine. It owns the step
 * buffers (ops memory, sized for max_tokens at creation) and the phases (epd_phase_t), timing
 * each; the engine and the benchmark both drive it. All ranks of comm run each step together. */
#ifndef EPD_COMM_STEP_H
#define EPD_COMM_STEP_H

#include <mpi.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "comm/transport.h"
#include "common/status.h"
#include "gpu/external.h"
#include "gpu/ops.h"

/* The step's phases, in the order they run. */
typedef enum {
    EPD_PHASE_LAYOUT_PACK = 0, /* layout + quantize/pack */
    EPD_PHASE_COUNTS,          /* MPI_Alltoall of record counts */
    EPD_PHASE_DISPATCH,        /* alltoallv of records */
    EPD_PHASE_EXPERTS,
    EPD_PHASE_COMBINE,         /* reverse alltoallv of partials */
    EPD_PHASE_REDUCE,          /* final combine into y */
    EPD_PHASE_MAX
} epd_phase_t;

/* The phases' names for stats, metrics and the benchmark: "pack", "counts", ... (comm/phase.c). */
extern const char *const epd_phase_names[EPD_PHASE_MAX];

typedef struct epd_step_timing {
    /* Per epd_phase_t. The count exchange overlaps the pack (pack is the rest of their time).
     * With device ops, experts are those on other ranks' records and combine includes the
     * experts on this rank's own records, which run beside it; host ops run all experts in the
     * experts phase. */
    uint64_t phase_ns[EPD_PHASE_MAX];
    uint64_t total_ns;
    uint32_t n_tokens;
    uint32_t records_sent;          /* dispatch records this rank sent, itself included */
    uint32_t records_sent_off_rank; /* ... to other ranks */
    uint32_t records_recv;          /* records this rank ran experts on */
    uint32_t records_recv_off_rank;
    uint64_t dispatch_bytes; /* records_sent x record size */
    uint64_t dispatch_bytes_off_rank;
    uint64_t combine_bytes; /* partials this rank sent back: records_recv x partial size */
    uint64_t combine_bytes_off_rank;
    /* telemetry.quant_error: this step's error sums (all zero when off or nothing quantized) */
    epd_quant_error_t quant_error;
    /* The rows (token, expert) pairs this rank's experts ran, per local expert, from the count
     * exchange: local_expert_rows[e] for expert local_first + e, e < n_local. The step owns the
     * array; it holds until the next step. */
    const uint32_t *local_expert_rows;
    uint32_t local_first, n_local;
    /* This rank's tokens naming each expert [E] (the layout's counts: every expert's count of
     * the step's top-k ids, the empty slots not counted); the step owns it until the next step. */
    const uint32_t *expert_tokens;
} epd_step_timing_t;

/* The step's input and output buffers in ops memory, each sized for max_tokens rows. */
typedef struct epd_step_io {
    uint16_t *x;         /* bf16 [max_tokens, H] */
    int32_t *topk_ids;   /* [max_tokens, K], then room for as many floats: a step of n tokens
                          * may put its weights at topk_ids + n K and copy both at once */
    float *topk_weights; /* [max_tokens, K] */
    uint16_t *y;         /* bf16 [max_tokens, H] */
} epd_step_io_t;

/* What the last step exchanged, for benchmarks that replay the same bytes with a raw alltoallv.
 * Counts and displacements are per peer, in records (items of record_bytes for the dispatch and
 * of partial_bytes for the combine, which runs with send and recv swapped). Owned by the step,
 * valid until its next run. */
typedef struct epd_step_exchange {
    const uint64_t *send_counts;
    const uint64_t *send_displs;
    const uint64_t *recv_counts;
    const uint64_t *recv_displs;
    void *send_buf; /* ops memory, max_tokens x min(W, K) records */
    void *recv_buf; /* ops memory, max_tokens x W records */
    size_t record_bytes;
    void *partials;          /* ops memory, one partial per received record */
    void *partials_back;     /* ops memory, one partial per sent record */
    size_t partial_bytes;    /* epd_partial_layout's size: 2H (BF16) or H + H/32, padded (FP8) */
    size_t send_capacity;    /* records */
    size_t recv_capacity;
} epd_step_exchange_t;

typedef struct epd_step epd_step_t;

/* Bytes a step for shape and max_tokens allocates (ops memory plus host), or SIZE_MAX when that
 * does not fit in size_t: lets a caller refuse a size clearly before trying. */
size_t epd_step_memory_bytes(const epd_moe_shape_t *shape, uint32_t max_tokens);

/* Creates a step for this rank (shape->rank and shape->world must be comm's). Allocates every
 * buffer up front, so a step never allocates; EPD_ERR_NO_MEMORY names what did not fit. ops,
 * transport, their contexts and comm stay the caller's. Not collective. */
epd_status_t epd_step_create(const epd_moe_shape_t *shape, uint32_t max_tokens,
                             const epd_ops_t *ops, epd_ops_ctx_t *ops_ctx,
                             const epd_transport_t *transport, epd_transport_ctx_t *transport_ctx,
                             MPI_Comm comm, epd_step_t **step_p, char err[EPD_ERR_LEN]);
void epd_step_destroy(epd_step_t *step);

/* The step's own input/output buffers (ops memory); callers may also pass their own to run. */
const epd_step_io_t *epd_step_io(const epd_step_t *step);

/* Runs one step on all ranks of comm (collective; n_tokens may be 0 and differ between ranks).
 * x bf16 [N,H], ids/weights [N,K] and y bf16 [N,H] are ops memory (ids and weights may be
 * alloc_host memory with ops->pack_reads_host and the ids set by epd_step_set_host_ids: only
 * the pack reads them); y is complete on return.
 * timing_p may be NULL. A failure after the count exchange leaves the ranks out of step: the
 * caller must treat any error as fatal for the job. */
epd_status_t epd_step_run(epd_step_t *step, uint32_t n_tokens, const uint16_t *x,
                          const int32_t *topk_ids, const float *topk_weights, uint16_t *y,
                          epd_step_timing_t *timing_p, char err[EPD_ERR_LEN]);

/* The next run's top-k ids [n, K] on the host as well (the same values as its ops-memory ids,
 * unchanged until it returns): the layout is then computed on the host and only its slots go to
 * the device. For that run only; NULL (the default) computes it with the ops. */
void epd_step_set_host_ids(epd_step_t *step, const int32_t *ids_host);

/* The layer the next runs serve (shape.layer as the ops see it); 0 until set. Every rank of a
 * step sets the same one (the agreement chose it). */
void epd_step_set_layer(epd_step_t *step, uint32_t layer);

/* The step scale (DESIGN.md section 3): on (the default is off), each FP8 run's pack also finds
 * the largest scale of the records for each rank, those maxima travel with the record counts
 * (one more word a peer in the same MPI_Alltoall) and S = the largest this rank received, its
 * own records' included. It costs the run a wait for the pack before the count exchange, which
 * otherwise overlaps the pack. Every rank of comm sets the same; for external experts and the
 * accuracy study, whose experts take one per-tensor input scale. */
void epd_step_set_scale_exchange(epd_step_t *step, bool on);

/* S of the last run: the largest scale of the records this rank received (those from itself
 * included), as the senders reported it; 0 when the exchange is off, the wire is BF16, or no
 * record arrived. What epd_requant_given_host/_cuda take as the step scale. */
float epd_step_scale(const epd_step_t *step);

/* The per-peer counts and buffers of the last run. */
void epd_step_last_exchange(const epd_step_t *step, epd_step_exchange_t *exchange_p);

/* The experts phase of an expert kind whose experts run outside the ops (epd_expert_ops_t
 * external): the step calls the hook once per run, on the thread that runs the step, with every
 * record this rank received (this rank's own included, segments in source-rank order, partials
 * to fill) and the rows per local expert; it must fill every partial (zeros when the experts did
 * not run) and set *failure_p: 0 when the experts ran, else a reason code (nonzero, the hook's
 * own). A status other than EPD_OK fails the step (the job then aborts), so a worker that is
 * missing or late is a failure code, not a status. The ranks then exchange their codes
 * (MPI_Allgather of one byte each, in every run while a hook is set, so all ranks must set one:
 * they run the same expert kind). */
typedef struct epd_step_experts {
    uint32_t layer;
    epd_external_segment_t segments[EPD_EXTERNAL_SEGMENTS];
    uint32_t n_segments;
    uint32_t n_records;
    const uint32_t *expert_rows; /* [E/W] host */
    float scale; /* with the scale exchange (epd_step_set_scale_exchange), the step scale S of
                    the records this rank received, from the count exchange; else 0 */
} epd_step_experts_t;

typedef epd_status_t (*epd_step_experts_fn)(void *arg, const epd_moe_shape_t *shape,
                                            const epd_step_experts_t *call, uint8_t *failure_p,
                                            char err[EPD_ERR_LEN]);

/* Sets the experts hook (NULL: the experts op). A step of an external kind without one fails. */
void epd_step_set_experts_hook(epd_step_t *step, epd_step_experts_fn fn, void *arg);

/* After a run with a hook: [W] failure codes, 0 where that rank's experts ran (all 0 without a
 * hook). Owned by the step, valid until its next run. */
const uint8_t *epd_step_experts_failures(const epd_step_t *step);

#endif
