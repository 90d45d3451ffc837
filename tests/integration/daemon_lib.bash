# Helpers sourced by tests/integration/daemon_*.sh (not a test itself): start the real daemon
# under mpirun in its own process group on a temporary socket directory, wait until every rank
# answers, stop it gracefully (SIGUSR1 to mpirun), and always clean up (trap).
set -u
BUILD=${BUILD:-build}
MPIRUN=${MPIRUN:-mpirun}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
EPD=$BUILD/epd
CHECK=$BUILD/tests/check_client
WIRE="python3 tests/integration/daemon_wire.py"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

skip() { echo "SKIP: $*"; exit 77; }
die() {
    echo "FAIL: $*"
    if [[ -n ${EPD_LOG:-} && -f ${EPD_LOG:-} ]]; then
        echo "--- daemon log:"
        tail -n 40 "$EPD_LOG"
    fi
    exit 1
}

command -v "$MPIRUN" >/dev/null 2>&1 || skip "no mpirun ($MPIRUN)"
command -v python3 >/dev/null 2>&1 || skip "no python3"
[[ -x $EPD ]] || skip "$EPD is not built"
[[ -x $CHECK ]] || skip "$CHECK is not built"

TMP=$(mktemp -d /tmp/epd-test.XXXXXX)
EPD_PID=
EPD_LOG=

cleanup() {
    if [[ -n $EPD_PID ]] && kill -0 "$EPD_PID" 2>/dev/null; then
        kill -KILL -- "-$EPD_PID" 2>/dev/null
        wait "$EPD_PID" 2>/dev/null
    fi
    rm -rf "$TMP"
}
trap cleanup EXIT

# epd_launch NP LOG ARGS...: starts mpirun (own process group) without waiting for readiness;
# MPIRUN_EXTRA adds mpirun arguments (e.g. --bind-to none).
epd_launch() {
    local np=$1 log=$2; shift 2
    EPD_LOG=$log
    # shellcheck disable=SC2086 # MPIRUN_EXTRA: more mpirun arguments, split on spaces
    setsid "$MPIRUN" --oversubscribe ${MPIRUN_EXTRA:-} -np "$np" --mca pml ucx \
        --mca pml_ucx_tls any --mca pml_ucx_devices any "$EPD" \
        --set "socket.path=$TMP/epd-%r.sock" --set device.backend=cpu "$@" >"$log" 2>&1 &
    EPD_PID=$!
}

# epd_wait_healthy NP SECONDS [WHAT]: waits until every rank of $EPD_PID answers health on
# $TMP/epd-RANK.sock; dies (naming WHAT) when the daemon exits or SECONDS pass first.
epd_wait_healthy() {
    local np=$1 limit=$2 what=${3:+ ($3)}
    local deadline=$((SECONDS + limit)) r
    for ((r = 0; r < np; r++)); do
        until [[ -S $TMP/epd-$r.sock ]] && $WIRE health "$TMP/epd-$r.sock" >/dev/null 2>&1; do
            kill -0 "$EPD_PID" 2>/dev/null || die "the daemon exited during start-up$what"
            ((SECONDS < deadline)) || die "rank $r did not come up within $limit s$what"
            sleep 0.1
        done
    done
}

# epd_start NP ARGS...: starts and waits (30 s at most) until every rank answers health.
epd_start() {
    local np=$1; shift
    epd_launch "$np" "$TMP/epd.log" "$@"
    epd_wait_healthy "$np" 30
}

# epd_wait_exit SECONDS: waits for mpirun to exit and sets EPD_RC to its exit code (124 when it
# is still running after SECONDS).
epd_wait_exit() {
    local deadline=$((SECONDS + $1))
    while kill -0 "$EPD_PID" 2>/dev/null; do
        if ((SECONDS >= deadline)); then
            EPD_RC=124
            return
        fi
        sleep 0.1
    done
    EPD_RC=0
    wait "$EPD_PID" || EPD_RC=$?
    EPD_PID=
}

# epd_stop: the graceful stop of DESIGN.md section 5 (SIGUSR1 to mpirun); fails unless exit 0.
epd_stop() {
    kill -USR1 "$EPD_PID"
    epd_wait_exit 30
    [[ $EPD_RC == 0 ]] || die "mpirun exited $EPD_RC after SIGUSR1 (124: still running after 30 s)"
}

# epd_stop_ranks: the other graceful stop of DESIGN.md section 5, SIGUSR1 to the ranks themselves
# (what systemd's KillSignal=SIGUSR1 does, since it signals the whole cgroup). Needed where mpirun
# does not forward SIGUSR1: Ubuntu 24.04's Open MPI 4.1.6 on the GPU machine did not (seen
# 2026-11-30), Debian 12's 4.1.4 does.
epd_stop_ranks() {
    pkill -USR1 -P "$EPD_PID" -x epd
    epd_wait_exit 30
    [[ $EPD_RC == 0 ]] || die "mpirun exited $EPD_RC after SIGUSR1 to the ranks (124: still running after 30 s)"
}

# sock R: the socket path of rank R.
sock() { echo "$TMP/epd-$1.sock"; }
