/* docs/protocol.md checked against the code: the examples marked `<!-- check: ... -->` there are
 * read and run through the real codec (hex frames decode with epd_frame_decode and validate with
 * epd_submit_validate to the documented code, and are byte for byte what the encoders write; SUBMIT
 * metas validate to the documented code), the error-code table is common/status.c's wire list
 * with its numbers, the frame-type table is the codec's, the CONTROL op table is daemon/control.c's
 * and the REPLY documents have the fields daemon/stats.c and config/ render. Paths are relative to
 * the repository root (where `make check` runs), or to $EPD_SOURCE_DIR. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <ctype.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/status.h"
#include "config/config.h"
#include "daemon/stats.h"
#include "proto/frame.h"

#define DOC_PATH "docs/protocol.md"
#define CONTROL_PATH "daemon/control.c"
#define MAX_DIRECTIVES 128
#define MAX_FRAMES 32
/* socket.max_frame_bytes' default: the limit the documented frames are decoded against. */
#define DOC_MAX_PAYLOAD 268435456u

/* One `<!-- check: KIND ARGS -->` and the fenced block or table right after it. */
typedef struct {
    int line;        /* of the directive in the doc */
    char kind[32];
    char args[256];  /* the rest of the directive */
    char *body;      /* the block's lines (fences dropped) or the table's lines; owned */
    int body_line;   /* first line of body */
} directive_t;

/* A documented frame, by name, for meta-of and payload=example. */
typedef struct {
    char name[32];
    uint8_t *bytes;
    size_t len;
    epd_frame_t frame; /* decoded (zeroed when it did not decode) */
} doc_frame_t;

static char *doc_text;
static directive_t directives[MAX_DIRECTIVES];
static size_t n_directives;
static doc_frame_t frames[MAX_FRAMES];
static size_t n_frames;
static int failures;

/* Reports one disagreement with its doc line; the test fails at its end. */
static void doc_fail(int line, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void doc_fail(int line, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "%s:%d: ", DOC_PATH, line);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    failures++;
}

static char *read_source(const char *rel)
{
    const char *dir = getenv("EPD_SOURCE_DIR");
    char path[1024];
    snprintf(path, sizeof(path), "%s%s%s", dir ? dir : "", dir ? "/" : "", rel);
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        fprintf(stderr, "cannot open %s (run from the repository root or set EPD_SOURCE_DIR)\n",
                path);
        return NULL;
    }
    char *buf = NULL;
    size_t len = 0, cap = 0, n;
    char chunk[65536];
    while ((n = fread(chunk, 1, sizeof(chunk), f)) > 0) {
        if (len + n + 1 > cap) {
            cap = (len + n + 1) * 2;
            buf = realloc(buf, cap);
            assert_non_null(buf);
        }
        memcpy(buf + len, chunk, n);
        len += n;
    }
    fclose(f);
    if (buf == NULL) buf = calloc(1, 1);
    buf[len] = '\0';
    return buf;
}

/* The value of key=VALUE among a directive's args ("" when absent), copied into out. */
static const char *arg_value(const directive_t *d, const char *key, char *out, size_t len)
{
    size_t klen = strlen(key);
    out[0] = '\0';
    for (const char *p = d->args; *p != '\0';) {
        while (*p == ' ') p++;
        const char *end = strchr(p, ' ');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n > klen && strncmp(p, key, klen) == 0 && p[klen] == '=') {
            snprintf(out, len, "%.*s", (int)(n - klen - 1), p + klen + 1);
            return out;
        }
        p += n;
    }
    return out;
}

/* The first word of a directive's args (a frame's name). */
static const char *arg_first(const directive_t *d, char *out, size_t len)
{
    const char *p = d->args;
    while (*p == ' ') p++;
    size_t n = strcspn(p, " ");
    if (memchr(p, '=', n) != NULL) n = 0;
    snprintf(out, len, "%.*s", (int)n, p);
    return out;
}

/* Splits the doc into directives, each with the fenced block or table that follows it. */
static void parse_doc(void)
{
    char *lines = doc_text;
    int line_no = 0;
    directive_t *cur = NULL;
    bool in_fence = false, in_table = false;
    size_t body_len = 0;

    for (char *line = lines; line != NULL && *line != '\0';) {
        char *nl = strchr(line, '\n');
        size_t len = nl ? (size_t)(nl - line) : strlen(line);
        line_no++;
        const char *dir = "<!-- check: ";
        if (!in_fence && strncmp(line, dir, strlen(dir)) == 0) {
            assert_true(n_directives < MAX_DIRECTIVES);
            cur = &directives[n_directives++];
            memset(cur, 0, sizeof(*cur));
            cur->line = line_no;
            const char *p = line + strlen(dir);
            const char *close = strstr(p, "-->");
            if (close == NULL) doc_fail(line_no, "a check must end with --> on its line");
            size_t dlen = close ? (size_t)(close - p) : len - strlen(dir);
            char text[300];
            snprintf(text, sizeof(text), "%.*s", (int)dlen, p);
            size_t klen = strcspn(text, " ");
            snprintf(cur->kind, sizeof(cur->kind), "%.*s", (int)klen, text);
            snprintf(cur->args, sizeof(cur->args), "%s", text + klen);
            for (char *e = cur->args + strlen(cur->args); e > cur->args && e[-1] == ' '; e--)
                e[-1] = '\0';
            in_table = false;
        } else if (cur != NULL && cur->body == NULL && !in_fence && strncmp(line, "```", 3) == 0) {
            in_fence = true;
            cur->body = calloc(1, 1);
            cur->body_line = line_no + 1;
            body_len = 0;
        } else if (in_fence && strncmp(line, "```", 3) == 0) {
            in_fence = false;
            cur = NULL;
        } else if (in_fence || in_table ||
                   (cur != NULL && cur->body == NULL && len > 0 && line[0] == '|')) {
            if (!in_fence && !in_table) {
                in_table = true;
                cur->body = calloc(1, 1);
                cur->body_line = line_no;
                body_len = 0;
            }
            if (in_table && (len == 0 || line[0] != '|')) {
                in_table = false;
                cur = NULL;
            } else {
                cur->body = realloc(cur->body, body_len + len + 2);
                assert_non_null(cur->body);
                memcpy(cur->body + body_len, line, len);
                body_len += len;
                cur->body[body_len++] = '\n';
                cur->body[body_len] = '\0';
            }
        }
        line = nl ? nl + 1 : NULL;
    }
    if (in_fence) doc_fail(line_no, "a fenced block is not closed");
}

