/* The few CUDA runtime calls `epctl bench --data cuda` needs, loaded with dlopen so that epctl
 * and libepd never link CUDA: device memory for the batches and its IPC handle for the daemon. */
#ifndef EPD_PROTO_CUDA_DL_H
#define EPD_PROTO_CUDA_DL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct epd_cuda_dl {
    void *lib;
    int (*set_device)(int device);
    int (*malloc)(void **ptr, size_t bytes);
    int (*free)(void *ptr);
    int (*memcpy)(void *dst, const void *src, size_t bytes, int kind); /* 1: to device, 2: to host */
    int (*ipc_get_mem_handle)(void *handle64, void *ptr);
    int (*device_synchronize)(void); /* a pageable cudaMemcpy may return before its DMA lands */
    const char *(*error_string)(int rc);
} epd_cuda_dl_t;

/* Loads libcudart (false with a sentence in err[len] when it is not there). */
bool epd_cuda_dl_open(epd_cuda_dl_t *cu, char *err, size_t len);

#endif
