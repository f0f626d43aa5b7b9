"""Run the real trainer for a few optimizer steps of one batching strategy, and read its timings.

Each timed run is `python -m trainer` itself (a subprocess), on a config derived from the user's
(`derive`): `batching.strategy` set, `schedule.max_steps` = warm-up + timed steps, no periodic
checkpoints, no evals, no trackers, the first drafter device and its share of the target
devices (one rank: "per device"), paths made absolute. So whatever the pipeline is (stages,
overlap, kernels, packing) is what is timed, and nothing here tracks its internals. The trainer
writes one metrics.jsonl record per optimizer step with `elapsed_s` (seconds since its start,
taken right after the step's host sync): step ends, differences of which are step times. The
target loads during the warm-up, never inside the timed steps.

The batches of every step are recomputed here from the same pure functions the trainer uses
(`trainer.pipeline.build` builds the sampler and the plan from the config), and their features
(`trainer.bucketing.timecost.FEATURES`) come from the `Batch` (rows, width, documents) and the
store's loss mask (anchor-eligible positions per sample).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import trainer
from trainer.bucketing.compare import measure as measure_epochs
from trainer.bucketing.timecost import FEATURES, batch_features, eligible_counts
from trainer.config import ConfigError, TrainConfig
from trainer.config.overlay import dump_toml, merge
from trainer.data.store import TokenStore
from trainer.errors import ExitCode, TrainerError
from trainer.pipeline.plan import BatchPlan
from trainer.sampler import BatchSampler, SamplerError

PREDICT_BATCHES = 2000  # epoch batches a prediction averages over (all of them, below this)
NEVER = 10**9  # checkpoint.every_steps / every_minutes of a timing run: only the final save
RUN_TIMEOUT_S = 3600.0


class MeasureError(TrainerError, ValueError):
    """A measurement that cannot run as asked (one line naming the flag or key): exit 2."""


class RunFailed(MeasureError):
    """A timing run of the trainer failed (one line: its last ERROR line): exit 1."""

    exit_code = ExitCode.FAILED


def variant(name: str) -> tuple[str, dict[str, Any]]:
    """A measured strategy name -> (batching.strategy, the batching keys it sets): `packed@N` is
    packed with `row_length = N` (ValueError names a malformed one)."""
    base, sep, length = name.partition("@")
    if not sep:
        return name, {}
    if base != "packed" or not length.isdigit() or int(length) < 1:
        raise ValueError(
            f"{name!r}: @N is a row length of N >= 1 tokens, for packed only (packed@1024)"
        )
    return base, {"row_length": int(length)}


def derive(cfg: TrainConfig, raw: dict[str, Any], strategy: str, max_steps: int) -> dict[str, Any]:
    """The timing run's config table from the user's parsed TOML `raw` (see module doc);
    `strategy` may be a `variant` (packed@N)."""
    base, keys = variant(strategy)
    topo = cfg.topology
    n_ranks = max(1, len(topo.drafter_devices))
    targets = topo.target_devices
    if len(targets) >= n_ranks:
        targets = targets[::n_ranks]  # rank 0's share (`distributed.pick_devices`)
    out = merge(
        raw,
        {
            "batching": {"strategy": base, **keys},
            "schedule": {"max_steps": max_steps},
            "checkpoint": {"every_steps": NEVER, "every_minutes": float(NEVER)},
            "topology": {"drafter_devices": topo.drafter_devices[:1], "target_devices": targets},
            "data": {"store": str(cfg.resolve(cfg.data.store))},
            "model": {"target_dir": str(cfg.resolve(cfg.model.target_dir))},
        },
    )
    ev = dict(out.get("eval", {}))
    for key in ("every_steps", "every_minutes", "prompts"):
        ev.pop(key, None)
    if ev.get("holdout_store"):
        ev["holdout_store"] = str(cfg.resolve(ev["holdout_store"]))
    out["eval"] = ev
    out.pop("tracking", None)
    return out


@dataclass(frozen=True)
class StrategyRun:
    """One timed run of one strategy: `steps` optimizer steps after `warmup` untimed ones."""

    strategy: str
    ends: np.ndarray  # seconds from the end of the warm-up to the end of each timed step
    cpu_ends: np.ndarray  # the trainer process's CPU seconds (all threads), same points
    features: np.ndarray  # (steps, len(FEATURES)) per timed step, summed over micro-batches
    real_tokens: np.ndarray  # per timed step (int64)
    samples: np.ndarray  # per timed step (int64)
    real_blocks: np.ndarray  # anchor blocks drawn from real eligible positions, per step
    largest_batch: int  # padded tokens of the largest timed micro-batch
    largest_samples: int  # most samples in one timed micro-batch


@dataclass(frozen=True)
class StrategyInfo:
    """What does not change between rounds: diversity, the sampler's warnings, and the features
    of epoch 0's batches (a sample of `PREDICT_BATCHES`) for the prediction."""

    strategy: str
    repeat: float | None
    warnings: tuple[str, ...]
    epoch_features: np.ndarray  # (n, len(FEATURES)) per sampled micro-batch
    epoch_tokens: np.ndarray
    epoch_samples: np.ndarray
    steps_per_epoch: int


