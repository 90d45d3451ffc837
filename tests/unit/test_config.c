/* Unit tests of config/: the settings table and its defaults, YAML loading with line numbers,
 * environment and legacy aliases, --set, precedence and origins, rejection of bad input, the
 * cross-field checks, printing, JSON, the fingerprint and the command line. Environments are
 * explicit envp arrays; the process environment is never read. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/parse.h"
#include "config/config.h"
#include "config/settings.h"

/* ---- helpers ---- */

typedef struct warnings {
    char messages[16][2 * EPD_ERR_LEN];
    size_t n;
} warnings_t;

static void collect_warning(void *arg, const char *message)
{
    warnings_t *w = arg;
    assert_true(w->n < EPD_ARRAY_SIZE(w->messages));
    snprintf(w->messages[w->n++], sizeof w->messages[0], "%s", message);
}

/* Number of warnings that contain needle. */
static size_t warnings_with(const warnings_t *w, const char *needle)
{
    size_t n = 0;
    for (size_t i = 0; i < w->n; i++) n += strstr(w->messages[i], needle) != NULL;
    return n;
}

/* Writes text to a fresh temporary file; its name goes to path (free with unlink). */
static void write_yaml(const char *text, char path[64])
{
    snprintf(path, 64, "/tmp/epd_test_config_XXXXXX");
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    size_t len = strlen(text);
    assert_int_equal(write(fd, text, len), (ssize_t)len);
    close(fd);
}

typedef struct load_args {
    const char *yaml;   /* file contents, or NULL for no file */
    const char *file;   /* an explicit file name instead of yaml */
    char *const *envp;
    const char *const *sets;
    size_t n_sets;
} load_args_t;

/* Loads with the given sources; returns the status, the state (or NULL), warnings and the file
 * name used (for messages that name it). */
static epd_status_t load(const load_args_t *a, epd_config_state_t **state_p, warnings_t *w,
                         char err[EPD_ERR_LEN], char path[64])
{
    char local_path[64] = "";
    if (path == NULL) path = local_path;
    path[0] = '\0';
    if (a->yaml != NULL) write_yaml(a->yaml, path);
    memset(w, 0, sizeof *w);
    err[0] = '\0';
    epd_config_sources_t src = {
        .file = a->yaml != NULL ? path : a->file,
        .envp = a->envp,
        .sets = a->sets,
        .n_sets = a->n_sets,
        .warn = collect_warning,
        .warn_arg = w,
    };
    epd_status_t status = epd_config_load(&src, state_p, err);
    if (a->yaml != NULL) unlink(path);
    if (status != EPD_OK) assert_null(*state_p);
    return status;
}

/* Loads a YAML text that must fail; checks the message names FILE:line and each needle. */
static void expect_yaml_error(const char *yaml, unsigned line, const char *needle1,
                              const char *needle2)
{
    epd_config_state_t *state = NULL;
    warnings_t w;
    char err[EPD_ERR_LEN], path[64], where[96];
    load_args_t a = {.yaml = yaml};
    assert_int_equal(load(&a, &state, &w, err, path), EPD_ERR_CONFIG);
    snprintf(where, sizeof where, "%s:%u", path, line);
    if (strstr(err, where) == NULL) fail_msg("'%s' does not name %s", err, where);
    if (needle1 && strstr(err, needle1) == NULL) fail_msg("'%s' lacks '%s'", err, needle1);
    if (needle2 && strstr(err, needle2) == NULL) fail_msg("'%s' lacks '%s'", err, needle2);
}

/* Loads with an environment that must fail; checks the message holds each needle. */
static void expect_env_error(char *const *envp, const char *needle1, const char *needle2)
{
    epd_config_state_t *state = NULL;
    warnings_t w;
    char err[EPD_ERR_LEN];
    load_args_t a = {.envp = envp};
    assert_int_equal(load(&a, &state, &w, err, NULL), EPD_ERR_CONFIG);
    if (needle1 && strstr(err, needle1) == NULL) fail_msg("'%s' lacks '%s'", err, needle1);
    if (needle2 && strstr(err, needle2) == NULL) fail_msg("'%s' lacks '%s'", err, needle2);
}

static void expect_set_error(const char *set, const char *needle1, const char *needle2)
{
    epd_config_state_t *state = NULL;
    warnings_t w;
    char err[EPD_ERR_LEN];
    const char *sets[] = {set};
    load_args_t a = {.sets = sets, .n_sets = 1};
    assert_int_equal(load(&a, &state, &w, err, NULL), EPD_ERR_CONFIG);
    if (needle1 && strstr(err, needle1) == NULL) fail_msg("'%s' lacks '%s'", err, needle1);
    if (needle2 && strstr(err, needle2) == NULL) fail_msg("'%s' lacks '%s'", err, needle2);
}

/* The --print-config line of one key. */
static void print_line(const epd_config_state_t *state, const char *key, char *line, size_t len)
{
    char *text = NULL;
    size_t size = 0;
    FILE *out = open_memstream(&text, &size);
    assert_non_null(out);
    epd_config_print(state, out);
    fclose(out);
    line[0] = '\0';
    size_t klen = strlen(key);
    for (char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
        if (strncmp(p, key, klen) == 0 && p[klen] == ' ') {
            size_t n = strcspn(p, "\n");
            snprintf(line, len, "%.*s", (int)n, p);
        }
    }
    free(text);
}

static void assert_origin(const epd_config_state_t *state, const char *key,
                          epd_origin_kind_t kind, const char *where)
{
    const epd_origin_t *origin = epd_config_origin(state, key);
    assert_non_null(origin);
    assert_int_equal(origin->kind, kind);
    if (where != NULL) assert_string_equal(origin->where, where);
}

/* ---- the table and defaults ---- */

static void test_config__defaults__match_the_design(void **state)
{
    (void)state;
    epd_config_t cfg;
    epd_config_defaults(&cfg);
    assert_string_equal(cfg.socket.path, "/run/epd/epd-%r.sock");
    assert_int_equal(cfg.socket.mode, 0660);
    assert_int_equal(cfg.socket.max_frame_bytes, 268435456);
    assert_int_equal(cfg.socket.max_clients, 1024);
    assert_int_equal(cfg.socket.max_output_bytes, 268435456);
    assert_int_equal(cfg.socket.n_allow_uids, 0);
    assert_int_equal(cfg.model.hidden, 7168);
    assert_int_equal(cfg.model.num_experts, 256);
    assert_int_equal(cfg.model.topk, 8);
    assert_int_equal(cfg.dispatch.dtype, EPD_WIRE_FP8);
    assert_int_equal(cfg.dispatch.scale, EPD_SCALE_GROUP128);
    assert_int_equal(cfg.dispatch.scale_format, EPD_SCALE_FMT_FP32);
    assert_int_equal(cfg.dispatch.max_tokens_per_step, 4096);
    assert_int_equal(cfg.dispatch.max_tokens_per_request, 4096);
    assert_int_equal(cfg.dispatch.max_queued_tokens, 65536);
    assert_int_equal(cfg.dispatch.transport, EPD_TRANSPORT_AUTO);
    assert_int_equal(cfg.dispatch.mpi_cuda_aware, EPD_TRISTATE_AUTO);
    assert_int_equal(cfg.dispatch.idle_backoff_us, 1000);
    assert_int_equal(cfg.experts.kind, EPD_EXPERTS_SCALE);
    assert_int_equal(cfg.device.backend, EPD_BACKEND_AUTO);
    assert_int_equal(cfg.device.id, -1);
    assert_int_equal(cfg.log.level, EPD_LOG_INFO);
}

static void test_config__table__every_row_is_well_formed(void **state)
{
    (void)state;
    char problem[EPD_ERR_LEN];
    size_t settings = 0, aliases = 0;
    for (const epd_setting_t *row = epd_settings; row->name != NULL; row++) {
        assert_non_null(row->env);
        assert_non_null(row->doc);
        if (row->type == EPD_SETTING_ALIAS_BOOL) {
            aliases++;
            assert_non_null(epd_setting_by_name(row->target));
            assert_non_null(row->note);
            assert_ptr_equal(epd_setting_by_env(row->env), row);
            continue;
        }
        settings++;
        /* env name is EPD_ + the dotted name upper-cased with '.' -> '_' */
        char env[EPD_CONFIG_STR_LEN] = "EPD_";
        for (size_t i = 0; row->name[i]; i++) {
            char c = row->name[i];
            env[4 + i] = c == '.' ? '_' : (char)(c >= 'a' && c <= 'z' ? c - 'a' + 'A' : c);
            env[5 + i] = '\0';
        }
        assert_string_equal(row->env, env);
        assert_ptr_equal(epd_setting_by_name(row->name), row);
        assert_ptr_equal(epd_setting_by_env(row->env), row);
        epd_config_t cfg;
        memset(&cfg, 0, sizeof cfg);
        if (!epd_setting_parse(row, row->def, &cfg, problem)) {
            fail_msg("default of %s does not parse: %s", row->name, problem);
        }
        /* formatting the default gives back the default text */
        char text[EPD_CONFIG_STR_LEN];
        epd_setting_format(row, &cfg, text, sizeof text);
        assert_string_equal(text, row->def);
    }
    /* the rows were each checked above; the counts guard against rows lost from the table (new
     * settings only add to them) */
    assert_true(settings >= 24);
    assert_int_equal(aliases, 2);
    assert_int_equal(epd_settings_rows(), settings + aliases);
    assert_null(epd_setting_by_name("SGLANG_DEEPEP_BF16_DISPATCH"));
    assert_null(epd_setting_by_name("socket"));
}

