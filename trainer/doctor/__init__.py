"""`python -m trainer.doctor --config RUN.toml`: the device self-test inside the container.

On each device the run config names, in order: allocation and a bf16 matmul (`alloc`); the
drafter's attention forward and backward, compiled at the config's heads, head_dim and block
size with the analytic BlockMask and the tiles fitted to the device (`attention`); the Triton
LM-head CE forward and backward (`ce`); one drafter step at a small width (`step`); the
target->drafter feature copy, peer-to-peer or through the host (`copy`); an NCCL all-reduce
among the drafter ranks (`nccl`). One line per device and stage: ok, warn, fail or skipped
(with why: a CPU device skips the CUDA stages by name). Exit 0 when nothing failed, 1 naming
the failing stages, 2 for a bad config. `--json` for scripts (dflashctl doctor reads it).
"""
