"""Host-screen panes: pure `RunState -> Rich Text` renderers plus one thin Static per pane.

Rendering is a pure function of (state, shape, now, width) so tests check pane values without an
app, and a redraw costs one Text build per pane, not one widget update per number.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widgets import Static

from dflashctl.gpus.nvidia_smi import HARMFUL_REASONS, GpuHealth
from dflashctl.gpus.xid_log import XID_TEXT
from dflashctl.humanize import format_age
from dflashctl.monitor.evals import best_checkpoint, last_eval, tau_history
from dflashctl.monitor.plan import RunShape, boundaries, total_steps, warmup_steps
from dflashctl.monitor.state import (
    RunState,
    SeenXid,
    bucket_labels,
    display_state,
    line_age,
    restart_summary,
)
from dflashctl.runs.regen_view import regen_line
from dflashctl.tui.group_rows import node_step, since_text
from dflashctl.tui.view import AppView
from dflashctl.tui.widgets.charts import BLOCKS, bar, curve, spark
from dflashctl.tui.widgets.served import served_text
from trainer.events import BOTTLENECK_KEY, STAGE_WAIT_KEYS, format_eta

DASH = "—"
AGE_TICK_S = 1.0
"""How often a pane showing an age ("3m05s ago") redraws it between state changes."""

STATE_STYLES = {
    "running": "bold green",
    "stale": "bold yellow",
    "stopped": "bold blue",
    "finished": "bold cyan",
    "unreachable": "bold red",
    "connecting": "dim",
    "restarting": "bold yellow",
    "stalled": "bold yellow",
    "gave-up": "bold red",
    "degraded": "bold yellow",
    "partial": "yellow",
    "measuring": "bold magenta",
    "rendezvous": "bold yellow",
    "regenerating": "bold cyan",
}


def state_style(state: str) -> str:
    """Colour of a display state by its first word (`crashed (exit 1)`, `unreachable since T`,
    a group's `degraded: b unreachable`); any crash or failure is red."""
    word = state.split(" ")[0].rstrip(":")
    if word in {"crashed", "failed"}:
        return "bold red"
    return STATE_STYLES.get(state) or STATE_STYLES.get(word, "")


def fmt(value: float | None, spec: str) -> str:
    return DASH if value is None else format(value, spec)


def _kv(text: Text, key: str, value: str, style: str = "bold") -> None:
    text.append(f"{key} ", style="dim")
    text.append(value, style=style)


def header_text(state: RunState, now: float) -> Text:
    """One line: host, state, release, step, age of the last line, config / link notes."""
    shown = display_state(state, now)
    out = Text()
    out.append(f" {state.host} ", style="bold reverse")
    out.append("  ")
    out.append(shown, style=state_style(shown))
    if shown == "unreachable" and state.unreachable_since is not None:
        out.append(f" since {since_text(state.unreachable_since, now)}", style="red")
    measuring = measure_since(state) if shown == "measuring" else None
    if measuring is not None:
        out.append(f" {measuring}", style="magenta")
    out.append("  ")
    info = state.run_info
    if info.nnodes is not None and info.nnodes > 1:  # one node of a multi-node run
        ranks = info.rank_range
        where = f"node {DASH if info.node_rank is None else info.node_rank} of {info.nnodes}"
        if ranks is not None and len(ranks) == 2:
            where += f", ranks {ranks[0]}-{ranks[1] - 1}"
        out.append(where + "  ", style="cyan")
    _kv(out, "release", state.release or DASH)
    out.append("  ")
    step = node_step(state)
    _kv(out, "step", DASH if step is None else str(step))
    out.append("  ")
    _kv(out, "last line", format_age(line_age(state, now)) + " ago")
    out.append("  ")
    if state.link == "retrying":
        retry = DASH if state.retry_at is None else format_age(max(0.0, state.retry_at - now))
        out.append(f"link down ({state.link_error or 'no error text'}), retry in {retry}  ", "red")
    restarts = restart_summary(state, now)
    if restarts:
        out.append(f"restarts {restarts}  ", style="yellow")
    detail = (state.supervisor or {}).get("detail")
    if state.run in {"restarting", "stalled", "gave-up"} and isinstance(detail, str) and detail:
        out.append(f"supervisor: {detail}  ", style=state_style(state.run))
    if state.config_changed:
        out.append("config changed: press r  ", style="bold magenta")
    if state.last_error:
        out.append(f"error: {state.last_error}", style="red")
    return out


def measure_since(state: RunState) -> str | None:
    """`since 17:02:11 UTC (12m05s ago)` of the measure running on the host (None: none); the
    age is the host's, at the last poll."""
    m = state.measure
    if m is None:
        return None
    since = m.since.partition(" ")[2] or m.since  # the id already says the day
    return f"since {since}" + (f" ({format_age(m.age_s)} ago)" if m.age_s is not None else "")


def measure_text(state: RunState, width: int = 120) -> Text | None:
    """The host screen's one line for a `dflashctl measure` running there (None: none): its id
    (its UTC start), since when where it fits (the header says it too), its last progress line
    and the commands that read or end it; the progress line is cut to `width`, the commands
    never are."""
    m = state.measure
    if m is None:
        return None
    commands = f"  dflashctl measure {state.host} --result|--stop"
    progress = m.progress or "no timing run has finished yet"
    full = measure_since(state) or ""
    heads = [f" {full}: ", f" {full.split(' (')[0]}: ", ": "]
    fits = [h for h in heads if 9 + len(m.id) + len(h) + len(progress) + len(commands) <= width]
    head = fits[0] if fits else heads[-1]
    room = max(8, width - 9 - len(m.id) - len(head) - len(commands))
    if len(progress) > room:
        progress = progress[: room - 1] + "…"
    out = Text(no_wrap=True, overflow="ellipsis")
    out.append(" measure ", style="bold magenta")
    out.append(m.id, style="bold")
    out.append(head, style="dim")
    out.append(progress)
    out.append(commands, style="cyan")
    return out


def regen_text(state: RunState, width: int = 120) -> Text | None:
    """The host screen's one line for the host's newest `dflashctl regen` job (None: none ran):
    its state, rows done of total, rows/s, generated tokens/s, ETA, errors, the length-capped
    share and the requests in flight per server, then the commands that read or end it."""
    job = state.regen
    if job is None:
        return None
    commands = f"  dflashctl regen {state.host} --status" + ("|--stop" if job.live else "")
    body = regen_line(state.host, job).strip().removeprefix("regen: ")
    room = max(8, width - 7 - len(commands))
    if len(body) > room:
        body = body[: room - 1] + "…"
    out = Text(no_wrap=True, overflow="ellipsis")
    out.append(" regen ", style="bold cyan" if job.live else "bold")
    out.append(body, style="red" if job.state in ("failed", "gave-up", "lost") else "")
    out.append(commands, style="cyan")
    return out


def throughput_text(state: RunState, width: int) -> Text:
    """Ktok/s history and the target / drafter batch rates."""
    st = state.status
    out = Text()
    _kv(out, "target", f"{fmt(st.tgt_bps if st else None, '.2f')} b/s")
    out.append("   ")
    _kv(out, "drafter", f"{fmt(st.dft_bps if st else None, '.2f')} b/s")
    out.append("\n")
    hist = state.ktok_hist
    if hist:
        out.append(f"min {min(hist):.1f}  max {max(hist):.1f}  n={len(hist)}\n", style="dim")
    out.append_text(spark(hist, max(8, width), lo=0.0, style="green"))
    return out


def eta_text(state: RunState, shape: RunShape, width: int) -> Text:
    """The trainer's own ETA and epoch progress (never a widget-side estimate)."""
    st = state.status
    out = Text()
    _kv(out, "ETA", format_eta(st.eta_s) if st else DASH, "bold cyan")
    out.append("\n")
    epoch = st.epoch if st else None
    total = shape.epochs
    _kv(out, "epoch", fmt(epoch, ".2f") + (f" / {total:g}" if total else ""))
    out.append("\n")
    if epoch is not None and total:
        out.append_text(bar(epoch, total, max(4, width), style="cyan"))
        out.append("\n")
    total_s = total_steps(shape, state)
    _kv(out, "step", (str(st.step) if st else DASH) + (f" / {total_s}" if total_s else ""))
    out.append("\n")
    _kv(out, "elapsed", f"{st.elapsed_min}m" if st else DASH)
    if state.checkpoint:
        out.append("\n")
        _kv(out, "checkpoint", f"step {state.checkpoint[0]}", "")
    return out


def lr_window(warm: int, total: int, step: int) -> int:
    """Steps shown by the LR curve: the warmup and what follows it (3x warmup, or 1.5x the
    current step once past that), never beyond the run. Warmup is ~4% of a run, so a curve of
    the whole run would hide exactly the part this pane is for."""
    return max(2, min(total, max(3 * warm, round(1.5 * step))))


def lr_points(shape: RunShape, state: RunState, width: int) -> tuple[list[float], int | None, int]:
    """The LR schedule sampled at `width` columns, the marker column, and the last step shown."""
    total = total_steps(shape, state)
    warm = warmup_steps(shape, state)
    if shape.schedule is None or not total or warm is None or width < 2:
        return [], None, 0
    step = state.status.step if state.status else 0
    end = lr_window(warm, total, step)
    steps = [round(i * (end - 1) / (width - 1)) for i in range(width)]
    values = [shape.schedule(s, warm, total) for s in steps]
    marker = min(width - 1, round(step / max(1, end - 1) * (width - 1)))
    return values, marker, end


def lr_text(state: RunState, shape: RunShape, width: int, height: int = 4) -> Text:
    """Current LR, warmup progress, and the schedule curve with a marker at the current step."""
    st = state.status
    warm = warmup_steps(shape, state)
    out = Text()
    _kv(out, "lr", fmt(st.lr if st else None, ".2e"), "bold yellow")
    out.append("   ")
    step = st.step if st else 0
    if warm:
        pct = min(100.0, 100.0 * step / warm)
        label = f"{step}/{warm} ({pct:.0f}%)" if step < warm else f"done ({warm} steps)"
        _kv(out, "warmup", label)
    else:
        _kv(out, "warmup", DASH)
    out.append("\n")
    values, marker, end = lr_points(shape, state, max(2, width))
    if values:
        out.append_text(curve(values, height, marker=marker))
        total = total_steps(shape, state)
        out.append(f"\nsteps 0-{end}" + (f" of {total}" if total and end < total else ""), "dim")
    else:
        out.append("schedule unknown (no run config)", style="dim")
    return out


def _queue_rows(
    out: Text,
    labels: Sequence[str],
    hist: Sequence[Sequence[int]],
    capacity: int | None,
    width: int,
) -> None:
    if not hist:
        out.append("no status line yet\n", style="dim")
        return
    current = hist[-1]
    cap_known = capacity is not None
    cap = capacity or max((max(row, default=0) for row in hist), default=1) or 1
    label_w = max((len(lbl) for lbl in labels), default=2)
    bar_w = max(6, min(24, (width - label_w - 12) // 2))
    spark_w = max(4, width - label_w - bar_w - 12)
    for i, depth in enumerate(current):
        style = "red" if depth == 0 else ("yellow" if depth < cap / 4 else "green")
        out.append(f"{labels[i]:>{label_w}} ", style="bold" if depth else "bold red")
        out.append_text(bar(depth, cap, bar_w, style=style))
        out.append(f" {depth:>3}/{cap}{'' if cap_known else '~'} ", style=style)
        series = [row[i] for row in hist if i < len(row)]
        out.append_text(spark(series, spark_w, lo=0.0, hi=float(cap), style="grey70"))
        out.append("\n")


def queues_text(state: RunState, shape: RunShape, width: int) -> Text:
    """q_pre gauges per length bucket and q_hs per drafter, with short histories.

    An empty queue is red: starvation is visible at a glance. The trainer's stage-wait extras
    (percent of time blocked) and its bottleneck verdict follow when present.
    """
    out = Text()
    q_pre = state.q_pre_hist
    count = len(q_pre[-1]) if q_pre else 0
    out.append("q_pre (prefetch, per length bucket)\n", style="dim")
    labels = bucket_labels(boundaries(shape, state), count)
    _queue_rows(out, labels, q_pre, shape.q_pre_capacity, width)
    q_hs = state.q_hs_hist
    n_hs = len(q_hs[-1]) if q_hs else 0
    out.append("q_hs (hidden states, per drafter)\n", style="dim")
    _queue_rows(out, [f"d{i}" for i in range(n_hs)], q_hs, shape.q_hs_capacity, width)
    extra = state.status.extra if state.status else {}
    waits = [f"{k}={extra[k].rstrip('%')}%" for k in STAGE_WAIT_KEYS if k in extra]
    if waits or BOTTLENECK_KEY in extra:
        _kv(out, "bottleneck", extra.get(BOTTLENECK_KEY, DASH), "bold magenta")
        out.append("  " + " ".join(waits), style="dim")
    return out


def metrics_text(state: RunState, width: int, *, loss: bool = True) -> Text:
    """Loss / acc / streak: current value and history (the host screen leaves loss to its
    chart: `loss=False`)."""
    st = state.status
    out = Text()
    spark_w = max(8, width - 16)
    rows = (
        ("loss", st.loss if st else None, ".4f", state.loss_hist, "red"),
        ("acc", st.acc if st else None, ".3f", state.acc_hist, "green"),
        ("streak", st.streak if st else None, ".2f", state.streak_hist, "cyan"),
    )[0 if loss else 1 :]
    for i, (name, value, spec, hist, colour) in enumerate(rows):
        out.append(f"{name:>6} ", style="dim")
        out.append(f"{fmt(value, spec):>8} ", style="bold")
        out.append_text(spark(hist, spark_w, style=colour))
        if i < len(rows) - 1:
            out.append("\n")
    return out


def eval_text(state: RunState, now: float, width: int) -> Text:
    """Held-out evaluation at a glance: the last simulated tau and its history with the best
    marked, the served evaluation's tau beside it (the newest `dflashctl eval`), acc@k per
    drafted position as a bar row, the last eval's step and age, the best checkpoint. From
    `Eval:` lines and run-state.json (`monitor.last_eval`, `best_checkpoint`) and status
    `served`."""
    out = Text()
    newest = last_eval(state)
    served = served_text(state.served)
    if newest is None:
        out.append("no evaluation yet ([eval] every_steps / every_minutes)", style="dim")
        if served is not None:
            out.append("\n")
            out.append_text(served)
        return out
    best = best_checkpoint(state)
    _kv(out, "tau", fmt(newest.tau, ".3f"), "bold cyan")
    if newest.tau_exp is not None:
        out.append("  ")
        _kv(out, "exp", f"{newest.tau_exp:.3f}", "")
    if newest.tau_real is not None:
        out.append("  ")
        _kv(out, "real", f"{newest.tau_real:.3f}", "bold")
    elif newest.loss is not None:
        out.append("  ")
        _kv(out, "loss", f"{newest.loss:.3f}", "")
    out.append("\n")
    if served is not None:  # the engine's tau beside the in-training one
        out.append_text(served)
        out.append("\n")
    history = tau_history(state)
    spark_w = max(8, width - 6)
    if history:
        shown = history[-spark_w:]
        taus = [t for _, t in shown]
        out.append("tau   ", style="dim")
        start = len(out)
        out.append_text(spark(taus, spark_w, lo=min(1.0, min(taus)), hi=max(taus), style="cyan"))
        if best is not None:
            cols = [i for i, (step, _) in enumerate(shown) if step == best.step]
            if cols:  # the best evaluation's column, highlighted
                out.stylize("bold yellow reverse", start + cols[0], start + cols[0] + 1)
        out.append("\n")
    if newest.acc_at:
        out.append("acc@k ", style="dim")
        cell = max(1, min(3, (width - 6) // max(1, len(newest.acc_at))))
        for a in newest.acc_at:
            level = max(1, min(8, round(a * 8))) if a > 0 else 0
            style = "green" if a >= 0.5 else ("yellow" if a >= 0.2 else "red")
            out.append((BLOCKS[level] * max(1, cell - 1)).ljust(cell), style=style)
        out.append("\n")
        out.append(" " * 6)
        k = len(newest.acc_at)
        out.append(f"@1 {newest.acc_at[0]:.2f}", style="dim")
        if k > 1:
            out.append(f" … @{k} {newest.acc_at[-1]:.2f}", style="dim")
        out.append("\n")
    if best is not None and best.step is not None:
        _kv(out, "best ", f"{fmt(best.tau, '.3f')} @ step {best.step}", "bold yellow")
        if best.checkpoint:
            name = best.checkpoint.rsplit("/", 1)[-1]
            line_w = len(out.plain) - (out.plain.rfind("\n") + 1)
            out.append("\n      " if line_w + 2 + len(name) > width else "  ")
            out.append(name, style="yellow")
        out.append("\n")
    _kv(out, "eval ", f"step {newest.step}", "")
    age = None if state.last_eval_at is None else max(0.0, now - state.last_eval_at)
    out.append(f", {format_age(age)} ago", style="dim")
    return out


def bucket_loss_text(state: RunState, shape: RunShape, width: int) -> Text:
    """One line per length bucket from the status lines' `loss_b=[...]` extra: the interval's
    mean loss and its history on one shared scale, so a jumpy total reads as the bucket mix
    (long sequences have a higher loss) rather than as instability."""
    out = Text()
    hist = state.bucket_loss_hist
    if not hist:
        out.append("no per-bucket loss yet (the trainer's loss_b= extra)", style="dim")
        return out
    count = max(len(row) for _, row in hist)
    labels = bucket_labels(boundaries(shape, state), count)
    values = [v for _, row in hist for v in row if v is not None]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    label_w = max(len(lbl) for lbl in labels)
    spark_w = max(6, width - label_w - 9)
    current = hist[-1][1]
    for i, label in enumerate(labels):
        value = current[i] if i < len(current) else None
        series = [row[i] for _, row in hist if i < len(row) and row[i] is not None]
        out.append(f"{label:>{label_w}} ", style="dim")
        out.append(f"{fmt(value, '.3f'):>7} ", style="bold" if value is not None else "dim")
        out.append_text(spark([v for v in series if v is not None], spark_w, lo=lo, hi=hi))
        if i < count - 1:
            out.append("\n")
    return out


def _health_for(state: RunState, index: int) -> GpuHealth | None:
    return next((h for h in state.gpu_health if h.index == index), None)


def _notable(health: GpuHealth) -> bool:
    """ECC errors or a harmful clock-event reason: worth its own line."""
    counts = (
        health.ecc_corrected_volatile,
        health.ecc_uncorrected_volatile,
        health.ecc_uncorrected_aggregate,
    )
    return any(counts) or bool(health.harmful)


def _health_line(out: Text, health: GpuHealth) -> None:
    """`ECC 0 corr / 0 uncorr` and the active clock-event reasons (harmful ones in red)."""
    out.append("\n     ")
    if health.ecc_mode != "Enabled":
        out.append(f"ECC {health.ecc_mode or 'n/a'}", style="dim")
    else:
        corrected = fmt(health.ecc_corrected_volatile, "d")
        bad = health.ecc_uncorrected_volatile or health.ecc_uncorrected_aggregate
        uncorrected = fmt(health.ecc_uncorrected_volatile, "d")
        out.append("ECC ", style="dim")
        out.append(f"{corrected} corr", style="yellow" if health.ecc_corrected_volatile else "")
        out.append(" / ")
        out.append(f"{uncorrected} uncorr", style="bold red" if bad else "")
        if health.ecc_uncorrected_aggregate:
            out.append(f" ({health.ecc_uncorrected_aggregate} ever)", style="red")
    out.append("  ")
    if not health.reasons:
        out.append("no throttle", style="dim")
        return
    harmful_first = sorted(health.reasons, key=lambda r: (r not in HARMFUL_REASONS, r))
    for n, reason in enumerate(harmful_first):
        if n:
            out.append(" ")
        out.append(reason, "bold red" if reason in HARMFUL_REASONS else "dim")


XIDS_SHOWN = 3
"""Xid lines the GPU pane shows (the newest); older ones are counted."""


def _xid_line(out: Text, state: RunState, seen: SeenXid, now: float | None, width: int) -> None:
    """`Xid  79 GPU0 9a:00   1m05s  GPU has fallen off the bus` (the bus id without its 0000
    domain; history dimmed; the meaning cut to the pane's width)."""
    x = seen.xid
    gpu = next((h.index for h in state.gpu_health if h.bus_id == x.bus_id), None)
    style = "dim" if seen.history else "bold red"
    head = f"Xid {x.code:>3} "
    where = f"GPU{gpu} " if gpu is not None else ""
    bus = x.bus_id.removeprefix("0000:") + " "
    age = DASH if now is None else format_age(max(0.0, now - seen.at))
    out.append(head, style=style)
    out.append(where, style="bold")
    out.append(bus, style="dim")
    out.append(f"{age:>6}  ", style="dim")
    room = max(12, width - len(head) - len(where) - len(bus) - 8)
    meaning = XID_TEXT.get(x.code) or x.detail or "(no text)"
    if len(meaning) > room:
        meaning = meaning[: room - 1] + "…"
    out.append(meaning, style="dim" if seen.history else "red")


def xids_text(state: RunState, now: float | None, width: int = 80) -> Text:
    """The node kernel log's Xids, newest first: code, GPU and bus id, age, meaning; those from
    before this view (the first read) dimmed."""
    out = Text()
    if not state.xids:
        return out
    new = sum(1 for s in state.xids if not s.history)
    old = len(state.xids) - new
    n = len(state.xids)
    out.append(f"kernel log Xids: {n}", style="bold")
    notes = [f"{new} new"] if new else []
    notes += [f"{old} before this view, dim"] if old else []
    out.append(f" ({'; '.join(notes)})", style="dim")
    for seen in reversed(state.xids[-XIDS_SHOWN:]):
        out.append("\n")
        _xid_line(out, state, seen, now, width)
    if n > XIDS_SHOWN:
        out.append(f"\n+{n - XIDS_SHOWN} older", style="dim")
    return out


def gpus_text(state: RunState, now: float | None = None, width: int = 80) -> Text:
    """Per-GPU utilisation, memory, temperature and power (`RunControl.gpus()` samples), under
    each GPU its ECC counts and throttle reasons where the control reports GPU health, then
    the Xids the node's kernel log holds (`now` gives their ages, `width` cuts their text)."""
    out = Text()
    xids = xids_text(state, now, width)
    if not state.gpus:
        out.append("no GPU samples (nvidia-smi absent or not yet polled)", style="dim")
        if xids:
            out.append("\n")
            out.append_text(xids)
        return out
    for i, g in enumerate(state.gpus):
        util = g.util_pct
        hot = g.temp_c is not None and g.temp_c >= 85
        out.append(f"GPU{g.index} ", style="bold")
        out.append_text(bar(float(util or 0.0), 100.0, 10, style="green"))
        out.append(f" {fmt(util, '.0f'):>3}%  ")
        if g.mem_total_mib:
            out.append(f"{fmt(g.mem_used_mib, '.0f')}/{g.mem_total_mib:.0f} MiB  ")
        out.append(f"{fmt(g.temp_c, '.0f')}°C", style="bold red" if hot else "")
        if g.power_w is not None:
            out.append(f"  {g.power_w:.0f} W", style="dim")
        health = _health_for(state, g.index)
        if health is not None and _notable(health):
            _health_line(out, health)
        if i < len(state.gpus) - 1:
            out.append("\n")
    fine = [g.index for g in state.gpus if (h := _health_for(state, g.index)) and not _notable(h)]
    if fine:  # one line for the GPUs with nothing to report
        ids = ",".join(str(i) for i in fine)
        out.append(
            f"\nGPU{'s' if len(fine) > 1 else ''} {ids}: ECC 0 errors, no HW throttle", "dim"
        )
    if xids:
        out.append("\n")
        out.append_text(xids)
    return out


class Pane(Static):
    """A bordered pane whose content is re-rendered from the latest state by the screen."""

    DEFAULT_CSS = """
    Pane { border: round $primary 40%; padding: 0 1; height: auto; }
    """

    def __init__(self, title: str, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.border_title = title


class EvalPane(Pane):
    """The held-out eval pane (`eval_text`). Its screen draws it when the host's state changes;
    between changes it redraws itself every AGE_TICK_S from the state it last drew, so the last
    eval's "N ago" keeps counting while no line arrives (no remote read, only the app's clock)."""

    def __init__(self, title: str, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(title, id=id, classes=classes)
        self._state: RunState | None = None
        self._shown: Text | None = None

    def on_mount(self) -> None:
        self.set_interval(AGE_TICK_S, self.tick)

    def show(self, state: RunState, now: float) -> None:
        """Draw `state` as of `now` (skipped when that is what the pane already shows)."""
        self._state = state
        text = eval_text(state, now, max(8, self.content_size.width))
        if text != self._shown:
            self._shown = text
            self.update(text)

    def tick(self) -> None:
        """The age timer: redraw the last state at the app's time (nothing to count before an
        eval)."""
        state, app = self._state, self.app
        if state is not None and state.last_eval_at is not None and isinstance(app, AppView):
            self.show(state, app.clock())
