/* Unit tests of proto/json_build.c: for every text the strict checker accepts, the fast builder
 * gives the tree cJSON_Parse gives (same types, keys in the same order, strings byte for byte,
 * numbers bit for bit), and epd_json_build_except gives it without one member and that member's
 * value text; texts are handwritten edge cases, the fuzz corpora's metas and generated metas of
 * the daemon's frames. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/json_build.h"
#include "proto/json_strict.h"

static void assert_same_tree(const cJSON *a, const cJSON *b, const char *text)
{
    if (a == NULL || b == NULL) {
        if (a != b) fail_msg("one tree is NULL for %s", text);
        return;
    }
    if ((a->type & 0xff) != (b->type & 0xff)) fail_msg("types differ in %s", text);
    if ((a->string == NULL) != (b->string == NULL) ||
        (a->string != NULL && strcmp(a->string, b->string) != 0))
        fail_msg("keys differ in %s", text);
    if (cJSON_IsString(a) && strcmp(a->valuestring, b->valuestring) != 0)
        fail_msg("strings differ in %s", text);
    if (cJSON_IsNumber(a) && (memcmp(&a->valuedouble, &b->valuedouble, sizeof(double)) != 0 ||
                              a->valueint != b->valueint))
        fail_msg("numbers differ in %s: %.17g vs %.17g", text, a->valuedouble, b->valuedouble);
    const cJSON *x = a->child, *y = b->child;
    for (; x != NULL && y != NULL; x = x->next, y = y->next) assert_same_tree(x, y, text);
    if (x != NULL || y != NULL) fail_msg("child counts differ in %s", text);
    /* the list's tail link, which cJSON's own appends rely on */
    if (a->child != NULL && a->child->prev->next != NULL) fail_msg("bad tail link in %s", text);
}

static int checked, checked_except;

/* epd_json_build_except(text, key) gives cJSON's tree without the first member named key, and
 * that member's value text parses to the member cJSON has. */
static void check_except(const char *text, size_t len, const char *key)
{
    cJSON *want = cJSON_ParseWithLengthOpts(text, len + 1, NULL, 1);
    cJSON *member = cJSON_DetachItemFromObjectCaseSensitive(want, key);
    const char *value;
    size_t value_len;
    cJSON *got = epd_json_build_except(text, len, key, &value, &value_len);
    assert_non_null(got);
    assert_same_tree(got, want, text);
    if (member == NULL) {
        assert_null(value);
        assert_int_equal(value_len, 0);
    } else {
        assert_non_null(value);
        char *copy = malloc(value_len + 1);
        assert_non_null(copy);
        memcpy(copy, value, value_len);
        copy[value_len] = '\0';
        cJSON *parsed = cJSON_ParseWithLengthOpts(copy, value_len + 1, NULL, 1);
        if (parsed == NULL) fail_msg("the value text of \"%s\" is not JSON: \"%s\" in %s", key, copy, text);
        free(parsed->string);
        parsed->string = member->string != NULL ? strdup(member->string) : NULL;
        assert_same_tree(parsed, member, text);
        cJSON_Delete(parsed);
        free(copy);
    }
    cJSON_Delete(member);
    cJSON_Delete(got);
    cJSON_Delete(want);
    checked_except++;
}

/* epd_json_build_simple takes a text only when the full path (the strict check, then the tree)
 * accepts it too, and then gives the same tree and the same top-level id. */
static int simple_taken, simple_refused;

static bool check_simple(const char *text, size_t len)
{
    char err[EPD_ERR_LEN];
    char *copy = malloc(len + 1);
    assert_non_null(copy);
    memcpy(copy, text, len);
    copy[len] = '\0';
    epd_json_id_span_t id = {.kind = EPD_JSON_ID_ESCAPED}, want_id;
    cJSON *got = epd_json_build_simple(copy, len, &id);
    if (got == NULL) {
        simple_refused++;
        free(copy);
        return false;
    }
    simple_taken++;
    if (epd_json_strict_check_id(copy, len, &want_id, err) != EPD_OK)
        fail_msg("the one-pass builder took a text the checker refuses: %s (%s)", copy, err);
    cJSON *want = cJSON_ParseWithLengthOpts(copy, len + 1, NULL, 1);
    assert_same_tree(got, want, copy);
    if (id.kind != want_id.kind ||
        (id.kind == EPD_JSON_ID_FOUND && (id.start != want_id.start || id.len != want_id.len)))
        fail_msg("the top-level id differs in %s", copy);
    epd_json_arena_free(got);
    cJSON_Delete(want);
    free(copy);
    return true;
}

