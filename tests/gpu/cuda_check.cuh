/* CUDA_OK(call): the GPU test programs' check of a CUDA runtime call that must not fail (setup,
 * copies): on an error, print where and why and exit 1. */
#ifndef EPD_TESTS_GPU_CUDA_CHECK_CUH
#define EPD_TESTS_GPU_CUDA_CHECK_CUH

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CUDA_OK(call)                                                                         \
    do {                                                                                      \
        cudaError_t rc_ = (call);                                                             \
        if (rc_ != cudaSuccess) {                                                             \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(rc_)); \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

#endif