/* ---- hexdump -C ---- */

/* Parses `hexdump -C` output: "OFFSET  hh hh ...  |ascii|" lines, "*" for repeats of the line
 * above, and a last line holding the total length. Checks offsets and the ASCII column. */
static bool parse_hexdump(const directive_t *d, uint8_t **bytes_p, size_t *len_p)
{
    uint8_t *out = NULL;
    size_t len = 0;
    uint8_t last[16];
    size_t last_n = 0;
    bool repeat = false, ended = false;
    int line_no = d->body_line;

    for (const char *line = d->body; *line != '\0'; line_no++) {
        const char *nl = strchr(line, '\n');
        size_t n = nl ? (size_t)(nl - line) : strlen(line);
        char text[128];
        snprintf(text, sizeof(text), "%.*s", (int)n, line);
        line = nl ? nl + 1 : line + n;
        if (ended) {
            doc_fail(line_no, "text after the hexdump's length line");
            goto fail;
        }
        if (strcmp(text, "*") == 0) {
            repeat = true;
            continue;
        }
        char *p;
        unsigned long long off = strtoull(text, &p, 16);
        if (p == text || p - text != 8) {
            doc_fail(line_no, "hexdump line without an 8-digit offset: %s", text);
            goto fail;
        }
        if (repeat) {
            if (last_n != 16) {
                doc_fail(line_no, "'*' after a short line");
                goto fail;
            }
            while (len < off) {
                out = realloc(out, len + 16);
                memcpy(out + len, last, 16);
                len += 16;
            }
            repeat = false;
        }
        if (off != len) {
            doc_fail(line_no, "offset %08llx, but %zu bytes come before it", off, len);
            goto fail;
        }
        uint8_t row[16];
        size_t row_n = 0;
        while (*p == ' ') {
            while (*p == ' ') p++;
            if (!isxdigit((unsigned char)p[0]) || !isxdigit((unsigned char)p[1])) break;
            if (row_n == 16) {
                doc_fail(line_no, "more than 16 bytes on a line");
                goto fail;
            }
            char hex[3] = {p[0], p[1], 0};
            row[row_n++] = (uint8_t)strtoul(hex, NULL, 16);
            p += 2;
        }
        if (row_n == 0) {
            ended = true; /* the length line */
            continue;
        }
        char ascii[20];
        for (size_t i = 0; i < row_n; i++)
            ascii[i] = row[i] >= 0x20 && row[i] < 0x7f ? (char)row[i] : '.';
        ascii[row_n] = '\0';
        if (*p != '|' || strncmp(p + 1, ascii, row_n) != 0 || p[1 + row_n] != '|') {
            doc_fail(line_no, "the ASCII column does not show the line's bytes (|%s|)", ascii);
            goto fail;
        }
        out = realloc(out, len + row_n);
        memcpy(out + len, row, row_n);
        len += row_n;
        memcpy(last, row, row_n);
        last_n = row_n;
    }
    if (!ended) {
        doc_fail(line_no, "the hexdump does not end with its length line");
        goto fail;
    }
    *bytes_p = out;
    *len_p = len;
    return true;
fail:
    free(out);
    return false;
}

/* ---- limits and expectations ---- */

/* layers=L: a daemon that serves layers 0 .. L-1 (as ffn experts that loaded those would). */
static bool doc_layer_known(void *arg, uint32_t layer)
{
    return layer < *(const uint32_t *)arg;
}

static uint32_t doc_layers;

/* regions=ID:BYTES,...: the connection's host regions, each holding the worked example's payload
 * at offset 0 and zeros after it. */
#define DOC_MAX_REGIONS 4
typedef struct {
    uint32_t id;
    uint64_t bytes;
    uint8_t *mem;
} doc_region_t;

static doc_region_t doc_regions[DOC_MAX_REGIONS];
static size_t n_doc_regions;

static epd_status_t doc_resolve(void *arg, uint32_t id, uint64_t begin, uint64_t end,
                                epd_region_span_t *span_p, char err[EPD_ERR_LEN])
{
    (void)arg;
    for (size_t i = 0; i < n_doc_regions; i++) {
        if (doc_regions[i].id != id) continue;
        if (end > doc_regions[i].bytes) {
            snprintf(err, EPD_ERR_LEN, "bytes [%" PRIu64 ", %" PRIu64 ") are past region %u (%"
                     PRIu64 " bytes)", begin, end, id, doc_regions[i].bytes);
            return EPD_ERR_BAD_REGION;
        }
        span_p->ptr = doc_regions[i].mem + begin;
        span_p->device = false;
        span_p->region = &doc_regions[i];
        return EPD_OK;
    }
    snprintf(err, EPD_ERR_LEN, "region %u is not registered on this connection", id);
    return EPD_ERR_BAD_REGION;
}

