/* The YAML config file reader: walks libyaml's events for a mapping of sections, each a mapping of
 * settings, and hands every setting with its line to a callback. It knows the table only to name
 * unknown sections and keys; values are parsed by the caller. Never prints. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <yaml.h>

#include "config/settings.h"

typedef struct yaml_reader {
    yaml_parser_t parser;
    yaml_event_t event; /* the current event, valid while has_event */
    bool has_event;
    const char *path;
    char *err;
    bool *seen; /* per table row: already set by this file */
    unsigned long *seen_line;
} yaml_reader_t;

static unsigned long event_line(const yaml_reader_t *r)
{
    return (unsigned long)r->event.start_mark.line + 1;
}

/* Replaces the current event with the next one; a syntax error fills err with file:line. */
static epd_status_t reader_next(yaml_reader_t *r)
{
    if (r->has_event) {
        yaml_event_delete(&r->event);
        r->has_event = false;
    }
    if (!yaml_parser_parse(&r->parser, &r->event)) {
        const char *problem = r->parser.problem ? r->parser.problem : "cannot be parsed";
        const yaml_mark_t *mark = &r->parser.problem_mark;
        if (r->parser.context != NULL) {
            epd_config_textf(r->err, EPD_ERR_LEN, "%.120s:%lu: invalid YAML: %s (%s at line %lu)",
                             r->path, (unsigned long)mark->line + 1, problem, r->parser.context,
                             (unsigned long)r->parser.context_mark.line + 1);
        } else {
            epd_config_textf(r->err, EPD_ERR_LEN, "%.120s:%lu: invalid YAML: %s", r->path,
                             (unsigned long)mark->line + 1, problem);
        }
        return EPD_ERR_CONFIG;
    }
    r->has_event = true;
    if (r->event.type == YAML_ALIAS_EVENT) {
        epd_config_textf(r->err, EPD_ERR_LEN, "%.120s:%lu: YAML aliases (*name) are not supported",
                         r->path, event_line(r));
        return EPD_ERR_CONFIG;
    }
    return EPD_OK;
}

/* Length of the current scalar for a bounded %.*s (at most cap). */
static int scalar_len(const yaml_reader_t *r, size_t cap)
{
    size_t n = r->event.data.scalar.length;
    return (int)(n < cap ? n : cap);
}

/* A plain scalar that YAML reads as null: empty, ~, null. */
static bool scalar_is_null(const yaml_event_t *ev)
{
    const char *v = (const char *)ev->data.scalar.value;
    size_t n = ev->data.scalar.length;
    if (ev->data.scalar.style != YAML_PLAIN_SCALAR_STYLE) return false;
    return n == 0 || (n == 1 && v[0] == '~') ||
           (n == 4 && (!strcmp(v, "null") || !strcmp(v, "Null") || !strcmp(v, "NULL")));
}

/* Copies the current scalar as a C string; a scalar holding a NUL byte is refused. */
static epd_status_t scalar_copy(yaml_reader_t *r, char **text_p)
{
    size_t n = r->event.data.scalar.length;
    if (memchr(r->event.data.scalar.value, '\0', n) != NULL) {
        epd_config_textf(r->err, EPD_ERR_LEN, "%.120s:%lu: a value holds a NUL character", r->path,
                         event_line(r));
        return EPD_ERR_CONFIG;
    }
    char *text = malloc(n + 1);
    if (text == NULL) {
        epd_config_textf(r->err, EPD_ERR_LEN, "out of memory reading %.120s", r->path);
        return EPD_ERR_NO_MEMORY;
    }
    memcpy(text, r->event.data.scalar.value, n);
    text[n] = '\0';
    *text_p = text;
    return EPD_OK;
}

/* Reads a sequence of scalars (the current event is its start) into one comma-joined string. */
static epd_status_t read_list(yaml_reader_t *r, const char *key, char **text_p)
{
    epd_status_t status;
    size_t used = 0, cap = 64;
    char *text = malloc(cap);
    char *item = NULL;
    if (text == NULL) {
        epd_config_textf(r->err, EPD_ERR_LEN, "out of memory reading %.120s", r->path);
        return EPD_ERR_NO_MEMORY;
    }
    text[0] = '\0';
    for (;;) {
        CHECK_GOTO(reader_next(r), err_free_text);
        if (r->event.type == YAML_SEQUENCE_END_EVENT) break;
        if (r->event.type != YAML_SCALAR_EVENT) {
            epd_config_textf(r->err, EPD_ERR_LEN,
                             "%.120s:%lu: %.100s: list items must be single values", r->path,
                             event_line(r), key);
            status = EPD_ERR_CONFIG;
            goto err_free_text;
        }
        CHECK_GOTO(scalar_copy(r, &item), err_free_text);
        if (item[0] == '\0' || strchr(item, ',') != NULL) {
            epd_config_textf(r->err, EPD_ERR_LEN,
                             "%.120s:%lu: %.100s: '%.40s' is not a single list item", r->path,
                             event_line(r), key, item);
            status = EPD_ERR_CONFIG;
            goto err_free_item;
        }
        size_t n = strlen(item);
        if (used + n + 2 > cap) {
            while (used + n + 2 > cap) cap *= 2;
            char *grown = realloc(text, cap);
            if (grown == NULL) {
                epd_config_textf(r->err, EPD_ERR_LEN, "out of memory reading %.120s", r->path);
                status = EPD_ERR_NO_MEMORY;
                goto err_free_item;
            }
            text = grown;
        }
        if (used > 0) text[used++] = ',';
        memcpy(text + used, item, n + 1);
        used += n;
        free(item);
        item = NULL;
    }
    *text_p = text;
    return EPD_OK;

err_free_item:
    free(item);
err_free_text:
    free(text);
    return status;
}

