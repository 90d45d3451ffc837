/* region_check: shared host regions through libepd against a running daemon (DESIGN.md section
 * 4b). On each socket given: results through a host region (x, ids, weights and y in it; i64 ids;
 * x alone in it) equal the payload path's bit for bit; the non-blocking interface gives the same;
 * a misbehaving second client on the same rank (unknown, misaligned and out-of-bounds regions, a
 * register without a file descriptor, unregister with requests in flight, closing with requests
 * in flight) gets its errors and leaves the first one's results unchanged.
 *
 *   region_check --hidden H --topk K --experts E --socket PATH [--socket PATH]... */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bf16.h"
#include "common/rng.h"
#include "proto/cuda_dl.h"
#include "proto/epd.h"

#define MAX_TOKENS 48
#define BATCHES 24

static int failures;

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (!(cond)) {                                                     \
            fprintf(stderr, "region_check: FAILED %s: ", #cond);           \
            fprintf(stderr, __VA_ARGS__);                                  \
            fprintf(stderr, "\n");                                         \
            failures++;                                                    \
        }                                                                  \
    } while (0)

static uint32_t H, K, E;

/* Where the tensors of one batch sit in a region (16-byte aligned pieces). */
typedef struct layout {
    uint64_t x, ids, ids64, w, y, bytes;
} layout_t;

static uint64_t align16(uint64_t v)
{
    return (v + 15) & ~UINT64_C(15);
}

static layout_t layout_for(uint32_t n)
{
    layout_t l;
    l.x = 0;
    l.ids = align16(l.x + (uint64_t)n * H * 2);
    l.ids64 = align16(l.ids + (uint64_t)n * K * 4);
    l.w = align16(l.ids64 + (uint64_t)n * K * 8);
    l.y = align16(l.w + (uint64_t)n * K * 4);
    l.bytes = align16(l.y + (uint64_t)n * H * 2);
    return l;
}

typedef struct batch {
    uint32_t n;
    uint16_t x[MAX_TOKENS * 8192];
    int32_t ids[MAX_TOKENS * 16];
    int64_t ids64[MAX_TOKENS * 16];
    float w[MAX_TOKENS * 16];
} batch_t;

/* A batch of n tokens (0: a random count in [1, MAX_TOKENS]). */
static void make_batch_n(batch_t *b, uint64_t *seed, uint32_t n)
{
    b->n = n != 0 ? n : 1 + (uint32_t)(epd_rng_next(seed) % MAX_TOKENS);
    for (uint64_t i = 0; i < (uint64_t)b->n * H; i++)
        b->x[i] = epd_f32_to_bf16(epd_rng_unit_f32(seed) * 8.0f - 4.0f);
    for (uint32_t t = 0; t < b->n; t++) {
        for (uint32_t k = 0; k < K; k++) {
            /* distinct: one expert from each K-th of the experts; some slots empty */
            int32_t e = (int32_t)(k * (E / K) + epd_rng_next(seed) % (E / K));
            int32_t id = epd_rng_next(seed) % 7 == 0 ? -1 : e;
            b->ids[t * K + k] = id;
            b->ids64[t * K + k] = id;
            b->w[t * K + k] = epd_rng_unit_f32(seed);
        }
    }
}

static void make_batch(batch_t *b, uint64_t *seed)
{
    make_batch_n(b, seed, 0);
}

/* The payload path's answer: the oracle. */
static int submit_payload(epd_client_t *c, uint64_t id, const batch_t *b, uint16_t *y)
{
    epd_client_batch_t batch = {.id = id, .n_tokens = b->n, .hidden = H, .topk = K,
                                .x = b->x, .topk_ids = b->ids, .topk_weights = b->w};
    return epd_client_submit(c, &batch, y, NULL);
}

static void fill_region(uint8_t *base, const layout_t *l, const batch_t *b)
{
    memcpy(base + l->x, b->x, (size_t)b->n * H * 2);
    memcpy(base + l->ids, b->ids, (size_t)b->n * K * 4);
    memcpy(base + l->ids64, b->ids64, (size_t)b->n * K * 8);
    memcpy(base + l->w, b->w, (size_t)b->n * K * 4);
    memset(base + l->y, 0xee, (size_t)b->n * H * 2);
}

