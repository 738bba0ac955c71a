"""Rollout trees of depth 2 under a tree budget, at a real model's pace: are children refused while
their tree still has tokens, and how much of min(budget, demand) does each tree use?

Real ``rlmq worker --repl-slots`` processes (``LocalFleet``: a private Redis, the scripted model
server in its own process) host the children; the top rollouts run in this process (``RLMEnv``,
``max_depth=2``), all ``--trees`` at once. Every tree has the same shape: its top's first root turn
(a ``[[mock:root-code:...]]`` directive) makes two sub-calls answered in 20-200 tokens, then
``rlm_batch`` of 4 children; each child's first root turn makes two sub-calls of 20-200 tokens and
answers. Every prompt of a tree carries ``[[mock:tag:<tree>]]`` and ``[[mock:tps:<n>]]``: the model
server decodes ``n`` tokens per second per call and counts the tokens it served per tree
(``per_tag``: child root turns and sub-calls, what the tree's budget is charged with; the top's own
root turns carry no tag and are not charged). The same trees run once unbudgeted (their demand, by
the server's count) and once under each of ``--budgets`` tokens per tree (2,000: the issue's case,
which covers most trees' demand; 1,000: below most trees' demand, the budget binds).

Figures: per tree, served / min(budget, demand) (the server's count), overshoot (served beyond the
budget), children that ended ``budget_spent`` (``tree_budget_spent_count``) and of those the ones
*refused while the tree had tokens* (its ledger had at least 64 tokens unspent at the end, the
least an estimate of a root turn can be), sub-calls refused and cut, and wall time against the unbudgeted run.

``python -m bench.tree_budget_paced`` (32 trees, budgets 2,000 and 1,000, 50 tokens/s); ``--quick``: 8 trees at
300 tokens/s. Writes ``bench/results/tree_budget_paced.json`` (``--out``).
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

from bench.recursion import model_stats, reset_stats
from rlmq.cli.local import LocalFleet
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.budget.wire import SEGMENT_MIN
from rlmq.common.connection import async_client
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv
from rlmq.scripted.markers import root_code_directive

TOP_MODEL = "top-root"
CHILDREN = 4

_CHILD_CODE = """\
subs = llm_batch([f"Child part {i}. __MARKS__" for i in range(2)])
answer["content"] = " ".join(s.split()[0] if s.split() else "-" for s in subs)
answer["ready"] = True
"""

_TOP_CODE = """\
subs = llm_batch([f"Top part {i}. __MARKS__" for i in range(2)])
kids = rlm_batch([{"prompt": f"Child {k}. __CHILD__", "context": f"part {k}"} for k in range(__N__)])
answer["content"] = " | ".join(str(k)[:40] for k in kids)
answer["ready"] = True
"""


def tree_row(tree: str, tps: float) -> DatasetRow:
    """One tree's top question; every prompt of the tree is tagged ``tree`` and paced at ``tps``.

    The marks are assembled inside the code (``"[[" + "mock..."``) so the top's own first user message,
    which carries the code in base64 only, is neither paced nor tagged."""
    marks = f"[[mock:tokens:20-200]] [[mock:tps:{tps:g}]] [[mock:tag:{tree}]]"
    child_marks = f"[[mock:tps:{tps:g}]] [[mock:tag:{tree}]]"
    child = root_code_directive(_CHILD_CODE.replace("__MARKS__", marks)) + " " + child_marks
    code = _TOP_CODE.replace("__MARKS__", marks).replace("__CHILD__", child).replace("__N__", str(CHILDREN))
    return DatasetRow(id=tree, question=f"Tree {tree}. {root_code_directive(code)}", context="x", answer="-")


async def _run(fleet: LocalFleet, rows: list[DatasetRow], budget: int | None) -> tuple[list[Any], list[str], float]:
    settings = load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model)
    kw: dict[str, Any] = {"sub_llm_max_completion_tokens": budget} if budget else {}
    ids = ["top" + uuid.uuid4().hex[:12] for _ in rows]
    t0 = time.perf_counter()
    async with RLMEnv(
        settings=settings, sub_model=fleet.model, max_depth=2, max_sub_llm_parallelism=8,
        rollout_timeout=600, sub_call_timeout=300, **kw,
    ) as env:  # fmt: skip
        results = await asyncio.gather(
            *(env.rollout(row, model=TOP_MODEL, rollout_id=rid) for row, rid in zip(rows, ids, strict=True))
        )
    return list(results), ids, time.perf_counter() - t0


async def _unspent(fleet: LocalFleet, ids: list[str]) -> list[int | None]:
    redis = async_client(str(fleet.redis_url))
    try:
        ledger = BudgetLedger(redis)
        snaps = [await ledger.snapshot(rid) for rid in ids]
        return [None if s is None else s.limit - s.used for s in snaps]
    finally:
        await redis.aclose()


def _tree_figures(res: Any, served: int, demand: int, budget: int, unspent: int | None, floor: int) -> dict[str, Any]:
    m = res.row.metrics
    spent_children = int(m.get("tree_budget_spent_count", 0))
    return {
        "stop_reason": res.row.stop_reason, "demand": demand, "served": served,
        "served_frac": round(served / max(1, min(budget, demand)), 4), "overshoot": max(0, served - budget),
        "children_budget_spent": spent_children, "unspent": unspent,
        "children_refused_with_tokens": spent_children if unspent is not None and unspent >= floor else 0,
        "sub_calls_refused": int(m.get("tree_sub_llm_rejected_count", 0)),
        "sub_call_errors": int(m.get("tree_sub_llm_error_count", 0)),
        "child_rollouts": int(m.get("tree_rollout_count", 0)) - 1,
    }  # fmt: skip


async def _main(trees: int, budgets: list[int], tps: float, workers: int, slots: int) -> list[dict[str, Any]]:
    names = [f"t{k:02d}x{uuid.uuid4().hex[:6]}" for k in range(trees)]
    rows = [tree_row(n, tps) for n in names]
    cases: list[dict[str, Any]] = []
    with LocalFleet(
        model=f"tbp-{uuid.uuid4().hex[:6]}", workers=workers, worker_concurrency=512, repl_slots=slots,
        worker_grace=1.0, log_dir=tempfile.mkdtemp(prefix="tree-budget-paced-"),
    ) as fleet:  # fmt: skip
        base = str(fleet.base_url)
        reset_stats(base)
        free_results, _, free_wall = await _run(fleet, rows, None)
        demand = {t: c["completion_tokens"] for t, c in model_stats(base).get("per_tag", {}).items()}
        for budget in budgets:
            reset_stats(base)
            results, ids, wall = await _run(fleet, rows, budget)
            served = {t: c["completion_tokens"] for t, c in model_stats(base).get("per_tag", {}).items()}
            unspent = await _unspent(fleet, ids)
            case = _case(names, results, unspent, demand, served, budget)
            case.update(tokens_per_second=tps, wall_s=round(wall, 2), unbudgeted_wall_s=round(free_wall, 2))
            case.update(wall_ratio=round(wall / max(free_wall, 1e-9), 2))
            case["unbudgeted_stop_reasons"] = sorted({r.row.stop_reason for r in free_results})
            print(json.dumps({k: v for k, v in case.items() if k != "per_tree"}), flush=True)
            cases.append(case)
    return cases


def _case(
    names: list[str], results: list[Any], unspent: list[int | None], demand: dict[str, int],
    served: dict[str, int], budget: int,
) -> dict[str, Any]:  # fmt: skip
    """The figures of one budget's run: per tree and summed."""
    floor = SEGMENT_MIN  # the least a root turn's estimate can be: a child ended with this much left was refused
    per_tree = [
        {"tree": n, **_tree_figures(r, served.get(n, 0), demand.get(n, 0), budget, u, floor)}
        for n, r, u in zip(names, results, unspent, strict=True)
    ]
    fracs = [t["served_frac"] for t in per_tree]
    return {
        "trees": len(names), "budget": budget, "children_per_tree": CHILDREN,
        "stop_reasons": sorted({t["stop_reason"] for t in per_tree}),
        "min_served_frac": min(fracs), "mean_served_frac": round(sum(fracs) / len(fracs), 4),
        "overshoot": sum(t["overshoot"] for t in per_tree),
        "children_budget_spent": sum(t["children_budget_spent"] for t in per_tree),
        "children_refused_with_tokens": sum(t["children_refused_with_tokens"] for t in per_tree),
        "sub_calls_refused": sum(t["sub_calls_refused"] for t in per_tree),
        "sub_call_errors": sum(t["sub_call_errors"] for t in per_tree),
        "demand_range": [min(demand.values(), default=0), max(demand.values(), default=0)],
        "trees_over_budget": sum(1 for t in per_tree if t["demand"] > budget), "per_tree": per_tree,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the case (see the module docstring); print the summary; write the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 trees at 300 tokens/s")
    parser.add_argument("--trees", type=int, default=0, help="trees at once (default 32; --quick 8)")
    parser.add_argument("--budgets", default="2000,1000", help="tokens per tree, comma-separated (one run each)")
    parser.add_argument("--tps", type=float, default=0.0, help="tokens per second per call (default 50; --quick 300)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repl-slots", type=int, default=16, help="children per worker at once")
    parser.add_argument("--out", default="bench/results/tree_budget_paced.json")
    args = parser.parse_args(argv)
    trees = args.trees or (8 if args.quick else 32)
    tps = args.tps or (300.0 if args.quick else 50.0)
    budgets = [int(x) for x in args.budgets.split(",") if x]
    cases = asyncio.run(_main(trees, budgets, tps, args.workers, args.repl_slots))
    Path(args.out).write_text(json.dumps({"quick": args.quick, "date": "2026-12-07", "cases": cases}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
