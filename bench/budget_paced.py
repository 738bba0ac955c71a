"""Segment grants at a real model's pace: sub-call batches under one budget, with and without it.

Against a private ``redis-server`` (the ledger's real Lua) and the scripted model over HTTP, paced
per call (``[[mock:tps:<n>]]``), with answers of 50-1,500 tokens (``[[mock:tokens:50-1500]]``):
each case runs a batch of sub-calls (:func:`rlmq.workers.subllm.run_sub_llm`, the worker's own turn:
segments, continuation, waits) under a budget, then the same batch unbudgeted, and reports whole /
cut / refused answers, deadline errors, served / min(budget, demand) (the server's own count),
wall time against the unbudgeted run, and segments per call. The queue and the workers' processes
are left out: they are measured by ``bench.budget``.

``python -m bench.budget_paced`` (pace 30 tokens/s, batches of 8, 40 and 200, budgets 2,000 / 8,000 /
20,000); ``--quick``: batches of 8 and 40 at 300 tokens/s (every time ten times shorter; the figures
count tokens, so only the wall-time ratio can move with it). ``--tps``, ``--sizes`` and ``--budgets``
set the pace, the batch sizes and the budgets. Writes ``bench/results/budget_paced.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.redis_server import EmbeddedRedis
from rlmq.common.schemas import SubLLMRequest, SubLLMResult
from rlmq.scripted.markers import answer_tokens
from rlmq.scripted.server import ScriptedModelServer
from rlmq.workers.model import ChatClient
from rlmq.workers.subllm import SubLLMContext, run_sub_llm
from rlmq.workers.tools import ToolRegistry

CAP = 2048
DEADLINE = 300.0


def _prompts(n: int, tps: float, seed: str) -> list[str]:
    return [f"{seed} part {i} [[mock:tokens:50-1500]] [[mock:tps:{tps:g}]]" for i in range(n)]


async def _batch(
    redis: Redis, server: ScriptedModelServer, rollout: str, prompts: list[str], budget: int | None
) -> tuple[list[SubLLMResult], float]:
    ledger = BudgetLedger(redis)
    if budget is not None:
        await ledger.open(rollout, budget, cap=CAP)
    ctx = SubLLMContext(
        client=ChatClient(server.url, "key", retries=0), ledger=ledger, tools=ToolRegistry(), worker_name="bench"
    )
    now = time.time()
    reqs = [
        SubLLMRequest(
            rollout_id=rollout,
            batch_id="b",
            index=i,
            prompt=p,
            model="m",
            enqueued_at=now,
            deadline=now + DEADLINE,
            budgeted=budget is not None,
            max_completion_tokens=CAP,
        )  # fmt: skip
        for i, p in enumerate(prompts)
    ]
    t0 = time.perf_counter()
    try:
        results = await asyncio.gather(*(run_sub_llm(r, ctx, job_id=f"{rollout}-{r.index}") for r in reqs))
    finally:
        await ctx.client.close()
        await ledger.aclose()
    return list(results), time.perf_counter() - t0


async def _case(redis: Redis, server: ScriptedModelServer, n: int, budget: int, tps: float) -> dict[str, Any]:
    seed = f"n{n}b{budget}"
    prompts = _prompts(n, tps, seed)
    demand = sum(min(CAP, answer_tokens(p) or 0) for p in prompts)
    rollout = f"paced-{seed}"
    results, wall = await _batch(redis, server, rollout, prompts, budget)
    served = server.stats["per_user"].get(rollout, {}).get("completion_tokens", 0)
    _, free_wall = await _batch(redis, server, rollout + "-free", prompts, None)
    ran = [r for r in results if r.status == "ok"]
    return {
        "calls": n, "budget": budget, "tokens_per_second": tps, "demand": demand,
        "whole": sum(1 for r in ran if not r.truncated), "cut": sum(1 for r in ran if r.truncated),
        "refused": sum(1 for r in results if r.status == "rejected"),
        "deadline_errors": sum(1 for r in results if r.error_kind == "deadline"),
        "other_errors": sum(1 for r in results if r.status == "error" and r.error_kind != "deadline"),
        "served": served, "overshoot": max(0, served - budget),
        "served_frac": round(served / max(1, min(budget, demand)), 4),
        "wall_s": round(wall, 2), "unbudgeted_wall_s": round(free_wall, 2),
        "wall_ratio": round(wall / max(free_wall, 1e-9), 2),
        "segments_per_call": round(sum(r.segments for r in ran) / max(1, len(ran)), 2),
        "budget_waits": sum(r.budget_waits for r in results),
    }  # fmt: skip


async def _main(
    quick: bool, only: tuple[int, ...] = (), pace: float = 0.0, budgets: tuple[int, ...] = (2000, 8000, 20000)
) -> list[dict[str, Any]]:
    sizes, tps = ((8, 40), 300.0) if quick else ((8, 40, 200), 30.0)
    sizes, tps = only or sizes, pace or tps
    rows: list[dict[str, Any]] = []
    with EmbeddedRedis() as embedded:
        redis = Redis.from_url(embedded.url, max_connections=512)
        async with ScriptedModelServer() as server:
            for n in sizes:
                for budget in budgets:
                    row = await _case(redis, server, n, budget, tps)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        await redis.aclose()
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the cases (see the module docstring); print one JSON line a case; write the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batches of 8 and 40 at 300 tokens/s")
    parser.add_argument("--out", default="bench/results/budget_paced.json")
    parser.add_argument("--sizes", default="", help="batch sizes, comma-separated (default: as above)")
    parser.add_argument("--tps", type=float, default=0.0, help="tokens per second per call (default: as above)")
    parser.add_argument("--budgets", default="2000,8000,20000", help="budgets in tokens, comma-separated")
    args = parser.parse_args(argv)
    sizes = tuple(int(x) for x in args.sizes.split(",") if x)
    budgets = tuple(int(x) for x in args.budgets.split(",") if x)
    rows = asyncio.run(_main(args.quick, sizes, args.tps, budgets))
    Path(args.out).write_text(json.dumps({"quick": args.quick, "date": "2026-12-07", "cases": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