static epd_client_request_t region_request(uint64_t id, uint32_t region, const layout_t *l,
                                           const batch_t *b, bool ids64, bool y_in_region)
{
    epd_client_request_t r = {.id = id, .n_tokens = b->n, .hidden = H, .topk = K, .layer = -1};
    r.x = (epd_client_tensor_t){.region = region, .offset = l->x};
    r.topk_ids = (epd_client_tensor_t){.region = region, .offset = ids64 ? l->ids64 : l->ids};
    r.ids_i64 = ids64;
    r.topk_weights = (epd_client_tensor_t){.region = region, .offset = l->w};
    if (y_in_region) r.y = (epd_client_tensor_t){.region = region, .offset = l->y};
    return r;
}

/* The misbehaving neighbour: every bad region use answered bad_region, the connection kept;
 * then requests left in flight on a region it unregisters, and on one it closes with. */
static void misbehave(const char *path, const batch_t *b, const layout_t *l)
{
    epd_client_t *bad = epd_client_create();
    uint32_t region = 0;
    void *mem = NULL;
    int rc = epd_client_connect(bad, path, 10000);
    CHECK(rc == EPD_CLIENT_OK, "misbehaving client: connect: %s", epd_client_last_message(bad));
    rc = epd_client_register_host(bad, l->bytes, &region, &mem);
    CHECK(rc == EPD_CLIENT_OK, "misbehaving client: register: %s", epd_client_last_message(bad));
    if (rc != EPD_CLIENT_OK) goto out;
    fill_region(mem, l, b);

    static const struct {
        const char *what;
        uint32_t region_delta; /* added to the real id: names another region */
        uint64_t x_offset;
    } cases[] = {
        {"an unknown region", 1000, 0},
        {"a misaligned offset", 0, 8},
        {"an offset past the end", 0, UINT64_C(1) << 40},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        epd_client_request_t r = region_request(900 + i, region, l, b, false, true);
        r.x.region = region + cases[i].region_delta;
        r.x.offset = cases[i].x_offset;
        rc = epd_client_submit_request(bad, &r, NULL, NULL);
        CHECK(rc == EPD_CLIENT_ERR_DAEMON && strcmp(epd_client_last_error(bad), "bad_region") == 0,
              "%s: rc %s code %s (%s)", cases[i].what, epd_client_rc_name(rc),
              epd_client_last_error(bad), epd_client_last_message(bad));
    }
    rc = epd_client_unregister(bad, region + 77);
    CHECK(rc == EPD_CLIENT_ERR_DAEMON && strcmp(epd_client_last_error(bad), "bad_region") == 0,
          "unregister of an unknown region: %s", epd_client_last_error(bad));

    /* requests in flight, then unregister: they are still answered, from the region */
    for (uint64_t i = 0; i < 4; i++) {
        epd_client_request_t r = region_request(950 + i, region, l, b, false, false);
        rc = epd_client_send_request(bad, &r);
        CHECK(rc == EPD_CLIENT_OK, "pipelined region request: %s", epd_client_last_message(bad));
    }
    uint32_t kept = region;
    rc = epd_client_unregister(bad, region);
    CHECK(rc == EPD_CLIENT_OK, "unregister with requests in flight: %s",
          epd_client_last_message(bad));
    for (uint64_t i = 0; i < 4; i++) {
        epd_client_reply_t reply;
        rc = epd_client_wait(bad, 950 + i, &reply);
        CHECK(rc == EPD_CLIENT_OK, "request %" PRIu64 " in flight at unregister: %s %s", 950 + i,
              epd_client_last_error(bad), epd_client_last_message(bad));
        epd_client_reply_free(&reply);
    }
    /* the region is gone now */
    epd_client_request_t r = region_request(960, kept, l, b, false, false);
    rc = epd_client_submit_request(bad, &r, NULL, NULL);
    CHECK(rc == EPD_CLIENT_ERR_DAEMON && strcmp(epd_client_last_error(bad), "bad_region") == 0,
          "use after unregister: rc %s code %s", epd_client_rc_name(rc),
          epd_client_last_error(bad));

    /* a fresh region, requests in flight, and the connection closed under them */
    rc = epd_client_register_host(bad, l->bytes, &region, &mem);
    CHECK(rc == EPD_CLIENT_OK, "second register: %s", epd_client_last_message(bad));
    if (rc == EPD_CLIENT_OK) {
        fill_region(mem, l, b);
        for (uint64_t i = 0; i < 6; i++) {
            epd_client_request_t q = region_request(970 + i, region, l, b, true, true);
            epd_client_send_request(bad, &q);
        }
    }
out:
    epd_client_destroy(bad); /* closes with requests in flight */
}

