"""`dflashctl measure HOST`: `python -m trainer.measure` in the host's container, detached.

A measure runs the deployed release (`releases/<id>`, resolved from `current` as start does, so a
deploy meanwhile swaps no code under it) against the deployed run config (`run/config.toml`),
in a tmux session of its own (the host's session name + `-measure`, never the training
session), so it outlives the SSH link and the client. Everything it leaves is under
`WORKDIR/measure/<id>/` (<id> = its UTC start, `20261201T170211Z`): `info.json` (what was asked),
`config.toml` (the config measured), `tmp/` (its TMPDIR: the timing runs), `progress.log` (trainer.measure's stderr: one line per
timing run), `stdout.txt`, `result.json` + `table.txt` (`--out`), `calibration.json`
(`--save-calibration`), and `exit-status` once it has exited. The newest directory is "the"
measure: running (no exit status, its pane alive), finished, failed, stopped, or lost (no exit
status and no live pane: the container restarted or the session was killed).

A measure is refused while a training run is live on the host (it would share the devices: the
figures would mean nothing, or one of them would OOM) and while another measure runs there.

Pure builders and parsers first, then `MeasureControl`, the service over a Transport (no
Textual); `dflashctl.cli.main.cmd_measure` only parses flags and prints.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dflashctl.config.inventory import HostConfig
from dflashctl.errors import DflashctlError, ExitCode, UsageError
from dflashctl.remote.files import read_file
from dflashctl.remote.layout import (
    CONFIG,
    MEASURE_CALIBRATION,
    MEASURE_RESULT,
    MEASURE_SOURCE,
    MEASURE_TABLE,
    MEASURE_TMP,
    RemoteLayout,
    measure_dir,
    measure_session,
)
from dflashctl.remote.run import (
    measure_cancel_argv,
    measure_prepare_argv,
    measure_run_argv,
    measure_status_argv,
)
from dflashctl.remote.tmux import PaneState, tmux_kill_session, tmux_new_session
from dflashctl.remote.transport import Transport
from dflashctl.runs.control import RunControl
from dflashctl.runs.detached import (
    DetachedControl,
    DetachedRecord,
    not_runnable,
    parse_status,
    training_busy,
)
from dflashctl.runs.detached import outcome_error as detached_outcome_error
from dflashctl.runs.follow import Backoff
from dflashctl.runs.snapshot import RunStatus
from trainer.events import sanitize_for_terminal

CLOCKS = ("wall", "cpu")
MEASURE_MODULE = "trainer.measure"
DETACH_GRACE_S = 5.0
"""`--detach` waits this long for a measure that is refused at once (a bad strategy or key)."""
FOLLOW_POLL_S = 30.0
"""One follow round trip waits up to this long on the host for a progress line or the end."""
STRATEGY_NAME = re.compile(r"^[a-z][a-z0-9-]{0,31}(@[0-9]{1,7})?$")  # packed@N: row length N
SET_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
PROGRESS_TAIL = 3
"""`--result` on a running measure shows at most this many of its last progress lines."""


class MeasureError(DflashctlError):
    """A measure that failed, ended without a result, or cannot run now (one line, the host)."""

    exit_code = ExitCode.FAILED


class MeasureRefused(MeasureError):
    """trainer.measure refused what it was asked (its own exit 2): its line, the host named."""

    exit_code = ExitCode.USAGE


class MeasureBusy(MeasureError):
    """The host runs training or another measure: a measure now would share the devices."""


class MeasureRunning(MeasureError):
    """`--result` while the newest measure still runs: how far it is."""


# --- the request: trainer.measure's flags, checked here as far as syntax goes ----------------


def parse_strategies(text: str) -> tuple[str, ...]:
    """`sorted,packed` -> names in order; the release's trainer.measure decides which exist."""
    names = tuple(s.strip() for s in text.split(","))
    if not names or not all(names):
        raise UsageError(f"--strategies {text!r}: a comma-separated list of strategy names")
    for name in names:
        if not STRATEGY_NAME.match(name):
            raise UsageError(f"--strategies: {name!r} is not a strategy name")
    if len(set(names)) != len(names):
        raise UsageError(f"--strategies {text!r}: names a strategy twice")
    return names


