"""The lane: a small batch reaches exactly one idle worker, whose calls start before START answers.

In-process workers on a real Redis, the scripted model (a test double) in-process too. The
races the lane must survive are set up, not waited for: a rival takes the job with ``START``
(as a busy worker peeking the queue would) before the idle worker pops the lane entry.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis
from redis.asyncio import Redis
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from rlmq.common import keys as K
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.jobs.store import JobStore, StartedJob
from rlmq.common.metrics import Metrics
from rlmq.common.schemas import SubCallOptions
from rlmq.common.settings import load_settings
from rlmq.producer.dispatch import LANE_KEEP, BatchSpec, Dispatcher
from rlmq.scripted.server import ScriptedModelServer
from rlmq.workers import fetch
from rlmq.workers.worker import SubLLMWorker
from tests.faults.conftest import await_until

pytestmark = pytest.mark.integration
MODEL = "lane-test"
QUEUE = K.queue_name_for_model(MODEL)


@pytest.fixture
async def model() -> AsyncIterator[ScriptedModelServer]:
    async with ScriptedModelServer("127.0.0.1", 0) as server:
        yield server


def make_worker(redis_url: str, model: ScriptedModelServer, name: str, **kw: object) -> SubLLMWorker:
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


def blocked_on_lane(sync: redis.Redis, n: int) -> bool:
    """``n`` clients of this database wait in ``BLPOP`` (the idle workers on the lane)."""
    db = sync.connection_pool.connection_kwargs.get("db", 0)
    clients = sync.client_list()
    return sum(1 for c in clients if int(c["db"]) == db and "b" in c["flags"] and c["cmd"] == "blpop") >= n


def spec(rollout: str, **kw: object) -> BatchSpec:
    """A batch spec; ``kw`` names fields of the spec or of its :class:`SubCallOptions`."""
    call = SubCallOptions.model_validate(
        {"model": MODEL, **{k: v for k, v in kw.items() if k in SubCallOptions.model_fields}}
    )
    base: dict[str, object] = dict(rollout_id=rollout, batch_id="b1", queue=QUEUE, sub_call_timeout=30.0, parallelism=8)
    base.update({k: v for k, v in kw.items() if k not in SubCallOptions.model_fields})
    return BatchSpec(**base, call=call)  # type: ignore[arg-type]


async def test_a_small_batch_goes_to_one_idle_worker_and_its_call_starts_early(
    real_redis: redis.Redis, aredis: Redis, redis_url: str, model: ScriptedModelServer
) -> None:
    a = make_worker(redis_url, model, "lane-a")
    b = make_worker(redis_url, model, "lane-b")
    async with running(a, b):
        await await_until(lambda: asyncio.to_thread(blocked_on_lane, real_redis, 2), 30, "both workers idle")
        s = spec("lane1")
        results = await Dispatcher(aredis).run_batch(s, ["Who keeps the key? The key is kept by Ada."])
    assert results[0].status == "ok", results[0]
    # exactly one of the two took it, from the lane, and called the model once
    assert sorted(lane_jobs(w, "early") for w in (a, b)) == [0.0, 1.0]
    assert lane_jobs(a, "lost") + lane_jobs(b, "lost") == 0
    assert model.stats["requests"] == 1
    job = Job.fetch(results[0].job_id, connection=real_redis, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.FINISHED
    assert job.worker_name == results[0].worker


def rival_first(w: SubLLMWorker, monkeypatch: pytest.MonkeyPatch, ready: Callable[[], Awaitable[bool]]) -> None:
    """Make ``w``'s ``START`` wait until ``ready()``, then let a rival ``START`` the same jobs
    first: a busy worker peeking the queue in the moment between the enqueue and ``w``'s ``START``."""
    real_start = JobStore.start

    async def start(self: JobStore, job_ids: list[bytes]) -> list[StartedJob]:
        if self.worker_name == w.name:
            await await_until(ready, 30, "the early call")
            await real_start(JobStore(self.redis, self.queue, "rival"), job_ids)
        return await real_start(self, job_ids)

    monkeypatch.setattr(JobStore, "start", start)


