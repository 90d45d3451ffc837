/* Unit tests of the transport choice (comm/registry.c): the registry walked over the real
 * transports' can_use for every combination of dispatch.transport, dispatch.mpi_cuda_aware, the
 * MPI's answer, the ops' memory and whether nccl is registered; the staged path's explanation,
 * the start-up errors, the registry's order and what each entry says about itself. The choice
 * never calls the NCCL glue: the doubles below stand in for comm/nccl_boot.c, so every build runs
 * the nccl cases. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>
#include <mpi.h>

#include "comm/nccl_boot.h"
#include "comm/registry.h"
#include "comm/transport_mpi.h"
#include "comm/transport_nccl.h"
#include "comm/transport_staged.h"
#include "tests/unit/mpi_main.h"

epd_status_t epd_nccl_create(MPI_Comm comm, void *stream, epd_nccl_t **nccl_p,
                             char err[EPD_ERR_LEN])
{
    fail_msg("the transport choice created an NCCL communicator");
    return EPD_ERR_INTERNAL;
}

epd_status_t epd_nccl_alltoallv(epd_nccl_t *nccl, const void *send, const uint64_t *send_counts,
                                const uint64_t *send_displs, void *recv,
                                const uint64_t *recv_counts, const uint64_t *recv_displs,
                                size_t item_bytes, char err[EPD_ERR_LEN])
{
    fail_msg("the transport choice ran an NCCL alltoallv");
    return EPD_ERR_INTERNAL;
}

void epd_nccl_destroy(epd_nccl_t *nccl)
{
    fail_msg("the transport choice destroyed an NCCL communicator");
}

/* The registries of a build with and without NCCL, in the order of epd_transports. */
static const epd_transport_t *const with_nccl[] = {&epd_transport_mpi, &epd_transport_nccl,
                                                   &epd_transport_mpi_staged, NULL};
static const epd_transport_t *const without_nccl[] = {&epd_transport_mpi,
                                                      &epd_transport_mpi_staged, NULL};
static const epd_transport_t *const nccl_only[] = {&epd_transport_nccl, NULL};

static epd_transport_job_t job_of(epd_transport_kind_t kind, epd_tristate_t aware,
                                  epd_mpi_cuda_t mpi, bool device_memory)
{
    epd_transport_job_t job = {
        .requested = kind,
        .mpi_cuda_aware = aware,
        .device_memory = device_memory,
        .mpi_cuda = mpi,
    };
    return job;
}

/* The choice for device memory, which must succeed; the reason is copied out when asked for. */
static const epd_transport_t *decide(const epd_transport_t *const *registry,
                                     epd_transport_kind_t kind, epd_tristate_t aware,
                                     epd_mpi_cuda_t mpi, char reason[EPD_ERR_LEN])
{
    epd_transport_job_t job = job_of(kind, aware, mpi, true);
    epd_transport_choice_t c;
    char err[EPD_ERR_LEN] = "";

    assert_int_equal(epd_transport_choose(registry, &job, &c, err), EPD_OK);
    assert_non_null(c.transport);
    if (reason != NULL) memcpy(reason, c.reason, EPD_ERR_LEN);
    return c.transport;
}

/* The error of a choice that must fail with EPD_ERR_CONFIG. */
static void refuse(const epd_transport_t *const *registry, const epd_transport_job_t *job,
                   char err[EPD_ERR_LEN])
{
    epd_transport_choice_t c;

    err[0] = '\0';
    assert_int_equal(epd_transport_choose(registry, job, &c, err), EPD_ERR_CONFIG);
    assert_null(c.transport);
    assert_true(err[0] != '\0');
}

static void test_registry__cuda_aware_mpi__direct_for_auto_and_mpi(void **state)
{
    char reason[EPD_ERR_LEN];

    assert_ptr_equal(decide(with_nccl, EPD_TRANSPORT_AUTO, EPD_TRISTATE_AUTO, EPD_MPI_CUDA_YES,
                            reason),
                     &epd_transport_mpi);
    assert_non_null(strstr(reason, "mpi: MPI_Alltoallv directly on device buffers"));
    assert_non_null(strstr(reason, "MPIX_Query_cuda_support() = 1"));
    assert_ptr_equal(decide(without_nccl, EPD_TRANSPORT_MPI, EPD_TRISTATE_AUTO, EPD_MPI_CUDA_YES,
                            NULL),
                     &epd_transport_mpi);
    /* forced true where MPI cannot say: trusted */
    assert_ptr_equal(decide(without_nccl, EPD_TRANSPORT_MPI, EPD_TRISTATE_TRUE,
                            EPD_MPI_CUDA_UNKNOWN, reason),
                     &epd_transport_mpi);
    assert_non_null(strstr(reason, "dispatch.mpi_cuda_aware = true"));
}