def parse_set(item: str) -> tuple[list[str], Any]:
    """`--set a.b=VALUE` -> (["a", "b"], VALUE): a TOML value, a bare word a string (as
    trainer.measure reads it)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not SET_KEY.match(key):
        raise UsageError(f"--set {item!r}: not KEY=VALUE (e.g. batching.pool_size=400)")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    return key.split("."), value


def overrides(items: Sequence[str]) -> dict[str, Any]:
    """Every `--set` as one nested table (for checking the config they make)."""
    out: dict[str, Any] = {}
    for item in items:
        keys, value = parse_set(item)
        node = out
        for k in keys[:-1]:
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise UsageError(f"--set {item!r}: {k} is set to a value by an earlier --set")
            node = child
        node[keys[-1]] = value
    return out


@dataclass(frozen=True)
class MeasureRequest:
    """What `dflashctl measure` asks of trainer.measure (None: trainer.measure's default)."""

    steps: int
    warmup: int | None = None
    rounds: int | None = None
    strategies: tuple[str, ...] | None = None
    window: int | None = None
    clock: str | None = None
    sets: tuple[str, ...] = ()

    def check(self) -> None:
        """UsageError (one line naming the flag) for what is wrong whatever the release."""
        for flag, value, low in (
            ("--steps", self.steps, 1),
            ("--warmup", self.warmup, 0),
            ("--rounds", self.rounds, 1),
            ("--window", self.window, 1),
        ):
            if value is not None and value < low:
                raise UsageError(f"{flag} {value}: must be >= {low}")
        if self.window is not None and self.window > self.steps:
            raise UsageError(f"--window {self.window}: must be <= --steps ({self.steps})")
        if self.clock is not None and self.clock not in CLOCKS:
            raise UsageError(f"--clock {self.clock!r}: one of {', '.join(CLOCKS)}")
        overrides(self.sets)

    def flags(self) -> list[str]:
        """trainer.measure's flags for this request (not --config, --out, ...: the layout's)."""
        out = ["--steps", str(self.steps)]
        if self.strategies is not None:
            out += ["--strategies", ",".join(self.strategies)]
        for flag, value in (
            ("--warmup", self.warmup),
            ("--rounds", self.rounds),
            ("--window", self.window),
            ("--clock", self.clock),
        ):
            if value is not None:
                out += [flag, str(value)]
        for item in self.sets:
            out += ["--set", item]
        return out

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "warmup": self.warmup,
            "rounds": self.rounds,
            "strategies": list(self.strategies) if self.strategies is not None else None,
            "window": self.window,
            "clock": self.clock,
            "set": list(self.sets),
        }


def measure_argv(
    python: str, layout: RemoteLayout, measure_id: str, req: MeasureRequest
) -> list[str]:
    """trainer.measure's argv for measure `measure_id`: the deployed config, the request's
    flags, its result and calibration into the measure's directory."""
    d = layout.path(measure_dir(measure_id))
    return [
        python,
        "-m",
        MEASURE_MODULE,
        "--config",
        layout.config,
        *req.flags(),
        "--out",
        d,
        "--save-calibration",
        f"{d}/{MEASURE_CALIBRATION}",
    ]


def check_overrides(config_text: str, sets: Sequence[str], host: str) -> None:
    """A `--set` the config cannot take, refused here (the config error's one line) before
    anything starts; skipped when the deployed config itself does not validate with this
    dflashctl's trainer.config (another version: the release's trainer.measure decides)."""
    if not sets:
        return
    from trainer.config import ConfigError, TrainConfig
    from trainer.config.overlay import merge

    try:
        raw = tomllib.loads(config_text)
        TrainConfig.from_dict(raw)
    except (tomllib.TOMLDecodeError, ConfigError):
        return
    try:
        TrainConfig.from_dict(merge(raw, overrides(sets)), source=f"{host}: {CONFIG} with --set")
    except ConfigError as err:
        raise UsageError(str(err)) from None


# --- the newest measure, as the status script reports it ------------------------------------


@dataclass(frozen=True)
class MeasureState(DetachedRecord):
    """The newest measure on a host (`parse_measure_status`); `progress` holds its progress
    lines from the line asked for on (made safe to print)."""

    host: str
    measure_id: str | None = None
    state: str = "none"  # none | running | finished | failed | cancelled | lost
    exit_status: int | None = None
    now: float | None = None  # the host's clock
    progress: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    has_table: bool = False
    release: str | None = None  # what `current` points at
    measurable: bool = False  # `current` ships trainer.measure
    pane: PaneState | None = None
    cancelled_at: str | None = None
    workdir: str = ""

    @property
    def record_id(self) -> str | None:
        return self.measure_id

    def subdir(self, record_id: str) -> str:
        return measure_dir(record_id)


