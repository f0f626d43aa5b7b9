"""The status-line contract: formatter, parser, round trips."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from trainer import events
from trainer.events import (
    EVENT_ADAPTER,
    STAGE_WAIT_KEYS,
    CheckpointEvent,
    ErrorEvent,
    PhaseEvent,
    RawLine,
    StatusEvent,
    format_checkpoint_line,
    format_error_line,
    format_eta,
    format_line,
    format_phase_line,
    format_status_line,
    grammar,
    parse_eta,
    parse_line,
    parse_status_line,
    parse_text,
)

FIXTURES = Path(__file__).parent / "fixtures"

SEED_LINE_1 = (
    "[0m] step=0 loss=--- acc=--- streak=--- lr=--- noise=0.1000 | tgt=0.00b/s dft=0.00b/s"
    " (0.0Ktok/s) | q_pre=[4, 4, 3, 3, 2, 2] q_hs=[0] | epoch~0.00 ETA=???"
)
SEED_LINE_2 = (
    "[0m] step=0 loss=1.3167 acc=0.000 streak=0.0 lr=6.00e-04 noise=0.1000 | tgt=0.30b/s"
    " dft=0.05b/s (1.9Ktok/s) | q_pre=[8, 6, 6, 5, 4, 4] q_hs=[4] | epoch~0.00 ETA=10.9d"
)


def test_seed_capture_parses() -> None:
    """The real capture from the seed run, as `capture-pane -J` gives it (tmux joins the rows it
    wrapped): two status lines and a truncated third."""
    text = (FIXTURES / "seed_capture_joined.txt").read_text()
    events = parse_text(text)
    kinds = [e.kind for e in events]
    assert kinds == ["phase", "phase", "status", "status", "raw"]
    assert [e.phase for e in events[:2] if isinstance(e, PhaseEvent)] == ["starting", "running"]
    first, second = events[2], events[3]
    assert isinstance(first, StatusEvent) and isinstance(second, StatusEvent)
    assert first.loss is None and first.lr is None and first.eta_s is None
    assert first.q_pre == [4, 4, 3, 3, 2, 2] and first.q_hs == [0]
    assert second.loss == pytest.approx(1.3167) and second.lr == pytest.approx(6e-4)
    assert second.ktok_s == pytest.approx(1.9)
    assert second.eta_s == pytest.approx(10.9 * 86400)
    assert format_status_line(first) == SEED_LINE_1
    assert format_status_line(second) == SEED_LINE_2
    assert isinstance(events[4], RawLine)
    assert events[4].text.startswith("[1m] step=2 loss=6.4079")  # truncated -> raw, kept


def test_seed_status_line_round_trips() -> None:
    """format(parse(line)) == line on the seed's own lines."""
    for line in (SEED_LINE_1, SEED_LINE_2):
        ev = parse_line(line)
        assert isinstance(ev, StatusEvent)
        assert format_status_line(ev) == line


def test_extra_fields_are_kept_in_order() -> None:
    """Fields appended after the contract's last one land in `extra` and print back."""
    line = SEED_LINE_2 + " | w_dft_in=1.5% bottleneck=drafter gnorm=0.812"
    ev = parse_line(line)
    assert isinstance(ev, StatusEvent)
    assert ev.extra == {"w_dft_in": "1.5%", "bottleneck": "drafter", "gnorm": "0.812"}
    assert list(ev.extra) == ["w_dft_in", "bottleneck", "gnorm"]
    assert format_status_line(ev) == line


def test_extra_with_whitespace_is_rejected_at_construction() -> None:
    """The formatter could not print it as one token, so the model refuses it."""
    with pytest.raises(ValueError, match="extra field"):
        StatusEvent(elapsed_min=0, step=0, extra={"note": "two words"})


