#!/usr/bin/env bash
# The first GPU run, time-boxed so that it always returns something (issue 16, item 9).
#
#   bash benchmarks/gpu.sh            # on a CUDA machine: < 13 min on an H200 (sum of the boxes)
#   bash benchmarks/gpu.sh --smoke    # the same steps on the CPU at tiny sizes (CI, ~2 min)
#
# Steps, in order, each under its own `timeout` (seconds in brackets, GPU run):
#   doctor [60]        python -m trainer.doctor on the pipeline step's config with the Qwen3-8B
#                      drafter's attention shape: alloc, flex fwd+bwd, Triton CE, a drafter step
#   env [20]           versions, device, memory, driver, allocator settings
#   drafter [150]      drafter fwd+bwd at real widths (5 layers, H 4096, V 151,936, bf16 autocast,
#                      compiled flex, Triton CE), query-row ladder up to the first OOM, then
#                      that rung in split steps and the largest fitted one with checkpointed layers
#   kernel-tests [100] tests/kernels with the compiled Triton kernels on CUDA
#   pipeline [125]     `python -m trainer` on cuda:0 with a small random target and split steps,
#                      resumed from its middle checkpoint: losses and drafter must be bit-equal
#   capture [35]       target capture throughput at Qwen3-8B width, 4 random layers
#   ce [40]            LM-head CE at training-size N: Triton vs chunked (dense at N = 8192)
#   measure [250]      python -m trainer.measure on the pipeline step's config: every batching
#                      strategy through the real trainer on cuda:0, two interleaved rounds,
#                      the step-cost fit (issue 14); GPU_SH_MEASURE_STRATEGIES=sorted,packed,
#                      packed@8192 picks them instead (packed@N: rows of N tokens)
# Boxes: 780 s in all (13 min), over issue 16's 8 minutes because of measure (issue 14:
# the table on CUDA within 15 minutes); GPU_SH_STEPS=doctor,env,drafter,kernel-tests,pipeline,
# capture,ce is the 530 s run without it (measure's box gave the doctor 50 s: issue 26).
# A step that fails or runs out of time is recorded and the next one runs: nothing aborts.
#
# Output, written as it goes, into $OUT (default: a fresh temp dir, printed at the start):
#   steps.jsonl    one line per step: {"step", "rc", "timed_out", "seconds", "timeout_s"}
#   results.jsonl  the steps' measurements (benchmarks/gpu_steps.py): kind start/.../done|error
#   gpu.log        everything the steps printed
# Exit status: 0 when every step exited 0, else 1 (after all steps ran).
#
# Needs: bash, coreutils `timeout`, and a Python with torch (CUDA build), triton, transformers,
# safetensors, numpy, pytest, hypothesis and pydantic. The GPU image (nvidia-h200: python3 =
# /opt/torch/.venv, Python 3.12) has all of them but pydantic: `bash benchmarks/gpu_wheels.sh`
# fetches, here, the lock's pydantic, pydantic_core, annotated-types, typing-inspection and
# typing_extensions wheels into ./.whl (or $GPU_SH_WHEELS); carry that folder (device tool:
# carry=[".whl"]). They are installed with `pip --no-index --target` into a temp dir put first on
# PYTHONPATH. Nothing is fetched on the GPU machine.
# Python: $PYTHON, else the project's .venv/bin/python when its torch sees CUDA (--smoke: when it
# exists), else python3. The repo root is put on PYTHONPATH, so nothing needs installing.
#
# GPU_SH_BUDGET=S: one overall budget of S seconds instead of the boxes: each step may take
# what is left of it (tests/test_gpu_script.py on a loaded machine, where the smoke boxes, sized
# for an idle one, would fail steps that are merely slow).
# Test hooks (tests/test_gpu_script.py): GPU_SH_STEPS=a,b runs only those steps;
# GPU_SH_FAIL_STEP=NAME makes that step raise; GPU_SH_STALL_STEP=NAME makes it hang under a
# GPU_SH_STALL_TIMEOUT-second box (default 3; the test derives it from measured start-up).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

smoke=0
for arg in "$@"; do
    case "$arg" in
        --smoke) smoke=1 ;;
        -h | --help) sed -n '2,49p' "$0"; exit 0 ;;
        *) echo "gpu.sh: unknown argument $arg (only --smoke)" >&2; exit 2 ;;
    esac
done

OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-sh.XXXXXX")}"
mkdir -p "$OUT" || exit 2
export OUT
echo "gpu.sh: writing into $OUT"

if [[ -n "${PYTHON:-}" ]]; then
    py="$PYTHON"
