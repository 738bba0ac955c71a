"""The verifiers 0.1.14 ``RLMEnv`` hooks of the legacy class: its REPL tool methods, output
format, context warning, stop conditions, ``env_response``, ``add_model_response`` and
``render_completion``, with the reference's meaning (verifiers 0.1.14 ``RLMEnv``; rlmq's own code).

In an rlmq rollout the REPL cells run in rlmq's sandbox, driven by rlmq's engine; these methods
are what a subclass or a test of the reference finds on the class, and they hold the
reference's rules for the state they are given.
"""

from __future__ import annotations

from typing import Any

import verifiers as vf

from rlmq.verifiers_legacy.summarize import Summarization

__all__ = ["ReferenceHooks", "format_cell"]

_TRUNCATED = "\n... [output truncated]"


def format_cell(result: dict[str, Any], *, language: str, limit: int) -> str:
    """The text the root model reads for one REPL cell, as the reference writes it.

    Args:
        result: ``status`` (``ok`` / ``error``), ``stdout``, ``stderr``, ``result`` (an
            expression's repr, or the traceback when ``status`` is ``error``), ``execution_count``.
        language: ``python``: stdout, ``stderr:`` and the stream, then ``Out[n]: value`` or the
            traceback; ``bash``: stdout and stderr as they are.
        limit: characters kept (``max_output_length``); a longer text ends in ``[output truncated]``.
    """
    stdout, stderr = result.get("stdout") or "", result.get("stderr") or ""
    value = result.get("result")
    if language == "bash":
        text = f"{stdout}{stderr}" or str(value or "")
    else:
        parts = [stdout.rstrip()] if stdout.rstrip() else []
        if stderr.rstrip():
            parts.append("stderr:\n" + stderr.rstrip())
        if result.get("status") == "error" and value:
            parts.append(str(value).rstrip())
        elif result.get("status") == "ok" and value is not None:
            parts.append(f"Out[{result.get('execution_count', 0)}]: {value}")
        text = "\n".join(parts)
    text = text or "(no output)"
    return text[:limit] + _TRUNCATED if len(text) > limit else text


