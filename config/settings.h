/* The settings table's row type and the helpers the config sources share: one row per setting
 * (name, env, type, default, range, doc, offset into epd_config_t), alias rows for legacy
 * variables, and the per-type parse/format/describe functions that YAML, env, --set and printing
 * all go through. Private to config/: the rest of epd reads epd_config_t. */
#ifndef EPD_CONFIG_SETTINGS_H
#define EPD_CONFIG_SETTINGS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "config/config.h"

typedef enum {
    EPD_SETTING_STRING = 0, /* char[EPD_CONFIG_STR_LEN], non-empty unless may_be_empty */
    EPD_SETTING_MODE,       /* uint32_t file mode, written in octal */
    EPD_SETTING_U32,        /* uint32_t in [min, max] */
    EPD_SETTING_U64,        /* uint64_t in [min, max] */
    EPD_SETTING_I32,        /* int32_t in [min, max] */
    EPD_SETTING_ENUM,       /* a C enum (int), by name from choices */
    EPD_SETTING_UIDS,       /* uint32_t[EPD_CONFIG_MAX_UIDS] plus a uint32_t count */
    EPD_SETTING_ALIAS_BOOL, /* legacy variable: a boolean mapped onto a value of its target */
} epd_setting_type_t;

typedef struct epd_setting {
    const char *name;  /* dotted name; an alias row's name is its legacy variable */
    const char *env;   /* EPD_<SECTION>_<KEY>; for an alias row, the legacy variable */
    epd_setting_type_t type;
    const char *def;   /* default, as text; parsed like any other value */
    int64_t min, max;  /* numeric types */
    uint32_t multiple_of;       /* numeric types: 0 = no constraint */
    const char *const *choices; /* ENUM: names indexed by enum value, NULL-terminated */
    bool bool_choices;          /* ENUM: any epd_parse_bool spelling selects "true"/"false" */
    /* STRING: extra check of the value; fills problem and returns false when it is rejected */
    bool (*check)(const char *text, char problem[EPD_ERR_LEN]);
    bool may_be_empty; /* STRING: "" is a value (it means "not set") */
    const char *doc;
    size_t offset;       /* of the value in epd_config_t */
    size_t count_offset; /* UIDS: of the count in epd_config_t */
    /* ALIAS_BOOL rows */
    const char *target;   /* dotted name of the setting the alias sets */
    const char *if_true;  /* value of the target when the variable is true */
    const char *if_false; /* ... and when it is false */
    const char *note;     /* deprecation note */
} epd_setting_t;

/* snprintf for messages, where cutting a long message short is intended (the compiler's
 * truncation warning does not apply). Returns what snprintf returns, or 0 on an encoding error. */
size_t epd_config_textf(char *buf, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The table: every setting, then the alias rows, then a sentinel whose name is NULL. */
extern const epd_setting_t epd_settings[];

/* Number of rows before the sentinel (settings and aliases). */
size_t epd_settings_rows(void);

/* The row of a dotted setting name (not an alias), or NULL. */
const epd_setting_t *epd_setting_by_name(const char *name);

/* The row whose env variable is name (a setting or an alias), or NULL. */
const epd_setting_t *epd_setting_by_env(const char *name);

/* The row whose env variable is the first len bytes of name, or NULL. */
const epd_setting_t *epd_setting_by_env_n(const char *name, size_t len);

/* True when some setting's dotted name starts with "<section>.". */
bool epd_setting_section_known(const char *section);

/* Writes the known section names ("socket, model, ...") into buf. */
void epd_setting_sections(char *buf, size_t len);

/* Writes the keys of one section ("path, mode, ...") into buf. */
void epd_setting_section_keys(const char *section, char *buf, size_t len);

/* Parses text as a value of row into cfg; cfg is untouched on failure, and problem says what is
 * wrong with the value (without the key or origin). Not for alias rows. */
bool epd_setting_parse(const epd_setting_t *row, const char *text, epd_config_t *cfg,
                       char problem[EPD_ERR_LEN]);

/* Writes the value of row in cfg as text (the form --print-config shows). snprintf contract. */
size_t epd_setting_format(const epd_setting_t *row, const epd_config_t *cfg, char *buf, size_t len);

/* Writes what row accepts ("one of fp8|bf16", "an integer in [1, 4096]") into buf. */
void epd_setting_allowed(const epd_setting_t *row, char *buf, size_t len);

/* Short type name for --help: "string", "mode", "u32", "enum", ... */
const char *epd_setting_type_name(epd_setting_type_t type);

/* The setting (by_env false: dotted name; true: env variable) closest to a misspelled name, or
 * NULL when none is close enough to suggest. Alias rows count for env names. */
const epd_setting_t *epd_setting_closest(const char *name, bool by_env);

/* Called for each setting a YAML file sets: text is its value (a list's items joined with
 * commas), NULL for an empty value; line is 1-based. A non-OK return stops the reading, and err
 * is passed on as it is. */
typedef epd_status_t (*epd_yaml_setting_fn)(void *arg, const epd_setting_t *row, const char *text,
                                            unsigned long line, char err[EPD_ERR_LEN]);

/* Reads a YAML config file of nested sections (`socket: {path: ...}`) and calls fn for each
 * setting in file order. Unknown sections or keys, values of the wrong shape, YAML aliases, more
 * than one document, duplicate keys and syntax errors are EPD_ERR_CONFIG with "FILE:LINE: ..." in
 * err; a file that cannot be opened is EPD_ERR_CONFIG naming it. */
epd_status_t epd_config_yaml_read(const char *path, epd_yaml_setting_fn fn, void *arg,
                                  char err[EPD_ERR_LEN]);

#endif
