#!/usr/bin/env bash
# Run a command on a machine made busy: N busy-loop CPU hogs beside it, killed (by their pids)
# when the command ends, fails or is interrupted. For checking that tests wait on conditions,
# not wall-clock deadlines (docs/benchmarks.md, "make test on a busy machine").
#
#   bash benchmarks/under_load.sh 2 .venv/bin/python -m pytest tests/test_gpu_script.py
#   HOG_NICE=-5 bash benchmarks/under_load.sh 2 CMD...   # hogs ahead of CMD (needs root)
#   HOG_SETSID=1 bash benchmarks/under_load.sh 2 CMD...  # each hog in a session of its own
#
# With the kernel's autogroup scheduling (/proc/sys/kernel/sched_autogroup_enabled) CPU time is
# shared between sessions first: hogs in CMD's session (the default) slow CMD and its children,
# but not what runs in a session of its own, such as a tmux server's panes (the demo's trainer);
# HOG_SETSID=1 hogs slow those, and CMD's session only as one session among several.
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
own=()
[[ -n "${HOG_SETSID:-}" ]] && own=(setsid)
for ((i = 0; i < hogs; i++)); do
    "${own[@]}" nice -n "${HOG_NICE:-0}" python3 -c 'while True: pass' &
    pids+=($!)
done
"$@"
