/* Every way a configuration leaves the config module as text: --print-config lines with origins,
 * the --help table, a JSON object (for the `config` control reply) and the canonical fingerprint
 * that ranks compare. All of them walk the settings table in order. */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "config/settings.h"

void epd_config_print(const epd_config_state_t *state, FILE *out)
{
    const epd_config_t *cfg = epd_config_get(state);
    for (const epd_setting_t *row = epd_settings; row->name != NULL; row++) {
        if (row->type == EPD_SETTING_ALIAS_BOOL) continue;
        char value[EPD_CONFIG_STR_LEN + 16], origin[EPD_CONFIG_STR_LEN + 32];
        epd_setting_format(row, cfg, value, sizeof value);
        epd_origin_format(epd_config_origin(state, row->name), origin, sizeof origin);
        fprintf(out, "%s = %s  # %s\n", row->name, value, origin);
    }
}

void epd_config_print_help(FILE *out)
{
    fprintf(out, "Settings: YAML `section: {key: value}` (--config FILE), environment variable, or "
                 "--set section.key=value.\n"
                 "Precedence: --set > EPD_* variable > legacy variable > file > default.\n\n");
    for (const epd_setting_t *row = epd_settings; row->name != NULL; row++) {
        if (row->type == EPD_SETTING_ALIAS_BOOL) continue;
        char allowed[EPD_ERR_LEN];
        epd_setting_allowed(row, allowed, sizeof allowed);
        fprintf(out, "  %-32s %-8s default %s\n", row->name, epd_setting_type_name(row->type),
                row->def[0] ? row->def : "(empty)");
        fprintf(out, "      %s\n", row->doc);
        fprintf(out, "      env %s; %s\n", row->env, allowed);
    }
    fprintf(out, "\nDeprecated environment variables (a warning names the replacement):\n");
    for (const epd_setting_t *row = epd_settings; row->name != NULL; row++) {
        if (row->type != EPD_SETTING_ALIAS_BOOL) continue;
        fprintf(out, "  %s\n      sets %s: true -> %s, false -> %s; %s\n", row->env, row->target,
                row->if_true, row->if_false, row->note);
    }
}

/* snprintf-style appender: counts everything, writes what fits, keeps buf NUL-terminated. */
typedef struct text_out {
    char *buf;
    size_t len;
    size_t used;
} text_out_t;

static void out_printf(text_out_t *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void out_printf(text_out_t *t, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(t->used < t->len ? t->buf + t->used : NULL,
                      t->used < t->len ? t->len - t->used : 0, fmt, ap);
    va_end(ap);
    if (n > 0) t->used += (size_t)n;
}

/* A JSON string literal of s, escaped. */
static void out_json_string(text_out_t *t, const char *s)
{
    out_printf(t, "\"");
    for (const unsigned char *p = (const unsigned char *)s; *p != '\0'; p++) {
        switch (*p) {
        case '"': out_printf(t, "\\\""); break;
        case '\\': out_printf(t, "\\\\"); break;
        case '\n': out_printf(t, "\\n"); break;
        case '\r': out_printf(t, "\\r"); break;
        case '\t': out_printf(t, "\\t"); break;
        default:
            if (*p < 0x20) {
                out_printf(t, "\\u%04x", *p);
            } else {
                out_printf(t, "%c", *p);
            }
        }
    }
    out_printf(t, "\"");
}

size_t epd_config_to_json(const epd_config_t *cfg, char *buf, size_t len)
{
    text_out_t t = {.buf = buf, .len = len};
    if (len > 0) buf[0] = '\0';
    out_printf(&t, "{");
    bool first = true;
    for (const epd_setting_t *row = epd_settings; row->name != NULL; row++) {
        if (row->type == EPD_SETTING_ALIAS_BOOL) continue;
        char value[EPD_CONFIG_STR_LEN + 16];
        epd_setting_format(row, cfg, value, sizeof value);
        out_printf(&t, "%s\"%s\": ", first ? "" : ", ", row->name);
        first = false;
        switch (row->type) {
        case EPD_SETTING_U32:
        case EPD_SETTING_U64:
        case EPD_SETTING_I32: out_printf(&t, "%s", value); break;
        case EPD_SETTING_UIDS: out_printf(&t, "[%s]", value); break;
        default: out_json_string(&t, value); break; /* strings, enums, the octal mode */
        }
    }
    out_printf(&t, "}");
    return t.used;
}

size_t epd_config_fingerprint(const epd_config_t *cfg, char *buf, size_t len)
{
    text_out_t t = {.buf = buf, .len = len};
    if (len > 0) buf[0] = '\0';
    for (const epd_setting_t *row = epd_settings; row->name != NULL; row++) {
        if (row->type == EPD_SETTING_ALIAS_BOOL) continue;
        char value[EPD_CONFIG_STR_LEN + 16];
        epd_setting_format(row, cfg, value, sizeof value);
        out_printf(&t, "%s=%s\n", row->name, value);
    }
    return t.used;
}
