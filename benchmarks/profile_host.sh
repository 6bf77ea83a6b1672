#!/usr/bin/env bash
# A sampling profile of one bench_host.py --spin loop, every thread of its process (on CUDA the
# backward runs on autograd's device thread), start-up left out: py-spy attaches once the loop
# has started.
#
#   bash benchmarks/profile_host.sh LOOP OUT.txt [SECONDS] [bench_host.py options ...]
#
# LOOP: axonn_c_off, axonn_c_on or nn_linear. OUT.txt: py-spy's raw stacks (one loop per file;
# benchmarks/profile_summary.py summarises several). PY (python3) and PYSPY (py-spy) name the
# programs; PYSPY_RATE the samples per second (200).
set -u -o pipefail
LOOP="$1" OUTFILE="$2" SECS="${3:-6}"  # (whole seconds)
shift $(($# < 3 ? $# : 3))
PY="${PY:-python3}"
PYSPY="${PYSPY:-py-spy}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LOG="$OUTFILE.log"
"$PY" "$HERE/bench_host.py" --spin "$SECS" --spin-loop "$LOOP" "$@" > "$LOG" 2>&1 &
PID=$!
for _ in $(seq 600); do  # (at most 120 s for torch's import and the warm-up)
    grep -q "^spinning" "$LOG" 2> /dev/null && break
    kill -0 "$PID" 2> /dev/null || break
    sleep 0.2
done
if ! grep -q "^spinning" "$LOG"; then
    echo "profile_host: the loop never started:" >&2
    cat "$LOG" >&2
    kill "$PID" 2> /dev/null
    exit 1
fi
# (py-spy may report an error when its target exits: the stacks it wrote count)
# (for a second less than the loop runs: its end, finalize and exit are no part of it)
"$PYSPY" record --native --rate "${PYSPY_RATE:-200}" --format raw --pid "$PID" -o "$OUTFILE" \
    --duration $((SECS > 1 ? SECS - 1 : 1)) > "$OUTFILE.pyspy.log" 2>&1
wait "$PID"
RC=$?
cat "$LOG"
[ "$RC" -eq 0 ] && [ -s "$OUTFILE" ]
