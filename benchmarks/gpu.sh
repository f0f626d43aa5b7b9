#!/usr/bin/env bash
# One-shot GPU check of the fused LM-head CE for a session that borrows a CUDA machine (~5 min):
#   1. the kernel tests with the real compiled Triton kernels on the GPU (fp32 and bf16),
#   2. bench_kernel.py --device cuda: time and max_memory_allocated, dense vs chunked vs Triton,
#      forward+backward in bf16 at N = 8192 (512 anchors x 16) and N = 2048, D = 4096, V = 151,936.
# Installs nothing. Python: $PYTHON, else .venv/bin/python, else python3 (needs torch with CUDA,
# triton, pytest, hypothesis, pytest-timeout). Prints everything; exits non-zero on the first failure.
#   bash benchmarks/gpu.sh 2>&1 | tee gpu-kernel.log
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -n "${PYTHON:-}" ]]; then
    py="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
    py=.venv/bin/python
else
    py=python3
fi

echo "== machine"
date -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$py" - <<'PY'
import sys
import torch
print(f"python {sys.version.split()[0]}  torch {torch.__version__}  cuda {torch.version.cuda}")
if not torch.cuda.is_available():
    sys.exit("gpu.sh: torch sees no CUDA device; this script needs one")
import triton
print(f"triton {triton.__version__}  device {torch.cuda.get_device_name()}")
PY

echo "== kernel tests on CUDA (compiled Triton, no interpreter)"
unset TRITON_INTERPRET
export TRITON_DEFAULT_FP_FUSION=1
DFLASH_KERNEL_TESTS_CUDA=1 timeout 240 "$py" -m pytest tests/kernels -q -p no:cacheprovider

echo "== bench_kernel.py --device cuda (N=8192: 512 anchors x block 16)"
timeout 120 "$py" benchmarks/bench_kernel.py --device cuda --repeats 5

echo "== bench_kernel.py --device cuda --positions 2048"
timeout 90 "$py" benchmarks/bench_kernel.py --device cuda --positions 2048 --repeats 5
echo "== done"
