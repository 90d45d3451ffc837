#!/usr/bin/env bash
# `make install` into a DESTDIR: binaries, library, both units, the launcher (its default MPIRUN
# and EPD filled in), man pages, docs, and the config in /etc/epd/ and /etc/default/epd — which a
# second install does not overwrite; `systemd-analyze security` of the installed template
# instance (printed, at most 4.0); `make uninstall` removes everything but the config.
set -u
BUILD=${BUILD:-build}
cd "$(dirname "$0")/../.."
fail() { echo "FAIL: $*"; exit 1; }
tmp=$(mktemp -d /tmp/epd-install.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
root=$tmp/root
inst() { make --no-print-directory -s BUILD="$BUILD" DESTDIR="$root" PREFIX=/usr/local "$@" >"$tmp/make.log" 2>&1 ||
    { cat "$tmp/make.log"; fail "make $* failed"; }; }

inst install
for f in usr/local/bin/epd usr/local/bin/epctl usr/local/lib/libepd.so.0 usr/local/include/epd.h \
         usr/local/lib/systemd/system/epd.service usr/local/lib/systemd/system/epd@.service \
         usr/local/libexec/epd/epd-launch usr/local/lib/tmpfiles.d/epd.conf \
         usr/local/lib/sysusers.d/epd.conf usr/local/share/man/man8/epd.8 \
         usr/local/share/man/man1/epctl.1 usr/local/share/doc/epd/operations.md \
         etc/epd/epd.yaml etc/default/epd; do
    [[ -f $root/$f ]] || fail "make install did not install /$f"
done
[[ -x $root/usr/local/libexec/epd/epd-launch ]] || fail "the launcher is not executable"
grep -q '@MPIRUN@\|@EPD@' "$root/usr/local/libexec/epd/epd-launch" && fail "the launcher's defaults are not filled in"
grep -q '^EPD=${EPD:-/usr/local/bin/epd}$' "$root/usr/local/libexec/epd/epd-launch" || fail "launcher EPD"
grep -qx 'ExecStart=/usr/local/libexec/epd/epd-launch /etc/epd/%i.yaml' \
    "$root/usr/local/lib/systemd/system/epd@.service" || fail "the installed template's ExecStart"
"$root/usr/local/bin/epd" --config "$root/etc/epd/epd.yaml" --print-config >/dev/null ||
    fail "the installed /etc/epd/epd.yaml is not a valid configuration"

# the operator's config survives a second install
echo "# mine" >>"$root/etc/epd/epd.yaml"
echo "MPI_RANKS=3" >>"$root/etc/default/epd"
inst install
grep -q "kept $root/etc/epd/epd.yaml" "$tmp/make.log" || fail "install did not say it kept the config"
tail -n 1 "$root/etc/epd/epd.yaml" | grep -qx "# mine" || fail "install overwrote /etc/epd/epd.yaml"
tail -n 1 "$root/etc/default/epd" | grep -qx "MPI_RANKS=3" || fail "install overwrote /etc/default/epd"

if command -v systemd-analyze >/dev/null 2>&1; then
    score=$(systemd-analyze security --offline=true --root="$root" --no-pager epd@model.service 2>&1 |
            sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p')
    [[ -n $score ]] || fail "systemd-analyze security of the installed epd@model.service gave no score"
    echo "systemd-analyze security --offline=true --root=DESTDIR epd@model.service: $score"
    awk -v s="$score" 'BEGIN { exit !(s <= 4.0) }' || fail "installed unit exposure $score > 4.0"
fi

inst uninstall
left=$(cd "$root" && find . -type f | sort | tr '\n' ' ')
[[ $left == "./etc/default/epd ./etc/epd/epd.yaml " ]] || fail "after uninstall: $left"
echo "PASS: install (config kept on reinstall), installed unit's exposure, uninstall"
