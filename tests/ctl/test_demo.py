"""The demo evaluates: its config is tiny-cpu.toml with configs/demo.toml laid over it, a config
nobody edited follows the bundled one, and a real headless demo run shows tau climbing, a best
checkpoint, and `status` reporting both (the real trainer on CPU under tmux, LocalTransport)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import threading
import tomllib
from pathlib import Path

import pytest

from dflashctl.cli.status_text import format_run_status
from dflashctl.demo import (
    DEMO_OVERLAY,
    REPO_CONFIG,
    WRITTEN,
    demo_host,
    parse_args,
    prepare,
)
from dflashctl.remote import LocalTransport
from dflashctl.runs.control import RunControl
from dflashctl.runs.snapshot import RunStatus
from tests import budget
from tests.conftest import demo_processes, headless_demo_argv, run_headless_demo
from trainer.config import TrainConfig
from trainer.events import EvalEvent, StatusEvent, parse_line

ROOT = Path(__file__).resolve().parents[2]


def test_the_demo_config_is_tiny_cpu_with_the_overlay_and_it_evaluates(tmp_path: Path) -> None:
    made = prepare(tmp_path / "demo")
    assert made.note is None and not made.fresh
    cfg = TrainConfig.load(made.path)  # a valid run config
    tiny = TrainConfig.load(REPO_CONFIG)
    overlay = tomllib.loads(DEMO_OVERLAY.read_text())
    assert cfg.eval.holdout_rows == overlay["eval"]["holdout_rows"] > 0
    assert cfg.eval.every_steps == overlay["eval"]["every_steps"]
    assert cfg.schedule.epochs == overlay["schedule"]["epochs"] > tiny.schedule.epochs
    # everything else is tiny-cpu's, with the store and target under the demo's cache
    assert cfg.batching == tiny.batching and cfg.model.drafter == tiny.model.drafter
    assert cfg.data.store == str(tmp_path / "demo" / "cache" / "tiny-store")
    assert cfg.model.target_dir == str(tmp_path / "demo" / "cache" / "tiny-qwen3")
    # the TUI test's scripted edit and the header's suggestions still apply to the text
    assert "\ninterval_s = 2\n" in made.path.read_text()


def _bundle(tmp: Path, every: int) -> tuple[Path, Path]:
    overlay = tmp / f"overlay-{every}.toml"
    overlay.write_text(f"[eval]\nholdout_rows = 16\nevery_steps = {every}\n")
    return REPO_CONFIG, overlay


def test_an_unedited_demo_config_follows_the_bundled_one_and_an_edited_one_is_kept(
    tmp_path: Path,
) -> None:
    demo = tmp_path / "demo"
    base, v1 = _bundle(tmp_path, 100)
    first = prepare(demo, base, v1)
    assert (demo / WRITTEN).is_file() and "every_steps = 100" in first.path.read_text()
    assert prepare(demo, base, v1) == first  # nothing changed: nothing done
    _, v2 = _bundle(tmp_path, 50)
    updated = prepare(demo, base, v2)  # nobody edited it: it follows the bundle, fresh
    assert updated.fresh and updated.note is not None and "updated" in updated.note
    assert "every_steps = 50" in updated.path.read_text()
    edited = updated.path.read_text().replace("interval_s = 2", "interval_s = 1")
    updated.path.write_text(edited)
    kept = prepare(demo, base, v1)  # the user's edit survives a bundle change
    assert kept.note is None and not kept.fresh and updated.path.read_text() == edited


def test_an_earlier_demos_config_without_eval_is_moved_aside_and_an_edit_without_it_said(
    tmp_path: Path,
) -> None:
    demo = tmp_path / "demo"
    demo.mkdir()
    old = "# an earlier demo's config\n" + REPO_CONFIG.read_text()
    (demo / "demo.toml").write_text(old)  # no digest: written before the demo evaluated
    base, overlay = _bundle(tmp_path, 100)
    made = prepare(demo, base, overlay)
    assert made.fresh and made.note is not None and "demo.toml.old" in made.note
    assert (demo / "demo.toml.old").read_text() == old
    assert "[eval]" in made.path.read_text()
    # the user removes [eval] from the demo's own config: kept, and said
    text = made.path.read_text()
    made.path.write_text(text[: text.index("[eval]")])
    again = prepare(demo, base, overlay)
    assert not again.fresh and again.note is not None and "has no [eval]" in again.note
    assert "[eval]" not in made.path.read_text()


def test_headless_stop_conditions_take_whole_numbers_from_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = parse_args(["--headless", "--evals", "4", "--until-step", "1"])
    assert (args.evals, args.until_step) == (4, 1)
    for flag in ("--evals", "--until-step"):
        with pytest.raises(SystemExit) as exc:
            parse_args(["--headless", flag, "0"])
        assert exc.value.code == 2
        assert f"{flag} 0: expected a whole number >= 1" in capsys.readouterr().err


@pytest.mark.parts
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_headless_demo_shows_tau_climbing_a_best_checkpoint_and_status_reports_both(
    tmp_path: Path,
) -> None:
    demo_dir, session = tmp_path / "demo", f"dflash-demo-eval-{os.getpid()}"
    done = run_headless_demo(demo_dir, session, "--evals", "4")  # steps 0, 200, 400, 600
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    events = [parse_line(ln) for ln in lines]
    evals = [e for e in events if isinstance(e, EvalEvent)]
    # the last two lines: the last Eval line, then the last status line
    assert isinstance(events[-1], StatusEvent) and events[-2] == evals[-1]
    live = evals[:-1]  # as they came (the last one is printed again at the end)
    assert len(live) >= 3, lines
    first, last = live[0], live[-1]
    assert first.step == 0 and first.tau is not None and first.best is None
    assert last.tau is not None and last.tau > 1.5 and last.tau > first.tau + 0.3, lines
    assert last.best is not None and last.best > 0
    assert any(ln.startswith("eval: step ") and "(best " in ln for ln in lines)

    # status on the demo host (the stopped run): the last eval and the best, json and text
    host = demo_host(demo_dir, demo_dir / "demo.toml", session)
    transport = LocalTransport()

    async def status() -> RunStatus:
        try:
            return await RunControl(transport, host).status()
        finally:
            await transport.close()

    st = asyncio.run(status())
    d = json.loads(json.dumps(st.to_json_dict(), default=str))
    ev, best = d["eval"], d["best"]
    every = TrainConfig.load(demo_dir / "demo.toml").eval.every_steps
    assert every and ev["step"] >= last.step and ev["step"] % every == 0  # maybe one more
    assert 0 < ev["share"] < 0.5 and len(ev["acc_at"]) == 3
    at_best = [e for e in live if e.step == best["step"]]
    if at_best:  # the best as its Eval line said (printed to 3 decimals)
        assert best["tau"] == pytest.approx(at_best[0].tau, abs=5e-4)
    assert best["tau"] >= max(e.tau or 0.0 for e in live if e.step > 0) - 5e-4
    best_file = Path(best["checkpoint"])
    assert best_file.name == f"step-{best['step']:08d}.pt" and best_file.is_file()
    assert (best_file.parent / "best.pt").resolve() == best_file.resolve()
    assert (
        f"  eval: step {ev['step']} tau={ev['tau']:.3f} (best {best['step']}, "
        f"tau={best['tau']:.3f}, checkpoints/{best_file.name}); evals cost "
    ) in format_run_status(st)


@pytest.fixture(scope="module")
def signalled_demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One demo dir for both signals: the second reuses the tiny store and target."""
    return tmp_path_factory.mktemp("signalled") / "demo"


