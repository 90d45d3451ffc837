# tests/python/: the Python client's tests (run by tests/integration/python_client.sh) and
# py_ref, libepd's answer and the host reference for one batch.
PY_REF_OBJS = $(BUILD)/obj/tests/python/py_ref.o $(call obj,gpu/ops_host.c gpu/quant_host.c)
$(BUILD)/tests/py_ref: $(PY_REF_OBJS) $(BUILD)/libepd.a
	@mkdir -p $(dir $@)
	$(call say,LD)$(CC) $(BASE_CFLAGS) -o $@ $(PY_REF_OBJS) $(BUILD)/libepd.a $(LIBEPD_LIBS) $(LDFLAGS)
BINS += $(BUILD)/tests/py_ref
