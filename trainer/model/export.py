"""Export and load drafters in the z-lab directory layout.

    DIR/config.json        architectures=[DFlashDraftModel], model_type=qwen3, block_size,
                           num_target_layers, dflash_config{mask_token_id, target_layer_ids},
                           layer_types, plus the Qwen3 shape keys serving engines read
    DIR/model.safetensors  drafter weights only (fc, hidden_norm, layers.*, norm); the
                           target's embedding and LM head are NOT stored — they are borrowed
    DIR/dflash.py          self-contained modeling code (torch + transformers only), generated
                           from the project's drafter by `trainer.model.remote_code`; config's
                           auto_map points AutoModel at it, so
                           `AutoModel.from_pretrained(DIR, trust_remote_code=True)` works

`target_layer_ids` is always written explicitly: loaders that fall back to the default rule
read the wrong layers for most published checkpoints.

A run that reaches its end (the plan's or `[schedule] max_steps`) exports twice (`export_forms`):
`RUN/export/` in the fp32 master weights and `RUN/export-bf16/` in the training dtype
(`TRAINING_DTYPE`, what autocast computes in and what serving engines load), half the size;
`dtype` in config.json says which. `python -m trainer.export` does the same for any checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from trainer.config.validation import dotted, one_line
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.engine_fields import engine_fields, nest
from trainer.model.errors import ExportError
from trainer.model.export_files import CONFIG, WEIGHTS, bf16_dir, read_export_json
from trainer.model.remote_code import AUTO_MAP, MODELING_FILE, write_modeling_file
from trainer.model.target import TargetModel

TRAINING_DTYPE = torch.bfloat16


def drafter_config_json(cfg: DrafterConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The z-lab/SpecForge `config.json` for `cfg`: every key a serving engine reads, with the
    value training used (`engine_fields`), plus what transformers' AutoModel needs."""
    data = nest(engine_fields(cfg))
    data.update(
        {
            "initializer_range": cfg.initializer_range,
            # `dtype` is the current key; `torch_dtype` for loaders older than transformers 4.56.
            "dtype": str(dtype).removeprefix("torch."),
            "torch_dtype": str(dtype).removeprefix("torch."),
            "auto_map": dict(AUTO_MAP),
        }
    )
    return data


def config_from_json(data: dict[str, Any], source: str = CONFIG) -> DrafterConfig:
    """Inverse of `drafter_config_json`; errors name `source` and the offending key."""
    try:
        dflash = data["dflash_config"]
        rope = data.get("rope_parameters") or {}
        return DrafterConfig(
            hidden_size=data["hidden_size"],
            intermediate_size=data["intermediate_size"],
            num_layers=data["num_hidden_layers"],
            num_attention_heads=data["num_attention_heads"],
            num_key_value_heads=data["num_key_value_heads"],
            head_dim=data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"],
            vocab_size=data["vocab_size"],
            block_size=data["block_size"],
            mask_token_id=dflash["mask_token_id"],
            target_layer_ids=list(dflash["target_layer_ids"]),
            num_target_layers=data["num_target_layers"],
            rms_norm_eps=data.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", data.get("rope_theta", 1_000_000.0)),
            max_position_embeddings=data.get("max_position_embeddings", 40960),
            initializer_range=data.get("initializer_range", 0.02),
        )
    except KeyError as err:
        raise ExportError(f"{source}: missing key {err.args[0]!r}") from None
    except ValidationError as err:
        detail = one_line(err, key=lambda loc: dotted(loc, "config"))
        raise ExportError(f"{source}: {detail}") from None


def export_drafter(
    drafter: DFlashDrafter, out_dir: str | Path, *, dtype: torch.dtype | None = None
) -> Path:
    """Write `config.json`, `model.safetensors` (trainable weights only) and `dflash.py`;
    the weights in `dtype` (default: the drafter's own, fp32 in training).

    Files are written under temporary names and renamed, so a crash never leaves a
    half-written export that loads.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype or drafter.fc.weight.dtype
    state = {
        k: v.detach()
        .to(device="cpu", dtype=dtype if v.is_floating_point() else v.dtype)
        .contiguous()
        for k, v in drafter.state_dict().items()
    }
    tmp_w, tmp_c = out / (WEIGHTS + ".tmp"), out / (CONFIG + ".tmp")
    save_file(state, tmp_w, metadata={"format": "pt"})
    tmp_c.write_text(json.dumps(drafter_config_json(drafter.config, dtype), indent=2) + "\n")
    write_modeling_file(out, MODELING_FILE)
    tmp_w.replace(out / WEIGHTS)
    tmp_c.replace(out / CONFIG)  # last: a directory with a config is a complete export
    return out


def export_forms(drafter: DFlashDrafter, out_dir: str | Path) -> tuple[Path, Path]:
    """What a finished run writes for a drafter: `OUT` in its own (fp32 master) weights and
    `OUT-bf16` in the training dtype; returns both directories."""
    out = export_drafter(drafter, out_dir)
    return out, export_drafter(drafter, bf16_dir(out), dtype=TRAINING_DTYPE)


def read_drafter_config(path: str | Path) -> DrafterConfig:
    """The DrafterConfig of an export directory, without reading its weights."""
    return config_from_json(read_export_json(path), str(Path(path) / CONFIG))


def load_drafter(
    path: str | Path,
    *,
    target: TargetModel | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> DFlashDrafter:
    """Load an exported drafter; bind it to `target` (a TargetModel) when given.

    Binding checks that the target is the one the drafter was trained for: same embedding
    shape and the same capture layers.
    """
    root = Path(path)
    cfg_path, w_path = root / CONFIG, root / WEIGHTS
    cfg = read_drafter_config(root)
    drafter = DFlashDrafter(cfg)
    state = load_file(w_path)
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ExportError(f"{w_path}: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    saved_dtype = next(iter(state.values())).dtype
    drafter.to(device=device, dtype=dtype or saved_dtype)
    if target is not None:
        if list(target.layer_ids) != list(cfg.target_layer_ids):
            raise ExportError(
                f"{cfg_path}: drafter reads target layers {cfg.target_layer_ids}, "
                f"target captures {list(target.layer_ids)}"
            )
        if target.num_layers != cfg.num_target_layers:
            raise ExportError(
                f"{cfg_path}: drafter was trained on a {cfg.num_target_layers}-layer target, "
                f"this one has {target.num_layers}"
            )
        drafter.bind_target(target.embed_tokens, target.lm_head)
    drafter.eval()
    return drafter
