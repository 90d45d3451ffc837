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
