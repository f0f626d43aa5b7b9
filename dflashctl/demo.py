"""`dflashctl demo` (what `make demo` runs): the real thing on this machine, no Proxmox needed.

The "host" is this machine through `LocalTransport`: the trainer tree is deployed as a release
into a demo workdir, the bundled `configs/tiny-cpu.toml` (synthetic token store and tiny random
Qwen3 target, both built by the trainer on first use) with `configs/demo.toml` laid over it (a
longer plan and a held-out evaluation every 200 steps, so tau climbs and a best checkpoint
appears) becomes the editable demo config, the real trainer runs under tmux on the private
`dflash` socket, and the TUI follows it exactly as it follows a container. Edit the demo config
(`e`), press `r`, and the restart modal shows the diff and whether the run resumes or starts
fresh.

`--headless --duration S` runs without the TUI, prints the status and Eval lines as they come,
stops gracefully and prints the last Eval line and then the last status line (exit 0), or says
why there was no status line (exit 1). `--evals N` or `--until-step N` stop it on what the run
did instead (the N-th Eval line, a status line at step N or past it), `--duration` still
bounding it: a slow or loaded machine then shows the same run, only later.

SIGINT (Ctrl-C) or SIGTERM (`timeout`, `kill`) stops the demo run as `q` does in the TUI: a
headless demo ends its follow early (same stop, same last lines), a TUI closes (the run is
stopped unless --keep), a bring-up is cut short and whatever it started stopped; the demo then
exits 128 + the signal's number (130, 143).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import re
import signal
import sys
import tomllib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from dflashctl.config.inventory import HostConfig
from dflashctl.errors import DflashctlError, ExitCode, run_main
from dflashctl.fleet import HostHandle, open_local
from dflashctl.runs.follow import lines_of
from dflashctl.runs.service import RunService
from dflashctl.runs.snapshot import eval_summary
from trainer.config.overlay import TomlTable, dump_toml, merge
from trainer.events import EvalEvent, StatusEvent, parse_line

DEMO_HOST = "demo"
DEMO_SESSION = "dflash-demo"
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
REPO_CONFIG = CONFIGS / "tiny-cpu.toml"
"""The base of the demo config (every pipeline test's base too: the demo changes it only
through DEMO_OVERLAY)."""
DEMO_OVERLAY = CONFIGS / "demo.toml"
"""What the demo changes in REPO_CONFIG: a longer plan and the held-out evaluation."""
WRITTEN = ".demo.toml.sha256"
"""Next to DEMO_DIR/demo.toml: the digest of the text the demo wrote there, so a later demo can
tell a config nobody edited (it follows the bundled one) from the user's edits (kept)."""
STOP_TIMEOUT_S = 60.0
HEADER = """\
# dflashctl demo run config. Edit it (key `e` in the TUI), then press `r`: the restart modal shows
# the diff and whether the run resumes or must start fresh (and which keys decide that).
# Try: [status] interval_s = 1 (resumes), or [batching] num_buckets = 3 (starts fresh).
# Made from configs/tiny-cpu.toml with configs/demo.toml laid over it; [eval] measures tau on
# held-out rows every every_steps steps and keeps the best checkpoint (checkpoints/best.pt).
"""


class DemoError(DflashctlError):
    """The demo cannot start (one line: what and where)."""


