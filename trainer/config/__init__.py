"""The run config: one TOML file, validated into frozen pydantic sections, torch-free.

``dflashctl`` pushes this file to a container and validates it locally before it does, so it must
import without torch. Every section rejects unknown keys (a typo must not silently fall back to a
default for a multi-day run) and every error is ONE line naming the file and the dotted key::

    run.toml: optimizer.lr: Input should be greater than 0

Relative paths (``data.store``, ``model.target_dir``) are relative to the config file, so a run
directory can be moved or pushed as a unit; ``resolve()`` turns them into absolute paths.

``config_hash`` fingerprints the whole config; ``resume_critical_changes`` lists the dotted keys
whose change makes a checkpoint meaningless (data order, model shape), which the trainer refuses
to resume across unless ``--fresh``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Self, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from trainer.config.overlay import toml_value
from trainer.config.validation import STRICT, NotUtf8Error, one_line, utf8_text
from trainer.errors import TrainerError

__all__ = [
    "RESUME_CRITICAL_KEYS",
    "ConfigError",
    "EvalConfig",
    "LossConfig",
    "TrackingConfig",
    "TrainConfig",
    "config_hash",
    "resume_critical_changes",
]


class ConfigError(TrainerError, ValueError):
    """A bad run config; the message is one line naming the file and the dotted key."""


# Strict types and finite floats in every section (trainer.config.validation.STRICT): `max_batch = true`,
# `"64"` or `64.0` is an error naming the key, not 1 or 64; `lr = inf` is refused at load. An
# integer is still a valid float (`interval_s = 2`), as TOML writes whole numbers that way.
_SECTION = ConfigDict(**STRICT, extra="forbid", frozen=True)


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


# TOML (and a checkpoint's JSON dump of the config) has arrays, never tuples; strict mode would
# refuse a list for a tuple field, so arrays are turned into tuples first (items stay strict).
Beta = Annotated[float, Field(ge=0, lt=1)]
Betas = Annotated[tuple[Beta, Beta], BeforeValidator(_tuple)]


class SyntheticData(BaseModel):
    """Build a synthetic store at ``data.store`` on first run when it does not exist (demo/CI)."""

    model_config = _SECTION

    rows: int = Field(default=4000, ge=1, description="samples to generate")
    max_length: int = Field(default=128, ge=8, description="longest sample (tokens)")
    lengths_from: str = Field(default="seed-shaped", description="length distribution source")
    length_scale: float = Field(
        default=1.0, ge=1.0, description="divide source lengths (CPU demos keep the seed's shape)"
    )
    seed: int = Field(default=0, ge=0)


class DataConfig(BaseModel):
    model_config = _SECTION

    store: str = Field(description="token store directory (relative to the config file)")
    synthetic: SyntheticData | None = Field(
        default=None, description="create a synthetic store here if absent (tests and demos)"
    )


# The batching strategies, named once (the sampler and the tests take them from here).
Strategy = Literal["bucketed", "sorted", "random", "pool-sort", "packed"]
STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)


class BatchingConfig(BaseModel):
    model_config = _SECTION

    strategy: Strategy = "bucketed"
    boundaries: list[int] | Literal["plan"] = Field(
        default="plan", description='K+1 bucket edges, or "plan": optimal edges for num_buckets'
    )
    num_buckets: int = Field(default=6, ge=1, le=64, description="K when boundaries = 'plan'")
    token_budget: int = Field(
        ge=1, description="max padded tokens per batch (packed: rows x row_length)"
    )
    max_batch: int = Field(
        default=64, ge=1, description="max samples per batch (packed: documents, over its rows)"
    )
    pool_size: int = Field(default=3200, ge=1, description="pool for strategy 'pool-sort'")
    row_length: int | None = Field(
        default=None,
        ge=1,
        description="tokens per packed row for strategy 'packed' (>= the longest sample, "
        "<= token_budget); None: the longest sample",
    )

    @model_validator(mode="after")
    def _edges(self) -> Self:
        b = self.boundaries
        if isinstance(b, list) and (len(b) < 2 or any(x >= y for x, y in itertools.pairwise(b))):
            raise ValueError(f"boundaries {b} must be at least 2 strictly increasing edges")
        return self

    @field_validator("row_length")
    @classmethod
    def _row_length(cls, value: int | None, info: ValidationInfo) -> int | None:
        strategy, budget = info.data.get("strategy"), info.data.get("token_budget")
        if value is not None and strategy != "packed":
            raise ValueError(f"applies to strategy 'packed' only (strategy is {strategy!r})")
        if value is not None and isinstance(budget, int) and value > budget:
            raise ValueError(
                f"{value} is more than token_budget {budget}: a batch holds at least one row"
            )
        return value


class TinyTarget(BaseModel):
    """Build a tiny random Qwen3 at ``model.target_dir`` when absent (no downloads)."""

    model_config = _SECTION

    seed: int = Field(default=0, ge=0)
    vocab_size: int = Field(default=512, ge=16)
    hidden_size: int = Field(default=64, ge=8)
    num_layers: int = Field(default=8, ge=2)
    num_heads: int = Field(default=4, ge=1)
    num_kv_heads: int = Field(default=2, ge=1)
    head_dim: int = Field(default=16, ge=2)
    intermediate_size: int = Field(default=128, ge=8)


class DrafterShape(BaseModel):
    model_config = _SECTION

    num_layers: int = Field(default=5, ge=1)
    block_size: int = Field(default=16, ge=2)
    intermediate_size: int | None = Field(default=None, ge=1, description="None: the target's")
    num_attention_heads: int | None = Field(default=None, ge=1, description="None: the target's")
    num_key_value_heads: int | None = Field(default=None, ge=1, description="None: the target's")
    head_dim: int | None = Field(default=None, ge=1, description="None: the target's")
    checkpoint_layers: bool = Field(
        default=False,
        description="recompute each layer in backward (activation checkpointing): the same "
        "gradients for ~1/3 more drafter compute and only each layer's inputs kept",
    )


# The training losses (trainer.model.losses), named once.
LossType = Literal["ce", "dpace"]
DPACE_ALPHA = 0.5  # D-PACE's smoothing alpha when [model.loss] does not set one (the paper's)


class LossConfig(BaseModel):
    """``[model.loss]``: what the drafter minimises (resume-critical: a checkpoint trained one
    loss is not continued under another). The held-out evaluation's loss is always ``ce``."""

    model_config = _SECTION

    type: LossType = Field(
        default="ce",
        description='"ce": CE weighted exp(-(k-1)/gamma) per slot; "dpace": D-PACE weights '
        "(arXiv 2605.18810) from the drafter's own detached confidences, instead of the decay",
    )
    alpha: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description=f"D-PACE smoothing alpha in (0, 1] (type 'dpace' only); None: {DPACE_ALPHA}",
    )
    kd_weight: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="share of logit distillation from the target's own distribution: each "
        "slot's loss is (1 - kd_weight) CE + kd_weight soft-label CE; 0: off, 1: KD only",
    )

    @model_validator(mode="after")
    def _alpha_is_dpace(self) -> Self:
        if self.alpha is not None and self.type != "dpace":
            raise ValueError(f"alpha applies to type 'dpace' only (type is {self.type!r})")
        return self

    @property
    def dpace_alpha(self) -> float:
        return DPACE_ALPHA if self.alpha is None else self.alpha

    @property
    def distills(self) -> bool:
        """Whether the target's last hidden state is captured (kd_weight > 0)."""
        return self.kd_weight > 0

    def label(self) -> str:
        """One token naming the loss (status line, checkpoints, trackers): ``ce``,
        ``dpace(alpha:0.5)``, ``ce+kd(0.3)``."""
        text = "ce" if self.type == "ce" else f"dpace(alpha:{self.dpace_alpha:g})"
        return text + (f"+kd({self.kd_weight:g})" if self.distills else "")


