#!/usr/bin/env bash
# epd(8) and epctl(1) render with `man -l` without a single groff warning; epd(8) lists every
# setting of `epd --print-config` and epctl(1) every command of `epctl --help`.
set -u
BUILD=${BUILD:-build}
cd "$(dirname "$0")/../.."
command -v man >/dev/null 2>&1 || { echo "SKIP: man is not installed (scripts/deps.sh installs man-db)"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
for page in "$BUILD/man/epd.8" "$BUILD/man/epctl.1"; do
    [[ -f $page ]] || fail "$page is not built"
    # man-db drops groff's stderr unless MAN_KEEP_STDERR is set
    warnings=$(MAN_KEEP_STDERR=1 MANWIDTH=100 man --warnings=all -l "$page" 2>&1 >/dev/null)
    [[ -z $warnings ]] || fail "$page: $warnings"
    text=$(MANWIDTH=100 man -l "$page" 2>/dev/null)
    [[ $(wc -l <<<"$text") -gt 40 ]] || fail "$page renders to almost nothing"
done
epd_text=$(MANWIDTH=200 man -l "$BUILD/man/epd.8")
for key in $("$BUILD/epd" --print-config | awk '{ print $1 }'); do
    grep -q "^ *$key\$" <<<"$epd_text" || fail "epd(8) does not list the setting $key"
done
epctl_text=$(MANWIDTH=200 man -l "$BUILD/man/epctl.1")
for cmd in $("$BUILD/epctl" --help | awk '/^commands:/ { on = 1; next } /^$/ { on = 0 } on { print $1 }'); do
    grep -Eq "^ +$cmd( |\$)" <<<"$epctl_text" || fail "epctl(1) does not describe the command $cmd"
done
echo "PASS: man -l epd.8 and epctl.1 without warnings; every setting and command is in them"
