/* The one table of epd's settings (DESIGN.md section 6) and the per-type code that parses,
 * formats and describes a value. YAML, environment, --set, --print-config, --help, JSON and the
 * fingerprint all walk this table; adding a setting is adding a row (and a field in config.h). */
#include "config/settings.h"

#include <ctype.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/parse.h"

_Static_assert(sizeof(epd_wire_dtype_t) == sizeof(int), "enum settings are stored as int");

/* The value names of each enum setting, indexed by the C enum (its row's .choices). */
static const char *const wire_dtype_names[] = {[EPD_WIRE_FP8] = "fp8", [EPD_WIRE_BF16] = "bf16",
                                               NULL};
static const char *const combine_dtype_names[] = {[EPD_COMBINE_BF16] = "bf16",
                                                  [EPD_COMBINE_FP8] = "fp8", NULL};
static const char *const switch_names[] = {[EPD_SWITCH_OFF] = "false", [EPD_SWITCH_ON] = "true",
                                           NULL};
static const char *const scale_kind_names[] = {[EPD_SCALE_GROUP128] = "group128",
                                               [EPD_SCALE_PER_TOKEN] = "per_token", NULL};
static const char *const scale_fmt_names[] = {[EPD_SCALE_FMT_FP32] = "fp32",
                                              [EPD_SCALE_FMT_UE8M0] = "ue8m0", NULL};
static const char *const transport_names[] = {[EPD_TRANSPORT_AUTO] = "auto",
                                              [EPD_TRANSPORT_MPI] = "mpi",
                                              [EPD_TRANSPORT_NCCL] = "nccl", NULL};
static const char *const tristate_names[] = {[EPD_TRISTATE_AUTO] = "auto",
                                             [EPD_TRISTATE_TRUE] = "true",
                                             [EPD_TRISTATE_FALSE] = "false", NULL};
static const char *const expert_kind_names[] = {[EPD_EXPERTS_IDENTITY] = "identity",
                                                [EPD_EXPERTS_SCALE] = "scale",
                                                [EPD_EXPERTS_FFN] = "ffn",
                                                [EPD_EXPERTS_EXTERNAL] = "external", NULL};
static const char *const external_input_names[] = {
    [EPD_EXTERNAL_FP8_GROUP128] = "fp8_group128", [EPD_EXTERNAL_BF16] = "bf16",
    [EPD_EXTERNAL_FP8_PER_TENSOR] = "fp8_per_tensor", NULL};
static const char *const external_layout_names[] = {[EPD_EXTERNAL_PACKED] = "packed",
                                                    [EPD_EXTERNAL_MASKED] = "masked", NULL};
static const char *const backend_names[] = {[EPD_BACKEND_AUTO] = "auto",
                                            [EPD_BACKEND_CUDA] = "cuda",
                                            [EPD_BACKEND_CPU] = "cpu", NULL};
static const char *const log_level_names[] = {[EPD_LOG_ERROR] = "error", [EPD_LOG_WARN] = "warn",
                                              [EPD_LOG_INFO] = "info", [EPD_LOG_DEBUG] = "debug",
                                              NULL};

static bool check_socket_path(const char *text, char problem[EPD_ERR_LEN]);
static bool check_layers(const char *text, char problem[EPD_ERR_LEN]);
static bool check_metrics_listen(const char *text, char problem[EPD_ERR_LEN]);

#define FIELD(f) offsetof(epd_config_t, f)
#define U32_MAX_I64 ((int64_t)UINT32_MAX)

