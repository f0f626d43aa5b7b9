"""Host screen: everything about one run, live; the panes the seed's user squinted at."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal, Vertical
from textual.widgets import Digits, Footer, Static

from dflashctl.monitor.plan import RunShape, warmup_steps
from dflashctl.monitor.state import RunState
from dflashctl.tui.view import LiveScreen
from dflashctl.tui.widgets.charts import SMOOTHING_STEPS
from dflashctl.tui.widgets.loss_plot import LossPlot
from dflashctl.tui.widgets.panes import (
    EvalPane,
    Pane,
    bucket_loss_text,
    eta_text,
    fmt,
    gpus_text,
    header_text,
    lr_text,
    measure_text,
    metrics_text,
    queues_text,
    regen_text,
    throughput_text,
)
from dflashctl.tui.widgets.tail_log import TailLog

LOG_PANE_LINES = 200


class HostScreen(LiveScreen[None]):
    """Panes re-rendered from the host's `RunState` on the app's coalesced tick."""

    BINDINGS: ClassVar[list[BindingType]] = [
        ("escape", "app.pop_screen", "Fleet"),
        ("m", "smoothing", "Smoothing"),
    ]

    def __init__(self, host: str) -> None:
        super().__init__(name=host)
        self.host = host
        self._painted = False
        self._ready = False

    def compose(self) -> ComposeResult:
        yield Static("", id="host-header")
        yield Static("", id="host-measure")  # shown only while a measure runs on the host
        yield Static("", id="host-regen")  # shown once a regeneration job ran on the host
        with Horizontal(id="row-eval"):  # "are we on track?" first
            yield LossPlot(id="loss-plot")
            yield EvalPane("held-out eval (tau, acc@k, best)", id="eval")
        with Horizontal(id="row-top"):
            with Vertical(id="throughput", classes="pane"):
                yield Digits("—", id="ktok-digits")
                yield Static("", id="throughput-body")
            yield Pane("ETA and epoch", id="eta")
            yield Pane("warmup LR", id="lr")
        with Horizontal(id="row-mid"):
            yield Pane("queues", id="queues")
            with Vertical(id="side"):
                yield Pane("loss per length bucket", id="bucket-loss")
                yield Pane("train acc / streak", id="metrics")
        with Horizontal(id="log-row"):
            yield Pane("GPUs", id="gpus")
            yield TailLog(LOG_PANE_LINES, id="host-log")
        yield Footer()

    def on_mount(self) -> None:
        self._ready = True
        self.request_redraw(self.host)
        self.query_one("#throughput").border_title = "throughput (Ktok/s)"
        self.query_one("#host-log").border_title = "log tail"

    def refresh_view(
        self, states: Mapping[str, RunState], now: float, dirty: Iterable[str]
    ) -> None:
        if not self._ready:
            return
        state = states.get(self.host)
        if state is None:
            return
        shape: RunShape = self.view.shape_for(self.host)
        self.query_one("#host-header", Static).update(header_text(state, now))
        line = self.query_one("#host-measure", Static)
        measure = measure_text(state, max(40, line.content_size.width or self.size.width))
        line.display = measure is not None
        if measure is not None:
            line.update(measure)
        regen_row = self.query_one("#host-regen", Static)
        regen = regen_text(state, max(40, regen_row.content_size.width or self.size.width))
        regen_row.display = regen is not None
        if regen is not None:
            regen_row.update(regen)
        if self._painted and self.host not in set(dirty):
            return
        if self.query_one("#queues").content_size.width == 0:
            return  # not laid out yet: charts drawn now would have the wrong width
        self._painted = True
        st = state.status
        self.query_one("#ktok-digits", Digits).update(fmt(st.ktok_s if st else None, ".1f"))
        self._pane("#throughput-body").update(
            throughput_text(state, self._width("#throughput-body"))
        )
        self._pane("#eta").update(eta_text(state, shape, self._width("#eta")))
        self._pane("#lr").update(lr_text(state, shape, self._width("#lr")))
        self._pane("#queues").update(queues_text(state, shape, self._width("#queues")))
        self._pane("#metrics").update(metrics_text(state, self._width("#metrics"), loss=False))
        self.query_one("#eval", EvalPane).show(state, now)  # it ages itself between changes
        self._pane("#bucket-loss").update(
            bucket_loss_text(state, shape, self._width("#bucket-loss"))
        )
        self.query_one("#loss-plot", LossPlot).show(state.loss_points, warmup_steps(shape, state))
        self._pane("#gpus").update(gpus_text(state, now, self._width("#gpus")))
        self.query_one("#host-log", TailLog).show(state)

    def action_smoothing(self) -> None:
        """Cycle the loss chart's EMA weight through `SMOOTHING_STEPS`."""
        plot = self.query_one("#loss-plot", LossPlot)
        steps = SMOOTHING_STEPS
        nxt = (
            steps[(steps.index(plot.smoothing) + 1) % len(steps)]
            if plot.smoothing in steps
            else steps[0]
        )
        plot.smoothing = nxt
        self.request_redraw(self.host)

    def on_resize(self) -> None:
        self._painted = False  # charts are sized to their panes: redraw at the new size
        self.request_redraw()

    @property
    def painted(self) -> bool:
        """True once the panes were drawn at their laid-out size (tests wait for it)."""
        return self._painted

    def _pane(self, selector: str) -> Static:
        return self.query_one(selector, Static)

    def _width(self, selector: str) -> int:
        return max(8, self.query_one(selector).content_size.width)
