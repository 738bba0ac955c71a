"""Size bounds on the child trajectories a rollout tree carries.

A child rollout's trajectory travels in its :class:`~rlmq.common.schemas.SubLLMResult`
(``child.trajectory``) through Redis into its parent's trajectory, and nests: a child's own
``rlm_batch`` events carry its children's trajectories. Without a bound, a model that writes
big cells, big answers or many children would fill the worker's memory, a Redis stream entry
and its parent's memory with many MB per child. Two bounds:

* :func:`cut_trajectory` on the child's host, before the result leaves the worker: the child's
  trajectory is at most :data:`CHILD_TRAJECTORY_MAX_CHARS` characters of JSON;
* :class:`KeptChildren` on the parent's host: the child trajectories one rollout keeps, over all
  its ``rlm_batch`` calls, are at most :data:`ROLLOUT_CHILD_TRAJECTORIES_MAX_CHARS` characters;
  later children keep their answer, stop reason and metrics, not their trajectory.

Every cut says what it left out (a ``{"type": "cut", ...}`` event, or ``trajectory_cut`` in the
child outcome). The figures of :mod:`rlmq.producer.tree_metrics` do not change: a child's host
computes its subtree's figures from the whole trajectory before it is cut and sends them in
``child.metrics``.
"""

from __future__ import annotations

import json
from typing import Any

CHILD_TRAJECTORY_MAX_CHARS = 4_000_000
"""Characters of JSON of one child's trajectory that leave its worker."""

ROLLOUT_CHILD_TRAJECTORIES_MAX_CHARS = 32_000_000
"""Characters of JSON of child trajectories one rollout keeps over all its ``rlm_batch`` calls."""

STUB_TEXT_CHARS = 2_000
"""Characters of a result's ``content`` kept in an ``rlm_batch`` event whose children were cut."""


def json_chars(value: Any) -> int:
    """The length (characters) of ``value`` as JSON (``str`` for what JSON cannot hold)."""
    return len(json.dumps(value, ensure_ascii=False, default=str))


def _without_children(event: dict[str, Any]) -> dict[str, Any]:
    """An ``rlm_batch`` event whose results keep their status, cut content and child outcome but
    not the children's trajectories (``trajectory_cut``: how many events each had)."""
    out = dict(event)
    results = []
    for r in event.get("results") or []:
        if not isinstance(r, dict):
            continue
        r = dict(r)
        content = r.get("content")
        if isinstance(content, str) and len(content) > STUB_TEXT_CHARS:
            r["content"] = (
                content[:STUB_TEXT_CHARS] + f"[... cut at {STUB_TEXT_CHARS:,} of {len(content):,} characters]"
            )
        child = r.get("child")
        if isinstance(child, dict):
            traj = child.get("trajectory")
            child = dict(child, trajectory=[])
            child["trajectory_cut"] = len(traj) if isinstance(traj, list) else 0
            r["child"] = child
        results.append(r)
    out["results"] = results
    return out


def cut_trajectory(trajectory: list[Any], max_chars: int = CHILD_TRAJECTORY_MAX_CHARS) -> list[Any]:
    """``trajectory`` bounded to about ``max_chars`` characters of JSON.

    Events are kept in order while they fit. One that does not: an ``rlm_batch`` event is kept
    without its children's trajectories (and with its results' contents cut to
    :data:`STUB_TEXT_CHARS`) if that fits, any other event is left out; later events that fit
    are still kept (the last root turn holds the answer). When anything was left out, one
    ``{"type": "cut", "events_dropped": int, "events_stubbed": int, "chars": int, "max_chars":
    int}`` event ends the list (``chars``: the whole trajectory's JSON length).

    Args:
        trajectory: a rollout's events (not changed).
        max_chars: the bound (characters of JSON; >= 0).
    """
    sizes = [json_chars(ev) for ev in trajectory]
    total = sum(sizes) + 2 * len(sizes)  # the brackets and the ", " separators
    if total <= max_chars:
        return trajectory
    room = max_chars - 200  # the cut event
    kept: list[Any] = []
    dropped = stubbed = 0
    for ev, size in zip(trajectory, sizes, strict=True):
        if size + 2 <= room:
            kept.append(ev)
            room -= size + 2
            continue
        if isinstance(ev, dict) and ev.get("type") == "rlm_batch":
            stub = _without_children(ev)
            stub_size = json_chars(stub)
            if stub_size + 2 <= room:
                kept.append(stub)
                room -= stub_size + 2
                stubbed += 1
                continue
        dropped += 1
    kept.append(
        {"type": "cut", "events_dropped": dropped, "events_stubbed": stubbed, "chars": total, "max_chars": max_chars}
    )
    return kept


class KeptChildren:
    """The child-trajectory allowance of one rollout (its parent's side of the bound).

    Args:
        max_chars: characters of JSON of child trajectories the rollout keeps in all.
    """

    def __init__(self, max_chars: int = ROLLOUT_CHILD_TRAJECTORIES_MAX_CHARS) -> None:
        self.room = max_chars

    def keep(self, result: dict[str, Any]) -> dict[str, Any]:
        """One ``rlm_batch`` result (a dumped :class:`~rlmq.common.schemas.SubLLMResult`), its
        child's trajectory kept while the allowance lasts, else replaced by ``[]`` with
        ``trajectory_cut`` (its event count); the allowance shrinks by what is kept."""
        child = result.get("child")
        if not isinstance(child, dict) or not isinstance(child.get("trajectory"), list):
            return result
        size = json_chars(child["trajectory"])
        if size <= self.room:
            self.room -= size
            return result
        self.room = 0  # later children too: the order of what is kept stays the order of the calls
        return dict(result, child=dict(child, trajectory=[], trajectory_cut=len(child["trajectory"])))


def without_surrogates(value: Any) -> Any:
    """``value`` (JSON-like: dicts, lists, strs, numbers) with every lone surrogate in its strings
    (keys included) replaced by U+FFFD: a REPL's answer (its bytes are read with surrogates
    passed) or a model's text (JSON escapes) may hold them, and JSON for Redis cannot."""
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, dict):
        return {without_surrogates(k): without_surrogates(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [without_surrogates(v) for v in value]
    return value
