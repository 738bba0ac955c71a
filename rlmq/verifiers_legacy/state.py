"""The reference's state keys, stop conditions and metrics, filled from an rlmq rollout.

verifiers 0.1.14's ``RLMEnv`` leaves its figures in the rollout's ``State`` and reports them
through its monitor rubric (``RLMMonitorRubric``: one metric per state key, 0 when absent).
:func:`fill_state` writes an rlmq :class:`~rlmq.RolloutResult` into the state
under the reference's names and meanings; :class:`LegacyMonitorRubric` reports them under the
same names.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import verifiers as vf
from verifiers.utils.message_utils import normalize_messages

from rlmq.verifiers_legacy.errors import RLMCodeExecutionTimeout

__all__ = ["REFERENCE_METRICS", "STOP_CONDITIONS", "LegacyMonitorRubric", "fill_state"]

STOP_CONDITIONS: dict[str, str] = {
    "answer_ready": "answer_ready",
    "max_turns": "max_turns_reached",
    "no_tool_call": "no_tools_called",
    "prompt_too_long": "prompt_too_long",
    "code_timeout": "has_error",  # the reference aborts the rollout with an error here
    "budget_spent": "max_turns_reached",
    "error": "has_error",
}
"""rlmq ``stop_reason`` -> the reference's ``state["stop_condition"]`` (its ``@vf.stop`` names)."""

RENAMED: dict[str, str] = {
    "root_llm_turns": "main_rlm_turns",
    "root_llm_prompt_tokens": "main_rlm_prompt_tokens",
    "root_llm_completion_tokens": "main_rlm_completion_tokens",
}
"""The reference's metric name -> rlmq's (the same figure; rlmq keeps #966's names)."""

REFERENCE_METRICS: tuple[str, ...] = (
    "sub_llm_call_count", "sub_llm_total_turns", "sub_llm_prompt_tokens", "sub_llm_completion_tokens",
    "sub_llm_total_tool_calls", "sub_llm_batch_count", "sub_llm_max_batch_size", "sub_llm_mean_batch_size",
    "root_llm_turns", "root_llm_prompt_tokens", "root_llm_completion_tokens", "repl_total_time_seconds",
    "repl_call_count", "repl_mean_time_seconds", "root_tool_call_count", "llm_batch_mean_time_seconds",
    "root_tool_non_llm_mean_time_seconds", "sub_llm_max_turns_reached_frac", "max_turns_in_context_stopped",
    "summarize_count", "summarize_rejected_count", "summarize_total_turns_dropped", "summarize_total_chars_dropped",
    "summarize_summary_length_chars", "summarize_char_compression_ratio", "summarize_mean_turns_per_call",
    "summarize_mean_remaining_turns", "summarize_mean_turns_between",
)  # fmt: skip
"""The metrics of the reference's monitor rubric, in its order (the summarization ones stay 0:
``enable_summarization`` is refused here)."""


def fill_state(state: Any, result: Any, *, first_prompt: list[Any] | None, turn_cap: int | None) -> None:
    """Write an rlmq rollout's outcome into a verifiers ``State``, under the reference's names.

    Args:
        state: the verifiers ``State`` (a dict-like) of the rollout.
        result: the :class:`~rlmq.RolloutResult`.
        first_prompt: the model-visible prompt of the first root call (verifiers messages), or
            ``None`` when no root call was made.
        turn_cap: ``max_turns_in_context`` when it, not ``max_turns``, limited the root turns.

    Sets ``rollout_id`` (rlmq's, the trajectory id), ``final_answer`` (``answer["content"]``;
    ``""`` when the rollout never set one, as the reference reads it back from its REPL),
    ``raw_prompt`` / ``prompt`` / ``completion``, the metric keys, ``stop_condition``,
    ``is_completed``, ``error`` and ``rlmq`` (rlmq's own row: rollout id, stop reason,
    metrics, error).
    """
    row = result.row
    metrics = dict(row.metrics)
    for reference, ours in RENAMED.items():
        metrics[reference] = metrics.get(ours, 0)
    metrics["llm_batch_mean_time_seconds"] = _mean_batch_seconds(result.trajectory)
    stop = STOP_CONDITIONS.get(row.stop_reason, "has_error")
    if turn_cap is not None and row.stop_reason == "max_turns":
        metrics["max_turns_in_context_stopped"] = True
    for key, value in metrics.items():
        state[key] = value
    state["final_answer"] = _final_answer(row, result)
    state["rollout_id"] = state["trajectory_id"]
    state.setdefault("raw_prompt", state["prompt"])
    if first_prompt is not None:
        state["prompt"] = first_prompt
        messages = normalize_messages(list(result.messages), field_name="rlmq messages")
        state["completion"] = messages[len(first_prompt) :]
    else:
        state["completion"] = []
    if row.stop_reason == "code_timeout":  # the reference's rollout ends with this error here
        state["error"] = RLMCodeExecutionTimeout(row.error or "a cell ran past code_execution_timeout")
    elif stop == "has_error":
        state["error"] = vf.Error(row.error or f"rlmq rollout ended with {row.stop_reason}")
    if row.stop_reason == "budget_spent" and (
        state.get("root_budget_stopped") or state.get("max_turns_in_context_stopped")
    ):
        stop = "has_final_env_response"  # the reference's env_response ends the rollout on these
    state["stop_condition"] = stop
    state["is_completed"] = True
    state["rlmq"] = {
        "rollout_id": state["trajectory_id"],
        "stop_reason": row.stop_reason,
        "metrics": dict(row.metrics),
        "error": row.error,
    }
    state["timing"].generation.end = time.time()


def _final_answer(row: Any, result: Any) -> str:
    """``answer["content"]`` as the reference reads it at the end: a reply without a tool call
    is not an answer (rlmq's row falls back to that reply's text)."""
    answer = row.final_answer or ""
    if row.stop_reason == "no_tool_call":
        roots = [e for e in result.trajectory if e.get("type") == "root"]
        if roots and (roots[-1].get("content") or "") == answer:
            return ""
    return answer


def _mean_batch_seconds(trajectory: list[dict[str, Any]]) -> float:
    seconds = [float(e["seconds"]) for e in trajectory if e.get("type") == "llm_batch" and "seconds" in e]
    return round(sum(seconds) / len(seconds), 4) if seconds else 0.0


def _state_metric(key: str) -> Callable[..., Awaitable[float]]:
    async def metric(state: Any) -> float:
        value = state.get(key, 0)
        return 0.0 if value is None else float(value)

    metric.__name__ = key
    return metric


def _root_tool_metric(name: str) -> Callable[..., Awaitable[float]]:
    key = f"{name}_root_calls"

    async def metric(state: Any) -> float:
        return float(state.get(key, 0) or 0)

    metric.__name__ = key
    return metric


class LegacyMonitorRubric(vf.Rubric):
    """The reference's monitor metrics (:data:`REFERENCE_METRICS`, ``<tool>_root_calls``) plus
    rlmq's own (``sub_llm_budget_*``, ``sub_llm_rejected_count``, ...), each read from the state;
    weight 0: they report, they do not reward."""

    def __init__(self, root_tool_names: list[str], extra: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for key in (*REFERENCE_METRICS, *extra):
            self.add_metric(_state_metric(key))
        for name in root_tool_names:
            self.add_metric(_root_tool_metric(name))
