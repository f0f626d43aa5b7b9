"""The ranks a group node launches for a config (torchrun's `--nproc-per-node` from
`dflashctl start GROUP`): the drafter ranks, plus one rank per target device when
`topology.targets = "shared"` (M:N), the count the trainer's launch check asks for."""

from __future__ import annotations

import tomllib

import pytest

from dflashctl.config.runconfig import drafter_device_count
from trainer.config import TrainConfig
from trainer.pipeline.assets import UserError
from trainer.pipeline.distributed import layout_from_env

BASE = """seed = 0
[data]
store = "/data/store"
[model]
target_dir = "/models/target"
mask_token_id = 7
[batching]
strategy = "bucketed"
boundaries = [1, 65]
token_budget = 256
[optimizer]
lr = 1e-4
[schedule]
epochs = 1
"""


def _topology(targets: str, n_targets: int, n_drafters: int) -> str:
    tgt = ", ".join(f'"cuda:{i}"' for i in range(n_targets))
    dft = ", ".join(f'"cuda:{n_targets + i}"' for i in range(n_drafters))
    return f'{BASE}[topology]\ntargets = "{targets}"\ntarget_devices = [{tgt}]\n' + (
        f"drafter_devices = [{dft}]\n"
    )


@pytest.mark.parametrize(
    ("targets", "n_targets", "n_drafters", "nproc"),
    [
        ("per_rank", 6, 1, 1),  # the seed's 6x1: target threads inside the one drafter rank
        ("per_rank", 4, 4, 4),
        ("shared", 1, 6, 7),  # configs/qwen3-8b-1x6.toml's shape
        ("shared", 2, 6, 8),
        ("shared", 1, 1, 2),
    ],
)
def test_shared_targets_are_ranks_of_their_own(
    targets: str, n_targets: int, n_drafters: int, nproc: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = _topology(targets, n_targets, n_drafters)
    assert drafter_device_count(text) == nproc
    if targets == "shared":  # the trainer's launch check takes exactly that many per node
        topo = TrainConfig.from_dict(tomllib.loads(text)).topology
        monkeypatch.setenv("WORLD_SIZE", str(2 * nproc))  # two such nodes
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(nproc))
        layout = layout_from_env(topo)
        assert (layout.n, layout.m, layout.nnodes) == (n_drafters, n_targets, 2)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(n_drafters))  # the count it used to pass
        monkeypatch.setenv("WORLD_SIZE", str(n_drafters))
        with pytest.raises(UserError, match=f"--nproc-per-node {nproc} "):
            layout_from_env(topo)
