"""Terminal escapes from the remote side: stripped for parsing, neutralised for display."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from trainer.events import sanitize_for_terminal, strip_escapes

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
