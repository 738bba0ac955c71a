"""``rlmq worker``: one worker process serving one model's queue.

A worker started before its Redis waits for it, with backoff, and says so (``--redis-wait``
bounds the wait). SIGINT, SIGTERM or SIGHUP stop it: it takes no new job, gives its in-flight
sub-calls ``--grace`` seconds (default 30) to finish, hands the rest back to the queue and
exits 0; a second signal hands them back at once.

With ``--repl-slots N`` it also hosts child rollouts (``rlm_batch``), N per depth, each with its
own REPL; it refuses to start (exit code 2) unless a probe REPL is fully contained (own uid, no
network, private file system) or ``--allow-uncontained-repl`` is given. On a stop, hosted child
rollouts get the same ``--grace``, then are cancelled (their REPLs killed) and handed back.
"""

from __future__ import annotations

import argparse
import logging

from rlmq.cli.flags import PORT, add_settings_flags, bounded, help_group, settings_from_flags
from rlmq.common.aio import run as run_loop

USAGE = "rlmq worker --base-url URL --model NAME [--redis-url URL] [--concurrency K] [--repl-slots N] [options]"
DESCRIPTION = """\
One worker process serving one model's queue: it takes sub-LLM calls (and, with --repl-slots,
child rollouts) from Redis and calls the model server. The Redis is --redis-url or REDIS_URL.

example:
  REDIS_URL=redis://127.0.0.1:6379/0 rlmq worker --base-url http://127.0.0.1:8000/v1 --model Qwen/Qwen3-8B

The flags below: the common ones, then tuning knobs by topic."""


QUIET_LOGGERS = ("httpx", "httpcore", "openai", "aiohttp.access")
"""Libraries that log every request at INFO: a worker logs their warnings only (``-v``: all)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``rlmq worker``: its own, then the settings it takes (generated), each in its
    ``--help`` group (:func:`~rlmq.cli.flags.help_group`)."""
    common, tuning, fleet = (help_group(p, name) for name in ("common", "worker", "fleet"))
    tuning.add_argument(
        "--redis-wait",
        type=bounded(float, 0),
        metavar="SECONDS",
        help="how long to wait for Redis at start, retrying with backoff (default: as long as it takes)",
    )
    tuning.add_argument(
        "--grace",
        type=bounded(float, 0),
        default=30.0,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM/SIGHUP, seconds in-flight sub-calls get before they are handed back (default 30)",
    )
    common.add_argument("--burst", action="store_true", help="exit once the queue is empty and nothing is in flight")
    common.add_argument("--name", metavar="NAME", help="RQ worker name (default host.pid.xxxx)")
    common.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    fleet.add_argument(
        "--metrics-port", type=PORT, metavar="PORT", help="serve Prometheus metrics here (0: a free port)"
    )
    fleet.add_argument(
        "--metrics-host", default="127.0.0.1", metavar="HOST", help="metrics address (default 127.0.0.1)"
    )
    add_settings_flags(p, "worker")


def run(args: argparse.Namespace) -> int:
    """Run the worker until SIGTERM / SIGINT (or, with ``--burst``, until idle)."""
    from rlmq.common.connection import wait_for_redis
    from rlmq.common.errors import ConfigError
    from rlmq.common.metrics import Metrics
    from rlmq.workers.worker import SubLLMWorker

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if not args.verbose:  # a line per HTTP request (the hosted children's root calls) is no operator's news
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    settings = settings_from_flags(args, "worker")
    if not settings.redis_url:
        raise ConfigError("rlmq worker needs --redis-url or REDIS_URL")
    log = logging.getLogger("rlmq.worker")
    wait_for_redis(settings.redis_url, say=log.warning, max_wait=args.redis_wait)
    metrics = Metrics()
    if args.metrics_port is not None:
        port = metrics.serve(args.metrics_port, host=args.metrics_host)
        log.info("metrics on http://%s:%d/metrics", args.metrics_host, port)
    worker = SubLLMWorker(settings, name=args.name, metrics=metrics)
    try:
        run_loop(worker.run(burst=args.burst, grace=args.grace))
    finally:
        metrics.close()
    return 0
