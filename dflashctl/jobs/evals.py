"""`dflashctl eval HOST`: `python -m trainer.eval --engine vllm` in the host's container, as a
detached job (`dflashctl.jobs.control`).

What is evaluated: an export already in the container (`--drafter DIR`), or a checkpoint of the
run (`--checkpoint latest|best|STEP|PATH`, resolved here to one file and its step, exported by
`python -m trainer.export` into the job's directory first). The target is the run config's
`model.target_dir` (resolved against run/, as the trainer resolves it) unless `--target` names
one. Prompt sets are the operator's local files, pushed into the job's `prompts/` (so the record
holds what was evaluated), and/or files already in the container (`--remote-prompts`). The
engine is one the job starts on the container (`--serve-cmd`) or one already serving
(`--server URL`, as the container reaches it). The job writes `result.json` (trainer.eval's
--json) and `summary.json` (`trainer.events.served`), which status and the TUI read.

Pure builders first, then `EvalJob`, the service over a Transport.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflashctl.config.inventory import HostConfig
from dflashctl.errors import UsageError
from dflashctl.jobs.control import JobControl, JobStarted
from dflashctl.jobs.state import JobError, JobState
from dflashctl.remote.files import read_file
from dflashctl.remote.jobs import EVAL, chain
from dflashctl.remote.layout import (
    CHECKPOINTS,
    JOB_EXPORT,
    JOB_PROMPTS,
    JOB_RESULT,
    JOB_SUMMARY,
    RemoteLayout,
)
from dflashctl.remote.transport import Transport
from trainer.events import sanitize_for_terminal
from trainer.events.served import ServedSummary, engine_name, parse_served_summary

NAMED_CHECKPOINTS = ("latest", "best")
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}$")
REMOTE_PATH = re.compile(r"^/[A-Za-z0-9_./@+-]*$")
CHECKPOINT_STEP = re.compile(r"step-(\d{8,})\.pt$")
ENGINE_LOG = "engine.log"


@dataclass(frozen=True)
class EvalRequest:
    """What `dflashctl eval` asks (None: trainer.eval's default)."""

    prompts: tuple[Path, ...] = ()  # local files, pushed
    remote_prompts: tuple[str, ...] = ()  # files in the container
    drafter: str | None = None  # an export in the container
    checkpoint: str | None = None  # latest | best | STEP | a checkpoint file in the container
    target: str | None = None  # the target in the container (default: the run config's)
    engine: str = "vllm"
    server: str | None = None
    serve_cmd: str | None = None
    serve_args: tuple[str, ...] = ()
    serve_timeout: float | None = None
    max_new_tokens: int | None = None
    template_kwargs: str | None = None
    tolerance: float | None = None
    device: str | None = None

    def check(self) -> None:
        """UsageError (one line naming the flag or file) for what is wrong whatever the host."""
        if not self.prompts and not self.remote_prompts:
            raise UsageError("eval: --prompts FILE (local) or --remote-prompts PATH is required")
        if self.drafter is not None and self.checkpoint is not None:
            raise UsageError("eval: --drafter DIR and --checkpoint C exclude each other")
        try:
            engine_name(self.engine)
        except ValueError as err:
            raise UsageError(f"eval: --engine {err}") from None
        reach = [f for f, v in (("--server", self.server), ("--serve-cmd", self.serve_cmd)) if v]
        if len(reach) != 1:
            raise UsageError("eval: exactly one of --server URL or --serve-cmd CMD")
        if self.server and self.serve_args:
            raise UsageError("eval: --serve-arg goes with --serve-cmd (a --server has its own)")
        if self.serve_cmd is not None:
            try:
                if not shlex.split(self.serve_cmd):
                    raise ValueError("empty")
            except ValueError as err:
                raise UsageError(f"eval: --serve-cmd {self.serve_cmd!r}: {err}") from None
        if self.server is not None and not re.match(r"^https?://[^\s/]+", self.server):
            raise UsageError(f"eval: --server {self.server!r}: not an http(s) URL")
        for flag, path in (("--drafter", self.drafter), ("--target", self.target)):
            if path is not None and not REMOTE_PATH.match(path):
                raise UsageError(f"eval: {flag} {path!r}: an absolute path in the container")
        for path in self.remote_prompts:
            if not REMOTE_PATH.match(path):
                raise UsageError(f"eval: --remote-prompts {path!r}: an absolute container path")
        c = self.checkpoint
        named = c is None or c in NAMED_CHECKPOINTS or c.isdigit()
        if c is not None and not named and not REMOTE_PATH.match(c):
            raise UsageError(
                f"eval: --checkpoint {c!r}: latest, best, a step, or a checkpoint file in "
                "the container"
            )
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise UsageError(f"eval: --max-new-tokens {self.max_new_tokens}: must be >= 1")
        if self.tolerance is not None and not 0 <= self.tolerance < 1:
            raise UsageError(f"eval: --tolerance {self.tolerance}: a share in [0, 1)")
        if self.template_kwargs is not None:
            try:
                if not isinstance(json.loads(self.template_kwargs), dict):
                    raise ValueError("not a JSON object")
            except ValueError as err:
                raise UsageError(f"eval: --template-kwargs: {err}") from None
        prompt_names(self.prompts)

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "prompts": [str(p) for p in self.prompts],
            "remote_prompts": list(self.remote_prompts),
            "drafter": self.drafter,
            "checkpoint": self.checkpoint,
            "target": self.target,
            "engine": self.engine,
            "server": self.server,
            "serve_cmd": self.serve_cmd,
            "serve_args": list(self.serve_args),
            "max_new_tokens": self.max_new_tokens,
            "tolerance": self.tolerance,
        }


