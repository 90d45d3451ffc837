/* Loading a configuration: defaults, then the YAML file, legacy env aliases, canonical EPD_*
 * variables and --set, each overriding the one before (DESIGN.md section 6), with the origin of
 * every value, deprecation and unknown-variable warnings through a callback, and the checks that
 * involve two settings. Never prints. */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/parse.h"
#include "config/settings.h"

struct epd_config_state {
    epd_config_t cfg;
    size_t n_rows;
    epd_origin_t origins[]; /* one per table row (alias rows stay "default") */
};

/* One legacy variable found in the environment. */
typedef struct legacy_var {
    const epd_setting_t *row;
    const char *value;
    const char *mapped; /* the target's value it stands for */
} legacy_var_t;

typedef struct load_ctx {
    epd_config_state_t *state;
    const epd_config_sources_t *sources;
    legacy_var_t legacy[8];
    size_t n_legacy;
} load_ctx_t;

/* Sends one formatted warning to the caller's callback, if any. */
static void warn(const load_ctx_t *ctx, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void warn(const load_ctx_t *ctx, const char *fmt, ...)
{
    char message[2 * EPD_ERR_LEN];
    va_list ap;
    if (ctx->sources->warn == NULL) return;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    ctx->sources->warn(ctx->sources->warn_arg, message);
}

size_t epd_origin_format(const epd_origin_t *origin, char *buf, size_t len)
{
    int n;
    switch (origin->kind) {
    case EPD_ORIGIN_FILE: n = snprintf(buf, len, "%s", origin->where); break;
    case EPD_ORIGIN_ENV: n = snprintf(buf, len, "env %s", origin->where); break;
    case EPD_ORIGIN_LEGACY_ENV:
        n = snprintf(buf, len, "legacy env %s (deprecated)", origin->where);
        break;
    case EPD_ORIGIN_CLI: n = snprintf(buf, len, "cli"); break;
    case EPD_ORIGIN_DEFAULT:
    default: n = snprintf(buf, len, "default"); break;
    }
    return n < 0 ? 0 : (size_t)n;
}

/* How an error names where a value came from: "FILE:LINE", "env NAME", "--set". */
static void origin_for_error(epd_origin_kind_t kind, const char *where, char *buf, size_t len)
{
    switch (kind) {
    case EPD_ORIGIN_FILE: snprintf(buf, len, "%s", where); break;
    case EPD_ORIGIN_ENV:
    case EPD_ORIGIN_LEGACY_ENV: snprintf(buf, len, "env %s", where); break;
    case EPD_ORIGIN_CLI: snprintf(buf, len, "--set"); break;
    case EPD_ORIGIN_DEFAULT:
    default: snprintf(buf, len, "default"); break;
    }
}

/* Parses text into row's field and records its origin; an error names the origin, the key, the
 * problem and what is allowed. A NULL text is an empty value (YAML `key:`). */
static epd_status_t apply_value(epd_config_state_t *state, const epd_setting_t *row,
                                const char *text, epd_origin_kind_t kind, const char *where,
                                char err[EPD_ERR_LEN])
{
    char problem[EPD_ERR_LEN];
    bool ok;
    if (text == NULL && row->type == EPD_SETTING_UIDS) text = "";
    if (text == NULL) {
        epd_config_textf(problem, sizeof problem, "no value given");
        ok = false;
    } else {
        ok = epd_setting_parse(row, text, &state->cfg, problem);
    }
    if (!ok) {
        char from[EPD_ERR_LEN], allowed[EPD_ERR_LEN];
        origin_for_error(kind, where, from, sizeof from);
        epd_setting_allowed(row, allowed, sizeof allowed);
        epd_config_textf(err, EPD_ERR_LEN, "%s: %s: %s; allowed: %s", from, row->name, problem,
                         allowed);
        return EPD_ERR_CONFIG;
    }
    epd_origin_t *origin = &state->origins[row - epd_settings];
    origin->kind = kind;
    snprintf(origin->where, sizeof origin->where, "%s", where ? where : "");
    return EPD_OK;
}

void epd_config_defaults(epd_config_t *cfg)
{
    char problem[EPD_ERR_LEN];
    memset(cfg, 0, sizeof *cfg);
    for (const epd_setting_t *row = epd_settings; row->name != NULL; row++) {
        /* the defaults are valid by construction (the unit tests parse every one) */
        if (row->type != EPD_SETTING_ALIAS_BOOL)
            (void)epd_setting_parse(row, row->def, cfg, problem);
    }
}

/* YAML callback: one setting of the file at line. */
static epd_status_t apply_file_value(void *arg, const epd_setting_t *row, const char *text,
                                     unsigned long line, char err[EPD_ERR_LEN])
{
    load_ctx_t *ctx = arg;
    char where[EPD_CONFIG_STR_LEN];
    const char *file = ctx->sources->file;
    size_t flen = strlen(file);
    /* keep the line number when a long path would not fit: drop the path's head instead */
    if (flen > sizeof where - 32) file += flen - (sizeof where - 32);
    snprintf(where, sizeof where, "%s:%lu", file, line);
    return apply_value(ctx->state, row, text, EPD_ORIGIN_FILE, where, err);
}

static bool starts_with(const char *s, size_t len, const char *prefix)
{
    size_t n = strlen(prefix);
    return len >= n && strncmp(s, prefix, n) == 0;
}

/* True when an earlier envp entry has the same name (the first one wins, as with getenv). */
static bool env_seen_before(char *const *envp, size_t index, const char *name, size_t len)
{
    for (size_t i = 0; i < index; i++) {
        if (strncmp(envp[i], name, len) == 0 && envp[i][len] == '=') return true;
    }
    return false;
}

/* Legacy aliases: each must be a boolean, and aliases of one target must agree. */
static epd_status_t apply_legacy(load_ctx_t *ctx, char err[EPD_ERR_LEN])
{
    epd_status_t status;
    for (size_t i = 0; i < ctx->n_legacy; i++) {
        legacy_var_t *var = &ctx->legacy[i];
        bool b;
        char ignored[EPD_ERR_LEN];
        const epd_setting_t *target = epd_setting_by_name(var->row->target);
        if (target == NULL) {
            epd_config_textf(err, EPD_ERR_LEN, "alias %s points at no setting", var->row->env);
            return EPD_ERR_INTERNAL;
        }
        if (epd_parse_bool(var->value, &b, ignored) != EPD_OK) {
            epd_config_textf(
                err, EPD_ERR_LEN,
                "env %s: '%.40s' is not a boolean; allowed: 1/0, true/false, yes/no, on/off "
                "(any case); it is deprecated, use %s",
                var->row->env, var->value, target->env);
            return EPD_ERR_CONFIG;
        }
        var->mapped = b ? var->row->if_true : var->row->if_false;
        for (size_t j = 0; j < i; j++) {
            const legacy_var_t *other = &ctx->legacy[j];
            if (strcmp(other->row->target, var->row->target) != 0) continue;
            if (strcmp(other->mapped, var->mapped) != 0) {
                epd_config_textf(
                    err, EPD_ERR_LEN,
                    "env %s=%.20s (%s = %s) and env %s=%.20s (%s = %s) disagree; unset one "
                    "of them (both are deprecated, use %s)",
                    other->row->env, other->value, other->row->target, other->mapped, var->row->env,
                    var->value, var->row->target, var->mapped, target->env);
                return EPD_ERR_CONFIG;
            }
        }
        CHECK_GOTO(
            apply_value(ctx->state, target, var->mapped, EPD_ORIGIN_LEGACY_ENV, var->row->env, err),
            out);
    }
    status = EPD_OK;
out:
    return status;
}

/* Walks envp: collects legacy aliases, applies canonical EPD_* variables after them, and warns
 * about EPD_* variables that are no setting (except EPD_TEST_* and EPD_BENCH_*, used by tests). */
static epd_status_t apply_env(load_ctx_t *ctx, char err[EPD_ERR_LEN])
{
    epd_status_t status = EPD_OK;
    char *const *envp = ctx->sources->envp;
    if (envp == NULL) return EPD_OK;
    for (size_t i = 0; envp[i] != NULL; i++) {
        const char *eq = strchr(envp[i], '=');
        if (eq == NULL) continue;
        size_t len = (size_t)(eq - envp[i]);
        const epd_setting_t *row = epd_setting_by_env_n(envp[i], len);
        if (row == NULL || row->type != EPD_SETTING_ALIAS_BOOL) continue;
        if (env_seen_before(envp, i, envp[i], len)) continue;
        if (ctx->n_legacy == EPD_ARRAY_SIZE(ctx->legacy)) break;
        ctx->legacy[ctx->n_legacy++] = (legacy_var_t){.row = row, .value = eq + 1};
    }
    CHECK_GOTO(apply_legacy(ctx, err), out);

    for (size_t i = 0; envp[i] != NULL; i++) {
        const char *eq = strchr(envp[i], '=');
        if (eq == NULL) continue;
        size_t len = (size_t)(eq - envp[i]);
        if (!starts_with(envp[i], len, "EPD_")) continue;
        if (env_seen_before(envp, i, envp[i], len)) continue;
        const epd_setting_t *row = epd_setting_by_env_n(envp[i], len);
        if (row != NULL && row->type != EPD_SETTING_ALIAS_BOOL) {
            char name[EPD_CONFIG_STR_LEN];
            snprintf(name, sizeof name, "%.*s", (int)len, envp[i]);
            CHECK_GOTO(apply_value(ctx->state, row, eq + 1, EPD_ORIGIN_ENV, name, err), out);
            continue;
        }
        /* not settings: the tests' and benches' own, and the request trace (daemon/trace.h) */
        if (starts_with(envp[i], len, "EPD_TEST_") || starts_with(envp[i], len, "EPD_BENCH_") ||
            (len == 9 && memcmp(envp[i], "EPD_TRACE", 9) == 0) ||
            (len == 15 && memcmp(envp[i], "EPD_TRACE_TIMES", 15) == 0)) {
            continue;
        }
        char name[EPD_CONFIG_STR_LEN];
        snprintf(name, sizeof name, "%.*s", (int)(len < 128 ? len : 128), envp[i]);
        const epd_setting_t *near = epd_setting_closest(name, true);
        if (near != NULL) {
            warn(ctx,
                 "unknown environment variable %s ignored: no epd setting has it (did you "
                 "mean %s?)",
                 name, near->env);
        } else {
            warn(ctx,
                 "unknown environment variable %s ignored: no epd setting has it (see "
                 "epd --help)",
                 name);
        }
    }
out:
    return status;
}

/* --set KEY=VALUE, in order (a later one wins). */
static epd_status_t apply_sets(load_ctx_t *ctx, char err[EPD_ERR_LEN])
{
    epd_status_t status = EPD_OK;
    for (size_t i = 0; i < ctx->sources->n_sets; i++) {
        const char *set = ctx->sources->sets[i];
        const char *eq = set ? strchr(set, '=') : NULL;
        if (eq == NULL) {
            epd_config_textf(err, EPD_ERR_LEN,
                             "--set '%.64s': expected KEY=VALUE, e.g. "
                             "--set dispatch.dtype=bf16",
                             set ? set : "");
            return EPD_ERR_CONFIG;
        }
        const char *key = set;
        const char *key_end = eq;
        while (key < key_end && (*key == ' ' || *key == '\t')) key++;
        while (key_end > key && (key_end[-1] == ' ' || key_end[-1] == '\t')) key_end--;
        char name[EPD_CONFIG_STR_LEN];
        snprintf(name, sizeof name, "%.*s", (int)(key_end - key < 128 ? key_end - key : 128), key);
        const epd_setting_t *row = epd_setting_by_name(name);
        if (row == NULL) {
            const epd_setting_t *near = epd_setting_closest(name, false);
            if (near != NULL) {
                epd_config_textf(err, EPD_ERR_LEN,
                                 "--set '%.80s': unknown setting '%s' (did you mean "
                                 "%s?)",
                                 set, name, near->name);
            } else {
                epd_config_textf(err, EPD_ERR_LEN,
                                 "--set '%.80s': unknown setting '%s' (epd --help "
                                 "lists them)",
                                 set, name);
            }
            return EPD_ERR_CONFIG;
        }
        CHECK_GOTO(apply_value(ctx->state, row, eq + 1, EPD_ORIGIN_CLI, name, err), out);
    }
out:
    return status;
}

/* After every source: one deprecation warning per legacy variable found, naming the canonical
 * variable, and saying so when a higher source overrode it. */
static void warn_legacy(const load_ctx_t *ctx)
{
    for (size_t i = 0; i < ctx->n_legacy; i++) {
        const legacy_var_t *var = &ctx->legacy[i];
        const epd_setting_t *target = epd_setting_by_name(var->row->target);
        const epd_origin_t *origin = &ctx->state->origins[target - epd_settings];
        char value[EPD_CONFIG_STR_LEN];
        epd_setting_format(target, &ctx->state->cfg, value, sizeof value);
        if (origin->kind == EPD_ORIGIN_LEGACY_ENV) {
            warn(ctx, "%s is deprecated; use %s=%s instead", var->row->env, target->env,
                 var->mapped);
        } else {
            char from[EPD_ERR_LEN];
            origin_for_error(origin->kind, origin->where, from, sizeof from);
            if (origin->kind == EPD_ORIGIN_CLI)
                snprintf(from, sizeof from, "--set %s", target->name);
            warn(ctx, "%s is deprecated and was overridden by %s (%s = %s); use %s instead",
                 var->row->env, from, target->name, value, target->env);
        }
    }
}

/* "key = value (origin)" of one setting, for errors that involve two settings. */
static void describe(const epd_config_state_t *state, const char *key, char *buf, size_t len)
{
    const epd_setting_t *row = epd_setting_by_name(key);
    char value[64], origin[EPD_ERR_LEN];
    epd_setting_format(row, &state->cfg, value, sizeof value);
    epd_origin_format(&state->origins[row - epd_settings], origin, sizeof origin);
    epd_config_textf(buf, len, "%s = %s (%s)", key, value, origin);
}

/* Checks that involve two or more settings. */
static epd_status_t check_combinations(const epd_config_state_t *state, char err[EPD_ERR_LEN])
{
    const epd_config_t *cfg = &state->cfg;
    char a[EPD_ERR_LEN], b[EPD_ERR_LEN];
    /* pairs of settings where the first must not exceed the second */
    const struct {
        const char *larger, *smaller, *allowed;
        uint64_t larger_value, smaller_value;
    } pairs[] = {
        {"model.topk", "model.num_experts", "topk <= num_experts", cfg->model.topk,
         cfg->model.num_experts},
        {"dispatch.max_tokens_per_request", "dispatch.max_queued_tokens",
         "a request fits in the queue", cfg->dispatch.max_tokens_per_request,
         cfg->dispatch.max_queued_tokens},
        {"dispatch.max_tokens_per_request", "dispatch.max_tokens_per_step",
         "a request fits in one step", cfg->dispatch.max_tokens_per_request,
         cfg->dispatch.max_tokens_per_step},
        {"socket.max_frame_bytes", "socket.max_buffered_bytes",
         "a largest frame fits in the buffer budget", cfg->socket.max_frame_bytes,
         cfg->socket.max_buffered_bytes},
    };
    for (size_t i = 0; i < EPD_ARRAY_SIZE(pairs); i++) {
        if (pairs[i].larger_value <= pairs[i].smaller_value) continue;
        describe(state, pairs[i].larger, a, sizeof a);
        describe(state, pairs[i].smaller, b, sizeof b);
        epd_config_textf(err, EPD_ERR_LEN, "%s is larger than %s; allowed: %s", a, b,
                         pairs[i].allowed);
        return EPD_ERR_CONFIG;
    }
    /* the ffn experts' settings take effect with experts.kind = ffn only */
    if (cfg->experts.kind != EPD_EXPERTS_FFN) {
        const char *ffn_only[] = {"experts.weights", "experts.layers", "model.intermediate"};
        bool set[] = {cfg->experts.weights[0] != '\0', cfg->experts.layers[0] != '\0',
                      cfg->model.intermediate != 0};
        for (size_t i = 0; i < EPD_ARRAY_SIZE(ffn_only); i++) {
            if (!set[i]) continue;
            describe(state, ffn_only[i], a, sizeof a);
            describe(state, "experts.kind", b, sizeof b);
            epd_config_textf(err, EPD_ERR_LEN, "%s is set but %s does not use it; allowed: "
                             "only with experts.kind = ffn", a, b);
            return EPD_ERR_CONFIG;
        }
    }
    /* the external experts' settings take effect with experts.kind = external only */
    if (cfg->experts.kind != EPD_EXPERTS_EXTERNAL) {
        const char *external_only[] = {"experts.external_input", "experts.external_layout",
                                       "experts.external_capacity",
                                       "experts.external_timeout_ms"};
        for (size_t i = 0; i < EPD_ARRAY_SIZE(external_only); i++) {
            const epd_setting_t *row = epd_setting_by_name(external_only[i]);
            if (state->origins[row - epd_settings].kind == EPD_ORIGIN_DEFAULT) continue;
            describe(state, external_only[i], a, sizeof a);
            describe(state, "experts.kind", b, sizeof b);
            epd_config_textf(err, EPD_ERR_LEN, "%s is set but %s does not use it; allowed: "
                             "only with experts.kind = external", a, b);
            return EPD_ERR_CONFIG;
        }
    } else if ((cfg->experts.external_layout == EPD_EXTERNAL_MASKED) !=
               (cfg->experts.external_capacity > 0)) {
        describe(state, "experts.external_layout", a, sizeof a);
        describe(state, "experts.external_capacity", b, sizeof b);
        epd_config_textf(err, EPD_ERR_LEN, "%s does not fit %s; allowed: masked with a capacity "
                         "> 0, packed with 0", a, b);
        return EPD_ERR_CONFIG;
    }
    /* An idle daemon's agreement may wait out the other ranks' back-off: not a stall. */
    if ((uint64_t)cfg->dispatch.stall_warn_ms * 1000 <= cfg->dispatch.idle_backoff_us) {
        describe(state, "dispatch.stall_warn_ms", a, sizeof a);
        describe(state, "dispatch.idle_backoff_us", b, sizeof b);
        epd_config_textf(err, EPD_ERR_LEN, "%s is not longer than %s; allowed: stall_warn_ms * "
                         "1000 > idle_backoff_us", a, b);
        return EPD_ERR_CONFIG;
    }
    if (cfg->dispatch.step_timeout_ms != 0 &&
        cfg->dispatch.step_timeout_ms <= cfg->dispatch.stall_warn_ms) {
        describe(state, "dispatch.step_timeout_ms", a, sizeof a);
        describe(state, "dispatch.stall_warn_ms", b, sizeof b);
        epd_config_textf(err, EPD_ERR_LEN, "%s is not longer than %s; allowed: 0 (never) or "
                         "step_timeout_ms > stall_warn_ms", a, b);
        return EPD_ERR_CONFIG;
    }
    /* a SUBMIT payload: x bf16 [N,H], topk_ids i32 [N,K], topk_weights f32 [N,K] */
    uint64_t n = cfg->dispatch.max_tokens_per_request;
    uint64_t need = n * (2 * (uint64_t)cfg->model.hidden + 8 * (uint64_t)cfg->model.topk);
    if (cfg->socket.max_frame_bytes < need) {
        describe(state, "socket.max_frame_bytes", a, sizeof a);
        describe(state, "dispatch.max_tokens_per_request", b, sizeof b);
        epd_config_textf(err, EPD_ERR_LEN,
                         "%s cannot hold a request of %s tokens: N*(2H+8K) = %" PRIu64
                         " bytes with H = %" PRIu32 ", K = %" PRIu32,
                         a, b, need, cfg->model.hidden, cfg->model.topk);
        return EPD_ERR_CONFIG;
    }
    return EPD_OK;
}

epd_status_t epd_config_load(const epd_config_sources_t *sources, epd_config_state_t **state_p,
                             char err[EPD_ERR_LEN])
{
    epd_status_t status;
    static const epd_config_sources_t none = {0};
    size_t rows = epd_settings_rows();
    *state_p = NULL;
    epd_config_state_t *state = calloc(1, sizeof *state + rows * sizeof state->origins[0]);
    if (state == NULL) {
        epd_config_textf(err, EPD_ERR_LEN, "out of memory loading the configuration");
        return EPD_ERR_NO_MEMORY;
    }
    state->n_rows = rows;
    epd_config_defaults(&state->cfg);
    load_ctx_t ctx = {.state = state, .sources = sources ? sources : &none};

    if (ctx.sources->file != NULL) {
        CHECK_GOTO(epd_config_yaml_read(ctx.sources->file, apply_file_value, &ctx, err),
                   err_free_state);
    }
    CHECK_GOTO(apply_env(&ctx, err), err_free_state);
    CHECK_GOTO(apply_sets(&ctx, err), err_free_state);
    warn_legacy(&ctx);
    CHECK_GOTO(check_combinations(state, err), err_free_state);
    *state_p = state;
    return EPD_OK;

err_free_state:
    free(state);
    /* every failure here is a configuration problem the caller reports the same way */
    return status == EPD_ERR_NO_MEMORY ? status : EPD_ERR_CONFIG;
}

void epd_config_state_free(epd_config_state_t *state)
{
    free(state);
}

const epd_config_t *epd_config_get(const epd_config_state_t *state)
{
    return &state->cfg;
}

const epd_origin_t *epd_config_origin(const epd_config_state_t *state, const char *key)
{
    const epd_setting_t *row = epd_setting_by_name(key);
    return row == NULL ? NULL : &state->origins[row - epd_settings];
}

epd_status_t epd_config_expand_path(const char *pattern, int rank, int local_rank,
                                    const char *hostname, char *out, size_t len,
                                    char err[EPD_ERR_LEN])
{
    size_t used = 0;
    for (const char *p = pattern; *p != '\0'; p++) {
        char piece[EPD_CONFIG_STR_LEN];
        if (*p != '%') {
            piece[0] = *p;
            piece[1] = '\0';
        } else {
            p++;
            switch (*p) {
            case 'r': snprintf(piece, sizeof piece, "%d", rank); break;
            case 'l': snprintf(piece, sizeof piece, "%d", local_rank); break;
            case 'h': {
                const char *host = hostname ? hostname : "";
                size_t n = strcspn(host, ".");
                snprintf(piece, sizeof piece, "%.*s", (int)(n < 128 ? n : 128), host);
                break;
            }
            case '%': snprintf(piece, sizeof piece, "%%"); break;
            default:
                epd_config_textf(err, EPD_ERR_LEN,
                                 "socket path '%.64s' has an unknown '%%%c' sequence "
                                 "(allowed: %%r, %%l, %%h, %%%%)",
                                 pattern, *p ? *p : ' ');
                return EPD_ERR_INVALID_ARG;
            }
        }
        size_t n = strlen(piece);
        if (used + n >= len) {
            epd_config_textf(err, EPD_ERR_LEN, "socket path '%.64s' expands to more than %zu bytes",
                             pattern, len == 0 ? 0 : len - 1);
            return EPD_ERR_INVALID_ARG;
        }
        memcpy(out + used, piece, n + 1);
        used += n;
    }
    if (len == 0) {
        epd_config_textf(err, EPD_ERR_LEN, "no room for the socket path");
        return EPD_ERR_INVALID_ARG;
    }
    out[used] = '\0';
    return EPD_OK;
}
