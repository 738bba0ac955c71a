"""Shared tools that misbehave: one that raises with a 52 MB message, one that hangs, one rollout
that floods its tool stream. What a tool answers is bounded before it travels, and one rollout's
flood or hang costs another rollout nothing.

The tools live in this test module and no worker allow-lists them: every call travels through
Redis to the rollout's process (this one), as :mod:`rlmq.producer.hosted_tools` serves it.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from rlmq.cli.local import LocalFleet
from rlmq.cli.report import write_run
from rlmq.common.connection import async_client
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.common.tool_wire import CALLS_PER_ROLLOUT, ToolCallRequest
from rlmq.producer.env import RLMEnv
from rlmq.producer.hosted_tools import HostedTools, HostedToolServer
from rlmq.scripted.server import root_code_directive
from rlmq.workers.hosted_tools import RolloutSlots, call_hosted
from tests.faults.conftest import model_stats

HUGE = 52_000_000
"""Characters of the message the failing tool raises with."""


def shout(key: str) -> str:
    """Fail loudly.

    Args:
        key: anything; the tool raises with a 52 MB message whatever it is.
    """
    raise ValueError(key + "x" * HUGE)


def slow(key: str) -> str:
    """Answer after 1 s (a sync tool, in a thread of its own).

    Args:
        key: anything.
    """
    time.sleep(1.0)
    return f"slow {key}"


def quick(key: str) -> str:
    """Answer at once.

    Args:
        key: anything.
    """
    return f"quick {key}"


@pytest.fixture(scope="module")
def tool_fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    logs = tmp_path_factory.mktemp("tool-flood-logs")
    with LocalFleet(
        redis_url=redis_url, model=f"flood-{uuid.uuid4().hex[:6]}", workers=1, log_dir=str(logs)
    ) as fleet:  # fmt: skip
        fleet.wait_for_workers(1)
        yield fleet


async def test_a_tool_raising_a_52_mb_message_is_cut_before_it_travels(tool_fleet: LocalFleet, tmp_path: Path) -> None:
    fleet = tool_fleet
    settings = load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model)
    prompt = 'Shout. [[mock:tool:shout:{"key": "k"}]] [[mock:echo-tool-result]]'
    code = f"out = llm_batch([{prompt!r}])\nanswer['content'] = out[0]\nanswer['ready'] = True\n"
    rid = f"shout-{uuid.uuid4().hex[:8]}"
    row = DatasetRow(id="shout", question="Shout. " + root_code_directive(code), context="x")
    async with RLMEnv(settings=settings, tools=[shout], include_sub_llm_in_trajectory=True) as env:
        res = await env.rollout(row, model=fleet.model, rollout_id=rid)
    assert res.row.stop_reason == "answer_ready", res.row.error
    answer = str(res.row.final_answer)
    assert "[tool error] shout: ValueError: kxxx" in answer and "[tool output truncated: " in answer, answer[:300]
    limit = settings.sub_tool_max_result_chars
    assert len(answer) < limit + 1000
    assert model_stats(str(fleet.base_url))["largest_request_bytes"] < limit + 20_000  # the next model request
    r = redis.Redis.from_url(str(fleet.redis_url))
    try:
        sizes = {k: r.memory_usage(k) or 0 for k in r.scan_iter(f"*{rid}*")}
    finally:
        r.close()
    assert sizes and max(sizes.values()) < limit + 20_000, sizes  # the answer stream, kept rollout_key_ttl
    folder = write_run(tmp_path / "run", [res], {"command": "test"})
    assert (folder / "trajectories.jsonl").stat().st_size < 10 * limit


FLOOD = 2000
"""Hosted-tool calls the flooding rollout makes at once."""


async def victim_latency(redis: object, rid: str, slots: RolloutSlots, n: int = 7) -> float:
    """Median seconds of ``n`` round trips of the victim rollout's ``quick`` calls."""
    times: list[float] = []
    for i in range(n):
        req = ToolCallRequest(
            id=f"v:{uuid.uuid4().hex[:8]}:{i}", tool=f"{__name__}.quick", arguments='{"key": "v"}', wait=30
        )
        t0 = time.monotonic()
        text = await call_hosted(redis, rid, req, name="quick", deadline=time.time() + 30, slots=slots)  # type: ignore[arg-type]
        times.append(time.monotonic() - t0)
        assert text == "quick v", text
    return statistics.median(times)


async def test_one_rollouts_tool_flood_costs_another_rollout_nothing(redis_url: str) -> None:
    """2,000 calls of a 1-s sync tool from one rollout at once, through a worker whose pool has
    64 connections: the other rollout's round trip is not queued behind the flood (it ends in well
    under one of the hog's 1-s calls), and the pool is never exhausted."""
    producer, worker = async_client(redis_url), async_client(redis_url, max_connections=64)
    tools = HostedTools([(f"{__name__}.slow", slow), (f"{__name__}.quick", quick)], timeout=30, max_args_bytes=1024)
    hog, victim = f"hog-{uuid.uuid4().hex[:6]}", f"victim-{uuid.uuid4().hex[:6]}"
    hog_server = HostedToolServer(producer, hog, tools, answer_ttl=60)
    victim_server = HostedToolServer(producer, victim, tools, answer_ttl=60)
    servers = [asyncio.create_task(x.serve()) for x in (hog_server, victim_server)]
    slots = RolloutSlots()
    flood: list[asyncio.Task[str]] = []
    try:
        alone = await victim_latency(worker, victim, slots)
        for i in range(FLOOD):
            req = ToolCallRequest(id=f"h:{i}", tool=f"{__name__}.slow", arguments=f'{{"key": "{i}"}}', wait=60)
            coro = call_hosted(worker, hog, req, name="slow", deadline=time.time() + 60, slots=slots)
            flood.append(asyncio.create_task(coro))
        t0 = time.monotonic()
        while hog_server.calls < 16:  # the flood under way: its calls run in this process
            assert time.monotonic() - t0 < 20, "the flood never reached the rollout's process"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        in_use = len(worker.connection_pool._in_use_connections)  # type: ignore[attr-defined]
        assert in_use <= CALLS_PER_ROLLOUT + 2, in_use  # the hog holds its own slots' connections, no more
        under = await victim_latency(worker, victim, slots)
        # Not queued behind the flood: each of the hog's calls takes 1 s, and the victim's round trip
        # ends in well under one of them (before: 4.9 s and 17.3 s). Ratios to its latency alone are
        # the bench's to measure: on a loaded host they swing with scheduling (1.2x to 5.8x seen).
        assert under < 0.5, (alone, under)
        await asyncio.wait(flood[:16], timeout=10)  # the hog is served too, its calls in turn
        assert all(t.done() and t.result() == f"slow {i}" for i, t in enumerate(flood[:16]))
    finally:
        for t in [*flood, *servers]:
            t.cancel()
        await asyncio.gather(*flood, *servers, return_exceptions=True)
        await producer.aclose()
        await worker.aclose()