static void doc_regions_free(void)
{
    for (size_t i = 0; i < n_doc_regions; i++) free(doc_regions[i].mem);
    n_doc_regions = 0;
}

static epd_submit_limits_t doc_limits(const directive_t *d)
{
    epd_submit_limits_t limits = {.hidden = 128, .topk = 2, .num_experts = 8,
                                  .max_tokens = 4096};
    char v[64];
    if (*arg_value(d, "layers", v, sizeof(v)) != '\0') {
        doc_layers = (uint32_t)strtoul(v, NULL, 10);
        limits.layer_known = doc_layer_known;
        limits.layer_arg = &doc_layers;
    }
    if (*arg_value(d, "limits", v, sizeof(v)) != '\0' &&
        sscanf(v, "%" SCNu32 ",%" SCNu32 ",%" SCNu32 ",%" SCNu32, &limits.hidden, &limits.topk,
               &limits.num_experts, &limits.max_tokens) != 4)
        doc_fail(d->line, "limits=%s is not H,K,E,MAX_TOKENS", v);
    return limits;
}

/* The documented code: "ok" or a wire code's name (anything else is itself a failure). */
static bool doc_expect(const directive_t *d, char *expect, size_t len)
{
    arg_value(d, "expect", expect, len);
    if (strcmp(expect, "ok") == 0) return true;
    epd_status_t s = epd_status_from_name(expect);
    if (!epd_status_is_wire_code(s) || strcmp(epd_status_name(s), expect) != 0) {
        doc_fail(d->line, "expect=%s is not a wire code of common/status.c", expect);
        return false;
    }
    return true;
}

static doc_frame_t *frame_by_name(const char *name)
{
    for (size_t i = 0; i < n_frames; i++)
        if (strcmp(frames[i].name, name) == 0) return &frames[i];
    return NULL;
}

/* Decodes bytes and, for a SUBMIT, validates it: the code the daemon's codec gives. */
static epd_status_t decode_and_validate(const uint8_t *bytes, size_t len,
                                        const epd_submit_limits_t *limits,
                                        const epd_submit_regions_t *regions,
                                        epd_frame_t *frame_p, epd_submit_view_t *view_p,
                                        char err[EPD_ERR_LEN])
{
    memset(frame_p, 0, sizeof(*frame_p));
    memset(view_p, 0, sizeof(*view_p));
    epd_status_t status = epd_frame_decode(bytes, len, DOC_MAX_PAYLOAD, frame_p, err);
    if (status == EPD_OK && frame_p->type == EPD_FRAME_SUBMIT)
        status = regions ? epd_submit_validate_regions(frame_p, limits, regions, view_p, err)
                         : epd_submit_validate(frame_p, limits, view_p, err);
    return status;
}

static bool same_bytes(const directive_t *d, const char *what, const epd_frame_out_t *out,
                       const uint8_t *bytes, size_t len)
{
    uint8_t *buf = NULL;
    size_t blen = 0;
    char err[EPD_ERR_LEN];
    bool same = false;

    if (epd_frame_out_flatten(out, &buf, &blen, err) != EPD_OK) {
        doc_fail(d->line, "cannot flatten the %s encoder's frame: %s", what, err);
        return false;
    }
    if (blen != len) {
        doc_fail(d->line, "the %s encoder writes %zu bytes, the doc shows %zu", what, blen, len);
    } else {
        for (size_t i = 0; i < len; i++) {
            if (buf[i] != bytes[i]) {
                doc_fail(d->line, "byte 0x%zx: the %s encoder writes %02x, the doc shows %02x", i,
                         what, buf[i], bytes[i]);
                goto out;
            }
        }
        same = true;
    }
out:
    free(buf);
    return same;
}