def test_other_line_kinds_round_trip() -> None:
    """Phase, checkpoint and error lines come from one definition shared with the trainer."""
    cases = [
        (format_phase_line("starting"), PhaseEvent),
        (format_phase_line("running"), PhaseEvent),
        (format_phase_line("stopping", "(SIGTERM)"), PhaseEvent),
        (format_checkpoint_line(1200, "/r/checkpoints/step-00001200.pt"), CheckpointEvent),
        (format_error_line("stage target[0] failed:\n ValueError: boom"), ErrorEvent),
        ("Traceback (most recent call last):", RawLine),
    ]
    for line, cls in cases:
        ev = parse_line(line)
        assert isinstance(ev, cls), line
        assert format_line(ev) == line
    ck = parse_line(format_checkpoint_line(1200, "/r/c k/step.pt"))
    assert isinstance(ck, CheckpointEvent) and ck.step == 1200 and ck.path == "/r/c k/step.pt"
    err = parse_line(format_error_line("a\nb"))
    assert isinstance(err, ErrorEvent) and err.message == "a b"
    stop = parse_line("Stopping pipeline... (SIGTERM)")
    assert isinstance(stop, PhaseEvent) and stop.phase == "stopping" and stop.detail == "(SIGTERM)"


def test_events_serialise_through_the_discriminated_union() -> None:
    """The TUI may ship events as JSON; the `kind` tag restores the right class."""
    for line in (SEED_LINE_2, "Starting pipeline...", "hello"):
        ev = parse_line(line)
        again = EVENT_ADAPTER.validate_json(EVENT_ADAPTER.dump_json(ev))
        assert type(again) is type(ev) and format_line(again) == line


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "???"),
        (float("inf"), "???"),
        (0, "0m"),
        (1020, "17m"),
        (3582, "1.0h"),
        (4.2 * 3600, "4.2h"),
        (86300, "1.0d"),
        (12.3 * 86400, "12.3d"),
        (-5, "0m"),
    ],
)
def test_format_eta(seconds: float | None, text: str) -> None:
    """ETA units switch on the rounded value (never `60m` or `24.0h`)."""
    assert format_eta(seconds) == text


@given(st.one_of(st.none(), st.just(float("nan")), st.floats(min_value=-10, max_value=1e9)))
def test_eta_round_trips(seconds: float | None) -> None:
    """Any printed ETA parses back to a value that prints the same."""
    text = format_eta(seconds)
    assert format_eta(parse_eta(text)) == text


def _opt_floats(lo: float, hi: float) -> st.SearchStrategy[float | None]:
    return st.one_of(st.none(), st.floats(min_value=lo, max_value=hi))


_token = st.text(
    alphabet=st.characters(codec="ascii", exclude_characters=" \t\n\r\x0b\x0c=|"),
    min_size=1,
    max_size=8,
).filter(lambda s: s.isprintable())

status_events = st.builds(
    StatusEvent,
    elapsed_min=st.integers(0, 100_000),
    step=st.integers(0, 10**9),
    loss=_opt_floats(0, 1e4),
    acc=_opt_floats(0, 1),
    streak=_opt_floats(0, 16),
    lr=_opt_floats(0, 1),
    noise=_opt_floats(0, 1),
    tgt_bps=_opt_floats(0, 1e5),
    dft_bps=_opt_floats(0, 1e5),
    ktok_s=_opt_floats(0, 1e6),
    q_pre=st.lists(st.integers(0, 999), max_size=12),
    q_hs=st.lists(st.integers(0, 999), max_size=8),
    epoch=_opt_floats(0, 100),
    eta_s=_opt_floats(0, 1e9),
    extra=st.one_of(
        st.dictionaries(_token, _token, max_size=4),
        # what the trainer prints (the fast path's own branch), sometimes with more pairs after
        st.builds(
            lambda values, gnorm, tau, loss_b, more: {
                **dict(zip(events.TRAINER_EXTRA_KEYS, values, strict=True)),
                **({"gnorm": gnorm} if gnorm else {}),
                **({events.TAU_KEY: tau} if tau else {}),
                **({events.BUCKET_LOSS_KEY: loss_b} if loss_b else {}),
                **more,
            },
            st.lists(_token, min_size=5, max_size=5),
            st.one_of(st.none(), _token),
            st.one_of(st.none(), _token),
            st.one_of(
                st.none(),
                _token,
                st.lists(st.one_of(st.none(), st.floats(0, 20)), max_size=8).map(
                    events.format_bucket_losses
                ),
            ),
            st.dictionaries(_token, _token, max_size=2),
        ),
    ),
)


