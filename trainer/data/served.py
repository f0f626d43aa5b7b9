"""Regenerated chat files (`python -m trainer.regen`) as the importer reads them. Pure.

A regenerated file is JSONL. Its first line is the manifest (`MANIFEST_KEY`): how the rows were
made (model, `--reasoning` mode, the `chat_template_kwargs` sent with every request, sampling).
Every other line is an OpenAI `messages` row that any chat importer reads as it is, plus:

    {"id": "<content hash of the source row>", "messages": [...], "tools": [...],
     "dflash_regen": {"source": "FILE:LINE",
                      "generations": [{"prompt_token_ids": [...], "token_ids": [...],
                                       "finish_reason": "stop"}, ...],
                      "length_capped": false, "ended": null}}

`generations[k]` is the server's request and answer for the k-th assistant message: the prompt
exactly as the server tokenised it (its chat template, with the row's tools and the mode's
kwargs) and the ids it generated. The importer builds the store from those ids (one row per
generation: the prompt unsupervised, the generated ids supervised) and never re-tokenises them;
a row without them (an engine that does not return ids) is rendered like any chat row.

The manifest's `chat_template_kwargs` is what decides the thinking mode the rows were made in,
so the importer refuses a `--template-kwargs` that disagrees with it (`kwargs_mismatch`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainer.config.validation import one_line

MANIFEST_KEY = "dflash_regen_manifest"
ROW_KEY = "dflash_regen"
FORMAT = 1
REASONING_MODES = ("none", "save", "disable")
ON_LENGTH = ("keep", "drop")
BAD_SERVED = "bad_served_ids"  # skip reason: a row whose `dflash_regen` the importer cannot use


class RegenManifest(BaseModel):
    """The first line of a regenerated file: how every row in it was made."""

    model_config = ConfigDict(extra="allow", frozen=True)

    format: int = FORMAT
    model: str
    reasoning: Literal["none", "save", "disable"]
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    temperature: float
    max_tokens: int
    on_length: Literal["keep", "drop"] = "keep"
    sampling: dict[str, Any] = Field(default_factory=dict)
    created_at: str = ""

    def line(self) -> str:
        """The manifest as the file's first line (no newline)."""
        return json.dumps({MANIFEST_KEY: self.model_dump(mode="json")}, ensure_ascii=False)

    def describe(self) -> str:
        """`--reasoning disable (chat_template_kwargs {"enable_thinking": false}), model M`."""
        kwargs = json.dumps(self.chat_template_kwargs, sort_keys=True)
        return f"--reasoning {self.reasoning} (chat_template_kwargs {kwargs}), model {self.model}"


# Keys of a manifest that must agree between a run and the file it resumes: a file made two ways
# trains two distributions (`trainer.regen --resume` refuses the difference by name).
RESUME_KEYS = (
    "model",
    "reasoning",
    "chat_template_kwargs",
    "temperature",
    "max_tokens",
    "on_length",
    "sampling",
)


def manifest_of(row: Any) -> RegenManifest | str | None:
    """The manifest a decoded first line holds; None when the line is not one; a one-line
    reason when it is one but unreadable."""
    if not (isinstance(row, dict) and MANIFEST_KEY in row):
        return None
    try:
        return RegenManifest.model_validate(row[MANIFEST_KEY])
    except ValidationError as err:
        return f"{MANIFEST_KEY}: {one_line(err)}"


def is_manifest_row(row: Any) -> bool:
    return isinstance(row, dict) and MANIFEST_KEY in row


def resume_differences(old: RegenManifest, new: RegenManifest) -> list[str]:
    """`reasoning: 'save' in the file, 'disable' now` for each resume key that differs."""
    out = []
    for key in RESUME_KEYS:
        was, now = getattr(old, key), getattr(new, key)
        if was != now:
            out.append(f"{key}: {_show(was)} in the file, {_show(now)} now")
    return out


def kwargs_mismatch(manifest: RegenManifest, kwargs: dict[str, Any]) -> tuple[list[str], set[str]]:
    """Check an import's `--template-kwargs` against the manifest's `chat_template_kwargs`.

    Returns (problems, declared): a problem for every key whose value differs from the one the
    rows were generated with, or that the generation did not send (its rows are in the server's
    default mode, which the import cannot know); `declared` are the keys that agree: they state
    the mode the rows were made in, so the import takes them even where the template reads them
    only for a generation prompt (Qwen3's `enable_thinking`).
    """
    problems: list[str] = []
    declared: set[str] = set()
    sent = manifest.chat_template_kwargs
    for key, value in kwargs.items():
        if key in sent and sent[key] == value:
            declared.add(key)
        elif key in sent:
            problems.append(
                f"{key!r} is {_show(value)} but the rows were generated with {_show(sent[key])} "
                f"(--reasoning {manifest.reasoning}): a drafter trained on them would be served "
                "in the other mode, where its acceptance collapses"
            )
        elif key == "enable_thinking" or manifest.reasoning == "none":
            problems.append(
                f"{key!r} was not sent when the rows were generated (--reasoning "
                f"{manifest.reasoning}: the server's default); regenerate with --reasoning "
                "save|disable to fix the mode, or leave it out here"
            )
    return problems, declared


@dataclass(frozen=True)
class ServedGeneration:
    """One request's prompt ids and the ids the server generated for it."""

    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    finish_reason: str


def parse_served(value: Any, assistant_turns: int) -> tuple[ServedGeneration, ...] | str | None:
    """A row's `dflash_regen` value as generations (one per assistant turn, in order); None
    when the row carries no token ids; a one-line reason when they are unusable."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return f"{ROW_KEY} is not an object"
    gens = value.get("generations")
    if gens is None:
        return None
    if not isinstance(gens, list):
        return f"{ROW_KEY}.generations is not a list"
    if not gens or all(isinstance(g, dict) and g.get("token_ids") is None for g in gens):
        return None  # the engine returned no ids: the row is rendered like any other
    if len(gens) != assistant_turns:
        return (
            f"{ROW_KEY}.generations has {len(gens)} entries for {assistant_turns} assistant turns"
        )
    out = []
    for k, gen in enumerate(gens):
        if not isinstance(gen, dict):
            return f"{ROW_KEY}.generations[{k}] is not an object"
        ids = {name: gen.get(name) for name in ("prompt_token_ids", "token_ids")}
        for name, value in ids.items():
            if not _ids(value):
                return f"{ROW_KEY}.generations[{k}].{name} is not a non-empty list of token ids"
        reason = gen.get("finish_reason")
        prompt, completion = (tuple(ids[name] or ()) for name in ids)
        out.append(ServedGeneration(prompt, completion, str(reason or "")))
    return tuple(out)


def _ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(type(i) is int and i >= 0 for i in value)  # bool is not an id
    )


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)
