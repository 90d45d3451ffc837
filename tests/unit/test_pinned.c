/* Unit tests of daemon/pinned.c: blocks are reused by size class, the cap sends the rest to
 * malloc, resize keeps the bytes, and host ops (not device memory) never pool. The ops here
 * count their "page-locked" allocations (malloc behind them). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "daemon/pinned.h"

static int n_alloc_host, n_free_host;

static void *count_alloc_host(epd_ops_ctx_t *ctx, size_t bytes)
{
    (void)ctx;
    n_alloc_host++;
    return malloc(bytes);
}

static void count_free_host(epd_ops_ctx_t *ctx, void *p)
{
    (void)ctx;
    n_free_host++;
    free(p);
}

static const epd_ops_t device_ops = {
    .name = "counting",
    .device_memory = true,
    .alloc_host = count_alloc_host,
    .free_host = count_free_host,
};

static const epd_ops_t host_ops = {
    .name = "host",
    .device_memory = false,
    .alloc_host = count_alloc_host,
    .free_host = count_free_host,
};

static int setup(void **state)
{
    (void)state;
    n_alloc_host = n_free_host = 0;
    return 0;
}

static void test_reuse_by_class(void **state)
{
    (void)state;
    epd_pinned_pool_t *pool = epd_pinned_pool_create(&device_ops, NULL, 64u << 20);
    assert_non_null(pool);
    uint8_t *a = epd_pinned_alloc(pool, 1800000);
    assert_non_null(a);
    assert_int_equal((uintptr_t)a % 16, 0);
    memset(a, 0xab, 1800000);
    assert_int_equal(n_alloc_host, 1);
    assert_int_equal(epd_pinned_pool_bytes(pool), 2u << 20);
    epd_pinned_release(a);
    /* the same class again: the cached block, no new allocation */
    uint8_t *b = epd_pinned_alloc(pool, 1500000);
    assert_ptr_equal(a, b);
    assert_int_equal(n_alloc_host, 1);
    /* another class while b is out: a second block */
    uint8_t *c = epd_pinned_alloc(pool, 100000);
    assert_non_null(c);
    assert_int_equal(n_alloc_host, 2);
    epd_pinned_release(b);
    epd_pinned_release(c);
    /* small buffers come from malloc, from 4 KiB up a 64 KiB block (the first class) */
    void *small = epd_pinned_alloc(pool, 4095);
    assert_non_null(small);
    assert_int_equal(n_alloc_host, 2);
    epd_pinned_release(small);
    void *token = epd_pinned_alloc(pool, 14336); /* one token's y at H 7168 */
    assert_non_null(token);
    assert_int_equal(n_alloc_host, 3);
    epd_pinned_release(token);
    epd_pinned_pool_free(pool);
    assert_int_equal(n_free_host, 3);
}

static void test_cap_falls_back_to_malloc(void **state)
{
    (void)state;
    epd_pinned_pool_t *pool = epd_pinned_pool_create(&device_ops, NULL, 4u << 20);
    void *a = epd_pinned_alloc(pool, 3u << 20); /* a 4 MiB block: the whole cap */
    void *b = epd_pinned_alloc(pool, 3u << 20); /* over the cap: malloc */
    assert_non_null(a);
    assert_non_null(b);
    assert_int_equal(n_alloc_host, 1);
    assert_int_equal(epd_pinned_pool_bytes(pool), 4u << 20);
    memset(b, 1, 3u << 20);
    epd_pinned_release(b);
    epd_pinned_release(a);
    epd_pinned_pool_free(pool);
    assert_int_equal(n_free_host, 1);
}

static void test_resize_keeps_bytes(void **state)
{
    (void)state;
    epd_pinned_pool_t *pool = epd_pinned_pool_create(&device_ops, NULL, 64u << 20);
    uint8_t *p = epd_pinned_resize(pool, NULL, 0, 64u << 10);
    assert_non_null(p);
    for (size_t i = 0; i < (64u << 10); i++) p[i] = (uint8_t)(i * 7);
    uint8_t *q = epd_pinned_resize(pool, p, 64u << 10, 1u << 20);
    assert_non_null(q);
    for (size_t i = 0; i < (64u << 10); i++) assert_int_equal(q[i], (uint8_t)(i * 7));
    /* within its block already: the same buffer */
    assert_ptr_equal(epd_pinned_resize(pool, q, 1u << 20, 900000), q);
    epd_pinned_release(q);
    epd_pinned_pool_free(pool);
}

static void test_host_ops_never_pool(void **state)
{
    (void)state;
    epd_pinned_pool_t *pool = epd_pinned_pool_create(&host_ops, NULL, 64u << 20);
    uint8_t *p = epd_pinned_resize(pool, NULL, 0, 1u << 20);
    assert_non_null(p);
    memset(p, 3, 1u << 20);
    p = epd_pinned_resize(pool, p, 1u << 20, 8u << 20);
    assert_non_null(p);
    assert_int_equal(p[(1u << 20) - 1], 3);
    epd_pinned_release(p);
    assert_int_equal(n_alloc_host, 0);
    assert_int_equal(epd_pinned_pool_bytes(pool), 0);
    epd_pinned_pool_free(pool);
    /* and without a pool at all */
    void *q = epd_pinned_alloc(NULL, 1u << 20);
    assert_non_null(q);
    epd_pinned_release(q);
    epd_pinned_release(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_reuse_by_class, setup),
        cmocka_unit_test_setup(test_cap_falls_back_to_malloc, setup),
        cmocka_unit_test_setup(test_resize_keeps_bytes, setup),
        cmocka_unit_test_setup(test_host_ops_never_pool, setup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