class ReferenceHooks(Summarization):
    """The reference's hooks (a mixin of the legacy ``RLMEnv``, a ``vf.StatefulToolEnv``)."""

    repl_language: str
    max_output_length: int
    max_seq_len: int | None
    context_warning_threshold: float
    root_max_completion_tokens: int | None
    max_turns_in_context: int | None
    max_turns: int

    def _format_execution_output(self, result: dict[str, Any]) -> str:
        """See :func:`format_cell` (this environment's language and ``max_output_length``)."""
        return format_cell(result, language=self.repl_language, limit=self.max_output_length)

    def _maybe_add_context_warning(self, output: str, state: Any, *, ready_instruction: str) -> str:
        """``output`` with the context-limit warning added, once per rollout, when the last root
        call's prompt tokens reached ``context_warning_threshold`` of ``max_seq_len``."""
        if not self.max_seq_len or state.get("context_warning_sent"):
            return output
        roots = [s for s in state.get("trajectory", []) if not (s.get("extras") or {}).get("is_sub_llm_call")]
        usage = getattr(roots[-1].get("response"), "usage", None) if roots else None
        used = (getattr(usage, "prompt_tokens", 0) or 0) if usage is not None else 0
        if used < int(self.max_seq_len * self.context_warning_threshold):
            return output
        state["context_warning_sent"] = True
        share = used / self.max_seq_len
        return (
            f"{output}\n\n[CONTEXT LIMIT WARNING] You have used {used:,} of {self.max_seq_len:,} tokens "
            f"({share:.0%}). {ready_instruction}"
        )

    async def _execute_code(self, code: str, state: Any) -> dict[str, Any]:
        """One cell in the rollout's REPL. rlmq's engine runs the cells of its rollouts in its
        own sandbox; outside one there is no REPL to run in.

        Raises:
            RuntimeError: always (no rlmq rollout runs this state).
        """
        raise RuntimeError("rlmq runs REPL cells inside its rollouts (RLMEnv.rollout); there is no REPL here")

    async def _call_repl(self, code: str, state: Any, *, ready_instruction: str) -> str:
        result = await self._execute_code(code, state)
        output = self._format_execution_output(result)
        answer = result.get("answer") or {}
        if answer.get("ready"):
            state["final_answer"] = answer.get("content", "")
        return self._maybe_add_context_warning(output, state, ready_instruction=ready_instruction)

    async def call_bash_repl(self, code: str, state: Any) -> str:
        """Run bash commands in the rollout's persistent REPL."""
        return await self._call_repl(
            code, state, ready_instruction="Please finalize your answer soon by setting ANSWER_READY=1."
        )

    async def call_python_repl(self, code: str, state: Any) -> str:
        """Run Python code in the rollout's persistent REPL."""
        return await self._call_repl(
            code, state, ready_instruction="Please finalize your answer soon by setting answer['ready'] = True."
        )

    def update_tool_args(
        self, tool_name: str, tool_args: dict[str, Any], messages: Any, state: Any, **kwargs: Any
    ) -> dict[str, Any]:
        """The REPL tools and ``summarize_turns`` get the rollout's state as ``state``."""
        if tool_name in {"call_python_repl", "call_bash_repl", "summarize_turns"}:
            return {**tool_args, "state": state}
        return tool_args

    def _is_root_budget_exhausted(self, state: Any) -> bool:
        """Whether the root model's completion tokens so far reached ``root_max_completion_tokens``."""
        limit = self.root_max_completion_tokens
        return limit is not None and state.get("root_llm_completion_tokens", 0) >= limit

    def _is_max_turns_in_context_reached(self, state: Any) -> bool:
        if self.max_turns_in_context is None:
            return False
        visible = self._main_turn_count(state) - state.get("_keep_from_assistant_index", 0)
        return bool(visible >= self.max_turns_in_context)

    async def _ensure_final_answer(self, state: Any) -> None:
        """``final_answer`` is ``""`` when the rollout ends before one was set."""
        state.setdefault("final_answer", "")

    async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
        """The tools' answers (``StatefulToolEnv``'s), added to ``.messages``; the answer being
        ready, the root budget spent or ``max_turns_in_context`` reached make them the last."""
        tool_messages = await super().env_response(messages, state, **kwargs)  # type: ignore[misc]
        if tool_messages:
            self._append_observable_messages(state, tool_messages)
        if "final_answer" in state:
            state["final_env_response"] = tool_messages
        elif self._is_root_budget_exhausted(state) or self._is_max_turns_in_context_reached(state):
            if not self._is_root_budget_exhausted(state):
                state["max_turns_in_context_stopped"] = True
            await self._ensure_final_answer(state)
            state["final_env_response"] = tool_messages
        return tool_messages

    async def add_model_response(self, state: Any, prompt_messages: Any, response: Any) -> None:
        """``MultiTurnEnv``'s, plus: the first turn's prompt becomes ``state["prompt"]`` (the
        row's own in ``raw_prompt``), and the turn joins ``.messages``."""
        if not state["trajectory"]:
            state.setdefault("raw_prompt", state["prompt"])
            state["prompt"] = prompt_messages
        await super().add_model_response(state, prompt_messages, response)  # type: ignore[misc]
        if not state.get("_observable_messages"):
            self._append_observable_messages(state, state["prompt"])
        self._append_observable_messages(state, state["trajectory"][-1]["completion"])

    async def render_completion(self, state: Any) -> None:
        """``state["completion"]``: the observable transcript after the prompt."""
        if not state.get("trajectory"):
            state["completion"] = []
            return
        observable = state.get("_observable_messages") or []
        rest = observable[len(state.get("prompt") or []) :]
        state["completion"] = [m.model_copy(deep=True) if hasattr(m, "model_copy") else dict(m) for m in rest]

    @vf.stop
    async def answer_ready(self, state: Any) -> bool:
        """The model set its answer ready."""
        return "final_answer" in state

    @vf.stop
    async def max_turns_reached(self, state: Any) -> bool:
        """``max_turns`` root turns (sub-LLM steps do not count); ``<= 0``: no limit."""
        return self.max_turns > 0 and self._main_turn_count(state) >= self.max_turns

    @vf.stop
    async def prompt_too_long(self, state: Any) -> bool:
        """The root model refused the prompt for its length."""
        if not state.get("prompt_too_long", False):
            return False
        await self._ensure_final_answer(state)
        return True
