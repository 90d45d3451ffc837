/* The payload read path, measured alone (issue 25): SUBMIT frames of a V3-shaped request stream
 * over a Unix socketpair from a sender thread, and the receiver decodes them the ways the daemon
 * can: `feed` (recvmsg into a 256 KiB buffer, then epd_decoder_feed copies the payload out of it:
 * two copies, the path before issue 25), `window` (recvmsg straight into the decoder's payload
 * window, the buffer only for headers and meta: one copy) and `window+spin` (daemon/conn.c's
 * path: the window, and after a large read the socket is tried again for a while before poll).
 * Each round runs every path, starting with the next one; it prints, per frame, the receiver
 * thread's CPU time, the wall time, the reads and the sender's CPU time, medians over the rounds,
 * and each path's ratio to feed in the same run. Payload buffers are reused as the daemon's
 * page-locked pool reuses them (--malloc: a fresh malloc per frame instead).
 * --sndbuf sets the sender's SO_SNDBUF (what bounds the bytes in flight on a Unix stream socket;
 * the kernel caps it at net.core.wmem_max).
 * --pin puts the receiver on CPU 0 and the sender on CPU 1.
 *   read-bench [--tokens N] [--hidden H] [--topk K] [--frames F] [--rounds R] [--sndbuf BYTES]
 *              [--malloc] [--pin] */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "proto/frame.h"

#define READ_BYTES (256u * 1024u) /* daemon/conn.c's CONN_READ_BYTES */
#define CONN_SPIN_MIN_READ (64u * 1024u) /* and its CONN_SPIN_MIN_READ, CONN_SPIN_NS */
#define CONN_SPIN_NS (100u * 1000u)
#define CACHE_SLOTS 8

typedef struct {
    uint8_t *frame; /* head + payload, sent F times */
    size_t head_len, payload_len;
    int fd;
    unsigned frames;
    int cpu;         /* pinned to this CPU, or -1 */
    uint64_t cpu_ns; /* the sender thread's CPU time for the run */
} sender_t;

/* A block cache in front of malloc, as the page-locked pool reuses its blocks. */
typedef struct {
    size_t cap;
} block_t;

static void *cache[CACHE_SLOTS];
static bool use_cache = true;

static void *cache_resize(void *arg, void *p, size_t keep, size_t bytes)
{
    (void)arg;
    if (p != NULL && ((block_t *)p - 1)->cap >= bytes) return p;
    block_t *b = NULL;
    for (int i = 0; use_cache && i < CACHE_SLOTS; i++) {
        if (cache[i] != NULL && ((block_t *)cache[i] - 1)->cap >= bytes) {
            b = (block_t *)cache[i] - 1;
            cache[i] = NULL;
            break;
        }
    }
    if (b == NULL) {
        /* 16-byte aligned, as the pool's buffers are */
        if (posix_memalign((void **)&b, 16, 16 + bytes) != 0) return NULL;
        b = (block_t *)((uint8_t *)b + 16 - sizeof(block_t));
        b->cap = bytes;
    }
    if (p != NULL) {
        memcpy(b + 1, p, keep);
        free((uint8_t *)p - 16);
    }
    return b + 1;
}

static void cache_release(void *p)
{
    if (p == NULL) return;
    for (int i = 0; use_cache && i < CACHE_SLOTS; i++) {
        if (cache[i] == NULL) {
            cache[i] = p;
            return;
        }
    }
    free((uint8_t *)p - 16);
}

static const epd_payload_alloc_t cache_alloc = {.resize = cache_resize, .release = cache_release};

static uint64_t ns(clockid_t clock);
static void pin(int cpu);

static void *send_main(void *arg)
{
    sender_t *s = arg;
    pin(s->cpu);
    uint64_t cpu0 = ns(CLOCK_THREAD_CPUTIME_ID);
    for (unsigned f = 0; f < s->frames; f++) {
        size_t off = 0, len = s->head_len + s->payload_len;
        while (off < len) {
            ssize_t n = send(s->fd, s->frame + off, len - off, MSG_NOSIGNAL);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) {
                perror("read-bench: send");
                exit(1);
            }
            off += (size_t)n;
        }
    }
    s->cpu_ns = ns(CLOCK_THREAD_CPUTIME_ID) - cpu0;
    return NULL;
}