elif [[ -x .venv/bin/python ]] && { ((smoke)) || .venv/bin/python -c \
    'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }; then
    py=.venv/bin/python
else
    py=python3
fi

export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
((smoke)) && export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

wheels="${GPU_SH_WHEELS:-.whl}"  # benchmarks/gpu_wheels.sh fetches them (not for --smoke)
if ((!smoke)) && compgen -G "$wheels/*.whl" >/dev/null; then
    site="$(mktemp -d "${TMPDIR:-/tmp}/gpu-sh-site.XXXXXX")"
    if "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        "$wheels"/*.whl >>"$OUT/gpu.log" 2>&1; then
        export PYTHONPATH="$site:$PYTHONPATH" GPU_SH_SITE="$site"
    else
        echo "gpu.sh: installing $wheels/*.whl failed (see gpu.log); going on without them" >&2
    fi
fi

now_ms() { date +%s%3N; }
failed=0
budget_end_ms=""
if [[ -n "${GPU_SH_BUDGET:-}" ]]; then
    if [[ ! "$GPU_SH_BUDGET" =~ ^[0-9]+$ || "$GPU_SH_BUDGET" -lt 1 ]]; then
        echo "gpu.sh: GPU_SH_BUDGET=$GPU_SH_BUDGET: expected whole seconds >= 1" >&2
        exit 2
    fi
    budget_end_ms=$(($(now_ms) + GPU_SH_BUDGET * 1000))
fi

# run_step NAME TIMEOUT CMD...: run CMD under `timeout`, tee its output into gpu.log, append
# NAME's exit code to steps.jsonl. Never aborts the script.
run_step() {
    local name="$1" limit="$2"
    shift 2
    if [[ -n "${GPU_SH_STEPS:-}" && ",$GPU_SH_STEPS," != *",$name,"* ]]; then
        return 0
    fi
    local -a cmd=("$@")
    if [[ "${GPU_SH_FAIL_STEP:-}" == "$name" ]]; then
        cmd+=(--fail)
    fi
    if [[ "${GPU_SH_STALL_STEP:-}" == "$name" ]]; then
        cmd+=(--stall)
        limit="${GPU_SH_STALL_TIMEOUT:-3}"
    elif [[ -n "$budget_end_ms" ]]; then  # what is left of the one overall budget
        limit=$(((budget_end_ms - $(now_ms)) / 1000))
        ((limit < 1)) && limit=1
    fi
    # the Python step stops its ladders 10 % (at least 5 s) before the box closes
    local budget=$((limit - (limit / 10 > 5 ? limit / 10 : 5)))
    ((budget < 1)) && budget=1
    echo "== $name (timeout ${limit}s) $(date -u +%H:%M:%S)" | tee -a "$OUT/gpu.log"
    local t0 rc
    t0=$(now_ms)
    timeout -k 5 "$limit" "${cmd[@]}" --budget "$budget" 2>&1 | tee -a "$OUT/gpu.log"
    rc=${PIPESTATUS[0]}
    local ms=$(($(now_ms) - t0)) timed_out=false
    if ((rc == 124 || rc == 137)); then
        timed_out=true
    fi
    ((rc != 0)) && failed=1
    printf '{"step": "%s", "rc": %d, "timed_out": %s, "seconds": %d.%03d, "timeout_s": %d}\n' \
        "$name" "$rc" "$timed_out" $((ms / 1000)) $((ms % 1000)) "$limit" >>"$OUT/steps.jsonl"
    echo "== $name: exit $rc in $((ms / 1000)) s" | tee -a "$OUT/gpu.log"
    return 0
}

steps=("$py" benchmarks/gpu_steps.py)
mode=()
((smoke)) && mode=(--smoke)
s() { if ((smoke)); then echo "$2"; else echo "$1"; fi; }  # s GPU_TIMEOUT SMOKE_TIMEOUT

run_step doctor "$(s 60 60)" "${steps[@]}" doctor "${mode[@]}"
run_step env "$(s 20 30)" "${steps[@]}" env "${mode[@]}"
run_step drafter "$(s 150 40)" "${steps[@]}" drafter "${mode[@]}"
run_step kernel-tests "$(s 100 40)" "${steps[@]}" kernel-tests "${mode[@]}"
run_step pipeline "$(s 125 60)" "${steps[@]}" pipeline "${mode[@]}"
run_step capture "$(s 35 30)" "${steps[@]}" capture "${mode[@]}"
run_step ce "$(s 40 30)" "${steps[@]}" ce "${mode[@]}"
run_step measure "$(s 250 180)" "${steps[@]}" measure "${mode[@]}"

echo "gpu.sh: done; records in $OUT (steps.jsonl, results.jsonl, gpu.log)"
exit "$failed"
