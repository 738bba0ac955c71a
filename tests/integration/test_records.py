"""The worker's batched Lua bookkeeping, read back through RQ's own classes on a real Redis."""

from __future__ import annotations

import time

import pytest
import redis
from redis.asyncio import Redis
from rq import Queue, Worker
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer

from rlmq.common import keys as K
from rlmq.common.jobs.record import rq_exc_string, rq_return_value
from rlmq.common.jobs.store import FinishedJob, JobStore
from rlmq.common.schemas import SubCallOptions
from rlmq.producer.dispatch import BatchSpec, Dispatcher
from tests.replies import reply_raw, reply_results

pytestmark = pytest.mark.integration
QUEUE = "rlmq.sub.records-test"


async def enqueue(aredis: Redis, n: int, timeout: float = 30.0) -> BatchSpec:
    spec = BatchSpec(
        rollout_id="r1", batch_id="b1", queue=QUEUE, sub_call_timeout=timeout, parallelism=100,
        call=SubCallOptions(model="m"),
    )  # fmt: skip
    await Dispatcher(aredis).enqueue(spec, [f"p{i}" for i in range(n)], list(range(n)))
    return spec


async def head(aredis: Redis, n: int) -> list[bytes]:
    """Up to ``n`` job ids at the head of the queue, as the worker's fetch round peeks them."""
    ids: list[bytes] = await aredis.lrange(K.rq_queue(QUEUE), 0, n - 1)
    return ids


def rq_view(sync: redis.Redis) -> tuple[Queue, StartedJobRegistry]:
    q = Queue(QUEUE, connection=sync, serializer=JSONSerializer)
    return q, StartedJobRegistry(queue=q)


