"""The scripted model's replies and counters: what one chat completion answers, in words as tokens."""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from rlmq.scripted.answerer import _NONSPACE_RE, answer_from_chunk
from rlmq.scripted.markers import (
    _ROOT_TOOL_RE,
    _TOOL_RE,
    BASH_TOOL_NAME,
    DEFAULT_MAX_TOKENS,
    MODEL_FINGERPRINT,
    NO_TOOL_REPLY,
    ROOT_FOLLOW_UP,
    ROOT_TOOL_NAME,
    _root_calls,
    _root_codes,
)
from rlmq.scripted.recursion import is_needle_prompt, needle_answer, recursion_of, split_parts, split_root_code
from rlmq.scripted.root_script import bash_root_code_for, recursive_root_code_for, root_code_for, root_tool_code
from rlmq.scripted.tokens import ServedLog


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return "\n".join(p for p in parts if isinstance(p, str))
    return ""


def _words(text: str) -> int:
    return len(text.split())


def _truncate(text: str, limit: int) -> str:
    """The first ``limit`` whitespace-separated words of ``text``, spacing kept."""
    end = 0
    for count, match in enumerate(_NONSPACE_RE.finditer(text), start=1):
        end = match.end()
        if count >= limit:
            break
    return text[:end]


@dataclass(slots=True)
class _Reply:
    content: str | None = None
    tool_calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments)


@dataclass(slots=True)
class _Counts:
    requests: int = 0
    completions: int = 0
    faults: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    repeats: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "repeats": self.repeats,
            "completions": self.completions,
            "faults": self.faults,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }


PARAMS_KEPT = 1000
"""Requests whose parameters ``GET /stats`` shows (``params``), newest last."""

CONVERSATIONS_KEPT = 100_000
"""Conversations the server remembers to count a request that repeats one (``repeats``)."""


class _State:
    def __init__(self, latency: float, spend_all: bool) -> None:
        self.latency = latency
        self.spend_all = spend_all
        self.started = time.time()
        self.ids = itertools.count(1)
        self.attempts: dict[str, int] = {}
        self.in_flight = 0
        self.served = ServedLog()
        self.reset()

    def reset(self) -> None:
        self.total = _Counts()
        self.invalid = 0
        self.largest_request_bytes = 0
        self.per_user: dict[str, _Counts] = {}
        self.per_model: dict[str, _Counts] = {}
        self.per_role: dict[str, _Counts] = {"root": _Counts(), "sub": _Counts()}
        self.per_tag: dict[str, _Counts] = {}
        self.system_prompts: list[str] = []
        self.root_requests_by_depth: dict[str, int] = {}
        self.attempts.clear()
        self.conversations: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.served.reset()
        self.params: collections.deque[dict[str, Any]] = collections.deque(maxlen=PARAMS_KEPT)
        self.in_flight_peak = self.in_flight  # the requests still open count towards the new peak
        self.last_request_at: float | None = None
        self.last_answered_at: float | None = None

    def opened(self) -> None:
        """A chat completion request was accepted: it is in flight until :meth:`closed`."""
        self.in_flight += 1
        self.in_flight_peak = max(self.in_flight_peak, self.in_flight)
        self.last_request_at = time.time()

    def closed(self) -> None:
        """An accepted request was answered (or failed, or its client went away)."""
        self.in_flight -= 1
        self.last_answered_at = time.time()

    def counters(self, user: str, model: str, role: str) -> tuple[_Counts, _Counts, _Counts, _Counts]:
        per_user = self.per_user.get(user)
        if per_user is None:
            per_user = self.per_user[user] = _Counts()
        per_model = self.per_model.get(model)
        if per_model is None:
            per_model = self.per_model[model] = _Counts()
        return self.total, per_user, per_model, self.per_role[role]

    def snapshot(self) -> dict[str, Any]:
        return {
            "server": f"{MODEL_FINGERPRINT} (test double)",
            **self.total.as_dict(),
            "invalid_requests": self.invalid,
            "largest_request_bytes": self.largest_request_bytes,
            "per_user": {k: v.as_dict() for k, v in self.per_user.items()},
            "per_model": {k: v.as_dict() for k, v in self.per_model.items()},
            "per_role": {k: v.as_dict() for k, v in self.per_role.items()},
            "per_tag": {k: v.as_dict() for k, v in self.per_tag.items()},
            "root_system_prompts": list(self.system_prompts),
            "root_requests_by_depth": dict(self.root_requests_by_depth),
            "params": list(self.params),
            "in_flight": self.in_flight,
            "in_flight_peak": self.in_flight_peak,
            "last_request_at": self.last_request_at,
            "last_answered_at": self.last_answered_at,
        }

    def is_repeat(self, messages: list[dict[str, Any]], tools: Any) -> bool:
        """True when a request with this conversation and these tools came before (the last
        :data:`CONVERSATIONS_KEPT` conversations): a client sent the same call again."""
        digest = hashlib.sha256(json.dumps([messages, tools], sort_keys=True, default=str).encode()).hexdigest()
        if digest in self.conversations:
            return True
        self.conversations[digest] = None
        if len(self.conversations) > CONVERSATIONS_KEPT:
            self.conversations.popitem(last=False)
        return False

    def record(self, body: dict[str, Any]) -> None:
        """Keep what a request asked for besides its conversation (sampling arguments, ``model``,
        ``max_tokens``, ``user``; its tools as ``tool_names``), the last :data:`PARAMS_KEPT`
        requests, for tests to read."""
        params = {k: v for k, v in body.items() if k not in ("messages", "tools")}
        tools = body.get("tools")
        if isinstance(tools, list):
            names = [t.get("function", {}).get("name") for t in tools if isinstance(t, dict)]
            params["tool_names"] = [n for n in names if isinstance(n, str)]
        self.params.append(params)


