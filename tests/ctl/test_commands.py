"""Pure argv builders and parsers: exact argv, one quoting layer, tmux exact targets."""

from __future__ import annotations

import contextlib
import shlex
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dflashctl.remote import commands as C
from tests import budget


def test_pct_exec_puts_double_dash_before_container_argv() -> None:
    argv = C.pct_exec(200, ["sh", "-c", "echo hi"])
    assert argv == ["pct", "exec", "200", "--", "sh", "-c", "echo hi"]


@given(
    st.lists(st.text(alphabet=st.characters(blacklist_characters="\x00"), min_size=0), max_size=6)
)
def test_shell_join_round_trips_any_argv(argv: list[str]) -> None:
    wrapped = C.pct_exec(101, C.clean_env(argv))
    assert shlex.split(C.shell_join(wrapped)) == wrapped


def test_hostile_argument_reaches_the_program_verbatim() -> None:
    hostile = "a b; rm -rf / $(touch pwned) `id` 'q' \"dq\" \\ * ~ # &"
    line = C.shell_join(["printf", "%s", hostile])
    out = subprocess.run(["sh", "-c", line], capture_output=True, text=True, check=True).stdout
    assert out == hostile


def test_clean_env_starts_from_nothing() -> None:
    argv = C.clean_env(["tail"], {"X": "1"})
    assert argv[:2] == ["env", "-i"]
    assert "X=1" in argv and f"PATH={C.CONTAINER_PATH}" in argv
    assert argv[-1] == "tail"


def test_tmux_uses_private_socket_and_exact_targets() -> None:
    for argv in (
        C.tmux_has_session("run"),
        C.tmux_kill_session("run"),
        C.tmux_interrupt("run"),
        C.tmux_capture("run"),
        C.tmux_attach("run"),
    ):
        assert argv[:3] == ["tmux", "-L", "dflash"]
        target = argv[argv.index("-t") + 1]
        assert target.startswith("=run"), argv


def test_new_session_sets_options_before_the_session_exists() -> None:
    argv = C.tmux_new_session(
        "run", ["python", "-m", "trainer"], cwd="/w", env={"A": "1 2", "B": "x;y"}
    )
    seq = " ".join(argv)
    assert seq.index("remain-on-exit on") < seq.index("new-session")
    assert seq.index("history-limit") < seq.index("new-session")
    assert argv[argv.index("-x") + 1] == str(C.PANE_WIDTH)
    assert argv[argv.index("A=1 2") - 1 : argv.index("A=1 2") + 1] == ["-e", "A=1 2"]
    assert argv[-3:] == ["python", "-m", "trainer"]  # multi-arg form: exec'd without a shell


def test_no_value_can_end_the_tmux_command() -> None:
    """tmux ends a command at an argument ending in ';' ("a;" -> "a", then a new command) and
    reads a trailing '\\;' as a literal ';': every value is escaped that way, nothing else."""
    assert C.tmux_literal("a;") == "a\\;"
    assert C.tmux_literal(";") == "\\;"
    assert C.tmux_literal("a\\;") == "a\\\\;"  # tmux turns it back into a\\;
    assert C.tmux_literal("a;b") == "a;b"  # only a trailing ';' is special
    argv = C.tmux_new_session("run", ["python", ";", "x;"], cwd="/w", env={"A": "v;"})
    assert argv[-2:] == ["\\;", "x\\;"] and "A=v\\;" in argv
    separators = [i for i, a in enumerate(argv) if a.endswith(";") and not a.endswith("\\;")]
    assert [argv[i + 1] for i in separators] == ["set-option", "set-option", "new-session"]


def test_every_command_is_bounded_on_the_node() -> None:
    argv = C.bounded(["pct", "exec", "200", "--", "true"], 5)
    assert argv == ["timeout", "-k", str(C.KILL_AFTER_S), "5", "pct", "exec", "200", "--", "true"]
    assert C.bounded(["x"], 0.25)[3] == "0.25"
    assert C.bounded(["x"], 1e6)[3] == "1000000"  # never an exponent `timeout` cannot read


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["sh", "-c", "...", "dflash-status", "/w", "s"], "status"),
        (C.write_file_atomic("/w/run/config.toml"), "writing /w/run/config.toml"),
        (C.tmux_new_session("s", ["x"], cwd="/w", env={}), "tmux new-session"),
        (C.tmux_settled_pane_state("s"), "the tmux pane query"),
        (["cat", "--", "/w/run/config.toml"], "reading /w/run/config.toml"),
        (C.pct_status(200), "pct status 200"),
        (C.bounded(C.pct_status(200), 3), "pct status 200"),
        (C.node_guarded(C.pct_exec(200, ["tail", "-F", "/w/a"])), "pct exec 200"),
        (["nvidia-smi", "--query-gpu=x"], "nvidia-smi"),
    ],
)
def test_commands_are_described_in_words(argv: list[str], words: str) -> None:
    assert C.describe(argv) == words


