#!/usr/bin/env bash
# Runs the fuzz harnesses built by `make fuzz`, one after the other, each for FUZZ_SECONDS on a
# fresh copy of its seed corpus (new inputs it finds stay in $BUILD/fuzz*/corpus-NAME):
#   frame   the frame decoder + SUBMIT validation   (tests/fuzz/corpus, frame.dict)
#   meta    the CONTROL meta path: strict JSON vs cJSON, decoding (tests/fuzz/meta-corpus)
#   config  the YAML configuration loader            (tests/fuzz/config-corpus)
# Arguments: the harnesses to run (default: all three). Exit status: non-zero on the first
# harness that finds something (a crash, a leak or a sanitizer report; the reproducer is left in
# its work folder), after printing its final stats.
set -eu
BUILD=${BUILD:-build}
FUZZ_SECONDS=${FUZZ_SECONDS:-60}
here=$(cd "$(dirname "$0")" && pwd)
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

run_one() {
    local name=$1 work=$2 bin=$3 seeds=$4 max_len=$5; shift 5
    rm -rf "$work/corpus-$name"
    mkdir -p "$work/corpus-$name"
    cp "$seeds"/* "$work/corpus-$name/"
    echo "== fuzz_$name: ${FUZZ_SECONDS}s on $(ls "$work/corpus-$name" | wc -l) seed inputs"
    local rc=0
    (cd "$work" && "./$bin" -max_total_time="$FUZZ_SECONDS" -max_len="$max_len" -timeout=10 \
        -rss_limit_mb=2048 -print_final_stats=1 "$@" "corpus-$name") >"$work/fuzz_$name.log" 2>&1 ||
        rc=$?
    grep -E '^#[0-9]+ +DONE|^stat::|ERROR|SUMMARY|^fuzz_|Test unit written' "$work/fuzz_$name.log" || true
    if [[ $rc -ne 0 ]]; then
        echo "fuzz_$name: FOUND SOMETHING (exit $rc); see $work"
        return "$rc"
    fi
    echo "fuzz_$name: no finding in ${FUZZ_SECONDS}s"
}

for h in "${@:-frame meta config}"; do
    for name in $h; do
        case $name in
        frame) run_one frame "$BUILD/fuzz" fuzz_frame "$here/corpus" 16384 -dict="$here/frame.dict" ;;
        meta) run_one meta "$BUILD/fuzz" fuzz_meta "$here/meta-corpus" 65536 ;;
        config) run_one config "$BUILD/fuzz-config" fuzz_config "$here/config-corpus" 4096 ;;
        *) echo "unknown harness '$name' (frame, meta, config)"; exit 2 ;;
        esac
    done
done
