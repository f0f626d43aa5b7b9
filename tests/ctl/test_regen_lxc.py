"""`dflashctl regen` on the real harness: sshd on loopback + the pct stand-in + an LXC container
in the host's network namespace (it reaches the vLLM regeneration engine on the host's
loopback), the committed trainer deployed, the job started, `status --json` showing its
progress while it runs (through a proxy that slows the engine down so there is a "while"), and
the finished job's output imported into a store built from the server's ids.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from dflashctl.cli.main import main as cli_main
from dflashctl.errors import ExitCode
from tests.conftest import require_part
from tests.ctl import parts as P
from tests.regen.fault_proxy import FaultProxy
from tests.regen.helpers import rows_of, run_import, write_mixed
from trainer.data.store import TokenStore
from trainer.serving.launch import RunningEngine

BUDGET_S = 900.0


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli_main(args)
    got = capsys.readouterr()
    return rc, got.out, got.err


def regen_status(inv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    rc, out, err = cli([*inv, "status", "ct", "--json"], capsys)
    assert rc in (ExitCode.OK, ExitCode.FAILED), err
    entry = json.loads(out)[0]
    assert isinstance(entry, dict)
    return entry.get("regen") or {}


@pytest.mark.parts
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_regen_on_the_lxc_harness_deploys_runs_shows_progress_and_imports(
    regen_server: RunningEngine,
    tmp_path: Path,
    qwen3_tokenizer_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    missing = P.have("/usr/sbin/sshd", "ssh-keygen", "lxc-create", "lxc-attach", "tmux")
    require_part(missing is None, missing or "")
    require_part(os.geteuid() == 0, "LXC containers need root")
    name = f"{P.NAME_PREFIX}{os.getpid()}-regen"
    with (
        P.real_parts(tmp_path / "parts", host_network=True, name=name) as parts,
        FaultProxy(regen_server.url, lambda key, attempt: "pass", delay_s=1.5) as slow,
    ):
        inv = P.pinned_inventory(parts, tmp_path)
        wd = parts.container.workdir_host
        write_mixed(wd / "mixed.jsonl")
        start = [*inv, "regen", "ct", "--input", "mixed.jsonl", "--out", "out.jsonl"]
        start += ["--server", slow.url, "--reasoning", "disable", "--max-tokens", "64"]
        start += ["--concurrency", "1", "--regen-arg=--status-interval-s 1"]
        rc, out, err = cli(start, capsys)
        assert rc == ExitCode.FAILED and "ct: nothing deployed; run `dflashctl deploy ct`" in err
        tree = P.frozen_tree(tmp_path / "tree")
        assert cli([*inv, "deploy", "ct", "--tree", str(tree), "--no-memory-check"], capsys)[0] == 0

        rc, out, err = cli(start, capsys)
        assert rc == 0 and "regeneration job" in err and "detached" in err, err
        deadline = time.monotonic() + BUDGET_S
        seen: list[dict[str, Any]] = []
        while True:  # progress while it runs, then its end
            view = regen_status(inv, capsys)
            seen.append(view)
            if view.get("state") not in ("running", "restarting"):
                break
            assert time.monotonic() < deadline, seen[-1]
            time.sleep(1.0)
        assert view["state"] == "finished", view
        running = [v for v in seen if v.get("state") == "running" and v.get("rows_total")]
        assert running, seen
        assert running[-1]["rows_total"] == 3 and running[-1]["in_flight"] in ([0], [1])
        assert view["rows_done"] == 3 and view["errors"] == 0 and view["gen_tok_s"] > 0
        rc, out, err = cli([*inv, "status", "ct"], capsys)
        assert "regen: " in out and "finished" in out and "3/3 rows (100%)" in out, out
        rc, out, err = cli([*inv, "regen", "ct", "--status", "--json"], capsys)
        assert rc == 0 and json.loads(out)["regen"]["state"] == "finished"

    _, rows = rows_of(wd / "out.jsonl")
    assert len(rows) == 3
    imported = run_import(wd / "out.jsonl", qwen3_tokenizer_dir, tmp_path / "store")
    assert imported.returncode == 0, imported.stderr
    gens = sum(len(r["dflash_regen"]["generations"]) for r in rows)
    store = TokenStore.open(tmp_path / "store")
    assert len(store) == gens
    first = rows[0]["dflash_regen"]["generations"][0]
    assert store.row(0)[0].tolist() == first["prompt_token_ids"] + first["token_ids"]