def test_capture_uses_negative_start_and_joins_wrapped_lines() -> None:
    argv = C.tmux_capture("s", 200)
    assert "-J" in argv and argv[argv.index("-S") + 1] == "-200"


def test_tail_follow_is_one_based_and_follows_by_name() -> None:
    assert C.tail_follow("/w/run/status.log", 0) == ["tail", "-n", "+1", "-F", "/w/run/status.log"]
    assert C.tail_follow("/x", 41)[2] == "+42"


@pytest.mark.parametrize(
    ("out", "state"),
    [("status: running\n", "running"), ("status: stopped", "stopped"), ("garbage", "unknown")],
)
def test_parse_pct_status(out: str, state: str) -> None:
    assert C.parse_pct_status(out) == state


def test_settled_pane_query_targets_the_exact_session_on_the_private_socket() -> None:
    argv = C.tmux_settled_pane_state("run")
    assert argv[:2] == ["sh", "-c"] and argv[-1] == "run"  # the name travels as "$1"
    assert '-L dflash display-message -p -t "=$1:"' in argv[2] and C.PANE_FORMAT in argv[2]


def test_parse_pane_state() -> None:
    s = C.parse_pane_state("1|3||1234\n")
    assert s == C.PaneState(dead=True, exit_status=3, pid=1234)
    alive = C.parse_pane_state("0|||99")
    assert alive is not None and not alive.dead and alive.exit_status is None
    killed = C.parse_pane_state("1||9|7")
    assert killed is not None and killed.exit_status == 137
    assert C.parse_pane_state("") is None
    assert C.parse_pane_state("can't find session") is None


def test_guard_kills_helper_when_stdin_closes() -> None:
    proc = subprocess.Popen(  # an hour: longer than any test budget
        C.guarded(["sleep", "3600"]), stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdin is not None
    proc.stdin.close()
    assert budget.wait(proc, "the guarded sleep") != 0  # the sleep was killed, not waited out


def test_node_guard_ends_the_whole_command_group_when_stdin_closes(tmp_path: Path) -> None:
    """The stream's node command keeps the channel as its stdin (the container guard inside
    reads it) and dies, children included, once it closes."""
    script = tmp_path / "hang.sh"
    script.write_text("cat >/dev/null & sleep 7781; wait\n")
    proc = subprocess.Popen(
        C.node_guarded(["sh", str(script)]), stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdin is not None
    proc.stdin.close()
    assert budget.wait(proc, "the node-guarded command") != 0
    budget.until(  # the group got its TERM; give the sleep a moment to be reaped
        lambda: (
            not subprocess.run(["pgrep", "-f", "sleep 7781"], capture_output=True, text=True).stdout
        ),
        "the group's sleep 7781 gone",
        every=0.1,
    )


def test_write_file_atomic_writes_stdin_with_mode(tmp_path: Path) -> None:
    target = tmp_path / "sub dir" / "secret"
    subprocess.run(C.write_file_atomic(str(target), "600"), input=b"tok\n", check=True)
    assert target.read_bytes() == b"tok\n"
    assert target.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in target.parent.iterdir()] == ["secret"]


@pytest.mark.parametrize("form", ["stream", "bounded"])
def test_no_abandoned_command_outlives_its_guard_under_load(tmp_path: Path, form: str) -> None:
    """Commands whose channel closes at once, 6 at a time: the node guard signals timeout's
    whole group and reaps what is left, so none of their children survives (signalling
    timeout's pid alone leaked ~1 in 4 of them under load)."""
    tag = "7793" if form == "stream" else "7794"
    script = tmp_path / "hang.sh"
    script.write_text(f"cat >/dev/null & sleep {tag}; wait\n")
    argv = (
        C.node_guarded(["sh", str(script)])
        if form == "stream"
        else C.bounded(["sh", str(script)], 300, watch_channel=True)
    )
    for _ in range(20):
        procs = [subprocess.Popen(argv, stdin=subprocess.PIPE) for _ in range(6)]
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.close()
        for proc in procs:
            budget.wait(proc, "an abandoned command's guard")

    def survivors() -> str:
        return subprocess.run(
            ["pgrep", "-f", f"sleep {tag}"], capture_output=True, text=True
        ).stdout

    with contextlib.suppress(budget.BudgetSpent):
        budget.until(lambda: not survivors(), every=0.1)
    left = survivors()
    subprocess.run(["pkill", "-f", f"sleep {tag}"], check=False)
    assert left == "", f"{len(left.split())} abandoned commands left running"
