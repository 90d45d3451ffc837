/* The strict JSON checker (proto/json_strict.h): a recursive-descent recognizer of RFC 8259's
 * grammar that builds nothing; the depth is bounded by EPD_JSON_MAX_DEPTH. */
#include "proto/json_strict.h"

#include <stdbool.h>
#include <stdio.h>

typedef struct {
    const unsigned char *s;
    size_t len;
    size_t at;
    char *err;
    epd_json_id_span_t *id; /* NULL: not wanted, or found already */
} json_reader_t;

static epd_status_t json_fail(json_reader_t *r, const char *what)
{
    snprintf(r->err, EPD_ERR_LEN, "meta is not strict JSON: %s at offset %zu", what, r->at);
    return EPD_ERR_BAD_JSON;
}

static void json_ws(json_reader_t *r)
{
    while (r->at < r->len && (r->s[r->at] == ' ' || r->s[r->at] == '\t' ||
                              r->s[r->at] == '\n' || r->s[r->at] == '\r'))
        r->at++;
}

static bool json_digit(json_reader_t *r)
{
    return r->at < r->len && r->s[r->at] >= '0' && r->s[r->at] <= '9';
}

/* -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)? */
static epd_status_t json_number(json_reader_t *r)
{
    if (r->s[r->at] == '-') r->at++;
    if (!json_digit(r)) return json_fail(r, "a number needs a digit");
    if (r->s[r->at] == '0') {
        r->at++;
        if (json_digit(r)) return json_fail(r, "a number with a leading zero");
    } else {
        while (json_digit(r)) r->at++;
    }
    if (r->at < r->len && r->s[r->at] == '.') {
        r->at++;
        if (!json_digit(r)) return json_fail(r, "a fraction needs a digit after '.'");
        while (json_digit(r)) r->at++;
    }
    if (r->at < r->len && (r->s[r->at] == 'e' || r->s[r->at] == 'E')) {
        r->at++;
        if (r->at < r->len && (r->s[r->at] == '+' || r->s[r->at] == '-')) r->at++;
        if (!json_digit(r)) return json_fail(r, "an exponent needs a digit");
        while (json_digit(r)) r->at++;
    }
    return EPD_OK;
}

