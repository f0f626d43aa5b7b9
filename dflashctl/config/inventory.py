"""hosts.toml -> validated pydantic models.

The inventory is the only place operator input enters remote command lines, so every name that
ends up in an argv (host names, tmux session, paths) is validated here against a strict
alphabet: nothing read from the file can smuggle shell or tmux syntax. The file holds references
(key paths, known_hosts paths), never secrets.

Groups (`[groups.NAME] hosts = [...]`) make several hosts one multi-node run: the list order is
the node rank, every member needs a `node_address` (where the other containers reach it), and a
host belongs to at most one group. Commands accept a group name wherever they take a host
(`Inventory.resolve_targets`), so group and host names share one namespace.
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from dflashctl.errors import UsageError
from trainer.config.policy import Policy
from trainer.config.validation import STRICT, NotUtf8Error, dotted, one_line, utf8_text

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Remote paths: absolute, no whitespace, quotes, globs or shell/tmux specials. Quoting would make
# any path safe for the shell, but tmux and humans reading `ps` deserve boring paths too.
REMOTE_PATH_RE = re.compile(r"^/[A-Za-z0-9_./@+-]*$")
# workdir gets releases/, current and run/ (checkpoints): never the root, a system directory or
# anything inside a kernel/tmpfs mount or the system's own files.
SYSTEM_DIRS = frozenset(
    {
        "/bin",
        "/boot",
        "/dev",
        "/etc",
        "/home",
        "/lib",
        "/lib32",
        "/lib64",
        "/libx32",
        "/media",
        "/mnt",
        "/opt",
        "/proc",
        "/root",
        "/run",
        "/sbin",
        "/srv",
        "/sys",
        "/tmp",
        "/usr",
        "/var",
        "/var/cache",
        "/var/lib",
        "/var/log",
        "/var/opt",
        "/var/spool",
        "/var/tmp",
    }
)
NOT_INSIDE = {
    "/proc": "the kernel's proc filesystem",
    "/sys": "the kernel's sysfs",
    "/dev": "device files",
    "/run": "a tmpfs, emptied at every boot",
    "/etc": "system configuration",
    "/boot": "the boot files",
    "/bin": "system programs",
    "/sbin": "system programs",
    "/lib": "system libraries",
    "/lib32": "system libraries",
    "/lib64": "system libraries",
    "/libx32": "system libraries",
    "/usr": "the system's own files",
}
# Interface names as Linux allows them in practice (IFNAMSIZ: 15 bytes), from a boring alphabet.
IFNAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,14}$")
# One DNS label (RFC 1123): letters, digits, inner hyphens, at most 63 characters.
DNS_LABEL_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
DEFAULT_RDZV_PORT = 29400
DEFAULT_RENDEZVOUS_TIMEOUT_S = 600.0
"""How long a group's rendezvous waits for every node (torchrun's join_timeout, its default)."""
DEFAULT_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
DEFAULT_INVENTORY = Path("hosts.toml")
DEFAULT_UNREACHABLE_ALERT_S = 300.0  # dflashctl watch: an outage this long is an alert


class InventoryError(UsageError):
    """A user-caused inventory problem; the message is one line naming file, host and key."""


def _invalid(reason: str) -> PydanticCustomError:
    """A validation error whose message is just `reason` (no "Value error, " in front)."""
    return PydanticCustomError("invalid_value", "{reason}", {"reason": reason})


def _check_name(value: str) -> str:
    if not NAME_RE.match(value):
        raise _invalid(f"{value!r} is not a plain name (allowed: letters, digits, '_', '.', '-')")
    return value


def _check_remote_path(value: str) -> str:
    if not REMOTE_PATH_RE.match(value) or ".." in PurePosixPath(value).parts:
        raise _invalid(
            f"{value!r} must be an absolute path of letters, digits and '_./@+-' without '..'"
        )
    return value.rstrip("/") or "/"


def _check_workdir(value: str) -> str:
    if value == "/" or value in SYSTEM_DIRS:
        raise _invalid(
            f"{value!r} is a system directory; give dflashctl a directory of its own "
            f"(e.g. /opt/dflash)"
        )
    for root, what in NOT_INSIDE.items():
        if value.startswith(root + "/"):
            raise _invalid(f"{value!r} is inside {root} ({what}); use e.g. /opt/dflash")
    return value


def _check_node_address(value: str) -> str:
    """An IP address (v4 or v6, without brackets) or a DNS-safe host name."""
    if "%" in value:
        raise _invalid(
            f"{value!r}: IPv6 scope ids (%iface) are not supported; use a routable address"
        )
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        ip = None
    if ip is not None:
        if ip.is_unspecified or ip.is_multicast:
            raise _invalid(f"{value!r} is not an address another container can reach")
        return str(ip)
    if value.startswith("["):
        raise _invalid(f"{value!r}: write an IPv6 address without brackets")
    labels = value.split(".")
    if len(value) > 253 or not all(DNS_LABEL_RE.match(label) for label in labels):
        raise _invalid(f"{value!r} is not an IP address or a host name (letters, digits, '-', '.')")
    if labels[-1].isdigit():
        # `10.1.2` is no host name, and the resolver would read it as the IP 10.1.0.2.
        raise _invalid(f"{value!r} is not an IP address, and a host name cannot end in digits")
    return value


def _check_ifname_list(value: str) -> list[str]:
    names = value.split(",")
    for name in names:
        if not IFNAME_RE.match(name):
            where = f"{value!r}: " if len(names) > 1 else ""
            raise _invalid(
                f"{where}{name!r} is not an interface name "
                f"(up to 15 of letters, digits, '_', '.', '-'; a list is comma-separated)"
            )
    return names


def _check_nccl_ifname(value: str) -> str:
    # NCCL's syntax: a comma list of name prefixes; '^' excludes them, '=' matches names exactly.
    _check_ifname_list(value.removeprefix("^").removeprefix("="))
    return value


def _check_gloo_ifname(value: str) -> str:
    # Gloo takes exact interface names only (a comma list), no prefixes or exclusions.
    if value[:1] in {"^", "="}:
        raise _invalid(f"{value!r}: gloo takes exact interface names; '^' and '=' are NCCL's")
    _check_ifname_list(value)
    return value


def _check_exit_code(value: int) -> int:
    if not 1 <= value <= 255:
        raise _invalid(
            f"{value} is not an exit status 1-255 (0 is a finished run: never restarted)"
        )
    return value


# Policy durations: at most 30 days (a typo of a few zeros must not disable the watchdog quietly).
MAX_POLICY_S = 30 * 86400.0
ExitCode = Annotated[int, AfterValidator(_check_exit_code)]
Name = Annotated[str, AfterValidator(_check_name)]
NodeAddress = Annotated[str, AfterValidator(_check_node_address)]
NcclIfname = Annotated[str, AfterValidator(_check_nccl_ifname)]
GlooIfname = Annotated[str, AfterValidator(_check_gloo_ifname)]
RemotePath = Annotated[str, AfterValidator(_check_remote_path)]
Workdir = Annotated[str, AfterValidator(_check_remote_path), AfterValidator(_check_workdir)]


class _Strict(BaseModel):
    # No coercion: `port = true`, `ctid = "200"` or `keep_releases = 2.0` are errors, not 1/200/2.
    model_config = ConfigDict(**STRICT, extra="forbid", frozen=True)


class HostSettings(_Strict):
    """Fields a host may set or inherit from [defaults]; None means "inherit"."""

    port: int | None = Field(default=None, ge=1, le=65535)
    user: Name | None = None
    identity_file: str | None = None
    use_agent: bool | None = None
    known_hosts: str | None = None
    workdir: Workdir | None = None
    python: RemotePath | None = None
    session: Name | None = None
    run_config: str | None = None
    data_store: RemotePath | None = None
    keep_releases: int | None = Field(default=None, ge=1, le=100)
    connect_timeout: float | None = Field(default=None, gt=0, le=3600)
    command_timeout: float | None = Field(default=None, gt=0, le=86400)
    max_channels: int | None = Field(default=None, ge=1, le=64)
    start_wait: float | None = Field(default=None, ge=0, le=86400)
    env: dict[str, str] | None = None
    # multi-node runs: the interface NCCL's bootstrap / gloo use (else they pick one themselves)
    nccl_socket_ifname: NcclIfname | None = None
    gloo_socket_ifname: GlooIfname | None = None
    # the in-container supervisor's restart policy (python -m trainer.supervise)
    restart: Literal["on-failure", "never"] | None = None
    max_restarts: int | None = Field(default=None, ge=0, le=1000)
    restart_window_s: float | None = Field(default=None, gt=0, le=MAX_POLICY_S)
    restart_backoff_s: float | None = Field(default=None, gt=0, le=MAX_POLICY_S)
    stall_timeout_s: float | None = Field(default=None, gt=0, le=MAX_POLICY_S)
    startup_timeout_s: float | None = Field(default=None, gt=0, le=MAX_POLICY_S)
    no_restart_exit_codes: list[ExitCode] | None = None
    # "before-start": start runs `python -m trainer.gate` first (once per release and config)
    gate: Literal["off", "before-start"] | None = None

    @field_validator("env")
    @classmethod
    def _env_keys(cls, env: dict[str, str] | None) -> dict[str, str] | None:
        if env is None:
            return env
        for key, value in env.items():
            if not ENV_KEY_RE.match(key):
                raise _invalid(f"env key {key!r} is not a valid variable name")
            if "\n" in value or "\0" in value:
                raise _invalid(f"env value of {key} contains a newline or NUL")
        return env


class HostEntry(HostSettings):
    """One [hosts.NAME] table: where the Proxmox node is and which container to drive."""

    address: str
    ctid: int = Field(ge=100, le=999_999_999)
    # the container's own address as the other containers of a group reach it
    node_address: NodeAddress | None = None

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        if not re.match(r"^[A-Za-z0-9_.:-]+$", value) or value.startswith("-"):
            raise _invalid(f"{value!r} is not a host name or IP address")
        return value


class HostConfig(_Strict):
    """A fully resolved host: defaults applied, local paths made absolute."""

    name: Name
    address: str
    port: int = 22
    user: Name = "root"
    identity_file: Path | None = None
    use_agent: bool = True
    known_hosts: Path
    ctid: int
    workdir: Workdir = "/opt/dflash"
    # unset in hosts.toml: WORKDIR/env/bin/python, the env `dflashctl setup` builds
    python: RemotePath = "/usr/bin/python3"
    session: Name = "dflash"
    run_config: Path | None = None
    data_store: RemotePath | None = None
    keep_releases: int = 5
    connect_timeout: float = 10.0
    command_timeout: float = 120.0
    # SSH channels open at once on the one connection (sshd's MaxSessions is 10 by default).
    max_channels: int = 8
    # seconds start/restart wait for the trainer's setup (or its exit); 0: do not wait
    start_wait: float = 120.0
    env: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_ENV))
    node_address: NodeAddress | None = None
    nccl_socket_ifname: NcclIfname | None = None
    gloo_socket_ifname: GlooIfname | None = None
    restart: Literal["on-failure", "never"] = "on-failure"
    max_restarts: int = Field(default=3, ge=0, le=1000)
    restart_window_s: float = Field(default=3600.0, gt=0, le=MAX_POLICY_S)
    restart_backoff_s: float = Field(default=10.0, gt=0, le=MAX_POLICY_S)
    stall_timeout_s: float = Field(default=900.0, gt=0, le=MAX_POLICY_S)
    # None: the larger of 1800 s and stall_timeout_s (the supervisor's own default)
    startup_timeout_s: float | None = Field(default=None, gt=0, le=MAX_POLICY_S)
    no_restart_exit_codes: list[ExitCode] = Field(default_factory=lambda: [2])
    gate: Literal["off", "before-start"] = "off"
    inventory: Path | None = None  # the file this host came from (for messages)

    @property
    def run_dir(self) -> str:
        return f"{self.workdir}/run"

    def supervisor_policy(self) -> Policy:
        """The restart policy `dflashctl start` hands the in-container supervisor."""
        return policy_of(self)

    @model_validator(mode="after")
    def _no_tmux_specials(self) -> HostConfig:
        # '.' and ':' separate window/pane in tmux targets; '=' exact match keeps prefixes safe,
        # but a session name containing them would still be parsed as a pane spec.
        if any(ch in self.session for ch in ".:"):
            raise _invalid(f"session {self.session!r} must not contain '.' or ':'")
        return self


POLICY_KEYS = (
    "restart",
    "max_restarts",
    "restart_window_s",
    "restart_backoff_s",
    "stall_timeout_s",
    "startup_timeout_s",
    "no_restart_exit_codes",
)
"""The restart policy's keys: a host's, or a group's (then counted for the whole group)."""


