"""TrainConfig: TOML loading, one-line errors, hashing, resume-critical diffs, torch-free import."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from tests import budget
from trainer.config import ConfigError, TrainConfig, config_hash, resume_critical_changes

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-cpu.toml"

MINIMAL = """
[data]
store = "store"
[batching]
token_budget = 4096
[model]
target_dir = "/abs/target"
mask_token_id = 151669
"""


def _write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_bundled_tiny_config_loads_and_resolves_paths_next_to_it() -> None:
    """configs/tiny-cpu.toml is valid and its relative paths point under configs/."""
    cfg = TrainConfig.load(TINY)
    assert cfg.topology.target_devices == ["cpu"] and cfg.topology.drafter_devices == ["cpu"]
    assert cfg.resolve(cfg.data.store) == (TINY.parent / ".cache/tiny-store").resolve()
    assert cfg.resolve("/abs/x") == Path("/abs/x")


def test_defaults_follow_the_paper_recipe(tmp_path: Path) -> None:
    """Unset keys take the DFlash recipe: lr 6e-4, warmup 4%, 6 epochs, clip 1, block 16."""
    cfg = TrainConfig.load(_write(tmp_path, MINIMAL))
    assert cfg.optimizer.lr == 6e-4 and cfg.schedule.warmup_ratio == 0.04
    assert cfg.schedule.epochs == 6 and cfg.optimizer.clip == 1.0
    assert cfg.model.drafter.block_size == 16 and cfg.model.drafter.num_layers == 5


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("[optimizer]\nlr = -1\n", "run.toml: optimizer.lr: Input should be greater than 0"),
        ("[optimizer]\nlrr = 1e-3\n", "run.toml: optimizer.lrr: unknown key (typo?)"),
        ("[topology]\ntarget_devices = []\n", "run.toml: topology.target_devices: "),
        ("[schedule]\nwarmup_ratio = 1.5\n", "run.toml: schedule.warmup_ratio: "),
        ("typo_top = 1\n", "run.toml: typo_top: unknown key (typo?)"),
    ],
)
def test_errors_are_one_line_naming_file_and_dotted_key(
    tmp_path: Path, extra: str, expected: str
) -> None:
    """A bad value or a typo is reported as `file: dotted.key: reason` on one line."""
    text = textwrap.dedent(MINIMAL)
    if extra.startswith("["):
        text += extra
    else:
        text = extra + text
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        TrainConfig.load(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path.parent / expected)), message


def test_missing_key_bad_toml_and_missing_file(tmp_path: Path) -> None:
    """Missing required keys, TOML syntax errors and absent files all name the file."""
    path = _write(tmp_path, "[data]\nstore = 's'\n[batching]\ntoken_budget = 8\n")
    with pytest.raises(ConfigError, match=r"run.toml: model: required key is missing"):
        TrainConfig.load(path)
    bad = _write(tmp_path, "[data\nstore=", "bad.toml")
    with pytest.raises(ConfigError, match=r"bad.toml: invalid TOML"):
        TrainConfig.load(bad)
    with pytest.raises(ConfigError, match=r"nope.toml: cannot read"):
        TrainConfig.load(tmp_path / "nope.toml")


def test_bad_boundaries_name_the_key(tmp_path: Path) -> None:
    """Non-increasing bucket edges are refused at load, not mid-run."""
    text = MINIMAL.replace("token_budget = 4096", "token_budget = 4096\nboundaries = [0, 9, 9]")
    with pytest.raises(ConfigError, match=r"batching: .*strictly increasing"):
        TrainConfig.load(_write(tmp_path, text))


def test_hash_is_stable_and_sensitive(tmp_path: Path) -> None:
    """Same content -> same 12-hex hash; any value change -> a different hash."""
    a = TrainConfig.load(_write(tmp_path, MINIMAL, "a.toml"))
    b = TrainConfig.load(_write(tmp_path, MINIMAL, "b.toml"))
    c = TrainConfig.load(_write(tmp_path, MINIMAL + "[optimizer]\nlr = 1e-4\n", "c.toml"))
    assert config_hash(a) == config_hash(b) and len(config_hash(a)) == 12
    assert config_hash(a) != config_hash(c)


def test_to_toml_round_trips(tmp_path: Path) -> None:
    """The canonical TOML written into checkpoints loads back to the same config."""
    cfg = TrainConfig.load(TINY)
    again = TrainConfig.from_dict(tomllib.loads(cfg.to_toml()))
    assert again.model_dump() == cfg.model_dump()
    assert config_hash(again) == config_hash(cfg)


def test_resume_critical_changes_name_only_breaking_keys() -> None:
    """Data order and model shape break resume; LR, intervals and noise do not."""
    base = tomllib.loads(TINY.read_text())
    old = TrainConfig.from_dict(base)
    same = TrainConfig.from_dict(
        base
        | {"optimizer": base["optimizer"] | {"lr": 1e-4}, "status": {"interval_s": 5}}
        | {"model": base["model"] | {"noise": 0.05}}
    )
    assert resume_critical_changes(old, same) == []
    new = TrainConfig.from_dict(
        base
        | {"batching": base["batching"] | {"boundaries": [0, 40, 97]}}
        | {"model": base["model"] | {"drafter": {"num_layers": 3, "block_size": 4}}}
        | {"seed": 1}
    )
    assert resume_critical_changes(old, new) == [
        "batching.boundaries",
        "model.drafter.num_layers",
        "seed",
    ]


BLOCK_TORCH = """
import importlib.abc, sys
class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith(("torch.", "transformers", "triton")):
            raise ImportError(f"{name} is blocked: this module must stay torch-free")
        return None
