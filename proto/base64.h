/* Base64 (RFC 4648, standard alphabet, with padding) for the CUDA IPC handles of CONTROL
 * register (DESIGN.md section 4b). */
#ifndef EPD_PROTO_BASE64_H
#define EPD_PROTO_BASE64_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Characters epd_base64_encode writes for n bytes, without the NUL. */
#define EPD_BASE64_LEN(n) ((((n) + 2) / 3) * 4)

/* Writes the encoding of in[n] and a NUL into out (EPD_BASE64_LEN(n) + 1 bytes). */
void epd_base64_encode(const uint8_t *in, size_t n, char *out);

/* Decodes text (padded, no whitespace) into out[cap]; false when it is not base64 or does not
 * decode to exactly `want` bytes. */
bool epd_base64_decode(const char *text, uint8_t *out, size_t want);

#endif