static void test_config__no_sources__all_defaults(void **state)
{
    (void)state;
    epd_config_state_t *st = NULL;
    char err[EPD_ERR_LEN];
    assert_int_equal(epd_config_load(NULL, &st, err), EPD_OK);
    epd_config_t def;
    epd_config_defaults(&def);
    assert_memory_equal(epd_config_get(st), &def, sizeof def);
    for (const epd_setting_t *row = epd_settings; row->name != NULL; row++) {
        if (row->type == EPD_SETTING_ALIAS_BOOL) continue;
        assert_origin(st, row->name, EPD_ORIGIN_DEFAULT, "");
    }
    assert_null(epd_config_origin(st, "no.such"));
    epd_config_state_free(st);
}

/* ---- precedence ---- */

static void test_config__precedence__five_levels_in_order(void **state)
{
    (void)state;
    epd_config_state_t *st = NULL;
    warnings_t w;
    char err[EPD_ERR_LEN], path[64], where[96];
    const char *yaml = "# comment\ndispatch:\n  dtype: bf16\n";

    load_args_t a = {0};
    assert_int_equal(load(&a, &st, &w, err, path), EPD_OK);
    assert_int_equal(epd_config_get(st)->dispatch.dtype, EPD_WIRE_FP8);
    assert_origin(st, "dispatch.dtype", EPD_ORIGIN_DEFAULT, NULL);
    epd_config_state_free(st);

    a.yaml = yaml; /* file beats default */
    assert_int_equal(load(&a, &st, &w, err, path), EPD_OK);
    assert_int_equal(epd_config_get(st)->dispatch.dtype, EPD_WIRE_BF16);
    snprintf(where, sizeof where, "%s:3", path);
    assert_origin(st, "dispatch.dtype", EPD_ORIGIN_FILE, where);
    epd_config_state_free(st);

    char *legacy[] = {"SGLANG_DEEPEP_BF16_DISPATCH=0", NULL}; /* legacy env beats file */
    a.envp = legacy;
    assert_int_equal(load(&a, &st, &w, err, path), EPD_OK);
    assert_int_equal(epd_config_get(st)->dispatch.dtype, EPD_WIRE_FP8);
    assert_origin(st, "dispatch.dtype", EPD_ORIGIN_LEGACY_ENV, "SGLANG_DEEPEP_BF16_DISPATCH");
    epd_config_state_free(st);

    /* canonical env beats legacy env, wherever it sits in envp */
    char *canonical[] = {"EPD_DISPATCH_DTYPE=bf16", "SGLANG_DEEPEP_BF16_DISPATCH=0", NULL};
    a.envp = canonical;
    assert_int_equal(load(&a, &st, &w, err, path), EPD_OK);
    assert_int_equal(epd_config_get(st)->dispatch.dtype, EPD_WIRE_BF16);
    assert_origin(st, "dispatch.dtype", EPD_ORIGIN_ENV, "EPD_DISPATCH_DTYPE");
    epd_config_state_free(st);

    const char *sets[] = {"dispatch.dtype=bf16", "dispatch.dtype=fp8"}; /* --set beats env */
    a.sets = sets;
    a.n_sets = 2;
    assert_int_equal(load(&a, &st, &w, err, path), EPD_OK);
    assert_int_equal(epd_config_get(st)->dispatch.dtype, EPD_WIRE_FP8); /* the later --set */
    assert_origin(st, "dispatch.dtype", EPD_ORIGIN_CLI, NULL);
    char line[512];
    print_line(st, "dispatch.dtype", line, sizeof line);
    assert_string_equal(line, "dispatch.dtype = fp8  # cli");
    epd_config_state_free(st);
}

static void test_config__precedence__per_key_independent(void **state)
{
    (void)state;
    epd_config_state_t *st = NULL;
    warnings_t w;
    char err[EPD_ERR_LEN], path[64], where[96];
    load_args_t a = {.yaml = "model:\n  hidden: 256\n  num_experts: 16\n  topk: 2\n"};
    char *envp[] = {"HOME=/root", "EPD_MODEL_NUM_EXPERTS=32", "EPD_MODEL_TOPK=4", NULL};
    const char *sets[] = {"model.topk=6"};
    a.envp = envp;
    a.sets = sets;
    a.n_sets = 1;
    assert_int_equal(load(&a, &st, &w, err, path), EPD_OK);
    const epd_config_t *cfg = epd_config_get(st);
    assert_int_equal(cfg->model.hidden, 256);
    assert_int_equal(cfg->model.num_experts, 32);
    assert_int_equal(cfg->model.topk, 6);
    snprintf(where, sizeof where, "%s:2", path);
    assert_origin(st, "model.hidden", EPD_ORIGIN_FILE, where);
    assert_origin(st, "model.num_experts", EPD_ORIGIN_ENV, "EPD_MODEL_NUM_EXPERTS");
    assert_origin(st, "model.topk", EPD_ORIGIN_CLI, NULL);
    assert_origin(st, "log.level", EPD_ORIGIN_DEFAULT, NULL);
    assert_int_equal(w.n, 0);
    epd_config_state_free(st);
}

static void test_config__env__first_occurrence_wins(void **state)
{
    (void)state;
    epd_config_state_t *st = NULL;
    warnings_t w;
    char err[EPD_ERR_LEN];
    char *envp[] = {"EPD_LOG_LEVEL=debug", "NOEQUALS", "EPD_LOG_LEVEL=error", "EPD_BOGUS=1",
                    "EPD_BOGUS=2", NULL};
    load_args_t a = {.envp = envp};
    assert_int_equal(load(&a, &st, &w, err, NULL), EPD_OK);
    assert_int_equal(epd_config_get(st)->log.level, EPD_LOG_DEBUG);
    assert_int_equal(warnings_with(&w, "EPD_BOGUS"), 1);
    epd_config_state_free(st);
}

/* ---- legacy aliases ---- */

static void test_config__legacy__both_spellings_every_boolean(void **state)
{
    (void)state;
    const char *names[] = {"SGLANG_DEEPEP_BF16_DISPATCH", "SGLANG_DEEPEP_NORMAL_BF16_DISPATCH"};
    const char *yes[] = {"1", "true", "TRUE", "True", "yes", "YES", "Yes", "on", "ON", "oN"};
    const char *no[] = {"0", "false", "FALSE", "False", "no", "NO", "nO", "off", "OFF", "Off"};
    for (size_t n = 0; n < 2; n++) {
        for (size_t i = 0; i < EPD_ARRAY_SIZE(yes); i++) {
            for (int truth = 0; truth < 2; truth++) {
                char var[96];
                snprintf(var, sizeof var, "%s=%s", names[n], truth ? yes[i] : no[i]);
                char *envp[] = {var, NULL};
                epd_config_state_t *st = NULL;
                warnings_t w;
                char err[EPD_ERR_LEN];
                load_args_t a = {.envp = envp};
                if (load(&a, &st, &w, err, NULL) != EPD_OK) fail_msg("%s: %s", var, err);
                assert_int_equal(epd_config_get(st)->dispatch.dtype,
                                 truth ? EPD_WIRE_BF16 : EPD_WIRE_FP8);
                assert_origin(st, "dispatch.dtype", EPD_ORIGIN_LEGACY_ENV, names[n]);
                assert_int_equal(w.n, 1);
                assert_non_null(strstr(w.messages[0], names[n]));
                assert_non_null(strstr(w.messages[0], "deprecated"));
                assert_non_null(strstr(w.messages[0], "EPD_DISPATCH_DTYPE"));
                char line[512], want[512];
                print_line(st, "dispatch.dtype", line, sizeof line);
                snprintf(want, sizeof want, "dispatch.dtype = %s  # legacy env %s (deprecated)",
                         truth ? "bf16" : "fp8", names[n]);
                assert_string_equal(line, want);
                epd_config_state_free(st);
            }
        }
    }
}

