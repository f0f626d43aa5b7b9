"""`dflashctl watch` inputs: the inventory's watch keys and the command's usage errors (exit 2,
one line naming the file and key). The watching itself is tested on real parts in test_watch.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dflashctl.cli.main import main as cli_main
from dflashctl.config.inventory import InventoryError, load_inventory, parse_inventory

REPO = Path(__file__).resolve().parents[2]
HOST = '[hosts.a]\naddress = "pve1"\nctid = 200\n'


def test_watch_keys_resolve_against_the_inventory_folder(tmp_path: Path) -> None:
    inv = parse_inventory(
        f'notify_urls_file = "secrets/urls"\nunreachable_alert_s = 90\n{HOST}',
        tmp_path / "hosts.toml",
    )
    assert inv.notify_urls_file == (tmp_path / "secrets" / "urls").resolve()
    assert inv.unreachable_alert_s == 90.0
    plain = parse_inventory(HOST, tmp_path / "hosts.toml")
    assert plain.notify_urls_file is None and plain.unreachable_alert_s == 300.0


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("unreachable_alert_s = 0", "unreachable_alert_s: Input should be greater than 0"),
        ("unreachable_alert_s = -5", "unreachable_alert_s: Input should be greater than 0"),
        ("unreachable_alert_s = inf", "unreachable_alert_s: Input should be a finite number"),
        ("unreachable_alert_s = nan", "unreachable_alert_s: Input should be a finite number"),
        ('unreachable_alert_s = "60"', "unreachable_alert_s: Input should be a valid number"),
        ("unreachable_alert_s = true", "unreachable_alert_s: Input should be a valid number"),
        ("notify_urls_file = 3", "notify_urls_file: Input should be a valid string"),
        ('notify_urls_file = ""', "notify_urls_file: String should have at least 1 character"),
    ],
)
def test_bad_watch_keys_are_one_line_naming_file_and_key(
    tmp_path: Path, line: str, said: str
) -> None:
    with pytest.raises(InventoryError) as err:
        parse_inventory(f"{line}\n{HOST}", tmp_path / "hosts.toml")
    msg = str(err.value)
    assert msg.startswith(f"{tmp_path / 'hosts.toml'}: {said}") and "\n" not in msg, msg


def test_the_watch_keys_belong_at_the_top_not_in_defaults(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match=r"defaults\.notify_urls_file: unknown key"):
        parse_inventory(f'[defaults]\nnotify_urls_file = "u"\n{HOST}', tmp_path / "hosts.toml")


def test_the_commented_watch_example_in_hosts_toml_loads_when_uncommented(tmp_path: Path) -> None:
    text = (REPO / "hosts.toml").read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith(("# notify_urls_file", "# unreach"))]
    assert len(lines) == 2, lines
    inv = parse_inventory("\n".join(ln[2:] for ln in lines) + "\n" + HOST, tmp_path / "h.toml")
    assert inv.notify_urls_file == (tmp_path / "notify-urls").resolve()


def write(tmp_path: Path, top: str, urls: str | None = None, mode: int = 0o600) -> list[str]:
    inv = tmp_path / "hosts.toml"
    inv.write_text(f'{top}[defaults]\nknown_hosts = "{tmp_path / "kh"}"\n{HOST}')
    if urls is not None:
        p = tmp_path / "urls"
        p.write_text(urls)
        p.chmod(mode)
    return ["--hosts", str(inv)]


@pytest.mark.parametrize(
    ("urls", "mode", "said"),
    [
        ("json://127.0.0.1:9/h\n", 0o640, r"notify_urls_file .*/urls: mode 0640 lets other"),
        ("json://127.0.0.1:9/h\n", 0o604, r"notify_urls_file .*/urls: mode 0604 lets other"),
        (None, 0o600, r"notify_urls_file .*/urls: cannot read it: No such file"),
        ("# nothing\n\n", 0o600, r"notify_urls_file .*/urls: holds no URLs"),
        ("json://127.0.0.1:9/h\nnot a url\n", 0o600, r"notify_urls_file .*/urls line 2: not a"),
    ],
)
def test_an_unusable_urls_file_is_exit_2_naming_inventory_key_and_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], urls: str | None, mode: int, said: str
) -> None:
    args = write(tmp_path, 'notify_urls_file = "urls"\n', urls, mode)
    assert cli_main([*args, "watch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"dflashctl: {tmp_path / 'hosts.toml'}: notify_urls_file ")
    assert re.search(said, err[0]), err[0]
    assert "127.0.0.1:9" not in err[0]  # a URL (a secret) is never quoted


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["watch", "nosuch"], "no host or group 'nosuch' (hosts: a; groups: none)"),
        (["watch", "--interval-s", "0"], "--interval-s 0: must be a number of seconds above 0"),
        (["watch", "--burst-s", "inf"], "--burst-s inf: must be a number of seconds above 0"),
        (["watch", "--drain-s", "-1"], "--drain-s -1: must be 0 or more seconds"),
    ],
)
def test_watch_usage_errors_are_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    args = write(tmp_path, "")
    assert cli_main([*args, *argv]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err


def test_watch_resolves_groups_and_all_to_hosts_in_order(tmp_path: Path) -> None:
    from dflashctl.cli.watch import watch_hosts

    inv_path = tmp_path / "hosts.toml"
    inv_path.write_text(
        "".join(
            f'[hosts.{n}]\naddress = "pve{i}"\nctid = 20{i}\nnode_address = "10.0.0.{i + 1}"\n'
            for i, n in enumerate(["a", "b", "c"])
        )
        + '[groups.pair]\nhosts = ["c", "b"]\n'
    )
    inv = load_inventory(inv_path)
    assert [h.name for h in watch_hosts(inv, [])] == ["a", "b", "c"]
    assert [h.name for h in watch_hosts(inv, ["all"])] == ["a", "b", "c"]
    assert [h.name for h in watch_hosts(inv, ["pair", "b", "a"])] == ["c", "b", "a"]