sys.meta_path.insert(0, _NoTorch())
"""


def test_shared_modules_import_without_torch() -> None:
    """dflashctl imports events, config, buckets and the LR schedule on laptops without torch."""
    modules = ["trainer.events", "trainer.config", "trainer.config.schedule"]
    if (REPO / "trainer" / "buckets.py").exists():  # the planner lands in parallel
        modules.append("trainer.buckets")
    code = (
        BLOCK_TORCH
        + "".join(f"import {m}\n" for m in modules)
        + (
            "assert 'torch' not in sys.modules\n"
            "trainer.config.TrainConfig.load(sys.argv[1])\n"
            "print('ok')\n"
        )
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(TINY)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=budget.left(),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_seed_topology_is_one_config_line() -> None:
    """The 6-1 production shape validates: six target workers, one drafter device."""
    cfg = TrainConfig.load(REPO / "configs" / "qwen3-8b-6x1.toml")
    assert cfg.topology.target_devices == [f"cuda:{i}" for i in range(1, 7)]
    assert cfg.topology.drafter_devices == ["cuda:0"]
    assert cfg.batching.boundaries == [1, 770, 1216, 1728, 2432, 3296, 8193]
    assert resume_critical_changes(cfg, cfg) == []


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("[optimizer]\nlr = inf\n", "optimizer.lr: Input should be a finite number, got inf"),
        ("[optimizer]\nlr = nan\n", "optimizer.lr: Input should be a finite number, got nan"),
        ("[optimizer]\nbetas = [0.9, inf]\n", "optimizer.betas.1: Input should be a finite"),
        ("[optimizer]\nbetas = [1.0, 0.9]\n", "optimizer.betas.0: Input should be less than 1"),
        ("[model.drafter]\nnum_layers = 1\n[status]\ninterval_s = -inf\n", "status.interval_s: "),
        ("[schedule]\nmin_lr = nan\n", "schedule.min_lr: Input should be a finite number"),
        ("[checkpoint]\nevery_minutes = inf\n", "checkpoint.every_minutes: Input should be a fin"),
    ],
)
def test_non_finite_floats_are_refused_in_every_field(
    tmp_path: Path, extra: str, expected: str
) -> None:
    """`lr = inf` passed `gt=0` and put NaN into every weight after one step: refused at load."""
    with pytest.raises(ConfigError) as info:
        TrainConfig.load(_write(tmp_path, textwrap.dedent(MINIMAL) + extra))
    assert str(info.value).startswith(f"{tmp_path / 'run.toml'}: {expected}"), str(info.value)


@pytest.mark.parametrize(
    ("value", "shown"),
    [("true", "true"), ('"64"', '"64"'), ("64.0", "64.0"), ("6.4e1", "64.0")],
)
def test_integers_are_strict_booleans_strings_and_floats_are_refused(
    tmp_path: Path, value: str, shown: str
) -> None:
    """`max_batch = true` became 1 (and "64" / 64.0 became 64): now an error naming the key."""
    text = MINIMAL.replace("token_budget = 4096", f"token_budget = 4096\nmax_batch = {value}")
    with pytest.raises(ConfigError) as info:
        TrainConfig.load(_write(tmp_path, text))
    assert str(info.value) == (
        f"{tmp_path / 'run.toml'}: batching.max_batch: Input should be a valid integer, got {shown}"
    )


def test_floats_take_integers_but_never_booleans_or_strings(tmp_path: Path) -> None:
    """`lr = 1` and `interval_s = 2` are natural TOML for floats; `true` or "1e-3" are not."""
    cfg = TrainConfig.load(_write(tmp_path, MINIMAL + "[optimizer]\nlr = 1\nbetas = [0, 0.5]\n"))
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.betas == (0.0, 0.5) and isinstance(cfg.optimizer.betas[0], float)
    for bad, shown in (("true", "true"), ('"1e-3"', '"1e-3"')):
        with pytest.raises(ConfigError, match=rf"optimizer.lr: .*valid number, got {shown}$"):
            TrainConfig.load(_write(tmp_path, MINIMAL + f"[optimizer]\nlr = {bad}\n"))
    with pytest.raises(ConfigError, match=r"data.store: Input should be a valid string, got 7"):
        TrainConfig.load(_write(tmp_path, MINIMAL.replace('store = "store"', "store = 7")))


def test_a_non_utf8_config_names_the_file_and_byte_offset(tmp_path: Path) -> None:
    """Latin-1 bytes in a comment: one line with the byte offset and its line, no traceback."""
    path = tmp_path / "run.toml"
    data = textwrap.dedent(MINIMAL).encode() + b"# caf\xe9\n"
    path.write_bytes(data)
    with pytest.raises(ConfigError) as info:
        TrainConfig.load(path)
    offset = data.index(b"\xe9")
    line = data[:offset].count(b"\n") + 1
    assert str(info.value) == (
        f"{path}: not UTF-8 text at byte {offset} (line {line}): invalid continuation byte 0xe9"
    )


def test_model_loss_defaults_labels_and_one_line_errors(tmp_path: Path) -> None:
    """[model.loss]: decayed CE by default; D-PACE's alpha defaults to the paper's 0.5; every
    misuse is one line naming the key."""
    cfg = TrainConfig.load(_write(tmp_path, MINIMAL))
    assert (cfg.model.loss.type, cfg.model.loss.kd_weight, cfg.model.loss.label()) == (
        "ce",
        0,
        "ce",
    )
    loss = "[model.loss]\n"
    dpace = TrainConfig.load(
        _write(tmp_path, MINIMAL + loss + 'type = "dpace"\nkd_weight = 0.25\n')
    )
    assert dpace.model.loss.dpace_alpha == 0.5 and dpace.model.loss.distills
    assert dpace.model.loss.label() == "dpace(alpha:0.5)+kd(0.25)"
    again = TrainConfig.from_dict(tomllib.loads(dpace.to_toml()))  # the checkpoint's copy
    assert again.model.loss == dpace.model.loss
    for extra, expected in [
        ('type = "kl"', "model.loss.type: Input should be 'ce' or 'dpace'"),
        ('type = "dpace"\nalpha = 0', "model.loss.alpha: Input should be greater than 0"),
        ('type = "dpace"\nalpha = 1.5', "model.loss.alpha: Input should be less than or equal"),
        ("alpha = 0.3", "model.loss: Value error, alpha applies to type 'dpace' only"),
        ("kd_weight = 2.0", "model.loss.kd_weight: Input should be less than or equal to 1"),
        ("kd = 0.5", "model.loss.kd: unknown key (typo?)"),
    ]:
        with pytest.raises(ConfigError) as info:
            TrainConfig.load(_write(tmp_path, MINIMAL + loss + extra + "\n"))
        assert str(info.value).startswith(f"{tmp_path / 'run.toml'}: {expected}"), str(info.value)


def test_changing_the_loss_is_resume_critical_by_name() -> None:
    """A checkpoint trained one loss is not continued under another: each key is named."""
    base = tomllib.loads(TINY.read_text())
    old = TrainConfig.from_dict(base)

    def with_loss(**loss: object) -> TrainConfig:
        return TrainConfig.from_dict(base | {"model": base["model"] | {"loss": loss}})

    assert resume_critical_changes(old, with_loss()) == []  # the default, spelled out
    assert resume_critical_changes(old, with_loss(type="ce")) == []
    assert resume_critical_changes(old, with_loss(type="dpace")) == ["model.loss.type"]
    assert resume_critical_changes(old, with_loss(kd_weight=0.5)) == ["model.loss.kd_weight"]
    dpace = with_loss(type="dpace")
    assert resume_critical_changes(dpace, with_loss(type="dpace", alpha=0.3)) == [
        "model.loss.alpha"
    ]