static void test_config__legacy__bad_value__error_names_variable(void **state)
{
    (void)state;
    char *envp1[] = {"SGLANG_DEEPEP_BF16_DISPATCH=maybe", NULL};
    expect_env_error(envp1, "SGLANG_DEEPEP_BF16_DISPATCH", "yes/no");
    char *envp2[] = {"SGLANG_DEEPEP_NORMAL_BF16_DISPATCH=", NULL};
    expect_env_error(envp2, "SGLANG_DEEPEP_NORMAL_BF16_DISPATCH", "not a boolean");
    char *envp3[] = {"SGLANG_DEEPEP_NORMAL_BF16_DISPATCH=2", NULL};
    expect_env_error(envp3, "SGLANG_DEEPEP_NORMAL_BF16_DISPATCH", "'2'");
}

static void test_config__legacy__conflicting_aliases__error_names_both(void **state)
{
    (void)state;
    char *envp[] = {"SGLANG_DEEPEP_BF16_DISPATCH=1", "SGLANG_DEEPEP_NORMAL_BF16_DISPATCH=0", NULL};
    expect_env_error(envp, "SGLANG_DEEPEP_BF16_DISPATCH=1", "SGLANG_DEEPEP_NORMAL_BF16_DISPATCH=0");
    /* still an error when the canonical variable is set too: nothing is guessed */
    char *envp2[] = {"SGLANG_DEEPEP_NORMAL_BF16_DISPATCH=yes", "EPD_DISPATCH_DTYPE=fp8",
                     "SGLANG_DEEPEP_BF16_DISPATCH=off", NULL};
    expect_env_error(envp2, "SGLANG_DEEPEP_BF16_DISPATCH", "SGLANG_DEEPEP_NORMAL_BF16_DISPATCH");
}

static void test_config__legacy__agreeing_aliases__one_warning_each(void **state)
{
    (void)state;
    epd_config_state_t *st = NULL;
    warnings_t w;
    char err[EPD_ERR_LEN];
    char *envp[] = {"SGLANG_DEEPEP_BF16_DISPATCH=true", "SGLANG_DEEPEP_NORMAL_BF16_DISPATCH=1",
                    NULL};
    load_args_t a = {.envp = envp};
    assert_int_equal(load(&a, &st, &w, err, NULL), EPD_OK);
    assert_int_equal(epd_config_get(st)->dispatch.dtype, EPD_WIRE_BF16);
    assert_int_equal(w.n, 2);
    assert_int_equal(warnings_with(&w, "SGLANG_DEEPEP_BF16_DISPATCH is deprecated"), 1);
    assert_int_equal(warnings_with(&w, "SGLANG_DEEPEP_NORMAL_BF16_DISPATCH is deprecated"), 1);
    assert_int_equal(warnings_with(&w, "EPD_DISPATCH_DTYPE"), 2);
    epd_config_state_free(st);
}

static void test_config__legacy__canonical_wins__warning_says_overridden(void **state)
{
    (void)state;
    epd_config_state_t *st = NULL;
    warnings_t w;
    char err[EPD_ERR_LEN];
    char *envp[] = {"SGLANG_DEEPEP_BF16_DISPATCH=1", "EPD_DISPATCH_DTYPE=fp8", NULL};
    load_args_t a = {.envp = envp};
    assert_int_equal(load(&a, &st, &w, err, NULL), EPD_OK);
    assert_int_equal(epd_config_get(st)->dispatch.dtype, EPD_WIRE_FP8);
    assert_origin(st, "dispatch.dtype", EPD_ORIGIN_ENV, "EPD_DISPATCH_DTYPE");
    assert_int_equal(w.n, 1);
    assert_non_null(strstr(w.messages[0], "SGLANG_DEEPEP_BF16_DISPATCH"));
    assert_non_null(strstr(w.messages[0], "overridden by env EPD_DISPATCH_DTYPE"));
    epd_config_state_free(st);

    /* --set overrides it too, and the warning says so */
    const char *sets[] = {"dispatch.dtype=fp8"};
    char *envp2[] = {"SGLANG_DEEPEP_NORMAL_BF16_DISPATCH=on", NULL};
    load_args_t b = {.envp = envp2, .sets = sets, .n_sets = 1};
    assert_int_equal(load(&b, &st, &w, err, NULL), EPD_OK);
    assert_int_equal(epd_config_get(st)->dispatch.dtype, EPD_WIRE_FP8);
    assert_int_equal(w.n, 1);
    assert_non_null(strstr(w.messages[0], "overridden by --set dispatch.dtype"));
    assert_non_null(strstr(w.messages[0], "EPD_DISPATCH_DTYPE"));
    epd_config_state_free(st);
}

static void test_config__legacy__repeated_variable__warned_once(void **state)
{
    (void)state;
    epd_config_state_t *st = NULL;
    warnings_t w;
    char err[EPD_ERR_LEN];
    char *envp[] = {"SGLANG_DEEPEP_BF16_DISPATCH=1", "PATH=/bin", "SGLANG_DEEPEP_BF16_DISPATCH=1",
                    "SGLANG_DEEPEP_BF16_DISPATCH=0", NULL};
    load_args_t a = {.envp = envp};
    assert_int_equal(load(&a, &st, &w, err, NULL), EPD_OK);
    assert_int_equal(epd_config_get(st)->dispatch.dtype, EPD_WIRE_BF16); /* the first one */
    assert_int_equal(w.n, 1);
    assert_int_equal(warnings_with(&w, "SGLANG_DEEPEP_BF16_DISPATCH is deprecated; use "
                                       "EPD_DISPATCH_DTYPE=bf16"), 1);
    epd_config_state_free(st);
}

/* ---- unknown variables ---- */

static void test_config__env__unknown_epd_variable__warned_test_bench_ignored(void **state)
{
    (void)state;
    epd_config_state_t *st = NULL;
    warnings_t w;
    char err[EPD_ERR_LEN];
    char *envp[] = {"EPD_MODEL_TOKP=4", "EPD_TEST_SOCKET_DIR=/tmp/x", "EPD_BENCH_RANKS=2",
                    "EPD_NOTHING_LIKE_IT=1", "EPDX=1", "SGLANG_OTHER=1", "EPD_TEST=1",
                    "EPD_TRACE=1", "EPD_TRACE_TIMES=/tmp/t", "EPD_TRACE_TIME=1", NULL};
    load_args_t a = {.envp = envp};
    assert_int_equal(load(&a, &st, &w, err, NULL), EPD_OK);
    assert_int_equal(w.n, 4);
    assert_int_equal(warnings_with(&w, "EPD_MODEL_TOKP"), 1);
    assert_int_equal(warnings_with(&w, "did you mean EPD_MODEL_TOPK?"), 1);
    assert_int_equal(warnings_with(&w, "EPD_NOTHING_LIKE_IT"), 1);
    assert_int_equal(warnings_with(&w, "EPD_TEST=1"), 0);
    assert_int_equal(warnings_with(&w, "EPD_TEST "), 1); /* only the EPD_TEST_ prefix is skipped */
    assert_int_equal(warnings_with(&w, "EPD_TEST_"), 0);
    assert_int_equal(warnings_with(&w, "EPD_BENCH_"), 0);
    assert_int_equal(warnings_with(&w, "EPDX"), 0);
    /* the request trace's two (daemon/trace.h), and only those */
    assert_int_equal(warnings_with(&w, "EPD_TRACE "), 0);
    assert_int_equal(warnings_with(&w, "EPD_TRACE_TIMES"), 0);
    assert_int_equal(warnings_with(&w, "EPD_TRACE_TIME "), 1);
    assert_int_equal(epd_config_get(st)->model.topk, 8);
    epd_config_state_free(st);
}

/* ---- YAML ---- */

