"""Figures of a rollout tree by depth, from a rollout's nested trajectory.

A rollout's ``rlm_batch(tasks)`` call appends one event to its trajectory::

    {"type": "rlm_batch", "batch_id": str, "seconds": float, "tasks": [str, ...],
     "results": [SubLLMResult.model_dump(exclude_none=True), ...]}

A result that a child rollout answered carries ``child`` (:class:`~rlmq.common.schemas.
ChildOutcome`): the child's ``metrics`` (the keys of a result row's metrics) and its own
``trajectory``, which can hold ``rlm_batch`` events of its own. :func:`tree_metrics` walks that
tree and returns the figures added to the result row (all integers):

Per depth ``d`` (1 = the top rollout, 2 = its children, ...), for every depth from the
rollout's own to the deepest reached (or ``max_depth`` when given):

* ``depth{d}_rollouts``: rollouts at depth ``d`` that reported (the top counts 1);
* ``depth{d}_root_turns`` / ``depth{d}_root_completion_tokens``: their root-model turns and
  completion tokens (each rollout's ``main_rlm_turns`` / ``main_rlm_completion_tokens``);
* ``depth{d}_sub_llm_call_count`` / ``depth{d}_sub_llm_completion_tokens``: the sub-LLM calls
  *made by* the rollouts at depth ``d`` that ran (not refused by the budget; as the reference's
  ``sub_llm_call_count``): every slot of their ``llm_batch`` calls, and every
  slot of their ``rlm_batch`` calls that no child rollout answered (at ``max_depth`` those run
  as plain sub-LLM calls; a child that never reported, refused or failed, lands here too, with
  its tokens, 0 when none were spent).

Tree-wide (the rollout and its whole subtree):

* ``rlm_call_count``: ``rlm_batch`` tasks issued anywhere in the tree (each task of each call:
  answered by a child rollout, run as a plain call at ``max_depth``, refused or failed);
* ``rlm_batch_count``: ``rlm_batch`` calls anywhere in the tree;
* ``rlm_call_failed_count``: those tasks whose slot ended ``error`` or ``rejected``;
* ``tree_rollout_count`` (the rollout itself included) and ``tree_depth`` (the deepest depth
  a rollout of the tree reached);
* ``tree_root_turns``, ``tree_root_completion_tokens``, ``tree_sub_llm_call_count``,
  ``tree_sub_llm_completion_tokens``: the sums over the depths;
* ``tree_sub_llm_error_count``: those sub-LLM calls that ended ``error``;
  ``tree_sub_llm_rejected_count``: the sub-LLM calls the budget refused (not in the call count);
* ``tree_budget_spent_count``: child rollouts anywhere in the tree that the budget ended
  (stop reason ``budget_spent``: their next root turn could not be granted whole);
* ``tree_charged_completion_tokens``: what the tree's budget is charged with: every sub-LLM
  completion token of the tree plus the root completion tokens of the rollouts at depth >= 2
  (the top rollout's own root turns are not charged). Summed here from the trajectory; a top
  rollout with a budget reports its ledger's ``charged`` instead
  (:meth:`rlmq.producer.budget.RolloutBudget.metrics`), which also holds what was served to
  attempts whose results never came back (a child host killed mid-tree).

Verifiers' names (``main_rlm_turns``, ``sub_llm_call_count``, ...) keep their meaning: the
top rollout's own figures; only the names above are tree-wide or per depth.

A child whose ``metrics`` already hold its own subtree's figures under its depth (its host ran
:func:`tree_metrics` with ``depth`` = its depth) is taken from them: they were computed from
its whole trajectory, which its parent may only have a cut copy of. Otherwise its trajectory is
walked. Nesting deeper than :data:`MAX_TREE_DEPTH` is not walked. Malformed parts (not a dict,
a non-numeric figure) count as nothing rather than raising.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MAX_TREE_DEPTH", "PER_DEPTH", "TREE_KEYS", "depth_key", "is_tree_metric", "number", "tree_metrics"]

MAX_TREE_DEPTH = 64
"""Deepest level walked (a tree's node chain holds at most 64 ids)."""
PER_DEPTH = ("rollouts", "root_turns", "root_completion_tokens", "sub_llm_call_count", "sub_llm_completion_tokens")
"""The figures kept per depth, as ``depth{d}_{name}``."""
TREE_KEYS = (
    "rlm_call_count", "rlm_batch_count", "rlm_call_failed_count", "tree_rollout_count", "tree_depth",
    "tree_root_turns", "tree_root_completion_tokens", "tree_sub_llm_call_count", "tree_sub_llm_completion_tokens",
    "tree_charged_completion_tokens", "tree_sub_llm_error_count", "tree_sub_llm_rejected_count",
    "tree_budget_spent_count",
)  # fmt: skip
"""The tree-wide figures."""
_SUMS = (
    "rlm_call_count", "rlm_batch_count", "rlm_call_failed_count",
    "tree_sub_llm_error_count", "tree_sub_llm_rejected_count", "tree_budget_spent_count",
)  # fmt: skip
_DEPTH_NAME = re.compile(r"depth[0-9]+_(" + "|".join(PER_DEPTH) + ")")


def depth_key(depth: int, name: str) -> str:
    """The metric name of figure ``name`` (one of :data:`PER_DEPTH`) at ``depth``: ``depth2_root_turns``."""
    return f"depth{depth}_{name}"


def is_tree_metric(name: str) -> bool:
    """True for the names :func:`tree_metrics` gives (``depth{d}_*`` and :data:`TREE_KEYS`)."""
    return name in TREE_KEYS or _DEPTH_NAME.fullmatch(name) is not None


def number(value: Any) -> int:
    """``value`` as a non-negative int (a float is truncated); anything else, NaN and negatives are 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0
    if isinstance(value, float) and not math.isfinite(value):
        return 0
    return max(0, int(value))


def _dicts(items: Any) -> Iterable[dict[str, Any]]:
    return (x for x in items if isinstance(x, dict)) if isinstance(items, list) else ()


@dataclass
class _Tree:
    by_depth: dict[int, dict[str, int]] = field(default_factory=dict)
    sums: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_SUMS, 0))

    def add(self, depth: int, name: str, n: int) -> None:
        row = self.by_depth.setdefault(depth, dict.fromkeys(PER_DEPTH, 0))
        row[name] += n


def _own_root(trajectory: list[dict[str, Any]], own: Mapping[str, Any]) -> tuple[int, int]:
    """(root turns, root completion tokens): the rollout's metrics when they hold them, else its root events."""
    roots = [ev for ev in trajectory if ev.get("type") == "root"]
    turns = number(own["main_rlm_turns"]) if "main_rlm_turns" in own else len(roots)
    if "main_rlm_completion_tokens" in own:
        tokens = number(own["main_rlm_completion_tokens"])
    else:
        usages = (ev.get("usage") for ev in roots)
        tokens = sum(number(u.get("completion")) for u in usages if isinstance(u, dict))
    return turns, tokens


def _precomputed(metrics: Mapping[str, Any], depth: int, tree: _Tree) -> bool:
    """Add a child's own account of its subtree (``metrics`` computed at ``depth``); False when it has none."""
    if number(metrics.get(depth_key(depth, "rollouts"))) != 1 or "tree_rollout_count" not in metrics:
        return False
    deepest = min(max(number(metrics.get("tree_depth")), depth), MAX_TREE_DEPTH)
    for d in range(depth, deepest + 1):
        for name in PER_DEPTH:
            tree.add(d, name, number(metrics.get(depth_key(d, name))))
    for name in _SUMS:
        tree.sums[name] += number(metrics.get(name))
    return True


def _walk(trajectory: list[dict[str, Any]], own: Mapping[str, Any], depth: int, tree: _Tree) -> None:
    turns, tokens = _own_root(trajectory, own)
    tree.add(depth, "rollouts", 1)
    tree.add(depth, "root_turns", turns)
    tree.add(depth, "root_completion_tokens", tokens)
    for ev in trajectory:
        kind = ev.get("type")
        if kind not in ("llm_batch", "rlm_batch"):
            continue
        if kind == "rlm_batch":
            tree.sums["rlm_batch_count"] += 1
        for result in _dicts(ev.get("results")):
            child = result.get("child") if kind == "rlm_batch" else None
            if kind == "rlm_batch":
                tree.sums["rlm_call_count"] += 1
                tree.sums["rlm_call_failed_count"] += result.get("status") in ("error", "rejected")
            if isinstance(child, dict):
                tree.sums["tree_budget_spent_count"] += child.get("stop_reason") == "budget_spent"
                if depth >= MAX_TREE_DEPTH:
                    continue
                metrics = child.get("metrics")
                metrics = metrics if isinstance(metrics, dict) else {}
                if not _precomputed(metrics, depth + 1, tree):
                    _walk(list(_dicts(child.get("trajectory"))), metrics, depth + 1, tree)
                continue
            if result.get("status") != "rejected":  # the calls that ran, as the reference counts them
                tree.add(depth, "sub_llm_call_count", 1)
            tree.sums["tree_sub_llm_error_count"] += result.get("status") == "error"
            tree.sums["tree_sub_llm_rejected_count"] += result.get("status") == "rejected"
            tree.add(depth, "sub_llm_completion_tokens", number(result.get("completion_tokens")))


def tree_metrics(
    trajectory: list[dict[str, Any]], own: Mapping[str, Any], *, depth: int = 1, max_depth: int | None = None
) -> dict[str, int]:
    """The per-depth and tree-wide figures of a rollout (see the module's docstring for each name).

    Args:
        trajectory: the rollout's trajectory (events as :class:`~rlmq.producer.rollout.
            RolloutResult` documents them; ``rlm_batch`` events nest children's trajectories).
        own: the rollout's own metrics (``RolloutStats.metrics()``): its ``main_rlm_turns`` and
            ``main_rlm_completion_tokens`` are taken from there when present.
        depth: the rollout's depth (1 for a top rollout; a child's host passes the child's).
        max_depth: the tree's depth limit, if known: the per-depth names are then given for
            every depth up to it (0 where nothing ran), so rows of one run share their keys.

    Returns:
        ``{name: int}``: ``depth{d}_*`` for ``d`` from ``depth`` to the deepest reached or
        ``max_depth`` (at most :data:`MAX_TREE_DEPTH`), and :data:`TREE_KEYS`.

    Raises:
        ValueError: ``depth`` is not in ``1 .. MAX_TREE_DEPTH``.
    """
    if not 1 <= depth <= MAX_TREE_DEPTH:
        raise ValueError(f"depth is in 1..{MAX_TREE_DEPTH}, not {depth}")
    tree = _Tree()
    _walk(list(_dicts(trajectory)), own, depth, tree)
    deepest = max(tree.by_depth)
    last = min(max(deepest, max_depth or 0), MAX_TREE_DEPTH)
    out: dict[str, int] = {}
    for d in range(depth, last + 1):
        row = tree.by_depth.get(d, dict.fromkeys(PER_DEPTH, 0))
        out.update({depth_key(d, name): row[name] for name in PER_DEPTH})
    rows = tree.by_depth.values()
    out.update(tree.sums)
    out["tree_rollout_count"] = sum(r["rollouts"] for r in rows)
    out["tree_depth"] = max(d for d, r in tree.by_depth.items() if r["rollouts"])
    for name in ("root_turns", "root_completion_tokens", "sub_llm_call_count", "sub_llm_completion_tokens"):
        out[f"tree_{name}"] = sum(r[name] for r in rows)
    out["tree_charged_completion_tokens"] = out["tree_sub_llm_completion_tokens"] + sum(
        r["root_completion_tokens"] for d, r in tree.by_depth.items() if d >= 2
    )
    return out


def first_sub_call_error(trajectory: list[dict[str, Any]], depth: int = 1) -> str | None:
    """The ``error`` of the first sub-LLM call that ended ``error`` in a rollout's tree (its own
    ``llm_batch`` calls and those of its child rollouts, in trajectory order); ``None``: none did."""
    for ev in _dicts(trajectory):
        if ev.get("type") not in ("llm_batch", "rlm_batch"):
            continue
        for result in _dicts(ev.get("results")):
            child = result.get("child")
            if isinstance(child, dict) and depth < MAX_TREE_DEPTH:
                found = first_sub_call_error(list(_dicts(child.get("trajectory"))), depth + 1)
                if found:
                    return found
            elif result.get("status") == "error":
                return str(result.get("error") or result.get("content") or "error")[:1000]
    return None
