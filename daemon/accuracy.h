/* `epd --accuracy`: what each wire format costs in accuracy (DESIGN.md section 3), measured on
 * synthetic activations shaped like a real model's, through the same step the daemon runs,
 * against an fp32 dispatch of the same tokens. The table docs/accuracy.md shows. */
#ifndef EPD_DAEMON_ACCURACY_H
#define EPD_DAEMON_ACCURACY_H

#include "config/config.h"

/* Runs the study on every rank of MPI_COMM_WORLD (MPI initialized by the caller with
 * MPI_THREAD_SERIALIZED; the caller finalizes): for each set of experts (the toy kind; for ffn,
 * each --bench-weights format generated, or experts.weights), each --bench-tokens entry (tokens
 * per rank per step, default 512) and --bench-iters steps (default 2), every mode, on the
 * configured shape, ops and transport. Rank 0 prints a markdown table each, or one JSON object
 * per line with --json. Returns the exit code: 0, or 2 for a bad setting or argument (ffn
 * without weights, --bench-weights without ffn, too many tokens); weights that do not load and
 * a failed step abort the job (exit 3) naming the rank and why. */
int epd_accuracy_run(const epd_args_t *args);

#endif
