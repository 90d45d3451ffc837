/* The daemon's line logger (see log.h): level filter, timestamp or journald priority, rank prefix,
 * one write(2) per line. Under systemd the ranks' stderr is a pipe to mpirun, which copies their
 * lines to its own stderr, the journal stream: so JOURNAL_STREAM (inherited from mpirun) being set
 * is the sign, not a match of its device:inode with our stderr as a lone process would check. */
#include "daemon/log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static atomic_int log_rank = -1;
static atomic_int log_level = EPD_LOG_INFO;
static atomic_int log_style = EPD_LOG_STYLE_AUTO;

/* syslog(3) priorities, as journald reads them from a "<N>" prefix */
static const int level_priorities[] = {
    [EPD_LOG_ERROR] = 3,
    [EPD_LOG_WARN] = 4,
    [EPD_LOG_INFO] = 6,
    [EPD_LOG_DEBUG] = 7,
};

static const char *const level_names[] = {
    [EPD_LOG_ERROR] = "ERROR",
    [EPD_LOG_WARN] = "WARN",
    [EPD_LOG_INFO] = "INFO",
    [EPD_LOG_DEBUG] = "DEBUG",
};

void epd_log_init(int rank, epd_log_level_t level)
{
    atomic_store(&log_rank, rank);
    atomic_store(&log_level, (int)level);
}

void epd_log_set_style(epd_log_style_t style)
{
    atomic_store(&log_style, (int)style);
}

static epd_log_style_t style_now(void)
{
    int style = atomic_load(&log_style);
    if (style != EPD_LOG_STYLE_AUTO) return (epd_log_style_t)style;
    const char *journal = getenv("JOURNAL_STREAM");
    style = journal != NULL && journal[0] != '\0' ? EPD_LOG_STYLE_JOURNAL : EPD_LOG_STYLE_TIMESTAMP;
    atomic_store(&log_style, style);
    return (epd_log_style_t)style;
}

/* "2026-12-01T09:21:08.123456Z " into buf; its length. */
static int timestamp(char *buf, size_t len)
{
    struct timespec ts;
    struct tm tm;
    char date[32];

    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%S", &tm);
    return snprintf(buf, len, "%s.%06ldZ ", date, ts.tv_nsec / 1000);
}

void epd_log_set_level(epd_log_level_t level)
{
    atomic_store(&log_level, (int)level);
}

bool epd_log_enabled(epd_log_level_t level)
{
    return (int)level <= atomic_load(&log_level);
}

void epd_log(epd_log_level_t level, const char *fmt, ...)
{
    char line[2048];
    int rank = atomic_load(&log_rank);
    int n;
    va_list ap;

    if (!epd_log_enabled(level)) return;
    if ((unsigned)level >= EPD_ARRAY_SIZE(level_names)) level = EPD_LOG_ERROR;
    if (style_now() == EPD_LOG_STYLE_JOURNAL)
        n = snprintf(line, sizeof(line), "<%d>", level_priorities[level]);
    else
        n = timestamp(line, sizeof(line));
    if (n < 0) return;
    int p;
    if (rank >= 0)
        p = snprintf(line + n, sizeof(line) - (size_t)n, "epd[rank %d] %s: ", rank,
                     level_names[level]);
    else
        p = snprintf(line + n, sizeof(line) - (size_t)n, "epd: %s: ", level_names[level]);
    if (p < 0) return;
    n += p;

    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
    va_end(ap);
    if (m < 0) m = 0;
    size_t len = (size_t)n + (size_t)m;
    if (len > sizeof(line) - 2) {
        len = sizeof(line) - 5;
        memcpy(line + len, "...", 3);
        len += 3;
    }
    /* One line per event: embedded newlines would split it. */
    for (size_t i = (size_t)n; i < len; i++)
        if (line[i] == '\n' || line[i] == '\r') line[i] = ' ';
    line[len++] = '\n';

    size_t off = 0;
    while (off < len) {
        ssize_t w = write(STDERR_FILENO, line + off, len - off);
        if (w <= 0) break;
        off += (size_t)w;
    }
}
