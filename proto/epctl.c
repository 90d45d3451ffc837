/* epctl: the operator's and benchmarker's client of epd (DESIGN.md section 9). Control queries
 * (health, stats, config, metrics), one random batch (submit), and a multi-connection load
 * generator (bench). Exit codes: 0 ok, 1 the daemon answered with an error (or failed mid-way),
 * 2 usage, 3 cannot connect. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/bf16.h"
#include "common/clock.h"
#include "common/parse.h"
#include "common/rng.h"
#include "proto/cuda_dl.h"
#include "proto/epd.h"

enum { EXIT_DAEMON = 1, EXIT_USAGE = 2, EXIT_CONNECT = 3 };

#define MAX_SOCKETS 64
#define MAX_CONCURRENCY 1024
#define MAX_PIPELINE 256

typedef struct options {
    const char *sockets[MAX_SOCKETS];
    int n_sockets;
    char *socket_lists[MAX_SOCKETS]; /* strdup'ed comma lists, split in place */
    int n_lists;
    bool json;
    int timeout_ms;
    const char *command;
    uint64_t tokens;
    uint64_t seed;
    uint64_t id;
    uint64_t requests;       /* 0: not given */
    uint64_t concurrency;
    uint64_t pipeline;
    double duration;         /* seconds; 0: not given */
    const char *data;        /* bench: "payload" (default), "host" or "cuda" */
    uint64_t cuda_device;    /* bench --data cuda: the GPU of the daemon's rank */
    uint64_t spin_us;        /* bench --spin-us (UINT64_MAX: libepd's default) */
} options_t;

/* The model shape every batch must match, from the daemon's config reply. */
typedef struct model {
    uint32_t hidden;
    uint32_t topk;
    uint32_t num_experts;
    char dtype[16];
} model_t;

static const struct {
    const char *name;
    const char *summary;
    const char *help;
} commands[] = {
    {"health", "is the daemon serving? (exit 0 when every socket answers ok)",
     "usage: epctl [--socket PATH]... [--json] health\n"
     "Asks each daemon socket for its health and prints the reply. Exits 0 when every one answers\n"
     "\"status\": \"ok\", 1 when one answers another status (\"stalled\": a rank waits for the\n"
     "others, the reply names the phase), 3 when one cannot be reached. With --json, for one socket or\n"
     "many (the same for stats, config and metrics), one document:\n"
     "  {\"command\": \"health\", \"sockets\": [{\"socket\": PATH, \"reply\": {...}},\n"
     "                                     {\"socket\": PATH, \"error\": {\"code\", \"message\"}}]}\n"},
    {"stats", "counters: requests, tokens, steps, queue, errors, latencies",
     "usage: epctl [--socket PATH]... [--json] stats\n"
     "Prints the daemon's statistics reply (JSON with --json).\n"},
    {"config", "the daemon's effective settings (model.hidden, dispatch.dtype, ...)",
     "usage: epctl [--socket PATH]... [--json] config\n"
     "Prints every setting of the running daemon, one `key = value` a line (JSON with --json).\n"},
    {"metrics", "Prometheus text exposition of the daemon's metrics",
     "usage: epctl [--socket PATH]... [--json] metrics\n"
     "Prints the daemon's metrics in the Prometheus text format. Several sockets give one valid\n"
     "exposition: each family once, every sample labelled socket=\"PATH\". With --json the entry\n"
     "of each socket also has \"text\": the exposition.\n"},
    {"submit", "send one random batch and summarize the output",
     "usage: epctl [--socket PATH] [--json] submit [--tokens N] [--seed S] [--id ID]\n"
     "Reads H, K and E from the daemon's config, sends one batch of N tokens (default 16): x\n"
     "normal(0, 1) in bf16 with a few outliers, K distinct random expert ids per token in [0, E)\n"
     "(now and then -1, an empty slot), softmax weights. Prints the id, N, the step, the round-trip\n"
     "time and the output's abs-mean, sum and FNV-1a hash. Same seed, same batch (default seed 1).\n"},
    {"bench", "load generator: tokens/s, requests/s, latency percentiles",
     "usage: epctl [--socket PATH[,PATH...]]... [--json] bench [--tokens N] [--requests R]\n"
     "             [--concurrency C] [--duration S] [--pipeline D] [--seed S]\n"
     "             [--data payload|host|cuda] [--cuda-device N] [--spin-us U]\n"
     "Opens C connections (one thread each, default 1), spread round-robin over the sockets, and\n"
     "sends R requests of N tokens in total (defaults 128 tokens, 1000 requests), or runs for S\n"
     "seconds when --duration is given (whichever ends first when both are). Each connection keeps\n"
     "up to D requests in flight (default 1). The clock starts once every connection is open with\n"
     "its batch built. Reports tokens/s, requests/s, latency p50/p90/p99, the tensor bytes of the\n"
     "answered requests (x, ids, weights out; y back) with their GB/s, and errors by code; a\n"
     "progress line is shown when stderr is a terminal. --spin-us U: each connection polls for its\n"
     "answer without sleeping for up to U us first (epd_client_set_spin; default libepd's, 200;\n"
     "0: sleep in poll(2) at once).\n"
     "--data says where the tensors are (DESIGN.md section 4b): payload (in each frame, the\n"
     "default), host (a shared memfd region per connection, y written into it) or cuda (device\n"
     "memory on GPU --cuda-device, default 0, shared by CUDA IPC: the daemon's rank must run on\n"
     "that GPU). The batch is put in place once; each request names it.\n"},
};

static void usage_main(FILE *out)
{
    fprintf(out,
            "usage: epctl [--socket PATH]... [--json] [--timeout MS] COMMAND [OPTIONS]\n"
            "       epctl COMMAND --help | epctl --help | epctl --version\n"
            "\nThe client of epd, the expert-parallel MoE dispatch daemon.\n\ncommands:\n");
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++) {
        fprintf(out, "  %-8s %s\n", commands[i].name, commands[i].summary);
    }
    fprintf(out,
            "\noptions:\n"
            "  -s, --socket PATH  daemon socket; repeat it or give a comma list to use several\n"
            "                     (bench spreads its connections over them). Default: $EPD_SOCKET,\n"
            "                     else " EPD_CLIENT_DEFAULT_SOCKET "\n"
            "  --json             machine-readable output (one JSON document)\n"
            "  --timeout MS       how long to wait for the daemon (default 30000)\n"
            "  -h, --help         this text; `epctl COMMAND --help` explains a command\n"
            "  --version          print the version\n"
            "\nexit status: 0 ok, 1 the daemon answered with an error, 2 usage, 3 cannot connect\n");
}

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static int usage_error(const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "epctl: ");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n(see epctl --help)\n");
    return EXIT_USAGE;
}

