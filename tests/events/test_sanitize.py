"""Terminal escapes from the remote side: stripped for parsing, neutralised for display."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from trainer.events import StatusEvent, format_status_line, sanitize_for_terminal, strip_escapes

HOSTILE = (
    "\x1b]0;PWNED-TITLE\x07"  # OSC: retitle the terminal / tmux pane
    "\x1b]52;c;cHduZWQ=\x1b\\"  # OSC 52: write the clipboard
    "\x1b[31mred\x1b[0m"  # CSI colours
    "\x1bPq#0;2;0;0;0\x1b\\"  # DCS (sixel)
    "\x9b2J"  # 8-bit CSI: clear screen
    "tail"
)


def test_strip_escapes_keeps_the_text_between_sequences() -> None:
    assert strip_escapes("\x1b[32m[1440m] step=1\x1b[0m") == "[1440m] step=1"
    assert strip_escapes(HOSTILE) == "redtail"
    assert strip_escapes("plain text") == "plain text"


def test_sanitize_makes_other_controls_visible() -> None:
    assert sanitize_for_terminal("a\rb\x08c\x00d\te\nf\x07") == "a\\x0db\\x08c\\x00d\te\nf\\x07"
    assert sanitize_for_terminal(HOSTILE) == "redtail"


@given(st.text())
def test_sanitized_text_has_no_escape_or_control(text: str) -> None:
    out = sanitize_for_terminal(text)
    assert not any(ch in out for ch in "\x1b\x07\x9b\x9d\r\x00\x7f")
    assert all(ch in "\t\n" or ord(ch) >= 0x20 for ch in out)


# ----- the parser strips escapes before parsing ------------------------------------------------

STATUS = format_status_line(
    StatusEvent(
        elapsed_min=1440,
        step=12000,
        loss=1.2345,
        acc=0.456,
        streak=3.2,
        lr=3e-4,
        noise=0.1,
        tgt_bps=2.5,
        dft_bps=2.4,
        ktok_s=25.1,
        q_pre=[4, 4, 3],
        q_hs=[2],
        epoch=1.25,
        eta_s=7380.0,
        extra={"gnorm": "0.91", "bottleneck": "target"},
    )
)


def _coloured(line: str) -> list[str]:
    return [
        f"\x1b[32m{line}\x1b[0m",  # SGR around the whole line (a colouring pager)
        f"\x1b[1;32m[\x1b[0m{line[1:10]}\x1b[38;5;208m{line[10:]}\x1b[m",  # colours inside it
        f"\x1b]0;title\x07{line}\x1b[K",  # OSC title before, erase-to-end after
        f"\x9b32m{line}\x9b0m",  # 8-bit CSI
    ]


def test_a_coloured_status_line_parses_as_the_plain_one() -> None:
    from trainer.events import parse_line

    plain = parse_line(STATUS)
    assert isinstance(plain, StatusEvent)
    for line in _coloured(STATUS):
        ev = parse_line(line)
        assert isinstance(ev, StatusEvent), repr(line)
        assert ev == plain


def test_other_events_keep_the_stripped_text() -> None:
    from trainer.events import CheckpointEvent, ErrorEvent, RawLine, parse_line

    ev = parse_line("\x1b[33mCheckpoint saved: step=5 path=/r/ck.pt\x1b[0m\n")
    assert isinstance(ev, CheckpointEvent) and (ev.step, ev.path) == (5, "/r/ck.pt")
    assert ev.text == "Checkpoint saved: step=5 path=/r/ck.pt"
    err = parse_line("\x1b[31mERROR: stage target failed: boom\x1b[0m")
    assert isinstance(err, ErrorEvent) and err.message == "stage target failed: boom"
    raw = parse_line("\x1b]52;c;cHduZWQ=\x07warning: \x1b[1mbold\x1b[0m")
    assert isinstance(raw, RawLine) and raw.text == "warning: bold"


def test_parse_text_strips_escapes_line_by_line() -> None:
    """A coloured status line parses as the plain one; an unterminated OSC on a line of its own
    swallows nothing after it (it and an escape-only line are blank once stripped: dropped)."""
    from trainer.events import RawLine, parse_line, parse_text

    text = "\x1b]0;cut off\n" + f"\x1b[32m{STATUS}\x1b[0m" + "\n\x1b[0m\nplain tail"
    evs = parse_text(text)
    assert [e.kind for e in evs] == ["status", "raw"]
    assert evs[0] == parse_line(STATUS)
    assert isinstance(evs[-1], RawLine) and evs[-1].text == "plain tail"
