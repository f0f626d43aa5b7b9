"""Acceptance evaluation: real greedy speculative decoding with a trained drafter.

    python -m trainer.eval --target DIR --drafter DIR --prompts FILE [FILE ...]
        [--max-new-tokens N] [--tokenizer DIR] [--template-kwargs JSON] [--raw-text]
        [--question-suffix TEXT|zlab]
        [--eos-id ID ...] [--ignore-eos] [--protocol exact|zlab] [--device cpu|cuda] [--json OUT]
        [--summary-json OUT]
        [--engine vllm (--server URL | --serve-cmd CMD [--serve-arg ARG ...]) [--tolerance F]]

Prompt files are JSONL prompt sets in the forms people have: MT-Bench `question.jsonl` as it is
(multi-turn: the model's own answer to turn 1 joins the conversation before turn 2), gsm8k
(`question`), MATH-500 (`problem`), OpenAI `messages`, `{"prompt"}`, `{"text"}`, or token ids (see
`trainer.eval_prompts`). Text goes through the tokenizer's chat template (`--template-kwargs
'{"enable_thinking": false}'` reaches it); token ids are used as they are. The tokenizer
defaults to the target directory, and generation stops at the tokenizer's and the target's
`generation_config.json` EOS ids (`<|im_end|>` for Qwen3), as serving does. Every prompt is read,
rendered and checked against the target's vocabulary before any model loads; what needs no
tokenizer (arguments, prompt files, the target's and the export's config.json) is checked before
torch and transformers are even imported, so `--help` and input errors answer at once.

For every prompt (every turn of a multi-turn prompt) it runs the speculative loop
(`trainer.model.speculative`) and plain greedy decoding of the target, and reports tau = mean
tokens committed per verify step (accepted drafts + the bonus token; max = block size), per
prompt set and over all sets; tau is the mean of per-turn taus (z-lab's averaging), pooled is
total committed / total verify steps. `--protocol zlab` counts verify steps as z-lab's
benchmark does (one more when the committed tokens land exactly on the limit); every figure
printed names its protocol.

`--engine vllm` also measures the drafter where it is served: every turn goes, as the same token
ids, to a vLLM engine (`--server URL`, one already running with this drafter; or `--serve-cmd
'vllm serve'`, started for the run with this export and stopped after it, its exact command line
and version written to the JSON), greedy, stopping at the same ids, and the engine's own
speculative-decoding counters are read around each request. Its tau and per-position acceptance
(protocol exact) are printed beside the project's loop; both must commit identical tokens and
agree within `--tolerance` (share of verify steps whose acceptance may differ; see
`trainer.serving.compare`), else exit 1 naming what differs. An engine that goes away mid-run is
one line naming its URL; the turns done so far are reported, marked partial. Ctrl-C (or SIGTERM) stops it cleanly: the summary and `--json` of
the turns done so far, marked partial. Exit status: 0 all outputs match greedy, 1 a mismatch (a
bug), 2 a usage or input error, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from trainer.errors import ExitCode, TrainerError
from trainer.eval_prompts import (
    ZLAB_MATH_SUFFIX,
    PromptError,
    PromptSet,
    Renderer,
    parse_template_kwargs,
    read_prompt_set,
    run_turns,
    unread_template_kwargs,
)
from trainer.eval_results import (
    EvalSummary,
    PromptResult,
    format_result,
    format_summary,
    results_json,
    summarize,
    summarize_sets,
)
from trainer.events.served import ENGINE_METAVAR, engine_arg, served_summary
from trainer.model.errors import TargetError
from trainer.model.export_files import read_export_json
from trainer.model.protocols import PROTOCOLS, Protocol
from trainer.serving.compare import DEFAULT_TOLERANCE
from trainer.serving.errors import EngineError
from trainer.serving.served_eval import (
    EngineSpec,
    ServedSession,
    format_turn,
    open_session,
    serve_cmd_problem,
)
from trainer.serving.served_eval import report as served_report

if TYPE_CHECKING:  # torch and transformers load only once the inputs are known to be good
    from trainer.model.drafter import DFlashDrafter
    from trainer.model.target import TargetModel

__all__ = ["EvalSummary", "PromptResult", "evaluate", "main", "summarize"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def evaluate(
    target: TargetModel,
    drafter: DFlashDrafter,
    prompt_sets: Sequence[PromptSet],
    renderer: Renderer,
    *,
    max_new_tokens: int,
    eos_id: int | Sequence[int] | None = None,
    check_greedy: bool = True,
    protocol: Protocol = "exact",
    on_result: Callable[[PromptResult], None] | None = None,
    on_turn: Callable[[list[int], PromptResult], None] | None = None,
) -> tuple[list[PromptResult], list[EvalSummary]]:
    """Run speculative decoding (and greedy, for the equality check) on every turn.

    `on_result` sees each turn's result as soon as it is measured (progress on long sets);
    `on_turn` then gets the turn's prompt ids with it (the served evaluation sends them on).
    Returns the per-turn results and one summary per prompt set followed by the overall one.
    """
    from trainer.model.speculative import greedy_generate, speculative_generate

    results: list[PromptResult] = []
    for pset in prompt_sets:
        first = len(results)
        for prompt in pset.prompts:
            where = f"{pset.path}:{prompt.line}"

            def generate(
                ids: list[int], line: int = prompt.line, name: str = pset.name, since: int = first
            ) -> list[int]:
                spec = speculative_generate(
                    target, drafter, ids, max_new_tokens, eos_id, protocol=protocol
                )
                greedy = (
                    greedy_generate(target, ids, max_new_tokens, eos_id) if check_greedy else None
                )
                results.append(
                    PromptResult(
                        index=len(results),
                        set=name,
                        line=line,
                        turn=sum(1 for r in results[since:] if r.line == line) + 1,
                        prompt_tokens=len(ids),
                        new_tokens=len(spec.tokens),
                        verify_steps=len(spec.accept_lengths),
                        tau=spec.tau,
                        matches_greedy=greedy is None or greedy.tokens == spec.tokens,
                        spec_seconds=spec.seconds,
                        greedy_seconds=greedy.seconds if greedy else 0.0,
                        tokens=spec.tokens,
                        accept_lengths=spec.accept_lengths,
                    )
                )
                if on_result is not None:
                    on_result(results[-1])
                if on_turn is not None:
                    on_turn(ids, results[-1])
                return spec.tokens

            run_turns(prompt, renderer, where, generate)
    sets = [(pset.name, pset.turns) for pset in prompt_sets]
    return results, summarize_sets(results, sets, protocol, drafter.config.block_size)


def target_vocab_size(target_dir: Path) -> int:
    """Embedding rows of the target, from its config.json (no weights are read)."""
    path = target_dir / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise TargetError(f"{target_dir}: not a model directory (no config.json)") from None
    except (OSError, json.JSONDecodeError) as err:
        raise TargetError(f"{path}: cannot read: {err}") from None
    vocab = data.get("vocab_size") or (data.get("text_config") or {}).get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise TargetError(f"{path}: no vocab_size")
    return vocab


def load_tokenizer(path: Path, *, required: bool) -> Any:
    """The tokenizer in `path`; None when it has none and nothing needs one."""
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        if not required:
            return None
        raise PromptError(
            f"{path}: no tokenizer here ({', '.join(TOKENIZER_FILES)}); text prompts need one: "
            "pass --tokenizer DIR"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as err:  # tokenizers/HF raise many types for a directory without one
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PromptError(f"{path}: cannot load tokenizer: {first}") from None


def default_stop_ids(tokenizer: Any, target_dir: Path) -> list[int]:
    """EOS ids serving stops at: the tokenizer's EOS plus the target's generation_config ones."""
    ids: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if isinstance(eos, int):
        ids.append(eos)
    gen = target_dir / "generation_config.json"
    if gen.is_file():
        try:
            value = json.loads(gen.read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError, AttributeError) as err:
            raise TargetError(f"{gen}: cannot read: {err}") from None
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer.eval",
        description="Measure drafter acceptance (tau) with real greedy speculative decoding.",
    )
    p.add_argument("--target", required=True, type=Path, help="target model directory (HF)")
    p.add_argument("--drafter", required=True, type=Path, help="exported drafter directory")
    p.add_argument(
        "--prompts",
        required=True,
        type=Path,
        nargs="+",
        help="JSONL prompt sets: MT-Bench question.jsonl, gsm8k, OpenAI messages, text, ids",
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=256, help="per turn (z-lab's benchmark uses 2048)"
    )
    p.add_argument(
        "--tokenizer", type=Path, default=None, help="tokenizer directory (default: --target)"
    )
    p.add_argument(
        "--template-kwargs",
        default=None,
        metavar="JSON",
        help="chat template variables, e.g. '{\"enable_thinking\": false}'",
    )
    p.add_argument(
        "--raw-text", action="store_true", help='tokenise {"text"} rows as is (no chat template)'
    )
    p.add_argument(
        "--question-suffix",
        default="",
        metavar="TEXT",
        help="appended to gsm8k/MATH-500 questions; 'zlab' = z-lab's benchmark suffix "
        f"{ZLAB_MATH_SUFFIX!r}",
    )
    p.add_argument(
        "--eos-id",
        type=int,
        action="append",
        default=None,
        help="stop at this token id (repeatable; default: the tokenizer's and "
        "generation_config.json's EOS)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    p.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="exact",
        help="verify-step counting: exact, or zlab (z-lab's benchmark, to compare with "
        "published tau)",
    )
    p.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: cuda when a GPU is visible)"
    )
    p.add_argument("--no-greedy-check", action="store_true", help="skip the greedy reference run")
    p.add_argument("--json", type=Path, default=None, help="also write results as JSON here")
    p.add_argument(
        "--summary-json",
        type=Path,
        default=None,
        metavar="OUT",
        help="also write the small summary monitors read (trainer.events.served)",
    )
    served = p.add_argument_group("served evaluation (the same turns in a serving engine)")
    served.add_argument(
        "--engine",
        type=engine_arg,
        default=None,
        metavar=ENGINE_METAVAR,
        help="also decode every turn in this engine",
    )
    served.add_argument("--server", default=None, metavar="URL", help="an engine already running")
    served.add_argument(
        "--serve-cmd",
        default=None,
        metavar="CMD",
        help="start the engine with this command (e.g. 'vllm serve'); the target, 127.0.0.1, "
        "a free port, --speculative-config for this export and --dtype are appended",
    )
    served.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more engine argument, appended last (repeatable; --serve-arg=--enforce-eager)",
    )
    served.add_argument(
        "--serve-timeout", type=float, default=600.0, help="seconds for the engine to come up"
    )
    served.add_argument("--serve-log", type=Path, default=None, help="the started engine's log")
    served.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help="share of verify steps whose acceptance may differ between the loops "
        f"(default {DEFAULT_TOLERANCE})",
    )
    return p


@dataclass
class Checked:
    """What was read and checked before torch or transformers load: every file a typo could
    name, the prompts, the template kwargs."""

    prompt_sets: list[PromptSet]
    template_kwargs: dict[str, Any]
    vocab: int


@dataclass
class Inputs:
    prompt_sets: list[PromptSet]
    renderer: Renderer
    stop_ids: list[int]


def check_inputs(args: argparse.Namespace) -> Checked:
    """The checks that need no tokenizer or model, so a bad input fails in a fraction of a
    second (transformers alone takes 10-40 s to import)."""
    if args.max_new_tokens < 1:
        raise PromptError("--max-new-tokens must be >= 1")
    check_engine_args(args)
    template_kwargs = parse_template_kwargs(args.template_kwargs)
    read_export_json(args.drafter)
    vocab = target_vocab_size(args.target)
    if args.tokenizer is not None and not args.tokenizer.is_dir():
        raise PromptError(f"--tokenizer {args.tokenizer}: not a directory")
    for i in args.eos_id or []:
        if not 0 <= i < vocab:
            raise PromptError(f"--eos-id {i} is outside the target vocabulary 0..{vocab - 1}")
    suffix = ZLAB_MATH_SUFFIX if args.question_suffix == "zlab" else args.question_suffix
    sets = [
        read_prompt_set(path, raw_text=args.raw_text, question_suffix=suffix)
        for path in args.prompts
    ]
    return Checked(sets, template_kwargs, vocab)


def check_engine_args(args: argparse.Namespace) -> None:
    """The served evaluation's flags: an engine, and exactly one way to reach it."""
    reach = [flag for flag, v in (("--server", args.server), ("--serve-cmd", args.serve_cmd)) if v]
    if args.engine is None:
        if reach or args.serve_arg:
            raise PromptError(f"{(reach or ['--serve-arg'])[0]} needs --engine vllm")
        return
    if len(reach) != 1:
        raise PromptError("--engine needs exactly one of --server URL or --serve-cmd CMD")
    if args.server and args.serve_arg:
        raise PromptError("--serve-arg goes with --serve-cmd (a running --server has its own)")
    if (problem := serve_cmd_problem(args.serve_cmd)) is not None:
        raise PromptError(problem)
    if args.protocol != "exact":
        raise PromptError("--engine counts verify steps as the engine does: use --protocol exact")
    if not 0 <= args.tolerance < 1:
        raise PromptError(f"--tolerance {args.tolerance}: a share of verify steps, in [0, 1)")


