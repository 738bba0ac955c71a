"""The ``rlmq`` command line: ``demo``, ``run``, ``worker``, ``mock-llm``, ``status``.

This module sits above both sides of the queue and imports each plainly: the rollout side
(``rlmq.producer``) and the worker side (``rlmq.cli.worker`` over ``rlmq.workers``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
import traceback
from typing import TYPE_CHECKING, Any

from rlmq.cli import worker as worker_cli
from rlmq.cli.exits import EXIT_INTERNAL, explain, say
from rlmq.cli.results import ResultSink, check_output, finish, load_rows
from rlmq.common.aio import current_latch, signal_latch
from rlmq.common.aio import run as run_loop
from rlmq.common.connection import check_redis, mask_url
from rlmq.common.errors import ConfigError
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import Settings, load_settings

if TYPE_CHECKING:
    from rlmq.cli.local import LocalFleet
    from rlmq.common.metrics import Metrics
    from rlmq.producer.env import RolloutResult


def _rollout_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", help="write result rows (JSONL) here")
    p.add_argument(
        "--run-dir",
        help="run folder: rows.jsonl, trajectories.jsonl, meta.json, report.html (default runs/<UTC time>-<command>)",
    )
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (0: any free port)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics exporter (default 127.0.0.1)")
    p.add_argument("--concurrency", type=int, help="rollouts at once (default 4)")
    p.add_argument("--max-turns", type=int, help="root-model turns per rollout (default 50)")
    p.add_argument("--sub-llm-max-turns", type=int, help="turns of one sub-LLM's tool loop (default 5)")
    p.add_argument("--sub-llm-max-completion-tokens", type=int, help="sub-LLM completion-token budget per rollout")
    p.add_argument("--sub-llm-per-call-max-tokens", type=int, help="cap on one sub-LLM call's completion tokens")
    p.add_argument("--root-max-completion-tokens", type=int, help="root model's completion-token limit per rollout")
    p.add_argument("--max-sub-llm-parallelism", type=int, help="sub-calls of one rollout in flight (default 64)")
    p.add_argument("--sub-call-timeout", type=float, help="deadline of one sub-call, seconds (default 300)")
    p.add_argument("--code-execution-timeout", type=float, help="seconds a REPL cell may run (default 120)")
    p.add_argument("--max-output-length", type=int, help="characters of cell output shown (default 8192)")
    p.add_argument("--root-prompt-verbosity", choices=["light", "medium", "heavy"])
    p.add_argument("--sub-prompt-verbosity", choices=["light", "medium", "heavy"])
    p.add_argument("--workers", type=int, default=2, help="local workers started when no Redis is given (default 2)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="show the traceback of an error")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlmq",
        description="Recursive Language Model rollouts whose sub-LLM calls run on a Redis-backed RQ worker fleet.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="everything embedded: Redis, workers, the scripted model, real text")
    demo.add_argument("--rollouts", type=int, default=8, help="number of rollouts (default 8)")
    demo.add_argument("--min-chars", type=int, default=100_000, help="context characters per rollout")
    _rollout_flags(demo)

    run = sub.add_parser("run", help="rollouts of a JSONL dataset against an OpenAI-compatible server")
    run.add_argument("dataset", help="JSONL rows: id, question, context, answer?, info?")
    run.add_argument("--base-url", required=True, help="root model's OpenAI-compatible base URL")
    run.add_argument("--model", required=True, help="root model name")
    run.add_argument("--sub-model", help="sub-LLM model name (default: --model)")
    run.add_argument("--sub-base-url", help="model server of locally started workers (default: --base-url)")
    run.add_argument("--redis-url", help="Redis URL; none: an embedded Redis and local workers")
    run.add_argument("--queue", help="RQ queue of the sub-LLM calls (default: named from the sub-model)")
    run.add_argument(
        "--tenant", help="fair-share key: jobs go to <queue>@<tenant>, served round-robin (default: host name)"
    )
    run.add_argument(
        "--api-key",
        help="API key of the model server(s), also given to local workers (default: RLMQ_API_KEY, else OPENAI_API_KEY)",
    )
    run.add_argument(
        "--sub-tool",
        action="append",
        dest="sub_tools",
        metavar="DOTTED.PATH",
        help="a tool the sub-LLMs may call (repeatable; local workers allow it, remote ones need --allow-tool)",
    )
    _rollout_flags(run)

    worker = sub.add_parser("worker", help="one worker process serving one model")
    worker_cli.add_arguments(worker)

    mock = sub.add_parser("mock-llm", help="the scripted OpenAI-compatible model (a test double)")
    mock.add_argument("--host", default="127.0.0.1")
    mock.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    mock.add_argument("--latency", type=float, default=0.0, help="seconds per call")
    mock.add_argument("--spend-all", action="store_true", help="every completion uses its whole max_tokens")

    status = sub.add_parser("status", help="queues, workers and live rollouts of a fleet, from Redis")
    status.add_argument("--redis-url", help="Redis URL (default: REDIS_URL / RLMQ_REDIS_URL)")
    status.add_argument(
        "--watch", nargs="?", type=float, const=2.0, metavar="SECONDS", help="redraw every SECONDS (default 2)"
    )
    status.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    status.add_argument("-v", "--verbose", action="store_true", help="show the traceback of an error")
    return parser


def _settings_from(args: argparse.Namespace, **extra: Any) -> Settings:
    names = [
        "concurrency", "max_turns", "sub_llm_max_turns", "sub_llm_max_completion_tokens",
        "sub_llm_per_call_max_tokens", "root_max_completion_tokens", "max_sub_llm_parallelism",
        "sub_call_timeout", "code_execution_timeout", "max_output_length", "root_prompt_verbosity",
        "sub_prompt_verbosity", "sub_tools",
    ]  # fmt: skip
    values = {n: getattr(args, n, None) for n in names}
    values.update(extra)
    return load_settings(**values)


async def evaluate(
    settings: Settings,
    rows: list[DatasetRow],
    *,
    model: str,
    sink: ResultSink,
    quiet: bool,
    metrics: Metrics | None = None,
) -> list[RolloutResult]:
    """Run the rollouts of ``rows``; each finished one goes to ``sink`` as it finishes.

    Returns the finished rollouts (row and trajectory) in the rows' order. Cancelled (a stop
    signal), it says how many finished and re-raises; ``sink`` keeps those.
    """
    from tqdm import tqdm

    from rlmq.producer.env import RLMEnv

    bar = tqdm(total=len(rows), desc="rollouts", unit="rollout", disable=quiet, file=sys.stderr)
    correct = 0

    def on_done(res: RolloutResult) -> None:
        nonlocal correct
        sink.add(res)
        if metrics is not None:
            metrics.observe_rollout(res.row.model_dump())
        correct += bool(res.row.correct)
        bar.update(1)
        bar.set_postfix(correct=correct)

    try:
        async with RLMEnv(settings=settings, metrics=metrics) as env:
            try:
                await env.evaluate(rows, model=model, concurrency=settings.concurrency, on_done=on_done)
            except asyncio.CancelledError:
                left = len(rows) - len(sink.results)
                say(f"rlmq: cancelled {left} unfinished rollout(s); keeping the {len(sink.results)} that finished")
                raise
    finally:
        bar.close()
    return sink.results


def start_metrics(args: argparse.Namespace) -> Metrics | None:
    """The process's :class:`~common.metrics.Metrics`, serving on ``--metrics-port`` if given."""
    if args.metrics_port is None:
        return None
    from rlmq.common.metrics import Metrics

    metrics = Metrics()
    port = metrics.serve(args.metrics_port, host=args.metrics_host)
    print(f"metrics: http://{args.metrics_host}:{port}/metrics")
    return metrics


