"""A worker's long-lived task that keeps failing stops the worker (never alive doing nothing)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis
from redis.asyncio import Redis

import rlmq.common.supervise as sup
from rlmq.common import keys as K
from rlmq.common.errors import WorkerFailed
from rlmq.common.metrics import Metrics
from rlmq.common.schemas import SubCallOptions
from rlmq.common.settings import load_settings
from rlmq.producer.dispatch import BatchSpec, Dispatcher
from rlmq.scripted.server import ScriptedModelServer
from rlmq.workers.worker import SubLLMWorker
from tests.faults.conftest import await_until

pytestmark = pytest.mark.integration
MODEL = "supervision-test"
QUEUE = K.queue_name_for_model(MODEL)


@pytest.fixture
async def model() -> AsyncIterator[ScriptedModelServer]:
    async with ScriptedModelServer("127.0.0.1", 0) as server:
        yield server


async def test_a_task_that_keeps_failing_stops_the_worker_and_hands_its_jobs_back(
    real_redis: redis.Redis, redis_url: str, model: ScriptedModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sup, "BACKOFF_MAX", 0.2)
    settings = load_settings(redis_url=redis_url, base_url=model.url, model=MODEL)
    w = SubLLMWorker(settings, name="sup-w", metrics=Metrics())
    run = asyncio.create_task(w.run(grace=0.5))
    client = Redis.from_url(redis_url)
    try:
        await await_until(lambda: asyncio.sleep(0, real_redis.exists(K.rq_worker("sup-w"))), 10, "registration")
        spec = BatchSpec(
            rollout_id="sup1",
            batch_id="b1",
            queue=QUEUE,
            sub_call_timeout=60,
            parallelism=4,
            call=SubCallOptions(model=MODEL),
        )
        await Dispatcher(client).enqueue(spec, ["[[mock:sleep:30]] slow one"], [0])
        await await_until(lambda: asyncio.sleep(0, len(w.jobs) == 1), 10, "the job in flight")

        async def broken() -> None:  # a bug in the heartbeat: not a Redis error, not retried as one
            raise RuntimeError("unexpected")

        monkeypatch.setattr(w.upkeep, "heartbeat_once", broken)
        with pytest.raises(WorkerFailed, match="heartbeat task kept failing"):
            await asyncio.wait_for(run, 60)
    finally:
        await client.aclose()
    # It handed its job back (queued again for another worker) and unregistered.
    assert real_redis.lrange(K.rq_queue(QUEUE), 0, -1) == [b"sup1-b1-0"]
    assert real_redis.zcard(K.rq_started(QUEUE)) == 0
    assert not real_redis.sismember(K.RQ_WORKERS, K.rq_worker("sup-w"))  # it registered its death
    assert real_redis.zscore(K.serving(QUEUE), "sup-w") is None
