/* Builds the cJSON tree of a JSON text that epd_json_strict_check accepted, several times faster
 * than cJSON_Parse (which allocates and strtod()s every number through the locale: 35 us for an
 * EXPERTS meta of 256 counts, 5 us for a SUBMIT meta). The tree is cJSON's own (free it with
 * cJSON_Delete) and holds what cJSON_Parse would give: duplicate keys kept in order, numbers as
 * doubles (integers of up to 15 digits exactly, others by strtod, as cJSON), strings unescaped to
 * UTF-8. */
#ifndef EPD_PROTO_JSON_BUILD_H
#define EPD_PROTO_JSON_BUILD_H

#include <stddef.h>

#include <cjson/cJSON.h>

#include "proto/json_strict.h"

/* The tree of text[0..len), which must have passed epd_json_strict_check; NULL without memory. */
cJSON *epd_json_build(const char *text, size_t len);

/* The same tree of an object or an array in one block of memory (a chunk or a few), several
 * mallocs fewer: free it with epd_json_arena_free, never cJSON_Delete, and add no nodes of
 * cJSON's to it. NULL without memory, or when the text is not an object or an array. */
cJSON *epd_json_build_arena(const char *text, size_t len);
void epd_json_arena_free(cJSON *tree);

/* The one-block tree of the compact JSON that the daemon and libepd write, in one pass that
 * checks as it goes: an object without whitespace, whose strings are printable ASCII without
 * escapes, whose numbers are integers of 1 to 15 digits without a sign or a leading zero, and
 * nested at most 16 deep. Such a text is valid JSON, and the tree is the one epd_json_build_arena
 * gives after epd_json_strict_check_id passes it; *id_p is what that check finds. NULL for any
 * other text (or without memory): the caller takes the full path, which also says what is wrong. */
cJSON *epd_json_build_simple(const char *text, size_t len, epd_json_id_span_t *id_p);

/* The same for an object, without its first top-level member named key (compared unescaped):
 * *value_p and *value_len_p get that member's value text (NULL and 0 when there is none), for a
 * caller that reads it faster itself (an EXPERTS meta's counts of 256 experts were most of its
 * tree's cost). NULL without memory or when the text is not an object. */
cJSON *epd_json_build_except(const char *text, size_t len, const char *key, const char **value_p,
                             size_t *value_len_p);

#endif