@settings(max_examples=300)
@given(status_events)
def test_status_line_round_trip(ev: StatusEvent) -> None:
    """format(parse(format(ev))) == format(ev), and parsing keeps the structure exactly."""
    line = format_status_line(ev)
    parsed = parse_line(line)
    assert isinstance(parsed, StatusEvent), line
    assert format_status_line(parsed) == line
    assert (parsed.step, parsed.q_pre, parsed.q_hs, parsed.extra) == (
        ev.step,
        ev.q_pre,
        ev.q_hs,
        ev.extra,
    )
    assert (parsed.loss is None) == (ev.loss is None)


@given(st.text(max_size=300))
def test_parse_line_never_raises(text: str) -> None:
    """Arbitrary text (including control characters) yields an event, never an exception."""
    ev = parse_line(text)
    assert ev.kind in {"status", "eval", "phase", "checkpoint", "error", "raw"}
    parse_text(text)


@given(st.integers(1, len(SEED_LINE_2) - 1))
def test_every_truncation_of_a_status_line_is_raw(cut: int) -> None:
    """A status line cut anywhere is never mistaken for a (wrong) status event."""
    ev = parse_line(SEED_LINE_2[:cut])
    assert not isinstance(ev, StatusEvent)


@given(status_events)
def test_constructed_status_equals_validated(ev: StatusEvent) -> None:
    """The parser's validation-free construction yields the same model validation would."""
    parsed = parse_line(format_status_line(ev))
    assert isinstance(parsed, StatusEvent)
    validated = StatusEvent.model_validate(parsed.model_dump())
    assert parsed == validated
    assert parsed.model_dump_json() == validated.model_dump_json()


# The status line as first specified: every field loose, any tail.  Kept apart from the parser's
# generated grammar so that the comparison below checks it against the plain regex.
_REFERENCE_RE = re.compile(
    r"\[(\d+)m\] step=(\d+) loss=([^ ]+) acc=([^ ]+) streak=([^ ]+) lr=([^ ]+) noise=([^ ]+)"
    r" \| tgt=([^ ]+)b/s dft=([^ ]+)b/s \(([^ ]+)Ktok/s\)"
    r" \| q_pre=\[((?:\d+(?:, \d+)*)?)\] q_hs=\[((?:\d+(?:, \d+)*)?)\]"
    r" \| epoch~([^ ]+) ETA=([^ ]+)(.*)"
)


def _reference_parse(line: str) -> StatusEvent | None:
    """The reference status parser: one loose regex, findall for the extras."""
    m = _REFERENCE_RE.fullmatch(line)
    if m is None:
        return None
    g = m.groups()
    try:
        eta = grammar.strict_eta(g[13])
        floats = [None if x == "---" else float(x) for x in (*g[2:10], g[12])]
    except ValueError:
        return None
    extra = grammar.parse_extras(g[14]) if g[14] else {}
    if extra is None:
        return None
    loss, acc, streak, lr, noise, tgt, dft, ktok, epoch = floats
    return StatusEvent.model_construct(
        kind="status",
        elapsed_min=int(g[0]),
        step=int(g[1]),
        loss=loss,
        acc=acc,
        streak=streak,
        lr=lr,
        noise=noise,
        tgt_bps=tgt,
        dft_bps=dft,
        ktok_s=ktok,
        q_pre=[int(x) for x in g[10].split(", ")] if g[10] else [],
        q_hs=[int(x) for x in g[11].split(", ")] if g[11] else [],
        epoch=epoch,
        eta_s=eta,
        extra=extra,
    )


# The last six carry the unit the tuned regex stops at ("dft=2.5b/s", "(1.5Ktok/s)") or near misses.
_odd_number = st.sampled_from(
    [
        *("---", "nan", "inf", "-inf", "1_0", "1e999", "x", "1.5", "0.0"),
        *("2.5b/s", "1bb/s", "b/s", "1.5Ktok/s)", "1KKtok/s)", "---Ktok/s)"),
    ]
)
# Tokens near the key=value shape: empty key or value, '|' in the key, a second '=', tab, newline.
_near = st.text(alphabet="ab|=-%\t\n", max_size=3)
_near_pair = st.one_of(st.tuples(_near, _near).map("=".join), _near)
_odd_tail = st.lists(_near_pair, min_size=1, max_size=3).map(" ".join)


