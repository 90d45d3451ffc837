/* Frame header codec and the incremental decoder of wire protocol v1 (DESIGN.md section 4):
 * header checks before any allocation, strict meta checks (UTF-8, one JSON object, nothing after
 * it), the exact uint64 "id" read from the JSON text. Tensor descriptors live in tensor.c, SUBMIT
 * validation and encoders in submit.c. */
#include "proto/frame.h"
#include "proto/json_build.h"
#include "proto/json_strict.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/parse.h"

/* The first payload allocation; it then doubles as bytes arrive, so a peer that announces a large
 * payload and sends nothing holds little memory. A payload up to PAYLOAD_WHOLE_CAP is allocated
 * whole at once (a 128-token V3 SUBMIT is 1.8 MB): its bytes are then copied once, not again at
 * every doubling. */
#define PAYLOAD_FIRST_CAP (64u * 1024u)
#define PAYLOAD_WHOLE_CAP (4u * 1024u * 1024u)

static const char *const type_names[] = {
    [EPD_FRAME_SUBMIT] = "submit", [EPD_FRAME_RESULT] = "result", [EPD_FRAME_ERROR] = "error",
    [EPD_FRAME_CONTROL] = "control", [EPD_FRAME_REPLY] = "reply",
    [EPD_FRAME_EXPERTS] = "experts", [EPD_FRAME_EXPERTS_DONE] = "experts_done",
};

const char *epd_frame_type_name(int type)
{
    if (type < EPD_FRAME_SUBMIT || type > EPD_FRAME_EXPERTS_DONE) return "unknown";
    return type_names[type];
}

static void put_le16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static void put_le32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static void put_le64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

void epd_frame_header_encode(epd_frame_type_t type, uint32_t meta_len, uint64_t payload_len,
                             uint8_t out[EPD_FRAME_HEADER_LEN])
{
    memcpy(out, EPD_FRAME_MAGIC, 4);
    put_le16(out + 4, EPD_FRAME_VERSION);
    put_le16(out + 6, (uint16_t)type);
    put_le32(out + 8, meta_len);
    put_le32(out + 12, 0);
    put_le64(out + 16, payload_len);
}

epd_status_t epd_frame_header_decode(const uint8_t in[EPD_FRAME_HEADER_LEN], uint64_t max_payload,
                                     uint32_t max_meta, epd_frame_header_t *header_p,
                                     char err[EPD_ERR_LEN])
{
    epd_frame_header_t h;

    if (memcmp(in, EPD_FRAME_MAGIC, 4) != 0) {
        snprintf(err, EPD_ERR_LEN,
                 "bad magic 0x%02x%02x%02x%02x: a frame starts with the 4 bytes \"EPD1\"", in[0],
                 in[1], in[2], in[3]);
        return EPD_ERR_BAD_MAGIC;
    }
    h.version = (uint16_t)get_le(in + 4, 2);
    h.type = (uint16_t)get_le(in + 6, 2);
    h.meta_len = (uint32_t)get_le(in + 8, 4);
    h.reserved = (uint32_t)get_le(in + 12, 4);
    h.payload_len = get_le(in + 16, 8);
    if (h.version != EPD_FRAME_VERSION) {
        snprintf(err, EPD_ERR_LEN, "protocol version %u is not supported (this side speaks 1)",
                 h.version);
        return EPD_ERR_BAD_VERSION;
    }
    if (h.type < EPD_FRAME_SUBMIT || h.type > EPD_FRAME_EXPERTS_DONE) {
        snprintf(err, EPD_ERR_LEN, "frame type %u is unknown (1 submit .. 7 experts_done)",
                 h.type);
        return EPD_ERR_BAD_TYPE;
    }
    if (h.reserved != 0) {
        snprintf(err, EPD_ERR_LEN, "reserved header field is 0x%08x, must be 0", h.reserved);
        return EPD_ERR_BAD_HEADER;
    }
    if (h.meta_len > max_meta) {
        snprintf(err, EPD_ERR_LEN, "meta_len %u exceeds the limit of %u bytes", h.meta_len,
                 max_meta);
        return EPD_ERR_FRAME_TOO_LARGE;
    }
    if (h.meta_len < 2) {
        snprintf(err, EPD_ERR_LEN, "meta_len %u is too short: meta must be a JSON object",
                 h.meta_len);
        return EPD_ERR_BAD_JSON;
    }
    if (h.payload_len > max_payload) {
        snprintf(err, EPD_ERR_LEN, "payload_len %" PRIu64 " exceeds the limit of %" PRIu64
                 " bytes (socket.max_frame_bytes)", h.payload_len, max_payload);
        return EPD_ERR_FRAME_TOO_LARGE;
    }
    *header_p = h;
    return EPD_OK;
}

