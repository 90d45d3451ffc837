/* epd's settings: one table (config/settings.c) drives defaults, YAML, environment, --set,
 * --print-config and --help (DESIGN.md section 6). This header is the typed view the rest of the
 * daemon reads; nothing outside config/ parses a setting. */
#ifndef EPD_CONFIG_CONFIG_H
#define EPD_CONFIG_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/status.h"
#include "gpu/types.h" /* the enums of the dispatch, experts and device settings */

#ifdef __cplusplus
extern "C" {
#endif

#define EPD_CONFIG_STR_LEN 256
#define EPD_CONFIG_MAX_UIDS 32
#define EPD_CONFIG_MAX_LAYERS 1024 /* experts.layers: values in a list */
#define EPD_CONFIG_MAX_LAYER 4095  /* ... each in [0, EPD_CONFIG_MAX_LAYER] */

typedef enum { EPD_TRANSPORT_AUTO = 0, EPD_TRANSPORT_MPI, EPD_TRANSPORT_NCCL } epd_transport_kind_t;
typedef enum { EPD_TRISTATE_AUTO = 0, EPD_TRISTATE_TRUE, EPD_TRISTATE_FALSE } epd_tristate_t;
typedef enum { EPD_SWITCH_OFF = 0, EPD_SWITCH_ON } epd_switch_t; /* a true/false setting */
typedef enum { EPD_LOG_ERROR = 0, EPD_LOG_WARN, EPD_LOG_INFO, EPD_LOG_DEBUG } epd_log_level_t;

typedef struct epd_config {
    struct {
        char path[EPD_CONFIG_STR_LEN];  /* may hold %r (rank), %l (local rank), %h (short host) */
        uint32_t mode;                  /* file mode of the socket, e.g. 0660 */
        uint64_t max_frame_bytes;       /* largest payload_len accepted */
        uint32_t max_clients;           /* connections per rank; more are answered busy */
        uint64_t max_output_bytes;      /* per-connection unsent reply bytes before reads pause */
        uint64_t max_buffered_bytes;    /* incoming frame bytes, all connections together */
        uint64_t pinned_bytes;          /* page-locked pool for payloads and results */
        uint32_t idle_timeout_ms;       /* close an idle connection after this; 0: never */
        uint32_t frame_timeout_ms;      /* close when a started frame takes longer; 0: never */
        uint32_t max_regions;           /* shared regions per connection */
        uint32_t sndbuf_bytes;          /* SO_SNDBUF of each connection; 0: the system's */
        uint32_t io_threads;            /* socket copy threads; 0: all I/O on the loop thread */
        uint64_t io_offload_bytes;      /* payloads this large are copied by those threads */
        uint32_t allow_uids[EPD_CONFIG_MAX_UIDS]; /* empty list: any peer the file mode lets in */
        uint32_t n_allow_uids;
    } socket;
    struct {
        uint32_t hidden;      /* H, a multiple of 128 */
        uint32_t num_experts; /* E, a multiple of the number of ranks */
        uint32_t topk;        /* K */
        uint32_t intermediate; /* I of the ffn experts; 0: from the weights */
    } model;
    struct {
        epd_wire_dtype_t dtype;
        epd_scale_kind_t scale;
        epd_scale_fmt_t scale_format;
        uint32_t max_tokens_per_step;
        uint32_t max_tokens_per_request;
        uint64_t max_queued_tokens;
        epd_transport_kind_t transport;
        epd_tristate_t mpi_cuda_aware;
        uint32_t idle_backoff_us; /* longest wait between agreements while every rank is idle */
        uint32_t stall_warn_ms;   /* health says stalled after an agreement/step waits this long */
        uint32_t step_timeout_ms; /* MPI_Abort after an agreement/step waits this long; 0: never */
        uint32_t hot_ms;          /* back-to-back agreements while work was seen this recently */
    } dispatch;
    struct {
        epd_combine_dtype_t dtype; /* wire format of the partials sent back */
    } combine;
    struct {
        epd_expert_kind_t kind;
        char weights[EPD_CONFIG_STR_LEN]; /* ffn: safetensors file or directory; "" none */
        char layers[EPD_CONFIG_STR_LEN];  /* ffn: layer list (epd_parse_u32_list); "" all */
        epd_external_input_t external_input;   /* external: the worker's input format */
        epd_external_layout_t external_layout; /* external: packed or masked rows */
        uint32_t external_capacity;            /* external, masked: rows per local expert */
        uint32_t external_timeout_ms;          /* external: wait for EXPERTS_DONE this long */
    } experts;
    struct {
        epd_switch_t quant_error; /* per-step quantization error of what was sent */
    } telemetry;
    struct {
        epd_backend_t backend;
        int32_t id; /* -1: the local rank */
    } device;
    struct {
        epd_log_level_t level;
    } log;
    struct {
        char listen[EPD_CONFIG_STR_LEN]; /* "off", or HOST:PORT (rank with local rank l: PORT + l) */
    } metrics;
} epd_config_t;

/* Where a setting's value came from. */
typedef enum {
    EPD_ORIGIN_DEFAULT = 0,
    EPD_ORIGIN_FILE,
    EPD_ORIGIN_LEGACY_ENV,
    EPD_ORIGIN_ENV,
    EPD_ORIGIN_CLI,
} epd_origin_kind_t;

typedef struct epd_origin {
    epd_origin_kind_t kind;
    char where[EPD_CONFIG_STR_LEN]; /* "FILE:LINE" or the variable's name; empty otherwise */
} epd_origin_t;

/* Warnings (deprecated alias, unknown EPD_* variable, overridden alias) go through this callback,
 * once per name; the config module itself never prints. */
typedef void (*epd_config_warn_fn)(void *arg, const char *message);

typedef struct epd_config_sources {
    const char *file;             /* --config FILE, or NULL */
    char *const *envp;            /* environment to read, NULL-terminated (e.g. environ) */
    const char *const *sets;      /* "key=value" strings from --set, in order */
    size_t n_sets;
    epd_config_warn_fn warn;      /* may be NULL */
    void *warn_arg;
} epd_config_sources_t;

typedef struct epd_config_state epd_config_state_t; /* values plus per-setting origins */

/* Fills cfg with built-in defaults. */
void epd_config_defaults(epd_config_t *cfg);

/* Builds the configuration from the sources with DESIGN.md's precedence (--set > EPD_* env >
 * legacy env > file > default), validates it, and returns a state that owns the values and their
 * origins (free with epd_config_state_free). On failure returns EPD_ERR_CONFIG with a message in
 * err that names the key, its origin and what is allowed, and *state_p is NULL. */
epd_status_t epd_config_load(const epd_config_sources_t *sources, epd_config_state_t **state_p,
                             char err[EPD_ERR_LEN]);
void epd_config_state_free(epd_config_state_t *state);

/* The typed values of a loaded state (owned by the state). */
const epd_config_t *epd_config_get(const epd_config_state_t *state);

/* Origin of one setting by dotted name; NULL if there is no such setting. */
const epd_origin_t *epd_config_origin(const epd_config_state_t *state, const char *key);

/* Prints every setting as `key = value  # origin`, one a line, in table order. */
void epd_config_print(const epd_config_state_t *state, FILE *out);

/* Prints the settings table (name, env variable, type, default, doc) for --help. */
void epd_config_print_help(FILE *out);

/* Writes every setting as a JSON object {"key": value, ...} into buf (NUL-terminated). Returns
 * the length, or the length needed when it does not fit (like snprintf). */
size_t epd_config_to_json(const epd_config_t *cfg, char *buf, size_t len);

/* A canonical text form of every value (no origins), for checking that all ranks agree. Same
 * contract as snprintf. */
size_t epd_config_fingerprint(const epd_config_t *cfg, char *buf, size_t len);

/* The name of an enum setting's value, as the settings table spells it for logs and replies:
 * epd_config_enum_name("dispatch.dtype", EPD_WIRE_BF16) is "bf16". A static string; "?" when key
 * is not an enum setting or value is not one of its values. */
const char *epd_config_enum_name(const char *key, int value);

/* Writes an origin the way --print-config shows it: "default", "FILE:LINE", "env NAME",
 * "legacy env NAME (deprecated)" or "cli". Same contract as snprintf. */
size_t epd_origin_format(const epd_origin_t *origin, char *buf, size_t len);

/* Expands socket.path's pattern into out: %r the rank, %l the local rank, %h the host name up to
 * its first '.', %% a '%'. EPD_ERR_INVALID_ARG (with err) on another '%' sequence or when the
 * result does not fit in len bytes. */
epd_status_t epd_config_expand_path(const char *pattern, int rank, int local_rank,
                                    const char *hostname, char *out, size_t len,
                                    char err[EPD_ERR_LEN]);

/* epd's command line (DESIGN.md section 9). */
typedef enum {
    EPD_ACTION_RUN = 0,       /* serve (under mpirun) */
    EPD_ACTION_PRINT_CONFIG,  /* --print-config: print every setting and its origin, exit 0, no MPI */
    EPD_ACTION_HELP,          /* --help: usage and the settings table */
    EPD_ACTION_VERSION,       /* --version */
    EPD_ACTION_BENCH,         /* --bench: synthetic steps without sockets (under mpirun) */
    EPD_ACTION_ACCURACY,      /* --accuracy: each wire format's error on synthetic data (mpirun) */
} epd_action_t;

typedef struct epd_args {
    epd_action_t action;
    const char *config_file;  /* --config FILE (points into argv) */
    const char **sets;        /* --set KEY=VALUE, in order (point into argv) */
    size_t n_sets;
    bool json;                /* --json: machine-readable bench output */
    const char *bench_tokens; /* --bench-tokens LIST, e.g. "128,512,2048"; NULL: the default list */
    uint32_t bench_iters;     /* --bench-iters N; 0: the default */
    const char *bench_weights; /* --bench-weights random|random-bf16|random-fp8; NULL: the file */
} epd_args_t;

/* Parses argv (--config FILE, --set KEY=VALUE repeatable, --print-config, --help, --version,
 * --bench, --accuracy, --json, --bench-tokens LIST, --bench-iters N; both "--opt value" and
 * "--opt=value").
 * An unknown option or a missing value is EPD_ERR_INVALID_ARG with a sentence in err. Free with
 * epd_args_free. */
epd_status_t epd_args_parse(int argc, char **argv, epd_args_t *args_p, char err[EPD_ERR_LEN]);
void epd_args_free(epd_args_t *args);

/* Parses a --bench-tokens list ("128,512,2048": positive integers up to 1048576, comma-separated)
 * into tokens (at most max entries) and its length into *n_p. EPD_ERR_INVALID_ARG with err on
 * anything else (an empty list, an empty item, junk, too many items). */
epd_status_t epd_args_parse_token_list(const char *list, uint32_t *tokens, size_t max,
                                       size_t *n_p, char err[EPD_ERR_LEN]);

/* Prints the usage of epd followed by the settings table. */
void epd_args_print_usage(FILE *out, const char *argv0);

#ifdef __cplusplus
}
#endif

#endif
