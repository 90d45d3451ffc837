# proto/: the wire codec (PROTO_SRCS, linked by the daemon too). libepd, epctl, tests and fuzz follow.
PROTO_SRCS := proto/frame.c proto/tensor.c proto/submit.c
UNIT_TESTS += frame
test_frame_SRCS := $(PROTO_SRCS) common/status.c common/parse.c
