"""Prompt sets for `trainer.eval`, read and validated before any model loads.

One JSON value per line (blank lines skipped); every error names the file and line. Row forms:

    [1, 2, 3]  or  {"input_ids": [...]}     token ids, used as they are (no chat template)
    {"turns": ["q1", "q2", ...]}            MT-Bench `question.jsonl` (question_id, category,
                                            ...): multi-turn, each turn sent after the model's
                                            own answer to the previous one
    {"prompt": "q" | ["q1", ...]}           HF prompt sets (mt_bench_prompts, mbpp sanitized)
    {"question": "q", ...}                  gsm8k
    {"problem": "q", ...}                   MATH-500 (these two get `question_suffix` appended;
                                            z-lab's benchmark appends ZLAB_MATH_SUFFIX)
    {"messages": [{"role", "content"}...]}  OpenAI chat; trailing assistant messages (reference
                                            answers) are dropped; row-level "tools" are passed
    {"text": "..."}                         one user message (or the raw text with --raw-text)

Everything except token ids goes through the tokenizer's chat template
(`add_generation_prompt=True` plus the template kwargs, e.g. `enable_thinking`), the way z-lab's
benchmark builds its prompts.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.data.conversations import content_text
from trainer.errors import TrainerError

ROLES = ("system", "user", "assistant", "tool")
# What z-lab's benchmark appends to gsm8k and MATH-500 questions (`--question-suffix zlab`).
ZLAB_MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
FORMS = (
    'token ids, {"input_ids"}, {"turns"} (MT-Bench), {"messages"} (OpenAI), '
    '{"prompt"}, {"question"} (gsm8k), {"problem"} (MATH-500) or {"text"}'
)


class PromptError(TrainerError, ValueError):
    """A prompt set (or a row of it) the evaluation cannot use; the message names file:line."""


@dataclass(frozen=True)
class TokenPrompt:
    """A prompt given as token ids: sent as is."""

    line: int
    ids: list[int]


@dataclass(frozen=True)
class ChatPrompt:
    """Fixed messages (`history`), then user `turns` sent one at a time; the model's answer to
    each turn joins the conversation before the next (MT-Bench's protocol)."""

    line: int
    form: str
    history: list[dict[str, Any]]
    turns: list[str]
    tools: list[Any] | None = None
    raw: bool = False  # {"text"} under --raw-text: tokenised as is, no template


Prompt = TokenPrompt | ChatPrompt


@dataclass(frozen=True)
class PromptSet:
    path: Path
    prompts: list[Prompt]
    forms: Counter[str] = field(default_factory=Counter)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def needs_tokenizer(self) -> bool:
        return any(isinstance(p, ChatPrompt) for p in self.prompts)

    @property
    def turns(self) -> int:
        return sum(1 if isinstance(p, TokenPrompt) else len(p.turns) for p in self.prompts)


def _strings(value: Any) -> list[str] | None:
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return value
    return None


def _messages_prompt(row: Mapping[str, Any], where: str, line: int) -> ChatPrompt:
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        raise PromptError(f"{where}: 'messages' must be a non-empty list")
    clean: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping) or msg.get("role") not in ROLES:
            role = msg.get("role") if isinstance(msg, Mapping) else type(msg).__name__
            raise PromptError(
                f"{where}: messages[{i}]: role {role!r} is not one of {', '.join(ROLES)}"
            )
        out = dict(msg)
        if "content" in msg and msg["content"] is not None:
            text = content_text(msg["content"])
            if text is None:
                raise PromptError(f"{where}: messages[{i}].content is not text")
            out["content"] = text
        clean.append(out)
    while clean and clean[-1]["role"] == "assistant":
        clean.pop()  # a reference answer: the model writes its own
    if not clean or clean[-1]["role"] != "user" or not clean[-1].get("content"):
        raise PromptError(f"{where}: 'messages' has no user message to answer")
    tools = row.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise PromptError(f"{where}: 'tools' must be a list")
    return ChatPrompt(line, "messages", clean[:-1], [clean[-1]["content"]], tools or None)


def parse_row(
    item: Any, where: str, line: int, *, raw_text: bool = False, question_suffix: str = ""
) -> Prompt:
    """One parsed JSON line -> a prompt; raises PromptError naming `where`."""
    if isinstance(item, list):
        ids: Any = item
    elif isinstance(item, Mapping) and "input_ids" in item:
        ids = item["input_ids"]
    else:
        ids = None
    if ids is not None:
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise PromptError(f"{where}: expected a non-empty list of token ids")
        return TokenPrompt(line, list(ids))
    if not isinstance(item, Mapping):
        raise PromptError(f"{where}: a {type(item).__name__} is not a prompt; expected {FORMS}")
    for key, form in (("turns", "mt-bench"), ("prompt", "prompt")):
        if key in item:
            turns = _strings(item[key])
            if turns is None:
                raise PromptError(f"{where}: {key!r} must be a non-empty string or list of them")
            return ChatPrompt(line, form, [], turns)
    for key, form in (("question", "gsm8k"), ("problem", "math")):
        if key in item:
            question = item[key]
            if not isinstance(question, str) or not question:
                raise PromptError(f"{where}: {key!r} must be a non-empty string")
            return ChatPrompt(line, form, [], [question + question_suffix])
    if "messages" in item:
        return _messages_prompt(item, where, line)
    if "text" in item:
        text = item["text"]
        if not isinstance(text, str) or not text:
            raise PromptError(f"{where}: 'text' must be a non-empty string")
        return ChatPrompt(line, "raw-text" if raw_text else "text", [], [text], raw=raw_text)
    keys = ", ".join(repr(k) for k in list(item)[:8])
    raise PromptError(f"{where}: no prompt in this row (keys {keys}); expected {FORMS}")


