"""Deploy and run control through LocalTransport: real processes, real tmux, a local workdir.

This is the path `dflashctl demo` uses; the SSH tests run the same services against real sshd
and LXC.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypedDict

import pytest

from dflashctl.config.inventory import HostConfig, local_host
from dflashctl.releases.deploy import DeployError, deploy
from dflashctl.releases.release import Release, build_release
from dflashctl.releases.resume import ResumeRefused
from dflashctl.remote import CommandTimeout, LocalTransport
from dflashctl.remote.commands import PaneState, parse_pane_state, tmux_settled_pane_state
from dflashctl.runs.control import RunControl
from dflashctl.runs.follow import lines_of
from dflashctl.runs.service import ControlError, StartFailed
from tests import budget
from tests.conftest import require_part
from tests.ctl.parts import bump_buckets, halve_lr

STANDIN = Path(__file__).resolve().parent / "standin"
Local = tuple[LocalTransport, HostConfig]


class QuickDeploy(TypedDict):
    min_free_bytes: int
    import_check: bool


class DeployKw(QuickDeploy, total=False):
    release: Release


pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def local(tmp_path: Path) -> tuple[LocalTransport, HostConfig]:
    require_part(shutil.which("tmux") is not None, "tmux not installed")
    sock = tmp_path / "tmux"
    sock.mkdir()
    # A private TMUX_TMPDIR: the test's `-L dflash` server is its own.
    transport = LocalTransport(env={"TMUX_TMPDIR": str(sock), "STANDIN_PERIOD": "0.1"})
    host = local_host("loc", tmp_path / "wd", python=sys.executable, session="t")
    return transport, host


@pytest.fixture
async def ctl(local: tuple[LocalTransport, HostConfig]) -> AsyncIterator[RunControl]:
    transport, host = local
    yield RunControl(transport, host)
    await transport.run(["tmux", "-L", "dflash", "kill-server"])
    await transport.close()


def standin_copy(tmp: Path) -> Path:
    dst = tmp / "tree"
    shutil.copytree(STANDIN, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


async def test_deploy_then_redeploy_transfers_nothing(local: Local, tmp_path: Path) -> None:
    transport, host = local
    rel = build_release(standin_copy(tmp_path))
    first = await deploy(transport, host, release=rel, min_free_bytes=0, import_check=False)
    wd = Path(host.workdir)
    assert first.transferred_bytes == len(rel.tar) and first.switched and first.previous is None
    assert os.readlink(wd / "current") == f"releases/{rel.id}"
    assert (wd / "releases" / rel.id / ".complete").is_file()
    again = await deploy(transport, host, release=rel, min_free_bytes=0, import_check=False)
    assert again.transferred_bytes == 0 and not again.switched
    assert not (wd / ".deploy.lock").exists()


async def test_corrupted_transfer_never_switches_current(local: Local, tmp_path: Path) -> None:
    transport, host = local
    tree = standin_copy(tmp_path)
    good = build_release(tree)
    await deploy(transport, host, release=good, min_free_bytes=0, import_check=False)
    (tree / "trainer" / "__init__.py").write_text("changed\n")
    newer = build_release(tree)
    bad = Release(id=newer.id, tar=good.tar, files=newer.files)  # payload does not match its id
    with pytest.raises(DeployError, match="expected " + newer.id):
        await deploy(transport, host, release=bad, min_free_bytes=0, import_check=False)
    wd = Path(host.workdir)
    assert os.readlink(wd / "current") == f"releases/{good.id}"
    assert not (wd / "releases" / newer.id).exists()
    assert not (wd / ".deploy.lock").exists()
    # and the next good deploy cleans the leftover temp dir and goes through
    done = await deploy(transport, host, release=newer, min_free_bytes=0, import_check=False)
    assert done.switched and not list((wd / "releases").glob(".tmp-*"))


async def test_concurrent_deploy_is_refused_by_the_lock(local: Local, tmp_path: Path) -> None:
    transport, host = local
    lock = Path(host.workdir) / ".deploy.lock"
    lock.mkdir(parents=True)
    (lock / "owner").write_text("laptop pid 1\n")
    rel = build_release(standin_copy(tmp_path))
    with pytest.raises(DeployError, match=r"another deploy holds .*laptop pid 1"):
        await deploy(transport, host, release=rel, min_free_bytes=0, import_check=False)
    assert lock.exists()  # someone else's lock is not ours to remove
    assert not (Path(host.workdir) / "current").exists()


async def test_two_deploys_at_once_one_wins(local: Local, tmp_path: Path) -> None:
    transport, host = local
    rel = build_release(standin_copy(tmp_path))
    results = await asyncio.gather(
        deploy(transport, host, release=rel, min_free_bytes=0, import_check=False),
        deploy(transport, host, release=rel, min_free_bytes=0, import_check=False),
        return_exceptions=True,
    )
    errors = [r for r in results if isinstance(r, BaseException)]
    oks = [r for r in results if not isinstance(r, BaseException)]
    assert len(oks) >= 1 and all(isinstance(e, DeployError) and "holds" in str(e) for e in errors)


async def test_old_releases_are_pruned_but_not_the_running_one(
    local: Local, tmp_path: Path
) -> None:
    transport, host = local
    host = host.model_copy(update={"keep_releases": 2})
    tree = standin_copy(tmp_path)
    ids = []
    for i in range(4):
        (tree / "trainer" / "v.py").write_text(f"v = {i}\n")
        rel = build_release(tree)
        ids.append(rel.id)
        if i == 1:
            (Path(host.workdir) / "run").mkdir(parents=True, exist_ok=True)
            (Path(host.workdir) / "run" / ".release").write_text(ids[0] + "\n")
        await deploy(transport, host, release=rel, min_free_bytes=0, import_check=False)
    left = {p.name for p in (Path(host.workdir) / "releases").iterdir()}
    assert left == {ids[0], ids[2], ids[3]}  # newest two + the one a run was started from


async def test_preflight_failure_is_reported_and_nothing_sent(local: Local, tmp_path: Path) -> None:
    transport, host = local
    bad = host.model_copy(update={"python": "/nonexistent/python3"})
    rel = build_release(standin_copy(tmp_path))
    with pytest.raises(DeployError, match=r"/nonexistent/python3 not found"):
        await deploy(transport, bad, release=rel)
    with pytest.raises(DeployError, match=r"GiB free under"):
        await deploy(transport, host, release=rel, min_free_bytes=10**18, import_check=False)
    assert not (Path(host.workdir) / "releases").exists() or not any(
        (Path(host.workdir) / "releases").iterdir()
    )


async def wait_for(pred: Callable[[], Awaitable[bool]]) -> None:
    """Until `pred()` holds, within the test's one budget."""
    await budget.until_awaited(pred)


