/* daemon/trace.h: a fixed table of samples, filled until it is full (the first requests of a
 * benchmark after its warm-up are as good as any). */
#include "daemon/trace.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/log.h"

#define TRACE_MAX 65536

enum { T_ARRIVE, T_DECODE, T_VALIDATE, T_INGEST, T_QUEUE, T_GATHER, T_STEP, T_Y, T_HAND, T_HANDOVER, T_DELIVER, T_TOTAL, T_N };

static const char *const names[T_N] = {
    [T_ARRIVE] = "recv(2) -> frame read",
    [T_DECODE] = "  of which the decoder",
    [T_VALIDATE] = "read -> queued (validate, ingest)",
    [T_INGEST] = "  of which the device (kernel, sync)",
    [T_QUEUE] = "queued -> taken by a step",
    [T_GATHER] = "taken -> step begins (gather, copies)",
    [T_STEP] = "step (epd_step_run)",
    [T_Y] = "step end -> y out, synced",
    [T_HAND] = "y out -> handed to the loop",
    [T_HANDOVER] = "handed -> loop thread has it",
    [T_DELIVER] = "loop thread -> RESULT written",
    [T_TOTAL] = "read -> RESULT written",
};

static int trace_state; /* 0 not read, 1 on, -1 off */
static uint32_t trace_every; /* EPD_TRACE=N > 1: report after every N requests */
static uint32_t n_samples;
static uint32_t *samples[T_N]; /* ns, saturated at 4 s */
/* EPD_TRACE_TIMES=FILE: every traced request's times, one line each (id, then CLOCK_MONOTONIC
 * ns: recv, read, queued, taken, step begins, step ends, done, handed, delivered, written), to
 * line up with a client's own (epctl bench does the same under EPD_BENCH_TIMES) */
static FILE *times;

bool epd_trace_on(void)
{
    if (trace_state == 0) {
        const char *v = getenv("EPD_TRACE");
        trace_state = v != NULL && v[0] != '\0' && strcmp(v, "0") != 0 ? 1 : -1;
        if (trace_state > 0) {
            long every = strtol(v, NULL, 10);
            trace_every = every > 1 && every <= TRACE_MAX ? (uint32_t)every : 0;
            const char *path = getenv("EPD_TRACE_TIMES");
            if (path != NULL && path[0] != '\0') times = fopen(path, "w");
        }
    }
    return trace_state > 0;
}

static uint32_t span(uint64_t from, uint64_t to)
{
    if (from == 0 || to < from) return 0;
    uint64_t d = to - from;
    return d > UINT32_MAX ? UINT32_MAX : (uint32_t)d;
}

void epd_trace_result(const epd_result_t *r, uint64_t delivered_ns, uint64_t written_ns)
{
    if (!epd_trace_on() || r->status != 0 || n_samples >= TRACE_MAX) return;
    if (samples[0] == NULL) {
        for (int i = 0; i < T_N; i++) {
            samples[i] = calloc(TRACE_MAX, sizeof(uint32_t));
            if (samples[i] == NULL) {
                trace_state = -1;
                return;
            }
        }
    }
    uint32_t at = n_samples++;
    samples[T_ARRIVE][at] = span(r->arrived_ns, r->read_ns);
    samples[T_DECODE][at] = span(r->arrived_ns, r->decoded_ns);
    samples[T_VALIDATE][at] = span(r->read_ns, r->enqueued_ns);
    samples[T_INGEST][at] = r->ingest_ns > UINT32_MAX ? UINT32_MAX : (uint32_t)r->ingest_ns;
    samples[T_QUEUE][at] = span(r->enqueued_ns, r->taken_ns);
    samples[T_GATHER][at] = span(r->taken_ns, r->step_begin_ns);
    samples[T_STEP][at] = span(r->step_begin_ns, r->step_end_ns);
    samples[T_Y][at] = span(r->step_end_ns, r->done_ns);
    samples[T_HAND][at] = span(r->done_ns, r->handed_ns);
    samples[T_HANDOVER][at] = span(r->handed_ns, delivered_ns);
    samples[T_DELIVER][at] = span(delivered_ns, written_ns);
    samples[T_TOTAL][at] = span(r->read_ns, written_ns);
    if (times != NULL)
        fprintf(times,
                "%" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64
                " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 "\n",
                r->id, r->arrived_ns, r->read_ns, r->enqueued_ns, r->taken_ns, r->step_begin_ns,
                r->step_end_ns, r->done_ns, r->handed_ns, delivered_ns, written_ns);
    if (trace_every != 0 && n_samples == trace_every) epd_trace_report();
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

void epd_trace_report(void)
{
    if (n_samples == 0) return;
    epd_log_info("trace: %u requests (us: p10 p50 p90 p99)", n_samples);
    for (int i = 0; i < T_N; i++) {
        uint32_t *s = samples[i];
        qsort(s, n_samples, sizeof *s, cmp_u32);
#define PCT(p) ((double)s[(size_t)((n_samples - 1) * (p) / 100)] / 1000.0)
        epd_log_info("trace: %-36s %8.1f %8.1f %8.1f %8.1f", names[i], PCT(10), PCT(50), PCT(90),
                     PCT(99));
#undef PCT
    }
    n_samples = 0;
    if (times != NULL) fflush(times);
}