def read_prompt_set(path: Path, *, raw_text: bool = False, question_suffix: str = "") -> PromptSet:
    """Parse and check the structure of every row of a JSONL prompt set (no tokenizer)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise PromptError(f"{path}: cannot read prompts: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise PromptError(f"{path}: not UTF-8 text ({err.reason})") from None
    prompts: list[Prompt] = []
    forms: Counter[str] = Counter()
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            if lineno == 1 and _is_json_array(text):
                raise PromptError(
                    f"{path}: one JSON array, not JSONL; convert it with "
                    f"`jq -c '.[]' {path} > {path.stem}.jsonl`"
                ) from None
            raise PromptError(f"{where}: invalid JSON ({err.msg})") from None
        prompt = parse_row(item, where, lineno, raw_text=raw_text, question_suffix=question_suffix)
        prompts.append(prompt)
        forms["token-ids" if isinstance(prompt, TokenPrompt) else prompt.form] += 1
    if not prompts:
        raise PromptError(f"{path}: no prompts")
    return PromptSet(path, prompts, forms)


def _is_json_array(text: str) -> bool:
    try:
        return isinstance(json.loads(text), list)
    except json.JSONDecodeError:
        return False


def parse_template_kwargs(text: str | None) -> dict[str, Any]:
    """`--template-kwargs '{"enable_thinking": false}'` -> a dict (one-line error otherwise)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise PromptError(f"--template-kwargs: invalid JSON ({err.msg})") from None
    if not isinstance(value, dict):
        raise PromptError(
            "--template-kwargs: expected a JSON object, e.g. '{\"enable_thinking\": false}'"
        )
    return value


def unread_template_kwargs(tokenizer: Any, kwargs: Mapping[str, Any]) -> list[str]:
    """The kwargs the tokenizer's chat template never reads (typos: Jinja ignores them
    silently, so `enable_thinkng` would change nothing while the user believes it worked)."""
    template = getattr(tokenizer, "chat_template", None)
    if not kwargs or not isinstance(template, str):
        return []
    import jinja2
    from jinja2 import meta

    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"])
    try:
        names = meta.find_undeclared_variables(env.parse(template))
    except jinja2.TemplateSyntaxError:  # a transformers-only tag: cannot tell, do not guess
        return []
    return [key for key in kwargs if key not in names]


class Renderer:
    """Prompt -> token ids through a tokenizer and its chat template; checks the id range."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.template_kwargs = dict(template_kwargs or {})

    def check_ids(self, ids: Sequence[int], where: str) -> list[int]:
        bad = [i for i in ids if i < 0 or (self.vocab_size is not None and i >= self.vocab_size)]
        if bad:
            top = "" if self.vocab_size is None else f" 0..{self.vocab_size - 1}"
            raise PromptError(f"{where}: token id {bad[0]} outside the target vocabulary{top}")
        return list(ids)

    def chat_ids(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, where: str
    ) -> list[int]:
        """The chat template's generation prompt for `messages`, tokenised."""
        if self.tokenizer is None:
            raise PromptError(f"{where}: a text prompt needs a tokenizer (--tokenizer DIR)")
        if not getattr(self.tokenizer, "chat_template", None):
            raise PromptError(
                f"{where}: the tokenizer has no chat template; give token ids, or plain "
                '{"text"} rows with --raw-text'
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=True,
                **self.template_kwargs,
            )
        except Exception as err:  # jinja raises its own types (TemplateError, TypeError...)
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise PromptError(f"{where}: chat template failed: {first}") from None
        return self.text_ids(text, where)

    def text_ids(self, text: str, where: str) -> list[int]:
        """`text` tokenised as is (the template already added any BOS)."""
        if self.tokenizer is None:
            raise PromptError(f"{where}: a text prompt needs a tokenizer (--tokenizer DIR)")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise PromptError(f"{where}: the prompt tokenises to nothing")
        return self.check_ids(ids, where)

    def first_ids(self, prompt: Prompt, where: str) -> list[int]:
        """Token ids of the first turn (everything that can be checked before generating)."""
        if isinstance(prompt, TokenPrompt):
            return self.check_ids(prompt.ids, where)
        if prompt.raw:
            return self.text_ids(prompt.turns[0], where)
        first = [*prompt.history, {"role": "user", "content": prompt.turns[0]}]
        return self.chat_ids(first, prompt.tools, where)

    def answer_text(self, tokens: Sequence[int]) -> str:
        """The model's answer as MT-Bench feeds it back: decoded without special tokens."""
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=True))


Generate = Callable[[list[int]], list[int]]


def run_turns(
    prompt: Prompt, renderer: Renderer, where: str, generate: Generate
) -> list[list[int]]:
    """Prompt ids of every turn, generating each answer with `generate(ids) -> tokens` before
    the next turn is rendered (the answer text joins the history as an assistant message).

    Returns the prompt ids of each turn, in order.
    """
    if isinstance(prompt, TokenPrompt) or prompt.raw:
        ids = renderer.first_ids(prompt, where)
        generate(ids)
        return [ids]
    messages = list(prompt.history)
    seen: list[list[int]] = []
    for k, turn in enumerate(prompt.turns):
        messages.append({"role": "user", "content": turn})
        turn_where = where if len(prompt.turns) == 1 else f"{where} turn {k + 1}"
        ids = renderer.chat_ids(messages, prompt.tools, turn_where)
        seen.append(ids)
        tokens = generate(ids)
        messages.append({"role": "assistant", "content": renderer.answer_text(tokens)})
    return seen
