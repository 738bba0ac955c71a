"""``rlmq worker``: one worker process serving one model's queue."""

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
    )
    metrics = Metrics()
    if args.metrics_port is not None:
        port = metrics.serve(args.metrics_port, host=args.metrics_host)
        logging.getLogger("rlmq.worker").info("metrics on http://%s:%d/metrics", args.metrics_host, port)
    worker = SubLLMWorker(settings, name=args.name, metrics=metrics)
    try:
        run_loop(worker.run(burst=args.burst))
    finally:
        metrics.close()
    return 0
