"""The producer's queue path on fakeredis: jobs RQ can read, ordered results, deadlines, duplicates."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import fakeredis
import pytest
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from rlmq.common import keys as K
from rlmq.common.jobs.record import COMPRESS_MIN_BYTES, SUB_LLM_FUNC, decode_job_data, encode_job_data
from rlmq.common.schemas import SubCallOptions, SubLLMResult, load_lane_entry, load_request
from rlmq.producer.dispatch import LANE_MAX_JOBS, LANE_MAX_PROMPT, BatchSpec, Dispatcher
from rlmq.producer.inflight import RolloutInFlight
from tests.faults.conftest import await_until


@pytest.fixture
def server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


def spec(**kw: object) -> BatchSpec:
    """A batch spec; ``kw`` names fields of the spec or of its :class:`SubCallOptions`."""
    call = SubCallOptions.model_validate(
        {"model": "m", **{k: v for k, v in kw.items() if k in SubCallOptions.model_fields}}
    )
    base: dict[str, object] = dict(
        rollout_id="r1", batch_id="b1", queue="rlmq.sub.m", sub_call_timeout=5.0, parallelism=64
    )
    base.update({k: v for k, v in kw.items() if k not in SubCallOptions.model_fields})
    return BatchSpec(**base, call=call)  # type: ignore[arg-type]


async def test_enqueued_jobs_are_ordinary_rq_jobs(server: fakeredis.FakeServer) -> None:
    r = fakeredis.aioredis.FakeRedis(server=server)
    await Dispatcher(r).enqueue(spec(), ["p0", "p1", "p2"], [0, 1, 2])
    sync = fakeredis.FakeRedis(server=server)
    q = Queue("rlmq.sub.m", connection=sync, serializer=JSONSerializer)
    assert q.count == 3
    assert q.job_ids == ["r1-b1-0", "r1-b1-1", "r1-b1-2"]
    assert q.key.encode() in sync.smembers("rq:queues")
    job = Job.fetch("r1-b1-1", connection=sync, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.QUEUED
    assert job.func_name == SUB_LLM_FUNC
    assert job.description == "sub-LLM rollout=r1 batch=b1 index=1 model=m"
    req = load_request(job.args[0])
    assert (req.prompt, req.index, req.rollout_id) == ("p1", 1, "r1")
    assert job.origin == "rlmq.sub.m" and job.enqueued_at is not None
    assert 0 < sync.ttl(job.key) <= 6  # an unstarted job expires with its deadline
    func, args, _ = decode_job_data(sync.hget(job.key, "data"))
    assert func == SUB_LLM_FUNC and args[0]["prompt"] == "p1"


def next_message(pubsub: Any) -> str:
    """The next published message (the subscription's confirmation comes back as ``None``)."""
    for _ in range(3):
        msg = pubsub.get_message(timeout=1)
        if msg is not None:
            return str(msg["data"].decode())
    raise AssertionError("no message published")


async def test_small_batches_go_to_the_lane_with_their_requests(server: fakeredis.FakeServer) -> None:
    r = fakeredis.aioredis.FakeRedis(server=server)
    sync = fakeredis.FakeRedis(server=server)
    pubsub = sync.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(K.wake_channel("rlmq.sub.m"))
    long = "x" * (LANE_MAX_PROMPT + 1)
    prompts = ["p0", long] + [f"p{i}" for i in range(2, LANE_MAX_JOBS)]
    d = Dispatcher(r)
    await d.enqueue(spec(), prompts, list(range(LANE_MAX_JOBS)))
    entry = load_lane_entry(sync.lpop(K.lane("rlmq.sub.m")))
    assert entry.queue == "rlmq.sub.m" and [j.job_id for j in entry.jobs] == [f"r1-b1-{i}" for i in range(8)]
    assert entry.jobs[0].request is not None and entry.jobs[0].request.prompt == "p0"
    assert entry.jobs[1].request is None  # too long to copy: the worker reads the job hash
    # the first batch on a queue names it to the workers, without waking anyone
    assert next_message(pubsub) == K.wake_message("rlmq.sub.m", announce_only=True)
    # a larger batch wakes the workers instead, naming its jobs
    await d.enqueue(spec(batch_id="b2"), [f"q{i}" for i in range(9)], list(range(9)))
    assert sync.llen(K.lane("rlmq.sub.m")) == 0
    assert K.parse_wake_message(next_message(pubsub)) == ("rlmq.sub.m", [f"r1-b2-{i}" for i in range(9)], False)


def test_short_job_data_is_stored_uncompressed_and_rq_reads_both() -> None:
    sync = fakeredis.FakeRedis()
    for prompt in ("short", "long " * 400):
        data = encode_job_data(SUB_LLM_FUNC, [{"prompt": prompt}])
        assert data.startswith(b"[") == (len(prompt) < COMPRESS_MIN_BYTES)
        sync.hset(f"rq:job:j{len(prompt)}", mapping={"data": data, "status": "queued", "created_at": ""})
        job = Job.fetch(f"j{len(prompt)}", connection=sync, serializer=JSONSerializer)
        assert job.func_name == SUB_LLM_FUNC and job.args == [{"prompt": prompt}]
        assert decode_job_data(data) == (SUB_LLM_FUNC, [{"prompt": prompt}], {})


def fake_result(i: int, content: str, batch: str = "b1") -> str:
    return SubLLMResult(
        rollout_id="r1", batch_id=batch, index=i, job_id=f"r1-{batch}-{i}", status="ok", content=content
    ).model_dump_json()


async def answer_jobs(
    r: fakeredis.aioredis.FakeRedis,
    queue: str,
    *,
    reverse: bool = False,
    dup: bool = False,
    skip: set[int] = frozenset(),
    stop_after: int | None = None,
) -> None:  # type: ignore[assignment]
    """A stand-in worker: pops job ids and pushes results (optionally out of order / duplicated)."""
    answered = 0
    while stop_after is None or answered < stop_after:
        jid = await r.blpop([K.rq_queue(queue)], timeout=1)
        if jid is None:
            return
        batch_ids = [jid[1].decode()]
        more = await r.lpop(K.rq_queue(queue), 100)
        batch_ids += [m.decode() for m in more or []]
        if reverse:
            batch_ids.reverse()
        for job_id in batch_ids:
            reply = (await r.hget(K.rq_job(job_id), "rlmq_reply")).decode()
            i = int(job_id.rsplit("-", 1)[1])
            if i in skip:
                continue
            await r.xadd(reply, {K.REPLY_FIELD: fake_result(0, "stranger", batch="b9")})
            await r.xadd(reply, {K.REPLY_FIELD: fake_result(i, f"answer {i}")})
            if dup:
                await r.xadd(reply, {K.REPLY_FIELD: fake_result(i, f"DUPLICATE {i}")})
            answered += 1


async def test_results_come_back_in_order_and_duplicates_are_dropped(server: fakeredis.FakeServer) -> None:
    r = fakeredis.aioredis.FakeRedis(server=server)
    worker = asyncio.create_task(answer_jobs(r, "rlmq.sub.m", reverse=True, dup=True, stop_after=20))
    results = await Dispatcher(r).run_batch(spec(), [f"p{i}" for i in range(20)])
    await worker
    assert [x.content for x in results] == [f"answer {i}" for i in range(20)]
    # the reply stream is deleted when the batch ends (a duplicate added later expires with its TTL)
    reply = K.RolloutKeys(spec().rollout_id).reply(spec().batch_id)
    await await_until(lambda: _absent(r, reply), 5, "the reply stream to be deleted")


async def _absent(r: fakeredis.aioredis.FakeRedis, key: str) -> bool:
    return not await r.exists(key)


async def test_parallelism_bounds_jobs_in_the_queue(server: fakeredis.FakeServer) -> None:
    r = fakeredis.aioredis.FakeRedis(server=server)
    seen_depths: list[int] = []

    async def worker() -> None:
        for _ in range(10):
            seen_depths.append(await r.llen(K.rq_queue("rlmq.sub.m")))
            got = await r.blpop([K.rq_queue("rlmq.sub.m")], timeout=2)
            assert got is not None
            jid = got[1].decode()
            reply = (await r.hget(K.rq_job(jid), "rlmq_reply")).decode()
            await r.xadd(reply, {K.REPLY_FIELD: fake_result(int(jid.rsplit("-", 1)[1]), "ok")})

    task = asyncio.create_task(worker())
    results = await Dispatcher(r).run_batch(spec(parallelism=3), [f"p{i}" for i in range(10)])
    await task
    assert all(x.content == "ok" for x in results)
    assert max(seen_depths) <= 3


async def test_parallelism_bounds_a_rollouts_concurrent_batches_together(server: fakeredis.FakeServer) -> None:
    """A cell that calls llm_batch / rlm_batch from many threads at once: the rollout's sub-calls
    in the queue stay within max_sub_llm_parallelism over all its batches, not per batch."""
    r = fakeredis.aioredis.FakeRedis(server=server)
    inflight = RolloutInFlight(3)
    seen: list[int] = []
    n_batches, per_batch = 5, 4

    async def worker() -> None:
        for _ in range(n_batches * per_batch):
            await asyncio.sleep(0.01)  # the worker is slower than the enqueues: jobs would pile up
            seen.append(await r.llen(K.rq_queue("rlmq.sub.m")))
            got = await r.blpop([K.rq_queue("rlmq.sub.m")], timeout=5)
            assert got is not None
            _, batch, index = got[1].decode().split("-")
            reply = (await r.hget(K.rq_job(got[1].decode()), "rlmq_reply")).decode()
            await r.xadd(reply, {K.REPLY_FIELD: fake_result(int(index), f"ok {batch}", batch=batch)})

    task = asyncio.create_task(worker())
    d = Dispatcher(r)
    batches = await asyncio.gather(
        *(
            d.run_batch(spec(batch_id=f"b{k}", parallelism=3, inflight=inflight), [f"p{i}" for i in range(per_batch)])
            for k in range(n_batches)
        )
    )
    await task
    assert [[x.content for x in b] for b in batches] == [[f"ok b{k}"] * per_batch for k in range(n_batches)]
    assert max(seen) <= 3, seen
    assert inflight.held == 0  # every batch gave its slots back


async def test_missing_results_become_deadline_errors(server: fakeredis.FakeServer) -> None:
    r = fakeredis.aioredis.FakeRedis(server=server)
    worker = asyncio.create_task(answer_jobs(r, "rlmq.sub.m", skip={1}, stop_after=2))
    t0 = time.monotonic()
    results = await Dispatcher(r).run_batch(spec(sub_call_timeout=0.5), ["a", "b", "c"])
    await worker
    assert time.monotonic() - t0 < 3
    assert [x.status for x in results] == ["ok", "error", "ok"]
    assert results[1].error_kind == "deadline" and "deadline" in results[1].content


async def test_empty_batch() -> None:
    r = fakeredis.aioredis.FakeRedis()
    assert await Dispatcher(r).run_batch(spec(), []) == []