static void test_config__yaml__all_types_with_origins(void **state)
{
    (void)state;
    /* a 1 TiB frame needs as large a buffer budget (the file then leaves it alone) */
    const char *budget_set[] = {"socket.max_buffered_bytes=1099511627776"};
    epd_config_state_t *st = NULL;
    warnings_t w;
    char err[EPD_ERR_LEN], path[64], where[96];
    load_args_t a = {.yaml =
                         "socket:\n"
                         "  path: \"/tmp/epd-%h-%l-%r.sock\"\n"
                         "  mode: 0600\n"
                         "  max_frame_bytes: 1099511627776\n"
                         "  allow_uids: [1000, 1001]\n"
                         "model: {hidden: 128, num_experts: 4096, topk: 64}\n"
                         "dispatch:\n"
                         "  dtype: bf16\n"
                         "  scale: per_token\n"
                         "  scale_format: ue8m0\n"
                         "  max_queued_tokens: 4294967296\n"
                         "  transport: nccl\n"
                         "  mpi_cuda_aware: Yes\n"
                         "  idle_backoff_us: 0\n"
                         "experts:\n"
                         "  kind: identity\n"
                         "device:\n"
                         "  backend: cpu\n"
                         "  id: 1023\n"
                         "log:\n"
                         "  level: debug\n",
                     .sets = budget_set, .n_sets = 1};
    assert_int_equal(load(&a, &st, &w, err, path), EPD_OK);
    const epd_config_t *cfg = epd_config_get(st);
    assert_string_equal(cfg->socket.path, "/tmp/epd-%h-%l-%r.sock");
    assert_int_equal(cfg->socket.mode, 0600);
    assert_int_equal(cfg->socket.max_frame_bytes, UINT64_C(1) << 40);
    assert_int_equal(cfg->socket.n_allow_uids, 2);
    assert_int_equal(cfg->socket.allow_uids[0], 1000);
    assert_int_equal(cfg->socket.allow_uids[1], 1001);
    assert_int_equal(cfg->model.hidden, 128);
    assert_int_equal(cfg->model.num_experts, 4096);
    assert_int_equal(cfg->model.topk, 64);
    assert_int_equal(cfg->dispatch.dtype, EPD_WIRE_BF16);
    assert_int_equal(cfg->dispatch.scale, EPD_SCALE_PER_TOKEN);
    assert_int_equal(cfg->dispatch.scale_format, EPD_SCALE_FMT_UE8M0);
    assert_int_equal(cfg->dispatch.max_queued_tokens, UINT64_C(1) << 32);
    assert_int_equal(cfg->dispatch.transport, EPD_TRANSPORT_NCCL);
    assert_int_equal(cfg->dispatch.mpi_cuda_aware, EPD_TRISTATE_TRUE);
    assert_int_equal(cfg->dispatch.idle_backoff_us, 0);
    assert_int_equal(cfg->experts.kind, EPD_EXPERTS_IDENTITY);
    assert_int_equal(cfg->device.backend, EPD_BACKEND_CPU);
    assert_int_equal(cfg->device.id, 1023);
    assert_int_equal(cfg->log.level, EPD_LOG_DEBUG);
    snprintf(where, sizeof where, "%s:6", path);
    assert_origin(st, "model.topk", EPD_ORIGIN_FILE, where);
    snprintf(where, sizeof where, "%s:21", path);
    assert_origin(st, "log.level", EPD_ORIGIN_FILE, where);
    assert_origin(st, "socket.max_clients", EPD_ORIGIN_DEFAULT, NULL);
    epd_config_state_free(st);
}

static void test_config__yaml__empty_and_comment_only_files__defaults(void **state)
{
    (void)state;
    const char *texts[] = {"", "# nothing here\n", "---\n", "socket:\nmodel: ~\n"};
    for (size_t i = 0; i < EPD_ARRAY_SIZE(texts); i++) {
        epd_config_state_t *st = NULL;
        warnings_t w;
        char err[EPD_ERR_LEN];
        load_args_t a = {.yaml = texts[i]};
        if (load(&a, &st, &w, err, NULL) != EPD_OK) fail_msg("'%s': %s", texts[i], err);
        assert_origin(st, "socket.path", EPD_ORIGIN_DEFAULT, NULL);
        epd_config_state_free(st);
    }
}

static void test_config__yaml__unknown_key__error_with_line(void **state)
{
    (void)state;
    expect_yaml_error("socket:\n  path: /tmp/a\n  pth: /tmp/b\n", 3, "socket.pth",
                      "allowed in socket: path, mode");
}

static void test_config__yaml__unknown_section__error_with_line(void **state)
{
    (void)state;
    expect_yaml_error("model:\n  topk: 2\nrouter:\n  port: 1\n", 3, "unknown section 'router'",
                      "socket, model, dispatch, combine, experts, device, telemetry, log");
    /* a top-level dotted key is no section either */
    expect_yaml_error("model.topk: 2\n", 1, "unknown section 'model.topk'", NULL);
}

static void test_config__yaml__wrong_types__error_with_line(void **state)
{
    (void)state;
    expect_yaml_error("model:\n  hidden:\n    a: 1\n", 2, "model.hidden", "not a mapping");
    expect_yaml_error("model:\n  hidden: [128, 256]\n", 2, "model.hidden", "not a list");
    expect_yaml_error("model:\n  hidden: abc\n", 2, "'abc' is not an integer",
                      "a multiple of 128 in [128, 65536]");
    expect_yaml_error("model:\n  hidden: 12.5\n", 2, "model.hidden", "not an integer");
    expect_yaml_error("model: 5\n", 1, "section 'model' must be a mapping", NULL);
    expect_yaml_error("model:\n  - topk\n", 1, "section 'model' must be a mapping", NULL);
    expect_yaml_error("- a\n- b\n", 1, "top level must be a mapping", NULL);
    expect_yaml_error("just text\n", 1, "top level must be a mapping", NULL);
    expect_yaml_error("socket:\n  allow_uids: [[1]]\n", 2, "list items must be single values",
                      NULL);
    expect_yaml_error("socket:\n  allow_uids: [1, {a: b}]\n", 2, "socket.allow_uids", NULL);
    expect_yaml_error("model:\n  topk:\n", 2, "model.topk: no value given", "[1, 64]");
    expect_yaml_error("socket:\n  path: \"\"\n", 2, "socket.path: the value is empty", NULL);
}

static void test_config__yaml__out_of_range__error_names_range(void **state)
{
    (void)state;
    expect_yaml_error("model:\n  topk: 65\n", 2, "model.topk: 65 is out of range",
                      "an integer in [1, 64]");
    expect_yaml_error("model:\n  hidden: 7000\n", 2, "7000 is not a multiple of 128", NULL);
    expect_yaml_error("model:\n  hidden: 65664\n", 2, "out of range", "[128, 65536]");
    expect_yaml_error("model:\n  num_experts: 0\n", 2, "model.num_experts", "[1, 4096]");
    expect_yaml_error("model:\n  num_experts: -3\n", 2, "model.num_experts", "not an integer");
    expect_yaml_error("socket:\n  mode: 01000\n", 2, "socket.mode", "[0, 0777]");
    expect_yaml_error("socket:\n  mode: 0689\n", 2, "not an octal number", NULL);
    expect_yaml_error("socket:\n  max_frame_bytes: 1023\n", 2, "socket.max_frame_bytes",
                      "[1024, 1099511627776]");
    expect_yaml_error("socket:\n  max_output_bytes: 65535\n", 2, "socket.max_output_bytes",
                      "[65536, ");
    expect_yaml_error("socket:\n  max_clients: 65537\n", 2, "socket.max_clients", "[1, 65536]");
    expect_yaml_error("dispatch:\n  max_queued_tokens: 4294967297\n", 2,
                      "dispatch.max_queued_tokens", "[1, 4294967296]");
    expect_yaml_error("dispatch:\n  idle_backoff_us: 1000001\n", 2, "idle_backoff_us", NULL);
    expect_yaml_error("dispatch:\n  max_tokens_per_step: 0\n", 2, "max_tokens_per_step", NULL);
    expect_yaml_error("device:\n  id: -2\n", 2, "device.id: -2 is out of range", "[-1, 1023]");
    expect_yaml_error("device:\n  id: 99999999999999999999\n", 2, "device.id", NULL);
}

static void test_config__yaml__bad_enum__error_lists_allowed(void **state)
{
    (void)state;
    expect_yaml_error("dispatch:\n  dtype: fp16\n", 2, "dispatch.dtype: 'fp16' is not an allowed",
                      "one of fp8|bf16");
    expect_yaml_error("dispatch:\n  transport: ucx\n", 2, "one of auto|mpi|nccl", NULL);
    expect_yaml_error("dispatch:\n  mpi_cuda_aware: sometimes\n", 2, "one of auto|true|false",
                      NULL);
    expect_yaml_error("log:\n  level: trace\n", 2, "one of error|warn|info|debug", NULL);
    expect_yaml_error("experts:\n  kind: mlp\n", 2, "one of identity|scale|ffn", NULL);
    expect_yaml_error("device:\n  backend: rocm\n", 2, "one of auto|cuda|cpu", NULL);
    expect_yaml_error("dispatch:\n  scale: group64\n", 2, "one of group128|per_token", NULL);
    expect_yaml_error("dispatch:\n  scale_format: e8m0\n", 2, "one of fp32|ue8m0", NULL);
    expect_yaml_error("dispatch:\n  dtype: FP8\n", 2, "'FP8'", NULL); /* names are exact */
}

static void test_config__yaml__malformed__error_with_line(void **state)
{
    (void)state;
    expect_yaml_error("socket:\n  path: /tmp/a\n   mode: 0600\n", 3, "invalid YAML", NULL);
    expect_yaml_error("socket:\n  allow_uids: [1\n  mode: 0600\n", 3, "invalid YAML",
                      "flow sequence at line 2");
    expect_yaml_error("model:\n  topk: \"2\n", 3, "invalid YAML", "quoted scalar");
    expect_yaml_error("model:\n\thidden: 128\n", 2, "invalid YAML", NULL);
    expect_yaml_error("model: {hidden: 128\n", 2, "invalid YAML", NULL);
}

