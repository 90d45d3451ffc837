# gpu/: device operations (gpu/ops.h) and FP8 numerics (gpu/quant.h), host (*.c) and CUDA (*.cu).
GPU_SRCS += gpu/quant_host.c

UNIT_TESTS += quant
test_quant_SRCS := gpu/quant_host.c
