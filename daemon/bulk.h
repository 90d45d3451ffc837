/* Socket copies off the loop thread: a small pool of threads that read a large payload straight
 * into its buffer, or write a large RESULT, on a connection's socket while the loop thread goes
 * on with the steps and the other connections. A loop thread alone copies every byte of every
 * payload once, by the kernel: at 128 tokens x 8 connections it spends most of its time in
 * recvmsg and writev (issue 25). A job never waits long: it moves what the socket has, waits up to
 * the pool's wait for more, and comes back with what it did; the connection goes on from there on
 * the loop thread (a slow client holds a thread for one wait, not for its whole frame). Completed
 * jobs are handed back to the loop thread through an eventfd; their callback runs there. */
#ifndef EPD_DAEMON_BULK_H
#define EPD_DAEMON_BULK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "common/status.h"

struct event_base;

typedef struct epd_bulk epd_bulk_t;

#define EPD_BULK_MAX_IOV 2
#define EPD_BULK_MAX_FDS 4

typedef enum { EPD_BULK_READ = 0, EPD_BULK_WRITE } epd_bulk_kind_t;

/* One copy on one socket. The submitter fills kind, fd, iov/n_iov, done (the callback), arg; the
 * pool fills the rest. The job and the memory it names are the submitter's until done runs. */
typedef struct epd_bulk_job {
    struct epd_bulk_job *next;   /* the pool's queues */
    epd_bulk_kind_t kind;
    int fd;                      /* non-blocking socket */
    struct iovec iov[EPD_BULK_MAX_IOV];
    unsigned n_iov;
    void (*done)(struct epd_bulk_job *job); /* on the loop thread */
    void *arg;
    /* results */
    size_t moved;                /* bytes read into / written from the iovecs, in order */
    bool eof;                    /* read: the peer closed its end */
    int error;                   /* errno of a failed recvmsg/sendmsg (0: none) */
    int fds[EPD_BULK_MAX_FDS];   /* read: file descriptors received with the bytes (SCM_RIGHTS) */
    unsigned n_fds;
    unsigned fds_dropped;        /* beyond EPD_BULK_MAX_FDS: closed */
} epd_bulk_job_t;

struct msghdr;

/* Appends the file descriptors of msg's SCM_RIGHTS messages to fds[*n_fds..cap), closing those
 * that do not fit; returns how many were closed. (Any thread: touches only its arguments.) */
unsigned epd_bulk_take_fds(struct msghdr *msg, int *fds, unsigned *n_fds, unsigned cap);

/* Starts threads (1..64) on base's loop; wait_us: how long a job waits for its socket to become
 * readable (writable) again before it comes back with part of its bytes. */
epd_status_t epd_bulk_create(struct event_base *base, unsigned threads, uint32_t wait_us,
                             epd_bulk_t **bulk_p, char err[EPD_ERR_LEN]);

/* Queues job (loop thread). */
void epd_bulk_submit(epd_bulk_t *bulk, epd_bulk_job_t *job);

/* Jobs submitted and not yet called back. */
uint64_t epd_bulk_in_flight(const epd_bulk_t *bulk);

/* Stops the threads once the jobs queued and running are done, then calls every callback still
 * due (on the calling thread, the loop thread). NULL is a no-op. */
void epd_bulk_free(epd_bulk_t *bulk);

#endif
