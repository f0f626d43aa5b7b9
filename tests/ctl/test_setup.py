"""`dflashctl setup` on the LXC harness (issue 26, Deliver 1): the container has no network, so
the env is built from a wheelhouse (downloaded once per lock into ~/.cache/dflash-tests from
whatever index this machine's pip uses, then reused by every session) pushed by `--wheelhouse`.

It builds a CPU venv from the checkout's requirements.lock; a second run is a no-op; a broken
lock fails and keeps the env that was there; `python` unset in hosts.toml means that env, and
the trainer runs from it (deploy's preflight imports torch with it, then a 3-step run).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dflashctl.cli.main import main as cli_main
from dflashctl.config.inventory import load_inventory
from dflashctl.releases.envsetup import EnvSpec, env_spec, setup_env
from dflashctl.remote.connect import make_transport
from tests import budget
from tests.conftest import require_part
from tests.ctl import parts as P
from trainer.config.overlay import dump_toml, merge

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.parts, pytest.mark.slow, pytest.mark.timeout(900)]
BASE_PYTHON = str(Path(sys.base_prefix) / "bin" / "python3")  # bind-mounted into the container


@pytest.fixture(scope="session")
def wheelhouse() -> Path:
    """The CPU env's wheels for this lock, downloaded once (cached across sessions)."""
    sys.path.insert(0, str(REPO / "tools"))
    import torch_build

    spec = env_spec(REPO)
    wanted = "\n".join([spec.lock, torch_build.requirement("cpu"), *spec.requirements])
    digest = hashlib.sha256(wanted.encode()).hexdigest()[:12]
    tag = f"{digest}-py{sys.version_info.major}{sys.version_info.minor}"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash-tests"
    dest = cache / f"wheelhouse-{tag}"
    if (dest / ".complete").is_file():
        return dest
    tmp = cache / f".wheelhouse-{tag}-{os.getpid()}"
    tmp.mkdir(parents=True)
    lock = tmp / "lock.txt"
    lock.write_text(spec.lock)
    got = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "-d", str(tmp), "--only-binary=:all:",
         "-c", str(lock), torch_build.requirement("cpu"), *spec.requirements],
        capture_output=True, text=True, timeout=budget.left(),
    )  # fmt: skip
    lock.unlink()
    require_part(got.returncode == 0, f"cannot build the test wheelhouse: {got.stderr[-500:]}")
    (tmp / ".complete").write_text("")
    tmp.rename(dest)
    return dest


def _inventory(parts: P.Parts, tmp: Path) -> list[str]:
    """The harness host with no `python`: the env setup builds."""
    argv = P.pinned_inventory(parts, tmp)
    inv = Path(argv[1])
    inv.write_text(re.sub(r"(?m)^python = .*\n", "", inv.read_text()))
    return argv


def _attach(ct: P.Container, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["lxc-attach", "-n", ct.name, "--clear-env", "--", "sh", "-c", script, "sh", *args],
        capture_output=True,
        text=True,
        timeout=budget.left(),
    )


def test_setup_builds_the_env_once_keeps_it_on_failure_and_the_trainer_runs_from_it(
    real_parts: P.Parts,
    clean_workdir: Path,
    wheelhouse: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    inv = _inventory(real_parts, tmp_path)
    host = load_inventory(Path(inv[1])).get("ct")
    assert host.python == f"{P.CONTAINER_WORKDIR}/env/bin/python"
    setup = [*inv, "setup", "ct", "--wheelhouse", str(wheelhouse), "--python", BASE_PYTHON]

    capsys.readouterr()
    assert cli_main(setup) == 0
    out = capsys.readouterr().out
    assert re.search(r"^ct: setup: pushing \d+ wheels \([\d,]+ MiB\)", out, re.M), out
    assert "setup: building env " in out and "torch 2.13.0 cpu build (no GPU listed)" in out
    assert re.search(r"^ct: setup: Successfully installed ", out, re.M), out
    env = clean_workdir / "env"
    key = os.readlink(env).removeprefix("envs/")
    record = json.loads((clean_workdir / "envs" / key / ".complete").read_text())
    assert record["build"] == "cpu" and record["torch"].startswith("2.13.0")
    assert record["lock"] == env_spec().lock_sha and record["torch_cuda"] is None

    # the same lock on the same driver: nothing to do, nothing pushed again
    assert cli_main(setup) == 0
    again = capsys.readouterr().out
    assert "setup: up to date: env " + key in again and "building" not in again
    assert "wheels already in" in again and "pushing" not in again

    # a lock naming a version that exists nowhere: the build fails, the env stays
    good = env_spec()
    broken = EnvSpec(
        re.sub(r"(?m)^numpy==.*$", "numpy==0.0.1", good.lock), good.rule, good.requirements
    )
    said: list[str] = []

    async def build_broken() -> str:
        t = make_transport(host)
        try:
            return await setup_env(
                t, host, base_python=BASE_PYTHON, wheelhouse=wheelhouse, spec=broken,
                progress=said.append,
            )  # fmt: skip
        finally:
            await t.close()

    from dflashctl.releases.envsetup import SetupError

    with pytest.raises(
        SetupError, match=r"setup failed: failed: pip install failed: .*numpy==0\.0\.1"
    ):
        asyncio.run(build_broken())
    assert any(f"the previous env ({key}) is kept" in line for line in said), said
    assert os.readlink(env) == f"envs/{key}"
    assert sorted(p.name for p in (clean_workdir / "envs").iterdir()) == [key]

    # deploy's preflight imports torch with the env's python; the trainer runs from it
    tiny = tomllib.loads((REPO / "configs" / "tiny-cpu.toml").read_text())
    cfg = tmp_path / "run.toml"
    cfg.write_text(dump_toml(merge(tiny, {"schedule": {"max_steps": 3}})))
    tree = P.frozen_tree(tmp_path / "tree")
    assert cli_main([*inv, "deploy", "ct", "--config", str(cfg), "--tree", str(tree)]) == 0
    deployed = capsys.readouterr().out
    assert "ct: preflight ok: python 3." in deployed and "torch=2.13.0" in deployed
    assert "older than requirements.lock" not in deployed and "no env set up" not in deployed
    run = _attach(
        real_parts.container,
        'cd "$1" && PYTHONPATH="$1/current" OMP_NUM_THREADS=1 "$1/env/bin/python" -m trainer '
        "--config run/config.toml --run-dir run/from-env",
        P.CONTAINER_WORKDIR,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    steps = [
        json.loads(x)["step"]
        for x in (clean_workdir / "run" / "from-env" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps[-1] == 3

    # an env built from another lock than the checkout's: deploy says so (and still deploys)
    record_path = clean_workdir / "envs" / key / ".complete"
    record["lock"] = "0123456789ab"
    record_path.write_text(json.dumps(record))
    assert cli_main([*inv, "deploy", "ct", "--config", str(cfg), "--tree", str(tree)]) == 0
    stale = capsys.readouterr().out
    assert (
        f"ct: the container's env (built {record['built']}) is older than requirements.lock "
        f"(0123456789ab there, {env_spec().lock_sha} here): dflashctl setup ct"
    ) in stale, stale