/* encoder=KIND: the documented bytes are what that encoder writes for the decoded frame. */
static void check_encoder(const directive_t *d, const char *encoder, const doc_frame_t *f,
                          const epd_submit_view_t *view)
{
    const epd_frame_t *fr = &f->frame;
    char err[EPD_ERR_LEN];
    epd_frame_out_t out;
    epd_status_t status = EPD_ERR_INVALID_ARG;

    if (strcmp(encoder, "submit") == 0 && fr->type == EPD_FRAME_SUBMIT) {
        status = epd_frame_encode_submit(view->id, view->n_tokens, view->hidden, view->topk,
                                         view->x, view->topk_ids, view->topk_weights, &out, err);
    } else if (strcmp(encoder, "result") == 0 && fr->type == EPD_FRAME_RESULT) {
        epd_tensor_t y;
        const cJSON *tensors = cJSON_GetObjectItemCaseSensitive(fr->meta, "tensors");
        const cJSON *step = cJSON_GetObjectItemCaseSensitive(fr->meta, "step");
        if (fr->id_kind != EPD_FRAME_ID_VALID || !cJSON_IsNumber(step) ||
            epd_tensor_parse(cJSON_GetObjectItemCaseSensitive(tensors, "y"), "y", fr->payload_len,
                             &y, err) != EPD_OK || y.ndim != 2) {
            doc_fail(d->line, "the RESULT needs an id, a step and a 2-D y");
            return;
        }
        status = epd_frame_encode_result(fr->id, (uint64_t)step->valuedouble,
                                         (uint32_t)y.shape[0], (uint32_t)y.shape[1],
                                         (const uint16_t *)(const void *)fr->payload, &out, err);
    } else if (strcmp(encoder, "result-region") == 0 && fr->type == EPD_FRAME_RESULT) {
        const cJSON *tensors = cJSON_GetObjectItemCaseSensitive(fr->meta, "tensors");
        const cJSON *y = cJSON_GetObjectItemCaseSensitive(tensors, "y");
        const cJSON *shape = cJSON_GetObjectItemCaseSensitive(y, "shape");
        const cJSON *region = cJSON_GetObjectItemCaseSensitive(y, "region");
        const cJSON *offset = cJSON_GetObjectItemCaseSensitive(y, "offset");
        const cJSON *step = cJSON_GetObjectItemCaseSensitive(fr->meta, "step");
        if (fr->id_kind != EPD_FRAME_ID_VALID || cJSON_GetArraySize(shape) != 2 ||
            !cJSON_IsNumber(region) || !cJSON_IsNumber(offset) || !cJSON_IsNumber(step)) {
            doc_fail(d->line, "the RESULT needs an id, a step and y with shape, region, offset");
            return;
        }
        status = epd_frame_encode_result_region(
            fr->id, (uint64_t)step->valuedouble,
            (uint32_t)cJSON_GetArrayItem(shape, 0)->valuedouble,
            (uint32_t)cJSON_GetArrayItem(shape, 1)->valuedouble, (uint32_t)region->valuedouble,
            (uint64_t)offset->valuedouble, &out, err);
    } else if (strcmp(encoder, "error") == 0 && fr->type == EPD_FRAME_ERROR) {
        const cJSON *code = cJSON_GetObjectItemCaseSensitive(fr->meta, "code");
        const cJSON *msg = cJSON_GetObjectItemCaseSensitive(fr->meta, "message");
        if (!cJSON_IsString(code) || !cJSON_IsString(msg)) {
            doc_fail(d->line, "the ERROR needs a code and a message");
            return;
        }
        epd_status_t s = epd_status_from_name(code->valuestring);
        if (strcmp(epd_status_name(s), code->valuestring) != 0) {
            doc_fail(d->line, "the ERROR's code %s is not a wire code", code->valuestring);
            return;
        }
        status = epd_frame_encode_error(fr->id_kind == EPD_FRAME_ID_VALID, fr->id, s,
                                        msg->valuestring, &out, err);
    } else if (strcmp(encoder, "control") == 0 && fr->type == EPD_FRAME_CONTROL) {
        const cJSON *op = cJSON_GetObjectItemCaseSensitive(fr->meta, "op");
        if (!cJSON_IsString(op)) {
            doc_fail(d->line, "the CONTROL needs an op");
            return;
        }
        status = epd_frame_encode_control(op->valuestring, &out, err);
    } else {
        doc_fail(d->line, "encoder=%s does not fit a %s frame", encoder,
                 epd_frame_type_name((int)fr->type));
        return;
    }
    if (status != EPD_OK) {
        doc_fail(d->line, "the %s encoder fails: %s", encoder, err);
        return;
    }
    same_bytes(d, encoder, &out, f->bytes, f->len);
    epd_frame_out_free(&out);
}

/* values=: "v,v*count,..." (decimal, or 0x.. bit patterns) against n elements of kind
 * 'i' (i32), 'f' (f32) or 'h' (16-bit patterns). */
static void check_values(const directive_t *d, const char *key, const void *data, size_t n,
                         char kind)
{
    char spec[512];
    size_t at = 0;

    if (*arg_value(d, key, spec, sizeof(spec)) == '\0') return;
    for (char *tok = strtok(spec, ","); tok != NULL; tok = strtok(NULL, ",")) {
        char *star = strchr(tok, '*');
        size_t count = star ? strtoul(star + 1, NULL, 10) : 1;
        if (star) *star = '\0';
        for (size_t k = 0; k < count; k++, at++) {
            if (at >= n) {
                doc_fail(d->line, "%s= lists more than the tensor's %zu values", key, n);
                return;
            }
            bool same;
            if (kind == 'i') {
                same = ((const int32_t *)data)[at] == (int32_t)strtol(tok, NULL, 0);
            } else if (kind == 'f') {
                same = ((const float *)data)[at] == strtof(tok, NULL);
            } else {
                same = ((const uint16_t *)data)[at] == (uint16_t)strtoul(tok, NULL, 0);
            }
            if (!same) {
                doc_fail(d->line, "%s[%zu] is not %s in the frame", key, at, tok);
                return;
            }
        }
    }
    if (at != n) doc_fail(d->line, "%s= lists %zu values, the tensor has %zu", key, at, n);
}

/* ---- the tests ---- */

static int setup(void **state)
{
    (void)state;
    doc_text = read_source(DOC_PATH);
    if (doc_text == NULL) return -1;
    parse_doc();
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    for (size_t i = 0; i < n_directives; i++) free(directives[i].body);
    for (size_t i = 0; i < n_frames; i++) {
        free(frames[i].bytes);
        epd_frame_free(&frames[i].frame);
    }
    free(doc_text);
    return 0;
}

static size_t count_kind(const char *kind)
{
    size_t n = 0;
    for (size_t i = 0; i < n_directives; i++) n += strcmp(directives[i].kind, kind) == 0;
    return n;
}

