/* A pool of page-locked host buffers for frame payloads and results (socket.pinned_bytes).
 * Copies between the device and pageable memory run at a few GB/s through the driver's own
 * staging; from page-locked memory they run at DMA speed. Page-locking is slow (cudaMallocHost:
 * milliseconds), so blocks are kept and reused: one free list per power-of-two size class from
 * 64 KiB up, never given back before the pool is freed. Below 4 KiB, or once the pool holds
 * socket.pinned_bytes, buffers come from malloc. Every buffer carries a small header naming where
 * it came from, so epd_pinned_release takes any of them. Thread-safe (the loop thread allocates
 * payloads, the worker results; either side releases). */
#ifndef EPD_DAEMON_PINNED_H
#define EPD_DAEMON_PINNED_H

#include <stddef.h>
#include <stdint.h>

#include "gpu/ops.h"

typedef struct epd_pinned_pool epd_pinned_pool_t;

/* A pool allocating through ops->alloc_host (page-locked with CUDA ops), at most max_bytes of
 * blocks in all; with ops that are not device memory (host ops), or max_bytes 0, every buffer
 * comes from malloc. NULL without memory. */
epd_pinned_pool_t *epd_pinned_pool_create(const epd_ops_t *ops, epd_ops_ctx_t *ops_ctx,
                                          uint64_t max_bytes);

/* Frees every cached block. Every buffer must have been released. */
void epd_pinned_pool_free(epd_pinned_pool_t *pool);

/* A buffer of at least bytes (16-byte aligned); NULL without memory. pool may be NULL (malloc). */
void *epd_pinned_alloc(epd_pinned_pool_t *pool, size_t bytes);

/* A buffer of at least bytes holding the first keep bytes of p (which it releases), as realloc;
 * NULL without memory (p is left as it was). p may be NULL. */
void *epd_pinned_resize(epd_pinned_pool_t *pool, void *p, size_t keep, size_t bytes);

/* Gives a buffer of epd_pinned_alloc/resize back (NULL: nothing). */
void epd_pinned_release(void *p);

/* Bytes of page-locked blocks the pool holds (in use or cached). */
uint64_t epd_pinned_pool_bytes(epd_pinned_pool_t *pool);

#endif
