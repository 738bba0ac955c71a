"""Benchmark: how much of a hard sub-LLM budget is served, how many answers come back whole, and
what the budget costs in time.

Runs real ``rlmq worker`` processes against the scripted model (which stops early:
``[[mock:tokens:N]]`` answers in N tokens, or in ``max_tokens`` when that is smaller,
``[[mock:tokens:1-N]]`` in a length drawn per prompt) on an embedded Redis, and drives batches
through the producer's :class:`~rlmq.producer.dispatch.Dispatcher` with a ledger opened as
``RLMEnv`` opens it (the per-call cap: the default ``max_tokens``, 2,048, unless a case sets one).

Scenarios, each at 0 and 50 ms model latency (``[[mock:sleep:0.05]]``):

* ``whole8`` / ``whole40``: 8 / 40 prompts answered in 1,500 tokens, budget 20,000.
* ``whole_random``: 48 prompts of 1-1,500 tokens, budget 20,000, beside a sequential oracle
  (the calls one after another, in order, each granted what is left: its whole answers are the
  longest prefix that fits).
* ``fixed``: 112 prompts answered in 250 tokens, budget 3,000 (with a per-call cap of 250, and
  without one).
* ``random``: 500 prompts of 1-400 tokens, budgets 500 / 2,000 / 5,000 / 20,000, 4 workers x 64.

For each: sub-calls answered whole / cut (``finish_reason == "length"``) / rejected / error, the
whole-answer rate (whole / answered), the oracle's whole answers (in prompt order; the fleet serves
calls in another order, so the two differ by which calls ran, not by how many were cut), tokens served
(the model server's own count for the rollout) and the served share of ``min(budget, demand)``,
the ledger's waits, and the wall time of the batch against the same batch unbudgeted.

    python -m bench.budget [--quick]

prints a table and saves ``bench/results/budget.json`` (``budget_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from rlmq.cli.local import LocalFleet
from rlmq.common.aio import run as run_loop
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.keys import queue_name_for_model
from rlmq.common.sampling import DEFAULT_CALL_MAX_TOKENS
from rlmq.common.schemas import SubCallOptions
from rlmq.producer.dispatch import BatchSpec, Dispatcher
from rlmq.scripted.server import answer_tokens

RESULTS = Path(__file__).parent / "results"


LENGTHS = {
    "fixed": "[[mock:tokens:250]]",
    "random": "[[mock:tokens:1-400]]",
    "whole8": "[[mock:tokens:1500]]",
    "whole40": "[[mock:tokens:1500]]",
    "whole_random": "[[mock:tokens:1-1500]]",
}
"""The answer-length directive of each scenario's prompts."""


def prompts_for(kind: str, n: int, latency: float, tag: str) -> list[str]:
    """``n`` prompts of scenario ``kind`` (:data:`LENGTHS`)."""
    sleep = f" [[mock:sleep:{latency:g}]]" if latency > 0 else ""
    return [f"Summarise part {i} of {tag}. {LENGTHS[kind]}{sleep}" for i in range(n)]


def oracle_whole(demand: list[int], budget: int) -> int:
    """Whole answers of the calls run one after another, in order, each granted what is left."""
    whole, left = 0, budget
    for d in demand:
        if d > left:
            break
        whole, left = whole + 1, left - d
    return whole


def served_to(base_url: str, rollout_id: str) -> int:
    """Completion tokens the scripted model itself counted for ``rollout_id``."""
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/stats", timeout=10) as resp:
        stats: dict[str, Any] = json.load(resp)
    return int(stats["per_user"].get(rollout_id, {}).get("completion_tokens", 0))


async def one_batch(
    fleet: LocalFleet, kind: str, n: int, budget: int | None, latency: float, cap: int | None = None
) -> dict[str, Any]:
    """Run one batch of ``n`` prompts under ``budget`` (``None``: unbudgeted); its figures."""
    redis = async_client(str(fleet.redis_url))
    try:
        rid = f"bench-{kind}-{uuid.uuid4().hex[:10]}"
        ledger = BudgetLedger(redis, ttl=600)
        cap = cap or DEFAULT_CALL_MAX_TOKENS  # as RLMEnv sends it: max_tokens on every call
        if budget is not None:  # as RLMEnv opens it: the per-call cap is a whole grant
            await ledger.open(rid, budget, cap)
        prompts = prompts_for(kind, n, latency, rid)
        demand = [answer_tokens(p) or 0 for p in prompts]
        spec = BatchSpec(
            rollout_id=rid,
            batch_id="b0",
            queue=queue_name_for_model(fleet.model),
            sub_call_timeout=120.0,
            parallelism=n,
            call=SubCallOptions(model=fleet.model, budgeted=budget is not None, max_completion_tokens=cap),
        )
        t0 = time.perf_counter()
        results = await Dispatcher(redis).run_batch(spec, prompts)
        wall = time.perf_counter() - t0
        snap = await ledger.snapshot(rid) if budget is not None else None
    finally:
        await redis.aclose()
    full = sum(1 for r, d in zip(results, demand, strict=True) if r.status == "ok" and r.completion_tokens >= d)
    ok = sum(1 for r in results if r.status == "ok")
    served = served_to(str(fleet.base_url), rid)
    useful = min(budget, sum(demand)) if budget is not None else sum(demand)
    affordable = oracle_whole([min(d, cap) for d in demand], budget) if budget is not None else n
    return {
        "kind": kind,
        "prompts": n,
        "budget": budget,
        "cap": cap,
        "latency_s": latency,
        "demand_tokens": sum(demand),
        "full": full,
        "truncated": ok - full,
        "oracle_whole": affordable,
        "whole_rate": round(full / ok, 4) if ok else 1.0,
        "rejected": sum(1 for r in results if r.status == "rejected"),
        "error": sum(1 for r in results if r.status == "error"),
        "served_tokens": served,
        "served_fraction": round(served / useful, 4) if useful else 1.0,
        "overshoot": budget is not None and served > budget,
        "ledger": None if snap is None else snap.__dict__,
        "budget_waits": sum(getattr(r, "budget_waits", 0) for r in results),
        "budget_wait_seconds": round(sum(getattr(r, "budget_wait_seconds", 0.0) for r in results), 3),
        "wall_s": round(wall, 3),
    }