class GroupEntry(_Strict):
    """One [groups.NAME] table: hosts in node-rank order, the rendezvous port on node 0, how
    long a rendezvous waits for every node, and the group's own restart policy (unset keys:
    [defaults]' values, else a host's defaults; the nodes' own policy keys do not apply)."""

    hosts: list[Name] = Field(min_length=1)
    rdzv_port: int = Field(default=DEFAULT_RDZV_PORT, ge=1, le=65535)
    rendezvous_timeout_s: float = Field(default=DEFAULT_RENDEZVOUS_TIMEOUT_S, gt=0, le=86400)
    restart: Literal["on-failure", "never"] | None = None
    max_restarts: int | None = Field(default=None, ge=0, le=1000)
    restart_window_s: float | None = Field(default=None, gt=0, le=MAX_POLICY_S)
    restart_backoff_s: float | None = Field(default=None, gt=0, le=MAX_POLICY_S)
    stall_timeout_s: float | None = Field(default=None, gt=0, le=MAX_POLICY_S)
    startup_timeout_s: float | None = Field(default=None, gt=0, le=MAX_POLICY_S)
    no_restart_exit_codes: list[ExitCode] | None = None


class GroupConfig(_Strict):
    """A resolved group: its hosts (every one with a node_address), node 0 first, and its one
    restart policy (what every node's supervisor counts, for the group)."""

    name: Name
    nodes: tuple[HostConfig, ...]
    rdzv_port: int = DEFAULT_RDZV_PORT
    rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S
    restart: Literal["on-failure", "never"] = "on-failure"
    max_restarts: int = 3
    restart_window_s: float = 3600.0
    restart_backoff_s: float = 10.0
    stall_timeout_s: float = 900.0
    startup_timeout_s: float | None = None
    no_restart_exit_codes: list[int] = Field(default_factory=lambda: [2])
    inventory: Path | None = None

    def supervisor_policy(self) -> Policy:
        """The policy every node's supervisor gets (the same flags on every node)."""
        return policy_of(self)

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(node.name for node in self.nodes)

    @property
    def nnodes(self) -> int:
        return len(self.nodes)