static void test_protocol_doc__directives__known_and_with_a_body(void **state)
{
    static const char *const kinds[] = {"frame", "submit", "meta-of", "error-codes",
                                        "frame-types", "control-ops", "reply",
                                        "python-client"};
    (void)state;
    failures = 0;
    for (size_t i = 0; i < n_directives; i++) {
        bool known = false;
        for (size_t k = 0; k < EPD_ARRAY_SIZE(kinds); k++)
            known |= strcmp(directives[i].kind, kinds[k]) == 0;
        if (!known) doc_fail(directives[i].line, "unknown check kind '%s'", directives[i].kind);
        if (directives[i].body == NULL)
            doc_fail(directives[i].line, "no fenced block or table follows the check");
    }
    /* the document keeps its checked parts: a doc that dropped them would pass anything */
    assert_int_equal(count_kind("error-codes"), 1);
    assert_int_equal(count_kind("frame-types"), 1);
    assert_int_equal(count_kind("control-ops"), 1);
    assert_true(count_kind("frame") >= 4);
    assert_true(count_kind("submit") >= 10);
    assert_true(count_kind("reply") >= 3);
    assert_int_equal(failures, 0);
}

/* Every hex frame decodes (and a SUBMIT validates) to its documented code; encoder=... frames are
 * exactly the encoder's bytes. */
static void test_protocol_doc__hex_frames__decode_to_the_documented_code(void **state)
{
    (void)state;
    failures = 0;
    for (size_t i = 0; i < n_directives; i++) {
        const directive_t *d = &directives[i];
        if (strcmp(d->kind, "frame") != 0 || d->body == NULL) continue;
        char name[32], expect[64], encoder[32], err[EPD_ERR_LEN] = "";
        arg_first(d, name, sizeof(name));
        if (name[0] == '\0' || frame_by_name(name) != NULL) {
            doc_fail(d->line, "a frame needs a name of its own");
            continue;
        }
        if (!doc_expect(d, expect, sizeof(expect))) continue;
        assert_true(n_frames < MAX_FRAMES);
        doc_frame_t *f = &frames[n_frames];
        memset(f, 0, sizeof(*f));
        snprintf(f->name, sizeof(f->name), "%s", name);
        if (!parse_hexdump(d, &f->bytes, &f->len)) continue;
        n_frames++;
        epd_submit_limits_t limits = doc_limits(d);
        epd_submit_view_t view;
        epd_status_t status =
            decode_and_validate(f->bytes, f->len, &limits, NULL, &f->frame, &view, err);
        const char *got = status == EPD_OK ? "ok" : epd_status_name(status);
        if (strcmp(got, expect) != 0) {
            doc_fail(d->line, "frame %s: the codec says %s (%s), the doc says %s", name, got, err,
                     expect);
            free(view.owned);
            continue;
        }
        if (status != EPD_OK && f->frame.meta != NULL) epd_frame_free(&f->frame);
        if (status == EPD_OK && f->frame.type == EPD_FRAME_SUBMIT) {
            size_t nk = (size_t)view.n_tokens * view.topk;
            check_values(d, "ids", view.topk_ids, nk, 'i');
            check_values(d, "weights", view.topk_weights, nk, 'f');
            check_values(d, "x", view.x, (size_t)view.n_tokens * view.hidden, 'h');
        } else if (status == EPD_OK && f->frame.type == EPD_FRAME_RESULT) {
            check_values(d, "y", f->frame.payload, f->frame.payload_len / 2, 'h');
        }
        if (*arg_value(d, "encoder", encoder, sizeof(encoder)) != '\0') {
            if (status != EPD_OK)
                doc_fail(d->line, "encoder= on a frame that does not decode");
            else
                check_encoder(d, encoder, f, &view);
        }
        free(view.owned);
    }
    assert_int_equal(failures, 0);
}

/* Builds the payload of a submit example: payload=example | example-x-first | example-topk |
 * zeros:N, then
 * patch=OFFSET:HEX. NULL (and a failure) when the spec is wrong. */
static uint8_t *example_payload(const directive_t *d, size_t *len_p)
{
    char spec[64], patch[128];
    uint8_t *p = NULL;
    size_t len = 0;

    arg_value(d, "payload", spec, sizeof(spec));
    if (strcmp(spec, "example") == 0 || strcmp(spec, "example-x-first") == 0 ||
        strcmp(spec, "example-topk") == 0) {
        doc_frame_t *f = frame_by_name("submit");
        if (f == NULL || f->frame.payload_len != 544) {
            doc_fail(d->line, "payload=%s needs the worked example's 544-byte SUBMIT", spec);
            return NULL;
        }
        len = 544;
        p = malloc(len);
        assert_non_null(p);
        if (strcmp(spec, "example") == 0) {
            memcpy(p, f->frame.payload, len);
        } else if (strcmp(spec, "example-topk") == 0) { /* ids and weights only */
            len = 32;
            memcpy(p, f->frame.payload, len);
        } else { /* x (bytes 32..544), then ids (0..16), then weights (16..32) */
            memcpy(p, f->frame.payload + 32, 512);
            memcpy(p + 512, f->frame.payload, 32);
        }
    } else if (strncmp(spec, "zeros:", 6) == 0) {
        len = strtoul(spec + 6, NULL, 10);
        p = calloc(1, len + 1);
        assert_non_null(p);
    } else {
        doc_fail(d->line, "payload=%s: expected example, example-x-first, example-topk or "
                 "zeros:N", spec);
        return NULL;
    }
    if (*arg_value(d, "patch", patch, sizeof(patch)) != '\0') {
        char *colon = strchr(patch, ':');
        size_t off = strtoul(patch, NULL, 10);
        size_t n = colon ? strlen(colon + 1) / 2 : 0;
        if (colon == NULL || n == 0 || off + n > len) {
            doc_fail(d->line, "patch=%s does not fit the %zu-byte payload", patch, len);
            free(p);
            return NULL;
        }
        for (size_t i = 0; i < n; i++) {
            char hex[3] = {colon[1 + 2 * i], colon[2 + 2 * i], 0};
            p[off + i] = (uint8_t)strtoul(hex, NULL, 16);
        }
    }
    *len_p = len;
    return p;
}

