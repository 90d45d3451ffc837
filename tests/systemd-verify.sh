#!/usr/bin/env bash
# Checks systemd/epd.service and systemd/epd@.service without installing anything:
#   - `systemd-analyze verify` of copies whose ExecStart points at this tree's launcher (any remark
#     fails), epd@.service as the instance epd@check.service;
#   - the properties DESIGN.md and STYLE.md rely on, and a comment above every hardening option;
#   - `systemd-analyze security --offline` of each: exposure at most 4.0 (the score is printed);
#   - the launcher systemd/epd-launch: MPI_RANKS=auto from nvidia-smi -L, else /dev/nvidia[0-9]*
#     (here: none), else 1 said clearly; MPIRUN, MPI_EXTRA_ARGS and the config reach mpirun.
# Exit 0 pass, 77 skip (no systemd-analyze), anything else fail.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v systemd-analyze >/dev/null 2>&1; then
    echo "SKIP: systemd-analyze is not installed (scripts/deps.sh installs the package systemd)"
    exit 77
fi
launcher=$(realpath systemd/epd-launch)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

for unit in epd.service epd@.service; do
    f=systemd/$unit
    sed -e "s|/usr/local/libexec/epd/epd-launch|$launcher|" "$f" >"$tmp/$unit"
    grep -q "^ExecStart=$launcher " "$tmp/$unit" || fail "$unit: ExecStart is not the launcher"
    for want in 'Type=notify' 'NotifyAccess=all' 'KillSignal=SIGUSR1' \
                'RuntimeDirectoryPreserve=restart' 'LimitMEMLOCK=infinity' 'User=epd' \
                'EnvironmentFile=-/etc/default/epd' 'Restart=on-failure' 'DevicePolicy=closed' \
                'NoNewPrivileges=yes' 'CapabilityBoundingSet='; do
        grep -qx "$want" "$f" || fail "$unit lacks '$want'"
    done
    if grep -q '^PrivateDevices=yes\|^PrivateDevices=true\|^KillMode=\|^MemoryDenyWriteExecute=yes' "$f"; then
        fail "$unit must not hide the GPUs (PrivateDevices), change KillMode, or forbid the CUDA JIT"
    fi
    # every option after the hardening header has a comment line right above it (or above the
    # run of options it belongs to)
    awk '/^# ---- hardening/ { on = 1; next } /^\[/ { on = 0 }
         on && /^[A-Za-z]/ { if (prev !~ /^#/ && prev !~ /^[A-Za-z]/) { print FILENAME ": " $0; bad = 1 } }
         { prev = $0 } END { exit bad }' "$f" || fail "$unit: a hardening option without a comment"
done
grep -qx 'RuntimeDirectory=epd/%i' systemd/epd@.service || fail "epd@.service: RuntimeDirectory"
grep -qx 'ExecStart=/usr/local/libexec/epd/epd-launch /etc/epd/%i.yaml' systemd/epd@.service ||
    fail "epd@.service: the instance's config is not /etc/epd/%i.yaml"
grep -qx 'Environment=EPD_SOCKET_PATH=/run/epd/%i/epd-%%r.sock' systemd/epd@.service ||
    fail "epd@.service: the sockets are not in /run/epd/%i/"

# systemd-analyze prints problems (unknown keys, bad values, missing binaries) and exits non-zero
# on errors; any remark at all fails the test.
for unit in epd.service epd@check.service; do
    out=$(cd "$tmp" && SYSTEMD_LOG_LEVEL=warning systemd-analyze verify --man=no "$tmp/$unit" 2>&1) &&
        rc=0 || rc=$?
    if [[ $rc -ne 0 || -n $out ]]; then
        echo "$out"
        fail "systemd-analyze verify $unit (exit $rc)"
    fi
    echo "systemd-analyze verify: $unit OK"
    score=$(cd "$tmp" && systemd-analyze security --offline=true --no-pager "$unit" 2>&1 |
            sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p')
    [[ -n $score ]] || fail "systemd-analyze security $unit printed no score"
    echo "systemd-analyze security: $unit exposure $score"
    awk -v s="$score" 'BEGIN { exit !(s <= 4.0) }' || fail "$unit: exposure $score > 4.0"
done

# The launcher, with a fake mpirun that prints its arguments and fake nvidia-smi on PATH.
mkdir -p "$tmp/bin"
printf '#!/bin/sh\necho "mpirun $*"\n' >"$tmp/bin/mpirun"
printf '#!/bin/sh\n[ "$1" = -L ] && printf "GPU 0: H200 (UUID: a)\\nGPU 1: H200 (UUID: b)\\nGPU 2: H200 (UUID: c)\\n"\n' \
    >"$tmp/bin/nvidia-smi"
chmod +x "$tmp/bin/mpirun" "$tmp/bin/nvidia-smi"
launch() { env -u INVOCATION_ID EPD_DEFAULTS=$tmp/defaults EPD=/opt/epd "$@" sh "$launcher" /etc/epd/m.yaml 2>&1; }
: >"$tmp/defaults"
out=$(launch PATH="$tmp/bin:$PATH" MPIRUN="$tmp/bin/mpirun")
grep -q "^mpirun -np 3 --bind-to none .* /opt/epd --config /etc/epd/m.yaml$" <<<"$out" ||
    fail "MPI_RANKS=auto with 3 GPUs in nvidia-smi -L: $out"
grep -q "3 GPUs listed by nvidia-smi -L" <<<"$out" || fail "the launcher did not say why 3: $out"
rm "$tmp/bin/nvidia-smi"
if ! ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
    out=$(launch PATH="$tmp/bin:/usr/bin:/bin" MPIRUN="$tmp/bin/mpirun")
    grep -q "^mpirun -np 1 " <<<"$out" && grep -q "no GPU found" <<<"$out" ||
        fail "no GPU: expected 1 rank said clearly: $out"
fi
printf 'MPI_RANKS=2\nMPI_EXTRA_ARGS="--hostfile /etc/epd/hosts -x FOO"\nMPIRUN=%s\n' "$tmp/bin/mpirun" \
    >"$tmp/defaults"
out=$(launch PATH="$tmp/bin:$PATH")
grep -q "^mpirun -np 2 --bind-to none --mca pml ucx --mca osc ucx --hostfile /etc/epd/hosts -x FOO /opt/epd" <<<"$out" ||
    fail "/etc/default/epd's MPIRUN, MPI_RANKS, MPI_EXTRA_ARGS: $out"
printf 'MPI_RANKS=two\n' >"$tmp/defaults"
out=$(launch PATH="$tmp/bin:$PATH" MPIRUN="$tmp/bin/mpirun") && fail "MPI_RANKS=two was accepted: $out"
grep -q "MPI_RANKS='two' is not a positive number or auto" <<<"$out" || fail "bad MPI_RANKS: $out"
echo "launcher: MPI_RANKS=auto (nvidia-smi, /dev, 1), /etc/default/epd, bad values refused: OK"