/* Four hex digits after "\u"; -1 when they are not. */
static long json_hex4(json_reader_t *r)
{
    long v = 0;

    if (r->len - r->at < 4) return -1;
    for (int i = 0; i < 4; i++) {
        unsigned char c = r->s[r->at + (size_t)i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    r->at += 4;
    return v;
}

static epd_status_t json_string(json_reader_t *r)
{
    r->at++; /* the opening quote */
    for (;;) {
        if (r->at >= r->len) return json_fail(r, "an unterminated string");
        unsigned char c = r->s[r->at];
        if (c == '"') {
            r->at++;
            return EPD_OK;
        }
        if (c == '\0') return json_fail(r, "a NUL byte in a string");
        if (c < 0x20) return json_fail(r, "an unescaped control character in a string");
        if (c != '\\') {
            r->at++;
            continue;
        }
        r->at++;
        if (r->at >= r->len) return json_fail(r, "an unterminated escape");
        c = r->s[r->at++];
        if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' || c == 'r' ||
            c == 't')
            continue;
        if (c != 'u') {
            r->at--;
            return json_fail(r, "an unknown escape");
        }
        long unit = json_hex4(r);
        if (unit < 0) return json_fail(r, "\\u needs four hex digits");
        if (unit == 0) return json_fail(r, "an escaped NUL (\\u0000) in a string");
        if (unit >= 0xDC00 && unit <= 0xDFFF)
            return json_fail(r, "a low surrogate escape without a high one");
        if (unit >= 0xD800 && unit <= 0xDBFF) {
            if (r->len - r->at < 2 || r->s[r->at] != '\\' || r->s[r->at + 1] != 'u')
                return json_fail(r, "a high surrogate escape without a low one");
            r->at += 2;
            long low = json_hex4(r);
            if (low < 0xDC00 || low > 0xDFFF)
                return json_fail(r, "a high surrogate escape without a low one");
        }
    }
}

static epd_status_t json_literal(json_reader_t *r, const char *word, size_t n)
{
    if (r->len - r->at < n) return json_fail(r, "an unknown literal");
    for (size_t i = 0; i < n; i++)
        if (r->s[r->at + i] != (unsigned char)word[i]) return json_fail(r, "an unknown literal");
    r->at += n;
    return EPD_OK;
}

static epd_status_t json_value(json_reader_t *r, unsigned depth);

/* An object or an array: the members (a string key, ':' and a value) or elements. */
static epd_status_t json_container(json_reader_t *r, unsigned depth, bool object)
{
    const unsigned char close = object ? '}' : ']';
    epd_status_t status;

    if (depth >= EPD_JSON_MAX_DEPTH) return json_fail(r, "nesting too deep");
    r->at++;
    json_ws(r);
    if (r->at < r->len && r->s[r->at] == close) {
        r->at++;
        return EPD_OK;
    }
    for (;;) {
        bool is_id = false;
        if (object) {
            if (r->at >= r->len || r->s[r->at] != '"') return json_fail(r, "a member needs a key");
            size_t key = r->at + 1;
            if ((status = json_string(r)) != EPD_OK) return status;
            if (depth == 0 && r->id != NULL) {
                /* the key's raw bytes, quotes excluded: "id" itself, or escapes to decode */
                size_t n = r->at - 1 - key;
                is_id = n == 2 && r->s[key] == 'i' && r->s[key + 1] == 'd';
                for (size_t i = key; !is_id && i < key + n; i++) {
                    if (r->s[i] == '\\') {
                        r->id->kind = EPD_JSON_ID_ESCAPED;
                        r->id = NULL;
                        break;
                    }
                }
            }
            json_ws(r);
            if (r->at >= r->len || r->s[r->at] != ':') return json_fail(r, "':' expected");
            r->at++;
        }
        if (is_id) {
            json_ws(r);
            size_t start = r->at;
            if ((status = json_value(r, depth + 1)) != EPD_OK) return status;
            *r->id = (epd_json_id_span_t){.kind = EPD_JSON_ID_FOUND, .start = start,
                                          .len = r->at - start};
            r->id = NULL;
        } else if ((status = json_value(r, depth + 1)) != EPD_OK) {
            return status;
        }
        json_ws(r);
        if (r->at >= r->len) return json_fail(r, "an unterminated container");
        if (r->s[r->at] == close) {
            r->at++;
            return EPD_OK;
        }
        if (r->s[r->at] != ',')
            return json_fail(r, object ? "',' or '}' expected" : "',' or ']' expected");
        r->at++;
        json_ws(r);
    }
}

/* Whitespace, then one value. */
static epd_status_t json_value(json_reader_t *r, unsigned depth)
{
    json_ws(r);
    if (r->at >= r->len) return json_fail(r, "a value expected");
    switch (r->s[r->at]) {
    case '{':
        return json_container(r, depth, true);
    case '[':
        return json_container(r, depth, false);
    case '"':
        return json_string(r);
    case 't':
        return json_literal(r, "true", 4);
    case 'f':
        return json_literal(r, "false", 5);
    case 'n':
        return json_literal(r, "null", 4);
    default:
        if (r->s[r->at] == '-' || json_digit(r)) return json_number(r);
        if (r->s[r->at] == 0xEF && r->len - r->at >= 3 && r->s[r->at + 1] == 0xBB &&
            r->s[r->at + 2] == 0xBF)
            return json_fail(r, "a byte-order mark");
        return json_fail(r, "a value expected");
    }
}

epd_status_t epd_json_strict_check(const char *text, size_t len, char err[EPD_ERR_LEN])
{
    return epd_json_strict_check_id(text, len, NULL, err);
}

epd_status_t epd_json_strict_check_id(const char *text, size_t len, epd_json_id_span_t *id_p,
                                      char err[EPD_ERR_LEN])
{
    json_reader_t r = {.s = (const unsigned char *)text, .len = len, .at = 0, .err = err,
                       .id = id_p};
    if (id_p != NULL) *id_p = (epd_json_id_span_t){.kind = EPD_JSON_ID_NONE};
    epd_status_t status = json_value(&r, 0);

    if (status != EPD_OK) return status;
    json_ws(&r);
    if (r.at != len) return json_fail(&r, "text after the value");
    return EPD_OK;
}
