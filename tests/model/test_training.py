"""Learning end to end on CPU: the overfit gate and held-out acceptance after real training.

Both train with the real objective and measure acceptance with the real speculative loop,
so a label shift, a wrong mask or a wrong feature index makes them fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.model.helpers import MASK_ID, make_drafter
from trainer import eval as eval_cli
from trainer.model.export import export_drafter
from trainer.model.fit import (
    evaluate_full_blocks,
    fit,
    greedy_continuations,
    teacher_forced_streaks,
    walk_accept_lengths,
)
from trainer.model.mask_token import validate_mask_token_id
from trainer.model.speculative import greedy_generate, speculative_generate
from trainer.model.target import TargetModel

BLOCK = 8


@pytest.mark.timeout(120)
def test_overfitting_one_sequence_reaches_full_streak_and_tau_block_size(
    target: TargetModel, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SpecForge's gate: streak B-1 under teacher forcing, then tau = B in the real loop."""
    prompt = torch.randint(0, 500, (1, 8), generator=torch.Generator().manual_seed(11))
    rows = greedy_continuations(target, prompt, 56)
    validate_mask_token_id(MASK_ID, target.vocab_size, data_token_ids=rows[0].ids)
    drafter = make_drafter(target, block_size=BLOCK, num_layers=2)
    history = fit(
        drafter,
        target,
        rows,
        steps=400,
        lr=1e-2,
        batch_size=1,
        num_anchors=64,
        stop_acc=1.0,
        patience=20,
    )
    assert history[-1].acc == 1.0, f"no overfit after {len(history)} steps: {history[-1]}"
    assert evaluate_full_blocks(drafter, target, rows).streak == BLOCK - 1

    # 1 prefill token + 5 full blocks stay inside the 56 trained tokens.
    spec = speculative_generate(target, drafter, rows[0].ids[:8], 41)
    assert spec.accept_lengths == [BLOCK] * 5
    assert spec.tokens == rows[0].ids[8 : 8 + 41]

    # The same through the CLI, from an export.
    export_drafter(drafter, tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(rows[0].ids[:8]) + "\n")
    rc = eval_cli.main(
        [
            "--target",
            str(target.model.name_or_path),
            "--drafter",
            str(tmp_path / "drafter"),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "41",
            "--device",
            "cpu",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "tau=8.000" in out and "greedy_match=1/1" in out


@pytest.mark.timeout(180)
def test_training_on_target_generations_raises_held_out_tau(target: TargetModel) -> None:
    """After a short run on the target's own greedy text, held-out tau is well above 1.

    Also checks train/inference consistency: teacher-forced streaks from the training forward,
    walked the way serving advances, give exactly the real loop's acceptance lengths.
    """
    gen = torch.Generator().manual_seed(0)
    rows = greedy_continuations(target, torch.randint(0, 500, (1024, 8), generator=gen), 40)
    # B extra tokens so the teacher-forced walk has labels wherever the real loop drafts.
    held = greedy_continuations(target, torch.randint(0, 500, (8, 8), generator=gen), 40 + BLOCK)
    assert not any(MASK_ID in r.ids for r in rows)
    drafter = make_drafter(target, block_size=BLOCK, num_layers=2)
    before = [speculative_generate(target, drafter, r.ids[:8], 40) for r in held[:2]]
    assert all(s.tau == 1.0 for s in before)  # untrained: only the bonus token

    fit(drafter, target, rows, steps=150, lr=1e-2, batch_size=16, num_anchors=8)
    taus = []
    for r in held:
        spec = speculative_generate(target, drafter, r.ids[:8], 40)
        assert spec.tokens == r.ids[8:48], "speculative output must equal greedy output"
        # The training-path metric walked like serving reproduces the real acceptance.
        walk = walk_accept_lengths(teacher_forced_streaks(drafter, target, r), 8, 40)
        assert walk == spec.accept_lengths
        taus.append(spec.tau)
    mean_tau = sum(taus) / len(taus)
    assert mean_tau > 1.6, f"held-out tau {mean_tau:.2f} ({taus})"


def test_speculative_output_equals_greedy_and_respects_eos(target: TargetModel) -> None:
    """Any drafter (here an untrained one) yields exactly greedy output, stopping at eos."""
    drafter = make_drafter(target, block_size=4)
    prompt = torch.randint(0, 500, (6,), generator=torch.Generator().manual_seed(3)).tolist()
    greedy = greedy_generate(target, prompt, 20)
    spec = speculative_generate(target, drafter, prompt, 20)
    assert spec.tokens == greedy.tokens and len(spec.tokens) == 20
    eos = greedy.tokens[5]
    stop = greedy.tokens.index(eos)
    assert (
        speculative_generate(target, drafter, prompt, 20, eos_id=eos).tokens
        == greedy.tokens[: stop + 1]
    )
    assert greedy_generate(target, prompt, 20, eos_id=eos).tokens == greedy.tokens[: stop + 1]
