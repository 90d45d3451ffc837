#!/usr/bin/env bash
# The ffn experts on one GPU, in one call (issue 17's "Done when"): build/tests/gpu/test_ffn_cuda
# (every weight format, wire, partials and tuning against the host reference),
# tests/gpu/daemon_ffn_gpu.sh (the daemon through its sockets, 1 rank and 2 ranks on GPU 0), and
# epd --bench at E_local 32, H 7168, I 2048 with 1..512 rows per expert, BF16 and FP8 block
# weights, every tuning of the sweep (the daemon's default first). Then a summary: one PASS/FAIL
# line per "Done when" line, for the default tuning and for the best tuning of the sweep.
# Build first: scripts/gpu-node-build.sh all; source /tmp/epd-env.sh
# Usage: tests/gpu/ffn_gpu.sh [--skip-tests] [--tokens LIST] [--iters N]
#   logs in $OUT (or build/ffn-gpu): test_ffn_cuda.log, daemon_ffn_gpu.log, bench.log
# The GEMM kernel of our own (tuning `kernel`, gpu/ffn_gemm.cu: cp.async pipeline, split-K):
#   build/tests/gpu/test_ffn_cuda      its layout and kernel checks first ("PASS  mma layout
#                                      check ...", "PASS  GEMM kernel ..., split none|fixed|auto
#                                      (N K ranges used): 0 of N outputs wrong"), then every
#                                      case with every tuning; ends "N passed, 0 failed"
#   bash tests/gpu/ffn_gpu.sh --skip-tests   the sweep with the kernel tunings (kernel,
#                                      kernel,split=1|2|4, kernel,prefetch=4|8, kernel,upto=..)
#                                      beside the default; the summary's kernel table says where
#                                      `kernel` wins (then epd_ffn_cuda_default_tuning's kernel
#                                      lines)
# The Hopper kernel (tuning `wgmma`, gpu/ffn_gemm_wgmma.cu): its checks and tunings in
#   test_ffn_cuda ("PASS  wgmma GEMM kernel ..."), the sweep's wgmma* tunings in the kernel
#   tables; tests/gpu/ffn_wgmma_gpu.sh runs them alone first (seconds)
# FFN_BENCH_TUNINGS="name name ..." limits the bench's sweep to those tunings (and the default)
set -uo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
out=${OUT:-build/ffn-gpu}
mkdir -p "$out"
tokens=4,8,16,32,64,128,256,512,1024,2048 # rows per expert = tokens * 8 / 32: 1 .. 512
iters=20
skip_tests=0
while (($#)); do
    case $1 in
    --skip-tests) skip_tests=1 ;;
    --tokens) tokens=$2; shift ;;
    --iters) iters=$2; shift ;;
    *) echo "usage: $0 [--skip-tests] [--tokens LIST] [--iters N]" >&2; exit 2 ;;
    esac
    shift
done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
[[ -f /tmp/epd-env.sh ]] && source /tmp/epd-env.sh
nvidia-smi -L 2>/dev/null | grep -q '^GPU ' || { echo "SKIP: no GPU"; exit 77; }
status=0
summary=()

if ((!skip_tests)); then
    build/tests/gpu/test_ffn_cuda >"$out/test_ffn_cuda.log" 2>&1
    rc=$?
    grep -E '^(FAIL|PASS)' "$out/test_ffn_cuda.log" | grep -v '^PASS' | head -n 20
    summary+=("$( ((rc == 0)) && echo PASS || echo FAIL)  test_ffn_cuda: $(tail -n 1 "$out/test_ffn_cuda.log")")
    ((rc == 0)) || status=1
    env BUILD=build MPIRUN=mpirun bash tests/gpu/daemon_ffn_gpu.sh >"$out/daemon_ffn_gpu.log" 2>&1
    rc=$?
    summary+=("$( ((rc == 0)) && echo PASS || echo FAIL)  daemon_ffn_gpu.sh: $(grep -cE '^ok ' "$out/daemon_ffn_gpu.log") cases ok; $(tail -n 1 "$out/daemon_ffn_gpu.log" | cut -c1-120)")
    ((rc == 0)) || status=1
fi

