# gpu/: device operations (gpu/ops.h) and FP8 numerics (gpu/quant.h), host (*.c) and CUDA (*.cu).
GPU_SRCS += gpu/quant_host.c
GPU_CU_SRCS += gpu/quant.cu

UNIT_TESTS += quant
test_quant_SRCS := gpu/quant_host.c

# host device ops (engine helper)
GPU_SRCS += gpu/ops_host.c
# external experts' rows and partials (gpu/external.h), host and CUDA
GPU_SRCS += gpu/external_host.c
GPU_CU_SRCS += gpu/external_cuda.cu
# ffn experts: safetensors loading (mmap) and the host arithmetic; test_ffn covers both, and the
# host ffn experts op against an fp64 computation.
GPU_SRCS += gpu/ffn.c gpu/safetensors.c
UNIT_TESTS += ffn
test_ffn_SRCS := gpu/ffn.c gpu/safetensors.c gpu/ops_host.c gpu/quant_host.c common/status.c \
                 common/parse.c
UNIT_TESTS += ops_host
test_ops_host_SRCS := gpu/ops_host.c gpu/quant_host.c gpu/ffn.c gpu/safetensors.c common/status.c \
                      common/parse.c

# FP8 GPU test (exits 77 'SKIP: no GPU' without a device) and the kernel benchmark: CUDA builds only.
ifeq ($(CUDA),1)
GPU_TESTS += test_quant
BINS += $(BUILD)/tests/gpu/test_quant $(BUILD)/kbench
QUANT_GPU_OBJS := $(BUILD)/obj/gpu/quant.cu.o $(BUILD)/obj/gpu/quant_host.o
$(BUILD)/tests/gpu/test_quant: $(BUILD)/obj/tests/gpu/test_quant.cu.o $(QUANT_GPU_OBJS)
	@mkdir -p $(dir $@)
	$(call say,LD)$(CC) $(BASE_CFLAGS) -o $@ $^ $(LDLIBS_ALL) -lstdc++
$(BUILD)/kbench: $(BUILD)/obj/tests/gpu/kbench.cu.o $(QUANT_GPU_OBJS)
	@mkdir -p $(dir $@)
	$(call say,LD)$(CC) $(BASE_CFLAGS) -o $@ $^ $(LDLIBS_ALL) -lstdc++
endif

# CUDA device ops and device selection (select.c includes CUDA headers); the ffn experts' CUDA
# side (cuBLASLt, hence -lcublasLt in CUDA_LIBS).
GPU_CU_SRCS += gpu/ops_cuda.cu gpu/ffn_cuda.cu
# the ffn experts' GEMM kernel of our own (gpu/ffn_gemm.h; the ffn_cuda tuning `kernel`)
GPU_CU_SRCS += gpu/ffn_gemm.cu
# the Hopper one (gpu/ffn_gemm_wgmma.cu: wgmma, TMA; the ffn_cuda tuning `wgmma`)
GPU_CU_SRCS += gpu/ffn_gemm_wgmma.cu
# its shared-memory layout (gpu/ffn_gemm_wgmma_layout.h: swizzle, descriptors) checked on the CPU
UNIT_TESTS += ffn_gemm_wgmma_layout
test_ffn_gemm_wgmma_layout_SRCS :=
# its index arithmetic (gpu/ffn_gemm_layout.h: swizzle, warp roles, split-K) checked on the CPU
UNIT_TESTS += ffn_gemm_layout
test_ffn_gemm_layout_SRCS :=
# the path an experts call takes and the default tuning (gpu/ffn_path.h) checked on the CPU
UNIT_TESTS += ffn_path
test_ffn_path_SRCS :=
GPU_SRCS += gpu/select.c
$(BUILD)/obj/gpu/select.o: CFLAGS += -I$(CUDA_HOME)/include
UNIT_TESTS += gpu_select
test_gpu_select_SRCS += gpu/select.c
# test_ops_cuda: CUDA ops against the host ops, byte for byte; daemon_gpu.sh: 2 ranks on 2 GPUs
# through the real sockets (both skip visibly without GPUs).
ifeq ($(CUDA),1)
GPU_TESTS += test_ops_cuda daemon_gpu.sh daemon_regions_gpu.sh
OPS_CUDA_TEST_OBJS += $(BUILD)/obj/tests/gpu/test_ops_cuda.cu.o $(BUILD)/obj/gpu/ops_cuda.cu.o \
                      $(BUILD)/obj/gpu/ffn_cuda.cu.o $(BUILD)/obj/gpu/ffn_gemm.cu.o \
                      $(BUILD)/obj/gpu/ffn_gemm_wgmma.cu.o \
                      $(patsubst %.c,$(BUILD)/obj/%.o,gpu/ops_host.c gpu/quant_host.c gpu/ffn.c \
                                                      gpu/safetensors.c common/status.c)