class ModelConfig(BaseModel):
    model_config = _SECTION

    target_dir: str = Field(description="HF model directory of the frozen target (relative ok)")
    tiny_target: TinyTarget | None = Field(default=None, description="build target_dir if absent")
    drafter: DrafterShape = Field(default_factory=DrafterShape)
    target_layer_ids: list[int] | None = Field(
        default=None, description="decoder layers to capture; None: the DFlash formula"
    )
    mask_token_id: int = Field(ge=0, description="embedding row used for masked block slots")
    num_anchors: int = Field(default=512, ge=1, description="anchors sampled per sequence")
    gamma: float | None = Field(default=None, gt=0, description="slot decay; None: 7/5/4 rule")
    noise: float = Field(default=0.0, ge=0, description="std of Gaussian noise on hidden states")
    max_query_rows: int | None = Field(
        default=None,
        ge=1,
        description="query rows (anchors x block) per drafter micro-step; larger packets are "
        "split, gradients accumulating into one optimizer step; None: unbounded",
    )
    attention: Literal["auto", "sdpa", "flex"] = Field(
        default="auto",
        description="the drafter's attention in training: auto = compiled flex_attention on "
        "CUDA (tiles fitted to the device), SDPA elsewhere; flex that does not compile at the "
        "first step falls back to SDPA with one WARNING line (flex on CPU has no backward, so "
        "'flex' there always falls back)",
    )
    loss: LossConfig = Field(default_factory=LossConfig)


