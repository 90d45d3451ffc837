#!/usr/bin/env bash
# Runs the frame decoder fuzzer (built by `make fuzz`) for FUZZ_SECONDS on a fresh copy of the seed
# corpus in $BUILD/fuzz/corpus; new inputs it finds stay there. Exit status: the fuzzer's (non-zero
# on a crash, leak or sanitizer report; the reproducer is left in $BUILD/fuzz/).
set -eu
BUILD=${BUILD:-build}
FUZZ_SECONDS=${FUZZ_SECONDS:-60}
here=$(cd "$(dirname "$0")" && pwd)
work=$BUILD/fuzz
rm -rf "$work/corpus"
mkdir -p "$work/corpus"
cp "$here"/corpus/* "$work/corpus/"
cd "$work"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
echo "fuzz_frame: ${FUZZ_SECONDS}s on $(ls corpus | wc -l) seed inputs"
exec ./fuzz_frame -max_total_time="$FUZZ_SECONDS" -max_len=16384 -timeout=10 -rss_limit_mb=2048 \
    -dict="$here/frame.dict" -print_final_stats=1 corpus
