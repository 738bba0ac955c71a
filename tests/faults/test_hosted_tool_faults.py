"""A hosted tool's call (a shared callable no worker imports, run in the rollout's process) runs
exactly once per logical call: under kill -9 of the worker that waits for it (the job re-runs on
another worker and gets the stored answer) and under dropped worker connections (requests and
reads sent again)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from rlmq.cli.local import LocalFleet
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv
from rlmq.scripted.server import root_code_directive
from tests.faults.conftest import HEARTBEAT_TTL, start_named_worker
from tests.faults.proxy import FaultProxy

CALLS: Counter[str] = Counter()
STARTED = threading.Event()


def slow_lookup(key: str) -> str:
    """Look a key up slowly (2 s), in the author's own table.

    Args:
        key: the key.
    """
    CALLS[key] += 1
    STARTED.set()
    time.sleep(2.0)
    return f"value-of-{key}"


def batch_code(keys: list[str]) -> str:
    prompts = [f'Find {k}. [[mock:tool:slow_lookup:{{"key": "{k}"}}]] [[mock:echo-tool-result]]' for k in keys]
    return f"""
out = llm_batch({prompts!r})
answer["content"] = " || ".join(out)
answer["ready"] = True
"""


async def rollout(fleet: LocalFleet, redis_url: str, keys: list[str]) -> tuple[list[str], list[dict[str, Any]]]:
    settings = load_settings(redis_url=redis_url, base_url=fleet.base_url, model=fleet.model, sub_call_timeout=60)
    row = DatasetRow(id="hosted-faults", question="Hosted. " + root_code_directive(batch_code(keys)), context="x")
    async with RLMEnv(settings=settings, tools=[slow_lookup]) as env:
        res = await env.rollout(row, model=fleet.model)
    assert res.row.stop_reason == "answer_ready", res.row.error
    batch = next(e for e in res.trajectory if e["type"] == "llm_batch")
    return str(res.row.final_answer).split(" || "), batch["results"]


async def test_kill9_of_the_waiting_worker_runs_the_call_once(fault_fleet: LocalFleet, redis_url: str) -> None:
    STARTED.clear()
    key = f"k9-{uuid.uuid4().hex[:6]}"
    victim, _ = start_named_worker(fault_fleet, "victim")
    task = asyncio.create_task(rollout(fault_fleet, redis_url, [key]))
    assert await asyncio.to_thread(STARTED.wait, 30), "the hosted call never started"
    os.kill(victim.pid, signal.SIGKILL)  # the worker waiting for the answer dies mid-call
    start_named_worker(fault_fleet, "rescuer")
    answers, results = await asyncio.wait_for(task, 60 + HEARTBEAT_TTL)
    assert results[0]["attempt"] == 2, results[0]  # the job ran again, on the rescuer
    assert f"tool result: value-of-{key}" in answers[0], answers
    assert CALLS[key] == 1


@pytest.fixture
def proxied(redis_url: str, tmp_path: Any) -> Iterator[tuple[FaultProxy, LocalFleet]]:
    with (
        FaultProxy(redis_url, seed=7) as proxy,
        LocalFleet(
            redis_url=proxy.url,
            model=f"hosted-drop-{uuid.uuid4().hex[:6]}",
            workers=1,
            worker_args=["--heartbeat-ttl", str(HEARTBEAT_TTL)],
            log_dir=str(tmp_path / "logs"),
        ) as fleet,
    ):
        fleet.wait_for_workers(1, timeout=60)
        yield proxy, fleet


async def test_dropped_worker_connections_run_each_call_once(
    proxied: tuple[FaultProxy, LocalFleet], redis_url: str
) -> None:
    proxy, fleet = proxied
    keys = [f"drop{i}-{uuid.uuid4().hex[:4]}" for i in range(6)]
    proxy.drop_containing = (b":toolreq", b":toolans:")  # the hosted calls' requests and answer reads
    proxy.drop_rate = 0.5
    try:
        answers, _ = await asyncio.wait_for(rollout(fleet, redis_url, keys), 90)
    finally:
        proxy.drop_rate = 0.0
    dropped = proxy.stats.dropped_by_command
    assert dropped.get("XADD", 0) > 0 and dropped.get("XREAD", 0) > 0, dropped  # requests sent and read again
    for key, answer in zip(keys, answers, strict=True):
        assert f"tool result: value-of-{key}" in answer, answer
    assert {k: CALLS[k] for k in keys} == dict.fromkeys(keys, 1)