def parse_measure_status(host: str, workdir: str, stdout: str) -> MeasureState:
    """MeasureState from `measure_status_argv`'s output (pure). Remote text is sanitised here."""
    s = parse_status(stdout)
    if s is None:
        return MeasureState(host=host, workdir=workdir)
    return MeasureState(
        host=host,
        measure_id=s.record_id,
        state=s.state,
        exit_status=s.exit_status,
        now=s.now,
        progress=s.lines("progress"),
        info=s.info,
        has_table=s.flag("table"),
        release=s.release,
        measurable=s.flag("measurable"),
        pane=s.pane,
        cancelled_at=s.cancelled_at,
        workdir=workdir,
    )


def outcome_error(st: MeasureState, progress: Sequence[str]) -> MeasureError | None:
    """The error a measure that ended without a result is (None: it finished); `progress` is
    all of its progress lines."""
    what = f"{st.host}: measure {st.measure_id}"
    refused = f"{st.host}: {MEASURE_MODULE}"
    return detached_outcome_error(st, progress, what, refused, (MeasureError, MeasureRefused))


def how_far(progress: Sequence[str]) -> str:
    """`round 1/2 packed: 12,003 tok/s (run 3 of 10)`, or that no timing run finished yet."""
    runs = [ln for ln in progress if ln.startswith("round ")]
    return "; ".join(runs[-PROGRESS_TAIL:]) if runs else "no timing run has finished yet"


# --- the service -----------------------------------------------------------------------------


def refuse_beside_training(host: HostConfig, run: RunStatus) -> None:
    """MeasureBusy while a training run is live on the host, or a job runs there (`run`: the
    host's run status): a measure would share its devices."""
    name = host.name
    busy = training_busy(host, run, "a measure")
    if busy is not None:
        raise MeasureBusy(busy)
    if run.job is not None:
        raise MeasureBusy(
            f"{name}: {run.job.kind} {run.job.id} is running there (since {run.job.since}): a "
            f"measure would share its devices; `dflashctl {run.job.kind} {name} --stop` ends it"
        )


def startable_release(st: MeasureState, session: str) -> str:
    """The deployed release a new measure runs (`st`: the host's newest measure); MeasureBusy
    while that measure runs (in tmux `session`), MeasureError when nothing deployed can run
    trainer.measure."""
    name = st.host
    if st.running:
        raise MeasureBusy(
            f"{name}: measure {st.measure_id} is already running ({st.since()}, tmux session "
            f"{session!r}): `dflashctl measure {name} --result` shows how far it is"
        )
    problem = not_runnable(name, st.release, st.measurable, MEASURE_SOURCE, MEASURE_MODULE)
    if problem or st.release is None:
        raise MeasureError(problem)
    return st.release


def measure_env(host: HostConfig, layout: RemoteLayout, release: str, mid: str) -> dict[str, str]:
    """The measure session's environment: the host's, unbuffered, the release's code on the
    path, and its own TMPDIR under the measure's directory."""
    return {
        **host.env,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": layout.release_dir(release),
        "DFLASH_RELEASE": release,
        "TMPDIR": f"{layout.path(measure_dir(mid))}/{MEASURE_TMP}",
    }


@dataclass(frozen=True)
class MeasureStarted:
    host: str
    measure_id: str
    release: str
    session: str
    argv: list[str]
    directory: str


