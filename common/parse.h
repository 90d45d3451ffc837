/* Checked conversions from text to numbers and booleans. Every number that comes from a file, a
 * variable or a command line goes through these; none of them log. */
#ifndef EPD_COMMON_PARSE_H
#define EPD_COMMON_PARSE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Whole string must be a base-10 (or 0x hex, or 0-prefixed octal when base is 0) number in
 * [min, max]; on failure returns EPD_ERR_INVALID_ARG and writes a sentence to err. */
epd_status_t epd_parse_u64(const char *str, int base, uint64_t min, uint64_t max, uint64_t *out_p,
                           char err[EPD_ERR_LEN]);
epd_status_t epd_parse_i64(const char *str, int64_t min, int64_t max, int64_t *out_p,
                           char err[EPD_ERR_LEN]);
epd_status_t epd_parse_double(const char *str, double min, double max, double *out_p,
                              char err[EPD_ERR_LEN]);

/* 1/0, true/false, yes/no, on/off in any case. */
epd_status_t epd_parse_bool(const char *str, bool *out_p, char err[EPD_ERR_LEN]);

/* "HOST:PORT" or "[IPV6]:PORT": host copied into host (len bytes, brackets dropped; not
 * resolved), port in [1, 65535]. EPD_ERR_INVALID_ARG with a sentence in err otherwise. */
epd_status_t epd_parse_host_port(const char *str, char *host, size_t len, uint16_t *port_p,
                                 char err[EPD_ERR_LEN]);

#ifdef __cplusplus
}
#endif

#endif
