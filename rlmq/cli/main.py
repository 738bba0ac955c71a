"""The ``rlmq`` command line: ``demo``, ``run``, ``worker``, ``mock-llm``, ``status``.

This module sits above both sides of the queue and imports each plainly: the rollout side
(``rlmq.producer``) and the worker side (``rlmq.cli.worker`` over ``rlmq.workers``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
import traceback
from typing import TYPE_CHECKING, Any

from rlmq.cli import worker as worker_cli
from rlmq.cli.exits import EXIT_INTERNAL, explain, say
from rlmq.cli.export_samples import Staleness
from rlmq.cli.flags import PORT, Parser, add_settings_flags, bounded, help_group, settings_from_flags
from rlmq.cli.results import ResultSink, check_output, finish, load_rows
from rlmq.common.aio import current_latch, signal_latch
from rlmq.common.aio import run as run_loop
from rlmq.common.connection import mask_url, reach_redis
from rlmq.common.errors import ConfigError
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import Settings

if TYPE_CHECKING:
    from rlmq.cli.local import LocalFleet
    from rlmq.common.metrics import Metrics
    from rlmq.producer.env import RolloutResult


def _command_flags(p: argparse.ArgumentParser, command: str) -> None:
    """The flags of ``run`` / ``demo`` that are not settings, then the settings' own (generated),
    each in its ``--help`` group (:func:`~rlmq.cli.flags.help_group`)."""
    common, fleet, sampling = (help_group(p, name) for name in ("common", "fleet", "sampling"))
    common.add_argument("--output", metavar="FILE", help="write result rows (JSONL) here")
    common.add_argument(
        "--run-dir",
        metavar="DIR",
        help="run folder: rows.jsonl, trajectories.jsonl, meta.json, report.html (default runs/<UTC time>-<command>)",
    )
    common.add_argument("--quiet", action="store_true", help="no progress bar")
    common.add_argument("-v", "--verbose", action="store_true", help="show the traceback of an error")
    fleet.add_argument(
        "--metrics-port", type=PORT, metavar="PORT", help="serve Prometheus metrics here (0: any free port)"
    )
    fleet.add_argument(
        "--metrics-host", default="127.0.0.1", metavar="HOST", help="metrics address (default 127.0.0.1)"
    )
    fleet.add_argument(
        "--workers", type=bounded(int, 1), default=2, metavar="N", help="local workers without Redis (default 2)"
    )
    sampling.add_argument(
        "-T", "--temperature", type=float, metavar="X", help="root model's sampling temperature (over --sampling-args)"
    )
    sampling.add_argument("--top-p", type=float, metavar="X", help="root model's top_p (over --sampling-args)")
    sampling.add_argument(
        "-t",
        "--max-tokens",
        type=int,
        metavar="TOKENS",
        help="completion tokens of one root-model call (over --sampling-args)",
    )
    sampling.add_argument(
        "--sub-temperature", type=float, metavar="X", help="sub-LLM sampling temperature (over --sub-sampling-args)"
    )
    sampling.add_argument("--sub-top-p", type=float, metavar="X", help="sub-LLM top_p (over --sub-sampling-args)")
    add_settings_flags(p, command)


RUN_USAGE = "rlmq run DATASET.jsonl --base-url URL --model NAME [--sub-model NAME] [--output FILE] [options]"
RUN_DESCRIPTION = """\
Rollouts of a JSONL dataset (one {"id", "question", "context", "answer"?, "info"?} per line)
against any OpenAI-compatible server. Sub-LLM calls run on the workers serving the sub-model's
queue; without --redis-url / REDIS_URL, an embedded Redis and two local workers.

example:
  rlmq run rlmq/data/sample.jsonl --base-url http://127.0.0.1:8000/v1 --model Qwen/Qwen3-8B \\
      --sub-llm-max-completion-tokens 20000 --output rows.jsonl

