/* The one pseudo-random generator of epd's tools, benchmarks and tests: splitmix64 (Steele,
 * Lea, Flood 2014). Deterministic for a seed on every platform, so a failing case can be replayed;
 * header-only so CUDA test files can use it too. Not for anything that needs secrecy. */
#ifndef EPD_COMMON_RNG_H
#define EPD_COMMON_RNG_H

#include <stdint.h>

/* splitmix64's output function on z, without advancing any state: a hash of z. */
static inline uint64_t epd_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Advances *state and returns the next 64 random bits. */
static inline uint64_t epd_rng_next(uint64_t *state)
{
    return epd_mix64(*state += 0x9e3779b97f4a7c15ull);
}

/* A hash of z: the value splitmix64 gives after one step from z (counter-based draws). */
static inline uint64_t epd_rng_hash(uint64_t z)
{
    return epd_mix64(z + 0x9e3779b97f4a7c15ull);
}

/* Uniform in [0, 1) with 24 random bits (the spacing of a float's mantissa). */
static inline float epd_rng_unit_f32(uint64_t *state)
{
    return (float)((double)(epd_rng_next(state) >> 40) / 16777216.0);
}

/* Uniform in [0, 1) with 53 random bits. */
static inline double epd_rng_unit_f64(uint64_t *state)
{
    return (double)(epd_rng_next(state) >> 11) * (1.0 / 9007199254740992.0);
}

#endif