/* regions=ID:BYTES,...: sets up the connection's regions (false: the example has none, as on a
 * connection that registered nothing). */
static bool doc_parse_regions(const directive_t *d)
{
    char spec[128];
    doc_frame_t *f = frame_by_name("submit");

    if (*arg_value(d, "regions", spec, sizeof(spec)) == '\0') return false;
    for (char *tok = strtok(spec, ","); tok != NULL; tok = strtok(NULL, ",")) {
        char *colon = strchr(tok, ':');
        if (colon == NULL || n_doc_regions == DOC_MAX_REGIONS || f == NULL) {
            doc_fail(d->line, "regions=%s: expected ID:BYTES,... (and the worked SUBMIT)", spec);
            break;
        }
        doc_region_t *r = &doc_regions[n_doc_regions++];
        r->id = (uint32_t)strtoul(tok, NULL, 10);
        r->bytes = strtoull(colon + 1, NULL, 10);
        r->mem = calloc(1, r->bytes + 544);
        assert_non_null(r->mem);
        memcpy(r->mem, f->frame.payload, r->bytes < 544 ? r->bytes : 544);
    }
    return true;
}

/* Every submit example (a JSON meta and a payload) validates to its documented code. */
static void test_protocol_doc__submit_examples__validate_to_the_documented_code(void **state)
{
    (void)state;
    failures = 0;
    for (size_t i = 0; i < n_directives; i++) {
        const directive_t *d = &directives[i];
        if (strcmp(d->kind, "submit") != 0 || d->body == NULL) continue;
        char expect[64], err[EPD_ERR_LEN] = "";
        size_t payload_len = 0;
        if (!doc_expect(d, expect, sizeof(expect))) continue;
        uint8_t *payload = example_payload(d, &payload_len);
        if (payload == NULL) continue;
        size_t meta_len = strlen(d->body);
        while (meta_len > 0 && d->body[meta_len - 1] == '\n') meta_len--;
        size_t len = EPD_FRAME_HEADER_LEN + meta_len + payload_len;
        uint8_t *bytes = malloc(len);
        assert_non_null(bytes);
        epd_frame_header_encode(EPD_FRAME_SUBMIT, (uint32_t)meta_len, payload_len, bytes);
        memcpy(bytes + EPD_FRAME_HEADER_LEN, d->body, meta_len);
        memcpy(bytes + EPD_FRAME_HEADER_LEN + meta_len, payload, payload_len);
        epd_submit_limits_t limits = doc_limits(d);
        epd_submit_regions_t regions = {.arg = NULL, .resolve = doc_resolve};
        bool with_regions = doc_parse_regions(d);
        epd_frame_t frame;
        epd_submit_view_t view;
        epd_status_t status = decode_and_validate(bytes, len, &limits,
                                                  with_regions ? &regions : NULL, &frame, &view,
                                                  err);
        const char *got = status == EPD_OK ? "ok" : epd_status_name(status);
        if (strcmp(got, expect) != 0)
            doc_fail(d->line, "the codec says %s (%s), the doc says %s", got, err, expect);
        free(view.owned);
        doc_regions_free();
        epd_frame_free(&frame);
        free(bytes);
        free(payload);
    }
    assert_int_equal(failures, 0);
}

/* The JSON shown as a frame's meta is that frame's meta. */
static void test_protocol_doc__meta_examples__are_the_frames_meta(void **state)
{
    (void)state;
    failures = 0;
    for (size_t i = 0; i < n_directives; i++) {
        const directive_t *d = &directives[i];
        if (strcmp(d->kind, "meta-of") != 0 || d->body == NULL) continue;
        char name[32];
        arg_first(d, name, sizeof(name));
        doc_frame_t *f = frame_by_name(name);
        cJSON *json = cJSON_Parse(d->body);
        if (f == NULL || f->frame.meta == NULL)
            doc_fail(d->line, "meta-of %s: no decoded frame of that name", name);
        else if (json == NULL)
            doc_fail(d->line, "meta-of %s: the block is not JSON", name);
        else if (!cJSON_Compare(json, f->frame.meta, true))
            doc_fail(d->line, "meta-of %s: the block is not the frame's meta", name);
        cJSON_Delete(json);
    }
    assert_int_equal(failures, 0);
}

/* Splits a table row "| a | b | c |" into trimmed cells (backticks dropped); returns the count. */
static int table_cells(const char *row, char cells[][256], int max)
{
    int n = 0;
    const char *p = strchr(row, '|');
    while (p != NULL && n < max) {
        const char *next = strchr(p + 1, '|');
        if (next == NULL) break;
        const char *a = p + 1, *b = next;
        while (a < b && *a == ' ') a++;
        while (b > a && b[-1] == ' ') b--;
        size_t k = 0;
        for (const char *c = a; c < b && k < 255; c++)
            if (*c != '`') cells[n][k++] = *c;
        cells[n][k] = '\0';
        n++;
        p = next;
    }
    return n;
}

