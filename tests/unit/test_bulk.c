/* Unit tests of daemon/bulk.c, the socket copy threads: jobs on socketpairs, called back on the
 * loop thread with what they moved; a job comes back after its wait with part of its bytes when
 * the peer is slow; end of stream, errors and file descriptors are reported; jobs still running
 * when the pool is freed are called back. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <event2/event.h>

#include "common/clock.h"
#include "daemon/bulk.h"
#include "daemon/log.h"

typedef struct {
    int calls;
    bool on_loop_thread; /* every callback ran inside event_base_loop of the test's thread */
} seen_t;

static bool in_loop;

static void job_done(epd_bulk_job_t *job)
{
    seen_t *seen = job->arg;
    seen->calls++;
    seen->on_loop_thread = seen->on_loop_thread && in_loop;
}

/* Runs the loop until seen->calls reaches calls (at most ms). */
static void run_until(struct event_base *base, seen_t *seen, int calls, int ms)
{
    uint64_t end = epd_now_ns() + (uint64_t)ms * 1000000u;
    while (seen->calls < calls && epd_now_ns() < end) {
        in_loop = true;
        event_base_loop(base, EVLOOP_ONCE | EVLOOP_NONBLOCK);
        in_loop = false;
        usleep(200);
    }
}

static void pair(int sv[2])
{
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv), 0);
}

static uint8_t *pattern(size_t n, unsigned seed)
{
    uint8_t *p = malloc(n);
    assert_non_null(p);
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(i * 31 + seed + (i >> 12));
    return p;
}

/* Submits the job again each time it comes back with bytes left (as a connection does), until
 * it has moved them all; returns the total moved. */
/* A job submitted again each time it comes back with bytes left, as a connection does. */
typedef struct {
    epd_bulk_job_t job;
    size_t total;
    bool busy, finished;
} resubmit_t;

static void resubmit_done(epd_bulk_job_t *job)
{
    resubmit_t *r = job->arg;
    assert_true(in_loop);
    assert_int_equal(job->error, 0);
    assert_false(job->eof);
    r->total += job->moved;
    r->busy = false;
    r->finished = job->n_iov == 0;
}

static void resubmit(epd_bulk_t *bulk, resubmit_t *r)
{
    if (r->busy || r->finished) return;
    r->busy = true;
    epd_bulk_submit(bulk, &r->job);
}

/* A write job and a read job on the two ends of one socketpair move 8 MB between them, the
 * write from two iovecs (head and payload, as a RESULT), byte for byte, on the loop thread's
 * callbacks. */
static void test_bulk__write_and_read_jobs__move_every_byte_in_order(void **state)
{
    (void)state;
    struct event_base *base = event_base_new();
    epd_bulk_t *bulk;
    char err[EPD_ERR_LEN];
    int sv[2];
    enum { HEAD = 100, BODY = 8 << 20 };
    uint8_t *src = pattern(HEAD + BODY, 1), *dst = calloc(1, HEAD + BODY);

    assert_int_equal(epd_bulk_create(base, 2, 500, &bulk, err), EPD_OK);
    pair(sv);
    resubmit_t w = {.job = {.kind = EPD_BULK_WRITE, .fd = sv[0], .n_iov = 2,
                            .done = resubmit_done, .arg = &w}};
    w.job.iov[0] = (struct iovec){src, HEAD};
    w.job.iov[1] = (struct iovec){src + HEAD, BODY};
    resubmit_t r = {.job = {.kind = EPD_BULK_READ, .fd = sv[1], .n_iov = 1,
                            .done = resubmit_done, .arg = &r}};
    r.job.iov[0] = (struct iovec){dst, HEAD + BODY};
    resubmit(bulk, &w);
    resubmit(bulk, &r);
    assert_int_equal(epd_bulk_in_flight(bulk), 2);
    uint64_t end = epd_now_ns() + 20000000000u;
    while (!(w.finished && r.finished) && epd_now_ns() < end) {
        in_loop = true;
        event_base_loop(base, EVLOOP_ONCE);
        in_loop = false;
        resubmit(bulk, &w);
        resubmit(bulk, &r);
    }
    assert_true(w.finished && r.finished);
    assert_int_equal(epd_bulk_in_flight(bulk), 0);
    assert_int_equal(w.total, HEAD + BODY);
    assert_int_equal(r.total, HEAD + BODY);
    assert_memory_equal(src, dst, HEAD + BODY);
    epd_bulk_free(bulk);
    close(sv[0]);
    close(sv[1]);
    free(src);
    free(dst);
    event_base_free(base);
}

