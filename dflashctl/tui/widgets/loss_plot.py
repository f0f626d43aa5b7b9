"""The loss chart: a real plot with axes (`textual_plotext.PlotextPlot`), raw points, the
debiased EMA and a warmup marker.

Redraws are cheap: `show` replots only when what it would draw changed (the points, the
warmup step, the smoothing weight); the app's 4 Hz tick otherwise costs nothing here.
"""

from __future__ import annotations

from collections.abc import Sequence

from textual_plotext import PlotextPlot

from dflashctl.tui.widgets.charts import LOSS_SMOOTHING, debiased_ema

PlotKey = tuple[int, tuple[int, float] | None, tuple[int, float] | None, int | None, float]


def by_step(points: Sequence[tuple[int, float]]) -> tuple[list[int], list[float]]:
    """Steps ascending, one loss each: after a resume the trainer prints steps it printed
    before (from the checkpoint on), and the later line is the run that continues."""
    latest = dict(points)  # a later (step, loss) replaces an earlier one
    steps = sorted(latest)
    return steps, [latest[s] for s in steps]


class LossPlot(PlotextPlot):
    """Loss against step: raw points (dim), the smoothed curve, a vertical line at the end of
    warmup when the run's warmup is known and falls inside the plotted steps."""

    DEFAULT_CSS = """
    LossPlot { border: round $primary 40%; height: 1fr; min-height: 8; }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._key: PlotKey | None = None
        self.replots = 0
        """How many times the data was replotted (tests and the benchmark check redraws)."""
        self.smoothing = LOSS_SMOOTHING
        self.border_title = "loss"

    def show(
        self,
        points: Sequence[tuple[int, float]],
        warmup: int | None,
        smoothing: float | None = None,
    ) -> bool:
        """Plot `points` ((step, loss)) if they differ from what is shown; True if replotted."""
        if smoothing is not None:
            self.smoothing = smoothing
        first = points[0] if points else None
        last = points[-1] if points else None
        key: PlotKey = (len(points), first, last, warmup, self.smoothing)
        if key == self._key:
            return False
        self._key = key
        self.replots += 1
        plt = self.plt
        plt.clear_data()
        self.border_title = (
            f"loss by step (raw, EMA {self.smoothing:g} debiased; m: smoothing)"
            if self.smoothing > 0
            else "loss by step (raw; m: smoothing)"
        )
        if not points:
            plt.title("no loss yet")
            self.refresh()
            return True
        plt.title("")
        steps, losses = by_step(points)
        plt.plot(steps, losses, marker="dot", color="gray", label="raw")
        if self.smoothing > 0:
            smooth = debiased_ema(losses, self.smoothing)
            plt.plot(steps, smooth, marker="braille", color="red", label="EMA")
        self.border_subtitle = ""
        if warmup is not None and steps[0] <= warmup <= steps[-1]:
            plt.vline(warmup, "yellow")
            plt.text("warmup end", x=warmup, y=max(losses), color="yellow", alignment="left")
        elif warmup is not None and warmup > steps[-1]:  # all of it is warmup: say until when
            pct = 100.0 * steps[-1] / warmup if warmup else 100.0
            self.border_subtitle = f"in warmup until step {warmup} ({pct:.0f}%)"
        self.refresh()
        return True