async def test_start_status_follow_stop_restart(ctl: RunControl, tmp_path: Path) -> None:
    host = ctl.host
    cfg = tmp_path / "run.toml"
    cfg.write_text("[run]\nname = 'a'\n")
    rel = build_release(standin_copy(tmp_path))
    await deploy(ctl.transport, host, release=rel, min_free_bytes=0, import_check=False)
    with pytest.raises(ControlError, match=r"config\.toml"):
        await ctl.start()
    (Path(host.run_dir)).mkdir(parents=True, exist_ok=True)
    (Path(host.run_dir) / "config.toml").write_bytes(cfg.read_bytes())

    started = await ctl.start()
    assert started.started and started.release == rel.id and started.pane_pid
    again = await ctl.start()
    assert not again.started  # idempotent

    async def stepping() -> bool:
        st = await ctl.status()
        return st.state == "running" and (st.step or 0) >= 3

    await wait_for(stepping)
    st = await ctl.status()
    assert st.run_release == rel.id and st.config_hash and len(st.config_hash) == 12

    got: list[str] = []
    async for line in lines_of(ctl.follow(0)):
        got.append(line)
        if len(got) == 5:
            break
    assert got[:2] == ["Starting pipeline...", "Pipeline running. Monitoring..."]
    assert got[2].startswith("[0m] step=1 ") and got[4].startswith("[0m] step=3 ")

    stopped = await ctl.stop(timeout=budget.left())
    assert stopped.was_running and stopped.outcome in {"exited", "checkpointed"}
    assert stopped.checkpoint is not None and stopped.checkpoint.step >= 3
    assert Path(host.workdir, stopped.checkpoint.path).is_file()
    assert (await ctl.status()).state == "stopped"
    assert not (await ctl.stop()).was_running