static int find_command(const char *name)
{
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++) {
        if (strcmp(commands[i].name, name) == 0) return (int)i;
    }
    return -1;
}

static int add_sockets(options_t *o, const char *arg)
{
    char *list, *save = NULL;
    if (o->n_lists == MAX_SOCKETS) return usage_error("too many --socket options");
    list = strdup(arg);
    if (list == NULL) return usage_error("out of memory");
    o->socket_lists[o->n_lists++] = list;
    for (char *p = strtok_r(list, ",", &save); p != NULL; p = strtok_r(NULL, ",", &save)) {
        if (o->n_sockets == MAX_SOCKETS) return usage_error("at most %d sockets", MAX_SOCKETS);
        o->sockets[o->n_sockets++] = p;
    }
    if (o->n_sockets == 0) return usage_error("--socket needs a path");
    return 0;
}

static int parse_number(const char *opt, const char *val, uint64_t min, uint64_t max,
                        uint64_t *out_p)
{
    char err[EPD_ERR_LEN];
    if (epd_parse_u64(val, 10, min, max, out_p, err) != EPD_OK) {
        return usage_error("%s: %s", opt, err);
    }
    return 0;
}

/* Parses argv into o; returns -1 to go on, or an exit status (help printed, usage error). */
static int parse_args(int argc, char **argv, options_t *o)
{
    int cmd = -1, rc;
    bool cmd_help = false;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            if (cmd < 0) {
                usage_main(stdout);
                return 0;
            }
            cmd_help = true;
            continue;
        }
        if (strcmp(a, "--version") == 0) {
            printf("epctl %s\n", epd_client_version());
            return 0;
        }
        if (strcmp(a, "--json") == 0) {
            o->json = true;
            continue;
        }
        if (a[0] != '-') {
            if (cmd >= 0) return usage_error("unexpected argument \"%s\"", a);
            cmd = find_command(a);
            if (cmd < 0) return usage_error("unknown command \"%s\"", a);
            o->command = commands[cmd].name;
            continue;
        }
        if (val == NULL) {
            bool known = strcmp(a, "-s") == 0 || strcmp(a, "--socket") == 0 ||
                         strcmp(a, "--timeout") == 0 || strcmp(a, "--tokens") == 0 ||
                         strcmp(a, "--seed") == 0 || strcmp(a, "--id") == 0 ||
                         strcmp(a, "--requests") == 0 || strcmp(a, "--concurrency") == 0 ||
                         strcmp(a, "--duration") == 0 || strcmp(a, "--pipeline") == 0 ||
                         strcmp(a, "--data") == 0 || strcmp(a, "--cuda-device") == 0;
            if (known) return usage_error("%s needs a value", a);
            return usage_error("unknown option \"%s\"", a);
        }
        bool is_submit = o->command && strcmp(o->command, "submit") == 0;
        bool is_bench = o->command && strcmp(o->command, "bench") == 0;
        if (strcmp(a, "-s") == 0 || strcmp(a, "--socket") == 0) {
            if ((rc = add_sockets(o, val)) != 0) return rc;
        } else if (strcmp(a, "--timeout") == 0) {
            uint64_t v;
            if ((rc = parse_number(a, val, 1, INT32_MAX, &v)) != 0) return rc;
            o->timeout_ms = (int)v;
        } else if (strcmp(a, "--tokens") == 0 && (is_submit || is_bench)) {
            if ((rc = parse_number(a, val, 1, 1u << 24, &o->tokens)) != 0) return rc;
        } else if (strcmp(a, "--seed") == 0 && (is_submit || is_bench)) {
            if ((rc = parse_number(a, val, 0, UINT64_MAX, &o->seed)) != 0) return rc;
        } else if (strcmp(a, "--id") == 0 && is_submit) {
            if ((rc = parse_number(a, val, 0, UINT64_MAX, &o->id)) != 0) return rc;
        } else if (strcmp(a, "--requests") == 0 && is_bench) {
            if ((rc = parse_number(a, val, 1, UINT64_MAX / 2, &o->requests)) != 0) return rc;
        } else if (strcmp(a, "--concurrency") == 0 && is_bench) {
            if ((rc = parse_number(a, val, 1, MAX_CONCURRENCY, &o->concurrency)) != 0) return rc;
        } else if (strcmp(a, "--pipeline") == 0 && is_bench) {
            if ((rc = parse_number(a, val, 1, MAX_PIPELINE, &o->pipeline)) != 0) return rc;
        } else if (strcmp(a, "--data") == 0 && is_bench) {
            if (strcmp(val, "payload") != 0 && strcmp(val, "host") != 0 &&
                strcmp(val, "cuda") != 0)
                return usage_error("--data: \"%s\" is not payload, host or cuda", val);
            o->data = val;
        } else if (strcmp(a, "--spin-us") == 0 && is_bench) {
            if ((rc = parse_number(a, val, 0, 1000000, &o->spin_us)) != 0) return rc;
        } else if (strcmp(a, "--cuda-device") == 0 && is_bench) {
            if ((rc = parse_number(a, val, 0, 1023, &o->cuda_device)) != 0) return rc;
        } else if (strcmp(a, "--duration") == 0 && is_bench) {
            char err[EPD_ERR_LEN];
            if (epd_parse_double(val, 0.001, 1e7, &o->duration, err) != EPD_OK) {
                return usage_error("--duration: %s", err);
            }
        } else {
            return usage_error("unknown option \"%s\"%s%s", a, o->command ? " for " : "",
                               o->command ? o->command : "");
        }
        i++;
    }
    if (cmd < 0) return usage_error("no command given");
    if (cmd_help) {
        fputs(commands[cmd].help, stdout);
        return 0;
    }
    if (o->n_sockets == 0) {
        const char *env = getenv("EPD_SOCKET");
        if ((rc = add_sockets(o, env && *env ? env : EPD_CLIENT_DEFAULT_SOCKET)) != 0) return rc;
    }
    if (o->n_sockets > 1 && strcmp(o->command, "submit") == 0) {
        return usage_error("submit takes one socket");
    }
    return -1;
}

/* ---- helpers ---- */

static double now_s(void)
{
    return (double)epd_now_ns() * 1e-9;
}

/* Exit status for a libepd failure, with the error printed to stderr. */
static int report_failure(epd_client_t *c, int rc, const char *socket)
{
    if (rc == EPD_CLIENT_ERR_CONNECT) { /* the message names the path already */
        fprintf(stderr, "epctl: %s\n", epd_client_last_message(c));
        return EXIT_CONNECT;
    }
    fprintf(stderr, "epctl: %s: %s (%s)\n", socket, epd_client_last_message(c),
            epd_client_last_error(c));
    return EXIT_DAEMON;
}

