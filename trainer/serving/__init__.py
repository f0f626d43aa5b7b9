"""The serving engine side: an exported drafter measured where it is served.

`metrics` reads vLLM's speculative-decoding counters (pure), `client` talks to a running engine
over HTTP, `launch` starts and stops one (`vllm serve` or the module entry point), `compare`
puts the engine's acceptance beside the project's own loop, and `served_eval` opens an engine
for a run and sends it each turn (`python -m trainer.eval --engine vllm`, `python -m
trainer.gate`). Torch-free: the project's loop runs in the callers.
"""