_STATE = web.AppKey("rlmq_scripted_model_state", _State)
_JSON = "application/json"


def _error(
    status: int, message: str, *, kind: str = "invalid_request_error", headers: dict[str, str] | None = None
) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return web.Response(status=status, body=json.dumps(body).encode(), content_type=_JSON, headers=headers)


def _limit_of(body: dict[str, Any]) -> int | str:
    """The completion limit in tokens, or an error message."""
    limits: list[int] = []
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{key} must be an integer, got {value!r}"
        if value <= 0:
            return f"{key} must be at least 1, got {value}"
        limits.append(value)
    return min(limits) if limits else DEFAULT_MAX_TOKENS


def _tool_names(tools: Any) -> list[str]:
    names: list[str] = []
    if isinstance(tools, list):
        for tool in tools:
            if isinstance(tool, dict):
                function = tool.get("function")
                if isinstance(function, dict) and isinstance(function.get("name"), str):
                    names.append(function["name"])
    return names


def _root_reply(messages: Sequence[dict[str, Any]], tool: str = ROOT_TOOL_NAME) -> _Reply:
    """The root's reply; ``tool``: the REPL tool offered (``call_bash_repl``: the default code is bash)."""
    first_user = next((_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
    turn = 1 + sum(1 for m in messages if m.get("role") == "assistant")
    if "[[mock:" in first_user:
        if "[[mock:no-tool]]" in first_user:
            return _Reply(content=NO_TOOL_REPLY)
        call = _root_calls(first_user).get(turn)
        if call is not None:
            return _Reply(tool_calls=[call])
        code = _root_codes(first_user).get(turn)
        if code is not None:
            return _Reply(tool_calls=[(tool, json.dumps({"code": code}))])
        named = _ROOT_TOOL_RE.search(first_user)
        if named is not None and turn == 1:
            code = root_tool_code(named.group(1), _ROOT_TOOL_RE.sub("", first_user).strip())
            return _Reply(tool_calls=[(tool, json.dumps({"code": code}))])
        if "[[mock:rlm-split:" in first_user:
            if turn != 1:
                return _Reply(content=ROOT_FOLLOW_UP)
            system = "\n".join(_text(m.get("content")) for m in messages if m.get("role") == "system")
            where = recursion_of(system)
            parts = split_parts(first_user, where.depth) or 1
            code = split_root_code(first_user, parts, recurse=where.recurses)
            return _Reply(tool_calls=[(tool, json.dumps({"code": code}))])
    if turn == 1:
        system = "\n".join(_text(m.get("content")) for m in messages if m.get("role") == "system")
        # rlm_batch starts child rollouts at this depth: the root recurses, as a real RLM may
        recurses = "rlm_batch" in system and recursion_of(system).recurses
        if tool == BASH_TOOL_NAME:
            code = bash_root_code_for(first_user)
        else:
            code = recursive_root_code_for(first_user) if recurses else root_code_for(first_user)
        return _Reply(tool_calls=[(tool, json.dumps({"code": code}))])
    return _Reply(content=ROOT_FOLLOW_UP)


def _sub_reply(messages: Sequence[dict[str, Any]], prompt: str, offers_tools: bool) -> _Reply:
    if "[[mock:" in prompt:
        if offers_tools:
            directives = _TOOL_RE.findall(prompt)
            turn = sum(1 for m in messages if m.get("role") == "assistant")
            if turn < len(directives):
                name, arguments = directives[turn]
                return _Reply(tool_calls=[(name, arguments)])
        content = needle_answer(prompt) if is_needle_prompt(prompt) else answer_from_chunk(prompt)
        if "[[mock:echo-tool-result]]" in prompt:
            results = [_text(m.get("content")) for m in messages if m.get("role") == "tool"]
            content = "\n".join([content, *(f"tool result: {r}" for r in results)])
        return _Reply(content=content)
    return _Reply(content=answer_from_chunk(prompt))


def _completion(state: _State, reply: _Reply, limit: int, spend_all: bool) -> tuple[dict[str, Any], int]:
    """The OpenAI message, finish_reason and completion tokens of ``reply``."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if spend_all:
        message["content"] = " ".join(["tok"] * limit)
        return {"message": message, "finish_reason": "length"}, limit
    used = _words(reply.content or "") + sum(_words(args) for _, args in reply.tool_calls)
    if used > limit:
        text = reply.tool_calls[0][1] if reply.tool_calls else reply.content or ""
        message["content"] = _truncate(text, limit)
        return {"message": message, "finish_reason": "length"}, _words(message["content"])
    if reply.tool_calls:
        message["tool_calls"] = [
            {
                "id": f"call_scripted_{next(state.ids)}",
                "type": "function",
                "function": {"name": n, "arguments": a},
            }
            for n, a in reply.tool_calls
        ]
        return {"message": message, "finish_reason": "tool_calls"}, used
    return {"message": message, "finish_reason": "stop"}, used
