"""Derive a run config from a bundled one: overlay nested tables, write the result as TOML.

For the tests and benchmarks that start from `configs/*.toml` and change a few keys. The writer
covers what configs hold (tables, strings, booleans, numbers, arrays); it is not a general TOML
writer. Torch-free.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

TomlTable = dict[str, Any]
"""A parsed TOML table (`tomllib.loads`): values are scalars, lists or nested tables."""


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> TomlTable:
    """`base` with `over` laid on top: nested tables merge key by key, anything else replaces.

    Neither argument is modified (the result shares nothing mutable with `base`).
    """
    out: TomlTable = copy.deepcopy(dict(base))
    for k, v in over.items():
        old = out.get(k)
        out[k] = merge(old, v) if isinstance(v, Mapping) and isinstance(old, Mapping) else v
    return out


def toml_value(value: object) -> str:
    """One TOML value: booleans, strings (a JSON string is a TOML basic string), arrays, numbers."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def dump_toml(table: Mapping[str, Any], prefix: str = "") -> str:
    """`table` as TOML text: its own keys first, then one `[section]` per nested table."""
    lines = [f"{k} = {toml_value(v)}" for k, v in table.items() if not isinstance(v, Mapping)]
    out = ([f"[{prefix}]"] if prefix else []) + lines
    for k, v in table.items():
        if isinstance(v, Mapping):
            out.append(dump_toml(v, f"{prefix}.{k}" if prefix else k))
    return "\n".join(out) + "\n"
