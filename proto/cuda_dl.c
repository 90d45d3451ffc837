/* CUDA runtime calls through dlopen (proto/cuda_dl.h). */
#include "proto/cuda_dl.h"

#include <dlfcn.h>
#include <stdio.h>

bool epd_cuda_dl_open(epd_cuda_dl_t *cu, char *err, size_t len)
{
    static const char *const names[] = {"libcudart.so", "libcudart.so.13", "libcudart.so.12",
                                        "/usr/local/cuda/lib64/libcudart.so"};
    void *lib = NULL;

    for (size_t i = 0; lib == NULL && i < sizeof names / sizeof names[0]; i++)
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        snprintf(err, len, "cannot load the CUDA runtime (libcudart.so): %s", dlerror());
        return false;
    }
    cu->lib = lib;
    *(void **)&cu->set_device = dlsym(lib, "cudaSetDevice");
    *(void **)&cu->malloc = dlsym(lib, "cudaMalloc");
    *(void **)&cu->free = dlsym(lib, "cudaFree");
    *(void **)&cu->memcpy = dlsym(lib, "cudaMemcpy");
    *(void **)&cu->ipc_get_mem_handle = dlsym(lib, "cudaIpcGetMemHandle");
    *(void **)&cu->error_string = dlsym(lib, "cudaGetErrorString");
    *(void **)&cu->device_synchronize = dlsym(lib, "cudaDeviceSynchronize");
    if (!cu->set_device || !cu->malloc || !cu->free || !cu->memcpy || !cu->ipc_get_mem_handle ||
        !cu->error_string || !cu->device_synchronize) {
        snprintf(err, len, "the CUDA runtime lacks a call epctl needs");
        dlclose(lib);
        return false;
    }
    return true;
}
