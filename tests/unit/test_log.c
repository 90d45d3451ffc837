/* Unit tests of daemon/log: the line format, the level filter and one line per event. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/log.h"

/* Runs fn with stderr going to a pipe and returns what it wrote (static buffer). */
static const char *capture(void (*fn)(void))
{
    static char buf[8192];
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    int saved = dup(STDERR_FILENO);
    assert_true(saved >= 0);
    assert_true(dup2(fds[1], STDERR_FILENO) >= 0);
    fn();
    assert_true(dup2(saved, STDERR_FILENO) >= 0);
    close(saved);
    close(fds[1]);
    ssize_t n = read(fds[0], buf, sizeof(buf) - 1);
    close(fds[0]);
    buf[n > 0 ? n : 0] = '\0';
    return buf;
}

/* The journal style: a syslog priority prefix, no timestamp (journald stamps lines itself). */
static void log_levels(void)
{
    epd_log_set_style(EPD_LOG_STYLE_JOURNAL);
    epd_log_init(3, EPD_LOG_INFO);
    epd_log_error("bad %d", 1);
    epd_log_warn("careful");
    epd_log_info("hello %s", "world");
    epd_log_debug("hidden");
}

static void test_log__rank_known__prefix_and_level_filter(void **state)
{
    (void)state;
    const char *out = capture(log_levels);
    assert_string_equal(out, "<3>epd[rank 3] ERROR: bad 1\n"
                             "<4>epd[rank 3] WARN: careful\n"
                             "<6>epd[rank 3] INFO: hello world\n");
}

static void log_debug_on(void)
{
    epd_log_init(0, EPD_LOG_WARN);
    epd_log_info("not shown");
    epd_log_set_level(EPD_LOG_DEBUG);
    epd_log_debug("shown");
}

static void test_log__set_level__debug_shown(void **state)
{
    (void)state;
    const char *out = capture(log_debug_on);
    assert_string_equal(out, "<7>epd[rank 0] DEBUG: shown\n");
    assert_true(epd_log_enabled(EPD_LOG_DEBUG));
}

static void log_no_rank(void)
{
    epd_log_init(-1, EPD_LOG_INFO);
    epd_log_info("line one\nline two");
}

static void test_log__no_rank_and_newline__one_line(void **state)
{
    (void)state;
    const char *out = capture(log_no_rank);
    assert_string_equal(out, "<6>epd: INFO: line one line two\n");
}

static void log_long(void)
{
    char big[5000];
    memset(big, 'x', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    epd_log_init(1, EPD_LOG_INFO);
    epd_log_error("%s", big);
}

static void test_log__long_message__cut_with_ellipsis(void **state)
{
    (void)state;
    const char *out = capture(log_long);
    size_t len = strlen(out);
    assert_true(len < 2100);
    assert_int_equal(out[len - 1], '\n');
    assert_memory_equal(out + len - 4, "...", 3);
    assert_int_equal(strchr(out, '\n') - out, (long)len - 1);
}

static void log_timestamped(void)
{
    epd_log_set_style(EPD_LOG_STYLE_TIMESTAMP);
    epd_log_init(2, EPD_LOG_INFO);
    epd_log_warn("stamped");
    epd_log_set_style(EPD_LOG_STYLE_JOURNAL);
}

/* RFC 3339 in UTC with microseconds, then the rank and level: 2026-12-01T09:21:08.123456Z */
static void test_log__timestamp_style__rfc3339_utc_microseconds(void **state)
{
    (void)state;
    const char *out = capture(log_timestamped);
    const char *pattern = "dddd-dd-ddTdd:dd:dd.ddddddZ ";
    assert_true(strlen(out) > strlen(pattern));
    for (size_t i = 0; pattern[i]; i++) {
        if (pattern[i] == 'd')
            assert_true(out[i] >= '0' && out[i] <= '9');
        else
            assert_int_equal(out[i], pattern[i]);
    }
    assert_string_equal(out + strlen(pattern), "epd[rank 2] WARN: stamped\n");
}

static void log_auto(void)
{
    epd_log_set_style(EPD_LOG_STYLE_AUTO);
    setenv("JOURNAL_STREAM", "8:12345", 1);
    epd_log_init(0, EPD_LOG_INFO);
    epd_log_error("to the journal");
    unsetenv("JOURNAL_STREAM");
    epd_log_set_style(EPD_LOG_STYLE_JOURNAL);
}

static void test_log__journal_stream_set__priority_prefix(void **state)
{
    (void)state;
    assert_string_equal(capture(log_auto), "<3>epd[rank 0] ERROR: to the journal\n");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_log__rank_known__prefix_and_level_filter),
        cmocka_unit_test(test_log__set_level__debug_shown),
        cmocka_unit_test(test_log__no_rank_and_newline__one_line),
        cmocka_unit_test(test_log__long_message__cut_with_ellipsis),
        cmocka_unit_test(test_log__timestamp_style__rfc3339_utc_microseconds),
        cmocka_unit_test(test_log__journal_stream_set__priority_prefix),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
