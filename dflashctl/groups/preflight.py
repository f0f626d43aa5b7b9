"""A group's data preflight: nodes share no storage (two Proxmox nodes each have their own
disks), so every node must hold the token store and the target model its deployed config names.
Before anything starts, each node is asked, in one round trip, whether those paths hold a store
(`manifest.json`) and a model (`config.json`); one line names each node and path that does not.
What the trainer builds itself when absent (`data.synthetic`, `model.tiny_target`: each node's
first process builds its own copy) is no problem.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from dataclasses import dataclass

from trainer.config import TrainConfig


@dataclass(frozen=True)
class DataNeed:
    """One path a node's trainer reads at start."""

    key: str  # data.store | model.target_dir
    path: str  # as the node resolves it (relative: against the config file's directory)
    marker: str  # the file inside that says it is there
    what: str  # for people: "token store", "target model"
    built: bool  # the trainer builds it there when it is absent

    @property
    def marker_path(self) -> str:
        return posixpath.join(self.path, self.marker)


def node_path(value: str, config_dir: str) -> str:
    """`value` as the trainer resolves it on the node (TrainConfig.resolve: against the config
    file's directory); `~/...` stays for the node's shell to expand."""
    if value.startswith("/") or value.startswith("~"):
        return value
    return posixpath.normpath(posixpath.join(config_dir, value))


def data_needs(cfg: TrainConfig, config_dir: str) -> list[DataNeed]:
    """The store and target the config names, as paths on the node (pure)."""
    return [
        DataNeed(
            "data.store",
            node_path(cfg.data.store, config_dir),
            "manifest.json",
            "token store",
            cfg.data.synthetic is not None,
        ),
        DataNeed(
            "model.target_dir",
            node_path(cfg.model.target_dir, config_dir),
            "config.json",
            "target model",
            cfg.model.tiny_target is not None,
        ),
    ]


# $@: marker files. One line per file: `yes` or `no` (`~/` expanded against the node's $HOME).
CHECK_SCRIPT = """for f; do
  case $f in "~/"*) f="$HOME/${f#??}";; esac
  if [ -f "$f" ]; then echo yes; else echo no; fi
done
"""


def check_argv(needs: Sequence[DataNeed]) -> list[str]:
    """One command that answers, per need, whether its marker file is there."""
    return ["sh", "-c", CHECK_SCRIPT, "dflash-data-check", *(n.marker_path for n in needs)]


def problems(host: str, needs: Sequence[DataNeed], stdout: str) -> list[str]:
    """One line per need that is absent on `host` and that the trainer would not build."""
    answers = stdout.split()
    out = []
    for i, need in enumerate(needs):
        there = i < len(answers) and answers[i] == "yes"
        if there or need.built:
            continue
        out.append(
            f"{host}: {need.key} {need.path}: no {need.what} there (no {need.marker}); every "
            f"node reads its own copy: put it at that path on {host}"
        )
    return out