const epd_setting_t epd_settings[] = {
    {.name = "socket.path", .env = "EPD_SOCKET_PATH", .type = EPD_SETTING_STRING,
     .def = "/run/epd/epd-%r.sock", .check = check_socket_path, .offset = FIELD(socket.path),
     .doc = "Unix socket of each rank; %r rank, %l local rank, %h short hostname, %% a '%'"},
    {.name = "socket.mode", .env = "EPD_SOCKET_MODE", .type = EPD_SETTING_MODE, .def = "0660",
     .min = 0, .max = 0777, .offset = FIELD(socket.mode),
     .doc = "file mode of the socket (octal)"},
    {.name = "socket.max_frame_bytes", .env = "EPD_SOCKET_MAX_FRAME_BYTES",
     .type = EPD_SETTING_U64, .def = "268435456", .min = 1024, .max = INT64_C(1) << 40,
     .offset = FIELD(socket.max_frame_bytes),
     .doc = "largest frame payload accepted; must hold a max_tokens_per_request request"},
    {.name = "socket.max_clients", .env = "EPD_SOCKET_MAX_CLIENTS", .type = EPD_SETTING_U32,
     .def = "1024", .min = 1, .max = 65536, .offset = FIELD(socket.max_clients),
     .doc = "connections per rank; more are answered busy"},
    {.name = "socket.max_output_bytes", .env = "EPD_SOCKET_MAX_OUTPUT_BYTES",
     .type = EPD_SETTING_U64, .def = "268435456", .min = 65536, .max = INT64_C(1) << 40,
     .offset = FIELD(socket.max_output_bytes),
     .doc = "unsent reply bytes per connection before the daemon stops reading it"},
    {.name = "socket.max_regions", .env = "EPD_SOCKET_MAX_REGIONS", .type = EPD_SETTING_U32,
     .def = "16", .min = 0, .max = 4096, .offset = FIELD(socket.max_regions),
     .doc = "shared memory regions a connection may register (0: none)"},
    {.name = "socket.allow_uids", .env = "EPD_SOCKET_ALLOW_UIDS", .type = EPD_SETTING_UIDS,
     .def = "", .min = 0, .max = U32_MAX_I64 - 1, .offset = FIELD(socket.allow_uids),
     .count_offset = FIELD(socket.n_allow_uids),
     .doc = "peer uids allowed to connect (SO_PEERCRED); empty: any the file mode lets in"},
    {.name = "socket.max_buffered_bytes", .env = "EPD_SOCKET_MAX_BUFFERED_BYTES",
     .type = EPD_SETTING_U64, .def = "1073741824", .min = 1024, .max = INT64_C(1) << 42,
     .offset = FIELD(socket.max_buffered_bytes),
     .doc = "bytes of incoming frames held by all connections together; over it a frame is "
            "answered busy (>= max_frame_bytes)"},
    {.name = "socket.pinned_bytes", .env = "EPD_SOCKET_PINNED_BYTES", .type = EPD_SETTING_U64,
     .def = "536870912", .min = 0, .max = INT64_C(1) << 42, .offset = FIELD(socket.pinned_bytes),
     .doc = "page-locked host memory kept for frame payloads and results, reused (copies to and "
            "from the GPU at DMA speed); beyond it, malloc; 0: none"},
    {.name = "socket.idle_timeout_ms", .env = "EPD_SOCKET_IDLE_TIMEOUT_MS",
     .type = EPD_SETTING_U32, .def = "300000", .min = 0, .max = 86400000,
     .offset = FIELD(socket.idle_timeout_ms),
     .doc = "close a connection with nothing in flight and no bytes for this long; 0: never"},
    {.name = "socket.frame_timeout_ms", .env = "EPD_SOCKET_FRAME_TIMEOUT_MS",
     .type = EPD_SETTING_U32, .def = "30000", .min = 0, .max = 86400000,
     .offset = FIELD(socket.frame_timeout_ms),
     .doc = "close a connection whose frame is not complete this long after its first byte; "
            "0: never"},
    {.name = "socket.sndbuf_bytes", .env = "EPD_SOCKET_SNDBUF_BYTES", .type = EPD_SETTING_U32,
     .def = "4194304", .min = 0, .max = INT64_C(1) << 30, .offset = FIELD(socket.sndbuf_bytes),
     .doc = "SO_SNDBUF asked for each connection, so that a large RESULT goes out in one write "
            "(the kernel caps it at net.core.wmem_max); 0: the system's default"},
    {.name = "socket.io_threads", .env = "EPD_SOCKET_IO_THREADS", .type = EPD_SETTING_U32,
     .def = "4", .min = 0, .max = 64, .offset = FIELD(socket.io_threads),
     .doc = "threads that copy large payloads (x read, y written) between the sockets and "
            "page-locked memory while the loop thread goes on; 0: the loop thread does all I/O"},
    {.name = "socket.io_offload_bytes", .env = "EPD_SOCKET_IO_OFFLOAD_BYTES",
     .type = EPD_SETTING_U64, .def = "262144", .min = 1, .max = INT64_C(1) << 40,
     .offset = FIELD(socket.io_offload_bytes),
     .doc = "a payload (SUBMIT's x, RESULT's y) at least this large is copied by the "
            "socket.io_threads; smaller ones, and everything else, by the loop thread"},
    {.name = "model.hidden", .env = "EPD_MODEL_HIDDEN", .type = EPD_SETTING_U32, .def = "7168",
     .min = 128, .max = 65536, .multiple_of = 128, .offset = FIELD(model.hidden),
     .doc = "hidden size H of a token"},
    {.name = "model.num_experts", .env = "EPD_MODEL_NUM_EXPERTS", .type = EPD_SETTING_U32,
     .def = "256", .min = 1, .max = 4096, .offset = FIELD(model.num_experts),
     .doc = "routed experts E, sharded contiguously over the ranks"},
    {.name = "model.topk", .env = "EPD_MODEL_TOPK", .type = EPD_SETTING_U32, .def = "8",
     .min = 1, .max = 64, .offset = FIELD(model.topk),
     .doc = "experts per token K (<= num_experts)"},
    {.name = "model.intermediate", .env = "EPD_MODEL_INTERMEDIATE", .type = EPD_SETTING_U32,
     .def = "0", .min = 0, .max = 65536, .multiple_of = 128, .offset = FIELD(model.intermediate),
     .doc = "ffn experts' intermediate size I; 0: from experts.weights (else checked against it)"},
    {.name = "dispatch.dtype", .env = "EPD_DISPATCH_DTYPE", .type = EPD_SETTING_ENUM,
     .def = "fp8", .choices = wire_dtype_names, .offset = FIELD(dispatch.dtype),
     .doc = "wire format of dispatched tokens"},
    {.name = "dispatch.scale", .env = "EPD_DISPATCH_SCALE", .type = EPD_SETTING_ENUM,
     .def = "group128", .choices = scale_kind_names, .offset = FIELD(dispatch.scale),
     .doc = "FP8 scales: one per 128 elements or one per token"},
    {.name = "dispatch.scale_format", .env = "EPD_DISPATCH_SCALE_FORMAT",
     .type = EPD_SETTING_ENUM, .def = "fp32", .choices = scale_fmt_names,
     .offset = FIELD(dispatch.scale_format),
     .doc = "FP8 scale format: fp32, or ue8m0 (powers of two)"},
    {.name = "dispatch.max_tokens_per_step", .env = "EPD_DISPATCH_MAX_TOKENS_PER_STEP",
     .type = EPD_SETTING_U32, .def = "4096", .min = 1, .max = 1048576,
     .offset = FIELD(dispatch.max_tokens_per_step),
     .doc = "tokens a rank takes into one step (whole requests)"},
    {.name = "dispatch.max_tokens_per_request", .env = "EPD_DISPATCH_MAX_TOKENS_PER_REQUEST",
     .type = EPD_SETTING_U32, .def = "4096", .min = 1, .max = 1048576,
     .offset = FIELD(dispatch.max_tokens_per_request),
     .doc = "largest N of one SUBMIT (<= max_tokens_per_step, <= max_queued_tokens)"},
    {.name = "dispatch.max_queued_tokens", .env = "EPD_DISPATCH_MAX_QUEUED_TOKENS",
     .type = EPD_SETTING_U64, .def = "65536", .min = 1, .max = INT64_C(1) << 32,
     .offset = FIELD(dispatch.max_queued_tokens),
     .doc = "tokens queued per rank before SUBMITs are answered busy"},
    {.name = "dispatch.transport", .env = "EPD_DISPATCH_TRANSPORT", .type = EPD_SETTING_ENUM,
     .def = "auto", .choices = transport_names, .offset = FIELD(dispatch.transport),
     .doc = "all-to-all transport; auto picks mpi (CUDA-aware), else nccl, else staged mpi"},
    {.name = "dispatch.mpi_cuda_aware", .env = "EPD_DISPATCH_MPI_CUDA_AWARE",
     .type = EPD_SETTING_ENUM, .def = "auto", .choices = tristate_names, .bool_choices = true,
     .offset = FIELD(dispatch.mpi_cuda_aware),
     .doc = "pass device buffers to MPI; auto asks MPIX_Query_cuda_support()"},
    {.name = "dispatch.idle_backoff_us", .env = "EPD_DISPATCH_IDLE_BACKOFF_US",
     .type = EPD_SETTING_U32, .def = "1000", .min = 0, .max = 1000000,
     .offset = FIELD(dispatch.idle_backoff_us),
     .doc = "longest wait (us) between step agreements while every rank is idle"},
    {.name = "dispatch.stall_warn_ms", .env = "EPD_DISPATCH_STALL_WARN_MS",
     .type = EPD_SETTING_U32, .def = "5000", .min = 100, .max = 3600000,
     .offset = FIELD(dispatch.stall_warn_ms),
     .doc = "health says stalled (naming the phase) once an agreement or step waits this long"},
    {.name = "dispatch.step_timeout_ms", .env = "EPD_DISPATCH_STEP_TIMEOUT_MS",
     .type = EPD_SETTING_U32, .def = "60000", .min = 0, .max = 86400000,
     .offset = FIELD(dispatch.step_timeout_ms),
     .doc = "abort the job (MPI_Abort, naming the phase) once an agreement or step waits this "
            "long; 0: never (> stall_warn_ms)"},
    {.name = "dispatch.hot_ms", .env = "EPD_DISPATCH_HOT_MS", .type = EPD_SETTING_U32,
     .def = "50", .min = 0, .max = 3600000, .offset = FIELD(dispatch.hot_ms),
     .doc = "agreements run back to back while any rank saw work this recently (ms)"},
    {.name = "combine.dtype", .env = "EPD_COMBINE_DTYPE", .type = EPD_SETTING_ENUM,
     .def = "bf16", .choices = combine_dtype_names, .offset = FIELD(combine.dtype),
     .doc = "wire format of the partials sent back: bf16, or fp8 (e4m3, group128 fp32 scales)"},
    {.name = "experts.kind", .env = "EPD_EXPERTS_KIND", .type = EPD_SETTING_ENUM,
     .def = "scale", .choices = expert_kind_names, .offset = FIELD(experts.kind),
     .doc = "expert function: identity (y = x), scale (y = x * (1 + e/E)), ffn (SwiGLU "
            "experts from experts.weights), or external (a frontend's worker, serve_experts)"},
    {.name = "experts.weights", .env = "EPD_EXPERTS_WEIGHTS", .type = EPD_SETTING_STRING,
     .def = "", .may_be_empty = true, .offset = FIELD(experts.weights),
     .doc = "ffn: safetensors file, or directory with model.safetensors.index.json"},
    {.name = "experts.layers", .env = "EPD_EXPERTS_LAYERS", .type = EPD_SETTING_STRING,
     .def = "", .may_be_empty = true, .check = check_layers, .offset = FIELD(experts.layers),
     .doc = "ffn: MoE layers served, e.g. 3-60 or 3,5; empty: every layer the weights have"},
    {.name = "experts.external_input", .env = "EPD_EXPERTS_EXTERNAL_INPUT",
     .type = EPD_SETTING_ENUM, .def = "fp8_group128", .choices = external_input_names,
     .offset = FIELD(experts.external_input),
     .doc = "external: the worker's input rows, fp8_group128 (as dispatched), bf16, or "
            "fp8_per_tensor (requantized to one scale S)"},
    {.name = "experts.external_layout", .env = "EPD_EXPERTS_EXTERNAL_LAYOUT",
     .type = EPD_SETTING_ENUM, .def = "packed", .choices = external_layout_names,
     .offset = FIELD(experts.external_layout),
     .doc = "external: packed (each expert's rows back to back) or masked (external_capacity "
            "rows per expert)"},
    {.name = "experts.external_capacity", .env = "EPD_EXPERTS_EXTERNAL_CAPACITY",
     .type = EPD_SETTING_U32, .def = "0", .min = 0, .max = 1048576,
     .offset = FIELD(experts.external_capacity),
     .doc = "external, masked layout: rows per local expert (> 0); packed: 0"},
    {.name = "experts.external_timeout_ms", .env = "EPD_EXPERTS_EXTERNAL_TIMEOUT_MS",
     .type = EPD_SETTING_U32, .def = "1000", .min = 1, .max = 600000,
     .offset = FIELD(experts.external_timeout_ms),
     .doc = "external: a step waits this long for EXPERTS_DONE, then goes on without the "
            "worker (experts_unavailable)"},
    {.name = "device.backend", .env = "EPD_DEVICE_BACKEND", .type = EPD_SETTING_ENUM,
     .def = "auto", .choices = backend_names, .offset = FIELD(device.backend),
     .doc = "device operations: cuda, cpu, or auto (cuda when a GPU is present)"},
    {.name = "device.id", .env = "EPD_DEVICE_ID", .type = EPD_SETTING_I32, .def = "-1",
     .min = -1, .max = 1023, .offset = FIELD(device.id),
     .doc = "CUDA device of this rank; -1: the local rank"},
    {.name = "telemetry.quant_error", .env = "EPD_TELEMETRY_QUANT_ERROR",
     .type = EPD_SETTING_ENUM, .def = "false", .choices = switch_names, .bool_choices = true,
     .offset = FIELD(telemetry.quant_error),
     .doc = "measure each step's FP8 quantization error (dispatch and FP8 combine) for stats"},
    {.name = "log.level", .env = "EPD_LOG_LEVEL", .type = EPD_SETTING_ENUM, .def = "info",
     .choices = log_level_names, .offset = FIELD(log.level),
     .doc = "least severe message logged"},
    {.name = "metrics.listen", .env = "EPD_METRICS_LISTEN", .type = EPD_SETTING_STRING,
     .def = "off", .check = check_metrics_listen, .offset = FIELD(metrics.listen),
     .doc = "HTTP /metrics for Prometheus: off, or HOST:PORT (local rank l listens on PORT + l)"},
    /* Legacy SGLang/DeepEP variables (environment only). */
    {.name = "SGLANG_DEEPEP_BF16_DISPATCH", .env = "SGLANG_DEEPEP_BF16_DISPATCH",
     .type = EPD_SETTING_ALIAS_BOOL, .target = "dispatch.dtype", .if_true = "bf16",
     .if_false = "fp8", .note = "deprecated, use EPD_DISPATCH_DTYPE",
     .doc = "legacy: true -> dispatch.dtype = bf16, false -> fp8"},
    {.name = "SGLANG_DEEPEP_NORMAL_BF16_DISPATCH", .env = "SGLANG_DEEPEP_NORMAL_BF16_DISPATCH",
     .type = EPD_SETTING_ALIAS_BOOL, .target = "dispatch.dtype", .if_true = "bf16",
     .if_false = "fp8", .note = "deprecated, use EPD_DISPATCH_DTYPE",
     .doc = "legacy: true -> dispatch.dtype = bf16, false -> fp8"},
    {.name = NULL},
};

