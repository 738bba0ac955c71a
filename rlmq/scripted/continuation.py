"""The scripted model continuing an answer, as vLLM and SGLang do with ``continue_final_message``.

A request whose messages end with an assistant message asks to continue it: with
``continue_final_message: true`` (then ``add_generation_prompt`` must be ``false``, as vLLM
requires: else a 400) or without it when it offers no tools (llama.cpp's assistant prefill; a
request that offers tools and ends with an assistant message is a conversation whose model turn
is next, as rlmq never continues a turn that offers tools). The scripted model answers
the conversation before that message as it always would, and serves the rest of that answer
from where the partial one stops (its content is the new text only, as vLLM's is). The prompt it
counts and serves ids for is the whole conversation, partial answer included: its ids are the
first segment's prompt ids followed by the ids sampled so far, unless a user message carries
``[[mock:continue-boundary]]`` (the last prompt id is then another one, as a server that
re-tokenizes the joint would give: :func:`rlmq.scripted.tokens.served_fields`).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from rlmq.scripted.answerer import _NONSPACE_RE

__all__ = ["BOUNDARY_MARKER", "continued_answer", "rest_of_answer"]

BOUNDARY_MARKER = "[[mock:continue-boundary]]"


def continued_answer(body: dict[str, Any], messages: list[dict[str, Any]]) -> str | None | web.Response:
    """The partial answer a request asks to continue, ``None`` when it asks for a new one, or a 400
    (``continue_final_message`` without a last assistant message, or with ``add_generation_prompt``)."""
    last = messages[-1]
    asks = body.get("continue_final_message") is True
    if asks and body.get("add_generation_prompt") is not False:
        return _bad("continue_final_message and add_generation_prompt cannot both be true")
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return _bad("continue_final_message needs a last assistant message") if asks else None
    if not asks and body.get("tools"):
        return None  # not a prefill: rlmq continues no turn that offers tools
    content = last.get("content")
    return content if isinstance(content, str) else ""


def rest_of_answer(full: str, partial: str) -> str:
    """What follows ``partial`` in ``full`` (the whole answer): the text past it when ``full`` starts
    with it, else past as many words as ``partial`` has; ``""`` when nothing is left."""
    if full.startswith(partial):
        return full[len(partial) :]
    words = len(partial.split())
    for count, match in enumerate(_NONSPACE_RE.finditer(full), start=1):
        if count == words:
            return full[match.end() :]
    return ""


def _bad(message: str) -> web.Response:
    body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
    return web.Response(status=400, body=json.dumps(body).encode(), content_type="application/json")
