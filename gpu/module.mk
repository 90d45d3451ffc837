# gpu/: device operations (gpu/ops.h) and FP8 numerics (gpu/quant.h), host (*.c) and CUDA (*.cu).
GPU_SRCS += gpu/quant_host.c

UNIT_TESTS += quant
test_quant_SRCS := gpu/quant_host.c

# host device ops (engine helper)
GPU_SRCS += gpu/ops_host.c
UNIT_TESTS += ops_host
test_ops_host_SRCS := gpu/ops_host.c gpu/quant_host.c common/status.c common/parse.c