size_t epd_config_textf(char *buf, size_t len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, len, fmt, ap);
    va_end(ap);
    return n < 0 ? 0 : (size_t)n;
}

size_t epd_settings_rows(void)
{
    return EPD_ARRAY_SIZE(epd_settings) - 1;
}

const epd_setting_t *epd_setting_by_name(const char *name)
{
    for (const epd_setting_t *row = epd_settings; name != NULL && row->name != NULL; row++) {
        if (row->type != EPD_SETTING_ALIAS_BOOL && strcmp(row->name, name) == 0) return row;
    }
    return NULL;
}

const epd_setting_t *epd_setting_by_env_n(const char *name, size_t len)
{
    for (const epd_setting_t *row = epd_settings; row->name != NULL; row++) {
        if (strlen(row->env) == len && strncmp(row->env, name, len) == 0) return row;
    }
    return NULL;
}

const epd_setting_t *epd_setting_by_env(const char *name)
{
    return name == NULL ? NULL : epd_setting_by_env_n(name, strlen(name));
}

/* Length of the section part of a dotted name ("socket" of "socket.path"). */
static size_t section_len(const char *name)
{
    const char *dot = strchr(name, '.');
    return dot ? (size_t)(dot - name) : strlen(name);
}

bool epd_setting_section_known(const char *section)
{
    for (const epd_setting_t *row = epd_settings; row->name != NULL; row++) {
        if (row->type == EPD_SETTING_ALIAS_BOOL) continue;
        size_t n = section_len(row->name);
        if (strlen(section) == n && strncmp(row->name, section, n) == 0) return true;
    }
    return false;
}

