"""What a trainer host of the test fleet runs (``python -m tests.hosts.driver COMMAND ...``, on a host).

Commands, each printing one JSON line:

* ``wait-workers --redis-url U --model M --n N``: until ``N`` workers serve the model's queue (30 s);
* ``main-job --redis-url U --base-url B --model M [--rollouts R --calls C --budget T --cap G --tokens K
  --sleep S --label L --busy N]``: :func:`tests.fleet.harness.main_job`; prints ``go`` first, ``busy``
  once the model has ``N`` calls in flight, then its counts and ``seconds``;
* ``tree-job ... [--max-depth D --parts P --rollout-key-ttl T]``: :func:`tests.fleet.harness.tree_job`;
* ``wait-children --redis-url U --model M --label L --n N --timeout T``: until ``N`` child rollouts of
  the trees labelled ``L`` run (listed by ``rlmq status``);
* ``latency --redis-url U --model M --n N``: ``N`` batches of one sub-call, one after the other:
  the median and p90 of their seconds;
* ``model-stats --base-url B --model M``: the scripted model's counters (and its quota's);
* ``drained --redis-url U --model M --timeout T``: until no job of the model's queues waits or runs,
  no worker has one in flight and ``rlmq status`` lists no live rollout; prints how long it took
  (``seconds``, ``None`` past the timeout) and how many reservations are still open in any ledger.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import redis

from rlmq.cli.status import collect
from rlmq.common import keys as K
from tests.fleet.harness import main_job, tree_job


def _wait_workers(args: argparse.Namespace) -> dict[str, Any]:
    client = redis.Redis.from_url(args.redis_url, socket_timeout=5)
    queue = K.queue_name_for_model(args.model)
    deadline = time.monotonic() + 30
    while client.scard(K.rq_workers_of_queue(queue)) < args.n:
        if time.monotonic() > deadline:
            raise SystemExit(f"{args.n} workers did not register on {queue} within 30 s")
        time.sleep(0.05)  # polling other hosts' registration, bounded by the deadline
    return {"workers": int(client.scard(K.rq_workers_of_queue(queue)))}


def _wait_children(args: argparse.Namespace) -> dict[str, Any]:
    client = redis.Redis.from_url(args.redis_url, socket_timeout=5)
    deadline = time.monotonic() + args.timeout
    while True:
        rollouts = collect(client)["rollouts"]
        children = [r for r in rollouts if r["depth"] >= 2 and str(r["parent"] or "").startswith(f"t_{args.label}")]
        if len(children) >= args.n:
            return {"children": [r["id"] for r in children]}
        if time.monotonic() > deadline:
            raise SystemExit(f"{args.n} child rollouts of {args.label} did not start within {args.timeout:g} s")
        time.sleep(0.1)  # polling the fleet's state, bounded by --timeout


def _drained(args: argparse.Namespace) -> dict[str, Any]:
    client = redis.Redis.from_url(args.redis_url, socket_timeout=5)
    base = K.queue_name_for_model(args.model)
    started = time.monotonic()
    while time.monotonic() - started < args.timeout:
        snap = collect(client)
        mine = [q for q in snap["queues"] if q["name"].startswith(base)]
        busy = sum(w["inflight"] for w in snap["workers"] if w.get("live", True))
        idle = all(q["depth"] == 0 and q["started"] == 0 for q in mine) and busy == 0
        if idle and snap["rollouts_total"] == 0:
            live = sum(int(client.zcard(k)) for k in client.scan_iter(match="rlmq:{*}:live", count=1000))
            return {"seconds": round(time.monotonic() - started, 2), "open_reservations": live}
        time.sleep(0.2)  # polling the fleet's state, bounded by --timeout
    return {"seconds": None, "queues": mine, "inflight": busy, "rollouts": snap["rollouts"]}


async def _say_busy(base_url: str, n: int) -> None:
    """Print ``busy`` once the scripted model has ``n`` requests in flight (polled every 50 ms)."""
    from tests.fleet.harness import model_stats

    while (await asyncio.to_thread(model_stats, base_url))["in_flight"] < n:
        await asyncio.sleep(0.05)
    print("busy", flush=True)


async def _main_job(args: argparse.Namespace) -> dict[str, Any]:
    print("go", flush=True)
    started = time.monotonic()
    busy = asyncio.create_task(_say_busy(args.base_url, args.busy)) if args.busy else None
    out = await main_job(
        args.redis_url, args.base_url, args.model, rollouts=args.rollouts, calls=args.calls, budget=args.budget,
        tokens=args.tokens, sleep=args.sleep, timeout=args.timeout, label=args.label, cap=args.cap,
    )  # fmt: skip
    if busy is not None:
        busy.cancel()
    return {**out.summary(), "seconds": round(time.monotonic() - started, 3)}


async def _latency(args: argparse.Namespace) -> dict[str, Any]:
    """``--n`` batches of one sub-call, one after the other: seconds of each (median, p90)."""
    import statistics
    import uuid

    from rlmq.common.budget.ledger import BudgetLedger
    from rlmq.common.connection import async_client
    from rlmq.common.schemas import SubCallOptions
    from rlmq.producer.dispatch import BatchSpec, Dispatcher

    client = async_client(args.redis_url)
    rid = f"t_{args.label}{uuid.uuid4().hex[:6]}"
    queue = K.tenant_queue(K.queue_name_for_model(args.model), "t")
    times: list[float] = []
    try:
        await BudgetLedger(client).open(rid, 10**7, cap=100)
        dispatcher = Dispatcher(client)
        for i in range(args.n):
            spec = BatchSpec(rollout_id=rid, batch_id=f"b{i}", queue=queue, sub_call_timeout=args.timeout,
                             parallelism=1, call=SubCallOptions(model=args.model, budgeted=True))  # fmt: skip
            started = time.monotonic()
            results = await dispatcher.run_batch(spec, [f"Ping {i}. [[mock:tokens:10]]"])
            times.append(time.monotonic() - started)
            assert results[0].status == "ok", results[0]
    finally:
        await client.aclose()
    times.sort()
    return {"n": len(times), "median": statistics.median(times), "p90": times[int(0.9 * (len(times) - 1))]}


def _model_stats(args: argparse.Namespace) -> dict[str, Any]:
    from tests.fleet.harness import model_stats

    stats = model_stats(args.base_url)
    return {k: stats[k] for k in ("requests", "completions", "faults", "quota") if k in stats}


async def _tree_job(args: argparse.Namespace) -> dict[str, Any]:
    print("go", flush=True)
    out = await tree_job(
        args.redis_url, args.base_url, args.model, max_depth=args.max_depth, rollouts=args.rollouts,
        parts=args.parts, label=args.label, timeout=args.timeout, rollout_key_ttl=args.rollout_key_ttl,
    )  # fmt: skip
    return out.summary()


def main(argv: list[str] | None = None) -> int:
    """Run one command (see the module docstring)."""
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "command",
        choices=["wait-workers", "wait-children", "main-job", "tree-job", "drained", "latency", "model-stats"],
    )
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--base-url", default="")
    parser.add_argument("--model", required=True)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--calls", type=int, default=16)
    parser.add_argument("--budget", type=int, default=4000)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--cap", type=int, default=None)
    parser.add_argument("--busy", type=int, default=0, help="main-job: say busy at this many model calls in flight")
    parser.add_argument("--sleep", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--label", default="job")
    parser.add_argument("--max-depth", type=int, default=2)
    parser.add_argument("--parts", type=int, default=2)
    parser.add_argument("--rollout-key-ttl", type=int, default=3600)
    args = parser.parse_args(argv)
    if args.command == "wait-workers":
        answer = _wait_workers(args)
    elif args.command == "latency":
        answer = asyncio.run(_latency(args))
    elif args.command == "model-stats":
        answer = _model_stats(args)
    elif args.command == "wait-children":
        answer = _wait_children(args)
    elif args.command == "drained":
        answer = _drained(args)
    elif args.command == "main-job":
        answer = asyncio.run(_main_job(args))
    else:
        answer = asyncio.run(_tree_job(args))
    print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
