/* daemon/pinned.h. */
#include "daemon/pinned.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#define PINNED_MIN_SHIFT 16u /* 64 KiB, the smallest class */
#define PINNED_CLASSES 26u   /* up to 2^41 bytes */
#define PINNED_MAGIC 0x45504450u /* "EPDP" */
#define FROM_MALLOC UINT32_MAX
/* Below this a buffer comes from malloc (a frame without tensors worth copying); from it up, a
 * 64 KiB block at least: a one-token request's x or y (14 KiB at H 7168) is copied to and from
 * the device by DMA only from page-locked memory, and written there by the step directly. */
#define PINNED_SMALL 4096u

/* In front of every buffer; 64 bytes so that what follows stays 64-byte aligned in a block. */
typedef struct header {
    uint32_t magic;
    uint32_t cls; /* size class, or FROM_MALLOC */
    epd_pinned_pool_t *pool;
    struct header *next; /* on the class's free list */
    uint8_t pad[40];
} header_t;

_Static_assert(sizeof(header_t) == 64, "the header keeps buffers 64-byte aligned");

struct epd_pinned_pool {
    const epd_ops_t *ops;
    epd_ops_ctx_t *ops_ctx;
    uint64_t max_bytes;
    pthread_mutex_t mu;
    uint64_t bytes;                   /* in blocks, under mu */
    header_t *free_list[PINNED_CLASSES]; /* under mu */
};

epd_pinned_pool_t *epd_pinned_pool_create(const epd_ops_t *ops, epd_ops_ctx_t *ops_ctx,
                                          uint64_t max_bytes)
{
    epd_pinned_pool_t *pool = calloc(1, sizeof *pool);
    if (pool == NULL) return NULL;
    pool->ops = ops;
    pool->ops_ctx = ops_ctx;
    /* host ops copy with memcpy: pageable memory is as fast there, and malloc gives it back */
    pool->max_bytes = ops != NULL && ops->device_memory && ops->alloc_host != NULL ? max_bytes : 0;
    pthread_mutex_init(&pool->mu, NULL);
    return pool;
}

void epd_pinned_pool_free(epd_pinned_pool_t *pool)
{
    if (pool == NULL) return;
    for (uint32_t c = 0; c < PINNED_CLASSES; c++) {
        for (header_t *h = pool->free_list[c]; h != NULL;) {
            header_t *next = h->next;
            pool->ops->free_host(pool->ops_ctx, h);
            h = next;
        }
    }
    pthread_mutex_destroy(&pool->mu);
    free(pool);
}

static size_t class_bytes(uint32_t cls)
{
    return (size_t)1 << (PINNED_MIN_SHIFT + cls);
}

static void *from_malloc(size_t bytes)
{
    if (bytes > SIZE_MAX - sizeof(header_t)) return NULL;
    header_t *h = malloc(sizeof *h + bytes);
    if (h == NULL) return NULL;
    h->magic = PINNED_MAGIC;
    h->cls = FROM_MALLOC;
    h->pool = NULL;
    h->next = NULL;
    return h + 1;
}

void *epd_pinned_alloc(epd_pinned_pool_t *pool, size_t bytes)
{
    if (pool == NULL || pool->max_bytes == 0 || bytes + sizeof(header_t) < bytes ||
        bytes < PINNED_SMALL)
        return from_malloc(bytes);
    uint32_t cls = 0;
    while (cls < PINNED_CLASSES && class_bytes(cls) < bytes + sizeof(header_t)) cls++;
    if (cls == PINNED_CLASSES) return from_malloc(bytes);

    pthread_mutex_lock(&pool->mu);
    header_t *h = pool->free_list[cls];
    if (h != NULL) {
        pool->free_list[cls] = h->next;
        pthread_mutex_unlock(&pool->mu);
        h->next = NULL;
        return h + 1;
    }
    bool room = pool->bytes + class_bytes(cls) <= pool->max_bytes;
    if (room) pool->bytes += class_bytes(cls); /* reserved while the block is made */
    pthread_mutex_unlock(&pool->mu);
    if (!room) return from_malloc(bytes);

    h = pool->ops->alloc_host(pool->ops_ctx, class_bytes(cls));
    if (h == NULL) {
        pthread_mutex_lock(&pool->mu);
        pool->bytes -= class_bytes(cls);
        pthread_mutex_unlock(&pool->mu);
        return from_malloc(bytes);
    }
    h->magic = PINNED_MAGIC;
    h->cls = cls;
    h->pool = pool;
    h->next = NULL;
    return h + 1;
}

static header_t *header_of(void *p)
{
    header_t *h = (header_t *)p - 1;
    /* a buffer from anywhere else is a bug in the daemon, not an input: stop here */
    if (h->magic != PINNED_MAGIC) abort();
    return h;
}

void *epd_pinned_resize(epd_pinned_pool_t *pool, void *p, size_t keep, size_t bytes)
{
    if (p != NULL) {
        header_t *h = header_of(p);
        if (h->cls != FROM_MALLOC && class_bytes(h->cls) - sizeof(header_t) >= bytes) return p;
        if (h->cls == FROM_MALLOC && (pool == NULL || pool->max_bytes == 0)) {
            if (bytes > SIZE_MAX - sizeof(header_t)) return NULL;
            header_t *g = realloc(h, sizeof *h + bytes); /* large blocks move by mremap */
            return g != NULL ? g + 1 : NULL;
        }
    }
    void *q = epd_pinned_alloc(pool, bytes);
    if (q == NULL) return NULL;
    if (p != NULL) {
        memcpy(q, p, keep < bytes ? keep : bytes);
        epd_pinned_release(p);
    }
    return q;
}

void epd_pinned_release(void *p)
{
    if (p == NULL) return;
    header_t *h = header_of(p);
    if (h->cls == FROM_MALLOC) {
        h->magic = 0;
        free(h);
        return;
    }
    epd_pinned_pool_t *pool = h->pool;
    pthread_mutex_lock(&pool->mu);
    h->next = pool->free_list[h->cls];
    pool->free_list[h->cls] = h;
    pthread_mutex_unlock(&pool->mu);
}

uint64_t epd_pinned_pool_bytes(epd_pinned_pool_t *pool)
{
    if (pool == NULL) return 0;
    pthread_mutex_lock(&pool->mu);
    uint64_t bytes = pool->bytes;
    pthread_mutex_unlock(&pool->mu);
    return bytes;
}
