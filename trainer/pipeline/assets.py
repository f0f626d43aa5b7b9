"""Everything the run needs before the first batch: data, target, drafter, borrowed head.

User-caused problems (missing store, bad target dir, mask id outside the vocabulary, impossible
bucket plan) raise `UserError` with one line naming the file or key; the CLI exits 2 on them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError
from safetensors import safe_open
from torch import nn

from trainer.config import TrainConfig
from trainer.config.validation import dotted, one_line
from trainer.errors import TrainerError
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.target import default_target_layer_ids


class UserError(TrainerError):
    """A problem the user can fix (config, data, checkpoint); one line, exit status 2."""


def ensure_store(cfg: TrainConfig) -> Path:
    """The store directory; built from `data.synthetic` when absent (demo and CI runs)."""
    path = cfg.resolve(cfg.data.store)
    if (path / "manifest.json").is_file() or cfg.data.synthetic is None:
        return path
    from trainer.data.errors import InputError
    from trainer.data.synth import synth_store

    syn = cfg.data.synthetic
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        synth_store(
            path,
            lengths_from=_scaled_lengths(syn.lengths_from, syn.length_scale, syn.seed, path),
            vocab_size=_vocab_hint(cfg),
            rows=syn.rows,
            max_length=syn.max_length,
            seed=syn.seed,
            mask_token_id=cfg.model.mask_token_id,
        )
    except InputError as exc:
        raise UserError(f"data.synthetic: {exc}") from None
    except FileExistsError:
        pass  # another rank or run published it first: same content
    return path


def _scaled_lengths(source: str, scale: float, seed: int, store: Path) -> str:
    """`source` as-is, or its lengths divided by `scale` saved next to the store (.npy)."""
    if scale == 1.0:
        return source
    from trainer.data.lengths import LengthsError, load_lengths, seed_shaped_lengths

    try:
        base = seed_shaped_lengths(seed=seed) if source == "seed-shaped" else load_lengths(source)
    except LengthsError as exc:
        raise UserError(f"data.synthetic.lengths_from: {exc}") from None
    out = store.parent / f"{store.name}.lengths-div{scale:g}.npy"
    tmp = out.with_name(f".{out.name}.{os.getpid()}.npy")  # another node may write it too
    np.save(tmp, np.maximum(1, np.rint(base / scale)).astype(np.int64))
    os.replace(tmp, out)
    return str(out)


def _vocab_hint(cfg: TrainConfig) -> int:
    if cfg.model.tiny_target is not None:
        return cfg.model.tiny_target.vocab_size
    config = cfg.resolve(cfg.model.target_dir) / "config.json"
    try:
        return int(json.loads(config.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{config}: cannot read vocab_size: {exc}") from None


def ensure_target(cfg: TrainConfig) -> Path:
    """The target directory; a tiny random Qwen3 is built there when configured and absent.

    Built in a temporary directory beside it and published by one rename: another process
    (a node sharing the directory, an M:N target rank) never reads half a target, and when two
    build it at once the first rename wins (the builds are bit-identical)."""
    path = cfg.resolve(cfg.model.target_dir)
    if (path / "config.json").is_file():
        return path
    if cfg.model.tiny_target is None:
        raise UserError(f"{path}: model.target_dir has no config.json (not a model directory)")
    from trainer.model.tiny import write_tiny_target

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        write_tiny_target(tmp, cfg.model.tiny_target)
        os.rename(tmp, path)  # replaces an empty directory; fails on a non-empty one
    except OSError:
        if not (path / "config.json").is_file():
            raise UserError(
                f"{path}: model.target_dir exists without a config.json; remove it or point "
                "model.target_dir elsewhere"
            ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def target_hf_config(target_dir: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(target_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(
            f"{target_dir}: cannot read the target config: {exc}".splitlines()[0]
        ) from None


def layer_ids_for(cfg: TrainConfig, hf: Any) -> list[int]:
    if cfg.model.target_layer_ids is not None:
        return list(cfg.model.target_layer_ids)
    return default_target_layer_ids(hf.num_hidden_layers, cfg.model.drafter.num_layers)


def drafter_config(cfg: TrainConfig, hf: Any, layer_ids: list[int]) -> DrafterConfig:
    """DrafterConfig from the target's HF config and the run's drafter shape."""
    shape = cfg.model.drafter
    shim = SimpleNamespace(
        config=hf,
        hidden_size=hf.hidden_size,
        vocab_size=hf.vocab_size,
        layer_ids=layer_ids,
        num_layers=hf.num_hidden_layers,
    )
    overrides = {
        k: v
        for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
        if (v := getattr(shape, k)) is not None
    }
    try:
        return DrafterConfig.from_target(
            shim,
            mask_token_id=cfg.model.mask_token_id,
            num_layers=shape.num_layers,
            block_size=shape.block_size,
            **overrides,
        )
    except ValidationError as exc:
        raise UserError(f"model: {one_line(exc, key=lambda loc: dotted(loc, 'model'))}") from None


def _tensor(target_dir: Path, names: tuple[str, ...]) -> torch.Tensor | None:
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        for name in names:
            if name in weight_map:
                with safe_open(target_dir / weight_map[name], framework="pt") as fh:
                    found: torch.Tensor = fh.get_tensor(name)
                    return found
        return None
    single = target_dir / "model.safetensors"
    if not single.is_file():
        raise UserError(f"{target_dir}: no model.safetensors or index (safetensors required)")
    with safe_open(single, framework="pt") as fh:
        keys = set(fh.keys())
        for name in names:
            if name in keys:
                tensor: torch.Tensor = fh.get_tensor(name)
                return tensor
    return None


def load_borrowed(
    target_dir: Path, hf: Any, device: torch.device, dtype: torch.dtype
) -> tuple[nn.Embedding, nn.Linear]:
    """The target's frozen embedding and LM head on the drafter's device, read by tensor name
    from the safetensors files (the rest of the target never loads there)."""
    embed_w = _tensor(target_dir, ("model.embed_tokens.weight", "embed_tokens.weight"))
    if embed_w is None:
        raise UserError(f"{target_dir}: no embed_tokens weight in the safetensors files")
    head_w = _tensor(target_dir, ("lm_head.weight",))
    if head_w is None:
        if not getattr(hf, "tie_word_embeddings", False):
            raise UserError(f"{target_dir}: no lm_head.weight and embeddings are not tied")
        head_w = embed_w
    embed = nn.Embedding(embed_w.shape[0], embed_w.shape[1], device=device, dtype=dtype)
    head = nn.Linear(head_w.shape[1], head_w.shape[0], bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        embed.weight.copy_(embed_w)
        head.weight.copy_(head_w)
    embed.requires_grad_(False)
    head.requires_grad_(False)
    return embed, head


def build_drafter(
    dcfg: DrafterConfig,
    borrowed: tuple[nn.Embedding, nn.Linear],
    device: torch.device,
    seed: int,
    *,
    checkpoint_layers: bool = False,
) -> DFlashDrafter:
    """fp32 master weights on the drafter device, initialised from `seed` (same on all ranks);
    `checkpoint_layers` recomputes each layer in backward (same gradients, less memory)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = DFlashDrafter(dcfg)
    drafter.to(device=device, dtype=torch.float32)
    drafter.bind_target(*borrowed)
    drafter.checkpoint_layers = checkpoint_layers
    return drafter