void epd_setting_sections(char *buf, size_t len)
{
    size_t used = 0;
    const char *prev = NULL;
    buf[0] = '\0';
    for (const epd_setting_t *row = epd_settings; row->name != NULL; row++) {
        if (row->type == EPD_SETTING_ALIAS_BOOL) continue;
        size_t n = section_len(row->name);
        if (prev != NULL && section_len(prev) == n && strncmp(prev, row->name, n) == 0) continue;
        prev = row->name;
        if (used < len) {
            used += (size_t)snprintf(buf + used, len - used, "%s%.*s", used ? ", " : "", (int)n,
                                     row->name);
        }
    }
}

void epd_setting_section_keys(const char *section, char *buf, size_t len)
{
    size_t used = 0;
    size_t slen = strlen(section);
    buf[0] = '\0';
    for (const epd_setting_t *row = epd_settings; row->name != NULL; row++) {
        if (row->type == EPD_SETTING_ALIAS_BOOL) continue;
        if (section_len(row->name) != slen || strncmp(row->name, section, slen) != 0) continue;
        if (used < len) {
            used += (size_t)snprintf(buf + used, len - used, "%s%s", used ? ", " : "",
                                     row->name + slen + 1);
        }
    }
}

/* socket.path: only %r, %l, %h and %% may follow a '%' (the daemon expands them). */
static bool check_socket_path(const char *text, char problem[EPD_ERR_LEN])
{
    for (const char *p = text; *p != '\0'; p++) {
        if (*p != '%') continue;
        p++;
        if (*p != 'r' && *p != 'l' && *p != 'h' && *p != '%') {
            epd_config_textf(problem, EPD_ERR_LEN, "'%.64s' has an unknown '%%%c' sequence", text,
                     *p ? *p : ' ');
            return false;
        }
    }
    return true;
}

