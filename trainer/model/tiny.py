"""A tiny random Qwen3 target built from a config, for CPU tests, demos and benchmarks.

Nothing is downloaded: the weights are drawn from a seeded generator and written with
`save_pretrained` (safetensors), so the directory loads like any Hugging Face checkpoint.

    python -m trainer.model.tiny --out /tmp/tiny-qwen3 [--seed 0] [--vocab-size 512]

Greedy text from random weights is partly repetitive and partly context-dependent; with
`init_std=0.04` about half of the next tokens are predictable from the previous one and the
rest depend on the context, so a drafter has something real to learn (held-out acceptance
rises well above 1 in `tests/model/test_training.py`). The top `reserved_top` ids get zero
LM-head rows: their logit is 0 while the max over ~500 random logits is positive, so greedy
decoding never emits them and they are safe mask-token ids (the synthetic token store
reserves the same top 8 ids).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from pydantic import ValidationError
from transformers import Qwen3Config, Qwen3ForCausalLM

from trainer.config import TinyTarget
from trainer.config.validation import one_line
from trainer.errors import ExitCode

INIT_STD = 0.04
"""Weight init std of the tiny target (see the module docstring for why 0.04)."""


def tiny_config(
    spec: TinyTarget | None = None,
    *,
    init_std: float = INIT_STD,
    max_position_embeddings: int = 1024,
) -> Qwen3Config:
    """The smallest Qwen3 that still has GQA, QK-norm and RoPE (reference §6), at `spec`'s shape
    (`[model.tiny_target]`; None: its defaults)."""
    t = spec or TinyTarget()
    return Qwen3Config(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_layers,
        num_attention_heads=t.num_heads,
        num_key_value_heads=t.num_kv_heads,
        head_dim=t.head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=init_std,
        # No special tokens: the synthetic data reserves the top ids itself.
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        # Taken through **kwargs by PreTrainedConfig, so Qwen3Config's signature lacks it.
        attn_implementation="sdpa",  # type: ignore[call-arg]
    )


def write_tiny_target(
    out_dir: str | Path,
    spec: TinyTarget | None = None,
    *,
    init_std: float = INIT_STD,
    reserved_top: int = 8,
) -> Path:
    """Build the seeded random Qwen3ForCausalLM of `spec` (`[model.tiny_target]`; None: its
    defaults) and save it to `out_dir` (safetensors).

    The same arguments always give bit-identical weights, so tests can rebuild it freely.

    Returns:
        The output directory.
    """
    t = spec or TinyTarget()
    out = Path(out_dir)
    config = tiny_config(t, init_std=init_std)
    cpu_rng = torch.random.get_rng_state()
    try:
        torch.manual_seed(t.seed)
        model = Qwen3ForCausalLM(config)
        # Norm weights start at 1.0; jitter them so every layer differs from the next.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(torch.randn_like(param) * 0.1)
            if reserved_top > 0:
                model.lm_head.weight[t.vocab_size - reserved_top :] = 0.0
    finally:
        torch.random.set_rng_state(cpu_rng)
    model.train(False)  # eval(); transformers leaves eval unannotated
    out.mkdir(parents=True, exist_ok=True)
    # transformers 5 writes nothing on a process whose torch.distributed rank is not 0 (its
    # own multi-process save); this target is this machine's own file, built by each node's
    # first process (trainer.pipeline.build), so every caller that asks for it gets it.
    model.should_save_on_this_rank = lambda is_main_process: is_main_process  # type: ignore[method-assign]
    model.save_pretrained(out, safe_serialization=True)
    return out


def build_tiny_target(
    out_dir: str | Path, *, init_std: float = INIT_STD, reserved_top: int = 8, **shape: int
) -> Path:
    """`write_tiny_target` with the `TinyTarget` fields as keywords (`seed=1`, `vocab_size=...`);
    an unknown or out-of-range field is a pydantic ValidationError."""
    spec = TinyTarget.model_validate(shape)
    return write_tiny_target(out_dir, spec, init_std=init_std, reserved_top=reserved_top)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.model.tiny", description="Write a tiny random Qwen3 target."
    )
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument(
        "--reserved-top", type=int, default=8, help="top ids the target never emits (default 8)"
    )
    args = parser.parse_args(argv)
    try:
        spec = TinyTarget(
            seed=args.seed,
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
        )
    except ValidationError as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return ExitCode.USAGE
    try:
        out = write_tiny_target(args.out, spec, reserved_top=args.reserved_top)
    except OSError as err:
        print(f"error: cannot write tiny target to {args.out}: {err}", file=sys.stderr)
        return ExitCode.FAILED
    print(out)
    return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())
