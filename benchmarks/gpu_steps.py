"""The Python steps of `benchmarks/gpu.sh`, one subcommand each; every step appends JSON lines to
`OUT/results.jsonl` as it goes, so a step killed by its time box still leaves what it measured.

    python benchmarks/gpu_steps.py STEP [--smoke] [--out DIR] [--budget SECONDS]

Steps (gpu.sh runs them in this order):
  env           versions, device, memory, driver, allocator settings
  drafter       drafter forward+backward at real widths (5 layers, H 4096, V 151,936, bf16
                autocast, compiled flex attention, Triton CE) over a ladder of query-row budgets
                up to the first OOM: ms/step, ms/anchor, peak memory, mask build cost, recompiles;
                then the OOM rung in split steps (model.max_query_rows) and checkpointed layers
  kernel-tests  tests/kernels with the compiled Triton kernels on the GPU
  pipeline      a short `python -m trainer` run on the GPU with a small random target and split
                steps, resumed from its middle checkpoint: resumed losses and drafter must be equal
  capture       target capture throughput at Qwen3-8B width with a few random layers
  ce            the LM-head CE kernel (Triton vs chunked, dense at the smallest N) at training N
  measure       `python -m trainer.measure` on the pipeline step's config: every batching
                strategy through the real trainer, two interleaved rounds, the step-cost fit

`--smoke` runs every step on the CPU at tiny sizes (CI: tests/test_gpu_script.py), so the script
cannot rot between the rare GPU loans. Records: {"step", "kind", ...}; kind "start" first, "done"
last (with "ok"), "error" when the step raised (exit 1). `--budget` is the step's time box minus
a margin: ladders stop before a rung that would not finish, subprocesses are given what is left.
Test hooks: `--fail` raises at the start, `--stall` sleeps until killed.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the GPU machine runs from a bare copy of the tree
    sys.path.insert(0, str(REPO))

from trainer.config.overlay import dump_toml, merge  # noqa: E402 (torch-free)
from trainer.memory.shapes import DrafterShape  # noqa: E402 (torch-free)

if TYPE_CHECKING:  # torch is imported inside the steps that use it
    import torch

    from trainer.kernels.common import Backend
    from trainer.model.drafter import DFlashDrafter, DrafterConfig

Rung = TypeVar("Rung")

QWEN3_VOCAB = 151_936
GiB = 2**30


class Recorder:
    """Appends one JSON object per line to OUT/results.jsonl, flushed at once."""

    def __init__(self, out: Path, step: str) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "results.jsonl"
        self.step = step

    def __call__(self, kind: str, **fields: Any) -> dict[str, Any]:
        rec = {"step": self.step, "kind": kind, "t": round(time.time(), 3), **fields}
        with self.path.open("a") as fh:
            fh.write(json.dumps(rec, default=str) + "\n")
        print(json.dumps(rec, default=str), flush=True)
        return rec


@dataclass
class Ctx:
    smoke: bool
    rec: Recorder
    deadline: float  # time.monotonic() by which the step should have written its last record

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _sync(device: torch.device) -> None:
    import torch

    if getattr(device, "type", device) == "cuda":
        torch.cuda.synchronize()


def _timed(
    fn: Callable[[], object], device: torch.device, reps: int, *, warmup: bool = True
) -> list[float]:
    """Wall seconds of `reps` calls, after one untimed warm-up call (compilation, allocator)."""
    if warmup:
        fn()
        _sync(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def _device(smoke: bool) -> torch.device:
    import torch

    if smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device (use --smoke on a CPU machine)")
    return torch.device("cuda", 0)


def _is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _free(device: torch.device) -> None:
    import torch

    gc.collect()
    if getattr(device, "type", device) == "cuda":
        torch.cuda.empty_cache()


def _peak_reset(device: torch.device) -> int:
    import torch

    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return int(torch.cuda.memory_allocated())


def _peak(device: torch.device) -> int | None:
    import torch

    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


# ----------------------------------------------------------------------------------- ladder
def run_ladder(
    rungs: Sequence[Rung],
    run_rung: Callable[[Rung], dict[str, Any]],
    ctx: Ctx,
    *,
    cost: Callable[[Rung], float],
) -> dict[str, Any]:
    """Run rungs in order until the first OOM, error-free; stops early when the next rung's
    predicted time (last rung's seconds scaled by `cost`) exceeds what the budget has left.

    Each rung's measurements are recorded as kind "rung" the moment it finishes; an OOM as
    kind "oom". Returns the largest rung that fitted, the one that ran out of memory (or None)
    and why the ladder ended ("top", "oom" or "budget").
    """
    fitted: Rung | None = None
    failed: Rung | None = None
    last: tuple[Rung, float] | None = None
    ended = "top"
    for rung in rungs:
        if last is not None:
            predicted = last[1] * cost(rung) / max(cost(last[0]), 1e-9)
            if predicted > ctx.left():
                ctx.rec("skipped", rung=rung, predicted_s=round(predicted, 1), left_s=ctx.left())
                ended = "budget"
                break
        t0 = time.monotonic()
        try:
            fields = run_rung(rung)
        except Exception as exc:
            if not _is_oom(exc):
                raise
            ctx.rec("oom", rung=rung, error=str(exc).splitlines()[0][:300])
            ended, failed = "oom", rung
            break
        wall = time.monotonic() - t0
        # A rung may report its time without one-off costs (the first rung's compilation):
        # predicting the next rung from a compile-inflated time would end the ladder at once.
        steady = fields.pop("steady_s", None)
        last = (rung, wall if steady is None else float(steady))
        fitted = rung
        ctx.rec("rung", rung=rung, seconds=round(wall, 2), **fields)
    gc.collect()  # an OOM's traceback held the failed rung's tensors
    return {"largest_fitted": fitted, "failed_rung": failed, "ended": ended}


# ----------------------------------------------------------------------------------- env
def step_env(ctx: Ctx) -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "carried_wheels": os.environ.get("GPU_SH_SITE"),
        "default_dtype": str(torch.get_default_dtype()),
    }
    for name in ("triton", "transformers", "pydantic", "safetensors", "numpy", "pytest"):
        try:
            facts[name] = __import__(name).__version__
        except Exception as exc:  # a missing package is a fact to report, not a failure
            facts[name] = f"missing: {type(exc).__name__}: {exc}"[:200]
    try:
        import torch.nn.attention.flex_attention

        facts["flex_attention"] = True
    except ImportError:
        facts["flex_attention"] = False
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        facts.update(
            device=props.name,
            capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            memory_total_gib=round(total / GiB, 2),
            memory_free_gib=round(free / GiB, 2),
            device_count=torch.cuda.device_count(),
        )
    try:
        smi = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,memory.total,driver_version",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=5,
        )
        facts["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        facts["nvidia_smi"] = f"unavailable: {exc}"
    try:
        facts["git"] = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        facts["git"] = None
    if not ctx.smoke and not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device: " + json.dumps(facts, default=str))
    ctx.rec("facts", **facts)
    return {}


# ----------------------------------------------------------------------------------- drafter
REAL_DRAFTER = DrafterShape(4096, 12288, 5, 32, 8, 128, QWEN3_VOCAB, 16, 5)
SMOKE_DRAFTER = DrafterShape(64, 128, 2, 4, 2, 16, 512, 4, 2)
TARGET_LAYERS = {REAL_DRAFTER: 36, SMOKE_DRAFTER: 8}
"""Decoder layers of the target each drafter serves (Qwen3-8B has 36): sets the capture ids."""
# (rows, context length, anchors per row); query rows = rows x anchors x block. Rows >= 2
# throughout: dynamo specialises size 1, so a rows=1 rung would cost a recompile.
REAL_RUNGS = [(2, 2048, 64), (2, 2048, 256), (2, 2048, 512), (4, 2048, 512), (8, 2048, 512)]
REAL_RUNGS += [(16, 2048, 512), (32, 2048, 512), (64, 2048, 512)]
SMOKE_RUNGS = [(2, 64, 4), (2, 64, 8), (4, 64, 8)]


def drafter_config(shape: DrafterShape) -> DrafterConfig:
    """The DrafterConfig of `shape` (the seed's Qwen3-8B drafter for REAL_DRAFTER)."""
    from trainer.memory.measure import drafter_config

    return drafter_config(shape, TARGET_LAYERS[shape])


def _drafter_model(shape: DrafterShape, device: torch.device) -> DFlashDrafter:
    """fp32 master weights on `device`, bound to a random frozen embedding and LM head."""
    import torch
    from torch import nn

    from trainer.model.drafter import DFlashDrafter

    cfg = drafter_config(shape)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    embed = nn.Embedding(shape.vocab, shape.hidden, device=device, dtype=dtype)
    head = nn.Linear(shape.hidden, shape.vocab, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        nn.init.normal_(embed.weight, std=0.02)
        nn.init.normal_(head.weight, std=0.02)
    embed.requires_grad_(False)
    head.requires_grad_(False)
    with torch.device(device):  # initialised where it runs: 1e9 parameters at real width
        drafter = DFlashDrafter(cfg).to(dtype=torch.float32)
    drafter.bind_target(embed, head)
    return drafter


def _recompiles() -> int | None:
    """Frames dynamo has compiled so far (a rung that adds any recompiled)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["frames"]["ok"])
    except Exception:
        return None


def step_drafter(ctx: Ctx) -> dict[str, Any]:
    import contextlib

    import torch

    from trainer.kernels.peak_memory import cpu_peak_bytes
    from trainer.model.attention import build_mask
    from trainer.model.masks import sample_anchors
    from trainer.model.split_step import bounded_objective_backward, split_pieces

    device = _device(ctx.smoke)
    shape = SMOKE_DRAFTER if ctx.smoke else REAL_DRAFTER
    rungs = SMOKE_RUNGS if ctx.smoke else REAL_RUNGS
    attn = "sdpa" if ctx.smoke else "flex"  # flex has no CPU backward in torch 2.13
    reps = 2  # timed calls per rung, after the first (compiling) one
    drafter = _drafter_model(shape, device)
    params = sum(p.numel() for p in drafter.parameters())
    for p in drafter.parameters():  # grads exist from the start, so every rung's base has them
        p.grad = torch.zeros_like(p)
    fixed = int(torch.cuda.memory_allocated()) if device.type == "cuda" else None
    ctx.rec(
        "model",
        shape={**asdict(shape), "num_target_layers": TARGET_LAYERS[shape]},
        params=params,
        master_fp32_bytes=4 * params,
        adamw_state_bytes=8 * params,
        allocated_after_build=fixed,
        attn_backend=attn,
    )
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else contextlib.nullcontext()
    )
    feat_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def measure(
        rung: tuple[int, int, int], budget: int | None = None, cpu_peak: bool = False
    ) -> dict[str, Any]:
        """One drafter step (the runner's path: `bounded_objective_backward`) at `rung`."""
        rows, seq, anchors = rung
        gen = torch.Generator().manual_seed(rows * 1000 + anchors)
        ids = torch.randint(0, shape.vocab - 1, (rows, seq), generator=gen).to(device)
        loss_mask = torch.ones(rows, seq, dtype=torch.long)
        loss_mask[:, : seq // 10] = 0
        att = torch.ones(rows, seq, dtype=torch.long, device=device)
        hidden = torch.randn(rows, seq, shape.features * shape.hidden, generator=gen)
        hidden = hidden.to(device=device, dtype=feat_dtype)
        drawn = sample_anchors(loss_mask, att, anchors, torch.Generator().manual_seed(1))
        loss_mask = loss_mask.to(device)
        positions = drawn.positions.to(device)

        def mask_build() -> None:
            build_mask(positions, att, shape.block, attn)

        mask_s = _timed(mask_build, device, reps)

        def step() -> None:
            bounded_objective_backward(
                drafter,
                ids,
                loss_mask,
                att,
                hidden,
                max_query_rows=budget,
                num_anchors=anchors,
                generator=torch.Generator().manual_seed(1),  # the anchors drawn above
                autocast=autocast,
                attn_backend=attn,
            )

        compiles_before = _recompiles()
        base = _peak_reset(device)
        (first_s,) = _timed(step, device, 1, warmup=False)  # compiles on the first rung
        times = _timed(step, device, reps, warmup=False)
        peak = _peak(device)
        above = None if peak is None else peak - base
        if cpu_peak:
            above = cpu_peak_bytes(step)
        compiles_after = _recompiles()
        q_rows = rows * drawn.num_blocks * shape.block
        ms = statistics.median(times) * 1e3
        return {
            "steady_s": (reps + 1) * (statistics.median(times) + statistics.median(mask_s)),
            "rows": rows,
            "seq": seq,
            "anchors": drawn.num_blocks,
            "query_rows": q_rows,
            "pieces": len(split_pieces(drawn, shape.block, budget)),
            "first_step_s": round(first_s, 3),
            "ms_step": round(ms, 2),
            "ms_per_anchor": round(ms / (rows * drawn.num_blocks), 4),
            "mask_build_ms": round(statistics.median(mask_s) * 1e3, 3),
            "peak_bytes": peak,
            "peak_above_base_bytes": above,
            "bytes_per_query_row": None if above is None else round(above / q_rows),
            "compiled_frames": None
            if compiles_before is None or compiles_after is None
            else compiles_after - compiles_before,
        }

    def cost(rung: tuple[int, int, int]) -> float:
        return float(rung[0] * rung[2])

    summary = run_ladder(rungs, measure, ctx, cost=cost)
    fitted = summary["largest_fitted"]
    if fitted is not None:
        # Item 1 on this device: the rung that did not fit (else the top one) in split steps of
        # half the largest fitted rung, and checkpointed layers at the largest fitted rung.
        over = summary["failed_rung"] or rungs[-1]
        budget = max(shape.block, fitted[0] * fitted[2] * shape.block // 2)
        cases = [("split", over, budget, False), ("checkpointed", fitted, None, True)]
        if ctx.smoke:  # the CPU has no peak counter: measure with and without, side by side
            cases = [("one-pass", over, None, False), *cases]
        for case, rung, case_budget, ckpt in cases:
            if ctx.left() < (3 if ctx.smoke else 30):
                ctx.rec("skipped", case=case, left_s=ctx.left())
                break
            drafter.checkpoint_layers = ckpt
            try:
                fields = measure(rung, case_budget, cpu_peak=ctx.smoke)
            except Exception as exc:
                if not _is_oom(exc):
                    raise
                ctx.rec("oom", case=case, rung=rung, error=str(exc).splitlines()[0][:300])
                _free(device)
                continue
            finally:
                drafter.checkpoint_layers = False
            fields.pop("steady_s")
            ctx.rec("case", case=case, rung=rung, max_query_rows=case_budget, **fields)
    drafter.zero_grad(set_to_none=True)
    _free(device)
    return summary


# ----------------------------------------------------------------------------------- kernel tests
def _junit_counts(path: Path) -> dict[str, Any]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed: list[str] = []
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
        for case in suite.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
    return {**counts, "failed": failed[:50]}


def step_kernel_tests(ctx: Ctx) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if ctx.smoke:
        targets = ["tests/kernels/test_api.py"]  # the CPU interpreter is too slow for the rest
    else:
        targets = ["tests/kernels"]
        env.update(DFLASH_KERNEL_TESTS_CUDA="1", TRITON_DEFAULT_FP_FUSION="1")
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        # -v streams one line per test into gpu.log, so a run killed by its box still shows
        # how far it got; a hung test costs 60 s, not the whole box
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--timeout=60"]
        cmd += ["--junitxml", str(junit), *targets]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, timeout=max(ctx.left(), 5))
        except subprocess.TimeoutExpired:
            ctx.rec("timeout", seconds=round(time.monotonic() - t0, 1))
            raise RuntimeError("kernel tests ran out of their time box (see gpu.log)") from None
        counts = _junit_counts(junit) if junit.is_file() else {}
    ctx.rec("pytest", rc=proc.returncode, seconds=round(time.monotonic() - t0, 1), **counts)
    if proc.returncode != 0:
        raise RuntimeError(f"kernel tests failed (pytest exit {proc.returncode})")
    return {"passed": counts.get("tests", 0) - counts.get("skipped", 0)}


# ------------------------------------------------------------------------------------- doctor
def step_doctor(ctx: Ctx) -> dict[str, Any]:
    """`python -m trainer.doctor` first: the device self-test on the pipeline step's config, with
    the Qwen3-8B drafter's attention (32 heads, 8 KV heads, head_dim 128, block 16) on the GPU.
    Each stage is one record; a failed stage fails this step (the others still run)."""
    root = Path(tempfile.mkdtemp(prefix="gpu-doctor-"))
    raw = pipeline_config(root, ctx.smoke, 2)
    if not ctx.smoke:
        raw = merge(
            raw,
            {
                "model": {
                    "drafter": {
                        "num_attention_heads": 32,
                        "num_key_value_heads": 8,
                        "head_dim": 128,
                    }
                }
            },
        )
    config = root / "run.toml"
    config.write_text(dump_toml(raw))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    paths = [str(REPO), os.environ.get("PYTHONPATH", "")]
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(p for p in paths if p))
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.doctor", "--config", str(config), "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=max(10.0, ctx.left()),
    )
    print(proc.stderr[-3000:], file=sys.stderr)
    report = json.loads(proc.stdout)
    for stage in report["stages"]:
        ctx.rec("stage", **stage)
    if proc.returncode != 0:
        raise RuntimeError(f"trainer.doctor exited {proc.returncode}: {report['failed']}")
    return {"doctor_ok": report["ok"], "stages": len(report["stages"])}


# ----------------------------------------------------------------------------------- pipeline
def pipeline_config(root: Path, smoke: bool, steps: int) -> dict[str, Any]:
    """configs/tiny-cpu.toml at absolute paths under `root`, checkpointing at steps/2, split
    steps on; on the GPU a wider random target, block 16 and every stage on cuda:0."""
    raw = tomllib.loads((REPO / "configs" / "tiny-cpu.toml").read_text())
    over: dict[str, Any] = {
        "data": {"store": str(root / "store"), "synthetic": {"rows": 600 if smoke else 4000}},
        # split steps (model.max_query_rows) on: the resume check covers the micro-step path
        "model": {"target_dir": str(root / "target"), "max_query_rows": 64 if smoke else 4096},
        "schedule": {"max_steps": steps},
        "status": {"interval_s": 1.0, "rate_window_s": 5.0},
        "checkpoint": {"every_steps": steps // 2, "every_minutes": 600.0, "keep_last": 4},
    }
    if smoke:
        over["batching"] = {"token_budget": 512, "max_batch": 8}
    else:
        over["data"]["synthetic"].update(max_length=1024, length_scale=4.0)
        over["batching"] = {"token_budget": 8192, "max_batch": 32}
        over["model"].update(
            mask_token_id=4095,
            num_anchors=64,
            tiny_target={
                "seed": 0,
                "vocab_size": 4096,
                "hidden_size": 512,
                "num_layers": 8,
                "num_heads": 8,
                "num_kv_heads": 4,
                "head_dim": 64,
                "intermediate_size": 1536,
            },
            drafter={"num_layers": 2, "block_size": 16},
        )
        over["topology"] = {"target_devices": ["cuda:0"], "drafter_devices": ["cuda:0"]}
    return merge(raw, over)


def pipeline_run(ctx: Ctx, root: Path, steps: int) -> tuple[Path, dict[str, str]]:
    """The pipeline steps' shared set-up in `root`: `pipeline_config` written to run.toml, its
    store and target built (one `assets` record with the seconds), and the environment a
    `python -m trainer...` child runs under (no DFLASH_ test knobs, unbuffered, this tree and
    gpu.sh's carried wheels on PYTHONPATH). Returns (config path, env)."""
    from trainer.config import TrainConfig
    from trainer.pipeline import assets

    raw = pipeline_config(root, ctx.smoke, steps)
    config = root / "run.toml"
    config.write_text(dump_toml(raw))
    t0 = time.monotonic()
    cfg = TrainConfig.from_dict(raw)
    assets.ensure_store(cfg)
    assets.ensure_target(cfg)
    ctx.rec("assets", seconds=round(time.monotonic() - t0, 1))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    paths = [str(REPO), os.environ.get("PYTHONPATH", "")]
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(p for p in paths if p))
    return config, env


def _losses(run_dir: Path) -> dict[int, float | None]:
    out: dict[int, float | None] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[int(rec["step"])] = rec["loss"]
    return out


def step_pipeline(ctx: Ctx) -> dict[str, Any]:
    import torch

    from trainer.pipeline.checkpoint import list_checkpoints, load_checkpoint

    steps = 6 if ctx.smoke else 24
    with tempfile.TemporaryDirectory(prefix="gpu-sh-pipeline-") as tmp:
        root = Path(tmp)
        config, env = pipeline_run(ctx, root, steps)

        def trainer(run: str, *args: str) -> float:
            t = time.monotonic()
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "trainer",
                    "--config",
                    str(config),
                    "--run-dir",
                    str(root / run),
                    *args,
                ],
                cwd=REPO,
                env=env,
                timeout=max(ctx.left(), 5),
            )  # output streams into gpu.log, so a run cut off by the box still shows its lines
            seconds = time.monotonic() - t
            if proc.returncode != 0:
                log = root / run / "console.log"
                tail = log.read_text().strip().splitlines()[-3:] if log.is_file() else []
                raise RuntimeError(f"trainer {run} exit {proc.returncode}: {' | '.join(tail)}")
            return seconds

        whole_s = trainer("whole")
        la = _losses(root / "whole")
        ctx.rec(
            "run",
            seconds=round(whole_s, 1),
            steps=len(la),
            first_loss=la.get(1),
            last_loss=la.get(steps),
        )
        mid = root / "whole" / "checkpoints" / f"step-{steps // 2:08d}.pt"
        resumed_s = trainer("resumed", "--resume", str(mid))
        lb = _losses(root / "resumed")
        tail_steps = range(steps // 2 + 1, steps + 1)
        diffs = [
            abs(a - b)
            if (a := la.get(s)) is not None and (b := lb.get(s)) is not None
            else math.inf
            for s in tail_steps
        ]
        sa = load_checkpoint(list_checkpoints(root / "whole")[-1][1])["drafter"]
        sb = load_checkpoint(list_checkpoints(root / "resumed")[-1][1])["drafter"]
        param_diff = max(float((sa[k].float() - sb[k].float()).abs().max()) for k in sa)
        losses_equal = sorted(lb) == list(tail_steps) and all(la[s] == lb[s] for s in tail_steps)
        drafter_equal = all(torch.equal(sa[k], sb[k]) for k in sa)
    ctx.rec(
        "resume",
        seconds=round(resumed_s, 1),
        losses_equal=losses_equal,
        max_loss_diff=max(diffs),
        drafter_equal=drafter_equal,
        max_param_diff=param_diff,
    )
    if not (losses_equal and drafter_equal):
        raise RuntimeError(
            f"resume is not exact: max loss diff {max(diffs):.3g}, max param diff {param_diff:.3g}"
        )
    return {"steps_per_s": round(steps / whole_s, 2)}


# ----------------------------------------------------------------------------------- capture
def step_capture(ctx: Ctx) -> dict[str, Any]:
    import torch
    from transformers import Qwen3ForCausalLM

    from trainer.config import TinyTarget
    from trainer.model.target import TargetModel
    from trainer.model.tiny import tiny_config

    device = _device(ctx.smoke)
    if ctx.smoke:
        spec = TinyTarget(vocab_size=512, hidden_size=64, num_layers=4)
        hf = tiny_config(spec, init_std=0.02)
        shapes = [(2, 32), (4, 16)]
        dtype, reps = torch.float32, 2
    else:
        spec = TinyTarget(
            vocab_size=QWEN3_VOCAB,
            hidden_size=4096,
            intermediate_size=12288,
            num_layers=4,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
        )
        hf = tiny_config(spec, init_std=0.02, max_position_embeddings=40960)
        shapes = [(16, 3072), (64, 768), (4, 12288)]  # each 49,152 tokens: the seed's budget
        dtype, reps = torch.bfloat16, 3
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(hf)
    model.to(dtype)  # type: ignore[arg-type]  # transformers types `to` as if self were the arg
    layers = hf.num_hidden_layers
    target = TargetModel(model, list(range(1, layers)))  # deepest id = last layer: all run
    ctx.rec("model", layers=layers, hidden=hf.hidden_size, dtype=str(dtype))
    measured = []
    for rows, seq in shapes:
        if ctx.left() < 5:
            ctx.rec("skipped", rows=rows, seq=seq, left_s=ctx.left())
            break
        ids = torch.randint(0, hf.vocab_size, (rows, seq), device=device)
        attn = torch.ones(rows, seq, dtype=torch.long, device=device)
        base = _peak_reset(device)
        try:
            times = _timed(functools.partial(target.capture, ids, attn), device, reps)
        except Exception as exc:
            if not _is_oom(exc):
                raise
            ctx.rec("oom", rows=rows, seq=seq, error=str(exc).splitlines()[0][:300])
            _free(device)
            continue
        peak = _peak(device)
        tokens = rows * seq
        ms = statistics.median(times) * 1e3
        per_layer_tok_us = ms * 1e3 / (tokens * layers)
        measured.append(per_layer_tok_us)
        ctx.rec(
            "shape",
            rows=rows,
            seq=seq,
            tokens=tokens,
            ms=round(ms, 2),
            tokens_per_s=round(tokens / (ms / 1e3)),
            us_per_token_layer=round(per_layer_tok_us, 5),
            # the seed's capture runs layers 0..33 of Qwen3-8B (deepest id 33)
            est_ms_qwen3_8b=round(ms * 34 / layers, 1),
            peak_above_base_bytes=None if peak is None else peak - base,
        )
    return {"shapes": len(measured)}


# ----------------------------------------------------------------------------------- ce
def _ce_case(
    ctx: Ctx, n: int, d: int, weight: torch.Tensor, backends: Sequence[Backend], seed: int
) -> None:
    """Forward+backward of every backend at one N, recorded side by side (kind "kernel")."""
    import torch

    from trainer.kernels import lm_head_cross_entropy

    device, vocab = weight.device, weight.shape[0]
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen).to(device, weight.dtype).requires_grad_(True)
    labels = torch.randint(0, vocab, (n,), generator=gen).to(device)
    labels[::7] = -100
    upstream = torch.rand(n, generator=gen).to(device)
    ms_by: dict[str, float] = {}
    for backend in backends:
        if ctx.left() < 5:
            ctx.rec("skipped", n=n, backend=backend, left_s=ctx.left())
            return

        def call(backend: Backend = backend) -> None:
            out = lm_head_cross_entropy(hidden, weight, labels, backend=backend)
            torch.autograd.backward((out.loss * upstream).sum())
            hidden.grad = None

        base = _peak_reset(device)
        try:
            times = _timed(call, device, 3)
        except Exception as exc:
            if not _is_oom(exc):
                raise
            ctx.rec("oom", n=n, backend=backend, error=str(exc).splitlines()[0][:300])
            _free(device)
            continue
        peak = _peak(device)
        ms_by[backend] = statistics.median(times) * 1e3
        ctx.rec(
            "kernel",
            n=n,
            d=d,
            vocab=vocab,
            backend=backend,
            ms_fwd_bwd=round(ms_by[backend], 3),
            peak_above_base_bytes=None if peak is None else peak - base,
        )
    if "triton" in ms_by and "chunked" in ms_by:
        ctx.rec("ratio", n=n, chunked_over_triton=round(ms_by["chunked"] / ms_by["triton"], 3))


def step_ce(ctx: Ctx) -> dict[str, Any]:
    import torch

    device = _device(ctx.smoke)
    if ctx.smoke:
        small, large, d, vocab, dtype = 64, 256, 32, 1000, torch.float32
        fast: list[Backend] = ["chunked"]
    else:
        # 8,192 = 512 anchors x 16; 115,200 = the seed's median step (122,880 query rows) x 15/16
        small, large, d, vocab, dtype = 8192, 115_200, 4096, QWEN3_VOCAB, torch.bfloat16
        fast = ["chunked", "triton"]
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(vocab, d, generator=gen) / d**0.5).to(device, dtype)
    # dense ([N, V] fp32 logits) only at the small N, for the ratio
    _ce_case(ctx, small, d, weight, ["dense", *fast], seed=1)
    _free(device)
    _ce_case(ctx, large, d, weight, fast, seed=2)
    return {}


