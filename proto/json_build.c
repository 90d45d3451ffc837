/* proto/json_build.h: a recursive descent over text the strict checker has validated, so it
 * checks nothing but its allocations (the checker bounds the depth). */
#include "proto/json_build.h"
#include "proto/json_strict.h"

#include <limits.h>
#include <stdalign.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The memory of an arena tree (epd_json_build_arena): chunks, the first one holding the root
 * node at its start, so that the tree finds its chunks. */
typedef struct arena_chunk {
    struct arena_chunk *next;
    size_t used, cap;
    alignas(max_align_t) unsigned char data[];
} arena_chunk_t;

typedef struct {
    const char *s;
    size_t len, at;
    arena_chunk_t *arena; /* NULL: cJSON's allocator, one call a node and a string */
    arena_chunk_t *last;  /* the chunk being filled */
    epd_json_id_span_t *id; /* epd_json_build_simple: the top-level "id" found */
} reader_t;

#define ARENA_ALIGN alignof(max_align_t)

/* An empty chunk of cap bytes, NULL without memory. */
static arena_chunk_t *arena_chunk_new(size_t cap)
{
    arena_chunk_t *c = malloc(sizeof *c + cap);
    if (c == NULL) return NULL;
    c->next = NULL;
    c->used = 0;
    c->cap = cap;
    return c;
}

/* The first chunk of a text's tree: a node every 8 bytes of text and the text's strings, one
 * allocation for the metas of this protocol (a SUBMIT's has about a node every 14 bytes). */
static arena_chunk_t *arena_first(size_t len)
{
    return arena_chunk_new((len / 8 + 4) * sizeof(cJSON) + len + 64);
}

/* bytes from the arena, NULL without memory (the chunks stay on the chain) */
static void *arena_take(reader_t *r, size_t bytes)
{
    bytes = (bytes + ARENA_ALIGN - 1) & ~(ARENA_ALIGN - 1);
    arena_chunk_t *c = r->last;
    if (c->cap - c->used < bytes) {
        size_t cap = c->cap * 2 > bytes ? c->cap * 2 : bytes;
        arena_chunk_t *more = arena_chunk_new(cap);
        if (more == NULL) return NULL;
        c->next = more;
        r->last = c = more;
    }
    void *p = c->data + c->used;
    c->used += bytes;
    return p;
}

/* A node of the given cJSON type, zeroed but for it. */
static cJSON *node_new(reader_t *r, int type)
{
    if (r->arena == NULL) {
        cJSON *item = cJSON_CreateNull();
        if (item != NULL) item->type = type;
        return item;
    }
    cJSON *item = arena_take(r, sizeof *item);
    if (item == NULL) return NULL;
    memset(item, 0, sizeof *item);
    item->type = type;
    return item;
}

/* A number node as cJSON_CreateNumber makes it (valueint saturated). */
static cJSON *number_new(reader_t *r, double v)
{
    if (r->arena == NULL) return cJSON_CreateNumber(v);
    cJSON *item = node_new(r, cJSON_Number);
    if (item == NULL) return NULL;
    item->valuedouble = v;
    item->valueint = v >= INT_MAX ? INT_MAX : v <= (double)INT_MIN ? INT_MIN : (int)v;
    return item;
}

static char *text_new(reader_t *r, size_t bytes)
{
    return r->arena == NULL ? malloc(bytes) : arena_take(r, bytes);
}

static void text_free(reader_t *r, char *text)
{
    if (r->arena == NULL) free(text);
}

static void tree_free(reader_t *r, cJSON *tree)
{
    if (r->arena == NULL) cJSON_Delete(tree); /* an arena tree goes with its arena */
}

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
    char *out = text_new(r, end - start + 1);
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
        return number_new(r, negative ? -(double)v : (double)v);
    }
    char lit[64];
    char *buf = n < sizeof lit ? lit : malloc(n + 1);
    if (buf == NULL) return NULL;
    memcpy(buf, p, n);
    buf[n] = '\0';
    double v = strtod(buf, NULL); /* the C locale: the daemon and libepd never set another */
    if (buf != lit) free(buf);
    return number_new(r, v);
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

