"""The app's parts without the app: what a key acts on (`targets.refusal`) and what becomes a
toast (`toasts.news`, `toasts.worker_failure`)."""

from __future__ import annotations

from dflashctl.errors import UsageError
from dflashctl.monitor.state import RunState, apply_status
from dflashctl.tui.targets import refusal
from dflashctl.tui.toasts import NEWS_TIMEOUT_S, Toast, news, worker_failure
from tests.tui.fixtures import Status
from tests.tui.test_supervisor_view import polled, restart

GROUPS = {"pair": ("n0", "n1")}


def test_a_key_acts_on_a_solo_host_and_on_a_node_except_for_run_commands() -> None:
    assert refusal("solo", None, GROUPS, "restart") is None
    assert refusal("n1", None, GROUPS, None) is None  # log, edit, attach: the node itself
    assert refusal("n1", None, GROUPS, "stop") == (
        "n1 is node 1 of group pair: `dflashctl stop pair` acts on every node (one node alone"
        " would break the run)"
    )
    assert refusal(None, "pair", GROUPS, None) == (
        "pair is a group: pick one of its nodes, or run `dflashctl restart|stop|deploy pair`"
    )
    assert refusal(None, None, GROUPS, "deploy") == "no host selected"


def test_news_is_each_supervisor_restart_once_and_a_failed_worker_is_one_titled_line() -> None:
    base = apply_status(RunState("h"), polled("running", []))
    one = apply_status(base, polled("restarting", [restart("signal 9")]))
    assert news(base, one) == [
        Toast(
            "h: trainer restarted (signal 9, resumed from step 40); restart 1 of 3",
            "warning",
            timeout=NEWS_TIMEOUT_S,
        )
    ]
    assert news(one, one) == [] and news(RunState("h"), apply_status(base, Status())) == []
    err = UsageError("no run_config", hint="add run_config to hosts.toml")
    assert worker_failure("restart-plan", "kpro6", err) == Toast(
        "kpro6: cannot read the deployed config: no run_config (hint: add run_config to"
        " hosts.toml)",
        "error",
        title="Restart",
    )
    assert worker_failure("sync", None, OSError("gone")) == Toast(
        "sync failed: gone", "error", title="Error"
    )
