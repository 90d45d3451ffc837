/* The quantization-error telemetry's counters and its part of the stats documents (see
 * quant_stats.h). */
#include "daemon/quant_stats.h"

#include <inttypes.h>
#include <math.h>

const char *epd_quant_dir_name(epd_quant_dir_t dir)
{
    return dir == EPD_QUANT_DISPATCH ? "dispatch" : dir == EPD_QUANT_COMBINE ? "combine" : "?";
}

double epd_quant_relative_rms(double err2, double ref2)
{
    return ref2 > 0.0 ? sqrt(err2 / ref2) : -1.0;
}

void epd_quant_stats_add(epd_quant_stats_t *stats, const epd_quant_error_t *step)
{
    const double err2[EPD_QUANT_DIRECTIONS] = {step->dispatch_err2, step->combine_err2};
    const double ref2[EPD_QUANT_DIRECTIONS] = {step->dispatch_ref2, step->combine_ref2};

    for (int d = 0; d < EPD_QUANT_DIRECTIONS; d++) {
        if (!(ref2[d] > 0.0)) continue;
        double rms = epd_quant_relative_rms(err2[d], ref2[d]);
        stats->steps[d]++;
        stats->last[d] = rms;
        if (rms > stats->max[d]) stats->max[d] = rms;
        stats->err2[d] += err2[d];
        stats->ref2[d] += ref2[d];
    }
}

/* Always a JSON number with an exponent (clients see one type): 0 until a step was measured
 * (steps says whether one was), and for a non-finite value (JSON has no NaN). */
static void json_number(FILE *f, double v, bool valid)
{
    fprintf(f, "%.6e", valid && isfinite(v) ? v : 0.0);
}

void epd_quant_stats_json(FILE *f, const epd_quant_stats_t *stats)
{
    fprintf(f, "\"quant_error\":{");
    for (int d = 0; d < EPD_QUANT_DIRECTIONS; d++) {
        bool seen = stats->steps[d] > 0;
        fprintf(f, "%s\"%s\":{\"steps\":%" PRIu64 ",\"last\":", d ? "," : "",
                epd_quant_dir_name((epd_quant_dir_t)d), stats->steps[d]);
        json_number(f, stats->last[d], seen);
        fprintf(f, ",\"max\":");
        json_number(f, stats->max[d], seen);
        fprintf(f, ",\"overall\":");
        json_number(f, epd_quant_relative_rms(stats->err2[d], stats->ref2[d]), seen);
        fprintf(f, "}");
    }
    fprintf(f, "}");
}

static void head(FILE *f, const char *name, const char *type, const char *help)
{
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

void epd_quant_stats_metrics(FILE *f, const epd_quant_stats_t *stats)
{
    head(f, "epd_quant_error_steps_total", "counter",
         "Steps whose FP8 quantization error was measured, by direction.");
    for (int d = 0; d < EPD_QUANT_DIRECTIONS; d++)
        fprintf(f, "epd_quant_error_steps_total{direction=\"%s\"} %" PRIu64 "\n",
                epd_quant_dir_name((epd_quant_dir_t)d), stats->steps[d]);
    head(f, "epd_quant_error_relative_rms", "gauge",
         "Relative RMS error of the FP8 data of the last measured step, by direction.");
    for (int d = 0; d < EPD_QUANT_DIRECTIONS; d++)
        fprintf(f, "epd_quant_error_relative_rms{direction=\"%s\"} %.9g\n",
                epd_quant_dir_name((epd_quant_dir_t)d), stats->last[d]);
    head(f, "epd_quant_error_relative_rms_max", "gauge",
         "Largest per-step relative RMS error of the FP8 data since start, by direction.");
    for (int d = 0; d < EPD_QUANT_DIRECTIONS; d++)
        fprintf(f, "epd_quant_error_relative_rms_max{direction=\"%s\"} %.9g\n",
                epd_quant_dir_name((epd_quant_dir_t)d), stats->max[d]);
    head(f, "epd_quant_error_squared_sum_total", "counter",
         "Sum of (x - dequant(q))^2 over the FP8 data, by direction.");
    for (int d = 0; d < EPD_QUANT_DIRECTIONS; d++)
        fprintf(f, "epd_quant_error_squared_sum_total{direction=\"%s\"} %.9g\n",
                epd_quant_dir_name((epd_quant_dir_t)d), stats->err2[d]);
    head(f, "epd_quant_reference_squared_sum_total", "counter",
         "Sum of x^2 over the FP8 data, by direction (the error's denominator).");
    for (int d = 0; d < EPD_QUANT_DIRECTIONS; d++)
        fprintf(f, "epd_quant_reference_squared_sum_total{direction=\"%s\"} %.9g\n",
                epd_quant_dir_name((epd_quant_dir_t)d), stats->ref2[d]);
}