/* Appends item, named key (NULL in an array), to container c whose last child is *tail_p, in
 * O(1) as cJSON keeps the list: child->prev is the tail. */
static void append_child(cJSON *c, cJSON **tail_p, cJSON *item, char *key)
{
    item->string = key; /* cJSON_Delete frees it (the item does not own a constant key) */
    if (*tail_p == NULL) {
        c->child = item;
    } else {
        (*tail_p)->next = item;
        item->prev = *tail_p;
    }
    *tail_p = item;
    c->child->prev = item;
}

/* The array or object at r->at; an object's first member named out->key (out may be NULL) is
 * skipped and its value's place kept in out. */
static cJSON *read_container(reader_t *r, bool object, left_out_t *out)
{
    cJSON *c = node_new(r, object ? cJSON_Object : cJSON_Array);
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
            text_free(r, key);
            out->value = r->s + r->at;
            skip_value(r);
            out->value_len = (size_t)(r->s + r->at - out->value);
            skip_ws(r);
            if (r->s[r->at++] == ',') continue;
            return c;
        }
        cJSON *item = read_value(r);
        if (item == NULL) {
            text_free(r, key);
            goto fail;
        }
        append_child(c, &tail, item, key);
        skip_ws(r);
        if (r->s[r->at++] == ',') continue;
        return c; /* '}' or ']' */
    }
fail:
    tree_free(r, c);
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
        cJSON *item = node_new(r, cJSON_String);
        if (item == NULL) {
            text_free(r, text);
            return NULL;
        }
        item->valuestring = text;
        return item;
    }
    case 't': r->at += 4; return node_new(r, cJSON_True);
    case 'f': r->at += 5; return node_new(r, cJSON_False);
    case 'n': r->at += 4; return node_new(r, cJSON_NULL);
    default: return read_number(r);
    }
}

cJSON *epd_json_build(const char *text, size_t len)
{
    reader_t r = {.s = text, .len = len, .at = 0};
    skip_ws(&r);
    return read_value(&r);
}

cJSON *epd_json_build_arena(const char *text, size_t len)
{
    size_t at = 0;
    while (at < len && (text[at] == ' ' || text[at] == '\t' || text[at] == '\n' || text[at] == '\r'))
        at++;
    if (at == len || (text[at] != '{' && text[at] != '[')) return NULL; /* the root first */
    arena_chunk_t *first = arena_first(len);
    if (first == NULL) return NULL;
    reader_t r = {.s = text, .len = len, .at = 0, .arena = first, .last = first};
    skip_ws(&r);
    cJSON *tree = read_value(&r); /* the root is the first node taken: first->data */
    if (tree == NULL) {
        epd_json_arena_free((cJSON *)(void *)first->data);
        return NULL;
    }
    return tree;
}

/* ---- the compact subset in one pass (epd_json_build_simple) ---- */

#define SIMPLE_MAX_DEPTH 16u

static cJSON *simple_value(reader_t *r, unsigned depth);

/* The bytes a simple string holds as they are: printable ASCII but the quote and the escape. */
static const uint8_t simple_plain[256] = {
    [0x20 ... '"' - 1] = 1, ['"' + 1 ... '\\' - 1] = 1, ['\\' + 1 ... 0x7e] = 1};

/* A string of printable ASCII without escapes, into the arena; NULL otherwise. */
static char *simple_string(reader_t *r)
{
    size_t start = ++r->at, end = start;
    while (end < r->len && simple_plain[(unsigned char)r->s[end]]) end++;
    if (end == r->len || r->s[end] != '"') return NULL; /* control, escape, non-ASCII, cut */
    char *out = arena_take(r, end - start + 1);
    if (out == NULL) return NULL;
    memcpy(out, r->s + start, end - start);
    out[end - start] = '\0';
    r->at = end + 1;
    return out;
}

