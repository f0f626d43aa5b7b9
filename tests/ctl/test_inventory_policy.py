"""Inventory keys of the in-container supervisor's restart policy (issue 12, item 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflashctl.config.inventory import HostConfig, InventoryError, parse_inventory
from trainer.config.policy import Policy
from trainer.supervise import _parser, parse_policy

HOST = '[hosts.a]\naddress = "pve"\nctid = 200\nknown_hosts = "/tmp/kh"\n'
PATH = Path("hosts.toml")


def host_with(extra: str, defaults: str = "") -> HostConfig:
    return parse_inventory(f"[defaults]\n{defaults}\n{HOST}{extra}\n", PATH).get("a")


def test_defaults_are_the_supervisor_defaults() -> None:
    assert host_with("").supervisor_policy() == Policy()


def test_host_keys_override_defaults_and_reach_the_supervisor_flags() -> None:
    host = host_with(
        'restart = "never"\nmax_restarts = 5\nrestart_window_s = 600\nrestart_backoff_s = 0.5\n'
        "stall_timeout_s = 30\nstartup_timeout_s = 90.5\nno_restart_exit_codes = [2, 3]",
        defaults="max_restarts = 1\nstall_timeout_s = 2000",
    )
    policy = host.supervisor_policy()
    assert policy.restart == "never" and policy.max_restarts == 5
    assert (policy.restart_window_s, policy.backoff_s) == (600.0, 0.5)
    assert (policy.stall_timeout_s, policy.startup_timeout_s) == (30.0, 90.5)
    assert policy.no_restart_exit_codes == frozenset({2, 3})
    # what `dflashctl start` puts in front of the trainer argv parses back to the same policy
    parser = _parser()
    assert parse_policy(parser, parser.parse_args(policy.cli_args())) == policy


def test_defaults_table_is_inherited() -> None:
    policy = host_with("", defaults="max_restarts = 0\nstall_timeout_s = 2400").supervisor_policy()
    assert policy.max_restarts == 0
    # without startup_timeout_s: the supervisor's rule, max(1800, stall)
    assert (policy.stall_timeout_s, policy.startup_timeout_s) == (2400.0, 2400.0)


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ('restart = "always"', "host 'a': restart: Input should be 'on-failure' or 'never'"),
        ("max_restarts = 2.0", "host 'a': max_restarts: Input should be a valid integer, got 2.0"),
        (
            "max_restarts = true",
            "host 'a': max_restarts: Input should be a valid integer, got true",
        ),
        ("max_restarts = -1", "host 'a': max_restarts: Input should be greater than or equal to 0"),
        ('restart_window_s = "1h"', "host 'a': restart_window_s: Input should be a valid number"),
        ("restart_window_s = 0", "host 'a': restart_window_s: Input should be greater than 0"),
        ("stall_timeout_s = inf", "host 'a': stall_timeout_s: Input should be a finite number"),
        ("restart_backoff_s = -1", "host 'a': restart_backoff_s: Input should be greater than 0"),
        (
            "no_restart_exit_codes = 2",
            "host 'a': no_restart_exit_codes: Input should be a valid list",
        ),
        (
            "no_restart_exit_codes = [0]",
            "host 'a': no_restart_exit_codes.0: 0 is not an exit status",
        ),
        (
            "no_restart_exit_codes = [256]",
            "no_restart_exit_codes.0: 256 is not an exit status 1-255",
        ),
        (
            'no_restart_exit_codes = ["2"]',
            "no_restart_exit_codes.0: Input should be a valid integer",
        ),
        (
            "stall_timeout_s = 100\nstartup_timeout_s = 50",
            "host 'a': startup_timeout_s: 50 is shorter than stall_timeout_s 100",
        ),
    ],
)
def test_bad_values_are_one_line_naming_file_host_and_key(extra: str, said: str) -> None:
    with pytest.raises(InventoryError) as err:
        host_with(extra)
    msg = str(err.value)
    assert msg.startswith("hosts.toml: ") and "\n" not in msg and said in msg, msg


def test_a_bad_default_names_the_defaults_key() -> None:
    with pytest.raises(InventoryError, match=r"^hosts\.toml: defaults\.restart: Input should be"):
        host_with("", defaults='restart = "sometimes"')
    with pytest.raises(InventoryError, match=r"host 'a': startup_timeout_s: 60 is shorter"):
        host_with("startup_timeout_s = 60")  # against the default stall timeout, 900 s