The flags below: those every run needs, the common ones, then tuning knobs by topic."""
DEMO_USAGE = "rlmq demo [--output FILE] [--max-depth N] [--rollouts N] [options]"
DEMO_DESCRIPTION = """\
Everything embedded (a private Redis, two workers, the scripted model, a test double):
needle-in-a-haystack rollouts over CPython's documentation.

example:
  rlmq demo --max-depth 3 --output rows.jsonl   # rollout trees three levels deep"""


def _version() -> str:
    """The installed distribution's version (``pyproject.toml``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rlmq")
    except PackageNotFoundError:  # pragma: no cover - run from a tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="rlmq",
        description="Recursive Language Model rollouts whose sub-LLM calls run on a Redis-backed RQ worker fleet.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    raw = argparse.RawDescriptionHelpFormatter
    demo = sub.add_parser(
        "demo",
        help="everything embedded: Redis, workers, the scripted model, real text",
        usage=DEMO_USAGE,
        description=DEMO_DESCRIPTION,
        formatter_class=raw,
    )
    help_group(demo, "common").add_argument(
        "--rollouts", type=bounded(int, 1), default=8, metavar="N", help="number of rollouts (default 8)"
    )
    help_group(demo, "common").add_argument(
        "--min-chars",
        type=bounded(int, 0),
        default=100_000,
        metavar="CHARS",
        help="context characters per rollout (default 100000)",
    )
    _command_flags(demo, "demo")

    run = sub.add_parser(
        "run",
        help="rollouts of a JSONL dataset against an OpenAI-compatible server",
        usage=RUN_USAGE,
        description=RUN_DESCRIPTION,
        formatter_class=raw,
    )
    run.add_argument("dataset", help="JSONL rows: id, question, context, answer?, info?")
    help_group(run, "common").add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run whose folder this is: its finished rows are kept and not run again "
        "(rows that ended in error are run again); new rows are appended there. Give the run's own flags: "
        "another model or rollout option is refused (deadlines may change), as is a folder a live run writes",
    )
    _command_flags(run, "run")

    worker = sub.add_parser(
        "worker",
        help="one worker process serving one model",
        usage=worker_cli.USAGE,
        description=worker_cli.DESCRIPTION,
        formatter_class=raw,
    )
    worker_cli.add_arguments(worker)

    mock = sub.add_parser("mock-llm", help="the scripted OpenAI-compatible model (a test double)")
    mock.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    mock.add_argument("--port", type=PORT, default=8000, help="0 picks a free port (printed; default 8000)")
    mock.add_argument(
        "--latency", type=bounded(float, 0), default=0.0, metavar="SECONDS", help="seconds per call (default 0)"
    )
    mock.add_argument("--spend-all", action="store_true", help="every completion uses its whole max_tokens")
    mock.add_argument(
        "--token-shape",
        choices=("vllm", "sglang"),
        default="vllm",
        help="whose token-id fields it answers (default vllm)",
    )
    mock.add_argument(
        "--quota-rpm",
        type=bounded(int, 1),
        default=None,
        metavar="N",
        help="a provider's hard quota: answer 429 past N requests per --quota-window, all callers",
    )
    mock.add_argument(
        "--quota-tpm",
        type=bounded(int, 1),
        default=None,
        metavar="N",
        help="a provider's hard quota: answer 429 past N tokens (words) per --quota-window",
    )
    mock.add_argument("--quota-window", type=bounded(float, 0.01), default=60.0, metavar="SECONDS",
                      help="the quota's window (default 60)")  # fmt: skip

    export = sub.add_parser(
        "export-samples", help="one training sample per branch of a run made with --include-sub-llm-in-trajectory"
    )
    export.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (rows.jsonl, trajectories.jsonl)")
    export.add_argument("--output", metavar="FILE", help="where to write (default RUN_DIR/samples.jsonl)")
    Staleness.add_arguments(export, bounded(int, 0))

    status = sub.add_parser(
        "status",
        help="queues, workers and live rollouts of a fleet, from Redis",
        description=(
            "Prints three tables, read from Redis (never written): QUEUES (jobs waiting, the oldest's age, "
            "started and failed jobs, live workers serving each), WORKERS (state, sub-calls in flight, "
            "concurrency, last heartbeat) and LIVE ROLLOUTS (depth and parent, row, models, age, the sub-LLM "
            "budget used/limit, a child rollout's being its tree's, and each top rollout's tree: live "
            "children, model calls, tokens charged, refusals). --json prints the same snapshot as JSON."
        ),
    )
    status.add_argument(
        "--watch",
        nargs="?",
        type=bounded(float, 0, above=True),
        const=2.0,
        metavar="SECONDS",
        help="redraw every SECONDS (default 2)",
    )
    status.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    status.add_argument("-v", "--verbose", action="store_true", help="show the traceback of an error")
    add_settings_flags(status, "status")
    return parser


def _settings(args: argparse.Namespace, command: str) -> Settings:
    """:func:`settings_from_flags` with the single-value sampling flags (``-T``, ``--top-p``,
    ``-t``, ``--sub-temperature``, ``--sub-top-p``) laid over ``--sampling-args`` /
    ``--sub-sampling-args``.

    Raises:
        ConfigError: a bad value, one line naming its flag.
    """
    extra: dict[str, Any] = {}
    root = _sampling(args.sampling_args, temperature=args.temperature, top_p=args.top_p,
                     max_tokens=args.max_tokens, flag="--sampling-args")  # fmt: skip
    sub = _sampling(args.sub_sampling_args, temperature=args.sub_temperature, top_p=args.sub_top_p,
                    flag="--sub-sampling-args")  # fmt: skip
    if root is not None:
        extra["sampling_args"] = root
    if sub is not None:
        extra["sub_sampling_args"] = sub
    return settings_from_flags(args, command, **extra)


def _sampling(text: str | None, *, flag: str, **fields: Any) -> dict[str, Any] | None:
    """A ``--sampling-args`` JSON object with the single-value flags (``--temperature``, ...) over it;
    ``None`` when none was given (the settings' own value stands).

    Raises:
        ConfigError: the JSON is not an object.
    """
    import json

    given = {k: v for k, v in fields.items() if v is not None}
    if text is None and not given:
        return None
    try:
        base = json.loads(text) if text is not None else {}
    except RecursionError:
        raise ConfigError(f"{flag}: JSON nested too deeply") from None
    except ValueError as exc:
        raise ConfigError(f"{flag}: not JSON ({exc}); give an object such as '{{\"temperature\": 0.7}}'") from None
    if not isinstance(base, dict):
        raise ConfigError(f"{flag}: give a JSON object such as '{{\"temperature\": 0.7}}'")
    return {**base, **given}


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

    skip = {r.row.key for r in sink.results}  # a resumed run's finished rollouts
    bar = tqdm(total=sink.total - len(skip), desc="rollouts", unit="rollout", disable=quiet, file=sys.stderr)
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
                await env.evaluate(
                    rows,
                    model=model,
                    concurrency=settings.concurrency,
                    on_done=on_done,
                    rollouts_per_example=settings.rollouts_per_example,
                    skip=skip,
                )
            except asyncio.CancelledError:
                left = sink.total - len(sink.results)
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
    from rlmq.cli.report import new_run_dir, public_settings
    from rlmq.cli.results import public_argv
    from rlmq.cli.run_folder import LiveRunFolder

    args.run_dir = str(args.run_dir or new_run_dir(args.command))
    folder = LiveRunFolder(args.run_dir)
    kept = getattr(args, "resumed", None) or []
    sink = ResultSink(rows, args.output, rollouts_per_example=settings.rollouts_per_example, run_dir=folder)
    for res in kept:
        sink.keep(res)
    metrics = start_metrics(args)
    started = time.time()
    meta: dict[str, Any] = {"model": model, **extra}
    if kept:
        meta["resumed"] = {"kept": len(kept)}
        print(f"resuming {args.run_dir}: {len(kept)} of {sink.total} rollouts finished before; running the rest")
    command = ["rlmq", *public_argv(getattr(args, "argv", None) or [args.command])]
    recorded = public_settings(settings.model_dump(mode="json", exclude={"api_key"}))  # what --resume compares
    folder.open({"command": command, "started": started, "settings": recorded, **meta}, sink.results)
    print(f"run folder: {args.run_dir} (rows.jsonl grows as rollouts finish)", flush=True)
    try:  # the folder stays locked until it is written for the last time
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
    finally:
        folder.unlock()


def cmd_demo(args: argparse.Namespace) -> int:
    from rlmq.cli.demo import needle_rows
    from rlmq.cli.local import COMMAND_WORKER_GRACE_SECONDS, LocalFleet, local_repl_slots

    check_output(args.output, run_dir=args.run_dir)
    settings0 = _settings(args, "demo")
    rows = [DatasetRow.model_validate(r) for r in needle_rows(args.rollouts, min_chars=args.min_chars)]
    if not rows:
        raise ConfigError("--rollouts must be at least 1")
    chars = sum(len(r.context) for r in rows if isinstance(r.context, str))
    print(
        f"rlmq demo: {len(rows)} needle-in-a-haystack rollouts over CPython's pydoc topics "
        f"({chars:,} characters of context in all)"
    )
    if settings0.redis_url:
        reach_redis(settings0.redis_url, say=lambda text: say(f"rlmq: {text}"))
    log_dir = tempfile.mkdtemp(prefix="rlmq-demo-logs-")
    fleet = LocalFleet(
        redis_url=settings0.redis_url,
        model="scripted",
        workers=args.workers,
        # with max_depth > 1 the scripted roots recurse: their children run on these workers
        repl_slots=local_repl_slots(int(settings0.max_depth), settings0.repl_slots),
        allow_uncontained_repl=settings0.allow_uncontained_repl,
        worker_grace=COMMAND_WORKER_GRACE_SECONDS,
        log_dir=log_dir,
        say=say,
    )
    embedded = settings0.redis_url or "redis://embedded"
    settings = settings0.model_copy(update={"redis_url": embedded, "model": "scripted"})

    return _evaluate(args, rows, settings, {"worker_logs": log_dir}, fleet, model="scripted")


def cmd_run(args: argparse.Namespace) -> int:
    from rlmq.cli.local import COMMAND_WORKER_GRACE_SECONDS, LocalFleet, local_repl_slots

    settings = _settings(args, "run")
    model = str(settings.model or "")
    if not model.strip():
        raise ConfigError("--model is empty: name the root model")
    for flag, url in (("--base-url", settings.base_url), ("--sub-base-url", settings.sub_base_url)):
        if url is not None and not url.lower().startswith(("http://", "https://")):
            raise ConfigError(f"{flag} {url}: not an http:// or https:// URL")
    if args.resume is not None:
        if args.run_dir is not None and os.path.abspath(args.run_dir) != os.path.abspath(args.resume):
            raise ConfigError("--resume RUN_DIR names the run folder: leave --run-dir out, or give the same folder")
        if not os.path.isdir(args.resume):
            raise ConfigError(f"--resume {args.resume}: no such run folder")
        args.run_dir = args.resume
    check_output(args.output, args.dataset, args.run_dir)
    rows = load_rows(args.dataset)
    if settings.num_examples is not None:
        rows = rows[: settings.num_examples]
    if args.resume is not None:  # checked before Redis and the model servers are tried
        from rlmq.cli.run_folder import LiveRunFolder

        args.resumed = LiveRunFolder(args.resume).load()
        ResultSink(rows, None).check_kept(args.resumed)
        per_row = settings.rollouts_per_example
        if any((r.row.rollout is None) != (per_row == 1) or (r.row.rollout or 0) >= per_row for r in args.resumed):
            raise ConfigError(f"--resume {args.resume}: that run had another --rollouts-per-example; give the same")
    sub_model = settings.sub_model or model
    if args.resume is not None:  # the kept rows are of the same rollouts (checked before Redis too)
        from rlmq.cli.flags import flag_label
        from rlmq.cli.report import public_settings
        from rlmq.cli.run_folder import LiveRunFolder

        current = settings.model_copy(update={"sub_model": sub_model}).model_dump(mode="json", exclude={"api_key"})
        LiveRunFolder(args.resume).check_resume(public_settings(current), label=flag_label)  # as meta.json has them
    redis_url = settings.redis_url
    if redis_url:
        reach_redis(redis_url, say=lambda text: say(f"rlmq: {text}"))
    settings = settings.model_copy(update={"sub_model": sub_model, "redis_url": redis_url or "redis://embedded"})
    from rlmq.producer.root_tools import RootToolbox

    # A --tool / --root-tool that does not import, or whose name is refused, is one clear line before anything starts.
    RootToolbox([*settings.tools, *settings.root_tools], timeout=1.0, max_result_bytes=1024).close()
    if settings.preflight:
        from rlmq.cli.preflight import preflight

        base_url = str(settings.base_url)
        preflight(settings, redis_url, base_url, None if redis_url else settings.sub_base_url or base_url)
    fleet = None
    if not redis_url:
        worker_args = ["--queue", settings.queue] if settings.queue else []
        for tool in dict.fromkeys([*settings.sub_tools, *settings.tools]):
            worker_args += ["--allow-tool", tool]
        worker_args += ["--token-ids-api", settings.token_ids_api]  # local workers: the same server's API
        if settings.weight_versions:
            worker_args.append("--weight-versions")
        fleet = LocalFleet(
            model=sub_model,
            base_url=settings.sub_base_url or settings.base_url,
            workers=args.workers,
            worker_args=worker_args,
            # recursive rollouts (max_depth > 1) need workers that host their children's REPLs
            repl_slots=local_repl_slots(int(getattr(settings, "max_depth", 1)), settings.repl_slots),
            allow_uncontained_repl=settings.allow_uncontained_repl,
            worker_env={"RLMQ_API_KEY": settings.api_key.get_secret_value()},
            worker_grace=COMMAND_WORKER_GRACE_SECONDS,
            say=say,
        )
    return _evaluate(args, rows, settings, {"sub_model": sub_model, "dataset": args.dataset}, fleet, model=model)


def cmd_status(args: argparse.Namespace) -> int:
    from rlmq.cli.status import run_status
    from rlmq.common.connection import sync_client

    url = settings_from_flags(args, "status").redis_url
    if not url:
        raise ConfigError("rlmq status needs --redis-url or REDIS_URL")
    reach_redis(url, say=lambda text: say(f"rlmq: {text}"))
    client = sync_client(url)
    try:
        return run_status(client, as_json=args.json, watch=args.watch, redis_label=mask_url(url))
    finally:
        client.close()


def cmd_mock_llm(args: argparse.Namespace) -> int:
    from rlmq.common.errors import ConfigError
    from rlmq.scripted.quota import ProviderQuota
    from rlmq.scripted.server import serve

    quota = None
    if args.quota_rpm is not None or args.quota_tpm is not None:
        quota = ProviderQuota(args.quota_rpm, args.quota_tpm, args.quota_window)
    try:
        serve(
            args.host,
            args.port,
            latency=args.latency,
            spend_all=args.spend_all,
            token_shape=args.token_shape,
            quota=quota,
        )
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
    if args.command == "export-samples":
        from rlmq.cli.export_samples import export_samples

        staleness = Staleness(args.weight_version, args.max_version_lag, args.current_version)
        path, count, dropped = export_samples(args.run_dir, args.output, staleness)
        note = f" ({dropped} dropped by the weight-version filter)" if staleness.active else ""
        say(f"rlmq: {count} sample(s) written to {path}{note}")
        return 0
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