static void test_config__yaml__duplicates_aliases_documents__rejected(void **state)
{
    (void)state;
    expect_yaml_error("model:\n  topk: 2\n  topk: 4\n", 3, "model.topk is set twice",
                      "first at line 2");
    expect_yaml_error("model:\n  topk: 2\nlog:\n  level: warn\nmodel:\n  hidden: 256\n", 5,
                      "section 'model' appears twice", "first at line 1");
    expect_yaml_error("model:\n  topk: &k 2\n  num_experts: *k\n", 3, "aliases", NULL);
    expect_yaml_error("model:\n  topk: 2\n---\nmodel:\n  topk: 4\n", 3, "one YAML document",
                      NULL);
}

static void test_config__yaml__missing_file__error_names_it(void **state)
{
    (void)state;
    epd_config_state_t *st = NULL;
    warnings_t w;
    char err[EPD_ERR_LEN];
    load_args_t a = {.file = "/nonexistent/epd-config.yaml"};
    assert_int_equal(load(&a, &st, &w, err, NULL), EPD_ERR_CONFIG);
    assert_non_null(strstr(err, "/nonexistent/epd-config.yaml"));
    assert_non_null(strstr(err, "No such file"));
    load_args_t b = {.file = "/tmp"};
    assert_int_equal(load(&b, &st, &w, err, NULL), EPD_ERR_CONFIG);
    assert_non_null(strstr(err, "directory"));
}

/* ---- values of each type from env and --set ---- */

static void test_config__uids__list_scalar_env_and_limits(void **state)
{
    (void)state;
    epd_config_state_t *st = NULL;
    warnings_t w;
    char err[EPD_ERR_LEN], line[512];
    load_args_t a = {.yaml = "socket:\n  allow_uids: 0, 1000 ,4294967294\n"};
    assert_int_equal(load(&a, &st, &w, err, NULL), EPD_OK);
    assert_int_equal(epd_config_get(st)->socket.n_allow_uids, 3);
    assert_int_equal(epd_config_get(st)->socket.allow_uids[2], 4294967294u);
    print_line(st, "socket.allow_uids", line, sizeof line);
    assert_non_null(strstr(line, "socket.allow_uids = 0,1000,4294967294  # "));
    epd_config_state_free(st);

    load_args_t b = {.yaml = "socket:\n  allow_uids: []\n"};
    assert_int_equal(load(&b, &st, &w, err, NULL), EPD_OK);
    assert_int_equal(epd_config_get(st)->socket.n_allow_uids, 0);
    epd_config_state_free(st);

    load_args_t c = {.yaml = "socket:\n  allow_uids:\n"}; /* null: empty list */
    assert_int_equal(load(&c, &st, &w, err, NULL), EPD_OK);
    assert_int_equal(epd_config_get(st)->socket.n_allow_uids, 0);
    epd_config_state_free(st);

    char *envp[] = {"EPD_SOCKET_ALLOW_UIDS=7", NULL};
    load_args_t d = {.envp = envp};
    assert_int_equal(load(&d, &st, &w, err, NULL), EPD_OK);
    assert_int_equal(epd_config_get(st)->socket.n_allow_uids, 1);
    assert_int_equal(epd_config_get(st)->socket.allow_uids[0], 7);
    print_line(st, "socket.allow_uids", line, sizeof line);
    assert_string_equal(line, "socket.allow_uids = 7  # env EPD_SOCKET_ALLOW_UIDS");
    epd_config_state_free(st);

    expect_yaml_error("socket:\n  allow_uids: 1,,2\n", 2, "empty item", NULL);
    expect_yaml_error("socket:\n  allow_uids: 1,\n", 2, "empty item", NULL);
    expect_yaml_error("socket:\n  allow_uids: [root]\n", 2, "'root' is not a uid", NULL);
    expect_yaml_error("socket:\n  allow_uids: 4294967295\n", 2, "is not a uid", NULL);
    expect_yaml_error("socket:\n  allow_uids: [\"1,2\"]\n", 2, "not a single list item", NULL);
    char many[512] = "socket:\n  allow_uids: [";
    for (int i = 0; i <= EPD_CONFIG_MAX_UIDS; i++) {
        snprintf(many + strlen(many), sizeof many - strlen(many), "%s%d", i ? "," : "", i);
    }
    strcat(many, "]\n");
    expect_yaml_error(many, 2, "more than 32 uids", NULL);
}

static void test_config__env__bad_values__error_names_variable(void **state)
{
    (void)state;
    char *e1[] = {"EPD_MODEL_TOPK=0", NULL};
    expect_env_error(e1, "env EPD_MODEL_TOPK: model.topk: 0 is out of range", "[1, 64]");
    char *e2[] = {"EPD_DISPATCH_DTYPE=fp16", NULL};
    expect_env_error(e2, "env EPD_DISPATCH_DTYPE", "one of fp8|bf16");
    char *e3[] = {"EPD_SOCKET_PATH=", NULL};
    expect_env_error(e3, "env EPD_SOCKET_PATH: socket.path: the value is empty", NULL);
    char *e4[] = {"EPD_SOCKET_PATH=/run/epd-%p.sock", NULL};
    expect_env_error(e4, "socket.path", "unknown '%p' sequence");
    char *e5[] = {"EPD_MODEL_HIDDEN= 128", NULL};
    expect_env_error(e5, "env EPD_MODEL_HIDDEN", "not an integer");
    char *e6[] = {"EPD_DISPATCH_MAX_TOKENS_PER_STEP=0x10", NULL};
    expect_env_error(e6, "EPD_DISPATCH_MAX_TOKENS_PER_STEP", "not an integer");
    char long_path[400] = "EPD_SOCKET_PATH=/";
    memset(long_path + strlen(long_path), 'a', 300);
    char *e7[] = {long_path, NULL};
    expect_env_error(e7, "socket.path", "bytes long");
}

static void test_config__tristate__any_boolean_spelling(void **state)
{
    (void)state;
    const struct {
        const char *text;
        epd_tristate_t want;
    } cases[] = {{"auto", EPD_TRISTATE_AUTO}, {"true", EPD_TRISTATE_TRUE},
                 {"1", EPD_TRISTATE_TRUE},    {"ON", EPD_TRISTATE_TRUE},
                 {"yes", EPD_TRISTATE_TRUE},  {"false", EPD_TRISTATE_FALSE},
                 {"0", EPD_TRISTATE_FALSE},   {"Off", EPD_TRISTATE_FALSE},
                 {"NO", EPD_TRISTATE_FALSE}};
    for (size_t i = 0; i < EPD_ARRAY_SIZE(cases); i++) {
        char set[64];
        snprintf(set, sizeof set, "dispatch.mpi_cuda_aware=%s", cases[i].text);
        const char *sets[] = {set};
        epd_config_state_t *st = NULL;
        warnings_t w;
        char err[EPD_ERR_LEN];
        load_args_t a = {.sets = sets, .n_sets = 1};
        if (load(&a, &st, &w, err, NULL) != EPD_OK) fail_msg("%s: %s", set, err);
        assert_int_equal(epd_config_get(st)->dispatch.mpi_cuda_aware, cases[i].want);
        epd_config_state_free(st);
    }
}

static void test_config__mode__octal_with_or_without_zero(void **state)
{
    (void)state;
    const char *sets[] = {"socket.mode=600"};
    epd_config_state_t *st = NULL;
    warnings_t w;
    char err[EPD_ERR_LEN], line[512];
    load_args_t a = {.sets = sets, .n_sets = 1};
    assert_int_equal(load(&a, &st, &w, err, NULL), EPD_OK);
    assert_int_equal(epd_config_get(st)->socket.mode, 0600);
    print_line(st, "socket.mode", line, sizeof line);
    assert_string_equal(line, "socket.mode = 0600  # cli");
    epd_config_state_free(st);
    expect_set_error("socket.mode=8", "--set: socket.mode: '8' is not an octal number", NULL);
}

/* ---- --set ---- */

static void test_config__set__errors(void **state)
{
    (void)state;
    expect_set_error("dispatch.dtype", "expected KEY=VALUE", NULL);
    expect_set_error("model.tokp=4", "unknown setting 'model.tokp'", "did you mean model.topk?");
    expect_set_error("nothing.close=4", "unknown setting 'nothing.close'", "epd --help");
    expect_set_error("SGLANG_DEEPEP_BF16_DISPATCH=1", "unknown setting", NULL);
    expect_set_error("=1", "unknown setting ''", NULL);
    expect_set_error("dispatch.dtype=int8", "--set: dispatch.dtype: 'int8'", "one of fp8|bf16");
    expect_set_error("model.topk=", "--set: model.topk", "not an integer");

    /* spaces around the key are forgiven; the value is taken as written */
    const char *sets[] = {" log.level =warn"};
    epd_config_state_t *st = NULL;
    warnings_t w;
    char err[EPD_ERR_LEN];
    load_args_t a = {.sets = sets, .n_sets = 1};
    assert_int_equal(load(&a, &st, &w, err, NULL), EPD_OK);
    assert_int_equal(epd_config_get(st)->log.level, EPD_LOG_WARN);
    epd_config_state_free(st);
}

