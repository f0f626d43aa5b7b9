"""`dflashctl status` as text for people: one host's `RunStatus` as lines (pure, no I/O).

The JSON form is `RunStatus.to_json_dict`; this is the text the CLI prints for a host and for
each node of a group.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from dflashctl.humanize import format_age
from dflashctl.runs.regen_view import regen_line
from dflashctl.runs.snapshot import (
    RunningMeasure,
    RunStatus,
    ServedEval,
    eval_summary,
    iso_time,
    restart_reason,
    restart_time,
)
from trainer.events import format_status_line


def format_run_status(st: RunStatus) -> str:
    """`dflashctl status` text for one host: a summary line, then what it knows of the run."""
    parts = [f"{st.host}: {'finished' if st.finished else st.state}"]
    if st.exit_status is not None:
        parts.append(f"exit={st.exit_status}")
    if st.signal:
        parts.append(f"(killed by {st.signal})")
    elif st.stop_signal:
        parts.append(f"(on {st.stop_signal})")
    parts.append(f"release={st.release or '-'}")
    if st.run_release and st.run_release != st.release:
        parts.append(f"(running {st.run_release})")
    parts.append(f"config={st.config_hash or '-'}")
    if st.deployed_config_hash and st.config_hash and st.deployed_config_hash != st.config_hash:
        parts.append(f"(deployed {st.deployed_config_hash}: restart to apply)")
    lines = [" ".join(parts)]
    if st.message:
        lines.append(f"  {st.message}")
    if st.run_state_error:
        lines.append(
            f"  {st.run_state_error}: pid, config hash and run state unknown "
            f"(the trainer rewrites it whole at its next start)"
        )
    if st.switch_note:
        lines.append(f"  note: {st.switch_note}")
    if st.measure is not None:
        lines.append(measure_line(st.host, st.measure))
    if st.job is not None:
        j = st.job
        ago = f" ({format_age(j.age_s)} ago)" if j.age_s is not None else ""
        lines.append(
            f"  {j.kind}: {j.id} running since {j.since}{ago} in tmux session {j.session!r}: "
            f"{j.progress or 'no output yet'} (`dflashctl {j.kind} {st.host} --result`)"
        )
    if st.regen is not None:
        lines.append(regen_line(st.host, st.regen))
    detail, ck_error = st.run_state.stop_detail, st.run_state.checkpoint_error
    if st.state != "running" and isinstance(detail, str) and detail:
        lines.append(f"  stop: {detail}")
    if isinstance(ck_error, str) and ck_error:
        lines.append(f"  checkpoint error: {ck_error}")
    if (failed := st.checkpoint_failed) is not None:
        lines.append(
            f"  checkpoint NOT written: step {failed.step} to {failed.directory}: {failed.reason}"
        )
    if st.stale_note:
        lines.append(f"  note: {st.stale_note}")
    if st.last_event is not None:
        lines.append("  " + format_status_line(st.last_event))
    if st.last_checkpoint is not None:
        lines.append(f"  last checkpoint: step {st.last_checkpoint.step} {st.last_checkpoint.path}")
    elif (writer := st.run_state.checkpoints_elsewhere) is not None:
        lines.append(f"  checkpoints: on node {writer} (this node writes none)")
    evaluated = eval_summary(st.run_state)
    if evaluated:
        lines.append(f"  {evaluated}")
    if st.served is not None:
        lines.append(served_line(st.host, st.served))
    if st.last_error:
        lines.append(f"  error: {st.last_error}")
    lines += supervisor_lines(st)
    lines += [f"  | {ln}" for ln in st.pane_tail]
    return "\n".join(lines)


def measure_line(host: str, m: RunningMeasure) -> str:
    """`dflashctl status`'s line for a measure running on the host: its id, since when, its
    last progress line."""
    ago = f" ({format_age(m.age_s)} ago)" if m.age_s is not None else ""
    return (
        f"  measure: {m.id} running since {m.since}{ago} in tmux session {m.session!r}: "
        f"{m.progress or 'no timing run has finished yet'} (`dflashctl measure {host} --result`)"
    )


def served_line(host: str, v: ServedEval) -> str:
    """`served: vllm 0.32.0 tau=3.410, own loop 3.410 (agree) on step 400 (eval ID, 2h ago)`."""
    s = v.summary
    where = f"step {v.step}" if v.step is not None else (v.checkpoint or "an export")
    ago = f", {format_age(v.age_s)} ago" if v.age_s is not None else ""
    if s.served is None:
        head = f"own loop tau={s.own.tau:.3f} (no engine)"
    else:
        verdict = "agree" if s.agree else "DIFFER: " + "; ".join(s.differences)
        head = f"{s.engine} tau={s.served.tau:.3f}, own loop {s.own.tau:.3f} ({verdict})"
    partial = " [partial]" if s.partial else ""
    return (
        f"  served: {head}{partial} on {where} (eval {v.id}{ago}; `dflashctl eval {host} --result`)"
    )


# supervisor states whose `detail` says what happened (why it waits, stopped or gave up)
DETAIL_STATES = frozenset({"restarting", "stalled", "gave-up", "not-restarted"})


def supervisor_lines(st: RunStatus, now: float | None = None) -> list[str]:
    """The supervisor's policy and restarts for `dflashctl status` (nothing for a bare run)."""
    sup = st.supervisor
    if st.supervisor_error:
        return [f"  {st.supervisor_error}: restarts unknown"]
    if not sup:
        return []
    now = time.time() if now is None else now
    raw_policy = sup.get("policy")
    policy: dict[str, object] = raw_policy if isinstance(raw_policy, dict) else {}
    head = (
        f"  supervisor: {sup.get('state')}, attempt {sup.get('attempt')}; restart = "
        f"{policy.get('restart', '?')}, at most {policy.get('max_restarts', '?')} in "
        f"{_num(policy.get('restart_window_s'))} s"
    )
    lines = [head]
    lines += [f"  {low}" for low in low_disk_lines(sup, now)]
    detail = sup.get("detail")
    if sup.get("state") in DETAIL_STATES and isinstance(detail, str):
        lines.append(f"  supervisor: {detail}")
    first = max(0, len(st.restarts) - 5)
    if first:
        lines.append(f"  ({len(st.restarts)} restarts; the last 5:)")
    for n, r in enumerate(st.restarts[first:], start=first + 1):
        at = restart_time(r)
        age = f"{format_age(now - at)} ago" if at is not None else "at ?"
        lines.append(f"  restart {n}: {restart_reason(r)} ({age})")
    return lines


