"""The scripted model's token ids and logprobs: vLLM's fields, served when asked, and recorded.

A request that asks (``return_token_ids: true``, as vLLM >= 0.10.2 takes it, with ``logprobs:
true``) gets ``prompt_token_ids`` (one id per word of its messages' contents: the prompt tokens
``usage`` counts), ``choices[0].token_ids`` (one id per word of the completion: its content, then
its tool calls' arguments) and ``choices[0].logprobs.content[i].logprob`` (one per completion id,
float32-exact, distinct per reply). Directives in a user message change that:

* ``[[mock:token-ids:none]]``: no token field at all (as llama.cpp or OpenAI answer);
* ``[[mock:token-ids:mismatch]]``: one logprob fewer than completion ids;
* ``[[mock:token-ids:usage]]``: one completion id more than ``usage.completion_tokens``;
* ``[[mock:token-ids:sglang]]``: SGLang's shape: ``prompt_token_ids`` on ``choices[0]``, not at
  the top of the reply;
* ``[[mock:continue-boundary]]``: a continuation's last prompt id is not the last id sampled so far
  (a server that re-tokenized the joint of the partial answer: :mod:`rlmq.scripted.continuation`).

Every reply that carried the fields is recorded (:class:`ServedLog`, ``GET /served``): its
``id``, ``user``, role and the three lists, so a test compares what a trajectory holds with what
was served, element by element.
"""

from __future__ import annotations

import collections
import re
import struct
import zlib
from typing import Any

__all__ = ["ServedLog", "served_fields", "word_id"]

_MODE_RE = re.compile(r"\[\[mock:token-ids:(none|mismatch|usage|sglang)\]\]")
SERVED_KEPT = 200_000
"""Served replies :class:`ServedLog` keeps (newest last)."""


def word_id(word: str) -> int:
    """The scripted tokenizer: a word's id, ``100 .. 150_099`` (CRC-32 of its UTF-8, surrogates replaced)."""
    return 100 + zlib.crc32(word.encode("utf-8", "replace")) % 150_000


def _f32(value: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


def _ids(text: str) -> list[int]:
    return [word_id(w) for w in text.split()]


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


class ServedLog:
    """The replies served with token fields, in order (at most :data:`SERVED_KEPT`)."""

    def __init__(self) -> None:
        self.items: collections.deque[dict[str, Any]] = collections.deque(maxlen=SERVED_KEPT)
        self.serial = 0

    def reset(self) -> None:
        """Forget every served reply."""
        self.items.clear()


def served_fields(
    log: ServedLog, body: dict[str, Any], result: dict[str, Any], messages: list[dict[str, Any]], role: str
) -> None:
    """Add vLLM's token fields to ``result`` (a chat completion about to be sent) when ``body`` asked,
    as the directives in the user messages say, and record what was served in ``log``."""
    if body.get("return_token_ids") is not True:
        return
    users = " ".join(_content(m) for m in messages if m.get("role") == "user")
    match = _MODE_RE.search(users)
    mode = match.group(1) if match else "vllm"
    if mode == "none":
        return
    choice = result["choices"][0]
    message = choice["message"]
    prompt = [i for m in messages for i in _ids(_content(m))]
    if "[[mock:continue-boundary]]" in users and messages[-1].get("role") == "assistant" and prompt:
        prompt[-1] = word_id(f"re-tokenized {prompt[-1]}")  # a joint the server tokenized otherwise
    completion = _ids(message.get("content") or "")
    for call in message.get("tool_calls") or []:
        completion += _ids(str(call["function"]["arguments"]))
    log.serial += 1
    n = log.serial
    logprobs = [_f32(-((n * 7919 + i * 104_729) % 100_000) / 10_000.0 - 1e-3) for i in range(len(completion))]
    if mode == "usage":
        completion = [*completion, word_id("</s>")]
        logprobs = [*logprobs, -0.5]
    if mode == "mismatch" and logprobs:
        logprobs = logprobs[:-1]
    (choice if mode == "sglang" else result)["prompt_token_ids"] = prompt
    choice["token_ids"] = completion
    choice["logprobs"] = {
        "content": [{"token": f"t{i}", "logprob": lp, "bytes": None} for i, lp in enumerate(logprobs)]
    }
    log.items.append({
        "id": result["id"], "user": body.get("user"), "role": role, "prompt_token_ids": prompt,
        "completion_token_ids": completion, "completion_logprobs": logprobs,
    })  # fmt: skip
