/* epd's command line (DESIGN.md section 9): options into an epd_args_t, the --bench-tokens list,
 * and the usage text (options, then the settings table). Never prints except into the FILE the
 * usage is asked for. */
#include <stdlib.h>
#include <string.h>

#include "common/parse.h"
#include "config/settings.h"

#define BENCH_TOKENS_MAX_ITEMS 64
#define BENCH_TOKENS_MAX 1048576

typedef enum { OPT_FLAG, OPT_VALUE } opt_kind_t;

typedef struct opt {
    const char *name;
    opt_kind_t kind;
} opt_t;

static const opt_t options[] = {
    {"--config", OPT_VALUE},
    {"--set", OPT_VALUE},
    {"--print-config", OPT_FLAG},
    {"--help", OPT_FLAG},
    {"-h", OPT_FLAG},
    {"--version", OPT_FLAG},
    {"--bench", OPT_FLAG},
    {"--accuracy", OPT_FLAG},
    {"--json", OPT_FLAG},
    {"--bench-tokens", OPT_VALUE},
    {"--bench-iters", OPT_VALUE},
    {"--bench-weights", OPT_VALUE},
};

epd_status_t epd_args_parse_token_list(const char *list, uint32_t *tokens, size_t max, size_t *n_p,
                                       char err[EPD_ERR_LEN])
{
    size_t n = 0;
    const char *p = list;
    if (list == NULL || *list == '\0') {
        epd_config_textf(err, EPD_ERR_LEN, "the token list is empty; expected e.g. 128,512,2048");
        return EPD_ERR_INVALID_ARG;
    }
    for (;;) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        char item[24], ignored[EPD_ERR_LEN];
        uint64_t v = 0;
        if (len == 0 || len >= sizeof item) {
            epd_config_textf(err, EPD_ERR_LEN, "token list '%.64s': item %zu is %s", list, n + 1,
                             len == 0 ? "empty" : "too long");
            return EPD_ERR_INVALID_ARG;
        }
        memcpy(item, p, len);
        item[len] = '\0';
        if (epd_parse_u64(item, 10, 1, BENCH_TOKENS_MAX, &v, ignored) != EPD_OK) {
            epd_config_textf(err, EPD_ERR_LEN,
                             "token list '%.64s': '%s' is not an integer in [1, %d]", list, item,
                             BENCH_TOKENS_MAX);
            return EPD_ERR_INVALID_ARG;
        }
        if (n == max) {
            epd_config_textf(err, EPD_ERR_LEN, "token list '%.64s' has more than %zu items", list,
                             max);
            return EPD_ERR_INVALID_ARG;
        }
        tokens[n++] = (uint32_t)v;
        if (end == NULL) break;
        p = end + 1;
    }
    *n_p = n;
    return EPD_OK;
}

/* Matches argv[*i] against the options; sets *value_p for options that take one ("--o v" or
 * "--o=v"), advancing *i past a separate value. */
static epd_status_t match_option(int argc, char **argv, int *i, const opt_t **opt_p,
                                 const char **value_p, char err[EPD_ERR_LEN])
{
    const char *arg = argv[*i];
    const char *eq = strchr(arg, '=');
    size_t len = eq && arg[0] == '-' ? (size_t)(eq - arg) : strlen(arg);
    for (size_t k = 0; k < EPD_ARRAY_SIZE(options); k++) {
        const opt_t *opt = &options[k];
        if (strlen(opt->name) != len || strncmp(opt->name, arg, len) != 0) continue;
        *opt_p = opt;
        *value_p = NULL;
        if (opt->kind == OPT_FLAG) {
            if (eq != NULL) {
                epd_config_textf(err, EPD_ERR_LEN, "option %s takes no value", opt->name);
                return EPD_ERR_INVALID_ARG;
            }
            return EPD_OK;
        }
        if (eq != NULL) {
            *value_p = eq + 1;
        } else if (*i + 1 < argc) {
            *value_p = argv[++*i];
        } else {
            epd_config_textf(err, EPD_ERR_LEN, "option %s needs a value", opt->name);
            return EPD_ERR_INVALID_ARG;
        }
        return EPD_OK;
    }
    if (arg[0] == '-') {
        epd_config_textf(err, EPD_ERR_LEN, "unknown option '%.64s' (epd --help lists the options)",
                         arg);
    } else {
        epd_config_textf(err, EPD_ERR_LEN,
                         "unexpected argument '%.64s' (settings go in --set KEY=VALUE)", arg);
    }
    return EPD_ERR_INVALID_ARG;
}

