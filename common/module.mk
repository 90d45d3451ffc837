COMMON_SRCS := common/status.c common/parse.c
UNIT_TESTS += common
test_common_SRCS := $(COMMON_SRCS)
