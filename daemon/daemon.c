/* Start-up and shutdown of one rank: node-local rank, configuration loaded on every rank and
 * checked identical, the E % W rule, device ops and transport, the socket, a barrier so READY=1
 * means every rank serves, the engine, the event loop, and the teardown after the drain. Any
 * start-up error is logged and ends the job with MPI_Abort, so no rank waits for a dead one. */
#include "daemon/daemon.h"

#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <event2/event.h>
#include <event2/thread.h>

#include "comm/registry.h"
#include "common/clock.h"
#include "common/mpi_error.h"
#include "daemon/engine.h"
#include "daemon/experts.h"
#include "daemon/external.h"
#include "daemon/log.h"
#include "daemon/notify.h"
#include "daemon/server.h"
#include "gpu/select.h"

extern char **environ;

#define DAEMON_START_FAILED 1 /* MPI_Abort code of a start-up error */
#define DAEMON_CONFIG_INVALID 78 /* of a configuration error (EX_CONFIG): the units do not restart */
#define DAEMON_STEP_FAILED 3  /* MPI_Abort code after a step failed (MPI, transport, device) */

typedef struct daemon {
    int rank;
    int world;
    int local_rank;
    int local_size;
    MPI_Comm comm; /* the engine's (a duplicate of MPI_COMM_WORLD) */
    epd_config_state_t *state;
    const epd_config_t *cfg;
    epd_rank_backend_t backend;
    bool backend_open;
    epd_ffn_weights_t *ffn; /* this rank's ffn experts (experts.kind ffn), else NULL */
    struct event_base *base;
    epd_server_t *server;
    epd_engine_t *engine;
    epd_external_t *external; /* experts.kind external: the rank's expert worker */
    char path[EPD_CONFIG_STR_LEN];
} daemon_t;

/* Logs why this rank cannot start and takes the whole job down with exit code `code`. */
static void __attribute__((noreturn, format(printf, 2, 3))) start_fail_code(int code,
                                                                            const char *fmt, ...)
{
    char message[1024];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(message, sizeof(message), fmt, ap);
    va_end(ap);
    epd_log_error("start-up failed: %s", message);
    MPI_Abort(MPI_COMM_WORLD, code);
    _exit(code); /* MPI_Abort does not return; this is for the compiler */
}

#define start_fail(...) start_fail_code(DAEMON_START_FAILED, __VA_ARGS__)

static void mpi_check(int rc, const char *what)
{
    char text[MPI_MAX_ERROR_STRING];

    if (rc == MPI_SUCCESS) return;
    start_fail("%s: %s", what, epd_mpi_error_text(rc, text));
}

epd_status_t epd_daemon_load_config(const epd_args_t *args, epd_config_warn_fn warn, void *warn_arg,
                                    epd_config_state_t **state_p, char err[EPD_ERR_LEN])
{
    epd_config_sources_t sources = {
        .file = args->config_file,
        .envp = environ,
        .sets = args->sets,
        .n_sets = args->n_sets,
        .warn = warn,
        .warn_arg = warn_arg,
    };
    return epd_config_load(&sources, state_p, err);
}

/* Configuration warnings are the same on every rank: rank 0 says them once. */
static void config_warn(void *arg, const char *message)
{
    const daemon_t *d = arg;
    if (d->rank == 0) epd_log_warn("config: %s", message);
}

/* 64-bit FNV-1a of the fingerprint text. */
static uint64_t text_hash(const char *text, size_t len)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < len; i++) {
        h ^= (unsigned char)text[i];
        h *= 1099511628211ull;
    }
    return h;
}

/* The first line where two fingerprints differ, copied into the two outputs. */
static void first_difference(const char *a, const char *b, char *line_a, char *line_b, size_t len)
{
    while (*a != '\0' || *b != '\0') {
        size_t na = strcspn(a, "\n"), nb = strcspn(b, "\n");
        if (na != nb || memcmp(a, b, na) != 0) {
            snprintf(line_a, len, "%.*s", (int)na, a);
            snprintf(line_b, len, "%.*s", (int)nb, b);
            return;
        }
        a += na + (a[na] == '\n');
        b += nb + (b[nb] == '\n');
    }
    snprintf(line_a, len, "(same text)");
    snprintf(line_b, len, "(same text)");
}