def prompt_names(prompts: Sequence[Path]) -> list[str]:
    """The names the local prompt files get in the job's prompts/ (their own: trainer.eval
    names each set after its file); refused when two share one or a name is not plain."""
    names = [p.name for p in prompts]
    for p, n in zip(prompts, names, strict=True):
        if not SAFE_NAME.match(n):
            raise UsageError(f"eval: --prompts {p}: name the file with letters, digits, '_.+-'")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UsageError(
            f"eval: --prompts: two files named {dup[0]} (trainer.eval names each "
            "set after its file); rename one"
        )
    return names


def read_prompts(prompts: Sequence[Path]) -> dict[str, bytes]:
    """The local prompt files as the job's files (prompts/<name> -> bytes)."""
    files: dict[str, bytes] = {}
    for path, name in zip(prompts, prompt_names(prompts), strict=True):
        try:
            files[f"{JOB_PROMPTS}/{name}"] = path.read_bytes()
        except OSError as err:
            raise UsageError(f"eval: --prompts {path}: {err.strerror or err}") from None
    return files


def target_of(config_text: str, run_dir: str, where: str) -> str:
    """The run config's `model.target_dir` in the container (relative: against run/, where
    the trainer resolves it)."""
    try:
        raw = tomllib.loads(config_text)
    except tomllib.TOMLDecodeError as err:
        raise JobError(f"{where}: not valid TOML: {err}") from None
    model = raw.get("model")
    target = model.get("target_dir") if isinstance(model, dict) else None
    if not isinstance(target, str) or not target:
        raise JobError(f"{where}: no model.target_dir; pass --target PATH")
    return posixpath.normpath(posixpath.join(run_dir, target))


def step_of(checkpoint: str) -> int | None:
    m = CHECKPOINT_STEP.search(checkpoint)
    return int(m.group(1)) if m else None


# $1 workdir $2 latest | best | STEP | PATH: the checkpoint file it names (nothing: none).
RESOLVE_SCRIPT = f"""cd "$1" || exit 0
case "$2" in
  best) f=$(readlink -f {CHECKPOINTS}/best.pt 2>/dev/null);;
  latest) f=$(ls -1 {CHECKPOINTS} 2>/dev/null | grep -E '^step-[0-9]{{8,}}\\.pt$' | tail -n 1)
          [ -z "$f" ] || f="$PWD/{CHECKPOINTS}/$f";;
  *[!0-9]*) f=$2;;
  *) f="$PWD/{CHECKPOINTS}/step-$(printf %08d "$2").pt";;
esac
[ -n "$f" ] && [ -f "$f" ] && echo "$f"
exit 0
"""


@dataclass(frozen=True)
class EvalPlan:
    """The resolved request: the paths in the container the job uses."""

    target: str
    drafter: str  # the export trainer.eval reads
    checkpoint: str | None = None  # exported first (trainer.export) when set
    step: int | None = None
    prompts: list[str] = field(default_factory=list)


def eval_argv(
    python: str, layout: RemoteLayout, job_id: str, req: EvalRequest, plan: EvalPlan
) -> list[str]:
    """The job's argv: trainer.export of the checkpoint (when one is asked), then trainer.eval
    with the engine, its JSON and summary into the job's directory."""
    d = layout.path(EVAL.dir(job_id))
    argv = [python, "-m", "trainer.eval", "--target", plan.target, "--drafter", plan.drafter]
    argv += ["--prompts", *plan.prompts, "--engine", req.engine]
    if req.server is not None:
        argv += ["--server", req.server]
    else:
        assert req.serve_cmd is not None
        argv += ["--serve-cmd", req.serve_cmd, "--serve-log", f"{d}/{ENGINE_LOG}"]
        argv += [f"--serve-arg={a}" for a in req.serve_args]
    for flag, value in (
        ("--max-new-tokens", req.max_new_tokens),
        ("--template-kwargs", req.template_kwargs),
        ("--tolerance", req.tolerance),
        ("--serve-timeout", req.serve_timeout),
        ("--device", req.device),
    ):
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--json", f"{d}/{JOB_RESULT}", "--summary-json", f"{d}/{JOB_SUMMARY}"]
    if plan.checkpoint is None:
        return argv
    export = [python, "-m", "trainer.export", "--checkpoint", plan.checkpoint]
    export += ["--out", plan.drafter, "--target", plan.target]
    return chain(export, argv)


