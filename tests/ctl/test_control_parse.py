"""Status parsing from the one-round-trip status script, GPU CSV, trainer argv."""

from __future__ import annotations

import json
from pathlib import Path

from dflashctl.cli.status_text import format_run_status
from dflashctl.gpus.nvidia_smi import parse_gpu_csv
from dflashctl.remote.run import MARK, stop_wait_argv, trainer_argv
from dflashctl.runs.snapshot import (
    eval_summary,
    parse_status,
    parse_supervisor_file,
    split_sections,
)
from trainer.events import EvalEvent, parse_line
from trainer.events.run_state import RunState, parse_run_state
from trainer.pipeline.status import RunStateFile

LINE = (
    "[3m] step={step} loss=1.2000 acc=0.500 streak=1.0 lr=6.00e-04 noise=0.1000 | tgt=1.00b/s "
    "dft=1.00b/s (2.0Ktok/s) | q_pre=[1, 2] q_hs=[1] | epoch~0.01 ETA=17m"
)


def script_output(**sections: str) -> str:
    return "".join(f"{MARK}{k}\n{v}\n" for k, v in sections.items())


def fake_hash(text: str) -> str:
    return f"h{len(text)}"


def test_running_session_with_status_lines() -> None:
    out = script_output(
        session="yes",
        pane="0|||4242",
        current="releases/abc123def456",
        run_release="abc123def456",
        run_state='{"config_hash": "cfg000000001", "pid": 4242}',
        log_lines="3",
        log="Starting pipeline...\n" + LINE.format(step=7) + "\n" + LINE.format(step=8),
        config="[x]\n",
        capture="",
    )
    st = parse_status("pve-a", out, fake_hash)
    assert st.state == "running" and st.exit_status is None
    assert st.step == 8 and st.release == "abc123def456" and st.run_release == "abc123def456"
    assert st.config_hash == "cfg000000001" and st.deployed_config_hash == "h3"
    assert st.log_lines == 3 and st.to_json_dict()["step"] == 8


def test_dead_pane_is_crashed_with_exit_status_and_traceback_tail() -> None:
    out = script_output(
        session="yes",
        pane="1|3||0",
        capture="Traceback (most recent call last):\nERROR: CUDA out of memory",
        log_lines="0",
    )
    st = parse_status("h", out, fake_hash)
    assert (st.state, st.exit_status) == ("crashed", 3)
    assert st.last_error == "CUDA out of memory" and st.pane_tail[-1].startswith("ERROR")


def test_clean_exit_is_stopped_and_no_session_is_stopped() -> None:
    assert (
        parse_status("h", script_output(session="yes", pane="1|0||0"), fake_hash).state == "stopped"
    )
    st = parse_status("h", script_output(session="no", pane=""), fake_hash)
    assert st.state == "stopped" and st.exit_status is None
    assert parse_status("h", f"{MARK}noworkdir\n", fake_hash).message == "nothing deployed yet"


def test_status_falls_back_to_the_pane_capture() -> None:
    """With an empty status.log the pane (captured with -J, so rows arrive re-joined) counts."""
    out = script_output(session="yes", pane="0|||1", capture=LINE.format(step=12), log_lines="0")
    assert parse_status("h", out, fake_hash).step == 12


def test_a_capture_line_exactly_the_pane_width_is_not_glued_to_the_next() -> None:
    """tmux -J leaves a line that filled the row exactly as it was; re-joining it by width would
    turn the status line plus the warning after it into one unreadable line."""
    line = LINE.format(step=12)
    capture = f"{line}\nUserWarning: something\nERROR: stage target failed: boom"
    out = script_output(session="yes", pane="1|1||1", capture=capture, log_lines="0")
    st = parse_status("h", out, fake_hash)
    assert st.step == 12 and st.last_error == "stage target failed: boom"


def test_sections_keep_blank_lines_inside() -> None:
    assert split_sections(script_output(config="a\n\nb"))["config"] == "a\n\nb"


