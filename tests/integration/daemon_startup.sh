#!/usr/bin/env bash
# Start-up checks across ranks and the actions without MPI: ranks that disagree on a setting
# refuse to start naming the rank and the setting; E % W != 0 refuses to start; a bad setting
# ends the job; --print-config / --help / --version run without mpirun.
source "$(dirname "$0")/daemon_lib.bash"

model=(--set model.hidden=256 --set model.num_experts=16 --set model.topk=4 --set device.backend=cpu)
mpi=(--oversubscribe --mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any)

# expect_job_failure LOG PATTERN: the job launched into EPD_PID exits non-zero within 30 s and
# LOG holds PATTERN.
expect_job_failure() {
    epd_wait_exit 30
    [[ $EPD_RC != 124 ]] || die "the job still runs 30 s after a failed start-up"
    [[ $EPD_RC != 0 ]] || die "the job exited 0"
    grep -q -- "$2" "$1" || { cat "$1"; die "no '$2' in the log"; }
    echo "refused (exit $EPD_RC): $(grep -m1 -o "start-up failed: .*" "$1")"
}

echo "== ranks disagree"
EPD_LOG=$TMP/mismatch.log
setsid "$MPIRUN" "${mpi[@]}" -np 1 "$EPD" --set "socket.path=$TMP/a-%r.sock" "${model[@]}" : \
    -np 1 "$EPD" --set "socket.path=$TMP/a-%r.sock" "${model[@]}" --set dispatch.dtype=bf16 \
    >"$EPD_LOG" 2>&1 &
EPD_PID=$!
expect_job_failure "$EPD_LOG" "rank 1 has 'dispatch.dtype=bf16' where rank 0 has 'dispatch.dtype=fp8'"

echo "== experts not a multiple of the ranks"
epd_launch 3 "$TMP/ew.log" "${model[@]}"
expect_job_failure "$TMP/ew.log" "model.num_experts = 16 is not a multiple of the 3 ranks"

echo "== bad setting under mpirun"
epd_launch 2 "$TMP/bad.log" "${model[@]}" --set dispatch.dtype=fp4
expect_job_failure "$TMP/bad.log" "dispatch.dtype"

echo "== without MPI"
out=$("$EPD" --print-config --set dispatch.dtype=bf16) || die "--print-config failed"
grep -q "^dispatch.dtype = bf16 .*cli" <<<"$out" || die "--print-config: $out"
rc=0
err=$("$EPD" --print-config --set model.hidden=100 2>&1 >/dev/null) || rc=$?
[[ $rc == 2 && $err == "epd: "*"model.hidden"* ]] || die "bad --set: exit $rc, '$err'"
err=$(SGLANG_DEEPEP_BF16_DISPATCH=yes "$EPD" --print-config 2>&1 >/dev/null) || die "legacy variable"
[[ $err == "epd: warning: "*SGLANG_DEEPEP_BF16_DISPATCH* ]] || die "no deprecation warning: '$err'"
"$EPD" --version | grep -q "^epd [0-9]" || die "--version"
"$EPD" --help | grep -q "socket.path" || die "--help does not list the settings"
rc=0
"$EPD" --no-such-option >/dev/null 2>&1 || rc=$?
[[ $rc == 2 ]] || die "an unknown option exits $rc, want 2"
echo "PASS: disagreeing ranks, E % W and bad settings refuse to start; no-MPI actions work"
