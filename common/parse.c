/* Checked text-to-number conversions (memcached's safe_strtoul, with ranges). */
#include "common/parse.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

epd_status_t epd_parse_u64(const char *str, int base, uint64_t min, uint64_t max, uint64_t *out_p,
                           char err[EPD_ERR_LEN])
{
    if (str == NULL || *str == '\0' || *str == '-' || *str == '+' || *str == ' ') {
        snprintf(err, EPD_ERR_LEN, "'%s' is not an unsigned integer", str ? str : "");
        return EPD_ERR_INVALID_ARG;
    }
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(str, &end, base);
    if (errno != 0 || end == str || *end != '\0') {
        snprintf(err, EPD_ERR_LEN, "'%s' is not an unsigned integer", str);
        return EPD_ERR_INVALID_ARG;
    }
    if (v < min || v > max) {
        snprintf(err, EPD_ERR_LEN, "%s is out of range [%" PRIu64 ", %" PRIu64 "]", str, min, max);
        return EPD_ERR_INVALID_ARG;
    }
    *out_p = (uint64_t)v;
    return EPD_OK;
}

epd_status_t epd_parse_i64(const char *str, int64_t min, int64_t max, int64_t *out_p,
                           char err[EPD_ERR_LEN])
{
    if (str == NULL || *str == '\0' || *str == ' ') {
        snprintf(err, EPD_ERR_LEN, "'%s' is not an integer", str ? str : "");
        return EPD_ERR_INVALID_ARG;
    }
    char *end = NULL;
    errno = 0;
    long long v = strtoll(str, &end, 10);
    if (errno != 0 || end == str || *end != '\0') {
        snprintf(err, EPD_ERR_LEN, "'%s' is not an integer", str);
        return EPD_ERR_INVALID_ARG;
    }
    if (v < min || v > max) {
        snprintf(err, EPD_ERR_LEN, "%s is out of range [%" PRId64 ", %" PRId64 "]", str, min, max);
        return EPD_ERR_INVALID_ARG;
    }
    *out_p = (int64_t)v;
    return EPD_OK;
}

epd_status_t epd_parse_double(const char *str, double min, double max, double *out_p,
                              char err[EPD_ERR_LEN])
{
    if (str == NULL || *str == '\0' || *str == ' ') {
        snprintf(err, EPD_ERR_LEN, "'%s' is not a number", str ? str : "");
        return EPD_ERR_INVALID_ARG;
    }
    char *end = NULL;
    errno = 0;
    double v = strtod(str, &end);
    if (errno != 0 || end == str || *end != '\0' || !isfinite(v)) {
        snprintf(err, EPD_ERR_LEN, "'%s' is not a finite number", str);
        return EPD_ERR_INVALID_ARG;
    }
    if (v < min || v > max) {
        snprintf(err, EPD_ERR_LEN, "%s is out of range [%g, %g]", str, min, max);
        return EPD_ERR_INVALID_ARG;
    }
    *out_p = v;
    return EPD_OK;
}

epd_status_t epd_parse_u32_list(const char *str, uint32_t max, uint32_t *out, size_t cap,
                                size_t *n_p, char err[EPD_ERR_LEN])
{
    char item[32];
    size_t n = 0;
    const char *p = str;

    *n_p = 0;
    if (str == NULL || *str == '\0') return EPD_OK;
    for (;;) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        uint64_t lo, hi;
        if (len == 0 || len >= sizeof item) {
            snprintf(err, EPD_ERR_LEN, "'%.64s' has an empty or overlong item", str);
            return EPD_ERR_INVALID_ARG;
        }
        memcpy(item, p, len);
        item[len] = '\0';
        char *dash = strchr(item, '-');
        if (dash != NULL) *dash = '\0';
        if (epd_parse_u64(item, 10, 0, max, &lo, err) != EPD_OK ||
            (dash != NULL && epd_parse_u64(dash + 1, 10, 0, max, &hi, err) != EPD_OK)) {
            snprintf(err, EPD_ERR_LEN, "'%.64s': '%.31s' is not an integer or range in [0, %u]",
                     str, p, max);
            return EPD_ERR_INVALID_ARG;
        }
        if (dash == NULL) hi = lo;
        if (hi < lo) {
            snprintf(err, EPD_ERR_LEN, "'%.64s': range %.31s runs backwards", str, item);
            return EPD_ERR_INVALID_ARG;
        }
        for (uint64_t v = lo; v <= hi; v++) {
            size_t at = n;
            bool dup = false;
            for (size_t i = 0; i < n; i++) dup = dup || out[i] == v;
            if (dup) continue;
            if (n == cap) {
                snprintf(err, EPD_ERR_LEN, "'%.64s' has more than %zu values", str, cap);
                return EPD_ERR_INVALID_ARG;
            }
            while (at > 0 && out[at - 1] > v) {
                out[at] = out[at - 1];
                at--;
            }
            out[at] = (uint32_t)v;
            n++;
        }
        if (comma == NULL) break;
        p = comma + 1;
    }
    *n_p = n;
    return EPD_OK;
}