class TopologyConfig(BaseModel):
    model_config = _SECTION

    targets: Literal["per_rank", "shared"] = Field(
        default="per_rank",
        description="per_rank: each drafter rank runs target threads on its share of "
        "target_devices; shared: each target device is a rank of its own serving every drafter "
        "rank (any M:N split; launch len(drafter_devices) + len(target_devices) processes)",
    )
    target_devices: list[str] = Field(
        default=["cpu"], min_length=1, description='one target worker per entry, e.g. "cuda:1"'
    )
    drafter_devices: list[str] = Field(
        default=["cpu"], min_length=1, description="one per data-parallel rank on this node"
    )

    @field_validator("target_devices", "drafter_devices")
    @classmethod
    def _each_device_once(cls, value: list[str], info: ValidationInfo) -> list[str]:
        """targets = "shared": every process owns its device ("cpu" may repeat: CPU ranks)."""
        if info.data.get("targets") != "shared":
            return value
        others = info.data.get("target_devices", []) if info.field_name == "drafter_devices" else []
        seen: set[str] = set()
        others = ["cuda:0" if d == "cuda" else d for d in others]
        for dev in ("cuda:0" if d == "cuda" else d for d in value):
            if dev == "cpu":
                continue
            if dev in seen:
                raise ValueError(
                    f"{dev!r} is listed twice (targets = 'shared': one rank per device)"
                )
            if dev in others:
                raise ValueError(
                    f"{dev!r} is also in target_devices (targets = 'shared': one rank per device)"
                )
            seen.add(dev)
        return value

    prefetch_depth: int = Field(
        default=4, ge=1, description="capacity of each q_pre queue (one prefetch thread per bucket)"
    )
    hidden_depth: int = Field(default=4, ge=1, description="capacity of each q_hs queue")
    target_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


class OptimizerConfig(BaseModel):
    model_config = _SECTION

    lr: float = Field(default=6e-4, gt=0)
    betas: Betas = Field(default=(0.9, 0.95), description="AdamW betas, each in [0, 1)")
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    clip: float = Field(default=1.0, ge=0, description="max grad norm; 0 disables clipping")
    grad_accum: int = Field(default=1, ge=1, description="micro-batches per optimizer step")
    max_nonfinite: int = Field(
        default=20, ge=1, description="stop after this many non-finite losses in a row"
    )


