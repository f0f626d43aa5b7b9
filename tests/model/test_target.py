"""Target capture: tiny target build, layer-id rule, index convention and early stop."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer.model.errors import TargetError
from trainer.model.speculative import greedy_generate
from trainer.model.target import TargetModel, default_target_layer_ids
from trainer.model.tiny import build_tiny_target


def test_tiny_target_is_seeded_and_saved_as_safetensors(tmp_path: Path, tiny_dir: Path) -> None:
    """Rebuilding with the same seed gives identical weights; another seed does not."""
    again = build_tiny_target(tmp_path / "again", seed=0)
    other = build_tiny_target(tmp_path / "other", seed=1)
    a, b, c = (load_file(d / "model.safetensors") for d in (tiny_dir, again, other))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(
        a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"]
    )
    assert a["model.embed_tokens.weight"].shape == (512, 64)
    assert "lm_head.weight" in a  # untied: the drafter borrows a real head


def test_tiny_cli_writes_a_loadable_model(tmp_path: Path) -> None:
    """`python -m trainer.model.tiny --out DIR` writes a directory TargetModel can load."""
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.model.tiny", "--out", str(out), "--num-layers", "4"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    target = TargetModel.load(out, num_draft_layers=1)
    assert target.num_layers == 4
    assert target.layer_ids == [2]


@pytest.mark.parametrize(
    ("total", "n", "expected"),
    [
        (36, 5, [1, 9, 17, 25, 33]),
        (64, 5, [1, 16, 31, 46, 61]),
        (8, 2, [1, 5]),
        (8, 1, [4]),
        # 23.5 -> 24 and 68.5 -> 68: half to even, as z-lab/SpecForge/SGLang (half up gives 69).
        (94, 5, [1, 24, 46, 68, 91]),
    ],
)
def test_default_layer_ids_follow_the_dflash_rule(total: int, n: int, expected: list[int]) -> None:
    """Uniform from layer 1 to L-3, rounded; one feature takes the middle layer."""
    assert default_target_layer_ids(total, n) == expected


def _zlab_build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    # The reference formula as z-lab/SpecForge write it (Python round(), half to even).
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def test_default_layer_ids_equal_the_reference_formula_for_every_depth() -> None:
    """Every (depth, features) pair a real model could have picks the reference's layers."""
    for total in range(4, 161):
        for n in range(1, min(total - 2, 12) + 1):
            assert default_target_layer_ids(total, n) == _zlab_build_target_layer_ids(total, n)


def test_greedy_generate_uses_the_kv_cache(target: TargetModel) -> None:
    """Cached greedy decoding equals re-running the whole sequence for every token.

    Under transformers 4.x a `cache=` keyword was silently ignored, so every step after the
    first saw only its own token and the output went wrong after the first token.
    """
    prompt = [5, 17, 42, 99, 3]
    ids = torch.tensor([prompt])
    want: list[int] = []
    with torch.no_grad():
        for _ in range(8):
            nxt = int(target.model(input_ids=ids).logits[0, -1].argmax())
            want.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    assert greedy_generate(target, prompt, 8).tokens == want


def test_capture_matches_hf_hidden_states_plus_one(target: TargetModel) -> None:
    """Layer id i is HF output_hidden_states[i + 1], for every layer whose entry is raw."""
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    attn[1, 18:] = 0  # right padding must not change the real positions
    with torch.no_grad():
        ref = target.model(
            input_ids=ids, attention_mask=attn, output_hidden_states=True
        ).hidden_states
    for layer_ids in ([1, 5], [0, 3, 6], [2]):
        probe = TargetModel(target.model, layer_ids)
        got = probe.capture(ids, attn)
        want = torch.cat([ref[i + 1] for i in layer_ids], dim=-1)
        assert got.shape == (2, 24, len(layer_ids) * 64)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1, :18], want[1, :18])


def test_capture_stops_after_the_deepest_layer(target: TargetModel) -> None:
    """Layers after max(layer_ids) and the LM head never run during capture."""
    ran: list[str] = []
    handles = [
        layer.register_forward_pre_hook(lambda *_a, i=i: ran.append(f"layer{i}"))
        for i, layer in enumerate(target.layers)
    ]
    handles.append(target.lm_head.register_forward_pre_hook(lambda *_a: ran.append("lm_head")))
    try:
        target.capture(torch.zeros(1, 4, dtype=torch.long))
    finally:
        for h in handles:
            h.remove()
    assert ran == [f"layer{i}" for i in range(6)]


def test_embedding_and_head_are_the_targets_own_frozen_modules(target: TargetModel) -> None:
    """No copies: the drafter must see exactly the target's tensors, with no gradient."""
    assert target.embed_tokens is target.model.get_input_embeddings()
    assert target.lm_head is target.model.get_output_embeddings()  # type: ignore[no-untyped-call]  # unannotated in transformers
    assert not any(p.requires_grad for p in target.model.parameters())
    assert not target.model.training
    assert (target.vocab_size, target.hidden_size, target.num_layers) == (512, 64, 8)
    assert target.dtype == torch.float32


def test_forward_with_capture_matches_capture_and_logits(target: TargetModel) -> None:
    """The full verify forward returns HF logits and the same features as capture()."""
    ids = torch.randint(0, 500, (1, 10), generator=torch.Generator().manual_seed(1))
    cache = target.new_cache()
    logits, feats = target.forward_with_capture(ids[:, :6], cache=cache)
    logits2, feats2 = target.forward_with_capture(ids[:, 6:], cache=cache)
    with torch.no_grad():
        ref_logits = target.model(input_ids=ids).logits
    torch.testing.assert_close(torch.cat([logits, logits2], 1), ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        torch.cat([feats, feats2], 1), target.capture(ids), atol=1e-5, rtol=1e-5
    )
    target.crop_cache(cache, 7)
    assert cache.get_seq_length() == 7
    # A fully accepted block crops nothing; transformers 4.x read crop(-0) as "keep none".
    target.crop_cache(cache, 7)
    assert cache.get_seq_length() == 7


@pytest.mark.parametrize(
    ("layer_ids", "fragment"), [([5, 1], "ascending"), ([1, 8], "out of range"), ([], "empty")]
)
def test_bad_layer_ids_are_rejected(
    target: TargetModel, layer_ids: list[int], fragment: str
) -> None:
    """Unsorted, duplicate or out-of-range ids fail loudly instead of reading wrong layers."""
    with pytest.raises(TargetError, match=fragment):
        TargetModel(target.model, layer_ids)


def test_missing_target_directory_names_the_path(tmp_path: Path) -> None:
    """A directory without config.json gives a one-line error naming it."""
    with pytest.raises(TargetError, match=str(tmp_path)):
        TargetModel.load(tmp_path, [1])
