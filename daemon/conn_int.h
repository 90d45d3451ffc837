/* The inside of a connection, shared by daemon/conn.c (its state machine and socket I/O) and
 * daemon/conn_frames.c (what it does with each frame it reads): the states, the struct, and the
 * few functions one file calls in the other. Not for the rest of the daemon (daemon/conn.h). */
#ifndef EPD_DAEMON_CONN_INT_H
#define EPD_DAEMON_CONN_INT_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include <event2/buffer.h>

#include "daemon/bulk.h"
#include "daemon/conn.h"
#include "proto/frame.h"

/* File descriptors (SCM_RIGHTS, for CONTROL register) a connection may have received and not
 * yet claimed. */
#define CONN_MAX_FDS 4

typedef enum {
    CONN_READING = 0, /* reads on: bytes go to the decoder, whole frames are answered or queued */
    CONN_YIELDED,     /* frame budget of this event used up, input left: reads off, resume queued */
    CONN_PAUSED,      /* unsent output above socket.max_output_bytes: reads off until it drains */
    CONN_CLOSING,     /* framing error answered or daemon stopping: drop unread input, arm the
                       * flush timeout, then flushing */
    CONN_FLUSHING,    /* reads off: waits until the output is written, then closes */
    CONN_CLOSED,      /* peer gone, flushed or timed out: freed; its pending answers are dropped */
    CONN_STATE_MAX
} conn_state_t;

struct epd_conn {
    uint64_t id;
    epd_payload_alloc_t payload_alloc; /* payloads in the engine's page-locked pool */
    conn_state_t state;
    const epd_conn_ctx_t *ctx;
    struct bufferevent *bev; /* output only: input is read with recvmsg (file descriptors) */
    struct event *rev;       /* readable socket */
    struct evbuffer *input;
    int fd;
    bool reading;
    int fds[CONN_MAX_FDS];   /* received with the input, oldest first, not claimed yet */
    unsigned n_fds;
    epd_region_table_t *regions; /* created by the first register */
    void *x_copy; /* the device copy of the SUBMIT being validated (conn_host_scan) */
    uint64_t scan_ns; /* time in conn_host_scan for that SUBMIT (EPD_TRACE) */
    struct event *resume; /* brings a yielded connection back to reading */
    epd_decoder_t decoder;
    uint64_t in_flight; /* requests on the engine, not answered yet */
    uid_t uid;
    pid_t pid;
    bool driving;       /* inside conn_drive: callbacks re-entering it only mark work */
    bool answer_input;  /* closing for the shutdown: frames already read are still answered */

    uint64_t reserved;  /* payload bytes of the frame being read, in stats->buffered_bytes */

    /* the timeouts: one timer, armed for the earliest deadline (deadline_ns, 0: not armed) */
    struct event *deadline;
    uint64_t deadline_ns;
    uint64_t active_ns;      /* last byte read, answer queued or output written */
    uint64_t frame_start_ns; /* the frame being read started (0: between frames) */
    uint64_t recv_ns;        /* the last read of the socket that returned bytes (EPD_TRACE) */
    uint64_t decoded_ns;     /* the decoder returned the frame being handled (EPD_TRACE) */

    /* Answers queued and not yet written whole, oldest first: the output stream offset where
     * each ends, the top bit set for a RESULT (a ring of answers_cap entries). */
    uint64_t out_queued;     /* bytes ever added to the output */
    struct evbuffer_cb_entry *output_cb; /* settles the answers as the output is written */
    uint64_t *answers;
    size_t answers_cap, answers_head, answers_count;

    /* Socket copies on the pool (ctx->bulk, daemon/bulk.h), at most one each way. While the read
     * job runs (bulk_reading) the loop does not read this socket (reads stay off) and does not
     * touch the decoder's window. A write job owns the output from its start until its frame is
     * written whole (bulk_writing): nothing else is written meanwhile, and the bytes it has left
     * count in conn_output_len; between its runs on the pool (wjob_busy) it waits for the socket
     * to take more (wev). A closed connection is freed once no job is on the pool (closed_told:
     * the server was told already; settled: its answers are counted). */
    epd_bulk_job_t rjob, wjob;
    bool bulk_reading, bulk_writing, wjob_busy, closed_told, settled;
    struct event *wev;          /* the socket is writable again, for the write job */
    uint64_t bulk_out_left;     /* bytes the write job has not written yet */
    uint8_t *bulk_head;         /* the head of the frame it writes (malloc'ed) */
    epd_result_t *bulk_result;  /* whose y it writes after the head */
};

/* daemon/conn.c: sends a frame now, as much as the socket takes, and queues the rest (release
 * frees out's parts once written); an ERROR frame, counted by code; a framing error answered,
 * then the connection closes once the answer is written. */
void epd_conn_send_frame(epd_conn_t *c, epd_frame_out_t *out, evbuffer_ref_cleanup_cb release,
                         void *release_arg);
void epd_conn_send_error(epd_conn_t *c, bool has_id, uint64_t id, epd_status_t code,
                         const char *message);
void epd_conn_fail_framing(epd_conn_t *c, bool has_id, uint64_t id, epd_status_t code,
                           const char *message);

/* daemon/conn_frames.c: one whole frame read from the client, answered or queued. */
void epd_conn_handle_frame(epd_conn_t *c, epd_frame_t *frame);

#endif