/* Device regions (--cuda-device): x, ids and weights in device memory shared by CUDA IPC, y
 * written there by the daemon, equal to the payload path bit for bit; a freed allocation's handle
 * is bad_region. */
static void check_cuda(const char *path, int device, uint64_t seed)
{
    static batch_t b;
    static uint16_t y_pay[MAX_TOKENS * 8192], y_dev[MAX_TOKENS * 8192];
    static uint8_t stage[MAX_TOKENS * 8192 * 4 + 65536];
    layout_t l = layout_for(MAX_TOKENS);
    epd_cuda_dl_t cu;
    char err[256];
    uint8_t handle[64];
    void *dev = NULL;
    uint32_t region = 0;
    unsigned equal = 0;

    if (!epd_cuda_dl_open(&cu, err, sizeof err)) {
        CHECK(false, "--cuda-device: %s", err);
        return;
    }
    epd_client_t *c = epd_client_create();
    int rc = epd_client_connect(c, path, 10000);
    CHECK(rc == EPD_CLIENT_OK, "connect %s: %s", path, epd_client_last_message(c));
    int cr = cu.set_device(device);
    if (cr == 0) cr = cu.malloc(&dev, l.bytes);
    if (cr == 0) cr = cu.ipc_get_mem_handle(handle, dev);
    CHECK(cr == 0, "cuda: %s", cu.error_string(cr));
    if (rc != EPD_CLIENT_OK || cr != 0) goto out;
    rc = epd_client_register_cuda(c, handle, 0, l.bytes, &region);
    CHECK(rc == EPD_CLIENT_OK, "register cuda: %s %s", epd_client_last_error(c),
          epd_client_last_message(c));
    if (rc != EPD_CLIENT_OK) goto out;
    for (int i = 0; i < BATCHES; i++) {
        make_batch(&b, &seed);
        layout_t bl = layout_for(b.n);
        rc = submit_payload(c, 5000 + (uint64_t)i * 2, &b, y_pay);
        CHECK(rc == EPD_CLIENT_OK, "payload submit: %s", epd_client_last_message(c));
        fill_region(stage, &bl, &b);
        /* DESIGN.md 4b: the tensors complete before the SUBMIT (a pageable cudaMemcpy may
         * return before its DMA has landed) */
        cu.memcpy(dev, stage, bl.bytes, 1);
        cu.device_synchronize();
        epd_client_request_t r = region_request(5001 + (uint64_t)i * 2, region, &bl, &b,
                                                i % 2 == 1, true);
        rc = epd_client_submit_request(c, &r, NULL, NULL);
        CHECK(rc == EPD_CLIENT_OK, "device-region submit: %s %s", epd_client_last_error(c),
              epd_client_last_message(c));
        cu.memcpy(y_dev, (uint8_t *)dev + bl.y, (size_t)b.n * H * 2, 2);
        bool same = rc == EPD_CLIENT_OK && memcmp(y_dev, y_pay, (size_t)b.n * H * 2) == 0;
        CHECK(same, "batch %d (%u tokens): y in device memory differs from the payload path", i,
              b.n);
        equal += same;
    }
    /* a non-finite x in device memory is refused like one in the payload */
    {
        layout_t bl = layout_for(b.n);
        uint16_t nan = 0x7fc0;
        cu.memcpy((uint8_t *)dev + bl.x + 2 * 3, &nan, 2, 1);
        cu.device_synchronize();
        epd_client_request_t r = region_request(6000, region, &bl, &b, false, true);
        rc = epd_client_submit_request(c, &r, NULL, NULL);
        CHECK(rc == EPD_CLIENT_ERR_DAEMON &&
                  strcmp(epd_client_last_error(c), "non_finite_input") == 0,
              "NaN in a device x: %s %s", epd_client_rc_name(rc), epd_client_last_error(c));
    }
    /* the handle of an allocation that has been freed */
    {
        void *gone = NULL;
        uint8_t stale[64];
        cr = cu.malloc(&gone, 1 << 20);
        if (cr == 0) cr = cu.ipc_get_mem_handle(stale, gone);
        if (cr == 0) cr = cu.free(gone);
        CHECK(cr == 0, "cuda: %s", cu.error_string(cr));
        uint32_t r2 = 0;
        rc = epd_client_register_cuda(c, stale, 0, 1 << 20, &r2);
        CHECK(rc == EPD_CLIENT_ERR_DAEMON && strcmp(epd_client_last_error(c), "bad_region") == 0,
              "a freed allocation's handle: %s %s (%s)", epd_client_rc_name(rc),
              epd_client_last_error(c), epd_client_last_message(c));
        /* and past the end of a live one */
        rc = epd_client_register_cuda(c, handle, 0, l.bytes + (UINT64_C(1) << 30), &r2);
        CHECK(rc == EPD_CLIENT_ERR_DAEMON && strcmp(epd_client_last_error(c), "bad_region") == 0,
              "a region past its allocation: %s %s", epd_client_rc_name(rc),
              epd_client_last_error(c));
    }
    /* the daemon still serves this connection */
    rc = submit_payload(c, 7000, &b, y_pay);
    CHECK(rc == EPD_CLIENT_OK, "payload after the refusals: %s", epd_client_last_message(c));
    printf("region_check: %s: %u of %d device-region results equal the payload path bit for bit; "
           "a NaN in device x, a freed handle and an oversized region refused\n",
           path, equal, BATCHES);
out:
    epd_client_destroy(c);
    if (dev != NULL) cu.free(dev);
}