/* Nobody reads the other end: the write job fills the socket, waits its 2 ms, and comes back with
 * part of its bytes and the rest still in its iovecs; submitted again after the peer read some, it
 * goes on from there. */
static void test_bulk__peer_not_reading__write_comes_back_with_part(void **state)
{
    (void)state;
    struct event_base *base = event_base_new();
    epd_bulk_t *bulk;
    char err[EPD_ERR_LEN];
    int sv[2];
    enum { BODY = 16 << 20 };
    uint8_t *src = pattern(BODY, 2);

    assert_int_equal(epd_bulk_create(base, 1, 2000, &bulk, err), EPD_OK);
    pair(sv);
    seen_t seen = {.on_loop_thread = true};
    epd_bulk_job_t w = {.kind = EPD_BULK_WRITE, .fd = sv[0], .n_iov = 1, .done = job_done,
                        .arg = &seen};
    w.iov[0] = (struct iovec){src, BODY};
    uint64_t start = epd_now_ns();
    epd_bulk_submit(bulk, &w);
    run_until(base, &seen, 1, 5000);
    assert_int_equal(seen.calls, 1);
    assert_true(epd_now_ns() - start >= 2000000u); /* it waited before giving up */
    size_t first = w.moved;
    assert_true(first > 0 && first < BODY);
    assert_int_equal(w.n_iov, 1);
    assert_ptr_equal(w.iov[0].iov_base, src + first);
    assert_int_equal(w.iov[0].iov_len, BODY - first);

    /* read everything, the job submitted again each time it comes back with bytes left */
    uint8_t *dst = malloc(BODY);
    size_t got = 0;
    int calls = seen.calls;
    epd_bulk_submit(bulk, &w);
    while (got < BODY) {
        ssize_t n = recv(sv[1], dst + got, BODY - got, MSG_DONTWAIT);
        if (n > 0) got += (size_t)n;
        else usleep(500);
        in_loop = true;
        event_base_loop(base, EVLOOP_ONCE | EVLOOP_NONBLOCK);
        in_loop = false;
        if (seen.calls > calls) {
            calls = seen.calls;
            if (w.n_iov > 0) epd_bulk_submit(bulk, &w);
        }
    }
    uint64_t end = epd_now_ns() + 5000000000u;
    while (epd_bulk_in_flight(bulk) > 0 && epd_now_ns() < end) {
        event_base_loop(base, EVLOOP_ONCE | EVLOOP_NONBLOCK);
        usleep(200);
    }
    assert_int_equal(epd_bulk_in_flight(bulk), 0);
    assert_int_equal(w.n_iov, 0);
    assert_memory_equal(src, dst, BODY);
    epd_bulk_free(bulk);
    close(sv[0]);
    close(sv[1]);
    free(src);
    free(dst);
    event_base_free(base);
}

/* A read job on a socket whose peer sends 1000 bytes with a file descriptor and then closes: it
 * reports the bytes, the descriptor and the end of the stream. */
static void test_bulk__read_with_fd_then_eof__reports_bytes_fd_and_eof(void **state)
{
    (void)state;
    struct event_base *base = event_base_new();
    epd_bulk_t *bulk;
    char err[EPD_ERR_LEN];
    int sv[2];
    uint8_t *src = pattern(1000, 3), dst[4096];

    assert_int_equal(epd_bulk_create(base, 1, 100000, &bulk, err), EPD_OK);
    pair(sv);
    int memfd = memfd_create("test_bulk", MFD_CLOEXEC);
    assert_true(memfd >= 0);
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } control;
    memset(&control, 0, sizeof control);
    struct iovec iov = {.iov_base = src, .iov_len = 1000};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                         .msg_controllen = sizeof control.buf};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &memfd, sizeof(int));
    assert_int_equal(sendmsg(sv[1], &msg, MSG_NOSIGNAL), 1000);
    close(memfd);
    close(sv[1]);

    seen_t seen = {.on_loop_thread = true};
    epd_bulk_job_t r = {.kind = EPD_BULK_READ, .fd = sv[0], .n_iov = 1, .done = job_done,
                        .arg = &seen};
    r.iov[0] = (struct iovec){dst, sizeof dst};
    epd_bulk_submit(bulk, &r);
    run_until(base, &seen, 1, 5000);
    assert_int_equal(seen.calls, 1);
    assert_int_equal(r.moved, 1000);
    assert_memory_equal(src, dst, 1000);
    assert_true(r.eof);
    assert_int_equal(r.n_fds, 1);
    struct stat st;
    assert_int_equal(fstat(r.fds[0], &st), 0);
    close(r.fds[0]);
    epd_bulk_free(bulk);
    close(sv[0]);
    free(src);
    event_base_free(base);
}