/* experts.layers: a list of layer numbers and ranges. */
static bool check_layers(const char *text, char problem[EPD_ERR_LEN])
{
    uint32_t layers[EPD_CONFIG_MAX_LAYERS];
    size_t n;
    return epd_parse_u32_list(text, EPD_CONFIG_MAX_LAYER, layers, EPD_CONFIG_MAX_LAYERS, &n,
                              problem) == EPD_OK;
}

/* metrics.listen: off, or HOST:PORT / [IPV6]:PORT (common/parse.h). */
static bool check_metrics_listen(const char *text, char problem[EPD_ERR_LEN])
{
    char host[EPD_CONFIG_STR_LEN], why[EPD_ERR_LEN];
    uint16_t port;

    if (strcmp(text, "off") == 0) return true;
    if (epd_parse_host_port(text, host, sizeof(host), &port, why) == EPD_OK) return true;
    epd_config_textf(problem, EPD_ERR_LEN, "%.200s; expected off or HOST:PORT, e.g. "
                     "127.0.0.1:9400", why);
    return false;
}

static bool parse_string(const epd_setting_t *row, const char *text, epd_config_t *cfg,
                         char problem[EPD_ERR_LEN])
{
    size_t n = strlen(text);
    if (n == 0 && !row->may_be_empty) {
        epd_config_textf(problem, EPD_ERR_LEN, "the value is empty");
        return false;
    }
    if (n >= EPD_CONFIG_STR_LEN) {
        epd_config_textf(problem, EPD_ERR_LEN, "the value is %zu bytes long", n);
        return false;
    }
    if (row->check != NULL && !row->check(text, problem)) return false;
    memcpy((char *)cfg + row->offset, text, n + 1);
    return true;
}