epd_status_t epd_parse_bool(const char *str, bool *out_p, char err[EPD_ERR_LEN])
{
    static const char *const yes[] = {"1", "true", "yes", "on"};
    static const char *const no[] = {"0", "false", "no", "off"};
    for (size_t i = 0; str != NULL && i < EPD_ARRAY_SIZE(yes); i++) {
        if (strcasecmp(str, yes[i]) == 0) {
            *out_p = true;
            return EPD_OK;
        }
        if (strcasecmp(str, no[i]) == 0) {
            *out_p = false;
            return EPD_OK;
        }
    }
    snprintf(err, EPD_ERR_LEN, "'%s' is not a boolean (1/0, true/false, yes/no, on/off)",
             str ? str : "");
    return EPD_ERR_INVALID_ARG;
}

epd_status_t epd_parse_host_port(const char *str, char *host, size_t len, uint16_t *port_p,
                                 char err[EPD_ERR_LEN])
{
    const char *colon, *begin = str, *end;
    char why[EPD_ERR_LEN];
    uint64_t port;

    if (str == NULL || *str == '\0') {
        snprintf(err, EPD_ERR_LEN, "'' is not HOST:PORT");
        return EPD_ERR_INVALID_ARG;
    }
    if (*str == '[') { /* [IPv6]:PORT */
        begin = str + 1;
        end = strchr(begin, ']');
        if (end == NULL || end[1] != ':') {
            snprintf(err, EPD_ERR_LEN, "'%.64s' is not [IPV6]:PORT", str);
            return EPD_ERR_INVALID_ARG;
        }
        colon = end + 1;
    } else {
        colon = strrchr(str, ':');
        if (colon == NULL || memchr(str, ':', (size_t)(colon - str)) != NULL) {
            snprintf(err, EPD_ERR_LEN, "'%.64s' is not HOST:PORT (an IPv6 address goes in [])",
                     str);
            return EPD_ERR_INVALID_ARG;
        }
        end = colon;
    }
    if (end == begin || (size_t)(end - begin) >= len) {
        snprintf(err, EPD_ERR_LEN, "'%.64s': the host is %s", str, end == begin ? "empty" : "too long");
        return EPD_ERR_INVALID_ARG;
    }
    for (const char *p = begin; p < end; p++) {
        if (*p <= ' ' || *p == '/' || *p == '[' || *p == ']') {
            snprintf(err, EPD_ERR_LEN, "'%.64s': the host has a '%c'", str, *p > ' ' ? *p : '?');
            return EPD_ERR_INVALID_ARG;
        }
    }
    if (epd_parse_u64(colon + 1, 10, 1, 65535, &port, why) != EPD_OK) {
        snprintf(err, EPD_ERR_LEN, "'%.64s': the port %.160s", str, why);
        return EPD_ERR_INVALID_ARG;
    }
    memcpy(host, begin, (size_t)(end - begin));
    host[end - begin] = '\0';
    *port_p = (uint16_t)port;
    return EPD_OK;
}