def start_after_calls_reach_model(w: SubLLMWorker, model: ScriptedModelServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make each ``START`` of ``w`` wait until every call ``w`` has started reached the model,
    as on a loaded machine, where a ``START``'s round trip outlasts an early call's send."""
    real_start = JobStore.start

    async def sent() -> bool:
        return bool(model.stats["requests"] >= w.processed + len(w.jobs.tasks))

    async def start(self: JobStore, job_ids: list[bytes]) -> list[StartedJob]:
        if self.worker_name == w.name:
            await await_until(sent, 10, "the worker's calls to reach the model")
        return await real_start(self, job_ids)

    monkeypatch.setattr(JobStore, "start", start)


async def test_an_early_call_is_cancelled_when_another_worker_took_the_job(
    real_redis: redis.Redis, aredis: Redis, redis_url: str, model: ScriptedModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = make_worker(redis_url, model, "lane-late")
    rival_first(w, monkeypatch, lambda: asyncio.sleep(0, model.stats["requests"] == 1))
    async with running(w):
        await await_until(lambda: asyncio.to_thread(blocked_on_lane, real_redis, 1), 30, "the worker idle")
        await Dispatcher(aredis).enqueue(spec("lane2"), ["[[mock:sleep:30]] Who keeps the key? Ada does."], [0])
        await await_until(lambda: asyncio.sleep(0, lane_jobs(w, "lost") == 1), 30, "the lost race")
        # The early call (its model answer is 30 s away) ends now: cancelled, not drained.
        await await_until(lambda: asyncio.sleep(0, not w.jobs.tasks), 10, "the early call to be cancelled")
        assert not len(w.jobs)
    assert lane_jobs(w, "early") == 0
    assert model.stats["completions"] == 0  # the early call was cancelled, not answered
    assert real_redis.llen(K.RolloutKeys("lane2").reply("b1")) == 0  # nothing delivered by the loser
    job = Job.fetch("lane2-b1-0", connection=real_redis, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.STARTED and job.worker_name == "rival"


async def test_an_entry_already_in_the_lane_starts_no_call_before_start(
    real_redis: redis.Redis, aredis: Redis, redis_url: str, model: ScriptedModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Enqueued while no worker waited on the lane, the job taken by a rival peeking the queue:
    the worker that pops the entry later must not have the model answer it a second time."""
    await Dispatcher(aredis).enqueue(spec("lane7"), ["Who keeps the key? Ada does."], [0])
    assert [j.job_id for j in await JobStore(aredis, QUEUE, "rival").start([b"lane7-b1-0"])] == ["lane7-b1-0"]
    w = make_worker(redis_url, model, "lane-lingering")
    start_after_calls_reach_model(w, model, monkeypatch)
    async with running(w):
        await await_until(lambda: asyncio.sleep(0, real_redis.llen(K.lane(QUEUE)) == 0), 30, "the lane popped")
        await await_until(lambda: asyncio.to_thread(blocked_on_lane, real_redis, 1), 30, "the worker idle again")
    assert model.stats["requests"] == 0
    assert lane_jobs(w, "early") + lane_jobs(w, "lost") == 0
    job = Job.fetch("lane7-b1-0", connection=real_redis, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.STARTED and job.worker_name == "rival"


async def test_a_budgeted_call_never_reaches_the_model_before_start(
    real_redis: redis.Redis, aredis: Redis, redis_url: str, model: ScriptedModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = BudgetLedger(aredis)
    await ledger.open("lane3", 1000)
    w = make_worker(redis_url, model, "lane-budget")

    async def reserved() -> bool:
        snap = await ledger.snapshot("lane3")
        return snap is not None and snap.grants == 1

    # This worker's START waits until its early reservation is in the ledger, so the call is
    # known to wait for START, not merely to have lost the race to it.
    rival_first(w, monkeypatch, reserved)
    async with running(w):
        await await_until(lambda: asyncio.to_thread(blocked_on_lane, real_redis, 1), 30, "the worker idle")
        s = spec("lane3", budgeted=True, max_completion_tokens=100)
        await Dispatcher(aredis).enqueue(s, ["Who keeps the key? Ada does."], [0])
        await await_until(lambda: asyncio.sleep(0, lane_jobs(w, "lost") == 1), 30, "the lost race")
    assert model.stats["requests"] == 0
    # The early reservation is the one the owner of the job makes: the same id, one grant.
    grant = await ledger.reserve("lane3", "lane3-b1-0:1:1", 100)
    assert (grant.tokens, grant.charged) == (100, 100)


async def test_a_small_batch_is_served_even_when_every_worker_is_busy(
    real_redis: redis.Redis, aredis: Redis, redis_url: str, model: ScriptedModelServer
) -> None:
    """Nobody pops the lane while the only worker is full; the jobs still run from the queue,
    and the lane keeps only its newest entries."""
    w = make_worker(redis_url, model, "lane-full", worker_concurrency=1)
    dispatcher = Dispatcher(aredis)
    async with running(w):
        slow = asyncio.create_task(dispatcher.run_batch(spec("lane4"), ["[[mock:sleep:1]] Who? Ada."]))
        await await_until(lambda: asyncio.sleep(0, len(w.jobs) == 1), 30, "the worker to be full")
        for i in range(LANE_KEEP + 5):
            await dispatcher.enqueue(spec(f"lane4x{i}"), ["filler"], [0])
        assert real_redis.llen(K.lane(QUEUE)) == LANE_KEEP
        assert 0 < real_redis.pttl(K.lane(QUEUE)) <= 10_000
        quick = await dispatcher.run_batch(spec("lane5"), ["Who keeps the key? Ada does."])
        assert quick[0].status == "ok", quick[0]
        assert (await slow)[0].status == "ok"


async def test_a_worker_never_calls_again_for_a_lane_entry_whose_jobs_it_took_from_the_queue(
    real_redis: redis.Redis, aredis: Redis, redis_url: str, model: ScriptedModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch is enqueued while the worker has no lane pop outstanding (here: before it
    starts; in a run, between two of its one-second pops), so its first round peeks the queue
    and runs the jobs from there; its next idle round pops the batch's lane entry, now stale.
    That entry must start no call: every sub-call reaches the model exactly once."""
    monkeypatch.setattr(fetch, "LANE_EARLY_MAX_AGE", 60.0)  # however slow the worker's start
    prompts = [f"Who keeps key {i}? Ada does." for i in range(4)]
    await Dispatcher(aredis).enqueue(spec("lane6"), prompts, list(range(4)))
    assert real_redis.llen(K.lane(QUEUE)) == 1
    w = make_worker(redis_url, model, "lane-self")
    start_after_calls_reach_model(w, model, monkeypatch)
    reply = K.RolloutKeys("lane6").reply("b1")
    async with running(w):
        await await_until(lambda: asyncio.sleep(0, real_redis.xlen(reply) == 4), 30, "the four results")
        await await_until(lambda: asyncio.sleep(0, real_redis.llen(K.lane(QUEUE)) == 0), 30, "the lane popped")
        # back in BLPOP: the popped entry has been dealt with
        await await_until(lambda: asyncio.to_thread(blocked_on_lane, real_redis, 1), 30, "the worker idle again")
        await await_until(lambda: asyncio.sleep(0, not w.jobs.tasks and not len(w.jobs)), 10, "nothing in flight")
    assert (model.stats["requests"], model.stats["completions"]) == (4, 4), model.stats
    assert lane_jobs(w, "early") + lane_jobs(w, "lost") == 0