/* Applies one matched option to args. */
static epd_status_t apply_option(const opt_t *opt, const char *value, epd_args_t *args,
                                 bool *print_config_p, bool *help_p, bool *version_p, bool *bench_p,
                                 bool *accuracy_p, char err[EPD_ERR_LEN])
{
    const char *name = opt->name;
    if (strcmp(name, "--config") == 0) {
        if (args->config_file != NULL) {
            epd_config_textf(err, EPD_ERR_LEN, "--config given twice ('%.64s' and '%.64s')",
                             args->config_file, value);
            return EPD_ERR_INVALID_ARG;
        }
        if (value[0] == '\0') {
            epd_config_textf(err, EPD_ERR_LEN, "--config needs a file name");
            return EPD_ERR_INVALID_ARG;
        }
        args->config_file = value;
    } else if (strcmp(name, "--set") == 0) {
        if (strchr(value, '=') == NULL || value[0] == '=') {
            epd_config_textf(err, EPD_ERR_LEN,
                             "--set '%.64s': expected KEY=VALUE, e.g. "
                             "--set dispatch.dtype=bf16",
                             value);
            return EPD_ERR_INVALID_ARG;
        }
        args->sets[args->n_sets++] = value;
    } else if (strcmp(name, "--print-config") == 0) {
        *print_config_p = true;
    } else if (strcmp(name, "--help") == 0 || strcmp(name, "-h") == 0) {
        *help_p = true;
    } else if (strcmp(name, "--version") == 0) {
        *version_p = true;
    } else if (strcmp(name, "--bench") == 0) {
        *bench_p = true;
    } else if (strcmp(name, "--accuracy") == 0) {
        *accuracy_p = true;
    } else if (strcmp(name, "--json") == 0) {
        args->json = true;
    } else if (strcmp(name, "--bench-tokens") == 0) {
        uint32_t tokens[BENCH_TOKENS_MAX_ITEMS];
        size_t n;
        char why[EPD_ERR_LEN];
        if (epd_args_parse_token_list(value, tokens, EPD_ARRAY_SIZE(tokens), &n, why) != EPD_OK) {
            epd_config_textf(err, EPD_ERR_LEN, "--bench-tokens: %s", why);
            return EPD_ERR_INVALID_ARG;
        }
        args->bench_tokens = value;
    } else if (strcmp(name, "--bench-iters") == 0) {
        uint64_t iters = 0;
        char why[EPD_ERR_LEN];
        if (epd_parse_u64(value, 10, 1, 1000000000, &iters, why) != EPD_OK) {
            epd_config_textf(err, EPD_ERR_LEN,
                             "--bench-iters: '%.64s' is not an integer in [1, 1000000000]", value);
            return EPD_ERR_INVALID_ARG;
        }
        args->bench_iters = (uint32_t)iters;
    } else if (strcmp(name, "--bench-weights") == 0) {
        if (strcmp(value, "random") != 0 && strcmp(value, "random-bf16") != 0 &&
            strcmp(value, "random-fp8") != 0) {
            epd_config_textf(err, EPD_ERR_LEN,
                             "--bench-weights: '%.64s' is not one of random|random-bf16|random-fp8",
                             value);
            return EPD_ERR_INVALID_ARG;
        }
        args->bench_weights = value;
    }
    return EPD_OK;
}