class ScheduleConfig(BaseModel):
    model_config = _SECTION

    epochs: float = Field(default=6.0, gt=0)
    warmup_ratio: float | None = Field(default=0.04, ge=0, lt=1)
    warmup_steps: int | None = Field(default=None, ge=0, description="overrides warmup_ratio")
    min_lr: float = Field(default=0.0, ge=0, description="cosine floor")
    max_steps: int | None = Field(
        default=None,
        ge=1,
        description="stop early at this optimizer step (the LR schedule still spans all epochs)",
    )


class StatusConfig(BaseModel):
    model_config = _SECTION

    interval_s: float = Field(default=30.0, gt=0, description="seconds between status lines")
    rate_window_s: float = Field(default=60.0, gt=0, description="window of Ktok/s and b/s")


class CheckpointConfig(BaseModel):
    model_config = _SECTION

    every_steps: int | None = Field(default=1000, ge=1)
    every_minutes: float | None = Field(default=30.0, gt=0)
    keep_last: int = Field(default=3, ge=1)
    keep_every_steps: int | None = Field(
        default=None,
        ge=1,
        description="also keep every checkpoint whose step is a multiple of this (None: none)",
    )


class EvalConfig(BaseModel):
    """In-training held-out evaluation (trainer.pipeline.evaluate): off while holdout_rows = 0."""

    model_config = _SECTION

    holdout_rows: int = Field(
        default=0,
        ge=0,
        description="store rows held out of training, drawn by the run seed (resume-critical)",
    )
    holdout_store: str | None = Field(
        default=None,
        min_length=1,
        description="or a separate token store to evaluate on (its first max_rows rows; "
        "relative to the config file); excludes nothing from training",
    )
    every_steps: int | None = Field(default=None, ge=1, description="evaluate every N steps")
    every_minutes: float | None = Field(default=None, gt=0, description="and/or every N minutes")
    max_rows: int = Field(
        default=64, ge=1, description="held-out rows scored per evaluation (the set's first N)"
    )
    prompts: str | None = Field(
        default=None,
        min_length=1,
        description="prompt file in trainer.eval's formats: real greedy speculative tau on "
        "its first max_prompts prompts at each evaluation (relative to the config file)",
    )
    max_prompts: int = Field(default=4, ge=1, description="prompts decoded per evaluation")
    max_new_tokens: int = Field(default=128, ge=1, description="tokens per prompt")

    @model_validator(mode="after")
    def _needs_rows(self) -> Self:
        when = [k for k in ("every_steps", "every_minutes") if getattr(self, k) is not None]
        if self.holdout_rows and self.holdout_store is not None:
            raise ValueError("holdout_rows and holdout_store exclude each other: pick one")
        if when and self.holdout_rows == 0 and self.holdout_store is None:
            raise ValueError(
                f"{when[0]} needs holdout_rows > 0 or holdout_store (rows to evaluate on)"
            )
        if self.prompts is not None and not when:
            raise ValueError("prompts needs every_steps or every_minutes (when to decode them)")
        return self

    @property
    def enabled(self) -> bool:
        return self.every_steps is not None or self.every_minutes is not None


class TrackingConfig(BaseModel):
    """Optional experiment trackers (trainer.tracking); never resume-critical."""

    model_config = _SECTION

    backends: list[Literal["tensorboard", "wandb"]] = Field(
        default=[], description='trackers to write to: "tensorboard" (RUN/tb/), "wandb"'
    )
    wandb_project: str = Field(default="dflash", min_length=1, description="W&B project")
    wandb_mode: Literal["auto", "offline", "online", "disabled"] = Field(
        default="auto", description="auto: online when an API key is configured, else offline"
    )

    @model_validator(mode="after")
    def _distinct(self) -> Self:
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"backends {self.backends} lists a backend twice")
        return self