static bool parse_number(const epd_setting_t *row, const char *text, epd_config_t *cfg,
                         char problem[EPD_ERR_LEN])
{
    char ignored[EPD_ERR_LEN];
    uint64_t u = 0;
    int64_t i = 0;
    epd_status_t status;
    if (row->type == EPD_SETTING_I32) {
        status = epd_parse_i64(text, INT64_MIN, INT64_MAX, &i, ignored);
    } else {
        /* file modes are octal whether or not they start with 0, as with chmod */
        status = epd_parse_u64(text, row->type == EPD_SETTING_MODE ? 8 : 10, 0, UINT64_MAX, &u,
                               ignored);
        i = u > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)u;
    }
    if (status != EPD_OK) {
        epd_config_textf(problem, EPD_ERR_LEN, "'%.64s' is not %s", text,
                 row->type == EPD_SETTING_MODE ? "an octal number" : "an integer");
        return false;
    }
    if (i < row->min || i > row->max) {
        epd_config_textf(problem, EPD_ERR_LEN, "%.64s is out of range", text);
        return false;
    }
    if (row->multiple_of != 0 && i % row->multiple_of != 0) {
        epd_config_textf(problem, EPD_ERR_LEN, "%.64s is not a multiple of %" PRIu32, text,
                 row->multiple_of);
        return false;
    }
    char *field = (char *)cfg + row->offset;
    switch (row->type) {
    case EPD_SETTING_MODE:
    case EPD_SETTING_U32: *(uint32_t *)(void *)field = (uint32_t)i; break;
    case EPD_SETTING_U64: *(uint64_t *)(void *)field = (uint64_t)i; break;
    case EPD_SETTING_I32: *(int32_t *)(void *)field = (int32_t)i; break;
    default: return false;
    }
    return true;
}

/* The name of value v of an ENUM row; "?" when v is none of its values. */
static const char *enum_name(const epd_setting_t *row, int v)
{
    int count = 0;
    while (row->choices[count] != NULL) count++;
    return v >= 0 && v < count ? row->choices[v] : "?";
}

static bool parse_enum(const epd_setting_t *row, const char *text, epd_config_t *cfg,
                       char problem[EPD_ERR_LEN])
{
    const char *want = text;
    bool b;
    char ignored[EPD_ERR_LEN];
    if (row->bool_choices && epd_parse_bool(text, &b, ignored) == EPD_OK) {
        want = b ? "true" : "false";
    }
    for (int v = 0; row->choices[v] != NULL; v++) {
        if (strcmp(row->choices[v], want) == 0) {
            *(int *)(void *)((char *)cfg + row->offset) = v;
            return true;
        }
    }
    epd_config_textf(problem, EPD_ERR_LEN, "'%.64s' is not an allowed value", text);
    return false;
}

