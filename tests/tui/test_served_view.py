"""Served tau beside in-training tau: the newest `dflashctl eval` that left a summary is read by
the status round trip (the real status script over LocalTransport, on a workdir holding eval
jobs as trainer.eval leaves them), folded into the host's state, and shown by the eval pane and
`dflashctl status`; kept while the host is unreachable."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dflashctl.cli.status_text import format_run_status
from dflashctl.config.inventory import local_host
from dflashctl.monitor.state import RunState, apply_lines, apply_status
from dflashctl.remote import LocalTransport
from dflashctl.runs.control import RunControl
from dflashctl.runs.snapshot import RunStatus
from dflashctl.tui.widgets.panes import eval_text
from tests.tui.fixtures import FIXED_NOW, eval_run_lines
from trainer.events.served import served_summary


def payload(own: float, served: float, agree: bool) -> dict[str, object]:
    """trainer.eval's --json document, the parts the summary reads."""
    side = {"tau_pooled": own, "verify_steps": 12, "acceptance_per_position": [0.9, 0.8, 0.7]}
    return {
        "summary": {"protocol": "exact", "prompts": 3, "block_size": 4, "matches": 3, "tau": own,
                    "tau_pooled": own, "verify_steps": 12},
        "engine": {"name": "vllm", "version": "0.32.0"},
        "served": {"summary": {"own": {**side, "tau": own}, "served": {**side, "tau": served},
                               "agree": agree, "differences": [] if agree else ["tokens differ"]}},
    }  # fmt: skip


def write_eval(workdir: Path, job_id: str, summary: str | None, info: dict[str, object]) -> None:
    d = workdir / "eval" / job_id
    d.mkdir(parents=True)
    (d / "info.json").write_text(json.dumps(info))
    if summary is not None:
        (d / "summary.json").write_text(summary)


async def test_the_newest_eval_with_a_summary_reaches_the_eval_pane_and_status(
    tmp_path: Path,
) -> None:
    wd = tmp_path / "wd"
    (wd / "run").mkdir(parents=True)
    older = served_summary(payload(3.2, 3.2, True), partial=False).model_dump_json()
    newer = served_summary(payload(3.5, 2.1, False), partial=False).model_dump_json()
    write_eval(wd, "20261201T100000Z", older, {"checkpoint": "/w/step-00000200.pt", "step": 200})
    write_eval(wd, "20261201T110000Z", newer, {"checkpoint": "/w/step-00000400.pt", "step": 400})
    write_eval(wd, "20261201T120000Z", None, {"step": 600})  # running, no summary yet
    host = local_host("loc", wd, python=sys.executable, session="t")
    transport = LocalTransport()
    try:
        status = await RunControl(transport, host).status()
    finally:
        await transport.close()
    served = status.served
    assert served is not None and served.id == "20261201T110000Z" and served.step == 400
    assert served.summary.served is not None and served.summary.served.tau == 2.1
    assert served.age_s is not None and served.age_s > 0
    text = format_run_status(status)
    assert (
        "  served: vllm 0.32.0 tau=2.100, own loop 3.500 (DIFFER: tokens differ) on step 400"
        in (text)
    )
    assert json.loads(json.dumps(status.to_json_dict(), default=str))["served"]["step"] == 400

    # the pane: beside the in-training tau (a run with evals), and alone before any
    trained = apply_lines(RunState("loc"), eval_run_lines(48), FIXED_NOW)
    state = apply_status(trained, status)
    pane = eval_text(state, FIXED_NOW, 80).plain.splitlines()
    assert pane[0].startswith("tau ") and pane[1].startswith(
        "served 2.100 vllm 0.32.0 · own 3.500 DIFFER · step 400, "
    )
    lone = eval_text(apply_status(RunState("loc"), status), FIXED_NOW, 80).plain.splitlines()
    assert lone[0].startswith("no evaluation yet") and lone[1].startswith("served 2.100 vllm")
    # an unreachable poll keeps what was known; a reachable one without an eval shows none
    lost = apply_status(state, RunStatus(host="loc", state="unreachable", message="timed out"))
    assert lost.served == state.served
    gone = apply_status(state, RunStatus(host="loc", state="stopped"))
    assert gone.served is None and "served" not in eval_text(gone, FIXED_NOW, 80).plain
