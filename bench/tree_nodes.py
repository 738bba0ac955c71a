"""What writing a tree into a verifiers ``Trace`` costs: :func:`rlmq.verifiers_plugin.tree_nodes.commit_tree`.

A synthetic expanded trajectory (no fleet): one ``llm_batch`` of ``n`` sub-calls, each two turns
whose second extends the first, ``--prompt-tokens``-token prompts; a trace holding two top root
turns as verifiers' interception leaves them. For each ``n`` it times the commit and
``trace.branches``. Run: ``python -m bench.tree_nodes [--calls 250 1000] [--prompt-tokens 8000]``;
prints a table and saves ``bench/results/tree_nodes.json``. Nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from rlmq.verifiers_plugin.tree_nodes import commit_tree
from tests.unit.test_tree_nodes import top_trace, turn


def trajectory(calls: int, prompt_tokens: int) -> list[dict[str, Any]]:
    """The expanded trajectory of a top rollout with ``calls`` two-turn sub-calls."""
    p = list(range(prompt_tokens))
    results = [
        {"status": "ok", "index": i, "steps": [turn(p, [i, i + 1]), turn([*p, i, i + 1, 5], [7])]} for i in range(calls)
    ]
    return [{"type": "root", "content": "top1"}, {"type": "llm_batch", "batch_id": "b1", "results": results}]


def measure(calls: int, prompt_tokens: int) -> dict[str, Any]:
    """One size: seconds to commit, seconds for ``trace.branches``, what was added."""
    events = trajectory(calls, prompt_tokens)
    trace = top_trace()
    t0 = time.perf_counter()
    added = commit_tree(trace, events)
    commit_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    branches = len(trace.branches)
    return {
        "calls": calls, "prompt_tokens": prompt_tokens, "turns": added.turns, "branches": branches,
        "commit_seconds": round(commit_s, 3), "branches_seconds": round(time.perf_counter() - t0, 3),
    }  # fmt: skip


def main() -> None:
    """Measure each size, print a table, save the JSON."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, nargs="+", default=[250, 1000])
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    args = ap.parse_args()
    rows = [measure(n, args.prompt_tokens) for n in args.calls]
    for r in rows:
        print(f"{r['calls']:>6} sub-calls  {r['turns']:>6} turns  {r['branches']:>6} branches  "
              f"commit {r['commit_seconds']:>7.2f} s  branches {r['branches_seconds']:>6.3f} s")  # fmt: skip
    doc = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "rows": rows}
    out = os.path.join(os.path.dirname(__file__), "results", "tree_nodes.json")
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1)
    print(f"saved {out}")


if __name__ == "__main__":
    main()
