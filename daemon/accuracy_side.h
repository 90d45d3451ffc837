/* The side path of `epd --accuracy`: a step's exchange done on host memory over MPI, for what the
 * daemon's step does not compute itself: the fp32 dispatch reference (rows sent unquantized, each
 * destination's partial in fp32, never rounded, summed in fp32) and the per-tensor requantization
 * modes of DESIGN.md section 3 (each destination requantizes the group128 records it receives to
 * one S with epd_requant_host, then runs the ops' own experts on them). */
#ifndef EPD_DAEMON_ACCURACY_SIDE_H
#define EPD_DAEMON_ACCURACY_SIDE_H

#include <mpi.h>
#include <stdint.h>

#include "common/status.h"
#include "gpu/ffn.h"
#include "gpu/ops.h"

/* The experts the side path runs: the study's shape (this rank of comm), the host kind (its
 * accumulate for the toy kinds), the ffn weights of this rank's experts and the layer studied
 * (ffn only; host copies kept), the ops and their context (the same experts the step runs), and
 * how many threads compute the host reference. All stay the caller's. */
typedef struct epd_acc_experts {
    epd_moe_shape_t shape;
    const epd_expert_ops_t *kind;
    const epd_ffn_weights_t *ffn;
    uint32_t layer;
    const epd_ops_t *ops;
    epd_ops_ctx_t *ops_ctx;
    uint32_t threads;
    MPI_Comm comm;
} epd_acc_experts_t;

typedef struct epd_acc_side epd_acc_side_t;

/* Buffers for steps of up to max_tokens tokens a rank (host and ops memory); EPD_ERR_NO_MEMORY
 * naming what did not fit. Not collective. */
epd_status_t epd_acc_side_create(const epd_acc_experts_t *experts, uint32_t max_tokens,
                                 epd_acc_side_t **side_p, char err[EPD_ERR_LEN]);
void epd_acc_side_destroy(epd_acc_side_t *side);

/* Collective: sends this rank's n tokens (x bf16 [n, H], ids and weights [n, K], host memory) once
 * to each rank that owns one of their experts, unquantized; the received rows serve the calls
 * below until the next dispatch. EPD_ERR_EXPERT_OUT_OF_RANGE for an id outside [-1, E). */
epd_status_t epd_acc_side_dispatch(epd_acc_side_t *side, uint32_t n, const uint16_t *x,
                                   const int32_t *ids, const float *weights,
                                   char err[EPD_ERR_LEN]);

/* Collective: the fp32 dispatch of the last dispatched tokens into ref [n, H] (host): each
 * destination's partial (ascending k over its experts, acc = acc + w * y in fp32, the experts'
 * host arithmetic: the toy kinds' accumulate, or epd_ffn_expert_host on the row as an
 * unquantized dispatch gives it: BF16 values for BF16 weights, the group128 bytes its FP8 GEMM
 * reads for FP8 weights), sent back in fp32, summed in ascending rank order in fp32. */
epd_status_t epd_acc_side_reference(epd_acc_side_t *side, float *ref, char err[EPD_ERR_LEN]);

/* Collective: the requant mode on the last dispatched tokens into y bf16 [n, H] (host): each
 * destination quantizes its received rows group128 fp32 (the bytes the pack writes), requantizes
 * them (epd_requant_host) to S = static_s when it is > 0, else the step S (the largest scale of
 * the records it received, epd_requant_step_scale_host), runs the ops' experts on them as FP8
 * records whose every group scale is S, and the BF16 partials come back and are combined as the
 * step combines them. *s_p: the S this rank used (0 when it received nothing). */
epd_status_t epd_acc_side_requant(epd_acc_side_t *side, float static_s, uint16_t *y, float *s_p,
                                  char err[EPD_ERR_LEN]);

#endif
