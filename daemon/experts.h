/* The experts a rank serves (DESIGN.md section 9): for experts.kind ffn, this rank's experts of
 * every layer loaded from experts.weights at start-up and handed to the device ops; the set of
 * layers a SUBMIT may name. The toy kinds need nothing and serve any layer. */
#ifndef EPD_DAEMON_EXPERTS_H
#define EPD_DAEMON_EXPERTS_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"
#include "config/config.h"
#include "gpu/ffn.h"
#include "gpu/ops.h"

/* Loads rank's experts of the configured layers (experts.weights, experts.layers,
 * model.intermediate) and gives them to ops (experts_load); *weights_p is NULL for the toy kinds.
 * Not collective. On failure err names the setting, file and tensor (or the bytes short) and
 * nothing stays allocated. Free with epd_ffn_free after the ops context is finished. */
epd_status_t epd_experts_open(const epd_config_t *cfg, uint32_t world, uint32_t rank,
                              const epd_ops_t *ops, epd_ops_ctx_t *ops_ctx,
                              epd_ffn_weights_t **weights_p, char err[EPD_ERR_LEN]);

/* Whether a SUBMIT may name layer (else unknown_layer): any layer for the toy kinds (weights
 * NULL), the loaded ones for ffn. */
bool epd_experts_layer_served(const epd_ffn_weights_t *weights, int64_t layer);

/* The same as a submit-limits hook (proto/frame.h layer_known): arg is the weights. */
bool epd_experts_layer_known(void *weights, uint32_t layer);

#endif
