/* The daemon's log: one line per event on stderr, written with one write(2) so lines from the
 * loop and engine threads never interleave:
 *   2026-12-01T09:21:08.123456Z epd[rank R] LEVEL: message     (RFC 3339, UTC, microseconds)
 *   <N>epd[rank R] LEVEL: message                              (JOURNAL_STREAM set: journald)
 * where <N> is the syslog priority (3 error, 4 warning, 6 info, 7 debug) that journald strips and
 * stores, so `journalctl -p err` finds errors; journald stamps the time itself. Before the rank is
 * known lines read `epd: LEVEL: message`. Only daemon code logs; leaf modules return errors. */
#ifndef EPD_DAEMON_LOG_H
#define EPD_DAEMON_LOG_H

#include <stdbool.h>

#include "config/config.h"

/* How lines start: chosen from the environment (journal when JOURNAL_STREAM is set, else
 * timestamp) unless set with epd_log_set_style. */
typedef enum {
    EPD_LOG_STYLE_AUTO = 0,
    EPD_LOG_STYLE_TIMESTAMP,
    EPD_LOG_STYLE_JOURNAL,
} epd_log_style_t;

void epd_log_set_style(epd_log_style_t style);

/* Sets the rank shown in every line (-1: not known yet) and the lowest level printed. */
void epd_log_init(int rank, epd_log_level_t level);

/* Changes the lowest level printed (e.g. once the configuration is loaded). */
void epd_log_set_level(epd_log_level_t level);

/* True when a line of this level would be printed (to skip building costly messages). */
bool epd_log_enabled(epd_log_level_t level);

/* Prints one line at level (a trailing newline in fmt is not needed). Thread-safe. */
void epd_log(epd_log_level_t level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define epd_log_error(...) epd_log(EPD_LOG_ERROR, __VA_ARGS__)
#define epd_log_warn(...) epd_log(EPD_LOG_WARN, __VA_ARGS__)
#define epd_log_info(...)                                     \
    do {                                                      \
        if (epd_log_enabled(EPD_LOG_INFO)) epd_log(EPD_LOG_INFO, __VA_ARGS__); \
    } while (0)
#define epd_log_debug(...)                                    \
    do {                                                      \
        if (epd_log_enabled(EPD_LOG_DEBUG)) epd_log(EPD_LOG_DEBUG, __VA_ARGS__); \
    } while (0)

#endif