def low_disk_lines(supervisor: Mapping[str, object] | None, now: float) -> list[str]:
    """One line per low filesystem (supervisor.json `low_disks`, else its `low_disk`), in the
    supervisor's own words: `disk: LOW: 2.0 MiB free on /data/ckpt, checkpoints need 3.0 MiB:
    the newest checkpoint (1.0 MiB) x 3 ... for 3m05s: the next checkpoint will fail unless space
    is freed`. An older supervisor's entry (figures only) says them plainly. [] when fine."""
    if not supervisor:
        return []
    many = supervisor.get("low_disks")
    one = supervisor.get("low_disk")
    entries = many if isinstance(many, list) and many else [one] if one else []
    return [_low_disk_line(e, now) for e in entries if isinstance(e, dict)]


def _low_disk_line(low: Mapping[str, object], now: float) -> str:
    since = iso_time(low.get("since"))
    age = f" for {format_age(max(0.0, now - since))}" if since is not None else ""
    text, consequence = low.get("text"), low.get("consequence")
    if isinstance(text, str) and isinstance(consequence, str):
        return f"disk: LOW: {text}{age}: {consequence} unless space is freed"
    free, need, one = (low.get(k) for k in ("free_mib", "needed_mib", "checkpoint_mib"))
    where = low.get("path") if isinstance(low.get("path"), str) else "the run directory"
    limit = one if isinstance(one, int | float) else need
    full = isinstance(free, int | float) and isinstance(limit, int | float) and free < limit
    return (
        f"disk: LOW: {_num(free)} MiB free on {where}, checkpoints need {_num(need)} MiB{age}: "
        f"{'the next' if full else 'a later'} checkpoint will fail unless space is freed"
    )


def _num(value: object) -> str:
    return f"{value:g}" if isinstance(value, int | float) else "?"
