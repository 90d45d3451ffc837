/* Unit tests of common/: status names and the checked parsers. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "common/parse.h"
#include "common/status.h"

static void test_common__status_names__round_trip(void **state)
{
    (void)state;
    for (int s = EPD_ERR_BAD_MAGIC; s <= EPD_ERR_INTERNAL; s++) {
        assert_true(epd_status_is_wire_code((epd_status_t)s));
        assert_int_equal(epd_status_from_name(epd_status_name((epd_status_t)s)), s);
    }
    assert_string_equal(epd_status_name(EPD_ERR_NON_FINITE_INPUT), "non_finite_input");
    assert_false(epd_status_is_wire_code(EPD_ERR_NO_MEMORY));
    assert_true(epd_status_is_framing(EPD_ERR_BAD_JSON));
    assert_false(epd_status_is_framing(EPD_ERR_BAD_TENSOR));
    assert_int_equal(epd_status_from_name("no_such_code"), EPD_ERR_INTERNAL);
    /* every status has its own name; local ones never parse back as wire codes */
    for (int s = EPD_OK; s < EPD_STATUS_MAX; s++) {
        assert_string_not_equal(epd_status_name((epd_status_t)s), "unknown");
        if (s > EPD_ERR_INTERNAL)
            assert_int_equal(epd_status_from_name(epd_status_name((epd_status_t)s)),
                             EPD_ERR_INTERNAL);
    }
    assert_string_equal(epd_status_name(EPD_STATUS_MAX), "unknown");
}

static void test_common__parse_u64__checks_range_and_junk(void **state)
{
    (void)state;
    char err[EPD_ERR_LEN];
    uint64_t v = 0;
    assert_int_equal(epd_parse_u64("7168", 10, 1, 16384, &v, err), EPD_OK);
    assert_int_equal(v, 7168);
    assert_int_equal(epd_parse_u64("0660", 8, 0, 0777, &v, err), EPD_OK);
    assert_int_equal(v, 0660);
    assert_int_equal(epd_parse_u64("12x", 10, 0, 100, &v, err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_parse_u64("", 10, 0, 100, &v, err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_parse_u64("-1", 10, 0, 100, &v, err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_parse_u64("101", 10, 0, 100, &v, err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_parse_u64("99999999999999999999999", 10, 0, UINT64_MAX, &v, err),
                     EPD_ERR_INVALID_ARG);
}

static void test_common__parse_bool__every_spelling(void **state)
{
    (void)state;
    char err[EPD_ERR_LEN];
    const char *yes[] = {"1", "true", "TRUE", "Yes", "on", "ON"};
    const char *no[] = {"0", "false", "False", "NO", "off", "Off"};
    bool b;
    for (size_t i = 0; i < EPD_ARRAY_SIZE(yes); i++) {
        assert_int_equal(epd_parse_bool(yes[i], &b, err), EPD_OK);
        assert_true(b);
        assert_int_equal(epd_parse_bool(no[i], &b, err), EPD_OK);
        assert_false(b);
    }
    assert_int_equal(epd_parse_bool("maybe", &b, err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_parse_bool("", &b, err), EPD_ERR_INVALID_ARG);
}

static void test_common__parse_numbers__signed_and_double(void **state)
{
    (void)state;
    char err[EPD_ERR_LEN];
    int64_t i;
    double d;
    assert_int_equal(epd_parse_i64("-1", -1, 64, &i, err), EPD_OK);
    assert_int_equal(i, -1);
    assert_int_equal(epd_parse_i64("-2", -1, 64, &i, err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_parse_double("0.5", 0, 1, &d, err), EPD_OK);
    assert_int_equal(epd_parse_double("nan", -1, 1, &d, err), EPD_ERR_INVALID_ARG);
}

static void test_common__parse_host_port__ipv4_ipv6_and_errors(void **state)
{
    (void)state;
    char host[64], err[EPD_ERR_LEN];
    uint16_t port = 0;
    assert_int_equal(epd_parse_host_port("127.0.0.1:9400", host, sizeof host, &port, err), EPD_OK);
    assert_string_equal(host, "127.0.0.1");
    assert_int_equal(port, 9400);
    assert_int_equal(epd_parse_host_port("[::1]:1", host, sizeof host, &port, err), EPD_OK);
    assert_string_equal(host, "::1");
    assert_int_equal(port, 1);
    assert_int_equal(epd_parse_host_port("gpu1.example:65535", host, sizeof host, &port, err),
                     EPD_OK);
    const char *bad[] = {"", "9400", ":9400", "host:", "host:0", "host:65536", "host:9x",
                         "::1:9400", "[::1]9400", "[::1", "a b:1", "host:-1"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = '\0';
        if (epd_parse_host_port(bad[i], host, sizeof host, &port, err) != EPD_ERR_INVALID_ARG)
            fail_msg("'%s' was accepted", bad[i]);
        assert_true(err[0] != '\0');
    }
    assert_int_equal(epd_parse_host_port("abcdefgh:1", host, 4, &port, err), EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(err, "too long"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_common__status_names__round_trip),
        cmocka_unit_test(test_common__parse_u64__checks_range_and_junk),
        cmocka_unit_test(test_common__parse_bool__every_spelling),
        cmocka_unit_test(test_common__parse_numbers__signed_and_double),
        cmocka_unit_test(test_common__parse_host_port__ipv4_ipv6_and_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