async def test_crash_leaves_exit_status_and_tail(ctl: RunControl, tmp_path: Path) -> None:
    host = ctl.host
    await deploy(
        ctl.transport,
        host,
        release=build_release(standin_copy(tmp_path)),
        min_free_bytes=0,
        import_check=False,
    )
    Path(host.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(host.run_dir) / "config.toml").write_text("crash = true\n")
    # start waits for the trainer's setup: one that dies at once is a failed start, not "started"
    with pytest.raises(StartFailed, match=r"exited with status 3 .*: config asked for a crash$"):
        await ctl.start()
    st = await ctl.status()
    assert st.state == "crashed" and st.exit_status == 3
    assert st.last_error == "config asked for a crash"
    stop = await ctl.stop()
    assert stop.outcome == "dead" and stop.exit_status == 3
    assert stop.summary() == "not running: the run had already exited with status 3"
    assert (await ctl.status()).exit_status is None  # dead session cleared


async def test_follow_interrupt_kills_the_tail(ctl: RunControl) -> None:
    log = Path(ctl.host.run_dir) / "status.log"
    log.parent.mkdir(parents=True)
    log.write_text("one\ntwo\n")
    got = []
    async for line in lines_of(ctl.follow(1)):
        got.append(line)
        break
    assert got == ["two"]

    async def tail_gone() -> bool:
        out = await ctl.transport.run(["pgrep", "-f", f"tail -n +2 -F {log}"])
        return out.stdout.strip() == ""

    await wait_for(tail_gone)


async def test_secret_goes_through_stdin_into_a_0600_file(ctl: RunControl) -> None:
    path = await ctl.put_secret("wandb", b"s3cr3t\n")
    assert Path(path).read_bytes() == b"s3cr3t\n" and Path(path).stat().st_mode & 0o777 == 0o600
    with pytest.raises(ControlError, match="not a plain name"):
        await ctl.put_secret("../x", b"")


TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml"


def write_checkpoint(run: Path, step: int, config_text: str) -> Path:
    """A checkpoint as the trainer writes it (its own writer), saving `config_text`'s config."""
    pytest.importorskip("torch")
    import torch

    from trainer.config import TrainConfig
    from trainer.pipeline.checkpoint import save_checkpoint

    src = run / f".ckpt-config-{step}.toml"
    src.write_text(config_text)
    cfg = TrainConfig.load(src)
    src.unlink()
    layer = torch.nn.Linear(4, 4)  # real state_dicts: OrderedDicts that carry `_metadata`
    opt = torch.optim.AdamW(layer.parameters())
    layer(torch.ones(1, 4)).sum().backward()
    opt.step()
    state = {
        "step": step,
        "micro": step,
        "drafter": layer.state_dict(),
        "optimizer": opt.state_dict(),
        "sampler": {"epoch": 0, "consumed": step},
        "rng": [{"anchor": torch.Generator().get_state()}],
        "counters": {"tokens": 0},
        "config": cfg.model_dump(mode="json"),
        "world_size": 1,
    }
    return save_checkpoint(run, step, state, keep_last=10)


async def test_restart_refuses_a_change_the_checkpoint_cannot_resume(
    ctl: RunControl, tmp_path: Path
) -> None:
    require_part(TINY.is_file(), "configs/tiny-cpu.toml not in this checkout")
    run = Path(ctl.host.run_dir)
    run.mkdir(parents=True)
    (run / "config.toml").write_text(TINY.read_text())
    ckpt = write_checkpoint(run, 12, TINY.read_text())
    new = tmp_path / "new.toml"
    new.write_text(bump_buckets(TINY.read_text()))
    with pytest.raises(
        ResumeRefused, match=r"batching\.num_buckets against .*step-00000012\.pt.*--fresh"
    ):
        await ctl.restart(config=new)
    assert (run / "config.toml").read_text() == TINY.read_text()  # nothing pushed
    assert not (Path(ctl.host.workdir) / "releases").exists()  # nothing deployed
    # --resume STEP names the checkpoint compared against; --fresh skips the comparison
    found = await ctl.checkpoint_config("12")
    assert found is not None and found.step == 12
    assert found.path is not None and found.path.endswith(ckpt.name)


