"""The drafter's fused context takes the captured features without an fp32 round trip under
autocast (issue 16 item 4): bf16 features of [R, S, F*H] were cast to the fp32 master weights'
dtype (a full fp32 copy) and autocast cast them back to bf16 for `fc`. The result is the same
bits; the copy is gone. Without autocast the cast to the weight's dtype stays."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.model.drafter import DFlashDrafter, DrafterConfig

ROWS, SEQ = 2, 24


def _drafter() -> DFlashDrafter:
    torch.manual_seed(0)
    cfg = DrafterConfig(
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
        mask_token_id=63,
        target_layer_ids=[0, 2, 3],
        num_target_layers=4,
        initializer_range=0.1,
    )
    return DFlashDrafter(cfg)


def _features(dtype: torch.dtype) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, SEQ, 3 * 32, generator=g).to(dtype)


class Outputs(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's mode is untyped
    """Every op's tensor outputs (shape and dtype), in order."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # as the class line
        self.made: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor):
                self.made.append((str(func), tuple(t.shape), t.dtype))
        return out


def _old_project_context(drafter: DFlashDrafter, features: Tensor) -> Tensor:
    """What project_context computed before: a cast to the weight's dtype first."""
    out: Tensor = drafter.hidden_norm(drafter.fc(features.to(drafter.fc.weight.dtype)))
    return out


def test_bf16_features_under_autocast_are_not_copied_to_fp32_and_give_the_same_bits() -> None:
    drafter = _drafter()
    feats = _features(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        old = _old_project_context(drafter, feats)
        with Outputs() as seen:
            new = drafter.project_context(feats)
    assert new.dtype == old.dtype == torch.bfloat16
    assert torch.equal(new, old)
    full = (ROWS, SEQ, 3 * 32)
    assert [m for m in seen.made if m[1] == full] == [], seen.made  # no copy of the features
    with torch.autocast("cpu", dtype=torch.bfloat16), Outputs() as before:
        _old_project_context(drafter, feats)
    assert (full, torch.float32) in [(m[1], m[2]) for m in before.made]  # what it used to make


def test_without_autocast_features_are_cast_to_the_weight_dtype_bit_for_bit() -> None:
    """fp32 features on fp32 weights: unchanged (no cast at all); bf16 features on fp32 weights
    without autocast: cast to fp32 as before; fp32 features on bf16 weights: cast to bf16."""
    drafter = _drafter()
    for dtype in (torch.float32, torch.bfloat16):
        feats = _features(dtype)
        new = drafter.project_context(feats)
        assert new.dtype == torch.float32
        assert torch.equal(new, _old_project_context(drafter, feats))
    drafter = drafter.to(torch.bfloat16)
    feats = _features(torch.float32)
    new = drafter.project_context(feats)
    assert new.dtype == torch.bfloat16
    assert torch.equal(new, _old_project_context(drafter, feats))


def test_float64_features_under_autocast_are_still_cast() -> None:
    """Autocast leaves float64 alone, so those still go through the weight's dtype."""
    drafter = _drafter()
    feats = _features(torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        new = drafter.project_context(feats)
        old = _old_project_context(drafter, feats)
    assert torch.equal(new, old)
