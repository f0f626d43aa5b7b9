"""`dflashctl gate HOST`: `python -m trainer.gate` on the deployed release and run config, as a
detached job (`dflashctl.jobs.control`), and `start`'s requirement of it (`gate =
"before-start"` in hosts.toml).

The gate's record is its job directory (`WORKDIR/gate/<id>/`: `key` = `<release> <sha256 of
run/config.toml>`, `result.json` = the gate's --json, `exit-status` 0 when it passed). That is
also the cache: a start finds the newest job that passed with the key of what it is about to
run (`remote.jobs.passed_argv`) and runs no gate again; a new release or config has a new key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dflashctl.config.inventory import HostConfig
from dflashctl.errors import DflashctlError, ExitCode, UsageError
from dflashctl.jobs.control import JobControl, JobStarted
from dflashctl.jobs.state import JobError, JobState, error_line, outcome_error
from dflashctl.remote.jobs import GATE, passed_argv
from dflashctl.remote.layout import JOB_OUT, JOB_RESULT, RemoteLayout
from dflashctl.remote.transport import Transport
from dflashctl.runs.snapshot import split_sections
from trainer.events import sanitize_for_terminal

GATE_SETTINGS = ("off", "before-start")


class GateRefused(DflashctlError):
    """start refused: the gate failed on what it was about to run (the gate's own line)."""

    exit_code = ExitCode.FAILED


@dataclass(frozen=True)
class GateRequest:
    """trainer.gate's flags (None: its default); the config is always the deployed one."""

    samples: int | None = None
    max_steps: int | None = None
    response_tokens: int | None = None
    device: str | None = None
    engine: str | None = None
    server: str | None = None
    serve_cmd: str | None = None
    serve_args: tuple[str, ...] = ()

    def check(self) -> None:
        for flag, value, low in (
            ("--samples", self.samples, 1),
            ("--max-steps", self.max_steps, 1),
            ("--response-tokens", self.response_tokens, 2),
        ):
            if value is not None and value < low:
                raise UsageError(f"gate: {flag} {value}: must be >= {low}")
        reach = [v for v in (self.server, self.serve_cmd) if v]
        if self.engine is None and (reach or self.serve_args):
            raise UsageError("gate: --server, --serve-cmd and --serve-arg need --engine vllm")
        if self.engine is not None and len(reach) != 1:
            raise UsageError("gate: --engine needs exactly one of --server URL or --serve-cmd CMD")

    def flags(self) -> list[str]:
        out: list[str] = []
        for flag, value in (
            ("--samples", self.samples),
            ("--max-steps", self.max_steps),
            ("--response-tokens", self.response_tokens),
            ("--device", self.device),
            ("--engine", self.engine),
            ("--server", self.server),
            ("--serve-cmd", self.serve_cmd),
        ):
            if value is not None:
                out += [flag, str(value)]
        return out + [f"--serve-arg={a}" for a in self.serve_args]

    def to_json_dict(self) -> dict[str, Any]:
        return {"flags": self.flags()}


def gate_argv(python: str, layout: RemoteLayout, job_id: str, req: GateRequest) -> list[str]:
    """trainer.gate on the deployed config, its export and JSON into the job's directory."""
    d = layout.path(GATE.dir(job_id))
    return [
        python, "-m", "trainer.gate", "--config", layout.config, *req.flags(),
        "--out", f"{d}/{JOB_OUT}", "--json", f"{d}/{JOB_RESULT}",
    ]  # fmt: skip


@dataclass(frozen=True)
class GateOutcome:
    """A gate that ran to a verdict: passed, or the stage that broke and what it said."""

    passed: bool
    stage: str | None  # the failing stage
    line: str  # `gate PASSED in 14.2 s: ...` or `gate FAILED at stage masks: ...`
    seconds: float | None
    result: dict[str, Any]


STAGE_LINE = re.compile(r"^gate FAILED at stage (\w+): ")


def outcome_of(st: JobState, result: dict[str, Any] | None) -> GateOutcome:
    """The verdict of a gate job that exited 0 or 1 (its output's last verdict line and its
    JSON: the failing stage is the first stage not ok)."""
    lines = [ln.strip() for ln in st.output if ln.strip()]
    verdict = next(
        (ln for ln in reversed(lines) if ln.startswith(("gate PASSED", "gate FAILED"))), None
    )
    data = result or {}
    passed = st.exit_status == 0
    stage = None
    if not passed:
        stages = data.get("stages")
        failing = (
            [s for s in stages if isinstance(s, dict) and not s.get("ok")]
            if isinstance(stages, list)
            else []
        )
        stage = str(failing[0].get("stage")) if failing else None
        m = STAGE_LINE.match(verdict or "")
        stage = m.group(1) if m else stage
    seconds = data.get("seconds")
    return GateOutcome(
        passed=passed,
        stage=stage,
        line=verdict or error_line(st.output, st.exit_status),
        seconds=float(seconds) if isinstance(seconds, int | float) else None,
        result=data,
    )


class GateJob:
    """`dflashctl gate` on one host: start it, read its verdict, and the start-time check."""

    def __init__(self, transport: Transport, host: HostConfig) -> None:
        self.jobs = JobControl(transport, host, GATE)
        self.host = host
        self.layout = RemoteLayout(host.workdir)

    async def start(self, req: GateRequest) -> JobStarted:
        req.check()

        async def ready() -> None:
            config = await self.jobs.transport.run(["test", "-f", self.layout.config])
            if not config.ok:
                raise JobError(
                    f"{self.host.name}: no {self.layout.config}; deploy with --config PATH or "
                    "set run_config in hosts.toml"
                )

        def command(job_id: str) -> list[str]:
            return gate_argv(self.host.python, self.layout, job_id, req)

        return await self.jobs.start(command, lambda: {"request": req.to_json_dict()}, None, ready)

    async def outcome(self, st: JobState) -> GateOutcome:
        """The verdict of a gate that ended; JobError (or JobRefused) for one that ended
        without one (exit 2: a config or usage error, stopped, lost)."""
        if st.state == "failed" and st.exit_status == 1:
            result = await self.jobs.read_json(st, JOB_RESULT) if st.has_result else None
            return outcome_of(st, result)
        error = outcome_error(st, st.output)
        if error is not None:
            raise error
        return outcome_of(st, await self.jobs.read_json(st, JOB_RESULT) if st.has_result else None)

    async def cached_pass(self) -> tuple[str, str | None]:
        """(the key of what `current` and run/config.toml are now, the newest gate job that
        passed with that key or None)."""
        res = await self.jobs.transport.run(passed_argv(self.host.workdir, GATE))
        s = split_sections(res.stdout)
        key = sanitize_for_terminal(s.get("key", "")).strip()
        passed = s.get("passed", "").strip()
        return key, passed or None

    async def ensure(
        self, say: Callable[[str], None], on_line: Callable[[str], None]
    ) -> GateOutcome | None:
        """start's check (`gate = "before-start"`): nothing when a gate passed on this release
        and config already (said), else a gate run here and followed; GateRefused with the
        gate's failing line when it fails."""
        name = self.host.name
        key, passed = await self.cached_pass()
        release, _, digest = key.partition(" ")
        what = f"release {release or '?'}, config {digest[:12] or '?'}"
        if passed is not None:
            say(f"{name}: gate: passed before on {what} (gate {passed}); not run again")
            return None
        say(f"{name}: gate: running python -m trainer.gate on {what} before the start")
        started = await self.start(GateRequest())
        st = await self.jobs.follow(
            on_line, lambda note: say(f"{name}: {note}"), job_id=started.job_id
        )
        try:
            outcome = await self.outcome(st)
        except JobError as err:
            raise GateRefused(f"{err}; start refused") from None
        if not outcome.passed:
            raise GateRefused(
                f"{name}: {outcome.line}; start refused (`dflashctl gate {name} --result` shows "
                f'it; gate = "off" in hosts.toml or start --no-gate skips the gate)'
            )
        say(f"{name}: {outcome.line}")
        return outcome


def gate_json(outcome: GateOutcome, st: JobState) -> str:
    """`gate --json`: the gate's own JSON with the job's id and host."""
    return json.dumps({"host": st.host, "id": st.job_id, **outcome.result}, indent=1)
