"""The lane: a small batch goes to the most recently idle worker, whose calls start before START answers.

In-process workers on a real Redis, the scripted model (a test double) in-process too. The
races the lane must survive are set up, not waited for: a rival takes the job with ``START``
(as a busy worker peeking the queue would) while the idle worker's own ``START`` is held.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
from redis.asyncio import Redis
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from common import keys as K
from common.ledger import BudgetLedger
from common.metrics import Metrics
from common.settings import load_settings
from producer.dispatch import LANE_MAX_JOBS, BatchSpec, Dispatcher
from producer.mock_llm import MockLLMServer
from tests.faults.conftest import await_until
from workers.records import Records, StartedJob
from workers.worker import SubLLMWorker

pytestmark = pytest.mark.integration
MODEL = "lane-test"
QUEUE = K.queue_name_for_model(MODEL)


@pytest.fixture
async def model() -> AsyncIterator[MockLLMServer]:
    async with MockLLMServer("127.0.0.1", 0) as server:
        yield server


@pytest.fixture
async def aredis(real_redis: redis.Redis, redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


def make_worker(redis_url: str, model: MockLLMServer, name: str, **kw: object) -> SubLLMWorker:
    settings = load_settings(redis_url=redis_url, base_url=model.url, model=MODEL, **kw)
    return SubLLMWorker(settings, name=name, metrics=Metrics())


@contextlib.asynccontextmanager
async def running(*workers: SubLLMWorker) -> AsyncIterator[None]:
    tasks = [asyncio.create_task(w.run(grace=5)) for w in workers]
    try:
        yield
    finally:
        for w in workers:
            w.request_stop()
        await asyncio.gather(*tasks)


def lane_jobs(w: SubLLMWorker, outcome: str) -> float:
    value = w.metrics.registry.get_sample_value("rlmq_lane_jobs_total", {"outcome": outcome})
    return value or 0.0


def idle_names(sync: redis.Redis) -> list[str]:
    return [n.decode() for n in sync.lrange(K.idle_workers(QUEUE), 0, -1)]


async def until_idle(sync: redis.Redis, *names: str) -> None:
    await await_until(lambda: asyncio.to_thread(lambda: set(names) <= set(idle_names(sync))), 30, f"{names} idle")


@contextlib.contextmanager
def held_start(monkeypatch: pytest.MonkeyPatch, worker: SubLLMWorker) -> Iterator[asyncio.Event]:
    """Hold ``worker``'s START calls until the returned event is set."""
    release = asyncio.Event()
    real_start = Records.start

    async def start(self: Records, job_ids: list[bytes]) -> list[StartedJob]:
        if self.worker_name == worker.name:
            await release.wait()
        return await real_start(self, job_ids)

    monkeypatch.setattr(Records, "start", start)
    yield release


def spec(rollout: str, **kw: object) -> BatchSpec:
    base: dict[str, object] = dict(
        rollout_id=rollout, batch_id="b1", model=MODEL, queue=QUEUE, timeout=30.0, parallelism=8
    )
    base.update(kw)
    return BatchSpec(**base)  # type: ignore[arg-type]


