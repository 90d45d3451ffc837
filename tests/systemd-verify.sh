#!/usr/bin/env bash
# Checks systemd/epd.service with `systemd-analyze verify` without installing anything: a copy of
# the unit whose ExecStart points at this tree's build/epd and at the mpirun found on PATH.
# Exit 0 pass, 77 skip (no systemd-analyze), anything else fail.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}

if ! command -v systemd-analyze >/dev/null 2>&1; then
    echo "SKIP: systemd-analyze is not installed"
    exit 77
fi
mpirun_path=$(command -v "${MPIRUN:-mpirun}" || true)
if [[ -z $mpirun_path ]]; then
    echo "SKIP: no mpirun to point ExecStart at"
    exit 77
fi
epd_path=$(realpath -m "$BUILD/epd")

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
sed -e "s|/usr/bin/mpirun|$mpirun_path|" -e "s|/usr/local/bin/epd|$epd_path|" \
    systemd/epd.service >"$tmp/epd.service"
grep -q "^ExecStart=$mpirun_path " "$tmp/epd.service"

# The unit must keep the properties DESIGN.md and STYLE.md rely on.
for want in 'Type=notify' 'NotifyAccess=all' 'KillSignal=SIGUSR1' 'RuntimeDirectory=epd' \
            'RuntimeDirectoryPreserve=restart' 'LimitMEMLOCK=infinity' 'User=epd' \
            'EnvironmentFile=-/etc/default/epd' 'Restart=on-failure' 'DevicePolicy=closed'; do
    if ! grep -qx "$want" systemd/epd.service; then
        echo "epd.service lacks '$want'"
        exit 1
    fi
done
if grep -q '^PrivateDevices=yes\|^PrivateDevices=true\|^KillMode=' systemd/epd.service; then
    echo "epd.service must not set PrivateDevices (hides the GPUs) nor change KillMode"
    exit 1
fi

# systemd-analyze prints problems (unknown keys, bad values, missing binaries) and exits non-zero
# on errors; any remark at all fails the test.
out=$(SYSTEMD_LOG_LEVEL=warning systemd-analyze verify --man=no "$tmp/epd.service" 2>&1) && rc=0 || rc=$?
if [[ $rc -ne 0 || -n $out ]]; then
    echo "$out"
    echo "systemd-analyze verify failed (exit $rc)"
    exit 1
fi
echo "systemd-analyze verify: epd.service OK"