/* 0, or 1-15 digits without a leading zero (exact as a double, as read_number makes them). */
static cJSON *simple_number(reader_t *r)
{
    size_t start = r->at;
    uint64_t v = 0;
    while (r->at < r->len && r->s[r->at] >= '0' && r->s[r->at] <= '9') {
        v = v * 10 + (uint64_t)(r->s[r->at] - '0');
        if (++r->at - start > 15) return NULL;
    }
    size_t n = r->at - start;
    if (n == 0 || (n > 1 && r->s[start] == '0')) return NULL;
    if (r->at < r->len && r->s[r->at] != ',' && r->s[r->at] != '}' && r->s[r->at] != ']')
        return NULL; /* a fraction, an exponent: the full grammar's */
    return number_new(r, (double)v);
}

static cJSON *simple_container(reader_t *r, unsigned depth, bool object)
{
    if (depth >= SIMPLE_MAX_DEPTH) return NULL;
    cJSON *c = node_new(r, object ? cJSON_Object : cJSON_Array);
    if (c == NULL) return NULL;
    r->at++;
    if (r->at < r->len && r->s[r->at] == (object ? '}' : ']')) {
        r->at++;
        return c;
    }
    cJSON *tail = NULL;
    for (;;) {
        char *key = NULL;
        if (object) {
            if (r->at >= r->len || r->s[r->at] != '"' || (key = simple_string(r)) == NULL)
                return NULL;
            if (r->at >= r->len || r->s[r->at] != ':') return NULL;
            r->at++;
        }
        size_t value_at = r->at;
        cJSON *item = simple_value(r, depth + 1);
        if (item == NULL) return NULL;
        if (object && depth == 0 && r->id != NULL && r->id->kind == EPD_JSON_ID_NONE &&
            strcmp(key, "id") == 0) {
            r->id->kind = EPD_JSON_ID_FOUND;
            r->id->start = value_at;
            r->id->len = r->at - value_at;
        }
        append_child(c, &tail, item, key);
        if (r->at >= r->len) return NULL;
        char sep = r->s[r->at++];
        if (sep == ',') continue;
        if (sep == (object ? '}' : ']')) return c;
        return NULL;
    }
}

static cJSON *simple_value(reader_t *r, unsigned depth)
{
    if (r->at >= r->len) return NULL;
    switch (r->s[r->at]) {
    case '{': return simple_container(r, depth, true);
    case '[': return simple_container(r, depth, false);
    case '"': {
        char *text = simple_string(r);
        if (text == NULL) return NULL;
        cJSON *item = node_new(r, cJSON_String);
        if (item != NULL) item->valuestring = text;
        return item;
    }
    default: return simple_number(r);
    }
}

cJSON *epd_json_build_simple(const char *text, size_t len, epd_json_id_span_t *id_p)
{
    epd_json_id_span_t id = {.kind = EPD_JSON_ID_NONE, .start = 0, .len = 0};
    if (len < 2 || text[0] != '{') return NULL;
    arena_chunk_t *first = arena_first(len);
    if (first == NULL) return NULL;
    reader_t r = {.s = text, .len = len, .at = 0, .arena = first, .last = first, .id = &id};
    cJSON *tree = simple_value(&r, 0); /* the root is the first node taken: first->data */
    if (tree == NULL || r.at != len) {
        epd_json_arena_free((cJSON *)(void *)first->data);
        return NULL;
    }
    if (id_p != NULL) *id_p = id;
    return tree;
}

void epd_json_arena_free(cJSON *tree)
{
    if (tree == NULL) return;
    arena_chunk_t *c = (arena_chunk_t *)(void *)((unsigned char *)tree - offsetof(arena_chunk_t, data));
    while (c != NULL) {
        arena_chunk_t *next = c->next;
        free(c);
        c = next;
    }
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
