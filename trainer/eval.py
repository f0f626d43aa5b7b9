"""Acceptance evaluation: real greedy speculative decoding with a trained drafter.

    python -m trainer.eval --target DIR --drafter DIR --prompts FILE [--max-new-tokens N]
        [--tokenizer DIR] [--eos-id ID] [--device cpu|cuda] [--json OUT]

Prompts file: JSONL, one prompt per line, either a JSON list of token ids, an object with
"input_ids" (list of ids), or an object with "text" (then --tokenizer DIR is required; the
text is tokenised as is, apply the chat template beforehand). Blank lines are skipped.

For every prompt it runs the speculative loop (`trainer.model.speculative`) and plain greedy
decoding of the target, and reports tau = mean tokens committed per verify step (accepted
drafts + the bonus token; max = block size), the tokens generated, and whether the output
equals greedy decoding. The overall tau is the mean of per-prompt taus (z-lab's protocol).
Exit status: 0 all outputs match greedy, 1 a mismatch (a bug), 2 a usage or input error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.model.drafter import DFlashDrafter
from trainer.model.export import ExportError, load_drafter, read_drafter_config
from trainer.model.speculative import greedy_generate, speculative_generate
from trainer.model.target import TargetError, TargetModel


class EvalInputError(ValueError):
    """A prompts file or argument the evaluation cannot use (names the file and line)."""


@dataclass(frozen=True)
class PromptResult:
    index: int
    prompt_tokens: int
    new_tokens: int
    verify_steps: int
    tau: float
    matches_greedy: bool
    spec_seconds: float
    greedy_seconds: float


@dataclass(frozen=True)
class EvalSummary:
    prompts: int
    tau: float  # mean of per-prompt tau
    tau_pooled: float  # total committed tokens / total verify steps
    new_tokens: int
    verify_steps: int
    matches: int
    block_size: int
    spec_seconds: float
    greedy_seconds: float


def load_prompts(path: Path, vocab_size: int, tokenizer_dir: Path | None = None) -> list[list[int]]:
    """Read the JSONL prompts file; every error names the file and line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise EvalInputError(f"{path}: cannot read prompts: {err.strerror}") from None
    tokenizer = None
    prompts: list[list[int]] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise EvalInputError(f"{where}: invalid JSON ({err.msg})") from None
        if isinstance(item, dict) and "text" in item:
            if tokenizer_dir is None:
                raise EvalInputError(f"{where}: a text prompt needs --tokenizer DIR")
            if tokenizer is None:
                tokenizer = _load_tokenizer(tokenizer_dir)
            ids = tokenizer(str(item["text"]), add_special_tokens=False)["input_ids"]
        else:
            ids = item.get("input_ids") if isinstance(item, dict) else item
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            raise EvalInputError(
                f'{where}: expected a non-empty list of token ids, {{"input_ids": [...]}} '
                'or {"text": "..."}'
            )
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise EvalInputError(
                f"{where}: token id {bad[0]} outside the target vocabulary 0..{vocab_size - 1}"
            )
        prompts.append(ids)
    if not prompts:
        raise EvalInputError(f"{path}: no prompts")
    return prompts


def _load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise EvalInputError(f"{path}: cannot load tokenizer: {str(err).splitlines()[0]}") from None


def evaluate(
    target: TargetModel,
    drafter: DFlashDrafter,
    prompts: Sequence[list[int]],
    *,
    max_new_tokens: int,
    eos_id: int | None = None,
    check_greedy: bool = True,
) -> tuple[list[PromptResult], EvalSummary]:
    """Run speculative decoding (and greedy, for the equality check) on every prompt."""
    results: list[PromptResult] = []
    committed = 0
    for i, prompt in enumerate(prompts):
        spec = speculative_generate(target, drafter, prompt, max_new_tokens, eos_id)
        greedy = greedy_generate(target, prompt, max_new_tokens, eos_id) if check_greedy else None
        committed += sum(spec.accept_lengths)
        results.append(
            PromptResult(
                index=i,
                prompt_tokens=len(prompt),
                new_tokens=len(spec.tokens),
                verify_steps=len(spec.accept_lengths),
                tau=spec.tau,
                matches_greedy=greedy is None or greedy.tokens == spec.tokens,
                spec_seconds=spec.seconds,
                greedy_seconds=greedy.seconds if greedy else 0.0,
            )
        )
    steps = sum(r.verify_steps for r in results)
    summary = EvalSummary(
        prompts=len(results),
        tau=sum(r.tau for r in results) / len(results),
        tau_pooled=committed / steps if steps else 0.0,
        new_tokens=sum(r.new_tokens for r in results),
        verify_steps=steps,
        matches=sum(r.matches_greedy for r in results),
        block_size=drafter.config.block_size,
        spec_seconds=sum(r.spec_seconds for r in results),
        greedy_seconds=sum(r.greedy_seconds for r in results),
    )
    return results, summary


def format_result(r: PromptResult) -> str:
    return (
        f"prompt {r.index}: tau={r.tau:.2f} steps={r.verify_steps} new_tokens={r.new_tokens} "
        f"greedy_match={'yes' if r.matches_greedy else 'NO'}"
    )


def format_summary(s: EvalSummary) -> str:
    return (
        f"tau={s.tau:.3f} (pooled {s.tau_pooled:.3f}, block {s.block_size}) prompts={s.prompts} "
        f"new_tokens={s.new_tokens} verify_steps={s.verify_steps} "
        f"greedy_match={s.matches}/{s.prompts} spec={s.spec_seconds:.1f}s greedy={s.greedy_seconds:.1f}s"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer.eval",
        description="Measure drafter acceptance (tau) with real greedy speculative decoding.",
    )
    p.add_argument("--target", required=True, type=Path, help="target model directory (HF)")
    p.add_argument("--drafter", required=True, type=Path, help="exported drafter directory")
    p.add_argument("--prompts", required=True, type=Path, help="JSONL prompts (token ids or text)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer dir for text prompts")
    p.add_argument("--eos-id", type=int, default=None, help="stop at this token (default: none)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-greedy-check", action="store_true", help="skip the greedy reference run")
    p.add_argument("--json", type=Path, default=None, help="also write results as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 1:
        print("error: --max-new-tokens must be >= 1", file=sys.stderr)
        return 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"error: --device {args.device} requested but no CUDA GPU is visible", file=sys.stderr
        )
        return 2
    try:
        drafter_cfg = read_drafter_config(args.drafter)
        target = TargetModel.load(args.target, drafter_cfg.target_layer_ids, device=args.device)
        drafter = load_drafter(args.drafter, target=target, device=args.device, dtype=target.dtype)
        prompts = load_prompts(args.prompts, target.vocab_size, args.tokenizer)
    except (EvalInputError, ExportError, TargetError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    results, summary = evaluate(
        target,
        drafter,
        prompts,
        max_new_tokens=args.max_new_tokens,
        eos_id=args.eos_id,
        check_greedy=not args.no_greedy_check,
    )
    for r in results:
        print(format_result(r))
    print(format_summary(summary))
    if args.json is not None:
        payload = {"summary": asdict(summary), "prompts": [asdict(r) for r in results]}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    if summary.matches != summary.prompts:
        print(
            f"error: {summary.prompts - summary.matches} prompt(s) differ from greedy decoding",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
