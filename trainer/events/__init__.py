"""The trainer's line protocol: one definition shared by the printer and every reader.

The trainer prints status, phase, checkpoint and error lines to stdout (tmux) and appends them
to ``RUN/status.log``; ``dflashctl`` reads them back over SSH.  Both sides import this module, so
the format and the parser can never drift apart.  Torch-free on purpose (dflashctl runs on laptops).

Status line (the contract in ARCHITECTURE.md)::

    [{elapsed_min}m] step={step} loss={loss:.4f|---} acc={acc:.3f|---} streak={streak:.1f|---}
    lr={lr:.2e|---} noise={noise:.4f} | tgt={tgt_bps:.2f}b/s dft={dft_bps:.2f}b/s
    ({ktok_s:.1f}Ktok/s) | q_pre=[d0, d1, ...] q_hs=[h0, ...] | epoch~{epoch:.2f} ETA={eta}
    [ | key=value ...]

(one physical line).  After the first evaluation the trainer's tail also carries ``tau=`` (the
last held-out simulated tau) and ``loss_b=[l0,l1,...]`` (mean loss per length bucket over the
interval, ``---`` for a bucket without a batch), in that order after ``gnorm``.

Eval line (one per in-training evaluation; ``acc@k`` for k = 1..B-1, ``tau_real`` only when
prompts are configured, ``best`` = step of the best checkpoint so far)::

    Eval: step={step} tau={tau:.3f|---} [tau_real={:.3f}] loss={loss:.4f|---} acc={acc:.3f|---}
    acc@1={:.3f} ... acc@{B-1}={:.3f} tau_exp={tau_exp:.3f|---} best={step|---} [ | key=value ...]

``parse_line`` never raises: anything it does not recognise becomes a
``RawLine``.  ``parse_text`` also re-joins lines that ``tmux capture-pane`` wrapped at the pane
width and tolerates a truncated last line (it becomes a ``RawLine``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from itertools import pairwise, repeat
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

__all__ = [
    "BOTTLENECK_KEY",
    "BUCKET_LOSS_KEY",
    "EVAL_PREFIX",
    "EVENT_ADAPTER",
    "GNORM_KEY",
    "PHASE_TEXTS",
    "STAGE_WAIT_KEYS",
    "TAU_KEY",
    "TRAINER_EXTRA_KEYS",
    "CheckpointEvent",
    "ErrorEvent",
    "EvalEvent",
    "Event",
    "PhaseEvent",
    "RawLine",
    "StatusEvent",
    "format_bucket_losses",
    "format_checkpoint_line",
    "format_error_line",
    "format_eta",
    "format_eval_line",
    "format_line",
    "format_phase_line",
    "format_status_line",
    "parse_bucket_losses",
    "parse_eta",
    "parse_line",
    "parse_text",
    "sanitize_for_terminal",
    "strip_escapes",
]

MISSING = "---"
UNKNOWN_ETA = "???"

# Phase lines: a fixed text per phase, optionally followed by " " + detail.
PHASE_TEXTS: dict[str, str] = {
    "loading": "Loading target and data...",
    "resuming": "Resuming from checkpoint:",
    "starting": "Starting pipeline...",
    "running": "Pipeline running. Monitoring...",
    "stopping": "Stopping pipeline...",
    "finished": "Training finished.",
    # printed by the supervisor (trainer.supervise), which runs the trainer as its child
    "restarting": "Restarting trainer:",
    "not_restarting": "Not restarting trainer:",
    "gave_up": "Supervisor gave up",
    "low_disk": "Run disk space:",  # detail "low: ..." or "ok again: ..."
}
CHECKPOINT_PREFIX = "Checkpoint saved: "
ERROR_PREFIX = "ERROR: "

# Extra fields the trainer appends to every status line (percent of wall time in the last interval
# that a stage spent blocked), so the TUI can show which stage starves or stalls.
STAGE_WAIT_KEYS: dict[str, str] = {
    "w_pre_out": "prefetch blocked on a full q_pre",
    "w_tgt_in": "target workers waiting for a batch (q_pre empty)",
    "w_tgt_out": "target workers blocked on a full q_hs",
    "w_dft_in": "drafter waiting for hidden states (q_hs empty / out of order)",
}
BOTTLENECK_KEY = "bottleneck"  # "prefetch" | "target" | "drafter" | "---"
GNORM_KEY = "gnorm"  # the last step's gradient norm, once a step has run
TAU_KEY = "tau"  # the last evaluation's simulated tau, once one has run
BUCKET_LOSS_KEY = "loss_b"  # mean loss per length bucket over the interval: [l0,l1,...]
EVAL_PREFIX = "Eval: "

_FROZEN = ConfigDict(frozen=True, extra="forbid")

# Terminal escape sequences: CSI (ESC [ ... final byte, or the 8-bit CSI), OSC (ESC ] ... BEL/ST,
# or the 8-bit OSC), the string controls DCS/SOS/PM/APC (ESC P/X/^/_ ... ST) and two-byte ESC
# sequences. A colouring pager or `capture-pane -e` wraps status lines in these; a hostile
# status.log can use OSC to retitle a terminal or write the clipboard (OSC 52).
_ESCAPE_RE = re.compile(
    # The lookahead names every introducer up front, so the engine skips plain text with a
    # character-set scan instead of trying four branches at each position (3x faster).
    r"(?=[\x1b\x90\x98\x9b\x9d\x9e\x9f])(?:"
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"  # CSI
    r"|(?:\x1b\]|\x9d)[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"  # OSC, to BEL or ST (or cut off)
    r"|(?:\x1b[PX^_]|[\x90\x98\x9e\x9f])[^\x1b\x9c]*(?:\x1b\\|\x9c)?"  # DCS/SOS/PM/APC
    r"|\x1b[ -/]*[0-~]?"  # other ESC sequences (and a lone ESC)
    r")"
)
# Every other C0/C1 control except tab and newline, and DEL.
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


_C1_INTRODUCER_RE = re.compile(r"[\x90\x98\x9b\x9d\x9e\x9f]")


def _has_escape(text: str) -> bool:
    # One `in` test for ESC; `isascii()` is O(1) in CPython, so the 8-bit introducers (never in
    # ASCII) are searched for only in non-ASCII text. Status lines pay two cheap checks.
    return "\x1b" in text or (not text.isascii() and _C1_INTRODUCER_RE.search(text) is not None)


def strip_escapes(text: str) -> str:
    """``text`` without terminal escape sequences (CSI colours, OSC titles, DCS, ...)."""
    if not _has_escape(text):
        return text
    return _ESCAPE_RE.sub("", text)


def sanitize_for_terminal(text: str) -> str:
    """Remote text made safe to print or show: escapes removed, other controls made visible.

    The one place dflashctl cleans what comes from a host (status.log, pane captures, error
    lines) before it reaches the operator's terminal or the TUI: escape sequences are dropped,
    any other control character (CR, BS, NUL, BEL, C1 ...) becomes a visible ``\\xNN``; tab and
    newline stay.
    """
    text = strip_escapes(text)
    return _CONTROL_RE.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class StatusEvent(BaseModel):
    """One periodic status report; ``None`` where the line shows ``---`` (or ``???`` for ETA)."""

    model_config = _FROZEN

    kind: Literal["status"] = "status"
    elapsed_min: int = Field(ge=0)
    step: int = Field(ge=0)
    loss: float | None = None
    acc: float | None = None
    streak: float | None = None
    lr: float | None = None
    noise: float | None = None
    tgt_bps: float | None = None
    dft_bps: float | None = None
    ktok_s: float | None = None
    q_pre: list[int] = Field(default_factory=list)
    q_hs: list[int] = Field(default_factory=list)
    epoch: float | None = None
    eta_s: float | None = None
    extra: dict[str, str] = Field(default_factory=dict)

    @field_validator("extra")
    @classmethod
    def _extra_is_printable(cls, v: dict[str, str]) -> dict[str, str]:
        # A key or value with whitespace or '=' could not be read back from the line.
        for k, val in v.items():
            if not k or _BAD_KEY.search(k) or not val or _BAD_VALUE.search(val) or k == "|":
                raise ValueError(f"extra field {k!r}={val!r} is not a single key=value token")
        return v


class PhaseEvent(BaseModel):
    """A lifecycle line such as ``Starting pipeline...``; ``detail`` is any text after it."""

    model_config = _FROZEN

    kind: Literal["phase"] = "phase"
    phase: str
    detail: str = ""
    text: str


class CheckpointEvent(BaseModel):
    """``Checkpoint saved: step=1200 path=/run/checkpoints/step-00001200.pt``."""

    model_config = _FROZEN

    kind: Literal["checkpoint"] = "checkpoint"
    step: int
    path: str
    text: str


class ErrorEvent(BaseModel):
    """``ERROR: <one-line message>``; the traceback, if any, follows as raw lines."""

    model_config = _FROZEN

    kind: Literal["error"] = "error"
    message: str
    text: str


class EvalEvent(BaseModel):
    """One held-out evaluation: ``Eval: step=400 tau=3.214 loss=1.2345 ... best=400``.

    ``acc_at[k-1]`` is acc@k, the share of blocks whose first k drafted tokens all match;
    ``tau`` is the serving walk's simulated tau, ``tau_exp`` the tau expected from acc@k and
    ``tau_real`` real greedy speculative tau on the configured prompts; ``best`` the step of the
    best checkpoint so far.  ``extra`` holds any ``key=value`` after ``" | "`` (rows, cost).
    """

    model_config = _FROZEN

    kind: Literal["eval"] = "eval"
    step: int = Field(ge=0)
    tau: float | None = None
    tau_real: float | None = None
    loss: float | None = None
    acc: float | None = None
    acc_at: list[float] = Field(default_factory=list)
    tau_exp: float | None = None
    best: int | None = Field(default=None, ge=0)
    extra: dict[str, str] = Field(default_factory=dict)

    @field_validator("extra")
    @classmethod
    def _extra_is_printable(cls, v: dict[str, str]) -> dict[str, str]:
        return StatusEvent._extra_is_printable(v)


class RawLine(BaseModel):
    """Anything else (library warnings, tracebacks, truncated captures)."""

    model_config = _FROZEN

    kind: Literal["raw"] = "raw"
    text: str


Event = Annotated[
    StatusEvent | EvalEvent | PhaseEvent | CheckpointEvent | ErrorEvent | RawLine,
    Field(discriminator="kind"),
]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)

_BAD_KEY = re.compile(r"[\s=|]")
_BAD_VALUE = re.compile(r"\s")

# --------------------------------------------------------------------------- formatting


def _fmt(value: float | None, spec: str) -> str:
    return MISSING if value is None else format(value, spec)


def format_eta(seconds: float | None) -> str:
    """``17m`` under an hour, ``4.2h`` under a day, else ``12.3d``; ``???`` when unknown.

    The unit is chosen from the *rounded* text so that parse_eta(format_eta(x)) formats back to
    the same string (59.7 minutes prints ``1.0h``, never ``60m``).
    """
    if seconds is None or not math.isfinite(seconds):
        return UNKNOWN_ETA
    seconds = max(0.0, float(seconds))
    minutes = f"{seconds / 60:.0f}"
    if int(minutes) < 60:
        return f"{minutes}m"
    hours = f"{seconds / 3600:.1f}"
    if float(hours) < 24:
        return f"{hours}h"
    return f"{seconds / 86400:.1f}d"


_ETA_UNITS = {"m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_eta(text: str) -> float | None:
    """Inverse of format_eta (``???`` or anything unreadable -> None)."""
    if len(text) < 2 or text[-1] not in _ETA_UNITS:
        return None
    try:
        value = float(text[:-1])
    except ValueError:
        return None
    return value * _ETA_UNITS[text[-1]] if math.isfinite(value) else None


def _fmt_queue(depths: Iterable[int]) -> str:
    return "[" + ", ".join(str(d) for d in depths) + "]"


def format_status_line(ev: StatusEvent) -> str:
    """Render a StatusEvent exactly per the contract (one line, no trailing newline)."""
    line = (
        f"[{ev.elapsed_min}m] step={ev.step} loss={_fmt(ev.loss, '.4f')}"
        f" acc={_fmt(ev.acc, '.3f')} streak={_fmt(ev.streak, '.1f')}"
        f" lr={_fmt(ev.lr, '.2e')} noise={_fmt(ev.noise, '.4f')}"
        f" | tgt={_fmt(ev.tgt_bps, '.2f')}b/s dft={_fmt(ev.dft_bps, '.2f')}b/s"
        f" ({_fmt(ev.ktok_s, '.1f')}Ktok/s)"
        f" | q_pre={_fmt_queue(ev.q_pre)} q_hs={_fmt_queue(ev.q_hs)}"
        f" | epoch~{_fmt(ev.epoch, '.2f')} ETA={format_eta(ev.eta_s)}"
    )
    if ev.extra:
        line += " | " + " ".join(f"{k}={v}" for k, v in ev.extra.items())
    return line


def format_phase_line(phase: str, detail: str = "") -> str:
    """The line for a lifecycle phase (one of PHASE_TEXTS)."""
    text = PHASE_TEXTS[phase]
    return f"{text} {detail}" if detail else text


def format_checkpoint_line(step: int, path: str) -> str:
    """The line printed after a checkpoint is durably on disk."""
    return f"{CHECKPOINT_PREFIX}step={step} path={path}"


def format_error_line(message: str) -> str:
    """One error line; newlines in the message are folded so the line stays one line."""
    return ERROR_PREFIX + " ".join(message.split())


def format_eval_line(ev: EvalEvent) -> str:
    """Render an EvalEvent per the contract (one line, no trailing newline)."""
    parts = [f"{EVAL_PREFIX}step={ev.step} tau={_fmt(ev.tau, '.3f')}"]
    if ev.tau_real is not None:
        parts.append(f"tau_real={ev.tau_real:.3f}")
    parts.append(f"loss={_fmt(ev.loss, '.4f')} acc={_fmt(ev.acc, '.3f')}")
    parts.extend(f"acc@{k}={a:.3f}" for k, a in enumerate(ev.acc_at, 1))
    parts.append(
        f"tau_exp={_fmt(ev.tau_exp, '.3f')} best={MISSING if ev.best is None else ev.best}"
    )
    line = " ".join(parts)
    if ev.extra:
        line += " | " + " ".join(f"{k}={v}" for k, v in ev.extra.items())
    return line


def format_bucket_losses(losses: Iterable[float | None]) -> str:
    """The ``loss_b`` extra's value: ``[1.2345,2.0001,---]`` (no blanks: one token)."""
    return "[" + ",".join(_fmt(x, ".4f") for x in losses) + "]"