/* ---- cross-field checks ---- */

static void test_config__cross_field__errors_name_both_keys(void **state)
{
    (void)state;
    char *e1[] = {"EPD_MODEL_NUM_EXPERTS=4", NULL};
    expect_env_error(e1, "model.topk = 8 (default)",
                     "model.num_experts = 4 (env EPD_MODEL_NUM_EXPERTS)");
    char *e2[] = {"EPD_DISPATCH_MAX_QUEUED_TOKENS=100", NULL};
    expect_env_error(e2, "dispatch.max_tokens_per_request = 4096",
                     "dispatch.max_queued_tokens = 100");
    char *e3[] = {"EPD_DISPATCH_MAX_TOKENS_PER_STEP=1024", NULL};
    expect_env_error(e3, "dispatch.max_tokens_per_request = 4096",
                     "dispatch.max_tokens_per_step = 1024 (env");
    /* 4096 tokens * (2*7168 + 8*8) = 58982400 bytes */
    char *e4[] = {"EPD_SOCKET_MAX_FRAME_BYTES=58982399", NULL};
    expect_env_error(e4, "socket.max_frame_bytes = 58982399", "58982400");
    expect_env_error(e4, "dispatch.max_tokens_per_request = 4096", NULL);
    /* issue 20's settings: a largest frame fits the buffer budget, the stall limits are ordered */
    char *e5[] = {"EPD_SOCKET_MAX_BUFFERED_BYTES=268435455", NULL};
    expect_env_error(e5, "socket.max_frame_bytes = 268435456 (default)",
                     "socket.max_buffered_bytes = 268435455 (env");
    char *e6[] = {"EPD_DISPATCH_STALL_WARN_MS=100", "EPD_DISPATCH_IDLE_BACKOFF_US=100000", NULL};
    expect_env_error(e6, "dispatch.stall_warn_ms = 100 (env", "dispatch.idle_backoff_us = 100000");
    char *e7[] = {"EPD_DISPATCH_STEP_TIMEOUT_MS=5000", NULL};
    expect_env_error(e7, "dispatch.step_timeout_ms = 5000 (env",
                     "dispatch.stall_warn_ms = 5000 (default)");

    epd_config_state_t *st = NULL;
    warnings_t w;
    char err[EPD_ERR_LEN];
    char *ok[] = {"EPD_SOCKET_MAX_FRAME_BYTES=58982400", "EPD_MODEL_NUM_EXPERTS=8",
                  "EPD_DISPATCH_MAX_QUEUED_TOKENS=4096", NULL};
    load_args_t a = {.envp = ok};
    if (load(&a, &st, &w, err, NULL) != EPD_OK) fail_msg("%s", err);
    epd_config_state_free(st);

    /* fixing one side with --set makes it pass */
    const char *sets[] = {"dispatch.max_tokens_per_request=1024"};
    load_args_t b = {.envp = e3, .sets = sets, .n_sets = 1};
    assert_int_equal(load(&b, &st, &w, err, NULL), EPD_OK);
    epd_config_state_free(st);
}

/* ---- output ---- */

