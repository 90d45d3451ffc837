/* `epd --bench`: synthetic steps without sockets, on the configured shape, ops and transport,
 * for each tokens-per-rank count and both wire dtypes, with per-phase times beside a raw
 * alltoallv of the same bytes measured in the same run (DESIGN.md section 10). */
#ifndef EPD_DAEMON_BENCH_H
#define EPD_DAEMON_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include "config/config.h"
#include "gpu/ops.h"

/* Runs the benchmark on every rank of MPI_COMM_WORLD (MPI is initialized by the caller with
 * MPI_THREAD_SERIALIZED; the caller finalizes). The configuration comes from args like the
 * daemon's; rank 0 prints a table, or one JSON object per line with --json. Returns the exit
 * code: 0, 2 for a bad setting or argument. A failure in the middle of a step aborts the job. */
int epd_bench_run(const epd_args_t *args);

/* The ffn experts bench (daemon/bench_ffn.c), run by epd_bench_run for experts.kind = ffn: the
 * experts op alone on one rank with ops (device device_id) for each of sizes tokens, with the
 * same-run dense GEMM and weight-read baselines and the accuracy against the host reference.
 * Returns the exit code (2 for a bad setting, 3 when the weights cannot be made or loaded). */
int epd_bench_ffn(const epd_config_t *cfg, const epd_args_t *args, const epd_ops_t *ops,
                  int device_id, int world, const uint32_t *sizes, size_t n_sizes,
                  uint32_t iters);

#endif
