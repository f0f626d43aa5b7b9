"""Training never goes on for long with nothing saved (issue 25, item 1): the real tiny CPU
trainer, under the supervisor as `dflashctl start` runs it, with RUN/checkpoints on a real tmpfs
of its own that fills up while RUN has room. Each failed write is an ERROR line naming the step,
RUN/checkpoints and the reason (an `ErrorEvent` with `checkpoint_failed`) and is recorded in
run-state.json; after two failures in a row the trainer tries once more and stops with exit 3,
which the supervisor does not restart, whatever its no-restart list says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import budget
from tests.conftest import tmpfs
from trainer.errors import ExitCode
from trainer.events import ErrorEvent, PhaseEvent, parse_line
from trainer.pipeline.checkpointer import MAX_FAILED_IN_A_ROW

from .conftest import REPO, RunCli, cli_env, trainer_argv, write_config
from .test_reliability import _fill, _run_state

EVERY = 5


def _events(run_dir: Path) -> list[Any]:
    return [parse_line(x) for x in (run_dir / "status.log").read_text().splitlines()]


def _metric_steps(run_dir: Path) -> list[int]:
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["step"] for x in rows]


@pytest.mark.timeout(300)
def test_checkpoints_failing_on_a_full_checkpoint_filesystem_stop_the_run_for_good(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with tmpfs(run_dir / "checkpoints", "24m") as ckpts:
        ckpt = {"every_steps": EVERY, "keep_last": 3}
        first = write_config(
            tmp_path / "a.toml", tiny_assets, schedule={"max_steps": EVERY}, checkpoint=ckpt
        )
        assert run_cli(first, run_dir).returncode == 0
        kept = ckpts / "step-00000005.pt"
        _fill(ckpts, leave=kept.stat().st_size // 3)  # RUN itself keeps its room

        cfg = write_config(
            tmp_path / "b.toml", tiny_assets, schedule={"max_steps": 60}, checkpoint=ckpt
        )
        sup = [sys.executable, "-m", "trainer.supervise", "--max-restarts", "3"]
        sup += ["--backoff-s", "0.05", "--no-restart-exit-codes=2", "--"]
        out = subprocess.run(
            [*sup, *trainer_argv(cfg, run_dir)],
            cwd=REPO,
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=budget.left(),
        )
        assert out.returncode == ExitCode.UNSAVED, out.stdout[-3000:] + out.stderr[-3000:]

        events = _events(run_dir)
        failed = [
            e.checkpoint_failed
            for e in events
            if isinstance(e, ErrorEvent) and e.checkpoint_failed is not None
        ]
        stop = failed[-1].step
        # 10 and 15 failed (two in a row), then the first step after that is known is tried
        # once more, synchronously; 20 only when write 15 outlasted a whole interval.
        assert [f.step for f in failed] in ([10, 15, stop], [10, 15, 20, stop]), failed
        assert 15 < stop <= 4 * EVERY + 1
        assert len(failed) >= MAX_FAILED_IN_A_ROW + 1
        for f in failed:
            assert f.directory == str(ckpts)  # RUN/checkpoints, not RUN, is the full one
            assert f.reason.startswith("no space left (") and f.reason.endswith(
                "; kept step-00000005.pt"
            ), f.reason
        assert max(_metric_steps(run_dir)) == stop  # not one step trained after the stop

        stopped = (
            f"stopped at step {stop}: the last {len(failed)} checkpoints failed, so training on "
            f"would not be kept (exit 3: not restarted); free space in {ckpts} (or fix what "
            f"the checkpoint errors say), then start again: resuming from step-00000005.pt "
            f"repeats {stop - EVERY} step(s)"
        )
        errors = [e.message for e in events if isinstance(e, ErrorEvent)]
        assert errors[-1] == stopped, errors
        state = _run_state(run_dir)
        assert (state["state"], state["exit_status"]) == ("crashed", 3), state
        assert state["checkpoint_failed"] == failed[-1].model_dump()
        assert state["checkpoint_failures"] == len(failed)
        assert state["last_step"] == EVERY and state["lost_steps"] == stop - EVERY
        assert state["stop_detail"] == stopped and state["last_error"] == stopped

        # The supervisor does not restart it (3 is not in its no-restart list: a rule of its
        # own), and its low-disk line names the checkpoint filesystem.
        phases = [e for e in events if isinstance(e, PhaseEvent)]
        (no,) = [p for p in phases if p.phase == "not_restarting"]
        assert no.detail.startswith("checkpoints kept failing (exit 3): ")
        assert not [p for p in phases if p.phase == "restarting"]
        low = [p.detail for p in phases if p.phase == "low_disk"]
        assert low and f" MiB free on {ckpts}, " in low[0]
        sup_state = json.loads((run_dir / "supervisor.json").read_text())
        assert (sup_state["state"], sup_state["exit_status"]) == ("not-restarted", 3)
        assert sup_state["restarts"] == []