static void test_registry__not_cuda_aware_auto__nccl_when_built_else_staged(void **state)
{
    char reason[EPD_ERR_LEN];

    assert_ptr_equal(decide(with_nccl, EPD_TRANSPORT_AUTO, EPD_TRISTATE_AUTO, EPD_MPI_CUDA_NO,
                            reason),
                     &epd_transport_nccl);
    assert_string_equal(reason, "nccl: grouped ncclSend/ncclRecv on device buffers "
                                "(dispatch.transport = auto, MPI not CUDA-aware: "
                                "MPIX_Query_cuda_support() = 0)");
    /* cuda-aware forced off: nccl even when MPI could */
    assert_ptr_equal(decide(with_nccl, EPD_TRANSPORT_AUTO, EPD_TRISTATE_FALSE, EPD_MPI_CUDA_YES,
                            NULL),
                     &epd_transport_nccl);
    assert_ptr_equal(decide(without_nccl, EPD_TRANSPORT_AUTO, EPD_TRISTATE_AUTO, EPD_MPI_CUDA_NO,
                            reason),
                     &epd_transport_mpi_staged);
    assert_non_null(strstr(reason, "~100x slower"));
    assert_non_null(strstr(reason, "scripts/cuda-mpi.sh"));
    assert_ptr_equal(decide(without_nccl, EPD_TRANSPORT_AUTO, EPD_TRISTATE_AUTO,
                            EPD_MPI_CUDA_UNKNOWN, reason),
                     &epd_transport_mpi_staged);
    assert_non_null(strstr(reason, "no MPIX_Query_cuda_support"));
}

static void test_registry__mpi_not_cuda_aware__staged_with_explanation(void **state)
{
    char reason[EPD_ERR_LEN];

    assert_ptr_equal(decide(with_nccl, EPD_TRANSPORT_MPI, EPD_TRISTATE_AUTO, EPD_MPI_CUDA_NO,
                            reason),
                     &epd_transport_mpi_staged);
    assert_non_null(strstr(reason, "MPIX_Query_cuda_support() = 0"));
    assert_non_null(strstr(reason, "~100x slower than direct on NVLink"));
    assert_ptr_equal(decide(with_nccl, EPD_TRANSPORT_MPI, EPD_TRISTATE_FALSE, EPD_MPI_CUDA_YES,
                            reason),
                     &epd_transport_mpi_staged);
    assert_non_null(strstr(reason, "mpi-staged (dispatch.mpi_cuda_aware = false)"));
}

static void test_registry__nccl_asked__nccl_or_error_when_not_built(void **state)
{
    epd_transport_job_t job = job_of(EPD_TRANSPORT_NCCL, EPD_TRISTATE_AUTO, EPD_MPI_CUDA_YES, true);
    char reason[EPD_ERR_LEN], err[EPD_ERR_LEN];

    assert_ptr_equal(decide(with_nccl, EPD_TRANSPORT_NCCL, EPD_TRISTATE_AUTO, EPD_MPI_CUDA_YES,
                            reason),
                     &epd_transport_nccl);
    assert_string_equal(reason, "nccl: grouped ncclSend/ncclRecv on device buffers "
                                "(dispatch.transport = nccl)");
    refuse(without_nccl, &job, err);
    assert_string_equal(err, "dispatch.transport = nccl, but this build has no NCCL (rebuild "
                             "with NCCL=1 and nccl.h in CUDA_HOME/include), or use auto or mpi");
    /* on the CPU backend: with NCCL, it needs GPU buffers; without, both are said */
    job.device_memory = false;
    refuse(with_nccl, &job, err);
    assert_non_null(strstr(err, "dispatch.transport = nccl needs GPU buffers"));
    refuse(without_nccl, &job, err);
    assert_non_null(strstr(err, "dispatch.transport = nccl, but this build has no NCCL"));
    assert_non_null(strstr(err, "this rank runs the CPU backend"));
}