async def test_start_and_finish_are_what_rq_reports(real_redis: redis.Redis, aredis: Redis) -> None:
    await enqueue(aredis, 3)
    w = Worker([Queue(QUEUE, connection=real_redis)], name="w-test", connection=real_redis)
    w.register_birth()
    rec = JobStore(aredis, QUEUE, "w-test", heartbeat_ttl=10)
    started = await rec.start(await head(aredis, 10))
    assert [s.job_id for s in started] == ["r1-b1-0", "r1-b1-1", "r1-b1-2"]
    assert all(s.attempt == 1 and s.reply_key == K.RolloutKeys("r1").reply("b1") for s in started)
    q, wip = rq_view(real_redis)
    assert q.count == 0
    assert sorted(wip.get_job_ids()) == ["r1-b1-0", "r1-b1-1", "r1-b1-2"]
    job = Job.fetch("r1-b1-0", connection=real_redis, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.STARTED and job.worker_name == "w-test" and job.started_at
    assert len(real_redis.smembers(K.rq_worker_executions("w-test"))) == 3

    done = [
        FinishedJob(started[0], True, '{"x":1}', rq_return_value({"status": "ok"})),
        FinishedJob(started[1], False, '{"x":2}', rq_exc_string("model: 503")),
    ]
    assert await rec.finish(done) == (2, 0)
    assert sorted(wip.get_job_ids()) == ["r1-b1-2"]
    j0 = Job.fetch("r1-b1-0", connection=real_redis, serializer=JSONSerializer)
    j1 = Job.fetch("r1-b1-1", connection=real_redis, serializer=JSONSerializer)
    assert j0.get_status() == JobStatus.FINISHED and j0.ended_at is not None
    assert j1.get_status() == JobStatus.FAILED
    assert "r1-b1-0" in FinishedJobRegistry(queue=q).get_job_ids()
    assert "r1-b1-1" in FailedJobRegistry(queue=q).get_job_ids()
    r0 = j0.latest_result()
    assert r0 is not None and r0.type == Result.Type.SUCCESSFUL and r0.return_value == {"status": "ok"}
    r1 = j1.latest_result()
    assert r1 is not None and r1.type == Result.Type.FAILED and r1.exc_string == "model: 503"
    assert reply_raw(real_redis, K.RolloutKeys("r1").reply("b1")) == [b'{"x":1}', b'{"x":2}']
    assert int(real_redis.hget(K.rq_worker("w-test"), "successful_job_count")) == 1
    assert int(real_redis.hget(K.rq_worker("w-test"), "failed_job_count")) == 1
    # finishing the same execution again delivers nothing
    assert await rec.finish(done) == (0, 0)


async def test_two_workers_never_take_the_same_job(real_redis: redis.Redis, aredis: Redis) -> None:
    await enqueue(aredis, 50)
    a, b = JobStore(aredis, QUEUE, "wa"), JobStore(aredis, QUEUE, "wb")
    ids = await head(aredis, 50)
    got_a = await a.start(ids)
    got_b = await b.start(ids)  # same candidates: all already taken
    assert len(got_a) == 50 and got_b == []


async def test_an_enqueue_applied_twice_never_runs_one_attempt_twice(real_redis: redis.Redis, aredis: Redis) -> None:
    """A client retry can apply an enqueue pipeline a second time (its first reply lost): the
    job is queued again while its first copy runs. START refuses the copy (the attempt has
    started), so the two can never share one attempt's budget reservations."""
    spec = await enqueue(aredis, 2)
    ids = ["r1-b1-0", "r1-b1-1"]
    written = {jid: real_redis.hgetall(K.rq_job(jid)) for jid in ids}  # what the pipeline wrote
    a = JobStore(aredis, QUEUE, "wa")
    first = await a.start(await head(aredis, 2))
    assert [j.job_id for j in first] == ids
    for jid in ids:  # the same pipeline applied again: the same fields, the ids queued again
        real_redis.hset(K.rq_job(jid), mapping=written[jid])
    real_redis.rpush(K.rq_queue(QUEUE), *ids)
    b = JobStore(aredis, QUEUE, "wb")
    assert await b.start(await head(aredis, 2)) == []
    assert real_redis.llen(K.rq_queue(QUEUE)) == 0  # the copies are gone from the queue
    # The real execution still finishes and delivers.
    assert await a.finish([FinishedJob(j, True, '{"x":1}', rq_return_value(None)) for j in first]) == (2, 0)
    # A new enqueue of the same job ids (a rollout id used again) is a new job: it runs.
    await Dispatcher(aredis).enqueue(spec, ["p0", "p1"], [0, 1])
    assert [j.job_id for j in await b.start(await head(aredis, 2))] == ["r1-b1-0", "r1-b1-1"]


async def test_expired_job_of_a_silent_worker_is_requeued_then_failed(real_redis: redis.Redis, aredis: Redis) -> None:
    await enqueue(aredis, 1)
    dead = JobStore(aredis, QUEUE, "dead", heartbeat_ttl=1, max_attempts=2)
    first = await dead.start(await head(aredis, 1))
    # the dead worker never heartbeats: make its lease lapse without waiting
    real_redis.zadd(K.rq_started(QUEUE), {first[0].member: time.time() - 1})
    reaper = JobStore(aredis, QUEUE, "alive", heartbeat_ttl=10, max_attempts=2)
    expired = await reaper.expired_members()
    assert expired == [first[0].member]
    assert await reaper.reap(expired) == (1, 0)
    q, wip = rq_view(real_redis)
    assert q.job_ids == ["r1-b1-0"] and wip.get_job_ids() == []
    assert Job.fetch("r1-b1-0", connection=real_redis).get_status() == JobStatus.QUEUED
    # a late result from the dead worker is not delivered
    assert await dead.finish([FinishedJob(first[0], True, '{"late":1}', rq_return_value(None))]) == (0, 0)
    assert real_redis.xlen(K.RolloutKeys("r1").reply("b1")) == 0
    # second execution, also abandoned: out of attempts -> failed with an error result
    second = await reaper.start(await head(aredis, 1))
    assert second[0].attempt == 2
    real_redis.zadd(K.rq_started(QUEUE), {second[0].member: time.time() - 1})
    assert await reaper.reap(await reaper.expired_members()) == (0, 1)
    job = Job.fetch("r1-b1-0", connection=real_redis)
    assert job.get_status() == JobStatus.FAILED
    res = reply_results(real_redis, K.RolloutKeys("r1").reply("b1"))[0]
    assert res.status == "error" and res.error_kind == "abandoned" and res.index == 0


async def test_hand_back_requeues_whatever_the_heartbeat(real_redis: redis.Redis, aredis: Redis) -> None:
    await enqueue(aredis, 2)
    rec = JobStore(aredis, QUEUE, "w", heartbeat_ttl=30, max_attempts=3)
    started = await rec.start(await head(aredis, 2))
    assert await rec.reap([s.member for s in started], hand_back=True) == (2, 0)
    q, wip = rq_view(real_redis)
    assert sorted(q.job_ids) == ["r1-b1-0", "r1-b1-1"] and wip.get_job_ids() == []


async def test_heartbeat_extends_only_own_members(real_redis: redis.Redis, aredis: Redis) -> None:
    await enqueue(aredis, 1)
    rec = JobStore(aredis, QUEUE, "w", heartbeat_ttl=5)
    started = await rec.start(await head(aredis, 1))
    real_redis.zadd(K.rq_started(QUEUE), {started[0].member: time.time() - 1})
    await rec.heartbeat([started[0].member, "ghost:1"], "busy")
    assert real_redis.zscore(K.rq_started(QUEUE), started[0].member) > time.time()
    assert real_redis.zscore(K.rq_started(QUEUE), "ghost:1") is None
    assert real_redis.hget(K.rq_worker("w"), "state") == b"busy"


async def test_expired_unstarted_job_is_dropped(real_redis: redis.Redis, aredis: Redis) -> None:
    await enqueue(aredis, 1)
    real_redis.delete(K.rq_job("r1-b1-0"))  # what its TTL does when the producer is gone
    rec = JobStore(aredis, QUEUE, "w")
    assert await rec.start(await head(aredis, 5)) == []
    assert real_redis.llen(K.rq_queue(QUEUE)) == 0


async def test_finish_sends_the_last_settlements_in_the_same_round_trip(real_redis: redis.Redis, aredis: Redis) -> None:
    from rlmq.common.budget.ledger import BudgetLedger

    ledger = BudgetLedger(aredis, ttl=60)
    await ledger.open("r1", 100)
    grant = await ledger.reserve("r1", "r1-b1-0:1:1", 40)
    assert grant.tokens == 40
    await enqueue(aredis, 1)
    rec = JobStore(aredis, QUEUE, "w", ledger=ledger)
    started = await rec.start(await head(aredis, 1))
    real_redis.script_flush()  # as after a Redis restart: FINISH must load both scripts again
    done = FinishedJob(started[0], True, '{"x":1}', rq_return_value(None), settles=[("r1", "r1-b1-0:1:1", 15)])
    assert await rec.finish([done]) == (1, 0)
    snap = await ledger.snapshot("r1")
    assert snap is not None and (snap.charged, snap.used, snap.released) == (15, 15, 25)
    # a second FINISH of the same execution neither delivers nor settles again
    assert await rec.finish([done]) == (0, 0)
    snap = await ledger.snapshot("r1")
    assert snap is not None and (snap.charged, snap.used) == (15, 15)


async def test_an_enqueue_and_a_start_sent_twice_apply_once(
    real_redis: redis.Redis, aredis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What redis-py does after a reply lost to a dropped connection: the same command again.
    ENQUEUE (same created_at) writes and queues nothing more; START (same execution ids) takes
    nothing more and returns the jobs the first one took, so none is left started unowned."""
    import rlmq.producer.dispatch as dispatch_mod

    monkeypatch.setattr(dispatch_mod, "utcnow_str", lambda: "2026-11-23T07:00:00.000000Z")
    spec = await enqueue(aredis, 3)
    await Dispatcher(aredis).enqueue(spec, ["p0", "p1", "p2"], [0, 1, 2])  # the re-send
    assert real_redis.lrange(K.rq_queue(QUEUE), 0, -1) == [b"r1-b1-0", b"r1-b1-1", b"r1-b1-2"]

    rec = JobStore(aredis, QUEUE, "w-twice")
    ids = await head(aredis, 3)
    monkeypatch.setattr(rec, "_next_execution_id", iter(["e0", "e1", "e2", "e0", "e1", "e2"]).__next__)
    first = await rec.start(ids)
    again = await rec.start(ids)  # the re-send: the queue is empty now
    assert [(j.job_id, j.execution_id) for j in again] == [(j.job_id, j.execution_id) for j in first]
    assert len(first) == 3 and all(j.attempt == 1 for j in again)
    assert real_redis.zcard(K.rq_started(QUEUE)) == 3 and real_redis.llen(K.rq_queue(QUEUE)) == 0
    # another worker's START (other execution ids) gets none of them
    assert await JobStore(aredis, QUEUE, "w-other").start(ids) == []


async def test_reply_streams_live_by_the_producers_ttl_not_the_workers(real_redis: redis.Redis, aredis: Redis) -> None:
    """The producer owns its reply streams: FINISH and REAP give them the TTL the job carries
    (``rlmq_reply_ttl``), whatever the worker's own ``reply_ttl`` fallback says."""
    spec = BatchSpec(
        rollout_id="r1", batch_id="b1", queue=QUEUE, sub_call_timeout=30.0, parallelism=100,
        call=SubCallOptions(model="m"), reply_ttl=4000,
    )  # fmt: skip
    await Dispatcher(aredis).enqueue(spec, ["p0", "p1"], [0, 1])
    worker = JobStore(aredis, QUEUE, "w-short", reply_ttl=10, max_attempts=1)
    started = await worker.start(await head(aredis, 2))
    reply = K.RolloutKeys("r1").reply("b1")
    assert await worker.finish([FinishedJob(started[0], True, '{"x":1}', rq_return_value(None))]) == (1, 0)
    assert 10 < real_redis.ttl(reply) <= 4000
    real_redis.persist(reply)
    assert await worker.reap([started[1].member], hand_back=True) == (0, 1)  # out of attempts: failed
    assert 10 < real_redis.ttl(reply) <= 4000


async def test_a_reply_ttl_below_one_second_in_a_job_hash_never_deletes_the_results(
    real_redis: redis.Redis, aredis: Redis
) -> None:
    """An EXPIRE of 0 deletes a key: a job hash claiming ``rlmq_reply_ttl`` 0 gets the default."""
    await enqueue(aredis, 1)
    real_redis.hset(K.rq_job("r1-b1-0"), "rlmq_reply_ttl", 0)
    worker = JobStore(aredis, QUEUE, "w-zero", reply_ttl=50)
    started = await worker.start(await head(aredis, 1))
    assert await worker.finish([FinishedJob(started[0], True, '{"x":1}', rq_return_value(None))]) == (1, 0)
    assert 0 < real_redis.ttl(K.RolloutKeys("r1").reply("b1")) <= 50
