#!/usr/bin/env bash
# Black-box test of epd's configuration on the command line: `epd --print-config` (no MPI) with the
# legacy SGLang variables, their deprecation warning, two disagreeing aliases, a canonical variable
# over an alias, --set over everything, and a YAML error with file:line. Exit 0 pass, 77 skip.
set -u
BUILD=${BUILD:-build}
EPD=$BUILD/epd
if [[ ! -x $EPD ]]; then
    echo "SKIP: $EPD not built"
    exit 77
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0

fail() {
    echo "FAIL: $*"
    failures=$((failures + 1))
}

# epd_env VAR=VALUE... -- ARGS...: runs epd with only the given variables (plus what the loader
# needs), stdout to $tmp/out, stderr to $tmp/err; sets rc.
epd_env() {
    local vars=()
    while [[ $# -gt 0 && $1 != -- ]]; do vars+=("$1"); shift; done
    shift
    env -i PATH="$PATH" ${LD_LIBRARY_PATH:+LD_LIBRARY_PATH="$LD_LIBRARY_PATH"} "${vars[@]}" \
        "$EPD" "$@" >"$tmp/out" 2>"$tmp/err"
    rc=$?
}

expect_rc() { # expect_rc WHAT WANT
    if [[ $rc -ne $2 ]]; then
        fail "$1: exit $rc, expected $2; stderr: $(head -c 600 "$tmp/err")"
    fi
}

expect_line() { # expect_line WHAT FILE LINE: an exact line of FILE
    if ! grep -qxF -- "$3" "$2"; then
        fail "$1: no line '$3' in $(basename "$2"):"
        sed 's/^/    /' "$2" | head -40
    fi
}

expect_grep() { # expect_grep WHAT FILE TEXT: a fixed string somewhere in FILE
    if ! grep -qF -- "$3" "$2"; then
        fail "$1: '$3' not in $(basename "$2"):"
        sed 's/^/    /' "$2" | head -20
    fi
}

# 1. The legacy variable selects BF16, says where it came from, and warns once naming the
#    canonical variable.
epd_env SGLANG_DEEPEP_BF16_DISPATCH=1 -- --print-config
expect_rc "legacy alias" 0
expect_line "legacy alias" "$tmp/out" \
    "dispatch.dtype = bf16  # legacy env SGLANG_DEEPEP_BF16_DISPATCH (deprecated)"
expect_grep "legacy alias warning" "$tmp/err" "epd: warning: SGLANG_DEEPEP_BF16_DISPATCH is deprecated"
expect_grep "legacy alias warning" "$tmp/err" "EPD_DISPATCH_DTYPE"
n=$(grep -c "SGLANG_DEEPEP_BF16_DISPATCH" "$tmp/err")
[[ $n -eq 1 ]] || fail "legacy alias: $n warnings about SGLANG_DEEPEP_BF16_DISPATCH, expected 1"
n=$(grep -c ' = .*  # ' "$tmp/out")
want=$(grep -cE '\{\.name = "[a-z_]+\.' "$(dirname "$0")/../../config/settings.c")
[[ $n -eq $want ]] || fail "--print-config printed $n settings, the table in config/settings.c has $want"

# The other spelling, false: FP8.
epd_env SGLANG_DEEPEP_NORMAL_BF16_DISPATCH=off -- --print-config
expect_rc "normal alias" 0
expect_line "normal alias" "$tmp/out" \
    "dispatch.dtype = fp8  # legacy env SGLANG_DEEPEP_NORMAL_BF16_DISPATCH (deprecated)"

# 2. Two aliases that disagree: refused, naming both.
epd_env SGLANG_DEEPEP_BF16_DISPATCH=1 SGLANG_DEEPEP_NORMAL_BF16_DISPATCH=0 -- --print-config
if [[ $rc -eq 0 || $rc -ge 128 ]]; then
    fail "conflicting aliases: exit $rc, expected a clean non-zero exit"
fi
expect_grep "conflicting aliases" "$tmp/err" "SGLANG_DEEPEP_BF16_DISPATCH"
expect_grep "conflicting aliases" "$tmp/err" "SGLANG_DEEPEP_NORMAL_BF16_DISPATCH"
[[ -s $tmp/out ]] && fail "conflicting aliases: printed a configuration anyway"

# A bad legacy value: refused, naming the variable.
epd_env SGLANG_DEEPEP_BF16_DISPATCH=maybe -- --print-config
[[ $rc -ne 0 && $rc -lt 128 ]] || fail "bad legacy value: exit $rc"
expect_grep "bad legacy value" "$tmp/err" "SGLANG_DEEPEP_BF16_DISPATCH"

# 3. The canonical variable beats the alias; the warning says it was overridden.
epd_env SGLANG_DEEPEP_BF16_DISPATCH=1 EPD_DISPATCH_DTYPE=fp8 -- --print-config
expect_rc "canonical over alias" 0
expect_line "canonical over alias" "$tmp/out" "dispatch.dtype = fp8  # env EPD_DISPATCH_DTYPE"
expect_grep "canonical over alias" "$tmp/err" "overridden"

# 4. File < env < --set, with origins; unknown EPD_* variables warned, EPD_TEST_* not.
cat >"$tmp/epd.yaml" <<'EOF'
# test config
model:
  topk: 4
  num_experts: 64
socket:
  mode: 0600
EOF
epd_env EPD_MODEL_NUM_EXPERTS=128 EPD_MODLE_TOPK=2 EPD_TEST_ANYTHING=1 -- \
    --config "$tmp/epd.yaml" --set model.topk=6 --print-config
expect_rc "precedence" 0
expect_line "precedence" "$tmp/out" "model.topk = 6  # cli"
expect_line "precedence" "$tmp/out" "model.num_experts = 128  # env EPD_MODEL_NUM_EXPERTS"
expect_line "precedence" "$tmp/out" "socket.mode = 0600  # $tmp/epd.yaml:6"
expect_line "precedence" "$tmp/out" "log.level = info  # default"
expect_grep "unknown variable" "$tmp/err" "epd: warning: unknown environment variable EPD_MODLE_TOPK"
grep -q "EPD_TEST_ANYTHING" "$tmp/err" && fail "EPD_TEST_ANYTHING was warned about"

# 5. A bad value in the file: refused with file:line and what is allowed.
printf 'dispatch:\n  dtype: fp8\n  transport: ucx\n' >"$tmp/bad.yaml"
epd_env -- --config "$tmp/bad.yaml" --print-config
[[ $rc -ne 0 && $rc -lt 128 ]] || fail "bad YAML value: exit $rc"
expect_grep "bad YAML value" "$tmp/err" "$tmp/bad.yaml:3"
expect_grep "bad YAML value" "$tmp/err" "auto|mpi|nccl"

# A missing file: refused, naming it.
epd_env -- --config "$tmp/nope.yaml" --print-config
[[ $rc -ne 0 && $rc -lt 128 ]] || fail "missing file: exit $rc"
expect_grep "missing file" "$tmp/err" "$tmp/nope.yaml"

# 6. --help: usage, the graceful stop, the settings table.
epd_env -- --help
expect_rc "--help" 0
expect_grep "--help" "$tmp/out" "SIGUSR1"
expect_grep "--help" "$tmp/out" "EPD_DISPATCH_MAX_TOKENS_PER_REQUEST"

# An unknown option is refused.
epd_env -- --no-such-option
[[ $rc -ne 0 && $rc -lt 128 ]] || fail "unknown option: exit $rc"
expect_grep "unknown option" "$tmp/err" "--no-such-option"

if [[ $failures -ne 0 ]]; then
    echo "$failures check(s) failed"
    exit 1
fi
echo "config_cli: all checks passed"