def parse_bucket_losses(text: str) -> list[float | None] | None:
    """Inverse of format_bucket_losses; None when ``text`` is not such a list."""
    if len(text) < 2 or text[0] != "[" or text[-1] != "]" or _BAD_VALUE.search(text):
        return None
    if text == "[]":
        return []
    try:
        values = [None if x == MISSING else float(x) for x in text[1:-1].split(",")]
    except ValueError:
        return None
    return values if all(v is None or math.isfinite(v) for v in values) else None


def format_line(ev: Event) -> str:
    """Render any event back to its line."""
    if isinstance(ev, StatusEvent):
        return format_status_line(ev)
    if isinstance(ev, EvalEvent):
        return format_eval_line(ev)
    return ev.text


# --------------------------------------------------------------------------- parsing

# Fields are captured loosely and validated by float()/int(): a regex that spelled out every
# number grammar was 4x slower, and the parser must sustain >= 100k lines/s.  Possessive
# quantifiers (no backtracking state kept) make the match about 20% faster; a field followed by
# a unit ("2.56b/s", "31.4Ktok/s") therefore stops at the unit's first letter, which no number
# float() accepts contains.
_F = r"([^ ]++)"
_QUEUE = r"\[((?:\d++(?:, \d++)*+)?)\]"
_STATUS_HEAD = (
    r"\[(\d++)m\] step=(\d++)"
    rf" loss={_F} acc={_F} streak={_F} lr={_F} noise={_F}"
    r" \| tgt=([^ b]++)b/s dft=([^ b]++)b/s \(([^ K]++)Ktok/s\)"
    rf" \| q_pre={_QUEUE} q_hs={_QUEUE} \| epoch~{_F} ETA={_F}"
)
# The general form: any tail after the ETA, checked by _general_extra.
_STATUS_RE = re.compile(_STATUS_HEAD + r"(.*)")
# The fast form: no tail, or one " | k=v k=v ..." group whose values hold no '='.  Its first
# branch is the tail the trainer itself prints (the stage waits, the bottleneck, then gnorm once
# a step has run), captured field by field so the hot path builds that dict from a literal.
# Every line it matches, the general form parses to the same event (a test checks this); every
# other line takes the general path.  '\n' is excluded because (.*) excludes it.
_FAST_VALUE = r"[^ =\n]++"
_FAST_PAIR = rf"[^ =|\n]++={_FAST_VALUE}"
TRAINER_EXTRA_KEYS = (*STAGE_WAIT_KEYS, BOTTLENECK_KEY)
_TRAINER_TAIL = (
    r" \| "
    + " ".join(f"{k}=({_FAST_VALUE})" for k in TRAINER_EXTRA_KEYS)
    + rf"(?: {GNORM_KEY}=({_FAST_VALUE}))?"
    + rf"(?: {TAU_KEY}=({_FAST_VALUE}))?(?: {BUCKET_LOSS_KEY}=({_FAST_VALUE}))?"
)
_STATUS_FAST_RE = re.compile(
    _STATUS_HEAD + rf"(?:{_TRAINER_TAIL}|(?: \| ({_FAST_PAIR}(?: {_FAST_PAIR})*))?)"
)
_STATUS_START_RE = re.compile(r"\[\d+m\] step=")
_CHECKPOINT_RE = re.compile(r"step=(\d+) path=(.+)")
# The eval line after its prefix; acc@k pairs are checked for k = 1, 2, ... by _parse_eval.
_EVAL_RE = re.compile(
    rf"step=(\d++) tau={_F}(?: tau_real={_F})? loss={_F} acc={_F}((?: acc@\d++=[^ ]++)*+)"
    rf" tau_exp={_F} best=(\d++|{MISSING})(.*)"
)
_ACC_AT_RE = re.compile(r" acc@(\d+)=([^ ]+)")
_PHASE_ITEMS = tuple(PHASE_TEXTS.items())


