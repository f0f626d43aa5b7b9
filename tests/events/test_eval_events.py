"""The eval line and the status line's `tau=` / `loss_b=` extras (issue 13 item 4)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.events import (
    BUCKET_LOSS_KEY,
    EVENT_ADAPTER,
    TAU_KEY,
    EvalEvent,
    RawLine,
    StatusEvent,
    format_bucket_losses,
    format_eval_line,
    format_line,
    format_status_line,
    grammar,
    parse_bucket_losses,
    parse_line,
    parse_text,
)
from trainer.events.status import STATUS_RE

EVAL_LINE = (
    "Eval: step=400 tau=3.214 loss=1.2345 acc=0.613 acc@1=0.912 acc@2=0.801 acc@3=0.655"
    " tau_exp=3.368 best=400 | rows=256 eval_s=4.1 share=2.3%"
)
TRAINER_STATUS = (
    "[12m] step=400 loss=1.2345 acc=0.613 streak=2.4 lr=5.90e-04 noise=0.0000 | tgt=3.10b/s"
    " dft=3.05b/s (8.2Ktok/s) | q_pre=[4, 4, 3] q_hs=[2] | epoch~0.41 ETA=1.2h"
    " | w_pre_out=0.0% w_tgt_in=1.2% w_tgt_out=30.5% w_dft_in=2.1% bottleneck=drafter"
    " gnorm=0.812 tau=3.214 loss_b=[1.9021,1.3012,0.8123,---]"
)


def test_eval_line_parses_into_typed_fields() -> None:
    ev = parse_line(EVAL_LINE)
    assert isinstance(ev, EvalEvent)
    assert ev.step == 400 and ev.best == 400
    assert ev.tau == pytest.approx(3.214) and ev.tau_exp == pytest.approx(3.368)
    assert ev.loss == pytest.approx(1.2345) and ev.acc == pytest.approx(0.613)
    assert ev.acc_at == pytest.approx([0.912, 0.801, 0.655])
    assert ev.tau_real is None
    assert ev.extra == {"rows": "256", "eval_s": "4.1", "share": "2.3%"}
    assert format_line(ev) == EVAL_LINE


def test_eval_line_with_real_tau_and_no_best_yet() -> None:
    line = "Eval: step=0 tau=1.000 tau_real=1.020 loss=--- acc=--- tau_exp=--- best=---"
    ev = parse_line(line)
    assert isinstance(ev, EvalEvent)
    assert ev.tau_real == pytest.approx(1.02) and ev.best is None and ev.acc_at == []
    assert (ev.loss, ev.acc, ev.tau_exp) == (None, None, None)
    assert format_eval_line(ev) == line


@pytest.mark.parametrize(
    "line",
    [
        "Eval: step=4 tau=1.0 loss=1 acc=1 acc@2=0.5 tau_exp=1 best=4",  # acc@k not from 1
        "Eval: step=4 tau=1.0 loss=1 acc=1 acc@1=0.5 acc@1=0.5 tau_exp=1 best=4",  # repeated
        "Eval: step=4 tau=x loss=1 acc=1 tau_exp=1 best=4",  # not a number
        "Eval: step=4 tau=1.0 loss=1 acc=1 tau_exp=1",  # no best: cut off
        "Eval: step=4 tau=1.0 loss=1 acc=1 tau_exp=1 best=4 | k",  # extra is not key=value
        "Eval: step=-4 tau=1.0 loss=1 acc=1 tau_exp=1 best=4",
        "Eval: step=4 tau=1.0 loss=1 acc=1 tau_exp=1 best=4 trailing",
    ],
)
def test_malformed_eval_lines_are_raw(line: str) -> None:
    ev = parse_line(line)
    assert isinstance(ev, RawLine) and ev.text == line


def test_eval_events_serialise_through_the_discriminated_union() -> None:
    ev = parse_line(EVAL_LINE)
    assert EVENT_ADAPTER.validate_json(EVENT_ADAPTER.dump_json(ev)) == ev


def test_eval_extra_with_whitespace_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="single key=value"):
        EvalEvent(step=1, extra={"rows": "2 3"})


_token = st.text(
    alphabet=st.characters(codec="ascii", exclude_characters=" \t\n\r\x0b\x0c=|"),
    min_size=1,
    max_size=8,
).filter(lambda s: s.isprintable())


def _opt(lo: float, hi: float) -> st.SearchStrategy[float | None]:
    return st.one_of(st.none(), st.floats(min_value=lo, max_value=hi))


eval_events = st.builds(
    EvalEvent,
    step=st.integers(0, 10**9),
    tau=_opt(1, 16),
    tau_real=_opt(1, 16),
    loss=_opt(0, 1e4),
    acc=_opt(0, 1),
    acc_at=st.lists(st.floats(0, 1), max_size=15),
    tau_exp=_opt(1, 16),
    best=st.one_of(st.none(), st.integers(0, 10**9)),
    extra=st.dictionaries(_token, _token, max_size=4),
)


@settings(max_examples=300)
@given(eval_events)
def test_eval_line_round_trip(ev: EvalEvent) -> None:
    """format(parse(format(ev))) == format(ev); the structure survives exactly."""
    line = format_eval_line(ev)
    parsed = parse_line(line)
    assert isinstance(parsed, EvalEvent), line
    assert format_eval_line(parsed) == line
    assert (parsed.step, parsed.best, len(parsed.acc_at), parsed.extra) == (
        ev.step,
        ev.best,
        len(ev.acc_at),
        ev.extra,
    )
    assert (parsed.tau_real is None) == (ev.tau_real is None)


@given(eval_events, st.integers(1, 400))
def test_every_truncation_of_an_eval_line_is_never_a_wrong_event(ev: EvalEvent, cut: int) -> None:
    """A cut eval line is raw, or (cut inside the last number/extra) an eval of the same step."""
    line = format_eval_line(ev)
    parsed = parse_line(line[: min(cut, len(line) - 1)])
    assert isinstance(parsed, RawLine | EvalEvent)
    if isinstance(parsed, EvalEvent):
        full = parse_line(line)
        assert isinstance(full, EvalEvent)
        assert (parsed.step, parsed.acc_at) == (full.step, full.acc_at)


@given(st.text(max_size=300).map(lambda t: "Eval: " + t))
def test_parse_line_never_raises_on_eval_like_text(text: str) -> None:
    ev = parse_line(text)
    assert ev.kind in {"eval", "raw"}
    parse_text(text)


# --------------------------------------------------------------------------- status extras


def test_tau_and_bucket_losses_parse_in_print_order() -> None:
    """The trainer's own tail with tau and loss_b comes back in the order it was printed."""
    ev = parse_line(TRAINER_STATUS)
    assert isinstance(ev, StatusEvent)
    assert list(ev.extra)[-3:] == ["gnorm", TAU_KEY, BUCKET_LOSS_KEY]
    assert ev.extra[TAU_KEY] == "3.214"
    assert parse_bucket_losses(ev.extra[BUCKET_LOSS_KEY]) == [1.9021, 1.3012, 0.8123, None]
    assert format_status_line(ev) == TRAINER_STATUS
    # the line's tail, read on its own, holds the same extras
    general = STATUS_RE.fullmatch(TRAINER_STATUS)
    assert general is not None and grammar.parse_extras(general.groups()[-1]) == ev.extra


