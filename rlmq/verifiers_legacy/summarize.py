"""Context summarization of verifiers 0.1.14's ``RLMEnv`` (``enable_summarization=True``).

The root model gets one more function-calling tool, ``summarize_turns(n_turns, summary)``: the
oldest ``n_turns`` root turns still in its context (a turn is an assistant message and the tool
messages after it) leave the prompt of its later calls, and ``summary`` joins a cumulative
summary, ``[Turns a-b] <summary>`` per call, one line each, that is put at the start of the
first assistant message still in the prompt as a ``<SUMMARY>...</SUMMARY>`` block. At least
``min_turns_in_context`` turns stay; ``n_turns=-1`` drops as many as may go. The figures go to
the state under the reference's ``summarize_*`` names. Same meaning as the reference
(verifiers 0.1.14 ``RLMEnv.summarize_turns`` and its tests); this is rlmq's own code.
"""

from __future__ import annotations

import re
from typing import Any

import verifiers as vf

__all__ = ["SUMMARY_FIGURES", "Summarization", "summary_block_on"]

SUMMARY_FIGURES: dict[str, Any] = {
    "summarize_count": 0,
    "summarize_rejected_count": 0,
    "summarize_total_turns_dropped": 0,
    "summarize_total_chars_dropped": 0,
    "summarize_summary_length_chars": 0,
    "summarize_char_compression_ratio": 0.0,
    "summarize_mean_turns_per_call": 0.0,
    "summarize_mean_remaining_turns": 0.0,
    "summarize_mean_turns_between": 0.0,
}
"""The summarization figures of a rollout's state, and their values before any call."""

_OLD_BLOCK = re.compile(r"^<SUMMARY>\n.*?\n</SUMMARY>\n\n", re.DOTALL)


def _role(message: Any) -> str | None:
    return message.get("role") if isinstance(message, dict) else getattr(message, "role", None)


def _field(message: Any, name: str) -> Any:
    return message.get(name) if isinstance(message, dict) else getattr(message, name, None)


def summary_block_on(message: Any, summary: str) -> vf.AssistantMessage:
    """``message`` (an assistant message) with its ``<SUMMARY>`` block replaced by one of
    ``summary`` (removed when ``summary`` is ``""``); text or list-of-parts content alike."""
    block = f"<SUMMARY>\n{summary}\n</SUMMARY>\n\n" if summary else ""
    content = _field(message, "content")
    if isinstance(content, str):
        content = block + _OLD_BLOCK.sub("", content, count=1)
    elif isinstance(content, list):
        kept = [p for p in content if not (isinstance(p, dict) and "<SUMMARY>" in str(p.get("text", "")))]
        content = [{"type": "text", "text": block}, *kept] if block else kept
    elif block:
        content = block
    return vf.AssistantMessage(
        content=content,
        tool_calls=_field(message, "tool_calls"),
        reasoning_content=_field(message, "reasoning_content"),
        thinking_blocks=_field(message, "thinking_blocks"),
    )


def _chars(message: Any) -> int:
    """Characters of a message's content (its tool calls' arguments when it has none)."""
    content = _field(message, "content")
    if content is None:
        return sum(len(getattr(c, "arguments", "") or "") for c in _field(message, "tool_calls") or [])
    if isinstance(content, list):
        return sum(len(str(p.get("text", "")) if isinstance(p, dict) else str(p)) for p in content)
    return len(content if isinstance(content, str) else str(content))