_PAIR_RE = re.compile(r" ([^ =|]+)=([^ ]+)")


def _general_extra(tail: str) -> dict[str, str] | None:
    # One or more " | k=v k=v" groups (merged); every space-separated token must be a pair.
    pairs = _PAIR_RE.findall(tail)
    if not tail.startswith(" | ") or len(pairs) != tail.count(" ") - tail.count(" | "):
        return None
    return dict(pairs)


class _Memo(dict):  # type: ignore[type-arg]
    """A bounded text -> value memo for the fixed-precision fields of status lines.

    They repeat from line to line (``acc=0.613``, ``noise=0.1000``, queue depths, ``ETA=9.8d``:
    a few thousand distinct texts), and a dict hit costs a fraction of float()/int().  When full
    it starts over, so memory stays bounded whatever the input.  ``convert`` may raise ValueError
    (nothing is stored then); NaN is never stored, so every parse gets its own NaN, as float() does.
    """

    __slots__ = ("_convert", "_preset")

    def __init__(self, convert, preset: dict[str, object]) -> None:
        super().__init__(preset)
        self._convert = convert
        self._preset = preset

    def __missing__(self, text: str) -> object:
        value = self._convert(text)
        if len(self) >= _MEMO_SIZE:
            self.clear()
            self.update(self._preset)
        if value == value:
            self[text] = value
        return value


