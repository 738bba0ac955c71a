"""Synthetic rollout trees: trajectories with nested ``rlm_batch`` events, as the engine writes
them (the wire shapes of :class:`~rlmq.common.schemas.SubLLMResult` / ``ChildOutcome``), for the
tree-metrics and report tests."""

from __future__ import annotations

from typing import Any

from rlmq.common.schemas import ChildOutcome, SubLLMResult


def root(completion: int, prompt: int = 100, content: str = "") -> dict[str, Any]:
    return {"type": "root", "content": content, "tool_calls": [], "seconds": 0.1,
            "usage": {"prompt": prompt, "completion": completion}}  # fmt: skip


def cell(code: str = "x", output: str = "") -> dict[str, Any]:
    return {"type": "cell", "code": code, "output": output, "seconds": 0.01, "timed_out": False, "restarted": False}


def sub(i: int, completion: int, status: str = "ok", **kw: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {"content": f"a{i}", **kw}
    res = SubLLMResult(
        rollout_id="p", batch_id="b1", index=i, job_id=f"j{i}", status=status,  # type: ignore[arg-type]
        completion_tokens=completion, **fields,
    )  # fmt: skip
    return res.model_dump(exclude_none=True)


def llm_batch(*completions: int) -> dict[str, Any]:
    return {"type": "llm_batch", "batch_id": "b1", "seconds": 0.2, "prompts": ["p"] * len(completions),
            "results": [sub(i, c) for i, c in enumerate(completions)]}  # fmt: skip


def child(
    i: int, depth: int, trajectory: list[dict[str, Any]], stop: str = "answer_ready", **kw: Any
) -> dict[str, Any]:
    """Slot ``i`` answered by a child rollout at ``depth`` (``kw``: more fields of the slot's result)."""
    outcome = ChildOutcome(rollout_id=f"c{depth}{i}-1", depth=depth, stop_reason=stop, trajectory=trajectory)
    return sub(i, 0, child=outcome, **kw)


def rlm_batch(results: list[dict[str, Any]], tasks: list[str] | None = None) -> dict[str, Any]:
    tasks = tasks if tasks is not None else [f"t{i}" for i in range(len(results))]
    return {"type": "rlm_batch", "batch_id": "b2", "seconds": 1.0, "tasks": tasks, "results": results}


def leaf(i: int) -> dict[str, Any]:
    """A depth-3 child: 2 root turns (10 + 20 tokens), one llm_batch of 2 calls (3 + 4 tokens)."""
    return child(i, 3, [root(10), llm_batch(3, 4), cell(), root(20)])


def three_levels() -> list[dict[str, Any]]:
    """Top (depth 1): 2 root turns (50, 60), an llm_batch (7 tokens), an rlm_batch of 3 tasks:
    two children at depth 2 and one rejected slot. Each depth-2 child: 1 root turn (30), an
    rlm_batch of 2 depth-3 leaves and one plain error slot (5 tokens spent)."""
    mid = [
        child(k, 2, [root(30), rlm_batch([leaf(0), leaf(1), sub(2, 5, "error", error_kind="deadline")]), cell()])
        for k in range(2)
    ]
    rejected = sub(2, 0, "rejected")
    return [root(50), llm_batch(7), rlm_batch([*mid, rejected]), cell(), root(60)]


def hostile_tree(evil: str) -> list[dict[str, Any]]:
    """A 3-level tree with ``evil`` in every string a model (or a child's host) writes: root
    texts, cell code and output, tasks, answers, stop reasons, ids, errors, workers, event types."""
    deep = child(
        0, 3, [root(4, content="deep " + evil), cell("print('deep " + evil + "')", "DEEP-MARK " + evil)],
        stop="answer_ready" + evil, content="leaf answer " + evil, worker="w" + evil,
    )  # fmt: skip
    batch = llm_batch(2)
    batch["prompts"] = ["prompt " + evil]
    batch["results"][0]["content"] = "sub " + evil
    mid_traj = [
        root(6, content="mid " + evil),
        {**rlm_batch([deep, sub(1, 0, "error", error_kind="deadline" + evil, error="gone " + evil)],
                     tasks=["task3 " + evil, "task3b"]), "batch_id": "b" + evil},
        batch,
        cell("rlm_batch(" + evil + ")", "mid output " + evil),
        {"type": evil, "text": evil},
    ]  # fmt: skip
    mid = child(0, 2, mid_traj, content="mid answer " + evil)
    mid["child"]["rollout_id"] = "id" + evil
    return [root(9, content="top " + evil), rlm_batch([mid], tasks=["task2 " + evil]), cell("go", "top output")]