def _evaluate(
    args: argparse.Namespace,
    rows: list[DatasetRow],
    settings: Settings,
    extra: dict[str, Any],
    fleet: LocalFleet | None,
    *,
    model: str,
) -> int:
    """Run the evaluation (on ``fleet``'s Redis when given), then :func:`finish`; on a stop
    signal, stop the fleet, keep what finished and re-raise ``KeyboardInterrupt``."""
    sink = ResultSink(rows, args.output)
    metrics = start_metrics(args)
    started = time.time()
    meta = {"model": model, **extra}
    try:
        if fleet is None:
            run_loop(evaluate(settings, rows, model=model, sink=sink, quiet=args.quiet, metrics=metrics))
        else:
            scripted = fleet.base_url is None
            with fleet:
                update = {"redis_url": fleet.redis_url}
                if scripted:  # the fleet started the scripted model: it is the root model too
                    update["base_url"] = str(fleet.base_url)
                settings = settings.model_copy(update=update)
                model_text = f"scripted model (test double) {fleet.base_url} | " if scripted else ""
                print(f"redis {mask_url(str(fleet.redis_url))} | {model_text}{fleet.n_workers} workers", flush=True)
                run_loop(evaluate(settings, rows, model=model, sink=sink, quiet=args.quiet, metrics=metrics))
    except KeyboardInterrupt:
        finish(args, sink, settings, started, meta, interrupted=True)
        raise
    latch = current_latch()
    with latch.held() if latch is not None else contextlib.nullcontext():  # the run is done: keep all of it
        return finish(args, sink, settings, started, meta)


