"""The root model of a legacy ``RLMEnv`` rollout, called through the verifiers environment's client.

The reference (verifiers 0.1.14's ``RLMEnv``, a ``MultiTurnEnv``) makes every root call with
``Environment.get_model_response(state, prompt)``, i.e. through the ``client`` that
``evaluate`` / ``vf-eval`` hands to ``rollout``. rlmq's rollout engine calls a
:class:`~rlmq.producer.root.RootClient` instead; :class:`RootDispatch` is that client for a
legacy environment: it finds the verifiers rollout it belongs to (a context variable set by
the rollout), converts rlmq's OpenAI-shaped request into verifiers messages and tools, calls
``get_model_response`` (which also counts the usage in the state) and records each root turn
through the environment's own ``add_model_response`` hook (a subclass that overrides it sees
each root turn), as ``MultiTurnEnv`` does.

Two rules of the reference live here, because rlmq's engine knows nothing of them:

* ``root_max_completion_tokens``: the reference runs root turns while the completion tokens
  used are below the limit, with no per-turn cap from it (so the last turn may pass it). So
  here: a root call starts only while used < limit (else the rollout stops), and its
  ``max_tokens`` is the rollout's own, or ``DEFAULT_CALL_MAX_TOKENS`` when the rollout gives
  none: a request always carries a bound, and the limit is passed by at most one turn.
* summarization (``enable_summarization``): the root model is offered ``summarize_turns`` beside
  the REPL; its prompt is the conversation with the dropped turns cut and the ``<SUMMARY>`` block
  on the first assistant message left (``_apply_context_dropping``). A reply that only calls
  ``summarize_turns`` is answered here and the model is asked again (at most
  :data:`SUMMARIZE_TURNS_IN_A_ROW` times in a row); rlmq's engine sees the next reply, and the
  usage of the replies answered here is added to it, so rlmq's counts and limits include them.
  The summarize exchange stays in the model's later prompts, where it was.
"""

from __future__ import annotations

import contextvars
import json
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import verifiers as vf
from verifiers.types import Tool
from verifiers.utils.message_utils import normalize_messages

from rlmq import DEFAULT_CALL_MAX_TOKENS, ModelError, PromptTooLongError, RootBudgetSpent

__all__ = ["CURRENT", "SUMMARIZE_TURNS_IN_A_ROW", "RootDispatch", "RootTurns"]

SUMMARIZE_TURNS_IN_A_ROW = 5
"""Replies in a row that only call ``summarize_turns`` before the next one goes to rlmq's engine
with those calls taken out (a model that only summarizes would otherwise never end)."""


