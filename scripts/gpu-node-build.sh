#!/usr/bin/env bash
# Builds epd on an air-gapped GPU node from a checkout that carries .deps/ (scripts/offline-deps.sh
# bundle) and, optionally, .cuda-mpi/epd-cuda-mpi.tar.gz (scripts/cuda-mpi.sh). Prints the
# environment to source afterwards. Usage: scripts/gpu-node-build.sh [make targets...]
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=/tmp/epd-deps
if ! pkg-config --exists yaml-0.1 libcjson cmocka 2>/dev/null; then
    scripts/offline-deps.sh install .deps "$prefix" >/dev/null
    export PKG_CONFIG_PATH=$prefix/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
    export LIBRARY_PATH=$prefix/lib${LIBRARY_PATH:+:$LIBRARY_PATH}
    export LD_LIBRARY_PATH=$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
if [[ -f .cuda-mpi/epd-cuda-mpi.tar.gz && ! -d /opt/epd-cuda-mpi ]]; then
    tar -C /opt -xzf .cuda-mpi/epd-cuda-mpi.tar.gz
fi
echo "export PKG_CONFIG_PATH=${PKG_CONFIG_PATH:-} LIBRARY_PATH=${LIBRARY_PATH:-} LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}" >/tmp/epd-env.sh
make -j"$(nproc)" -k "$@"