async def test_one_resume_rule_for_deploy_and_restart_against_the_checkpoint(
    ctl: RunControl, tmp_path: Path
) -> None:
    """The fault: `deploy --config B` (breaking) went through unchecked, after which going back
    to A (the checkpoint's own config) was refused by restart with advice to use --fresh."""
    require_part(TINY.is_file(), "configs/tiny-cpu.toml not in this checkout")
    rel = build_release(standin_copy(tmp_path))
    a = tmp_path / "a.toml"
    a.write_text(TINY.read_text())
    b = tmp_path / "b.toml"
    b.write_text(bump_buckets(TINY.read_text()))
    kw: DeployKw = {"release": rel, "min_free_bytes": 0, "import_check": False}
    await deploy(ctl.transport, ctl.host, config=a, **kw)
    run = Path(ctl.host.run_dir)
    write_checkpoint(run, 7, a.read_text())
    with pytest.raises(ResumeRefused, match=r"num_buckets .*step-00000007\.pt"):
        await deploy(ctl.transport, ctl.host, config=b, **kw)
    assert (run / "config.toml").read_text() == a.read_text()  # B was not pushed
    await deploy(ctl.transport, ctl.host, config=b, fresh=True, **kw)  # meant for a fresh start
    assert (run / "config.toml").read_text() == b.read_text()
    # back to A: it matches the checkpoint, so it resumes (the deployed B is not the reference)
    res = await ctl.restart(config=a, release=rel, stop_timeout=budget.left())
    assert res.start.started and res.start.ready
    assert (run / "config.toml").read_text() == a.read_text()
    await ctl.stop(timeout=budget.left())


async def test_checkpoint_config_skips_an_unreadable_newest_checkpoint(
    ctl: RunControl, tmp_path: Path
) -> None:
    require_part(TINY.is_file(), "configs/tiny-cpu.toml not in this checkout")
    run = Path(ctl.host.run_dir)
    run.mkdir(parents=True)
    write_checkpoint(run, 5, TINY.read_text())
    newest = write_checkpoint(run, 9, bump_buckets(TINY.read_text()))
    newest.write_bytes(newest.read_bytes()[:300])  # truncated, as a full disk leaves it
    found = await ctl.checkpoint_config()
    assert found is not None and found.step == 5 and found.count == 2
    assert [p for p, _ in found.skipped] == ["run/checkpoints/step-00000009.pt"]
    # so the tiny config resumes step 5 and is not refused for what step 9 had
    new = tmp_path / "same.toml"
    new.write_text(TINY.read_text())
    from dflashctl.releases.resume import check_config_push

    check = await check_config_push(ctl.transport, ctl.host, new, fresh=False)
    assert check.checkpoint is not None and check.checkpoint.step == 5
    assert any("step-00000009.pt unreadable" in n for n in check.notes)


async def test_a_first_deploy_with_a_config_says_nothing_about_checkpoints(
    local: Local, tmp_path: Path
) -> None:
    """The fault: the first deploy to a workdir that does not exist yet (every `make demo` on a
    fresh clone) printed "could not read the checkpoints' config": there are none to read."""
    require_part(TINY.is_file(), "configs/tiny-cpu.toml not in this checkout")
    transport, host = local
    assert not Path(host.workdir).exists()
    said: list[str] = []
    rel = build_release(standin_copy(tmp_path))
    kw: DeployKw = {"release": rel, "min_free_bytes": 0, "import_check": False}
    await deploy(transport, host, config=TINY, progress=said.append, **kw)
    assert (Path(host.run_dir) / "config.toml").read_text() == TINY.read_text()
    assert not [line for line in said if "checkpoint" in line], said
    # a reader that really fails still says so, and why (here: no python where the host says)
    from dflashctl.releases.resume import check_config_push

    broken = host.model_copy(update={"python": str(tmp_path / "no-python")})
    check = await check_config_push(transport, broken, TINY, fresh=False)
    assert check.notes == [
        f"loc: could not read the checkpoints' config ({tmp_path / 'no-python'}: command not "
        "found); not compared"
    ]


async def test_restart_pushes_config_redeploys_and_resumes(ctl: RunControl, tmp_path: Path) -> None:
    require_part(TINY.is_file(), "configs/tiny-cpu.toml not in this checkout")
    rel = build_release(standin_copy(tmp_path))
    cfg = tmp_path / "run.toml"
    cfg.write_text(TINY.read_text())
    await deploy(
        ctl.transport, ctl.host, release=rel, config=cfg, min_free_bytes=0, import_check=False
    )
    await ctl.start()

    async def stepping() -> bool:
        return ((await ctl.status()).step or 0) >= 2

    await wait_for(stepping)
    text, old_lr, new_lr = halve_lr(TINY.read_text())
    cfg.write_text(text)
    res = await ctl.restart(config=cfg, release=rel, stop_timeout=budget.left())
    assert f"-{old_lr}" in res.config_diff and f"+{new_lr}" in res.config_diff
    assert res.deploy.transferred_bytes == 0 and res.stop.checkpoint is not None
    assert res.start.started and res.old_config_hash != res.new_config_hash
    assert (Path(ctl.host.run_dir) / "config.toml").read_text() == cfg.read_text()
    resumed_from = res.stop.checkpoint.step
    ck = res.stop.checkpoint
    assert (
        res.stop.summary()
        == f"stopped ({res.stop.outcome}); checkpoint step {ck.step} at {ck.path}"
    )

    async def resumed() -> bool:
        st = await ctl.status()
        return st.run_state.last_step == resumed_from

    await wait_for(resumed)  # the stand-in resumed from the checkpoint the stop left
    await ctl.stop(timeout=budget.left())


