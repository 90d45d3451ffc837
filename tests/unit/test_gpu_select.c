/* Unit tests of gpu/select.c, the device choice: the pure decision for every backend against
 * builds with and without CUDA, GPU counts and node placements, and epd_device_select on this
 * machine (cpu always works; cuda works exactly when a GPU is there). The ops tables are doubles:
 * the choice only hands out their addresses. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "gpu/select.h"

const epd_ops_t epd_ops_host = { .name = "host" };
#ifdef EPD_HAVE_CUDA
const epd_ops_t epd_ops_cuda = { .name = "cuda" };
#endif

static epd_device_facts_t facts(bool cuda_built, int n_gpus, int local_rank, int local_size)
{
    epd_device_facts_t f = {
        .cuda_built = cuda_built, .n_gpus = n_gpus, .no_gpu = n_gpus > 0 ? NULL : "no CUDA-capable device is detected",
        .local_rank = local_rank, .local_size = local_size,
    };
    return f;
}

static void test_gpu_select__cpu_backend__host_whatever_the_node(void **state)
{
    epd_device_choice_t c;
    char err[EPD_ERR_LEN] = "";
    epd_device_facts_t f = facts(true, 8, 3, 8);

    assert_int_equal(epd_device_decide(EPD_BACKEND_CPU, -1, &f, &c, err), EPD_OK);
    assert_ptr_equal(c.ops, &epd_ops_host);
    assert_int_equal(c.device_id, -1);
    assert_non_null(strstr(c.reason, "cpu"));
    /* more ranks than GPUs does not matter on the host */
    f = facts(false, 0, 5, 16);
    assert_int_equal(epd_device_decide(EPD_BACKEND_CPU, 2, &f, &c, err), EPD_OK);
    assert_ptr_equal(c.ops, &epd_ops_host);
    assert_non_null(strstr(c.reason, "device.id is ignored"));
}

static void test_gpu_select__auto_without_cuda_build_or_gpu__host_with_reason(void **state)
{
    epd_device_choice_t c;
    char err[EPD_ERR_LEN] = "";
    epd_device_facts_t f = facts(false, 4, 0, 2);

    assert_int_equal(epd_device_decide(EPD_BACKEND_AUTO, -1, &f, &c, err), EPD_OK);
    assert_ptr_equal(c.ops, &epd_ops_host);
    assert_non_null(strstr(c.reason, "built without CUDA"));

    f = facts(true, 0, 0, 2);
    assert_int_equal(epd_device_decide(EPD_BACKEND_AUTO, -1, &f, &c, err), EPD_OK);
    assert_ptr_equal(c.ops, &epd_ops_host);
    assert_non_null(strstr(c.reason, "no CUDA-capable device"));
}

static void test_gpu_select__cuda_forced_without_build_or_gpu__config_error(void **state)
{
    epd_device_choice_t c;
    char err[EPD_ERR_LEN] = "";
    epd_device_facts_t f = facts(false, 2, 0, 1);

    assert_int_equal(epd_device_decide(EPD_BACKEND_CUDA, -1, &f, &c, err), EPD_ERR_CONFIG);
    assert_non_null(strstr(err, "built without CUDA"));
    assert_null(c.ops);

    f = facts(true, 0, 0, 1);
    err[0] = '\0';
    assert_int_equal(epd_device_decide(EPD_BACKEND_CUDA, -1, &f, &c, err), EPD_ERR_CONFIG);
    assert_non_null(strstr(err, "no GPU is usable"));
    assert_non_null(strstr(err, "no CUDA-capable device"));
}

static void test_gpu_select__gpus_present__local_rank_or_device_id(void **state)
{
    epd_device_choice_t c;
    char err[EPD_ERR_LEN] = "";
    epd_device_facts_t f = facts(true, 2, 1, 2);

#ifdef EPD_HAVE_CUDA
    assert_int_equal(epd_device_decide(EPD_BACKEND_AUTO, -1, &f, &c, err), EPD_OK);
    assert_ptr_equal(c.ops, &epd_ops_cuda);
    assert_int_equal(c.device_id, 1);
    assert_non_null(strstr(c.reason, "local rank"));

    assert_int_equal(epd_device_decide(EPD_BACKEND_CUDA, 0, &f, &c, err), EPD_OK);
    assert_ptr_equal(c.ops, &epd_ops_cuda);
    assert_int_equal(c.device_id, 0);
    assert_non_null(strstr(c.reason, "device.id"));

    /* device.id lets several ranks share one GPU: no ranks-vs-GPUs check */
    f = facts(true, 1, 3, 4);
    assert_int_equal(epd_device_decide(EPD_BACKEND_CUDA, 0, &f, &c, err), EPD_OK);
    assert_int_equal(c.device_id, 0);
#else
    /* this object has no CUDA ops to hand out, whatever the facts say */
    assert_int_equal(epd_device_decide(EPD_BACKEND_AUTO, -1, &f, &c, err), EPD_ERR_UNSUPPORTED);
    assert_true(strlen(err) > 0);
#endif
}

