#!/usr/bin/env bash
# 200 clients connected at once to one rank of a 2-rank daemon, each with a few requests whose
# results must equal the reference; the rank counts them all at the same time.
source "$(dirname "$0")/daemon_lib.bash"

clients=200
need=$((clients + 64))
if (($(ulimit -n) < need)); then
    ulimit -n "$need" 2>/dev/null || skip "cannot raise the open-files limit to $need"
fi

epd_start 2 --set model.hidden=256 --set model.num_experts=16 --set model.topk=4 \
    --set dispatch.max_tokens_per_request=64
timeout 60 "$CHECK" --socket "$(sock 0)" --clients $clients --requests 3 --max-tokens 8 \
    --window 2 --hold-ms 1000 --expect-clients $clients --seed 21 \
    || die "$clients concurrent clients"
total=$($WIRE stat "$(sock 0)" server.clients_total)
((total >= clients)) || die "rank 0 accepted only $total clients"
epd_stop
echo "PASS: $clients concurrent clients on one rank, every result equal to the reference"