static epd_client_t *open_client(const options_t *o, const char *socket, int *exit_p)
{
    epd_client_t *c = epd_client_create();
    int rc;
    if (c == NULL) {
        fprintf(stderr, "epctl: out of memory\n");
        *exit_p = EXIT_DAEMON;
        return NULL;
    }
    rc = epd_client_connect(c, socket, o->timeout_ms);
    if (rc != EPD_CLIENT_OK) {
        *exit_p = report_failure(c, rc == EPD_CLIENT_ERR_TIMEOUT ? EPD_CLIENT_ERR_CONNECT : rc,
                                 socket);
        epd_client_destroy(c);
        return NULL;
    }
    return c;
}

static bool json_u32(const cJSON *obj, const char *key, uint32_t *out_p)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!cJSON_IsNumber(v) || v->valuedouble < 1 || v->valuedouble > UINT32_MAX ||
        floor(v->valuedouble) != v->valuedouble) {
        return false;
    }
    *out_p = (uint32_t)v->valuedouble;
    return true;
}

/* Reads model.hidden, model.topk, model.num_experts (and dispatch.dtype) from `config`. */
static int fetch_model(epd_client_t *c, const char *socket, model_t *m)
{
    char *json = NULL;
    cJSON *cfg;
    int rc = epd_client_control(c, "config", &json, NULL, NULL);
    if (rc != EPD_CLIENT_OK) return report_failure(c, rc, socket);
    cfg = cJSON_Parse(json);
    epd_client_free(json);
    memset(m, 0, sizeof(*m));
    if (cfg == NULL || !json_u32(cfg, "model.hidden", &m->hidden) ||
        !json_u32(cfg, "model.topk", &m->topk) ||
        !json_u32(cfg, "model.num_experts", &m->num_experts)) {
        cJSON_Delete(cfg);
        fprintf(stderr, "epctl: %s: the config reply lacks model.hidden, model.topk or "
                        "model.num_experts\n", socket);
        return EXIT_DAEMON;
    }
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(cfg, "dispatch.dtype");
    snprintf(m->dtype, sizeof(m->dtype), "%s", cJSON_IsString(dt) ? dt->valuestring : "?");
    cJSON_Delete(cfg);
    if (m->topk > m->num_experts) {
        fprintf(stderr, "epctl: %s: model.topk %u > model.num_experts %u\n", socket, m->topk,
                m->num_experts);
        return EXIT_DAEMON;
    }
    return 0;
}

/* ---- metrics of several sockets, merged into one exposition ---- */

/* One metric family: its HELP and TYPE lines (from the first exposition that has them) and the
 * samples of every socket, each labelled socket="PATH". */
typedef struct family {
    char *name;
    char *help;
    char *type;
    char **samples;
    size_t n_samples, cap_samples;
} family_t;

typedef struct exposition {
    family_t *families;
    size_t n, cap;
} exposition_t;

static family_t *family_get(exposition_t *x, const char *name, size_t len)
{
    for (size_t i = 0; i < x->n; i++)
        if (strlen(x->families[i].name) == len && strncmp(x->families[i].name, name, len) == 0)
            return &x->families[i];
    if (x->n == x->cap) {
        size_t cap = x->cap ? x->cap * 2 : 64;
        family_t *f = realloc(x->families, cap * sizeof(*f));
        if (f == NULL) return NULL;
        x->families = f;
        x->cap = cap;
    }
    family_t *f = &x->families[x->n];
    memset(f, 0, sizeof(*f));
    f->name = strndup(name, len);
    if (f->name == NULL) return NULL;
    x->n++;
    return f;
}

static bool family_add_sample(family_t *f, char *line)
{
    if (f->n_samples == f->cap_samples) {
        size_t cap = f->cap_samples ? f->cap_samples * 2 : 16;
        char **p = realloc(f->samples, cap * sizeof(*p));
        if (p == NULL) return false;
        f->samples = p;
        f->cap_samples = cap;
    }
    f->samples[f->n_samples++] = line;
    return true;
}

/* The socket path as a label value: backslash, quote and newline escaped. */
static char *label_value(const char *text)
{
    size_t n = strlen(text);
    char *out = malloc(2 * n + 1), *o = out;
    if (out == NULL) return NULL;
    for (const char *p = text; *p; p++) {
        if (*p == '\\' || *p == '"') *o++ = '\\';
        if (*p == '\n') {
            *o++ = '\\';
            *o++ = 'n';
            continue;
        }
        *o++ = *p;
    }
    *o = '\0';
    return out;
}

/* Adds one socket's exposition: HELP/TYPE lines name the family the samples after them belong
 * to; each sample gets socket="PATH" as its first label. False when out of memory. */
static bool exposition_add(exposition_t *x, const char *text, size_t len, const char *socket)
{
    char *value = label_value(socket);
    family_t *cur = NULL;
    const char *p = text, *end = text + len;
    bool ok = value != NULL;

    while (ok && p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t n = nl ? (size_t)(nl - p) : (size_t)(end - p);
        const char *next = nl ? nl + 1 : end;
        if (n == 0) {
            p = next;
            continue;
        }
        if (p[0] == '#') {
            bool help = n > 7 && strncmp(p, "# HELP ", 7) == 0;
            bool type = n > 7 && strncmp(p, "# TYPE ", 7) == 0;
            if (help || type) {
                const char *name = p + 7;
                size_t nlen = strcspn(name, " \n");
                cur = family_get(x, name, nlen);
                if (cur == NULL) {
                    ok = false;
                    break;
                }
                char **slot = help ? &cur->help : &cur->type;
                if (*slot == NULL && (*slot = strndup(p, n)) == NULL) ok = false;
            }
            p = next;
            continue;
        }
        size_t nlen = strcspn(p, "{ ");
        if (nlen > n) nlen = n;
        if (cur == NULL) cur = family_get(x, p, nlen);
        char *line = NULL;
        int w;
        if (nlen < n && p[nlen] == '{')
            w = asprintf(&line, "%.*s{socket=\"%s\",%.*s", (int)nlen, p, value,
                         (int)(n - nlen - 1), p + nlen + 1);
        else
            w = asprintf(&line, "%.*s{socket=\"%s\"}%.*s", (int)nlen, p, value,
                         (int)(n - nlen), p + nlen);
        if (cur == NULL || w < 0 || !family_add_sample(cur, line)) {
            if (w >= 0) free(line);
            ok = false;
        }
        p = next;
    }
    free(value);
    return ok;
}