class Measurer:
    """Derives each strategy's config, runs the trainer on it, and reads back its steps."""

    def __init__(self, cfg: TrainConfig, raw: dict[str, Any], work: Path | None = None) -> None:
        self.cfg, self.raw = cfg, raw
        self.work = work or Path(tempfile.mkdtemp(prefix="dflash-measure-"))
        self._store: TokenStore | None = None
        self._eligible: np.ndarray | None = None
        self._per_document: bool | None = None
        self.infos: dict[str, StrategyInfo] = {}

    @classmethod
    def from_file(
        cls, path: str | Path, work: Path | None = None, over: dict[str, Any] | None = None
    ) -> Measurer:
        """The config file with `over` laid on top (ConfigError: one line naming the key)."""
        cfg = TrainConfig.load(path)
        raw = merge(tomllib.loads(Path(path).read_text()), over or {})
        if over:
            cfg = TrainConfig.from_dict(raw, source=f"{path} (with --set)")
            cfg._source = Path(path).resolve()
        return cls(cfg, raw, work)

    def _topology(self) -> dict[str, Any]:
        """The timing runs' `[topology]` (every strategy's is the same)."""
        table: dict[str, Any] = derive(self.cfg, self.raw, "sorted", 1)["topology"]
        return table

    def device(self) -> str:
        """Where the timing runs train: the first drafter device and its target devices."""
        table = self._topology()
        return f"drafter {table['drafter_devices'][0]}, target {','.join(table['target_devices'])}"

    def config_for(self, strategy: str, max_steps: int) -> tuple[TrainConfig, Path]:
        """The timing run's validated config and its file (ConfigError names the key)."""
        table = derive(self.cfg, self.raw, strategy, max_steps)
        path = self.work / f"{strategy}.toml"
        path.write_text(dump_toml(table))
        return TrainConfig.load(path), path

    def store(self, cfg: TrainConfig) -> TokenStore:
        if self._store is None:
            from trainer.pipeline import assets

            self._store = TokenStore.open(assets.ensure_store(cfg))
        return self._store

    def document_lengths(self, cfg: TrainConfig) -> np.ndarray | None:
        """Every sample's length when the timing runs' target attends per document (the
        packed batches' attention feature is then per document, `batch_features`), else None."""
        if self._per_document is None:
            from trainer.model.target import TargetModel
            from trainer.pipeline import assets

            device = self._topology()["target_devices"][0]
            try:
                hf = assets.target_hf_config(assets.ensure_target(cfg))
            except assets.UserError as exc:
                raise MeasureError(str(exc)) from None
            self._per_document = TargetModel.attends_per_document(hf, device)
        return np.asarray(self.store(cfg).lengths) if self._per_document else None

    def eligible(self, cfg: TrainConfig) -> np.ndarray:
        if self._eligible is None:
            s = self.store(cfg)
            self._eligible = eligible_counts(s.mask, s.offsets)
        return self._eligible

    def plan(self, cfg: TrainConfig) -> BatchPlan:
        """The trainer's own plan for `cfg` (rank 0 of one): the sampler `build_parts` makes."""
        from trainer.pipeline import assets, build
        from trainer.pipeline.distributed import World

        try:
            _, sampler = build._data(cfg, World(), self.store(cfg))
        except assets.UserError as exc:
            raise MeasureError(str(exc)) from None
        return BatchPlan(sampler, cfg.schedule.epochs)

    def info(self, cfg: TrainConfig, sampler: BatchSampler) -> StrategyInfo:
        """Diversity over two epochs (`trainer.bucketing.compare.measure`) and the features of
        (a sample of) epoch 0's batches."""
        report = measure_epochs(sampler, 2)
        batches = sampler.epoch_batches(0)
        pick = np.arange(len(batches))
        if len(batches) > PREDICT_BATCHES:
            pick = np.sort(np.random.default_rng(0).choice(len(batches), PREDICT_BATCHES, False))
        elig, a, docs = self.eligible(cfg), cfg.model.num_anchors, self.document_lengths(cfg)
        return StrategyInfo(
            strategy=sampler.strategy,
            repeat=report.pair_repeat,
            warnings=tuple(sampler.warnings),
            epoch_features=np.stack([batch_features(batches[i], elig, a, docs) for i in pick]),
            epoch_tokens=np.array([batches[i].real_tokens for i in pick], dtype=np.int64),
            epoch_samples=np.array([len(batches[i].indices) for i in pick], dtype=np.int64),
            steps_per_epoch=len(batches),
        )

    def check(self, strategy: str, steps: int, warmup: int) -> tuple[TrainConfig, Path, BatchPlan]:
        """`strategy`'s timing-run config, its file and plan, checked before any run (a bad
        row length or too few batches is one line, not an error after hours of other runs)."""
        try:
            cfg, path = self.config_for(strategy, warmup + steps)
            plan = self.plan(cfg)
        except (ConfigError, MeasureError, SamplerError) as exc:
            if "@" not in strategy:
                raise
            said = str(exc).removeprefix(f"{self.work / strategy}.toml: ")
            raise MeasureError(f"--strategies {strategy}: {said}") from None
        accum = cfg.optimizer.grad_accum
        if plan.total < (warmup + steps) * accum:
            raise MeasureError(
                f"--steps/--warmup: {warmup} + {steps} steps need {(warmup + steps) * accum} "
                f"micro-batches but strategy {strategy!r} plans {plan.total} in "
                f"schedule.epochs = {cfg.schedule.epochs:g}: ask for fewer steps"
            )
        return cfg, path, plan

    def run(self, strategy: str, steps: int, warmup: int, tag: str) -> StrategyRun:
        """`warmup` + `steps` optimizer steps of `python -m trainer` on `strategy`."""
        cfg, path, plan = self.check(strategy, steps, warmup)
        if strategy not in self.infos:
            self.infos[strategy] = self.info(cfg, plan.sampler)
        run_dir = self.work / f"run-{tag}"
        wall, cpu = self._train(path, run_dir, warmup + steps)
        ends = wall[warmup:] - (wall[warmup - 1] if warmup else 0.0)
        cpu_ends = cpu[warmup:] - (cpu[warmup - 1] if warmup else 0.0)
        return self._record(cfg, plan, strategy, steps, warmup, ends, cpu_ends)

    def _train(self, config: Path, run_dir: Path, steps: int) -> tuple[np.ndarray, np.ndarray]:
        """Run the trainer; `elapsed_s` and `cpu_s` of each of its `steps` metrics records."""
        env = dict(os.environ)
        root = str(Path(trainer.__file__).resolve().parents[1])
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-m", "trainer", "--config", str(config)]
        cmd += ["--run-dir", str(run_dir), "--resume", "never"]
        try:
            proc = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired:
            raise RunFailed(f"trainer run {run_dir.name} took over {RUN_TIMEOUT_S:.0f} s") from None
        if proc.returncode != 0:
            errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("ERROR")]
            tail = errors[-1] if errors else (proc.stderr.strip().splitlines() or ["?"])[-1]
            raise RunFailed(f"trainer run {run_dir.name} exited {proc.returncode}: {tail}")
        records = [
            json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln
        ]
        by_step = {int(r["step"]): r for r in records}
        if any(s not in by_step for s in range(1, steps + 1)):
            raise RunFailed(f"trainer run {run_dir.name}: metrics.jsonl lacks steps 1..{steps}")
        if "elapsed_s" not in by_step[1] or "cpu_s" not in by_step[1]:
            raise MeasureError(
                "the trainer's metrics.jsonl has no elapsed_s/cpu_s (a trainer older than this "
                "measure tool)"
            )
        wall = np.array([float(by_step[s]["elapsed_s"]) for s in range(1, steps + 1)])
        return wall, np.array([float(by_step[s]["cpu_s"]) for s in range(1, steps + 1)])

    def _record(
        self,
        cfg: TrainConfig,
        plan: BatchPlan,
        strategy: str,
        steps: int,
        warmup: int,
        ends: np.ndarray,
        cpu_ends: np.ndarray,
    ) -> StrategyRun:
        accum = cfg.optimizer.grad_accum
        elig, a, docs = self.eligible(cfg), cfg.model.num_anchors, self.document_lengths(cfg)
        feats = np.zeros((steps, len(FEATURES)))
        tokens = np.zeros(steps, dtype=np.int64)
        samples = np.zeros(steps, dtype=np.int64)
        blocks = np.zeros(steps, dtype=np.int64)
        largest, largest_n = 0, 0
        for i in range(steps):
            for j in range(accum):
                batch = plan.batch((warmup + i) * accum + j)
                feats[i] += batch_features(batch, elig, a, docs)
                tokens[i] += batch.real_tokens
                samples[i] += len(batch.indices)
                blocks[i] += int(np.minimum(elig[batch.indices], a).sum())
                largest = max(largest, batch.padded_tokens)
                largest_n = max(largest_n, len(batch.indices))
        return StrategyRun(
            strategy, ends, cpu_ends, feats, tokens, samples, blocks, largest, largest_n
        )
