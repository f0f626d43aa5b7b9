"""hosts.toml validation: errors name file, host and key; nothing injectable gets through."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflashctl.config.inventory import InventoryError, load_inventory, parse_inventory

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
        # strict types: TOML's true / "200" / 200.0 are never taken for an integer
        ('[hosts.a]\naddress = "h"\nctid = true\n', "host 'a': ctid: Input should be a valid"),
        ('[hosts.a]\naddress = "h"\nctid = "200"\n', "host 'a': ctid:"),
        ('[hosts.a]\naddress = "h"\nctid = 200.0\n', "host 'a': ctid:"),
        ('[hosts.a]\naddress = "h"\nctid = 200\nport = true\n', "host 'a': port:"),
        ("[defaults]\nkeep_releases = 2.0\n", "defaults.keep_releases:"),
        ("[defaults]\nmax_channels = false\n", "defaults.max_channels:"),
        ('[defaults]\nuse_agent = "yes"\n', "defaults.use_agent:"),
        ("[defaults]\nuse_agent = 1\n", "defaults.use_agent:"),
        ("[defaults]\ncommand_timeout = inf\n", "defaults.command_timeout:"),
        ("[defaults]\ncommand_timeout = nan\n", "defaults.command_timeout:"),
        ('[defaults]\ncommand_timeout = "5"\n', "defaults.command_timeout:"),
        ("[defaults]\nenv = { A = 1 }\n", "defaults.env.A:"),
        # workdir gets releases, current and checkpoints: never / or a system directory
        ('[hosts.a]\naddress = "h"\nctid = 200\nworkdir = "/"\n', "workdir: '/' is a system"),
        ('[hosts.a]\naddress = "h"\nctid = 200\nworkdir = "/run"\n', "workdir: '/run' is a"),
        ('[defaults]\nworkdir = "/run/dflash"\n', "defaults.workdir: '/run/dflash' is inside /run"),
        ('[defaults]\nworkdir = "/usr/lib"\n', "defaults.workdir:"),
        ('[defaults]\nworkdir = "/etc/dflash"\n', "defaults.workdir:"),
        ('[defaults]\nworkdir = "/proc/1"\n', "defaults.workdir:"),
        ('[defaults]\nworkdir = "/var/lib"\n', "defaults.workdir:"),
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


def test_error_messages_show_what_was_given(tmp_path: Path) -> None:
    with pytest.raises(InventoryError) as info:
        parse_inventory('[hosts.a]\naddress = "h"\nctid = 200\nport = true\n', tmp_path / "h")
    assert str(info.value).endswith("host 'a': port: Input should be a valid integer, got true")


@pytest.mark.parametrize("workdir", ["/opt/dflash", "/srv/dflash", "/var/lib/dflash", "/dflash"])
def test_ordinary_workdirs_are_accepted(tmp_path: Path, workdir: str) -> None:
    text = f'[hosts.a]\naddress = "h"\nctid = 200\nworkdir = "{workdir}"\n'
    assert parse_inventory(text, tmp_path / "hosts.toml").hosts["a"].workdir == workdir


def test_timeouts_and_channels_take_ints_and_floats(tmp_path: Path) -> None:
    text = "[defaults]\ncommand_timeout = 5\nconnect_timeout = 2.5\nmax_channels = 4\n"
    host = parse_inventory(text + GOOD.split("[defaults]")[1], tmp_path / "hosts.toml")
    a = host.hosts["pve-a"]
    assert (a.command_timeout, a.connect_timeout, a.max_channels) == (5.0, 2.5, 4)
    assert a.inventory == tmp_path / "hosts.toml"


def test_a_non_utf8_inventory_names_the_byte_offset(tmp_path: Path) -> None:
    path = tmp_path / "hosts.toml"
    path.write_bytes(b'[hosts.a]\naddress = "h\xe9"\nctid = 200\n')
    with pytest.raises(InventoryError) as info:
        load_inventory(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: not UTF-8 text at byte 22 (line 2)") and "\n" not in msg


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
    from dflashctl.config.inventory import local_host

    assert local_host("demo", tmp_path / "wd", python="/usr/bin/python3").workdir.endswith("/wd")
    with pytest.raises(InventoryError, match=r"local host 'demo': workdir:"):
        local_host("demo", tmp_path / "my runs", python="/usr/bin/python3")


def test_python_unset_is_the_env_setup_builds(tmp_path: Path) -> None:
    """`python` is optional once `dflashctl setup` built WORKDIR/env (issue 26): unset, a host
    runs WORKDIR/env/bin/python, under its own workdir or the default one."""
    text = """
[defaults]
known_hosts = "kh"
[hosts.a]
address = "10.0.0.1"
ctid = 200
workdir = "/srv/run-a"
[hosts.b]
address = "10.0.0.2"
ctid = 201
[hosts.c]
address = "10.0.0.3"
ctid = 202
python = "/opt/venv/bin/python"
"""
    inv = parse_inventory(text, tmp_path / "hosts.toml")
    assert inv.get("a").python == "/srv/run-a/env/bin/python"
    assert inv.get("b").python == "/opt/dflash/env/bin/python"
    assert inv.get("c").python == "/opt/venv/bin/python"
