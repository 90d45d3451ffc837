/* Unit tests of proto/ (the wire codec): round trips of every frame type, every split of the
 * stream, and malformed headers, meta and SUBMIT tensors (non-finite x included) each with its
 * expected code. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <ctype.h>
#include <string.h>

#include "common/status.h"
#include "common/bf16.h"
#include "proto/frame.h"

#define MAX_PAYLOAD (1u << 20)

/* The SUBMIT limits used by the malformed-input cases: H 4, K 2, E 8, at most 16 tokens. */
static epd_submit_limits_t limits = {.hidden = 4, .topk = 2, .num_experts = 8,
                                           .max_tokens = 16};

/* A flat buffer holding one encoded frame. */
typedef struct {
    uint8_t *buf;
    size_t len;
} bytes_t;

static bytes_t flatten(epd_frame_out_t *out)
{
    char err[EPD_ERR_LEN];
    bytes_t b;
    assert_int_equal(epd_frame_out_flatten(out, &b.buf, &b.len, err), EPD_OK);
    epd_frame_out_free(out);
    return b;
}

/* A raw frame with a chosen header and meta text and payload_len bytes of payload. */
static bytes_t raw_frame(const uint8_t magic[4], uint16_t version, uint16_t type, uint32_t reserved,
                         const char *meta, size_t meta_len, const void *payload,
                         uint64_t payload_len)
{
    bytes_t b;
    b.len = EPD_FRAME_HEADER_LEN + meta_len + (size_t)payload_len;
    b.buf = calloc(1, b.len);
    assert_non_null(b.buf);
    epd_frame_header_encode((epd_frame_type_t)type, (uint32_t)meta_len, payload_len, b.buf);
    if (magic) memcpy(b.buf, magic, 4);
    b.buf[4] = (uint8_t)version;
    b.buf[5] = (uint8_t)(version >> 8);
    b.buf[6] = (uint8_t)type;
    b.buf[7] = (uint8_t)(type >> 8);
    memcpy(b.buf + 12, &reserved, 4);
    memcpy(b.buf + EPD_FRAME_HEADER_LEN, meta, meta_len);
    if (payload) memcpy(b.buf + EPD_FRAME_HEADER_LEN + meta_len, payload, (size_t)payload_len);
    return b;
}

static bytes_t simple_frame(uint16_t type, const char *meta)
{
    return raw_frame(NULL, 1, type, 0, meta, strlen(meta), NULL, 0);
}

static epd_status_t decode_bytes(bytes_t b, epd_frame_t *frame, char err[EPD_ERR_LEN])
{
    epd_status_t status = epd_frame_decode(b.buf, b.len, MAX_PAYLOAD, frame, err);
    free(b.buf);
    return status;
}

static epd_status_t decode_meta(uint16_t type, const char *meta)
{
    epd_frame_t frame = {0};
    char err[EPD_ERR_LEN] = "";
    epd_status_t status = decode_bytes(simple_frame(type, meta), &frame, err);
    if (status != EPD_OK) assert_true(strlen(err) > 10); /* every failure says why */
    epd_frame_free(&frame);
    return status;
}

/* The standard SUBMIT payload of the malformed cases: N = 2, H = 4, K = 2, laid out as ids at
 * [0,16), weights at [16,32), x at [32,48). */
static uint8_t std_payload[48];
#define STD_IDS "\"topk_ids\":{\"dtype\":\"i32\",\"shape\":[2,2],\"data_offsets\":[0,16]}"
#define STD_W "\"topk_weights\":{\"dtype\":\"f32\",\"shape\":[2,2],\"data_offsets\":[16,32]}"
#define STD_X "\"x\":{\"dtype\":\"bf16\",\"shape\":[2,4],\"data_offsets\":[32,48]}"

static void std_payload_fill(const int32_t ids[4], const float w[4])
{
    static const int32_t def_ids[4] = {0, 5, 7, -1};
    static const float def_w[4] = {0.75f, 0.25f, 1.0f, 0.0f};
    uint16_t x[8];
    for (int i = 0; i < 8; i++) x[i] = (uint16_t)(0x3f80 + i); /* 1.0, 1.0078, ... */
    memcpy(std_payload, ids ? ids : def_ids, 16);
    memcpy(std_payload + 16, w ? w : def_w, 16);
    memcpy(std_payload + 32, x, 16);
}

/* Decodes a SUBMIT built from meta text + payload and validates it: the first failing code. */
static epd_status_t submit_status(const char *meta, const void *payload, size_t payload_len,
                                  epd_submit_view_t *view_p, char err[EPD_ERR_LEN])
{
    epd_frame_t frame = {0};
    epd_submit_view_t view;
    epd_status_t status;
    bytes_t b = raw_frame(NULL, 1, EPD_FRAME_SUBMIT, 0, meta, strlen(meta), payload, payload_len);

    err[0] = '\0';
    status = decode_bytes(b, &frame, err);
    if (status == EPD_OK) status = epd_submit_validate(&frame, &limits, &view, err);
    if (status != EPD_OK) assert_true(strlen(err) > 10);
    if (view_p) *view_p = view;
    epd_frame_free(&frame);
    return status;
}

/* A SUBMIT with the standard payload and the given tensors text. */
static epd_status_t std_submit(const char *tensors)
{
    char meta[1024], err[EPD_ERR_LEN];
    snprintf(meta, sizeof(meta), "{\"id\":7,\"tensors\":{%s}}", tensors);
    return submit_status(meta, std_payload, sizeof(std_payload), NULL, err);
}

static epd_status_t std_submit_data(const int32_t ids[4], const float w[4])
{
    epd_status_t status;
    std_payload_fill(ids, w);
    status = std_submit(STD_IDS "," STD_W "," STD_X);
    std_payload_fill(NULL, NULL);
    return status;
}

static int setup(void **state)
{
    (void)state;
    std_payload_fill(NULL, NULL);
    return 0;
}

/* ---- round trips ---- */

static void test_frame__header__encodes_little_endian(void **state)
{
    uint8_t h[EPD_FRAME_HEADER_LEN];
    epd_frame_header_t hdr;
    char err[EPD_ERR_LEN];
    (void)state;
    epd_frame_header_encode(EPD_FRAME_REPLY, 0x01020304, 0x0102030405060708ull, h);
    static const uint8_t want[EPD_FRAME_HEADER_LEN] = {
        'E', 'P', 'D', '1', 1, 0, 5, 0, 4, 3, 2, 1, 0, 0, 0, 0, 8, 7, 6, 5, 4, 3, 2, 1};
    assert_memory_equal(h, want, sizeof(want));
    assert_int_equal(epd_frame_header_decode(h, UINT64_MAX, UINT32_MAX, &hdr, err), EPD_OK);
    assert_int_equal(hdr.type, EPD_FRAME_REPLY);
    assert_int_equal(hdr.meta_len, 0x01020304);
    assert_true(hdr.payload_len == 0x0102030405060708ull);
}

/* N tokens of H 4 / K 2 data with a recognizable pattern. */
typedef struct {
    uint16_t x[16 * 4];
    int32_t ids[16 * 2];
    float w[16 * 2];
} sample_t;

static void sample_fill(sample_t *s, uint32_t n)
{
    for (uint32_t i = 0; i < n * 4; i++) s->x[i] = (uint16_t)(0x3f00 + i * 3);
    for (uint32_t i = 0; i < n; i++) {
        s->ids[2 * i] = (int32_t)(i % 8);
        s->ids[2 * i + 1] = i % 3 == 0 ? -1 : (int32_t)((i + 3) % 8);
        s->w[2 * i] = 0.5f + (float)i;
        s->w[2 * i + 1] = -0.25f * (float)i;
    }
}

static void test_frame__submit__round_trips(void **state)
{
    sample_t s;
    epd_frame_out_t out;
    epd_frame_t frame = {0};
    epd_submit_view_t view;
    char err[EPD_ERR_LEN];
    (void)state;
    sample_fill(&s, 16);
    assert_int_equal(epd_frame_encode_submit(UINT64_MAX, 16, 4, 2, s.x, s.ids, s.w, &out, err),
                     EPD_OK);
    assert_int_equal(out.payload_len, 16 * 2 * 4 * 2 + 16 * 4 * 2);
    assert_int_equal(decode_bytes(flatten(&out), &frame, err), EPD_OK);
    assert_int_equal(frame.type, EPD_FRAME_SUBMIT);
    assert_int_equal(frame.id_kind, EPD_FRAME_ID_VALID);
    assert_true(frame.id == UINT64_MAX); /* exact: not through a double */
    assert_int_equal(epd_submit_validate(&frame, &limits, &view, err), EPD_OK);
    assert_true(view.id == UINT64_MAX);
    assert_int_equal(view.n_tokens, 16);
    assert_memory_equal(view.x, s.x, sizeof(s.x));
    assert_memory_equal(view.topk_ids, s.ids, sizeof(s.ids));
    assert_memory_equal(view.topk_weights, s.w, sizeof(s.w));
    assert_int_equal((uintptr_t)view.topk_weights % 4, 0);
    epd_frame_free(&frame);
}

static void test_frame__result__round_trips(void **state)
{
    uint16_t y[3 * 4];
    epd_frame_out_t out;
    epd_frame_t frame = {0};
    epd_tensor_t t;
    char err[EPD_ERR_LEN];
    (void)state;
    for (int i = 0; i < 12; i++) y[i] = (uint16_t)(0xbf80 - i);
    assert_int_equal(epd_frame_encode_result(42, 9007199254740993ull, 3, 4, y, &out, err), EPD_OK);
    assert_int_equal(decode_bytes(flatten(&out), &frame, err), EPD_OK);
    assert_int_equal(frame.type, EPD_FRAME_RESULT);
    assert_true(frame.id == 42);
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(
        cJSON_GetObjectItemCaseSensitive(frame.meta, "tensors"), "y");
    assert_int_equal(epd_tensor_parse(ty, "y", frame.payload_len, &t, err), EPD_OK);
    assert_int_equal(t.dtype, EPD_DTYPE_BF16);
    assert_int_equal(t.shape[0], 3);
    assert_int_equal(t.shape[1], 4);
    assert_memory_equal(frame.payload + t.begin, y, sizeof(y));
    assert_true(cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(frame.meta, "step")));
    epd_frame_free(&frame);
}

static void test_frame__error__round_trips_with_and_without_id(void **state)
{
    epd_frame_out_t out;
    epd_frame_t frame = {0};
    char err[EPD_ERR_LEN];
    (void)state;
    assert_int_equal(epd_frame_encode_error(true, 5, EPD_ERR_INVALID_TOPK, "token 0: \"dup\"", &out,
                                            err), EPD_OK);
    assert_int_equal(decode_bytes(flatten(&out), &frame, err), EPD_OK);
    assert_int_equal(frame.type, EPD_FRAME_ERROR);
    assert_int_equal(frame.id_kind, EPD_FRAME_ID_VALID);
    assert_true(frame.id == 5);
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(frame.meta, "code")->valuestring,
                        "invalid_topk");
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(frame.meta, "message")->valuestring,
                        "token 0: \"dup\"");
    epd_frame_free(&frame);

    /* no id, and a message with invalid UTF-8 that must still decode on the other side */
    assert_int_equal(epd_frame_encode_error(false, 0, EPD_ERR_BAD_MAGIC, "bad \xff\xc3 end", &out,
                                            err), EPD_OK);
    assert_int_equal(decode_bytes(flatten(&out), &frame, err), EPD_OK);
    assert_int_equal(frame.id_kind, EPD_FRAME_ID_NULL);
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(frame.meta, "message")->valuestring,
                        "bad ?? end");
    epd_frame_free(&frame);

    assert_int_equal(epd_frame_encode_error(true, 1, EPD_ERR_NO_MEMORY, "x", &out, err),
                     EPD_ERR_INVALID_ARG);
}

