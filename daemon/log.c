/* The daemon's line logger (see log.h): level filter, rank prefix, one write(2) per line. */
#include "daemon/log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static atomic_int log_rank = -1;
static atomic_int log_level = EPD_LOG_INFO;

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
    if (rank >= 0)
        n = snprintf(line, sizeof(line), "epd[rank %d] %s: ", rank, level_names[level]);
    else
        n = snprintf(line, sizeof(line), "epd: %s: ", level_names[level]);
    if (n < 0) return;

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
