/* The experts of a rank: loading the ffn weights at start-up, and the served layers. */
#include "daemon/experts.h"

#include <stdio.h>
#include <stdlib.h>

#include "common/parse.h"
#include "daemon/engine.h"

epd_status_t epd_experts_open(const epd_config_t *cfg, uint32_t world, uint32_t rank,
                              const epd_ops_t *ops, epd_ops_ctx_t *ops_ctx,
                              epd_ffn_weights_t **weights_p, char err[EPD_ERR_LEN])
{
    uint32_t *layers = NULL;
    size_t n_layers = 0;
    epd_ffn_weights_t *w = NULL;
    epd_moe_shape_t shape;
    epd_status_t status;
    char why[EPD_ERR_LEN];

    *weights_p = NULL;
    if (cfg->experts.kind != EPD_EXPERTS_FFN) return EPD_OK;
    if (cfg->experts.weights[0] == '\0') {
        snprintf(err, EPD_ERR_LEN, "experts.kind = ffn needs experts.weights (a safetensors file, "
                 "or a directory with model.safetensors.index.json)");
        return EPD_ERR_CONFIG;
    }
    if (ops->experts_load == NULL) {
        snprintf(err, EPD_ERR_LEN, "the %s device ops cannot serve experts.kind = ffn", ops->name);
        return EPD_ERR_CONFIG;
    }
    CHECK_GOTO(epd_moe_experts_check(cfg->model.num_experts, world, err), out);
    layers = calloc(EPD_CONFIG_MAX_LAYERS, sizeof *layers);
    if (layers == NULL) {
        snprintf(err, EPD_ERR_LEN, "out of memory");
        return EPD_ERR_NO_MEMORY;
    }
    if (epd_parse_u32_list(cfg->experts.layers, EPD_CONFIG_MAX_LAYER, layers,
                           EPD_CONFIG_MAX_LAYERS, &n_layers, why) != EPD_OK) {
        snprintf(err, EPD_ERR_LEN, "experts.layers: %.200s", why);
        status = EPD_ERR_CONFIG;
        goto out;
    }
    uint32_t per_rank = cfg->model.num_experts / world;
    epd_ffn_spec_t spec = {
        .path = cfg->experts.weights,
        .layers = layers,
        .n_layers = n_layers,
        .hidden = cfg->model.hidden,
        .intermediate = cfg->model.intermediate,
        .num_experts = cfg->model.num_experts,
        .first_expert = rank * per_rank,
        .n_local = per_rank,
    };
    status = epd_ffn_load(&spec, &w, why);
    if (status != EPD_OK) {
        snprintf(err, EPD_ERR_LEN, "experts.weights: %.230s", why);
        goto out;
    }
    shape = epd_moe_shape_from_config(cfg, world, rank);
    status = ops->experts_load(ops_ctx, &shape, w, why);
    if (status != EPD_OK) {
        snprintf(err, EPD_ERR_LEN, "ffn experts (%llu bytes on this rank): %.200s",
                 (unsigned long long)w->local_bytes, why);
        goto out;
    }
    /* the device holds its own copy now */
    if (ops->device_memory) epd_ffn_drop_host(w);
    *weights_p = w;
    w = NULL;
out:
    epd_ffn_free(w);
    free(layers);
    return status;
}

bool epd_experts_layer_served(const epd_ffn_weights_t *weights, int64_t layer)
{
    if (layer < 0 || layer > UINT32_MAX) return false;
    return weights == NULL || epd_ffn_find_layer(weights, (uint32_t)layer) != NULL;
}

bool epd_experts_layer_known(void *weights, uint32_t layer)
{
    return epd_experts_layer_served(weights, layer);
}
