/* The socket copy pool (daemon/bulk.h): threads take jobs from one queue, move bytes with
 * recvmsg/sendmsg (MSG_DONTWAIT), wait for the socket with ppoll between tries, and put the job
 * on the done list; the first job on an empty done list writes the eventfd that the loop thread
 * watches. */
#include "daemon/bulk.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <event2/event.h>

#include "daemon/log.h"

#define BULK_MAX_THREADS 64

struct epd_bulk {
    pthread_mutex_t lock;
    pthread_cond_t cond;          /* a job was queued, or stopping */
    epd_bulk_job_t *queue, **queue_tail;
    epd_bulk_job_t *done, **done_tail;
    bool stopping;
    uint64_t in_flight;           /* loop thread only */
    uint32_t wait_us;
    int efd;
    struct event *ev;
    pthread_t threads[BULK_MAX_THREADS];
    unsigned n_threads;
};

/* Drops the first n bytes of the iovecs (those moved). */
static void iov_advance(epd_bulk_job_t *job, size_t n)
{
    unsigned i = 0;
    while (i < job->n_iov && n >= job->iov[i].iov_len) n -= job->iov[i++].iov_len;
    unsigned k = 0;
    for (; i < job->n_iov; i++) job->iov[k++] = job->iov[i];
    job->n_iov = k;
    if (k > 0) {
        job->iov[0].iov_base = (char *)job->iov[0].iov_base + n;
        job->iov[0].iov_len -= n;
    }
}

unsigned epd_bulk_take_fds(struct msghdr *msg, int *fds, unsigned *n_fds, unsigned cap)
{
    unsigned closed = 0;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(msg); cm != NULL; cm = CMSG_NXTHDR(msg, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
        size_t n = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < n; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof fd);
            if (*n_fds < cap) {
                fds[(*n_fds)++] = fd;
            } else {
                closed++;
                close(fd);
            }
        }
    }
    return closed;
}

static void take_fds(epd_bulk_job_t *job, struct msghdr *msg)
{
    job->fds_dropped += epd_bulk_take_fds(msg, job->fds, &job->n_fds, EPD_BULK_MAX_FDS);
    if (msg->msg_flags & MSG_CTRUNC) job->fds_dropped++;
}

/* One try: bytes moved (> 0), 0 when the socket would block, -1 when the job is over (eof or
 * error recorded). */
