#!/usr/bin/env bash
# Installs the Debian 12 / Ubuntu 24.04 packages that epd's build and tests need, idempotently.
# As root it runs apt-get; otherwise it prints the command and fails.
#   scripts/deps.sh            install what is missing
#   scripts/deps.sh --list     print the package list
set -euo pipefail

packages=(
    build-essential pkg-config make
    openmpi-bin libopenmpi-dev          # MPI with the UCX PML
    libevent-dev libyaml-dev libcjson-dev libcmocka-dev
    clang                               # libFuzzer harness (make fuzz)
    procps psmisc                       # ps, pkill, killall in the integration tests
    systemd                             # systemd-analyze verify/security of the units
    prometheus                          # promtool check metrics on a live /metrics
    man-db                              # man -l on the man pages
    iproute2                            # ip netns: the two-node test
    python3                             # the tests' reference checks and helpers
    python3-numpy python3-setuptools    # the Python client package (python/) and its tests;
                                        # scripts/make-test-model.py (the ffn test model)
    python3-pip                         # make install of the Python package
    python3-torch                       # the external experts example's worker on CPU
                                        # (tests/integration/external_example.sh); left out
                                        # where /usr/bin/python3 already imports a torch
)

if [[ "${1:-}" == "--list" ]]; then
    printf '%s\n' "${packages[@]}"
    exit 0
fi

missing=()
for p in "${packages[@]}"; do
    if [[ $p == python3-torch ]] && /usr/bin/python3 -c 'import torch' >/dev/null 2>&1; then
        continue
    fi
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
    exit 0
fi

echo "epd: installing missing packages: ${missing[*]}"
if [[ $(id -u) -ne 0 ]]; then
    echo "epd: not root; run this and try again:" >&2
    echo "    sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
