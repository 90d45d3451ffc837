#!/usr/bin/env bash
# The soak (issue 20; not part of make check): a 2-rank daemon under N clients for M minutes of
# mixed good and bad traffic (tests/soak/soak.py): good requests checked against the reference,
# malformed frames, partial frames abandoned, slow frames, idle connections, connect/disconnect
# storms, and one rank SIGSTOPped and continued now and then. At the end, per rank: accepted =
# answered + discarded, nothing left in the buffers, RSS within 20% of where it started; then the
# graceful stop must exit 0 with nothing unanswered.
#   tests/soak/soak.sh [CLIENTS] [MINUTES]       (defaults: 8 clients, 10 minutes)
source "$(dirname "$0")/../integration/daemon_lib.bash"

clients=${1:-8}
minutes=${2:-10}
need=$((clients * 8 + 256))
if (($(ulimit -n) < need)); then ulimit -n "$need" 2>/dev/null || true; fi

epd_start 2 --set model.hidden=256 --set model.num_experts=16 --set model.topk=4 \
    --set dispatch.max_tokens_per_request=256 --set socket.max_frame_bytes=16777216 \
    --set socket.max_buffered_bytes=25165824 --set socket.idle_timeout_ms=3000 \
    --set socket.frame_timeout_ms=2000 --set dispatch.stall_warn_ms=1000 \
    --set dispatch.step_timeout_ms=30000
PYTHONPATH=tests/integration python3 tests/soak/soak.py --check "$CHECK" --clients "$clients" \
    --minutes "$minutes" "$(sock 0)" "$(sock 1)" || die "the soak's checks failed"
epd_stop
if grep -q "never answered" "$EPD_LOG"; then die "the drain left accepted requests unanswered"; fi
grep -E "drained: answered" "$EPD_LOG" | sed 's/^/  /'
echo "PASS: soak of $clients clients x $minutes min"
