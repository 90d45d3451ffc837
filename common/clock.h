/* The monotonic clock every part of epd times with (CLOCK_MONOTONIC, in nanoseconds). */
#ifndef EPD_COMMON_CLOCK_H
#define EPD_COMMON_CLOCK_H

#include <stdint.h>
#include <time.h>

/* Nanoseconds on CLOCK_MONOTONIC: for intervals and deadlines, never for wall time. */
static inline uint64_t epd_now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

#endif