static void check_text(const char *text, size_t len)
{
    char err[EPD_ERR_LEN];
    check_simple(text, len);
    if (epd_json_strict_check(text, len, err) != EPD_OK) return; /* the builder never sees it */
    char *copy = malloc(len + 1);
    assert_non_null(copy);
    memcpy(copy, text, len);
    copy[len] = '\0';
    cJSON *want = cJSON_ParseWithLengthOpts(copy, len + 1, NULL, 1);
    cJSON *got = epd_json_build(copy, len);
    assert_non_null(got);
    assert_same_tree(got, want, copy);
    /* and the builder's tree works with cJSON's own calls */
    cJSON_AddNumberToObject(got, "appended", 1);
    cJSON_Delete(got);
    /* the one-block tree of the decoder: the same tree for objects and arrays, none otherwise;
     * a copy of it (epd_frame_take_meta) is cJSON's own */
    cJSON *block = epd_json_build_arena(copy, len);
    if (cJSON_IsObject(want) || cJSON_IsArray(want)) {
        assert_non_null(block);
        assert_same_tree(block, want, copy);
        cJSON *dup = cJSON_Duplicate(block, true);
        epd_json_arena_free(block);
        assert_same_tree(dup, want, copy);
        cJSON_Delete(dup);
    } else {
        assert_null(block);
    }
    /* objects: without their first member, their last, and a key they do not have */
    if (cJSON_IsObject(want)) {
        if (want->child != NULL && want->child->string != NULL) {
            check_except(copy, len, want->child->string);
            check_except(copy, len, want->child->prev->string);
        }
        check_except(copy, len, "no such key");
    } else {
        const char *value = "untouched";
        size_t value_len = 7;
        assert_null(epd_json_build_except(copy, len, "a", &value, &value_len));
        assert_null(value);
        assert_int_equal(value_len, 0);
    }
    cJSON_Delete(want);
    free(copy);
    checked++;
}

static void test_edge_cases(void **state)
{
    (void)state;
    static const char *const texts[] = {
        "{}", "[]", " { } ", "{\"a\":1}", "[1,2,3]", "{\"a\":[],\"b\":{},\"c\":[{}]}",
        "{\"id\":0,\"id\":1}", "[0,-0,1,-1,123456789012345,1234567890123456,-999999999999999]",
        "[18446744073709551615,9007199254740993,1e308,1e-320,-2.5e-3,0.1,3.14159265358979323]",
        "[1E5,1e+5,1.0,0.000001,2147483647,2147483648,-2147483648,-2147483649]",
        "[true,false,null]", "{\"s\":\"\"}", "{\"s\":\"plain ascii\"}",
        "{\"s\":\"q\\\" b\\\\ s\\/ \\b\\f\\n\\r\\t\"}", "{\"u\":\"\\u00e9\\u20ac\\u0041\"}",
        "{\"u\":\"\\ud83d\\ude00 pair\"}", "{\"utf8\":\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"}",
        "{\"k\\u0065y\":\"v\"}", "{\"nested\":{\"a\":{\"b\":{\"c\":[[[[1]]]]}}}}",
        "  \t\r\n{ \"a\" : [ 1 , 2 ] , \"b\" : \"x\" }  \n",
        "{\"a\":\"x]}\\\"\\\\\",\"b\":[1,\"]\",{\"c\":\"}\"}],\"d\":true,\"e\":-1.5e3 , \"f\":null}",
        "{\"a\" : { \"b\" : [ ] } , \"a\" : 2 }",
    };
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) check_text(texts[i], strlen(texts[i]));
    assert_int_equal(checked, (int)(sizeof texts / sizeof texts[0]));
    assert_true(checked_except > 0);
}

static void test_daemon_metas(void **state)
{
    (void)state;
    char meta[16384];
    for (int n_counts = 0; n_counts <= 256; n_counts += 32) {
        int n = snprintf(meta, sizeof meta, "{\"step\":%d,\"layer\":3,\"counts\":[", n_counts * 977);
        for (int e = 0; e < n_counts; e++) n += snprintf(meta + n, sizeof meta - n, "%s%d", e ? "," : "", (e * 7919) % 1000);
        n += snprintf(meta + n, sizeof meta - n,
                      "],\"tensors\":{\"x\":{\"dtype\":\"f8_e4m3\",\"shape\":[%d,7168],\"region\":1,"
                      "\"offset\":0}},\"scale\":0.0123456789,\"sent_ns\":1234567890123456}",
                      n_counts);
        check_text(meta, (size_t)n);
    }
    const char *submit = "{\"id\":1099511627776,\"layer\":0,\"tensors\":{\"x\":{\"dtype\":\"bf16\","
                         "\"shape\":[1,7168],\"data_offsets\":[0,14336]},\"topk_ids\":{\"dtype\":"
                         "\"i64\",\"shape\":[1,8],\"region\":2,\"offset\":64}}}";
    check_text(submit, strlen(submit));
}

/* The metas the daemon and libepd write are taken by the one-pass builder; every byte of them
 * replaced, removed or doubled gives a text it either refuses or builds as the full path does. */
