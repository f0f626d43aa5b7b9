#!/usr/bin/env bash
# Run a command on a machine made busy: N busy-loop CPU hogs beside it, killed (by their pids)
# when the command ends, fails or is interrupted. For checking that tests wait on conditions,
# not wall-clock deadlines (docs/benchmarks.md, "make test on a busy machine").
#
#   bash benchmarks/under_load.sh 2 .venv/bin/python -m pytest tests/test_gpu_script.py
#   HOG_NICE=-5 bash benchmarks/under_load.sh 2 CMD...   # hogs ahead of CMD (needs root)
#
# Exit status: the command's.
set -uo pipefail

if [[ $# -lt 2 || ! "$1" =~ ^[0-9]+$ ]]; then
    echo "usage: under_load.sh HOGS CMD [ARGS...]" >&2
    exit 2
fi
hogs="$1"
shift
pids=()
stop_hogs() {
    ((${#pids[@]})) || return 0
    kill "${pids[@]}" 2>/dev/null
    wait "${pids[@]}" 2>/dev/null
    pids=()
}
trap stop_hogs EXIT
trap 'stop_hogs; exit 130' INT TERM
# each hog in a session of its own: with the kernel's autogroup scheduling, hogs sharing one
# session share one CPU share between them, and would load the machine far less than N
for ((i = 0; i < hogs; i++)); do
    setsid nice -n "${HOG_NICE:-0}" python3 -c 'while True: pass' &
    pids+=($!)
done
"$@"