class EvalJob:
    """`dflashctl eval` on one host: resolve, start, and read what a finished eval left."""

    def __init__(self, transport: Transport, host: HostConfig) -> None:
        self.jobs = JobControl(transport, host, EVAL)
        self.host = host
        self.layout = RemoteLayout(host.workdir)

    async def plan(self, req: EvalRequest) -> EvalPlan:
        """Resolve the target, the checkpoint and the remote prompt paths in the container."""
        name, t = self.host.name, self.jobs.transport
        target = req.target
        if target is None:
            config = await t.run(read_file(self.layout.config))
            if not config.ok or not config.stdout.strip():
                raise JobError(
                    f"{name}: no {self.layout.config} to take the target from; pass --target "
                    "PATH or deploy with --config"
                )
            target = target_of(config.stdout, self.layout.run_dir, f"{name}: {self.layout.config}")
        checkpoint: str | None = None
        if req.drafter is None:
            asked = req.checkpoint or "latest"
            res = await t.run(
                ["sh", "-c", RESOLVE_SCRIPT, "dflash-eval-ckpt", self.host.workdir, asked]
            )
            checkpoint = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else None
            if checkpoint is None:
                raise JobError(
                    f"{name}: no checkpoint {asked!r} in {self.layout.run_dir}/checkpoints (pass "
                    "--drafter DIR for an export, or --checkpoint latest|best|STEP|PATH)"
                )
            checkpoint = sanitize_for_terminal(checkpoint)
        return EvalPlan(
            target=target,
            drafter=req.drafter or "",  # the checkpoint's: filled in per job (its directory)
            checkpoint=checkpoint,
            step=step_of(checkpoint) if checkpoint else None,
            prompts=list(req.remote_prompts),
        )

    async def start(self, req: EvalRequest) -> JobStarted:
        req.check()
        files = read_prompts(req.prompts)
        plans: list[EvalPlan] = []

        async def ready() -> None:
            plans.append(await self.plan(req))

        def info() -> dict[str, object]:
            plan = plans[0]
            return {
                "request": req.to_json_dict(),
                "target": plan.target,
                "checkpoint": plan.checkpoint,
                "step": plan.step,
                "drafter": plan.drafter or None,
            }

        def command(job_id: str) -> list[str]:
            plan = plans[0]
            d = self.layout.path(EVAL.dir(job_id))
            pushed = [f"{d}/{name}" for name in files]
            drafter = plan.drafter or f"{d}/{JOB_EXPORT}"
            resolved = EvalPlan(
                plan.target, drafter, plan.checkpoint, plan.step, [*pushed, *plan.prompts]
            )
            return eval_argv(self.host.python, self.layout, job_id, req, resolved)

        return await self.jobs.start(command, info, files, ready)

    async def summary(self, st: JobState) -> ServedSummary:
        """The finished (or failed) eval's summary.json."""
        data = await self.jobs.read_json(st, JOB_SUMMARY)
        summary, why = parse_served_summary(json.dumps(data))
        if summary is None:
            raise JobError(f"{self.host.name}: {st.directory}/{JOB_SUMMARY}: {why}")
        return summary


def format_served(summary: ServedSummary) -> list[str]:
    """The summary as lines: both loops' tau and per-position acceptance, the ratio, the
    verdict (all from summary.json)."""

    def rates(values: Sequence[float]) -> str:
        return "[" + " ".join(f"{v:.2f}" for v in values) + "]"

    own = summary.own
    lines = [
        f"own loop   tau {own.tau:.3f} over {summary.turns} turn(s), protocol "
        f"{summary.protocol}, block {summary.block_size}"
        + (
            f", per position {rates(own.acceptance_per_position)}"
            if own.acceptance_per_position
            else ""
        )
    ]
    served = summary.served
    if served is not None:
        lines.append(
            f"{summary.engine or 'engine':<10} tau {served.tau:.3f}, per position "
            f"{rates(served.acceptance_per_position)}"
        )
        verdict = "agree" if summary.agree else "DIFFER: " + "; ".join(summary.differences)
        ratio = summary.ratio
        lines.append(f"served/own tau {ratio:.3f}: {verdict}" if ratio is not None else verdict)
    if summary.partial:
        lines.append("partial: the evaluation was cut short; figures cover the turns done")
    return lines