_MEMO_SIZE = 16384


def _status_eta(text: str) -> float | None:
    """The ETA field's seconds; ValueError when the line cannot be a status line."""
    if text == UNKNOWN_ETA:
        return None
    unit = _ETA_UNITS.get(text[-1])
    eta = float(text[:-1]) * unit if unit else None
    if eta is None or not math.isfinite(eta):
        raise ValueError(f"bad ETA {text!r}")
    return eta


# '---' -> None; anything float() refuses raises ValueError (the line is then not a status line).
_FLOATS = _Memo(float, {MISSING: None})
_INTS = _Memo(int, {})
_ETAS = _Memo(_status_eta, {UNKNOWN_ETA: None})
_STATUS_FIELDS_SET = frozenset(StatusEvent.model_fields)
_new = object.__new__
# BaseModel's own attribute descriptors, called directly (the frozen model's __setattr__ refuses).
_set_dict, _set_fields_set, _set_extra, _set_private = (
    BaseModel.__dict__[name].__set__
    for name in (
        "__dict__",
        "__pydantic_fields_set__",
        "__pydantic_extra__",
        "__pydantic_private__",
    )
)


def _parse_status(
    line: str,
    _fast=_STATUS_FAST_RE.fullmatch,  # globals bound as locals: the hot path
    _general=_STATUS_RE.fullmatch,
    _float=_FLOATS.__getitem__,
    _small_int=_INTS.__getitem__,
    _eta=_ETAS.__getitem__,
    _map=map,
    _split=str.split,
    _repeat=repeat,
    _gnorm=GNORM_KEY,
    _tau=TAU_KEY,
    _loss_b=BUCKET_LOSS_KEY,
) -> StatusEvent | None:
    # Hot path (>= 100k lines/s for dflashctl's log replay): one regex that also checks the extra
    # pairs, memoised number fields, and the model built without validation.
    m = _fast(line)
    if m is not None:
        (el, step, loss, acc, streak, lr, noise, tgt, dft, ktok, q_pre, q_hs, epoch, eta,
         w_pre_out, w_tgt_in, w_tgt_out, w_dft_in, neck, gnorm, tau, loss_b,
         pairs) = m.groups()  # fmt: skip
        if w_pre_out is not None:  # the trainer's own tail, in TRAINER_EXTRA_KEYS order
            extra = {"w_pre_out": w_pre_out, "w_tgt_in": w_tgt_in, "w_tgt_out": w_tgt_out}
            extra["w_dft_in"] = w_dft_in
            extra["bottleneck"] = neck
            if gnorm is not None:
                extra[_gnorm] = gnorm
            if tau is not None:
                extra[_tau] = tau
            if loss_b is not None:
                extra[_loss_b] = loss_b
        elif pairs:  # the regex checked every token is key=value with exactly one '='
            extra = dict(_map(_split, pairs.split(" "), _repeat("=")))
        else:
            extra = {}
    else:
        m = _general(line)
        if m is None:
            return None
        el, step, loss, acc, streak, lr, noise, tgt, dft, ktok, q_pre, q_hs, epoch, eta, tail = (
            m.groups()
        )
        extra = _general_extra(tail) if tail else {}
        if extra is None:
            return None
    try:
        # float() also accepts forms the trainer never prints ("1_0", "infinity"): lenient.
        # loss takes most of its 4-digit values over a run: memoising it would only churn (lr has
        # 3 significant digits, so it repeats).  The regex already guarantees every type, and
        # pydantic's model_construct/validation would cost 4x the regex, so this sets exactly
        # the attributes model_construct sets; a test compares the result with validation.
        fields = {
            "kind": "status",
            "elapsed_min": _small_int(el),  # repeats for every line of the same minute
            "step": int(step),
            "loss": None if loss == MISSING else float(loss),
            "acc": _float(acc),
            "streak": _float(streak),
            "lr": _float(lr),
            "noise": _float(noise),
            "tgt_bps": _float(tgt),
            "dft_bps": _float(dft),
            "ktok_s": _float(ktok),
            "q_pre": list(_map(_small_int, q_pre.split(", "))) if q_pre else [],
            # one drafter per rank is the usual case: skip the split for a single depth
            "q_hs": (
                [_small_int(q_hs)]
                if q_hs and "," not in q_hs
                else list(_map(_small_int, q_hs.split(", ")))
                if q_hs
                else []
            ),
            "epoch": _float(epoch),
            "eta_s": _eta(eta),
            "extra": extra,
        }
    except ValueError:
        return None
    ev = _new(StatusEvent)
    _set_dict(ev, fields)
    _set_fields_set(ev, set(_STATUS_FIELDS_SET))  # one per event: model_copy adds to it
    _set_extra(ev, None)
    _set_private(ev, None)
    return ev


