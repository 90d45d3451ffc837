/* Base64 (proto/base64.h). */
#include "proto/base64.h"

#include <string.h>

static const char alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

void epd_base64_encode(const uint8_t *in, size_t n, char *out)
{
    size_t i = 0;

    for (; i + 3 <= n; i += 3) {
        uint32_t v = (uint32_t)in[i] << 16 | (uint32_t)in[i + 1] << 8 | in[i + 2];
        *out++ = alphabet[v >> 18];
        *out++ = alphabet[(v >> 12) & 63];
        *out++ = alphabet[(v >> 6) & 63];
        *out++ = alphabet[v & 63];
    }
    if (i < n) {
        uint32_t v = (uint32_t)in[i] << 16 | (i + 1 < n ? (uint32_t)in[i + 1] << 8 : 0);
        *out++ = alphabet[v >> 18];
        *out++ = alphabet[(v >> 12) & 63];
        *out++ = i + 1 < n ? alphabet[(v >> 6) & 63] : '=';
        *out++ = '=';
    }
    *out = '\0';
}

static int value_of(char c)
{
    const char *p = c != '\0' ? strchr(alphabet, c) : NULL;
    return p != NULL ? (int)(p - alphabet) : -1;
}

bool epd_base64_decode(const char *text, uint8_t *out, size_t want)
{
    size_t len = strlen(text), got = 0;

    if (len % 4 != 0 || len / 4 * 3 < want || len / 4 * 3 > want + 2) return false;
    for (size_t i = 0; i < len; i += 4) {
        int v[4];
        int pad = 0;
        for (int j = 0; j < 4; j++) {
            if (text[i + j] == '=' && i + 4 == len && j >= 2) {
                v[j] = 0;
                pad++;
                continue;
            }
            if (pad > 0) return false; /* data after padding */
            v[j] = value_of(text[i + j]);
            if (v[j] < 0) return false;
        }
        uint32_t word = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | v[3];
        uint8_t bytes[3] = {(uint8_t)(word >> 16), (uint8_t)(word >> 8), (uint8_t)word};
        for (int j = 0; j < 3 - pad; j++) {
            if (got == want) return false;
            out[got++] = bytes[j];
        }
    }
    return got == want;
}
