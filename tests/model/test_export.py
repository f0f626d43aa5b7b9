"""Export in the z-lab layout and load back to identical logits."""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests import budget
from tests.model.helpers import MASK_ID, make_batch, make_drafter
from trainer.model.errors import ExportError
from trainer.model.export import export_drafter, load_drafter
from trainer.model.remote_code import PIECES, modeling_source
from trainer.model.speculative import speculative_generate
from trainer.model.target import TargetModel

REPO = Path(__file__).resolve().parents[2]


def test_export_writes_zlab_config_and_drafter_only_weights(
    target: TargetModel, tmp_path: Path
) -> None:
    """config.json carries dflash_config; safetensors holds no embedding or LM head."""
    drafter = make_drafter(target, block_size=8, num_layers=2)
    out = export_drafter(drafter, tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 8
    assert cfg["dflash_config"]["mask_token_id"] == MASK_ID
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 5]
    assert cfg["layer_types"] == ["full_attention", "full_attention"]
    keys = set(load_file(out / "model.safetensors"))
    assert {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.1.self_attn.q_norm.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.0.mlp.gate_proj.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.post_attention_layernorm.weight",
    } <= keys
    assert not any("embed" in k or "lm_head" in k for k in keys)
    assert not list(out.glob("*.tmp"))


def test_loaded_drafter_gives_identical_logits(target: TargetModel, tmp_path: Path) -> None:
    """Round trip: same weights, same config, same logits bit for bit."""
    drafter = make_drafter(target, block_size=4)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # not just the init
    loaded = load_drafter(export_drafter(drafter, tmp_path / "x"), target=target)
    ids, _loss, attn = make_batch(rows=1)
    feats = target.capture(ids, attn)
    block = drafter.block_input_ids(ids[:, 10:11])
    pos = torch.arange(10, 14)[None]
    with torch.no_grad():
        want = drafter.logits(drafter(feats[:, :10], block, pos))
        got = loaded.logits(loaded(feats[:, :10], block, pos))
    assert torch.equal(got, want)
    assert loaded.config == drafter.config


def test_load_refuses_a_target_with_other_capture_layers(
    target: TargetModel, tmp_path: Path
) -> None:
    """A drafter trained on layers [1, 5] must not silently read other layers."""
    out = export_drafter(make_drafter(target), tmp_path / "x")
    other = TargetModel(target.model, [2, 6])
    with pytest.raises(ExportError, match=r"\[1, 5\]"):
        load_drafter(out, target=other)


