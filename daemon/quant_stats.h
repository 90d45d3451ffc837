/* The live quantization-error telemetry (telemetry.quant_error): each step's relative RMS error
 * of what the rank quantized (the FP8 dispatch records it packed, the FP8 partials its experts
 * wrote), folded into counters and gauges, and their part of the `stats` JSON and the metrics
 * text. Leaf module: no logging, no I/O beyond the FILE it is given. */
#ifndef EPD_DAEMON_QUANT_STATS_H
#define EPD_DAEMON_QUANT_STATS_H

#include <stdint.h>
#include <stdio.h>

#include "gpu/ops.h"

/* The two directions of a step that can be quantized. */
typedef enum { EPD_QUANT_DISPATCH = 0, EPD_QUANT_COMBINE, EPD_QUANT_DIRECTIONS } epd_quant_dir_t;

typedef struct epd_quant_stats {
    uint64_t steps[EPD_QUANT_DIRECTIONS]; /* steps that quantized something in this direction */
    double last[EPD_QUANT_DIRECTIONS];    /* relative RMS error of the last such step */
    double max[EPD_QUANT_DIRECTIONS];     /* the largest per-step relative RMS error */
    double err2[EPD_QUANT_DIRECTIONS];    /* sum over steps of sum (x - dequant(q))^2 */
    double ref2[EPD_QUANT_DIRECTIONS];    /* ... of sum x^2: sqrt(err2/ref2) over all steps */
} epd_quant_stats_t;

/* The direction's name in documents: "dispatch", "combine". */
const char *epd_quant_dir_name(epd_quant_dir_t dir);

/* Relative RMS error sqrt(err2 / ref2) of one step's sums, or -1 when nothing was quantized
 * (ref2 == 0: telemetry off, a BF16 direction, or nothing sent). */
double epd_quant_relative_rms(double err2, double ref2);

/* Folds one step's sums (epd_step_timing_t.quant_error) into stats: a direction whose ref2 is 0
 * is left as it was. This is the one place a per-step value is observed. */
void epd_quant_stats_add(epd_quant_stats_t *stats, const epd_quant_error_t *step);

/* Writes `"quant_error":{"dispatch":{...},"combine":{...}}` (no separator around it): per
 * direction steps, last, max and overall relative RMS (null before the first step). */
void epd_quant_stats_json(FILE *f, const epd_quant_stats_t *stats);

/* Writes the Prometheus lines, with HELP and TYPE: epd_quant_error_steps_total,
 * epd_quant_error_relative_rms (last step), epd_quant_error_relative_rms_max (gauges) and
 * epd_quant_error_squared_sum_total / epd_quant_reference_squared_sum_total (counters, whose
 * rate ratio's square root is the error over a window), each labelled direction. */
void epd_quant_stats_metrics(FILE *f, const epd_quant_stats_t *stats);

#endif
