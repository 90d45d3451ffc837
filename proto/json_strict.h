/* A strict JSON checker (RFC 8259) run on frame meta before cJSON parses it: cJSON is lenient
 * (it skips a byte-order mark, takes "007" and "1." as numbers, stops a string at an escaped NUL,
 * lets raw control characters through), and DESIGN.md section 4 says such meta is `bad_json`.
 * Leaf module: no allocation, no logging. */
#ifndef EPD_PROTO_JSON_STRICT_H
#define EPD_PROTO_JSON_STRICT_H

#include <stddef.h>

#include "common/status.h"

/* Containers nested deeper than this are refused (cJSON's own limit). */
#define EPD_JSON_MAX_DEPTH 1000

/* Checks that text[0..len) is exactly one JSON value with optional whitespace around it, per
 * RFC 8259, and also: no byte-order mark, no NUL in strings (raw or \u0000), no unpaired UTF-16
 * surrogate escapes. The text must already be valid UTF-8 (epd_utf8_check). EPD_OK, or
 * EPD_ERR_BAD_JSON with err saying what is wrong and at which byte offset. */
epd_status_t epd_json_strict_check(const char *text, size_t len, char err[EPD_ERR_LEN]);

/* Where the value of the first member of a top-level object whose key is exactly "id" is
 * (bytes [start, start + len) of the text), found in the same pass. */
typedef struct epd_json_id_span {
    enum {
        EPD_JSON_ID_NONE = 0, /* no such member (or the text is not an object) */
        EPD_JSON_ID_FOUND,    /* start, len */
        EPD_JSON_ID_ESCAPED,  /* a top-level key before it has escapes: look again by decoding */
    } kind;
    size_t start, len;
} epd_json_id_span_t;

/* epd_json_strict_check, also filling *id_p (when the text passes). */
epd_status_t epd_json_strict_check_id(const char *text, size_t len, epd_json_id_span_t *id_p,
                                      char err[EPD_ERR_LEN]);

#endif
