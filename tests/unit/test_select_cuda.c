/* Unit tests of comm/select_cuda.c, the transport choice for device ops: every combination of
 * dispatch.transport, dispatch.mpi_cuda_aware, the MPI's answer and the NCCL build, the staged
 * path's explanation, and the two start-up errors. Transports and ops are doubles (the choice only
 * hands out their addresses). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "comm/select_cuda.h"
#include "comm/transport_mpi.h"
#include "comm/transport_nccl.h"
#include "comm/transport_staged.h"

const epd_transport_t epd_transport_mpi = { .name = "mpi" };
const epd_transport_t epd_transport_mpi_staged = { .name = "mpi-staged" };
#ifdef EPD_HAVE_NCCL
const epd_transport_t epd_transport_nccl = { .name = "nccl" };
#endif
const epd_ops_t epd_ops_host = { .name = "host" };

static const epd_transport_t *decide(epd_transport_kind_t kind, epd_tristate_t aware,
                                     epd_mpi_cuda_t mpi, bool nccl, char reason[EPD_ERR_LEN])
{
    epd_transport_choice_t c;
    char err[EPD_ERR_LEN] = "";

    assert_int_equal(epd_transport_decide_cuda(kind, aware, mpi, nccl, &c, err), EPD_OK);
    assert_non_null(c.transport);
    if (reason != NULL) memcpy(reason, c.reason, EPD_ERR_LEN);
    return c.transport;
}

static void test_select_cuda__cuda_aware_mpi__direct_for_auto_and_mpi(void **state)
{
    char reason[EPD_ERR_LEN];

    assert_ptr_equal(decide(EPD_TRANSPORT_AUTO, EPD_TRISTATE_AUTO, EPD_MPI_CUDA_YES, true, reason),
                     &epd_transport_mpi);
    assert_non_null(strstr(reason, "MPIX_Query_cuda_support() = 1"));
    assert_ptr_equal(decide(EPD_TRANSPORT_MPI, EPD_TRISTATE_AUTO, EPD_MPI_CUDA_YES, false, NULL),
                     &epd_transport_mpi);
    /* forced true where MPI cannot say: trusted */
    assert_ptr_equal(decide(EPD_TRANSPORT_MPI, EPD_TRISTATE_TRUE, EPD_MPI_CUDA_UNKNOWN, false, reason),
                     &epd_transport_mpi);
    assert_non_null(strstr(reason, "dispatch.mpi_cuda_aware = true"));
}

static void test_select_cuda__not_cuda_aware_auto__nccl_when_built_else_staged(void **state)
{
    char reason[EPD_ERR_LEN];

#ifdef EPD_HAVE_NCCL
    assert_ptr_equal(decide(EPD_TRANSPORT_AUTO, EPD_TRISTATE_AUTO, EPD_MPI_CUDA_NO, true, reason),
                     &epd_transport_nccl);
    assert_non_null(strstr(reason, "nccl"));
    /* cuda-aware forced off: nccl even when MPI could */
    assert_ptr_equal(decide(EPD_TRANSPORT_AUTO, EPD_TRISTATE_FALSE, EPD_MPI_CUDA_YES, true, NULL),
                     &epd_transport_nccl);
#endif
    assert_ptr_equal(decide(EPD_TRANSPORT_AUTO, EPD_TRISTATE_AUTO, EPD_MPI_CUDA_NO, false, reason),
                     &epd_transport_mpi_staged);
    assert_non_null(strstr(reason, "~100x slower"));
    assert_non_null(strstr(reason, "scripts/cuda-mpi.sh"));
    assert_ptr_equal(decide(EPD_TRANSPORT_AUTO, EPD_TRISTATE_AUTO, EPD_MPI_CUDA_UNKNOWN, false, reason),
                     &epd_transport_mpi_staged);
    assert_non_null(strstr(reason, "no MPIX_Query_cuda_support"));
}