static void exposition_print_free(exposition_t *x, bool print)
{
    for (size_t i = 0; i < x->n; i++) {
        family_t *f = &x->families[i];
        if (print && f->help) printf("%s\n", f->help);
        if (print && f->type) printf("%s\n", f->type);
        for (size_t j = 0; j < f->n_samples; j++) {
            if (print) printf("%s\n", f->samples[j]);
            free(f->samples[j]);
        }
        free(f->samples);
        free(f->help);
        free(f->type);
        free(f->name);
    }
    free(x->families);
    memset(x, 0, sizeof(*x));
}

/* ---- control commands ---- */

static void print_value_human(const char *key, const cJSON *v, int indent)
{
    if (cJSON_IsObject(v)) {
        printf("%*s%s:\n", indent, "", key);
        const cJSON *child;
        cJSON_ArrayForEach(child, v) print_value_human(child->string, child, indent + 2);
        return;
    }
    char *text = cJSON_IsString(v) ? NULL : cJSON_PrintUnformatted(v);
    printf("%*s%s = %s\n", indent, "", key, text ? text : v->valuestring);
    free(text);
}

/* A failed socket in the --json document: {"socket", "error": {"code", "message"}}. */
static void json_add_failure(cJSON *list, const char *sock, epd_client_t *c, int exit_code)
{
    cJSON *entry = cJSON_CreateObject(), *error = cJSON_CreateObject();
    cJSON_AddStringToObject(entry, "socket", sock);
    cJSON_AddStringToObject(error, "code", c == NULL ? (exit_code == EXIT_CONNECT ? "connect"
                                                                                 : "client")
                                                     : epd_client_last_error(c));
    cJSON_AddStringToObject(error, "message", c == NULL ? "" : epd_client_last_message(c));
    cJSON_AddItemToObject(entry, "error", error);
    cJSON_AddItemToArray(list, entry);
}

/* health, stats, config, metrics on every socket. With --json: one document always,
 * {"command": C, "sockets": [{"socket": P, "reply": {...}} or {"socket": P, "error": {...}}]}
 * (metrics entries also carry "text"). metrics of several sockets without --json: one valid
 * exposition, every sample labelled socket="PATH". */
static int run_control(const options_t *o)
{
    int status = 0;
    bool metrics = strcmp(o->command, "metrics") == 0;
    bool merge = metrics && !o->json && o->n_sockets > 1;
    cJSON *doc = o->json ? cJSON_CreateObject() : NULL;
    cJSON *list = doc ? cJSON_AddArrayToObject(doc, "sockets") : NULL;
    exposition_t merged;

    memset(&merged, 0, sizeof(merged));
    if (doc) cJSON_AddStringToObject(doc, "command", o->command);
    for (int s = 0; s < o->n_sockets; s++) {
        const char *sock = o->sockets[s];
        int exit_code = 0;
        char *json = NULL, *payload = NULL;
        size_t len = 0;
        epd_client_t *c = open_client(o, sock, &exit_code);
        if (c == NULL) {
            if (exit_code > status) status = exit_code;
            if (list) json_add_failure(list, sock, NULL, exit_code);
            continue;
        }
        int rc = epd_client_control(c, o->command, &json, &payload, &len);
        if (rc != EPD_CLIENT_OK) {
            int e = report_failure(c, rc, sock);
            if (e > status) status = e;
            if (list) json_add_failure(list, sock, c, e);
            epd_client_destroy(c);
            continue;
        }
        cJSON *meta = cJSON_Parse(json);
        if (strcmp(o->command, "health") == 0) {
            /* a daemon that answers but is not ok (stalled) is a failure for scripts */
            const cJSON *st = cJSON_GetObjectItemCaseSensitive(meta, "status");
            if (!cJSON_IsString(st) || strcmp(st->valuestring, "ok") != 0) {
                const cJSON *phase = cJSON_GetObjectItemCaseSensitive(meta, "stalled_phase");
                fprintf(stderr, "epctl: %s: status %s%s%s\n", sock,
                        cJSON_IsString(st) ? st->valuestring : "(none)",
                        cJSON_IsString(phase) ? ", waiting in the " : "",
                        cJSON_IsString(phase) ? phase->valuestring : "");
                if (status < EXIT_DAEMON) status = EXIT_DAEMON;
            }
        }
        if (list) {
            cJSON *entry = cJSON_CreateObject();
            cJSON_AddStringToObject(entry, "socket", sock);
            cJSON_AddItemToObject(entry, "reply", meta ? meta : cJSON_CreateNull());
            if (metrics) cJSON_AddStringToObject(entry, "text", payload ? payload : "");
            cJSON_AddItemToArray(list, entry);
        } else if (merge) {
            if (!exposition_add(&merged, payload ? payload : "", len, sock)) {
                fprintf(stderr, "epctl: out of memory merging the metrics\n");
                status = EXIT_DAEMON;
            }
            cJSON_Delete(meta);
        } else {
            if (o->n_sockets > 1) printf("== %s ==\n", sock);
            if (metrics) {
                fwrite(payload, 1, len, stdout);
                if (len > 0 && payload[len - 1] != '\n') putchar('\n');
            } else if (meta != NULL) {
                const cJSON *child;
                cJSON_ArrayForEach(child, meta) print_value_human(child->string, child, 0);
            }
            cJSON_Delete(meta);
        }
        epd_client_free(json);
        epd_client_free(payload);
        epd_client_destroy(c);
    }
    if (merge) exposition_print_free(&merged, true);
    if (doc) {
        char *text = cJSON_PrintUnformatted(doc);
        printf("%s\n", text ? text : "null");
        free(text);
        cJSON_Delete(doc);
    }
    return status;
}

/* ---- random batches ---- */

static double rng_normal(uint64_t *r)
{
    double u1 = epd_rng_unit_f64(r), u2 = epd_rng_unit_f64(r);
    return sqrt(-2.0 * log(1.0 - u1)) * cos(6.283185307179586 * u2);
}

typedef struct batch {
    uint16_t *x;
    int32_t *ids;
    float *w;
    uint16_t *y;
    epd_client_batch_t b;
} batch_t;

static void batch_free(batch_t *bt)
{
    free(bt->x);
    free(bt->ids);
    free(bt->w);
    free(bt->y);
    memset(bt, 0, sizeof(*bt));
}

/* N tokens: x ~ normal(0,1) with ~1% outliers (x30), distinct ids with ~2% empty slots, softmax
 * weights over the non-empty slots. */
