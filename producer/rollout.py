"""One rollout's state and the root model's loop.

A :class:`Rollout` is everything one rollout carries from its first root turn to its result
row: its ids, the sub-model and queue its ``llm_batch`` calls go to, its running figures
(:class:`RolloutStats`), its trajectory and its messages. :func:`root_loop` is the RLM loop of
the paper and of the verifiers ``RLMEnv``: the root model answers, each ``call_python_repl``
tool call runs in the rollout's REPL, until ``answer["ready"]``, ``max_turns`` root turns,
or a root reply without a tool call.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from rlmq.common.schemas import DatasetRow, ResultRow, StopReason, SubLLMResult
from rlmq.common.settings import Settings
from rlmq.producer.repl import Repl
from rlmq.producer.root import RootModel
from rlmq.producer.scaffold import REPL_TOOL


def normalize_answer(text: str | None) -> str:
    """Case-folded, whitespace-collapsed, outer punctuation stripped (for ``correct``)."""
    if text is None:
        return ""
    t = " ".join(str(text).split()).casefold()
    return t.strip(" .,:;!?'\"`")


@dataclass
class RolloutResult:
    """A finished rollout: its result row and its trajectory.

    ``trajectory`` is a list of events: ``{"type": "root", ...}`` per root turn,
    ``{"type": "cell", "code", "output", "seconds", ...}`` per REPL cell and
    ``{"type": "llm_batch", "prompts", "results": [...]}`` per batch.
    """

    row: ResultRow
    trajectory: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class RolloutStats:
    """Running figures of one rollout; :meth:`metrics` names them as verifiers does."""

    batches: list[int] = field(default_factory=list)
    """Size (prompts) of each ``llm_batch`` call."""
    sub: list[SubLLMResult] = field(default_factory=list)
    root_turns: int = 0
    root_prompt_tokens: int = 0
    root_completion_tokens: int = 0
    repl_times: list[float] = field(default_factory=list)
    """Seconds of each REPL cell."""

    def metrics(self) -> dict[str, float | int]:
        """The result row's metrics (names of verifiers' ``RLMEnv`` plus rlmq's own)."""
        sub = self.sub
        waits = [r.queue_wait_seconds for r in sub if r.status != "rejected" and r.job_id]
        batches = self.batches
        times = self.repl_times
        return {
            "sub_llm_call_count": len(sub),
            "sub_llm_total_turns": sum(r.turns for r in sub),
            "sub_llm_prompt_tokens": sum(r.prompt_tokens for r in sub),
            "sub_llm_completion_tokens": sum(r.completion_tokens for r in sub),
            "sub_llm_total_tool_calls": sum(r.tool_calls for r in sub),
            "sub_llm_batch_count": len(batches),
            "sub_llm_max_batch_size": max(batches, default=0),
            "sub_llm_mean_batch_size": round(sum(batches) / len(batches), 3) if batches else 0.0,
            "main_rlm_turns": self.root_turns,
            "main_rlm_prompt_tokens": self.root_prompt_tokens,
            "main_rlm_completion_tokens": self.root_completion_tokens,
            "repl_call_count": len(times),
            "repl_total_time_seconds": round(sum(times), 4),
            "repl_mean_time_seconds": round(sum(times) / len(times), 4) if times else 0.0,
            "sub_llm_rejected_count": sum(1 for r in sub if r.status == "rejected"),
            "sub_llm_error_count": sum(1 for r in sub if r.status == "error"),
            "sub_llm_budget_waits": sum(r.budget_waits for r in sub),
            "sub_llm_budget_wait_seconds": round(sum(r.budget_wait_seconds for r in sub), 4),
            "sub_llm_truncated_count": sum(1 for r in sub if r.truncated),
            "sub_llm_queue_wait_seconds_mean": round(sum(waits) / len(waits), 5) if waits else 0.0,
        }