static void test_simple_mutations(void **state)
{
    (void)state;
    static const char *const bases[] = {
        "{\"id\":1099511627776,\"tensors\":{\"topk_ids\":{\"dtype\":\"i32\",\"shape\":[1,8],"
        "\"region\":1,\"offset\":0},\"topk_weights\":{\"dtype\":\"f32\",\"shape\":[1,8],\"region\":1,"
        "\"offset\":4096},\"x\":{\"dtype\":\"bf16\",\"shape\":[1,7168],\"region\":1,\"offset\":8192},"
        "\"y\":{\"dtype\":\"bf16\",\"shape\":[1,7168],\"region\":2,\"offset\":0}}}",
        "{\"id\":7,\"layer\":3,\"tensors\":{\"topk_ids\":{\"dtype\":\"i64\",\"shape\":[2,8],"
        "\"data_offsets\":[0,128]},\"x\":{\"dtype\":\"bf16\",\"shape\":[2,4],\"data_offsets\":[128,144]}}}",
        "{\"id\":0,\"step\":123456,\"tensors\":{\"y\":{\"dtype\":\"bf16\",\"shape\":[128,7168],"
        "\"region\":1,\"offset\":1843200}}}",
        "{\"id\":18,\"op\":\"health\",\"status\":\"ok\",\"list\":[],\"obj\":{},\"s\":\"\"}",
        "{\"step\":99,\"seen_ns\":123456789012345,\"done_ns\":999999999999999,\"a\":[[0],[1,[2]]]}",
        "{\"k\":\"v\",\"id\":\"not a number\",\"id\":3}",
    };
    static const char subst[] = {'"', '\\', ',', ':', '{', '}', '[', ']', '0', '1', '9', '-', '.',
                                 'e', 'E', '+', ' ', '\t', '\n', 'a', 'n', 't', 'f', '/', '\x7f',
                                 '\x01', '\x1f'};
    char buf[1024];
    for (size_t b = 0; b < sizeof bases / sizeof bases[0]; b++) {
        const char *base = bases[b];
        size_t len = strlen(base);
        assert_true(len + 1 < sizeof buf);
        if (!check_simple(base, len)) fail_msg("the one-pass builder refused %s", base);
        for (size_t i = 0; i < len; i++) {
            for (size_t k = 0; k < sizeof subst; k++) {
                memcpy(buf, base, len);
                buf[i] = subst[k]; /* replaced */
                check_simple(buf, len);
                memcpy(buf, base, i); /* inserted before byte i */
                buf[i] = subst[k];
                memcpy(buf + i + 1, base + i, len - i);
                check_simple(buf, len + 1);
            }
            memcpy(buf, base, i); /* removed */
            memcpy(buf + i, base + i + 1, len - i - 1);
            check_simple(buf, len - 1);
            memcpy(buf, base, i + 1); /* doubled */
            memcpy(buf + i + 1, base + i, len - i);
            check_simple(buf, len + 1);
        }
    }
    /* both kinds happened: the mutations are not all refused, nor all taken */
    assert_true(simple_taken > 1000);
    assert_true(simple_refused > 1000);
    /* deeper than its limit: refused (the full path takes it) */
    char deep[64] = "{\"a\":";
    size_t at = strlen(deep);
    for (int d = 0; d < 20; d++) deep[at++] = '[';
    for (int d = 0; d < 20; d++) deep[at++] = ']';
    deep[at++] = '}';
    assert_false(check_simple(deep, at));
    /* 15 digits are taken, 16 are the full path's */
    assert_true(check_simple("{\"n\":999999999999999}", 21));
    assert_false(check_simple("{\"n\":1000000000000000}", 22));
}

/* Every file of the fuzz corpora (the ones the checker accepts). */
static void test_corpora(void **state)
{
    (void)state;
    const char *dirs[] = {"tests/fuzz/meta-corpus", "tests/fuzz/config-corpus"};
    int before = checked;
    for (size_t d = 0; d < 2; d++) {
        DIR *dir = opendir(dirs[d]);
        if (dir == NULL) continue;
        struct dirent *ent;
        while ((ent = readdir(dir)) != NULL) {
            if (ent->d_name[0] == '.') continue;
            char path[512];
            snprintf(path, sizeof path, "%s/%s", dirs[d], ent->d_name);
            FILE *f = fopen(path, "rb");
            if (f == NULL) continue;
            static char buf[1 << 16];
            size_t len = fread(buf, 1, sizeof buf, f);
            fclose(f);
            check_text(buf, len);
        }
        closedir(dir);
    }
    assert_true(checked > before); /* the corpus holds texts the checker accepts */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_edge_cases),
        cmocka_unit_test(test_daemon_metas),
        cmocka_unit_test(test_corpora),
        cmocka_unit_test(test_simple_mutations),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