async def test_failed_preflight_releases_only_our_own_lock(local: Local, tmp_path: Path) -> None:
    transport, host = local
    rel = build_release(standin_copy(tmp_path))
    with pytest.raises(DeployError, match="GiB free"):
        await deploy(transport, host, release=rel, min_free_bytes=10**18, import_check=False)
    assert not (Path(host.workdir) / ".deploy.lock").exists()
    # an unlock for somebody else's lock leaves it alone
    from dflashctl.remote.release import unlock_argv

    lock = Path(host.workdir) / ".deploy.lock"
    lock.mkdir()
    (lock / "owner").write_text("other host pid 7\n")
    await transport.run(unlock_argv(host.workdir, "me pid 1"))
    assert lock.exists()


async def test_deploy_with_config_writes_it_in_the_switch(local: Local, tmp_path: Path) -> None:
    transport, host = local
    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml"
    require_part(tiny.is_file(), "configs/tiny-cpu.toml not in this checkout")
    res = await deploy(
        transport,
        host,
        release=build_release(standin_copy(tmp_path)),
        config=tiny,
        min_free_bytes=0,
        import_check=False,
    )
    assert res.config_pushed
    assert (Path(host.run_dir) / "config.toml").read_bytes() == tiny.read_bytes()
    assert sorted(p.name for p in Path(host.run_dir).iterdir()) == ["config.toml"]


async def test_stop_does_not_report_an_old_checkpoint_as_its_own(
    ctl: RunControl, tmp_path: Path
) -> None:
    """A trainer that ignores SIGINT: the periodic checkpoint from before is not 'the' stop one."""
    run = Path(ctl.host.run_dir)
    run.mkdir(parents=True)
    (run / "status.log").write_text(
        "Checkpoint saved: step=5 path=run/checkpoints/step-00000005.pt\n"
    )
    ready = tmp_path / "sigint-ignored"
    script = (
        "import pathlib, signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        f"pathlib.Path({str(ready)!r}).touch(); "
        "print('Checkpoint saved: step=5 path=run/checkpoints/step-00000005.pt', flush=True); "
        "time.sleep(60)"
    )

    res = await ctl.starter.new_session([sys.executable, "-c", script], {})
    assert res.ok
    # Signal only once the handler is installed: under load, python's start-up can outlast
    # the stop's SIGINT, and an un-ignored SIGINT makes this a different test.
    await budget.until_async(ready.exists, "the SIGINT-ignoring stand-in started")
    stop = await ctl.stop(timeout=1.0)  # the feature: SIGINT is ignored, so it times out
    assert stop.was_running and stop.outcome == "timeout" and stop.checkpoint is None
    assert (
        stop.summary()
        == "stopped (timeout); its checkpoint was NOT written: no checkpoint line seen"
    )
    assert not stop.saved
    assert (await ctl.status()).state == "stopped"  # killed after the timeout


async def test_interrupted_deploy_leaves_current_and_no_lock(local: Local, tmp_path: Path) -> None:
    transport, host = local
    tree = standin_copy(tmp_path)
    first = build_release(tree)
    await deploy(transport, host, release=first, min_free_bytes=0, import_check=False)
    (tree / "trainer" / "v.py").write_text("v = 2\n")
    second = build_release(tree)
    # cancel while the (slow, importing) preflight runs, as Ctrl-C would
    task = asyncio.create_task(deploy(transport, host, release=second, min_free_bytes=0))
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    wd = Path(host.workdir)
    assert os.readlink(wd / "current") == f"releases/{first.id}"
    assert not (wd / ".deploy.lock").exists()
    assert not (wd / "releases" / second.id).exists()
    probes = await transport.run(["pgrep", "-f", f"import importlib.*{host.workdir}"])
    assert probes.stdout.strip() == ""  # the remote probe was killed with the local command


