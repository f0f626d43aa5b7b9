"""One regeneration job: its servers, its files, a task per row, the status lines.

1. The servers are asked for their models (`--model` must be among them; unset: the first
   server's first); one that does not answer starts as down.
2. OUT and its errors file: a new OUT opens with the manifest; `--resume` reads both back
   (`output.scan`: a torn last line is cut) and checks the manifest against this run's.
3. The inputs are read once to count the rows of the scope (`--limit`: the first N usable
   rows) and which of them ended before (their ids in OUT or the errors file), then again to
   regenerate the rest: at most 2 x the total concurrency rows at a time, each a task
   (`dialogue.regenerate`), written whole when it ends.
4. Every `--status-interval-s` a status line; each server state change one line.

It ends with exit 0 when every row of the scope ended (in OUT or in the errors file), 1 when
every server stayed away for `--wait-s`, 2 when the first rows all failed the same way (a
wrong model, a server ignoring the mode, a missing reasoning parser: the rest would too), 130
on SIGINT/SIGTERM. Rows in flight then are not written; `--resume` does them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from trainer.data.chat_import import ImportStats, describe
from trainer.data.served import RegenManifest
from trainer.errors import ExitCode, TrainerError
from trainer.events import format_error_line, format_phase_line
from trainer.regen.client import Failure, models, new_http
from trainer.regen.dialogue import regenerate
from trainer.regen.output import LineFile, check_resume, encode, errors_path, scan
from trainer.regen.progress import Tally, status_line, summary
from trainer.regen.replies import Reply
from trainer.regen.requests import Budget, Requester, RowFailed
from trainer.regen.rows import SourceRow, read_rows
from trainer.regen.servers import ServerPool

LENGTH_CAPPED = "length_capped"
BREAKER_ROWS = 20
"""The job stops (exit 2) when its first this many ended rows all failed: the rest would too."""


class JobError(TrainerError):
    """The job cannot start or go on (one line naming the URL, file or flag)."""


@dataclass(frozen=True)
class JobConfig:
    inputs: list[Path]
    servers: list[str]
    out: Path
    manifest: RegenManifest  # model "" until the servers named it
    concurrency: int = 64
    resume: bool = False
    limit: int | None = None
    max_retries: int = 8
    request_timeout_s: float = 1800.0
    wait_s: float = 3600.0
    status_interval_s: float = 30.0
    backoff_s: float = 1.0
    token_ids: bool = True
    run_dir: Path | None = None
    body: dict[str, Any] = field(default_factory=dict)  # sampling + chat_template_kwargs


class Console:
    """Lines to stdout and, with a run dir, appended to RUN/status.log (what the supervisor and
    dflashctl read)."""

    def __init__(self, run_dir: Path | None, out: TextIO) -> None:
        self.out = out
        self.log: TextIO | None = None
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.log = open(run_dir / "status.log", "a", encoding="utf-8")  # noqa: SIM115

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)
        if self.log is not None:
            self.log.write(line + "\n")
            self.log.flush()

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


async def pick_model(
    http: Any, servers: list[str], wanted: str, max_tokens: int
) -> tuple[str, list[str]]:
    """The model to ask for, and the servers that did not answer (they start down). A model a
    server does not serve, or a --max-tokens past a server's context, is refused here."""
    answers = await asyncio.gather(*(models(http, url) for url in servers), return_exceptions=True)
    silent = [url for url, a in zip(servers, answers, strict=True) if isinstance(a, Failure)]
    listed = {url: a for url, a in zip(servers, answers, strict=True) if isinstance(a, dict)}
    for answer in answers:
        if isinstance(answer, BaseException) and not isinstance(answer, Failure):
            raise answer
    model = wanted or next((next(iter(a)) for a in listed.values() if a), "")
    if not model:
        raise JobError(
            f"no server answered /v1/models ({', '.join(servers)}): start them, or name the "
            "model with --model to wait for them"
        )
    for url, served in listed.items():
        if served and model not in served:
            raise JobError(f"--model {model!r}: {url} serves {', '.join(served)}")
        context = served.get(model)
        if context is not None and max_tokens >= context:
            raise JobError(
                f"--max-tokens {max_tokens}: {url} serves {model!r} with a context of {context} "
                "tokens (its --max-model-len); ask for fewer"
            )
    return model, silent


