/* safetensors reading: the index of a sharded checkpoint, each shard's header checked in full
 * when it is mapped, and a hash of tensor names. See gpu/safetensors.h. */
#include "gpu/safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* snprintf into err; messages are cut at EPD_ERR_LEN on purpose (paths can be long). */
__attribute__((format(printf, 2, 3))) static void errf(char err[EPD_ERR_LEN], const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, EPD_ERR_LEN, fmt, ap);
    va_end(ap);
}

#define INDEX_NAME "model.safetensors.index.json"
#define SINGLE_NAME "model.safetensors"
/* A header larger than this is not a checkpoint's (DeepSeek-V3's largest shard header is ~100 kB);
 * refusing it keeps a lying length from allocating gigabytes. */
#define MAX_HEADER_BYTES (64u << 20)
#define MAX_INDEX_BYTES (256u << 20)

typedef struct st_file {
    char *path;
    bool opened;
    bool bad; /* opened, and its header failed a check: none of its tensors is served */
    void *map;
    size_t map_bytes;
    const uint8_t *data; /* the byte buffer after the header */
    uint64_t data_bytes;
    epd_st_tensor_t *tensors;
    size_t n_tensors;
} st_file_t;

typedef struct st_entry {
    char *name;
    size_t file;              /* index into files */
    const epd_st_tensor_t *t; /* NULL until its file is opened */
} st_entry_t;

struct epd_st_model {
    char *path; /* as given, for messages */
    st_file_t *files;
    size_t n_files;
    st_entry_t *entries;
    size_t n_entries, cap_entries;
    size_t *hash; /* open addressing: entry index + 1, 0 = empty */
    size_t hash_cap;
    const char **names;
    uint64_t mapped;
};

static uint64_t hash_name(const char *s)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

static st_entry_t *lookup(const epd_st_model_t *m, const char *name)
{
    if (m->hash_cap == 0) return NULL;
    for (size_t i = hash_name(name) & (m->hash_cap - 1);; i = (i + 1) & (m->hash_cap - 1)) {
        if (m->hash[i] == 0) return NULL;
        st_entry_t *e = &m->entries[m->hash[i] - 1];
        if (strcmp(e->name, name) == 0) return e;
    }
}

static epd_status_t rehash(epd_st_model_t *m, size_t cap)
{
    size_t *h = calloc(cap, sizeof *h);

    if (h == NULL) return EPD_ERR_NO_MEMORY;
    for (size_t j = 0; j < m->n_entries; j++) {
        size_t i = hash_name(m->entries[j].name) & (cap - 1);
        while (h[i] != 0) i = (i + 1) & (cap - 1);
        h[i] = j + 1;
    }
    free(m->hash);
    m->hash = h;
    m->hash_cap = cap;
    return EPD_OK;
}

/* Adds name (copied) in file; EPD_ERR_BAD_TENSOR when the name is already there. */
static epd_status_t add_entry(epd_st_model_t *m, const char *name, size_t file,
                              const char *where, char err[EPD_ERR_LEN])
{
    if (lookup(m, name) != NULL) {
        errf(err, "%.120s: tensor %.100s is named twice", where, name);
        return EPD_ERR_BAD_TENSOR;
    }
    if (m->n_entries == m->cap_entries) {
        size_t cap = m->cap_entries ? 2 * m->cap_entries : 256;
        st_entry_t *e = realloc(m->entries, cap * sizeof *e);
        if (e == NULL) goto no_memory;
        m->entries = e;
        m->cap_entries = cap;
    }
    st_entry_t *e = &m->entries[m->n_entries];
    e->name = strdup(name);
    if (e->name == NULL) goto no_memory;
    e->file = file;
    e->t = NULL;
    m->n_entries++;
    if (2 * m->n_entries > m->hash_cap) {
        if (rehash(m, m->hash_cap ? 2 * m->hash_cap : 1024) != EPD_OK) goto no_memory;
    } else {
        size_t i = hash_name(name) & (m->hash_cap - 1);
        while (m->hash[i] != 0) i = (i + 1) & (m->hash_cap - 1);
        m->hash[i] = m->n_entries;
    }
    return EPD_OK;

no_memory:
    errf(err, "%.120s: out of memory listing its tensors", where);
    return EPD_ERR_NO_MEMORY;
}