def _opt_float(text: str | None) -> float | None:
    return None if text is None or text == MISSING else float(text)


def _parse_eval(line: str) -> EvalEvent | None:
    """The EvalEvent of an ``Eval: ...`` line, or None when it is not one (never raises)."""
    m = _EVAL_RE.fullmatch(line, len(EVAL_PREFIX))
    if m is None:
        return None
    step, tau, tau_real, loss, acc, acc_at, tau_exp, best, tail = m.groups()
    pairs = _ACC_AT_RE.findall(acc_at)
    if [k for k, _ in pairs] != [str(k) for k in range(1, len(pairs) + 1)]:
        return None
    extra = _general_extra(tail) if tail else {}
    if extra is None:
        return None
    try:
        return EvalEvent(
            step=int(step),
            tau=_opt_float(tau),
            tau_real=_opt_float(tau_real),
            loss=_opt_float(loss),
            acc=_opt_float(acc),
            acc_at=[float(a) for _, a in pairs],
            tau_exp=_opt_float(tau_exp),
            best=None if best == MISSING else int(best),
            extra=extra,
        )
    except ValueError:  # float() or the model refused a field (pydantic errors are ValueErrors)
        return None


def parse_line(line: str) -> Event:
    """Parse one line (trailing newline allowed); never raises, unknown text -> RawLine.

    Terminal escapes (CSI colours, OSC titles, ...; what a colouring pager or ``capture-pane -e``
    adds) are stripped first, so a coloured status line parses like the plain one, and every
    event's ``text`` is the stripped line: safe to print, never carrying a remote escape.
    """
    try:
        line = line.rstrip("\r\n")
        if "\x1b" in line or (not line.isascii() and _C1_INTRODUCER_RE.search(line)):
            line = _ESCAPE_RE.sub("", line)  # _has_escape inlined: this is the hot path
        if line.startswith("["):
            status = _parse_status(line)
            if status is not None:
                return status
        elif line.startswith(CHECKPOINT_PREFIX):
            m = _CHECKPOINT_RE.fullmatch(line, len(CHECKPOINT_PREFIX))
            if m is not None:
                return CheckpointEvent(step=int(m.group(1)), path=m.group(2), text=line)
        elif line.startswith(ERROR_PREFIX):
            return ErrorEvent(message=line[len(ERROR_PREFIX) :], text=line)
        elif line.startswith(EVAL_PREFIX):
            evaluation = _parse_eval(line)
            if evaluation is not None:
                return evaluation
        else:
            for phase, text in _PHASE_ITEMS:
                if line == text:
                    return PhaseEvent(phase=phase, text=line)
                if line.startswith(text + " "):
                    return PhaseEvent(phase=phase, detail=line[len(text) + 1 :], text=line)
        return RawLine(text=line)
    except Exception:  # a parser for a live feed must never take the reader down
        return RawLine(text=str(line))


