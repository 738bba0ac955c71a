"""A rollout's process serving two rollouts' hosted tools (one ``HostedTools``) on a real Redis:
while one rollout has a call running, the other's flood runs one call at a time, each once, and
has its whole cap back once the first is quiet. Counts and orders only; every wait has a deadline."""

from __future__ import annotations

import asyncio
import time
import uuid

from rlmq.common.connection import async_client
from rlmq.common.tool_wire import ToolCallRequest
from rlmq.producer.hosted_tools import HostedTools, HostedToolServer
from rlmq.workers.hosted_tools import call_hosted

STATE: dict[str, int] = {"hog_now": 0, "hog_most_beside": 0, "hog_most": 0, "hog_runs": 0}
VICTIM_IN = asyncio.Event()
VICTIM_GO = asyncio.Event()


async def hold(key: str) -> str:
    """The victim's call: runs until the test lets it end.

    Args:
        key: anything.
    """
    VICTIM_IN.set()
    await asyncio.wait_for(VICTIM_GO.wait(), 30)
    return f"held {key}"


async def work(key: str) -> str:
    """One of the hog's calls: counts how many of them run at once.

    Args:
        key: anything.
    """
    STATE["hog_runs"] += 1
    STATE["hog_now"] += 1
    STATE["hog_most"] = max(STATE["hog_most"], STATE["hog_now"])
    if VICTIM_IN.is_set() and not VICTIM_GO.is_set():
        STATE["hog_most_beside"] = max(STATE["hog_most_beside"], STATE["hog_now"])
    try:
        await asyncio.sleep(0.02)
    finally:
        STATE["hog_now"] -= 1
    return f"work {key}"


def call(redis: object, rid: str, tool: str, key: str) -> asyncio.Task[str]:
    req = ToolCallRequest(id=f"{key}-{uuid.uuid4().hex[:8]}", tool=tool, arguments=f'{{"key": "{key}"}}', wait=30)
    name = tool.rsplit(".", 1)[-1]
    return asyncio.create_task(call_hosted(redis, rid, req, name=name, deadline=time.time() + 30))  # type: ignore[arg-type]


async def test_a_running_call_of_one_rollout_holds_anothers_flood_to_one_call(redis_url: str) -> None:
    global VICTIM_IN, VICTIM_GO
    VICTIM_IN, VICTIM_GO = asyncio.Event(), asyncio.Event()  # of this test's loop
    STATE.update(hog_now=0, hog_most_beside=0, hog_most=0, hog_runs=0)
    producer, worker = async_client(redis_url), async_client(redis_url)
    tools = HostedTools([(f"{__name__}.hold", hold), (f"{__name__}.work", work)], timeout=30, max_args_bytes=1024)
    tools.turns.linger, tools.turns.young = 0.05, 60.0  # no call of the hog's ages past its share
    hog, victim = f"hog-{uuid.uuid4().hex[:6]}", f"victim-{uuid.uuid4().hex[:6]}"
    servers = [HostedToolServer(producer, rid, tools, answer_ttl=60) for rid in (hog, victim)]
    serving = [asyncio.create_task(s.serve()) for s in servers]
    calls: list[asyncio.Task[str]] = []
    try:
        held = call(worker, victim, f"{__name__}.hold", "v")
        calls.append(held)
        await asyncio.wait_for(VICTIM_IN.wait(), 20)
        flood = [call(worker, hog, f"{__name__}.work", f"h{i}") for i in range(60)]
        calls += flood
        done, _ = await asyncio.wait(flood, timeout=60)
        assert len(done) == 60, "the hog was starved beside the victim's running call"
        assert [t.result() for t in flood] == [f"work h{i}" for i in range(60)]
        assert STATE["hog_runs"] == 60  # each once
        assert STATE["hog_most_beside"] == 1, STATE  # one at a time while the victim's call runs
        VICTIM_GO.set()
        assert await asyncio.wait_for(held, 20) == "held v"
        await asyncio.sleep(0.2)  # the victim is quiet past its linger
        STATE["hog_most"] = 0
        again = [call(worker, hog, f"{__name__}.work", f"g{i}") for i in range(60)]
        calls += again
        done, _ = await asyncio.wait(again, timeout=60)
        assert len(done) == 60
        assert STATE["hog_most"] > 1, STATE  # alone, the hog runs many at once again
        assert servers[0].calls == 120 and servers[1].calls == 1
    finally:
        for s in servers:
            s.stop()
        for t in [*calls, *serving]:
            t.cancel()
        finished, _ = await asyncio.wait({*calls, *serving}, timeout=30)
        await producer.aclose()
        await worker.aclose()
        assert len(finished) == len(calls) + len(serving), "the servers did not stop within 30 s"
