"""A cancellation swallowed inside a blocking Redis read: every loop around one still ends.

redis-py 8.2's asyncio client was measured swallowing about 1 in 60-150 cancellations that land
inside a blocking ``XREAD`` (``docs/redis-py-cancel.md``): the read returns as if it had timed
out, and a ``while True`` loop around it reads on. Here the test double of that behaviour
(:func:`swallowing_xread`) swallows every one, so a loop that relies on its cancellation never
ends, every time, and one that checks its own stop ends within a read's block.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from redis.asyncio import Redis

from rlmq.common.connection import async_client
from rlmq.common.keys import RolloutKeys
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.common.tool_wire import ToolCallRequest
from rlmq.producer.env import RLMEnv
from rlmq.producer.hosted_tools import HostedTools, HostedToolServer
from rlmq.scripted.server import ScriptedModelServer
from rlmq.workers.hosted_tools import call_hosted

ROLLOUTS = 200


STALL = 30.0
"""Seconds in which not one more rollout ending means the rest never will (a slow host only
slows them: 200 REPLs start on two busy cores in minutes, and each ending is progress)."""


async def until_no_progress(tasks: list[asyncio.Task[Any]], cap: float = 420.0) -> set[asyncio.Task[Any]]:
    """Wait while ``tasks`` keep ending: the ones still pending after :data:`STALL` seconds in which
    none ended (or after ``cap`` seconds in all)."""
    pending: set[asyncio.Task[Any]] = set(tasks)
    deadline = time.monotonic() + cap
    while pending and time.monotonic() < deadline:
        done, pending = await asyncio.wait(pending, timeout=STALL)
        if not done:
            break
    return pending


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: the key.
    """
    return f"value-of-{key}"


@pytest.fixture
def swallowing_xread(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """``Redis.xread`` (asyncio) swallowing every cancellation that lands in it, as redis-py 8.2
    swallows some: the read returns nothing instead. Yields the count of swallowed ones."""
    original = Redis.xread
    swallowed = [0]

    async def xread(self: Redis, *args: Any, **kwargs: Any) -> Any:
        try:
            return await original(self, *args, **kwargs)
        except asyncio.CancelledError:
            swallowed[0] += 1
            return []

    monkeypatch.setattr(Redis, "xread", xread)
    yield swallowed


async def ends(task: asyncio.Task[Any], seconds: float) -> bool:
    done, _ = await asyncio.wait({task}, timeout=seconds)
    return bool(done)


async def test_a_hosted_tool_server_whose_cancellation_is_swallowed_ends(
    redis_url: str, swallowing_xread: list[int]
) -> None:
    redis = async_client(redis_url)
    tools = HostedTools([(f"{__name__}:lookup", lookup)], timeout=5.0, max_args_bytes=1024)
    server = HostedToolServer(redis, f"swallow-{uuid.uuid4().hex[:6]}", tools, answer_ttl=60)
    try:
        task = asyncio.create_task(server.serve())
        await asyncio.sleep(0.3)  # in its blocking read
        task.cancel()
        assert await ends(task, 5), "the server read on after its cancellation"
        assert swallowing_xread[0] >= 1
    finally:
        task.cancel()
        await redis.aclose()


async def test_a_workers_hosted_call_whose_cancellation_is_swallowed_ends(
    redis_url: str, swallowing_xread: list[int]
) -> None:
    redis = async_client(redis_url)
    request = ToolCallRequest(id="j:1:0:abc", tool="pkg.tool", arguments="{}", wait=60)
    try:
        task = asyncio.create_task(call_hosted(redis, "nobody", request, name="tool", deadline=time.time() + 60))
        await asyncio.sleep(0.3)
        task.cancel()
        assert await ends(task, 5), "the call read on to its deadline after its cancellation"
        assert swallowing_xread[0] >= 1
    finally:
        task.cancel()
        await redis.aclose()
        await asyncio.sleep(0)


@pytest.mark.parametrize("repeat", [1, 2])
async def test_200_short_rollouts_with_a_hosted_tool_all_end(
    redis_url: str, swallowing_xread: list[int], repeat: int
) -> None:
    """200 rollouts with a shared tool at once, each cancelled at a random point of its short
    life (or ending first): every one ends, and no hosted-tool server task is left reading."""
    rng = random.Random(repeat)
    async with ScriptedModelServer() as model:
        settings = load_settings(redis_url=redis_url, base_url=model.url, model="m", concurrency=ROLLOUTS)
        async with RLMEnv(settings=settings, tools=[lookup]) as env:
            ids = [f"swallow-{repeat}-{i}-{uuid.uuid4().hex[:4]}" for i in range(ROLLOUTS)]
            rows = [DatasetRow(id=str(i), question="Hi. [[mock:no-tool]]", context="x") for i in range(ROLLOUTS)]
            tasks = [
                asyncio.create_task(env.rollout(r, model="m", rollout_id=rid)) for r, rid in zip(rows, ids, strict=True)
            ]

            async def cancel_later(task: asyncio.Task[Any]) -> None:
                await asyncio.sleep(rng.uniform(0.0, 1.5))
                task.cancel()

            cancels = [asyncio.create_task(cancel_later(t)) for t in tasks]
            pending = await until_no_progress(tasks)
            await asyncio.gather(*cancels)
            readers = [t for t in asyncio.all_tasks() if t.get_name().startswith("rlmq-hosted-tools-")]
            assert not pending, f"{len(pending)} of {ROLLOUTS} rollouts never ended"
            assert not readers, f"{len(readers)} hosted-tool servers still read"
        redis = async_client(redis_url)
        try:
            left = [rid for rid in ids if await redis.exists(RolloutKeys(rid).tool_requests)]
        finally:
            await redis.aclose()
        assert not left
