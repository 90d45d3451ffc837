# daemon/: the epd binary (main, start-up, server, listener, connections and their table, CONTROL
# documents, engine, bench, stats, log, notify),
# its unit tests, and the C clients of the integration tests (build/tests/<name>).
DAEMON_SRCS := daemon/main.c daemon/daemon.c daemon/server.c daemon/listener.c daemon/conn.c \
               daemon/conn_frames.c \
               daemon/conn_table.c daemon/control.c daemon/stats.c daemon/quant_stats.c \
               daemon/log.c daemon/notify.c daemon/engine.c daemon/bench.c daemon/bench_ffn.c \
               daemon/accuracy.c daemon/experts.c daemon/region.c daemon/http.c daemon/watchdog.c \
               daemon/trim.c daemon/trace.c daemon/pinned.c daemon/accuracy_side.c daemon/bulk.c
DAEMON_SRCS += daemon/external.c

# Other folders' module.mk files are read after this one: their source lists are expanded in the
# prerequisites a second time, once every list is complete.
.SECONDEXPANSION:

EPD_LINK_SRCS = $(COMMON_SRCS) $(CONFIG_SRCS) $(PROTO_SRCS) $(GPU_SRCS) $(GPU_CU_SRCS) \
                $(COMM_SRCS) $(COMM_CU_SRCS) $(DAEMON_SRCS)
EPD_CXX_LIBS = $(if $(filter 1,$(CUDA)),-lstdc++)

$(BUILD)/epd: $$(call obj,$$(EPD_LINK_SRCS))
	@mkdir -p $(dir $@)
	$(call say,LD)$(CC) $(BASE_CFLAGS) -o $@ $^ $(LDLIBS_ALL) $(EPD_CXX_LIBS)

BINS += $(BUILD)/epd

# Integration-test clients: the frame codec, the host reference (epd_moe_reference) and common.
DAEMON_TEST_CLIENTS := check_client region_check
DAEMON_TEST_CLIENTS += external_check
EPD_CLIENT_TEST_SRCS = $(COMMON_SRCS) $(PROTO_SRCS) proto/client.c proto/cuda_dl.c gpu/quant_host.c \
                       gpu/ops_host.c gpu/ffn.c gpu/safetensors.c
define daemon_test_client_rule
$(BUILD)/tests/$(1): $(BUILD)/obj/tests/integration/$(1).o $$$$(call obj,$$$$(EPD_CLIENT_TEST_SRCS))
	@mkdir -p $$(dir $$@)
	$$(call say,LD)$$(CC) $$(BASE_CFLAGS) -o $$@ $$^ $$(LDLIBS_ALL) $$(EPD_CXX_LIBS)
endef
$(foreach c,$(DAEMON_TEST_CLIENTS),$(eval $(call daemon_test_client_rule,$(c))))
BINS += $(foreach c,$(DAEMON_TEST_CLIENTS),$(BUILD)/tests/$(c))

UNIT_TESTS += log notify stats
test_log_SRCS = daemon/log.c
test_notify_SRCS = daemon/notify.c
test_stats_SRCS = daemon/stats.c daemon/quant_stats.c comm/phase.c $(COMMON_SRCS) $(CONFIG_SRCS)

# One connection on a socketpair with a stub engine (tests/unit/test_conn.c).
UNIT_TESTS += conn
test_conn_SRCS = daemon/conn.c daemon/conn_frames.c daemon/bulk.c daemon/pinned.c daemon/region.c daemon/log.c $(PROTO_SRCS) common/status.c common/parse.c
UNIT_TESTS += trim
test_trim_SRCS = daemon/trim.c daemon/log.c
UNIT_TESTS += pinned
UNIT_TESTS += bulk
test_bulk_SRCS = daemon/bulk.c daemon/log.c common/status.c common/parse.c
test_pinned_SRCS = daemon/pinned.c
