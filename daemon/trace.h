/* Request tracing for latency work (EPD_TRACE=1 in the environment): each answered request's
 * times through the daemon (frame read, queued, taken by a step, step done, result handed to
 * the loop, RESULT written to the socket), summarized as percentiles in the log at exit. Off, it
 * costs one branch per request. Not a metric: the Prometheus histograms are for operators; this
 * is for whoever profiles the daemon (docs/results.md says how it was used). */
#ifndef EPD_DAEMON_TRACE_H
#define EPD_DAEMON_TRACE_H

#include <stdbool.h>
#include <stdint.h>

#include "daemon/engine.h"

/* Reads EPD_TRACE once; true when tracing. EPD_TRACE=N (N > 1) reports after every N requests. */
bool epd_trace_on(void);

/* The result's RESULT frame was queued to its connection at written_ns. */
void epd_trace_result(const epd_result_t *result, uint64_t delivered_ns, uint64_t written_ns);

/* Logs the percentiles of every interval (info level) and starts over. */
void epd_trace_report(void);

#endif
