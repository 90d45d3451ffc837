# config/: the settings table, YAML loading, environment and --set, printing, the command line.
CONFIG_SRCS := config/settings.c config/yaml.c config/config.c config/print.c config/args.c
UNIT_TESTS += config
test_config_SRCS := $(CONFIG_SRCS) $(COMMON_SRCS)
