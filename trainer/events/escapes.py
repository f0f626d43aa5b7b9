"""Terminal escapes in remote text: stripped before parsing, neutralised before display."""

from __future__ import annotations

import re

__all__ = ["has_escape", "sanitize_for_terminal", "strip_escapes"]

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


def has_escape(text: str) -> bool:
    """Whether ``text`` may hold an escape sequence (two cheap checks for plain ASCII text)."""
    # `isascii()` is O(1) in CPython, so the 8-bit introducers (never in ASCII) are searched
    # for only in non-ASCII text.
    return "\x1b" in text or (not text.isascii() and _C1_INTRODUCER_RE.search(text) is not None)


def strip_escapes(text: str) -> str:
    """``text`` without terminal escape sequences (CSI colours, OSC titles, DCS, ...)."""
    if not has_escape(text):
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