epd_status_t epd_args_parse(int argc, char **argv, epd_args_t *args_p, char err[EPD_ERR_LEN])
{
    epd_status_t status;
    bool print_config = false, help = false, version = false, bench = false, accuracy = false;
    memset(args_p, 0, sizeof *args_p);
    args_p->sets = calloc(argc > 0 ? (size_t)argc : 1, sizeof args_p->sets[0]);
    if (args_p->sets == NULL) {
        epd_config_textf(err, EPD_ERR_LEN, "out of memory parsing the command line");
        return EPD_ERR_NO_MEMORY;
    }
    for (int i = 1; i < argc; i++) {
        const opt_t *opt = NULL;
        const char *value = NULL;
        CHECK_GOTO(match_option(argc, argv, &i, &opt, &value, err), err_free);
        CHECK_GOTO(apply_option(opt, value, args_p, &print_config, &help, &version, &bench,
                                &accuracy, err),
                   err_free);
    }
    if (help) {
        args_p->action = EPD_ACTION_HELP;
    } else if (version) {
        args_p->action = EPD_ACTION_VERSION;
    } else if (print_config + bench + accuracy > 1) {
        epd_config_textf(err, EPD_ERR_LEN, "%s cannot be combined",
                         !bench ? "--print-config and --accuracy"
                         : !accuracy ? "--print-config and --bench" : "--bench and --accuracy");
        status = EPD_ERR_INVALID_ARG;
        goto err_free;
    } else if (print_config) {
        args_p->action = EPD_ACTION_PRINT_CONFIG;
    } else if (bench) {
        args_p->action = EPD_ACTION_BENCH;
    } else if (accuracy) {
        args_p->action = EPD_ACTION_ACCURACY;
    } else {
        args_p->action = EPD_ACTION_RUN;
    }
    if (!bench && !accuracy && !help && !version &&
        (args_p->bench_tokens != NULL || args_p->bench_iters != 0)) {
        epd_config_textf(err, EPD_ERR_LEN, "%s only goes with --bench or --accuracy",
                         args_p->bench_tokens != NULL ? "--bench-tokens" : "--bench-iters");
        status = EPD_ERR_INVALID_ARG;
        goto err_free;
    }
    if (!bench && !accuracy && !help && !version && args_p->bench_weights != NULL) {
        epd_config_textf(err, EPD_ERR_LEN, "--bench-weights only goes with --bench or --accuracy");
        status = EPD_ERR_INVALID_ARG;
        goto err_free;
    }
    return EPD_OK;

err_free:
    epd_args_free(args_p);
    return status;
}

void epd_args_free(epd_args_t *args)
{
    if (args == NULL) return;
    free(args->sets);
    memset(args, 0, sizeof *args);
}

void epd_args_print_usage(FILE *out, const char *argv0)
{
    const char *prog = argv0 && argv0[0] ? argv0 : "epd";
    fprintf(
        out,
        "Usage: mpirun [MPI options] %s [--config FILE] [--set KEY=VALUE]...\n"
        "       %s --print-config [--config FILE] [--set KEY=VALUE]...\n"
        "       mpirun [MPI options] %s --bench [--json] [--bench-tokens LIST] "
        "[--bench-iters N] [--bench-weights random|random-bf16|random-fp8]\n"
        "       mpirun [MPI options] %s --accuracy [--json] [--bench-tokens LIST] "
        "[--bench-iters N] [--bench-weights random|random-bf16|random-fp8]\n"
        "       %s --help | --version\n"
        "\n"
        "epd, the expert-parallel MoE dispatch daemon: every rank of an mpirun job runs it and\n"
        "serves SUBMIT frames on its own Unix socket (socket.path).\n"
        "\n"
        "Options:\n"
        "  --config FILE        read settings from a YAML file\n"
        "  --set KEY=VALUE      set one setting (repeatable; beats the file and the "
        "environment)\n"
        "  --print-config       print every setting with its value and origin, then exit "
        "(no MPI)\n"
        "  --bench              run synthetic steps without sockets and report timings\n"
        "  --accuracy           measure each wire format's error against an fp32 dispatch on\n"
        "                       synthetic activations, print a markdown table\n"
        "  --json               machine-readable --bench / --accuracy output\n"
        "  --bench-tokens LIST  tokens per rank per step to bench (--accuracy: default 512)\n"
        "  --bench-iters N      steps per --bench-tokens entry (--accuracy: default 2)\n"
        "  --bench-weights W    with experts.kind=ffn (--bench, --accuracy): synthetic weights\n"
        "                       at the configured shape (random: BF16 and FP8 block; else\n"
        "                       experts.weights is read)\n"
        "  -h, --help           this text\n"
        "  --version            print the version\n"
        "\n"
        "Stopping: send SIGUSR1 to mpirun (it forwards the signal and waits), or SIGTERM to\n"
        "the ranks themselves; every accepted request is answered before the ranks exit 0.\n"
        "SIGTERM or SIGINT to mpirun kills the ranks after about a second, cutting the drain.\n"
        "\n",
        prog, prog, prog, prog, prog);
    epd_config_print_help(out);
}
