#!/usr/bin/env bash
# Fetch, HERE, the wheels benchmarks/gpu.sh needs on a GPU machine whose image lacks them.
#
#   bash benchmarks/gpu_wheels.sh            # -> ./.whl/*.whl (.gitignore'd)
#   bash benchmarks/gpu_wheels.sh --dry-run  # print the pinned specs only
#
# The nvidia-h200 image (Python 3.12, torch, triton, transformers, safetensors, numpy, pytest,
# hypothesis) has no pydantic, which trainer.config and the drafter's config need. The versions are
# requirements.lock's, for CPython 3.12 on manylinux x86-64; gpu.sh installs ./.whl/*.whl with
# `pip --no-index --no-deps --target` when the directory is there. Then, on the device tool:
#   run(command="bash benchmarks/gpu.sh", carry=[".whl"])    (~2.8 MB travels)
set -euo pipefail
cd "$(dirname "$0")/.."

names=(pydantic pydantic_core annotated-types typing-inspection typing_extensions)
specs=()
for name in "${names[@]}"; do
    # the lock spells names either way (pydantic_core, annotated-types); match both
    pattern="^$(echo "$name" | sed 's/[-_]/[-_]/g')=="
    line=$(grep -iE "$pattern" requirements.lock | head -1) || {
        echo "gpu_wheels.sh: $name is not pinned in requirements.lock" >&2
        exit 2
    }
    specs+=("$line")
done

if [[ "${1:-}" == "--dry-run" ]]; then
    printf '%s\n' "${specs[@]}"
    exit 0
fi

py="${PYTHON:-.venv/bin/python}"
[[ -x "$py" ]] || py=python3
mkdir -p .whl
"$py" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${specs[@]}"
ls -la .whl