size_t epd_st_dtype_size(epd_st_dtype_t dtype)
{
    switch (dtype) {
    case EPD_ST_BF16: return 2;
    case EPD_ST_F16: return 2;
    case EPD_ST_F8_E4M3: return 1;
    case EPD_ST_F32: return 4;
    default: return 0;
    }
}

/* The dtypes of the safetensors format, with their element sizes. */
static const struct {
    const char *name;
    epd_st_dtype_t dtype;
    size_t size;
} dtypes[] = {
    {"BF16", EPD_ST_BF16, 2},     {"F8_E4M3", EPD_ST_F8_E4M3, 1}, {"F32", EPD_ST_F32, 4},
    {"F16", EPD_ST_F16, 2},       {"F64", EPD_ST_OTHER, 8},       {"F8_E5M2", EPD_ST_OTHER, 1},
    {"I64", EPD_ST_OTHER, 8},     {"I32", EPD_ST_OTHER, 4},       {"I16", EPD_ST_OTHER, 2},
    {"I8", EPD_ST_OTHER, 1},      {"U64", EPD_ST_OTHER, 8},       {"U32", EPD_ST_OTHER, 4},
    {"U16", EPD_ST_OTHER, 2},     {"U8", EPD_ST_OTHER, 1},        {"BOOL", EPD_ST_OTHER, 1},
};

static bool json_u64(const cJSON *v, uint64_t *out)
{
    if (!cJSON_IsNumber(v)) return false;
    double d = v->valuedouble;
    /* exact integers only: doubles hold every integer up to 2^53 */
    if (!(d >= 0) || d > 9007199254740992.0 || d != (double)(uint64_t)d) return false;
    *out = (uint64_t)d;
    return true;
}

static int cmp_begin(const void *a, const void *b)
{
    const epd_st_tensor_t *x = *(const epd_st_tensor_t *const *)a;
    const epd_st_tensor_t *y = *(const epd_st_tensor_t *const *)b;
    return x->data < y->data ? -1 : x->data > y->data;
}

/* Parses one entry of a header into t; a sentence in problem when it is not valid. */
static bool parse_tensor(const cJSON *item, const st_file_t *f, epd_st_tensor_t *t,
                         char *problem, size_t len)
{
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(item, "dtype");
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(item, "shape");
    const cJSON *offs = cJSON_GetObjectItemCaseSensitive(item, "data_offsets");
    uint64_t begin, end, numel = 1;
    size_t esize = 0;

    if (!cJSON_IsObject(item) || !cJSON_IsString(dt) || !cJSON_IsArray(shape) ||
        !cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2) {
        snprintf(problem, len, "needs dtype (string), shape (array) and data_offsets [begin, end]");
        return false;
    }
    for (size_t i = 0; i < EPD_ARRAY_SIZE(dtypes); i++) {
        if (strcmp(dtypes[i].name, dt->valuestring) == 0) {
            t->dtype = dtypes[i].dtype;
            t->dtype_name = dtypes[i].name;
            esize = dtypes[i].size;
        }
    }
    if (esize == 0) {
        snprintf(problem, len, "dtype \"%.32s\" is not a safetensors dtype", dt->valuestring);
        return false;
    }
    if (cJSON_GetArraySize(shape) > EPD_ST_MAX_DIMS) {
        snprintf(problem, len, "has more than %d dimensions", EPD_ST_MAX_DIMS);
        return false;
    }
    t->n_dims = 0;
    for (const cJSON *d = shape->child; d != NULL; d = d->next) {
        uint64_t v;
        if (!json_u64(d, &v)) {
            snprintf(problem, len, "shape has an entry that is not a non-negative integer");
            return false;
        }
        t->shape[t->n_dims++] = v;
        if (v != 0 && numel > UINT64_MAX / v) {
            snprintf(problem, len, "shape's element count overflows");
            return false;
        }
        numel *= v;
    }
    if (!json_u64(offs->child, &begin) || !json_u64(offs->child->next, &end) || end < begin) {
        snprintf(problem, len, "data_offsets are not integers 0 <= begin <= end");
        return false;
    }
    if (end > f->data_bytes) {
        snprintf(problem, len,
                 "data_offsets [%llu, %llu] run past the %llu data bytes of the file "
                 "(truncated, or the header lies)",
                 (unsigned long long)begin, (unsigned long long)end,
                 (unsigned long long)f->data_bytes);
        return false;
    }
    if (numel > UINT64_MAX / esize || end - begin != numel * esize) {
        snprintf(problem, len,
                 "data_offsets [%llu, %llu] hold %llu bytes, but dtype %s and its shape need %llu",
                 (unsigned long long)begin, (unsigned long long)end,
                 (unsigned long long)(end - begin), t->dtype_name,
                 (unsigned long long)(numel * esize));
        return false;
    }
    t->data = f->data + begin;
    t->bytes = end - begin;
    t->file = f->path;
    return true;
}