static void test_gpu_select__more_ranks_than_gpus__error_names_both(void **state)
{
    epd_device_choice_t c;
    char err[EPD_ERR_LEN] = "";
    epd_device_facts_t f = facts(true, 2, 0, 4);

#ifdef EPD_HAVE_CUDA
    assert_int_equal(epd_device_decide(EPD_BACKEND_CUDA, -1, &f, &c, err), EPD_ERR_CONFIG);
    assert_non_null(strstr(err, "4 ranks on this node but only 2 GPUs"));
    assert_null(c.ops);
    err[0] = '\0';
    assert_int_equal(epd_device_decide(EPD_BACKEND_AUTO, -1, &f, &c, err), EPD_ERR_CONFIG);
    assert_non_null(strstr(err, "4 ranks on this node but only 2 GPUs"));
    f = facts(true, 1, 0, 2);
    assert_int_equal(epd_device_decide(EPD_BACKEND_AUTO, -1, &f, &c, err), EPD_ERR_CONFIG);
    assert_non_null(strstr(err, "2 ranks on this node but only 1 GPU:"));
#else
    assert_int_equal(epd_device_decide(EPD_BACKEND_CUDA, -1, &f, &c, err), EPD_ERR_UNSUPPORTED);
#endif
}

static void test_gpu_select__device_id_beyond_gpus__config_error(void **state)
{
    epd_device_choice_t c;
    char err[EPD_ERR_LEN] = "";
    epd_device_facts_t f = facts(true, 2, 0, 1);

#ifdef EPD_HAVE_CUDA
    assert_int_equal(epd_device_decide(EPD_BACKEND_CUDA, 2, &f, &c, err), EPD_ERR_CONFIG);
    assert_non_null(strstr(err, "device.id = 2 but this node has only 2 GPUs"));
#else
    assert_int_equal(epd_device_decide(EPD_BACKEND_CUDA, 2, &f, &c, err), EPD_ERR_UNSUPPORTED);
#endif
}

static void test_gpu_select__bad_backend_or_placement__invalid_arg(void **state)
{
    epd_device_choice_t c;
    char err[EPD_ERR_LEN] = "";
    epd_device_facts_t f = facts(true, 2, 0, 1);

    assert_int_equal(epd_device_decide((epd_backend_t)42, -1, &f, &c, err), EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(err, "device.backend"));
#ifdef EPD_HAVE_CUDA
    f = facts(true, 2, 2, 2);
    assert_int_equal(epd_device_decide(EPD_BACKEND_CUDA, -1, &f, &c, err), EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(err, "local rank 2 of 2"));
#endif
}

static void test_gpu_select__this_machine__consistent_with_its_gpus(void **state)
{
    epd_device_choice_t c;
    char err[EPD_ERR_LEN] = "";

    assert_int_equal(epd_device_select(EPD_BACKEND_CPU, -1, 0, 1, &c, err), EPD_OK);
    assert_ptr_equal(c.ops, &epd_ops_host);

    epd_status_t status = epd_device_select(EPD_BACKEND_CUDA, -1, 0, 1, &c, err);
    if (status == EPD_OK) {
#ifdef EPD_HAVE_CUDA
        assert_ptr_equal(c.ops, &epd_ops_cuda);
        assert_int_equal(c.device_id, 0);
#else
        fail_msg("cuda chosen in a build without CUDA");
#endif
    } else {
        assert_int_equal(status, EPD_ERR_CONFIG);
        assert_true(strstr(err, "no GPU is usable") != NULL || strstr(err, "without CUDA") != NULL);
    }

    assert_int_equal(epd_device_select(EPD_BACKEND_AUTO, -1, 0, 1, &c, err), EPD_OK);
    assert_true(c.ops == &epd_ops_host || c.device_id == 0);
    assert_true(strlen(c.reason) > 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gpu_select__cpu_backend__host_whatever_the_node),
        cmocka_unit_test(test_gpu_select__auto_without_cuda_build_or_gpu__host_with_reason),
        cmocka_unit_test(test_gpu_select__cuda_forced_without_build_or_gpu__config_error),
        cmocka_unit_test(test_gpu_select__gpus_present__local_rank_or_device_id),
        cmocka_unit_test(test_gpu_select__more_ranks_than_gpus__error_names_both),
        cmocka_unit_test(test_gpu_select__device_id_beyond_gpus__config_error),
        cmocka_unit_test(test_gpu_select__bad_backend_or_placement__invalid_arg),
        cmocka_unit_test(test_gpu_select__this_machine__consistent_with_its_gpus),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