def policy_of(c: HostConfig | GroupConfig) -> Policy:
    """The supervisor's Policy from a host's or a group's resolved keys."""
    base = Policy()
    startup = c.startup_timeout_s
    if startup is None:
        startup = max(base.startup_timeout_s, c.stall_timeout_s)
    return Policy(
        restart=c.restart,
        max_restarts=c.max_restarts,
        restart_window_s=c.restart_window_s,
        stall_timeout_s=c.stall_timeout_s,
        startup_timeout_s=startup,
        no_restart_exit_codes=frozenset(c.no_restart_exit_codes),
        backoff_s=c.restart_backoff_s,
        backoff_max_s=max(base.backoff_max_s, c.restart_backoff_s),
    )


class Inventory(_Strict):
    path: Path
    hosts: dict[str, HostConfig]
    groups: dict[str, GroupConfig] = Field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    # `dflashctl watch`: the file of notification URLs (resolved against hosts.toml's folder;
    # the URLs are secrets and live only there) and how long a host is unreachable before that
    # is an alert.
    notify_urls_file: Path | None = None
    unreachable_alert_s: float = DEFAULT_UNREACHABLE_ALERT_S

    def get(self, name: str) -> HostConfig:
        """Look a host up, failing with a message that lists the known names."""
        try:
            return self.hosts[name]
        except KeyError:
            known = ", ".join(sorted(self.hosts)) or "none"
            raise InventoryError(f"{self.path}: no host {name!r} (known: {known})") from None

    def group_of(self, host: str) -> GroupConfig | None:
        """The group `host` is a node of, if any (a host is in at most one)."""
        return next((g for g in self.groups.values() if host in g.hosts), None)

    def resolve_targets(self, names: Sequence[str]) -> list[HostConfig | GroupConfig]:
        """Hosts and groups by name, in the order given (a repeated name counts once).

        Host and group names never collide (load refuses that), so each name means one thing.
        """
        targets: list[HostConfig | GroupConfig] = []
        seen: set[str] = set()
        for name in names:
            if name in seen:
                continue
            seen.add(name)
            if name in self.hosts:
                targets.append(self.hosts[name])
            elif name in self.groups:
                targets.append(self.groups[name])
            else:
                hosts = ", ".join(sorted(self.hosts)) or "none"
                groups = ", ".join(sorted(self.groups)) or "none"
                raise InventoryError(
                    f"{self.path}: no host or group {name!r} (hosts: {hosts}; groups: {groups})"
                )
        return targets


