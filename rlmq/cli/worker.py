"""``rlmq worker``: one worker process serving one model's queue.

A worker started before its Redis waits for it, with backoff, and says so (``--redis-wait``
bounds the wait). SIGINT, SIGTERM or SIGHUP stop it: it takes no new job, gives its in-flight
sub-calls ``--grace`` seconds (default 30) to finish, hands the rest back to the queue and
exits 0; a second signal hands them back at once.
"""

from __future__ import annotations

import argparse
import logging

from rlmq.common.aio import run as run_loop
from rlmq.common.settings import load_settings


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``rlmq worker``."""
    p.add_argument("--base-url", help="OpenAI-compatible base URL of the model server (http://host:port/v1)")
    p.add_argument("--model", help="model name served (the queue is named from it unless --queue)")
    p.add_argument("--redis-url", help="Redis URL (default: REDIS_URL / RLMQ_REDIS_URL)")
    p.add_argument(
        "--redis-wait",
        type=float,
        metavar="SECONDS",
        help="how long to wait for Redis at start, retrying with backoff (default: as long as it takes)",
    )
    p.add_argument(
        "--api-key", help="API key of the model server (default: RLMQ_API_KEY, else OPENAI_API_KEY, else EMPTY)"
    )
    p.add_argument(
        "--grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM/SIGHUP, seconds in-flight sub-calls get before they are handed back (default 30)",
    )
    p.add_argument("--queue", help="RQ queue to serve (default: derived from --model)")
    p.add_argument("--concurrency", type=int, help="sub-calls in flight in this process (default 256)")
    p.add_argument("--burst", action="store_true", help="exit once the queue is empty and nothing is in flight")
    p.add_argument("--name", help="RQ worker name (default host.pid.xxxx)")
    p.add_argument("--allow-tool", action="append", dest="allowed_sub_tools", help="dotted path of an allowed sub-tool")
    p.add_argument(
        "--heartbeat-ttl",
        type=int,
        dest="job_heartbeat_ttl",
        help="seconds before a silent worker's jobs are taken back",
    )
    p.add_argument("--model-retries", type=int, help="retries of a failed model call (default 3)")
    p.add_argument("--model-timeout", type=float, help="seconds per model HTTP call (default 120)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (0: a free one)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint")
    p.add_argument("-v", "--verbose", action="store_true")


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
    settings = load_settings(
        base_url=args.base_url,
        model=args.model,
        redis_url=args.redis_url,
        queue=args.queue,
        worker_concurrency=args.concurrency,
        allowed_sub_tools=args.allowed_sub_tools,
        job_heartbeat_ttl=args.job_heartbeat_ttl,
        model_retries=args.model_retries,
        model_timeout=args.model_timeout,
        api_key=args.api_key,
    )
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