static void check_socket(const char *path, uint64_t seed)
{
    static batch_t b;
    static uint16_t y_pay[MAX_TOKENS * 8192], y_got[MAX_TOKENS * 8192];
    layout_t l = layout_for(MAX_TOKENS);
    epd_client_t *c = epd_client_create();
    uint32_t region = 0;
    void *mem = NULL;
    uint64_t id = 1;

    int rc = epd_client_connect(c, path, 10000);
    CHECK(rc == EPD_CLIENT_OK, "connect %s: %s", path, epd_client_last_message(c));
    if (rc != EPD_CLIENT_OK) return;
    rc = epd_client_register_host(c, l.bytes, &region, &mem);
    CHECK(rc == EPD_CLIENT_OK, "register %" PRIu64 " bytes: %s %s", l.bytes,
          epd_client_last_error(c), epd_client_last_message(c));
    if (rc != EPD_CLIENT_OK) goto out;
    uint8_t *base = mem;

    unsigned equal = 0;
    for (int i = 0; i < BATCHES; i++) {
        make_batch(&b, &seed);
        layout_t bl = layout_for(b.n);
        rc = submit_payload(c, id++, &b, y_pay);
        CHECK(rc == EPD_CLIENT_OK, "payload submit: %s", epd_client_last_message(c));
        fill_region(base, &bl, &b);
        /* all in the region, y too; i64 ids on odd batches */
        epd_client_request_t r = region_request(id++, region, &bl, &b, i % 2 == 1, true);
        epd_client_reply_t reply;
        rc = epd_client_send_request(c, &r);
        if (rc == EPD_CLIENT_OK) rc = epd_client_wait(c, r.id, &reply);
        CHECK(rc == EPD_CLIENT_OK, "region submit: %s %s", epd_client_last_error(c),
              epd_client_last_message(c));
        if (rc == EPD_CLIENT_OK) {
            CHECK(reply.y == NULL && reply.y_region == region && reply.y_offset == bl.y,
                  "RESULT should name y's region %u at %" PRIu64 ", names %u at %" PRIu64, region,
                  bl.y, reply.y_region, reply.y_offset);
            bool same = memcmp(base + bl.y, y_pay, (size_t)b.n * H * 2) == 0;
            CHECK(same, "batch %d (%u tokens): y in the region differs from the payload path", i,
                  b.n);
            equal += same;
            epd_client_reply_free(&reply);
        }
        /* x alone in the region, ids and weights in the frame, y in the RESULT */
        epd_client_request_t mixed = {.id = id++, .n_tokens = b.n, .hidden = H, .topk = K,
                                      .layer = i % 3};
        mixed.x = (epd_client_tensor_t){.region = region, .offset = bl.x};
        mixed.topk_ids = (epd_client_tensor_t){.data = b.ids};
        mixed.topk_weights = (epd_client_tensor_t){.data = b.w};
        rc = epd_client_submit_request(c, &mixed, y_got, NULL);
        CHECK(rc == EPD_CLIENT_OK, "mixed submit: %s", epd_client_last_message(c));
        bool same = rc == EPD_CLIENT_OK && memcmp(y_got, y_pay, (size_t)b.n * H * 2) == 0;
        CHECK(same, "batch %d: x from the region, y in the RESULT differs", i);
        equal += same;
        if (i == BATCHES / 2) misbehave(path, &b, &bl);
    }
    /* A NaN late in a large x (past EPD_SUBMIT_DEVICE_SCAN_BYTES: a CUDA daemon scans a
     * page-locked x on the device), in the region and in the frame: refused, the value named */
    {
        make_batch_n(&b, &seed, MAX_TOKENS);
        layout_t bl = layout_for(b.n);
        uint64_t at = (uint64_t)(MAX_TOKENS - 2) * H + H - 5;
        char want[96];
        snprintf(want, sizeof want, "x[%d][%u]", MAX_TOKENS - 2, H - 5);
        uint16_t keep = b.x[at];
        b.x[at] = 0xff80; /* -Inf */
        fill_region(base, &bl, &b);
        epd_client_request_t r = region_request(id++, region, &bl, &b, false, true);
        rc = epd_client_submit_request(c, &r, NULL, NULL);
        CHECK(rc == EPD_CLIENT_ERR_DAEMON &&
                  strcmp(epd_client_last_error(c), "non_finite_input") == 0 &&
                  strstr(epd_client_last_message(c), want) != NULL,
              "-Inf in a large x in a host region: %s %s %s", epd_client_rc_name(rc),
              epd_client_last_error(c), epd_client_last_message(c));
        rc = submit_payload(c, id++, &b, y_got);
        CHECK(rc == EPD_CLIENT_ERR_DAEMON &&
                  strcmp(epd_client_last_error(c), "non_finite_input") == 0 &&
                  strstr(epd_client_last_message(c), want) != NULL,
              "-Inf in a large x in the frame: %s %s %s", epd_client_rc_name(rc),
              epd_client_last_error(c), epd_client_last_message(c));
        b.x[at] = keep;
        /* and the same x, finite, through both: equal */
        rc = submit_payload(c, id++, &b, y_pay);
        CHECK(rc == EPD_CLIENT_OK, "large payload submit: %s", epd_client_last_message(c));
        fill_region(base, &bl, &b);
        r = region_request(id++, region, &bl, &b, false, true);
        rc = epd_client_submit_request(c, &r, NULL, NULL);
        CHECK(rc == EPD_CLIENT_OK && memcmp(base + bl.y, y_pay, (size_t)b.n * H * 2) == 0,
              "a large x in a host region differs from the payload path: %s",
              epd_client_last_message(c));
    }

    /* the non-blocking interface: 8 requests queued, answers collected as they come */
    make_batch(&b, &seed);
    layout_t bl = layout_for(b.n);
    rc = submit_payload(c, id++, &b, y_pay);
    fill_region(base, &bl, &b);
    uint64_t first = id;
    for (int i = 0; i < 8; i++) {
        epd_client_request_t r = region_request(id++, region, &bl, &b, false, false);
        rc = epd_client_queue_request(c, &r);
        CHECK(rc == EPD_CLIENT_OK || rc == EPD_CLIENT_AGAIN, "queue_request: %s",
              epd_client_last_message(c));
    }
    /* an event loop: poll, flush, then take answers until there is none yet */
    unsigned answered = 0, again = 0;
    bool wait = false;
    while (answered < 8) {
        struct pollfd pfd = {.fd = epd_client_fd(c),
                             .events = POLLIN | (epd_client_pending_output(c) ? POLLOUT : 0)};
        if (wait && poll(&pfd, 1, 10000) <= 0) {
            CHECK(false, "no answer within 10 s on the non-blocking path");
            break;
        }
        if (epd_client_pending_output(c)) epd_client_flush(c);
        epd_client_reply_t reply;
        rc = epd_client_try_recv(c, &reply);
        wait = rc == EPD_CLIENT_AGAIN;
        if (rc == EPD_CLIENT_AGAIN) {
            again++;
            continue;
        }
        CHECK(rc == EPD_CLIENT_OK && reply.id >= first && reply.id < first + 8,
              "try_recv: %s id %" PRIu64, epd_client_rc_name(rc), reply.id);
        if (rc == EPD_CLIENT_OK)
            CHECK(memcmp(reply.y, y_pay, (size_t)b.n * H * 2) == 0,
                  "non-blocking request %" PRIu64 " differs from the payload path", reply.id);
        epd_client_reply_free(&reply);
        answered++;
    }
    epd_client_reply_t none;
    rc = epd_client_try_recv(c, &none);
    CHECK(rc == EPD_CLIENT_AGAIN, "try_recv with nothing due gave %s (%s)", epd_client_rc_name(rc),
          epd_client_last_message(c));
    printf("region_check: %s: %u of %d region results equal the payload path bit for bit; "
           "%u non-blocking answers (%u tries found nothing yet)\n",
           path, equal, 2 * BATCHES, answered, again);
out:
    epd_client_destroy(c);
}

