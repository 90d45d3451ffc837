/* Unit tests of comm/transport_staged.c at world = 1 (MPI singleton): init refuses ops without
 * async hooks and a bad EPD_TEST_STAGED_CHUNK, the self block is copied with its displacements,
 * bad counts are refused with a message, and can_use serves device memory only. Multi-rank
 * chunking is tests/integration/transport_staged.sh. Runs on the host ops, whose async copies
 * complete at once. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <mpi.h>

#include "comm/transport_staged.h"
#include "gpu/ops.h"
#include "tests/unit/mpi_main.h"

static epd_ops_ctx_t *ops_ctx;

static int setup(void **state)
{
    char err[EPD_ERR_LEN];
    return epd_ops_host.init(-1, &ops_ctx, err) == EPD_OK ? 0 : -1;
}

static int teardown(void **state)
{
    epd_ops_host.fini(ops_ctx);
    return 0;
}

static void test_transport_staged__ops_without_hooks__unsupported(void **state)
{
    epd_ops_t bare = epd_ops_host;
    epd_transport_ctx_t *ctx = (epd_transport_ctx_t *)&bare; /* must be reset to NULL */
    char err[EPD_ERR_LEN] = "";

    bare.name = "bare";
    bare.copy_to_host_async = NULL;
    assert_int_equal(epd_transport_mpi_staged.init(MPI_COMM_WORLD, &bare, ops_ctx, &ctx, err),
                     EPD_ERR_UNSUPPORTED);
    assert_null(ctx);
    assert_non_null(strstr(err, "bare ops have no async copies"));
}

static void test_transport_staged__bad_chunk_variable__config_error(void **state)
{
    const char *bad[] = { "0", "abc", "12x", "2000000000", "-5" };
    epd_transport_ctx_t *ctx = NULL;
    char err[EPD_ERR_LEN];

    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        setenv(EPD_STAGED_CHUNK_ENV, bad[i], 1);
        err[0] = '\0';
        assert_int_equal(epd_transport_mpi_staged.init(MPI_COMM_WORLD, &epd_ops_host, ops_ctx, &ctx,
                                                       err),
                         EPD_ERR_CONFIG);
        assert_null(ctx);
        assert_non_null(strstr(err, EPD_STAGED_CHUNK_ENV "="));
        assert_non_null(strstr(err, bad[i]));
    }
    setenv(EPD_STAGED_CHUNK_ENV, "4096", 1);
    assert_int_equal(epd_transport_mpi_staged.init(MPI_COMM_WORLD, &epd_ops_host, ops_ctx, &ctx, err),
                     EPD_OK);
    epd_transport_mpi_staged.fini(ctx);
    unsetenv(EPD_STAGED_CHUNK_ENV);
}

static void test_transport_staged__self_block__copied_at_its_displacements(void **state)
{
    epd_transport_ctx_t *ctx = NULL;
    char err[EPD_ERR_LEN];
    const size_t item = 48;
    uint8_t send[20 * 48], recv[20 * 48], want[20 * 48];
    uint64_t sc[1] = { 7 }, sd[1] = { 3 }, rc[1] = { 7 }, rd[1] = { 11 };

    for (size_t i = 0; i < sizeof send; i++) send[i] = (uint8_t)(i * 37 + 5);
    memset(recv, 0xee, sizeof recv);
    memcpy(want, recv, sizeof want);
    memcpy(want + rd[0] * item, send + sd[0] * item, sc[0] * item);

    setenv(EPD_STAGED_CHUNK_ENV, "5", 1);
    assert_int_equal(epd_transport_mpi_staged.init(MPI_COMM_WORLD, &epd_ops_host, ops_ctx, &ctx, err),
                     EPD_OK);
    unsetenv(EPD_STAGED_CHUNK_ENV);
    assert_int_equal(epd_transport_mpi_staged.alltoallv(ctx, send, sc, sd, recv, rc, rd, item), EPD_OK);
    assert_memory_equal(recv, want, sizeof recv);
    assert_string_equal(epd_transport_mpi_staged.last_error(ctx), "");

    /* nothing to move at all: fine, and the buffers may be NULL */
    sc[0] = rc[0] = 0;
    assert_int_equal(epd_transport_mpi_staged.alltoallv(ctx, NULL, sc, sd, NULL, rc, rd, item), EPD_OK);
    epd_transport_mpi_staged.fini(ctx);
}

static void test_transport_staged__bad_counts__refused_with_message(void **state)
{
    epd_transport_ctx_t *ctx = NULL;
    char err[EPD_ERR_LEN];
    uint8_t buf[64];
    uint64_t sc[1] = { 2 }, sd[1] = { 0 }, rc[1] = { 3 }, rd[1] = { 0 };

    assert_int_equal(epd_transport_mpi_staged.init(MPI_COMM_WORLD, &epd_ops_host, ops_ctx, &ctx, err),
                     EPD_OK);
    assert_int_equal(epd_transport_mpi_staged.alltoallv(ctx, buf, sc, sd, buf, rc, rd, 8),
                     EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(epd_transport_mpi_staged.last_error(ctx),
                           "sends itself 16 bytes but expects 24"));

    sc[0] = rc[0] = UINT64_MAX / 4;
    assert_int_equal(epd_transport_mpi_staged.alltoallv(ctx, buf, sc, sd, buf, rc, rd, 8),
                     EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(epd_transport_mpi_staged.last_error(ctx), "overflows"));

    sc[0] = rc[0] = 1;
    assert_int_equal(epd_transport_mpi_staged.alltoallv(ctx, buf, sc, sd, buf, rc, rd, 0),
                     EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_transport_mpi_staged.alltoallv(ctx, NULL, sc, sd, buf, rc, rd, 8),
                     EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(epd_transport_mpi_staged.last_error(ctx), "NULL send buffer"));
    assert_int_equal(epd_transport_mpi_staged.alltoallv(ctx, buf, NULL, sd, buf, rc, rd, 8),
                     EPD_ERR_INVALID_ARG);
    epd_transport_mpi_staged.fini(ctx);
}

static void test_transport_staged__can_use__device_memory_only_with_its_cost(void **state)
{
    epd_transport_job_t job = {
        .requested = EPD_TRANSPORT_MPI,
        .mpi_cuda_aware = EPD_TRISTATE_AUTO,
        .device_memory = false,
        .mpi_cuda = EPD_MPI_CUDA_NO,
    };
    char why[EPD_ERR_LEN] = "";

    assert_false(epd_transport_mpi_staged.can_use(&job, why));
    assert_non_null(strstr(why, "host memory, nothing to stage"));
    job.device_memory = true;
    assert_true(epd_transport_mpi_staged.can_use(&job, why));
    assert_non_null(strstr(why, "mpi-staged (MPIX_Query_cuda_support() = 0)"));
    assert_non_null(strstr(why, "~100x slower than direct on NVLink"));
    assert_string_equal(epd_transport_mpi_staged.last_error(NULL), "");
}

static int run_group(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_transport_staged__ops_without_hooks__unsupported),
        cmocka_unit_test(test_transport_staged__bad_chunk_variable__config_error),
        cmocka_unit_test(test_transport_staged__self_block__copied_at_its_displacements),
        cmocka_unit_test(test_transport_staged__bad_counts__refused_with_message),
        cmocka_unit_test(test_transport_staged__can_use__device_memory_only_with_its_cost),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

int main(int argc, char **argv)
{
    return epd_test_mpi_main(argc, argv, run_group);
}
