# gpu/: device operations (gpu/ops.h) and FP8 numerics (gpu/quant.h), host (*.c) and CUDA (*.cu).
GPU_SRCS += gpu/quant_host.c
GPU_CU_SRCS += gpu/quant.cu

UNIT_TESTS += quant
test_quant_SRCS := gpu/quant_host.c

# host device ops (engine helper)
GPU_SRCS += gpu/ops_host.c
UNIT_TESTS += ops_host
test_ops_host_SRCS := gpu/ops_host.c gpu/quant_host.c common/status.c common/parse.c

# FP8 GPU test (exits 77 'SKIP: no GPU' without a device) and the kernel benchmark: CUDA builds only.
# Explicit object paths: obj is defined after the module.mk includes.
ifeq ($(CUDA),1)
GPU_TESTS += test_quant
BINS += $(BUILD)/tests/gpu/test_quant $(BUILD)/kbench
QUANT_GPU_OBJS := $(BUILD)/obj/gpu/quant.cu.o $(BUILD)/obj/gpu/quant_host.o
$(BUILD)/tests/gpu/test_quant: $(BUILD)/obj/tests/gpu/test_quant.cu.o $(QUANT_GPU_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(BASE_CFLAGS) -o $@ $^ $(LDLIBS_ALL) -lstdc++
$(BUILD)/kbench: $(BUILD)/obj/tests/gpu/kbench.cu.o $(QUANT_GPU_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(BASE_CFLAGS) -o $@ $^ $(LDLIBS_ALL) -lstdc++
endif

