/* libFuzzer harness of the CONTROL meta path: each input is a frame's meta text. The strict
 * checker (proto/json_strict.c) is held against cJSON (anything it accepts cJSON must parse, to
 * an object or not, and the decoder's builder, proto/json_build.c, must give cJSON's tree; its
 * one-pass builder of the compact subset may take only what the checker takes, to the same tree
 * and the same top-level id), then the input goes through the decoder as a CONTROL frame and,
 * when it decodes, its "op" and "id" are read as the daemon reads them. Built and run by
 * `make fuzz`. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "proto/frame.h"
#include "proto/json_build.h"
#include "proto/json_strict.h"

#define FUZZ_CHECK(cond)                                                                 \
    do {                                                                                 \
        if (!(cond)) {                                                                   \
            fprintf(stderr, "fuzz_meta: %s failed at line %d\n", #cond, __LINE__);       \
            abort();                                                                     \
        }                                                                                \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[EPD_ERR_LEN] = "";
    char *text = malloc(size + 1);

    if (text == NULL) return 0;
    memcpy(text, data, size);
    text[size] = '\0';

    /* the one-pass builder's texts are strict JSON, and it builds what the full path builds */
    epd_json_id_span_t simple_id;
    cJSON *simple = epd_json_build_simple(text, size, &simple_id);
    if (simple != NULL) {
        epd_json_id_span_t id;
        FUZZ_CHECK(epd_utf8_check((const uint8_t *)text, size) == size);
        FUZZ_CHECK(epd_json_strict_check_id(text, size, &id, err) == EPD_OK);
        FUZZ_CHECK(id.kind == simple_id.kind);
        FUZZ_CHECK(id.kind != EPD_JSON_ID_FOUND ||
                   (id.start == simple_id.start && id.len == simple_id.len));
        cJSON *full = epd_json_build_arena(text, size);
        FUZZ_CHECK(full != NULL);
        char *a = cJSON_PrintUnformatted(full), *b = cJSON_PrintUnformatted(simple);
        FUZZ_CHECK(a != NULL && b != NULL && strcmp(a, b) == 0);
        free(a);
        free(b);
        epd_json_arena_free(full);
        epd_json_arena_free(simple);
    }

    /* strict JSON is a subset of what cJSON takes (for valid UTF-8 without NUL bytes) */
    if (memchr(text, '\0', size) == NULL &&
        epd_utf8_check((const uint8_t *)text, size) == size) {
        epd_status_t status = epd_json_strict_check(text, size, err);
        FUZZ_CHECK(status == EPD_OK || (status == EPD_ERR_BAD_JSON && err[0] != '\0'));
        if (status == EPD_OK) {
            const char *end = NULL;
            cJSON *json = cJSON_ParseWithLengthOpts(text, size + 1, &end, 1);
            FUZZ_CHECK(json != NULL);
            /* and the decoder's own builder gives cJSON's tree (as printed, numbers included) */
            cJSON *built = epd_json_build(text, size);
            FUZZ_CHECK(built != NULL);
            char *a = cJSON_PrintUnformatted(json), *b = cJSON_PrintUnformatted(built);
            FUZZ_CHECK(a != NULL && b != NULL && strcmp(a, b) == 0);
            free(a);
            free(b);
            cJSON_Delete(built);
            cJSON_Delete(json);
        }
    }

    /* the whole decode of a CONTROL frame with this meta, as the daemon reads it */
    if (size <= EPD_FRAME_MAX_META) {
        uint8_t *buf = malloc(EPD_FRAME_HEADER_LEN + size);
        epd_frame_t frame = {0};
        if (buf != NULL) {
            epd_frame_header_encode(EPD_FRAME_CONTROL, (uint32_t)size, 0, buf);
            memcpy(buf + EPD_FRAME_HEADER_LEN, data, size);
            epd_status_t status = epd_frame_decode(buf, EPD_FRAME_HEADER_LEN + size, 0, &frame,
                                                   err);
            if (status == EPD_OK) {
                FUZZ_CHECK(cJSON_IsObject(frame.meta));
                FUZZ_CHECK(epd_json_strict_check(text, size, err) == EPD_OK);
                const cJSON *op = cJSON_GetObjectItemCaseSensitive(frame.meta, "op");
                if (cJSON_IsString(op)) FUZZ_CHECK(strlen(op->valuestring) < size);
                epd_frame_free(&frame);
            } else {
                FUZZ_CHECK(err[0] != '\0');
            }
            free(buf);
        }
    }
    free(text);
    return 0;
}