static void test_registry__cuda_aware_forced_on_plain_mpi__config_error(void **state)
{
    char err[EPD_ERR_LEN];

    for (int kind = EPD_TRANSPORT_AUTO; kind <= EPD_TRANSPORT_NCCL; kind++) {
        epd_transport_job_t job = job_of((epd_transport_kind_t)kind, EPD_TRISTATE_TRUE,
                                         EPD_MPI_CUDA_NO, true);
        refuse(with_nccl, &job, err);
        assert_non_null(strstr(err, "dispatch.mpi_cuda_aware = true"));
        assert_non_null(strstr(err, "MPIX_Query_cuda_support() = 0"));
    }
}

static void test_registry__host_memory__mpi_on_host_buffers(void **state)
{
    epd_transport_job_t job = job_of(EPD_TRANSPORT_AUTO, EPD_TRISTATE_AUTO, EPD_MPI_CUDA_NO, false);
    epd_transport_choice_t c;
    char err[EPD_ERR_LEN] = "";

    assert_int_equal(epd_transport_choose(with_nccl, &job, &c, err), EPD_OK);
    assert_ptr_equal(c.transport, &epd_transport_mpi);
    assert_string_equal(c.reason, "mpi: host buffers (CPU backend; dispatch.transport = auto)");
    job.requested = EPD_TRANSPORT_MPI;
    assert_int_equal(epd_transport_choose(with_nccl, &job, &c, err), EPD_OK);
    assert_ptr_equal(c.transport, &epd_transport_mpi);
    assert_string_equal(c.reason, "mpi: host buffers (CPU backend)");
    /* dispatch.mpi_cuda_aware is about device buffers: the host ignores it */
    job.mpi_cuda_aware = EPD_TRISTATE_TRUE;
    assert_int_equal(epd_transport_choose(with_nccl, &job, &c, err), EPD_OK);
    assert_ptr_equal(c.transport, &epd_transport_mpi);
}

static void test_registry__can_use__says_why_not(void **state)
{
    epd_transport_job_t job = job_of(EPD_TRANSPORT_MPI, EPD_TRISTATE_AUTO, EPD_MPI_CUDA_NO, true);
    char why[EPD_ERR_LEN] = "";

    assert_false(epd_transport_mpi.can_use(&job, why));
    assert_string_equal(why, "mpi: no MPI_Alltoallv directly on device buffers "
                             "(MPIX_Query_cuda_support() = 0)");
    job.device_memory = false;
    assert_false(epd_transport_nccl.can_use(&job, why));
    assert_non_null(strstr(why, "needs GPU buffers"));
    assert_false(epd_transport_mpi_staged.can_use(&job, why));
    assert_non_null(strstr(why, "nothing to stage"));
}

static void test_registry__nothing_serves__last_why_not_or_missing_family(void **state)
{
    epd_transport_job_t job = job_of(EPD_TRANSPORT_AUTO, EPD_TRISTATE_AUTO, EPD_MPI_CUDA_NO, false);
    char err[EPD_ERR_LEN];

    refuse(nccl_only, &job, err);
    assert_non_null(strstr(err, "dispatch.transport = auto: no transport of this build can serve"));
    assert_non_null(strstr(err, "needs GPU buffers"));
    job.requested = EPD_TRANSPORT_MPI;
    refuse(nccl_only, &job, err);
    assert_string_equal(err, "dispatch.transport = mpi: this build has no such transport");
}

static void test_registry__unknown_values__errors(void **state)
{
    epd_transport_job_t job = job_of((epd_transport_kind_t)9, EPD_TRISTATE_AUTO, EPD_MPI_CUDA_YES,
                                     true);
    char err[EPD_ERR_LEN];

    refuse(with_nccl, &job, err);
    assert_non_null(strstr(err, "dispatch.transport: unknown value 9"));
    job.device_memory = false;
    refuse(with_nccl, &job, err);
    assert_non_null(strstr(err, "dispatch.transport: unknown value 9"));
    job = job_of(EPD_TRANSPORT_AUTO, (epd_tristate_t)9, EPD_MPI_CUDA_YES, true);
    refuse(with_nccl, &job, err);
    assert_non_null(strstr(err, "dispatch.mpi_cuda_aware: unknown value 9"));
}

