/* Unit tests of daemon/notify: datagrams to a path or an abstract socket, and bad names. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "daemon/notify.h"

/* A datagram socket bound to name ('@' = abstract), like systemd's notify socket. */
static int listen_on(const char *name)
{
    struct sockaddr_un addr;
    socklen_t len;
    int fd = socket(AF_UNIX, SOCK_DGRAM, 0);
    assert_true(fd >= 0);
    memset(&addr, 0, sizeof(addr));
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path, name, strlen(name));
    if (name[0] == '@') {
        addr.sun_path[0] = '\0';
        len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + strlen(name));
    } else {
        len = sizeof(addr);
    }
    assert_int_equal(bind(fd, (struct sockaddr *)&addr, len), 0);
    return fd;
}

static void expect_datagram(int fd, const char *text)
{
    char buf[256];
    ssize_t n = recv(fd, buf, sizeof(buf) - 1, MSG_DONTWAIT);
    assert_true(n >= 0);
    buf[n] = '\0';
    assert_string_equal(buf, text);
}

static void test_notify__path_socket__datagram_received(void **state)
{
    (void)state;
    char dir[] = "/tmp/epd-notify-XXXXXX";
    char path[128];
    char err[EPD_ERR_LEN];
    bool sent = false;
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof(path), "%s/notify", dir);
    int fd = listen_on(path);
    assert_int_equal(epd_notify_send(path, "READY=1\nSTATUS=serving", &sent, err), EPD_OK);
    assert_true(sent);
    expect_datagram(fd, "READY=1\nSTATUS=serving");
    close(fd);
    unlink(path);
    rmdir(dir);
}

static void test_notify__abstract_name__datagram_received(void **state)
{
    (void)state;
    char name[64];
    char err[EPD_ERR_LEN];
    bool sent = false;
    snprintf(name, sizeof(name), "@epd-notify-test-%ld", (long)getpid());
    int fd = listen_on(name);
    assert_int_equal(epd_notify_send(name, "STOPPING=1", &sent, err), EPD_OK);
    assert_true(sent);
    expect_datagram(fd, "STOPPING=1");
    close(fd);
}

static void test_notify__no_socket__nothing_sent(void **state)
{
    (void)state;
    char err[EPD_ERR_LEN];
    bool sent = true;
    assert_int_equal(epd_notify_send(NULL, "READY=1", &sent, err), EPD_OK);
    assert_false(sent);
    sent = true;
    assert_int_equal(epd_notify_send("", "READY=1", &sent, err), EPD_OK);
    assert_false(sent);
}

static void test_notify__bad_names__clear_errors(void **state)
{
    (void)state;
    char err[EPD_ERR_LEN];
    char long_name[200];
    bool sent = true;
    assert_int_equal(epd_notify_send("relative/path", "READY=1", &sent, err), EPD_ERR_INVALID_ARG);
    assert_non_null(strstr(err, "relative/path"));
    memset(long_name, 'a', sizeof(long_name) - 1);
    long_name[0] = '/';
    long_name[sizeof(long_name) - 1] = '\0';
    assert_int_equal(epd_notify_send(long_name, "READY=1", &sent, err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_notify_send("/nonexistent-dir-epd/notify", "READY=1", &sent, err),
                     EPD_ERR_IO);
    assert_false(sent);
    assert_non_null(strstr(err, "sendto"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_notify__path_socket__datagram_received),
        cmocka_unit_test(test_notify__abstract_name__datagram_received),
        cmocka_unit_test(test_notify__no_socket__nothing_sent),
        cmocka_unit_test(test_notify__bad_names__clear_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