Say = Callable[[str], None]
T = TypeVar("T")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """SIGINT and SIGTERM while the demo drives its run: asked to stop, never killed mid-way.

    Handled on the running loop (between callbacks, never inside one), and also when the demo
    was started with SIGINT ignored (a script's background job: `dflashctl demo ... &`), which
    an asyncio program otherwise never hears. The first signal sets `requested` and is kept for
    the exit status; a later one only says the stop is under way: a second Ctrl-C must not end
    dflashctl halfway through the graceful stop and leave the trainer training.
    """

    def __init__(self, say: Say) -> None:
        self.received: signal.Signals | None = None
        self.requested = asyncio.Event()
        self._say = say

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.received is None:
            self.received = sig
            self.requested.set()
        else:
            self._say(
                f"{sig.name}: the demo is ending already (a graceful stop takes up to "
                f"{STOP_TIMEOUT_S:g} s)"
            )

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignals]:
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield self
        finally:
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)

    async def race(self, task: asyncio.Future[T]) -> bool:
        """Wait until `task` is done or a signal came (True: the signal; `task` goes on)."""
        waiter = asyncio.ensure_future(self.requested.wait())
        both: list[asyncio.Future[Any]] = [task, waiter]
        try:
            await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        return not task.done()

    async def unless_signalled(self, work: Awaitable[T]) -> T | None:
        """`work`'s result, or None when a signal came first (`work` is then cancelled)."""
        task = asyncio.ensure_future(work)
        try:
            signalled = await self.race(task)
        except BaseException:
            task.cancel()
            raise
        if not signalled:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None

    def exit_code(self, rc: int) -> int:
        """What a signal makes of the demo's exit status `rc`: 130 (Ctrl-C), 143 (SIGTERM)."""
        if self.received is None:
            return rc
        return ExitCode.INTERRUPTED if self.received == signal.SIGINT else ExitCode.TERMINATED

    def why(self) -> str:
        """`SIGINT: ` once a signal came (what the demo then says starts with it), else empty."""
        return f"{self.received.name}: " if self.received is not None else ""


def default_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "dflash-demo"


