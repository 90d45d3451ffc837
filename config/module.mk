# config/: the settings table, YAML loading, environment and --set, printing, the command line.
CONFIG_SRCS := config/settings.c config/yaml.c config/config.c config/print.c config/args.c
UNIT_TESTS += config
test_config_SRCS := $(CONFIG_SRCS) $(COMMON_SRCS)

# make fuzz-config [FUZZ_SECONDS=60]: the YAML configuration loader under libFuzzer, ASan and
# UBSan, on a copy of tests/fuzz/config-corpus in $(BUILD)/fuzz-config/corpus.
$(BUILD)/fuzz-config/fuzz_config: tests/fuzz/fuzz_config.c $(CONFIG_SRCS) common/status.c common/parse.c \
        $(wildcard config/*.h common/*.h)
	@mkdir -p $(dir $@)
	$(call say,FUZZ)$(FUZZ_CC) -std=gnu11 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
	    -D_GNU_SOURCE -I. $(shell pkg-config --cflags yaml-0.1 libcjson 2>/dev/null) -o $@ \
	    $(filter %.c,$^) $(shell pkg-config --libs yaml-0.1 libcjson 2>/dev/null) -lm

.PHONY: fuzz-config
fuzz-config: $(BUILD)/fuzz-config/fuzz_config
	@rm -rf $(BUILD)/fuzz-config/corpus && mkdir -p $(BUILD)/fuzz-config/corpus
	@cp tests/fuzz/config-corpus/* $(BUILD)/fuzz-config/corpus/
	cd $(BUILD)/fuzz-config && ASAN_OPTIONS=detect_leaks=1 ./fuzz_config -max_total_time=$(FUZZ_SECONDS) \
	    -max_len=4096 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 corpus