/* Maps file fi and checks its header; in a sharded checkpoint every tensor of the shard must be
 * the index's (in this file) and every name the index puts here must be in the header. */
static epd_status_t open_file(epd_st_model_t *m, size_t fi, bool indexed, const char *for_tensor,
                              char err[EPD_ERR_LEN])
{
    st_file_t *f = &m->files[fi];
    struct stat st;
    uint8_t len_bytes[8];
    uint64_t header_len = 0;
    cJSON *root = NULL;
    epd_status_t status = EPD_ERR_BAD_TENSOR;
    int fd;
    char problem[160];

    fd = open(f->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (indexed)
            errf(err, "%.120s: missing shard (the index puts %.80s in it): %s",
                     f->path, for_tensor ? for_tensor : "tensors", strerror(errno));
        else
            errf(err, "%.200s: %s", f->path, strerror(errno));
        return EPD_ERR_IO;
    }
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        errf(err, "%.200s: not a regular file", f->path);
        close(fd);
        return EPD_ERR_IO;
    }
    if (st.st_size < 8 || pread(fd, len_bytes, 8, 0) != 8) {
        errf(err, "%.200s: truncated (%lld bytes: no 8-byte header length)",
                 f->path, (long long)st.st_size);
        close(fd);
        return EPD_ERR_BAD_TENSOR;
    }
    for (int i = 7; i >= 0; i--) header_len = header_len << 8 | len_bytes[i];
    if (header_len < 2 || header_len > MAX_HEADER_BYTES ||
        header_len > (uint64_t)st.st_size - 8) {
        errf(err,
                 "%.160s: header length %llu does not fit the file's %lld bytes (truncated, or "
                 "not safetensors)",
                 f->path, (unsigned long long)header_len, (long long)st.st_size);
        close(fd);
        return EPD_ERR_BAD_TENSOR;
    }
    f->map_bytes = (size_t)st.st_size;
    f->map = mmap(NULL, f->map_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (f->map == MAP_FAILED) {
        f->map = NULL;
        errf(err, "%.200s: mmap failed: %s", f->path, strerror(errno));
        return EPD_ERR_IO;
    }
    f->opened = true;
    m->mapped += f->map_bytes;
    f->data = (const uint8_t *)f->map + 8 + header_len;
    f->data_bytes = (uint64_t)st.st_size - 8 - header_len;

    root = cJSON_ParseWithLength((const char *)f->map + 8, (size_t)header_len);
    if (root == NULL || !cJSON_IsObject(root)) {
        errf(err, "%.200s: the header is not a JSON object", f->path);
        goto out;
    }
    size_t n = 0;
    for (const cJSON *it = root->child; it != NULL; it = it->next)
        if (strcmp(it->string, "__metadata__") != 0) n++;
    f->tensors = calloc(n ? n : 1, sizeof *f->tensors);
    epd_st_tensor_t **order = calloc(n ? n : 1, sizeof *order);
    if (f->tensors == NULL || order == NULL) {
        free(order);
        errf(err, "%.200s: out of memory reading its header", f->path);
        status = EPD_ERR_NO_MEMORY;
        goto out;
    }
    for (const cJSON *it = root->child; it != NULL; it = it->next) {
        if (strcmp(it->string, "__metadata__") == 0) continue;
        epd_st_tensor_t *t = &f->tensors[f->n_tensors];
        if (!parse_tensor(it, f, t, problem, sizeof problem)) {
            errf(err, "%.100s: tensor %.80s: %s", f->path, it->string, problem);
            free(order);
            goto out;
        }
        st_entry_t *e = lookup(m, it->string);
        if (indexed) {
            if (e == NULL) continue; /* a tensor the index does not list: not served */
            if (e->file != fi) {
                errf(err,
                         "%.100s: tensor %.80s is also here, but the index puts it in %.60s "
                         "(a duplicate name)",
                         f->path, it->string, m->files[e->file].path);
                free(order);
                goto out;
            }
        } else {
            if (e != NULL) {
                errf(err, "%.120s: tensor %.100s is named twice", f->path,
                         it->string);
                free(order);
                goto out;
            }
            status = add_entry(m, it->string, fi, f->path, err);
            if (status != EPD_OK) {
                free(order);
                goto out;
            }
            status = EPD_ERR_BAD_TENSOR;
            e = &m->entries[m->n_entries - 1];
        }
        if (e->t != NULL) {
            errf(err, "%.120s: tensor %.100s is named twice", f->path,
                     it->string);
            free(order);
            goto out;
        }
        t->name = e->name;
        e->t = t;
        order[f->n_tensors++] = t;
    }
    /* no two tensors share bytes */
    qsort(order, f->n_tensors, sizeof *order, cmp_begin);
    for (size_t i = 1; i < f->n_tensors; i++) {
        const epd_st_tensor_t *a = order[i - 1], *b = order[i];
        if ((const uint8_t *)a->data + a->bytes > (const uint8_t *)b->data) {
            errf(err, "%.100s: tensors %.70s and %.70s overlap in the file",
                     f->path, a->name, b->name);
            free(order);
            goto out;
        }
    }
    free(order);
    if (indexed) {
        for (size_t j = 0; j < m->n_entries; j++) {
            if (m->entries[j].file == fi && m->entries[j].t == NULL) {
                errf(err,
                         "%.100s: the index puts tensor %.100s in this shard, but its header does "
                         "not have it",
                         f->path, m->entries[j].name);
                goto out;
            }
        }
    }
    status = EPD_OK;
out:
    if (status != EPD_OK) f->bad = true;
    cJSON_Delete(root);
    return status;
}