/* Calls row_fn for each data row of a table body (the header and the |---| line skipped). */
static void table_rows(const directive_t *d, void (*row_fn)(const directive_t *, int,
                                                            char cells[][256], int, void *),
                       void *arg)
{
    int line_no = d->body_line, row = 0;
    for (const char *line = d->body; *line != '\0'; line_no++, row++) {
        const char *nl = strchr(line, '\n');
        char text[2048], cells[8][256];
        snprintf(text, sizeof(text), "%.*s", (int)(nl ? nl - line : (long)strlen(line)), line);
        line = nl ? nl + 1 : line + strlen(line);
        if (row < 2) continue;
        int n = table_cells(text, cells, 8);
        row_fn(d, line_no, cells, n, arg);
    }
}

static void error_row(const directive_t *d, int line, char cells[][256], int n, void *arg)
{
    int *seen = arg;
    if (n < 4) {
        doc_fail(line, "an error-code row has code | number | connection | when");
        return;
    }
    epd_status_t s = epd_status_from_name(cells[0]);
    if (strcmp(epd_status_name(s), cells[0]) != 0 || !epd_status_is_wire_code(s)) {
        doc_fail(line, "'%s' is not a wire code of common/status.c", cells[0]);
        return;
    }
    seen[s]++;
    if (strtol(cells[1], NULL, 10) != (long)s)
        doc_fail(line, "%s is number %d in epd_status_t, the doc says %s", cells[0], (int)s,
                 cells[1]);
    bool closed = strncmp(cells[2], "closed", 6) == 0, stays = strncmp(cells[2], "stays", 5) == 0;
    if (!closed && !stays)
        doc_fail(line, "connection column of %s is neither closed nor stays", cells[0]);
    else if (closed != epd_status_is_framing(s))
        doc_fail(line, "%s is %sa framing error in the code (closes the connection), the doc says "
                 "%s", cells[0], epd_status_is_framing(s) ? "" : "not ", cells[2]);
}

static void test_protocol_doc__error_table__is_the_wire_list(void **state)
{
    int seen[EPD_STATUS_MAX] = {0};
    (void)state;
    failures = 0;
    for (size_t i = 0; i < n_directives; i++)
        if (strcmp(directives[i].kind, "error-codes") == 0 && directives[i].body != NULL)
            table_rows(&directives[i], error_row, seen);
    for (int s = 0; s < EPD_STATUS_MAX; s++) {
        if (epd_status_is_wire_code((epd_status_t)s) && seen[s] != 1)
            doc_fail(0, "wire code %s (%d) is in the error table %d times, not once",
                     epd_status_name((epd_status_t)s), s, seen[s]);
    }
    assert_int_equal(failures, 0);
}

static void type_row(const directive_t *d, int line, char cells[][256], int n, void *arg)
{
    bool *listed = arg;
    long type = n >= 2 ? strtol(cells[0], NULL, 10) : -1;
    if (type < 0 || type > 255) {
        doc_fail(line, "a frame-type row starts with the type number and its name");
        return;
    }
    listed[type] = true;
    if (strcmp(epd_frame_type_name((int)type), cells[1]) != 0)
        doc_fail(line, "type %ld is '%s' in the codec, the doc says '%s'", type,
                 epd_frame_type_name((int)type), cells[1]);
}

static void test_protocol_doc__frame_types__are_the_codecs(void **state)
{
    bool listed[256] = {false};
    (void)state;
    failures = 0;
    for (size_t i = 0; i < n_directives; i++)
        if (strcmp(directives[i].kind, "frame-types") == 0 && directives[i].body != NULL)
            table_rows(&directives[i], type_row, listed);
    for (int t = 0; t < 256; t++) {
        bool known = strcmp(epd_frame_type_name(t), "unknown") != 0;
        if (known != listed[t])
            doc_fail(0, "frame type %d is %s the codec but %s the doc's table", t,
                     known ? "in" : "not in", listed[t] ? "in" : "not in");
        /* and the header check agrees with the name table */
        uint8_t head[EPD_FRAME_HEADER_LEN];
        epd_frame_header_t h;
        char err[EPD_ERR_LEN];
        epd_frame_header_encode((epd_frame_type_t)t, 2, 0, head);
        bool accepted = epd_frame_header_decode(head, 0, EPD_FRAME_MAX_META, &h, err) == EPD_OK;
        if (accepted != known)
            doc_fail(0, "frame type %d: the header check %s it", t,
                     accepted ? "accepts" : "refuses");
    }
    assert_int_equal(failures, 0);
}

#define MAX_OPS 32

typedef struct {
    char names[MAX_OPS][64];
    int n;
} op_list_t;

static void op_row(const directive_t *d, int line, char cells[][256], int n, void *arg)
{
    op_list_t *ops = arg;
    if (n < 1 || cells[0][0] == '\0' || ops->n == MAX_OPS) {
        doc_fail(line, "a control-op row starts with the op's name");
        return;
    }
    snprintf(ops->names[ops->n++], sizeof(ops->names[0]), "%s", cells[0]);
}

/* The names of daemon/control.c's control_ops[] table, read from its source. */
static void code_ops(op_list_t *ops)
{
    char *src = read_source(CONTROL_PATH);
    assert_non_null(src);
    char *start = strstr(src, "control_ops[] = {");
    assert_non_null(start);
    char *end = strstr(start, "};");
    assert_non_null(end);
    *end = '\0';
    for (char *p = start; (p = strstr(p, ".name = \"")) != NULL;) {
        p += strlen(".name = \"");
        char *q = strchr(p, '"');
        assert_non_null(q);
        assert_true(ops->n < MAX_OPS);
        snprintf(ops->names[ops->n++], sizeof(ops->names[0]), "%.*s", (int)(q - p), p);
        p = q;
    }
    free(src);
}

static bool op_in(const op_list_t *ops, const char *name)
{
    for (int i = 0; i < ops->n; i++)
        if (strcmp(ops->names[i], name) == 0) return true;
    return false;
}