def _starts_event(line: str) -> bool:
    if _STATUS_START_RE.match(line) or line.startswith(
        (CHECKPOINT_PREFIX, ERROR_PREFIX, EVAL_PREFIX)
    ):
        return True
    return any(line.startswith(text) for text in PHASE_TEXTS.values())


def _is_report(line: str) -> bool:
    """A status or eval line's start: the lines that are long enough to wrap."""
    return _STATUS_START_RE.match(line) is not None or line.startswith(EVAL_PREFIX)


def _parses_as_report(line: str) -> bool:
    if line.startswith(EVAL_PREFIX):
        return _parse_eval(line) is not None
    return _parse_status(line) is not None


def _incomplete_status(line: str) -> bool:
    if line.startswith(EVAL_PREFIX):  # an eval line ends with its best= field
        return " best=" not in line or _parse_eval(line) is None
    if not _STATUS_START_RE.match(line):
        return False
    # Cheap test first: a status line without its ETA field cannot be complete.
    return " ETA=" not in line or _parse_status(line) is None


def _wrapped_in_extras(line: str, following: str) -> bool:
    # A row break at a blank inside the extras (before ` | k=v` or ` k=v`) leaves a status (or
    # eval) line that parses on its own; the next row starting with that blank proves the wrap
    # only if the joined line parses too.  (A break inside a token whose both halves read as a
    # complete line is ambiguous without the pane width.)
    return following.startswith(" ") and _is_report(line) and _parses_as_report(line + following)