class Job:
    """The running job (see the module docstring)."""

    def __init__(self, cfg: JobConfig, console: Console) -> None:
        self.cfg, self.console = cfg, console
        self.tally = Tally()
        self.stop: str | None = None
        self.started = time.monotonic()
        self.failure: tuple[int, str] | None = None  # (exit status, line) that ends the job
        self.http = new_http(cfg.request_timeout_s, len(cfg.servers) * cfg.concurrency)
        self.pool = ServerPool(
            cfg.servers, cfg.concurrency, lambda url: models(self.http, url), self._server_line
        )
        self.requester = Requester(self.pool, self.http, cfg.body, cfg.backoff_s)
        self.files: tuple[LineFile, LineFile] | None = None
        self.before: tuple[set[str], set[str]] = (set(), set())
        self.skips = ""

    def _server_line(self, text: str) -> None:
        self.console.say(format_phase_line("regen_server", text))

    def open_files(self) -> None:
        """OUT and its errors file, ready to append; what ended in them before (a resume)."""
        out, errs = self.cfg.out, errors_path(self.cfg.out)
        present = [p for p in (out, errs) if p.exists() and p.stat().st_size]
        if present and not self.cfg.resume:
            raise JobError(f"{present[0]} exists: --resume continues it, or choose another --out")
        if not out.parent.is_dir():
            raise JobError(f"--out {out}: no directory {out.parent}")
        rows = scan(out, with_manifest=True, marker=b'"length_capped":true')
        failed = scan(errs, with_manifest=False, marker=b'"reason":"length_capped"')
        for path, found in ((out, rows), (errs, failed)):
            if found.cut_bytes:
                detail = f"{path}: cut {found.cut_bytes} bytes: {found.cut_reason}"
                self.console.say(format_phase_line("regen_starting", detail))
        check_resume(out, rows.manifest, self.cfg.manifest)
        self.files = (LineFile(out), LineFile(errs))
        if rows.manifest is None:
            self.files[0].write((self.cfg.manifest.line() + "\n").encode())
        self.tally.length_before = rows.marked + failed.marked
        self.before = (rows.ids, failed.ids)

    def scope(self) -> set[str]:
        """Count the scope (first pass over the inputs); the ids still to do."""
        stats = ImportStats()
        todo: set[str] = set()
        written, failed = self.before
        for n, row in enumerate(read_rows(self.cfg.inputs, stats)):
            if self.cfg.limit is not None and n >= self.cfg.limit:
                break
            self.tally.total += 1
            if row.id in written or row.id in failed:
                self.tally.before += 1
                self.tally.errors_before += row.id in failed and row.id not in written
            else:
                todo.add(row.id)
        self.tally.skipped = sum(s.count for s in stats.skipped.values())
        self.skips = "; ".join(f"{r} {s.count} ({describe(s)})" for r, s in stats.skipped.items())
        return todo

    async def one(self, row: SourceRow) -> None:
        assert self.files is not None
        rows_file, errors_file = self.files
        budget = Budget(self.cfg.max_retries)

        async def ask(messages: list[dict[str, Any]], tools: Any) -> Reply:
            return await self.requester.ask(messages, tools, budget)

        try:
            done = await regenerate(row, ask, self.cfg.manifest.reasoning)
        except RowFailed as failed:
            errors_file.write(encode(_error(row, failed.reason, failed.detail, failed.attempts)))
            self.tally.error(failed.reason)
            failures = sum(v for k, v in self.tally.reasons.items() if k != LENGTH_CAPPED)
            if failures >= BREAKER_ROWS and not self.tally.written and self.failure is None:
                line = f"the first {failures} rows all failed; the last: {failed}"
                self.failure = (ExitCode.USAGE, line)
            return
        if done.length_capped:
            self.tally.length += 1
            if self.cfg.manifest.on_length == "drop":
                why = f"a reply was cut at --max-tokens {self.cfg.manifest.max_tokens}"
                errors_file.write(encode(_error(row, LENGTH_CAPPED, why, budget.attempts)))
                self.tally.error(LENGTH_CAPPED)
                self.tally.dropped += 1
                return
        rows_file.write(encode(done.row))
        self.tally.written += 1

    def status(self) -> str:
        return status_line(
            self.tally,
            self.requester.counts,
            self.pool.in_flight(),
            len(self.pool.down()),
            time.monotonic() - self.started,
        )

    async def watch(self) -> None:
        """Status lines, and the end of the job when every server stayed away past --wait-s."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(min(1.0, self.cfg.status_interval_s))
            if self.pool.all_down_s() > self.cfg.wait_s and self.failure is None:
                urls = ", ".join(self.cfg.servers)
                self.failure = (
                    ExitCode.FAILED,
                    f"no server answered for {self.cfg.wait_s:g} s ({urls}); the rows in "
                    "flight are not written: --resume does them again",
                )
            if time.monotonic() - last >= self.cfg.status_interval_s:
                last = time.monotonic()
                self.console.say(self.status())

    async def dispatch(self, todo: set[str]) -> None:
        """Every row still to do, at most 2 x the total concurrency at a time."""
        live = asyncio.Semaphore(2 * self.cfg.concurrency * len(self.cfg.servers))
        tasks: set[asyncio.Task[None]] = set()

        def ended(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            live.release()

        for n, row in enumerate(read_rows(self.cfg.inputs, ImportStats())):
            if self.cfg.limit is not None and n >= self.cfg.limit:
                break
            if row.id not in todo:
                continue
            await live.acquire()
            if self.stop or self.failure:
                live.release()
                break
            task = asyncio.get_running_loop().create_task(self.one(row))
            tasks.add(task)
            task.add_done_callback(ended)
        while tasks and not (self.stop or self.failure):
            await asyncio.wait(set(tasks), timeout=0.5)
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def on_signal(self, signum: int) -> None:
        self.stop = self.stop or signal.Signals(signum).name

    async def close(self) -> None:
        self.pool.close()
        await self.http.aclose()
        if self.files is not None:
            for f in self.files:
                f.close()


def _error(row: SourceRow, reason: str, detail: str, attempts: int) -> dict[str, Any]:
    return {
        "id": row.id,
        "source": row.source,
        "reason": reason,
        "detail": detail,
        "attempts": attempts,
    }


async def run_job(cfg: JobConfig, console: Console) -> int:
    """The whole job (module docstring); its exit status."""
    job = Job(cfg, console)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, job.on_signal, signum)
    watcher: asyncio.Task[None] | None = None
    try:
        model, silent = await pick_model(
            job.http, cfg.servers, cfg.manifest.model, cfg.manifest.max_tokens
        )
        manifest = cfg.manifest.model_copy(update={"model": model})
        job.cfg = cfg = replace(cfg, manifest=manifest)
        job.requester.body = {**cfg.body, "model": model}
        job.open_files()
        todo = job.scope()
        for server in job.pool.servers:
            if server.url in silent:
                await job.pool.mark_down(server, "no answer at start")
        t = job.tally
        console.say(
            format_phase_line(
                "regen_starting",
                f"{len(todo)} rows to regenerate of {t.total} ({t.before} ended before); "
                f"{t.skipped} input rows skipped{': ' + job.skips if job.skips else ''}; "
                f"{manifest.describe()}; servers {', '.join(cfg.servers)}, "
                f"{cfg.concurrency} requests each",
            )
        )
        job.started = time.monotonic()
        watcher = loop.create_task(job.watch())
        await job.dispatch(todo)
        console.say(job.status())
        elapsed = time.monotonic() - job.started
        if job.failure is not None:
            console.say(format_error_line(job.failure[1]))
            return job.failure[0]
        if job.stop is not None:
            console.say(
                format_error_line(
                    f"stopped ({job.stop}): {summary(t, job.requester.counts, elapsed, manifest.on_length)}"
                )
            )
            return ExitCode.INTERRUPTED
        console.say(
            format_phase_line(
                "regen_finished", summary(t, job.requester.counts, elapsed, manifest.on_length)
            )
        )
        return ExitCode.OK
    finally:
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        await job.close()
