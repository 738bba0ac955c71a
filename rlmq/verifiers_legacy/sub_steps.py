"""The sub-LLM calls of an rlmq rollout as verifiers 0.1.14 ``TrajectoryStep`` s
(``include_sub_llm_in_trajectory=True``).

The reference adds one step per model turn of each sub-LLM call to ``state["trajectory"]``,
after the root turn whose cell made the call: ``trajectory_id`` ``"<batch>_<request>"``,
``extras`` with ``is_sub_llm_call=True``, ``parent_turn``, ``batch_id``, ``request_id``,
``sub_turn_index``, ``total_sub_turns``, ``tool_call_count``, and the turn's token ids and
logprobs in ``tokens``. Here they come from rlmq's trajectory, the same turns
``trajectories.jsonl`` holds (:func:`~rlmq.expand_trajectory`): the ids and
logprobs the model server served, as the worker recorded them; a turn rlmq could not keep
tokens for (a server that sent none, the payload cap) has ``tokens=None`` and says why in
``extras["untrainable_reason"]``. ``response`` is ``None``: the worker's response object stays
on the worker.
"""

from __future__ import annotations

from typing import Any

from verifiers.types import TrajectoryStep

from rlmq import expand_trajectory

__all__ = ["interleave_sub_steps", "sub_steps"]


def _turns(messages: list[dict[str, Any]]) -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """(prompt, assistant message) for each assistant message of a sub-LLM conversation."""
    return [(messages[:i], m) for i, m in enumerate(messages) if m.get("role") == "assistant"]


def _tokens(step: dict[str, Any], truncated: bool) -> dict[str, Any] | None:
    if not step.get("trainable"):
        return None
    prompt, completion = step["prompt_token_ids"], step["completion_token_ids"]
    return {
        "prompt_ids": prompt, "prompt_mask": [0] * len(prompt), "completion_ids": completion,
        "completion_mask": [1] * len(completion), "completion_logprobs": step["completion_logprobs"],
        "overlong_prompt": False, "is_truncated": truncated,
    }  # fmt: skip


def sub_steps(result: dict[str, Any], *, batch_id: str, parent_turn: int) -> list[TrajectoryStep]:
    """The steps of one sub-LLM call (``result``: an expanded ``llm_batch`` result, with
    ``messages`` and ``steps``); none when it has no conversation (refused by the budget, failed
    before the model answered)."""
    turns = _turns([m for m in result.get("messages") or [] if isinstance(m, dict)])
    served = result.get("steps") or []
    out: list[TrajectoryStep] = []
    for i, (prompt, reply) in enumerate(turns):
        step = served[i] if i < len(served) else {}
        last = i == len(turns) - 1
        extras = {
            "is_sub_llm_call": True, "parent_turn": parent_turn, "batch_id": batch_id,
            "request_id": str(result.get("index", 0)), "sub_turn_index": i, "total_sub_turns": len(turns),
            "tool_call_count": len(reply.get("tool_calls") or []),
        }  # fmt: skip
        if step and not step.get("trainable"):
            extras["untrainable_reason"] = step.get("untrainable_reason")
        out.append(
            TrajectoryStep(
                prompt=prompt,
                completion=[reply],
                response=None,
                tokens=_tokens(step, bool(result.get("truncated")) and last),
                reward=None,
                advantage=None,
                is_truncated=bool(result.get("truncated")) and last,
                trajectory_id=f"{batch_id}_{result.get('index', 0)}",
                extras=extras,
            )
        )
    return out


def interleave_sub_steps(root_steps: list[Any], trajectory: list[dict[str, Any]]) -> list[Any]:
    """``root_steps`` (the verifiers rollout's root turns, in order) with the sub-LLM steps of
    rlmq's ``trajectory`` put after the root turn whose cell made each ``llm_batch``."""
    out: list[Any] = []
    roots = iter(root_steps)
    turn = 0
    for event in expand_trajectory(trajectory):
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "root":
            turn += 1
            out.extend(_next_visible(roots))
        elif kind == "llm_batch":
            batch = str(event.get("batch_id") or f"batch{turn}")
            for result in event.get("results") or []:
                if isinstance(result, dict):
                    out.extend(sub_steps(result, batch_id=batch, parent_turn=max(0, turn - 1)))
    out.extend(roots)
    return out


def _next_visible(roots: Any) -> list[Any]:
    """The next root step rlmq's engine saw, with the summarize-only steps before it."""
    taken: list[Any] = []
    for step in roots:
        taken.append(step)
        calls = [getattr(c, "name", None) for m in step["completion"] for c in (getattr(m, "tool_calls", None) or [])]
        if not calls or any(name != "summarize_turns" for name in calls):
            break
    return taken
