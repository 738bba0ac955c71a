"""Batch dispatch: a batch's prompts become RQ jobs; results come back on its reply list.

The producer side of the queue path. One pipeline enqueues the jobs (job hashes written
exactly as RQ writes them, see :mod:`rlmq.common.rqjobs`), then the batch waits on its own
reply list (``BLPOP``, then ``LPOP count`` to drain what else arrived) until every slot
has a result or the deadline passes; missing slots become error results, so a batch never
hangs. A duplicate result for a slot (a job re-run after its worker was presumed dead) is
dropped here as well as at the worker.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError

from rlmq.common import keys as K
from rlmq.common.errors import PayloadError
from rlmq.common.rqjobs import SUB_LLM_FUNC, encode_job_data, job_hash
from rlmq.common.schemas import LaneEntry, LaneJob, SubLLMRequest, SubLLMResult, load_result


@dataclass
class BatchSpec:
    """What every sub-call of one batch shares.

    Attributes:
        rollout_id / batch_id: ids (``[A-Za-z0-9_-]``; batch ids without ``-``).
        model: the sub-model name (sent to the server by the worker).
        queue: the RQ queue of that model.
        timeout: seconds from enqueue to the deadline of each sub-call.
        parallelism: at most this many of the batch's sub-calls are queued or running at once.
    """

    rollout_id: str
    batch_id: str
    model: str
    queue: str
    timeout: float
    parallelism: int
    max_turns: int = 5
    system_prompt: str | None = None
    sub_tools: list[str] = field(default_factory=list)
    max_completion_tokens: int | None = None
    budgeted: bool = False
    include_messages: bool = False
    result_ttl: int = 600
    reply_ttl: int = 3600


WAKE_HINT_MAX_JOBS = 32
"""Batches up to this size name their job ids in the wake-up message."""

LANE_MAX_JOBS = 8
"""Batches up to this size are announced on the queue's lane instead of by a wake-up: one
``BLPOP`` hands the entry to exactly one idle worker (no herd of woken workers racing for
one job), and the entry carries the requests, so that worker starts each call (a budgeted
one: its first reservation) while its ``START`` is on the way (see :mod:`rlmq.workers.worker`)."""

LANE_MAX_PROMPT = 8192
"""Prompts longer than this (characters) are not copied into the lane entry."""

LANE_KEEP = 64
"""The lane keeps only its newest entries: when no worker is idle nobody pops it, and the
busy workers take the jobs from their RQ queue anyway."""

LANE_TTL_MS = 10_000
"""Milliseconds a lane lives after its last entry."""


def deadline_result(spec: BatchSpec, index: int) -> SubLLMResult:
    """The error result of a slot that got no answer before its deadline."""
    return SubLLMResult(
        rollout_id=spec.rollout_id,
        batch_id=spec.batch_id,
        index=index,
        job_id=job_id_for(spec, index),
        status="error",
        error_kind="deadline",
        content=f"[error] sub-LLM call got no result within its deadline ({spec.timeout:g} s)",
        error="deadline exceeded",
    )


QUEUE_SET_REFRESH = 30.0
"""Seconds between re-adding a queue to RQ's ``rq:queues`` set (workers add theirs at start)."""


def job_id_for(spec: BatchSpec, index: int) -> str:
    """RQ job id of slot ``index``: ``<rollout>-<batch>-<index>``."""
    return f"{spec.rollout_id}-{spec.batch_id}-{index}"