static void test_select_cuda__mpi_not_cuda_aware__staged_with_explanation(void **state)
{
    char reason[EPD_ERR_LEN];

    assert_ptr_equal(decide(EPD_TRANSPORT_MPI, EPD_TRISTATE_AUTO, EPD_MPI_CUDA_NO, true, reason),
                     &epd_transport_mpi_staged);
    assert_non_null(strstr(reason, "MPIX_Query_cuda_support() = 0"));
    assert_non_null(strstr(reason, "~100x slower than direct on NVLink"));
    assert_ptr_equal(decide(EPD_TRANSPORT_MPI, EPD_TRISTATE_FALSE, EPD_MPI_CUDA_YES, true, reason),
                     &epd_transport_mpi_staged);
    assert_non_null(strstr(reason, "dispatch.mpi_cuda_aware = false"));
}

static void test_select_cuda__nccl_asked__nccl_or_error_when_not_built(void **state)
{
    epd_transport_choice_t c;
    char err[EPD_ERR_LEN] = "";

#ifdef EPD_HAVE_NCCL
    assert_ptr_equal(decide(EPD_TRANSPORT_NCCL, EPD_TRISTATE_AUTO, EPD_MPI_CUDA_YES, true, NULL),
                     &epd_transport_nccl);
#endif
    assert_int_equal(epd_transport_decide_cuda(EPD_TRANSPORT_NCCL, EPD_TRISTATE_AUTO,
                                               EPD_MPI_CUDA_YES, false, &c, err),
                     EPD_ERR_CONFIG);
    assert_non_null(strstr(err, "dispatch.transport = nccl"));
    assert_non_null(strstr(err, "no NCCL"));
    assert_null(c.transport);
}

static void test_select_cuda__cuda_aware_forced_on_plain_mpi__config_error(void **state)
{
    epd_transport_choice_t c;
    char err[EPD_ERR_LEN] = "";

    for (int kind = EPD_TRANSPORT_AUTO; kind <= EPD_TRANSPORT_NCCL; kind++) {
        err[0] = '\0';
        assert_int_equal(epd_transport_decide_cuda((epd_transport_kind_t)kind, EPD_TRISTATE_TRUE,
                                                   EPD_MPI_CUDA_NO, true, &c, err),
                         EPD_ERR_CONFIG);
        assert_non_null(strstr(err, "dispatch.mpi_cuda_aware = true"));
        assert_non_null(strstr(err, "MPIX_Query_cuda_support() = 0"));
    }
}

static void test_select_cuda__unknown_values_or_host_ops__errors(void **state)
{
    epd_transport_choice_t c;
    epd_config_t cfg;
    char err[EPD_ERR_LEN] = "";

    assert_int_equal(epd_transport_decide_cuda((epd_transport_kind_t)9, EPD_TRISTATE_AUTO,
                                               EPD_MPI_CUDA_YES, true, &c, err),
                     EPD_ERR_CONFIG);
    assert_non_null(strstr(err, "dispatch.transport"));
    assert_int_equal(epd_transport_decide_cuda(EPD_TRANSPORT_AUTO, (epd_tristate_t)9,
                                               EPD_MPI_CUDA_YES, true, &c, err),
                     EPD_ERR_CONFIG);
    assert_non_null(strstr(err, "dispatch.mpi_cuda_aware"));

    memset(&cfg, 0, sizeof cfg);
    assert_int_equal(epd_transport_select_cuda(&cfg, &epd_ops_host, &c, err), EPD_ERR_INVALID_ARG);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_select_cuda__cuda_aware_mpi__direct_for_auto_and_mpi),
        cmocka_unit_test(test_select_cuda__not_cuda_aware_auto__nccl_when_built_else_staged),
        cmocka_unit_test(test_select_cuda__mpi_not_cuda_aware__staged_with_explanation),
        cmocka_unit_test(test_select_cuda__nccl_asked__nccl_or_error_when_not_built),
        cmocka_unit_test(test_select_cuda__cuda_aware_forced_on_plain_mpi__config_error),
        cmocka_unit_test(test_select_cuda__unknown_values_or_host_ops__errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