_SEED_EVENT = StatusEvent(elapsed_min=3, step=7, q_pre=[1, 2])
_TRAINER_TAIL = " | w_pre_out=1.0% w_tgt_in=2.0% w_tgt_out=3.0% w_dft_in=4.0% bottleneck=target"


@settings(max_examples=200)
@given(
    status_events,
    st.lists(
        st.tuples(st.sampled_from(["loss=", "acc=", "noise=", "dft=", "(", "epoch~"]), _odd_number)
    ),
    # a new " | " group, or more tokens continuing the line's own extras (if any)
    st.one_of(st.just(""), _odd_tail.map(lambda t: " | " + t), _odd_tail.map(lambda t: " " + t)),
)
@example(ev=_SEED_EVENT, subs=[], tail=" | a|=b")
@example(ev=_SEED_EVENT, subs=[], tail=" | a=b\n")
@example(ev=_SEED_EVENT, subs=[], tail=" | a=b\tc")
@example(ev=_SEED_EVENT, subs=[], tail=" | a==b")
@example(ev=_SEED_EVENT, subs=[], tail=" | =b")
@example(ev=_SEED_EVENT, subs=[], tail=" | a=")
@example(ev=_SEED_EVENT, subs=[], tail=" | a=b  c=d")
@example(ev=_SEED_EVENT, subs=[], tail=" | a=b ")
@example(ev=_SEED_EVENT, subs=[], tail=" | a=b | c=d")
@example(ev=_SEED_EVENT, subs=[], tail=" |  | a=b")
@example(ev=_SEED_EVENT, subs=[], tail=" | | a=b")
@example(ev=_SEED_EVENT, subs=[], tail=" | a=b c")
@example(ev=_SEED_EVENT, subs=[], tail=" | a=1 a=2")
@example(ev=StatusEvent(elapsed_min=0, step=0, extra={"w": "1%"}), subs=[], tail=" a|=b")
@example(ev=_SEED_EVENT, subs=[], tail=" a=b")
@example(ev=_SEED_EVENT, subs=[], tail=" | a=|")
@example(ev=_SEED_EVENT, subs=[("acc=", "---"), ("loss=", "nan")], tail="")
@example(ev=_SEED_EVENT, subs=[], tail=_TRAINER_TAIL)
@example(ev=_SEED_EVENT, subs=[], tail=_TRAINER_TAIL + " gnorm=0.512")
@example(ev=_SEED_EVENT, subs=[], tail=_TRAINER_TAIL + " gnorm=0.512 nonfinite=3")
@example(ev=_SEED_EVENT, subs=[], tail=_TRAINER_TAIL + " gnorm=0.512 tau=3.214 loss_b=[1.0,---]")
@example(ev=_SEED_EVENT, subs=[], tail=_TRAINER_TAIL + " tau=3.214")
@example(ev=_SEED_EVENT, subs=[], tail=_TRAINER_TAIL + " loss_b=[1.0] tau=3.214")
@example(ev=_SEED_EVENT, subs=[], tail=_TRAINER_TAIL + " gnorm=0.5 tau=3 loss_b=[1] nonfinite=3")
@example(ev=_SEED_EVENT, subs=[], tail=_TRAINER_TAIL + " tau=")
@example(ev=_SEED_EVENT, subs=[], tail=_TRAINER_TAIL + " tau=1=2")
@example(ev=_SEED_EVENT, subs=[], tail=_TRAINER_TAIL + " gnorm=")
@example(ev=_SEED_EVENT, subs=[], tail=_TRAINER_TAIL + " gnorm=1=2")
@example(ev=_SEED_EVENT, subs=[], tail=_TRAINER_TAIL + " w_pre_out=9.9%")
@example(ev=_SEED_EVENT, subs=[], tail=_TRAINER_TAIL + " | gnorm=0.5")
@example(ev=_SEED_EVENT, subs=[], tail=_TRAINER_TAIL.replace(" w_tgt_in=2.0%", ""))
@example(ev=_SEED_EVENT, subs=[], tail=_TRAINER_TAIL.replace("4.0%", "4=0%"))
@example(ev=_SEED_EVENT, subs=[], tail=_TRAINER_TAIL.replace("target", "a|b"))
@example(ev=_SEED_EVENT, subs=[("dft=", "1bb/s")], tail="")
@example(ev=_SEED_EVENT, subs=[("(", "1.5Ktok/s)")], tail=_TRAINER_TAIL)
def test_status_parser_matches_the_reference_parser(
    ev: StatusEvent, subs: list[tuple[str, str]], tail: str
) -> None:
    """The grammar-built regex, its number fields and the extras agree with the reference."""
    line = format_status_line(ev)
    for key, value in subs:  # replace one number field's text, keeping the rest of the line
        start = line.index(key) + len(key)
        line = line[:start] + value + line[line.index(" ", start) :]
    line += tail
    expected = _reference_parse(line)
    for _ in range(2):  # parsing twice gives the same (the parser keeps no state)
        got = parse_status_line(line)
        assert (got is None) == (expected is None), line
        if got is not None:
            assert expected is not None
            assert got.model_dump_json() == expected.model_dump_json(), line
            assert got.model_fields_set == expected.model_fields_set
            assert format_status_line(got) == format_status_line(expected)