@dataclass
class RootTurns:
    """One verifiers rollout's root calls: the environment (whose client makes them) and its state."""

    env: Any
    """The legacy ``RLMEnv`` (a verifiers ``Environment``)."""
    state: Any
    """The rollout's verifiers ``State``: ``client``, ``model``, ``sampling_args``, ``trajectory``."""
    first_prompt: list[Any] | None = None
    """The model-visible prompt of the first root call (rlmq's scaffold + the question)."""

    hidden: list[tuple[int, list[Any]]] = field(default_factory=list)
    """Summarize exchanges answered here: (assistant messages of rlmq's conversation before it,
    [the reply, its tool messages])."""

    async def chat(self, kwargs: dict[str, Any]) -> Any:
        """One root call, as :meth:`RootClient.chat` gets it, through the environment's client.

        Raises:
            RootBudgetSpent: ``root_max_completion_tokens`` is used up (the rollout stops).
            PromptTooLongError: verifiers' ``OverlongPromptError`` (the state gets
                ``prompt_too_long``, as in the reference).
            ModelError: any other verifiers error of the call.
        """
        prompt = normalize_messages(list(kwargs["messages"]), field_name="root messages")
        if self.first_prompt is None:
            self.first_prompt = list(prompt)
        tools = [_tool(t) for t in kwargs.get("tools") or []]
        sampling = dict(self.state.get("sampling_args") or {})
        if kwargs.get("max_tokens") is not None:
            sampling["max_tokens"] = kwargs["max_tokens"]
        limit = getattr(self.env, "root_max_completion_tokens", None)
        if limit is not None:
            used = self.root_completion_tokens()
            if used >= limit:
                self.state["root_budget_stopped"] = True
                raise RootBudgetSpent(f"root_max_completion_tokens reached: {used} of {limit} used")
            sampling.setdefault("max_tokens", DEFAULT_CALL_MAX_TOKENS)
            sampling["max_tokens"] = sampling["max_tokens"] or DEFAULT_CALL_MAX_TOKENS
        if not getattr(self.env, "enable_summarization", False):
            return _chat_completion(await self._call(prompt, tools, sampling))
        if self.env._is_max_turns_in_context_reached(self.state):
            self.state["max_turns_in_context_stopped"] = True
            raise RootBudgetSpent(f"max_turns_in_context={self.env.max_turns_in_context} turns are in context")
        return await self._summarizing(prompt, tools, sampling)

    def root_completion_tokens(self) -> int:
        """Completion tokens of the rollout's root turns so far."""
        main = self.state["trajectory_id"]
        steps = [s for s in self.state["trajectory"] if s.get("trajectory_id") == main]
        return sum(int(getattr(s["response"].usage, "completion_tokens", 0) or 0) for s in steps if s["response"].usage)

    async def _call(self, prompt: list[Any], tools: list[Tool], sampling: dict[str, Any]) -> Any:
        try:
            response = await self.env.get_model_response(self.state, prompt, tool_defs=tools, sampling_args=sampling)
        except vf.OverlongPromptError as exc:
            self.state["prompt_too_long"] = True
            self.state["is_truncated"] = True
            raise PromptTooLongError(f"the root model refused the prompt: {exc}") from exc
        except vf.Error as exc:
            raise ModelError(f"the root model call failed: {type(exc).__name__}: {exc}") from exc
        await self.env.add_model_response(self.state, prompt, response)
        return response

    async def _summarizing(self, prompt: list[Any], tools: list[Tool], sampling: dict[str, Any]) -> Any:
        """A root call with ``summarize_turns`` offered and answered here (module docstring)."""
        tools = [*tools, *(t for t in self.env.tool_defs if t.name == "summarize_turns")]
        spent = [0, 0]
        for _ in range(SUMMARIZE_TURNS_IN_A_ROW):
            view = self.env._apply_context_dropping(
                self._with_hidden(prompt),
                self.state.get("_keep_from_assistant_index", 0),
                summary_text=self.state.get("_summary_text", ""),
            )
            response = await self._call(view, tools, sampling)
            calls = response.message.tool_calls or []
            mine = [c for c in calls if c.name == "summarize_turns"]
            if not mine:
                return _chat_completion(response, spent)
            answers = [vf.ToolMessage(tool_call_id=c.id, content=await self._summarize(c.arguments)) for c in mine]
            self.env._append_observable_messages(self.state, answers)
            if len(mine) < len(calls):  # the REPL's calls go on to rlmq; the summary is on the next prompt
                return _chat_completion(response, spent, drop="summarize_turns")
            turns = sum(1 for m in prompt if getattr(m, "role", None) == "assistant")
            self.hidden.append((turns, [*self.state["trajectory"][-1]["completion"], *answers]))
            usage = response.usage
            spent[0] += int(getattr(usage, "prompt_tokens", 0) or 0) if usage else 0
            spent[1] += int(getattr(usage, "completion_tokens", 0) or 0) if usage else 0
        return _chat_completion(response, spent, drop="summarize_turns")

    async def _summarize(self, arguments: str) -> str:
        try:
            args = json.loads(arguments or "{}")
            return str(await self.env.summarize_turns(int(args["n_turns"]), str(args["summary"]), self.state))
        except (ValueError, KeyError, TypeError) as exc:
            return f"Error: summarize_turns(n_turns: int, summary: str): {type(exc).__name__}: {exc}"

    def _with_hidden(self, prompt: list[Any]) -> list[Any]:
        """rlmq's conversation with the summarize exchanges answered here put back where they were."""
        if not self.hidden:
            return prompt
        out: list[Any] = []
        pending = list(self.hidden)
        seen = 0
        for message in prompt:
            if getattr(message, "role", None) == "assistant":
                while pending and pending[0][0] == seen:
                    out.extend(pending.pop(0)[1])
                seen += 1
            out.append(message)
        for _, exchange in pending:
            out.extend(exchange)
        return out


CURRENT: contextvars.ContextVar[RootTurns | None] = contextvars.ContextVar("rlmq_legacy_root", default=None)
"""The verifiers rollout whose root calls the running rlmq rollout makes (set by the rollout)."""


class RootDispatch:
    """rlmq's root client for a legacy environment: each call goes to its rollout's :class:`RootTurns`."""

    async def chat(self, **kwargs: Any) -> Any:
        """See :meth:`RootTurns.chat`.

        Raises:
            ModelError: called outside a verifiers rollout, or the call failed.
            PromptTooLongError: the prompt is too long for the root model.
        """
        turns = CURRENT.get()
        if turns is None:
            raise ModelError("a root call outside a verifiers rollout of rlmq.verifiers_legacy.RLMEnv")
        return await turns.chat(kwargs)

    async def close(self) -> None:
        """Nothing to close: the client belongs to verifiers."""


def _tool(spec: dict[str, Any]) -> Tool:
    function = spec.get("function", spec)
    return Tool(
        name=str(function["name"]),
        description=str(function.get("description", "")),
        parameters=dict(function.get("parameters") or {}),
    )


def _chat_completion(response: Any, before: list[int] | None = None, drop: str | None = None) -> Any:
    """A verifiers ``Response`` in the shape rlmq's engine reads from an OpenAI ``ChatCompletion``;
    ``before`` (prompt, completion tokens of replies answered here) added to its usage, tool calls
    named ``drop`` left out."""
    message = response.message
    content = message.content if isinstance(message.content, str) else None
    calls = [
        SimpleNamespace(id=c.id, type="function", function=SimpleNamespace(name=c.name, arguments=c.arguments))
        for c in message.tool_calls or []
        if c.name != drop
    ]
    usage = response.usage
    extra = before or [0, 0]
    return SimpleNamespace(
        id=response.id,
        model=response.model,
        choices=[
            SimpleNamespace(
                message=SimpleNamespace(content=content, tool_calls=calls or None),
                finish_reason=message.finish_reason,
            )
        ],
        usage=SimpleNamespace(
            prompt_tokens=(usage.prompt_tokens if usage else 0) + extra[0],
            completion_tokens=(usage.completion_tokens if usage else 0) + extra[1],
        ),
    )
