#!/usr/bin/env bash
# Issue 25's payload read path on this machine's CPUs (no GPU needed): build/read-bench, feed
# (socket -> buffer -> payload, the path before) against the window (socket -> payload) and the
# daemon's window+spin, at 128 and 1024 V3 tokens, with the socket's default send buffer and with
# 4 MiB (what libepd asks for; the kernel caps it at net.core.wmem_max, printed first). Each ratio
# is against feed in the same run.
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
[[ -x $BUILD/read-bench ]] || { echo "FAIL: $BUILD/read-bench is not built (make)"; exit 1; }
echo "net.core.wmem_max = $(cat /proc/sys/net/core/wmem_max), wmem_default = $(cat /proc/sys/net/core/wmem_default)"
pin=(); (($(nproc) >= 2)) && pin=(--pin)
rc=0
for tokens in 128 1024; do
    frames=$((tokens == 128 ? 200 : 30))
    for sndbuf in 0 4194304; do
        args=(--tokens "$tokens" --frames "$frames" --rounds 9 "${pin[@]}")
        ((sndbuf > 0)) && args+=(--sndbuf "$sndbuf")
        timeout 120 "$BUILD/read-bench" "${args[@]}" || rc=1
    done
done
exit $rc