def test_trainer_status_lines_parse_exactly() -> None:
    """Lines the trainer's status_line prints parse back exactly, extras in print order."""
    from trainer.pipeline.status import Board, status_line

    waits = {k: 12.5 * i for i, k in enumerate(STAGE_WAIT_KEYS)}
    for gnorm in (None, 0.731):
        line = status_line(
            elapsed_s=95.0,
            board=Board(step=12, lr=3e-4, gnorm=gnorm),
            metrics={"loss": 2.5, "acc": 0.25, "streak": 3.5},
            noise=0.1,
            tgt_bps=1.5,
            dft_bps=0.5,
            ktok_s=12.0,
            q_pre=[3, 4],
            q_hs=[1],
            epoch=0.5,
            eta_s=5000.0,
            waits=waits,
        )
        got = parse_line(line)
        assert isinstance(got, StatusEvent) and format_status_line(got) == line
        reference = _reference_parse(line)
        assert reference is not None
        assert got.model_dump_json() == reference.model_dump_json()
        assert list(got.extra) == [
            *events.TRAINER_EXTRA_KEYS,
            *(["gnorm"] if gnorm else []),
            events.TOKENS_KEY,  # step 12 has run: the tokens trained so far
        ]


_sgr = st.lists(st.integers(0, 255), max_size=3).map(
    lambda ps: "\x1b[" + ";".join(map(str, ps)) + "m"
)


@given(status_events, st.lists(st.tuples(st.integers(0, 400), _sgr), max_size=4))
def test_colour_codes_anywhere_in_a_status_line_change_nothing(
    ev: StatusEvent, cuts: list[tuple[int, str]]
) -> None:
    """SGR sequences inserted at any positions (a pager, `capture-pane -e`): the same event."""
    line = format_status_line(ev)
    coloured = line
    for pos, code in sorted(cuts, reverse=True):
        p = min(pos, len(line))
        coloured = coloured[:p] + code + coloured[p:]
    plain = parse_line(line)
    assert isinstance(plain, StatusEvent)
    assert parse_line(coloured) == plain


@pytest.mark.parametrize(
    ("template", "fields"),
    [
        ("step={step:d}", {"step": grammar.INT}),  # a format spec: the slot prints itself
        ("step={step} at={at}", {"step": grammar.INT}),  # a slot without a field
        ("step={step}", {"step": grammar.INT, "at": grammar.INT}),  # a field without a slot
        ("step={step} again={step}", {"step": grammar.INT}),  # one field, two slots
    ],
)
def test_a_grammar_whose_slots_and_fields_differ_is_refused(
    template: str, fields: dict[str, grammar.Slot[int]]
) -> None:
    with pytest.raises(ValueError, match="slot"):
        grammar.LineGrammar(template, fields, extras=False)


def test_a_grammar_parses_what_it_formats() -> None:
    """The formatter and the parser come from one template: a line kind of two slots."""
    g = grammar.LineGrammar(
        "at {step}: {eta}", {"step": grammar.INT, "eta": grammar.ETA}, extras=True
    )
    line = g.format({"step": 12, "eta": 5400.0}, {"k": "v"})
    assert line == "at 12: 1.5h | k=v"
    assert g.parse(line) == {"step": 12, "eta": 5400.0, "extra": {"k": "v"}}
    assert g.parse("at 12: 1.5h | k") is None and g.parse("at x: 1.5h") is None
