"""Export conventions pinned against the engines' loaders (docs/serving.md): an export carries
every config.json key vLLM and SGLang read for DFlash, each with the value the run trained
with, and the check names any key that is missing, differs from the run's config, or would
make an engine read something else instead."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.model.helpers import make_drafter
from trainer.config import TrainConfig
from trainer.config.overlay import dump_toml, merge
from trainer.model.drafter import DrafterConfig
from trainer.model.engine_fields import OVERRIDING_KEYS, check_export, engine_fields, lookup, nest
from trainer.model.errors import ExportError
from trainer.model.export import export_drafter
from trainer.model.target import TargetModel
from trainer.pipeline import assets

REPO = Path(__file__).resolve().parents[2]


def run_drafter_config(tmp_path: Path, tiny_dir: Path, **model: object) -> DrafterConfig:
    """The DrafterConfig `python -m trainer` builds from the bundled tiny config over `tiny_dir`."""
    import tomllib

    base = tomllib.loads((REPO / "configs" / "tiny-cpu.toml").read_text())
    table = merge(base, {"model": {"target_dir": str(tiny_dir), **model}})
    path = tmp_path / "run.toml"
    path.write_text(dump_toml(table))
    cfg = TrainConfig.load(path)
    hf = assets.target_hf_config(tiny_dir)
    return assets.drafter_config(cfg, hf, assets.layer_ids_for(cfg, hf))


def test_an_export_carries_every_engine_key_with_the_runs_value(
    target: TargetModel, tiny_dir: Path, tmp_path: Path
) -> None:
    run = run_drafter_config(tmp_path, tiny_dir, mask_token_id=511, target_layer_ids=[1, 5])
    drafter = make_drafter(target, block_size=run.block_size, num_layers=run.num_layers)
    assert drafter.config.model_dump(exclude={"initializer_range"}) == run.model_dump(
        exclude={"initializer_range"}
    )
    out = export_drafter(drafter, tmp_path / "export")
    check_export(out, run)  # nothing missing, nothing different
    data = json.loads((out / "config.json").read_text())
    assert data["dflash_config"] == {
        "target_layer_ids": [1, 5],
        "mask_token_id": 511,
        "causal": False,
        "use_swa": False,
        "use_aux_hidden_state": True,
        "sample_from_anchor": False,
    }
    assert data["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert data["is_neox_style"] is True and data["layer_types"] == ["full_attention"] * 2


def test_every_missing_key_is_named(target: TargetModel, tmp_path: Path) -> None:
    drafter = make_drafter(target)
    out = export_drafter(drafter, tmp_path / "export")
    data = json.loads((out / "config.json").read_text())
    for key in engine_fields(drafter.config):
        stripped = json.loads(json.dumps(data))
        *parents, leaf = key.split(".")
        node = stripped
        for part in parents:
            node = node[part]
        del node[leaf]
        (out / "config.json").write_text(json.dumps(stripped))
        with pytest.raises(ExportError, match=rf"config.json: missing {key} \(the run used "):
            check_export(out, drafter.config)


@pytest.mark.parametrize(
    ("model", "key", "message"),
    [
        ({"mask_token_id": 500}, "dflash_config.mask_token_id", "is 511, the run used 500"),
        (
            {"target_layer_ids": [2, 5]},
            "dflash_config.target_layer_ids",
            "is [1, 5], the run used [2, 5]",
        ),
    ],
)
def test_an_export_unlike_the_runs_config_names_the_key(
    target: TargetModel,
    tiny_dir: Path,
    tmp_path: Path,
    model: dict[str, object],
    key: str,
    message: str,
) -> None:
    """The export (mask 511, layers [1, 5]) checked against a run that trained otherwise."""
    run = run_drafter_config(
        tmp_path, tiny_dir, **{"mask_token_id": 511, "target_layer_ids": [1, 5], **model}
    )
    out = export_drafter(make_drafter(target, block_size=run.block_size), tmp_path / "export")
    with pytest.raises(ExportError, match=re.escape(f"{key} {message}")):
        check_export(out, run)


@pytest.mark.parametrize("key", OVERRIDING_KEYS)
def test_a_key_an_engine_reads_instead_of_ours_is_refused(
    target: TargetModel, tmp_path: Path, key: str
) -> None:
    """vLLM reads eagle_aux_hidden_state_layer_ids (no +1) before dflash_config.target_layer_ids."""
    drafter = make_drafter(target)
    out = export_drafter(drafter, tmp_path / "export")
    data = json.loads((out / "config.json").read_text())
    data[key] = [2, 6]
    (out / "config.json").write_text(json.dumps(data))
    with pytest.raises(ExportError, match=rf"{key} is set: an engine reads it instead"):
        check_export(out, drafter.config)


def test_nest_and_lookup_are_inverse() -> None:
    flat = {"a": 1, "b.c": [2], "b.d.e": False}
    assert nest(flat) == {"a": 1, "b": {"c": [2], "d": {"e": False}}}
    assert all(lookup(nest(flat), k) == v for k, v in flat.items())
