"""One-line validation messages: every offending key is named, not just the first."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from dflashctl.config.inventory import InventoryError, parse_inventory
from trainer.config import ConfigError, TrainConfig
from trainer.config.validation import STRICT, NotUtf8Error, one_line, utf8_text


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
    a: int
    b: int
    c: int
    d: int


def _error(**values: object) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        _Strict.model_validate(values)
    return info.value


def test_names_each_problem_in_plain_words_then_counts_the_rest() -> None:
    assert one_line(_error(a="x", b=1, c=1, d=1)).startswith("a: Input should be a valid integer")
    assert one_line(_error(a=1, b=1, c=1, d=1, typo=2)) == "typo: unknown key (typo?)"
    msg = one_line(_error(e=1))  # a, b, c, d missing and e unknown: 5 problems
    assert msg == (
        "a: required key is missing; b: required key is missing; c: required key is missing"
        " (+2 more)"
    )
    assert "\n" not in msg


def test_a_run_config_with_several_mistakes_names_them_all(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('seed = "one"\n[data]\nstore = "s"\nstroe = "s"\n')
    with pytest.raises(ConfigError) as info:
        TrainConfig.load(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    for key in ("seed: ", "data.stroe: unknown key (typo?)", "batching: required key is missing"):
        assert key in message, message


def test_an_inventory_with_several_mistakes_names_each_host_key() -> None:
    text = '[hosts.a]\naddress = "h"\nctid = "x"\n[hosts.b]\naddress = "h"\nctid = 1\nprot = 2\n'
    with pytest.raises(InventoryError) as info:
        parse_inventory(text, Path("/inv/hosts.toml"))
    message = str(info.value)
    assert message.startswith("/inv/hosts.toml: host 'a': ctid: ")
    assert "; host 'b': prot: unknown key (typo?)" in message


class _Typed(BaseModel):
    model_config = ConfigDict(**STRICT, extra="forbid")
    n: int = 0
    x: float = 0.0
    s: str = ""


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"n": True}, "n: Input should be a valid integer, got true"),
        ({"n": "64"}, 'n: Input should be a valid integer, got "64"'),
        ({"n": 64.0}, "n: Input should be a valid integer, got 64.0"),
        ({"x": float("inf")}, "x: Input should be a finite number, got inf"),
        ({"x": float("nan")}, "x: Input should be a finite number, got nan"),
        ({"x": False}, "x: Input should be a valid number, got false"),
        ({"s": ["a"]}, "s: Input should be a valid string, got a list"),
    ],
)
def test_strict_types_say_what_was_given(values: dict[str, object], expected: str) -> None:
    """Under STRICT nothing is coerced, and the message shows the value as TOML spells it."""
    with pytest.raises(ValidationError) as info:
        _Typed.model_validate(values)
    assert one_line(info.value) == expected
    assert _Typed.model_validate({"x": 2}).x == 2.0  # an integer is still a valid float


def test_a_long_given_value_is_cut() -> None:
    with pytest.raises(ValidationError) as info:
        _Typed.model_validate({"n": "9" * 100})
    assert one_line(info.value) == 'n: Input should be a valid integer, got "' + "9" * 36 + "..."


def test_utf8_text_names_the_first_bad_byte_and_its_line() -> None:
    assert utf8_text("naïve\n".encode()) == "naïve\n"
    with pytest.raises(NotUtf8Error) as info:
        utf8_text(b"a = 1\nb = '\xff'\n")
    assert str(info.value) == "not UTF-8 text at byte 11 (line 2): invalid start byte 0xff"
    assert (info.value.offset, info.value.line) == (11, 2)


def test_overlay_merges_tables_and_writes_toml_that_reads_back() -> None:
    import tomllib

    from trainer.config.overlay import dump_toml, merge

    base = {"a": 1, "t": {"x": 'q"uote', "keep": [1, 2]}, "u": {"v": True}}
    out = merge(base, {"t": {"x": "new", "y": (3, 4)}, "u": 5})
    assert out == {"a": 1, "t": {"x": "new", "keep": [1, 2], "y": (3, 4)}, "u": 5}
    assert base["t"] == {"x": 'q"uote', "keep": [1, 2]}  # base untouched
    assert tomllib.loads(dump_toml(base)) == base
    assert tomllib.loads(dump_toml(out))["t"]["y"] == [3, 4]