mpirun -np 1 --bind-to none --mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any \
    build/epd --bench --set experts.kind=ffn --bench-weights random --set model.num_experts=32 \
    --set model.hidden=7168 --set model.intermediate=2048 --set model.topk=8 \
    --set device.backend=cuda --bench-tokens "$tokens" --bench-iters "$iters" >"$out/bench.log" 2>&1
rc=$?
((rc == 0)) || { summary+=("FAIL  bench: exit $rc ($(tail -n 1 "$out/bench.log"))"); status=1; }
# the table of the default tuning as printed (every tuning's rows are in bench.log), skips and
# errors, the baselines and the accuracy
grep -E '^(weights|bf16 +default|fp8-block +default|accuracy|read baseline)|skipped|rror' \
    "$out/bench.log" | head -n 60
grep -E '^ffn-baseline' "$out/bench.log"

# Done when (one H200, one rank, E_local 32, H 7168, I 2048):
#   bf16, <= 128 rows/expert: experts <= 1.25 x weight read     (worst vs_read over those rows)
#   bf16, 512 rows/expert: >= 0.75 x the dense GEMM's TFLOP/s   (vs_dense)
#   fp8-block: <= 0.6 x the bf16 experts at <= 128 rows/expert  (worst fp8_over_bf16)
#   accuracy of each format printed, within DESIGN.md section 9
awk -v status_file="$out/status" '
function kv(line, key,   m) { if (match(line, key "=[^ ]+")) return substr(line, RSTART + length(key) + 1, RLENGTH - length(key) - 1); return "" }
/^ffn-result / {
    w = kv($0, "weights"); t = kv($0, "tuning"); r = kv($0, "rows_per_expert") + 0
    tunings[t] = 1
    if (w == "bf16" && r <= 128) { v = kv($0, "vs_read") + 0; if (!((w SUBSEP t) in rd) || v > rd[w, t]) rd[w, t] = v }
    if (w == "bf16" && r == 512) dense[t] = kv($0, "vs_dense") + 0
    if (w == "fp8-block" && r <= 128) { v = kv($0, "fp8_over_bf16"); if (v != "nan") { v += 0; if (!(t in f8) || v > f8[t]) f8[t] = v } }
    # the fastest tuning per format and rows (for fp8 at its best over bf16 at its best)
    if (r <= 128) { us = kv($0, "experts_us") + 0; rows[r] = 1; if (!((w SUBSEP r) in fast) || us < fast[w, r]) { fast[w, r] = us; fastt[w, r] = t } }
}
/^ffn-accuracy / { acc[kv($0, "weights")] = kv($0, "worst_rel"); tol[kv($0, "weights")] = kv($0, "tolerance") }
function line(ok, text) { printf "%s  %s\n", ok ? "PASS" : "FAIL", text; if (!ok) bad = 1 }
# the same for a tuning other than the default: what switching the default would give (the exit
# status stays that of the default)
function info(ok, text) { printf "%s  %s\n", ok ? "PASS (not the default)" : "FAIL (not the default)", text }
END {
    # the best tuning per criterion (lowest vs_read, highest vs_dense, lowest fp8/bf16)
    for (t in tunings) {
        if (("bf16" SUBSEP t) in rd && (br == "" || rd["bf16", t] < rd["bf16", br])) br = t
        if ((t in dense) && (bd == "" || dense[t] > dense[bd])) bd = t
        if ((t in f8) && (bf == "" || f8[t] < f8[bf])) bf = t
    }
    n = split("default", names)
    for (i = 1; i <= n; i++) {
        t = names[i]
        line((("bf16" SUBSEP t) in rd) && rd["bf16", t] <= 1.25, sprintf("bf16 <= 128 rows/expert: experts / weight read, worst %.2f (target <= 1.25) [%s]", rd["bf16", t], t))
        line((t in dense) && dense[t] >= 0.75, sprintf("bf16 512 rows/expert: experts TFLOP/s / dense GEMM %.2f (target >= 0.75) [%s]", dense[t], t))
        line((t in f8) && f8[t] <= 0.6, sprintf("fp8-block <= 128 rows/expert: fp8 / bf16, worst %.2f (target <= 0.6) [%s]", f8[t], t))
    }
    printf "best of the sweep: vs_read %.2f [%s]; vs_dense %.2f [%s]; fp8/bf16 %.2f [%s]\n", rd["bf16", br], br, dense[bd], bd, f8[bf], bf
    if (br != "" && br != "default") info(rd["bf16", br] <= 1.25, sprintf("bf16 <= 128 rows/expert: experts / weight read, worst %.2f (target <= 1.25) [%s]", rd["bf16", br], br))
    if (bd != "" && bd != "default") info(dense[bd] >= 0.75, sprintf("bf16 512 rows/expert: experts TFLOP/s / dense GEMM %.2f (target >= 0.75) [%s]", dense[bd], bd))
    if (bf != "" && bf != "default") info(f8[bf] <= 0.6, sprintf("fp8-block <= 128 rows/expert: fp8 / bf16, worst %.2f (target <= 0.6) [%s]", f8[bf], bf))
    # each format at its fastest tuning per row count (they may differ: the daemon could pick per format)
    worst = -1; wr = ""
    for (r in rows) if (("fp8-block" SUBSEP r) in fast && ("bf16" SUBSEP r) in fast) { v = fast["fp8-block", r] / fast["bf16", r]; if (v > worst) { worst = v; wr = r } }
    if (wr != "") info(worst <= 0.6, sprintf("fp8-block <= 128 rows/expert: fp8 at its fastest tuning / bf16 at its fastest, worst %.2f at %s rows/expert [fp8 %s, bf16 %s] (target <= 0.6)", worst, wr, fastt["fp8-block", wr], fastt["bf16", wr]))
    for (w in acc) line(acc[w] + 0 <= tol[w] + 0, sprintf("accuracy %s weights: worst relative L2 %s (tolerance %s)", w, acc[w], tol[w]))
    if (!("bf16" in acc) || !("fp8-block" in acc)) line(0, "accuracy of both weight formats printed")
    print bad ? 1 : 0 > status_file
}' "$out/bench.log" >"$out/summary_bench.txt"
[[ $(cat "$out/status" 2>/dev/null) == 0 ]] || status=1

