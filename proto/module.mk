# proto/: the wire codec (PROTO_SRCS, linked by the daemon too), libepd (static, shared, pkg-config),
# epctl, the codec's unit tests, and `make fuzz` (libFuzzer harness of the decoder).

PROTO_SRCS := proto/frame.c proto/json_strict.c proto/json_build.c proto/tensor.c proto/submit.c proto/base64.c
LIBEPD_SRCS := $(PROTO_SRCS) proto/client.c common/status.c common/parse.c
EPCTL_SRCS := proto/epctl.c proto/cuda_dl.c

# libepd needs cJSON and pthreads only: never MPI, libevent or CUDA.
LIBEPD_LIBS = $(shell pkg-config --libs libcjson 2>/dev/null) -lpthread -lm
LIBEPD_SONAME := libepd.so.0

BINS += $(BUILD)/libepd.a $(BUILD)/libepd.so $(BUILD)/epd.pc $(BUILD)/epctl

$(BUILD)/libepd.a: $(call obj,$(LIBEPD_SRCS))
	@mkdir -p $(dir $@)
	@rm -f $@
	$(call say,AR)ar rcs $@ $^

# Only epd_client_* is exported (proto/libepd.map); everything else stays inside the library.
$(BUILD)/libepd.so: $(call obj,$(LIBEPD_SRCS)) proto/libepd.map
	@mkdir -p $(dir $@)
	$(call say,SO)$(CC) -shared -o $@ $(call obj,$(LIBEPD_SRCS)) -Wl,-soname,$(LIBEPD_SONAME) \
	    -Wl,--version-script=proto/libepd.map -Wl,--no-undefined $(LIBEPD_LIBS) $(LDFLAGS)

$(BUILD)/epd.pc: proto/epd.pc.in
	@mkdir -p $(dir $@)
	$(call say,GEN)sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@VERSION@|$(VERSION)|g' $< > $@

$(BUILD)/epctl: $(call obj,$(EPCTL_SRCS)) $(BUILD)/libepd.a
	@mkdir -p $(dir $@)
	$(call say,LD)$(CC) $(BASE_CFLAGS) -o $@ $(call obj,$(EPCTL_SRCS)) $(BUILD)/libepd.a $(LIBEPD_LIBS) $(LDFLAGS)

# The installed epd.pc is written with the PREFIX of `make install` (which may differ from the
# build's).
INSTALL_EXTRA += install -m 0644 $(BUILD)/libepd.a $(DESTDIR)$(PREFIX)/lib/ ; \
	install -m 0755 $(BUILD)/libepd.so $(DESTDIR)$(PREFIX)/lib/$(LIBEPD_SONAME) ; \
	ln -sf $(LIBEPD_SONAME) $(DESTDIR)$(PREFIX)/lib/libepd.so ; \
	install -m 0644 proto/epd.h $(DESTDIR)$(PREFIX)/include/ ; \
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@VERSION@|$(VERSION)|g' proto/epd.pc.in \
	    > $(DESTDIR)$(PREFIX)/lib/pkgconfig/epd.pc ;

UNIT_TESTS += frame client json_build
test_json_build_SRCS := proto/json_build.c proto/json_strict.c common/status.c
test_frame_SRCS := $(PROTO_SRCS) common/status.c common/parse.c
test_client_SRCS := $(LIBEPD_SRCS)

# The fuzz harnesses (libFuzzer, ASan and UBSan): the decoder + SUBMIT validation, on a copy of
# tests/fuzz/corpus in $(BUILD)/fuzz/corpus.
FUZZ_SECONDS ?= 60
FUZZ_CC ?= clang
FUZZ_SRCS := tests/fuzz/fuzz_frame.c $(PROTO_SRCS) common/status.c common/parse.c

$(BUILD)/fuzz/fuzz_frame: $(FUZZ_SRCS) $(wildcard proto/*.h common/*.h)
	@mkdir -p $(dir $@)
	$(call say,FUZZ)$(FUZZ_CC) -std=gnu11 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
	    -ffp-contract=off -D_GNU_SOURCE -I. $(shell pkg-config --cflags libcjson 2>/dev/null) \
	    -o $@ $(FUZZ_SRCS) $(shell pkg-config --libs libcjson 2>/dev/null) -lm

# The CONTROL meta path: the strict JSON checker against cJSON, and the decoder on CONTROL meta.
FUZZ_META_SRCS := tests/fuzz/fuzz_meta.c $(PROTO_SRCS) common/status.c common/parse.c

$(BUILD)/fuzz/fuzz_meta: $(FUZZ_META_SRCS) $(wildcard proto/*.h common/*.h)
	@mkdir -p $(dir $@)
	$(call say,FUZZ)$(FUZZ_CC) -std=gnu11 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
	    -ffp-contract=off -D_GNU_SOURCE -I. $(shell pkg-config --cflags libcjson 2>/dev/null) \
	    -o $@ $(FUZZ_META_SRCS) $(shell pkg-config --libs libcjson 2>/dev/null) -lm

# make fuzz [FUZZ_SECONDS=60] [FUZZ_HARNESSES="frame meta config"]: each harness in turn, for
# FUZZ_SECONDS each, on a fresh copy of its corpus (tests/fuzz/run.sh).
FUZZ_HARNESSES ?= frame meta config
fuzz: $(BUILD)/fuzz/fuzz_frame $(BUILD)/fuzz/fuzz_meta $(BUILD)/fuzz-config/fuzz_config
	@BUILD=$(BUILD) FUZZ_SECONDS=$(FUZZ_SECONDS) tests/fuzz/run.sh $(FUZZ_HARNESSES)

# The payload read path alone, feed against the direct window (tests/bench/read_bench.c; run by
# hand, it prints a same-run ratio).
BINS += $(BUILD)/read-bench
$(BUILD)/read-bench: $(call obj,tests/bench/read_bench.c $(PROTO_SRCS) common/status.c common/parse.c)
	@mkdir -p $(dir $@)
	$(call say,LD)$(CC) $(BASE_CFLAGS) -o $@ $^ $(LIBEPD_LIBS) $(LDFLAGS)

# The metas of a request's path decoded alone, against cJSON_Parse (tests/bench/meta_bench.c; run
# by hand, it prints a same-run ratio; under callgrind it counts instructions).
BINS += $(BUILD)/meta-bench
$(BUILD)/meta-bench: $(call obj,tests/bench/meta_bench.c $(PROTO_SRCS) common/status.c common/parse.c)
	@mkdir -p $(dir $@)
	$(call say,LD)$(CC) $(BASE_CFLAGS) -o $@ $^ $(LIBEPD_LIBS) $(LDFLAGS)