/* Every rank must run the same settings: hashes and lengths are gathered everywhere; when one
 * differs, the differing rank's text goes to rank 0, which names the rank and the setting. */
static void check_config_identical(daemon_t *d)
{
    size_t need = epd_config_fingerprint(d->cfg, NULL, 0) + 1;
    char *text = malloc(need);
    uint64_t mine[2], *all;
    int differs = -1;

    if (text == NULL) start_fail("out of memory");
    epd_config_fingerprint(d->cfg, text, need);
    mine[0] = text_hash(text, strlen(text));
    mine[1] = strlen(text);
    all = malloc(sizeof(uint64_t) * 2 * (size_t)d->world);
    if (all == NULL) start_fail("out of memory");
    mpi_check(MPI_Allgather(mine, 2, MPI_UINT64_T, all, 2, MPI_UINT64_T, MPI_COMM_WORLD),
              "MPI_Allgather of the configuration fingerprints");
    for (int r = 1; r < d->world && differs < 0; r++)
        if (all[2 * r] != all[0] || all[2 * r + 1] != all[1]) differs = r;
    if (differs < 0) {
        free(all);
        free(text);
        return;
    }

    /* Every rank knows which rank differs; that rank sends its text to rank 0 for the message. */
    if (d->rank == differs) {
        mpi_check(MPI_Send(text, (int)mine[1] + 1, MPI_CHAR, 0, 0, MPI_COMM_WORLD),
                  "MPI_Send of the configuration");
    } else if (d->rank == 0) {
        size_t other_len = (size_t)all[2 * differs + 1] + 1;
        char *other = malloc(other_len);
        char line_0[EPD_CONFIG_STR_LEN + 64], line_r[EPD_CONFIG_STR_LEN + 64];
        if (other == NULL) start_fail("out of memory");
        mpi_check(MPI_Recv(other, (int)other_len, MPI_CHAR, differs, 0, MPI_COMM_WORLD,
                           MPI_STATUS_IGNORE), "MPI_Recv of the configuration");
        other[other_len - 1] = '\0';
        first_difference(text, other, line_0, line_r, sizeof(line_0));
        start_fail("the configuration differs between ranks: rank %d has '%s' where rank 0 has "
                   "'%s' (every rank must see the same file, variables and --set)", differs, line_r,
                   line_0);
    }
    /* The others wait for rank 0's abort. */
    mpi_check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
    start_fail("the configuration differs between ranks (rank %d differs from rank 0)", differs);
}

epd_status_t epd_daemon_backend_open(const epd_config_t *cfg, MPI_Comm comm, int local_rank,
                                     int local_size, epd_rank_backend_t *backend_p,
                                     char err[EPD_ERR_LEN])
{
    epd_device_choice_t device;
    epd_transport_choice_t transport;
    epd_status_t status;

    memset(backend_p, 0, sizeof(*backend_p));
    CHECK_GOTO(epd_device_select(cfg->device.backend, cfg->device.id, local_rank, local_size,
                                 &device, err), out);
    CHECK_GOTO(device.ops->init(device.device_id, &backend_p->ops_ctx, err), out);
    backend_p->ops = device.ops;
    backend_p->device_id = device.device_id;
    snprintf(backend_p->device_reason, EPD_ERR_LEN, "%s", device.reason);

    CHECK_GOTO(epd_transport_select(cfg, device.ops, &transport, err), out_ops);
    CHECK_GOTO(transport.transport->init(comm, device.ops, backend_p->ops_ctx,
                                         &backend_p->transport_ctx, err), out_ops);
    backend_p->transport = transport.transport;
    snprintf(backend_p->transport_reason, EPD_ERR_LEN, "%s", transport.reason);
    return EPD_OK;

out_ops:
    device.ops->fini(backend_p->ops_ctx);
    backend_p->ops_ctx = NULL;
    backend_p->ops = NULL;
out:
    return status;
}

