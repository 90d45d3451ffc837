/* epd_status_t: the one status enum of the project. The first block are the wire error codes of
 * DESIGN.md section 4 (their snake_case names travel in ERROR frames); the second block are local
 * failures that never travel as such (a daemon reports them to a client as `internal`). */
#ifndef EPD_COMMON_STATUS_H
#define EPD_COMMON_STATUS_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EPD_ERR_LEN 256

typedef enum {
    EPD_OK = 0,
    /* framing: answered with ERROR, then the connection is closed */
    EPD_ERR_BAD_MAGIC,
    EPD_ERR_BAD_VERSION,
    EPD_ERR_BAD_TYPE,
    EPD_ERR_BAD_HEADER,
    EPD_ERR_FRAME_TOO_LARGE,
    EPD_ERR_BAD_JSON,
    /* request: answered with ERROR for that id, the connection stays */
    EPD_ERR_BAD_TENSOR,
    EPD_ERR_UNSUPPORTED_DTYPE,
    EPD_ERR_SHAPE_MISMATCH,
    EPD_ERR_EXPERT_OUT_OF_RANGE,
    EPD_ERR_INVALID_TOPK,
    EPD_ERR_NON_FINITE_INPUT,
    EPD_ERR_TOO_MANY_TOKENS,
    EPD_ERR_UNKNOWN_LAYER,
    EPD_ERR_BAD_REGION,
    EPD_ERR_EXPERTS_UNAVAILABLE,
    EPD_ERR_BUSY,
    EPD_ERR_SHUTTING_DOWN,
    EPD_ERR_UNKNOWN_OP,
    EPD_ERR_INTERNAL,
    /* local only */
    EPD_ERR_AGAIN,        /* incremental decoder: need more bytes */
    EPD_ERR_NO_MEMORY,
    EPD_ERR_INVALID_ARG,
    EPD_ERR_CONFIG,
    EPD_ERR_IO,
    EPD_ERR_MPI,
    EPD_ERR_CUDA,
    EPD_ERR_NCCL,
    EPD_ERR_UNSUPPORTED,
    EPD_STATUS_MAX
} epd_status_t;

/* The snake_case name of a status ("bad_magic", "ok", "no_memory", ...); never NULL. */
const char *epd_status_name(epd_status_t status);

/* Parses a wire error code back into a status; EPD_ERR_INTERNAL for names not in the list. */
epd_status_t epd_status_from_name(const char *name);

/* True for the codes that may travel in an ERROR frame (DESIGN.md section 4). */
bool epd_status_is_wire_code(epd_status_t status);

/* True for framing errors, after which the connection is closed. */
bool epd_status_is_framing(epd_status_t status);

/* Runs call, stores its result in the caller's `status`, and jumps to label on failure. */
#define CHECK_GOTO(call, label)          \
    do {                                 \
        status = (call);                 \
        if (status != EPD_OK) goto label; \
    } while (0)

#define EPD_ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))

#ifdef __cplusplus
}
#endif

#endif