async def test_a_small_batch_goes_to_one_idle_worker_and_its_call_starts_early(
    real_redis: redis.Redis, aredis: Redis, redis_url: str, model: MockLLMServer
) -> None:
    a = make_worker(redis_url, model, "lane-a")
    b = make_worker(redis_url, model, "lane-b")
    dispatcher = Dispatcher(aredis)
    async with running(a, b):
        await until_idle(real_redis, "lane-a", "lane-b")
        first = idle_names(real_redis)[0]  # the most recently idle
        results = await dispatcher.run_batch(spec("lane1"), ["Who keeps the key? The key is kept by Ada."])
        # its name went back first on the idle list with its FINISH, before the result came
        assert idle_names(real_redis)[0] == first
        again = await dispatcher.run_batch(spec("lane1", batch_id="b2"), ["Who keeps the key? Ada."])
    assert results[0].status == "ok" and again[0].status == "ok", (results, again)
    # one worker, the most recently idle, took both, from the lane, calling the model once each
    assert results[0].worker == again[0].worker == first
    assert sorted(lane_jobs(w, "early") for w in (a, b)) == [0.0, 2.0]
    assert lane_jobs(a, "lost") + lane_jobs(b, "lost") == 0
    assert model.stats["requests"] == 2
    job = Job.fetch(results[0].job_id, connection=real_redis, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.FINISHED
    assert job.worker_name == first


async def test_an_early_call_is_cancelled_when_another_worker_took_the_job(
    real_redis: redis.Redis, aredis: Redis, redis_url: str, model: MockLLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = make_worker(redis_url, model, "lane-late")
    async with running(w):
        await until_idle(real_redis, "lane-late")
        with held_start(monkeypatch, w) as release:
            await Dispatcher(aredis).enqueue(spec("lane2"), ["[[mock:sleep:30]] Who keeps the key? Ada does."], [0])
            await await_until(lambda: asyncio.sleep(0, bool(w._tasks)), 30, "the early call")
            rival = await Records(aredis, QUEUE, "rival").start([b"lane2-b1-0"])
            assert [j.job_id for j in rival] == ["lane2-b1-0"]
            release.set()
            await await_until(lambda: asyncio.sleep(0, lane_jobs(w, "lost") == 1), 30, "the lost race")
        # The early call (its model answer is 30 s away) ends now: cancelled, not drained.
        await await_until(lambda: asyncio.sleep(0, not w._tasks), 10, "the early call to be cancelled")
        assert not w._inflight
    assert lane_jobs(w, "early") == 0
    assert model.stats["completions"] == 0  # the early call was cancelled, not answered
    assert real_redis.llen(K.RolloutKeys("lane2").reply("b1")) == 0  # nothing delivered by the loser
    job = Job.fetch("lane2-b1-0", connection=real_redis, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.STARTED and job.worker_name == "rival"


async def test_a_budgeted_call_never_reaches_the_model_before_start(
    real_redis: redis.Redis, aredis: Redis, redis_url: str, model: MockLLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = BudgetLedger(aredis)
    await ledger.open("lane3", 1000)
    w = make_worker(redis_url, model, "lane-budget")

    async def reserved() -> bool:
        snap = await ledger.snapshot("lane3")
        return snap is not None and snap.grants == 1

    async with running(w):
        await until_idle(real_redis, "lane-budget")
        # START is held until the early reservation is in the ledger and a rival has the job,
        # so the call is known to wait for START, not merely to have lost the race to it.
        with held_start(monkeypatch, w) as release:
            s = spec("lane3", budgeted=True, max_completion_tokens=100)
            await Dispatcher(aredis).enqueue(s, ["Who keeps the key? Ada does."], [0])
            await await_until(reserved, 30, "the early reservation")
            await Records(aredis, QUEUE, "rival").start([b"lane3-b1-0"])
            release.set()
            await await_until(lambda: asyncio.sleep(0, lane_jobs(w, "lost") == 1), 30, "the lost race")
    assert model.stats["requests"] == 0
    # The early reservation is the one the owner of the job makes: the same id, one grant.
    grant = await ledger.reserve("lane3", "lane3-b1-0:1:1", 100)
    assert (grant.tokens, grant.charged) == (100, 100)


async def test_a_worker_that_is_full_passes_a_routed_batch_on(
    real_redis: redis.Redis, aredis: Redis, redis_url: str, model: MockLLMServer
) -> None:
    """A worker whose name is still on the idle list but which filled up meanwhile (here from
    a large batch's wake-up) hands a small batch routed to it on to every worker."""
    w = make_worker(redis_url, model, "lane-full", worker_concurrency=1)
    dispatcher = Dispatcher(aredis)
    pubsub = aredis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(K.wake_channel(QUEUE))
    async with running(w):
        await until_idle(real_redis, "lane-full")
        big = [f"[[mock:sleep:{1 if i == 0 else 0}]] Who? Ada {i}." for i in range(LANE_MAX_JOBS + 1)]
        large = asyncio.create_task(dispatcher.run_batch(spec("lane4", parallelism=64), big))
        await await_until(lambda: asyncio.sleep(0, len(w._inflight) == 1), 30, "the worker to be full")
        assert idle_names(real_redis) == ["lane-full"]  # still listed: it got work by a wake-up
        small = asyncio.create_task(dispatcher.run_batch(spec("lane5"), ["Who keeps the key? Ada does."]))

        async def passed_on() -> bool:
            msg = await pubsub.get_message(timeout=1)
            return msg is not None and K.parse_wake_message(msg["data"].decode()) == (QUEUE, ["lane5-b1-0"], False)

        await await_until(passed_on, 30, "the routed batch to be passed on")
        assert (await small)[0].status == "ok"
        assert all(r.status == "ok" for r in await large)
    await pubsub.aclose()