def measure_argv(
    smoke: bool, config: Path, cal: Path, steps: int, warmup: int, rounds: int
) -> list[str]:
    """The measure step's trainer.measure command. Its strategies: $GPU_SH_MEASURE_STRATEGIES
    when set (e.g. sorted,packed,packed@8192: rows of the token budget, which the CUDA
    target attends over whole), else every one (smoke: sorted,packed, the wiring only)."""
    argv = [sys.executable, "-m", "trainer.measure", "--config", str(config), "--json"]
    argv += ["--steps", str(steps), "--warmup", str(warmup), "--rounds", str(rounds)]
    argv += ["--save-calibration", str(cal)]
    chosen = os.environ.get("GPU_SH_MEASURE_STRATEGIES", "").strip()
    if smoke:  # the wiring, not the table: one-step windows
        argv += ["--window", "1", "--strategies", chosen or "sorted,packed"]
    elif chosen:
        argv += ["--strategies", chosen]
    return argv


def step_measure(ctx: Ctx) -> dict[str, Any]:
    """`python -m trainer.measure` on the pipeline step's config (GPU: the wider random target,
    every stage on cuda:0, bf16): every strategy through the real trainer, interleaved over two
    rounds; one record per strategy and the fitted step-cost model. Its per-run progress lines
    stream into gpu.log, so a run cut off by the box still shows the rounds it finished."""
    steps, warmup, rounds = (3, 1, 1) if ctx.smoke else (20, 5, 2)
    with tempfile.TemporaryDirectory(prefix="gpu-sh-measure-") as tmp:
        root = Path(tmp)
        config, env = pipeline_run(ctx, root, warmup + steps)
        cal = root / "calibration.json"
        argv = measure_argv(ctx.smoke, config, cal, steps, warmup, rounds)
        proc = subprocess.run(
            argv, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, timeout=max(ctx.left(), 5)
        )  # stderr (one line per timed run) streams into gpu.log
        if proc.returncode != 0:
            raise RuntimeError(f"trainer.measure exit {proc.returncode}")
        result = json.loads(proc.stdout)
    for name, e in result["strategies"].items():
        ratio = e["ratio_to_sorted"]
        ctx.rec(
            "strategy",
            strategy=name,
            tokens_s=e["tokens_s"],
            samples_s=e["samples_s"],
            anchor_blocks_s=e["anchor_blocks_s"],
            padding_efficiency=e["padding_efficiency"],
            ratio_to_sorted=None if ratio is None else ratio["tokens_s"],
            repeat=e["repeat"],
            predicted_tokens_s=e["predicted_tokens_s"],
            predicted_loo_tokens_s=e["predicted_loo_tokens_s"],
            rounds=[r["tokens_s"] for r in e["rounds"]],
        )
    c = result["calibration"]
    ctx.rec("calibration", coef=c["coef"], r2=c["r2"], points=c["points"])
    return {"strategies": list(result["strategies"]), "device": result["device"]}


