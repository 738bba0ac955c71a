"""The worker's model client over an in-memory transport: retries, statuses and faults, no HTTP server.

The transport answers from a script: replies (any status, headers, body), a connection that
breaks (``ConnectionError``), a reply that never comes (``TimeoutError``), a request that
cannot be sent (``ModelError``). Everything above the transport is the production code.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import pytest

from rlmq.common.errors import ConfigError, ModelError
from rlmq.workers.model import ChatClient, HttpReply

Step = HttpReply | BaseException


def completion(content: str, *, tokens: int | None = None, finish: str = "stop") -> HttpReply:
    body: dict[str, Any] = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}]
    }
    if tokens is not None:
        body["usage"] = {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}
    return HttpReply(200, {"Content-Type": "application/json"}, json.dumps(body).encode())


def status(code: int, body: str = "", headers: Mapping[str, str] | None = None) -> HttpReply:
    return HttpReply(code, dict(headers or {}), body.encode())


class ScriptedTransport:
    """A :class:`~rlmq.workers.model.Transport` that answers from ``script`` (then ``default``)."""

    def __init__(self, *script: Step, default: Step | None = None) -> None:
        self.script = list(script)
        self.default = default
        self.requests: list[dict[str, Any]] = []
        self.timeouts: list[float] = []
        self.arrivals: list[float] = []
        self.closed = 0

    async def post(self, url: str, data: bytes, *, headers: Mapping[str, str], timeout: float) -> HttpReply:
        self.requests.append({"url": url, "body": json.loads(data), "headers": dict(headers)})
        self.timeouts.append(timeout)
        self.arrivals.append(time.monotonic())
        step = self.script.pop(0) if self.script else self.default
        assert step is not None, "the transport's script ran out"
        if isinstance(step, BaseException):
            raise step
        return step

    async def close(self) -> None:
        self.closed += 1


def client(transport: ScriptedTransport, **kw: Any) -> ChatClient:
    kw.setdefault("retries", 2)
    kw.setdefault("backoff_base", 0.001)
    kw.setdefault("backoff_max", 0.05)
    return ChatClient("http://model.test/v1/", "sk-seam", transport=transport, **kw)


async def test_the_request_the_transport_sees() -> None:
    t = ScriptedTransport(completion("hello", tokens=2))
    async with client(t, timeout=30.0) as c:
        r = await c.chat(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=7, user="r1")
    assert (r.content, r.completion_tokens, r.usage_reported) == ("hello", 2, True)
    [req] = t.requests
    assert req["url"] == "http://model.test/v1/chat/completions"
    assert req["body"] == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "user": "r1"}
    assert req["headers"]["Authorization"] == "Bearer sk-seam"
    assert t.timeouts == [30.0]
    assert t.closed == 1  # the client closes its transport


async def test_broken_connections_and_5xx_are_retried_then_answered() -> None:
    t = ScriptedTransport(ConnectionError("reset by peer"), status(503, "busy"), completion("third time", tokens=2))
    async with client(t) as c:
        r = await c.chat(model="m", messages=[])
    assert r.content == "third time" and c.attempts == 3


async def test_retry_after_is_waited_for() -> None:
    t = ScriptedTransport(status(429, headers={"Retry-After": "0.2"}), completion("ok", tokens=1))
    async with client(t, backoff_max=5.0) as c:
        await c.chat(model="m", messages=[])
    assert t.arrivals[1] - t.arrivals[0] >= 0.19  # Retry-After, not the 1 ms backoff


async def test_giving_up_names_the_last_failure() -> None:
    t = ScriptedTransport(default=TimeoutError())
    async with client(t, retries=1, timeout=0.5) as c:
        with pytest.raises(ModelError) as info:
            await c.chat(model="m", messages=[])
    assert info.value.status is None
    assert str(info.value) == "model call timed out after 0.5 s after 2 attempts"


async def test_client_errors_and_unsendable_requests_are_not_retried() -> None:
    t = ScriptedTransport(status(400, '{"error": "bad max_tokens"}'))
    async with client(t) as c:
        with pytest.raises(ModelError) as info:
            await c.chat(model="m", messages=[])
    assert info.value.status == 400 and "bad max_tokens" in str(info.value) and c.attempts == 1
    t = ScriptedTransport(ModelError("request to the model server failed (InvalidURL: x)"))
    async with client(t) as c:
        with pytest.raises(ModelError, match="InvalidURL") as info:
            await c.chat(model="m", messages=[])
    assert c.attempts == 1


async def test_malformed_bodies_are_retried() -> None:
    t = ScriptedTransport(HttpReply(200, {}, b"{not json"), HttpReply(200, {}, b'{"choices": []}'), completion("fine"))
    async with client(t) as c:
        r = await c.chat(model="m", messages=[{"role": "user", "content": "x"}])
    assert r.content == "fine" and c.attempts == 3
    assert not r.usage_reported and r.completion_tokens >= 1  # estimated when the server sends no usage


async def test_the_deadline_bounds_the_transport_timeout() -> None:
    t = ScriptedTransport(completion("quick"))
    async with client(t, timeout=120.0) as c:
        await c.chat(model="m", messages=[], deadline=time.time() + 2.0)
    assert 0 < t.timeouts[0] <= 2.0


def test_negative_retries_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        ChatClient("http://model.test/v1", retries=-1, transport=ScriptedTransport())
