"""CLI contract: exit codes and one-line errors for user mistakes, attach argv."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dflashctl.cli.main import main
from dflashctl.config.inventory import load_inventory
from dflashctl.errors import DflashctlError, ExitCode, UsageError, run_main
from dflashctl.remote.commands import with_known_term
from dflashctl.remote.connect import attach_argv
from tests import budget


def write_inv(tmp: Path, body: str) -> str:
    p = tmp / "hosts.toml"
    p.write_text(body)
    return str(p)


def test_bad_inventory_is_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inv = write_inv(tmp_path, '[hosts.a]\naddress = "h"\nctid = 200\nbogus = 1\n')
    assert main(["--hosts", inv, "status"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"dflashctl: {inv}: host 'a': bogus: unknown key (typo?)"


def test_unknown_host_and_missing_inventory_are_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inv = write_inv(tmp_path, '[hosts.a]\naddress = "h"\nctid = 200\n')
    assert main(["--hosts", inv, "deploy", "zz"]) == 2
    assert "no host 'zz' (known: a)" in capsys.readouterr().err
    assert main(["--hosts", str(tmp_path / "none.toml"), "hosts"]) == 2


def test_invalid_run_config_is_exit_2_before_connecting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("trainer.config")
    bad = tmp_path / "run.toml"
    bad.write_text("[batching]\nstrategy = 'bucketed'\n")
    # port 9 on loopback: nothing listens; validation must fail first, naming the file
    inv = write_inv(
        tmp_path,
        f'[hosts.a]\naddress = "127.0.0.1"\nport = 9\nctid = 200\nknown_hosts = "{tmp_path}/kh"\n',
    )
    from dflashctl.config.runconfig import RunConfigError, validate_config

    with pytest.raises(RunConfigError, match=str(bad)):
        validate_config(bad)
    assert main(["--hosts", inv, "deploy", "a", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err


def test_missing_tree_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inv = write_inv(tmp_path, '[hosts.a]\naddress = "h"\nctid = 200\n')
    assert main(["--hosts", inv, "deploy", "a", "--tree", str(tmp_path)]) == 2
    assert "trainer package not found" in capsys.readouterr().err


def test_attach_argv_pins_host_key_and_targets_exact_session(tmp_path: Path) -> None:
    inv = write_inv(
        tmp_path,
        '[hosts.a]\naddress = "10.1.2.6"\nport = 2222\nctid = 200\nsession = "run-1"\n'
        'identity_file = "id"\n',
    )
    argv = attach_argv(load_inventory(inv).get("a"), "xterm-256color")
    assert argv[:2] == ["ssh", "-t"] and "StrictHostKeyChecking=yes" in argv
    assert argv[argv.index("-i") + 1] == str(tmp_path / "id")
    assert argv[-2] == "root@10.1.2.6"
    assert argv[-1].startswith("pct exec 200 -- env -i ")
    assert argv[-1].endswith("tmux -L dflash attach-session -t =run-1")
    assert "TERM=xterm-256color" in argv[-1] and "infocmp" in argv[-1]


@pytest.mark.parametrize(
    ("term", "seen"),
    [
        ("xterm-256color", "xterm-256color"),
        ("vt100", "vt100"),
        ("no-such-term-x9", "xterm-256color"),
    ],
)
def test_attach_falls_back_to_a_terminal_the_container_knows(term: str, seen: str) -> None:
    """An unknown $TERM (say xterm-kitty without its terminfo) would make tmux refuse to attach."""
    argv = with_known_term(["sh", "-c", 'echo "$TERM"'])
    out = subprocess.run(
        argv, env={"PATH": os.defpath, "TERM": term}, capture_output=True, text=True
    )
    assert out.stdout.strip() == seen


def _unreachable_inv(tmp: Path, *names: str) -> str:
    """Hosts on a loopback port nobody listens on (connections are refused at once)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp / "kh").write_text("")
    body = "".join(
        f'[hosts.{n}]\naddress = "127.0.0.1"\nport = {port}\nctid = 200\n'
        f'known_hosts = "{tmp}/kh"\nconnect_timeout = 2\n'
        for n in names
    )
    return write_inv(tmp, body)


