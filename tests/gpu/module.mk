# tests/gpu/: GPU test programs. mpi_cuda_aware is an MPI program (run it with
# tests/gpu/run-mpi-cuda-aware.sh under mpirun), so it is not in GPU_TESTS, which tests/run.sh
# runs without mpirun. Built when CUDA=1, against $(MPI_HOME)'s MPI when set.
ifeq ($(CUDA),1)
MPI_CUDA_AWARE_SRCS := tests/gpu/mpi_cuda_aware.c common/parse.c common/status.c
BINS += $(BUILD)/tests/gpu/mpi_cuda_aware

# Its own object rule: the generic one has no CUDA include path (for cuda_runtime_api.h).
$(BUILD)/obj/tests/gpu/mpi_cuda_aware.o: tests/gpu/mpi_cuda_aware.c
	@mkdir -p $(dir $@)
	$(call say,CC)$(CC) $(BASE_CFLAGS) -I$(CUDA_HOME)/include -MMD -MP -c $< -o $@

$(BUILD)/tests/gpu/mpi_cuda_aware: $(patsubst %.c,$(BUILD)/obj/%.o,$(MPI_CUDA_AWARE_SRCS))
	@mkdir -p $(dir $@)
	$(call say,LD)$(CC) $(BASE_CFLAGS) -o $@ $^ $(MPI_LIBS) -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lm
endif
