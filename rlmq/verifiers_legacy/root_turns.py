"""The root model of a legacy ``RLMEnv`` rollout, called through the verifiers environment's client.

The reference (verifiers 0.1.14's ``RLMEnv``, a ``MultiTurnEnv``) makes every root call with
``Environment.get_model_response(state, prompt)``, i.e. through the ``client`` that
``evaluate`` / ``vf-eval`` hands to ``rollout``. rlmq's rollout engine calls a
:class:`~rlmq.producer.root.RootClient` instead; :class:`RootDispatch` is that client for a
legacy environment: it finds the verifiers rollout it belongs to (a context variable set by
the rollout), converts rlmq's OpenAI-shaped request into verifiers messages and tools, calls
``get_model_response`` (which also counts the usage in the state) and records each root turn
as a verifiers ``TrajectoryStep``, as ``MultiTurnEnv.add_model_response`` does.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import verifiers as vf
from verifiers.types import Tool, TrajectoryStep
from verifiers.utils.message_utils import normalize_messages
from verifiers.utils.response_utils import parse_response_message, parse_response_tokens

from rlmq.common.errors import ModelError, PromptTooLongError

__all__ = ["CURRENT", "RootDispatch", "RootTurns"]


@dataclass
class RootTurns:
    """One verifiers rollout's root calls: the environment (whose client makes them) and its state."""

    env: Any
    """The legacy ``RLMEnv`` (a verifiers ``Environment``)."""
    state: Any
    """The rollout's verifiers ``State``: ``client``, ``model``, ``sampling_args``, ``trajectory``."""
    first_prompt: list[Any] | None = None
    """The model-visible prompt of the first root call (rlmq's scaffold + the question)."""

    async def chat(self, kwargs: dict[str, Any]) -> Any:
        """One root call, as :meth:`RootClient.chat` gets it, through the environment's client.

        Raises:
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
        try:
            response = await self.env.get_model_response(self.state, prompt, tool_defs=tools, sampling_args=sampling)
        except vf.OverlongPromptError as exc:
            self.state["prompt_too_long"] = True
            self.state["is_truncated"] = True
            raise PromptTooLongError(f"the root model refused the prompt: {exc}") from exc
        except vf.Error as exc:
            raise ModelError(f"the root model call failed: {type(exc).__name__}: {exc}") from exc
        await self._record(prompt, response)
        return _chat_completion(response)

    async def _record(self, prompt: list[Any], response: Any) -> None:
        tokens = await parse_response_tokens(response, self.env.max_seq_len)
        truncated = bool(response.message.is_truncated) or bool(tokens and tokens.get("is_truncated"))
        step = TrajectoryStep(
            prompt=prompt,
            completion=await parse_response_message(response),
            response=response,
            tokens=tokens,
            reward=None,
            advantage=None,
            is_truncated=truncated,
            trajectory_id=self.state["trajectory_id"],
            extras={},
        )
        self.state["trajectory"].append(step)


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


def _chat_completion(response: Any) -> Any:
    """A verifiers ``Response`` in the shape rlmq's engine reads from an OpenAI ``ChatCompletion``."""
    message = response.message
    content = message.content if isinstance(message.content, str) else None
    calls = [
        SimpleNamespace(id=c.id, type="function", function=SimpleNamespace(name=c.name, arguments=c.arguments))
        for c in message.tool_calls or []
    ]
    usage = response.usage
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
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
        ),
    )
