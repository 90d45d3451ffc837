# tests/python/: the Python client's tests (run by tests/integration/python_client.sh) and
# py_ref, libepd's answer and the host reference for one batch.
PY_REF_OBJS = $(BUILD)/obj/tests/python/py_ref.o $(call obj,gpu/ops_host.c gpu/quant_host.c)
$(BUILD)/tests/py_ref: $(PY_REF_OBJS) $(BUILD)/libepd.a
	@mkdir -p $(dir $@)
	$(call say,LD)$(CC) $(BASE_CFLAGS) -o $@ $(PY_REF_OBJS) $(BUILD)/libepd.a $(LIBEPD_LIBS) $(LDFLAGS)
BINS += $(BUILD)/tests/py_ref

# The GPU test of device regions and examples/torch_moe.py (skips visibly without a GPU or torch).
ifeq ($(CUDA),1)
GPU_TESTS += python_cuda.sh
$(BUILD)/tests/gpu/python_cuda.sh: tests/gpu/python_cuda.sh
	@mkdir -p $(dir $@)
	$(call say,GEN)printf '#!/bin/sh\nexec bash tests/gpu/python_cuda.sh "$$@"\n' >$@ && chmod 0755 $@
BINS += $(BUILD)/tests/gpu/python_cuda.sh
endif