static char *path_join(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p != NULL) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static epd_status_t add_file(epd_st_model_t *m, char *path, size_t *fi_p)
{
    st_file_t *f = realloc(m->files, (m->n_files + 1) * sizeof *f);

    if (f == NULL || path == NULL) {
        free(f == NULL ? path : NULL);
        if (f != NULL) m->files = f;
        return EPD_ERR_NO_MEMORY;
    }
    m->files = f;
    memset(&f[m->n_files], 0, sizeof *f);
    f[m->n_files].path = path;
    *fi_p = m->n_files++;
    return EPD_OK;
}

/* Reads the index (a small JSON file, read whole) and lists its names and shards. */
static epd_status_t read_index(epd_st_model_t *m, const char *dir, const char *index_path,
                               char err[EPD_ERR_LEN])
{
    FILE *fp = fopen(index_path, "rb");
    char *text = NULL;
    long size;
    cJSON *root = NULL;
    epd_status_t status = EPD_ERR_BAD_TENSOR;

    if (fp == NULL) {
        errf(err, "%.200s: %s", index_path, strerror(errno));
        return EPD_ERR_IO;
    }
    if (fseek(fp, 0, SEEK_END) != 0 || (size = ftell(fp)) < 0 || size > (long)MAX_INDEX_BYTES ||
        fseek(fp, 0, SEEK_SET) != 0) {
        errf(err, "%.200s: unreadable or larger than %u bytes", index_path,
                 MAX_INDEX_BYTES);
        fclose(fp);
        return EPD_ERR_IO;
    }
    text = malloc((size_t)size + 1);
    if (text == NULL || fread(text, 1, (size_t)size, fp) != (size_t)size) {
        errf(err, "%.200s: cannot read it", index_path);
        status = text == NULL ? EPD_ERR_NO_MEMORY : EPD_ERR_IO;
        goto out;
    }
    root = cJSON_ParseWithLength(text, (size_t)size);
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(map)) {
        errf(err, "%.200s: no \"weight_map\" object", index_path);
        goto out;
    }
    for (const cJSON *it = map->child; it != NULL; it = it->next) {
        const char *shard = cJSON_IsString(it) ? it->valuestring : NULL;
        size_t fi = SIZE_MAX;
        if (shard == NULL || shard[0] == '\0' || strchr(shard, '/') != NULL ||
            strcmp(shard, "..") == 0 || strcmp(shard, ".") == 0) {
            errf(err,
                     "%.120s: tensor %.80s: its shard must be a file name in the directory",
                     index_path, it->string);
            goto out;
        }
        for (size_t i = 0; i < m->n_files; i++) {
            const char *base = strrchr(m->files[i].path, '/') + 1;
            if (strcmp(base, shard) == 0) fi = i;
        }
        if (fi == SIZE_MAX && add_file(m, path_join(dir, shard), &fi) != EPD_OK) {
            errf(err, "%.200s: out of memory", index_path);
            status = EPD_ERR_NO_MEMORY;
            goto out;
        }
        status = add_entry(m, it->string, fi, index_path, err);
        if (status != EPD_OK) goto out;
        status = EPD_ERR_BAD_TENSOR;
    }
    status = EPD_OK;