@pytest.mark.parts
@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    ("sig", "ignored"),
    [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True)],
    ids=["SIGINT", "SIGTERM", "SIGINT-to-a-background-job"],
)
def test_a_signal_stops_the_headless_demo_and_its_training(
    signalled_demo_dir: Path, tmp_path: Path, sig: signal.Signals, ignored: bool
) -> None:
    """The fault: SIGINT 40 s into `dflashctl demo --headless --duration 120` left it running past
    its duration, training on; SIGTERM (what `timeout` sends) ended dflashctl and left the
    trainer training in its tmux session. Either must stop the run, as `q` does in the TUI:
    also when the demo is a script's background job (`dflashctl demo ... &`: the shell starts
    it with SIGINT ignored, and `kill -INT` did nothing at all)."""
    demo_dir, session = signalled_demo_dir, f"dflash-demo-sig-{os.getpid()}"
    sock = tmp_path / "tmux"  # a private tmux server: its socket -L dflash is this test's alone
    sock.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMUX_TMPDIR": str(sock)}

    def tmux(*args: str) -> subprocess.CompletedProcess[str]:
        argv = ["tmux", "-L", "dflash", *args]
        return subprocess.run(argv, env=env, capture_output=True, text=True, check=False)

    argv = headless_demo_argv(demo_dir, session, 3600)  # only the signal can end it in time
    if ignored:  # as sh starts a background job without job control
        argv = ["sh", "-c", 'trap "" INT; exec "$@"', "background-job", *argv]
    lines: list[str] = []
    with (tmp_path / "stderr").open("w") as err:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True
        )

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:

        def training() -> bool:
            return proc.poll() is not None or any(
                isinstance(parse_line(ln), StatusEvent) for ln in lines
            )

        budget.until(training, "a first status line", detail=lambda: str(lines[-5:]))
        assert proc.poll() is None, lines
        proc.send_signal(sig)
        try:
            proc.wait(budget.left())
        except subprocess.TimeoutExpired:
            pytest.fail(f"the demo was still running after {sig.name}: {lines[-5:]}")
        reader.join(budget.left())

        stderr = (tmp_path / "stderr").read_text()
        assert proc.returncode == 128 + sig, (proc.returncode, lines[-5:], stderr[-2000:])
        assert f"{sig.name}: stopping the demo run gracefully ..." in lines, lines
        assert any(ln.startswith("stop: stopped (") for ln in lines), lines  # gracefully
        assert isinstance(parse_line(lines[-1]), StatusEvent), lines[-5:]  # as a timed end

        def all_gone() -> bool:
            alive = tmux("has-session", "-t", f"={session}").returncode == 0
            return not alive and not demo_processes(demo_dir)

        budget.until(
            all_gone,
            "the demo's session and processes to end",
            detail=lambda: f"{tmux('ls').stdout} {demo_processes(demo_dir)}",
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        tmux("kill-server")
        for left in demo_processes(demo_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(left.split()[0]), signal.SIGKILL)