def test_gpu_csv_tolerates_not_supported_fields() -> None:
    gpus = parse_gpu_csv("0, NVIDIA RTX PRO 6000, 97, 81000, 97887, 64, [N/A]\nbogus\n")
    assert len(gpus) == 1 and gpus[0].util_pct == 97 and gpus[0].power_w is None


def test_trainer_argv_resume_vs_fresh() -> None:
    assert trainer_argv("/p", False)[-2:] == ["--resume", "auto"]
    assert trainer_argv("/p", True)[-1] == "--fresh" and "--resume" not in trainer_argv("/p", True)
    assert trainer_argv("/p", False)[:3] == ["/p", "-m", "trainer"]


def test_stop_wait_scans_from_the_line_after_the_mark() -> None:
    argv = stop_wait_argv("/w", "s", 41, 10)
    assert argv[-2:] == ["42", "50"]


def test_unterminated_file_does_not_swallow_the_next_section() -> None:
    out = f"{MARK}config\n[x]\n\n{MARK}capture\nline\n"  # `cat` of "[x]" then the script's echo
    assert split_sections(out) == {"config": "[x]", "capture": "line"}


def test_a_clean_exit_after_the_whole_plan_is_finished_not_just_stopped() -> None:
    state = '{"state": "finished", "pid": 4242, "exit_status": 0}'
    out = script_output(session="yes", pane="1|0||4242", run_state=state, log_lines="0")
    st = parse_status("h", out, fake_hash)
    assert (st.state, st.exit_status, st.finished) == ("stopped", 0, True)
    assert st.to_json_dict()["finished"] is True
    assert format_run_status(st).startswith("h: finished exit=0 ")
    stopped = script_output(session="yes", pane="1|0||4242", run_state='{"state": "stopped"}')
    assert not parse_status("h", stopped, fake_hash).finished


def test_run_state_is_the_typed_contract_and_status_json_shows_the_file_as_read() -> None:
    written = {
        "pid": 4242,
        "state": "running",
        "config_hash": "cfg000000001",
        "total_steps": 1200,
        "boundaries": [64, 128],
        "last_eval": {"step": 400, "tau": 3.2, "acc_at": [0.9, 0.7]},
        "a_newer_key": {"kept": True},
    }
    out = script_output(session="yes", pane="0|||4242", run_state=json.dumps(written))
    st = parse_status("h", out, fake_hash)
    assert isinstance(st.run_state, RunState) and st.run_state_error is None
    assert (st.run_state.total_steps, st.run_state.boundaries) == (1200, [64, 128])
    assert st.run_state.last_eval is not None and st.run_state.last_eval.step == 400
    assert st.to_json_dict()["run_state"] == written  # no defaults added, unknown keys kept
    assert (
        parse_status("h", script_output(session="no"), fake_hash).to_json_dict()["run_state"] == {}
    )


def test_a_run_state_with_a_wrong_type_is_reported_like_a_corrupted_one() -> None:
    state, error = parse_run_state('{"state": "sleeping", "pid": 1}', "run/run-state.json")
    assert not state.model_fields_set and error == (
        "run/run-state.json is corrupted: key state: "
        "Input should be 'starting', 'running', 'finished', 'stopped', 'refused' or 'crashed'"
    )
    state, error = parse_run_state("[1]", "run/run-state.json")
    assert error == "run/run-state.json is corrupted: a JSON list, not an object"


def test_supervisor_file_is_read_on_its_own_not_as_run_state() -> None:
    sup, error = parse_supervisor_file('{"pid": 7, "trainer_pid": 8, "state": "gave-up"}')
    assert error is None and sup is not None
    assert (sup.pid, sup.trainer_pid, sup.gave_up, sup.restarts, sup.policy) == (7, 8, True, [], {})
    assert parse_supervisor_file("") == (None, None)
    assert parse_supervisor_file("{")[1] == (
        "run/supervisor.json is corrupted: Expecting property name enclosed in double quotes "
        "(byte 1)"
    )


