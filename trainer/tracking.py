"""Experiment trackers: the status and eval figures, also written to TensorBoard and/or W&B.

``open_trackers(cfg.tracking, run_dir)`` returns one ``Tracker``; the runner calls
``log_event(tracker, event)`` for every status and eval event it prints and ``close()`` at the end.
Both backends are optional and imported only when enabled (``torch.utils.tensorboard`` needs the
``tensorboard`` package, W&B needs ``wandb``; both are in the ``train`` extra).

A tracker must never stop training: each backend is wrapped so that its first failure (import,
disk, network) prints ONE warning line naming the backend and the reason, and that backend is
dropped for the rest of the run while the others keep logging.

W&B: ``wandb_mode = "auto"`` runs online when an API key is configured (``WANDB_API_KEY``, or
the file ``dflashctl secret HOST wandb`` writes: ``WORKDIR/secrets/wandb``, i.e. ``secrets/wandb``
next to the run directory), else offline under ``RUN/wandb/`` (``wandb sync`` uploads it later).
An online start that fails falls back to offline. The run id is kept in ``RUN/wandb-run-id``, so
a resumed run continues the same W&B run. The key is passed to wandb in its settings, never put
in the environment, and scrubbed from every warning.
"""

from __future__ import annotations

import functools
import os
import secrets
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from trainer.config import TrackingConfig
from trainer.events import (
    BUCKET_LOSS_KEY,
    GNORM_KEY,
    STAGE_WAIT_KEYS,
    EvalEvent,
    StatusEvent,
    parse_bucket_losses,
)

__all__ = [
    "TB_DIR",
    "WANDB_ID_FILE",
    "GuardedTracker",
    "MultiTracker",
    "Tracker",
    "eval_scalars",
    "event_scalars",
    "log_event",
    "open_trackers",
    "read_wandb_key",
    "resolve_wandb_mode",
    "status_scalars",
]

TB_DIR = "tb"
WANDB_ID_FILE = "wandb-run-id"
WANDB_SECRET = "wandb"
NONFINITE_KEY = "nonfinite"  # non-finite losses skipped in a row (trainer.pipeline.status)

Warn = Callable[[str], None]


class Tracker(Protocol):
    """Where scalars go: one call per status interval or evaluation."""

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- event -> scalars


def _number(text: str | None) -> float | None:
    """An extra's value as a number (``12.5%`` -> 12.5); None when it is not one."""
    if not text:
        return None
    try:
        return float(text[:-1] if text.endswith("%") else text)
    except ValueError:
        return None


def _put(out: dict[str, float], tag: str, value: float | None) -> None:
    if value is not None:
        out[tag] = float(value)


def status_scalars(ev: StatusEvent) -> dict[str, float]:
    """Every figure of a status line as tracker tags (``train/*``, ``speed/*``, ``wait/*``, ``queue/*``).

    Missing fields (``---``) are left out rather than logged as zero. Samples/s are the target's
    and the drafter's batch rates (``tgt``/``dft`` b/s); ``train/loss_b{i}`` is bucket i's mean
    loss over the interval when the line carries ``loss_b=[...]``.
    """
    out: dict[str, float] = {}
    _put(out, "train/loss", ev.loss)
    _put(out, "train/acc", ev.acc)
    _put(out, "train/streak", ev.streak)
    _put(out, "train/lr", ev.lr)
    _put(out, "train/epoch", ev.epoch)
    _put(out, "speed/ktok_s", ev.ktok_s)
    _put(out, "speed/tgt_batches_s", ev.tgt_bps)
    _put(out, "speed/dft_batches_s", ev.dft_bps)
    _put(out, "train/gnorm", _number(ev.extra.get(GNORM_KEY)))
    for key in STAGE_WAIT_KEYS:
        _put(out, f"wait/{key}", _number(ev.extra.get(key)))
    _put(out, "train/nonfinite", _number(ev.extra.get(NONFINITE_KEY)))
    for i, depth in enumerate(ev.q_pre):
        out[f"queue/q_pre{i}"] = float(depth)
    for i, depth in enumerate(ev.q_hs):
        out[f"queue/q_hs{i}"] = float(depth)
    buckets = parse_bucket_losses(ev.extra.get(BUCKET_LOSS_KEY, ""))
    for i, loss in enumerate(buckets or ()):
        _put(out, f"train/loss_b{i}", loss)
    return out