class TrainConfig(BaseModel):
    """The whole run. Load with ``TrainConfig.load(path)``."""

    model_config = _SECTION

    seed: int = Field(default=0, ge=0)
    data: DataConfig
    batching: BatchingConfig
    model: ModelConfig
    topology: TopologyConfig = Field(default_factory=TopologyConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    status: StatusConfig = Field(default_factory=StatusConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    _source: Path | None = PrivateAttr(default=None)

    @classmethod
    def load(cls, path: str | Path) -> TrainConfig:
        """Read and validate a TOML run config; raises ConfigError (one line) on any problem."""
        path = Path(path)
        try:
            raw = tomllib.loads(utf8_text(path.read_bytes()))
        except OSError as err:
            raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from None
        except NotUtf8Error as err:
            raise ConfigError(f"{path}: {err}") from None
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: invalid TOML: {err}") from None
        cfg = cls.from_dict(raw, source=str(path))
        cfg._source = path.resolve()
        return cfg

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "<config>") -> TrainConfig:
        """Validate a parsed mapping; errors name ``source`` and the first bad dotted key."""
        try:
            return cls.model_validate(raw)
        except ValidationError as err:
            raise ConfigError(f"{source}: {one_line(err)}") from None

    @property
    def source(self) -> Path | None:
        """The file this config was loaded from (None when built in memory)."""
        return self._source

    def resolve(self, relative: str) -> Path:
        """A path from the config, made absolute against the config file's directory."""
        p = Path(relative).expanduser()
        if p.is_absolute() or self._source is None:
            return p
        return (self._source.parent / p).resolve()

    def to_toml(self) -> str:
        """Canonical TOML of this config (saved next to checkpoints for the record)."""
        return _to_toml(self.model_dump(mode="json", exclude_none=True))


def config_hash(cfg: TrainConfig) -> str:
    """sha256-12 of the canonical JSON of the config (as written: relative paths stay relative)."""
    blob = json.dumps(cfg.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


# Dotted keys (or prefixes) whose change makes an existing checkpoint unusable: the batch order,
# the samples themselves, or the shape/meaning of the drafter's weights.
RESUME_CRITICAL_KEYS: tuple[str, ...] = (
    "seed",
    "data.store",
    "batching.strategy",
    "batching.boundaries",
    "batching.num_buckets",
    "batching.token_budget",
    "batching.max_batch",
    "batching.pool_size",
    "batching.row_length",
    "model.target_dir",
    "model.tiny_target",
    "model.drafter",
    "model.target_layer_ids",
    "model.mask_token_id",
    "model.loss",  # what the optimizer state was minimising
    "optimizer.grad_accum",
    "eval.holdout_rows",  # which rows train
)
# Keys under a critical prefix that change only how the same numbers are computed.
RESUME_SAFE_KEYS: tuple[str, ...] = ("model.drafter.checkpoint_layers",)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict) and d:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else k))
        return out
    return {prefix: d}


def resume_critical_changes(old: TrainConfig, new: TrainConfig) -> list[str]:
    """Dotted keys that differ between ``old`` and ``new`` and make resuming impossible."""
    a = _flatten(old.model_dump(mode="json"))
    b = _flatten(new.model_dump(mode="json"))
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k, _ABSENT) != b.get(k, _ABSENT))
    return [
        k
        for k in changed
        if k not in RESUME_SAFE_KEYS
        and any(k == c or k.startswith(c + ".") for c in RESUME_CRITICAL_KEYS)
    ]


_ABSENT = object()


def _to_toml(d: dict[str, Any], prefix: str = "") -> str:
    scalars = [f"{k} = {toml_value(v)}" for k, v in d.items() if not isinstance(v, dict)]
    tables = [
        _to_toml(v, f"{prefix}.{k}" if prefix else k) for k, v in d.items() if isinstance(v, dict)
    ]
    head = [f"[{prefix}]"] if prefix and scalars else []
    body = "\n".join(head + scalars)
    return "\n\n".join(x for x in [body, *tables] if x) + ("\n" if not prefix else "")