class _File(_Strict):
    # top-level keys (before any table): the watch's, fleet-wide
    notify_urls_file: str | None = Field(default=None, min_length=1)
    unreachable_alert_s: float = Field(default=DEFAULT_UNREACHABLE_ALERT_S, gt=0, le=7 * 86400)
    defaults: HostSettings = HostSettings()
    hosts: dict[str, HostEntry] = Field(default_factory=dict)
    groups: dict[str, GroupEntry] = Field(default_factory=dict)


def user_config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "dflashctl"


def default_inventory_path() -> Path:
    """./hosts.toml if present, else the user config dir's hosts.toml."""
    if DEFAULT_INVENTORY.exists():
        return DEFAULT_INVENTORY
    return user_config_dir() / "hosts.toml"


def _inventory_key(loc: Sequence[int | str]) -> str:
    """`host 'a': ctid` for a host's key, `group 'g': hosts[1]` for a group's, dotted elsewhere."""
    if len(loc) >= 2 and loc[0] == "hosts":
        return f"host {str(loc[1])!r}: {dotted(loc[2:], '(table)')}"
    if len(loc) >= 2 and loc[0] == "groups":
        key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[2:]).lstrip(".")
        return f"group {str(loc[1])!r}: {key or '(table)'}"
    return dotted(loc, "(table)")


