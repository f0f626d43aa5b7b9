"""flex_attention kernel options chosen from the device (issue 26, Deliver 4).

From captured device properties of H100, H200, B200 and RTX PRO 6000 (fixtures/
device_properties.json, each with its source), the chosen tiles fit the device's shared memory
by the estimate of `trainer.kernels.flex_options`; the estimate is held against what compiled
kernels were measured to need (fixtures/flex_shared_measured.json, each with its source): never
below a measured requirement, never rejecting tiles known to run. The option names are the
installed torch's, and docs/kernels.md shows the table the code produces.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.kernels.devices import SHARED_MEMORY_OPTIN, DeviceProps
from trainer.kernels.flex_options import (
    DTYPE_BYTES,
    SPARSE_TILE,
    BwdTiles,
    FwdTiles,
    NoFittingTiles,
    bwd_shared_bytes,
    choose,
    fwd_shared_bytes,
    markdown_table,
)
from trainer.model.attention import flex_kernel_options
from trainer.model.masks import TILE

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parents[2]
DEVICES: dict[str, dict[str, Any]] = json.loads((FIXTURES / "device_properties.json").read_text())[
    "devices"
]
MEASURED: list[dict[str, Any]] = json.loads((FIXTURES / "flex_shared_measured.json").read_text())[
    "points"
]


def _props(name: str) -> DeviceProps:
    raw = {k: v for k, v in DEVICES[name].items() if k != "source"}
    return DeviceProps(**raw)


@pytest.mark.parametrize("device", sorted(DEVICES))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_chosen_tiles_fit_the_captured_device(device: str, head_dim: int, dtype: str) -> None:
    props = _props(device)
    limit = props.shared_memory_per_block_optin
    o = choose(props.arch, limit, head_dim, head_dim, DTYPE_BYTES[dtype])
    assert o.fwd_bytes <= limit and o.bwd_bytes <= limit, o.describe()
    assert o.fwd_bytes == fwd_shared_bytes(o.fwd, head_dim, head_dim, DTYPE_BYTES[dtype])
    assert o.bwd_bytes == bwd_shared_bytes(o.bwd, head_dim, head_dim, DTYPE_BYTES[dtype])
    # inductor's constraints: every block divides the BlockMask's tile, N1 % M1, M2 % N2
    f, b = o.fwd, o.bwd
    for block in (f.block_m, f.block_n, b.block_m1, b.block_n1, b.block_m2, b.block_n2):
        assert SPARSE_TILE % block == 0 and SPARSE_TILE == TILE
    assert b.block_n1 % b.block_m1 == 0 and b.block_m2 % b.block_n2 == 0


def test_the_choice_follows_the_device() -> None:
    """At the Qwen3-8B drafter's head_dim (128, bf16) the Hopper tiles would not fit an
    RTX PRO 6000: the sm_120 choice is a different, smaller one that does."""
    h100, pro = _props("H100"), _props("RTX PRO 6000")
    big = choose(h100.arch, h100.shared_memory_per_block_optin, 128, 128, 2)
    small = choose(pro.arch, pro.shared_memory_per_block_optin, 128, 128, 2)
    assert big.bwd_bytes > pro.shared_memory_per_block_optin
    assert (small.fwd, small.bwd) != (big.fwd, big.bwd)
    assert small.bwd_bytes <= pro.shared_memory_per_block_optin < big.bwd_bytes


def test_no_fitting_tiles_is_an_error_naming_the_limit() -> None:
    with pytest.raises(NoFittingTiles, match="sm_120's 20,000 B per block at head_dim 128"):
        choose(120, 20_000, 128, 128, 2)


@pytest.mark.parametrize("point", MEASURED, ids=lambda p: f"{p['pass']}{p['tiles']}")
def test_estimate_against_measured_kernels(point: dict[str, Any]) -> None:
    qk, v, tiles = point["qk_dim"], point["v_dim"], point["tiles"]
    if point["pass"] == "fwd":
        est = fwd_shared_bytes(FwdTiles(*tiles), qk, v, 2)
    else:
        est = bwd_shared_bytes(BwdTiles(*tiles), qk, v, 2)
    if point["required"] is not None:
        assert est >= point["required"], (est, point["source"])
    elif point["runs"]:
        assert est <= point["limit"], (est, point["source"])
    else:
        assert est > point["limit"], (est, point["source"])


def test_option_names_are_flex_attentions() -> None:
    from torch.nn.attention.flex_attention import FlexKernelOptions

    known = set(typing.get_type_hints(FlexKernelOptions))
    options = choose(120, 101_376, 128, 128, 2).kernel_options()
    for key in options:
        assert key.split("_", 1)[1] in known, key


def test_cpu_tensors_get_no_kernel_options() -> None:
    q = torch.zeros(1, 2, 4, 16)
    assert flex_kernel_options(q, q) is None


def test_the_docs_table_is_the_codes() -> None:
    doc = (REPO / "docs" / "kernels.md").read_text()
    assert markdown_table() in doc
    for arch in SHARED_MEMORY_OPTIN:
        assert f"sm_{arch}" in doc