/* --pin: sender and receiver each on a CPU of their own (less noise from the scheduler). */
static void pin(int cpu)
{
    if (cpu < 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static uint64_t ns(clockid_t clock)
{
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

typedef struct {
    double cpu_us, wall_us, reads;
} result_t;

/* A whole frame arrived: the first of a run is compared with what was sent. */
static void frame_done(epd_frame_t *frame, unsigned *done_p, const uint8_t *want, size_t want_len)
{
    if (*done_p == 0 &&
        (frame->payload_len != want_len || memcmp(frame->payload, want, want_len) != 0)) {
        fprintf(stderr, "read-bench: the payload differs from the one sent\n");
        exit(1);
    }
    epd_frame_free(frame);
    (*done_p)++;
}

static void check(epd_status_t status, const char *err)
{
    if (status == EPD_OK || status == EPD_ERR_AGAIN) return;
    fprintf(stderr, "read-bench: %s\n", err);
    exit(1);
}

/* The three ways to read, in the order they are printed. */
enum { PATH_FEED, PATH_WINDOW, PATH_SPIN, PATHS };
static const char *const path_names[PATHS] = {"feed", "window", "window+spin"};

/* Receives `frames` frames on fd the way `path` says: feed only; the payload through the window
 * (reads counted, misses included); the window and, after a read of CONN_SPIN_MIN_READ bytes or
 * more, the socket tried again for up to CONN_SPIN_NS before poll (daemon/conn.c's path). */
static result_t receive(int fd, unsigned frames, int path, const uint8_t *want, size_t want_len)
{
    bool window = path != PATH_FEED;
    uint64_t spin_until = 0;
    static uint8_t buf[READ_BYTES];
    epd_decoder_t dec;
    char err[EPD_ERR_LEN];
    unsigned done = 0;
    uint64_t reads = 0;

    epd_decoder_init(&dec, UINT64_C(1) << 32, EPD_FRAME_MAX_META);
    epd_decoder_set_alloc(&dec, &cache_alloc);
    uint64_t cpu0 = ns(CLOCK_THREAD_CPUTIME_ID), wall0 = ns(CLOCK_MONOTONIC);
    while (done < frames) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        if (spin_until != 0 && ns(CLOCK_MONOTONIC) < spin_until) {
            /* the daemon tries the socket again rather than poll */
        } else if (poll(&pfd, 1, 5000) != 1) {
            fprintf(stderr, "read-bench: no bytes for 5 s\n");
            exit(1);
        }
        void *ptr = NULL;
        size_t len = 0;
        epd_frame_t frame;
        epd_status_t status;
        if (window) check(epd_decoder_payload_window(&dec, &ptr, &len, err), err);
        if (len > 0) {
            ssize_t n = recv(fd, ptr, len, MSG_DONTWAIT);
            if (n <= 0) continue;
            reads++;
            status = epd_decoder_payload_commit(&dec, (size_t)n, &frame, err);
            check(status, err);
            spin_until = 0;
            if (status == EPD_OK) frame_done(&frame, &done, want, want_len);
            else if (path == PATH_SPIN && (size_t)n >= CONN_SPIN_MIN_READ)
                spin_until = ns(CLOCK_MONOTONIC) + CONN_SPIN_NS;
            continue;
        }
        ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        spin_until = 0;
        if (n <= 0) continue;
        reads++;
        for (size_t at = 0; at < (size_t)n;) {
            size_t used = 0;
            status = epd_decoder_feed(&dec, buf + at, (size_t)n - at, &used, &frame, err);
            check(status, err);
            at += used;
            if (status == EPD_OK) frame_done(&frame, &done, want, want_len);
        }
    }
    uint64_t cpu1 = ns(CLOCK_THREAD_CPUTIME_ID), wall1 = ns(CLOCK_MONOTONIC);
    epd_decoder_free(&dec);
    return (result_t){(double)(cpu1 - cpu0) / 1e3 / frames, (double)(wall1 - wall0) / 1e3 / frames,
                      (double)reads / frames};
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, unsigned n)
{
    qsort(v, n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int main(int argc, char **argv)
{
    unsigned tokens = 128, hidden = 7168, topk = 8, frames = 200, rounds = 9, sndbuf = 0;
    bool pinned = false;
    char err[EPD_ERR_LEN];

    for (int i = 1; i < argc; i++) {
        unsigned *dst = NULL;
        if (strcmp(argv[i], "--malloc") == 0) {
            use_cache = false;
            continue;
        }
        if (strcmp(argv[i], "--pin") == 0) {
            pinned = true;
            continue;
        }
        if (strcmp(argv[i], "--tokens") == 0) dst = &tokens;
        else if (strcmp(argv[i], "--hidden") == 0) dst = &hidden;
        else if (strcmp(argv[i], "--topk") == 0) dst = &topk;
        else if (strcmp(argv[i], "--frames") == 0) dst = &frames;
        else if (strcmp(argv[i], "--rounds") == 0) dst = &rounds;
        else if (strcmp(argv[i], "--sndbuf") == 0) dst = &sndbuf;
        if (dst == NULL || i + 1 == argc || (*dst = (unsigned)strtoul(argv[++i], NULL, 10)) == 0) {
            fprintf(stderr, "usage: read-bench [--tokens N] [--hidden H] [--topk K] [--frames F] "
                            "[--rounds R] [--sndbuf BYTES] [--malloc] [--pin]\n");
            return 2;
        }
    }

    uint16_t *x = calloc((size_t)tokens * hidden, 2);
    int32_t *ids = calloc((size_t)tokens * topk, 4);
    float *w = calloc((size_t)tokens * topk, 4);
    if (x == NULL || ids == NULL || w == NULL) return 1;
    for (size_t i = 0; i < (size_t)tokens * hidden; i++) x[i] = (uint16_t)(0x3f80 + i % 97);
    for (size_t i = 0; i < (size_t)tokens * topk; i++) {
        ids[i] = (int32_t)(i % topk);
        w[i] = 0.125f;
    }
    epd_frame_out_t out;
    sender_t s = {.frames = frames};
    size_t total;
    if (epd_frame_encode_submit(1, tokens, hidden, topk, x, ids, w, &out, err) != EPD_OK ||
        epd_frame_out_flatten(&out, &s.frame, &total, err) != EPD_OK) {
        fprintf(stderr, "read-bench: %s\n", err);
        return 1;
    }
    s.head_len = out.head_len;
    s.payload_len = total - out.head_len;
    epd_frame_out_free(&out);

    double *v[PATHS][4];
    for (int m = 0; m < PATHS; m++)
        for (int k = 0; k < 4; k++) v[m][k] = calloc(rounds, sizeof(double));
    s.cpu = pinned ? 1 : -1;
    pin(pinned ? 0 : -1);
    for (unsigned r = 0; r < rounds; r++) {
        for (int m = 0; m < PATHS; m++) {
            int sv[2];
            pthread_t th;
            /* each round starts with the next path, so none always goes first */
            int path = (int)((m + r) % PATHS);
            if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return 1;
            s.fd = sv[1];
            if (sndbuf > 0) setsockopt(sv[1], SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
            pthread_create(&th, NULL, send_main, &s);
            result_t res = receive(sv[0], frames, path, s.frame + s.head_len, s.payload_len);
            pthread_join(th, NULL);
            close(sv[0]);
            close(sv[1]);
            v[path][0][r] = res.cpu_us;
            v[path][1][r] = res.wall_us;
            v[path][2][r] = res.reads;
            v[path][3][r] = (double)s.cpu_ns / 1e3 / frames;
        }
    }
    int got_sndbuf = 0;
    socklen_t optlen = sizeof got_sndbuf;
    int probe[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, probe) == 0) {
        if (sndbuf > 0) setsockopt(probe[1], SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
        getsockopt(probe[1], SOL_SOCKET, SO_SNDBUF, &got_sndbuf, &optlen);
        close(probe[0]);
        close(probe[1]);
    }
    printf("read-bench: %u tokens x %u hidden, top-%u: payload %zu bytes, %u frames x %u rounds, "
           "payload buffers %s, sender SO_SNDBUF %d\n", tokens, hidden, topk, s.payload_len,
           frames, rounds, use_cache ? "reused" : "malloc'ed per frame", got_sndbuf);
    printf("  %-12s %14s %14s %12s %14s\n", "path", "cpu us/frame", "wall us/frame",
           "reads/frame", "sender cpu us");
    double med[PATHS][4];
    for (int m = 0; m < PATHS; m++) {
        for (int k = 0; k < 4; k++) med[m][k] = median(v[m][k], rounds);
        printf("  %-12s %14.1f %14.1f %12.1f %14.1f\n", path_names[m], med[m][0], med[m][1],
               med[m][2], med[m][3]);
    }
    for (int m = PATH_WINDOW; m < PATHS; m++)
        printf("  %s / feed: cpu %.2f, wall %.2f (medians of the same run)\n", path_names[m],
               med[m][0] / med[PATH_FEED][0], med[m][1] / med[PATH_FEED][1]);
    for (int m = 0; m < PATHS; m++)
        for (int k = 0; k < 4; k++) free(v[m][k]);
    free(s.frame);
    free(x);
    free(ids);
    free(w);
    return 0;
}
