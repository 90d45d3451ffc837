/* A frame's meta written by hand into a fixed buffer: the metas on every request's path (SUBMIT,
 * RESULT) have a fixed shape of names and integers, and snprintf took most of their encoding
 * (12k of the 13.1k instructions of libepd's send of a SUBMIT). Header-only, for proto/. */
#ifndef EPD_PROTO_META_TEXT_H
#define EPD_PROTO_META_TEXT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    char *buf;
    size_t cap; /* bytes of buf, the NUL included */
    size_t len; /* written so far; cap once something did not fit (then nothing more is) */
} epd_meta_text_t;

static inline epd_meta_text_t epd_meta_text(char *buf, size_t cap)
{
    return (epd_meta_text_t){.buf = buf, .cap = cap, .len = 0};
}

/* False once something did not fit (with its NUL). */
static inline bool epd_meta_text_ok(const epd_meta_text_t *t)
{
    return t->len < t->cap;
}

static inline void epd_meta_put(epd_meta_text_t *t, const char *text)
{
    size_t n = strlen(text);
    if (t->len >= t->cap || t->cap - t->len <= n) {
        t->len = t->cap;
        return;
    }
    memcpy(t->buf + t->len, text, n + 1);
    t->len += n;
}

/* v in decimal, as printf's PRIu64. */
static inline void epd_meta_put_u64(epd_meta_text_t *t, uint64_t v)
{
    char digits[21];
    size_t n = sizeof digits;
    digits[--n] = '\0';
    do {
        digits[--n] = (char)('0' + v % 10);
        v /= 10;
    } while (v != 0);
    epd_meta_put(t, digits + n);
}

#endif
