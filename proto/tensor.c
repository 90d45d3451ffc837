/* Safetensors-style tensor descriptors of wire protocol v1: dtype names and sizes, and the check
 * of one {"dtype", "shape", "data_offsets"} descriptor against its payload. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "proto/frame.h"

static const struct {
    const char *name;
    size_t size;
} dtypes[EPD_DTYPE_MAX] = {
    [EPD_DTYPE_UNKNOWN] = {"unknown", 0}, [EPD_DTYPE_BOOL] = {"bool", 1},
    [EPD_DTYPE_U8] = {"u8", 1},           [EPD_DTYPE_I8] = {"i8", 1},
    [EPD_DTYPE_F8_E4M3] = {"f8_e4m3", 1}, [EPD_DTYPE_F8_E5M2] = {"f8_e5m2", 1},
    [EPD_DTYPE_U16] = {"u16", 2},         [EPD_DTYPE_I16] = {"i16", 2},
    [EPD_DTYPE_F16] = {"f16", 2},         [EPD_DTYPE_BF16] = {"bf16", 2},
    [EPD_DTYPE_U32] = {"u32", 4},         [EPD_DTYPE_I32] = {"i32", 4},
    [EPD_DTYPE_F32] = {"f32", 4},         [EPD_DTYPE_U64] = {"u64", 8},
    [EPD_DTYPE_I64] = {"i64", 8},         [EPD_DTYPE_F64] = {"f64", 8},
};

epd_dtype_t epd_dtype_from_name(const char *name)
{
    if (name == NULL) return EPD_DTYPE_UNKNOWN;
    /* the names a SUBMIT carries, as every client writes them, without walking the table
     * (a strcmp a name: 30 a SUBMIT); then the others as written; then any case */
    size_t len = strnlen(name, 5);
    if (len == 3) {
        if (strcmp(name, "i32") == 0) return EPD_DTYPE_I32;
        if (strcmp(name, "f32") == 0) return EPD_DTYPE_F32;
        if (strcmp(name, "i64") == 0) return EPD_DTYPE_I64;
    } else if (len == 4 && strcmp(name, "bf16") == 0) {
        return EPD_DTYPE_BF16;
    }
    for (int d = EPD_DTYPE_UNKNOWN + 1; d < EPD_DTYPE_MAX; d++)
        if (strcmp(name, dtypes[d].name) == 0) return (epd_dtype_t)d;
    for (int d = EPD_DTYPE_UNKNOWN + 1; d < EPD_DTYPE_MAX; d++)
        if (strcasecmp(name, dtypes[d].name) == 0) return (epd_dtype_t)d;
    return EPD_DTYPE_UNKNOWN;
}

const char *epd_dtype_name(epd_dtype_t dtype)
{
    if ((unsigned)dtype >= EPD_DTYPE_MAX) return "unknown";
    return dtypes[dtype].name;
}

size_t epd_dtype_size(epd_dtype_t dtype)
{
    if ((unsigned)dtype >= EPD_DTYPE_MAX) return 0;
    return dtypes[dtype].size;
}

bool epd_json_to_u64(const cJSON *item, uint64_t *out_p)
{
    /* cJSON_IsNumber and floor inline: a dozen of these a SUBMIT */
    if (item == NULL || (item->type & 0xff) != cJSON_Number) return false;
    double v = item->valuedouble;
    if (!(v >= 0 && v <= 9007199254740992.0)) return false; /* NaN and inf fail too */
    uint64_t u = (uint64_t)v;
    if ((double)u != v) return false; /* a fraction */
    *out_p = u;
    return true;
}

