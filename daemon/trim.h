/* Giving memory back after a burst (DESIGN.md section 8): glibc keeps freed heap memory in the
 * process (fragmented arenas, a raised mmap threshold), so a rank that served a burst of big
 * frames would keep its peak RSS. Once the daemon is quiet again after moving enough bytes, it
 * calls malloc_trim(0), which returns the free pages of every arena. Loop thread only. */
#ifndef EPD_DAEMON_TRIM_H
#define EPD_DAEMON_TRIM_H

#include <stdbool.h>
#include <stdint.h>

/* Bytes moved (in and out) since the last trim that make a burst worth trimming after. */
#define EPD_TRIM_AFTER_BYTES (UINT64_C(64) << 20)

typedef struct epd_trim {
    uint64_t moved_at_trim;  /* the byte count at the last trim */
    uint64_t moved_last;     /* the byte count at the previous look */
} epd_trim_t;

/* Called every housekeeping period with the bytes moved since start and whether anything is
 * still held (queued requests, unfinished frames): trims when a burst has passed, that is, when
 * at least EPD_TRIM_AFTER_BYTES moved since the last trim, nothing moved since the previous look
 * and nothing is held. Returns true when it trimmed. */
bool epd_trim_tick(epd_trim_t *trim, uint64_t moved, bool holding);

#endif
