"""Exports of the gate's drafter that a serving engine reads unlike the training: the faults
the served evaluation must catch (tests/serving/test_negative_controls.py).

- layer ids - 1: config.json's target_layer_ids one lower, so vLLM (which adds 1) captures
  the output of layer i - 1: what an engine that reads the ids as its own capture points
  (before layer i, no + 1) feeds the drafter, the HF/engine convention slip;
- mask token: another embedding row in the masked block slots;
- anchor-first: a drafter whose slot k predicts token a + k + 1 (DeepSpec's layout,
  `sample_from_anchor = true`), served by an engine that reads slot k as token a + k
  (sglang#40144). It is trained here on the gate's sample, one row per anchor a with token
  a + 1 cut out, so the objective's slot-k label is x[a + k + 1] while the block still holds
  x[a] and sees the true features of x[:a].
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tests.serving.engine import GATE_RESPONSE_TOKENS, GateRun

ANCHOR_FIRST_STEPS = 300


def edited(export: Path, out: Path, edit: dict[str, Any]) -> Path:
    """A copy of `export` whose config.json has `edit` merged into dflash_config."""
    shutil.copytree(export, out)
    config = json.loads((out / "config.json").read_text())
    config["dflash_config"].update(edit)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def layer_ids_shifted(export: Path, out: Path, by: int) -> Path:
    ids = json.loads((export / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    return edited(export, out, {"target_layer_ids": [i + by for i in ids]})


def mask_token_changed(export: Path, out: Path, mask_id: int) -> Path:
    return edited(export, out, {"mask_token_id": mask_id})


def anchor_first(gate: GateRun, target_dir: Path, out: Path) -> Path:
    """Train the anchor-first drafter on the gate's sample and export it (declaring itself:
    sample_from_anchor = true, which vLLM 0.32 does not read)."""
    import torch

    from trainer.config import TrainConfig
    from trainer.model.export import export_drafter
    from trainer.model.fit import greedy_continuations, lr_at
    from trainer.model.masks import Anchors
    from trainer.model.objective import dflash_objective
    from trainer.model.target import TargetModel
    from trainer.pipeline import assets

    cfg = TrainConfig.load(gate.config)
    hf = assets.target_hf_config(target_dir)
    dcfg = assets.drafter_config(cfg, hf, assets.layer_ids_for(cfg, hf))
    target = TargetModel.load(target_dir, dcfg.target_layer_ids, device="cpu")
    prompt = json.loads(gate.prompts.read_text().splitlines()[0])["input_ids"]
    x = torch.tensor(
        greedy_continuations(target, torch.tensor([prompt]), GATE_RESPONSE_TOKENS)[0].ids
    )
    bsz, n = dcfg.block_size, len(x)
    feats = target.capture(x[None], torch.ones(1, n, dtype=torch.long))
    firsts = list(range(len(prompt), n - bsz))  # x[a + bsz] exists: every slot has a label
    rows = torch.stack([torch.cat([x[: a + 1], x[a + 2 :], x[-1:]]) for a in firsts])
    loss_mask = torch.zeros_like(rows)
    for r, a in enumerate(firsts):
        loss_mask[r, a : a + bsz] = 1
    anchors = Anchors(torch.tensor(firsts)[:, None], torch.ones(len(firsts), 1, dtype=torch.bool))
    drafter = assets.build_drafter(
        dcfg, (target.embed_tokens, target.lm_head), torch.device("cpu"), 0
    )
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    acc, step = 0.0, 0
    for step in range(ANCHOR_FIRST_STEPS):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, ANCHOR_FIRST_STEPS, 3e-3)
        res = dflash_objective(
            drafter,
            target,
            rows,
            loss_mask,
            torch.ones_like(rows),
            feats.expand(len(firsts), -1, -1),
            anchors=anchors,
        )
        opt.zero_grad(set_to_none=True)
        torch.autograd.backward(res.loss_sum / res.weight_sum)
        opt.step()
        acc = float(res.n_correct) / max(1, int(res.n_pred))
        if acc == 1.0:
            break
    assert acc == 1.0, f"the anchor-first drafter did not memorise its sample (accuracy {acc:.3f})"
    print(f"anchor-first drafter: memorised in {step + 1} steps")
    export_drafter(drafter.eval(), out)
    return edited(out, out.with_name(out.name + "-declared"), {"sample_from_anchor": True})