def prepare_inputs(args: argparse.Namespace, checked: Checked) -> Inputs:
    """The tokenizer's part, still before any model loads: every prompt rendered and its ids
    checked against the target's vocabulary, and the stop ids."""
    sets, vocab = checked.prompt_sets, checked.vocab
    tok_dir = args.tokenizer or args.target
    needed = any(s.needs_tokenizer for s in sets)
    tokenizer = load_tokenizer(tok_dir, required=needed or args.tokenizer is not None)
    unread = unread_template_kwargs(tokenizer, checked.template_kwargs)
    if unread:
        names = ", ".join(repr(k) for k in unread)
        raise PromptError(
            f"--template-kwargs: {names} never read by the chat template of {tok_dir}"
        )
    renderer = Renderer(tokenizer, vocab, checked.template_kwargs)
    for pset in sets:
        for prompt in pset.prompts:
            renderer.first_ids(prompt, f"{pset.path}:{prompt.line}")
    if args.ignore_eos:
        stops: list[int] = []
    elif args.eos_id:
        stops = list(dict.fromkeys(args.eos_id))
    else:
        stops = default_stop_ids(tokenizer, args.target)
    for i in stops:
        if not 0 <= i < vocab:
            raise PromptError(f"--eos-id {i} is outside the target vocabulary 0..{vocab - 1}")
    return Inputs(sets, renderer, stops)