def _load_toml(path: Path) -> TomlTable:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise DemoError(f"{path}: cannot read the bundled config: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise DemoError(f"{path}: not TOML: {exc}") from None


def demo_config_text(base: TomlTable, overlay: TomlTable, cache_dir: Path) -> str:
    """The bundled tiny config with the demo overlay laid over it and its store and target made
    absolute under the demo's cache.

    Absolute, because the trainer reads the pushed copy from WORKDIR/run/, and relative paths
    would resolve there, rebuilding the data and target on every fresh workdir.
    """
    table = merge(base, overlay)
    table["data"] = {**table.get("data", {}), "store": str(cache_dir / "tiny-store")}
    table["model"] = {**table.get("model", {}), "target_dir": str(cache_dir / "tiny-qwen3")}
    text = re.sub(r"\n{2,}", "\n", dump_toml(table))  # one blank line before each table
    return HEADER + "\n" + re.sub(r"\n\[", "\n\n[", text).strip("\n") + "\n"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class DemoConfig:
    path: Path  # DEMO_DIR/demo.toml, the config the demo deploys
    note: str | None = None  # what prepare did to a config an earlier demo left, for people
    fresh: bool = False  # the config was replaced: its checkpoints may not resume (archived)


def prepare(
    demo_dir: Path, template: Path = REPO_CONFIG, overlay: Path = DEMO_OVERLAY
) -> DemoConfig:
    """Create the demo dir and its editable config. A config the user edited is kept across
    runs; one nobody edited follows the bundled one (rewritten when that changed); one an
    earlier demo wrote before the demo evaluated (no digest, no [eval] table) is moved aside to
    demo.toml.old and replaced. A replaced config starts fresh (checkpoints archived)."""
    try:
        demo_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DemoError(f"{demo_dir}: cannot create the demo directory: {exc.strerror}") from None
    config, written = demo_dir / "demo.toml", demo_dir / WRITTEN
    text = demo_config_text(_load_toml(template), _load_toml(overlay), demo_dir / "cache")

    def write(note: str | None) -> DemoConfig:
        config.write_text(text, encoding="utf-8")
        written.write_text(_digest(text) + "\n", encoding="utf-8")
        return DemoConfig(config, note, fresh=note is not None)

    if not config.exists():
        return write(None)
    current = config.read_text(encoding="utf-8")
    recorded = written.read_text(encoding="utf-8").strip() if written.exists() else None
    if recorded == _digest(current):  # as the demo wrote it: follow the bundled config
        if current == text:
            return DemoConfig(config)
        return write(f"{config}: updated to the bundled demo config (nobody had edited it)")
    try:
        has_eval = "eval" in tomllib.loads(current)
    except tomllib.TOMLDecodeError:
        has_eval = True  # the user's broken edit: kept, and deploy names the bad line
    if has_eval:
        return DemoConfig(config)
    if recorded is None:  # written by a demo from before it evaluated
        aside = config.with_name("demo.toml.old")
        config.replace(aside)
        return write(
            f"{config}: an earlier demo's config without [eval] (held-out tau) was moved to "
            f"{aside.name}; the new one evaluates every few seconds"
        )
    return DemoConfig(
        config,
        f"{config}: your edited demo config has no [eval]: no held-out tau and no best "
        f"checkpoint (see {overlay} for the bundled settings)",
    )


def demo_host(demo_dir: Path, config: Path, session: str) -> HostConfig:
    from dflashctl.config.inventory import local_host

    host = local_host(DEMO_HOST, demo_dir / "host", python=sys.executable, session=session)
    return host.model_copy(update={"run_config": config})


DEMO_START_WAIT_S = 30.0


async def bring_up(demo: HostHandle, session: str, *, fresh: bool, say: Say) -> int:
    """Deploy the trainer tree and the config, then start the run unless it already runs.

    Returns the status log's line count before the start: the lines after it are this run's
    (a run already going: its lines from now on)."""
    control = demo.control
    status = await control.status()
    if status.state == "running":
        say(f"demo run already running in tmux session {session}; following it")
        return status.log_lines
    if demo.deploy is None:
        raise DemoError(f"{demo.name}: the demo host has no deploy")
    say("deploying the trainer release locally ...")
    await demo.deploy(progress=say, fresh=fresh)
    say("starting the trainer under tmux (first start builds the tiny store and target) ...")
    # a trainer that dies at once is reported here; a slow first build just goes on in the TUI
    await control.start(fresh=fresh, wait_s=DEMO_START_WAIT_S, progress=say)
    return status.log_lines


@dataclass(frozen=True)
class StopAt:
    """What ends a headless demo before its duration: the `evals`-th Eval line, or the first
    status line at step `step` or past it (None: not that)."""

    evals: int | None = None
    step: int | None = None


async def headless(
    control: RunService,
    duration: float,
    say: Say,
    from_line: int | None,
    signals: StopSignals,
    stop_at: StopAt = StopAt(),
) -> int:
    """Follow the status and Eval lines after `from_line` (None: from now) for `duration` s,
    until `stop_at` or until one of `signals` comes, stop gracefully, print the last Eval line
    (when the run evaluated) and then the last status line. `bring_up` gives the line the run
    started at, so a line the run wrote while the start waited for it (its first evaluation, at
    step 0) is not skipped."""
    if from_line is None:
        from_line = (await control.status()).log_lines
    last: str | None = None
    last_eval: str | None = None
    evals = 0

    async def watch() -> None:
        nonlocal last, last_eval, evals
        async with contextlib.aclosing(lines_of(control.follow(from_line=from_line))) as lines:
            async for line in lines:
                event = parse_line(line)
                if isinstance(event, StatusEvent):
                    last = line
                    say(line)
                    if stop_at.step is not None and event.step >= stop_at.step:
                        return
                elif isinstance(event, EvalEvent):
                    last_eval, evals = line, evals + 1
                    say(line)
                    if stop_at.evals is not None and evals >= stop_at.evals:
                        return

    async def watch_for_duration() -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(watch(), duration)

    await signals.unless_signalled(watch_for_duration())
    before = await control.status()
    await stop_run(control, say, signals.why())
    evaluated = eval_summary((await control.status()).run_state)
    if evaluated:
        say(evaluated)
    if last is None:
        tail = [ln for ln in before.pane_tail if ln.strip()]
        why = before.last_error or (tail[-1] if tail else None) or f"run is {before.state}"
        until = f"before {signals.received.name}" if signals.received else f"within {duration:g} s"
        print(f"dflashctl demo: no status line {until} ({why})", file=sys.stderr)
        return ExitCode.FAILED
    if last_eval is not None:
        print(last_eval)
    print(last)
    return ExitCode.OK


async def stop_run(control: RunService, say: Say, why: str = "", note: str = "") -> None:
    """Stop the demo run gracefully and say how it went (`why`: what asked, `note`: an aside)."""
    say(f"{why}stopping the demo run gracefully{note} ...")
    stopped = await control.stop(timeout=STOP_TIMEOUT_S)
    say(f"stop: {stopped.summary()}")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dflashctl demo", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--dir", type=Path, default=None, help="demo directory (default ~/.cache/dflash-demo)"
    )
    p.add_argument("--session", default=DEMO_SESSION, help="tmux session name (socket -L dflash)")
    p.add_argument("--fresh", action="store_true", help="start from step 0 (checkpoints archived)")
    p.add_argument("--headless", action="store_true", help="no TUI: follow, stop, print last line")
    p.add_argument("--duration", type=float, default=60.0, help="headless seconds (default 60)")
    p.add_argument(
        "--evals", type=int, default=None, metavar="N", help="headless: stop after N Eval lines"
    )
    p.add_argument(
        "--until-step",
        type=int,
        default=None,
        metavar="N",
        help="headless: stop at the first status line at step N or past it",
    )
    p.add_argument("--keep", action="store_true", help="leave the run going when the TUI exits")
    args = p.parse_args(list(argv))
    for flag, value in (("--evals", args.evals), ("--until-step", args.until_step)):
        if value is not None and value < 1:
            p.error(f"{flag} {value}: expected a whole number >= 1")
    return args