static ssize_t bulk_try(epd_bulk_job_t *job)
{
    ssize_t got;
    if (job->kind == EPD_BULK_READ) {
        union {
            char buf[CMSG_SPACE(EPD_BULK_MAX_FDS * sizeof(int))];
            struct cmsghdr align;
        } control;
        struct msghdr msg = {.msg_iov = job->iov, .msg_iovlen = job->n_iov,
                             .msg_control = control.buf, .msg_controllen = sizeof control.buf};
        got = recvmsg(job->fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (got >= 0) take_fds(job, &msg);
        if (got == 0) {
            job->eof = true;
            return -1;
        }
    } else {
        struct msghdr msg = {.msg_iov = job->iov, .msg_iovlen = job->n_iov};
        got = sendmsg(job->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    }
    if (got < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
        job->error = errno;
        return -1;
    }
    return got;
}

/* Moves bytes until the iovecs are done, the job is over, or the socket stays quiet for wait_us. */
static void bulk_run(const epd_bulk_t *bulk, epd_bulk_job_t *job)
{
    struct timespec wait = {(time_t)(bulk->wait_us / 1000000u),
                            (long)(bulk->wait_us % 1000000u) * 1000L};
    short events = job->kind == EPD_BULK_READ ? POLLIN : POLLOUT;

    while (job->n_iov > 0) {
        ssize_t got = bulk_try(job);
        if (got < 0) return;
        if (got > 0) {
            job->moved += (size_t)got;
            iov_advance(job, (size_t)got);
            continue;
        }
        struct pollfd pfd = {.fd = job->fd, .events = events};
        int rc = ppoll(&pfd, 1, &wait, NULL);
        if (rc == 0) return; /* quiet for wait_us: back to the loop with what was moved */
        if (rc < 0 && errno != EINTR) {
            job->error = errno;
            return;
        }
        /* readable, writable, or hung up / failed: the next try says which */
    }
}

static void *bulk_main(void *arg)
{
    epd_bulk_t *bulk = arg;

    pthread_mutex_lock(&bulk->lock);
    for (;;) {
        while (bulk->queue == NULL && !bulk->stopping) pthread_cond_wait(&bulk->cond, &bulk->lock);
        epd_bulk_job_t *job = bulk->queue;
        if (job == NULL) break; /* stopping, nothing left */
        bulk->queue = job->next;
        if (bulk->queue == NULL) bulk->queue_tail = &bulk->queue;
        pthread_mutex_unlock(&bulk->lock);

        bulk_run(bulk, job);

        pthread_mutex_lock(&bulk->lock);
        bool was_empty = bulk->done == NULL;
        job->next = NULL;
        *bulk->done_tail = job;
        bulk->done_tail = &job->next;
        if (was_empty) {
            uint64_t one = 1;
            /* the counter cannot overflow here: the loop reads it before it takes the list */
            (void)!write(bulk->efd, &one, sizeof one);
        }
    }
    pthread_mutex_unlock(&bulk->lock);
    return NULL;
}

/* Calls back every job done so far (loop thread). */
static void bulk_complete(epd_bulk_t *bulk)
{
    uint64_t n;
    (void)!read(bulk->efd, &n, sizeof n);
    pthread_mutex_lock(&bulk->lock);
    epd_bulk_job_t *job = bulk->done;
    bulk->done = NULL;
    bulk->done_tail = &bulk->done;
    pthread_mutex_unlock(&bulk->lock);
    while (job != NULL) {
        epd_bulk_job_t *next = job->next;
        job->next = NULL;
        bulk->in_flight--;
        job->done(job);
        job = next;
    }
}

static void bulk_ev_cb(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    bulk_complete(arg);
}

epd_status_t epd_bulk_create(struct event_base *base, unsigned threads, uint32_t wait_us,
                             epd_bulk_t **bulk_p, char err[EPD_ERR_LEN])
{
    *bulk_p = NULL;
    if (threads == 0 || threads > BULK_MAX_THREADS) {
        snprintf(err, EPD_ERR_LEN, "socket copy threads: %u (allowed: 1..%d)", threads,
                 BULK_MAX_THREADS);
        return EPD_ERR_INVALID_ARG;
    }
    epd_bulk_t *bulk = calloc(1, sizeof(*bulk));
    if (bulk == NULL) {
        snprintf(err, EPD_ERR_LEN, "out of memory creating the socket copy threads");
        return EPD_ERR_NO_MEMORY;
    }
    pthread_mutex_init(&bulk->lock, NULL);
    pthread_cond_init(&bulk->cond, NULL);
    bulk->queue_tail = &bulk->queue;
    bulk->done_tail = &bulk->done;
    bulk->wait_us = wait_us;
    bulk->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (bulk->efd < 0) {
        snprintf(err, EPD_ERR_LEN, "eventfd for the socket copy threads: %s", strerror(errno));
        epd_bulk_free(bulk);
        return EPD_ERR_IO;
    }
    bulk->ev = event_new(base, bulk->efd, EV_READ | EV_PERSIST, bulk_ev_cb, bulk);
    if (bulk->ev == NULL || event_add(bulk->ev, NULL) != 0) {
        snprintf(err, EPD_ERR_LEN, "cannot watch the socket copy threads' eventfd");
        epd_bulk_free(bulk);
        return EPD_ERR_IO;
    }
    /* The threads take no signals: the loop thread's handlers see every one. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    for (unsigned i = 0; i < threads; i++) {
        int rc = pthread_create(&bulk->threads[i], NULL, bulk_main, bulk);
        if (rc != 0) {
            pthread_sigmask(SIG_SETMASK, &old, NULL);
            snprintf(err, EPD_ERR_LEN, "cannot start socket copy thread %u: %s", i, strerror(rc));
            epd_bulk_free(bulk);
            return EPD_ERR_IO;
        }
        bulk->n_threads++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    *bulk_p = bulk;
    return EPD_OK;
}

void epd_bulk_submit(epd_bulk_t *bulk, epd_bulk_job_t *job)
{
    job->next = NULL;
    job->moved = 0;
    job->eof = false;
    job->error = 0;
    job->n_fds = 0;
    job->fds_dropped = 0;
    bulk->in_flight++;
    pthread_mutex_lock(&bulk->lock);
    *bulk->queue_tail = job;
    bulk->queue_tail = &job->next;
    pthread_cond_signal(&bulk->cond);
    pthread_mutex_unlock(&bulk->lock);
}

uint64_t epd_bulk_in_flight(const epd_bulk_t *bulk)
{
    return bulk->in_flight;
}

void epd_bulk_free(epd_bulk_t *bulk)
{
    if (bulk == NULL) return;
    pthread_mutex_lock(&bulk->lock);
    bulk->stopping = true;
    pthread_cond_broadcast(&bulk->cond);
    pthread_mutex_unlock(&bulk->lock);
    for (unsigned i = 0; i < bulk->n_threads; i++) pthread_join(bulk->threads[i], NULL);
    /* every job is on the done list now */
    if (bulk->efd >= 0) {
        while (bulk->in_flight > 0 && bulk->done != NULL) bulk_complete(bulk);
    }
    if (bulk->in_flight > 0)
        epd_log_error("socket copy threads: %llu jobs lost at shutdown",
                      (unsigned long long)bulk->in_flight);
    if (bulk->ev != NULL) event_free(bulk->ev);
    if (bulk->efd >= 0) close(bulk->efd);
    pthread_cond_destroy(&bulk->cond);
    pthread_mutex_destroy(&bulk->lock);
    free(bulk);
}