$(BUILD)/tests/gpu/test_ops_cuda: $(OPS_CUDA_TEST_OBJS)
	@mkdir -p $(dir $@)
	$(call say,LD)$(CC) $(BASE_CFLAGS) -o $@ $^ $(LDLIBS_ALL) -lstdc++
# tests/run.sh runs GPU_TESTS as $(BUILD)/tests/gpu/NAME from the repository root: a wrapper.
$(BUILD)/tests/gpu/daemon_gpu.sh: tests/gpu/daemon_gpu.sh
	@mkdir -p $(dir $@)
	$(call say,GEN)printf '#!/bin/sh\nexec bash tests/gpu/daemon_gpu.sh "$$@"\n' >$@ && chmod 0755 $@
$(BUILD)/tests/gpu/daemon_regions_gpu.sh: tests/gpu/daemon_regions_gpu.sh
	@mkdir -p $(dir $@)
	$(call say,GEN)printf '#!/bin/sh\nexec bash tests/gpu/daemon_regions_gpu.sh "$$@"\n' >$@ && chmod 0755 $@
BINS += $(BUILD)/tests/gpu/test_ops_cuda $(BUILD)/tests/gpu/daemon_gpu.sh \
        $(BUILD)/tests/gpu/daemon_regions_gpu.sh
# test_ffn_cuda: the CUDA ffn experts against the host ones, within DESIGN.md section 9's tolerance.
GPU_TESTS += test_ffn_cuda
$(BUILD)/tests/gpu/test_ffn_cuda: $(BUILD)/obj/tests/gpu/test_ffn_cuda.cu.o \
                                  $(filter-out %/test_ops_cuda.cu.o,$(OPS_CUDA_TEST_OBJS))
	@mkdir -p $(dir $@)
	$(call say,LD)$(CC) $(BASE_CFLAGS) -o $@ $^ $(LDLIBS_ALL) -lstdc++
BINS += $(BUILD)/tests/gpu/test_ffn_cuda
# gemmbench: the Hopper ffn GEMM kernel alone against a read of its weights (a benchmark, not a
# test: run it on the GPU machine by hand, docs/results.md)
$(BUILD)/gemmbench: $(BUILD)/obj/tests/gpu/gemmbench.cu.o $(BUILD)/obj/gpu/ffn_gemm_wgmma.cu.o
	@mkdir -p $(dir $@)
	$(call say,LD)$(CC) $(BASE_CFLAGS) -o $@ $^ $(LDLIBS_ALL) -lstdc++
BINS += $(BUILD)/gemmbench
# daemon_ffn_gpu.sh: the ffn daemon on the GPU through the sockets, within the tolerance.
GPU_TESTS += daemon_ffn_gpu.sh
$(BUILD)/tests/gpu/daemon_ffn_gpu.sh: tests/gpu/daemon_ffn_gpu.sh
	@mkdir -p $(dir $@)
	$(call say,GEN)printf '#!/bin/sh\nexec bash tests/gpu/daemon_ffn_gpu.sh "$$@"\n' >$@ && \
	    chmod 0755 $@
BINS += $(BUILD)/tests/gpu/daemon_ffn_gpu.sh
# accuracy_gpu.sh: epd --accuracy with ffn experts at H 7168, I 2048 (docs/accuracy.md's table).
GPU_TESTS += accuracy_gpu.sh
$(BUILD)/tests/gpu/accuracy_gpu.sh: tests/gpu/accuracy_gpu.sh
	@mkdir -p $(dir $@)
	$(call say,GEN)printf '#!/bin/sh\nexec bash tests/gpu/accuracy_gpu.sh "$$@"\n' >$@ && \
	    chmod 0755 $@
BINS += $(BUILD)/tests/gpu/accuracy_gpu.sh
# test_external_cuda: the external experts' kernels against their host twins, byte for byte.
GPU_TESTS += test_external_cuda
$(BUILD)/tests/gpu/test_external_cuda: $(BUILD)/obj/tests/gpu/test_external_cuda.cu.o \
        $(BUILD)/obj/gpu/external_cuda.cu.o \
        $(patsubst %.c,$(BUILD)/obj/%.o,gpu/external_host.c gpu/ops_host.c gpu/quant_host.c \
                                        gpu/ffn.c gpu/safetensors.c common/status.c common/parse.c)
	@mkdir -p $(dir $@)
	$(call say,LD)$(CC) $(BASE_CFLAGS) -o $@ $^ $(LDLIBS_ALL) -lstdc++
BINS += $(BUILD)/tests/gpu/test_external_cuda
# external_gpu.sh: external experts' CUDA kernels bit for bit, device regions, hand-over latency.
GPU_TESTS += external_gpu.sh
$(BUILD)/tests/gpu/external_gpu.sh: tests/gpu/external_gpu.sh
	@mkdir -p $(dir $@)
	$(call say,GEN)printf '#!/bin/sh\nexec bash tests/gpu/external_gpu.sh "$$@"\n' >$@ && \
	    chmod 0755 $@
BINS += $(BUILD)/tests/gpu/external_gpu.sh
endif
