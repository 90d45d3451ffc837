# comm/: transports (comm/transport.h), their selection, and the collective step.
COMM_SRCS += comm/transport_mpi.c comm/step.c comm/phase.c comm/select.c

# The step at world = 1 (MPI singleton), the transport's count conversion, the selection.
UNIT_TESTS += step
test_step_SRCS := comm/transport_mpi.c comm/step.c comm/select.c gpu/ops_host.c gpu/quant_host.c \
                  common/status.c common/parse.c

# MPI test programs run by tests/integration/step_np.sh and engine_np.sh under mpirun.
STEP_CHECK_SRCS := tests/integration/step_check.c comm/transport_mpi.c comm/step.c \
                   gpu/ops_host.c gpu/quant_host.c common/status.c common/parse.c
$(BUILD)/tests/step_check: $(call obj,$(STEP_CHECK_SRCS))
	@mkdir -p $(dir $@)
	$(call say,LD)$(CC) $(BASE_CFLAGS) -o $@ $^ $(LDLIBS_ALL)
BINS += $(BUILD)/tests/step_check

# The engine (daemon/engine.c) on a real event loop without sockets, at np = 2.
ENGINE_CHECK_SRCS := tests/integration/engine_check.c daemon/engine.c comm/transport_mpi.c \
                     comm/step.c gpu/ops_host.c gpu/quant_host.c common/status.c common/parse.c
$(BUILD)/tests/engine_check: $(patsubst %.c,$(BUILD)/obj/%.o,$(ENGINE_CHECK_SRCS))
	@mkdir -p $(dir $@)
	$(call say,LD)$(CC) $(BASE_CFLAGS) -o $@ $^ $(LDLIBS_ALL)
BINS += $(BUILD)/tests/engine_check

# GPU transports: staged mpi (pure MPI + ops hooks, built everywhere), nccl (NCCL=1), the CUDA
# transport choice. Unit tests at world 1; staged_check runs 3 ranks (transport_staged.sh).
COMM_SRCS += comm/transport_staged.c comm/select_cuda.c $(if $(filter 1,$(NCCL)),comm/transport_nccl.c comm/nccl_boot.c)
$(BUILD)/obj/comm/nccl_boot.o: CFLAGS += -I$(CUDA_HOME)/include
UNIT_TESTS += transport_staged select_cuda
test_transport_staged_SRCS += comm/transport_staged.c gpu/ops_host.c gpu/quant_host.c \
                              common/status.c common/parse.c
test_select_cuda_SRCS += comm/select_cuda.c common/status.c
STAGED_CHECK_SRCS += tests/integration/staged_check.c comm/transport_staged.c gpu/ops_host.c \
                     gpu/quant_host.c common/status.c common/parse.c
$(BUILD)/tests/staged_check: $(patsubst %.c,$(BUILD)/obj/%.o,$(STAGED_CHECK_SRCS))
	@mkdir -p $(dir $@)
	$(call say,LD)$(CC) $(BASE_CFLAGS) -o $@ $^ $(LDLIBS_ALL)
BINS += $(BUILD)/tests/staged_check