static bool parse_uids(const epd_setting_t *row, const char *text, epd_config_t *cfg,
                       char problem[EPD_ERR_LEN])
{
    uint32_t uids[EPD_CONFIG_MAX_UIDS];
    uint32_t n = 0;
    const char *p = text;
    while (*p == ' ' || *p == '\t') p++;
    if (*p != '\0') {
        for (;;) {
            while (*p == ' ' || *p == '\t') p++;
            const char *end = p;
            while (*end != '\0' && *end != ',') end++;
            const char *last = end;
            while (last > p && (last[-1] == ' ' || last[-1] == '\t')) last--;
            char item[32];
            size_t len = (size_t)(last - p);
            if (len == 0) {
                epd_config_textf(problem, EPD_ERR_LEN, "'%.64s' has an empty item", text);
                return false;
            }
            if (n == EPD_CONFIG_MAX_UIDS) {
                epd_config_textf(problem, EPD_ERR_LEN, "'%.64s' has more than %d uids", text,
                         EPD_CONFIG_MAX_UIDS);
                return false;
            }
            uint64_t v = 0;
            char ignored[EPD_ERR_LEN];
            if (len >= sizeof item) len = sizeof item - 1; /* too long for a uid: fails below */
            memcpy(item, p, len);
            item[len] = '\0';
            if (len >= sizeof item - 1 ||
                epd_parse_u64(item, 10, (uint64_t)row->min, (uint64_t)row->max, &v, ignored) !=
                    EPD_OK) {
                epd_config_textf(problem, EPD_ERR_LEN, "'%.40s' is not a uid", item);
                return false;
            }
            uids[n++] = (uint32_t)v;
            if (*end == '\0') break;
            p = end + 1;
        }
    }
    memcpy((char *)cfg + row->offset, uids, n * sizeof uids[0]);
    *(uint32_t *)(void *)((char *)cfg + row->count_offset) = n;
    return true;
}

bool epd_setting_parse(const epd_setting_t *row, const char *text, epd_config_t *cfg,
                       char problem[EPD_ERR_LEN])
{
    switch (row->type) {
    case EPD_SETTING_STRING: return parse_string(row, text, cfg, problem);
    case EPD_SETTING_MODE:
    case EPD_SETTING_U32:
    case EPD_SETTING_U64:
    case EPD_SETTING_I32: return parse_number(row, text, cfg, problem);
    case EPD_SETTING_ENUM: return parse_enum(row, text, cfg, problem);
    case EPD_SETTING_UIDS: return parse_uids(row, text, cfg, problem);
    case EPD_SETTING_ALIAS_BOOL: break;
    }
    epd_config_textf(problem, EPD_ERR_LEN, "%s is not a setting", row->name);
    return false;
}

size_t epd_setting_format(const epd_setting_t *row, const epd_config_t *cfg, char *buf, size_t len)
{
    const char *field = (const char *)cfg + row->offset;
    const void *value = field;
    int n = 0;
    switch (row->type) {
    case EPD_SETTING_STRING: n = snprintf(buf, len, "%s", field); break;
    case EPD_SETTING_MODE: n = snprintf(buf, len, "%04" PRIo32, *(const uint32_t *)value); break;
    case EPD_SETTING_U32: n = snprintf(buf, len, "%" PRIu32, *(const uint32_t *)value); break;
    case EPD_SETTING_U64: n = snprintf(buf, len, "%" PRIu64, *(const uint64_t *)value); break;
    case EPD_SETTING_I32: n = snprintf(buf, len, "%" PRId32, *(const int32_t *)value); break;
    case EPD_SETTING_ENUM: n = snprintf(buf, len, "%s", enum_name(row, *(const int *)value)); break;
    case EPD_SETTING_UIDS: {
        const uint32_t *uids = value;
        uint32_t count = *(const uint32_t *)(const void *)((const char *)cfg + row->count_offset);
        size_t used = 0;
        if (len > 0) buf[0] = '\0';
        for (uint32_t i = 0; i < count && i < EPD_CONFIG_MAX_UIDS; i++) {
            int k = snprintf(used < len ? buf + used : NULL, used < len ? len - used : 0,
                             "%s%" PRIu32, i ? "," : "", uids[i]);
            used += (size_t)k;
        }
        return used;
    }
    case EPD_SETTING_ALIAS_BOOL: n = snprintf(buf, len, "%s", ""); break;
    }
    return n < 0 ? 0 : (size_t)n;
}

