"""`dflashctl eval` and `gate`: the served evaluation and the one-sample overfit gate in the
host's container, detached like `measure` (`dflashctl.jobs`). A group runs them on node 0."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from dflashctl.config.inventory import HostConfig
from dflashctl.errors import ExitCode, UsageError
from dflashctl.remote.transport import Transport
from trainer.events.served import ENGINE_METAVAR, engine_arg

if TYPE_CHECKING:
    from dflashctl.jobs.control import JobControl, JobStarted
    from dflashctl.jobs.evals import EvalJob
    from dflashctl.jobs.state import JobState
    from dflashctl.remote.jobs import JobKind

from dflashctl.cli import detached
from dflashctl.cli.common import Subparsers, command_adder, say, with_transport


def _check_modes(args: argparse.Namespace) -> None:
    if args.id is not None and not args.result:
        raise UsageError(f"{args.command}: --id ID goes with --result (which job's result)")


class _Request(Protocol):
    def check(self) -> None: ...


async def _run_job(
    args: argparse.Namespace,
    host: HostConfig,
    kind: JobKind,
    req: _Request,
    start: Callable[[Transport], Awaitable[JobStarted]],
    outcome: Callable[[Transport, JobState], Awaitable[int]],
) -> int:
    """The shared flow: --stop, --result, or start `req` (checked first; then detach, or
    follow to the outcome)."""
    from dflashctl.jobs.control import JobControl

    word = args.command
    starting = not (args.result or args.stop)
    if starting:
        req.check()

    async def go(t: Transport) -> int:
        jc = JobControl(t, host, kind)
        if args.stop:
            detached.print_stopped(host.name, word, await jc.stop())
            return ExitCode.OK
        if not starting:
            st = await jc.state(job_id=args.id)
            return await _finished(jc, st, args, lambda s: outcome(t, s))
        started = await start(t)
        what = f"{word} {started.job_id}"
        detached.say_started(
            host.name, what, started.session, started.release, started.directory, started.argv
        )
        if args.detach:
            from dflashctl.jobs.control import DETACH_GRACE_S

            st = await jc.state(0, DETACH_GRACE_S, started.job_id)
            if st.running:
                detached.say_detached(host.name, word, args.host)
                return ExitCode.OK
            return await _finished(jc, st, args, lambda s: outcome(t, s))
        try:
            st = await jc.follow(
                lambda line: say(f"{host.name}: {line}"),
                lambda note: say(f"{host.name}: {note}"),
                job_id=started.job_id,
            )
        except asyncio.CancelledError:  # Ctrl-C: this client leaves, the job does not
            detached.say_goes_on(host.name, what, started.session, word, args.host)
            raise
        return await outcome(t, st)

    return await with_transport(host, go)


async def _finished(
    jc: JobControl,
    st: JobState,
    args: argparse.Namespace,
    outcome: Callable[[JobState], Awaitable[int]],
) -> int:
    """`--result`: the newest (or --id) job's outcome, or what it is when it has none yet."""
    from dflashctl.jobs.control import output_tail
    from dflashctl.jobs.state import JobError, JobRunning

    host, word = jc.host.name, args.command
    if st.job_id is None:
        if args.id:
            raise JobError(f"{host}: no {word} {args.id} in {jc.host.workdir}/{jc.kind.root}")
        raise JobError(f"{host}: no {word} has run here; `dflashctl {word} {args.host}` starts one")
    if st.running:
        raise JobRunning(
            f"{host}: {st.name} is still running ({st.since()}): {output_tail(st.output)}; "
            f"`dflashctl {word} {args.host} --result` again later, `--stop` ends it"
        )
    if not st.output:  # the status read only the lines from 0: all of them
        st = await jc.state(0, 0, st.job_id)
    return await outcome(st)


# --- eval ------------------------------------------------------------------------------------


async def cmd_eval(args: argparse.Namespace) -> int:
    """`eval HOST|GROUP`: trainer.eval --engine on the container (`dflashctl.jobs.evals`)."""
    from dflashctl.jobs.evals import EvalJob, EvalRequest
    from dflashctl.remote.jobs import EVAL

    _check_modes(args)
    host = detached.node0_host(args, "evaluating")
    req = EvalRequest(
        prompts=tuple(Path(p) for p in args.prompts),
        remote_prompts=tuple(args.remote_prompts),
        drafter=args.drafter,
        checkpoint=args.checkpoint,
        target=args.target,
        engine=args.engine,
        server=args.server,
        serve_cmd=args.serve_cmd,
        serve_args=tuple(args.serve_arg),
        serve_timeout=args.serve_timeout,
        max_new_tokens=args.max_new_tokens,
        template_kwargs=args.template_kwargs,
        tolerance=args.tolerance,
        device=args.device,
    )

    async def start(t: Transport) -> JobStarted:
        return await EvalJob(t, host).start(req)

    async def outcome(t: Transport, st: JobState) -> int:
        return await _eval_outcome(EvalJob(t, host), st, args.json)

    return await _run_job(args, host, EVAL, req, start, outcome)