/* Reads one section's mapping (the current event is its start), calling fn per setting. */
static epd_status_t read_section(yaml_reader_t *r, const char *section, epd_yaml_setting_fn fn,
                                 void *arg)
{
    epd_status_t status = EPD_OK;
    char key[EPD_CONFIG_STR_LEN];
    for (;;) {
        CHECK_GOTO(reader_next(r), out);
        if (r->event.type == YAML_MAPPING_END_EVENT) break;
        unsigned long line = event_line(r);
        if (r->event.type != YAML_SCALAR_EVENT) {
            epd_config_textf(r->err, EPD_ERR_LEN,
                             "%.120s:%lu: keys of section '%.32s' must be plain names", r->path,
                             line, section);
            return EPD_ERR_CONFIG;
        }
        snprintf(key, sizeof key, "%.32s.%.*s", section, scalar_len(r, 128),
                 (const char *)r->event.data.scalar.value);
        const epd_setting_t *row = epd_setting_by_name(key);
        if (row == NULL) {
            char keys[EPD_ERR_LEN];
            epd_setting_section_keys(section, keys, sizeof keys);
            epd_config_textf(r->err, EPD_ERR_LEN,
                             "%.120s:%lu: unknown key '%.64s' (allowed in %.32s: %.100s)", r->path,
                             line, key, section, keys);
            return EPD_ERR_CONFIG;
        }
        size_t index = (size_t)(row - epd_settings);
        if (r->seen[index]) {
            epd_config_textf(r->err, EPD_ERR_LEN,
                             "%.120s:%lu: %.100s is set twice (first at line %lu)", r->path, line,
                             key, r->seen_line[index]);
            return EPD_ERR_CONFIG;
        }
        r->seen[index] = true;
        r->seen_line[index] = line;

        char *text = NULL;
        CHECK_GOTO(reader_next(r), out);
        switch (r->event.type) {
        case YAML_SCALAR_EVENT:
            if (!scalar_is_null(&r->event)) CHECK_GOTO(scalar_copy(r, &text), out);
            break;
        case YAML_SEQUENCE_START_EVENT:
            if (row->type != EPD_SETTING_UIDS) {
                epd_config_textf(r->err, EPD_ERR_LEN,
                                 "%.120s:%lu: %.100s takes a single value, not a list", r->path,
                                 line, key);
                return EPD_ERR_CONFIG;
            }
            CHECK_GOTO(read_list(r, key, &text), out);
            break;
        default:
            epd_config_textf(r->err, EPD_ERR_LEN,
                             "%.120s:%lu: %.100s takes a single value, not a mapping", r->path,
                             line, key);
            return EPD_ERR_CONFIG;
        }
        status = fn(arg, row, text, line, r->err);
        free(text);
        if (status != EPD_OK) return status;
    }
out:
    return status;
}