@dataclass
class Rollout:
    """One rollout in flight.

    Attributes:
        id: the rollout id (``[A-Za-z0-9_-]``, the hash tag of its Redis keys).
        row: the dataset row.
        model / sub_model: root and sub-LLM model names.
        queue: the tenant queue its sub-calls are enqueued on.
        settings: the environment's settings (every limit of this rollout).
    """

    id: str
    row: DatasetRow
    model: str
    sub_model: str
    queue: str
    settings: Settings
    stats: RolloutStats = field(default_factory=RolloutStats)
    trajectory: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def budget(self) -> int | None:
        """The sub-LLM completion-token budget (``None``: no budget)."""
        return self.settings.sub_llm_max_completion_tokens

    def start_batch(self, size: int) -> str:
        """Record a batch of ``size`` prompts; returns its id, ``b1``, ``b2``, ... (batch ids hold
        no ``-``: see :mod:`rlmq.producer.dispatch`)."""
        self.stats.batches.append(size)
        return f"b{len(self.stats.batches)}"


def _repl_code(arguments: str | None) -> str | None:
    """The ``code`` string of a ``call_python_repl`` call's JSON arguments, or ``None``."""
    try:
        code = json.loads(arguments or "{}")["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


async def root_loop(root: RootModel, rollout: Rollout, repl: Repl) -> tuple[StopReason, str | None]:
    """Run the root model's turns of ``rollout`` until it stops; returns (stop reason, final answer).

    Each root call gets ``max_tokens`` = what is left of ``root_max_completion_tokens``
    (tokens) when that is set. Tool calls other than ``call_python_repl(code)`` and
    malformed arguments get an ``[error]`` tool message, not an exception.

    Raises:
        RlmqError: the root model failed past its retries (see :class:`RootModel`), or the
            REPL could not run a cell.
    """
    s = rollout.settings
    stats, trajectory, messages = rollout.stats, rollout.trajectory, rollout.messages
    last_answer: str | None = None
    for _turn in range(s.max_turns):
        kwargs: dict[str, Any] = {"model": rollout.model, "messages": messages, "tools": [REPL_TOOL]}
        if s.root_max_completion_tokens is not None:
            left = s.root_max_completion_tokens - stats.root_completion_tokens
            if left <= 0:
                trajectory.append({"type": "note", "text": "root completion-token limit reached"})
                return "max_turns", last_answer
            kwargs["max_tokens"] = left
        t0 = time.perf_counter()
        resp = await root.chat(**kwargs)
        stats.root_turns += 1
        usage = getattr(resp, "usage", None)
        if usage is not None:
            stats.root_prompt_tokens += int(usage.prompt_tokens or 0)
            stats.root_completion_tokens += int(usage.completion_tokens or 0)
        msg = resp.choices[0].message
        tool_calls = list(msg.tool_calls or [])
        assistant: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
        if tool_calls:
            assistant["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.function.name, "arguments": tc.function.arguments},
                }
                for tc in tool_calls
            ]
        messages.append(assistant)
        trajectory.append(
            {
                "type": "root",
                "content": msg.content or "",
                "tool_calls": assistant.get("tool_calls", []),
                "seconds": round(time.perf_counter() - t0, 4),
                "usage": {
                    "prompt": getattr(usage, "prompt_tokens", 0),
                    "completion": getattr(usage, "completion_tokens", 0),
                },
            }
        )
        if not tool_calls:
            return "no_tool_call", last_answer if last_answer else (msg.content or None)
        for tc in tool_calls:
            if tc.function.name != "call_python_repl":
                out = f"[error] unknown tool {tc.function.name!r}; the only tool is call_python_repl(code)"
                messages.append({"role": "tool", "tool_call_id": tc.id, "content": out})
                continue
            code = _repl_code(tc.function.arguments)
            if code is None:
                out = '[error] call_python_repl takes one string argument: {"code": "..."}'
                messages.append({"role": "tool", "tool_call_id": tc.id, "content": out})
                continue
            cell = await repl.execute(code)
            stats.repl_times.append(cell.seconds)
            trajectory.append(
                {
                    "type": "cell",
                    "code": code,
                    "output": cell.output,
                    "seconds": round(cell.seconds, 4),
                    "timed_out": cell.timed_out,
                    "restarted": cell.restarted,
                }
            )
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": cell.output})
            if cell.answer_content:
                last_answer = cell.answer_content
            if cell.answer_ready:
                return "answer_ready", cell.answer_content
    return "max_turns", last_answer
