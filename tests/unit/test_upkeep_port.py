"""The upkeep on a small stand-in of its worker (what :class:`~rlmq.workers.upkeep.UpkeepPort`
declares, nothing else) on fakeredis: the heartbeat extends the jobs it holds and its serving
entry, the reaper takes back a dead worker's job and tells the job's kind which attempt died,
and the pruning drops expired registry members and dead workers' entries."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import fakeredis
import pytest
from redis.asyncio import Redis

from rlmq.common import keys as K
from rlmq.common.jobs.lua import ENQUEUE_LUA
from rlmq.common.jobs.record import SUB_LLM_FUNC, utcnow_str
from rlmq.common.jobs.store import EnqueueShared, JobStore, NewJob, StartedJob
from rlmq.common.metrics import Metrics
from rlmq.common.settings import Settings, load_settings
from rlmq.workers.capacity import MODEL_CALLS, Capacity, PoolSpec
from rlmq.workers.inflight import InFlight
from rlmq.workers.kinds import JobKind, Outcome
from rlmq.workers.upkeep import Upkeep, UpkeepPort

QUEUE = "rlmq:sub:m"
TTL = 10


@dataclass
class _Queues:
    queues: list[str]


@dataclass
class _Worker:
    """What the upkeep reads of a worker: settings, names, its jobs, its records, one job kind."""

    redis: Redis
    settings: Settings = field(
        default_factory=lambda: load_settings(redis_url="redis://127.0.0.1:1", model="m", job_heartbeat_ttl=TTL)
    )
    name: str = "w-alive"
    queue: str = QUEUE
    concurrency: int = 4
    repl_slots: int = 0
    metrics: Metrics = field(default_factory=Metrics)
    jobs: InFlight = field(default_factory=lambda: InFlight(QUEUE, Capacity({MODEL_CALLS: PoolSpec(4)})))
    fetcher: _Queues = field(default_factory=lambda: _Queues([QUEUE]))
    dead: list[tuple[str, int]] = field(default_factory=list)

    def child_queues(self) -> list[str]:
        return []

    def records_for(self, queue: str) -> JobStore:
        return JobStore(self.redis, queue, self.name, heartbeat_ttl=TTL)

    def kind_of_queue(self, queue: str) -> JobKind:
        async def dead_attempts(taken: list[tuple[str, int]]) -> None:
            self.dead += taken

        async def never(payload: object, job: StartedJob) -> Outcome:
            raise AssertionError("the upkeep runs no job")

        def failure(job_id: str, meta: bytes | None, kind: str, message: str, attempt: int) -> Outcome:
            raise AssertionError("the upkeep makes no failure result")

        return JobKind(
            name="stub", func=SUB_LLM_FUNC, load=lambda a: a, run=never, failure=failure, pool=MODEL_CALLS,
            dead_attempts=dead_attempts,
        )  # fmt: skip


@pytest.fixture
def aredis() -> Redis:
    return fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer())


async def _enqueue(r: Redis, job_id: str) -> None:
    await r.script_load(ENQUEUE_LUA)
    async with r.pipeline(transaction=False) as pipe:
        JobStore(r, QUEUE).add_enqueue(
            pipe,
            [NewJob(job_id, "[{}]", "sub-call", {"rollout_id": "r1", "batch_id": "b1", "index": 0})],
            EnqueueShared(SUB_LLM_FUNC, K.RolloutKeys("r1").reply("b1"), 600, 600, 600, 600),
            utcnow_str(),
        )
        await pipe.execute()


async def test_the_heartbeat_extends_the_held_job_and_the_serving_entry(aredis: Redis) -> None:
    w = _Worker(aredis)
    port: UpkeepPort = w  # the stand-in is an upkeep port: nothing else is read
    upkeep = Upkeep(port)
    await _enqueue(aredis, "j1")
    [job] = await w.records_for(QUEUE).start([b"j1"])
    w.jobs.track(job, QUEUE, MODEL_CALLS)
    await aredis.zadd(K.rq_started(QUEUE), {job.member: 1.0})  # about to lapse
    await aredis.hset(K.rq_worker(w.name), "state", "idle")  # registered (nothing to register again)
    await upkeep.heartbeat_once()
    sec, usec = await aredis.time()
    now = sec + usec / 1e6
    score = await aredis.zscore(K.rq_started(QUEUE), job.member)
    serving = await aredis.zscore(K.serving(QUEUE), w.name)
    assert score is not None and now < score <= now + TTL
    assert serving is not None and now < serving <= now + TTL
    assert await aredis.hget(K.rq_worker(w.name), "state") == b"busy"


async def test_the_reaper_takes_back_a_dead_workers_job_and_names_its_attempt(aredis: Redis) -> None:
    w = _Worker(aredis)
    upkeep = Upkeep(w)
    await _enqueue(aredis, "j2")
    [job] = await JobStore(aredis, QUEUE, "w-dead", heartbeat_ttl=1).start([b"j2"])
    await aredis.zadd(K.rq_started(QUEUE), {job.member: time.time() - 1})  # its heartbeat lapsed
    assert await upkeep.reap_once() == 1
    assert w.dead == [("j2", 1)]
    assert await aredis.lrange(K.rq_queue(QUEUE), 0, -1) == [b"j2"]  # re-queued
    assert await upkeep.reap_once() == 0


async def test_pruning_drops_expired_registry_members_and_dead_workers(aredis: Redis) -> None:
    w = _Worker(aredis)
    upkeep = Upkeep(w)
    await aredis.zadd(K.rq_finished(QUEUE), {"old": 1.0, "new": time.time() + 600})
    await aredis.hset(K.rq_worker("w-alive"), "state", "idle")
    await aredis.sadd(K.RQ_WORKERS, K.rq_worker("w-alive"), K.rq_worker("w-gone"))
    assert await upkeep.prune_once() == 2
    assert await aredis.zrange(K.rq_finished(QUEUE), 0, -1) == [b"new"]
    assert await aredis.smembers(K.RQ_WORKERS) == {K.rq_worker("w-alive").encode()}