epd_status_t epd_tensor_parse(const cJSON *desc, const char *name, uint64_t payload_len,
                              epd_tensor_t *tensor_p, char err[EPD_ERR_LEN])
{
    const cJSON *dtype, *shape, *offsets, *dim;
    epd_tensor_t t;
    uint64_t count = 1, bytes, size;
    int n;

    memset(&t, 0, sizeof(t));
    if (!cJSON_IsObject(desc)) {
        snprintf(err, EPD_ERR_LEN, "tensor %.40s: descriptor must be an object", name);
        return EPD_ERR_BAD_TENSOR;
    }
    /* one pass over the keys, the first of each name as cJSON_GetObjectItemCaseSensitive
     * finds it (five lookups walked the keys with a strcmp each: 14 strcmp a descriptor) */
    const cJSON *region = NULL, *offset = NULL;
    dtype = shape = offsets = NULL;
    for (const cJSON *c = desc->child; c != NULL; c = c->next) {
        const char *k = c->string;
        if (k == NULL) continue;
        switch (k[0]) {
        case 'd':
            if (dtype == NULL && strcmp(k, "dtype") == 0)
                dtype = c;
            else if (offsets == NULL && strcmp(k, "data_offsets") == 0)
                offsets = c;
            break;
        case 's':
            if (shape == NULL && strcmp(k, "shape") == 0) shape = c;
            break;
        case 'r':
            if (region == NULL && strcmp(k, "region") == 0) region = c;
            break;
        case 'o':
            if (offset == NULL && strcmp(k, "offset") == 0) offset = c;
            break;
        default:
            break;
        }
    }
    if (!cJSON_IsString(dtype)) {
        snprintf(err, EPD_ERR_LEN, "tensor %.40s: \"dtype\" is missing or not a string", name);
        return EPD_ERR_BAD_TENSOR;
    }
    t.dtype = epd_dtype_from_name(dtype->valuestring);
    if (t.dtype == EPD_DTYPE_UNKNOWN) {
        snprintf(err, EPD_ERR_LEN, "tensor %.40s: unknown dtype \"%.40s\"", name,
                 dtype->valuestring);
        return EPD_ERR_BAD_TENSOR;
    }
    size = epd_dtype_size(t.dtype);
    if (!cJSON_IsArray(shape)) {
        snprintf(err, EPD_ERR_LEN, "tensor %.40s: \"shape\" is missing or not a list", name);
        return EPD_ERR_BAD_TENSOR;
    }
    n = cJSON_GetArraySize(shape);
    if (n > EPD_TENSOR_MAX_DIMS) {
        snprintf(err, EPD_ERR_LEN, "tensor %.40s: %d dimensions, at most %d", name, n,
                 EPD_TENSOR_MAX_DIMS);
        return EPD_ERR_BAD_TENSOR;
    }
    cJSON_ArrayForEach(dim, shape) {
        uint64_t d;
        if (!epd_json_to_u64(dim, &d)) {
            snprintf(err, EPD_ERR_LEN,
                     "tensor %.40s: shape entry %u is not a non-negative integer", name, t.ndim);
            return EPD_ERR_BAD_TENSOR;
        }
        t.shape[t.ndim++] = d;
        /* saturate: any product above 2^64 cannot match a payload anyway */
        if (__builtin_mul_overflow(count, d, &count)) count = UINT64_MAX;
    }
    if (region != NULL) {
        uint64_t id;
        if (offsets != NULL) {
            snprintf(err, EPD_ERR_LEN,
                     "tensor %.40s: names a \"region\" and \"data_offsets\"; one or the other",
                     name);
            return EPD_ERR_BAD_TENSOR;
        }
        if (!epd_json_to_u64(region, &id) || id > UINT32_MAX) {
            snprintf(err, EPD_ERR_LEN, "tensor %.40s: \"region\" must be a region id", name);
            return EPD_ERR_BAD_TENSOR;
        }
        t.begin = 0;
        if (offset != NULL && !epd_json_to_u64(offset, &t.begin)) {
            snprintf(err, EPD_ERR_LEN,
                     "tensor %.40s: \"offset\" must be a non-negative integer", name);
            return EPD_ERR_BAD_TENSOR;
        }
        if (count == UINT64_MAX || __builtin_mul_overflow(count, size, &bytes) ||
            __builtin_add_overflow(t.begin, bytes, &t.end)) {
            snprintf(err, EPD_ERR_LEN, "tensor %.40s: offset + bytes overflows", name);
            return EPD_ERR_BAD_TENSOR;
        }
        t.in_region = true;
        t.region = (uint32_t)id;
        *tensor_p = t;
        return EPD_OK;
    }
    if (!cJSON_IsArray(offsets) || cJSON_GetArraySize(offsets) != 2 ||
        !epd_json_to_u64(cJSON_GetArrayItem(offsets, 0), &t.begin) ||
        !epd_json_to_u64(cJSON_GetArrayItem(offsets, 1), &t.end)) {
        snprintf(err, EPD_ERR_LEN,
                 "tensor %.40s: \"data_offsets\" must be [begin, end] with non-negative integers",
                 name);
        return EPD_ERR_BAD_TENSOR;
    }
    if (t.begin > t.end) {
        snprintf(err, EPD_ERR_LEN, "tensor %.40s: data_offsets begin %" PRIu64 " > end %" PRIu64,
                 name, t.begin, t.end);
        return EPD_ERR_BAD_TENSOR;
    }
    if (t.end > payload_len) {
        snprintf(err, EPD_ERR_LEN,
                 "tensor %.40s: data_offsets end %" PRIu64 " is past the payload (%" PRIu64
                 " bytes)", name, t.end, payload_len);
        return EPD_ERR_BAD_TENSOR;
    }
    if (t.begin % size != 0) {
        snprintf(err, EPD_ERR_LEN,
                 "tensor %.40s: data_offsets begin %" PRIu64
                 " is not aligned to its %zu-byte dtype",
                 name, t.begin, (size_t)size);
        return EPD_ERR_BAD_TENSOR;
    }
    if (__builtin_mul_overflow(count, size, &bytes) || bytes != t.end - t.begin) {
        snprintf(err, EPD_ERR_LEN,
                 "tensor %.40s: shape holds %s bytes of %s but data_offsets span %" PRIu64, name,
                 count == UINT64_MAX ? "too many" : "a different number of",
                 epd_dtype_name(t.dtype), t.end - t.begin);
        if (count != UINT64_MAX && !__builtin_mul_overflow(count, size, &bytes)) {
            snprintf(err, EPD_ERR_LEN,
                     "tensor %.40s: shape holds %" PRIu64 " bytes of %s but data_offsets span %"
                     PRIu64, name, bytes, epd_dtype_name(t.dtype), t.end - t.begin);
        }
        return EPD_ERR_BAD_TENSOR;
    }
    *tensor_p = t;
    return EPD_OK;
}