/* A write to a socket whose peer is gone fails with EPIPE (no SIGPIPE), reported in error. */
static void test_bulk__write_to_closed_peer__error_not_signal(void **state)
{
    (void)state;
    struct event_base *base = event_base_new();
    epd_bulk_t *bulk;
    char err[EPD_ERR_LEN];
    int sv[2];
    uint8_t buf[1000] = {0};

    assert_int_equal(epd_bulk_create(base, 1, 1000, &bulk, err), EPD_OK);
    pair(sv);
    close(sv[1]);
    seen_t seen = {.on_loop_thread = true};
    epd_bulk_job_t w = {.kind = EPD_BULK_WRITE, .fd = sv[0], .n_iov = 1, .done = job_done,
                        .arg = &seen};
    w.iov[0] = (struct iovec){buf, sizeof buf};
    epd_bulk_submit(bulk, &w);
    run_until(base, &seen, 1, 5000);
    assert_int_equal(seen.calls, 1);
    assert_int_equal(w.error, EPIPE);
    assert_int_equal(w.moved, 0);
    epd_bulk_free(bulk);
    close(sv[0]);
    event_base_free(base);
}

/* Freed with a job still waiting for its socket: the free waits for it and calls it back. */
static void test_bulk__free_with_job_running__calls_it_back(void **state)
{
    (void)state;
    struct event_base *base = event_base_new();
    epd_bulk_t *bulk;
    char err[EPD_ERR_LEN];
    int sv[2];
    uint8_t dst[100];

    assert_int_equal(epd_bulk_create(base, 1, 50000, &bulk, err), EPD_OK);
    pair(sv);
    seen_t seen = {.on_loop_thread = true};
    epd_bulk_job_t r = {.kind = EPD_BULK_READ, .fd = sv[0], .n_iov = 1, .done = job_done,
                        .arg = &seen};
    r.iov[0] = (struct iovec){dst, sizeof dst};
    epd_bulk_submit(bulk, &r);
    usleep(5000); /* the thread is in its wait now */
    epd_bulk_free(bulk);
    assert_int_equal(seen.calls, 1);
    assert_int_equal(r.moved, 0);
    assert_false(r.eof);
    close(sv[0]);
    close(sv[1]);
    event_base_free(base);
}

static void test_bulk__bad_thread_count__refused(void **state)
{
    (void)state;
    struct event_base *base = event_base_new();
    epd_bulk_t *bulk = (epd_bulk_t *)1;
    char err[EPD_ERR_LEN];

    assert_int_equal(epd_bulk_create(base, 0, 500, &bulk, err), EPD_ERR_INVALID_ARG);
    assert_null(bulk);
    assert_non_null(strstr(err, "1..64"));
    assert_int_equal(epd_bulk_create(base, 65, 500, &bulk, err), EPD_ERR_INVALID_ARG);
    epd_bulk_free(NULL);
    event_base_free(base);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bulk__write_and_read_jobs__move_every_byte_in_order),
        cmocka_unit_test(test_bulk__peer_not_reading__write_comes_back_with_part),
        cmocka_unit_test(test_bulk__read_with_fd_then_eof__reports_bytes_fd_and_eof),
        cmocka_unit_test(test_bulk__write_to_closed_peer__error_not_signal),
        cmocka_unit_test(test_bulk__free_with_job_running__calls_it_back),
        cmocka_unit_test(test_bulk__bad_thread_count__refused),
    };
    epd_log_init(-1, EPD_LOG_WARN);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
