"""Inputs and runners shared by the regeneration tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.serving.engine import REPO, python_env

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOL_RESULT = '{"temp": 21, "sky": "clear"}'
SHAREGPT = {
    "conversations": [
        {"from": "human", "value": "Hello there"},
        {"from": "gpt", "value": "Hi! How can I help?"},
        {"from": "human", "value": "Tell me a joke"},
        {"from": "gpt", "value": "Why did the chicken cross the road?"},
    ]
}
WITH_TOOLS = {
    "messages": [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": TOOL_RESULT},
        {"role": "assistant", "content": "It is 21 degrees and clear."},
    ],
    "tools": [WEATHER_TOOL],
}
WITH_REASONING = {
    "messages": [
        {"role": "user", "content": "Is 17 prime?"},
        {
            "role": "assistant",
            "reasoning_content": "17 has no divisors but 1 and itself.",
            "content": "Yes, 17 is prime.",
        },
    ]
}
BAD_LINE = '{"messages": [{"role": "user", "content": "broken'


def write_mixed(path: Path) -> Path:
    """ShareGPT multi-turn, OpenAI with tools, a row with reasoning, then a malformed line."""
    rows = [json.dumps(r) for r in (SHAREGPT, WITH_TOOLS, WITH_REASONING)]
    path.write_text("\n".join([*rows, BAD_LINE]) + "\n")
    return path


def write_many(path: Path, rows: int) -> Path:
    """`rows` distinct rows: every third with the tool, every fourth two user turns."""
    lines = []
    for k in range(rows):
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"question {k}"}]
        messages.append({"role": "assistant", "content": f"answer {k}"})
        row: dict[str, Any] = {"messages": messages}
        if k % 3 == 0:
            messages[1] = {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {}}}
                ],
            }
            messages += [
                {"role": "tool", "content": f"result {k}"},
                {"role": "assistant", "content": "ok"},
            ]
            row["tools"] = [WEATHER_TOOL]
        if k % 4 == 0:
            messages += [
                {"role": "user", "content": f"follow-up {k}"},
                {"role": "assistant", "content": "x"},
            ]
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


def regen_argv(inputs: list[Path], server: str, out: Path, *more: str) -> list[str]:
    argv = [sys.executable, "-m", "trainer.regen", "--input", *map(str, inputs)]
    argv += ["--server", server, "--out", str(out), "--status-interval-s", "1"]
    return [*argv, "--max-tokens", "64", *more]  # the engine's context is 1024


def run_regen(
    inputs: list[Path], server: str, out: Path, *more: str, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        regen_argv(inputs, server, out, *more),
        cwd=REPO,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rows_of(out: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the manifest, the rows) of a regenerated file."""
    lines = read_jsonl(out)
    return lines[0]["dflash_regen_manifest"], lines[1:]


def run_import(
    source: Path, tokenizer: Path, store: Path, *more: str
) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "trainer.data", "import", "--input", str(source)]
    argv += ["--tokenizer", str(tokenizer), "--max-length", "1024", "--out", str(store)]
    argv += ["--workers", "1", *more]
    return subprocess.run(argv, cwd=REPO, env=python_env(), capture_output=True, text=True)