void epd_daemon_backend_close(epd_rank_backend_t *backend)
{
    if (backend->transport != NULL) backend->transport->fini(backend->transport_ctx);
    if (backend->ops != NULL) backend->ops->fini(backend->ops_ctx);
    memset(backend, 0, sizeof(*backend));
}

static void log_mpi_library(void)
{
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;

    MPI_Get_library_version(version, &len);
    version[strcspn(version, "\n")] = '\0';
    epd_log_info("MPI: %s", version);
}

/* Rank, world, node-local rank; logging prefixed with the rank from here on. */
static void start_identity(daemon_t *d)
{
    MPI_Comm node;

    MPI_Comm_rank(MPI_COMM_WORLD, &d->rank);
    MPI_Comm_size(MPI_COMM_WORLD, &d->world);
    epd_log_init(d->rank, EPD_LOG_INFO);
    if (d->rank == 0) log_mpi_library();
    mpi_check(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, d->rank, MPI_INFO_NULL,
                                  &node), "MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)");
    MPI_Comm_rank(node, &d->local_rank);
    MPI_Comm_size(node, &d->local_size);
    MPI_Comm_free(&node);
}

static void start_config(daemon_t *d, const epd_args_t *args)
{
    char err[EPD_ERR_LEN], why[EPD_ERR_LEN];

    if (epd_daemon_load_config(args, config_warn, d, &d->state, err) != EPD_OK)
        start_fail_code(DAEMON_CONFIG_INVALID, "configuration: %s", err);
    d->cfg = epd_config_get(d->state);
    epd_log_set_level(d->cfg->log.level);
    check_config_identical(d);
    /* Same on every rank (the configuration is identical): only rank 0 explains, all abort. */
    if (epd_moe_experts_check(d->cfg->model.num_experts, (uint32_t)d->world, why) != EPD_OK) {
        if (d->rank == 0) epd_log_error("start-up failed: model.%s", why); /* num_experts = ... */
        MPI_Barrier(MPI_COMM_WORLD);
        start_fail_code(DAEMON_CONFIG_INVALID, "model.num_experts %% ranks != 0");
    }
}

static void start_backend(daemon_t *d)
{
    char err[EPD_ERR_LEN];

    mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &d->comm), "MPI_Comm_dup");
    if (epd_daemon_backend_open(d->cfg, d->comm, d->local_rank, d->local_size, &d->backend, err) !=
        EPD_OK)
        start_fail("%s", err);
    d->backend_open = true;
    if (d->rank == 0) {
        epd_log_info("device: %s", d->backend.device_reason);
        epd_log_info("transport: %s", d->backend.transport_reason);
    } else {
        epd_log_debug("device: %s", d->backend.device_reason);
        epd_log_debug("transport: %s", d->backend.transport_reason);
    }
}

/* The ffn experts of this rank, loaded before anything listens: a checkpoint that does not fit
 * the settings stops the start-up naming the file and tensor. */
static void start_experts(daemon_t *d)
{
    char err[EPD_ERR_LEN];
    uint64_t start = epd_now_ns();

    if (epd_experts_open(d->cfg, (uint32_t)d->world, (uint32_t)d->rank, d->backend.ops,
                         d->backend.ops_ctx, &d->ffn, err) != EPD_OK)
        start_fail("%s", err);
    if (d->ffn != NULL)
        epd_log_info("ffn experts: %u layers of experts [%u, %u), %s, H %u, I %u: %llu bytes on "
                     "this rank (%s memory), loaded in %.1f s",
                     d->ffn->n_layers, d->ffn->first_expert, d->ffn->first_expert + d->ffn->n_local,
                     epd_ffn_format_name(d->ffn->format), d->ffn->hidden, d->ffn->intermediate,
                     (unsigned long long)d->ffn->local_bytes, d->backend.ops->name,
                     (double)(epd_now_ns() - start) / 1e9);
}