static void test_registry__registry__auto_order_and_complete_entries(void **state)
{
    size_t n = 0;

    while (epd_transports[n] != NULL) {
        const epd_transport_t *t = epd_transports[n++];
        assert_non_null(t->name);
        assert_true(t->kind == EPD_TRANSPORT_MPI || t->kind == EPD_TRANSPORT_NCCL);
        assert_non_null(t->can_use);
        assert_non_null(t->init);
        assert_non_null(t->fini);
        assert_non_null(t->alltoallv);
        assert_non_null(t->last_error);
        assert_string_equal(t->last_error(NULL), "");
    }
    assert_true(n >= 2);
    assert_ptr_equal(epd_transports[0], &epd_transport_mpi);
    assert_ptr_equal(epd_transports[n - 1], &epd_transport_mpi_staged);
    /* what the benchmark's raw baseline asks of them */
    assert_true(epd_transport_mpi.mpi_on_ops_memory);
    assert_null(epd_transport_mpi.raw_baseline);
    assert_false(epd_transport_mpi_staged.mpi_on_ops_memory);
    assert_null(epd_transport_mpi_staged.raw_baseline);
    assert_false(epd_transport_nccl.mpi_on_ops_memory);
    assert_non_null(strstr(epd_transport_nccl.raw_baseline, "ncclSend/ncclRecv"));
}

static void test_registry__select_from_config__host_mpi_device_an_mpi_transport(void **state)
{
    const epd_ops_t host = {.name = "host", .device_memory = false};
    const epd_ops_t device = {.name = "device", .device_memory = true};
    epd_transport_choice_t c;
    epd_config_t cfg;
    char err[EPD_ERR_LEN] = "";

    memset(&cfg, 0, sizeof cfg);
    cfg.dispatch.transport = EPD_TRANSPORT_AUTO;
    cfg.dispatch.mpi_cuda_aware = EPD_TRISTATE_AUTO;
    assert_int_equal(epd_transport_select(&cfg, &host, &c, err), EPD_OK);
    assert_ptr_equal(c.transport, &epd_transport_mpi);
    assert_non_null(strstr(c.reason, "mpi: host buffers"));
    cfg.dispatch.transport = EPD_TRANSPORT_MPI;
    assert_int_equal(epd_transport_select(&cfg, &device, &c, err), EPD_OK);
    assert_int_equal(c.transport->kind, EPD_TRANSPORT_MPI);
    cfg.dispatch.transport = EPD_TRANSPORT_NCCL;
    assert_int_equal(epd_transport_select(&cfg, &host, &c, err), EPD_ERR_CONFIG);
    assert_non_null(strstr(err, "dispatch.transport = nccl"));
    assert_null(c.transport);
}

static int run_group(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_registry__cuda_aware_mpi__direct_for_auto_and_mpi),
        cmocka_unit_test(test_registry__not_cuda_aware_auto__nccl_when_built_else_staged),
        cmocka_unit_test(test_registry__mpi_not_cuda_aware__staged_with_explanation),
        cmocka_unit_test(test_registry__nccl_asked__nccl_or_error_when_not_built),
        cmocka_unit_test(test_registry__cuda_aware_forced_on_plain_mpi__config_error),
        cmocka_unit_test(test_registry__host_memory__mpi_on_host_buffers),
        cmocka_unit_test(test_registry__can_use__says_why_not),
        cmocka_unit_test(test_registry__nothing_serves__last_why_not_or_missing_family),
        cmocka_unit_test(test_registry__unknown_values__errors),
        cmocka_unit_test(test_registry__registry__auto_order_and_complete_entries),
        cmocka_unit_test(test_registry__select_from_config__host_mpi_device_an_mpi_transport),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

int main(int argc, char **argv)
{
    /* epd_transport_select asks MPI about device buffers: an MPI singleton */
    return epd_test_mpi_main(argc, argv, run_group);
}