int main(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"socket", required_argument, NULL, 's'}, {"hidden", required_argument, NULL, 'H'},
        {"topk", required_argument, NULL, 'K'},   {"experts", required_argument, NULL, 'E'},
        {"cuda-device", required_argument, NULL, 'c'}, {NULL, 0, NULL, 0},
    };
    const char *sockets[16];
    int n_sockets = 0, opt, cuda_device = -1;

    while ((opt = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        switch (opt) {
        case 's':
            if (n_sockets < 16) sockets[n_sockets++] = optarg;
            break;
        case 'H': H = (uint32_t)strtoul(optarg, NULL, 10); break;
        case 'K': K = (uint32_t)strtoul(optarg, NULL, 10); break;
        case 'E': E = (uint32_t)strtoul(optarg, NULL, 10); break;
        case 'c': cuda_device = (int)strtol(optarg, NULL, 10); break;
        default: return 2;
        }
    }
    if (n_sockets == 0 || H == 0 || H > 8192 || K == 0 || K > 16 || E < K) {
        fprintf(stderr, "usage: region_check --hidden H --topk K --experts E --socket PATH...\n");
        return 2;
    }
    for (int i = 0; i < n_sockets; i++) {
        if (cuda_device >= 0)
            check_cuda(sockets[i], cuda_device, 4321 + (uint64_t)i);
        else
            check_socket(sockets[i], 1234 + (uint64_t)i);
    }
    if (failures) fprintf(stderr, "region_check: %d failures\n", failures);
    return failures ? 1 : 0;
}