/* Reads the top-level mapping of sections (the current event is its start). */
static epd_status_t read_sections(yaml_reader_t *r, epd_yaml_setting_fn fn, void *arg)
{
    epd_status_t status = EPD_OK;
    char seen[16][EPD_CONFIG_STR_LEN];
    unsigned long seen_line[16];
    size_t n_seen = 0;
    char section[EPD_CONFIG_STR_LEN];
    for (;;) {
        CHECK_GOTO(reader_next(r), out);
        if (r->event.type == YAML_MAPPING_END_EVENT) break;
        unsigned long line = event_line(r);
        if (r->event.type != YAML_SCALAR_EVENT) {
            epd_config_textf(r->err, EPD_ERR_LEN, "%.120s:%lu: section names must be plain names",
                             r->path, line);
            return EPD_ERR_CONFIG;
        }
        snprintf(section, sizeof section, "%.*s", scalar_len(r, 128),
                 (const char *)r->event.data.scalar.value);
        if (!epd_setting_section_known(section)) {
            char sections[EPD_ERR_LEN];
            epd_setting_sections(sections, sizeof sections);
            epd_config_textf(r->err, EPD_ERR_LEN,
                             "%.120s:%lu: unknown section '%.64s' (allowed: %.100s)", r->path, line,
                             section, sections);
            return EPD_ERR_CONFIG;
        }
        for (size_t i = 0; i < n_seen; i++) {
            if (strcmp(seen[i], section) == 0) {
                epd_config_textf(r->err, EPD_ERR_LEN,
                                 "%.120s:%lu: section '%.32s' appears twice (first at line %lu)",
                                 r->path, line, section, seen_line[i]);
                return EPD_ERR_CONFIG;
            }
        }
        if (n_seen < EPD_ARRAY_SIZE(seen)) {
            memcpy(seen[n_seen], section, sizeof section);
            seen_line[n_seen++] = line;
        }
        CHECK_GOTO(reader_next(r), out);
        if (r->event.type == YAML_MAPPING_START_EVENT) {
            CHECK_GOTO(read_section(r, section, fn, arg), out);
        } else if (r->event.type == YAML_SCALAR_EVENT && scalar_is_null(&r->event)) {
            continue; /* `section:` with nothing under it */
        } else {
            epd_config_textf(r->err, EPD_ERR_LEN,
                             "%.120s:%lu: section '%.32s' must be a mapping of settings", r->path,
                             line, section);
            return EPD_ERR_CONFIG;
        }
    }
out:
    return status;
}

/* Reads the stream: nothing, or one document whose root is a mapping (or empty). */
static epd_status_t read_stream(yaml_reader_t *r, epd_yaml_setting_fn fn, void *arg)
{
    epd_status_t status;
    CHECK_GOTO(reader_next(r), out); /* stream start */
    CHECK_GOTO(reader_next(r), out);
    if (r->event.type == YAML_STREAM_END_EVENT) return EPD_OK; /* empty file */
    CHECK_GOTO(reader_next(r), out);                           /* past document start */
    if (r->event.type == YAML_MAPPING_START_EVENT) {
        CHECK_GOTO(read_sections(r, fn, arg), out);
    } else if (!(r->event.type == YAML_SCALAR_EVENT && scalar_is_null(&r->event))) {
        epd_config_textf(r->err, EPD_ERR_LEN,
                         "%.120s:%lu: the top level must be a mapping of sections", r->path,
                         event_line(r));
        return EPD_ERR_CONFIG;
    }
    CHECK_GOTO(reader_next(r), out); /* document end */
    CHECK_GOTO(reader_next(r), out);
    if (r->event.type != YAML_STREAM_END_EVENT) {
        epd_config_textf(r->err, EPD_ERR_LEN, "%.120s:%lu: only one YAML document is allowed",
                         r->path, event_line(r));
        return EPD_ERR_CONFIG;
    }
out:
    return status;
}

epd_status_t epd_config_yaml_read(const char *path, epd_yaml_setting_fn fn, void *arg,
                                  char err[EPD_ERR_LEN])
{
    epd_status_t status;
    yaml_reader_t r = {.path = path, .err = err};
    FILE *file = fopen(path, "rb");
    if (file == NULL) {
        epd_config_textf(err, EPD_ERR_LEN, "cannot open config file %.160s: %s", path,
                         strerror(errno));
        return EPD_ERR_CONFIG;
    }
    struct stat st;
    if (fstat(fileno(file), &st) == 0 && S_ISDIR(st.st_mode)) {
        epd_config_textf(err, EPD_ERR_LEN, "cannot read config file %.160s: it is a directory",
                         path);
        fclose(file);
        return EPD_ERR_CONFIG;
    }
    r.seen = calloc(epd_settings_rows(), sizeof r.seen[0]);
    r.seen_line = calloc(epd_settings_rows(), sizeof r.seen_line[0]);
    if (r.seen == NULL || r.seen_line == NULL) {
        epd_config_textf(err, EPD_ERR_LEN, "out of memory reading %.120s", path);
        status = EPD_ERR_NO_MEMORY;
        goto out_free_seen;
    }
    if (!yaml_parser_initialize(&r.parser)) {
        epd_config_textf(err, EPD_ERR_LEN, "cannot initialize the YAML parser for %.120s", path);
        status = EPD_ERR_NO_MEMORY;
        goto out_free_seen;
    }
    yaml_parser_set_input_file(&r.parser, file);
    status = read_stream(&r, fn, arg);
    if (r.has_event) yaml_event_delete(&r.event);
    yaml_parser_delete(&r.parser);
out_free_seen:
    free(r.seen_line);
    free(r.seen);
    fclose(file);
    return status;
}
