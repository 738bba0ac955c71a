"""Stress: many small rollout trees at once under CPU load, looking for a tree whose calls wait on a
reservation no call is using (a *stall*).

The shape that stalled: 32 trees at once on a loaded host, one tree got no model request for
300 s and its calls were rejected "waited ... for tokens held by running calls", while a grant of
128 tokens was held by a job with no model call behind it. This repeats that shape on real
``rlmq worker`` processes (``--workers``, serving one scripted model server, its own process) and a
private Redis, with a CPU burner process per core:

* each run starts ``--trees`` trees at once; a tree is one budget ledger (``--budget`` tokens, the
  default per-call cap: 128 for budgets up to 1,024) with a top node, which makes one batch of
  ``--top-prompts`` prompts (more than the lane takes: its wake-up makes workers peek the queue,
  where they may take a lane entry's jobs first), and ``--children`` child nodes,
  each child making ``--rounds`` ``llm_batch`` calls one after the other, ``--prompts`` prompts
  each (small batches: they reach the workers through the lane, whose early calls start before
  ``START``), answered in 20 to 120 tokens; the tree's demand exceeds its budget, so its calls wait
  for releases and the last ones are refused because the budget is spent;
* ``--early on,off``: with the workers' lane early calls on, then off (``--no-lane-early-calls``);
* a tree *stalls* when one of its calls waited until its deadline (``WAITED_OUT``: rejected or cut
  after "waited ... for tokens held by running calls"). Each call's deadline is ``--deadline``
  seconds, so a stall costs that, not 300 s. A tree slower than ``--slow-s`` is counted as *slow*
  (CPU starvation alone makes those on a loaded host).

Figures per mode: runs, trees, stalled and slow trees, calls answered / refused because the budget
was spent / waited out / failed otherwise, tree latency p50 / p99 / max, overshoot (tokens the ledger
says were used beyond a budget: 0), tokens of grants given back unbegun (the ledger's ``reclaimed``),
and the workers' lane jobs by outcome (``rlmq_lane_jobs_total``: ``early``, ``lost`` = an early
call cancelled because another worker took its job, ``after_start``).

    python -m bench.tree_stall --runs 100 --early on,off

prints a line per stalled run and one per ten runs, and saves ``bench/results/tree_stall.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from bench.budget_wake import cpu_burners
from rlmq.cli.local import LocalFleet
from rlmq.common.aio import run as run_loop
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.keys import LedgerKeys, queue_name_for_model
from rlmq.common.sampling import DEFAULT_CALL_MAX_TOKENS
from rlmq.common.schemas import SubCallOptions, SubLLMResult
from rlmq.producer.dispatch import BatchSpec, Dispatcher

RESULTS = Path(__file__).parent / "results"
WAITED = "waited "  # the start of a waited-out call's reason ("waited 299.5 s for tokens held by running calls")


def classify(result: SubLLMResult) -> str:
    """``ok``, ``spent`` (refused or cut: the budget is spent), ``waited_out`` or ``error``."""
    text = result.content or ""
    if WAITED in text and "tokens held by running calls" in text:
        return "waited_out"
    if result.status == "ok":
        return "ok"
    if result.status == "rejected" and "budget" in text:
        return "spent"
    return "error"


async def one_run(fleet: LocalFleet, a: argparse.Namespace) -> list[dict[str, Any]]:
    """``a.trees`` trees at once; one figure row per tree."""
    redis = async_client(str(fleet.redis_url))
    try:
        ledger = BudgetLedger(redis, ttl=600)
        dispatcher = Dispatcher(redis)
        cap = DEFAULT_CALL_MAX_TOKENS
        queue = queue_name_for_model(fleet.model)

        async def child(top: str, name: str) -> list[SubLLMResult]:
            out: list[SubLLMResult] = []
            for r in range(a.rounds):
                spec = BatchSpec(
                    rollout_id=name, batch_id=f"b{r}", queue=queue, sub_call_timeout=a.deadline,
                    parallelism=a.prompts, call=SubCallOptions(model=fleet.model, budgeted=True),
                    ledger_id=top, nodes=(top, name),
                )  # fmt: skip
                prompts = [f"Part {j} of {name} round {r}. [[mock:tokens:20-120]]" for j in range(a.prompts)]
                out += await dispatcher.run_batch(spec, prompts)
            return out

        async def top_batch(top: str) -> list[SubLLMResult]:
            """The top's own batch, larger than the lane takes: its wake-up makes workers peek the queue."""
            if not a.top_prompts:
                return []
            spec = BatchSpec(
                rollout_id=top, batch_id="t0", queue=queue, sub_call_timeout=a.deadline,
                parallelism=a.top_prompts, call=SubCallOptions(model=fleet.model, budgeted=True),
            )  # fmt: skip
            prompts = [f"Part {j} of {top}. [[mock:tokens:20-120]]" for j in range(a.top_prompts)]
            return await dispatcher.run_batch(spec, prompts)

        async def tree() -> dict[str, Any]:
            top = "ts" + uuid.uuid4().hex[:10]
            await ledger.open(top, a.budget, cap)
            names = [f"{top}c{k}" for k in range(a.children)]
            for node in (top, *names):
                await ledger.open_node(top, node, ttl=120)
            t0 = time.perf_counter()
            per_child = await asyncio.gather(top_batch(top), *(child(top, n) for n in names))
            wall = time.perf_counter() - t0
            results = [r for rs in per_child for r in rs]
            kinds = [classify(r) for r in results]
            snap = await ledger.snapshot(top)
            reclaimed = await redis.hget(LedgerKeys(top).budget, "reclaimed")
            await ledger.close(top, top_node=top)
            return {
                "tree": top,
                "wall_s": round(wall, 3),
                "calls": len(results),
                "ok": kinds.count("ok"),
                "spent": kinds.count("spent"),
                "waited_out": kinds.count("waited_out"),
                "error": kinds.count("error"),
                "errors": sorted({r.content[:120] for r, k in zip(results, kinds, strict=True) if k == "error"})[:3],
                "parks": sum(r.budget_waits for r in results),
                "used": snap.used if snap else -1,
                "charged": snap.charged if snap else -1,
                "overshoot": max(0, (snap.used if snap else 0) - a.budget),
                "reclaimed": int(reclaimed or 0),
                "stalled": kinds.count("waited_out") > 0,
                "slow": wall > a.slow_s,
            }

        return list(await asyncio.gather(*(tree() for _ in range(a.trees))))
    finally:
        await redis.aclose()


