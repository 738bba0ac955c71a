"""Parked calls give their worker slot back, and take one again before calling the model.

An in-process :class:`~rlmq.workers.worker.SubLLMWorker` on a real Redis, with a model client double
that counts the calls running at once. Another "worker" (this test) holds the rollout's whole
budget; the worker parks all eight calls of a batch, then the holder releases everything at
once, so all eight are granted together: no more than ``worker_concurrency`` may run.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.keys import queue_name_for_model, rq_queue
from rlmq.common.schemas import SubCallOptions
from rlmq.common.settings import load_settings
from rlmq.producer.dispatch import BatchSpec, Dispatcher
from rlmq.workers.model import ChatResponse
from rlmq.workers.worker import SubLLMWorker

pytestmark = pytest.mark.integration


class CountingModel:
    """A model client double: each call takes 50 ms (a model's latency) and answers in 5 tokens."""

    def __init__(self) -> None:
        self.running = 0
        self.peak = 0
        self.calls = 0

    async def chat(self, **_: Any) -> ChatResponse:
        self.running += 1
        self.calls += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(0.05)  # the double's latency, not synchronisation
            return ChatResponse(
                content="ok",
                tool_calls=[],
                finish_reason="stop",
                prompt_tokens=3,
                completion_tokens=5,
                usage_reported=True,
                message={"role": "assistant", "content": "ok"},
            )
        finally:
            self.running -= 1

    async def close(self) -> None:
        return None


async def hold_budget_and_send(
    redis: Any, model: str, rollout_id: str, n: int
) -> tuple[BudgetLedger, asyncio.Task[Any]]:
    """Open a 1,000-token ledger (cap 100) whose whole budget another "worker" (this test)
    holds in ten reservations ``elsewhere-0..9``, and send a budgeted batch of ``n`` prompts."""
    ledger = BudgetLedger(redis)
    await ledger.open(rollout_id, 1000, cap=100)
    deadline = time.time() + 60
    for i in range(10):
        assert (await ledger.reserve(rollout_id, f"elsewhere-{i}", None, deadline)).tokens == 100
    spec = BatchSpec(
        rollout_id=rollout_id,
        batch_id="b1",
        queue=queue_name_for_model(model),
        sub_call_timeout=60,
        parallelism=n,
        call=SubCallOptions(model=model, budgeted=True),
    )
    batch = asyncio.create_task(Dispatcher(redis).run_batch(spec, [f"Part {i}?" for i in range(n)]))
    return ledger, batch


@pytest.mark.parametrize("concurrency", [1, 2])  # 1: held calls must still pass one by one (no deadlock)
async def test_calls_granted_after_a_wait_stay_within_the_workers_concurrency(redis_url: str, concurrency: int) -> None:
    model = f"resume-{uuid.uuid4().hex[:6]}"
    settings = load_settings(
        redis_url=redis_url,
        model=model,
        worker_concurrency=concurrency,
        sub_llm_budget_max_parked=8,
        heartbeat_interval=0.5,
    )
    double = CountingModel()
    worker = SubLLMWorker(settings, client_factory=lambda: double)  # type: ignore[arg-type,return-value]
    running = asyncio.create_task(worker.run(grace=5))
    redis = async_client(redis_url)
    try:
        rid = f"resume-{uuid.uuid4().hex[:8]}"
        ledger, batch = await hold_budget_and_send(redis, model, rid, 8)
        async with asyncio.timeout(30):
            while getattr(worker, "ledger", None) is None or worker.ledger.parked < 8:
                await asyncio.sleep(0.01)  # polling this process's own counter, bounded by the timeout
        assert double.calls == 0
        for i in range(10):
            await ledger.settle(rid, f"elsewhere-{i}", 0)  # 1,000 free at once: all eight are granted together
        results = await asyncio.wait_for(batch, 30)
    finally:
        worker.request_stop()
        await asyncio.wait_for(running, 30)
        await redis.aclose()
    assert [r.status for r in results] == ["ok"] * 8
    assert all(r.budget_waits >= 1 for r in results)
    assert double.calls == 8
    assert double.peak <= concurrency, f"{double.peak} model calls ran at once on a worker of concurrency {concurrency}"


async def test_a_stopping_worker_hands_its_parked_calls_back_instead_of_running_them(redis_url: str) -> None:
    """Found by a hostile review: after SIGTERM a worker granted its parked budget calls one by
    one and started their model calls inside its grace period. Now a stopping worker's parked
    calls end unrun and their jobs go back to the queue, for the next worker."""
    model = f"abandon-{uuid.uuid4().hex[:6]}"
    settings = load_settings(
        redis_url=redis_url, model=model, worker_concurrency=4, sub_llm_budget_max_parked=8, heartbeat_interval=0.5
    )
    double = CountingModel()
    worker = SubLLMWorker(settings, client_factory=lambda: double)  # type: ignore[arg-type,return-value]
    running = asyncio.create_task(worker.run(grace=20))
    redis = async_client(redis_url)
    queue = queue_name_for_model(model)
    try:
        rid = f"abandon-{uuid.uuid4().hex[:8]}"
        ledger, batch = await hold_budget_and_send(redis, model, rid, 6)
        async with asyncio.timeout(30):
            while getattr(worker, "ledger", None) is None or worker.ledger.parked < 6:
                await asyncio.sleep(0.01)  # polling this process's own counter, bounded by the timeout
        t0 = time.monotonic()
        worker.request_stop()
        for i in range(10):  # the budget comes free while the worker drains: it must not use it
            await ledger.settle(rid, f"elsewhere-{i}", 0)
        await asyncio.wait_for(running, 30)
        stopped_in = time.monotonic() - t0
        queued = await redis.llen(rq_queue(queue))
        batch.cancel()
    finally:
        if not running.done():
            worker.request_stop()
            await asyncio.wait_for(running, 30)
        await redis.aclose()
    assert double.calls == 0, f"a stopping worker started {double.calls} model calls for parked jobs"
    assert queued == 6  # all six handed back, unrun
    assert stopped_in < 20  # it did not sit out its grace period