def _format_error(path: Path, err: ValidationError) -> str:
    return f"{path}: {one_line(err, key=_inventory_key)}"


def _resolve_local(base: Path, value: str | None) -> Path | None:
    if value is None:
        return None
    p = Path(os.path.expanduser(value))
    return p if p.is_absolute() else (base / p).resolve()


def _merge(path: Path, name: str, entry: HostEntry, defaults: HostSettings) -> HostConfig:
    base = path.parent.resolve()
    merged: dict[str, Any] = {}
    for field in HostSettings.model_fields:
        value = getattr(entry, field)
        merged[field] = value if value is not None else getattr(defaults, field)
    env = dict(DEFAULT_ENV)
    env.update(defaults.env or {})
    env.update(entry.env or {})
    known = _resolve_local(base, merged["known_hosts"]) or (user_config_dir() / "known_hosts")
    resolved: dict[str, Any] = {
        k: v for k, v in merged.items() if v is not None and k not in {"env", "known_hosts"}
    }
    if merged["python"] is None:  # the env `dflashctl setup` builds
        workdir = merged["workdir"] or HostConfig.model_fields["workdir"].default
        resolved["python"] = f"{workdir}/env/bin/python"
    resolved.update(
        name=name,
        address=entry.address,
        ctid=entry.ctid,
        env=env,
        known_hosts=known,
        identity_file=_resolve_local(base, merged["identity_file"]),
        run_config=_resolve_local(base, merged["run_config"]),
        node_address=entry.node_address,
        inventory=path,
    )
    for key in ("nccl_socket_ifname", "gloo_socket_ifname"):
        if merged[key] is not None and key.upper() in env:
            # Two sources for one variable: which one wins would be a guess.
            raise InventoryError(
                f"{path}: host {name!r}: {key}: also set as env.{key.upper()}; keep one of them"
            )
    stall = merged["stall_timeout_s"] or HostConfig.model_fields["stall_timeout_s"].default
    if merged["startup_timeout_s"] is not None and merged["startup_timeout_s"] < stall:
        raise InventoryError(
            f"{path}: host {name!r}: startup_timeout_s: {merged['startup_timeout_s']:g} is "
            f"shorter than stall_timeout_s {stall:g} (the limit before the first step is the "
            f"longer one)"
        )
    try:
        return HostConfig(**resolved)
    except ValidationError as err:
        detail = one_line(err, key=lambda loc: dotted(loc, "(host)"))
        raise InventoryError(f"{path}: host {name!r}: {detail}") from None