class Dispatcher:
    """Runs batches of sub-LLM calls through Redis.

    Args:
        redis: asyncio client (``decode_responses=False``); its pool must allow one
            blocking connection per batch in flight.
    """

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._queues_registered: dict[str, float] = {}

    async def enqueue(self, spec: BatchSpec, prompts: list[str], indices: list[int]) -> float:
        """Enqueue slots ``indices`` of ``prompts`` in one pipeline; returns the enqueue time."""
        now = time.time()
        reply = K.RolloutKeys(spec.rollout_id).reply(spec.batch_id)
        ttl = max(1, int(spec.timeout) + 1)
        lane_jobs: list[LaneJob] | None = [] if len(indices) <= LANE_MAX_JOBS else None
        async with self.redis.pipeline(transaction=False) as pipe:
            ids = []
            for i in indices:
                req = SubLLMRequest(
                    rollout_id=spec.rollout_id,
                    batch_id=spec.batch_id,
                    index=i,
                    prompt=prompts[i],
                    model=spec.model,
                    system_prompt=spec.system_prompt,
                    sub_tools=spec.sub_tools,
                    max_turns=spec.max_turns,
                    max_completion_tokens=spec.max_completion_tokens,
                    budgeted=spec.budgeted,
                    include_messages=spec.include_messages,
                    session_id=spec.rollout_id,
                    enqueued_at=now,
                    deadline=now + spec.timeout,
                )
                jid = job_id_for(spec, i)
                ids.append(jid)
                if lane_jobs is not None:
                    lane_jobs.append(LaneJob(job_id=jid, request=req if len(req.prompt) <= LANE_MAX_PROMPT else None))
                key = K.rq_job(jid)
                pipe.hset(
                    key,
                    mapping=job_hash(  # type: ignore[arg-type]  # str keys are fine for redis-py
                        queue=spec.queue,
                        data=encode_job_data(SUB_LLM_FUNC, args_json=f"[{req.model_dump_json(exclude_defaults=True)}]"),
                        description=(
                            f"sub-LLM rollout={spec.rollout_id} batch={spec.batch_id} index={i} model={spec.model}"
                        ),
                        timeout=ttl,
                        result_ttl=spec.result_ttl,
                        failure_ttl=spec.reply_ttl,
                        ttl=ttl,
                        reply_key=reply,
                        meta={"rollout_id": spec.rollout_id, "batch_id": spec.batch_id, "index": i},
                    ),
                )
                pipe.expire(key, ttl)
            pipe.rpush(K.rq_queue(spec.queue), *ids)
            # The reply list gets its TTL from the worker's FINISH script with every push (an
            # EXPIRE here would hit a key that does not exist yet), and the queue's entry in
            # RQ's queue set is re-asserted every QUEUE_SET_REFRESH seconds, not per batch.
            announce = now - self._queues_registered.get(spec.queue, 0.0) > QUEUE_SET_REFRESH
            if announce:
                pipe.sadd(K.RQ_QUEUES, K.rq_queue(spec.queue))
                self._queues_registered[spec.queue] = now
            if lane_jobs is not None:
                # One idle worker pops the entry; busy ones take the jobs off the queue.
                lane = K.lane(spec.queue)
                entry = LaneEntry(queue=spec.queue, enqueued_at=now, jobs=lane_jobs)
                pipe.rpush(lane, entry.model_dump_json(exclude_defaults=True))
                pipe.ltrim(lane, -LANE_KEEP, -1)
                pipe.pexpire(lane, LANE_TTL_MS)
                if announce:  # name the (tenant) queue to busy workers without waking anyone
                    pipe.publish(K.wake_channel(spec.queue), K.wake_message(spec.queue, announce_only=True))
            else:
                # Wakes idle workers and names new tenants; batches up to WAKE_HINT_MAX_JOBS
                # also name their jobs, so an idle worker takes them without peeking first.
                pipe.publish(
                    K.wake_channel(spec.queue),
                    K.wake_message(spec.queue, ids if len(ids) <= WAKE_HINT_MAX_JOBS else None),
                )
            await pipe.execute()
        return now

    async def run_batch(self, spec: BatchSpec, prompts: list[str]) -> list[SubLLMResult]:
        """Run every prompt as one sub-call; return one result per prompt, in order.

        At most ``spec.parallelism`` sub-calls of the batch are queued or running at once;
        the next ones are enqueued as results arrive. Each slot's deadline is ``spec.timeout``
        seconds after its enqueue. Never raises for a sub-call's failure: the slot gets an
        error result instead.
        """
        n = len(prompts)
        if n == 0:
            return []
        results: list[SubLLMResult | None] = [None] * n
        deadlines: dict[int, float] = {}
        reply = K.RolloutKeys(spec.rollout_id).reply(spec.batch_id)
        next_index = min(n, spec.parallelism)
        t0 = await self.enqueue(spec, prompts, list(range(next_index)))
        for i in range(next_index):
            deadlines[i] = t0 + spec.timeout
        pending = n
        while pending:
            now = time.time()
            # Slots past their deadline get an error result now.
            for i, dl in list(deadlines.items()):
                if dl <= now and results[i] is None:
                    results[i] = deadline_result(spec, i)
                    deadlines.pop(i)
                    pending -= 1
            if not pending:
                break
            if next_index < n and len(deadlines) < spec.parallelism:
                take = list(range(next_index, min(n, next_index + spec.parallelism - len(deadlines))))
                t = await self.enqueue(spec, prompts, take)
                for i in take:
                    deadlines[i] = t + spec.timeout
                next_index = take[-1] + 1
            wait = max(0.01, min(deadlines.values()) - time.time()) if deadlines else 0.01
            try:
                got = await self.redis.blpop([reply], timeout=min(wait, 2.0))
                raws = [] if got is None else [got[1]]
                # Drain what else arrived in one more round trip, unless this was the last one.
                if raws and pending > 1:
                    more = await self.redis.lpop(reply, 1000)
                    if more:
                        raws.extend(more if isinstance(more, list) else [more])
            except (RedisError, OSError):
                # Redis is away (restarting?): keep waiting until the deadlines turn the
                # missing slots into error results; the client reconnects with backoff.
                await asyncio.sleep(min(0.5, wait))
                continue
            for raw in raws:
                try:
                    res = load_result(raw)
                except PayloadError:
                    continue
                i = res.index
                if res.batch_id != spec.batch_id or not (0 <= i < n) or results[i] is not None:
                    continue  # a late duplicate or a stranger: ignored
                results[i] = res
                deadlines.pop(i, None)
                pending -= 1
        # No DEL: a drained list no longer exists in Redis; a late duplicate expires with the
        # TTL the worker set on the reply list.
        return [r if r is not None else deadline_result(spec, i) for i, r in enumerate(results)]