def _stop_names(stops: Sequence[int], tokenizer: Any) -> str:
    if not stops:
        return "none"
    if tokenizer is None:
        return ", ".join(str(i) for i in stops)
    return ", ".join(f"{i} {tokenizer.convert_ids_to_tokens(i)!s}" for i in stops)


@dataclass
class _Progress:
    """What a run has done so far: all a Ctrl-C must not lose."""

    sets: list[PromptSet] = field(default_factory=list)
    stop_ids: list[int] = field(default_factory=list)
    block_size: int = 0
    results: list[PromptResult] = field(default_factory=list)
    served: ServedSession | None = None

    def add(self, result: PromptResult) -> None:
        self.results.append(result)
        print(format_result(result), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    done = _Progress()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        checked = check_inputs(args)  # no torch, no transformers yet
        done.sets = checked.prompt_sets
        _run(args, checked, done)
    except EngineError as err:  # the engine would not start, refused, or went away mid-run
        print(f"error: {err}", file=sys.stderr)
        if done.results:
            _report(args, done, partial=True)
        return ExitCode.FAILED
    except TrainerError as err:  # PromptError, ExportError, TargetError: one line
        print(f"error: {err}", file=sys.stderr)
        return ExitCode.USAGE
    except KeyboardInterrupt:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the report
            signal.signal(sig, signal.SIG_IGN)
        planned = sum(s.turns for s in done.sets)
        print(
            f"interrupted: {len(done.results)} of {planned} turns done; the summary covers "
            "those (partial)",
            file=sys.stderr,
        )
        _report(args, done, partial=True)
        return ExitCode.INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)
    return _report(args, done, partial=False)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM ends the run as Ctrl-C does: with its report