class Summarization:
    """The summarization methods of the legacy ``RLMEnv`` (a mixin; the class sets
    ``min_turns_in_context``)."""

    min_turns_in_context: int

    def _main_turn_count(self, state: Any) -> int:
        """Root-model steps of the trajectory (sub-LLM steps have other trajectory ids)."""
        main = state.get("trajectory_id")
        return sum(1 for step in state.get("trajectory", []) if step.get("trajectory_id") == main)

    def _last_main_trajectory_step(self, state: Any) -> Any:
        """The last root-model step of the trajectory, or ``None``."""
        main = state.get("trajectory_id")
        return next((s for s in reversed(state.get("trajectory", [])) if s.get("trajectory_id") == main), None)

    async def summarize_turns(self, n_turns: int, summary: str, state: Any) -> str:
        """Drop the oldest ``n_turns`` turns from your context, keeping ``summary`` of them.

        Args:
            n_turns: how many of the oldest turns still in context to drop; -1 drops all that may go.
            summary: what the dropped turns found, to keep.

        Returns:
            The whole summary so far (every earlier summary and this one), or why nothing was dropped.
        """
        for name, value in SUMMARY_FIGURES.items():
            state.setdefault(name, value)
        turn = self._main_turn_count(state)
        kept_from = int(state.get("_keep_from_assistant_index", 0))
        visible = turn - kept_from
        most = max(0, visible - self.min_turns_in_context)
        n_turns = most if n_turns == -1 else n_turns
        if n_turns <= 0 or n_turns > most:
            state["summarize_rejected_count"] += 1
            if n_turns <= 0:
                return f"Nothing to drop (n_turns={n_turns}). {visible} turn(s) are in context."
            return (
                f"Cannot drop {n_turns} turn(s): {visible} turn(s) are in context and at least "
                f"min_turns_in_context={self.min_turns_in_context} stay, so at most {most} can go. "
                "No turns were dropped."
            )
        dropped_chars = self._compute_dropped_chars(state, n_turns)
        state["_keep_from_assistant_index"] = kept_from + n_turns
        line = f"[Turns {kept_from + 1}-{kept_from + n_turns}] {summary}"
        state["_summary_text"] = f"{state['_summary_text']}\n{line}" if state.get("_summary_text") else line
        self._refresh_observable_summary_insertion(state)
        self._count_summary(state, n_turns, dropped_chars, remaining=visible - n_turns, turn=turn)
        return str(state["_summary_text"])

    @staticmethod
    def _count_summary(state: Any, n_turns: int, dropped_chars: int, *, remaining: int, turn: int) -> None:
        state["summarize_count"] += 1
        state["summarize_total_turns_dropped"] += n_turns
        state["summarize_total_chars_dropped"] += dropped_chars
        state["summarize_summary_length_chars"] = len(state["_summary_text"])
        if state["summarize_total_chars_dropped"]:
            ratio = state["summarize_summary_length_chars"] / state["summarize_total_chars_dropped"]
            state["summarize_char_compression_ratio"] = ratio
        state["summarize_mean_turns_per_call"] = state["summarize_total_turns_dropped"] / state["summarize_count"]
        remaining_after = state.setdefault("_summarize_remaining_turns_list", [])
        remaining_after.append(remaining)
        state["summarize_mean_remaining_turns"] = sum(remaining_after) / len(remaining_after)
        at = state.setdefault("_summarize_at_root_llm_turns", [])
        at.append(turn)
        if len(at) > 1:
            state["summarize_mean_turns_between"] = (at[-1] - at[0]) / (len(at) - 1)

    def _compute_dropped_chars(self, state: Any, n_turns: int) -> int:
        """Characters of the ``n_turns`` oldest turns in the last root prompt and completion
        (that prompt already has the earlier drops applied)."""
        last = self._last_main_trajectory_step(state)
        if last is None or n_turns <= 0:
            return 0
        messages = [*last["prompt"], *last["completion"]]
        starts = [i for i, m in enumerate(messages) if _role(m) == "assistant"]
        if not starts:
            return 0
        end = starts[n_turns] if n_turns < len(starts) else len(messages)
        return sum(_chars(m) for m in messages[starts[0] : end])

    def _apply_context_dropping(self, messages: Any, keep_from_assistant_index: int, summary_text: str = "") -> Any:
        """``messages`` without the turns before the ``keep_from_assistant_index``-th assistant
        message (what comes before the first assistant message always stays), the summary
        block on the first assistant message left. Applied again to its own result it drops
        nothing more (an index past the assistant messages keeps them all)."""
        if keep_from_assistant_index <= 0 and not summary_text:
            return messages
        starts = [i for i, m in enumerate(messages) if _role(m) == "assistant"]
        if not starts:
            return messages
        head = list(messages[: starts[0]])
        cut = starts[keep_from_assistant_index] if keep_from_assistant_index < len(starts) else starts[0]
        rest = list(messages[cut:])
        if summary_text:
            rest[0] = summary_block_on(rest[0], summary_text)
        return head + rest

    def _with_summary_on_assistant_message(self, message: Any, summary_text: str) -> vf.AssistantMessage:
        """See :func:`summary_block_on`."""
        return summary_block_on(message, summary_text)

    def _refresh_observable_summary_insertion(self, state: Any) -> None:
        """Put the summary block on the assistant message of ``.messages`` (the observable
        transcript) where the context now starts, and off every other one."""
        observable = state.get("_observable_messages") or []
        target, summary, seen = state.get("_keep_from_assistant_index", 0), state.get("_summary_text", ""), 0
        for i, message in enumerate(observable):
            if _role(message) == "assistant":
                observable[i] = summary_block_on(message, summary if seen == target else "")
                seen += 1

    def _append_observable_messages(self, state: Any, messages: Any) -> None:
        """Add copies of ``messages`` to the observable transcript (``.messages``)."""
        log = state.setdefault("_observable_messages", [])
        log.extend(m.model_copy(deep=True) if hasattr(m, "model_copy") else dict(m) for m in messages)

    def _build_message_history(self, state: Any) -> list[dict[str, Any]]:
        """The observable transcript as JSON-ready dicts (what ``.messages`` holds)."""
        out: list[dict[str, Any]] = []
        for message in state.get("_observable_messages", []):
            if hasattr(message, "model_dump"):
                out.append(message.model_dump(exclude_none=True))
            elif isinstance(message, dict):
                out.append(dict(message))
        return out
