/* epd's entry point: the command line, the actions that need no MPI (--help, --version,
 * --print-config), and MPI_Init_thread / MPI_Finalize around the daemon and the benchmark. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#include "config/config.h"
#include "daemon/accuracy.h"
#include "daemon/bench.h"
#include "daemon/daemon.h"

#ifndef EPD_VERSION
#define EPD_VERSION "unknown"
#endif

static void print_warning(void *arg, const char *message)
{
    fprintf(stderr, "epd: warning: %s\n", message);
}

/* --print-config: every setting with its value and origin; no MPI, exit 2 on a bad setting. */
static int print_config(const epd_args_t *args)
{
    epd_config_state_t *state = NULL;
    char err[EPD_ERR_LEN];

    if (epd_daemon_load_config(args, print_warning, NULL, &state, err) != EPD_OK) {
        fprintf(stderr, "epd: %s\n", err);
        return 2;
    }
    epd_config_print(state, stdout);
    epd_config_state_free(state);
    return fflush(stdout) == 0 ? 0 : 1;
}

/* RUN, BENCH and ACCURACY: all step through MPI (the daemon with two threads, event loop and
 * engine, taking turns). */
static int run_mpi(int argc, char **argv, const epd_args_t *args)
{
    int provided = MPI_THREAD_SINGLE;
    int rc;

    if (MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
        fprintf(stderr, "epd: MPI_Init_thread failed\n");
        return 1;
    }
    if (provided < MPI_THREAD_SERIALIZED) {
        fprintf(stderr, "epd: this MPI library provides thread level %d, but epd needs "
                "MPI_THREAD_SERIALIZED (%d): its event loop and engine thread both call MPI, "
                "one at a time\n", provided, MPI_THREAD_SERIALIZED);
        MPI_Finalize();
        return 1;
    }
    if (args->action == EPD_ACTION_BENCH)
        rc = epd_bench_run(args);
    else if (args->action == EPD_ACTION_ACCURACY)
        rc = epd_accuracy_run(args);
    else
        rc = epd_daemon_run(args);
    MPI_Finalize();
    return rc;
}

int main(int argc, char **argv)
{
    epd_args_t args;
    char err[EPD_ERR_LEN];
    int rc = 0;

    if (epd_args_parse(argc, argv, &args, err) != EPD_OK) {
        fprintf(stderr, "epd: %s (see epd --help)\n", err);
        return 2;
    }
    switch (args.action) {
    case EPD_ACTION_HELP:
        epd_args_print_usage(stdout, argv[0]);
        break;
    case EPD_ACTION_VERSION:
        printf("epd %s\n", EPD_VERSION);
        break;
    case EPD_ACTION_PRINT_CONFIG:
        rc = print_config(&args);
        break;
    case EPD_ACTION_RUN:
    case EPD_ACTION_BENCH:
    case EPD_ACTION_ACCURACY:
        rc = run_mpi(argc, argv, &args);
        break;
    }
    epd_args_free(&args);
    return rc;
}
