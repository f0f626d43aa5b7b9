"""Text charts drawn with block characters: cheap to render 16 hosts at a few Hz, and exact.

Pure functions returning Rich `Text`, so they are tested without an app.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text

BLOCKS = " ▁▂▃▄▅▆▇█"


def _levels(values: Sequence[float], lo: float, hi: float, steps: int) -> list[int]:
    span = hi - lo
    if span <= 0:
        return [steps if v > 0 else 0 for v in values]
    return [max(0, min(steps, round((v - lo) / span * steps))) for v in values]


def resample(values: Sequence[float], width: int) -> list[float]:
    """Last `width` points; if fewer, as they are (a chart fills from the left)."""
    return list(values[-width:]) if width > 0 else []


def spark(
    values: Sequence[float],
    width: int,
    *,
    lo: float | None = None,
    hi: float | None = None,
    style: str = "",
) -> Text:
    """One-row sparkline of the last `width` values, scaled to [lo, hi] (default: data range)."""
    pts = resample(values, width)
    if not pts:
        return Text(" " * width)
    low = min(pts) if lo is None else lo
    high = max(pts) if hi is None else hi
    if lo is None and high > low:
        low = low - (high - low) * 0.05
    chars = "".join(BLOCKS[lvl] if lvl else BLOCKS[1] for lvl in _levels(pts, low, high, 8))
    return Text(chars.ljust(width), style=style)


def curve(
    values: Sequence[float],
    height: int,
    *,
    marker: int | None = None,
    style: str = "cyan",
    marker_style: str = "bold yellow",
) -> Text:
    """Multi-row area chart of `values` (one column each), with column `marker` highlighted."""
    height = max(1, height)
    if not values:
        return Text("\n".join(" " for _ in range(height)))
    hi = max(values)
    lo = min(0.0, min(values))
    levels = _levels(values, lo, hi, height * 8)
    out = Text()
    for row in range(height):
        floor = (height - 1 - row) * 8
        cells = [BLOCKS[max(0, min(8, lvl - floor))] for lvl in levels]
        if marker is not None and 0 <= marker < len(cells) and cells[marker] == " ":
            cells[marker] = "│"
        start = len(out)
        out.append("".join(cells), style=style)  # one span per row: cheap to convert and draw
        if marker is not None and 0 <= marker < len(cells):
            out.stylize(marker_style, start + marker, start + marker + 1)
        if row < height - 1:
            out.append("\n")
    return out


def bar(value: float, total: float, width: int, *, style: str = "green") -> Text:
    """Horizontal gauge `value / total` in eighths of a cell."""
    width = max(1, width)
    frac = 0.0 if total <= 0 else max(0.0, min(1.0, value / total))
    eighths = round(frac * width * 8)
    full, part = divmod(eighths, 8)
    partial = "▏▎▍▌▋▊▉"[part - 1] if part else ""
    text = Text("█" * full + partial, style=style)
    text.append("·" * (width - full - (1 if partial else 0)), style="grey35")
    return text


LOSS_SMOOTHING = 0.6
"""The loss chart's EMA weight (TensorBoard's default slider value); `m` on the host screen
cycles through `SMOOTHING_STEPS`."""
SMOOTHING_STEPS = (0.0, 0.6, 0.9, 0.99)


def debiased_ema(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's / W&B's smoothing: an exponential moving average with weight `weight`
    (0 = raw) whose zero start is corrected (divided by 1 - weight^n), so the first points
    are not pulled towards 0. Non-finite values are passed through without entering the
    average."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1), not {weight}")
    out: list[float] = []
    last = 0.0
    n = 0
    for v in values:
        if v != v or v in (float("inf"), float("-inf")):  # NaN / inf: shown as is
            out.append(v)
            continue
        last = last * weight + (1.0 - weight) * v
        n += 1
        out.append(last / (1.0 - weight**n))
    return out