async def _run(args: argparse.Namespace, demo: HostHandle, config: DemoConfig) -> int:
    """Bring the run up, then follow it headless or in the TUI, then stop it (unless --keep);
    one loop throughout, so SIGINT and SIGTERM are heard in every phase (StopSignals)."""

    def say(msg: str) -> None:
        print(msg, file=sys.stderr if not args.headless else sys.stdout, flush=True)

    signals = StopSignals(say)
    with signals.installed():
        try:
            rc = await _drive(args, demo, config, signals, say)
        finally:
            if demo.close is not None:
                await demo.close()
    return signals.exit_code(rc)


async def _drive(
    args: argparse.Namespace, demo: HostHandle, config: DemoConfig, signals: StopSignals, say: Say
) -> int:
    if config.note:
        say(config.note + ("; starting fresh (checkpoints archived)" if config.fresh else ""))
    fresh = args.fresh or config.fresh
    started_at = await signals.unless_signalled(bring_up(demo, args.session, fresh=fresh, say=say))
    if started_at is None:  # cut short: stop whatever it started (nothing: "not running")
        await stop_run(demo.control, say, signals.why())
        return ExitCode.OK
    if args.headless:
        stop_at = StopAt(evals=args.evals, step=args.until_step)
        return await headless(demo.control, args.duration, say, started_at, signals, stop_at)
    return await run_tui(args, demo, signals)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for `dflashctl demo` and `python -m dflashctl.demo`."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return run_main(lambda: _main(args), prog="dflashctl demo")


def _main(args: argparse.Namespace) -> int:
    demo_dir = (args.dir or default_dir()).resolve()
    config = prepare(demo_dir)
    host = demo_host(demo_dir, config.path, args.session)
    demo = open_local(host, label=DEMO_HOST)  # one handle: bring-up, the TUI, the final stop
    return asyncio.run(_run(args, demo, config))


def _stdout(msg: str) -> None:
    print(msg, flush=True)


async def run_tui(args: argparse.Namespace, demo: HostHandle, signals: StopSignals) -> int:
    """The TUI on the demo host until `q` or a signal; then stop the run unless --keep."""
    from dflashctl.tui.app import DflashApp

    quit_action = (
        "quit (the demo run keeps going: --keep)"
        if args.keep
        else "quit and stop the demo run gracefully (--keep leaves it running)"
    )
    app = DflashApp([demo], quit_action=quit_action)
    running = asyncio.ensure_future(app.run_async())
    if await signals.race(running):
        app.exit()  # as `q` does: the app restores the terminal, then the run is stopped
    await running
    why = signals.why()
    if args.keep:
        print(f"{why}demo run left running: tmux -L dflash attach -t ={args.session}")
        return ExitCode.OK
    await stop_run(demo.control, _stdout, why, " (use --keep to leave it running)")
    return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())