def test_non_utf8_run_config_is_one_line_naming_the_byte_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "run.toml"
    bad.write_bytes(b"seed = 1\n# caf\xe9\n")
    inv = _unreachable_inv(tmp_path, "a")
    for cmd in (["deploy", "a", "--config", str(bad)], ["restart", "a", "--config", str(bad)]):
        assert main(["--hosts", inv, *cmd]) == 2
        err = capsys.readouterr().err
        assert err == f"dflashctl: {bad}: not UTF-8 text at byte 14 (line 2): invalid byte 0xe9\n"


def test_hosts_is_exit_3_when_every_host_is_unreachable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inv = _unreachable_inv(tmp_path, "a", "b")
    assert main(["--hosts", inv, "hosts"]) == 3
    out = capsys.readouterr().out
    assert out.count("UNREACHABLE") == 2
    assert main(["--hosts", inv, "hosts", "--no-check"]) == 0  # nothing was asked


def test_status_into_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    """`dflashctl status | head -1`: the reader is gone before status prints; no traceback."""
    import sys

    inv = _unreachable_inv(tmp_path, "a", "b")
    read, write = os.pipe()
    os.close(read)  # head has already exited
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "dflashctl", "--hosts", inv, "status"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=budget.left(),
            cwd=Path(__file__).resolve().parents[2],
        )
    finally:
        os.close(write)
    assert proc.returncode == 141 and proc.stderr == ""


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--fresh", "--resume", "12"], "--fresh and --resume exclude each other"),
        (["--resume", "-3"], "--resume '-3': expected auto, never, a checkpoint step or a"),
    ],
)
def test_bad_resume_choices_are_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], said: str
) -> None:
    inv = _unreachable_inv(tmp_path, "a")
    for cmd in ("start", "restart"):
        assert main(["--hosts", inv, cmd, "a", *args]) == 2
        assert said in capsys.readouterr().err


def test_start_wait_comes_from_the_inventory_and_is_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from dflashctl.cli.common import wait_s_of

    inv = write_inv(
        tmp_path, '[defaults]\nstart_wait = 7.5\n[hosts.a]\naddress = "h"\nctid = 200\n'
    )
    host = load_inventory(Path(inv)).get("a")
    assert wait_s_of(argparse.Namespace(wait_s=None), host) == 7.5
    assert wait_s_of(argparse.Namespace(wait_s=0.0), host) == 0.0
    assert main(["--hosts", inv, "start", "a", "--wait-s", "-1"]) == 2
    assert "--wait-s -1: must be 0 (do not wait) or more" in capsys.readouterr().err


class _Refused(DflashctlError):
    exit_code = ExitCode.UNREACHABLE


def _raise(err: BaseException) -> int:
    raise err


def test_run_main_reports_a_dflashctl_error_as_lines_plus_hint_and_its_exit_code(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _Refused("kpro6: connection refused\nsecond line", hint="is sshd up?")
    assert run_main(lambda: _raise(err)) == ExitCode.UNREACHABLE
    assert capsys.readouterr().err.splitlines() == [
        "dflashctl: kpro6: connection refused",
        "dflashctl: second line",
        "dflashctl: hint: is sshd up?",
    ]
    assert run_main(lambda: _raise(UsageError("bad flag")), prog="dflashctl demo") == 2
    assert capsys.readouterr().err == "dflashctl demo: bad flag\n"


def test_run_main_ctrl_c_is_130_and_other_exceptions_propagate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run_main(lambda: _raise(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == "dflashctl: interrupted\n"
    with pytest.raises(ZeroDivisionError):  # a bug is a traceback, not a one-line "error"
        run_main(lambda: 1 // 0)
    assert run_main(lambda: ExitCode.FAILED) == 1


def test_the_usage_errors_of_this_layer_share_the_one_base() -> None:
    from dflashctl.alerts.notify import NotifyConfigError
    from dflashctl.config.inventory import InventoryError
    from dflashctl.demo import DemoError

    assert issubclass(InventoryError, UsageError) and InventoryError.exit_code == 2
    assert issubclass(NotifyConfigError, UsageError)
    assert issubclass(DemoError, DflashctlError) and DemoError.exit_code == ExitCode.FAILED


def test_a_demo_that_cannot_start_is_one_line_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = tmp_path / "file"
    taken.write_text("")
    assert main(["demo", "--dir", str(taken), "--headless"]) == 1
    err = capsys.readouterr().err
    assert err == f"dflashctl demo: {taken}: cannot create the demo directory: File exists\n"