# The summary as Markdown (also in $out/summary.md), to paste into docs/results.md as it is
{
    echo "---- summary (logs in $out; this block is $out/summary.md)"
    echo
    echo "Device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1); commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)."
    grep -E '^ffn-baseline' "$out/bench.log" | awk '{ printf "Same-run read baseline: %s\n", $0 }' | sed 's/ffn-baseline //'
    echo
    ((${#summary[@]})) && printf '%s\n' "${summary[@]}" | sed 's/^/- /'
    sed 's/^/- /' "$out/summary_bench.txt"
    # tunings this GPU's cuBLAS cannot run (set_tuning refused them), with the reason
    grep -E '^[a-z0-9-]+ +[a-z0-9=,_]+ +skipped: ' "$out/bench.log" | sed -E 's/^([a-z0-9-]+) +([a-z0-9=,_]+) +skipped: /- skipped: \1 \2: /'
    echo
    echo "Default tuning (used: experts with rows; vs_used: over the read of their weights only):"
    echo
    awk '
function kv(line, key) { if (match(line, key "=[^ ]+")) return substr(line, RSTART + length(key) + 1, RLENGTH - length(key) - 1); return "" }
BEGIN { print "| weights | rows/expert | used | experts_us | host_us | vs_read | vs_used | vs_dense | fp8/bf16 |"; print "|---|---:|---:|---:|---:|---:|---:|---:|---:|" }
/^ffn-result / && kv($0, "tuning") == "default" {
    f = kv($0, "fp8_over_bf16")
    printf "| %s | %s | %s | %s | %s | %.2f | %.2f | %.2f | %s |\n", kv($0, "weights"), kv($0, "rows_per_expert") + 0, kv($0, "experts_used"), kv($0, "experts_us"), kv($0, "host_us"), kv($0, "vs_read"), kv($0, "vs_used"), kv($0, "vs_dense"), f == "nan" ? "-" : sprintf("%.2f", f)
}' "$out/bench.log"
    echo
    echo "Every tuning (worst over <= 128 rows/expert, except vs_dense at 512):"
    echo
    awk '
function kv(line, key) { if (match(line, key "=[^ ]+")) return substr(line, RSTART + length(key) + 1, RLENGTH - length(key) - 1); return "" }
/^ffn-result / {
    w = kv($0, "weights"); t = kv($0, "tuning"); r = kv($0, "rows_per_expert") + 0
    if (!(t in seen)) { seen[t] = 1; order[++n] = t }
    if (w == "bf16" && r <= 128) { v = kv($0, "vs_read") + 0; if (!(t in rd) || v > rd[t]) rd[t] = v; u = kv($0, "vs_used") + 0; if (!(t in ru) || u > ru[t]) ru[t] = u }
    if (w == "bf16" && r == 512) dn[t] = kv($0, "vs_dense") + 0
    if (w == "fp8-block" && r <= 128) { v = kv($0, "fp8_over_bf16"); if (v != "nan") { v += 0; if (!(t in f8) || v > f8[t]) f8[t] = v } }
    if (w == "fp8-block" && r <= 128) { v = kv($0, "vs_read") + 0; if (!(t in fr) || v > fr[t]) fr[t] = v }
    # the experts and host times at 1 and 128 rows/expert
    if (r == 1 || r == 128) { us[w, t, r] = kv($0, "experts_us"); hs[w, t, r] = kv($0, "host_us") }
}
function cell(a, t) { return (t in a) ? sprintf("%.2f", a[t]) : "-" }
function tm(w, t, r) { return ((w SUBSEP t SUBSEP r) in us) ? sprintf("%.0f / %.0f", us[w, t, r], hs[w, t, r]) : "-" }
END {
    print "| tuning | bf16 vs_read | bf16 vs_used | bf16 vs_dense (512) | fp8/bf16 | fp8 vs_read | bf16 us / host us (1 row) | (128 rows) | fp8 us / host us (1 row) | (128 rows) |"
    print "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    for (i = 1; i <= n; i++) { t = order[i]; printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", t, cell(rd, t), cell(ru, t), cell(dn, t), cell(f8, t), cell(fr, t), tm("bf16", t, 1), tm("bf16", t, 128), tm("fp8-block", t, 1), tm("fp8-block", t, 128) }
}' "$out/bench.log"
    echo
    echo "The GEMM kernel of our own (tuning kernel) beside the default, per rows/expert (experts us; kernel/default < 1: the kernel wins; fp8/bf16 of the kernel against the kernel's bf16):"
    echo
    awk '
function kv(line, key) { if (match(line, key "=[^ ]+")) return substr(line, RSTART + length(key) + 1, RLENGTH - length(key) - 1); return "" }
/^ffn-result / {
    w = kv($0, "weights"); t = kv($0, "tuning"); r = kv($0, "rows_per_expert") + 0
    if (t != "default" && t != "kernel") next
    if (!(r in seen)) { seen[r] = 1; order[++n] = r }
    us[w, t, r] = kv($0, "experts_us") + 0; rd[w, t, r] = kv($0, "vs_read") + 0
}
function cell(w, t, r) { return ((w SUBSEP t SUBSEP r) in us) ? sprintf("%.1f", us[w, t, r]) : "-" }
function rat(a, b) { return (a > 0 && b > 0) ? sprintf("%.2f", a / b) : "-" }
END {
    print "| rows/expert | bf16 default | bf16 kernel | kernel/default | kernel vs_read | fp8 default | fp8 kernel | kernel/default | fp8/bf16 (kernel) |"
    print "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    for (i = 1; i <= n; i++) {
        r = order[i]
        printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", r, cell("bf16", "default", r), cell("bf16", "kernel", r), rat(us["bf16", "kernel", r], us["bf16", "default", r]), (("bf16" SUBSEP "kernel" SUBSEP r) in rd) ? sprintf("%.2f", rd["bf16", "kernel", r]) : "-", cell("fp8-block", "default", r), cell("fp8-block", "kernel", r), rat(us["fp8-block", "kernel", r], us["fp8-block", "default", r]), rat(us["fp8-block", "kernel", r], us["bf16", "kernel", r])
    }
}' "$out/bench.log"
    echo
    echo "Every kernel tuning (kernel: mma.sync, wgmma: the Hopper kernel) per rows/expert (experts us), the fastest against the default, and where each beats the default at every row count up to there (the kernel_max_rows / kernel_fp8_max_rows a switch would set):"
    echo
    awk '
function kv(line, key) { if (match(line, key "=[^ ]+")) return substr(line, RSTART + length(key) + 1, RLENGTH - length(key) - 1); return "" }
/^ffn-result / {
    w = kv($0, "weights"); t = kv($0, "tuning"); r = kv($0, "rows_per_expert") + 0
    if (t != "default" && t !~ /^(kernel|wgmma)/) next
    if (t != "default" && !(t in kseen)) { kseen[t] = 1; kt[++nk] = t }
    if (!(r in rseen)) { rseen[r] = 1; ro[++nr] = r }
    us[w, t, r] = kv($0, "experts_us") + 0
}
END {
    nw = split("bf16 fp8-block", ws)
    for (x = 1; x <= nw; x++) {
        w = ws[x]
        hdr = "| " w " rows/expert | default"; sep = "|---:|---:"
        for (i = 1; i <= nk; i++) { hdr = hdr " | " kt[i]; sep = sep "|---:" }
        print hdr " | fastest kernel / default |"; print sep "|---|"
        for (j = 1; j <= nr; j++) {
            r = ro[j]; line = "| " r " | " (((w SUBSEP "default" SUBSEP r) in us) ? sprintf("%.1f", us[w, "default", r]) : "-")
            best = ""; for (i = 1; i <= nk; i++) {
                t = kt[i]
                if ((w SUBSEP t SUBSEP r) in us) { line = line sprintf(" | %.1f", us[w, t, r]); if (best == "" || us[w, t, r] < us[w, best, r]) best = t } else line = line " | -"
            }
            d = us[w, "default", r]
            print line " | " ((best != "" && d > 0) ? sprintf("%.2f [%s]", us[w, best, r] / d, best) : "-") " |"
        }
        print ""
        for (i = 1; i <= nk; i++) {
            t = kt[i]; upto = 0
            for (j = 1; j <= nr; j++) { r = ro[j]; if (!((w SUBSEP t SUBSEP r) in us) || !((w SUBSEP "default" SUBSEP r) in us) || us[w, t, r] >= us[w, "default", r]) break; upto = r }
            printf "- %s %s: faster than the default at every rows/expert up to %s\n", w, t, upto ? upto : "none"
        }
        print ""
    }
}' "$out/bench.log"
    echo
    echo "The default tuning's GEMM plans up to 128 rows (autotune: the heuristic's first against the chosen, alone on the stream; GB/s of weights read):"
    echo
    awk '
function kv(line, key) { if (match(line, key "=[^ ]+")) return substr(line, RSTART + length(key) + 1, RLENGTH - length(key) - 1); return "" }
BEGIN { print "| weights | proj | rows | candidates | chosen | splitk | waves | heuristic_us | chosen_us | heuristic GB/s | chosen GB/s |"; print "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" }
/^ffn-plan / && kv($0, "tuning") == "default" && kv($0, "rows") + 0 <= 128 && kv($0, "batch") == "0" {
    printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", kv($0, "weights"), kv($0, "proj"), kv($0, "rows"), kv($0, "candidates"), kv($0, "chosen"), kv($0, "splitk"), kv($0, "waves"), kv($0, "heuristic_us"), kv($0, "chosen_us"), kv($0, "heuristic_GBps"), kv($0, "chosen_GBps")
}' "$out/bench.log"
    echo
    echo "The strided tuning's batched plans (runs of experts as one GEMM; the first 24):"
    echo
    awk '
function kv(line, key) { if (match(line, key "=[^ ]+")) return substr(line, RSTART + length(key) + 1, RLENGTH - length(key) - 1); return "" }
BEGIN { print "| weights | proj | rows | batch | tile | splitk | waves |"; print "|---|---|---:|---:|---:|---:|---:|" }
/^ffn-plan / && kv($0, "tuning") == "strided" && kv($0, "batch_mode") == "strided" && n++ < 24 {
    printf "| %s | %s | %s | %s | %s | %s | %s |\n", kv($0, "weights"), kv($0, "proj"), kv($0, "rows"), kv($0, "batch"), kv($0, "tile"), kv($0, "splitk"), kv($0, "waves")
}' "$out/bench.log"
} | tee "$out/summary.md"
exit $status