def summarise(rows: list[dict[str, Any]], runs: int) -> dict[str, Any]:
    walls = sorted(r["wall_s"] for r in rows) or [0.0]
    return {
        "runs": runs,
        "trees": len(rows),
        "stalled_trees": sum(1 for r in rows if r["stalled"]),
        "runs_with_a_stall": len({r["run"] for r in rows if r["stalled"]}),
        "slow_trees": sum(1 for r in rows if r["slow"]),
        "reclaimed_tokens": sum(r["reclaimed"] for r in rows),
        "calls": sum(r["calls"] for r in rows),
        "ok": sum(r["ok"] for r in rows),
        "spent": sum(r["spent"] for r in rows),
        "waited_out": sum(r["waited_out"] for r in rows),
        "error": sum(r["error"] for r in rows),
        "parks": sum(r["parks"] for r in rows),
        "overshoot": sum(r["overshoot"] for r in rows),
        "tree_wall_p50_s": walls[len(walls) // 2],
        "tree_wall_p99_s": walls[min(len(walls) - 1, int(len(walls) * 0.99))],
        "tree_wall_max_s": walls[-1],
        "examples": [r for r in rows if r["stalled"] or r["error"]][:3],
    }


def lane_outcomes(log_dir: str) -> dict[str, float]:
    """``rlmq_lane_jobs_total`` by outcome, summed over the workers whose logs are in ``log_dir``."""
    totals: dict[str, float] = {}
    for name in os.listdir(log_dir):
        with open(os.path.join(log_dir, name), errors="replace") as f:
            found = re.search(r"metrics on (http://\S+/metrics)", f.read())
        if found is None:
            continue
        try:
            with urllib.request.urlopen(found.group(1), timeout=10) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        for outcome, value in re.findall(r'rlmq_lane_jobs_total\{outcome="(\w+)"\} ([0-9.e+]+)', text):
            totals[outcome] = totals.get(outcome, 0.0) + float(value)
    return totals


def run_mode(early: bool, a: argparse.Namespace) -> dict[str, Any]:
    args = ["--sub-llm-budget-grant-lease", str(a.lease)] if a.lease else []
    args += ["--lane-early-calls" if early else "--no-lane-early-calls", "--metrics-port", "0"]
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    log_dir = tempfile.mkdtemp(prefix="tree-stall-")
    with LocalFleet(
        model=f"stall-{uuid.uuid4().hex[:6]}", workers=a.workers, worker_concurrency=a.concurrency,
        worker_args=args, log_dir=log_dir,
    ) as fleet:  # fmt: skip
        for i in range(a.runs):
            if time.perf_counter() - t0 > a.max_minutes * 60:
                print(f"early={early}: stopping after {i} runs ({a.max_minutes} min)", flush=True)
                break
            got = run_loop(one_run(fleet, a))
            for r in got:
                r["run"] = i
            rows += got
            done = len({r["run"] for r in rows})
            if any(r["stalled"] for r in got) or done % 10 == 0:
                s = summarise(rows, done)
                s.pop("examples")
                print(f"early={early} run {i + 1}: {json.dumps(s)}", flush=True)
        lanes = lane_outcomes(log_dir)
    out = summarise(rows, len({r["run"] for r in rows}))
    out["lane_jobs"] = lanes
    out["early_calls"] = early
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=100, help="runs per mode")
    p.add_argument("--trees", type=int, default=32, help="trees at once per run")
    p.add_argument("--children", type=int, default=3, help="child nodes per tree, each with its own batches")
    p.add_argument("--rounds", type=int, default=2, help="llm_batch calls per child, one after the other")
    p.add_argument("--prompts", type=int, default=4, help="prompts per llm_batch (up to 8: the lane)")
    p.add_argument("--top-prompts", type=int, default=12, help="prompts of the top's own batch (0: none)")
    p.add_argument("--budget", type=int, default=768, help="budget per tree, completion tokens")
    p.add_argument("--deadline", type=float, default=15.0, help="seconds from a call's enqueue to its deadline")
    p.add_argument("--slow-s", type=float, default=10.0, help="a tree slower than this counts as slow")
    p.add_argument("--workers", type=int, default=3, help="rlmq worker processes")
    p.add_argument("--concurrency", type=int, default=64, help="--concurrency of each worker")
    p.add_argument("--lease", type=float, default=0.0, help="--sub-llm-budget-grant-lease (0: the default)")
    p.add_argument("--early", default="on,off", help="lane early calls: on, off or on,off")
    p.add_argument("--burners", type=int, default=None, help="CPU burner processes (default: one per core)")
    p.add_argument("--max-minutes", type=float, default=30.0, help="stop a mode's runs after this long")
    p.add_argument("--output", default=None, help="JSON path (default bench/results/tree_stall.json)")
    a = p.parse_args()
    out: dict[str, Any] = {
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_before": os.getloadavg()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["python -m bench.tree_stall", *sys.argv[1:]]),
        "modes": [],
    }
    with cpu_burners(a.burners):
        for mode in a.early.split(","):
            out["modes"].append(run_mode(mode.strip() == "on", a))
            out["host"]["load_after_" + mode.strip()] = os.getloadavg()
    for m in out["modes"]:
        print(
            f"early calls {'on ' if m['early_calls'] else 'off'}: {m['runs']} runs, {m['trees']} trees, "
            f"{m['stalled_trees']} stalled ({m['runs_with_a_stall']} runs), waited out {m['waited_out']}, "
            f"errors {m['error']}, overshoot {m['overshoot']}, reclaimed {m['reclaimed_tokens']} tokens, "
            f"lane jobs {m['lane_jobs']}, tree latency p50 {m['tree_wall_p50_s']} s "
            f"p99 {m['tree_wall_p99_s']} s max {m['tree_wall_max_s']} s, {m['slow_trees']} slower than {a.slow_s} s",
            flush=True,
        )
    path = Path(a.output) if a.output else RESULTS / "tree_stall.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
