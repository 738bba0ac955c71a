"""Hosted tools on a real Redis, worker side against the rollout's server: answers, the one-line
errors (producer gone, too large, unknown tool, the tool's own), each id run once."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from rlmq.common.connection import async_client
from rlmq.common.keys import RolloutKeys
from rlmq.common.metrics import Metrics
from rlmq.common.tool_wire import ToolCallRequest, request_id
from rlmq.producer.hosted_tools import HostedTools, HostedToolServer
from rlmq.workers.hosted_tools import REQUESTS_TTL_MARGIN, call_hosted

RUNS: list[str] = []


def echo(text: str) -> str:
    """Say it back.

    Args:
        text: what to say.
    """
    RUNS.append(text)
    if text == "boom":
        raise ValueError("no such record")
    return text.upper()


@pytest.fixture
async def served(redis_url: str) -> AsyncIterator[tuple[object, str, HostedToolServer]]:
    redis = async_client(redis_url)
    rid = f"ht-{uuid.uuid4().hex[:8]}"
    tools = HostedTools([(f"{__name__}:echo", echo)], timeout=5.0, max_args_bytes=1024)
    server = HostedToolServer(redis, rid, tools, answer_ttl=60, metrics=Metrics())
    task = asyncio.create_task(server.serve())
    try:
        yield redis, rid, server
    finally:
        server.stop()
        task.cancel()
        # bounded: a cancel the Redis client swallowed (the server read on forever) held this for 600 s
        done, _ = await asyncio.wait({task}, timeout=30)
        await redis.aclose()
        assert done, "the hosted-tool server did not stop within 30 s of its cancellation"


def request(text: str, tool: str = f"{__name__}.echo", index: int = 0) -> ToolCallRequest:
    args = '{"text": "' + text + '"}'
    return ToolCallRequest(id=request_id("job-1", 1, index, "echo", args), tool=tool, arguments=args, wait=10)


async def ask(redis: object, rid: str, req: ToolCallRequest, wait: float = 10) -> str:
    return await call_hosted(redis, rid, req, name="echo", deadline=time.time() + wait)  # type: ignore[arg-type]


async def test_an_answer_and_each_id_run_once(served: tuple[object, str, HostedToolServer]) -> None:
    redis, rid, server = served
    word = uuid.uuid4().hex[:6]
    req = request(word)
    assert await ask(redis, rid, req) == word.upper()
    assert await ask(redis, rid, req) == word.upper()  # asked again: the stored answer
    assert RUNS.count(word) == 1 and server.calls == 1
    assert await redis.xlen(RolloutKeys(rid).tool_requests) == 0  # type: ignore[attr-defined]  # taken, removed
    ttl = await redis.ttl(RolloutKeys(rid).tool_answer(req.id))  # type: ignore[attr-defined]
    assert 0 < ttl <= 60


async def test_errors_are_one_line(served: tuple[object, str, HostedToolServer]) -> None:
    redis, rid, _ = served
    raised = await ask(redis, rid, request("boom", index=1))
    assert raised == "[tool error] echo: ValueError: no such record"
    unknown = await ask(redis, rid, request("x", tool="pkg.other.tool", index=2))
    assert unknown.startswith("[tool error] unknown tool 'pkg.other.tool'")
    large = await ask(redis, rid, request("y" * 2000, index=3))
    assert large.startswith("[tool error] echo: arguments too large (") and "\n" not in large


async def redis_ttl(url: str, key: str) -> int:
    redis = async_client(url)
    try:
        return int(await redis.ttl(key))
    finally:
        await redis.aclose()


async def test_no_rollout_gives_a_producer_gone_line_by_the_deadline(redis_url: str) -> None:
    redis = async_client(redis_url)
    try:
        t0 = time.monotonic()
        rid = f"gone-{uuid.uuid4().hex[:6]}"
        text = await ask(redis, rid, request("z"), wait=1.5)
    finally:
        await redis.aclose()
    assert 1.4 < time.monotonic() - t0 < 4
    ttl = await redis_ttl(redis_url, RolloutKeys(rid).tool_requests)
    assert 0 < ttl <= 10 + REQUESTS_TTL_MARGIN  # a request nobody serves does not stay (its wait: 10 s)
    assert text.startswith("[tool error] echo: no answer from the rollout's process"), text


class Opaque:
    """A parameter type with no JSON schema."""


def takes_an_object(thing: Opaque) -> str:
    """Takes what no model can send."""
    return "x"


def test_a_callable_without_a_tool_schema_is_left_out_not_refused() -> None:
    tools = HostedTools(
        [(f"{__name__}:echo", echo), ("pkg.mod:takes_an_object", takes_an_object)], timeout=1.0, max_args_bytes=1024
    )
    assert [spec.name for spec in tools.specs] == ["echo"]