def eval_scalars(ev: EvalEvent) -> dict[str, float]:
    """Every figure of an eval line as ``eval/*`` tags (acc@k as ``eval/acc@k``, numeric extras)."""
    out: dict[str, float] = {}
    _put(out, "eval/tau", ev.tau)
    _put(out, "eval/tau_real", ev.tau_real)
    _put(out, "eval/tau_exp", ev.tau_exp)
    _put(out, "eval/loss", ev.loss)
    _put(out, "eval/acc", ev.acc)
    for k, acc in enumerate(ev.acc_at, 1):
        out[f"eval/acc@{k}"] = acc
    _put(out, "eval/best_step", ev.best)
    for key, value in ev.extra.items():
        _put(out, f"eval/{key}", _number(value))
    return out


def event_scalars(ev: object) -> tuple[int, dict[str, float]] | None:
    """(step, scalars) for a status or eval event; None for any other event."""
    if isinstance(ev, StatusEvent):
        return ev.step, status_scalars(ev)
    if isinstance(ev, EvalEvent):
        return ev.step, eval_scalars(ev)
    return None


def log_event(tracker: Tracker, ev: object) -> None:
    """Log a status or eval event's figures (other events are ignored): the runner's one call."""
    item = event_scalars(ev)
    if item is not None and item[1]:
        tracker.log_scalars(*item)


# --------------------------------------------------------------------------- guard and fan-out


def _reason(exc: BaseException, scrub: str | None) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if scrub:
        text = text.replace(scrub, "***")
    return f"{type(exc).__name__}: {text}"[:300]


class GuardedTracker:
    """One backend; its first exception warns once and disables it (training goes on)."""

    def __init__(self, name: str, inner: Tracker, warn: Warn, scrub: str | None = None) -> None:
        self.name = name
        self._inner: Tracker | None = inner
        self._warn = warn
        self._scrub = scrub

    @property
    def active(self) -> bool:
        return self._inner is not None

    def _fail(self, what: str, exc: BaseException) -> None:
        self._inner = None
        self._warn(
            f"tracking: {self.name} {what} failed, {self.name} logging is off for this run"
            f" ({_reason(exc, self._scrub)})"
        )

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._inner is None:
            return
        try:
            self._inner.log_scalars(step, scalars)
        except Exception as exc:
            self._fail("logging", exc)

    def close(self) -> None:
        inner, self._inner = self._inner, None
        if inner is None:
            return
        try:
            inner.close()
        except Exception as exc:
            self._fail("close", exc)


class MultiTracker:
    """All enabled backends; an empty one does nothing (the default config)."""

    def __init__(self, trackers: list[GuardedTracker]) -> None:
        self.trackers = trackers

    @property
    def names(self) -> list[str]:
        """The backends still logging."""
        return [t.name for t in self.trackers if t.active]

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        for t in self.trackers:
            t.log_scalars(step, scalars)

    def close(self) -> None:
        for t in self.trackers:
            t.close()


# --------------------------------------------------------------------------- backends


class TensorBoardTracker:
    """Event files under ``RUN/tb/`` through ``torch.utils.tensorboard.SummaryWriter``;
    ``notes`` (what the run is, e.g. its loss) are written once as text ``run/<key>``."""

    def __init__(
        self,
        log_dir: Path,
        resume_step: int | None = None,
        notes: Mapping[str, str] | None = None,
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter  # heavy: only when enabled

        self.log_dir = log_dir
        # purge_step: a run resumed from step S re-trains the steps after S; TensorBoard then
        # drops the first attempt's points from S on, so each step shows once (the resumed one).
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=resume_step)
        for key, text in (notes or {}).items():
            self._writer.add_text(f"run/{key}", text, global_step=resume_step or 0)
        self._writer.flush()

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()  # one small write per status interval; readers see it live

    def close(self) -> None:
        self._writer.close()


def read_wandb_key(secrets_dir: Path, env: Mapping[str, str]) -> str | None:
    """The W&B API key: ``WANDB_API_KEY``, else ``secrets_dir/wandb``; None when neither is set.

    Raises OSError when the secret file exists but cannot be read (the caller warns and goes
    offline). The key is never printed.
    """
    key = env.get("WANDB_API_KEY", "").strip()
    if key:
        return key
    try:
        key = (secrets_dir / WANDB_SECRET).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    return key or None


def resolve_wandb_mode(mode: str, key: str | None) -> str:
    """The wandb.init mode: ``auto`` is online with a key, offline without one."""
    if mode == "auto":
        return "online" if key else "offline"
    return mode


def wandb_run_id(run_dir: Path) -> str:
    """The run's W&B id, created on first use and kept in ``RUN/wandb-run-id`` (resume = same)."""
    path = run_dir / WANDB_ID_FILE
    try:
        run_id = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        run_id = ""
    if run_id:
        return run_id
    run_id = secrets.token_hex(4)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(run_id + "\n", encoding="utf-8")
    tmp.replace(path)
    return run_id