static void test_frame__control_and_reply__round_trip(void **state)
{
    epd_frame_out_t out;
    epd_frame_t frame = {0};
    char err[EPD_ERR_LEN];
    static const char prom[] = "# TYPE epd_steps counter\nepd_steps 3\n";
    (void)state;
    assert_int_equal(epd_frame_encode_control("metrics", &out, err), EPD_OK);
    assert_int_equal(decode_bytes(flatten(&out), &frame, err), EPD_OK);
    assert_int_equal(frame.type, EPD_FRAME_CONTROL);
    assert_int_equal(frame.id_kind, EPD_FRAME_ID_ABSENT);
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(frame.meta, "op")->valuestring, "metrics");
    epd_frame_free(&frame);

    assert_int_equal(epd_frame_encode_reply("{\"model.hidden\":7168,\"ok\":true}", prom,
                                            strlen(prom), &out, err), EPD_OK);
    assert_int_equal(decode_bytes(flatten(&out), &frame, err), EPD_OK);
    assert_int_equal(frame.type, EPD_FRAME_REPLY);
    assert_int_equal(cJSON_GetObjectItemCaseSensitive(frame.meta, "model.hidden")->valueint, 7168);
    assert_int_equal(frame.payload_len, strlen(prom));
    assert_memory_equal(frame.payload, prom, strlen(prom));
    epd_frame_free(&frame);

    assert_int_equal(epd_frame_encode_reply("[1,2]", NULL, 0, &out, err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_frame_encode_reply("{\"a\":", NULL, 0, &out, err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_frame_encode_control("", &out, err), EPD_ERR_INVALID_ARG);
}

/* ---- splits of the stream ---- */

static bytes_t sample_submit(uint64_t id, uint32_t n)
{
    static sample_t s;
    epd_frame_out_t out;
    char err[EPD_ERR_LEN];
    sample_fill(&s, n);
    assert_int_equal(epd_frame_encode_submit(id, n, 4, 2, s.x, s.ids, s.w, &out, err), EPD_OK);
    return flatten(&out);
}

static void assert_sample_frame(epd_frame_t *frame, uint64_t id, uint32_t n)
{
    epd_submit_view_t view;
    sample_t s;
    char err[EPD_ERR_LEN];
    sample_fill(&s, n);
    assert_int_equal(epd_submit_validate(frame, &limits, &view, err), EPD_OK);
    assert_true(view.id == id);
    assert_int_equal(view.n_tokens, n);
    assert_memory_equal(view.x, s.x, n * 4 * 2);
    assert_memory_equal(view.topk_weights, s.w, n * 2 * 4);
    epd_frame_free(frame);
}

static void test_frame__every_split__yields_the_frame(void **state)
{
    bytes_t b = sample_submit(11, 3);
    char err[EPD_ERR_LEN];
    (void)state;
    for (size_t cut = 0; cut <= b.len; cut++) {
        epd_decoder_t dec;
        epd_frame_t frame = {0};
        size_t used = 0;
        epd_decoder_init(&dec, MAX_PAYLOAD, EPD_FRAME_MAX_META);
        epd_status_t status = epd_decoder_feed(&dec, b.buf, cut, &used, &frame, err);
        if (cut < b.len) {
            assert_int_equal(status, EPD_ERR_AGAIN);
            assert_int_equal(used, cut);
            assert_int_equal(epd_decoder_idle(&dec), cut == 0);
            status = epd_decoder_feed(&dec, b.buf + cut, b.len - cut, &used, &frame, err);
            assert_int_equal(used, b.len - cut);
        }
        assert_int_equal(status, EPD_OK);
        assert_true(epd_decoder_idle(&dec));
        assert_sample_frame(&frame, 11, 3);
        epd_decoder_free(&dec);
    }
    free(b.buf);
}

static void test_frame__one_byte_at_a_time__yields_each_frame(void **state)
{
    bytes_t a = sample_submit(1, 2), b = sample_submit(2, 5);
    uint8_t *stream = malloc(a.len + b.len);
    epd_decoder_t dec;
    epd_frame_t frames[2];
    int n_frames = 0;
    char err[EPD_ERR_LEN];
    (void)state;
    assert_non_null(stream);
    memcpy(stream, a.buf, a.len);
    memcpy(stream + a.len, b.buf, b.len);
    epd_decoder_init(&dec, MAX_PAYLOAD, EPD_FRAME_MAX_META);
    for (size_t i = 0; i < a.len + b.len; i++) {
        size_t used = 0;
        epd_status_t status = epd_decoder_feed(&dec, stream + i, 1, &used, &frames[n_frames], err);
        assert_int_equal(used, 1);
        if (status == EPD_OK) {
            assert_int_equal(i, n_frames == 0 ? a.len - 1 : a.len + b.len - 1);
            n_frames++;
        } else {
            assert_int_equal(status, EPD_ERR_AGAIN);
        }
    }
    assert_int_equal(n_frames, 2);
    assert_sample_frame(&frames[0], 1, 2);
    assert_sample_frame(&frames[1], 2, 5);

    /* both frames in one feed: the first stops at its end, the rest yields the second */
    size_t used = 0;
    assert_int_equal(epd_decoder_feed(&dec, stream, a.len + b.len, &used, &frames[0], err), EPD_OK);
    assert_int_equal(used, a.len);
    assert_int_equal(epd_decoder_feed(&dec, stream + used, b.len, &used, &frames[1], err), EPD_OK);
    assert_int_equal(used, b.len);
    assert_sample_frame(&frames[0], 1, 2);
    assert_sample_frame(&frames[1], 2, 5);
    epd_decoder_free(&dec);
    free(stream);
    free(a.buf);
    free(b.buf);
}

static void test_frame__partial_frame__is_freed_by_decoder_free(void **state)
{
    bytes_t b = sample_submit(3, 4);
    epd_decoder_t dec;
    epd_frame_t frame = {0};
    size_t used;
    char err[EPD_ERR_LEN];
    (void)state;
    epd_decoder_init(&dec, MAX_PAYLOAD, EPD_FRAME_MAX_META);
    /* stop inside the meta, then inside the payload: ASan reports any leak */
    assert_int_equal(epd_decoder_feed(&dec, b.buf, 30, &used, &frame, err), EPD_ERR_AGAIN);
    epd_decoder_reset(&dec);
    assert_int_equal(epd_decoder_feed(&dec, b.buf, b.len - 3, &used, &frame, err), EPD_ERR_AGAIN);
    assert_false(epd_decoder_idle(&dec));
    epd_decoder_free(&dec);
    free(b.buf);
}

/* ---- malformed frames ---- */

static void test_frame__bad_magic__is_bad_magic(void **state)
{
    (void)state;
    bytes_t b = raw_frame((const uint8_t *)"EPD2", 1, 4, 0, "{}", 2, NULL, 0);
    epd_frame_t frame;
    char err[EPD_ERR_LEN];
    assert_int_equal(decode_bytes(b, &frame, err), EPD_ERR_BAD_MAGIC);
    b = raw_frame((const uint8_t *)"GET ", 1, 4, 0, "{}", 2, NULL, 0);
    assert_int_equal(decode_bytes(b, &frame, err), EPD_ERR_BAD_MAGIC);
}

static void test_frame__bad_version__is_bad_version(void **state)
{
    epd_frame_t frame;
    char err[EPD_ERR_LEN];
    (void)state;
    assert_int_equal(decode_bytes(raw_frame(NULL, 2, 4, 0, "{}", 2, NULL, 0), &frame, err),
                     EPD_ERR_BAD_VERSION);
    assert_int_equal(decode_bytes(raw_frame(NULL, 0, 4, 0, "{}", 2, NULL, 0), &frame, err),
                     EPD_ERR_BAD_VERSION);
}

static void test_frame__unknown_type__is_bad_type(void **state)
{
    epd_frame_t frame;
    char err[EPD_ERR_LEN];
    (void)state;
    assert_int_equal(decode_bytes(raw_frame(NULL, 1, 0, 0, "{}", 2, NULL, 0), &frame, err),
                     EPD_ERR_BAD_TYPE);
    assert_int_equal(decode_bytes(raw_frame(NULL, 1, 8, 0, "{}", 2, NULL, 0), &frame, err),
                     EPD_ERR_BAD_TYPE);
    assert_int_equal(decode_bytes(raw_frame(NULL, 1, 0x0104, 0, "{}", 2, NULL, 0), &frame, err),
                     EPD_ERR_BAD_TYPE);
}

static void test_frame__reserved_nonzero__is_bad_header(void **state)
{
    epd_frame_t frame;
    char err[EPD_ERR_LEN];
    (void)state;
    assert_int_equal(decode_bytes(raw_frame(NULL, 1, 4, 1u << 31, "{}", 2, NULL, 0), &frame, err),
                     EPD_ERR_BAD_HEADER);
}

static void test_frame__oversize__is_frame_too_large_before_allocation(void **state)
{
    uint8_t h[EPD_FRAME_HEADER_LEN];
    epd_decoder_t dec;
    epd_frame_t frame;
    size_t used;
    char err[EPD_ERR_LEN];
    (void)state;
    /* only the header is fed: the limits are checked on it alone */
    epd_decoder_init(&dec, MAX_PAYLOAD, EPD_FRAME_MAX_META);
    epd_frame_header_encode(EPD_FRAME_CONTROL, EPD_FRAME_MAX_META + 1, 0, h);
    assert_int_equal(epd_decoder_feed(&dec, h, sizeof(h), &used, &frame, err),
                     EPD_ERR_FRAME_TOO_LARGE);
    assert_non_null(strstr(err, "meta_len"));
    assert_null(dec.meta_text);
    epd_decoder_reset(&dec);
    epd_frame_header_encode(EPD_FRAME_SUBMIT, 2, (uint64_t)MAX_PAYLOAD + 1, h);
    assert_int_equal(epd_decoder_feed(&dec, h, sizeof(h), &used, &frame, err),
                     EPD_ERR_FRAME_TOO_LARGE);
    assert_non_null(strstr(err, "payload_len"));
    epd_decoder_reset(&dec);
    epd_frame_header_encode(EPD_FRAME_SUBMIT, 2, UINT64_MAX, h);
    assert_int_equal(epd_decoder_feed(&dec, h, sizeof(h), &used, &frame, err),
                     EPD_ERR_FRAME_TOO_LARGE);
    /* a failed stream stays failed until reset */
    assert_int_equal(epd_decoder_feed(&dec, "{}", 2, &used, &frame, err), EPD_ERR_FRAME_TOO_LARGE);
    assert_int_equal(used, 0);
    epd_decoder_free(&dec);
}

static void test_frame__bad_meta_json__is_bad_json(void **state)
{
    (void)state;
    static const struct {
        const char *meta;
        size_t len;
    } cases[] = {
        {"{\"op\":\"hea", 10},                  /* truncated */
        {"{\"op\":\"health\"", 14},             /* truncated, no closing brace */
        {"[1,2,3]", 7},                         /* not an object */
        {"\"health\"", 8},                      /* a string */
        {"42", 2},                              /* a number */
        {"{op: health}", 12},                   /* garbage */
        {"{\"op\":\"health\"} x", 17},          /* trailing garbage */
        {"{\"op\":\"health\"}{}", 16},          /* two values */
        {"{\"op\":\"he\xffth\"}", 14},          /* invalid UTF-8 */
        {"{\"op\":\"\xc0\xaf\"}", 11},          /* overlong UTF-8 */
        {"{\"op\":\"\xed\xa0\x80\"}", 12},      /* UTF-8 surrogate */
        {"{\"op\":\"health\"}\0\0", 17},        /* NUL inside meta_len */
        {"{}", 0},                              /* meta_len 0 */
        {"{", 1},                               /* meta_len 1 */
    };
    for (size_t i = 0; i < EPD_ARRAY_SIZE(cases); i++) {
        epd_frame_t frame = {0};
        char err[EPD_ERR_LEN] = "";
        epd_status_t status = decode_bytes(
            raw_frame(NULL, 1, EPD_FRAME_CONTROL, 0, cases[i].meta, cases[i].len, NULL, 0), &frame,
            err);
        if (status != EPD_ERR_BAD_JSON) fail_msg("case %zu: got %s", i, epd_status_name(status));
        assert_true(strlen(err) > 10);
    }
    /* valid: whitespace around the object, UTF-8 text */
    assert_int_equal(decode_meta(EPD_FRAME_CONTROL, " \n{\"op\":\"h\xc3\xa9\xe2\x82\xac\"}\t "),
                     EPD_OK);
}

/* Issue 20 item 9: meta cJSON took although it is not RFC 8259 JSON. */
/* Feeds one frame's bytes to a decoder that keeps EXPERTS meta as text. */
static epd_status_t decode_keeping_text(bytes_t b, epd_frame_t *frame, char err[EPD_ERR_LEN])
{
    epd_decoder_t dec;
    size_t used = 0;
    epd_decoder_init(&dec, MAX_PAYLOAD, EPD_FRAME_MAX_META);
    epd_decoder_keep_text(&dec, 1u << EPD_FRAME_EXPERTS);
    epd_decoder_reset(&dec); /* the setting survives a reset */
    epd_status_t status = epd_decoder_feed(&dec, b.buf, b.len, &used, frame, err);
    epd_decoder_free(&dec);
    free(b.buf);
    return status;
}

static void test_frame__keep_text__gives_checked_meta_text_for_those_types_only(void **state)
{
    (void)state;
    const char *meta = " {\"step\":7,\"id\":42,\"counts\":[1,2,3]} ";
    epd_frame_t frame = {0};
    char err[EPD_ERR_LEN] = "";

    assert_int_equal(decode_keeping_text(simple_frame(EPD_FRAME_EXPERTS, meta), &frame, err),
                     EPD_OK);
    assert_null(frame.meta);
    assert_non_null(frame.meta_text);
    assert_string_equal(frame.meta_text, meta);
    assert_int_equal(frame.id_kind, EPD_FRAME_ID_VALID);
    assert_int_equal(frame.id, 42);
    epd_frame_free(&frame);
    assert_null(frame.meta_text);
    /* other types still get the tree */
    assert_int_equal(decode_keeping_text(simple_frame(EPD_FRAME_REPLY, meta), &frame, err),
                     EPD_OK);
    assert_non_null(frame.meta);
    assert_null(frame.meta_text);
    epd_frame_free(&frame);
    /* kept text is checked as strictly: not strict, not UTF-8, not an object */
    static const char *const bad[] = {"{\"step\":07}", "{\"s\":\"\xff\"}", "[1,2]", " \"x\""};
    for (size_t i = 0; i < EPD_ARRAY_SIZE(bad); i++) {
        err[0] = '\0';
        epd_status_t status =
            decode_keeping_text(simple_frame(EPD_FRAME_EXPERTS, bad[i]), &frame, err);
        if (status != EPD_ERR_BAD_JSON) fail_msg("case %zu: got %s", i, epd_status_name(status));
        assert_true(strlen(err) > 10);
    }
}

/* The top-level "id" is found by the strict checker's own pass (the first member whose key is
 * "id"; a key with escapes before it makes the decoder decode them), the same for metas kept as
 * text and for those given as a tree: raw UTF-8 and escapes elsewhere, nested "id"s, keys that
 * only start with "id", and values that are not ids. */
static void test_frame__top_level_id__found_in_the_checkers_pass(void **state)
{
    (void)state;
    static const struct {
        const char *meta;
        epd_frame_id_kind_t kind;
        uint64_t id;
    } cases[] = {
        {"{\"id\":5}", EPD_FRAME_ID_VALID, 5},
        {"{\"s\":\"\\u00e9\xc3\xa9\",\"id\":5}", EPD_FRAME_ID_VALID, 5},
        {"{\"\xc3\xa9\":1, \"id\" : 7 }", EPD_FRAME_ID_VALID, 7},
        {"{\"x\":[{\"id\":1}],\"id\":null}", EPD_FRAME_ID_NULL, 0},
        {"{\"x\":{\"id\":1}}", EPD_FRAME_ID_ABSENT, 0},
        {"{\"i\\u0064\":3}", EPD_FRAME_ID_VALID, 3},
        {"{\"a\\\\\":1,\"id\":4}", EPD_FRAME_ID_VALID, 4},
        {"{\"\\u0069d\":\"3\"}", EPD_FRAME_ID_INVALID, 0},
        {"{\"ids\":1,\"idx\":2,\"id\":18446744073709551615}", EPD_FRAME_ID_VALID,
         UINT64_MAX},
        {"{\"idx\":1}", EPD_FRAME_ID_ABSENT, 0},
        {"{\"id\":-1}", EPD_FRAME_ID_INVALID, 0},
        {"{\"id\":1.5}", EPD_FRAME_ID_INVALID, 0},
        {"{\"id\":18446744073709551616}", EPD_FRAME_ID_INVALID, 0},
        {"{\"id\":2,\"id\":3}", EPD_FRAME_ID_VALID, 2},
    };
    for (size_t i = 0; i < EPD_ARRAY_SIZE(cases); i++) {
        for (int kept = 0; kept < 2; kept++) {
            epd_frame_t frame = {0};
            char err[EPD_ERR_LEN] = "";
            bytes_t b = simple_frame(kept ? EPD_FRAME_EXPERTS : EPD_FRAME_REPLY, cases[i].meta);
            epd_status_t status = kept ? decode_keeping_text(b, &frame, err)
                                       : decode_bytes(b, &frame, err);
            if (status != EPD_OK) fail_msg("case %zu: %s", i, err);
            if (frame.id_kind != cases[i].kind || (cases[i].kind == EPD_FRAME_ID_VALID &&
                                                   frame.id != cases[i].id))
                fail_msg("case %zu (%s): id kind %d id %llu", i, kept ? "text" : "tree",
                         (int)frame.id_kind, (unsigned long long)frame.id);
            epd_frame_free(&frame);
        }
    }
    /* the UTF-8 check's error offset after its eight-byte ASCII steps */
    static const char bad[] = "{\"op\":\"abcdefghijklmnopq\xff\"}";
    epd_frame_t frame = {0};
    char err[EPD_ERR_LEN] = "";
    assert_int_equal(decode_bytes(raw_frame(NULL, 1, EPD_FRAME_CONTROL, 0, bad, sizeof bad - 1,
                                            NULL, 0), &frame, err), EPD_ERR_BAD_JSON);
    assert_non_null(strstr(err, "byte 0xff at offset 24"));
}

static void test_frame__meta_not_strict_json__is_bad_json(void **state)
{
    (void)state;
    static const char *const cases[] = {
        "\xef\xbb\xbf{\"op\":\"health\"}",       /* UTF-8 byte-order mark */
        "{\"op\":\"health\",\"id\":007}",        /* leading zeros */
        "{\"op\":\"health\",\"id\":-01}",        /* leading zero after '-' */
        "{\"op\":\"heal\\u0000th\"}",          /* NUL inside the op, escaped */
        "{\"op\":\"health\",\"x\":1.}",          /* fraction without digits */
        "{\"op\":\"health\",\"x\":.5}",          /* number without an integer part */
        "{\"op\":\"health\",\"x\":+1}",          /* leading '+' */
        "{\"op\":\"health\",\"x\":1e}",          /* exponent without digits */
        "{\"op\":\"he\tlth\"}",                 /* raw control character */
        "{\"op\":\"\\ud800\"}",                /* unpaired high surrogate */
        "{\"op\":\"\\udc00x\"}",               /* unpaired low surrogate */
        "{\"op\":\"health\",}",                  /* trailing comma */
        "{\"op\":\"health\",\"x\":[1,]}",        /* trailing comma in an array */
        "{\"op\":\"\\x41\"}",                  /* unknown escape */
        "{\"op\":tru}",                          /* bad literal */
    };
    for (size_t i = 0; i < EPD_ARRAY_SIZE(cases); i++) {
        epd_frame_t frame = {0};
        char err[EPD_ERR_LEN] = "";
        epd_status_t status = decode_bytes(
            raw_frame(NULL, 1, EPD_FRAME_CONTROL, 0, cases[i], strlen(cases[i]), NULL, 0), &frame,
            err);
        if (status != EPD_ERR_BAD_JSON)
            fail_msg("case %zu (%s): got %s", i, cases[i], epd_status_name(status));
        assert_non_null(strstr(err, "strict JSON"));
    }
    /* strict JSON that cJSON also takes still passes: escapes, pairs, exponents, nesting */
    assert_int_equal(decode_meta(EPD_FRAME_CONTROL,
                                 "{\"op\":\"health\",\"id\":0,\"a\":[-0.5e+3,1E2,0,true,false,"
                                 "null,{}],\"s\":\"\\\"\\\\\\/\\b\\f\\n\\r\\t\\u00e9\\ud83d\\ude00\"}"),
                     EPD_OK);
}

static void test_frame__truncated_stream__is_reported(void **state)
{
    bytes_t b = sample_submit(1, 2);
    epd_frame_t frame;
    char err[EPD_ERR_LEN];
    (void)state;
    assert_int_equal(epd_frame_decode(b.buf, b.len - 1, MAX_PAYLOAD, &frame, err),
                     EPD_ERR_BAD_JSON);
    assert_non_null(strstr(err, "truncated"));
    assert_int_equal(epd_frame_decode(b.buf, 10, MAX_PAYLOAD, &frame, err), EPD_ERR_BAD_JSON);
    free(b.buf);
}

/* ---- SUBMIT meta schema ---- */

static void test_frame__submit_id__missing_or_invalid_is_bad_json(void **state)
{
    static const char *const ids[] = {
        NULL, "-1", "1.5", "1e3", "\"7\"", "null", "true", "[7]", "18446744073709551616", "-0",
    };
    char meta[1024], err[EPD_ERR_LEN];
    epd_submit_view_t view;
    (void)state;
    for (size_t i = 0; i < EPD_ARRAY_SIZE(ids); i++) {
        if (ids[i] == NULL) {
            snprintf(meta, sizeof(meta), "{\"tensors\":{" STD_IDS "," STD_W "," STD_X "}}");
        } else {
            snprintf(meta, sizeof(meta), "{\"id\":%s,\"tensors\":{" STD_IDS "," STD_W "," STD_X
                     "}}", ids[i]);
        }
        epd_status_t status = submit_status(meta, std_payload, sizeof(std_payload), &view, err);
        if (status != EPD_ERR_BAD_JSON) fail_msg("id %s: got %s", ids[i] ? ids[i] : "(none)",
                                                 epd_status_name(status));
        assert_non_null(strstr(err, "id"));
    }
    /* the id is read from the text: escapes in the key, a nested "id" is not the top-level one */
    snprintf(meta, sizeof(meta), "{\"x\":{\"id\":1},\"\\u0069d\":18446744073709551615,\"tensors\":{"
             STD_IDS "," STD_W "," STD_X "}}");
    assert_int_equal(submit_status(meta, std_payload, sizeof(std_payload), &view, err), EPD_OK);
    assert_true(view.id == UINT64_MAX);
}

static void test_frame__submit_tensors__missing_is_bad_json(void **state)
{
    char err[EPD_ERR_LEN];
    (void)state;
    assert_int_equal(submit_status("{\"id\":1}", std_payload, 48, NULL, err), EPD_ERR_BAD_JSON);
    assert_int_equal(submit_status("{\"id\":1,\"tensors\":[]}", std_payload, 48, NULL, err),
                     EPD_ERR_BAD_JSON);
    assert_int_equal(submit_status("{\"id\":1,\"Tensors\":{}}", std_payload, 48, NULL, err),
                     EPD_ERR_BAD_JSON);
}

static void test_frame__submit_valid__passes_and_keeps_minus_one(void **state)
{
    static const int32_t ids[4] = {-1, -1, 7, 0};
    (void)state;
    assert_int_equal(std_submit(STD_IDS "," STD_W "," STD_X), EPD_OK);
    /* same tensors in another order, uppercase safetensors dtype names */
    assert_int_equal(
        std_submit(STD_X "," STD_W ","
                   "\"topk_ids\":{\"dtype\":\"I32\",\"shape\":[2,2],\"data_offsets\":[0,16]}"),
        EPD_OK);
    assert_int_equal(std_submit_data(ids, NULL), EPD_OK);
}

static bool only_layers_below_3(void *arg, uint32_t layer)
{
    (void)arg;
    return layer < 3;
}

static void test_frame__submit_layer__optional_integer_unknown_is_unknown_layer(void **state)
{
    static const char *const bad[] = {"-1", "1.5", "\"2\"", "null", "true", "[1]", "2147483648"};
    char meta[1024], err[EPD_ERR_LEN];
    epd_submit_view_t view;
    (void)state;
    snprintf(meta, sizeof(meta), "{\"id\":1,\"tensors\":{" STD_IDS "," STD_W "," STD_X "}}");
    assert_int_equal(submit_status(meta, std_payload, sizeof(std_payload), &view, err), EPD_OK);
    assert_int_equal(view.layer, 0); /* absent: layer 0 */
    snprintf(meta, sizeof(meta),
             "{\"id\":1,\"layer\":57,\"tensors\":{" STD_IDS "," STD_W "," STD_X "}}");
    assert_int_equal(submit_status(meta, std_payload, sizeof(std_payload), &view, err), EPD_OK);
    assert_int_equal(view.layer, 57); /* no layer_known: every layer is served */
    for (size_t i = 0; i < EPD_ARRAY_SIZE(bad); i++) {
        snprintf(meta, sizeof(meta),
                 "{\"id\":1,\"layer\":%s,\"tensors\":{" STD_IDS "," STD_W "," STD_X "}}",
                 bad[i]);
        epd_status_t status = submit_status(meta, std_payload, sizeof(std_payload), &view, err);
        if (status != EPD_ERR_BAD_JSON) fail_msg("layer %s: got %s", bad[i], epd_status_name(status));
        assert_non_null(strstr(err, "layer"));
    }
    limits.layer_known = only_layers_below_3;
    snprintf(meta, sizeof(meta),
             "{\"id\":5,\"layer\":2,\"tensors\":{" STD_IDS "," STD_W "," STD_X "}}");
    assert_int_equal(submit_status(meta, std_payload, sizeof(std_payload), &view, err), EPD_OK);
    snprintf(meta, sizeof(meta),
             "{\"id\":5,\"layer\":3,\"tensors\":{" STD_IDS "," STD_W "," STD_X "}}");
    assert_int_equal(submit_status(meta, std_payload, sizeof(std_payload), &view, err),
                     EPD_ERR_UNKNOWN_LAYER);
    assert_true(view.id == 5);
    assert_non_null(strstr(err, "layer 3"));
    limits.layer_known = NULL;
}


/* ---- i64 ids and shared regions ---- */

/* A fake region table: region 3 is host memory `region_mem`, region 4 "device" memory (the test's
 * device_read copies it), anything else is unknown. */
static uint8_t region_mem[4096] __attribute__((aligned(64)));
static uint8_t device_mem[4096] __attribute__((aligned(64)));
static int device_reads, device_scans;

static epd_status_t fake_resolve(void *arg, uint32_t id, uint64_t begin, uint64_t end,
                                 epd_region_span_t *span_p, char err[EPD_ERR_LEN])
{
    (void)arg;
    if (id != 3 && id != 4) {
        snprintf(err, EPD_ERR_LEN, "region %u is not registered", id);
        return EPD_ERR_BAD_REGION;
    }
    if (end > sizeof region_mem) {
        snprintf(err, EPD_ERR_LEN, "[%llu, %llu) is past the end of region %u",
                 (unsigned long long)begin, (unsigned long long)end, id);
        return EPD_ERR_BAD_REGION;
    }
    span_p->ptr = (id == 3 ? region_mem : device_mem) + begin;
    span_p->device = id == 4;
    span_p->region = id == 3 ? (void *)region_mem : (void *)device_mem;
    return EPD_OK;
}

/* One round trip: the ids and weights copied, x scanned (counted as one read and one scan). */
static epd_status_t fake_device_fetch(void *arg, const void *ids, size_t ids_bytes, void *ids_dst,
                                      const void *w, size_t w_bytes, void *w_dst,
                                      const uint16_t *x, uint64_t n, int64_t *first_p,
                                      char err[EPD_ERR_LEN])
{
    (void)arg;
    (void)err;
    if (ids != NULL) device_reads++, memcpy(ids_dst, ids, ids_bytes);
    if (w != NULL) device_reads++, memcpy(w_dst, w, w_bytes);
    if (x != NULL) {
        device_scans++;
        *first_p = -1;
        for (uint64_t i = 0; i < n; i++)
            if (!epd_bf16_is_finite(x[i])) {
                *first_p = (int64_t)i;
                break;
            }
    }
    return EPD_OK;
}

static const epd_submit_regions_t fake_regions = {
    .resolve = fake_resolve,
    .device_fetch = fake_device_fetch,
};

static epd_status_t region_submit(const char *tensors, size_t payload_len, epd_submit_view_t *view_p,
                                  char err[EPD_ERR_LEN])
{
    char meta[1024];
    epd_frame_t frame = {0};
    epd_submit_view_t view;
    snprintf(meta, sizeof meta, "{\"id\":4,\"tensors\":{%s}}", tensors);
    bytes_t b = raw_frame(NULL, 1, EPD_FRAME_SUBMIT, 0, meta, strlen(meta), std_payload,
                          payload_len);
    epd_status_t status = decode_bytes(b, &frame, err);
    if (status == EPD_OK) status = epd_submit_validate_regions(&frame, &limits, &fake_regions, &view, err);
    if (status == EPD_OK && view_p != NULL) {
        *view_p = view;
        /* the view may point into the payload: keep what the tests read */
        static int32_t ids_copy[4];
        memcpy(ids_copy, view.topk_ids, sizeof ids_copy);
        view_p->topk_ids = ids_copy;
    }
    free(view.owned);
    if (view_p != NULL) view_p->owned = NULL;
    epd_frame_free(&frame);
    return status;
}

#define RX(region, off) "\"x\":{\"dtype\":\"bf16\",\"shape\":[2,4],\"region\":" #region ",\"offset\":" #off "}"
#define RY(region, off) "\"y\":{\"dtype\":\"bf16\",\"shape\":[2,4],\"region\":" #region ",\"offset\":" #off "}"
#define RIDS(dtype, region, off) "\"topk_ids\":{\"dtype\":\"" dtype "\",\"shape\":[2,2],\"region\":" #region ",\"offset\":" #off "}"
#define RW(region, off) "\"topk_weights\":{\"dtype\":\"f32\",\"shape\":[2,2],\"region\":" #region ",\"offset\":" #off "}"

static void test_frame__i64_ids__narrowed_or_expert_out_of_range(void **state)
{
    int64_t ids[4] = {1, -1, 7, 0};
    char err[EPD_ERR_LEN];
    epd_submit_view_t view;
    (void)state;
    memcpy(region_mem, ids, sizeof ids);
    memset(region_mem + 64, 0, 32); /* weights 0.0 */
    memset(region_mem + 128, 0, 16);
    assert_int_equal(region_submit(RIDS("i64", 3, 0) "," RW(3, 64) "," RX(3, 128), 0, &view, err), EPD_OK);
    assert_int_equal(view.topk_ids[0], 1);
    assert_int_equal(view.topk_ids[1], -1);
    assert_int_equal(view.topk_ids[2], 7);
    ids[2] = INT64_C(1) << 32; /* would be 0 as an i32 */
    memcpy(region_mem, ids, sizeof ids);
    assert_int_equal(region_submit(RIDS("i64", 3, 0) "," RW(3, 64) "," RX(3, 128), 0, NULL, err),
                     EPD_ERR_EXPERT_OUT_OF_RANGE);
    assert_non_null(strstr(err, "token 1 slot 0"));
    assert_non_null(strstr(err, "4294967296"));
}

static void test_frame__region_tensors__bounds_alignment_unknown_are_bad_region(void **state)
{
    char err[EPD_ERR_LEN];
    epd_submit_view_t view;
    (void)state;
    memset(region_mem, 0, sizeof region_mem);
    memset(region_mem, 0xff, 16); /* ids all -1 */
    /* all in region 3; y too; the payload is empty */
    assert_int_equal(region_submit(RIDS("i32", 3, 0) "," RW(3, 16) "," RX(3, 32) "," RY(3, 64), 0,
                                   &view, err), EPD_OK);
    assert_ptr_equal(view.y, region_mem + 64);
    assert_int_equal(view.y_region, 3);
    assert_int_equal(view.y_offset, 64);
    assert_ptr_equal(view.regions[EPD_SUBMIT_X], region_mem);
    /* x in the region, ids and weights in the payload */
    assert_int_equal(region_submit(STD_IDS "," STD_W "," RX(3, 128), 32, &view, err), EPD_OK);
    assert_null(view.regions[EPD_SUBMIT_IDS]);
    /* a payload byte no tensor describes */
    assert_int_equal(region_submit(STD_IDS "," STD_W "," RX(3, 0), 48, NULL, err), EPD_ERR_BAD_TENSOR);
    /* unknown region, misaligned, past the end, offset + bytes overflowing */
    assert_int_equal(region_submit(STD_IDS "," STD_W "," RX(9, 0), 32, NULL, err), EPD_ERR_BAD_REGION);
    assert_non_null(strstr(err, "region 9"));
    assert_int_equal(region_submit(STD_IDS "," STD_W "," RX(3, 8), 32, NULL, err), EPD_ERR_BAD_REGION);
    assert_non_null(strstr(err, "multiple of 16"));
    assert_int_equal(region_submit(STD_IDS "," STD_W "," RX(3, 4096), 32, NULL, err), EPD_ERR_BAD_REGION);
    assert_int_equal(region_submit(STD_IDS "," STD_W "," RX(3, 9007199254740992), 32, NULL, err),
                     EPD_ERR_BAD_REGION);
    /* y in the payload, region and data_offsets both, a region id that is not an integer */
    assert_int_equal(region_submit(STD_IDS "," STD_W "," RX(3, 0) ",\"y\":{\"dtype\":\"bf16\",\"shape\":[2,4],\"data_offsets\":[32,48]}", 48, NULL, err),
                     EPD_ERR_BAD_TENSOR);
    assert_int_equal(region_submit(STD_IDS "," STD_W ",\"x\":{\"dtype\":\"bf16\",\"shape\":[2,4],\"region\":3,\"data_offsets\":[32,48]}", 48, NULL, err),
                     EPD_ERR_BAD_TENSOR);
    assert_int_equal(region_submit(STD_IDS "," STD_W ",\"x\":{\"dtype\":\"bf16\",\"shape\":[2,4],\"region\":\"3\"}", 32, NULL, err),
                     EPD_ERR_BAD_TENSOR);
    /* y of another shape */
    assert_int_equal(region_submit(STD_IDS "," STD_W "," RX(3, 0) ",\"y\":{\"dtype\":\"bf16\",\"shape\":[3,4],\"region\":3,\"offset\":64}", 32, NULL, err),
                     EPD_ERR_SHAPE_MISMATCH);
    /* without a region table every region tensor is bad_region */
    epd_frame_t frame = {0};
    const char *meta = "{\"id\":1,\"tensors\":{" STD_IDS "," STD_W "," RX(3, 0) "}}";
    bytes_t b = raw_frame(NULL, 1, EPD_FRAME_SUBMIT, 0, meta, strlen(meta), std_payload, 32);
    assert_int_equal(decode_bytes(b, &frame, err), EPD_OK);
    assert_int_equal(epd_submit_validate(&frame, &limits, &view, err), EPD_ERR_BAD_REGION);
    free(view.owned);
    epd_frame_free(&frame);
}

static void test_frame__device_tensors__read_and_checked_like_host_ones(void **state)
{
    char err[EPD_ERR_LEN];
    epd_submit_view_t view;
    int32_t ids[4] = {2, 5, 1, 1}; /* token 0 fine, token 1: 1 twice */
    float w[4] = {0.5f, 0.25f, 1.0f, 2.0f};
    (void)state;
    memset(device_mem, 0, sizeof device_mem);
    memcpy(device_mem, ids, sizeof ids);
    memcpy(device_mem + 16, w, sizeof w);
    device_reads = device_scans = 0;
    assert_int_equal(region_submit(RIDS("i32", 4, 0) "," RW(4, 16) "," RX(4, 32), 0, NULL, err),
                     EPD_ERR_INVALID_TOPK);
    assert_int_equal(device_reads, 2);
    ids[2] = 3;
    memcpy(device_mem, ids, sizeof ids);
    /* token 1 is [3, 1] now */
    assert_int_equal(region_submit(RIDS("i32", 4, 0) "," RW(4, 16) "," RX(4, 32), 0, &view, err), EPD_OK);
    assert_true(view.x_device);
    assert_int_equal(view.topk_ids[2], 3);
    /* one round trip per SUBMIT: x is scanned with the ids and weights, also for the refused one */
    assert_int_equal(device_scans, 2);
    assert_int_equal(device_reads, 4);
    memset(device_mem + 32, 0, 16);
    ((uint16_t *)(void *)(device_mem + 32))[5] = 0x7fc0; /* NaN at x[1][1] */
    assert_int_equal(region_submit(RIDS("i32", 4, 0) "," RW(4, 16) "," RX(4, 32), 0, NULL, err),
                     EPD_ERR_NON_FINITE_INPUT);
    assert_non_null(strstr(err, "x[1][1]"));
}

/* ---- SUBMIT tensors ---- */

/* epd_json_to_u64: non-negative integers up to 2^53 (exact as doubles); no fraction, sign,
 * larger value or other type. */
static void test_frame__json_to_u64__integers_up_to_2_53(void **state)
{
    (void)state;
    static const struct {
        const char *text;
        bool ok;
        uint64_t v;
    } cases[] = {{"0", true, 0},          {"7", true, 7},
                 {"9007199254740992", true, 9007199254740992ull},
                 {"9007199254740994", false, 0}, {"-1", false, 0}, {"-0.0", true, 0},
                 {"0.5", false, 0},        {"1e300", false, 0}, {"-1e300", false, 0},
                 {"\"1\"", false, 0},      {"[1]", false, 0},  {"true", false, 0}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cJSON *j = cJSON_Parse(cases[i].text);
        assert_non_null(j);
        uint64_t v = 12345;
        bool ok = epd_json_to_u64(j, &v);
        if (ok != cases[i].ok || (ok && v != cases[i].v))
            fail_msg("%s: %s %llu", cases[i].text, ok ? "ok" : "refused", (unsigned long long)v);
        cJSON_Delete(j);
    }
    uint64_t v;
    assert_false(epd_json_to_u64(NULL, &v));
}

/* A descriptor's keys are found wherever they are, the first of a repeated one taking effect
 * (as cJSON's lookup did), and region and data_offsets together are refused. */
static void test_frame__tensor_keys__any_order_first_wins(void **state)
{
    (void)state;
    epd_tensor_t t;
    char err[EPD_ERR_LEN];
    cJSON *d = cJSON_Parse("{\"offset\":64,\"region\":3,\"shape\":[2,4],\"dtype\":\"i32\"}");
    assert_int_equal(epd_tensor_parse(d, "topk_ids", 0, &t, err), EPD_OK);
    assert_true(t.in_region && t.region == 3 && t.begin == 64 && t.end == 64 + 32);
    assert_int_equal(t.dtype, EPD_DTYPE_I32);
    cJSON_Delete(d);
    /* cJSON_Parse keeps repeated keys: the first one counts */
    d = cJSON_Parse("{\"dtype\":\"f32\",\"dtype\":\"i32\",\"shape\":[1,2],\"shape\":[9],"
                    "\"data_offsets\":[0,8],\"data_offsets\":[0,4]}");
    assert_int_equal(epd_tensor_parse(d, "w", 8, &t, err), EPD_OK);
    assert_true(t.dtype == EPD_DTYPE_F32 && t.ndim == 2 && t.end == 8);
    cJSON_Delete(d);
    d = cJSON_Parse("{\"dtype\":\"f32\",\"shape\":[1,2],\"data_offsets\":[0,8],\"region\":1}");
    assert_int_equal(epd_tensor_parse(d, "w", 8, &t, err), EPD_ERR_BAD_TENSOR);
    assert_non_null(strstr(err, "one or the other"));
    cJSON_Delete(d);
}

static void test_frame__tensor_missing_or_unknown__is_bad_tensor(void **state)
{
    (void)state;
    assert_int_equal(std_submit(STD_IDS "," STD_W), EPD_ERR_BAD_TENSOR);
    assert_int_equal(std_submit(STD_IDS "," STD_X), EPD_ERR_BAD_TENSOR);
    assert_int_equal(std_submit(STD_IDS "," STD_W "," STD_X ",\"z\":{}"), EPD_ERR_BAD_TENSOR);
    assert_int_equal(std_submit(STD_IDS "," STD_W "," STD_X "," STD_X), EPD_ERR_BAD_TENSOR);
    assert_int_equal(std_submit(STD_IDS "," STD_W ",\"x\":[]"), EPD_ERR_BAD_TENSOR);
}

static void test_frame__unknown_dtype__is_bad_tensor(void **state)
{
    (void)state;
    assert_int_equal(
        std_submit(STD_IDS "," STD_W
                   ",\"x\":{\"dtype\":\"bfloat17\",\"shape\":[2,4],\"data_offsets\":[32,48]}"),
        EPD_ERR_BAD_TENSOR);
    assert_int_equal(
        std_submit(STD_IDS "," STD_W ",\"x\":{\"dtype\":16,\"shape\":[2,4],\"data_offsets\":[32,48]}"),
        EPD_ERR_BAD_TENSOR);
    assert_int_equal(std_submit(STD_IDS "," STD_W ",\"x\":{\"shape\":[2,4],\"data_offsets\":[32,48]}"),
                     EPD_ERR_BAD_TENSOR);
}

static void test_frame__known_other_dtype__is_unsupported_dtype(void **state)
{
    (void)state;
    assert_int_equal(
        std_submit(STD_IDS "," STD_W ",\"x\":{\"dtype\":\"f16\",\"shape\":[2,4],\"data_offsets\":[32,48]}"),
        EPD_ERR_UNSUPPORTED_DTYPE);
    assert_int_equal(
        std_submit(STD_IDS "," STD_W ",\"x\":{\"dtype\":\"f8_e4m3\",\"shape\":[2,8],\"data_offsets\":[32,48]}"),
        EPD_ERR_UNSUPPORTED_DTYPE);
    assert_int_equal(
        std_submit(STD_W "," STD_X ",\"topk_ids\":{\"dtype\":\"u32\",\"shape\":[2,2],\"data_offsets\":[0,16]}"),
        EPD_ERR_UNSUPPORTED_DTYPE);
    assert_int_equal(
        std_submit(STD_IDS "," STD_X ",\"topk_weights\":{\"dtype\":\"f64\",\"shape\":[2,1],\"data_offsets\":[16,32]}"),
        EPD_ERR_UNSUPPORTED_DTYPE);
    assert_int_equal(
        std_submit(STD_W "," STD_X ",\"topk_ids\":{\"dtype\":\"u8\",\"shape\":[2,8],\"data_offsets\":[0,16]}"),
        EPD_ERR_UNSUPPORTED_DTYPE);
}

static void test_frame__wrong_ndim__is_bad_tensor(void **state)
{
    (void)state;
    assert_int_equal(
        std_submit(STD_IDS "," STD_W ",\"x\":{\"dtype\":\"bf16\",\"shape\":[2,2,2],\"data_offsets\":[32,48]}"),
        EPD_ERR_BAD_TENSOR);
    assert_int_equal(
        std_submit(STD_IDS "," STD_W ",\"x\":{\"dtype\":\"bf16\",\"shape\":[8],\"data_offsets\":[32,48]}"),
        EPD_ERR_BAD_TENSOR);
    assert_int_equal(
        std_submit(STD_IDS "," STD_W ",\"x\":{\"dtype\":\"bf16\",\"shape\":[2,-4],\"data_offsets\":[32,48]}"),
        EPD_ERR_BAD_TENSOR);
    assert_int_equal(
        std_submit(STD_IDS "," STD_W ",\"x\":{\"dtype\":\"bf16\",\"shape\":[2,4.5],\"data_offsets\":[32,48]}"),
        EPD_ERR_BAD_TENSOR);
}

static void test_frame__shape_offsets_disagree__is_bad_tensor(void **state)
{
    (void)state;
    /* [2,4] bf16 is 16 bytes, not 14 */
    assert_int_equal(
        std_submit(STD_IDS "," STD_W ",\"x\":{\"dtype\":\"bf16\",\"shape\":[2,4],\"data_offsets\":[32,46]}"),
        EPD_ERR_BAD_TENSOR);
    /* a shape product that overflows 64 bits */
    assert_int_equal(
        std_submit(STD_IDS "," STD_W ",\"x\":{\"dtype\":\"bf16\",\"shape\":[4294967296,4294967296],"
                   "\"data_offsets\":[32,48]}"),
        EPD_ERR_BAD_TENSOR);
    assert_int_equal(
        std_submit(STD_IDS "," STD_W ",\"x\":{\"dtype\":\"bf16\",\"shape\":[2,4],\"data_offsets\":[32]}"),
        EPD_ERR_BAD_TENSOR);
}

static void test_frame__offsets_past_end__is_bad_tensor(void **state)
{
    (void)state;
    assert_int_equal(
        std_submit(STD_IDS "," STD_W ",\"x\":{\"dtype\":\"bf16\",\"shape\":[2,4],\"data_offsets\":[34,50]}"),
        EPD_ERR_BAD_TENSOR);
    assert_int_equal(
        std_submit(STD_IDS "," STD_W ",\"x\":{\"dtype\":\"bf16\",\"shape\":[2,4],"
                   "\"data_offsets\":[18446744073709551600,18446744073709551616]}"),
        EPD_ERR_BAD_TENSOR);
}

static void test_frame__begin_after_end__is_bad_tensor(void **state)
{
    (void)state;
    assert_int_equal(
        std_submit(STD_IDS "," STD_W ",\"x\":{\"dtype\":\"bf16\",\"shape\":[2,4],\"data_offsets\":[48,32]}"),
        EPD_ERR_BAD_TENSOR);
}

static void test_frame__overlap__is_bad_tensor(void **state)
{
    char err[EPD_ERR_LEN], meta[1024];
    (void)state;
    /* x moved onto the weights: [16,32) twice, [32,48) undescribed */
    snprintf(meta, sizeof(meta), "{\"id\":1,\"tensors\":{" STD_IDS "," STD_W
             ",\"x\":{\"dtype\":\"bf16\",\"shape\":[2,4],\"data_offsets\":[16,32]}}}");
    assert_int_equal(submit_status(meta, std_payload, 48, NULL, err), EPD_ERR_BAD_TENSOR);
    assert_non_null(strstr(err, "overlaps"));
}

static void test_frame__gap__is_bad_tensor(void **state)
{
    char err[EPD_ERR_LEN], meta[1024];
    uint8_t payload[52] = {0};
    (void)state;
    /* 4 bytes nobody describes between weights and x */
    snprintf(meta, sizeof(meta), "{\"id\":1,\"tensors\":{" STD_IDS "," STD_W
             ",\"x\":{\"dtype\":\"bf16\",\"shape\":[2,4],\"data_offsets\":[36,52]}}}");
    assert_int_equal(submit_status(meta, payload, 52, NULL, err), EPD_ERR_BAD_TENSOR);
    assert_non_null(strstr(err, "no tensor"));
    /* 4 trailing bytes */
    snprintf(meta, sizeof(meta), "{\"id\":1,\"tensors\":{" STD_IDS "," STD_W "," STD_X "}}");
    assert_int_equal(submit_status(meta, payload, 52, NULL, err), EPD_ERR_BAD_TENSOR);
    assert_non_null(strstr(err, "no tensor"));
}

static void test_frame__misaligned_offset__is_bad_tensor(void **state)
{
    char err[EPD_ERR_LEN], meta[1024];
    uint8_t payload[50] = {0};
    (void)state;
    /* x first at [0,16), ids at [16,32), weights at [32,48) would be fine; shift weights by 2 */
    snprintf(meta, sizeof(meta), "{\"id\":1,\"tensors\":{"
             "\"x\":{\"dtype\":\"bf16\",\"shape\":[2,4],\"data_offsets\":[0,18]},"
             "\"topk_ids\":{\"dtype\":\"i32\",\"shape\":[2,2],\"data_offsets\":[18,34]},"
             "\"topk_weights\":{\"dtype\":\"f32\",\"shape\":[2,2],\"data_offsets\":[34,50]}}}");
    assert_int_equal(submit_status(meta, payload, 50, NULL, err), EPD_ERR_BAD_TENSOR);
    snprintf(meta, sizeof(meta), "{\"id\":1,\"tensors\":{"
             "\"x\":{\"dtype\":\"bf16\",\"shape\":[1,4],\"data_offsets\":[0,8]},"
             "\"topk_ids\":{\"dtype\":\"i32\",\"shape\":[1,2],\"data_offsets\":[10,18]},"
             "\"topk_weights\":{\"dtype\":\"f32\",\"shape\":[1,2],\"data_offsets\":[18,26]}}}");
    assert_int_equal(submit_status(meta, payload, 26, NULL, err), EPD_ERR_BAD_TENSOR);
    assert_non_null(strstr(err, "aligned"));
}

static void test_frame__zero_tokens__is_bad_tensor(void **state)
{
    char err[EPD_ERR_LEN];
    (void)state;
    assert_int_equal(submit_status("{\"id\":1,\"tensors\":{"
                                   "\"x\":{\"dtype\":\"bf16\",\"shape\":[0,4],\"data_offsets\":[0,0]},"
                                   "\"topk_ids\":{\"dtype\":\"i32\",\"shape\":[0,2],\"data_offsets\":[0,0]},"
                                   "\"topk_weights\":{\"dtype\":\"f32\",\"shape\":[0,2],\"data_offsets\":[0,0]}}}",
                                   NULL, 0, NULL, err),
                     EPD_ERR_BAD_TENSOR);
    assert_non_null(strstr(err, "N = 0"));
}

static void test_frame__hidden_mismatch__is_shape_mismatch(void **state)
{
    char err[EPD_ERR_LEN], meta[1024];
    uint8_t payload[64] = {0};
    (void)state;
    /* N = 2 everywhere, H = 8 instead of 4 */
    snprintf(meta, sizeof(meta), "{\"id\":1,\"tensors\":{" STD_IDS "," STD_W ","
             "\"x\":{\"dtype\":\"bf16\",\"shape\":[2,8],\"data_offsets\":[32,64]}}}");
    assert_int_equal(submit_status(meta, payload, 64, NULL, err), EPD_ERR_SHAPE_MISMATCH);
    assert_non_null(strstr(err, "hidden"));
}

static void test_frame__topk_mismatch__is_shape_mismatch(void **state)
{
    char err[EPD_ERR_LEN], meta[1024];
    uint8_t payload[40] = {0};
    (void)state;
    /* N = 1, K = 4 for both: consistent with each other, not with the daemon's K = 2 */
    snprintf(meta, sizeof(meta), "{\"id\":1,\"tensors\":{"
             "\"topk_ids\":{\"dtype\":\"i32\",\"shape\":[1,4],\"data_offsets\":[0,16]},"
             "\"topk_weights\":{\"dtype\":\"f32\",\"shape\":[1,4],\"data_offsets\":[16,32]},"
             "\"x\":{\"dtype\":\"bf16\",\"shape\":[1,4],\"data_offsets\":[32,40]}}}");
    assert_int_equal(submit_status(meta, payload, 40, NULL, err), EPD_ERR_SHAPE_MISMATCH);
    assert_non_null(strstr(err, "top-2"));
}

static void test_frame__n_disagreement__is_shape_mismatch(void **state)
{
    char err[EPD_ERR_LEN], meta[1024];
    uint8_t payload[64] = {0};
    (void)state;
    snprintf(meta, sizeof(meta), "{\"id\":1,\"tensors\":{" STD_IDS "," STD_W ","
             "\"x\":{\"dtype\":\"bf16\",\"shape\":[4,4],\"data_offsets\":[32,64]}}}");
    assert_int_equal(submit_status(meta, payload, 64, NULL, err), EPD_ERR_SHAPE_MISMATCH);
    assert_non_null(strstr(err, "disagree"));
}

static void test_frame__too_many_tokens__is_too_many_tokens(void **state)
{
    sample_t s;
    static uint16_t x[17 * 4];
    static int32_t ids[17 * 2];
    static float w[17 * 2];
    epd_frame_out_t out;
    epd_frame_t frame = {0};
    epd_submit_view_t view;
    char err[EPD_ERR_LEN];
    (void)state;
    sample_fill(&s, 16);
    memcpy(x, s.x, sizeof(s.x));
    memcpy(ids, s.ids, sizeof(s.ids));
    memcpy(w, s.w, sizeof(s.w));
    assert_int_equal(epd_frame_encode_submit(9, 17, 4, 2, x, ids, w, &out, err), EPD_OK);
    assert_int_equal(decode_bytes(flatten(&out), &frame, err), EPD_OK);
    assert_int_equal(epd_submit_validate(&frame, &limits, &view, err), EPD_ERR_TOO_MANY_TOKENS);
    assert_true(view.id == 9); /* known even on failure, for the ERROR frame */
    epd_frame_free(&frame);
}

static void test_frame__ids_out_of_range__is_expert_out_of_range(void **state)
{
    static const int32_t too_big[4] = {0, 8, 1, 2};
    static const int32_t minus_two[4] = {0, 1, -2, 2};
    static const int32_t int_min[4] = {INT32_MIN, 1, 2, 3};
    (void)state;
    assert_int_equal(std_submit_data(too_big, NULL), EPD_ERR_EXPERT_OUT_OF_RANGE);
    assert_int_equal(std_submit_data(minus_two, NULL), EPD_ERR_EXPERT_OUT_OF_RANGE);
    assert_int_equal(std_submit_data(int_min, NULL), EPD_ERR_EXPERT_OUT_OF_RANGE);
}

/* The id and weight checks go over a request's words eight at a time, then one at a time for
 * the rest: one bad id or weight at each position of 37 tokens x top-4 (148 words: 18 steps of
 * eight and a tail of four) is found and named; a repeat before it does not hide it. */
enum { WIDE_TOKENS = 37, WIDE_K = 4, WIDE_H = 4, WIDE_E = 64 };

static epd_status_t wide_submit(const int32_t *ids, const float *w, char err[EPD_ERR_LEN])
{
    static uint16_t x[WIDE_TOKENS * WIDE_H];
    const epd_submit_limits_t wide = {.hidden = WIDE_H, .topk = WIDE_K, .num_experts = WIDE_E,
                                      .max_tokens = WIDE_TOKENS};
    epd_frame_out_t out;
    epd_frame_t frame = {0};
    epd_submit_view_t view;
    assert_int_equal(epd_frame_encode_submit(5, WIDE_TOKENS, WIDE_H, WIDE_K, x, ids, w, &out, err),
                     EPD_OK);
    bytes_t b = flatten(&out);
    assert_int_equal(decode_bytes(b, &frame, err), EPD_OK);
    epd_status_t status = epd_submit_validate(&frame, &wide, &view, err);
    if (status == EPD_OK) free(view.owned);
    epd_frame_free(&frame);
    return status;
}

static void test_frame__ids_and_weights__checked_at_every_position(void **state)
{
    int32_t ids[WIDE_TOKENS * WIDE_K];
    float w[WIDE_TOKENS * WIDE_K];
    char err[EPD_ERR_LEN], want[64];
    (void)state;
    for (int i = 0; i < WIDE_TOKENS * WIDE_K; i++) {
        ids[i] = (i % WIDE_K == 3) ? -1 : (i * 7) % WIDE_E; /* distinct in a token, a -1 each */
        w[i] = 0.25f;
    }
    assert_int_equal(wide_submit(ids, w, err), EPD_OK);
    static const int32_t bad_ids[] = {WIDE_E, -2, INT32_MIN, INT32_MAX};
    static const float bad_w[] = {INFINITY, -INFINITY, NAN};
    for (int i = 0; i < WIDE_TOKENS * WIDE_K; i++) {
        snprintf(want, sizeof want, "token %d slot %d:", i / WIDE_K, i % WIDE_K);
        for (size_t b = 0; b < sizeof bad_ids / sizeof bad_ids[0]; b++) {
            int32_t keep = ids[i];
            ids[i] = bad_ids[b];
            assert_int_equal(wide_submit(ids, w, err), EPD_ERR_EXPERT_OUT_OF_RANGE);
            assert_non_null(strstr(err, want));
            ids[i] = keep;
        }
        for (size_t b = 0; b < sizeof bad_w / sizeof bad_w[0]; b++) {
            float keep = w[i];
            w[i] = bad_w[b];
            assert_int_equal(wide_submit(ids, w, err), EPD_ERR_NON_FINITE_INPUT);
            assert_non_null(strstr(err, want));
            w[i] = keep;
        }
        /* the largest finite weights pass */
        w[i] = i % 2 ? FLT_MAX : -FLT_MAX;
        assert_int_equal(wide_submit(ids, w, err), EPD_OK);
        w[i] = 0.25f;
    }
    /* a repeat in token 0, an id out of range in the last token: the range is reported */
    ids[1] = ids[0];
    ids[WIDE_TOKENS * WIDE_K - 1] = WIDE_E + 5;
    assert_int_equal(wide_submit(ids, w, err), EPD_ERR_EXPERT_OUT_OF_RANGE);
    snprintf(want, sizeof want, "token %d slot %d:", WIDE_TOKENS - 1, WIDE_K - 1);
    assert_non_null(strstr(err, want));
    ids[WIDE_TOKENS * WIDE_K - 1] = -1;
    assert_int_equal(wide_submit(ids, w, err), EPD_ERR_INVALID_TOPK);
    assert_non_null(strstr(err, "token 0:"));
}

static void test_frame__duplicate_ids__is_invalid_topk(void **state)
{
    static const int32_t dup[4] = {0, 1, 3, 3};
    static const int32_t minus_ones[4] = {-1, -1, 3, 4};
    static const int32_t across_tokens[4] = {3, 4, 3, 4};
    (void)state;
    assert_int_equal(std_submit_data(dup, NULL), EPD_ERR_INVALID_TOPK);
    assert_int_equal(std_submit_data(minus_ones, NULL), EPD_OK);
    assert_int_equal(std_submit_data(across_tokens, NULL), EPD_OK);
}

static void test_frame__non_finite_weights__is_non_finite_input(void **state)
{
    float nan_w[4] = {0.5f, 0.5f, 0.5f, 0.5f};
    float inf_w[4] = {0.5f, 0.5f, 0.5f, 0.5f};
    (void)state;
    nan_w[2] = NAN;
    inf_w[3] = -INFINITY;
    assert_int_equal(std_submit_data(NULL, nan_w), EPD_ERR_NON_FINITE_INPUT);
    assert_int_equal(std_submit_data(NULL, inf_w), EPD_ERR_NON_FINITE_INPUT);
}

/* A SUBMIT of the sample data (N tokens, H 4, K 2) with x[at] replaced by the bf16 pattern bits:
 * the validation code, and the message in err. */
static epd_status_t sample_x_status(uint32_t n, uint32_t at, uint16_t bits, char err[EPD_ERR_LEN])
{
    sample_t s;
    epd_frame_out_t out;
    epd_frame_t frame = {0};
    epd_submit_view_t view;
    epd_status_t status;

    sample_fill(&s, n);
    s.x[at] = bits;
    assert_int_equal(epd_frame_encode_submit(5, n, 4, 2, s.x, s.ids, s.w, &out, err), EPD_OK);
    assert_int_equal(decode_bytes(flatten(&out), &frame, err), EPD_OK);
    err[0] = '\0';
    status = epd_submit_validate(&frame, &limits, &view, err);
    if (status != EPD_OK) assert_true(view.id == 5);
    epd_frame_free(&frame);
    return status;
}

static void test_frame__non_finite_x__is_non_finite_input(void **state)
{
    static const uint16_t bad[] = {0x7fc0 /* NaN */, 0xffc1 /* -NaN */, 0x7f81 /* signalling */,
                                   0x7f80 /* +Inf */, 0xff80 /* -Inf */};
    char err[EPD_ERR_LEN];
    (void)state;
    for (size_t i = 0; i < EPD_ARRAY_SIZE(bad); i++) {
        assert_int_equal(sample_x_status(2, 5, bad[i], err), EPD_ERR_NON_FINITE_INPUT);
        assert_string_equal(err, "x[1][1] is not finite (Inf or NaN)");
    }
    /* the last value of a whole 64-value block, and a first value */
    assert_int_equal(sample_x_status(16, 63, 0x7f80, err), EPD_ERR_NON_FINITE_INPUT);
    assert_string_equal(err, "x[15][3] is not finite (Inf or NaN)");
    assert_int_equal(sample_x_status(16, 0, 0xff80, err), EPD_ERR_NON_FINITE_INPUT);
    assert_string_equal(err, "x[0][0] is not finite (Inf or NaN)");
}

/* host_scan: what the fake device says, counted; EPD_ERR_AGAIN or a failure: the codec scans. */
static int host_scans;
static epd_status_t host_scan_answer;
static epd_status_t fake_host_scan(void *arg, const uint16_t *x, uint64_t n, int64_t *first_p,
                                   char err[EPD_ERR_LEN])
{
    (void)arg;
    host_scans++;
    if (host_scan_answer != EPD_OK) {
        snprintf(err, EPD_ERR_LEN, "fake device says %s", epd_status_name(host_scan_answer));
        return host_scan_answer;
    }
    *first_p = -1;
    for (uint64_t i = 0; i < n; i++)
        if (!epd_bf16_is_finite(x[i])) {
            *first_p = (int64_t)i;
            break;
        }
    return EPD_OK;
}

/* A payload SUBMIT of n tokens at hidden H (K 2) with x[at] = bits, validated with host_scan. */
static epd_status_t large_x_status(uint32_t n, uint32_t hidden, uint64_t at, uint16_t bits,
                                   char err[EPD_ERR_LEN])
{
    epd_submit_limits_t lim = {.hidden = hidden, .topk = 2, .num_experts = 8, .max_tokens = n};
    epd_submit_regions_t hooks = {.host_scan = fake_host_scan};
    uint16_t *x = calloc((size_t)n * hidden, sizeof *x);
    int32_t *ids = calloc((size_t)n * 2, sizeof *ids);
    float *w = calloc((size_t)n * 2, sizeof *w);
    epd_frame_out_t out;
    epd_frame_t frame = {0};
    epd_submit_view_t view = {0};
    assert_non_null(x);
    assert_non_null(ids);
    assert_non_null(w);
    for (uint64_t i = 0; i < (uint64_t)n * hidden; i++) x[i] = (uint16_t)(0x3f00 + i % 97);
    for (uint64_t i = 0; i < (uint64_t)n * 2; i++) ids[i] = (int32_t)(i % 2); /* distinct */
    x[at] = bits;
    assert_int_equal(epd_frame_encode_submit(9, n, hidden, 2, x, ids, w, &out, err), EPD_OK);
    assert_int_equal(decode_bytes(flatten(&out), &frame, err), EPD_OK);
    err[0] = '\0';
    epd_status_t status = epd_submit_validate_regions(&frame, &lim, &hooks, &view, err);
    free(view.owned);
    epd_frame_free(&frame);
    free(x);
    free(ids);
    free(w);
    return status;
}

static void test_frame__large_host_x__scanned_by_the_device_or_else_the_codec(void **state)
{
    char err[EPD_ERR_LEN];
    uint32_t hidden = 1024, n = EPD_SUBMIT_DEVICE_SCAN_BYTES / (1024 * 2); /* exactly the bound */
    (void)state;
    host_scan_answer = EPD_OK;
    host_scans = 0;
    assert_int_equal(large_x_status(n, hidden, 5, 0x3f80, err), EPD_OK);
    assert_int_equal(host_scans, 1);
    assert_int_equal(large_x_status(n, hidden, (uint64_t)(n - 1) * hidden + 7, 0x7f80, err),
                     EPD_ERR_NON_FINITE_INPUT);
    assert_string_equal(err, "x[127][7] is not finite (Inf or NaN)");
    assert_int_equal(host_scans, 2);
    /* one token fewer: under the bound, the codec scans it alone */
    assert_int_equal(large_x_status(n - 1, hidden, 3, 0xffc1, err), EPD_ERR_NON_FINITE_INPUT);
    assert_string_equal(err, "x[0][3] is not finite (Inf or NaN)");
    assert_int_equal(host_scans, 2);
    /* not page-locked (AGAIN), or the device failed: the codec scans, with the same answers */
    epd_status_t answers[] = {EPD_ERR_AGAIN, EPD_ERR_CUDA};
    for (size_t i = 0; i < EPD_ARRAY_SIZE(answers); i++) {
        host_scan_answer = answers[i];
        assert_int_equal(large_x_status(n, hidden, 2049, 0x7fc0, err), EPD_ERR_NON_FINITE_INPUT);
        assert_string_equal(err, "x[2][1] is not finite (Inf or NaN)");
        assert_int_equal(large_x_status(n, hidden, 2049, 0x3f80, err), EPD_OK);
    }
    assert_int_equal(host_scans, 6);
    host_scan_answer = EPD_OK;
}

static void test_frame__largest_finite_x__passes(void **state)
{
    char err[EPD_ERR_LEN];
    (void)state;
    assert_int_equal(sample_x_status(16, 63, 0x7f7f /* 3.39e38 */, err), EPD_OK);
    assert_int_equal(sample_x_status(2, 0, 0xff7f /* -3.39e38 */, err), EPD_OK);
    assert_int_equal(sample_x_status(2, 7, 0x0001 /* smallest subnormal */, err), EPD_OK);
}

static void test_frame__non_finite_weight_and_x__reports_the_weight(void **state)
{
    sample_t s;
    epd_frame_out_t out;
    epd_frame_t frame = {0};
    epd_submit_view_t view;
    char err[EPD_ERR_LEN];
    (void)state;
    sample_fill(&s, 2);
    s.x[0] = 0x7fc0;
    s.w[3] = INFINITY;
    assert_int_equal(epd_frame_encode_submit(5, 2, 4, 2, s.x, s.ids, s.w, &out, err), EPD_OK);
    assert_int_equal(decode_bytes(flatten(&out), &frame, err), EPD_OK);
    assert_int_equal(epd_submit_validate(&frame, &limits, &view, err), EPD_ERR_NON_FINITE_INPUT);
    assert_non_null(strstr(err, "weight is infinite"));
    epd_frame_free(&frame);
}

static void test_frame__large_experts__checks_duplicates_with_heap_bitmap(void **state)
{
    epd_submit_limits_t big = {.hidden = 4, .topk = 2, .num_experts = 100000, .max_tokens = 16};
    static const int32_t dup[4] = {99999, 5, 70000, 70000};
    static const int32_t ok[4] = {99999, 5, 70000, 70001};
    epd_frame_t frame = {0};
    epd_submit_view_t view;
    char err[EPD_ERR_LEN], meta[1024];
    (void)state;
    snprintf(meta, sizeof(meta), "{\"id\":1,\"tensors\":{" STD_IDS "," STD_W "," STD_X "}}");
    std_payload_fill(dup, NULL);
    assert_int_equal(decode_bytes(raw_frame(NULL, 1, 1, 0, meta, strlen(meta), std_payload, 48),
                                  &frame, err), EPD_OK);
    assert_int_equal(epd_submit_validate(&frame, &big, &view, err), EPD_ERR_INVALID_TOPK);
    memcpy(frame.payload, ok, 16);
    assert_int_equal(epd_submit_validate(&frame, &big, &view, err), EPD_OK);
    epd_frame_free(&frame);
    std_payload_fill(NULL, NULL);
}

static void test_frame__dtype_names__round_trip(void **state)
{
    (void)state;
    for (int d = EPD_DTYPE_UNKNOWN + 1; d < EPD_DTYPE_MAX; d++) {
        const char *name = epd_dtype_name((epd_dtype_t)d);
        char upper[16];
        size_t n = strlen(name);
        assert_true(n < sizeof upper);
        for (size_t i = 0; i <= n; i++) upper[i] = (char)toupper((unsigned char)name[i]);
        /* as written and in upper case (a SUBMIT's names are looked up before the table) */
        assert_int_equal(epd_dtype_from_name(name), d);
        assert_int_equal(epd_dtype_from_name(upper), d);
        assert_true(epd_dtype_size((epd_dtype_t)d) >= 1);
    }
    static const char *const not_names[] = {"", "i3", "i322", "bf1", "bf166", "bf17", "f33",
                                            "bf16 ", "i 32", "unknown"};
    for (size_t i = 0; i < sizeof not_names / sizeof not_names[0]; i++)
        assert_int_equal(epd_dtype_from_name(not_names[i]), EPD_DTYPE_UNKNOWN);
    assert_int_equal(epd_dtype_from_name(NULL), EPD_DTYPE_UNKNOWN);
    assert_string_equal(epd_frame_type_name(3), "error");
    assert_string_equal(epd_frame_type_name(9), "unknown");
}

/* ---- the payload window (the daemon's direct read) ---- */

/* A stream of frames with payloads of many sizes (none, a few bytes, one byte, 300 KB, and 5 MB,
 * above the whole-at-once cap so its buffer grows while it is read), each payload distinct. */
typedef struct {
    uint8_t *buf;
    size_t len;
    int n_frames;
} stream_t;

#define WINDOW_BIG_PAYLOAD (5u * 1024u * 1024u)
#define WINDOW_MAX_PAYLOAD (8u * 1024u * 1024u)

static void stream_add(stream_t *st, uint16_t type, const char *meta, uint64_t payload_len,
                       uint32_t seed)
{
    uint8_t *payload = malloc(payload_len ? (size_t)payload_len : 1);
    assert_non_null(payload);
    uint32_t r = seed;
    for (size_t i = 0; i < payload_len; i++) {
        r = r * 1664525u + 1013904223u;
        payload[i] = (uint8_t)(r >> 24);
    }
    bytes_t b = raw_frame(NULL, 1, type, 0, meta, strlen(meta), payload, payload_len);
    free(payload);
    st->buf = realloc(st->buf, st->len + b.len);
    assert_non_null(st->buf);
    memcpy(st->buf + st->len, b.buf, b.len);
    st->len += b.len;
    st->n_frames++;
    free(b.buf);
}

static stream_t window_stream(void)
{
    stream_t st = {0};
    stream_add(&st, EPD_FRAME_CONTROL, "{\"op\":\"health\",\"id\":1}", 0, 1);
    stream_add(&st, EPD_FRAME_SUBMIT, "{\"id\":2,\"tensors\":{}}", 48, 2);
    stream_add(&st, EPD_FRAME_SUBMIT, "{\"id\":3}", 1, 3);
    stream_add(&st, EPD_FRAME_SUBMIT, "{\"id\":18446744073709551615}", 300000, 4);
    stream_add(&st, EPD_FRAME_REPLY, "{\"a\":[1,2,3]}", 7, 5);
    stream_add(&st, EPD_FRAME_SUBMIT, "{\"id\":6}", WINDOW_BIG_PAYLOAD, 6);
    stream_add(&st, EPD_FRAME_CONTROL, "{\"op\":\"stats\"}", 0, 7);
    stream_add(&st, EPD_FRAME_SUBMIT, "{\"id\":8}", 65536 + 3, 8);
    return st;
}

static void assert_frames_equal(const epd_frame_t *a, const epd_frame_t *b)
{
    assert_int_equal(a->type, b->type);
    assert_int_equal(a->meta_len, b->meta_len);
    assert_true(a->payload_len == b->payload_len);
    assert_true(cJSON_Compare(a->meta, b->meta, true));
    assert_int_equal(a->id_kind, b->id_kind);
    assert_true(a->id == b->id);
    assert_int_equal(a->dropped, b->dropped);
    assert_int_equal(a->payload == NULL, b->payload == NULL);
    if (a->payload_len > 0 && a->payload != NULL)
        assert_memory_equal(a->payload, b->payload, (size_t)a->payload_len);
}

/* The stream through feed alone, the reference. */
static epd_frame_t *feed_all(const stream_t *st)
{
    epd_frame_t *frames = calloc((size_t)st->n_frames, sizeof(*frames));
    epd_decoder_t dec;
    char err[EPD_ERR_LEN];
    size_t at = 0;
    int n = 0;
    assert_non_null(frames);
    epd_decoder_init(&dec, WINDOW_MAX_PAYLOAD, EPD_FRAME_MAX_META);
    while (at < st->len) {
        size_t used = 0;
        epd_status_t status = epd_decoder_feed(&dec, st->buf + at, st->len - at, &used,
                                               &frames[n], err);
        at += used;
        if (status == EPD_OK) n++;
        else assert_int_equal(status, EPD_ERR_AGAIN);
    }
    assert_int_equal(n, st->n_frames);
    assert_true(epd_decoder_idle(&dec));
    epd_decoder_free(&dec);
    return frames;
}

static uint32_t test_rng;

static size_t rand_below(size_t n)
{
    test_rng ^= test_rng << 13; /* xorshift32 */
    test_rng ^= test_rng >> 17;
    test_rng ^= test_rng << 5;
    return n == 0 ? 0 : (size_t)test_rng % n;
}

/* A read of a random size: mostly small, sometimes up to a few hundred KB, sometimes huge. */
static size_t rand_read(void)
{
    switch (rand_below(4)) {
    case 0: return 1 + rand_below(32);
    case 1: return 1 + rand_below(4096);
    case 2: return 1 + rand_below(300000);
    default: return 1 + rand_below(8u << 20);
    }
}

/* Decodes the stream the way the daemon reads a socket: while a window is open (and the coin
 * says so), a "read" of random size lands in it (never more than the window), else a random
 * chunk is fed (every read lands in a window while one is open, for a quarter of the seeds);
 * every frame must equal feed's, byte for byte. */
static void test_frame__payload_window__random_splits_equal_feed(void **state)
{
    (void)state;
    stream_t st = window_stream();
    epd_frame_t *want = feed_all(&st);
    char err[EPD_ERR_LEN];
    int all_windows = 0;

    for (uint32_t seed = 1; seed <= 24; seed++) {
        epd_decoder_t dec;
        size_t at = 0;
        int n = 0, windows = 0;
        test_rng = seed;
        epd_decoder_init(&dec, WINDOW_MAX_PAYLOAD, EPD_FRAME_MAX_META);
        while (at < st.len) {
            void *ptr;
            size_t len;
            epd_frame_t frame;
            epd_status_t status;
            assert_int_equal(epd_decoder_payload_window(&dec, &ptr, &len, err), EPD_OK);
            size_t chunk = rand_read();
            if (chunk > st.len - at) chunk = st.len - at;
            if (len > 0 && (seed % 4 == 0 || rand_below(4) != 0)) {
                assert_non_null(ptr);
                if (chunk > len) chunk = len;
                memcpy(ptr, st.buf + at, chunk);
                status = epd_decoder_payload_commit(&dec, chunk, &frame, err);
                at += chunk;
                windows++;
            } else {
                size_t used = 0;
                status = epd_decoder_feed(&dec, st.buf + at, chunk, &used, &frame, err);
                assert_true(used <= chunk);
                assert_true(status == EPD_OK || used == chunk);
                at += used;
            }
            if (status == EPD_OK) {
                assert_true(n < st.n_frames);
                assert_frames_equal(&frame, &want[n]);
                epd_frame_free(&frame);
                n++;
            } else {
                assert_int_equal(status, EPD_ERR_AGAIN);
            }
        }
        assert_int_equal(n, st.n_frames);
        if (seed % 4 == 0) assert_true(windows > 0);
        all_windows += windows;
        assert_true(epd_decoder_idle(&dec));
        epd_decoder_free(&dec);
    }
    assert_true(all_windows > 24);
    for (int i = 0; i < st.n_frames; i++) epd_frame_free(&want[i]);
    free(want);
    free(st.buf);
}

/* No window between frames, in a header or a meta, or for a frame without payload; one right
 * after the meta; a payload finished partly in the window and partly by a feed that goes on into
 * the next frame's header stops at the payload's end. */
static void test_frame__payload_window__only_inside_an_admitted_payload(void **state)
{
    (void)state;
    bytes_t a = sample_submit(21, 3), b = sample_submit(22, 2);
    size_t head = a.len - 3 * 4 * 2 - 3 * 2 * 4 - 3 * 2 * 4; /* header + meta of a */
    epd_decoder_t dec;
    epd_frame_t frame;
    char err[EPD_ERR_LEN];
    void *ptr;
    size_t len, used;
    uint8_t *stream = malloc(a.len + b.len);
    assert_non_null(stream);
    memcpy(stream, a.buf, a.len);
    memcpy(stream + a.len, b.buf, b.len);

    epd_decoder_init(&dec, MAX_PAYLOAD, EPD_FRAME_MAX_META);
    assert_int_equal(epd_decoder_payload_window(&dec, &ptr, &len, err), EPD_OK);
    assert_int_equal(len, 0);
    assert_null(ptr);
    for (size_t cut = 1; cut < head; cut += 7) { /* inside the header, then the meta */
        epd_decoder_reset(&dec);
        assert_int_equal(epd_decoder_feed(&dec, stream, cut, &used, &frame, err), EPD_ERR_AGAIN);
        assert_int_equal(epd_decoder_payload_window(&dec, &ptr, &len, err), EPD_OK);
        assert_int_equal(len, 0);
        assert_int_equal(epd_decoder_payload_commit(&dec, 1, &frame, err), EPD_ERR_INVALID_ARG);
    }
    epd_decoder_reset(&dec);
    assert_int_equal(epd_decoder_feed(&dec, stream, head, &used, &frame, err), EPD_ERR_AGAIN);
    assert_int_equal(epd_decoder_payload_window(&dec, &ptr, &len, err), EPD_OK);
    assert_int_equal(len, a.len - head); /* a small payload: the whole of it */
    /* half of it in the window, the rest and all of b in one feed */
    size_t half = len / 2;
    memcpy(ptr, stream + head, half);
    assert_int_equal(epd_decoder_payload_commit(&dec, half, &frame, err), EPD_ERR_AGAIN);
    assert_int_equal(epd_decoder_payload_window(&dec, &ptr, &len, err), EPD_OK);
    assert_int_equal(len, a.len - head - half);
    assert_int_equal(epd_decoder_feed(&dec, stream + head + half, a.len + b.len - head - half,
                                      &used, &frame, err), EPD_OK);
    assert_int_equal(used, a.len - head - half);
    assert_sample_frame(&frame, 21, 3);
    assert_true(epd_decoder_idle(&dec));
    assert_int_equal(epd_decoder_payload_window(&dec, &ptr, &len, err), EPD_OK);
    assert_int_equal(len, 0);
    assert_int_equal(epd_decoder_feed(&dec, stream + a.len, b.len, &used, &frame, err), EPD_OK);
    assert_sample_frame(&frame, 22, 2);

    /* a frame without payload is handed out by the feed that completes its meta */
    bytes_t c = simple_frame(EPD_FRAME_CONTROL, "{\"op\":\"health\"}");
    assert_int_equal(epd_decoder_feed(&dec, c.buf, c.len, &used, &frame, err), EPD_OK);
    epd_frame_free(&frame);
    assert_int_equal(epd_decoder_payload_window(&dec, &ptr, &len, err), EPD_OK);
    assert_int_equal(len, 0);
    epd_decoder_free(&dec);
    free(c.buf);
    free(stream);
    free(a.buf);
    free(b.buf);
}

static bool refuse_all(void *arg, const epd_frame_header_t *header)
{
    (void)header;
    ++*(int *)arg;
    return false;
}

/* A frame the admit callback refuses gets no window: its payload goes through feed and is thrown
 * away, the frame handed out dropped, and the next frame decodes as usual. */
static void test_frame__payload_window__dropped_frame_has_none(void **state)
{
    (void)state;
    bytes_t a = sample_submit(31, 4);
    size_t payload = 4 * 4 * 2 + 4 * 2 * 4 + 4 * 2 * 4, head = a.len - payload;
    epd_decoder_t dec;
    epd_frame_t frame;
    char err[EPD_ERR_LEN];
    void *ptr;
    size_t len, used;
    int asked = 0;

    epd_decoder_init(&dec, MAX_PAYLOAD, EPD_FRAME_MAX_META);
    epd_decoder_set_admit(&dec, refuse_all, &asked);
    assert_int_equal(epd_decoder_feed(&dec, a.buf, head + 1, &used, &frame, err), EPD_ERR_AGAIN);
    assert_int_equal(asked, 1);
    assert_int_equal(epd_decoder_payload_window(&dec, &ptr, &len, err), EPD_OK);
    assert_int_equal(len, 0);
    assert_int_equal(epd_decoder_payload_commit(&dec, 1, &frame, err), EPD_ERR_INVALID_ARG);
    assert_int_equal(epd_decoder_feed(&dec, a.buf + head + 1, payload - 1, &used, &frame, err),
                     EPD_OK);
    assert_true(frame.dropped);
    assert_null(frame.payload);
    assert_true(frame.id == 31);
    epd_frame_free(&frame);

    epd_decoder_set_admit(&dec, NULL, NULL);
    assert_int_equal(epd_decoder_feed(&dec, a.buf, head, &used, &frame, err), EPD_ERR_AGAIN);
    assert_int_equal(epd_decoder_payload_window(&dec, &ptr, &len, err), EPD_OK);
    assert_int_equal(len, payload);
    memcpy(ptr, a.buf + head, payload);
    assert_int_equal(epd_decoder_payload_commit(&dec, payload, &frame, err), EPD_OK);
    assert_false(frame.dropped);
    assert_sample_frame(&frame, 31, 4);
    epd_decoder_free(&dec);
    free(a.buf);
}

/* An allocator that counts the bytes it holds and can be told to fail. */
typedef struct {
    size_t held, peak;
    bool fail;
} count_alloc_t;

static void *count_resize(void *arg, void *p, size_t keep, size_t bytes)
{
    count_alloc_t *ca = arg;
    if (ca->fail) return NULL;
    size_t *q = realloc(p ? (size_t *)p - 2 : NULL, 2 * sizeof(size_t) + bytes);
    if (q == NULL) return NULL;
    if (p != NULL) ca->held -= q[0];
    (void)keep;
    q[0] = bytes;
    ca->held += bytes;
    if (ca->held > ca->peak) ca->peak = ca->held;
    return q + 2;
}

static count_alloc_t *count_alloc_of_release; /* count_release has no arg */

static void count_release(void *p)
{
    if (p == NULL) return;
    size_t *q = (size_t *)p - 2;
    count_alloc_of_release->held -= q[0];
    free(q);
}

/* A peer that claims a 1 GiB payload and sends a little: the windows open on 64 KiB and double
 * only as they fill, so the decoder holds about twice what came; up to 4 MiB the first window is
 * the whole payload. Committing more than the window, or without one, is refused and changes
 * nothing; without memory the window fails the decoder with no_memory. */
static void test_frame__payload_window__grows_geometrically_and_checks_commits(void **state)
{
    (void)state;
    count_alloc_t ca = {0};
    epd_payload_alloc_t alloc = {.resize = count_resize, .release = count_release, .arg = &ca};
    const char *meta = "{\"id\":9}";
    uint8_t h[EPD_FRAME_HEADER_LEN];
    epd_decoder_t dec;
    epd_frame_t frame;
    char err[EPD_ERR_LEN];
    void *ptr;
    size_t len, used, sent = 0;

    count_alloc_of_release = &ca;
    epd_decoder_init(&dec, UINT64_C(1) << 31, EPD_FRAME_MAX_META);
    epd_decoder_set_alloc(&dec, &alloc);
    epd_frame_header_encode(EPD_FRAME_SUBMIT, (uint32_t)strlen(meta), UINT64_C(1) << 30, h);
    assert_int_equal(epd_decoder_feed(&dec, h, sizeof h, &used, &frame, err), EPD_ERR_AGAIN);
    assert_int_equal(epd_decoder_feed(&dec, meta, strlen(meta), &used, &frame, err),
                     EPD_ERR_AGAIN);
    assert_int_equal(ca.held, 0); /* nothing before the first window */
    size_t want = 64u * 1024u;
    for (int i = 0; i < 6; i++) {
        assert_int_equal(epd_decoder_payload_window(&dec, &ptr, &len, err), EPD_OK);
        assert_int_equal(len, want);
        memset(ptr, i, len);
        /* one byte too many is refused, nothing taken */
        assert_int_equal(epd_decoder_payload_commit(&dec, len + 1, &frame, err),
                         EPD_ERR_INVALID_ARG);
        assert_true(strlen(err) > 10);
        assert_int_equal(epd_decoder_payload_commit(&dec, len, &frame, err), EPD_ERR_AGAIN);
        sent += len;
        assert_true(ca.held <= 2 * sent);
        want = sent; /* the buffer doubles: the next window is as large as what came */
    }
    /* a window asked for again without a commit is the same window */
    void *again;
    assert_int_equal(epd_decoder_payload_window(&dec, &ptr, &len, err), EPD_OK);
    assert_int_equal(epd_decoder_payload_window(&dec, &again, &used, err), EPD_OK);
    assert_ptr_equal(ptr, again);
    assert_int_equal(len, used);
    assert_int_equal(epd_decoder_payload_commit(&dec, 0, &frame, err), EPD_ERR_AGAIN);
    assert_true(ca.peak <= 4 * 1024 * 1024 + 64 * 1024);
    epd_decoder_free(&dec); /* a partial payload goes back to the allocator */
    assert_int_equal(ca.held, 0);

    /* up to 4 MiB: the whole payload at once, and the frame's payload is the allocator's */
    epd_decoder_reset(&dec);
    epd_frame_header_encode(EPD_FRAME_SUBMIT, (uint32_t)strlen(meta), 4u << 20, h);
    assert_int_equal(epd_decoder_feed(&dec, h, sizeof h, &used, &frame, err), EPD_ERR_AGAIN);
    assert_int_equal(epd_decoder_feed(&dec, meta, strlen(meta), &used, &frame, err),
                     EPD_ERR_AGAIN);
    assert_int_equal(epd_decoder_payload_window(&dec, &ptr, &len, err), EPD_OK);
    assert_int_equal(len, 4u << 20);
    memset(ptr, 0x5a, len);
    assert_int_equal(epd_decoder_payload_commit(&dec, len - 1, &frame, err), EPD_ERR_AGAIN);
    assert_int_equal(epd_decoder_payload_window(&dec, &ptr, &len, err), EPD_OK);
    assert_int_equal(len, 1);
    assert_int_equal(epd_decoder_payload_commit(&dec, 1, &frame, err), EPD_OK);
    assert_true(frame.payload_release == count_release);
    assert_true(frame.payload_len == 4u << 20);
    assert_int_equal(frame.payload[0], 0x5a);
    assert_int_equal(frame.payload[(4u << 20) - 1], 0x5a);
    assert_int_equal(epd_decoder_payload_commit(&dec, 1, &frame, err), EPD_ERR_INVALID_ARG);
    epd_frame_free(&frame);
    assert_int_equal(ca.held, 0);

    /* no memory: no_memory, and the decoder stays failed with it */
    ca.fail = true;
    assert_int_equal(epd_decoder_feed(&dec, h, sizeof h, &used, &frame, err), EPD_ERR_AGAIN);
    assert_int_equal(epd_decoder_feed(&dec, meta, strlen(meta), &used, &frame, err),
                     EPD_ERR_AGAIN);
    assert_int_equal(epd_decoder_payload_window(&dec, &ptr, &len, err), EPD_ERR_NO_MEMORY);
    assert_int_equal(len, 0);
    assert_true(strlen(err) > 10);
    assert_int_equal(epd_decoder_payload_window(&dec, &ptr, &len, err), EPD_ERR_NO_MEMORY);
    assert_int_equal(epd_decoder_feed(&dec, h, 1, &used, &frame, err), EPD_ERR_NO_MEMORY);
    epd_decoder_free(&dec);
}

/* A failed decoder's window answers with its sticky failure, as feed does. */
static void test_frame__payload_window__failed_decoder_is_sticky(void **state)
{
    (void)state;
    bytes_t bad = raw_frame((const uint8_t *)"EPD2", 1, EPD_FRAME_CONTROL, 0, "{}", 2, NULL, 0);
    epd_decoder_t dec;
    epd_frame_t frame;
    char err[EPD_ERR_LEN];
    void *ptr;
    size_t len, used;

    epd_decoder_init(&dec, MAX_PAYLOAD, EPD_FRAME_MAX_META);
    assert_int_equal(epd_decoder_feed(&dec, bad.buf, bad.len, &used, &frame, err),
                     EPD_ERR_BAD_MAGIC);
    err[0] = '\0';
    assert_int_equal(epd_decoder_payload_window(&dec, &ptr, &len, err), EPD_ERR_BAD_MAGIC);
    assert_int_equal(len, 0);
    assert_true(strlen(err) > 10);
    assert_int_equal(epd_decoder_payload_commit(&dec, 1, &frame, err), EPD_ERR_INVALID_ARG);
    epd_decoder_free(&dec);
    free(bad.buf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_frame__header__encodes_little_endian),
        cmocka_unit_test(test_frame__submit__round_trips),
        cmocka_unit_test(test_frame__result__round_trips),
        cmocka_unit_test(test_frame__tensor_keys__any_order_first_wins),
        cmocka_unit_test(test_frame__json_to_u64__integers_up_to_2_53),
        cmocka_unit_test(test_frame__error__round_trips_with_and_without_id),
        cmocka_unit_test(test_frame__control_and_reply__round_trip),
        cmocka_unit_test(test_frame__every_split__yields_the_frame),
        cmocka_unit_test(test_frame__one_byte_at_a_time__yields_each_frame),
        cmocka_unit_test(test_frame__partial_frame__is_freed_by_decoder_free),
        cmocka_unit_test(test_frame__payload_window__random_splits_equal_feed),
        cmocka_unit_test(test_frame__payload_window__only_inside_an_admitted_payload),
        cmocka_unit_test(test_frame__payload_window__dropped_frame_has_none),
        cmocka_unit_test(test_frame__payload_window__grows_geometrically_and_checks_commits),
        cmocka_unit_test(test_frame__payload_window__failed_decoder_is_sticky),
        cmocka_unit_test(test_frame__bad_magic__is_bad_magic),
        cmocka_unit_test(test_frame__bad_version__is_bad_version),
        cmocka_unit_test(test_frame__unknown_type__is_bad_type),
        cmocka_unit_test(test_frame__reserved_nonzero__is_bad_header),
        cmocka_unit_test(test_frame__oversize__is_frame_too_large_before_allocation),
        cmocka_unit_test(test_frame__bad_meta_json__is_bad_json),
        cmocka_unit_test(test_frame__meta_not_strict_json__is_bad_json),
        cmocka_unit_test(test_frame__keep_text__gives_checked_meta_text_for_those_types_only),
        cmocka_unit_test(test_frame__top_level_id__found_in_the_checkers_pass),
        cmocka_unit_test(test_frame__truncated_stream__is_reported),
        cmocka_unit_test(test_frame__submit_id__missing_or_invalid_is_bad_json),
        cmocka_unit_test(test_frame__submit_tensors__missing_is_bad_json),
        cmocka_unit_test(test_frame__submit_valid__passes_and_keeps_minus_one),
        cmocka_unit_test(test_frame__submit_layer__optional_integer_unknown_is_unknown_layer),
        cmocka_unit_test(test_frame__i64_ids__narrowed_or_expert_out_of_range),
        cmocka_unit_test(test_frame__region_tensors__bounds_alignment_unknown_are_bad_region),
        cmocka_unit_test(test_frame__device_tensors__read_and_checked_like_host_ones),
        cmocka_unit_test(test_frame__tensor_missing_or_unknown__is_bad_tensor),
        cmocka_unit_test(test_frame__unknown_dtype__is_bad_tensor),
        cmocka_unit_test(test_frame__known_other_dtype__is_unsupported_dtype),
        cmocka_unit_test(test_frame__wrong_ndim__is_bad_tensor),
        cmocka_unit_test(test_frame__shape_offsets_disagree__is_bad_tensor),
        cmocka_unit_test(test_frame__offsets_past_end__is_bad_tensor),
        cmocka_unit_test(test_frame__begin_after_end__is_bad_tensor),
        cmocka_unit_test(test_frame__overlap__is_bad_tensor),
        cmocka_unit_test(test_frame__gap__is_bad_tensor),
        cmocka_unit_test(test_frame__misaligned_offset__is_bad_tensor),
        cmocka_unit_test(test_frame__zero_tokens__is_bad_tensor),
        cmocka_unit_test(test_frame__hidden_mismatch__is_shape_mismatch),
        cmocka_unit_test(test_frame__topk_mismatch__is_shape_mismatch),
        cmocka_unit_test(test_frame__n_disagreement__is_shape_mismatch),
        cmocka_unit_test(test_frame__too_many_tokens__is_too_many_tokens),
        cmocka_unit_test(test_frame__ids_out_of_range__is_expert_out_of_range),
        cmocka_unit_test(test_frame__duplicate_ids__is_invalid_topk),
        cmocka_unit_test(test_frame__ids_and_weights__checked_at_every_position),
        cmocka_unit_test(test_frame__non_finite_weights__is_non_finite_input),
        cmocka_unit_test(test_frame__non_finite_x__is_non_finite_input),
        cmocka_unit_test(test_frame__largest_finite_x__passes),
        cmocka_unit_test(test_frame__large_host_x__scanned_by_the_device_or_else_the_codec),
        cmocka_unit_test(test_frame__non_finite_weight_and_x__reports_the_weight),
        cmocka_unit_test(test_frame__large_experts__checks_duplicates_with_heap_bitmap),
        cmocka_unit_test(test_frame__dtype_names__round_trip),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
