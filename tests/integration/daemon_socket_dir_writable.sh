#!/usr/bin/env bash
# Guards issue 20 item 2: a socket directory that other users may write is refused at start-up
# (they could rename the socket away and listen in its place), unless it is sticky and owned by
# root or the daemon's user (like /tmp); a directory owned by another user is refused too.
source "$(dirname "$0")/daemon_lib.bash"

model=(--set model.hidden=256 --set model.num_experts=16 --set model.topk=4)

expect_start_failure() {
    local dir=$1 pattern=$2
    epd_launch 1 "$TMP/fail.log" "${model[@]}" --set "socket.path=$dir/epd-%r.sock"
    epd_wait_exit 30
    [[ $EPD_RC != 124 ]] || die "a failed start-up still runs after 30 s"
    [[ $EPD_RC != 0 ]] || die "start-up in $dir ($(stat -c %a "$dir")) succeeded"
    grep -q -- "$pattern" "$TMP/fail.log" || { cat "$TMP/fail.log"; die "no '$pattern' in the log"; }
    [[ ! -e $dir/epd-0.sock ]] || die "a socket was made in $dir"
    echo "refused as expected: $(grep -m1 -o "start-up failed: .*" "$TMP/fail.log")"
}

expect_start() {
    local dir=$1
    epd_launch 1 "$TMP/epd.log" "${model[@]}" --set "socket.path=$dir/epd-%r.sock"
    local deadline=$((SECONDS + 30))
    until [[ -S $dir/epd-0.sock ]] && $WIRE health "$dir/epd-0.sock" >/dev/null 2>&1; do
        kill -0 "$EPD_PID" 2>/dev/null || die "the daemon did not start in $dir ($(stat -c %a "$dir"))"
        ((SECONDS < deadline)) || die "no socket in $dir within 30 s"
        sleep 0.1
    done
    epd_stop
    echo "accepted as expected: $dir (mode $(stat -c %a "$dir"))"
}

for mode in 0777 0770 0733; do
    echo "== directory mode $mode"
    mkdir -m "$mode" "$TMP/d$mode"
    chmod "$mode" "$TMP/d$mode"
    expect_start_failure "$TMP/d$mode" "writable by other users"
done

echo "== sticky 1777, owned by the daemon's user"
mkdir "$TMP/sticky" && chmod 1777 "$TMP/sticky"
expect_start "$TMP/sticky"

echo "== 0700 and 0750, owned by the daemon's user"
mkdir -m 0700 "$TMP/private" && expect_start "$TMP/private"
mkdir -m 0750 "$TMP/group" && expect_start "$TMP/group"

if [[ $(id -u) == 0 ]]; then
    echo "== owned by another user (nobody), 0755"
    mkdir -m 0755 "$TMP/other" && chown 65534 "$TMP/other"
    expect_start_failure "$TMP/other" "belongs to uid 65534"
    echo "== sticky 1777 but owned by another user"
    mkdir "$TMP/sticky-other" && chmod 1777 "$TMP/sticky-other" && chown 65534 "$TMP/sticky-other"
    expect_start_failure "$TMP/sticky-other" "belongs to uid 65534"
else
    echo "(not root: the directories owned by another user are not tried)"
fi
echo "PASS: socket directories writable by others refused, sticky and private ones accepted"
