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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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


class DemoError(Exception):
    """The demo cannot start (one line: what and where)."""


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
    demo_dir.mkdir(parents=True, exist_ok=True)
    config = demo_dir / "demo.toml"
    if not config.exists():
        try:
            text = template.read_text(encoding="utf-8")
        except OSError as exc:
            raise DemoError(f"{template}: cannot read the bundled config: {exc.strerror}") from None
        config.write_text(demo_config_text(text, demo_dir / "cache"), encoding="utf-8")
    return config


def demo_host(demo_dir: Path, config: Path, session: str) -> Any:
    from dflashctl.inventory import local_host

    host = local_host(DEMO_HOST, demo_dir / "host", python=sys.executable, session=session)
    return host.model_copy(update={"run_config": config})


DEMO_START_WAIT_S = 30.0


async def bring_up(control: Any, transport: Any, host: Any, *, fresh: bool, say: Any) -> None:
    """Deploy the trainer tree and the config, then start the run unless it already runs."""
    from dflashctl.deploy import deploy

    status = await control.status()
    if status.state == "running":
        say(f"demo run already running in tmux session {host.session}; following it")
        return
    say("deploying the trainer release locally ...")
    await deploy(transport, host, config=host.run_config, progress=say, fresh=fresh)
    say("starting the trainer under tmux (first start builds the tiny store and target) ...")
    # a trainer that dies at once is reported here; a slow first build just goes on in the TUI
    await control.start(fresh=fresh, wait_s=DEMO_START_WAIT_S, progress=say)


async def headless(control: Any, duration: float, say: Any) -> int:
    """Follow new status lines for `duration` s, stop gracefully, print the last status line."""
    start = await control.status()
    last: str | None = None

    async def watch() -> None:
        nonlocal last
        async for line in control.follow(from_line=start.log_lines):
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
        return 1
    print(last)
    return 0


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


async def _run(args: argparse.Namespace) -> int:
    from dflashctl.control import RunControl
    from dflashctl.remote.transport import LocalTransport

    demo_dir = (args.dir or default_dir()).resolve()
    config = prepare(demo_dir)
    host = demo_host(demo_dir, config, args.session)
    transport = LocalTransport(label="demo")
    control = RunControl(transport, host)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr if not args.headless else sys.stdout, flush=True)

    try:
        await bring_up(control, transport, host, fresh=args.fresh, say=say)
        if args.headless:
            return await headless(control, args.duration, say)
    finally:
        if args.headless:
            await transport.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for `dflashctl demo` and `python -m dflashctl.demo`."""
    from dflashctl.control import ControlError
    from dflashctl.deploy import DeployError
    from dflashctl.remote.transport import TransportError
    from dflashctl.resume import ResumeRefused
    from dflashctl.runconfig import RunConfigError

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        rc = asyncio.run(_run(args))
        if rc or args.headless:
            return rc
        return run_tui(args)
    except KeyboardInterrupt:
        return 130
    except (
        DemoError,
        ControlError,
        DeployError,
        TransportError,
        RunConfigError,
        ResumeRefused,
    ) as exc:
        print(f"dflashctl demo: {exc}", file=sys.stderr)
        return 1


def run_tui(args: argparse.Namespace) -> int:
    """Open the TUI on the demo host; stop the run on exit unless --keep."""
    from dflashctl.control import RunControl
    from dflashctl.deploy import deploy
    from dflashctl.monitor import shape_from_config
    from dflashctl.remote.commands import tmux_attach
    from dflashctl.remote.transport import LocalTransport
    from dflashctl.tui.app import DflashApp, HostBinding

    demo_dir = (args.dir or default_dir()).resolve()
    config = demo_dir / "demo.toml"
    host = demo_host(demo_dir, config, args.session)
    transport = LocalTransport(label="demo")
    control = RunControl(transport, host)
    binding = HostBinding(
        name=DEMO_HOST,
        control=control,
        config_path=config,
        attach_argv=tmux_attach(host.session),
        deploy=lambda: deploy(transport, host, config=config),
        shape=shape_from_config(config),
        close=transport.close,
    )
    quit_action = (
        "quit (the demo run keeps going: --keep)"
        if args.keep
        else "quit and stop the demo run gracefully (--keep leaves it running)"
    )
    DflashApp([binding], quit_action=quit_action).run()
    if args.keep:
        print(f"demo run left running: tmux -L dflash attach -t ={host.session}")
        return 0
    print("stopping the demo run gracefully (use --keep to leave it running) ...")

    async def stop() -> None:
        local = LocalTransport(label="demo")
        try:
            result = await RunControl(local, host).stop(timeout=STOP_TIMEOUT_S)
            print(f"stop: {result.summary()}")
        finally:
            await local.close()

    asyncio.run(stop())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