cJSON *epd_frame_take_meta(epd_frame_t *frame)
{
    cJSON *meta = frame->meta;
    if (meta != NULL && frame->meta_arena) {
        meta = cJSON_Duplicate(frame->meta, true);
        epd_json_arena_free(frame->meta);
    }
    frame->meta = NULL;
    frame->meta_arena = false;
    return meta;
}

void epd_frame_free(epd_frame_t *frame)
{
    if (frame == NULL) return;
    if (frame->meta_arena)
        epd_json_arena_free(frame->meta);
    else
        cJSON_Delete(frame->meta);
    free(frame->meta_text);
    if (frame->payload_release != NULL)
        frame->payload_release(frame->payload);
    else
        free(frame->payload);
    memset(frame, 0, sizeof(*frame));
}

size_t epd_utf8_check(const uint8_t *s, size_t len)
{
    size_t i = 0;
    while (i < len) {
        /* ASCII eight bytes at a time (meta is nearly all ASCII) */
        while (len - i >= 8) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (w & UINT64_C(0x8080808080808080)) break;
            i += 8;
        }
        if (i >= len) break;
        uint8_t c = s[i];
        size_t n;
        uint32_t cp, min;
        if (c < 0x80) {
            i++;
            continue;
        } else if ((c & 0xe0) == 0xc0) {
            n = 1, cp = c & 0x1f, min = 0x80;
        } else if ((c & 0xf0) == 0xe0) {
            n = 2, cp = c & 0x0f, min = 0x800;
        } else if ((c & 0xf8) == 0xf0) {
            n = 3, cp = c & 0x07, min = 0x10000;
        } else {
            return i;
        }
        if (len - i <= n) return i;
        for (size_t k = 1; k <= n; k++) {
            if ((s[i + k] & 0xc0) != 0x80) return i;
            cp = (cp << 6) | (s[i + k] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return i;
        i += n + 1;
    }
    return len;
}

/* ---- reading the top-level "id" from the JSON text (already validated by cJSON) ---- */

static size_t skip_ws(const char *s, size_t len, size_t i)
{
    while (i < len && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) i++;
    return i;
}

/* Skips a JSON string starting at s[i] == '"'; returns the index after the closing quote. When
 * is_id_p is given, says whether the decoded string is exactly "id" (escapes included). */
static size_t skip_string(const char *s, size_t len, size_t i, bool *is_id_p)
{
    char dec[3];
    size_t n_dec = 0;
    bool ascii = true;
    i++;
    while (i < len && s[i] != '"') {
        char c = s[i];
        if (c == '\\' && i + 1 < len) {
            char e = s[i + 1];
            if (e == 'u' && i + 5 < len) {
                unsigned cp = 0;
                for (int k = 2; k < 6; k++) {
                    char h = s[i + k];
                    cp = cp * 16 + (unsigned)(h <= '9' ? h - '0' : (h | 0x20) - 'a' + 10);
                }
                if (cp >= 0x80) ascii = false;
                c = (char)cp;
                i += 6;
            } else {
                static const char from[] = "\"\\/bfnrt", to[] = "\"\\/\b\f\n\r\t";
                const char *p = strchr(from, e);
                c = p ? to[p - from] : e;
                i += 2;
            }
        } else {
            i++;
        }
        if (n_dec < sizeof(dec)) dec[n_dec] = c;
        n_dec++;
    }
    if (is_id_p) *is_id_p = ascii && n_dec == 2 && dec[0] == 'i' && dec[1] == 'd';
    return i + 1;
}

/* Skips any JSON value starting at s[i]; returns the index after it. */
static size_t skip_value(const char *s, size_t len, size_t i)
{
    int depth = 0;
    do {
        i = skip_ws(s, len, i);
        if (i >= len) return len;
        char c = s[i];
        if (c == '"') {
            i = skip_string(s, len, i, NULL);
        } else if (c == '{' || c == '[') {
            depth++;
            i++;
        } else if (c == '}' || c == ']') {
            depth--;
            i++;
        } else {
            /* number, literal, or the ',' ':' between members of a container being skipped */
            i++;
            while (i < len && depth == 0 && strchr(",}] \t\r\n", s[i]) == NULL) i++;
        }
    } while (depth > 0);
    return i;
}

/* Classifies the text v[0..n) of an "id" member's value: null, an integer in [0, 2^64), or not. */
static epd_frame_id_kind_t id_classify(const char *v, size_t n, uint64_t *id_p)
{
    char lit[32];
    char perr[EPD_ERR_LEN];
    if (n == 4 && memcmp(v, "null", 4) == 0) return EPD_FRAME_ID_NULL;
    if (n == 0 || n >= sizeof(lit)) return EPD_FRAME_ID_INVALID;
    for (size_t k = 0; k < n; k++) {
        if (v[k] < '0' || v[k] > '9') return EPD_FRAME_ID_INVALID;
    }
    memcpy(lit, v, n);
    lit[n] = '\0';
    if (epd_parse_u64(lit, 10, 0, UINT64_MAX, id_p, perr) != EPD_OK) return EPD_FRAME_ID_INVALID;
    return EPD_FRAME_ID_VALID;
}

/* Classifies the value of the first top-level "id" member of a valid JSON object text, decoding
 * the keys' escapes (what epd_json_strict_check_id leaves to it). */
static epd_frame_id_kind_t meta_read_id(const char *s, size_t len, uint64_t *id_p)
{
    size_t i = skip_ws(s, len, 0);
    if (i >= len || s[i] != '{') return EPD_FRAME_ID_ABSENT;
    i++;
    for (;;) {
        i = skip_ws(s, len, i);
        if (i >= len || s[i] != '"') return EPD_FRAME_ID_ABSENT;
        bool is_id = false;
        i = skip_string(s, len, i, &is_id);
        i = skip_ws(s, len, i);
        if (i >= len || s[i] != ':') return EPD_FRAME_ID_ABSENT;
        i = skip_ws(s, len, i + 1);
        size_t start = i;
        i = skip_value(s, len, i);
        if (is_id) return id_classify(s + start, i - start, id_p);
        i = skip_ws(s, len, i);
        if (i >= len || s[i] != ',') return EPD_FRAME_ID_ABSENT;
        i++;
    }
}

/* ---- the decoder ---- */

void epd_decoder_init(epd_decoder_t *dec, uint64_t max_payload, uint32_t max_meta)
{
    memset(dec, 0, sizeof(*dec));
    dec->max_payload = max_payload;
    dec->max_meta = max_meta > EPD_FRAME_MAX_META ? EPD_FRAME_MAX_META : max_meta;
    dec->state = EPD_DECODER_HEADER;
}

void epd_decoder_set_admit(epd_decoder_t *dec, epd_decoder_admit_fn admit, void *arg)
{
    dec->admit = admit;
    dec->admit_arg = arg;
}

void epd_decoder_set_alloc(epd_decoder_t *dec, const epd_payload_alloc_t *alloc)
{
    dec->alloc = alloc;
}

void epd_decoder_keep_text(epd_decoder_t *dec, uint32_t type_mask)
{
    dec->text_types = type_mask;
}

void epd_decoder_free(epd_decoder_t *dec)
{
    if (dec == NULL) return;
    free(dec->meta_text);
    dec->meta_text = NULL;
    epd_frame_free(&dec->frame);
    dec->head_have = 0;
    dec->meta_have = 0;
    dec->payload_have = 0;
    dec->payload_cap = 0;
}

void epd_decoder_reset(epd_decoder_t *dec)
{
    epd_decoder_free(dec);
    dec->state = EPD_DECODER_HEADER;
    dec->failure = EPD_OK;
}

bool epd_decoder_idle(const epd_decoder_t *dec)
{
    return dec->state == EPD_DECODER_HEADER && dec->head_have == 0;
}

static epd_status_t decoder_fail(epd_decoder_t *dec, epd_status_t status)
{
    epd_decoder_free(dec);
    dec->state = EPD_DECODER_FAILED;
    dec->failure = status;
    return status;
}

/* The meta text is complete: check it and parse it. */
static epd_status_t decoder_parse_meta(epd_decoder_t *dec, char err[EPD_ERR_LEN])
{
    const char *text = dec->meta_text;
    size_t len = dec->header.meta_len;
    size_t bad;
    cJSON *meta;

    /* what the daemon and libepd write (compact, plain ASCII, integers) in one pass; anything
     * else, or a frame kept as text, through the checks below */
    if (!(dec->text_types & (1u << dec->header.type))) {
        epd_json_id_span_t simple_id;
        meta = epd_json_build_simple(text, len, &simple_id);
        if (meta != NULL) {
            dec->frame.meta = meta;
            dec->frame.meta_arena = true;
            dec->frame.id_kind = simple_id.kind == EPD_JSON_ID_FOUND
                                     ? id_classify(text + simple_id.start, simple_id.len,
                                                   &dec->frame.id)
                                     : EPD_FRAME_ID_ABSENT;
            free(dec->meta_text);
            dec->meta_text = NULL;
            return EPD_OK;
        }
    }
    if (memchr(text, '\0', len) != NULL) {
        snprintf(err, EPD_ERR_LEN, "meta contains a NUL byte at offset %zu",
                 (size_t)((const char *)memchr(text, '\0', len) - text));
        return EPD_ERR_BAD_JSON;
    }
    bad = epd_utf8_check((const uint8_t *)text, len);
    if (bad != len) {
        snprintf(err, EPD_ERR_LEN, "meta is not valid UTF-8 (byte 0x%02x at offset %zu)",
                 (uint8_t)text[bad], bad);
        return EPD_ERR_BAD_JSON;
    }
    /* cJSON is lenient (BOM, leading zeros, escaped NULs): the strict grammar decides; the same
     * pass finds the top-level "id" */
    epd_json_id_span_t id;
    if (epd_json_strict_check_id(text, len, &id, err) != EPD_OK) return EPD_ERR_BAD_JSON;
    epd_frame_id_kind_t id_kind =
        id.kind == EPD_JSON_ID_FOUND    ? id_classify(text + id.start, id.len, &dec->frame.id)
        : id.kind == EPD_JSON_ID_ESCAPED ? meta_read_id(text, len, &dec->frame.id)
                                         : EPD_FRAME_ID_ABSENT;
    size_t at = 0;
    while (at < len && (text[at] == ' ' || text[at] == '\t' || text[at] == '\n' || text[at] == '\r'))
        at++;
    if (at == len || text[at] != '{') {
        snprintf(err, EPD_ERR_LEN, "meta must be a JSON object");
        return EPD_ERR_BAD_JSON;
    }
    if (dec->text_types & (1u << dec->header.type)) {
        dec->frame.meta_text = dec->meta_text; /* NUL-terminated: meta_len + 1 bytes */
        dec->frame.id_kind = id_kind;
        dec->meta_text = NULL;
        return EPD_OK;
    }
    /* the checker passed it: the fast builder gives cJSON's tree, in one block (NULL only
     * without memory) */
    meta = epd_json_build_arena(text, len);
    if (meta == NULL) {
        snprintf(err, EPD_ERR_LEN, "out of memory parsing a meta of %zu bytes", len);
        return EPD_ERR_NO_MEMORY;
    }
    dec->frame.meta = meta;
    dec->frame.meta_arena = true;
    dec->frame.id_kind = id_kind;
    free(dec->meta_text);
    dec->meta_text = NULL;
    return EPD_OK;
}

/* Makes room for `want` more payload bytes (want > 0). */
static epd_status_t decoder_grow_payload(epd_decoder_t *dec, uint64_t want, char err[EPD_ERR_LEN])
{
    uint64_t need = dec->payload_have + want;
    uint64_t cap = dec->payload_cap;
    uint8_t *p;

    if (need <= cap) return EPD_OK;
    if (cap == 0)
        cap = dec->header.payload_len <= PAYLOAD_WHOLE_CAP ? dec->header.payload_len
                                                            : PAYLOAD_FIRST_CAP;
    if (cap < need && cap == 0) cap = need;
    while (cap < need) cap = cap > UINT64_MAX / 2 ? need : cap * 2;
    if (cap > dec->header.payload_len) cap = dec->header.payload_len;
    if (cap > SIZE_MAX) {
        snprintf(err, EPD_ERR_LEN, "payload of %" PRIu64 " bytes does not fit in memory",
                 dec->header.payload_len);
        return EPD_ERR_NO_MEMORY;
    }
    if (dec->alloc != NULL) {
        p = dec->alloc->resize(dec->alloc->arg, dec->frame.payload, (size_t)dec->payload_have,
                               (size_t)cap);
        if (p != NULL) dec->frame.payload_release = dec->alloc->release;
    } else {
        p = realloc(dec->frame.payload, (size_t)cap);
    }
    if (p == NULL) {
        snprintf(err, EPD_ERR_LEN, "cannot allocate %" PRIu64 " bytes for a payload", cap);
        return EPD_ERR_NO_MEMORY;
    }
    dec->frame.payload = p;
    dec->payload_cap = cap;
    return EPD_OK;
}

static void decoder_take_frame(epd_decoder_t *dec, epd_frame_t *frame_p)
{
    *frame_p = dec->frame;
    memset(&dec->frame, 0, sizeof(dec->frame));
    dec->state = EPD_DECODER_HEADER;
    dec->head_have = 0;
    dec->meta_have = 0;
    dec->payload_have = 0;
    dec->payload_cap = 0;
}

epd_status_t epd_decoder_feed(epd_decoder_t *dec, const void *data, size_t len, size_t *used_p,
                              epd_frame_t *frame_p, char err[EPD_ERR_LEN])
{
    const uint8_t *in = data;
    size_t used = 0;
    epd_status_t status;

    *used_p = 0;
    if (dec->state == EPD_DECODER_FAILED) {
        snprintf(err, EPD_ERR_LEN, "stream already failed with %s",
                 epd_status_name(dec->failure));
        return dec->failure;
    }
    if (len == 0) return EPD_ERR_AGAIN; /* no state completes without a byte (meta_len >= 2) */
    for (;;) {
        switch (dec->state) {
        case EPD_DECODER_HEADER: {
            size_t take = EPD_FRAME_HEADER_LEN - dec->head_have;
            if (take > len - used) take = len - used;
            memcpy(dec->head + dec->head_have, in + used, take);
            dec->head_have += take;
            used += take;
            *used_p = used;
            if (dec->head_have < EPD_FRAME_HEADER_LEN) return EPD_ERR_AGAIN;
            status = epd_frame_header_decode(dec->head, dec->max_payload, dec->max_meta,
                                             &dec->header, err);
            if (status != EPD_OK) return decoder_fail(dec, status);
            dec->meta_text = malloc((size_t)dec->header.meta_len + 1);
            if (dec->meta_text == NULL) {
                snprintf(err, EPD_ERR_LEN, "cannot allocate %u bytes for meta",
                         dec->header.meta_len);
                return decoder_fail(dec, EPD_ERR_NO_MEMORY);
            }
            dec->meta_text[dec->header.meta_len] = '\0';
            dec->frame.type = (epd_frame_type_t)dec->header.type;
            dec->frame.meta_len = dec->header.meta_len;
            dec->frame.payload_len = dec->header.payload_len;
            dec->state = EPD_DECODER_META;
            break;
        }
        case EPD_DECODER_META: {
            size_t take = dec->header.meta_len - dec->meta_have;
            if (take > len - used) take = len - used;
            memcpy(dec->meta_text + dec->meta_have, in + used, take);
            dec->meta_have += take;
            used += take;
            *used_p = used;
            if (dec->meta_have < dec->header.meta_len) return EPD_ERR_AGAIN;
            status = decoder_parse_meta(dec, err);
            if (status != EPD_OK) return decoder_fail(dec, status);
            dec->frame.dropped = dec->header.payload_len > 0 && dec->admit != NULL &&
                                 !dec->admit(dec->admit_arg, &dec->header);
            dec->state = EPD_DECODER_PAYLOAD;
            break;
        }
        case EPD_DECODER_PAYLOAD: {
            uint64_t left = dec->header.payload_len - dec->payload_have;
            uint64_t take = left < (uint64_t)(len - used) ? left : (uint64_t)(len - used);
            if (take > 0 && dec->frame.dropped) {
                dec->payload_have += take;
                used += (size_t)take;
                *used_p = used;
            } else if (take > 0) {
                status = decoder_grow_payload(dec, take, err);
                if (status != EPD_OK) return decoder_fail(dec, status);
                memcpy(dec->frame.payload + dec->payload_have, in + used, (size_t)take);
                dec->payload_have += take;
                used += (size_t)take;
                *used_p = used;
            }
            if (dec->payload_have < dec->header.payload_len) return EPD_ERR_AGAIN;
            decoder_take_frame(dec, frame_p);
            return EPD_OK;
        }
        case EPD_DECODER_FAILED:
        default:
            snprintf(err, EPD_ERR_LEN, "decoder in an impossible state");
            return EPD_ERR_INTERNAL;
        }
    }
}

epd_status_t epd_decoder_payload_window(epd_decoder_t *dec, void **ptr_p, size_t *len_p,
                                        char err[EPD_ERR_LEN])
{
    *ptr_p = NULL;
    *len_p = 0;
    if (dec->state == EPD_DECODER_FAILED) {
        snprintf(err, EPD_ERR_LEN, "stream already failed with %s",
                 epd_status_name(dec->failure));
        return dec->failure;
    }
    if (dec->state != EPD_DECODER_PAYLOAD || dec->frame.dropped) return EPD_OK;
    /* not at rest with nothing left: feed completes a frame in the call that fills it */
    if (dec->payload_have == dec->header.payload_len) return EPD_OK;
    if (dec->payload_have == dec->payload_cap) {
        /* one more byte's worth: the growth rule of feed (whole, or the next doubling) */
        epd_status_t status = decoder_grow_payload(dec, 1, err);
        if (status != EPD_OK) return decoder_fail(dec, status);
    }
    *ptr_p = dec->frame.payload + dec->payload_have;
    *len_p = (size_t)(dec->payload_cap - dec->payload_have);
    return EPD_OK;
}

epd_status_t epd_decoder_payload_commit(epd_decoder_t *dec, size_t got, epd_frame_t *frame_p,
                                        char err[EPD_ERR_LEN])
{
    if (dec->state != EPD_DECODER_PAYLOAD || dec->frame.dropped ||
        dec->payload_have == dec->header.payload_len) {
        snprintf(err, EPD_ERR_LEN, "no payload window to commit %zu bytes to", got);
        return EPD_ERR_INVALID_ARG;
    }
    if ((uint64_t)got > dec->payload_cap - dec->payload_have) {
        snprintf(err, EPD_ERR_LEN, "%zu bytes committed to a payload window of %" PRIu64, got,
                 dec->payload_cap - dec->payload_have);
        return EPD_ERR_INVALID_ARG;
    }
    dec->payload_have += got;
    if (dec->payload_have < dec->header.payload_len) return EPD_ERR_AGAIN;
    decoder_take_frame(dec, frame_p);
    return EPD_OK;
}

epd_status_t epd_frame_decode(const void *buf, size_t len, uint64_t max_payload,
                              epd_frame_t *frame_p, char err[EPD_ERR_LEN])
{
    epd_decoder_t dec;
    size_t used = 0;
    epd_status_t status;

    epd_decoder_init(&dec, max_payload, EPD_FRAME_MAX_META);
    status = epd_decoder_feed(&dec, buf, len, &used, frame_p, err);
    if (status == EPD_ERR_AGAIN) {
        snprintf(err, EPD_ERR_LEN, "frame is truncated after %zu bytes", len);
        status = EPD_ERR_BAD_JSON;
    } else if (status == EPD_OK && used != len) {
        epd_frame_free(frame_p);
        snprintf(err, EPD_ERR_LEN, "%zu bytes follow the frame", len - used);
        status = EPD_ERR_BAD_HEADER;
    }
    epd_decoder_free(&dec);
    return status;
}