def test_load_names_the_broken_file(target: TargetModel, tmp_path: Path) -> None:
    """A config without dflash_config is reported with its path and the missing key."""
    out = export_drafter(make_drafter(target), tmp_path / "x")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["dflash_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match=r"config\.json: missing key 'dflash_config'"):
        load_drafter(out)
    with pytest.raises(ExportError, match="not a drafter export"):
        load_drafter(tmp_path / "nothing")


# Run from the export directory with the repository off sys.path (and its editable-install
# finder blocked), as a user who has only the export, torch and transformers would.
_LOAD_WITH_AUTOMODEL = """
import importlib.abc, sys
repo = sys.argv[1]
sys.path[:] = [p for p in sys.path if p not in (repo, "", ".")]

class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("trainer", "dflashctl", "tests"):
            raise ModuleNotFoundError(f"{name} must not be importable here")
        return None

sys.meta_path.insert(0, _Block())
import torch
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM

torch.set_num_threads(1)
model = AutoModel.from_pretrained(".", trust_remote_code=True).eval()
io = torch.load(sys.argv[2])
embed = nn.Embedding(*io["embed"].shape)
embed.weight.data = io["embed"]
head = nn.Linear(io["head"].shape[1], io["head"].shape[0], bias=False)
head.weight.data = io["head"]
model.bind_target(embed, head)
with torch.no_grad():
    hidden = model(io["features"], io["block"], io["positions"])
    logits = model.logits(hidden)
# The z-lab README's next step: generate with the target, loaded the usual way.
target = AutoModelForCausalLM.from_pretrained(sys.argv[4]).eval()
generated = model.spec_generate(
    input_ids=io["prompt"], max_new_tokens=12, temperature=0.0, target=target,
    stop_token_ids=io["stops"],
)
torch.save(
    {
        "class": type(model).__name__,
        "logits": logits,
        "generated": generated,
        "block_size": model.block_size,
        "mask_token_id": model.mask_token_id,
        "target_layer_ids": model.target_layer_ids,
        "state_keys": sorted(model.state_dict()),
        "trainer_modules": [m for m in sys.modules if m.split(".")[0] == "trainer"],
    },
    sys.argv[3],
)
"""


def test_automodel_with_remote_code_returns_the_drafter_from_the_export_alone(
    target: TargetModel, tmp_path: Path
) -> None:
    """`AutoModel.from_pretrained(export, trust_remote_code=True)` (the z-lab README's call)
    gives the trained drafter: same weights, identical logits, z-lab attributes, and its
    `spec_generate(..., target=...)` gives the project loop's tokens."""
    drafter = make_drafter(target, block_size=4)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    out = export_drafter(drafter, tmp_path / "export")
    ids, _loss, attn = make_batch(rows=1)
    feats = target.capture(ids, attn)
    block = drafter.block_input_ids(ids[:, 10:11])
    pos = torch.arange(10, 14)[None]
    with torch.no_grad():
        want = drafter.logits(drafter(feats[:, :10], block, pos))
    prompt = [5, 17, 42, 99, 3, 250]
    stops = [speculative_generate(target, drafter, prompt, 12).tokens[9]]
    want_tokens = speculative_generate(target, drafter, prompt, 12, stops).tokens
    io = tmp_path / "io.pt"
    torch.save(
        {
            "features": feats[:, :10],
            "block": block,
            "positions": pos,
            "embed": target.embed_tokens.weight.detach(),
            "head": target.lm_head.weight.detach(),
            "prompt": torch.tensor([prompt]),
            "stops": stops,
        },
        io,
    )
    result = tmp_path / "result.pt"
    env = dict(os.environ)
    # Keep other PYTHONPATH entries (the lowest-transformers step puts its install there).
    keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p) != REPO]
    env["PYTHONPATH"] = os.pathsep.join(keep)
    env["HF_HOME"] = str(tmp_path / "hf-home")  # the remote-code module cache
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _LOAD_WITH_AUTOMODEL,
            str(REPO),
            str(io),
            str(result),
            str(target.model.name_or_path),
        ],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=budget.left(),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(result)
    assert got["class"] == "DFlashDraftModel"
    assert got["trainer_modules"] == []
    assert torch.equal(got["logits"], want)
    assert got["generated"][0].tolist() == prompt + want_tokens
    assert got["state_keys"] == sorted(drafter.state_dict())
    assert (got["block_size"], got["mask_token_id"], got["target_layer_ids"]) == (
        4,
        MASK_ID,
        [1, 5],
    )


def test_export_config_points_automodel_at_the_modeling_file(
    target: TargetModel, tmp_path: Path
) -> None:
    """auto_map, `dtype` (and the older `torch_dtype`) next to the keys serving engines read."""
    out = export_drafter(make_drafter(target), tmp_path / "x")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert cfg["dtype"] == cfg["torch_dtype"] == "float32"
    assert cfg["model_type"] == "qwen3"
    assert (out / "dflash.py").read_text() == modeling_source()


def test_modeling_file_is_the_projects_drafter_source(tmp_path: Path) -> None:
    """Every class/function of `dflash.py` is cut verbatim from the project's modules (so the
    two cannot drift), and the file has no undefined or unused names."""
    source = modeling_source()
    tree = ast.parse(source)
    defined = {
        n.name: ast.get_source_segment(source, n)
        for n in tree.body
        if isinstance(n, ast.ClassDef | ast.FunctionDef)
    }
    for module, names in PIECES:
        project = inspect.getsource(module)
        for node in ast.parse(project).body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name in names:
                assert defined[node.name] == ast.get_source_segment(project, node), node.name
    assert {"DFlashDrafter", "DFlashDraftModel", "DrafterConfig", "RMSNorm"} <= set(defined)
    path = tmp_path / "dflash.py"
    path.write_text(source)
    lint = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "F", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert lint.returncode == 0, lint.stdout
