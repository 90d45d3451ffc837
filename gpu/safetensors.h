/* Reading safetensors checkpoints (DESIGN.md section 9): one file, or a directory with the
 * model.safetensors.index.json Hugging Face writes beside its shards. Files are mapped (mmap),
 * never read whole: only the pages of the tensors a caller touches are read from disk. Each
 * header is checked in full when its file is opened (offsets inside the file, sizes matching
 * dtype and shape, no overlaps, no duplicate names); every error names the file and the tensor.
 * A leaf module: it never logs, it fills err. */
#ifndef EPD_GPU_SAFETENSORS_H
#define EPD_GPU_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define EPD_ST_MAX_DIMS 8

typedef enum {
    EPD_ST_BF16 = 0,
    EPD_ST_F8_E4M3, /* "F8_E4M3" */
    EPD_ST_F32,
    EPD_ST_F16,
    EPD_ST_OTHER, /* any other dtype the format knows (I64, U8, ...): listed, never served */
} epd_st_dtype_t;

typedef struct epd_st_tensor {
    const char *name;
    epd_st_dtype_t dtype;
    const char *dtype_name; /* as the header spells it, e.g. "BF16" */
    uint32_t n_dims;
    uint64_t shape[EPD_ST_MAX_DIMS];
    const void *data; /* inside the mapping; valid until epd_st_close */
    uint64_t bytes;
    const char *file; /* the file it lives in (a path) */
} epd_st_tensor_t;

typedef struct epd_st_model epd_st_model_t;

/* Opens path: a .safetensors file, or a directory holding model.safetensors.index.json (its
 * shards are opened when a tensor in them is first looked up) or, without an index, one
 * model.safetensors. EPD_ERR_IO (missing or unreadable file), EPD_ERR_BAD_TENSOR (a header or
 * index that is not what the format says), EPD_ERR_NO_MEMORY, with a sentence naming the file
 * (and tensor) in err. Free with epd_st_close. */
epd_status_t epd_st_open(const char *path, epd_st_model_t **model_p, char err[EPD_ERR_LEN]);
void epd_st_close(epd_st_model_t *model);

/* Every tensor name the checkpoint has (the index's names for a directory), in no particular
 * order; *n_p gets their count. Owned by the model. */
const char *const *epd_st_names(const epd_st_model_t *model, size_t *n_p);

/* Whether the checkpoint has a tensor of that name (no file is opened). */
int epd_st_has(const epd_st_model_t *model, const char *name);

/* Looks a tensor up, opening (and checking) its shard if it is not open yet. EPD_OK with
 * *tensor_p (owned by the model), EPD_ERR_BAD_TENSOR when there is no such tensor (err names it
 * and the checkpoint), or the shard's error when it cannot be opened. */
epd_status_t epd_st_get(epd_st_model_t *model, const char *name, const epd_st_tensor_t **tensor_p,
                        char err[EPD_ERR_LEN]);

/* Bytes of the files the model mapped so far (the shards opened). */
uint64_t epd_st_mapped_bytes(const epd_st_model_t *model);

/* Bytes of one element of dtype; 0 for EPD_ST_OTHER. */
size_t epd_st_dtype_size(epd_st_dtype_t dtype);

#endif