STEPS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "doctor": step_doctor,
    "env": step_env,
    "drafter": step_drafter,
    "kernel-tests": step_kernel_tests,
    "pipeline": step_pipeline,
    "capture": step_capture,
    "ce": step_ce,
    "measure": step_measure,
}


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=list(STEPS))
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes (CI)")
    parser.add_argument("--out", type=Path, default=None, help="default: $OUT, else a temp dir")
    parser.add_argument("--budget", type=float, default=600.0, help="seconds this step may take")
    parser.add_argument("--fail", action="store_true", help="test hook: raise at the start")
    parser.add_argument("--stall", action="store_true", help="test hook: sleep until killed")
    args = parser.parse_args(list(argv) if argv is not None else None)
    out = args.out or Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-sh-"))
    rec = Recorder(out, args.step)
    ctx = Ctx(smoke=args.smoke, rec=rec, deadline=time.monotonic() + args.budget)
    rec("start", smoke=args.smoke, budget_s=args.budget)
    t0 = time.monotonic()
    try:
        if args.fail:
            raise RuntimeError("failing on purpose (--fail)")
        if args.stall:
            time.sleep(10**6)
        summary = STEPS[args.step](ctx)
    except Exception as exc:
        traceback.print_exc()
        rec("error", error=f"{type(exc).__name__}: {exc}"[:1000], seconds=time.monotonic() - t0)
        return 1
    rec("done", ok=True, seconds=round(time.monotonic() - t0, 2), **summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
