"""The scripted model's token ids, logprobs and weight versions, served when asked, and recorded.

It answers in the shape of the server it plays (``token_shape`` of the server, ``rlmq mock-llm
--token-shape``; a directive in a user message overrides it for one reply), each as that server's
current release writes it (:mod:`rlmq.common.token_servers`):

* ``vllm`` (default): asked with ``return_token_ids: true``, it answers ``prompt_token_ids`` at the
  top of the reply and ``choices[0].token_ids``; asked with ``return_weight_versions: true`` too,
  ``choices[0].weight_versions`` (``[{"version", "start", "end"}]``);
* ``sglang``: SGLang 0.5.23's chat shape: asked with ``return_token_ids`` (or
  ``return_prompt_token_ids`` for the prompt alone), it answers ``choices[0].prompt_token_ids``
  and ``choices[0].response_token_ids``, and ``metadata.weight_version`` at the top, as SGLang does.

The ids: one per word of the messages' contents (the prompt tokens ``usage`` counts), one per word
of the completion (its content, then its tool calls' arguments); the logprobs at
``choices[0].logprobs.content[i].logprob``, one per completion id, float32-exact, distinct per
reply. Its weights carry a label (``step-0`` at start; ``POST /update_weight_version`` with
``{"new_version": label}`` sets another, as vLLM's dev endpoint does). Directives in a user message:

* ``[[mock:token-ids:none]]``: no token field at all (as llama.cpp or OpenAI answer);
* ``[[mock:token-ids:mismatch]]``: one logprob fewer than completion ids;
* ``[[mock:token-ids:usage]]``: one completion id more than ``usage.completion_tokens``;
* ``[[mock:token-ids:sglang]]`` / ``[[mock:token-ids:vllm]]``: that server's shape for this reply;
* ``[[mock:token-ids:vllm-no-weight-versions]]``: a vLLM that answers ids but has no weight versions
  (it ignores ``return_weight_versions``);
* ``[[mock:token-ids:sglang-token-ids]]``: the shape of an SGLang release from before its chat choice
  answered ``response_token_ids``: ``choices[0].prompt_token_ids`` and ``choices[0].token_ids``;
* ``[[mock:weight-update:K]]``: the weights are updated after the reply's first ``K`` completion
  tokens: its tokens span two versions (``[0, K)`` the old label, ``[K, n)`` the next one: the
  trailing number of the label plus one), and later replies carry the next label;
* ``[[mock:token-ids:nan]]``, ``[[mock:token-ids:inf]]``, ``[[mock:token-ids:-inf]]``,
  ``[[mock:token-ids:positive]]``: a lying server (vLLM's shape): its last logprob is ``NaN``,
  ``+inf``, ``-inf`` or ``0.5`` (the JSON body then holds ``NaN`` / ``Infinity`` as Python writes them);
* ``[[mock:token-ids:flood-<n>]]``: a flooding server (vLLM's shape): ``n`` completion ids (and
  logprobs), its ``usage`` saying ``n`` too, whatever ``max_tokens`` was (the served count
  :func:`served_fields` returns);
* ``[[mock:continue-boundary]]``: a continuation's last prompt id is not the last id sampled so far
  (a server that re-tokenized the joint of the partial answer: :mod:`rlmq.scripted.continuation`).

Every reply that carried token fields is recorded (:class:`ServedLog`, ``GET /served``): its
``id``, ``user``, role, the three lists and its ``weight_versions``, so a test compares what a
trajectory holds with what was served, element by element.
"""

from __future__ import annotations

import collections
import math
import re
import struct
import zlib
from typing import Any

__all__ = ["TOKEN_SHAPES", "ServedLog", "next_label", "served_fields", "word_id"]

_MODES = r"none|mismatch|usage|sglang-token-ids|sglang|vllm-no-weight-versions|vllm|nan|inf|-inf|positive|flood-\d{1,8}"
_MODE_RE = re.compile(rf"\[\[mock:token-ids:({_MODES})\]\]")
_UPDATE_RE = re.compile(r"\[\[mock:weight-update:(\d{1,6})\]\]")
_LIES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "positive": 0.5}
TOKEN_SHAPES = ("vllm", "sglang")
"""The servers whose token fields the scripted model answers in."""
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


def next_label(label: str) -> str:
    """The weight-version label after ``label``: its trailing number plus one (``step-7`` -> ``step-8``),
    or ``-1`` appended when it ends in no number."""
    match = re.search(r"(\d+)$", label)
    if match is None:
        return f"{label}-1"
    return label[: match.start()] + str(int(match.group(1)) + 1)


