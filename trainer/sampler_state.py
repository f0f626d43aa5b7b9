"""The sampler's resume check, pure: the settings that shape its batches (the fingerprint
config), their sha256-16 fingerprint, and why a saved sampler state does not match them.

`trainer.sampler.BatchSampler` builds its config here and raises `SamplerError` with the line
`state_mismatch` returns; `trainer.pipeline.plan.BatchPlan` saves the version, the fingerprint
and the config in its state.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import numpy as np

STATE_VERSION = 1


def rows_digest(ids: np.ndarray) -> str:
    """sha256-16 of a row-id set (order-free): what a run records of its held-out rows."""
    return hashlib.sha256(np.sort(ids).astype("<i8").tobytes()).hexdigest()[:16]


def sampler_config(
    *,
    lengths: np.ndarray,
    strategy: str,
    boundaries: list[int],
    token_budget: int,
    max_batch: int,
    seed: int,
    world_size: int,
    pool_size: int,
    row_length: int | None,
    pack_open_rows: int,
    excluded: np.ndarray,
) -> dict[str, object]:
    """Every setting that shapes the batches (not the rank), with the lengths' digest.

    Keys a strategy ignores are None; the packed keys and the exclusion appear only when used,
    so the fingerprints of checkpoints from before they existed stay as they were.
    """
    digest = hashlib.sha256(lengths.astype("<i8").tobytes()).hexdigest()[:16]
    config: dict[str, object] = {
        "strategy": strategy,
        "boundaries": boundaries if strategy == "bucketed" else None,
        "token_budget": token_budget,
        "max_batch": max_batch,
        "seed": seed,
        "world_size": world_size,
        "pool_size": pool_size if strategy == "pool-sort" else None,
        "num_samples": len(lengths),
        "lengths_sha256": digest,
    }
    if row_length is not None:  # packed only: older fingerprints stay as they were
        config["row_length"] = row_length
        config["pack_open_rows"] = pack_open_rows
    if excluded.size:  # no exclusion: the fingerprint of every earlier checkpoint
        config["excluded"] = f"{excluded.size}:{rows_digest(excluded)}"
    return config


def config_fingerprint(config: Mapping[str, object]) -> str:
    """sha256-16 of a `sampler_config` (its JSON with sorted keys)."""
    blob = json.dumps(config, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def state_mismatch(state: Mapping[str, object], config: Mapping[str, object]) -> str | None:
    """Why a saved sampler state (`BatchPlan.state_dict`) was not made under `config`: one line
    naming the version, or each setting that differs; None when it matches."""
    if state.get("version") != STATE_VERSION:
        return f"sampler state version {state.get('version')!r} is not {STATE_VERSION}"
    if state.get("fingerprint") == config_fingerprint(config):
        return None
    saved = state.get("config")
    saved = saved if isinstance(saved, dict) else {}
    diffs = [
        f"{key} is {saved.get(key)!r} in the saved state but {now!r} now"
        for key, now in config.items()
        if saved.get(key) != now
    ]
    return (
        "sampler state does not match this data/config ("
        + ("; ".join(diffs) or "fingerprint differs")
        + "): resuming would replay different batches"
    )