async def test_killing_helpers_never_confuses_the_child_watcher(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A command killed at its timeout is reaped without asyncio's "Unknown child process"
    warning (it reached the terminal in the demo: Popen.poll() had reaped the child first)."""
    transport = LocalTransport()
    with caplog.at_level("WARNING", logger="asyncio"):
        for _ in range(1000):  # the race hit about 1 kill in 170 here
            with pytest.raises(CommandTimeout):
                await transport.run(["sleep", "100"], timeout=0.002)
        await asyncio.sleep(0.1)  # the watcher thread reports late
    await transport.close()
    assert not [r.getMessage() for r in caplog.records if "child process" in r.getMessage()]


async def test_exit_status_of_a_pane_tmux_failed_to_reap(ctl: RunControl) -> None:
    """tmux (with libutempter) sometimes loses the SIGCHLD of a pane process that exits as its
    pty closes: the pane reads dead with no status and the process stays a zombie. Status and
    stop must still see the exit status (they nudge the server), never a crash with no code.
    Each stop kills the server's last session, so each new session also meets a server that is
    exiting ("server exited unexpectedly"), which new_session retries."""
    Path(ctl.host.workdir).mkdir(parents=True, exist_ok=True)
    for _ in range(60):  # about 1 instant exit in 6 to 20 hit the race here
        started = await ctl.starter.new_session(["sh", "-c", "exit 3"], {})
        assert started.ok, started.stderr

        async def exited() -> bool:  # under load the pane's sh may not have exited yet
            return (await ctl.status()).state != "running"

        await wait_for(exited)
        st = await ctl.status()
        assert (st.state, st.exit_status) == ("crashed", 3)
        stop = await ctl.stop()
        assert (stop.outcome, stop.exit_status) == ("dead", 3)  # and the session is gone


async def test_settled_pane_query_on_real_tmux(ctl: RunControl) -> None:
    """No session: nothing. A live pane: alive with its pid. A pane that exited: its status."""
    transport, session = ctl.transport, ctl.host.session
    Path(ctl.host.workdir).mkdir(parents=True, exist_ok=True)

    async def query() -> PaneState | None:
        res = await transport.run(tmux_settled_pane_state(session))
        assert res.ok, res.stderr
        return parse_pane_state(res.stdout)

    assert await query() is None
    assert (await ctl.starter.new_session(["sleep", "30"], {})).ok
    alive = await query()
    assert alive is not None and not alive.dead and alive.pid is not None
    await transport.run(["tmux", "-L", "dflash", "kill-server"])
    assert (await ctl.starter.new_session(["sh", "-c", "sleep 0.3; exit 5"], {})).ok

    async def pane_dead() -> bool:
        state = await query()
        return state is not None and state.dead

    await wait_for(pane_dead)
    dead = await query()
    assert dead is not None and dead.dead and dead.exit_status == 5


KILLED_CLIENT = """
import asyncio, sys
from pathlib import Path
from dflashctl.releases.deploy import deploy
from dflashctl.config.inventory import local_host
from dflashctl.releases.release import build_release
from dflashctl.remote import LocalTransport

host = local_host("loc", Path(sys.argv[1]), python=sys.executable, session="t")
asyncio.run(deploy(LocalTransport(), host, release=build_release(Path(sys.argv[2]))))
"""


async def test_a_lock_left_by_a_killed_deploy_is_taken_over(local: Local, tmp_path: Path) -> None:
    """A client SIGKILLed during preflight leaves .deploy.lock naming a pid that is gone."""
    import signal
    import subprocess

    transport, host = local
    tree = standin_copy(tmp_path)
    lock = Path(host.workdir) / ".deploy.lock"
    client = subprocess.Popen(
        [sys.executable, "-c", KILLED_CLIENT, host.workdir, str(tree)],
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        await budget.until_async(
            lambda: (lock / "owner").is_file() and (lock / "owner").read_text().strip(),
            "the client took the deploy lock",
        )
        client.send_signal(signal.SIGKILL)  # during its (importing) preflight
    finally:
        client.wait()
    stale = (lock / "owner").read_text().strip()
    assert f"pid {client.pid} " in stale
    said: list[str] = []
    res = await deploy(
        transport,
        host,
        release=build_release(tree),
        min_free_bytes=0,
        import_check=False,
        progress=said.append,
    )
    assert res.switched and not lock.exists()
    assert any(f"taking over a stale deploy lock: its owner ({stale})" in m for m in said)


async def test_break_lock_removes_a_foreign_lock_but_not_a_live_one(
    local: Local, tmp_path: Path
) -> None:
    from dflashctl.releases.deploy import lock_owner

    transport, host = local
    rel = build_release(standin_copy(tmp_path))
    lock = Path(host.workdir) / ".deploy.lock"
    lock.mkdir(parents=True)
    (lock / "owner").write_text("laptop-b pid 4242 at 2026-01-01T00:00:00\n")  # cannot be judged
    kw: DeployKw = {"release": rel, "min_free_bytes": 0, "import_check": False}
    with pytest.raises(DeployError, match=r"held by: laptop-b pid 4242 .*--break-lock"):
        await deploy(transport, host, **kw)
    said: list[str] = []
    res = await deploy(transport, host, break_stale_lock=True, progress=said.append, **kw)
    assert res.switched and not lock.exists()
    assert any("broke the deploy lock held by: laptop-b pid 4242" in m for m in said)
    # a lock whose owner provably runs (this very process) is neither taken over nor broken
    lock.mkdir()
    (lock / "owner").write_text(lock_owner() + "\n")
    with pytest.raises(DeployError, match="another deploy holds"):
        await deploy(transport, host, **kw)
    with pytest.raises(DeployError, match=r"not breaking .*its deploy is still running"):
        await deploy(transport, host, break_stale_lock=True, **kw)
    assert lock.exists()


async def test_a_switch_nobody_reported_is_reported_by_the_next_command(
    ctl: RunControl, tmp_path: Path
) -> None:
    """A client killed while its switch ran: `current` moved and the client never said so. The
    switch it sent is run here exactly as the dead client's last command ran."""
    from dflashctl.remote.release import switch_argv

    tree = standin_copy(tmp_path)
    first = build_release(tree)
    kw: QuickDeploy = {"min_free_bytes": 0, "import_check": False}
    await deploy(ctl.transport, ctl.host, release=first, **kw)
    assert not (Path(ctl.host.workdir) / ".deploy-switched").exists()  # reported: acknowledged
    (tree / "trainer" / "v.py").write_text("v = 2\n")
    second = build_release(tree)
    await deploy(ctl.transport, ctl.host, release=second, **kw)
    owner = "laptop pid 999999 at 2026-12-01T07:00:00"
    res = await ctl.transport.run(switch_argv(ctl.host.workdir, first.id, 5, owner=owner))
    assert res.ok, res.stderr
    st = await ctl.status()
    assert st.switch_note == (
        f"a deploy switched current {second.id} -> {first.id} and never reported back "
        f"({owner}); it is switched"
    )
    from dflashctl.cli.status_text import format_run_status

    assert f"note: {st.switch_note}" in format_run_status(st)
    run = Path(ctl.host.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.toml").write_text("[run]\n")
    started = await ctl.start()
    assert started.notes == [st.switch_note]  # start says it once, then it is acknowledged
    assert (await ctl.status()).switch_note is None
    await ctl.stop(timeout=budget.left())


HOSTILE_LOG = (
    "Starting pipeline...\n"
    "\x1b]0;PWNED-TITLE\x07\x1b]52;c;cm0gLXJmIH4=\x07\x1b[31mERROR: red alert\x1b[0m\n"
    "\x1b[32m[0m] step=1 loss=2.0000 acc=0.500 streak=1.0 lr=6.00e-04 noise=0.1000 | "
    "tgt=1.00b/s dft=1.00b/s (2.0Ktok/s) | q_pre=[1] q_hs=[1] | epoch~0.01 ETA=17m\x1b[0m\n"
    "\x1b[2Jcleared?\r\n"
)


async def test_remote_text_is_sanitised_where_it_enters(ctl: RunControl) -> None:
    """OSC title / OSC 52 clipboard / colour / clear-screen bytes in status.log never reach the
    terminal: status, the log tail and the live follow all hand out clean text."""
    run = Path(ctl.host.run_dir)
    run.mkdir(parents=True)
    (run / "status.log").write_text(HOSTILE_LOG)
    (run / "run-state.json").write_text('{"release": "\\u001b]0;PWNED\\u0007abc"}')
    st = await ctl.status()
    assert st.last_error == "red alert" and st.step == 1
    assert st.run_release == "abc"
    tail = await ctl.log.log_tail(0)
    followed = []
    async for line in lines_of(ctl.follow(0)):
        followed.append(line)
        if len(followed) == 4:
            break
    for lines in (tail, followed):
        assert lines[1] == "ERROR: red alert"
        assert lines[2].startswith("[0m] step=1 ") and lines[2].endswith("ETA=17m")
        assert lines[3] == "cleared?\\x0d"  # a CR is shown, not obeyed
        assert not any("\x1b" in ln or "\x07" in ln for ln in lines)


async def test_status_shows_only_the_current_runs_errors(ctl: RunControl, tmp_path: Path) -> None:
    run = Path(ctl.host.run_dir)
    run.mkdir(parents=True)
    (run / "status.log").write_text("Loading target and data...\nERROR: an earlier run's failure\n")
    (run / "config.toml").write_text("[run]\n")
    await deploy(
        ctl.transport,
        ctl.host,
        release=build_release(standin_copy(tmp_path)),
        min_free_bytes=0,
        import_check=False,
    )
    await ctl.start()
    st = await ctl.status()
    assert st.state == "running" and st.last_error is None
    await ctl.stop(timeout=budget.left())


async def test_corrupted_run_state_is_reported_not_taken_as_a_config_change(
    ctl: RunControl,
) -> None:
    from dflashctl.cli.status_text import format_run_status

    run = Path(ctl.host.run_dir)
    run.mkdir(parents=True)
    (run / "config.toml").write_text(TINY.read_text() if TINY.is_file() else "[run]\n")
    (run / "run-state.json").write_text('{"pid": 12, "config_ha')
    st = await ctl.status()
    assert st.run_state_error == (
        "run/run-state.json is corrupted: Unterminated string starting at (byte 12)"
    )
    text = format_run_status(st)
    assert "restart to apply" not in text
    assert "run/run-state.json is corrupted" in text and "config hash and run state unknown" in text


async def test_a_stop_the_trainer_completed_is_stopped_whatever_the_last_signal(
    ctl: RunControl,
) -> None:
    """Two Ctrl-C: the trainer checkpoints, writes run-state stopped/0, and the pane's process
    then dies of the second SIGINT (pane status 130). That run was stopped, not crashed."""
    Path(ctl.host.run_dir).mkdir(parents=True)
    script = (
        "import json, os, signal; "
        "open('run/run-state.json', 'w').write(json.dumps({'pid': os.getpid(), "
        "'state': 'stopped', 'exit_status': 0, 'stop_signal': 'SIGINT'})); "
        "signal.signal(signal.SIGINT, signal.SIG_DFL); os.kill(os.getpid(), signal.SIGINT)"
    )
    assert (await ctl.starter.new_session([sys.executable, "-c", script], {})).ok

    async def dead() -> bool:
        return (await ctl.status()).state != "running"

    await wait_for(dead)
    st = await ctl.status()
    assert (st.state, st.exit_status, st.stop_signal, st.signal) == ("stopped", 0, "SIGINT", None)


async def test_a_signal_exit_names_the_signal(ctl: RunControl) -> None:
    from dflashctl.cli.status_text import format_run_status

    Path(ctl.host.run_dir).mkdir(parents=True)
    script = "import os, signal, time; time.sleep(0.2); os.kill(os.getpid(), signal.SIGKILL)"
    assert (await ctl.starter.new_session([sys.executable, "-c", script], {})).ok

    async def dead() -> bool:
        return (await ctl.status()).state != "running"

    await wait_for(dead)
    st = await ctl.status()
    assert (st.state, st.exit_status, st.signal) == ("crashed", 137, "SIGKILL")
    assert "crashed exit=137 (killed by SIGKILL)" in format_run_status(st)


async def test_start_passes_resume_and_reports_readiness(ctl: RunControl, tmp_path: Path) -> None:
    await deploy(
        ctl.transport,
        ctl.host,
        release=build_release(standin_copy(tmp_path)),
        min_free_bytes=0,
        import_check=False,
    )
    run = Path(ctl.host.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.toml").write_text("[run]\n")
    started = await ctl.start(resume="run/checkpoints/step-00000004.pt")
    assert started.argv[-2:] == ["--resume", "run/checkpoints/step-00000004.pt"]
    assert started.ready is True  # the stand-in printed its phase line
    res = await ctl.transport.run(
        ["tmux", "-L", "dflash", "display-message", "-p", "-t", "=t:", "#{pane_start_command}"]
    )
    assert "--resume run/checkpoints/step-00000004.pt" in res.stdout
    await ctl.stop(timeout=budget.left())
