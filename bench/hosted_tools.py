"""Round trip of a hosted tool: a sub-LLM's call of a shared tool run in the rollout's process.

Against a private ``redis-server`` (``rlmq.common.redis_server.EmbeddedRedis``): one
:class:`~rlmq.producer.hosted_tools.HostedToolServer` serves a trivial sync tool; callers
send ``--calls`` requests through :func:`~rlmq.workers.hosted_tools.call_hosted`, one at a
time and then ``--concurrency`` at once (twice: the first round opens the client's
connections); the same tool run in-process through a
:class:`~rlmq.workers.tools.ToolRegistry` (a worker's fast path) is the baseline.

Prints a table and writes ``bench/results/hosted_tools.json``. Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from pathlib import Path

from rlmq.common.connection import async_client
from rlmq.common.redis_server import EmbeddedRedis
from rlmq.common.tool_wire import ToolCallRequest, request_id
from rlmq.producer.hosted_tools import HostedTools, HostedToolServer
from rlmq.workers.hosted_tools import call_hosted
from rlmq.workers.tools import ToolRegistry, count_words

TEXT = " ".join(["word"] * 200)
ARGS = json.dumps({"text": TEXT})
PATH = "rlmq.workers.tools.count_words"


def _ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": round(statistics.median(ordered) * 1000, 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 3),
    }


async def _measure(url: str, calls: int, concurrency: int) -> dict[str, object]:
    redis = async_client(url)
    tools = HostedTools([(PATH, count_words)], timeout=10.0, max_args_bytes=1 << 20)
    server = HostedToolServer(redis, "bench-hosted", tools, answer_ttl=60)
    serving = asyncio.create_task(server.serve())
    local = ToolRegistry.from_paths([PATH])

    async def one(i: int) -> float:
        req = ToolCallRequest(id=request_id("bench-job", 1, i, "count_words", ARGS), tool=PATH, arguments=ARGS, wait=20)
        t0 = time.perf_counter()
        text = await call_hosted(redis, "bench-hosted", req, name="count_words", deadline=time.time() + 20)
        assert text == "200", text
        return time.perf_counter() - t0

    try:
        serial = [await one(i) for i in range(calls)]
        cold_t0 = time.perf_counter()  # the first round also opens the pool's connections
        cold = await asyncio.gather(*(one(calls + i) for i in range(concurrency)))
        cold_wall = time.perf_counter() - cold_t0
        t0 = time.perf_counter()
        parallel = await asyncio.gather(*(one(calls + concurrency + i) for i in range(concurrency)))
        wall = time.perf_counter() - t0
        fast = []
        for _ in range(calls):
            t1 = time.perf_counter()
            await local.call(PATH, ARGS)
            fast.append(time.perf_counter() - t1)
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await redis.aclose()
    return {
        "hosted_serial": _ms(serial),
        "hosted_concurrent_cold": {**_ms(list(cold)), "calls": concurrency, "wall_s": round(cold_wall, 3)},
        "hosted_concurrent": {**_ms(list(parallel)), "calls": concurrency, "wall_s": round(wall, 3)},
        "worker_fast_path": _ms(fast),
        "runs": server.calls,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=100)
    args = parser.parse_args(argv)
    with EmbeddedRedis() as server:
        figures = asyncio.run(_measure(server.url, args.calls, args.concurrency))
    doc = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "host": f"{platform.machine()} {platform.python_version()}",
        "calls": args.calls,
        **figures,
    }
    for key in ("hosted_serial", "hosted_concurrent_cold", "hosted_concurrent", "worker_fast_path"):
        print(f"{key:20s} {doc[key]}")
    out = Path(__file__).parent / "results" / "hosted_tools.json"
    out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