async def light(fleet: LocalFleet, n: int) -> dict[str, Any]:
    """Unbudgeted one-prompt batches, one after another, alternating between a batch of a rollout
    the workers have seen (they remember it has no ledger) and a batch of a new rollout (its call
    first asks Redis whether the rollout has a ledger: the price of not trusting the job's
    ``budgeted: false``). Alternating keeps the machine's drift out of the difference."""
    redis = async_client(str(fleet.redis_url))
    dispatcher = Dispatcher(redis)
    queue = queue_name_for_model(fleet.model)
    shared = f"light-{uuid.uuid4().hex[:8]}"
    lat: dict[str, list[float]] = {"seen_rollout": [], "new_rollout": []}
    try:
        for i in range(-20, n):  # 20 warm-up rounds, not counted
            for mode in lat:
                rid = shared if mode == "seen_rollout" else f"light-{uuid.uuid4().hex[:10]}"
                spec = BatchSpec(
                    rollout_id=rid,
                    batch_id=f"b{i + 20}",
                    queue=queue,
                    sub_call_timeout=30,
                    parallelism=1,
                    call=SubCallOptions(model=fleet.model),
                )
                t0 = time.perf_counter()
                (result,) = await dispatcher.run_batch(spec, [f"Quick {i}?"])
                if i >= 0:
                    lat[mode].append((time.perf_counter() - t0) * 1000)
                assert result.status == "ok", result
    finally:
        await redis.aclose()
    out: dict[str, Any] = {}
    for mode, values in lat.items():
        values.sort()
        out[mode] = {"p50_ms": round(values[len(values) // 2], 3), "mean_ms": round(sum(values) / len(values), 3)}
    out["new_minus_seen_p50_ms"] = round(out["new_rollout"]["p50_ms"] - out["seen_rollout"]["p50_ms"], 3)
    return out


def scenario(
    fleet: LocalFleet, kind: str, n: int, budgets: list[int], latencies: list[float], cap: int | None = None
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for latency in latencies:
        base = run_loop(one_batch(fleet, kind, n, None, latency, cap))
        for budget in budgets:
            row = run_loop(one_batch(fleet, kind, n, budget, latency, cap))
            row["unbudgeted_wall_s"] = base["wall_s"]
            row["wall_ratio"] = round(row["wall_s"] / base["wall_s"], 2) if base["wall_s"] else None
            rows.append(row)
            print(
                f"{kind:<12} n={n:<4} budget={budget:<6} cap={row['cap']:<5} latency={latency * 1000:>3.0f} ms: "
                f"whole {row['full']:>3} ({row['whole_rate']:.0%} of answers; oracle {row['oracle_whole']:>3})  "
                f"cut {row['truncated']:>3}  rejected {row['rejected']:>3}  error {row['error']}  "
                f"served {row['served_tokens']:>6} ({row['served_fraction']:.1%})  "
                f"waits {row['budget_waits']:>4}  wall {row['wall_s']:.2f} s vs {base['wall_s']:.2f} s unbudgeted "
                f"(x{row['wall_ratio']})",
                flush=True,
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer budgets and prompts (a smoke run)")
    p.add_argument("--output", default=None, help="where to save the JSON (default bench/results/budget.json)")
    a = p.parse_args()
    latencies = [0.0, 0.05]
    out: dict[str, Any] = {
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    model = f"bench-budget-{uuid.uuid4().hex[:6]}"
    with LocalFleet(model=model, workers=3, worker_concurrency=64) as fleet:
        out["whole8"] = scenario(fleet, "whole8", 8, [20000], latencies)
        out["whole40"] = scenario(fleet, "whole40", 40, [20000], latencies)
        out["whole_random"] = scenario(fleet, "whole_random", 48, [20000], latencies)
        out["fixed"] = scenario(fleet, "fixed", 112, [3000], latencies, cap=250)
        out["fixed_default_cap"] = scenario(fleet, "fixed", 112, [3000], latencies)
        out["light_unbudgeted"] = run_loop(light(fleet, 100 if a.quick else 400))
        print("light, unbudgeted one-prompt batches:", json.dumps(out["light_unbudgeted"]), flush=True)
    budgets = [500, 5000] if a.quick else [500, 2000, 5000, 20000]
    with LocalFleet(model=model + "r", workers=4, worker_concurrency=64) as fleet:
        out["random"] = scenario(fleet, "random", 200 if a.quick else 500, budgets, latencies)
    path = Path(a.output) if a.output else RESULTS / ("budget_quick.json" if a.quick else "budget.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