static int batch_make(batch_t *bt, const model_t *m, uint32_t n, uint64_t seed)
{
    uint64_t r = seed;
    size_t nh = (size_t)n * m->hidden, nk = (size_t)n * m->topk;

    memset(bt, 0, sizeof(*bt));
    bt->x = malloc(nh * sizeof(*bt->x));
    bt->y = malloc(nh * sizeof(*bt->y));
    bt->ids = malloc(nk * sizeof(*bt->ids));
    bt->w = malloc(nk * sizeof(*bt->w));
    if (!bt->x || !bt->y || !bt->ids || !bt->w) {
        batch_free(bt);
        fprintf(stderr, "epctl: cannot allocate a batch of %u tokens\n", n);
        return EXIT_DAEMON;
    }
    for (size_t i = 0; i < nh; i++) {
        double v = rng_normal(&r);
        if (epd_rng_unit_f64(&r) < 0.01) v *= 30.0;
        bt->x[i] = epd_f32_to_bf16((float)v);
    }
    for (uint32_t t = 0; t < n; t++) {
        int32_t *ids = bt->ids + (size_t)t * m->topk;
        float *w = bt->w + (size_t)t * m->topk;
        double sum = 0;
        for (uint32_t k = 0; k < m->topk; k++) {
            int32_t e;
            bool dup;
            do { /* rejection: K <= E, so it ends */
                e = (int32_t)(epd_rng_next(&r) % m->num_experts);
                dup = false;
                for (uint32_t j = 0; j < k; j++) dup |= ids[j] == e;
            } while (dup);
            ids[k] = e;
            w[k] = (float)exp(rng_normal(&r));
            if (epd_rng_unit_f64(&r) < 0.02) ids[k] = -1, w[k] = 0;
            sum += w[k];
        }
        for (uint32_t k = 0; k < m->topk; k++) w[k] = sum > 0 ? (float)(w[k] / sum) : 0.0f;
    }
    bt->b = (epd_client_batch_t){.n_tokens = n, .hidden = m->hidden, .topk = m->topk,
                                 .x = bt->x, .topk_ids = bt->ids, .topk_weights = bt->w};
    return 0;
}

static int run_submit(const options_t *o)
{
    const char *sock = o->sockets[0];
    int exit_code = 0, rc;
    model_t m;
    batch_t bt;
    uint64_t step = 0;
    epd_client_t *c = open_client(o, sock, &exit_code);

    if (c == NULL) return exit_code;
    if ((exit_code = fetch_model(c, sock, &m)) != 0) goto out_client;
    uint32_t n = o->tokens ? (uint32_t)o->tokens : 16;
    if ((exit_code = batch_make(&bt, &m, n, o->seed ? o->seed : 1)) != 0) goto out_client;
    bt.b.id = o->id;
    double t0 = now_s();
    rc = epd_client_submit(c, &bt.b, bt.y, &step);
    double ms = (now_s() - t0) * 1e3;
    if (rc != EPD_CLIENT_OK) {
        exit_code = report_failure(c, rc, sock);
        goto out_batch;
    }
    double sum = 0, abs_sum = 0;
    uint64_t fnv = 0xcbf29ce484222325ull;
    const uint8_t *bytes = (const uint8_t *)bt.y;
    for (size_t i = 0; i < (size_t)n * m.hidden; i++) {
        double v = epd_bf16_to_f32(bt.y[i]);
        sum += v;
        abs_sum += fabs(v);
    }
    for (size_t i = 0; i < (size_t)n * m.hidden * 2; i++) fnv = (fnv ^ bytes[i]) * 0x100000001b3ull;
    double abs_mean = abs_sum / ((double)n * m.hidden);
    if (o->json) {
        printf("{\"id\":%" PRIu64 ",\"tokens\":%u,\"hidden\":%u,\"topk\":%u,\"step\":%" PRIu64
               ",\"time_ms\":%.3f,\"y_sum\":%.9g,\"y_abs_mean\":%.9g,\"y_fnv1a\":\"%016" PRIx64
               "\"}\n", o->id, n, m.hidden, m.topk, step, ms, sum, abs_mean, fnv);
    } else {
        printf("id %" PRIu64 "  tokens %u (H %u, K %u, E %u, dispatch %s)  step %" PRIu64
               "  time %.3f ms\ny abs-mean %.6g  sum %.6g  fnv1a %016" PRIx64 "\n", o->id, n,
               m.hidden, m.topk, m.num_experts, m.dtype, step, ms, abs_mean, sum, fnv);
    }
out_batch:
    batch_free(&bt);
out_client:
    epd_client_destroy(c);
    return exit_code;
}

/* ---- bench ---- */

#define MAX_CODES 16

typedef struct bench_shared {
    const options_t *o;
    const model_t *m;
    uint32_t tokens;
    uint64_t requests;       /* UINT64_MAX: until the deadline */
    double deadline;         /* now_s() value; 0: none */
    atomic_uint_fast64_t claimed;
    atomic_uint_fast64_t done;
    atomic_uint_fast64_t finished; /* workers that returned */
    atomic_bool stop;
    /* The clock starts once every worker has connected and built its batch: */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t ready;          /* workers set up (or failed to), under mu */
    bool go;                 /* the clock has started, under mu */
} bench_shared_t;

typedef struct bench_worker {
    bench_shared_t *sh;
    int index;
    pthread_t thread;
    double *lat_ms;          /* one per ok request */
    uint64_t n_lat;
    uint64_t cap_lat;
    uint64_t ok, errors;
    char codes[MAX_CODES][EPD_CLIENT_CODE_LEN];
    uint64_t code_counts[MAX_CODES];
    int fatal;               /* an exit status when the connection failed */
    char fatal_msg[EPD_CLIENT_MESSAGE_LEN + 256];
} bench_worker_t;

static void worker_count_error(bench_worker_t *w, const char *code)
{
    w->errors++;
    for (int i = 0; i < MAX_CODES; i++) {
        if (w->codes[i][0] == '\0') snprintf(w->codes[i], sizeof(w->codes[i]), "%s", code);
        if (strcmp(w->codes[i], code) == 0) {
            w->code_counts[i]++;
            return;
        }
    }
}

static bool worker_add_latency(bench_worker_t *w, double ms)
{
    if (w->n_lat == w->cap_lat) {
        uint64_t cap = w->cap_lat ? w->cap_lat * 2 : 1024;
        double *p = realloc(w->lat_ms, cap * sizeof(*p));
        if (p == NULL) return false;
        w->lat_ms = p;
        w->cap_lat = cap;
    }
    w->lat_ms[w->n_lat++] = ms;
    return true;
}

