"""[groups.*] in hosts.toml: node order, node keys, and one-line errors naming group and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflashctl.config.inventory import (
    GroupConfig,
    HostConfig,
    Inventory,
    InventoryError,
    parse_inventory,
)

HOSTS = """
[defaults]
known_hosts = "pins"
gloo_socket_ifname = "eth1"

[hosts.pve-a]
address = "pve-a.lan"
ctid = 200
node_address = "192.0.2.10"
nccl_socket_ifname = "^=docker0,lo"

[hosts.pve-b]
address = "pve-b.lan"
ctid = 200
node_address = "2001:DB8::20"

[hosts.pve-c]
address = "pve-c.lan"
ctid = 300
node_address = "node-c.example"

[hosts.solo]
address = "pve-d.lan"
ctid = 400
"""


def parse(text: str, tmp_path: Path) -> Inventory:
    return parse_inventory(text, tmp_path / "hosts.toml")


def test_group_order_is_node_rank_and_node_keys_resolve(tmp_path: Path) -> None:
    text = HOSTS + '[groups.pair]\nhosts = ["pve-b", "pve-a"]\nrdzv_port = 29555\n'
    inv = parse(text, tmp_path)
    pair = inv.groups["pair"]
    assert pair.hosts == ("pve-b", "pve-a") and pair.nnodes == 2 and pair.rdzv_port == 29555
    assert pair.nodes[0] is inv.hosts["pve-b"]
    a, b = inv.hosts["pve-a"], inv.hosts["pve-b"]
    assert a.node_address == "192.0.2.10" and b.node_address == "2001:db8::20"  # normalised
    assert (a.nccl_socket_ifname, b.nccl_socket_ifname) == ("^=docker0,lo", None)
    assert a.gloo_socket_ifname == b.gloo_socket_ifname == "eth1"  # inherited from [defaults]
    assert inv.group_of("pve-a") is pair and inv.group_of("solo") is None


def test_rdzv_port_defaults_to_29400_and_single_host_users_see_no_groups(tmp_path: Path) -> None:
    assert parse(HOSTS, tmp_path).groups == {}
    inv = parse(HOSTS + '[groups.g]\nhosts = ["pve-a", "pve-c"]\n', tmp_path)
    assert inv.groups["g"].rdzv_port == 29400


@pytest.mark.parametrize(
    "address",
    ["10.0.0.7", "127.0.0.1", "fd00::7", "::1", "node-7", "n7.cluster.example", "a-b.c-d.example"],
)
def test_node_addresses_accepted(tmp_path: Path, address: str) -> None:
    text = f'[hosts.a]\naddress = "p"\nctid = 200\nnode_address = "{address}"\n'
    assert parse(text, tmp_path).hosts["a"].node_address == address


@pytest.mark.parametrize(
    ("group", "expected"),
    [
        ('[groups.g]\nhosts = ["pve-a", "nope"]\n', "group 'g': hosts[1]: no host 'nope' (known: "),
        (
            '[groups.g]\nhosts = ["pve-a", "pve-a"]\n',
            "group 'g': hosts[1]: 'pve-a' is already node 0",
        ),
        (
            '[groups.g]\nhosts = ["pve-a"]\n[groups.h]\nhosts = ["pve-c", "pve-a"]\n',
            "group 'h': hosts[1]: 'pve-a' is already node 0 of group 'g'; a host is in at most one",
        ),
        (
            '[groups.g]\nhosts = ["pve-a", "solo"]\n',
            "group 'g': hosts[1]: host 'solo' has no node_address",
        ),
        ('[groups.pve-a]\nhosts = ["pve-b"]\n', "group 'pve-a': also the name of [hosts.pve-a]"),
        (
            '[groups."g;reboot"]\nhosts = ["pve-a"]\n',
            "group 'g;reboot': 'g;reboot' is not a plain name",
        ),
        (
            '[groups.g]\nhosts = ["pve-a", "a b"]\n',
            "group 'g': hosts[1]: 'a b' is not a plain name",
        ),
        (
            '[groups.g]\nhosts = ["pve-a", 7]\n',
            "group 'g': hosts[1]: Input should be a valid string, got 7",
        ),
        ("[groups.g]\nhosts = []\n", "group 'g': hosts: List should have at least 1 item"),
        ('[groups.g]\nhosts = "pve-a"\n', "group 'g': hosts: Input should be a valid list"),
        ("[groups.g]\n", "group 'g': hosts: required key is missing"),
        (
            '[groups.g]\nhosts = ["pve-a"]\nrdzv_port = true\n',
            "group 'g': rdzv_port: Input should be a valid integer, got true",
        ),
        (
            '[groups.g]\nhosts = ["pve-a"]\nrdzv_port = "29400"\n',
            "group 'g': rdzv_port: Input should be a valid integer",
        ),
        (
            '[groups.g]\nhosts = ["pve-a"]\nrdzv_port = 29400.0\n',
            "group 'g': rdzv_port: Input should be a valid integer",
        ),
        (
            '[groups.g]\nhosts = ["pve-a"]\nrdzv_port = 0\n',
            "group 'g': rdzv_port: Input should be greater than or equal to 1",
        ),
        (
            '[groups.g]\nhosts = ["pve-a"]\nrdzv_port = 65536\n',
            "group 'g': rdzv_port: Input should be less than",
        ),
        (
            '[groups.g]\nhosts = ["pve-a"]\nmaster_addr = "x"\n',
            "group 'g': master_addr: unknown key",
        ),
    ],
)
def test_group_errors_are_one_line_naming_file_group_and_key(
    tmp_path: Path, group: str, expected: str
) -> None:
    path = tmp_path / "hosts.toml"
    with pytest.raises(InventoryError) as info:
        parse_inventory(HOSTS + group, path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: ") and expected in msg and "\n" not in msg, msg


def test_the_same_container_twice_in_a_group_is_refused(tmp_path: Path) -> None:
    text = HOSTS + (
        '[hosts.alias]\naddress = "pve-a.lan"\nctid = 200\nnode_address = "192.0.2.11"\n'
        '[groups.g]\nhosts = ["pve-a", "alias"]\n'
    )
    with pytest.raises(
        InventoryError,
        match=r"group 'g': hosts\[1\]: 'alias' is the same container as node 0 'pve-a' \(pve-a.lan:22 ctid 200\)",
    ):
        parse(text, tmp_path)
    # Another container on the same Proxmox node is a node of its own.
    other = text.replace(
        'ctid = 200\nnode_address = "192.0.2.11"', 'ctid = 201\nnode_address = "192.0.2.11"'
    )
    assert parse(other, tmp_path).groups["g"].hosts == ("pve-a", "alias")


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            'node_address = "10.0.0.1;reboot"',
            "node_address: '10.0.0.1;reboot' is not an IP address or a host name",
        ),
        ('node_address = "$(reboot)"', "node_address: '$(reboot)' is not"),
        ('node_address = "#{pane_pid}"', "node_address: '#{pane_pid}' is not"),
        ('node_address = "a b"', "node_address: 'a b' is not"),
        ('node_address = "-oProxyCommand=x"', "node_address: '-oProxyCommand=x' is not"),
        (
            'node_address = "[2001:db8::1]"',
            "node_address: '[2001:db8::1]': write an IPv6 address without brackets",
        ),
        (
            'node_address = "10.1.2"',
            "node_address: '10.1.2' is not an IP address, and a host name cannot end in digits",
        ),
        (
            'node_address = "0.0.0.0"',
            "node_address: '0.0.0.0' is not an address another container can reach",
        ),
        ('node_address = "::"', "node_address: '::' is not an address another container can reach"),
        ('node_address = "224.0.0.1"', "node_address: '224.0.0.1' is not an address"),
        ('node_address = "fe80::1%eth0"', "node_address: 'fe80::1%eth0': IPv6 scope ids"),
        ('node_address = "node_1.lan"', "node_address: 'node_1.lan' is not"),
        ('node_address = "a..b"', "node_address: 'a..b' is not"),
        ('node_address = ""', "node_address: '' is not"),
        ("node_address = 10", "node_address: Input should be a valid string, got 10"),
        (
            'nccl_socket_ifname = "eth0;reboot"',
            "nccl_socket_ifname: 'eth0;reboot' is not an interface name",
        ),
        (
            'nccl_socket_ifname = "eth0 eth1"',
            "nccl_socket_ifname: 'eth0 eth1' is not an interface name",
        ),
        (
            'nccl_socket_ifname = "eth0,"',
            "nccl_socket_ifname: 'eth0,': '' is not an interface name",
        ),
        ('nccl_socket_ifname = "^^eth0"', "nccl_socket_ifname: '^eth0' is not an interface name"),
        ('nccl_socket_ifname = "enp1s0f0np0long0"', "is not an interface name"),
        (
            'gloo_socket_ifname = "^eth0"',
            "gloo_socket_ifname: '^eth0': gloo takes exact interface names",
        ),
        ('gloo_socket_ifname = "eth0:1"', "gloo_socket_ifname: 'eth0:1' is not an interface name"),
        ('gloo_socket_ifname = "$(id)"', "gloo_socket_ifname: '$(id)' is not an interface name"),
        (
            'nccl_socket_ifname = "eth1"\nenv = { NCCL_SOCKET_IFNAME = "eth0" }',
            "nccl_socket_ifname: also set as env.NCCL_SOCKET_IFNAME; keep one of them",
        ),
    ],
)
def test_node_key_errors_name_host_and_key(tmp_path: Path, line: str, expected: str) -> None:
    path = tmp_path / "hosts.toml"
    with pytest.raises(InventoryError) as info:
        parse_inventory(f'[hosts.a]\naddress = "p"\nctid = 200\n{line}\n', path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: host 'a': ") and expected in msg and "\n" not in msg, msg


@pytest.mark.parametrize(
    "value", ["eth0", "=eth0", "^docker,lo", "^=docker0", "ib0,eth1", "br-train.42"]
)
def test_nccl_interface_syntax_accepted(tmp_path: Path, value: str) -> None:
    text = f'[hosts.a]\naddress = "p"\nctid = 200\nnccl_socket_ifname = "{value}"\n'
    assert parse(text, tmp_path).hosts["a"].nccl_socket_ifname == value


def test_node_address_is_per_container_not_a_default(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match=r"defaults\.node_address: unknown key"):
        parse('[defaults]\nnode_address = "10.0.0.1"\n', tmp_path)


def test_resolve_targets_accepts_hosts_and_groups_in_order(tmp_path: Path) -> None:
    inv = parse(HOSTS + '[groups.pair]\nhosts = ["pve-a", "pve-b"]\n', tmp_path)
    targets = inv.resolve_targets(["solo", "pair", "solo", "pve-c"])
    assert [t.name for t in targets] == ["solo", "pair", "pve-c"]
    assert isinstance(targets[0], HostConfig) and isinstance(targets[1], GroupConfig)
    assert inv.resolve_targets([]) == []


def test_resolve_targets_names_the_unknown_name_and_lists_hosts_and_groups(tmp_path: Path) -> None:
    path = tmp_path / "hosts.toml"
    inv = parse_inventory(HOSTS + '[groups.pair]\nhosts = ["pve-a", "pve-b"]\n', path)
    with pytest.raises(InventoryError) as info:
        inv.resolve_targets(["pair", "piar"])
    assert str(info.value) == (
        f"{path}: no host or group 'piar' (hosts: pve-a, pve-b, pve-c, solo; groups: pair)"
    )
    with pytest.raises(InventoryError, match=r"\(hosts: pve-a, pve-b, pve-c, solo; groups: none\)"):
        parse_inventory(HOSTS, path).resolve_targets(["x"])


def test_the_commented_group_example_in_hosts_toml_loads_when_uncommented() -> None:
    path = Path(__file__).resolve().parents[2] / "hosts.toml"
    text = path.read_text()
    marker = "# [hosts.pve-a]"
    assert marker in text
    example = marker + text.split(marker, 1)[1]
    lines = [line[2:] if line.startswith("# ") else "" for line in example.splitlines()]
    inv = parse_inventory(text + "\n" + "\n".join(lines) + "\n", path)
    pair = inv.groups["pair"]
    assert pair.hosts == ("pve-a", "pve-b") and pair.rdzv_port == 29400
    # documentation addresses only (RFC 5737), never a real private network
    assert all((node.node_address or "").startswith("192.0.2.") for node in pair.nodes)