class ServedLog:
    """The replies served with token fields, in order (at most :data:`SERVED_KEPT`), the shape the
    server answers in and the label of its weights."""

    def __init__(self, shape: str = "vllm") -> None:
        if shape not in TOKEN_SHAPES:
            raise ValueError(f"token shape must be one of {', '.join(TOKEN_SHAPES)}, not {shape!r}")
        self.items: collections.deque[dict[str, Any]] = collections.deque(maxlen=SERVED_KEPT)
        self.serial = 0
        self.shape = shape
        self.weight_version = "step-0"

    def reset(self) -> None:
        """Forget every served reply."""
        self.items.clear()


def _asked(body: dict[str, Any], mode: str) -> bool:
    if mode in ("sglang", "sglang-token-ids"):
        return body.get("return_token_ids") is True or body.get("return_prompt_token_ids") is True
    return body.get("return_token_ids") is True


def _versions(log: ServedLog, users: str, length: int) -> list[dict[str, Any]]:
    """The weight-version spans of a reply of ``length`` completion tokens, the weights updated
    mid-reply when a ``[[mock:weight-update:K]]`` directive says so (the label moves on)."""
    old = log.weight_version
    match = _UPDATE_RE.search(users)
    if match is None:
        return [{"version": old, "start": 0, "end": length}] if length else []
    cut = min(int(match.group(1)), length)
    log.weight_version = new = next_label(old)
    spans: list[dict[str, Any]] = [
        {"version": old, "start": 0, "end": cut}, {"version": new, "start": cut, "end": length}
    ]  # fmt: skip
    return [sp for sp in spans if sp["end"] > sp["start"]]


def served_fields(
    log: ServedLog, body: dict[str, Any], result: dict[str, Any], messages: list[dict[str, Any]], role: str
) -> int | None:
    """Add the token fields of the server it plays to ``result`` (a chat completion about to be sent)
    when ``body`` asked, as the directives in the user messages say, and record what was served in ``log``.
    Returns the completion ids served when a flood directive made them more than the reply's text,
    else ``None``."""
    users = " ".join(_content(m) for m in messages if m.get("role") == "user")
    match = _MODE_RE.search(users)
    mode = match.group(1) if match else log.shape
    sglang = mode in ("sglang", "sglang-token-ids") or (mode in ("none", "mismatch", "usage") and log.shape == "sglang")
    if sglang:
        result["metadata"] = {"weight_version": log.weight_version}
    if mode == "none" or not _asked(body, "sglang" if sglang else mode):
        return None
    if mode.startswith("flood-"):
        return _flood(log, result, messages, body.get("user"), int(mode.removeprefix("flood-")))
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
    if mode in _LIES and logprobs:
        logprobs[-1] = _LIES[mode]
    record: dict[str, Any] = {"id": result["id"], "user": body.get("user"), "role": role, "shape": mode}
    if sglang:
        choice["prompt_token_ids"] = prompt
        if body.get("return_token_ids") is True:
            choice["token_ids" if mode == "sglang-token-ids" else "response_token_ids"] = completion
    else:
        result["prompt_token_ids"] = prompt
        choice["token_ids"] = completion
        if body.get("return_weight_versions") is True and mode != "vllm-no-weight-versions":
            choice["weight_versions"] = record["weight_versions"] = _versions(log, users, len(completion))
    if body.get("logprobs") is True or not sglang:
        choice["logprobs"] = {
            "content": [{"token": f"t{i}", "logprob": lp, "bytes": None} for i, lp in enumerate(logprobs)]
        }
    log.items.append({
        **record, "prompt_token_ids": prompt, "completion_token_ids": completion, "completion_logprobs": logprobs,
    })  # fmt: skip
    return None


def _flood(log: ServedLog, result: dict[str, Any], messages: list[dict[str, Any]], user: Any, n: int) -> int:
    """``n`` completion ids and logprobs in ``result`` (compact items, vLLM's shape); logged without its lists."""
    choice = result["choices"][0]
    result["prompt_token_ids"] = [i for m in messages for i in _ids(_content(m))]
    choice["token_ids"] = [100 + i % 150_000 for i in range(n)]
    choice["logprobs"] = {"content": [{"logprob": -0.5}] * n}
    log.serial += 1
    log.items.append({"id": result["id"], "user": user, "role": "sub", "flood": n})
    return n