def _run(args: argparse.Namespace, checked: Checked, done: _Progress) -> None:
    import torch

    from trainer.model.export import load_drafter, read_drafter_config
    from trainer.model.target import TargetModel

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise PromptError(f"--device {device} requested but no CUDA GPU is visible")
    drafter_cfg = read_drafter_config(args.drafter)
    done.block_size = drafter_cfg.block_size
    inputs = prepare_inputs(args, checked)  # before any model loads: a bad prompt fails early
    done.stop_ids = inputs.stop_ids
    target = TargetModel.load(args.target, drafter_cfg.target_layer_ids, device=device)
    drafter = load_drafter(args.drafter, target=target, device=device, dtype=target.dtype)
    forms = ", ".join(
        f"{s.name}: {', '.join(f'{n} {k}' for k, n in s.forms.items())}" for s in inputs.prompt_sets
    )
    print(f"prompts {forms}; stop at {_stop_names(inputs.stop_ids, inputs.renderer.tokenizer)}")

    def run(on_turn: Callable[[list[int], PromptResult], None] | None = None) -> None:
        evaluate(
            target,
            drafter,
            inputs.prompt_sets,
            inputs.renderer,
            max_new_tokens=args.max_new_tokens,
            eos_id=inputs.stop_ids,
            check_greedy=not args.no_greedy_check,
            protocol=args.protocol,
            on_result=done.add,
            on_turn=on_turn,
        )

    if args.engine is None:
        run()
        return
    spec = EngineSpec(
        args.engine,
        args.server,
        args.serve_cmd,
        tuple(args.serve_arg),
        args.serve_timeout,
        args.serve_log,
    )
    with open_session(
        spec,
        target=args.target,
        drafter=args.drafter,
        block_size=drafter_cfg.block_size,
        dtype=str(target.dtype).removeprefix("torch."),
        max_new_tokens=args.max_new_tokens,
        stop_ids=inputs.stop_ids,
    ) as session:
        done.served = session

        def served_turn(ids: list[int], own: PromptResult) -> None:
            print(format_turn(own, session.turn(ids, own), session.engine), flush=True)

        run(served_turn)


