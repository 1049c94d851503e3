# Sourced by the GPU session scripts: results go under $OUT (default /tmp/out; JSON in $OUT/r),
# the carried wheels' scripts are on PATH, and `step SECONDS NAME COMMAND...` runs COMMAND with
# a time limit, logs it to $OUT/NAME.log and shows the log's last $TAIL lines (default 12).
# Past the limit every benchmark, test and engine process gets SIGABRT first, which makes
# Python's faulthandler (PYTHONFAULTHANDLER=1) print each one's stack into the log (a stall
# shows where it stands), then SIGKILL. The pattern names python processes only, so the
# session script itself (run by bash) is never caught.
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 PATH=/tmp/site/bin:$PATH
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/r"
STEP_PATTERN='python[0-9.]* (-m pytest|-m braid|benchmarks/)|multiprocessing'
step() {
    local limit=$1 name=$2
    shift 2
    local t0=$SECONDS
    "$@" >"$OUT/$name.log" 2>&1 &
    local pid=$!
    (sleep "$limit"; pkill -ABRT -f "$STEP_PATTERN"; sleep 5; pkill -KILL -f "$STEP_PATTERN") \
        >/dev/null 2>&1 &
    local watcher=$!
    wait "$pid"
    local rc=$?
    kill "$watcher" 2>/dev/null
    echo "== $name: rc $rc after $((SECONDS - t0)) s"
    tail -n "${TAIL:-12}" "$OUT/$name.log"
}
