"""hosts.toml validation: errors name file, host and key; nothing injectable gets through."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflashctl.inventory import InventoryError, load_inventory, parse_inventory

GOOD = """
[defaults]
user = "root"
known_hosts = "pins"
workdir = "/opt/dflash"
env = { WANDB_MODE = "offline" }

[hosts.pve-a]
address = "10.1.2.6"
ctid = 200
identity_file = "keys/id_ed25519"
run_config = "configs/run.toml"

[hosts.pve-b]
address = "pve-b.lan"
port = 2222
ctid = 201
session = "train2"
env = { PYTORCH_CUDA_ALLOC_CONF = "expandable_segments:False" }
"""


def test_defaults_merge_and_relative_paths_resolve(tmp_path: Path) -> None:
    inv = parse_inventory(GOOD, tmp_path / "hosts.toml")
    a, b = inv.hosts["pve-a"], inv.hosts["pve-b"]
    assert (a.ctid, a.port, a.user, a.workdir, a.session) == (
        200,
        22,
        "root",
        "/opt/dflash",
        "dflash",
    )
    assert a.known_hosts == (tmp_path / "pins").resolve()
    assert a.identity_file == (tmp_path / "keys/id_ed25519").resolve()
    assert a.run_config == (tmp_path / "configs/run.toml").resolve()
    assert a.env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "WANDB_MODE": "offline"}
    assert b.env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
    assert (b.port, b.session, b.run_dir) == (2222, "train2", "/opt/dflash/run")


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        ('[hosts.a]\naddress = "h"\nctid = 200\npasword = "x"\n', "host 'a': pasword: unknown key"),
        ('[hosts.a]\naddress = "h"\n', "host 'a': ctid: required key is missing"),
        ('[hosts.a]\naddress = "h"\nctid = "two"\n', "host 'a': ctid:"),
        ("[defaults]\nport = 0\n", "defaults.port:"),
        ('[hosts.a]\naddress = "h;reboot"\nctid = 200\n', "host 'a': address:"),
        ('[hosts.a]\naddress = "h"\nctid = 200\nsession = "x; kill-server"\n', "session"),
        ('[hosts.a]\naddress = "h"\nctid = 200\nsession = "a.b"\n', "session"),
        ('[hosts.a]\naddress = "h"\nctid = 200\nworkdir = "/opt/$(reboot)"\n', "workdir"),
        ('[hosts.a]\naddress = "h"\nctid = 200\nworkdir = "/opt/../etc"\n', "workdir"),
        ('[hosts.a]\naddress = "h"\nctid = 200\nenv = { "A B" = "1" }\n', "env"),
        ('[hosts."bad name"]\naddress = "h"\nctid = 200\n', "host 'bad name'"),
        ("[hosts.a\n", "not valid TOML"),
    ],
)
def test_errors_are_one_line_naming_file_host_and_key(
    tmp_path: Path, snippet: str, expected: str
) -> None:
    path = tmp_path / "hosts.toml"
    with pytest.raises(InventoryError) as info:
        parse_inventory(snippet, path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: ") and expected in msg and "\n" not in msg


def test_missing_file_and_unknown_host(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="inventory not found"):
        load_inventory(tmp_path / "nope.toml")
    path = tmp_path / "hosts.toml"
    path.write_text(GOOD)
    with pytest.raises(InventoryError, match=r"no host 'c' \(known: pve-a, pve-b\)"):
        load_inventory(path).get("c")


def test_example_inventory_in_repo_is_valid() -> None:
    inv = load_inventory(Path(__file__).resolve().parents[2] / "hosts.toml")
    assert inv.hosts


def test_group_writable_inventory_warns(tmp_path: Path) -> None:
    path = tmp_path / "hosts.toml"
    path.write_text(GOOD)
    path.chmod(0o644)
    assert load_inventory(path).warnings == ()
    path.chmod(0o664)
    assert "writable by group or others" in load_inventory(path).warnings[0]


def test_local_host_with_an_unusable_path_is_a_clear_error(tmp_path: Path) -> None:
    from dflashctl.inventory import local_host

    assert local_host("demo", tmp_path / "wd", python="/usr/bin/python3").workdir.endswith("/wd")
    with pytest.raises(InventoryError, match=r"local host 'demo': workdir:"):
        local_host("demo", tmp_path / "my runs", python="/usr/bin/python3")
