/* libFuzzer harness of proto/: the incremental decoder (fed in chunks whose size the input's
 * first byte picks), whole-buffer decoding, SUBMIT validation under two sets of limits, RESULT
 * tensor parsing, and a re-encode/decode/validate round trip of every SUBMIT that validates.
 * Built and run by `make fuzz` (tests/fuzz/run.sh). */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/frame.h"

#define FUZZ_MAX_PAYLOAD (1u << 20)

#define FUZZ_CHECK(cond)                                                   \
    do {                                                                   \
        if (!(cond)) {                                                     \
            fprintf(stderr, "fuzz_frame: %s failed at line %d\n", #cond, __LINE__); \
            abort();                                                       \
        }                                                                  \
    } while (0)

static const epd_submit_limits_t small_limits = {.hidden = 4, .topk = 2, .num_experts = 8,
                                                 .max_tokens = 64};
static const epd_submit_limits_t wide_limits = {.hidden = 8, .topk = 4, .num_experts = 300,
                                                .max_tokens = 1u << 20};

/* A SUBMIT that validated must survive encode -> decode -> validate unchanged. */
static void check_round_trip(const epd_submit_view_t *v, const epd_submit_limits_t *limits)
{
    epd_frame_out_t out;
    epd_frame_t frame = {0};
    epd_submit_view_t again;
    uint8_t *buf;
    size_t len;
    char err[EPD_ERR_LEN];

    FUZZ_CHECK(epd_frame_encode_submit(v->id, v->n_tokens, v->hidden, v->topk, v->x, v->topk_ids,
                                       v->topk_weights, &out, err) == EPD_OK);
    FUZZ_CHECK(epd_frame_out_flatten(&out, &buf, &len, err) == EPD_OK);
    epd_frame_out_free(&out);
    FUZZ_CHECK(epd_frame_decode(buf, len, FUZZ_MAX_PAYLOAD * 2, &frame, err) == EPD_OK);
    FUZZ_CHECK(epd_submit_validate(&frame, limits, &again, err) == EPD_OK);
    FUZZ_CHECK(again.id == v->id && again.n_tokens == v->n_tokens);
    FUZZ_CHECK(memcmp(again.x, v->x, (size_t)v->n_tokens * v->hidden * 2) == 0);
    FUZZ_CHECK(memcmp(again.topk_ids, v->topk_ids, (size_t)v->n_tokens * v->topk * 4) == 0);
    FUZZ_CHECK(memcmp(again.topk_weights, v->topk_weights, (size_t)v->n_tokens * v->topk * 4) == 0);
    epd_frame_free(&frame);
    free(buf);
}

static void check_frame(epd_frame_t *frame)
{
    char err[EPD_ERR_LEN];
    epd_submit_view_t view;
    epd_tensor_t t;

    FUZZ_CHECK(cJSON_IsObject(frame->meta));
    FUZZ_CHECK(frame->payload_len == 0 || frame->payload != NULL);
    if (frame->type == EPD_FRAME_SUBMIT) {
        const epd_submit_limits_t *all[2] = {&small_limits, &wide_limits};
        for (int i = 0; i < 2; i++) {
            err[0] = '\0';
            epd_status_t status = epd_submit_validate(frame, all[i], &view, err);
            if (status == EPD_OK) {
                check_round_trip(&view, all[i]);
            } else {
                FUZZ_CHECK(epd_status_is_wire_code(status));
                FUZZ_CHECK(strlen(err) > 0);
            }
        }
    } else if (frame->type == EPD_FRAME_RESULT) {
        const cJSON *y = cJSON_GetObjectItemCaseSensitive(
            cJSON_GetObjectItemCaseSensitive(frame->meta, "tensors"), "y");
        if (epd_tensor_parse(y, "y", frame->payload_len, &t, err) == EPD_OK) {
            FUZZ_CHECK(t.begin <= t.end && t.end <= frame->payload_len);
        }
    }
    epd_frame_free(frame);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    epd_decoder_t dec;
    epd_frame_t frame;
    char err[EPD_ERR_LEN];
    size_t chunk, off = 0;

    if (size < 1) return 0;
    chunk = data[0] == 0 ? size : data[0]; /* 0: everything at once */
    data++;
    size--;

    epd_decoder_init(&dec, FUZZ_MAX_PAYLOAD, EPD_FRAME_MAX_META);
    while (off < size) {
        size_t len = size - off < chunk ? size - off : chunk;
        size_t used = 0;
        epd_status_t status = epd_decoder_feed(&dec, data + off, len, &used, &frame, err);
        FUZZ_CHECK(used <= len);
        off += used;
        if (status == EPD_OK) {
            check_frame(&frame);
        } else if (status == EPD_ERR_AGAIN) {
            FUZZ_CHECK(used == len);
        } else {
            FUZZ_CHECK(epd_status_is_framing(status) || status == EPD_ERR_NO_MEMORY);
            FUZZ_CHECK(strlen(err) > 0);
            /* sticky: the same code again, nothing consumed */
            FUZZ_CHECK(epd_decoder_feed(&dec, data, size, &used, &frame, err) == status);
            FUZZ_CHECK(used == 0);
            break;
        }
    }
    epd_decoder_free(&dec);

    /* the whole-buffer form must agree on the first frame */
    if (epd_frame_decode(data, size, FUZZ_MAX_PAYLOAD, &frame, err) == EPD_OK) check_frame(&frame);
    return 0;
}
