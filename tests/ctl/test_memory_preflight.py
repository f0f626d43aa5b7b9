"""Deploy's memory checks against real parts: the release's `python -m trainer.memory` run in a
real LXC container over sshd + pct, on its (stand-in) GPU and on a small tmpfs workdir.

The container has no GPU: the fit check's GPU is a stand-in `nvidia-smi` on the container's
PATH (a tmpfs mounted over /usr/local/sbin inside the container only) printing what an H200
node prints for the preflight's query. Workdirs are tmpfs mounts inside the container, so the
free space the check reads is the size given here.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflashctl.cli.main import main as cli_main
from dflashctl.config.inventory import HostConfig
from dflashctl.releases.deploy import DeployError, deploy
from dflashctl.releases.preflight import MIB, judge_disk, judge_memory, smallest_gpu
from dflashctl.releases.release import Release, build_release
from dflashctl.remote.ssh import SshTransport
from tests.ctl import parts as P

pytestmark = [pytest.mark.parts, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parents[2]
H200 = "0, NVIDIA H200, 143771\n1, NVIDIA H200, 143771\n"
TARGET = "/srv/dflash-target"  # the Qwen3-8B config.json, inside the container


@contextlib.contextmanager
def standin_nvidia_smi(parts: P.Parts, csv: str) -> Iterator[None]:
    """`nvidia-smi` on the container's PATH answering the preflight's GPU query with `csv`."""
    script = (
        "#!/bin/sh\n"
        'case "$*" in *--query-gpu=index,name,memory.total*) cat "$0.csv";; '
        '*) echo "stand-in nvidia-smi: unsupported query" >&2; exit 2;; esac\n'
    )
    with P.container_tmpfs(parts, "/usr/local/sbin", "1m"):
        P.attach(parts, "cat > /usr/local/sbin/nvidia-smi.csv", stdin=csv)
        P.attach(
            parts,
            "cat > /usr/local/sbin/nvidia-smi && chmod 755 /usr/local/sbin/nvidia-smi",
            stdin=script,
        )
        got = P.attach(
            parts, "nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits"
        )
        assert got == csv
        yield


@pytest.fixture(scope="module")
def trainer_release(tmp_path_factory: pytest.TempPathFactory) -> Release:
    """A frozen copy of the real trainer (it ships trainer.memory)."""
    tree = tmp_path_factory.mktemp("tree")
    shutil.copytree(
        REPO / "trainer", tree / "trainer", ignore=shutil.ignore_patterns("__pycache__")
    )
    return build_release(tree)


@pytest.fixture
def target_in_container(real_parts: P.Parts) -> Iterator[str]:
    cfg = (REPO / "tests" / "fixtures" / "qwen3-8b" / "config.json").read_text()
    P.attach(real_parts, 'mkdir -p "$1" && cat > "$1/config.json"', TARGET, stdin=cfg)
    yield TARGET
    P.attach(real_parts, 'rm -rf "$1"', TARGET)


def seed_config(tmp_path: Path, *, max_query_rows: int, name: str = "run.toml") -> Path:
    """The seed config (6 target GPUs + 1 drafter GPU) pointed at the container's target."""
    text = (REPO / "configs" / "qwen3-8b-6x1.toml").read_text()
    text = re.sub(r"(?m)^target_dir = .*$", f'target_dir = "{TARGET}"', text)
    text = re.sub(r"(?m)^store = .*$", 'store = "/srv/no-store-here"', text)
    text = re.sub(r"(?m)^max_query_rows = .*$", f"max_query_rows = {max_query_rows}", text)
    path = tmp_path / name
    path.write_text(text)
    return path


def local_estimate(config: Path, device_memory_mib: int) -> dict:  # type: ignore[type-arg]
    """What the estimator says here, with the same target shape (the expected value)."""
    from trainer.memory.cli import run

    target = REPO / "tests" / "fixtures" / "qwen3-8b" / "config.json"
    return run(config, device_memory_mib * MIB, int(1.5 * 2**30), target)


def test_smallest_gpu_and_a_failed_estimate_is_a_note_naming_the_host() -> None:
    assert smallest_gpu(["0, NVIDIA H200, 143771", "1, NVIDIA H100 80GB HBM3, 81559"]) == (
        "NVIDIA H100 80GB HBM3",
        81559,
    )
    assert smallest_gpu([]) is None
    probe = {
        "rc": 2,
        "report": None,
        "tmp": "/w/run/.config.memory-check.7.toml",
        "error": "error: /w/run/.config.memory-check.7.toml: model.target_dir: no config.json",
    }
    v = judge_memory("node3", "run.toml", "/w/run", [], probe)
    assert v.failures == []
    assert v.notes == [
        "node3: memory estimate failed (exit 2): error: run.toml: model.target_dir: no "
        "config.json; fit and checkpoint disk checks not made"
    ]


def test_disk_warns_within_twice_and_counts_checkpoints_already_there() -> None:
    rep = {"checkpoint": {"bytes": 100 * MIB, "keep_last": 3, "keep_every_steps": None}}
    tight = judge_disk("n", "/w/run", {"free_bytes": 700 * MIB, "existing_bytes": 0}, rep)
    assert tight.failures == [] and tight.notes[0].startswith(
        "n: warning: only 700 MiB free under /w/run, checkpoints need 400 MiB"
    )
    short = judge_disk("n", "/w/run", {"free_bytes": 250 * MIB, "existing_bytes": 0}, rep)
    assert short.failures[0].startswith("n: 250 MiB free under /w/run, checkpoints need 400 MiB")
    # three checkpoints already on disk are replaced by retention: one more is needed
    resumed = judge_disk("n", "/w/run", {"free_bytes": 250 * MIB, "existing_bytes": 300 * MIB}, rep)
    assert resumed.failures == [] and "checkpoints need 100 MiB" in resumed.notes[0]