async def _eval_outcome(job: EvalJob, st: JobState, as_json: bool) -> int:
    """Print a finished eval's summary (exit 0), or one whose loops differ (exit 1:
    trainer.eval's verdict, after its summary); raise what an eval without a result is."""
    import json

    from dflashctl.jobs.evals import format_served
    from dflashctl.jobs.state import outcome_error
    from dflashctl.remote.layout import JOB_RESULT

    error = outcome_error(st, st.output)
    judged = st.state == "failed" and st.exit_status == 1 and st.has_result
    if error is not None and not judged:
        raise error
    info = st.info
    what = info.get("checkpoint") or info.get("drafter") or "?"
    step = info.get("step")
    say(
        f"{st.host}: {st.name} (release {info.get('release', '?')}) of {what}"
        + (f" (step {step})" if step is not None else "")
        + f": {st.directory}"
    )
    if as_json:
        print(json.dumps(await job.jobs.read_json(st, JOB_RESULT), indent=1), flush=True)
    else:
        for line in format_served(await job.summary(st)):
            print(line, flush=True)
    if error is not None:
        raise error
    return ExitCode.OK


# --- gate ------------------------------------------------------------------------------------


async def cmd_gate(args: argparse.Namespace) -> int:
    """`gate HOST|GROUP`: trainer.gate on the deployed config (`dflashctl.jobs.gate`)."""
    from dflashctl.jobs.gate import GateJob, GateRequest
    from dflashctl.remote.jobs import GATE

    _check_modes(args)
    host = detached.node0_host(args, "gating")
    req = GateRequest(
        samples=args.samples,
        max_steps=args.max_steps,
        response_tokens=args.response_tokens,
        device=args.device,
        engine=args.engine,
        server=args.server,
        serve_cmd=args.serve_cmd,
        serve_args=tuple(args.serve_arg),
    )

    async def start(t: Transport) -> JobStarted:
        return await GateJob(t, host).start(req)

    async def outcome(t: Transport, st: JobState) -> int:
        from dflashctl.jobs.gate import gate_json

        got = await GateJob(t, host).outcome(st)
        if args.json:
            print(gate_json(got, st), flush=True)
        else:
            print(f"{host.name}: {st.name}: {got.line}", flush=True)
        return ExitCode.OK if got.passed else ExitCode.FAILED

    return await _run_job(args, host, GATE, req, start, outcome)


# --- flags -----------------------------------------------------------------------------------


def _modes(sp: argparse.ArgumentParser, word: str) -> None:
    sp.add_argument("--json", action="store_true", help="the result as JSON instead of text")
    detached.add_modes(sp, word)


def _engine_flags(sp: argparse.ArgumentParser, *, default: str | None) -> None:
    sp.add_argument(
        "--engine",
        type=engine_arg,
        default=default,
        metavar=ENGINE_METAVAR,
        help="the serving engine",
    )
    sp.add_argument(
        "--server", metavar="URL", help="an engine already serving, as the container reaches it"
    )
    sp.add_argument(
        "--serve-cmd",
        metavar="CMD",
        help="start the engine on the container with this command (e.g. 'vllm serve'; the "
        "target, a port, the drafter and --dtype are appended)",
    )
    sp.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more engine argument (repeatable; --serve-arg=--enforce-eager)",
    )
    sp.add_argument("--device", help="cpu or cuda (default: the trainer's choice)")


def register(sub: Subparsers) -> None:
    """Adds eval, gate."""
    add = command_adder(sub)
    sp = add(
        "eval",
        cmd_eval,
        "served evaluation on a host: python -m trainer.eval --engine on its deployed release, "
        "a checkpoint or export there, in its own tmux session (a group: on node 0)",
        host=False,
    )
    sp.add_argument("host", help="a host, or a group (evaluated on its node 0)")
    sp.add_argument(
        "--prompts", nargs="+", default=[], metavar="FILE", help="local prompt sets (pushed)"
    )
    sp.add_argument(
        "--remote-prompts",
        nargs="+",
        default=[],
        metavar="PATH",
        help="prompt sets in the container",
    )
    sp.add_argument("--drafter", metavar="DIR", help="an export in the container")
    sp.add_argument(
        "--checkpoint",
        metavar="C",
        help="latest (default), best, a step, or a checkpoint file: exported first",
    )
    sp.add_argument(
        "--target", metavar="DIR", help="the target in the container (default: the run config's)"
    )
    _engine_flags(sp, default="vllm")
    sp.add_argument("--serve-timeout", type=float, help="seconds for a started engine to come up")
    sp.add_argument("--max-new-tokens", type=int, metavar="N", help="per turn (default 256)")
    sp.add_argument("--template-kwargs", metavar="JSON", help="chat template variables")
    sp.add_argument("--tolerance", type=float, help="share of verify steps that may differ")
    _modes(sp, "eval")
    sp = add(
        "gate",
        cmd_gate,
        "one-sample overfit gate on a host: python -m trainer.gate on its deployed release and "
        "run config, in its own tmux session; exit 1 names the stage that broke (a group: node 0)",
        host=False,
    )
    sp.add_argument("host", help="a host, or a group (gated on its node 0)")
    sp.add_argument("--samples", type=int, metavar="N", help="store rows to memorise (default 1)")
    sp.add_argument("--max-steps", type=int, metavar="N", help="training steps at most")
    sp.add_argument("--response-tokens", type=int, metavar="N", help="target tokens per sample")
    _engine_flags(sp, default=None)
    _modes(sp, "gate")