static bool worker_claim(bench_worker_t *w)
{
    bench_shared_t *sh = w->sh;
    if (atomic_load(&sh->stop)) return false;
    if (sh->deadline > 0 && now_s() >= sh->deadline) return false;
    if (sh->requests == UINT64_MAX) return true;
    return atomic_fetch_add(&sh->claimed, 1) < sh->requests;
}

static void *worker_run(bench_worker_t *w);

/* Says this worker is set up (or gave up) and waits for the start. */
static void worker_ready_wait(bench_shared_t *sh)
{
    pthread_mutex_lock(&sh->mu);
    sh->ready++;
    pthread_cond_broadcast(&sh->cv);
    while (!sh->go) pthread_cond_wait(&sh->cv, &sh->mu);
    pthread_mutex_unlock(&sh->mu);
}

static void *worker_main(void *arg)
{
    bench_worker_t *w = arg;
    worker_run(w);
    atomic_fetch_add(&w->sh->finished, 1);
    return NULL;
}

/* Where a worker's batch sits for --data host|cuda: one slot per request in flight, each holding
 * x, ids, weights and room for y, filled once. */
typedef struct bench_place {
    uint32_t region;
    uint64_t slot_bytes, x, ids, w, y;
    void *dev; /* cuda: the device allocation */
    epd_cuda_dl_t cu;
} bench_place_t;

static uint64_t up16(uint64_t v)
{
    return (v + 15) & ~UINT64_C(15);
}

/* Registers the worker's region and puts `depth` copies of the batch in it. */
static int place_setup(bench_worker_t *w, epd_client_t *c, const batch_t *bt, uint64_t depth,
                       bench_place_t *pl)
{
    const options_t *o = w->sh->o;
    uint64_t n = bt->b.n_tokens, hk = (uint64_t)bt->b.topk;
    char err[256];

    pl->x = 0;
    pl->ids = up16(n * bt->b.hidden * 2);
    pl->w = pl->ids + up16(n * hk * 4);
    pl->y = pl->w + up16(n * hk * 4);
    pl->slot_bytes = pl->y + up16(n * bt->b.hidden * 2);
    uint64_t bytes = pl->slot_bytes * depth;
    uint8_t *stage = malloc(bytes);
    if (stage == NULL) return snprintf(w->fatal_msg, sizeof w->fatal_msg, "out of memory"), -1;
    for (uint64_t s = 0; s < depth; s++) {
        uint8_t *slot = stage + s * pl->slot_bytes;
        memcpy(slot + pl->x, bt->x, n * bt->b.hidden * 2);
        memcpy(slot + pl->ids, bt->ids, n * hk * 4);
        memcpy(slot + pl->w, bt->w, n * hk * 4);
    }
    int rc;
    if (strcmp(o->data, "host") == 0) {
        void *mem = NULL;
        rc = epd_client_register_host(c, bytes, &pl->region, &mem);
        if (rc == EPD_CLIENT_OK) memcpy(mem, stage, bytes);
    } else {
        uint8_t handle[64];
        if (!epd_cuda_dl_open(&pl->cu, err, sizeof err)) {
            snprintf(w->fatal_msg, sizeof w->fatal_msg, "--data cuda: %s", err);
            free(stage);
            return -1;
        }
        int cr = pl->cu.set_device((int)o->cuda_device);
        if (cr == 0) cr = pl->cu.malloc(&pl->dev, bytes);
        if (cr == 0) cr = pl->cu.memcpy(pl->dev, stage, bytes, 1);
        if (cr == 0) cr = pl->cu.device_synchronize(); /* landed before the first SUBMIT */
        if (cr == 0) cr = pl->cu.ipc_get_mem_handle(handle, pl->dev);
        if (cr != 0) {
            snprintf(w->fatal_msg, sizeof w->fatal_msg, "--data cuda: device %" PRIu64 ": %s",
                     o->cuda_device, pl->cu.error_string(cr));
            free(stage);
            return -1;
        }
        rc = epd_client_register_cuda(c, handle, 0, bytes, &pl->region);
    }
    free(stage);
    if (rc != EPD_CLIENT_OK) {
        snprintf(w->fatal_msg, sizeof w->fatal_msg, "registering a %s region: %s (%s)", o->data,
                 epd_client_last_message(c), epd_client_last_error(c));
        return -1;
    }
    return 0;
}

static epd_client_request_t place_request(const bench_place_t *pl, const batch_t *bt, uint64_t id,
                                          uint64_t slot)
{
    uint64_t at = slot * pl->slot_bytes;
    epd_client_request_t r = {.id = id, .n_tokens = bt->b.n_tokens, .hidden = bt->b.hidden,
                              .topk = bt->b.topk, .layer = -1};
    r.x = (epd_client_tensor_t){.region = pl->region, .offset = at + pl->x};
    r.topk_ids = (epd_client_tensor_t){.region = pl->region, .offset = at + pl->ids};
    r.topk_weights = (epd_client_tensor_t){.region = pl->region, .offset = at + pl->w};
    r.y = (epd_client_tensor_t){.region = pl->region, .offset = at + pl->y};
    return r;
}

