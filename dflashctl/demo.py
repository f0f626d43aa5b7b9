"""`dflashctl demo` (what `make demo` runs): the real thing on this machine, no Proxmox needed.

The "host" is this machine through `LocalTransport`: the trainer tree is deployed as a release
into a demo workdir, the bundled `configs/tiny-cpu.toml` (synthetic token store and tiny random
Qwen3 target, both built by the trainer on first use) becomes the editable demo config, the real
trainer runs under tmux on the private `dflash` socket, and the TUI follows it exactly as it
follows a container. Edit the demo config (`e`), press `r`, and the restart modal shows the diff
and whether the run resumes or starts fresh.

`--headless --duration S` runs without the TUI, stops gracefully and prints the last status
line (exit 0), or says why there was none (exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from dflashctl.control import RunService
from dflashctl.errors import DflashctlError, ExitCode, run_main
from dflashctl.fleet import HostHandle, open_local
from dflashctl.follow import lines_of
from dflashctl.inventory import HostConfig
from trainer.events import StatusEvent, parse_line

DEMO_HOST = "demo"
DEMO_SESSION = "dflash-demo"
REPO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny-cpu.toml"
STOP_TIMEOUT_S = 60.0
DEMO_EPOCHS = 20
HEADER = """\
# dflashctl demo run config. Edit it (key `e` in the TUI), then press `r`: the restart modal shows
# the diff and whether the run resumes or must start fresh (and which keys decide that).
# Try: [status] interval_s = 1 (resumes), or [batching] num_buckets = 3 (starts fresh).
"""


class DemoError(DflashctlError):
    """The demo cannot start (one line: what and where)."""


Say = Callable[[str], None]


def default_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "dflash-demo"


def demo_config_text(template: str, cache_dir: Path) -> str:
    """The bundled tiny config with its store and target made absolute under the demo's cache.

    Absolute, because the trainer reads the pushed copy from WORKDIR/run/, and relative paths
    would resolve there, rebuilding the data and target on every fresh workdir.
    """
    text = re.sub(
        r'^store = ".*"$', f'store = "{cache_dir / "tiny-store"}"', template, flags=re.M, count=1
    )
    text = re.sub(
        r'^target_dir = ".*"$',
        f'target_dir = "{cache_dir / "tiny-qwen3"}"',
        text,
        flags=re.M,
        count=1,
    )
    # Long enough to watch (about half an hour on two cores) and to see warmup in the LR pane.
    text = re.sub(r"^epochs = .*$", f"epochs = {DEMO_EPOCHS}", text, flags=re.M, count=1)
    return HEADER + text


def prepare(demo_dir: Path, template: Path = REPO_CONFIG) -> Path:
    """Create the demo dir and its editable config (kept across runs: user edits survive)."""
    try:
        demo_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DemoError(f"{demo_dir}: cannot create the demo directory: {exc.strerror}") from None
    config = demo_dir / "demo.toml"
    if not config.exists():
        try:
            text = template.read_text(encoding="utf-8")
        except OSError as exc:
            raise DemoError(f"{template}: cannot read the bundled config: {exc.strerror}") from None
        config.write_text(demo_config_text(text, demo_dir / "cache"), encoding="utf-8")
    return config


def demo_host(demo_dir: Path, config: Path, session: str) -> HostConfig:
    from dflashctl.inventory import local_host

    host = local_host(DEMO_HOST, demo_dir / "host", python=sys.executable, session=session)
    return host.model_copy(update={"run_config": config})


DEMO_START_WAIT_S = 30.0


async def bring_up(demo: HostHandle, session: str, *, fresh: bool, say: Say) -> None:
    """Deploy the trainer tree and the config, then start the run unless it already runs."""
    control = demo.control
    status = await control.status()
    if status.state == "running":
        say(f"demo run already running in tmux session {session}; following it")
        return
    if demo.deploy is None:
        raise DemoError(f"{demo.name}: the demo host has no deploy")
    say("deploying the trainer release locally ...")
    await demo.deploy(progress=say, fresh=fresh)
    say("starting the trainer under tmux (first start builds the tiny store and target) ...")
    # a trainer that dies at once is reported here; a slow first build just goes on in the TUI
    await control.start(fresh=fresh, wait_s=DEMO_START_WAIT_S, progress=say)


async def headless(control: RunService, duration: float, say: Say) -> int:
    """Follow new status lines for `duration` s, stop gracefully, print the last status line."""
    start = await control.status()
    last: str | None = None

    async def watch() -> None:
        nonlocal last
        async with contextlib.aclosing(
            lines_of(control.follow(from_line=start.log_lines))
        ) as lines:
            async for line in lines:
                if isinstance(parse_line(line), StatusEvent):
                    last = line
                    say(line)

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(watch(), duration)
    before = await control.status()
    say("stopping the demo run gracefully ...")
    stopped = await control.stop(timeout=STOP_TIMEOUT_S)
    say(f"stop: {stopped.summary()}")
    if last is None:
        tail = [ln for ln in before.pane_tail if ln.strip()]
        why = before.last_error or (tail[-1] if tail else None) or f"run is {before.state}"
        print(f"dflashctl demo: no status line within {duration:g} s ({why})", file=sys.stderr)
        return ExitCode.FAILED
    print(last)
    return ExitCode.OK


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dflashctl demo", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--dir", type=Path, default=None, help="demo directory (default ~/.cache/dflash-demo)"
    )
    p.add_argument("--session", default=DEMO_SESSION, help="tmux session name (socket -L dflash)")
    p.add_argument("--fresh", action="store_true", help="start from step 0 (checkpoints archived)")
    p.add_argument("--headless", action="store_true", help="no TUI: follow, stop, print last line")
    p.add_argument("--duration", type=float, default=60.0, help="headless seconds (default 60)")
    p.add_argument("--keep", action="store_true", help="leave the run going when the TUI exits")
    return p.parse_args(list(argv))


async def _run(args: argparse.Namespace, demo: HostHandle) -> int:
    def say(msg: str) -> None:
        print(msg, file=sys.stderr if not args.headless else sys.stdout, flush=True)

    try:
        await bring_up(demo, args.session, fresh=args.fresh, say=say)
        if args.headless:
            return await headless(demo.control, args.duration, say)
    finally:
        if args.headless and demo.close is not None:
            await demo.close()
    return ExitCode.OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for `dflashctl demo` and `python -m dflashctl.demo`."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return run_main(lambda: _main(args), prog="dflashctl demo")


def _main(args: argparse.Namespace) -> int:
    demo_dir = (args.dir or default_dir()).resolve()
    host = demo_host(demo_dir, prepare(demo_dir), args.session)
    demo = open_local(host, label=DEMO_HOST)  # one handle: bring-up, the TUI, the final stop
    rc = asyncio.run(_run(args, demo))
    if rc or args.headless:
        return rc
    return run_tui(args, demo, host.session)


def run_tui(args: argparse.Namespace, demo: HostHandle, session: str) -> int:
    """Open the TUI on the demo host; stop the run on exit unless --keep."""
    from dflashctl.tui.app import DflashApp

    quit_action = (
        "quit (the demo run keeps going: --keep)"
        if args.keep
        else "quit and stop the demo run gracefully (--keep leaves it running)"
    )
    DflashApp([demo], quit_action=quit_action).run()
    if args.keep:
        print(f"demo run left running: tmux -L dflash attach -t ={session}")
        return ExitCode.OK
    print("stopping the demo run gracefully (use --keep to leave it running) ...")

    async def stop() -> None:
        try:
            result = await demo.control.stop(timeout=STOP_TIMEOUT_S)
            print(f"stop: {result.summary()}")
        finally:
            if demo.close is not None:
                await demo.close()

    asyncio.run(stop())
    return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())
