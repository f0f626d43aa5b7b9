"""The declared transformers range is the tested one: `make test` runs tests/model on the floor."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _floor(requirement: str, name: str) -> str:
    match = re.fullmatch(rf"{re.escape(name)}>=([0-9][0-9.]*)", requirement.replace(" ", ""))
    assert match, f"{requirement!r} is not a plain {name}>=X floor"
    return match.group(1)


def test_makefile_tests_the_transformers_floor_pyproject_declares() -> None:
    train = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    reqs = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]: r for r in train["train"]}
    declared = _floor(reqs["transformers"], "transformers")
    makefile = (ROOT / "Makefile").read_text()
    tested = re.search(r"^TRANSFORMERS_FLOOR := (\S+)$", makefile, re.MULTILINE)
    assert tested, "Makefile has no TRANSFORMERS_FLOOR"
    assert tested.group(1).removesuffix(".0") == declared.removesuffix(".0")
    assert "test-lowest" in makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    # The tokenizers pin of that step must satisfy the declared tokenizers floor.
    pin = re.search(r"tokenizers==([0-9.]+)", makefile)
    assert pin
    tok_floor = _floor(reqs["tokenizers"], "tokenizers")

    def as_tuple(version: str) -> tuple[int, ...]:
        return tuple(int(x) for x in version.split("."))

    assert as_tuple(pin.group(1)) >= as_tuple(tok_floor)