def _report(args: argparse.Namespace, done: _Progress, *, partial: bool) -> int:
    """Summary lines (and `--json`) of the turns done; the exit status of a whole run."""
    sets = [(s.name, s.turns) for s in done.sets]
    summaries = summarize_sets(done.results, sets, args.protocol, done.block_size)
    for s in summaries:
        print(format_summary(s) + ("  [partial]" if partial else ""))
    problem = None
    payload = results_json(args.protocol, done.stop_ids, done.results, summaries)
    if done.served is not None:
        lines, served, problem = served_report(
            done.served, done.results, sets, done.block_size, args.tolerance
        )
        for line in lines:
            print(line + ("  [partial]" if partial else ""))
        payload.update(served)
    if args.json is not None:
        payload["partial"] = partial
        payload["turns_planned"] = sum(turns for _, turns in sets)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    if args.summary_json is not None:  # after --json: a monitor that sees it finds both
        summary = served_summary(payload, partial=partial)
        args.summary_json.write_text(summary.model_dump_json(indent=1) + "\n")
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return ExitCode.FAILED
    overall = summaries[-1]
    if overall.matches != overall.prompts:
        print(
            f"error: {overall.prompts - overall.matches} prompt(s) differ from greedy decoding",
            file=sys.stderr,
        )
        return ExitCode.FAILED
    return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())