static void start_server(daemon_t *d)
{
    char err[EPD_ERR_LEN];
    char host[256] = "";

    if (evthread_use_pthreads() != 0) start_fail("libevent has no pthreads support");
    d->base = event_base_new();
    if (d->base == NULL) start_fail("cannot create the event loop");
    if (epd_server_create(d->cfg, d->base, d->rank, d->world, &d->server, err) != EPD_OK)
        start_fail("%s", err);
    if (gethostname(host, sizeof(host) - 1) != 0) snprintf(host, sizeof(host), "localhost");
    if (epd_config_expand_path(d->cfg->socket.path, d->rank, d->local_rank, host, d->path,
                               sizeof(d->path), err) != EPD_OK)
        start_fail("socket.path: %s", err);
    /* ffn experts serve the layers they loaded; SUBMITs naming another get unknown_layer */
    if (d->ffn != NULL) epd_server_set_layer_hook(d->server, epd_experts_layer_known, d->ffn);
    if (epd_server_listen(d->server, d->path, err) != EPD_OK) start_fail("%s", err);
    if (epd_server_metrics_listen(d->server, d->local_rank, err) != EPD_OK) start_fail("%s", err);
}

int epd_daemon_run(const epd_args_t *args)
{
    daemon_t d;
    char err[EPD_ERR_LEN];
    bool sent = false;
    int rc = 0;

    memset(&d, 0, sizeof(d));
    d.comm = MPI_COMM_NULL;
    /* A client that goes away must not kill the rank that writes to it. */
    signal(SIGPIPE, SIG_IGN);

    start_identity(&d);
    start_config(&d, args);
    start_backend(&d);
    start_experts(&d);
    start_server(&d);

    /* READY means every rank accepts connections (they wait in the backlog until the loop runs). */
    mpi_check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier after listen");
    if (epd_engine_create(d.cfg, d.comm, d.backend.ops, d.backend.ops_ctx, d.backend.transport,
                          d.backend.transport_ctx, epd_server_wake, d.server, &d.engine,
                          err) != EPD_OK)
        start_fail("engine: %s", err);
    if (d.cfg->experts.kind == EPD_EXPERTS_EXTERNAL) {
        /* the frontend's worker runs this rank's experts (CONTROL serve_experts) */
        if (epd_external_create(d.cfg, (uint32_t)d.world, (uint32_t)d.rank, d.base,
                                d.backend.ops, d.backend.ops_ctx, &d.external, err) != EPD_OK)
            start_fail("%s", err);
        epd_server_set_external(d.server, d.external);
        epd_engine_set_experts(d.engine, epd_external_run, d.external, epd_external_failure_text);
    }
    if (epd_server_start(d.server, d.engine, err) != EPD_OK) start_fail("%s", err);

    epd_log_info("serving on %s (mode %04o): %d ranks, %" PRIu32 " experts, hidden %" PRIu32
                 ", top-%" PRIu32 ", dispatch %s, experts %s", d.path,
                 (unsigned)d.cfg->socket.mode, d.world, d.cfg->model.num_experts,
                 d.cfg->model.hidden, d.cfg->model.topk,
                 epd_config_enum_name("dispatch.dtype", d.cfg->dispatch.dtype),
                 epd_config_enum_name("experts.kind", d.cfg->experts.kind));
    if (d.rank == 0) {
        char state[256];
        snprintf(state, sizeof(state), "READY=1\nSTATUS=serving: %d ranks, dispatch %s", d.world,
                 epd_config_enum_name("dispatch.dtype", d.cfg->dispatch.dtype));
        if (epd_notify_send(getenv("NOTIFY_SOCKET"), state, &sent, err) != EPD_OK)
            epd_log_warn("systemd notify: %s", err);
        else if (sent)
            epd_log_info("told systemd READY=1");
    }

    if (epd_server_run(d.server) < 0) {
        epd_log_error("the event loop failed");
        rc = 1;
    }
    /* After a failed step the ranks are out of step: no clean finalize is possible. */
    if (epd_engine_failed(d.engine, err)) {
        epd_log_error("aborting the job: %s", err);
        MPI_Abort(MPI_COMM_WORLD, DAEMON_STEP_FAILED);
    }

    epd_server_free(d.server);
    epd_engine_destroy(d.engine);
    epd_external_free(d.external);
    epd_daemon_backend_close(&d.backend);
    epd_ffn_free(d.ffn);
    event_base_free(d.base);
    MPI_Comm_free(&d.comm);
    epd_config_state_free(d.state);
    epd_log_debug("rank finished");
    return rc;
}