class MeasureControl(DetachedControl):
    """Start, follow, read and stop one host's measure through a Transport (SSH+pct or local)."""

    error = MeasureError

    def __init__(self, transport: Transport, host: HostConfig) -> None:
        super().__init__(transport, host, measure_session(host.session))
        self.layout = RemoteLayout(host.workdir)

    async def state(
        self, from_line: int = 0, wait_s: float = 0.0, measure_id: str | None = None
    ) -> MeasureState:
        """The newest measure (or `measure_id`), after waiting on the host up to `wait_s` for
        its progress line past 0-based `from_line` or its end. TransportError when the host
        cannot be asked."""
        argv = measure_status_argv(
            self.host.workdir, self.host.session, from_line, wait_s, measure_id
        )
        stdout = await self._status(argv, wait_s)
        return parse_measure_status(self.host.name, self.host.workdir, stdout)

    async def start(self, req: MeasureRequest) -> MeasureStarted:
        """Start a measure in its own tmux session; refused (MeasureBusy) while training or
        another measure runs on the host, and for what cannot run (nothing deployed, a release
        without trainer.measure, no run config, a `--set` the config cannot take)."""
        req.check()
        name = self.host.name
        run = await RunControl(self.transport, self.host).reader.status_for("measure")
        refuse_beside_training(self.host, run)
        st = await self.state()
        release = startable_release(st, self.session)
        config = await self._run(read_file(self.layout.config))
        if not config.ok or not config.stdout.strip():
            raise MeasureError(
                f"{name}: no {self.layout.config}; deploy with --config PATH or set run_config "
                f"in hosts.toml"
            )
        check_overrides(config.stdout, req.sets, name)
        info = {
            "request": req.to_json_dict(),
            "release": release,
            "config": self.layout.config,
            "session": self.session,
        }
        mid = await self._prepare(
            measure_prepare_argv(self.host.workdir), info, "measure directory"
        )
        argv = measure_argv(self.host.python, self.layout, mid, req)
        if st.pane is not None:  # the last measure's dead pane (remain-on-exit): cleared
            await self._run(tmux_kill_session(self.session))
        command = tmux_new_session(
            self.session,
            measure_run_argv(self.host.workdir, mid, argv),
            cwd=self.host.workdir,
            env=measure_env(self.host, self.layout, release, mid),
        )
        d = self.layout.path(measure_dir(mid))
        await self._launch(command, d, "measure", MeasureBusy)
        return MeasureStarted(name, mid, release, self.session, argv, d)

    async def follow(
        self,
        on_line: Callable[[str], None],
        on_note: Callable[[str], None],
        *,
        from_line: int = 0,
        poll_s: float = FOLLOW_POLL_S,
        backoff: Backoff | None = None,
        measure_id: str | None = None,
    ) -> MeasureState:
        """Wait for the newest measure (or `measure_id`: the one this client started, whatever
        starts after it) to end, passing each new progress line to `on_line`;
        a dropped link is retried (the measure goes on: it lives in tmux), each drop and
        reconnect one `on_note`. Returns its last state (all of its progress lines in it)."""

        async def fetch(seen: int) -> MeasureState:
            return await self.state(from_line + seen, poll_s, measure_id)

        st, lines = await self._follow(
            fetch, lambda s: s.progress, on_line, on_note, "the measure", backoff
        )
        return replace(st, progress=lines)

    async def result(self, st: MeasureState, *, as_json: bool) -> str:
        """A finished measure's table (or its JSON, re-encoded: nothing in it reaches the
        terminal raw)."""
        d = st.directory
        if not st.has_table:  # written last, after result.json
            raise MeasureError(
                f"{self.host.name}: measure {st.measure_id} finished but left no "
                f"{d}/{MEASURE_TABLE} (a trainer.measure without --out?)"
            )
        unread = f"{self.host.name}: measure {st.measure_id}"
        if as_json:
            return json.dumps(await self._read_json(f"{d}/{MEASURE_RESULT}", unread), indent=1)
        res = await self._run(read_file(f"{d}/{MEASURE_TABLE}"))
        if not res.ok:
            raise MeasureError(f"{unread}: {res.error_line()}")
        return sanitize_for_terminal(res.stdout).rstrip("\n")

    async def fetch_calibration(self, st: MeasureState, local: Path) -> Path:
        """The measure's calibration JSON, checked to be a JSON object, written to `local`
        (temp file + rename)."""
        remote = f"{st.directory}/{MEASURE_CALIBRATION}"
        data = await self._read_json_object(remote, f"{self.host.name}: {remote}")
        write_local(local, json.dumps(data, indent=1) + "\n")
        return local

    async def stop(self) -> MeasureState | None:
        """End the running measure (its session, and so the trainer runs under it), recording
        that it was stopped; None when none was running."""
        st = await self.state()
        if not st.running or st.measure_id is None:
            return None
        await self._run(measure_cancel_argv(self.host.workdir, st.measure_id))
        await self._kill_session()
        return st


def check_local_target(path: Path) -> None:
    """`--save-calibration FILE`: refused before a measure of hours when FILE cannot be written."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UsageError(f"--save-calibration {path}: is a directory")
    if not parent.is_dir():
        raise UsageError(f"--save-calibration {path}: no directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--save-calibration {path}: {parent} is not writable")


def write_local(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"--save-calibration {path}: {err.strerror or err}") from None