async def test_fit_check_on_the_containers_gpu(
    real_parts: P.Parts,
    ssh_host: HostConfig,
    trainer_release: Release,
    target_in_container: str,
    tmp_path: Path,
) -> None:
    too_big = seed_config(tmp_path, max_query_rows=200_000, name="big.toml")
    fits = seed_config(tmp_path, max_query_rows=24_576)
    expected = local_estimate(too_big, 143771)["drafter"]["largest_max_query_rows"]
    assert expected is not None and 24_576 <= expected < 200_000
    with (
        standin_nvidia_smi(real_parts, H200),
        P.container_tmpfs(real_parts, "/srv/fitcheck", "400g") as workdir,
    ):
        host = ssh_host.model_copy(update={"workdir": workdir})
        transport = SshTransport(host)
        lines: list[str] = []
        try:
            with pytest.raises(DeployError) as err:
                await deploy(
                    transport,
                    host,
                    config=too_big,
                    release=trainer_release,
                    import_check=False,
                    memory_check=True,
                    progress=lines.append,
                )
            assert str(err.value) == (
                f"ct: {too_big} does not fit the container's NVIDIA H200 (143771 MiB): "
                f"model.max_query_rows = 200000; the largest that fits is {expected}"
            )
            # refused before the switch: no config pushed, no current
            assert P.attach(
                real_parts, 'ls -A "$1"; test ! -e "$1/run/config.toml"', workdir
            ).split() == ["releases", "run"]
            ok = await deploy(
                transport,
                host,
                config=fits,
                release=trainer_release,
                import_check=False,
                memory_check=True,
                progress=lines.append,
            )
            assert ok.config_pushed and ok.switched
            assert any(
                ln.startswith("ct: fits the container's NVIDIA H200 (143771 MiB): peak ")
                and ln.endswith(f"largest model.max_query_rows that fits: {expected}")
                for ln in lines
            ), lines
            assert any(ln.startswith("ct: checkpoints fit: ") for ln in lines), lines
        finally:
            await transport.close()


def _inventory(parts: P.Parts, ssh_host: HostConfig, tmp_path: Path, workdir: str) -> list[str]:
    inv = tmp_path / f"hosts-{Path(workdir).name}.toml"
    text = P.hosts_toml(parts, known_hosts=ssh_host.known_hosts)
    inv.write_text(text.replace(f'workdir = "{P.CONTAINER_WORKDIR}"', f'workdir = "{workdir}"'))
    return ["--hosts", str(inv)]


def test_disk_check_and_no_gpu_through_the_cli(
    real_parts: P.Parts,
    ssh_host: HostConfig,
    target_in_container: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = seed_config(tmp_path, max_query_rows=24_576)
    tree = tmp_path / "tree"
    shutil.copytree(
        REPO / "trainer", tree / "trainer", ignore=shutil.ignore_patterns("__pycache__")
    )
    ckpt = local_estimate(cfg, 143771)["checkpoint"]["bytes"]
    needed = ckpt * (3 + 1)
    with P.container_tmpfs(real_parts, "/srv/small", "1536m") as small:
        inv = _inventory(real_parts, ssh_host, tmp_path, small)
        # --no-doctor: the seed's GPU config in this CPU container is on purpose here (the
        # disk check is under test; doctor would refuse the missing GPUs first)
        argv = [*inv, "deploy", "ct", "--config", str(cfg), "--tree", str(tree), "--no-doctor"]
        assert cli_main(argv) == 1
        out = capsys.readouterr()
        refusal = [ln for ln in out.err.splitlines() if "checkpoints need" in ln]
        assert len(refusal) == 1, out
        m = re.fullmatch(
            r"ct: ([\d,]+) MiB free under /srv/small/run, checkpoints need ([\d,]+) MiB "
            r"\(checkpoint.keep_last = 3, \+1 being written, [\d,]+ MiB each\); free space or "
            r"lower checkpoint.keep_last",
            refusal[0].removeprefix("dflashctl: "),
        )
        assert m, refusal[0]
        assert int(m[1].replace(",", "")) < 1536
        assert int(m[2].replace(",", "")) == round(needed / MIB)
        assert "ct: no GPU in the container: memory fit check skipped" in out.out
        assert P.attach(real_parts, 'test ! -e "$1/current" && echo none', small).strip() == "none"
        # --no-memory-check: deployed, and said so
        assert cli_main([*argv, "--no-memory-check"]) == 0
        skipped = capsys.readouterr().out
        assert "ct: memory checks skipped (--no-memory-check)" in skipped
        assert "checkpoints" not in skipped
    with P.container_tmpfs(real_parts, "/srv/roomy", "400g") as roomy:
        inv = _inventory(real_parts, ssh_host, tmp_path, roomy)
        deploy = [*inv, "deploy", "ct", "--config", str(cfg), "--tree", str(tree), "--no-doctor"]
        assert cli_main(deploy) == 0
        fits = capsys.readouterr().out
        assert "ct: no GPU in the container: memory fit check skipped" in fits
        assert re.search(rf"ct: checkpoints fit: [\d,]+ MiB free under {roomy}/run, ", fits), fits
        # run/checkpoints on a volume of its own (common): measured there, not in run/
        with P.container_tmpfs(real_parts, f"{roomy}/run/checkpoints", "1536m") as ckpts:
            assert cli_main(deploy) == 1
            short = capsys.readouterr().err
            assert f"MiB free under {ckpts}, checkpoints need " in short, short