static void test_config__ffn_settings__only_with_ffn_and_checked(void **state)
{
    (void)state;
    epd_config_state_t *st = NULL;
    warnings_t w;
    char err[EPD_ERR_LEN];

    char *e1[] = {"EPD_EXPERTS_WEIGHTS=/models/v3", NULL};
    expect_env_error(e1, "experts.weights = /models/v3 (env EPD_EXPERTS_WEIGHTS)",
                     "experts.kind = scale (default)");
    char *e2[] = {"EPD_EXPERTS_LAYERS=3-60", NULL};
    expect_env_error(e2, "experts.layers = 3-60", "only with experts.kind = ffn");
    char *e3[] = {"EPD_MODEL_INTERMEDIATE=2048", NULL};
    expect_env_error(e3, "model.intermediate = 2048", "experts.kind");
    expect_set_error("experts.layers=3-x", "experts.layers", "3-x");
    expect_set_error("experts.layers=9-3", "experts.layers", "backwards");
    expect_set_error("experts.layers=5000", "experts.layers", "4095");
    expect_set_error("model.intermediate=100", "model.intermediate", "multiple of 128");

    const char *sets[] = {"experts.kind=ffn", "experts.weights=/models/v3",
                          "experts.layers=3,5-7", "model.intermediate=2048"};
    load_args_t a = {.sets = sets, .n_sets = 4};
    if (load(&a, &st, &w, err, NULL) != EPD_OK) fail_msg("%s", err);
    const epd_config_t *cfg = epd_config_get(st);
    assert_int_equal(cfg->experts.kind, EPD_EXPERTS_FFN);
    assert_string_equal(cfg->experts.weights, "/models/v3");
    assert_string_equal(cfg->experts.layers, "3,5-7");
    assert_int_equal(cfg->model.intermediate, 2048);
    epd_config_state_free(st);

    uint32_t layers[8];
    size_t n;
    assert_int_equal(epd_parse_u32_list("7,3-5,4", 100, layers, 8, &n, err), EPD_OK);
    assert_int_equal(n, 4);
    assert_int_equal(layers[0], 3);
    assert_int_equal(layers[3], 7);
    assert_int_equal(epd_parse_u32_list("", 100, layers, 8, &n, err), EPD_OK);
    assert_int_equal(n, 0);
    assert_int_equal(epd_parse_u32_list("1,,2", 100, layers, 8, &n, err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_parse_u32_list("0-9", 100, layers, 8, &n, err), EPD_ERR_INVALID_ARG);
}

static void test_config__print__every_setting_in_table_order(void **state)
{
    (void)state;
    epd_config_state_t *st = NULL;
    warnings_t w;
    char err[EPD_ERR_LEN], path[64], want[256];
    char *envp[] = {"EPD_LOG_LEVEL=warn", NULL};
    load_args_t a = {.yaml = "model:\n  topk: 4\n", .envp = envp};
    assert_int_equal(load(&a, &st, &w, err, path), EPD_OK);
    char *text = NULL;
    size_t size = 0;
    FILE *out = open_memstream(&text, &size);
    epd_config_print(st, out);
    fclose(out);
    /* one line per setting, in table order */
    const char *p = text;
    size_t lines = 0;
    for (const epd_setting_t *row = epd_settings; row->name != NULL; row++) {
        if (row->type == EPD_SETTING_ALIAS_BOOL) continue;
        assert_int_equal(strncmp(p, row->name, strlen(row->name)), 0);
        assert_int_equal(strncmp(p + strlen(row->name), " = ", 3), 0);
        p = strchr(p, '\n') + 1;
        lines++;
    }
    assert_int_equal(*p, '\0');
    assert_int_equal(lines, epd_settings_rows() - 2); /* every row but the two legacy aliases */
    assert_non_null(strstr(text, "socket.path = /run/epd/epd-%r.sock  # default\n"));
    assert_non_null(strstr(text, "socket.mode = 0660  # default\n"));
    assert_non_null(strstr(text, "socket.allow_uids =   # default\n"));
    assert_non_null(strstr(text, "dispatch.max_queued_tokens = 65536  # default\n"));
    assert_non_null(strstr(text, "dispatch.mpi_cuda_aware = auto  # default\n"));
    assert_non_null(strstr(text, "device.id = -1  # default\n"));
    assert_non_null(strstr(text, "log.level = warn  # env EPD_LOG_LEVEL\n"));
    snprintf(want, sizeof want, "model.topk = 4  # %s:2\n", path);
    assert_non_null(strstr(text, want));
    free(text);
    epd_config_state_free(st);
}

static void test_config__json__valid_and_snprintf_contract(void **state)
{
    (void)state;
    epd_config_t cfg;
    epd_config_defaults(&cfg);
    snprintf(cfg.socket.path, sizeof cfg.socket.path, "/tmp/a \"quoted\"\\path\n");
    cfg.socket.n_allow_uids = 2;
    cfg.socket.allow_uids[0] = 5;
    cfg.socket.allow_uids[1] = 6;
    cfg.dispatch.dtype = EPD_WIRE_BF16;
    size_t need = epd_config_to_json(&cfg, NULL, 0);
    char *buf = malloc(need + 1);
    assert_int_equal(epd_config_to_json(&cfg, buf, need + 1), need);
    assert_int_equal(strlen(buf), need);
    cJSON *root = cJSON_Parse(buf);
    assert_non_null(root);
    assert_int_equal(cJSON_GetArraySize(root), epd_settings_rows() - 2); /* less the aliases */
    assert_string_equal(cJSON_GetObjectItem(root, "socket.path")->valuestring,
                        "/tmp/a \"quoted\"\\path\n");
    assert_string_equal(cJSON_GetObjectItem(root, "socket.mode")->valuestring, "0660");
    assert_int_equal(cJSON_GetObjectItem(root, "model.hidden")->valueint, 7168);
    assert_int_equal((int)cJSON_GetObjectItem(root, "device.id")->valuedouble, -1);
    assert_string_equal(cJSON_GetObjectItem(root, "dispatch.dtype")->valuestring, "bf16");
    cJSON *uids = cJSON_GetObjectItem(root, "socket.allow_uids");
    assert_true(cJSON_IsArray(uids));
    assert_int_equal(cJSON_GetArraySize(uids), 2);
    assert_int_equal(cJSON_GetArrayItem(uids, 1)->valueint, 6);
    cJSON_Delete(root);
    /* too small: NUL-terminated prefix, full length returned */
    char small[16];
    assert_int_equal(epd_config_to_json(&cfg, small, sizeof small), need);
    assert_int_equal(strlen(small), sizeof small - 1);
    assert_memory_equal(small, buf, sizeof small - 1);
    free(buf);
}

static void test_config__fingerprint__changes_with_any_value(void **state)
{
    (void)state;
    epd_config_t a, b;
    epd_config_defaults(&a);
    epd_config_defaults(&b);
    char fa[4096], fb[4096];
    size_t na = epd_config_fingerprint(&a, fa, sizeof fa);
    assert_true(na < sizeof fa);
    assert_int_equal(epd_config_fingerprint(&b, fb, sizeof fb), na);
    assert_string_equal(fa, fb);
    assert_non_null(strstr(fa, "dispatch.dtype=fp8\n"));
    assert_null(strstr(fa, "#")); /* values only, no origins */
    b.dispatch.idle_backoff_us = 999;
    epd_config_fingerprint(&b, fb, sizeof fb);
    assert_string_not_equal(fa, fb);
    epd_config_defaults(&b);
    b.socket.n_allow_uids = 1;
    epd_config_fingerprint(&b, fb, sizeof fb);
    assert_string_not_equal(fa, fb);
    char small[8];
    assert_int_equal(epd_config_fingerprint(&a, small, sizeof small), na);
    assert_int_equal(strlen(small), 7);
}

static void test_config__names__every_enum_value(void **state)
{
    static const struct {
        const char *key;
        int value;
        const char *name;
    } cases[] = {
        {"dispatch.dtype", EPD_WIRE_FP8, "fp8"},
        {"dispatch.dtype", EPD_WIRE_BF16, "bf16"},
        {"dispatch.scale", EPD_SCALE_GROUP128, "group128"},
        {"dispatch.scale", EPD_SCALE_PER_TOKEN, "per_token"},
        {"dispatch.scale_format", EPD_SCALE_FMT_FP32, "fp32"},
        {"dispatch.scale_format", EPD_SCALE_FMT_UE8M0, "ue8m0"},
        {"dispatch.transport", EPD_TRANSPORT_AUTO, "auto"},
        {"dispatch.transport", EPD_TRANSPORT_MPI, "mpi"},
        {"dispatch.transport", EPD_TRANSPORT_NCCL, "nccl"},
        {"dispatch.mpi_cuda_aware", EPD_TRISTATE_AUTO, "auto"},
        {"dispatch.mpi_cuda_aware", EPD_TRISTATE_TRUE, "true"},
        {"dispatch.mpi_cuda_aware", EPD_TRISTATE_FALSE, "false"},
        {"experts.kind", EPD_EXPERTS_IDENTITY, "identity"},
        {"experts.kind", EPD_EXPERTS_SCALE, "scale"},
        {"device.backend", EPD_BACKEND_AUTO, "auto"},
        {"device.backend", EPD_BACKEND_CUDA, "cuda"},
        {"device.backend", EPD_BACKEND_CPU, "cpu"},
        {"log.level", EPD_LOG_ERROR, "error"},
        {"log.level", EPD_LOG_WARN, "warn"},
        {"log.level", EPD_LOG_INFO, "info"},
        {"log.level", EPD_LOG_DEBUG, "debug"},
        /* out of range, not an enum setting, no such setting */
        {"dispatch.dtype", 2, "?"},
        {"device.backend", -1, "?"},
        {"model.hidden", 0, "?"},
        {"dispatch.dtypo", 0, "?"},
        {NULL, 0, "?"},
    };
    (void)state;
    for (size_t i = 0; i < EPD_ARRAY_SIZE(cases); i++) {
        assert_string_equal(epd_config_enum_name(cases[i].key, cases[i].value), cases[i].name);
    }
}

static void test_config__help__lists_every_setting_and_alias(void **state)
{
    (void)state;
    char *text = NULL;
    size_t size = 0;
    FILE *out = open_memstream(&text, &size);
    epd_config_print_help(out);
    fclose(out);
    for (const epd_setting_t *row = epd_settings; row->name != NULL; row++) {
        if (strstr(text, row->env) == NULL) fail_msg("help lacks %s", row->env);
        if (strstr(text, row->doc) == NULL && row->type != EPD_SETTING_ALIAS_BOOL) {
            fail_msg("help lacks the doc of %s", row->name);
        }
    }
    assert_non_null(strstr(text, "dispatch.dtype"));
    assert_non_null(strstr(text, "one of fp8|bf16"));
    assert_non_null(strstr(text, "deprecated, use EPD_DISPATCH_DTYPE"));
    free(text);
}

static void test_config__expand_path__rank_local_host(void **state)
{
    (void)state;
    char out[64], err[EPD_ERR_LEN];
    assert_int_equal(epd_config_expand_path("/run/epd/epd-%r.sock", 3, 1, "gpu7.example.com", out,
                                            sizeof out, err), EPD_OK);
    assert_string_equal(out, "/run/epd/epd-3.sock");
    assert_int_equal(epd_config_expand_path("/s/%h-%l-%r-100%%", 12, 4, "gpu7.example.com", out,
                                            sizeof out, err), EPD_OK);
    assert_string_equal(out, "/s/gpu7-4-12-100%");
    assert_int_equal(epd_config_expand_path("/s/%q", 0, 0, "h", out, sizeof out, err),
                     EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(err, "'%q'"));
    assert_int_equal(epd_config_expand_path("/s/%", 0, 0, "h", out, sizeof out, err),
                     EPD_ERR_INVALID_ARG);
    char tiny[8];
    assert_int_equal(epd_config_expand_path("/abc/%r", 123456, 0, "h", tiny, sizeof tiny, err),
                     EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(err, "more than 7 bytes"));
    assert_int_equal(epd_config_expand_path("/abc/%r", 12, 0, "h", tiny, sizeof tiny, err), EPD_OK);
    assert_string_equal(tiny, "/abc/12");
}

/* ---- command line ---- */

static epd_status_t parse_argv(const char *const *words, size_t n, epd_args_t *args,
                               char err[EPD_ERR_LEN])
{
    char *argv[32];
    assert_true(n < EPD_ARRAY_SIZE(argv));
    for (size_t i = 0; i < n; i++) argv[i] = (char *)words[i];
    argv[n] = NULL;
    return epd_args_parse((int)n, argv, args, err);
}

static void test_config__args__every_option_both_forms(void **state)
{
    (void)state;
    epd_args_t args;
    char err[EPD_ERR_LEN];
    const char *run[] = {"epd", "--config", "/etc/epd.yaml", "--set", "model.topk=4",
                         "--set=log.level=debug"};
    assert_int_equal(parse_argv(run, EPD_ARRAY_SIZE(run), &args, err), EPD_OK);
    assert_int_equal(args.action, EPD_ACTION_RUN);
    assert_string_equal(args.config_file, "/etc/epd.yaml");
    assert_int_equal(args.n_sets, 2);
    assert_string_equal(args.sets[0], "model.topk=4");
    assert_string_equal(args.sets[1], "log.level=debug");
    assert_false(args.json);
    assert_null(args.bench_tokens);
    assert_int_equal(args.bench_iters, 0);
    epd_args_free(&args);
    assert_null(args.sets);

    const char *print[] = {"epd", "--config=/x.yaml", "--print-config"};
    assert_int_equal(parse_argv(print, EPD_ARRAY_SIZE(print), &args, err), EPD_OK);
    assert_int_equal(args.action, EPD_ACTION_PRINT_CONFIG);
    assert_string_equal(args.config_file, "/x.yaml");
    epd_args_free(&args);

    const char *bench[] = {"epd", "--bench", "--json", "--bench-tokens", "128,512,2048",
                           "--bench-iters=20"};
    assert_int_equal(parse_argv(bench, EPD_ARRAY_SIZE(bench), &args, err), EPD_OK);
    assert_int_equal(args.action, EPD_ACTION_BENCH);
    assert_true(args.json);
    assert_string_equal(args.bench_tokens, "128,512,2048");
    assert_int_equal(args.bench_iters, 20);
    epd_args_free(&args);

    const char *help[] = {"epd", "--print-config", "-h"};
    assert_int_equal(parse_argv(help, EPD_ARRAY_SIZE(help), &args, err), EPD_OK);
    assert_int_equal(args.action, EPD_ACTION_HELP);
    epd_args_free(&args);
    const char *version[] = {"epd", "--version", "--print-config"};
    assert_int_equal(parse_argv(version, EPD_ARRAY_SIZE(version), &args, err), EPD_OK);
    assert_int_equal(args.action, EPD_ACTION_VERSION);
    epd_args_free(&args);
    const char *none[] = {"epd"};
    assert_int_equal(parse_argv(none, 1, &args, err), EPD_OK);
    assert_int_equal(args.action, EPD_ACTION_RUN);
    assert_int_equal(args.n_sets, 0);
    epd_args_free(&args);
    epd_args_free(NULL);
}

static void expect_args_error(const char *const *words, size_t n, const char *needle)
{
    epd_args_t args;
    char err[EPD_ERR_LEN];
    assert_int_equal(parse_argv(words, n, &args, err), EPD_ERR_INVALID_ARG);
    if (strstr(err, needle) == NULL) fail_msg("'%s' lacks '%s'", err, needle);
    assert_null(args.sets);
}

static void test_config__args__bad_command_lines__errors(void **state)
{
    (void)state;
    const char *a1[] = {"epd", "--frobnicate"};
    expect_args_error(a1, 2, "unknown option '--frobnicate'");
    const char *a2[] = {"epd", "--config"};
    expect_args_error(a2, 2, "--config needs a value");
    const char *a3[] = {"epd", "--set", "dispatch.dtype"};
    expect_args_error(a3, 3, "expected KEY=VALUE");
    const char *a4[] = {"epd", "--print-config=yes"};
    expect_args_error(a4, 2, "--print-config takes no value");
    const char *a5[] = {"epd", "--bench", "--bench-tokens", "128,,512"};
    expect_args_error(a5, 4, "item 2 is empty");
    const char *a6[] = {"epd", "--bench", "--bench-iters", "0"};
    expect_args_error(a6, 4, "--bench-iters: '0'");
    const char *a7[] = {"epd", "config.yaml"};
    expect_args_error(a7, 2, "unexpected argument 'config.yaml'");
    const char *a8[] = {"epd", "--print-config", "--bench"};
    expect_args_error(a8, 3, "cannot be combined");
    const char *a9[] = {"epd", "--config", "a.yaml", "--config", "b.yaml"};
    expect_args_error(a9, 5, "--config given twice");
    const char *a10[] = {"epd", "--bench-iters", "5"};
    expect_args_error(a10, 3, "--bench-iters only goes with --bench");
    const char *a11[] = {"epd", "--bench", "--bench-tokens", "1048577"};
    expect_args_error(a11, 4, "[1, 1048576]");
    const char *a12[] = {"epd", "--set"};
    expect_args_error(a12, 2, "--set needs a value");
    const char *a13[] = {"epd", "--config="};
    expect_args_error(a13, 2, "--config needs a file name");
    const char *a14[] = {"epd", "--bench", "--bench-tokens", "64x"};
    expect_args_error(a14, 4, "'64x'");
}

static void test_config__args__token_list(void **state)
{
    (void)state;
    uint32_t tokens[4];
    size_t n = 0;
    char err[EPD_ERR_LEN];
    assert_int_equal(epd_args_parse_token_list("1,1048576", tokens, 4, &n, err), EPD_OK);
    assert_int_equal(n, 2);
    assert_int_equal(tokens[1], 1048576);
    assert_int_equal(epd_args_parse_token_list("1,2,3,4,5", tokens, 4, &n, err),
                     EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(err, "more than 4 items"));
    assert_int_equal(epd_args_parse_token_list("", tokens, 4, &n, err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_args_parse_token_list("8,", tokens, 4, &n, err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_args_parse_token_list("0", tokens, 4, &n, err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_args_parse_token_list("-1", tokens, 4, &n, err), EPD_ERR_INVALID_ARG);
}

static void test_config__args__usage_mentions_sigusr1_and_settings(void **state)
{
    (void)state;
    char *text = NULL;
    size_t size = 0;
    FILE *out = open_memstream(&text, &size);
    epd_args_print_usage(out, "build/epd");
    fclose(out);
    assert_non_null(strstr(text, "build/epd --print-config"));
    assert_non_null(strstr(text, "--set KEY=VALUE"));
    assert_non_null(strstr(text, "SIGUSR1 to mpirun"));
    assert_non_null(strstr(text, "EPD_DISPATCH_MAX_TOKENS_PER_REQUEST"));
    assert_non_null(strstr(text, "SGLANG_DEEPEP_NORMAL_BF16_DISPATCH"));
    free(text);
}

static void test_config__metrics_listen__off_or_host_port(void **state)
{
    (void)state;
    expect_set_error("metrics.listen=localhost", "metrics.listen", "HOST:PORT");
    expect_set_error("metrics.listen=127.0.0.1:0", "metrics.listen", "port");
    expect_set_error("metrics.listen=::1:9400", "metrics.listen", "[]");
    char *envp[] = {"EPD_METRICS_LISTEN=0.0.0.0:70000", NULL};
    expect_env_error(envp, "EPD_METRICS_LISTEN", "65535");
    expect_yaml_error("metrics:\n  listen: on\n", 2, "metrics.listen", "off or HOST:PORT");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_config__metrics_listen__off_or_host_port),
        cmocka_unit_test(test_config__defaults__match_the_design),
        cmocka_unit_test(test_config__table__every_row_is_well_formed),
        cmocka_unit_test(test_config__no_sources__all_defaults),
        cmocka_unit_test(test_config__precedence__five_levels_in_order),
        cmocka_unit_test(test_config__precedence__per_key_independent),
        cmocka_unit_test(test_config__env__first_occurrence_wins),
        cmocka_unit_test(test_config__legacy__both_spellings_every_boolean),
        cmocka_unit_test(test_config__legacy__bad_value__error_names_variable),
        cmocka_unit_test(test_config__legacy__conflicting_aliases__error_names_both),
        cmocka_unit_test(test_config__legacy__agreeing_aliases__one_warning_each),
        cmocka_unit_test(test_config__legacy__canonical_wins__warning_says_overridden),
        cmocka_unit_test(test_config__legacy__repeated_variable__warned_once),
        cmocka_unit_test(test_config__env__unknown_epd_variable__warned_test_bench_ignored),
        cmocka_unit_test(test_config__yaml__all_types_with_origins),
        cmocka_unit_test(test_config__yaml__empty_and_comment_only_files__defaults),
        cmocka_unit_test(test_config__yaml__unknown_key__error_with_line),
        cmocka_unit_test(test_config__yaml__unknown_section__error_with_line),
        cmocka_unit_test(test_config__yaml__wrong_types__error_with_line),
        cmocka_unit_test(test_config__yaml__out_of_range__error_names_range),
        cmocka_unit_test(test_config__yaml__bad_enum__error_lists_allowed),
        cmocka_unit_test(test_config__yaml__malformed__error_with_line),
        cmocka_unit_test(test_config__yaml__duplicates_aliases_documents__rejected),
        cmocka_unit_test(test_config__yaml__missing_file__error_names_it),
        cmocka_unit_test(test_config__uids__list_scalar_env_and_limits),
        cmocka_unit_test(test_config__env__bad_values__error_names_variable),
        cmocka_unit_test(test_config__tristate__any_boolean_spelling),
        cmocka_unit_test(test_config__mode__octal_with_or_without_zero),
        cmocka_unit_test(test_config__set__errors),
        cmocka_unit_test(test_config__cross_field__errors_name_both_keys),
        cmocka_unit_test(test_config__ffn_settings__only_with_ffn_and_checked),
        cmocka_unit_test(test_config__print__every_setting_in_table_order),
        cmocka_unit_test(test_config__json__valid_and_snprintf_contract),
        cmocka_unit_test(test_config__fingerprint__changes_with_any_value),
        cmocka_unit_test(test_config__names__every_enum_value),
        cmocka_unit_test(test_config__help__lists_every_setting_and_alias),
        cmocka_unit_test(test_config__expand_path__rank_local_host),
        cmocka_unit_test(test_config__args__every_option_both_forms),
        cmocka_unit_test(test_config__args__bad_command_lines__errors),
        cmocka_unit_test(test_config__args__token_list),
        cmocka_unit_test(test_config__args__usage_mentions_sigusr1_and_settings),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