static void *worker_run(bench_worker_t *w)
{
    bench_shared_t *sh = w->sh;
    const options_t *o = sh->o;
    const char *sock = o->sockets[w->index % o->n_sockets];
    uint64_t depth = o->pipeline ? o->pipeline : 1;
    struct {
        uint64_t id;
        double t;
        uint64_t slot;
        uint64_t send_ns, sent_ns; /* EPD_BENCH_TIMES */
    } inflight[MAX_PIPELINE];
    bool slot_busy[MAX_PIPELINE] = {false};
    bench_place_t place;
    bool placed = o->data != NULL && strcmp(o->data, "payload") != 0;
    memset(&place, 0, sizeof place);
    uint64_t n_inflight = 0, seq = 0;
    batch_t bt;
    epd_client_t *c = epd_client_create();
    /* EPD_BENCH_TIMES=FILE: the first connection's requests, one line each (id, then
     * CLOCK_MONOTONIC ns: send called, send returned, the RESULT's recv(2) returned, the reply
     * returned), to line up with the daemon's EPD_TRACE_TIMES */
    const char *times_path = w->index == 0 ? getenv("EPD_BENCH_TIMES") : NULL;
    FILE *times = times_path != NULL && times_path[0] != '\0' ? fopen(times_path, "w") : NULL;

    uint64_t seed = (o->seed ? o->seed : 1) + (uint64_t)w->index * 7919;
    if (c == NULL || batch_make(&bt, sh->m, sh->tokens, seed) != 0) {
        w->fatal = EXIT_DAEMON;
        snprintf(w->fatal_msg, sizeof(w->fatal_msg), "out of memory");
        epd_client_destroy(c);
        worker_ready_wait(sh);
        return NULL;
    }
    /* connected, and the batch in place, before the clock starts */
    int rc = epd_client_connect(c, sock, o->timeout_ms);
    if (o->spin_us != UINT64_MAX) epd_client_set_spin(c, (unsigned)o->spin_us);
    bool place_failed = rc == EPD_CLIENT_OK && placed && place_setup(w, c, &bt, depth, &place) != 0;
    worker_ready_wait(sh);
    if (rc != EPD_CLIENT_OK) {
        w->fatal = EXIT_CONNECT;
        snprintf(w->fatal_msg, sizeof(w->fatal_msg), "%s", epd_client_last_message(c));
        goto out;
    }
    if (place_failed) {
        w->fatal = EXIT_DAEMON;
        goto out;
    }
    for (;;) {
        while (n_inflight < depth && worker_claim(w)) {
            bt.b.id = ((uint64_t)w->index << 40) | seq++;
            uint64_t slot = 0;
            uint64_t send_ns = epd_now_ns();
            if (placed) {
                while (slot_busy[slot]) slot++;
                epd_client_request_t req = place_request(&place, &bt, bt.b.id, slot);
                rc = epd_client_send_request(c, &req);
            } else {
                rc = epd_client_send(c, &bt.b);
            }
            if (rc != EPD_CLIENT_OK) goto conn_failed;
            slot_busy[slot] = placed;
            inflight[n_inflight].id = bt.b.id;
            inflight[n_inflight].slot = slot;
            inflight[n_inflight].t = now_s();
            inflight[n_inflight].send_ns = send_ns;
            inflight[n_inflight].sent_ns = epd_now_ns();
            n_inflight++;
        }
        if (n_inflight == 0) break;
        epd_client_reply_t r;
        rc = epd_client_recv(c, &r);
        if (rc != EPD_CLIENT_OK && rc != EPD_CLIENT_ERR_DAEMON) goto conn_failed;
        if (!r.has_id) { /* the daemon is closing this connection */
            worker_count_error(w, r.code);
            epd_client_reply_free(&r);
            rc = EPD_CLIENT_ERR_CLOSED;
            goto conn_failed;
        }
        double t = 0;
        for (uint64_t i = 0; i < n_inflight; i++) {
            if (inflight[i].id == r.id) {
                t = inflight[i].t;
                if (times != NULL)
                    fprintf(times, "%" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 "\n",
                            r.id, inflight[i].send_ns, inflight[i].sent_ns,
                            epd_client_last_read_ns(c), epd_now_ns());
                slot_busy[inflight[i].slot] = false;
                inflight[i] = inflight[--n_inflight];
                break;
            }
        }
        if (r.status == EPD_CLIENT_OK) {
            w->ok++;
            if (!worker_add_latency(w, (now_s() - t) * 1e3)) {
                epd_client_reply_free(&r);
                w->fatal = EXIT_DAEMON;
                snprintf(w->fatal_msg, sizeof(w->fatal_msg), "out of memory");
                goto out;
            }
        } else {
            worker_count_error(w, r.code);
        }
        epd_client_reply_free(&r);
        atomic_fetch_add(&sh->done, 1);
    }
    goto out;
conn_failed:
    w->fatal = EXIT_DAEMON;
    for (uint64_t i = 0; i < n_inflight; i++) worker_count_error(w, epd_client_last_error(c));
    snprintf(w->fatal_msg, sizeof(w->fatal_msg), "%s: %s (%s)", sock, epd_client_last_message(c),
             epd_client_last_error(c));
out:
    if (times != NULL) fclose(times);
    batch_free(&bt);
    epd_client_destroy(c); /* releases the region on the daemon's side */
    if (place.dev != NULL) place.cu.free(place.dev);
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double percentile(const double *sorted, uint64_t n, double p)
{
    if (n == 0) return 0;
    uint64_t i = (uint64_t)ceil(p / 100.0 * (double)n);
    return sorted[i == 0 ? 0 : i - 1];
}

static int run_bench(const options_t *o)
{
    int exit_code = 0;
    model_t m;
    bench_shared_t sh;
    uint64_t conc = o->concurrency ? o->concurrency : 1;
    bench_worker_t *w;
    bool tty = isatty(STDERR_FILENO);

    /* the model shape comes from the first socket; all ranks run one configuration */
    epd_client_t *c = open_client(o, o->sockets[0], &exit_code);
    if (c == NULL) return exit_code;
    exit_code = fetch_model(c, o->sockets[0], &m);
    epd_client_destroy(c);
    if (exit_code != 0) return exit_code;

    memset(&sh, 0, sizeof(sh));
    sh.o = o;
    sh.m = &m;
    sh.tokens = o->tokens ? (uint32_t)o->tokens : 128;
    sh.requests = o->requests ? o->requests : (o->duration > 0 ? UINT64_MAX : 1000);
    w = calloc(conc, sizeof(*w));
    if (w == NULL) {
        fprintf(stderr, "epctl: out of memory\n");
        return EXIT_DAEMON;
    }
    pthread_mutex_init(&sh.mu, NULL);
    pthread_cond_init(&sh.cv, NULL);
    uint64_t started = 0;
    for (uint64_t i = 0; i < conc; i++) {
        w[i].sh = &sh;
        w[i].index = (int)i;
        if (pthread_create(&w[i].thread, NULL, worker_main, &w[i]) != 0) {
            fprintf(stderr, "epctl: cannot start thread %" PRIu64 "\n", i);
            atomic_store(&sh.stop, true);
            exit_code = EXIT_DAEMON;
            break;
        }
        started++;
    }
    /* every worker connected with its batch built: the clock starts now, not before */
    pthread_mutex_lock(&sh.mu);
    while (sh.ready < started) pthread_cond_wait(&sh.cv, &sh.mu);
    double t0 = now_s();
    if (o->duration > 0) sh.deadline = t0 + o->duration;
    sh.go = true;
    pthread_cond_broadcast(&sh.cv);
    pthread_mutex_unlock(&sh.mu);
    if (tty) {
        /* progress on the terminal only, never into a pipe or file */
        for (;;) {
            struct timespec pause = {.tv_sec = 0, .tv_nsec = 250 * 1000 * 1000};
            nanosleep(&pause, NULL);
            uint64_t done = atomic_load(&sh.done);
            double el = now_s() - t0;
            if (sh.requests != UINT64_MAX) {
                fprintf(stderr, "\r  %" PRIu64 "/%" PRIu64 " requests  %.0f tokens/s  %.1f s ",
                        done, sh.requests, (double)done * sh.tokens / el, el);
            } else {
                fprintf(stderr, "\r  %" PRIu64 " requests  %.0f tokens/s  %.1f/%.1f s ", done,
                        (double)done * sh.tokens / el, el, o->duration);
            }
            bool all_done = (sh.requests != UINT64_MAX && done >= sh.requests) ||
                            (sh.deadline > 0 && now_s() >= sh.deadline);
            if (all_done || atomic_load(&sh.finished) == started) break;
        }
        fprintf(stderr, "\r\033[K");
    }
    for (uint64_t i = 0; i < started; i++) pthread_join(w[i].thread, NULL);
    double wall = now_s() - t0;

    uint64_t ok = 0, errors = 0, n_lat = 0;
    for (uint64_t i = 0; i < started; i++) {
        ok += w[i].ok;
        errors += w[i].errors;
        n_lat += w[i].n_lat;
    }
    double *lat = malloc((n_lat ? n_lat : 1) * sizeof(*lat));
    uint64_t at = 0;
    for (uint64_t i = 0; i < started && lat; i++) {
        memcpy(lat + at, w[i].lat_ms, w[i].n_lat * sizeof(*lat));
        at += w[i].n_lat;
    }
    if (lat) qsort(lat, n_lat, sizeof(*lat), cmp_double);
    double p50 = lat ? percentile(lat, n_lat, 50) : 0, p90 = lat ? percentile(lat, n_lat, 90) : 0;
    double p99 = lat ? percentile(lat, n_lat, 99) : 0;
    double max = lat && n_lat ? lat[n_lat - 1] : 0;
    double tok_s = wall > 0 ? (double)ok * sh.tokens / wall : 0;
    /* payload bytes of the answered requests: x, ids and weights out, y back */
    double bytes_out = (double)ok * sh.tokens * (m.hidden * 2.0 + m.topk * 8.0);
    double bytes_back = (double)ok * sh.tokens * m.hidden * 2.0;
    double req_s = wall > 0 ? (double)ok / wall : 0;

    /* errors by code over all workers */
    char codes[MAX_CODES][EPD_CLIENT_CODE_LEN] = {{0}};
    uint64_t counts[MAX_CODES] = {0};
    for (uint64_t i = 0; i < started; i++) {
        for (int k = 0; k < MAX_CODES && w[i].codes[k][0]; k++) {
            for (int j = 0; j < MAX_CODES; j++) {
                if (codes[j][0] == '\0') memcpy(codes[j], w[i].codes[k], sizeof(codes[j]));
                if (strcmp(codes[j], w[i].codes[k]) == 0) {
                    counts[j] += w[i].code_counts[k];
                    break;
                }
            }
        }
    }
    for (uint64_t i = 0; i < started; i++) {
        if (w[i].fatal) {
            fprintf(stderr, "epctl: connection %" PRIu64 ": %s\n", i, w[i].fatal_msg);
            if (w[i].fatal == EXIT_CONNECT || exit_code == 0) exit_code = w[i].fatal;
        }
    }
    if (exit_code == 0 && errors > 0) exit_code = EXIT_DAEMON;

    if (o->json) {
        printf("{\"sockets\":%d,\"connections\":%" PRIu64 ",\"pipeline\":%" PRIu64
               ",\"tokens_per_request\":%u,\"hidden\":%u,\"topk\":%u,\"num_experts\":%u,"
               "\"dispatch_dtype\":\"%s\",\"data\":\"%s\",\"requests_ok\":%" PRIu64
               ",\"errors\":%" PRIu64
               ",\"seconds\":%.6f,\"tokens_per_s\":%.3f,\"requests_per_s\":%.3f,"
               "\"latency_ms\":{\"p50\":%.4f,\"p90\":%.4f,\"p99\":%.4f,\"max\":%.4f},"
               "\"payload_bytes\":{\"sent\":%.0f,\"received\":%.0f},"
               "\"payload_gb_per_s\":{\"sent\":%.6f,\"received\":%.6f},"
               "\"errors_by_code\":{", o->n_sockets, conc, o->pipeline ? o->pipeline : 1,
               sh.tokens, m.hidden, m.topk, m.num_experts, m.dtype,
               o->data ? o->data : "payload", ok, errors, wall, tok_s,
               req_s, p50, p90, p99, max, bytes_out, bytes_back,
               wall > 0 ? bytes_out / wall / 1e9 : 0, wall > 0 ? bytes_back / wall / 1e9 : 0);
        for (int j = 0; j < MAX_CODES && codes[j][0]; j++) {
            printf("%s\"%s\":%" PRIu64, j ? "," : "", codes[j], counts[j]);
        }
        printf("}}\n");
    } else {
        printf("bench: %d socket%s, %" PRIu64 " connection%s, pipeline %" PRIu64
               ", %u tokens/request, H %u K %u E %u, dispatch %s, data %s\n", o->n_sockets,
               o->n_sockets > 1 ? "s" : "", conc, conc > 1 ? "s" : "",
               o->pipeline ? o->pipeline : 1, sh.tokens, m.hidden, m.topk, m.num_experts,
               m.dtype, o->data ? o->data : "payload");
        printf("requests: %" PRIu64 " ok, %" PRIu64 " errors in %.3f s\n", ok, errors, wall);
        printf("throughput: %.0f tokens/s, %.1f requests/s\n", tok_s, req_s);
        printf("payload: %.3f MB sent (%.3f GB/s), %.3f MB received (%.3f GB/s)\n",
               bytes_out / 1e6, wall > 0 ? bytes_out / wall / 1e9 : 0, bytes_back / 1e6,
               wall > 0 ? bytes_back / wall / 1e9 : 0);
        printf("latency ms: p50 %.3f  p90 %.3f  p99 %.3f  max %.3f\n", p50, p90, p99, max);
        for (int j = 0; j < MAX_CODES && codes[j][0]; j++) {
            printf("errors %s: %" PRIu64 "\n", codes[j], counts[j]);
        }
    }
    free(lat);
    for (uint64_t i = 0; i < started; i++) free(w[i].lat_ms);
    free(w);
    pthread_cond_destroy(&sh.cv);
    pthread_mutex_destroy(&sh.mu);
    return exit_code;
}

int main(int argc, char **argv)
{
    options_t o;
    int status;

    memset(&o, 0, sizeof(o));
    o.timeout_ms = 30000;
    o.spin_us = UINT64_MAX;
    status = parse_args(argc, argv, &o);
    if (status < 0) {
        if (strcmp(o.command, "submit") == 0) status = run_submit(&o);
        else if (strcmp(o.command, "bench") == 0) status = run_bench(&o);
        else status = run_control(&o);
    }
    for (int i = 0; i < o.n_lists; i++) free(o.socket_lists[i]);
    return status;
}