void epd_setting_allowed(const epd_setting_t *row, char *buf, size_t len)
{
    switch (row->type) {
    case EPD_SETTING_STRING:
        snprintf(buf, len, "a non-empty string shorter than %d bytes%s", EPD_CONFIG_STR_LEN,
                 row->check == check_socket_path      ? " (with %r, %l, %h, %%)"
                 : row->check == check_metrics_listen ? " (off, or HOST:PORT)"
                                                      : "");
        return;
    case EPD_SETTING_MODE:
        snprintf(buf, len, "an octal mode in [0, %04" PRIo64 "]", (uint64_t)row->max);
        return;
    case EPD_SETTING_U32:
    case EPD_SETTING_U64:
    case EPD_SETTING_I32:
        if (row->multiple_of != 0) {
            snprintf(buf, len, "a multiple of %" PRIu32 " in [%" PRId64 ", %" PRId64 "]",
                     row->multiple_of, row->min, row->max);
        } else {
            snprintf(buf, len, "an integer in [%" PRId64 ", %" PRId64 "]", row->min, row->max);
        }
        return;
    case EPD_SETTING_ENUM: {
        size_t used = (size_t)snprintf(buf, len, "one of ");
        for (int v = 0; row->choices[v] != NULL && used < len; v++) {
            used += (size_t)snprintf(buf + used, len - used, "%s%s", v ? "|" : "", row->choices[v]);
        }
        if (row->bool_choices && used < len) {
            snprintf(buf + used, len - used, " (true/false in any boolean spelling)");
        }
        return;
    }
    case EPD_SETTING_UIDS:
        snprintf(buf, len, "a comma-separated list of at most %d uids, or empty",
                 EPD_CONFIG_MAX_UIDS);
        return;
    case EPD_SETTING_ALIAS_BOOL:
        snprintf(buf, len, "a boolean: 1/0, true/false, yes/no, on/off (any case)");
        return;
    }
}

const char *epd_setting_type_name(epd_setting_type_t type)
{
    switch (type) {
    case EPD_SETTING_STRING: return "string";
    case EPD_SETTING_MODE: return "mode";
    case EPD_SETTING_U32: return "u32";
    case EPD_SETTING_U64: return "u64";
    case EPD_SETTING_I32: return "i32";
    case EPD_SETTING_ENUM: return "enum";
    case EPD_SETTING_UIDS: return "uid list";
    case EPD_SETTING_ALIAS_BOOL: return "bool";
    }
    return "?";
}

const char *epd_config_enum_name(const char *key, int value)
{
    const epd_setting_t *row = epd_setting_by_name(key);
    return row != NULL && row->type == EPD_SETTING_ENUM ? enum_name(row, value) : "?";
}

/* Edit distance between a and b, capped: returns cap as soon as it is certain to be >= cap. */
static size_t edit_distance(const char *a, const char *b, size_t cap)
{
    size_t la = strlen(a), lb = strlen(b);
    size_t row[EPD_CONFIG_STR_LEN + 1];
    if (la > EPD_CONFIG_STR_LEN || lb > EPD_CONFIG_STR_LEN) return cap;
    if ((la > lb ? la - lb : lb - la) >= cap) return cap;
    for (size_t j = 0; j <= lb; j++) row[j] = j;
    for (size_t i = 1; i <= la; i++) {
        size_t diag = row[0];
        size_t best = row[0] = i;
        for (size_t j = 1; j <= lb; j++) {
            size_t up = row[j];
            int ca = toupper((unsigned char)a[i - 1]), cb = toupper((unsigned char)b[j - 1]);
            size_t cost = ca == cb ? 0 : 1;
            size_t v = diag + cost;
            if (up + 1 < v) v = up + 1;
            if (row[j - 1] + 1 < v) v = row[j - 1] + 1;
            row[j] = v;
            diag = up;
            if (v < best) best = v;
        }
        if (best >= cap) return cap;
    }
    return row[lb] < cap ? row[lb] : cap;
}

const epd_setting_t *epd_setting_closest(const char *name, bool by_env)
{
    const epd_setting_t *best = NULL;
    size_t best_d = 4; /* suggest only within 3 edits (case-insensitive) */
    for (const epd_setting_t *row = epd_settings; name != NULL && row->name != NULL; row++) {
        if (!by_env && row->type == EPD_SETTING_ALIAS_BOOL) continue;
        size_t d = edit_distance(name, by_env ? row->env : row->name, best_d);
        if (d < best_d) {
            best_d = d;
            best = row;
        }
    }
    return best;
}