def parse_inventory(text: str, path: Path) -> Inventory:
    """Parse inventory text (pure; `path` is used for messages and relative paths)."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise InventoryError(f"{path}: not valid TOML: {err}") from None
    try:
        parsed = _File.model_validate(raw)
    except ValidationError as err:
        raise InventoryError(_format_error(path, err)) from None
    hosts: dict[str, HostConfig] = {}
    for name, entry in parsed.hosts.items():
        try:
            _check_name(name)
        except ValueError as err:
            raise InventoryError(f"{path}: host {name!r}: {err}") from None
        hosts[name] = _merge(path, name, entry, parsed.defaults)
    groups = _groups(path, parsed.groups, hosts, parsed.defaults)
    return Inventory(
        path=path,
        hosts=hosts,
        groups=groups,
        notify_urls_file=_resolve_local(path.parent.resolve(), parsed.notify_urls_file),
        unreachable_alert_s=parsed.unreachable_alert_s,
    )


def _groups(
    path: Path,
    entries: dict[str, GroupEntry],
    hosts: dict[str, HostConfig],
    defaults: HostSettings | None = None,
) -> dict[str, GroupConfig]:
    """Resolve [groups.*] against the hosts; each rule's error names the group and the key.

    A host is a node of at most one group, checked here rather than "at most one *running*
    group" at start: a host has one tmux session and one run directory, so two groups sharing
    it could never both run, and a rule the file alone decides fails at load, on the laptop,
    with the key named, instead of on a live node halfway through a start.
    """
    groups: dict[str, GroupConfig] = {}
    member: dict[str, tuple[str, int]] = {}  # host -> (group, node rank)
    for gname, entry in entries.items():
        where = f"{path}: group {gname!r}"
        try:
            _check_name(gname)
        except ValueError as err:
            raise InventoryError(f"{where}: {err}") from None
        if gname in hosts:
            raise InventoryError(
                f"{where}: also the name of [hosts.{gname}]; commands take either, so a group "
                f"needs a name of its own"
            )
        containers: dict[tuple[str, int, int], int] = {}
        for rank, hname in enumerate(entry.hosts):
            key = f"{where}: hosts[{rank}]"
            host = hosts.get(hname)
            if host is None:
                known = ", ".join(sorted(hosts)) or "none"
                raise InventoryError(f"{key}: no host {hname!r} (known: {known})")
            if hname in member:
                other, at = member[hname]
                if other == gname:
                    raise InventoryError(f"{key}: {hname!r} is already node {at} of this group")
                raise InventoryError(
                    f"{key}: {hname!r} is already node {at} of group {other!r}; a host is in "
                    f"at most one group"
                )
            container = (host.address, host.port, host.ctid)
            if container in containers:
                first = entry.hosts[containers[container]]
                raise InventoryError(
                    f"{key}: {hname!r} is the same container as node {containers[container]} "
                    f"{first!r} ({host.address}:{host.port} ctid {host.ctid})"
                )
            if host.node_address is None:
                raise InventoryError(
                    f"{key}: host {hname!r} has no node_address (the address the other nodes "
                    f"reach its container at); set it in [hosts.{hname}]"
                )
            member[hname] = (gname, rank)
            containers[container] = rank
        policy = _group_policy(where, entry, defaults or HostSettings())
        groups[gname] = GroupConfig(
            name=gname,
            nodes=tuple(hosts[h] for h in entry.hosts),
            rdzv_port=entry.rdzv_port,
            rendezvous_timeout_s=entry.rendezvous_timeout_s,
            inventory=path,
            **policy,
        )
    return groups


def _group_policy(where: str, entry: GroupEntry, defaults: HostSettings) -> dict[str, Any]:
    """The group's policy keys: its own, else [defaults]', else a host's defaults."""
    got: dict[str, Any] = {}
    for key in POLICY_KEYS:
        value = getattr(entry, key)
        got[key] = value if value is not None else getattr(defaults, key)
    got = {k: v for k, v in got.items() if v is not None}
    stall = got.get("stall_timeout_s", GroupConfig.model_fields["stall_timeout_s"].default)
    startup = got.get("startup_timeout_s")
    if startup is not None and startup < stall:
        raise InventoryError(
            f"{where}: startup_timeout_s: {startup:g} is shorter than stall_timeout_s "
            f"{stall:g} (the limit before the first step is the longer one)"
        )
    return got