out:
    cJSON_Delete(root);
    free(text);
    fclose(fp);
    return status;
}

epd_status_t epd_st_open(const char *path, epd_st_model_t **model_p, char err[EPD_ERR_LEN])
{
    epd_st_model_t *m;
    struct stat st;
    epd_status_t status;
    size_t fi;

    *model_p = NULL;
    if (path == NULL || path[0] == '\0') {
        errf(err, "no safetensors path");
        return EPD_ERR_INVALID_ARG;
    }
    if (stat(path, &st) != 0) {
        errf(err, "%.200s: %s", path, strerror(errno));
        return EPD_ERR_IO;
    }
    m = calloc(1, sizeof *m);
    if (m == NULL || (m->path = strdup(path)) == NULL) goto no_memory;
    if (S_ISDIR(st.st_mode)) {
        char *index = path_join(path, INDEX_NAME);
        if (index == NULL) goto no_memory;
        if (access(index, F_OK) == 0) {
            status = read_index(m, path, index, err);
            free(index);
            if (status != EPD_OK) goto fail;
        } else {
            free(index);
            char *single = path_join(path, SINGLE_NAME);
            if (access(single, F_OK) != 0) {
                errf(err, "%.180s: has neither %s nor %s", path, INDEX_NAME,
                         SINGLE_NAME);
                free(single);
                status = EPD_ERR_IO;
                goto fail;
            }
            if (add_file(m, single, &fi) != EPD_OK) goto no_memory;
            CHECK_GOTO(open_file(m, fi, false, NULL, err), fail);
        }
    } else {
        char *copy = strdup(path);
        if (copy == NULL || add_file(m, copy, &fi) != EPD_OK) goto no_memory;
        CHECK_GOTO(open_file(m, fi, false, NULL, err), fail);
    }
    m->names = calloc(m->n_entries ? m->n_entries : 1, sizeof *m->names);
    if (m->names == NULL) goto no_memory;
    for (size_t i = 0; i < m->n_entries; i++) m->names[i] = m->entries[i].name;
    *model_p = m;
    return EPD_OK;

no_memory:
    errf(err, "%.200s: out of memory", path);
    status = EPD_ERR_NO_MEMORY;
fail:
    epd_st_close(m);
    return status;
}

void epd_st_close(epd_st_model_t *m)
{
    if (m == NULL) return;
    for (size_t i = 0; i < m->n_files; i++) {
        if (m->files[i].map != NULL) munmap(m->files[i].map, m->files[i].map_bytes);
        free(m->files[i].tensors);
        free(m->files[i].path);
    }
    for (size_t i = 0; i < m->n_entries; i++) free(m->entries[i].name);
    free(m->files);
    free(m->entries);
    free(m->hash);
    free(m->names);
    free(m->path);
    free(m);
}

const char *const *epd_st_names(const epd_st_model_t *m, size_t *n_p)
{
    *n_p = m->n_entries;
    return m->names;
}

int epd_st_has(const epd_st_model_t *m, const char *name)
{
    return lookup(m, name) != NULL;
}

epd_status_t epd_st_get(epd_st_model_t *m, const char *name, const epd_st_tensor_t **tensor_p,
                        char err[EPD_ERR_LEN])
{
    st_entry_t *e = lookup(m, name);
    epd_status_t status;

    if (e == NULL) {
        errf(err, "%.120s: no tensor %.120s", m->path, name);
        return EPD_ERR_BAD_TENSOR;
    }
    if (!m->files[e->file].opened) {
        status = open_file(m, e->file, true, name, err);
        if (status != EPD_OK) return status;
    } else if (m->files[e->file].bad || e->t == NULL) {
        /* the shard was opened before and failed its checks */
        errf(err, "%.120s: tensor %.100s: its shard did not open",
                 m->files[e->file].path, name);
        return EPD_ERR_BAD_TENSOR;
    }
    *tensor_p = e->t;
    return EPD_OK;
}

uint64_t epd_st_mapped_bytes(const epd_st_model_t *m)
{
    return m->mapped;
}
