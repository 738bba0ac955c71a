"""Stress: small budgets under CPU load, where a lost budget wake-up used to stall a rollout.

Issue 25: ``rlmq demo --sub-llm-max-completion-tokens 20`` took 5 minutes instead of seconds in
2 of 8 runs on a busy machine: calls parked for tokens "held by running calls" while 16 of 20
were free and nothing ran, until their deadline. This runs the same shape many times on real
``rlmq worker`` processes and the scripted model, with a CPU burner process per core:

* ``--rounds N`` rounds, each on a fresh fleet of 2 workers (new processes, as each demo run
  starts), each ``--rollouts`` rollouts at once (the demo's 8), each one batch of
  ``--prompts`` prompts (6) answered in 2 tokens, budget ``--budget`` (20) with the default
  per-call cap: a first call takes the whole budget, the others wait for its release. Every
  call fits (6 x 2 <= 20), so a call rejected or waiting out its deadline waited while tokens
  were free and nothing ran. Figures: batches, stalled batches (any call not answered), batch
  wall time (p50 / p99 / max), parks and parked seconds.
* ``--demo N``: ``rlmq demo --sub-llm-max-completion-tokens 20`` N times, wall time of each.
* ``--explore``: the interleaving explorer of ``tests/budget_model.py`` over its larger spaces.

    python -m bench.budget_wake --rounds 300 --demo 20 --explore

prints a table and saves ``bench/results/budget_wake.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
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

RESULTS = Path(__file__).parent / "results"
BURN = "while True:\n    pass\n"


@contextmanager
def cpu_burners(n: int | None = None) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` (default: one per core) processes that spin, ended (by their pid) on exit."""
    procs = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(n or os.cpu_count() or 2)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)


async def small_budget_round(
    fleet: LocalFleet, *, rollouts: int = 8, prompts: int = 6, budget: int = 20, timeout: float = 30.0
) -> list[dict[str, Any]]:
    """``rollouts`` batches at once, one per rollout, each of ``prompts`` prompts answered in 2 tokens
    under ``budget`` tokens; one figure row per batch."""
    redis = async_client(str(fleet.redis_url))
    try:
        ledger = BudgetLedger(redis, ttl=600)
        dispatcher = Dispatcher(redis)
        cap = DEFAULT_CALL_MAX_TOKENS

        async def one() -> dict[str, Any]:
            rid = f"wake-{uuid.uuid4().hex[:10]}"
            await ledger.open(rid, budget, cap)
            spec = BatchSpec(
                rollout_id=rid,
                batch_id="b0",
                queue=queue_name_for_model(fleet.model),
                sub_call_timeout=timeout,
                parallelism=prompts,
                call=SubCallOptions(model=fleet.model, budgeted=True),
            )
            t0 = time.perf_counter()
            results = await dispatcher.run_batch(
                spec, [f"Part {j} of {rid}. [[mock:tokens:2]]" for j in range(prompts)]
            )
            return {
                "rollout": rid,
                "wall_s": round(time.perf_counter() - t0, 3),
                "not_ok": [f"{r.status}: {r.content[:160]}" for r in results if r.status != "ok"],
                "parks": sum(r.budget_waits for r in results),
                "parked_s": round(max(r.budget_wait_seconds for r in results), 3),
            }

        return list(await asyncio.gather(*(one() for _ in range(rollouts))))
    finally:
        await redis.aclose()


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    walls = sorted(r["wall_s"] for r in rows)
    return {
        "batches": len(rows),
        "stalled_batches": sum(1 for r in rows if r["not_ok"]),
        "wall_p50_s": walls[len(walls) // 2],
        "wall_p99_s": walls[min(len(walls) - 1, int(len(walls) * 0.99))],
        "wall_max_s": walls[-1],
        "parks": sum(r["parks"] for r in rows),
        "parked_max_s": max(r["parked_s"] for r in rows),
        "examples_not_ok": [r["not_ok"][0] for r in rows if r["not_ok"]][:5],
    }


def stress(
    rounds: int, *, workers: int = 2, rollouts: int = 8, prompts: int = 6, budget: int = 20, timeout: float = 30.0
) -> dict[str, Any]:
    """``rounds`` rounds under a CPU burner per core, each on a fresh fleet (new worker processes,
    as each ``rlmq demo`` run has: a worker's first waits are where its pub/sub connection is made)."""
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with cpu_burners():
        for i in range(rounds):
            with LocalFleet(model=f"wake-{uuid.uuid4().hex[:6]}", workers=workers) as fleet:
                got = run_loop(
                    small_budget_round(fleet, rollouts=rollouts, prompts=prompts, budget=budget, timeout=timeout)
                )
            rows += got
            bad = [r for r in got if r["not_ok"]]
            if bad or (i + 1) % 10 == 0:
                print(f"round {i + 1}/{rounds}: {json.dumps(summarise(rows))}", flush=True)
    out = summarise(rows)
    out.update(rounds=rounds, workers=workers, rollouts=rollouts, prompts=prompts, budget=budget)
    out["total_s"] = round(time.perf_counter() - t0, 1)
    return out


def demo_runs(n: int, timeout: float = 120.0) -> dict[str, Any]:
    walls: list[float] = []
    codes: list[int] = []
    with cpu_burners():
        for i in range(n):
            t0 = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "rlmq", "demo", "--sub-llm-max-completion-tokens", "20"],
                capture_output=True,
                timeout=timeout,
                check=False,
            )
            walls.append(round(time.perf_counter() - t0, 2))
            codes.append(done.returncode)
            print(f"demo {i + 1}/{n}: {walls[-1]} s, exit {done.returncode}", flush=True)
    return {"runs": n, "wall_s": walls, "wall_max_s": max(walls), "exit_codes": sorted(set(codes))}


def explore_all() -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.budget_model import QUIET, explore, schedules

    out: dict[str, Any] = {}
    for name, calls, kill in (("two_rollouts_with_kill", [1, 1], True), ("three_calls", [2, 1], False)):
        t0 = time.perf_counter()
        n, counterexample, why = explore(schedules(calls, gaps=[0, QUIET], connect_turns=[0, 2], kill=kill))
        out[name] = {
            "schedules": n,
            "counterexample": None if counterexample is None else f"{counterexample}: {why}",
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(f"explore {name}: {json.dumps(out[name])}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=300, help="rounds of small-budget batches (0: none)")
    p.add_argument("--rollouts", type=int, default=8, help="rollouts (batches) at once per round")
    p.add_argument("--prompts", type=int, default=6, help="prompts per batch")
    p.add_argument("--budget", type=int, default=20, help="budget per rollout, completion tokens")
    p.add_argument("--demo", type=int, default=0, help="runs of `rlmq demo --sub-llm-max-completion-tokens 20`")
    p.add_argument("--explore", action="store_true", help="run the interleaving explorer's larger spaces")
    p.add_argument("--output", default=None, help="where to save the JSON (default bench/results/budget_wake.json)")
    a = p.parse_args()
    out: dict[str, Any] = {
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["python -m bench.budget_wake", *sys.argv[1:]]),
    }
    if a.rounds:
        out["stress"] = stress(a.rounds, rollouts=a.rollouts, prompts=a.prompts, budget=a.budget)
        print("stress:", json.dumps(out["stress"]), flush=True)
    if a.demo:
        out["demo"] = demo_runs(a.demo)
        print("demo:", json.dumps(out["demo"]), flush=True)
    if a.explore:
        out["explore"] = explore_all()
    path = Path(a.output) if a.output else RESULTS / "budget_wake.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