def load_inventory(path: Path | str | None = None) -> Inventory:
    """Read and validate hosts.toml; every failure is an InventoryError naming the file."""
    p = Path(path) if path is not None else default_inventory_path()
    try:
        text = utf8_text(p.read_bytes())
    except FileNotFoundError:
        raise InventoryError(f"{p}: inventory not found (pass --hosts FILE)") from None
    except OSError as err:
        raise InventoryError(f"{p}: cannot read inventory: {err.strerror}") from None
    except NotUtf8Error as err:
        raise InventoryError(f"{p}: {err}; save the inventory as UTF-8") from None
    inv = parse_inventory(text, p)
    if p.stat().st_mode & 0o022:
        # Whoever can write the inventory chooses which host and key dflashctl trusts.
        warning = f"{p}: writable by group or others; restrict it (chmod go-w {p})"
        inv = inv.model_copy(update={"warnings": (*inv.warnings, warning)})
    return inv


def local_host(name: str, workdir: Path, *, python: str, session: str = "dflash") -> HostConfig:
    """A host whose 'container' is this machine (LocalTransport): demo and local tests."""
    try:
        return HostConfig(
            name=name,
            address="localhost",
            ctid=100,
            workdir=str(workdir.resolve()),
            python=python,
            session=session,
            known_hosts=user_config_dir() / "known_hosts",
        )
    except ValidationError as err:
        raise InventoryError(f"local host {name!r}: {one_line(err)}") from None
