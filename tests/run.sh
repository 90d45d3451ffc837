#!/usr/bin/env bash
# Runs every test `make check` owns and prints one summary line: 'N passed, N failed, N skipped'.
#   unit tests (cmocka), the same under ASan+UBSan, integration tests (tests/integration/*.sh,
#   real mpirun and sockets), GPU tests (skipped, visibly, without a GPU), systemd-analyze verify.
# Environment: BUILD, MPIRUN, UNIT_TESTS, GPU_TESTS (set by the Makefile). TESTS_FILTER=regex
# narrows what runs.
set -u
BUILD=${BUILD:-build}
export BUILD MPIRUN=${MPIRUN:-mpirun}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
filter=${TESTS_FILTER:-.}
passed=0 failed=0 skipped=0
failures=()
logdir=$BUILD/test-logs
mkdir -p "$logdir"

# The tests start python3 often, many times while a daemon is flooded. Where python3 is a
# wrapper script (pyenv's shim runs `pyenv exec`: a bash and several processes each time), they
# start the interpreter it runs instead: flooding 2 ranks on 2 cores, `python3 -c pass` took
# 12-15 s through the shim and 3.4-3.8 s as the interpreter itself. Same interpreter, same
# modules; a python3 that is already the interpreter is left alone.
py=$(python3 -c 'import sys; print(sys.executable)' 2>/dev/null)
py_cmd=$(command -v python3)
if [[ -n $py && -x $py && $(readlink -f "$py_cmd") != "$(readlink -f "$py")" ]]; then
    mkdir -p "$BUILD/test-bin"
    ln -sfn "$py" "$BUILD/test-bin/python3"
    PATH=$(cd "$BUILD/test-bin" && pwd):$PATH
    echo "python3: $py, the interpreter $py_cmd runs"
fi

# run NAME CMD...: exit 0 pass, 77 skip (the test prints why), anything else fail.
run() {
    local name=$1; shift
    [[ $name =~ $filter ]] || return 0
    local log=$logdir/${name//\//_}.log start=$SECONDS rc ompi_tmp
    # each test's Open MPI session directories under a base of its own: a job of the test before
    # still exiting removes /tmp/ompi.HOST.UID once empty, and a mpirun starting then cannot make
    # its pid directory in it ("orte_session_dir failed")
    ompi_tmp=$(mktemp -d /tmp/epd-ompi.XXXXXX)
    OMPI_MCA_orte_tmpdir_base=$ompi_tmp "$@" >"$log" 2>&1
    rc=$?
    rm -rf "$ompi_tmp"
    local took=$((SECONDS - start))
    if [[ $rc -eq 0 ]]; then
        passed=$((passed + 1))
        printf 'PASS  %-48s %3ss\n' "$name" "$took"
        grep -E '^\[  PASSED  \]|^\[  FAILED  \]' "$log" | sed 's/^/        /'
    elif [[ $rc -eq 77 ]]; then
        skipped=$((skipped + 1))
        printf 'SKIP  %-48s %s\n' "$name" "$(grep -m1 -i 'skip' "$log")"
    else
        failed=$((failed + 1))
        failures+=("$name")
        printf 'FAIL  %-48s %3ss (exit %d), last lines of %s:\n' "$name" "$took" "$rc" "$log"
        tail -n 30 "$log" | sed 's/^/        /'
    fi
}

for t in ${UNIT_TESTS:-}; do
    run "unit/$t" "$BUILD/tests/test_$t"
done
for t in ${UNIT_TESTS:-}; do
    run "asan/$t" "$BUILD/asan/tests/test_$t"
done
for s in tests/integration/*.sh; do
    [[ -e $s ]] || continue
    run "integration/$(basename "$s" .sh)" bash "$s"
done
for t in ${GPU_TESTS:-}; do
    run "gpu/$t" "$BUILD/tests/gpu/$t"
done
if command -v systemd-analyze >/dev/null 2>&1 && [[ -f systemd/epd.service ]]; then
    run "systemd/verify" tests/systemd-verify.sh
else
    run "systemd/verify" bash -c 'echo "SKIP: systemd-analyze is not installed"; exit 77'
fi

echo
if [[ $failed -gt 0 ]]; then
    echo "failed: ${failures[*]} (logs in $logdir)"
fi
echo "$passed passed, $failed failed, $skipped skipped"
[[ $failed -eq 0 ]]
