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


async def test_results_redis_keeps_refusing_are_left_to_the_reaper(
    real_redis: redis.Redis,
    redis_url: str,
    model: ScriptedModelServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every write refused (-READONLY) for longer than FLUSH_GIVE_UP: the worker lets go of
    the finished job (stops heartbeating it), its reaper re-queues it once writes pass again,
    and the re-run's result reaches the producer: slower, not lost."""
    import rlmq.workers.worker as worker_mod
    from tests.faults.proxy import FaultProxy

    monkeypatch.setattr(worker_mod, "FLUSH_GIVE_UP", 1.0)
    with FaultProxy(redis_url) as proxy:
        settings = load_settings(redis_url=proxy.url, base_url=model.url, model=MODEL, job_heartbeat_ttl=2)
        w = SubLLMWorker(settings, name="giveup-w", metrics=Metrics())
        run = asyncio.create_task(w.run(grace=1))
        client = Redis.from_url(redis_url)
        try:
            await await_until(lambda: asyncio.sleep(0, real_redis.exists(K.rq_worker("giveup-w"))), 10, "registration")
            spec = BatchSpec(
                rollout_id="gu1",
                batch_id="b1",
                queue=QUEUE,
                sub_call_timeout=60,
                parallelism=4,
                call=SubCallOptions(model=MODEL),
            )
            batch = asyncio.create_task(Dispatcher(client).run_batch(spec, ["[[mock:sleep:0.5]] who keeps the key?"]))
            # the model call under way (past the ledger's check, which a refusal would only delay):
            # the writes it needs to finish are the ones refused
            await await_until(lambda: asyncio.sleep(0, model.stats["in_flight"] == 1), 10, "the model call")
            proxy.refuse_writes(4.0)
            results = await asyncio.wait_for(batch, 60)
        finally:
            w.request_stop()
            await asyncio.wait_for(run, 30)
            await client.aclose()
    assert results[0].status == "ok" and results[0].attempt == 2, results[0]
    assert proxy.stats.refused > 0
    assert "letting the reaper re-queue them" in caplog.text