def _infer_width(lines: list[str]) -> int | None:
    # A status line that only parses once joined proves the capture was wrapped; no row of a
    # capture is wider than the pane, so the widest row is the width (one row short when every
    # wrap happened at a blank that tmux trimmed: pass `width` explicitly to be exact).
    wrapped = any(_incomplete_status(ln) for ln in lines) or any(
        _wrapped_in_extras(a, b) for a, b in pairwise(lines)
    )
    return max(len(ln) for ln in lines) if wrapped else None


def _join_wrapped(lines: list[str], width: int | None) -> list[str]:
    logical: list[str] = []
    i = 0
    while i < len(lines):
        current = lines[i]
        last = current
        is_status = _is_report(current)
        i += 1
        while i < len(lines) and lines[i] and not _starts_event(lines[i]):
            if width is not None and len(last) == width:
                sep = ""
            elif is_status and width is not None and len(last) == width - 1:
                sep = " "  # tmux trimmed the trailing blank of a row that wrapped at a space
            elif is_status and width is None and _incomplete_status(current):
                sep = ""
            else:
                break
            last = lines[i]
            current += sep + last
            i += 1
        logical.append(current)
    return logical


def parse_text(text: str, width: int | None = None) -> list[Event]:
    """Parse a block of output, re-joining rows a terminal wrapped at ``width`` columns.

    With ``width=None`` the width is inferred from status lines that only parse once joined.
    Terminal escapes are stripped as in `parse_line` (``text`` fields hold the stripped rows).
    A truncated last line (a capture cut mid-line) comes back as a RawLine; blank rows are dropped.
    """
    # Escapes are stripped row by row (an unterminated OSC must not swallow the next rows), and
    # before joining: the pane width counts visible columns, not escape bytes.
    lines = (
        [strip_escapes(ln) for ln in text.splitlines()] if _has_escape(text) else text.splitlines()
    )
    if width is None:
        width = _infer_width(lines)
    # Blank rows (tmux pads captures with them) carry no event.
    return [parse_line(ln) for ln in _join_wrapped(lines, width) if ln.strip()]
