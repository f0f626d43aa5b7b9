"""`trainer.eval --engine`'s flags: refused by name before anything loads when they cannot
work, and an engine command that dies at start is one line with its log's last words (a real
process; the vLLM runs are in tests/serving)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.model.helpers import make_drafter
from trainer import eval as eval_cli
from trainer.model.export import export_drafter
from trainer.model.target import TargetModel


@pytest.fixture
def base_argv(target: TargetModel, tmp_path: Path) -> list[str]:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("[5, 6, 7]\n[8, 9]\n")
    drafter = export_drafter(make_drafter(target), tmp_path / "d")
    return [
        "--target",
        str(target.model.name_or_path),
        "--drafter",
        str(drafter),
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "4",
        "--device",
        "cpu",
    ]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--server", "http://127.0.0.1:1"], "--server needs --engine vllm"),
        (["--engine", "vllm"], "--engine needs exactly one of --server URL or --serve-cmd CMD"),
        (
            ["--engine", "vllm", "--server", "http://h:1", "--serve-cmd", "vllm serve"],
            "--engine needs exactly one of --server URL or --serve-cmd CMD",
        ),
        (
            ["--engine", "vllm", "--server", "http://h:1", "--protocol", "zlab"],
            "--engine counts verify steps as the engine does: use --protocol exact",
        ),
        (
            ["--engine", "vllm", "--serve-cmd", "vllm serve --x 'open"],
            '--serve-cmd "vllm serve --x \'open": No closing quotation',
        ),
        (
            ["--engine", "vllm", "--server", "http://h:1", "--serve-arg=--enforce-eager"],
            "--serve-arg goes with --serve-cmd (a running --server has its own)",
        ),
    ],
)
def test_engine_flags_that_cannot_work_are_refused_by_name(
    base_argv: list[str], extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert eval_cli.main([*base_argv, *extra]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_an_engine_that_dies_at_start_is_one_line_naming_its_log(
    base_argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "engine.log"
    cmd = f"{sys.executable} -c \"print('RuntimeError: no DFlash here'); raise SystemExit(3)\""
    argv = [*base_argv, "--engine", "vllm", "--serve-cmd", cmd, "--serve-log", str(log)]
    assert eval_cli.main([*argv, "--json", str(tmp_path / "r.json")]) == 1
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1  # (transformers' progress bar shares stderr)
    assert re.fullmatch(
        rf"error: engine exited with status 3 before http://127\.0\.0\.1:\d+/health answered; "
        rf"{re.escape(str(log))}: RuntimeError: no DFlash here",
        errors[0],
    )
    started = next(line for line in out.splitlines() if line.startswith("starting vllm: "))
    assert "--speculative-config" in started and '"num_speculative_tokens":3' in started
    assert not (tmp_path / "r.json").exists()  # no turn ran: nothing to report
