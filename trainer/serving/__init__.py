"""The serving engine side: an exported drafter measured where it is served.

`metrics` reads vLLM's speculative-decoding counters (pure), `client` talks to a running engine
over HTTP, `launch` starts and stops one (`vllm serve` or the module entry point), `compare`
puts the engine's acceptance beside the project's own loop, and `served_eval` is the per-turn
driver `python -m trainer.eval --engine vllm` and `python -m trainer.gate` use.
Torch-free except `served_eval` (which runs the project's loop).
"""