class _WandbRun(Protocol):
    """What WandbTracker uses of a `wandb.Run` (wandb is imported only when enabled)."""

    def log(self, data: dict[str, float], step: int) -> None: ...

    def finish(self) -> None: ...


class WandbTracker:
    """A W&B run (online or offline) under ``RUN/wandb/``; stdout is left alone (console off)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        project: str,
        mode: str,
        key: str | None,
        name: str | None,
        config: Mapping[str, Any] | None,
        warn: Warn,
        init_timeout: float = 30.0,
    ) -> None:
        import wandb  # heavy: only when enabled

        self.run_id = wandb_run_id(run_dir)
        self.mode = mode
        self._init_timeout = init_timeout
        try:
            self._run = self._init(wandb, run_dir, project, mode, key, name, config)
        except Exception as exc:
            if mode != "online":
                raise
            # The failed online run still holds the id in this process: tear it down first.
            wandb.teardown()
            self._run = self._init(wandb, run_dir, project, "offline", None, name, config)
            self.mode = "offline"  # only once offline works: one warning either way
            warn(
                f"tracking: wandb online start failed ({_reason(exc, key)}); logging offline"
                f" to {run_dir / 'wandb'} (upload later with `wandb sync`)"
            )

    def _init(
        self,
        wandb: ModuleType,
        run_dir: Path,
        project: str,
        mode: str,
        key: str | None,
        name: str | None,
        config: Mapping[str, Any] | None,
    ) -> _WandbRun:
        settings = wandb.Settings(
            silent=True,
            console="off",  # dflashctl parses the trainer's stdout: never wrapped
            disable_git=True,
            save_code=False,
            init_timeout=self._init_timeout,
            **({"api_key": key} if key else {}),
        )
        run: _WandbRun = wandb.init(
            project=project,
            id=self.run_id,
            resume="allow",
            name=name,
            dir=str(run_dir),
            mode=mode,
            config=dict(config) if config else None,
            settings=settings,
            reinit="create_new",
        )
        return run

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        self._run.finish()


def _open(
    name: str, build: Callable[[], Tracker], warn: Warn, scrub: str | None
) -> list[GuardedTracker]:
    try:
        return [GuardedTracker(name, build(), warn, scrub)]
    except Exception as exc:
        warn(f"tracking: {name} could not start, {name} logging is off ({_reason(exc, scrub)})")
        return []


def open_trackers(
    cfg: TrackingConfig,
    run_dir: Path,
    *,
    name: str | None = None,
    config: Mapping[str, Any] | None = None,
    warn: Warn = _stderr,
    secrets_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
    wandb_init_timeout: float = 30.0,
    resume_step: int | None = None,
    notes: Mapping[str, str] | None = None,
) -> MultiTracker:
    """The trackers ``cfg.backends`` names, each guarded; a backend that cannot start warns once.

    ``notes``: one-word facts about the run (``{"loss": "dpace(alpha:0.5)"}``), as TensorBoard
    text ``run/<key>`` and top-level W&B config keys (beside ``config``).

    ``secrets_dir`` defaults to ``secrets/`` next to the run directory (dflashctl runs the trainer
    in WORKDIR with ``--run-dir run``; ``dflashctl secret HOST wandb`` writes WORKDIR/secrets/).
    An online W&B start that gets no answer within ``wandb_init_timeout`` s goes offline.
    ``resume_step``: the checkpoint step a resumed run starts from (TensorBoard purges later
    points of the earlier attempt; W&B keeps its own rule: a step below the run's last is dropped).
    """
    run_dir = Path(run_dir)
    env = os.environ if env is None else env
    trackers: list[GuardedTracker] = []
    for backend in cfg.backends:
        if backend == "tensorboard":
            trackers += _open(
                "tensorboard",
                lambda: TensorBoardTracker(run_dir / TB_DIR, resume_step, notes),
                warn,
                None,
            )
        elif backend == "wandb" and cfg.wandb_mode != "disabled":
            try:
                key = read_wandb_key(secrets_dir or run_dir.parent / "secrets", env)
            except OSError as exc:
                warn(f"tracking: wandb key file unreadable ({_reason(exc, None)}); offline")
                key = None
            mode = resolve_wandb_mode(cfg.wandb_mode, key)
            trackers += _open(
                "wandb",
                functools.partial(
                    WandbTracker,
                    run_dir,
                    project=cfg.wandb_project,
                    mode=mode,
                    key=key,
                    name=name,
                    config={**(config or {}), **(notes or {})} or None,
                    warn=warn,
                    init_timeout=wandb_init_timeout,
                ),
                warn,
                key,
            )
    return MultiTracker(trackers)
