/* Names of epd_status_t values: the wire error codes of DESIGN.md section 4 and local failures. */
#include "common/status.h"

#include <string.h>

static const char *const status_names[EPD_STATUS_MAX] = {
    [EPD_OK] = "ok",
    [EPD_ERR_BAD_MAGIC] = "bad_magic",
    [EPD_ERR_BAD_VERSION] = "bad_version",
    [EPD_ERR_BAD_TYPE] = "bad_type",
    [EPD_ERR_BAD_HEADER] = "bad_header",
    [EPD_ERR_FRAME_TOO_LARGE] = "frame_too_large",
    [EPD_ERR_BAD_JSON] = "bad_json",
    [EPD_ERR_BAD_TENSOR] = "bad_tensor",
    [EPD_ERR_UNSUPPORTED_DTYPE] = "unsupported_dtype",
    [EPD_ERR_SHAPE_MISMATCH] = "shape_mismatch",
    [EPD_ERR_EXPERT_OUT_OF_RANGE] = "expert_out_of_range",
    [EPD_ERR_INVALID_TOPK] = "invalid_topk",
    [EPD_ERR_NON_FINITE_INPUT] = "non_finite_input",
    [EPD_ERR_TOO_MANY_TOKENS] = "too_many_tokens",
    [EPD_ERR_UNKNOWN_LAYER] = "unknown_layer",
    [EPD_ERR_BAD_REGION] = "bad_region",
    [EPD_ERR_EXPERTS_UNAVAILABLE] = "experts_unavailable",
    [EPD_ERR_BUSY] = "busy",
    [EPD_ERR_SHUTTING_DOWN] = "shutting_down",
    [EPD_ERR_UNKNOWN_OP] = "unknown_op",
    [EPD_ERR_INTERNAL] = "internal",
    [EPD_ERR_AGAIN] = "again",
    [EPD_ERR_NO_MEMORY] = "no_memory",
    [EPD_ERR_INVALID_ARG] = "invalid_argument",
    [EPD_ERR_CONFIG] = "config",
    [EPD_ERR_IO] = "io",
    [EPD_ERR_MPI] = "mpi",
    [EPD_ERR_CUDA] = "cuda",
    [EPD_ERR_NCCL] = "nccl",
    [EPD_ERR_UNSUPPORTED] = "unsupported",
};

const char *epd_status_name(epd_status_t status)
{
    if ((unsigned)status >= EPD_STATUS_MAX || status_names[status] == NULL) return "unknown";
    return status_names[status];
}

epd_status_t epd_status_from_name(const char *name)
{
    if (name == NULL) return EPD_ERR_INTERNAL;
    for (int s = 0; s <= EPD_ERR_INTERNAL; s++) {
        if (strcmp(status_names[s], name) == 0) return (epd_status_t)s;
    }
    return EPD_ERR_INTERNAL;
}

bool epd_status_is_wire_code(epd_status_t status)
{
    return status > EPD_OK && status <= EPD_ERR_INTERNAL;
}

bool epd_status_is_framing(epd_status_t status)
{
    return status >= EPD_ERR_BAD_MAGIC && status <= EPD_ERR_BAD_JSON;
}
