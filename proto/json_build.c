/* proto/json_build.h: a recursive descent over text the strict checker has validated, so it
 * checks nothing but its allocations (the checker bounds the depth). */
#include "proto/json_build.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *s;
    size_t len, at;
} reader_t;

static void skip_ws(reader_t *r)
{
    while (r->at < r->len && (r->s[r->at] == ' ' || r->s[r->at] == '\t' ||
                              r->s[r->at] == '\n' || r->s[r->at] == '\r'))
        r->at++;
}

static unsigned hex4(const char *p)
{
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        v = v * 16 + (unsigned)(c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
    }
    return v;
}

static size_t put_utf8(char *out, unsigned cp)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xc0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xe0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (char)(0xf0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    out[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* The string at r->at (its opening quote), unescaped, NUL-terminated, malloc'ed (the escapes
 * only shrink it); r->at moves past the closing quote. */
static char *read_string(reader_t *r)
{
    size_t start = ++r->at, end = start;
    bool escaped = false;
    while (r->s[end] != '"') {
        if (r->s[end] == '\\') {
            escaped = true;
            end++;
        }
        end++;
    }
    char *out = malloc(end - start + 1);
    if (out == NULL) return NULL;
    r->at = end + 1;
    if (!escaped) {
        memcpy(out, r->s + start, end - start);
        out[end - start] = '\0';
        return out;
    }
    size_t o = 0;
    for (size_t i = start; i < end; i++) {
        char c = r->s[i];
        if (c != '\\') {
            out[o++] = c;
            continue;
        }
        c = r->s[++i];
        switch (c) {
        case 'b': out[o++] = '\b'; break;
        case 'f': out[o++] = '\f'; break;
        case 'n': out[o++] = '\n'; break;
        case 'r': out[o++] = '\r'; break;
        case 't': out[o++] = '\t'; break;
        case 'u': {
            unsigned cp = hex4(r->s + i + 1);
            i += 4;
            if (cp >= 0xd800 && cp < 0xdc00) { /* the checker saw its low half follow */
                unsigned lo = hex4(r->s + i + 3);
                cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                i += 6;
            }
            o += put_utf8(out + o, cp);
            break;
        }
        default: out[o++] = c; /* " \ / */
        }
    }
    out[o] = '\0';
    return out;
}

static cJSON *read_number(reader_t *r)
{
    size_t start = r->at;
    bool integer = true;
    while (r->at < r->len) {
        char c = r->s[r->at];
        if (c == '.' || c == 'e' || c == 'E' || c == '+')
            integer = false;
        else if (!(c == '-' || (c >= '0' && c <= '9')))
            break;
        r->at++;
    }
    size_t n = r->at - start;
    const char *p = r->s + start;
    bool negative = p[0] == '-';
    if (integer && n - negative <= 15) {
        int64_t v = 0;
        for (size_t i = negative; i < n; i++) v = v * 10 + (p[i] - '0');
        return cJSON_CreateNumber(negative ? -(double)v : (double)v);
    }
    char lit[64];
    char *buf = n < sizeof lit ? lit : malloc(n + 1);
    if (buf == NULL) return NULL;
    memcpy(buf, p, n);
    buf[n] = '\0';
    double v = strtod(buf, NULL); /* the C locale: the daemon and libepd never set another */
    if (buf != lit) free(buf);
    return cJSON_CreateNumber(v);
}

/* Moves r->at past the value that starts there. */
static void skip_value(reader_t *r)
{
    size_t depth = 0;
    do {
        char c = r->s[r->at];
        if (c == '"') {
            r->at++;
            while (r->s[r->at] != '"') r->at += r->s[r->at] == '\\' ? 2 : 1;
            r->at++;
        } else if (c == '{' || c == '[') {
            depth++;
            r->at++;
        } else if (c == '}' || c == ']') {
            depth--;
            r->at++;
        } else if (depth == 0) { /* a number, true, false or null */
            while (r->at < r->len && strchr(",}] \t\r\n", r->s[r->at]) == NULL) r->at++;
        } else {
            r->at++;
        }
    } while (depth > 0);
}

/* A member left out of the tree (epd_json_build_except): its key, then where its value is. */
typedef struct {
    const char *key;
    const char *value;
    size_t value_len;
} left_out_t;

static cJSON *read_value(reader_t *r);

/* The array or object at r->at; an object's first member named out->key (out may be NULL) is
 * skipped and its value's place kept in out. */
static cJSON *read_container(reader_t *r, bool object, left_out_t *out)
{
    cJSON *c = object ? cJSON_CreateObject() : cJSON_CreateArray();
    if (c == NULL) return NULL;
    r->at++;
    skip_ws(r);
    if (r->s[r->at] == (object ? '}' : ']')) {
        r->at++;
        return c;
    }
    cJSON *tail = NULL;
    for (;;) {
        char *key = NULL;
        if (object) {
            skip_ws(r);
            key = read_string(r);
            if (key == NULL) goto fail;
            skip_ws(r);
            r->at++; /* ':' */
        }
        skip_ws(r);
        if (out != NULL && out->value == NULL && strcmp(key, out->key) == 0) {
            free(key);
            out->value = r->s + r->at;
            skip_value(r);
            out->value_len = (size_t)(r->s + r->at - out->value);
            skip_ws(r);
            if (r->s[r->at++] == ',') continue;
            return c;
        }
        cJSON *item = read_value(r);
        if (item == NULL) {
            free(key);
            goto fail;
        }
        item->string = key; /* cJSON_Delete frees it (the item does not own a constant key) */
        /* append in O(1), as cJSON keeps the list: child->prev is the tail */
        if (tail == NULL) {
            c->child = item;
        } else {
            tail->next = item;
            item->prev = tail;
        }
        tail = item;
        c->child->prev = tail;
        skip_ws(r);
        if (r->s[r->at++] == ',') continue;
        return c; /* '}' or ']' */
    }
fail:
    cJSON_Delete(c);
    return NULL;
}

static cJSON *read_value(reader_t *r)
{
    switch (r->s[r->at]) {
    case '{': return read_container(r, true, NULL);
    case '[': return read_container(r, false, NULL);
    case '"': {
        char *text = read_string(r);
        if (text == NULL) return NULL;
        cJSON *item = cJSON_CreateNull();
        if (item == NULL) {
            free(text);
            return NULL;
        }
        item->type = cJSON_String;
        item->valuestring = text;
        return item;
    }
    case 't': r->at += 4; return cJSON_CreateTrue();
    case 'f': r->at += 5; return cJSON_CreateFalse();
    case 'n': r->at += 4; return cJSON_CreateNull();
    default: return read_number(r);
    }
}

cJSON *epd_json_build(const char *text, size_t len)
{
    reader_t r = {.s = text, .len = len, .at = 0};
    skip_ws(&r);
    return read_value(&r);
}

cJSON *epd_json_build_except(const char *text, size_t len, const char *key, const char **value_p,
                             size_t *value_len_p)
{
    reader_t r = {.s = text, .len = len, .at = 0};
    left_out_t out = {.key = key, .value = NULL, .value_len = 0};
    skip_ws(&r);
    cJSON *tree = r.s[r.at] == '{' ? read_container(&r, true, &out) : NULL;
    *value_p = tree != NULL ? out.value : NULL;
    *value_len_p = tree != NULL ? out.value_len : 0;
    return tree;
}
