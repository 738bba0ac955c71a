"""Continuing one answer on the model server under a new budget segment (``docs/budget.md``).

A budgeted sub-call turn is granted a *segment*, not its whole cap. When the model stops for
length at the segment's end, the worker reserves the next segment and asks the server to go on
with the same answer: the partial answer is sent back as the last, unfinished assistant message.

* ``continue_final_message`` (vLLM's and SGLang's chat completions): the messages end with
  ``{"role": "assistant", "content": partial}`` and the request carries
  ``continue_final_message: true`` and ``add_generation_prompt: false``; the chat template then
  renders the partial answer without closing it, and the reply's ``content`` is the new text only.
  (vLLM ``ChatCompletionRequest`` / SGLang ``ChatCompletionRequest``, both 2025-2026.)
* ``prefill`` (llama.cpp's server): a last assistant message is taken as the start of the reply.
* ``none``: the server cannot continue; the worker's calls keep whole-cap grants.

The joined turn is what the call returns, is charged (every segment settles its own server count),
is recorded in the trajectory and is counted in metrics. Its trainable record holds the prompt ids of
the first segment and the sampled ids and logprobs of every segment, in order; when a continuation's
prompt ids are not exactly the first prompt followed by every id sampled so far (the server
re-tokenized the boundary), the turn is marked untrainable (``continuation_boundary``).
"""

from __future__ import annotations

from typing import Any, Literal

from rlmq.common.token_wire import ServedTokens
from rlmq.workers.model import ChatResponse

__all__ = ["CONTINUATION_MODES", "Continuation", "continuation_request", "join_segments"]

Continuation = Literal["continue_final_message", "prefill", "none"]
CONTINUATION_MODES: tuple[Continuation, ...] = ("continue_final_message", "prefill", "none")
"""How a worker's model server continues an answer (the setting ``sub_llm_continuation``)."""

BOUNDARY_REASON = "continuation_boundary"
"""Why a continued turn is untrainable: a continuation's prompt ids did not end with the ids sampled so far."""


def continuation_request(
    messages: list[dict[str, Any]], partial: str, sampling: dict[str, Any], mode: Continuation
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra request fields that continue ``partial`` (the answer so far, text).

    Args:
        messages: the turn's conversation (system, user, tool messages ...), without the partial answer.
        partial: the assistant's text so far (every earlier segment's content, joined).
        sampling: the turn's sampling fields; the continuation's are added to a copy.
        mode: ``continue_final_message`` (vLLM, SGLang) or ``prefill`` (llama.cpp).

    Returns:
        ``(messages, sampling)`` for :meth:`rlmq.workers.model.ChatClient.chat`.

    Raises:
        ValueError: ``mode`` is ``none`` (such a server is never asked to continue).
    """
    if mode == "none":
        raise ValueError("this worker's model server cannot continue an answer (sub_llm_continuation=none)")
    out = [*messages, {"role": "assistant", "content": partial}]
    extra = dict(sampling)
    if mode == "continue_final_message":
        extra.update(continue_final_message=True, add_generation_prompt=False)
    return out, extra


def _join_served(first: ChatResponse, nxt: ChatResponse) -> tuple[ServedTokens | None, str | None]:
    """The served tokens of ``first`` followed by ``nxt``'s, or ``(None, reason)``."""
    if first.served is None:
        return None, first.untrainable
    if nxt.served is None:
        return None, nxt.untrainable
    so_far = first.served.prompt_ids + first.served.completion_ids
    if nxt.served.prompt_ids != so_far:
        return None, BOUNDARY_REASON
    return (
        ServedTokens(
            prompt_ids=list(first.served.prompt_ids),
            completion_ids=first.served.completion_ids + nxt.served.completion_ids,
            logprobs=first.served.logprobs + nxt.served.logprobs,
        ),
        None,
    )


def join_segments(first: ChatResponse, nxt: ChatResponse) -> ChatResponse:
    """One turn made of ``first`` (the answer so far) and ``nxt`` (its continuation).

    The content is the two texts joined, the completion tokens their sum, the prompt tokens
    ``first``'s (the turn's prompt), ``finish_reason`` and tool calls ``nxt``'s, and ``usage`` counts
    as reported only when both reported it. Served tokens: see :func:`_join_served`.
    """
    content = (first.content or "") + (nxt.content or "")
    served, reason = _join_served(first, nxt)
    message = {**nxt.message, "role": "assistant", "content": content}
    return ChatResponse(
        content=content,
        tool_calls=nxt.tool_calls,
        finish_reason=nxt.finish_reason,
        prompt_tokens=first.prompt_tokens,
        completion_tokens=first.completion_tokens + nxt.completion_tokens,
        usage_reported=first.usage_reported and nxt.usage_reported,
        message=message,
        served=served,
        untrainable=reason if served is None else None,
    )