static void test_protocol_doc__control_ops__are_the_daemons(void **state)
{
    op_list_t doc = {.n = 0}, code = {.n = 0};
    (void)state;
    failures = 0;
    for (size_t i = 0; i < n_directives; i++)
        if (strcmp(directives[i].kind, "control-ops") == 0 && directives[i].body != NULL)
            table_rows(&directives[i], op_row, &doc);
    code_ops(&code);
    assert_true(code.n > 0);
    for (int i = 0; i < code.n; i++)
        if (!op_in(&doc, code.names[i]))
            doc_fail(0, "CONTROL op '%s' of %s is not in the doc's op table", code.names[i],
                     CONTROL_PATH);
    for (int i = 0; i < doc.n; i++)
        if (!op_in(&code, doc.names[i]))
            doc_fail(0, "the doc's op table has '%s', which %s does not", doc.names[i],
                     CONTROL_PATH);
    assert_int_equal(failures, 0);
}

static const char *json_kind(const cJSON *j)
{
    if (cJSON_IsBool(j)) return "bool";
    if (cJSON_IsNumber(j)) return "number";
    if (cJSON_IsString(j)) return "string";
    if (cJSON_IsArray(j)) return "array";
    if (cJSON_IsObject(j)) return "object";
    if (cJSON_IsNull(j)) return "null";
    return "invalid";
}

/* Same keys, same JSON types, recursively through objects (values may differ). */
static void same_shape(int line, const char *path, const cJSON *doc, const cJSON *code)
{
    const cJSON *item;
    if (strcmp(json_kind(doc), json_kind(code)) != 0) {
        doc_fail(line, "%s: the daemon sends a %s, the doc shows a %s", path, json_kind(code),
                 json_kind(doc));
        return;
    }
    if (!cJSON_IsObject(code)) return;
    cJSON_ArrayForEach(item, code) {
        char sub[256];
        snprintf(sub, sizeof(sub), "%s.%s", path, item->string);
        const cJSON *other = cJSON_GetObjectItemCaseSensitive(doc, item->string);
        if (other == NULL)
            doc_fail(line, "%s: the daemon sends it, the doc does not show it", sub);
        else
            same_shape(line, sub, other, item);
    }
    cJSON_ArrayForEach(item, doc) {
        if (cJSON_GetObjectItemCaseSensitive(code, item->string) == NULL)
            doc_fail(line, "%s.%s: the doc shows it, the daemon does not send it", path,
                     item->string);
    }
}

static void test_protocol_doc__reply_documents__have_the_daemons_fields(void **state)
{
    epd_engine_stats_t engine;
    epd_server_stats_t server;
    epd_config_t cfg;
    (void)state;
    failures = 0;
    memset(&engine, 0, sizeof(engine));
    memset(&server, 0, sizeof(server));
    epd_stats_view_t view = {.rank = 0, .world = 1, .uptime_s = 1.0, .dtype = EPD_WIRE_FP8,
                             .engine = &engine, .server = &server};
    epd_config_defaults(&cfg);
    size_t need = epd_config_to_json(&cfg, NULL, 0);
    char *config = malloc(need + 1);
    assert_non_null(config);
    epd_config_to_json(&cfg, config, need + 1);
    char *health = epd_stats_health_json(&view), *stats = epd_stats_json(&view);
    assert_non_null(health);
    assert_non_null(stats);
    struct {
        const char *op;
        const char *text;
    } docs[] = {{"health", health}, {"stats", stats}, {"config", config}};
    bool shown[EPD_ARRAY_SIZE(docs)] = {false};

    for (size_t i = 0; i < n_directives; i++) {
        const directive_t *d = &directives[i];
        if (strcmp(d->kind, "reply") != 0 || d->body == NULL) continue;
        char op[32];
        arg_first(d, op, sizeof(op));
        size_t k;
        for (k = 0; k < EPD_ARRAY_SIZE(docs); k++)
            if (strcmp(docs[k].op, op) == 0) break;
        if (k == EPD_ARRAY_SIZE(docs)) {
            doc_fail(d->line, "reply %s: not a document this test knows", op);
            continue;
        }
        shown[k] = true;
        cJSON *doc = cJSON_Parse(d->body), *code = cJSON_Parse(docs[k].text);
        assert_non_null(code);
        if (doc == NULL)
            doc_fail(d->line, "reply %s: the block is not JSON", op);
        else
            same_shape(d->line, op, doc, code);
        cJSON_Delete(doc);
        cJSON_Delete(code);
    }
    for (size_t k = 0; k < EPD_ARRAY_SIZE(docs); k++)
        if (!shown[k]) doc_fail(0, "the %s document is not shown (check: reply %s)", docs[k].op,
                                docs[k].op);
    free(health);
    free(stats);
    free(config);
    assert_int_equal(failures, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_protocol_doc__directives__known_and_with_a_body),
        cmocka_unit_test(test_protocol_doc__hex_frames__decode_to_the_documented_code),
        cmocka_unit_test(test_protocol_doc__submit_examples__validate_to_the_documented_code),
        cmocka_unit_test(test_protocol_doc__meta_examples__are_the_frames_meta),
        cmocka_unit_test(test_protocol_doc__error_table__is_the_wire_list),
        cmocka_unit_test(test_protocol_doc__frame_types__are_the_codecs),
        cmocka_unit_test(test_protocol_doc__control_ops__are_the_daemons),
        cmocka_unit_test(test_protocol_doc__reply_documents__have_the_daemons_fields),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
