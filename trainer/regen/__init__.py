"""`python -m trainer.regen`: regenerate a chat file's assistant turns with the target itself,
through OpenAI-compatible serving engines (vLLM, SGLang), in the thinking mode it will serve.

Read top to bottom: `cli` (flags, checked before anything connects) -> `job` (the run: inputs,
resume, one task per row, status lines) -> `dialogue` (one row, turn by turn, on the model's own
answers; tool results spliced back) -> `requests` (one request with bounded jittered retries)
-> `servers` (per-server concurrency, least-loaded choice, a server that went away waited for)
-> `client` (one HTTP request, its failure classified) and `replies` (a chat completion read,
the think guard) -> `rows` (the source rows: ids, turns), `output` (OUT and OUT.errors.jsonl:
whole lines only, resume scan) and `progress` (counters and the status line). The file format
the importer reads is `trainer.data.served`'s.
"""