EVAL_LINE = (
    "Eval: step=400 tau=3.214 loss=1.2345 acc=0.612 acc@1=0.901 acc@2=0.700 acc@3=0.512 "
    "tau_exp=3.113 best=400 | rows=64 blocks=2831 eval_s=0.21 cost=4.2%"
)


def _evaluated_run_state(run: Path) -> str:
    """run-state.json as the trainer writes it after an evaluation that made a new best: the
    trainer's own writer (RunStateFile), fed what trainer.pipeline.evals records."""
    ev = parse_line(EVAL_LINE)
    assert isinstance(ev, EvalEvent)
    best = run / "checkpoints" / "step-00000400.pt"
    state = RunStateFile(run)
    assert not state.update(pid=4242, state="running", config_hash="cfg000000001")
    assert not state.update(holdout_rows=64, eval_rows=64)
    assert not state.update(
        last_eval=ev.model_dump(mode="json", exclude={"kind", "extra"}),
        eval_seconds=3.5,
        eval_share=0.0421,
    )
    assert not state.update(best_step=400, best_tau=ev.tau, best_checkpoint=str(best))
    return (run / "run-state.json").read_text()


def test_status_shows_the_last_eval_and_the_best_checkpoint_from_the_trainers_run_state(
    tmp_path: Path,
) -> None:
    text = _evaluated_run_state(tmp_path)
    out = script_output(session="yes", pane="0|||4242", run_state=text, log=LINE.format(step=420))
    st = parse_status("h", out, fake_hash)
    assert st.run_state_error is None
    d = json.loads(json.dumps(st.to_json_dict(), default=str))  # as status --json prints it
    assert d["eval"] == {
        "step": 400,
        "tau": 3.214,
        "tau_real": None,
        "loss": 1.2345,
        "acc": 0.612,
        "acc_at": [0.901, 0.7, 0.512],
        "tau_exp": 3.113,
        "best": 400,
        "share": 0.0421,
    }
    assert d["best"] == {
        "step": 400,
        "tau": 3.214,
        "checkpoint": str(tmp_path / "checkpoints" / "step-00000400.pt"),
    }
    want = (
        "  eval: step 400 tau=3.214 (best 400, tau=3.214, checkpoints/step-00000400.pt); "
        "evals cost 4.2% of wall time"
    )
    lines = format_run_status(st).splitlines()
    assert want in lines
    assert lines.index(want) == lines.index("  " + LINE.format(step=420)) + 1  # after the step


def test_a_run_without_evaluations_has_null_eval_and_best_and_no_eval_line(
    tmp_path: Path,
) -> None:
    state = RunStateFile(tmp_path)
    assert not state.update(pid=4242, state="running", config_hash="cfg000000001")
    out = script_output(
        session="yes", pane="0|||4242", run_state=(tmp_path / "run-state.json").read_text()
    )
    st = parse_status("h", out, fake_hash)
    d = st.to_json_dict()
    assert d["eval"] is None and d["best"] is None
    assert "eval:" not in format_run_status(st)
    # nothing deployed / no run-state at all: the same keys, null
    d = parse_status("h", script_output(session="no"), fake_hash).to_json_dict()
    assert d["eval"] is None and d["best"] is None


def test_the_eval_line_before_a_best_exists_and_a_best_without_a_new_eval() -> None:
    first = RunState.model_validate(
        {"last_eval": {"step": 0, "tau": 1.052, "acc_at": [0.04, 0.0, 0.0]}}
    )
    assert eval_summary(first) == "eval: step 0 tau=1.052 (no best checkpoint yet)"
    # a resumed run: build_evaluator records the checkpoint's best before this process evaluates
    resumed = RunState(best_step=1800, best_tau=2.454, best_checkpoint="/w/run/checkpoints/b.pt")
    assert eval_summary(resumed) == (
        "eval: none recorded yet (best 1800, tau=2.454, checkpoints/b.pt)"
    )
    assert eval_summary(RunState()) is None