def cmd_demo(args: argparse.Namespace) -> int:
    from rlmq.cli.demo import needle_rows
    from rlmq.cli.local import COMMAND_WORKER_GRACE_SECONDS, LocalFleet

    check_output(args.output, run_dir=args.run_dir)
    settings0 = load_settings()
    rows = [DatasetRow.model_validate(r) for r in needle_rows(args.rollouts, min_chars=args.min_chars)]
    if not rows:
        raise ConfigError("--rollouts must be at least 1")
    chars = sum(len(r.context) for r in rows if isinstance(r.context, str))
    print(
        f"rlmq demo: {len(rows)} needle-in-a-haystack rollouts over CPython's pydoc topics "
        f"({chars:,} characters of context in all)"
    )
    if settings0.redis_url:
        check_redis(settings0.redis_url)
    log_dir = tempfile.mkdtemp(prefix="rlmq-demo-logs-")
    fleet = LocalFleet(
        redis_url=settings0.redis_url,
        model="scripted",
        workers=args.workers,
        worker_grace=COMMAND_WORKER_GRACE_SECONDS,
        log_dir=log_dir,
        say=say,
    )
    settings = _settings_from(args, redis_url=settings0.redis_url or "redis://embedded", model="scripted")

    return _evaluate(args, rows, settings, {"worker_logs": log_dir}, fleet, model="scripted")


def cmd_run(args: argparse.Namespace) -> int:
    from rlmq.cli.local import COMMAND_WORKER_GRACE_SECONDS, LocalFleet
    from rlmq.common.errors import ConfigError

    if not args.model.strip():
        raise ConfigError("--model is empty: name the root model")
    for flag, url in (("--base-url", args.base_url), ("--sub-base-url", args.sub_base_url)):
        if url is not None and not url.lower().startswith(("http://", "https://")):
            raise ConfigError(f"{flag} {url}: not an http:// or https:// URL")
    check_output(args.output, args.dataset, args.run_dir)
    rows = load_rows(args.dataset)
    sub_model = args.sub_model or args.model
    base = load_settings()
    redis_url = args.redis_url or base.redis_url
    if redis_url:
        check_redis(redis_url)
    extra = dict(
        base_url=args.base_url,
        model=args.model,
        sub_model=sub_model,
        queue=args.queue,
        api_key=args.api_key,
        tenant=args.tenant,
    )
    extra = {k: v for k, v in extra.items() if v is not None}
    settings = _settings_from(args, redis_url=redis_url or "redis://embedded", **extra)
    fleet = None
    if not redis_url:
        worker_args = ["--queue", args.queue] if args.queue else []
        for tool in settings.sub_tools:
            worker_args += ["--allow-tool", tool]
        fleet = LocalFleet(
            model=sub_model,
            base_url=args.sub_base_url or args.base_url,
            workers=args.workers,
            worker_args=worker_args,
            worker_env={"RLMQ_API_KEY": settings.api_key.get_secret_value()},
            worker_grace=COMMAND_WORKER_GRACE_SECONDS,
            say=say,
        )
    return _evaluate(args, rows, settings, {"sub_model": sub_model, "dataset": args.dataset}, fleet,
                     model=args.model)  # fmt: skip


def cmd_status(args: argparse.Namespace) -> int:
    from rlmq.cli.status import run_status
    from rlmq.common.connection import sync_client

    url = args.redis_url or load_settings().redis_url
    if not url:
        raise ConfigError("rlmq status needs --redis-url or REDIS_URL")
    check_redis(url)
    client = sync_client(url)
    try:
        return run_status(client, as_json=args.json, watch=args.watch, redis_label=mask_url(url))
    finally:
        client.close()


def cmd_mock_llm(args: argparse.Namespace) -> int:
    from rlmq.common.errors import ConfigError
    from rlmq.scripted.server import serve

    try:
        serve(args.host, args.port, latency=args.latency, spend_all=args.spend_all)
    except OSError as exc:  # the port is taken, or the address is not ours
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from exc
    return 0


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "demo":
        return cmd_demo(args)
    if args.command == "run":
        return cmd_run(args)
    if args.command == "worker":
        return int(worker_cli.run(args))
    if args.command == "mock-llm":
        return cmd_mock_llm(args)
    if args.command == "status":
        return cmd_status(args)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rlmq`` console script; returns the exit code (see :mod:`rlmq.cli.exits`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    with signal_latch() as latch:  # a stop signal is never lost, whatever runs when it comes
        if args.command == "run":
            latch.stopping_note = "stopping: cancelling rollouts, keeping the finished ones"
        try:
            return _dispatch(args)
        except KeyboardInterrupt:
            say("rlmq: interrupted; everything it started was stopped")
            return latch.exit_code
        except Exception as exc:
            code, text = explain(exc)
            if getattr(args, "verbose", False):
                traceback.print_exc()
            elif code == EXIT_INTERNAL:
                text += " (--verbose shows the traceback)"
            say(f"rlmq: {text}")
            return code


if __name__ == "__main__":
    sys.exit(main())