def test_tau_without_gnorm_and_extras_after_loss_b_still_parse() -> None:
    base = TRAINER_STATUS.split(" gnorm=")[0]
    for tail in (" tau=2.000", " loss_b=[1.0000]", " tau=2.000 loss_b=[1.0000] nonfinite=3"):
        ev = parse_line(base + tail)
        assert isinstance(ev, StatusEvent), tail
        assert format_status_line(ev) == base + tail


@given(st.lists(st.one_of(st.none(), st.floats(0, 1e4)), max_size=64))
def test_bucket_losses_round_trip(losses: list[float | None]) -> None:
    text = format_bucket_losses(losses)
    assert " " not in text
    back = parse_bucket_losses(text)
    assert back is not None and len(back) == len(losses)
    assert format_bucket_losses(back) == text


@pytest.mark.parametrize("text", ["", "[", "1,2", "[1,,2]", "[a]", "[nan]", "[1.0 ,2]", "[inf]"])
def test_bad_bucket_losses_are_none(text: str) -> None:
    assert parse_bucket_losses(text) is None


def test_status_tau_extra_value_is_a_number() -> None:
    ev = parse_line(TRAINER_STATUS)
    assert isinstance(ev, StatusEvent)
    assert math.isclose(float(ev.extra[TAU_KEY]), 3.214)
