# comm/: transports (comm/transport.h), their registry and selection, the collective step and its
# phases.
COMM_SRCS += comm/transport.c comm/transport_mpi.c comm/step.c comm/phase.c comm/registry.c

# The step at world = 1 (MPI singleton), the mpi transport's count conversion and datatype items.
UNIT_TESTS += step
test_step_SRCS := comm/transport.c comm/transport_mpi.c comm/step.c gpu/ops_host.c gpu/ffn.c \
                  gpu/safetensors.c gpu/quant_host.c common/status.c common/parse.c

# MPI test programs run by tests/integration/step_np.sh and engine_np.sh under mpirun.
# With CUDA, step_check --ops cuda runs the step on the CUDA ops (staged mpi; the step scale on
# the GPU, tests/gpu/quant_gpu.sh).
STEP_CHECK_SRCS := tests/integration/step_check.c comm/transport.c comm/transport_mpi.c \
                   comm/step.c gpu/ops_host.c gpu/quant_host.c gpu/ffn.c gpu/safetensors.c \
                   common/status.c common/parse.c comm/transport_staged.c \
                   $(if $(filter 1,$(CUDA)),gpu/ops_cuda.cu gpu/ffn_cuda.cu gpu/ffn_gemm.cu gpu/ffn_gemm_wgmma.cu)
$(BUILD)/tests/step_check: $(call obj,$(STEP_CHECK_SRCS))
	@mkdir -p $(dir $@)
	$(call say,LD)$(CC) $(BASE_CFLAGS) -o $@ $^ $(LDLIBS_ALL) $(if $(filter 1,$(CUDA)),-lstdc++)
BINS += $(BUILD)/tests/step_check

# The engine (daemon/engine.c) on a real event loop without sockets, at np = 2.
ENGINE_CHECK_SRCS := tests/integration/engine_check.c daemon/engine.c daemon/pinned.c daemon/quant_stats.c \
                     daemon/log.c comm/transport.c comm/transport_mpi.c comm/step.c \
                     gpu/ops_host.c gpu/quant_host.c gpu/ffn.c gpu/safetensors.c \
                     common/status.c common/parse.c
$(BUILD)/tests/engine_check: $(patsubst %.c,$(BUILD)/obj/%.o,$(ENGINE_CHECK_SRCS))
	@mkdir -p $(dir $@)
	$(call say,LD)$(CC) $(BASE_CFLAGS) -o $@ $^ $(LDLIBS_ALL)
BINS += $(BUILD)/tests/engine_check

# GPU transports: staged mpi (pure MPI + ops hooks, built everywhere) and nccl with its NCCL glue
# (NCCL=1; nccl_boot.c is the one comm/ file that includes CUDA and NCCL headers). Unit tests at
# world 1; staged_check runs 3 ranks (transport_staged.sh).
COMM_SRCS += comm/transport_staged.c $(if $(filter 1,$(NCCL)),comm/transport_nccl.c comm/nccl_boot.c)
$(BUILD)/obj/comm/nccl_boot.o: CFLAGS += -I$(CUDA_HOME)/include
UNIT_TESTS += transport_staged registry
test_transport_staged_SRCS += comm/transport.c comm/transport_staged.c gpu/ops_host.c gpu/ffn.c \
                              gpu/safetensors.c \
                              gpu/quant_host.c common/status.c common/parse.c
# The registry walk over the real transports' can_use, nccl included in every build (the test
# stands in for the NCCL glue, which the choice never calls).
test_registry_SRCS += comm/registry.c comm/transport.c comm/transport_mpi.c \
                      comm/transport_staged.c comm/transport_nccl.c common/status.c common/parse.c
STAGED_CHECK_SRCS += tests/integration/staged_check.c comm/transport.c comm/transport_staged.c \
                     gpu/ops_host.c gpu/quant_host.c gpu/ffn.c gpu/safetensors.c common/status.c \
                     common/parse.c
$(BUILD)/tests/staged_check: $(patsubst %.c,$(BUILD)/obj/%.o,$(STAGED_CHECK_SRCS))
	@mkdir -p $(dir $@)
	$(call say,LD)$(CC) $(BASE_CFLAGS) -o $@ $^ $(LDLIBS_ALL)
BINS += $(BUILD)/tests/staged_check
