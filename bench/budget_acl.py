"""Budgeted rollouts on a fleet that runs under its ACL users, with calls that take seconds: does
every rollout use its budget (or its demand), with no call ending at its deadline?

A private Redis with one user per role of :mod:`rlmq.common.acl` (``acl_rules``, as the operator's
guide sets them up); ``--workers`` real ``rlmq worker`` processes connect as the ``worker`` user, the
producer side (ledgers and batches, :class:`rlmq.producer.dispatch.Dispatcher`) as the ``producer``
user. ``--rollouts`` rollouts run at once, each one budget ledger of ``--budget`` tokens and one
``llm_batch`` of ``--calls`` sub-calls (``--parallelism`` at once) whose answers are 50-1,500 tokens
(``[[mock:tokens:50-1500]]``) and take ``--call-seconds`` each at the scripted model server
(``[[mock:sleep:S]]``); every prompt carries ``[[mock:tag:<rollout>]]``, so the server counts what it
served per rollout. The demand exceeds the budget (16 calls of 775 tokens on average against 8,000).

Figures per rollout: served / min(budget, demand) (the server's count), overshoot, whole / cut /
refused calls, deadline errors, budget waits; and the worst rollout's share.

``python -m bench.budget_acl`` (12 rollouts, budget 8,000, calls of 4 s, 16 calls each);
``--quick``: calls of 1 s. Writes ``bench/results/budget_acl.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import redis

from bench.recursion import model_stats, reset_stats
from rlmq.cli.local import LocalFleet
from rlmq.common import keys as K
from rlmq.common.acl import ROLES, acl_rules
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.redis_server import EmbeddedRedis
from rlmq.common.sampling import DEFAULT_CALL_MAX_TOKENS
from rlmq.common.schemas import SubCallOptions, SubLLMResult
from rlmq.producer.dispatch import BatchSpec, Dispatcher
from rlmq.scripted.markers import answer_tokens


def acl_users(admin_url: str) -> dict[str, str]:
    """One user per role on the Redis at ``admin_url`` (random passwords); their URLs by role."""
    admin = redis.Redis.from_url(admin_url)
    u = urlparse(admin_url)
    urls: dict[str, str] = {}
    for role in ROLES:
        name, password = f"rlmq-{role}-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
        admin.execute_command("ACL", "SETUSER", name, "reset", "on", f">{password}", *acl_rules(role))  # type: ignore[no-untyped-call]
        urls[role] = f"redis://{name}:{password}@{u.hostname}:{u.port}{u.path or '/0'}"
    admin.close()
    return urls


async def _rollout(
    dispatcher: Dispatcher, ledger: BudgetLedger, queue: str, model: str, rid: str, a: argparse.Namespace
) -> tuple[list[SubLLMResult], int]:
    await ledger.open(rid, a.budget)
    call = SubCallOptions(model=model, budgeted=True)
    spec = BatchSpec(
        rollout_id=rid, batch_id="b1", queue=queue, sub_call_timeout=a.deadline, parallelism=a.parallelism, call=call
    )
    marks = f"[[mock:tokens:50-1500]] [[mock:sleep:{a.call_seconds:g}]] [[mock:tag:{rid}]]"
    prompts = [f"Part {i} of {rid}. {marks}" for i in range(a.calls)]
    demand = sum(min(DEFAULT_CALL_MAX_TOKENS, answer_tokens(p) or 0) for p in prompts)
    return await dispatcher.run_batch(spec, prompts), demand


def _figures(rid: str, results: list[SubLLMResult], demand: int, served: int, budget: int) -> dict[str, Any]:
    ran = [r for r in results if r.status == "ok"]
    return {
        "rollout": rid, "demand": demand, "served": served, "overshoot": max(0, served - budget),
        "served_frac": round(served / max(1, min(budget, demand)), 4),
        "whole": sum(1 for r in ran if not r.truncated), "cut": sum(1 for r in ran if r.truncated),
        "refused": sum(1 for r in results if r.status == "rejected"),
        "deadline_errors": sum(1 for r in results if r.error_kind == "deadline" or "waited" in (r.content or "")),
        "other_errors": sum(1 for r in results if r.status == "error" and r.error_kind != "deadline"),
        "budget_waits": sum(r.budget_waits for r in results),
        "segments_per_call": round(sum(r.segments for r in ran) / max(1, len(ran)), 2),
    }  # fmt: skip


async def _main(a: argparse.Namespace) -> dict[str, Any]:
    with EmbeddedRedis() as embedded:
        urls = acl_users(embedded.url)
        model = f"acl-{uuid.uuid4().hex[:6]}"
        with LocalFleet(
            redis_url=urls["worker"], model=model, workers=a.workers, worker_concurrency=a.concurrency,
            worker_grace=1.0, log_dir=tempfile.mkdtemp(prefix="budget-acl-"),
        ) as fleet:  # fmt: skip
            fleet.wait_for_workers(a.workers)
            base = str(fleet.base_url)
            reset_stats(base)
            client = async_client(urls["producer"])
            try:
                dispatcher, ledger = Dispatcher(client), BudgetLedger(client)
                queue = K.queue_name_for_model(model)
                rids = [f"acl{k:02d}x{uuid.uuid4().hex[:6]}" for k in range(a.rollouts)]
                t0 = time.perf_counter()
                outs = await asyncio.gather(*(_rollout(dispatcher, ledger, queue, model, r, a) for r in rids))
                wall = time.perf_counter() - t0
                snaps = [await ledger.snapshot(r) for r in rids]
            finally:
                await client.aclose()
            per_tag = model_stats(base).get("per_tag", {})
    rows = [
        {**_figures(r, res, d, per_tag.get(r, {}).get("completion_tokens", 0), a.budget), "ledger_used": s and s.used}
        for r, (res, d), s in zip(rids, outs, snaps, strict=True)
    ]
    return {
        "rollouts": a.rollouts, "budget": a.budget, "calls": a.calls, "call_seconds": a.call_seconds,
        "parallelism": a.parallelism, "deadline_s": a.deadline, "workers": a.workers, "wall_s": round(wall, 2),
        "min_served_frac": min(r["served_frac"] for r in rows),
        "overshoot": sum(r["overshoot"] for r in rows),
        "deadline_errors": sum(r["deadline_errors"] for r in rows),
        "other_errors": sum(r["other_errors"] for r in rows),
        "max_cut_per_rollout": max(r["cut"] for r in rows),
        "ledger_matches_server": all(r["ledger_used"] == r["served"] for r in rows),
        "per_rollout": rows,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the case (see the module docstring); print the summary; write the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="calls of 1 s")
    parser.add_argument("--rollouts", type=int, default=12)
    parser.add_argument("--budget", type=int, default=8000, help="tokens per rollout")
    parser.add_argument("--calls", type=int, default=16, help="sub-calls per rollout")
    parser.add_argument("--parallelism", type=int, default=16, help="sub-calls of a rollout at once")
    parser.add_argument("--call-seconds", type=float, default=0.0, help="seconds per call (default 4; --quick 1)")
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds from a call's enqueue to its deadline")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64, help="calls in flight per worker")
    parser.add_argument("--out", default="bench/results/budget_acl.json")
    args = parser.parse_args(argv)
    args.call_seconds = args.call_seconds or (1.0 if args.quick else 4.0)
    doc = asyncio.run(_main(args))
    print(json.dumps({k: v for k, v in doc.items() if k != "per_rollout"}), flush=True)
    Path(args.out).write_text(json.dumps({"quick": args.quick, "date": "2026-12-07", **doc}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
