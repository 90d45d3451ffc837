# tests/unit/: unit tests that are not one module's, registered like the modules' own.
# protocol_doc checks docs/protocol.md against the codec, the error list, the CONTROL op table and
# the REPLY documents (it reads docs/ and daemon/control.c at run time, from the repository root).
UNIT_TESTS += protocol_doc
test_protocol_doc_SRCS = $(PROTO_SRCS) daemon/stats.c daemon/quant_stats.c comm/phase.c $(COMMON_SRCS) $(CONFIG_SRCS)
