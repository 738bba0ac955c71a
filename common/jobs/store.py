"""The job store: the one owner of rlmq's queue protocol (``ENQUEUE``, ``START``, ``FINISH``, ``REAP``).

The producer enqueues through it (:meth:`JobStore.add_enqueue`), the worker starts, heartbeats,
finishes and reaps through it; the job-hash fields and RQ's record format are
:mod:`rlmq.common.jobs.record`, the scripts :mod:`rlmq.common.jobs.lua`. saq's ``Queue`` is the model.

RQ's records of jobs are kept truthful by rlmq's asyncio worker in batched Lua scripts.

A stock RQ worker spends about 57 Redis commands and a few milliseconds of Python per
job on bookkeeping, one job at a time. rlmq's worker holds hundreds of jobs in flight,
so it writes the same records (job hash status and timestamps, the started registry
with ``job_id:execution_id`` members and heartbeat-expiry scores, execution hashes, the
worker's executions set, finished / failed registries, the job's result stream) for a
whole batch of jobs in one script call. What is *not* written: RQ's per-job
``rq:executions:<job>`` index (only RQ's own horse reads it) and dependents/callbacks
(rlmq's jobs have none). ``tests/integration/test_records.py`` reads everything back
through RQ's own classes.

The scripts (:mod:`rlmq.common.jobs.lua`) take all their keys through ``KEYS[]``; each has a
header comment stating its contract.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from rlmq.common import keys as K
from rlmq.common.budget.calls import Settle
from rlmq.common.budget.ledger import LEDGER_LUA, BudgetLedger
from rlmq.common.fleet_checks import redis_time
from rlmq.common.jobs.lua import ENQUEUE_LUA, FINISH_LUA, REAP_LUA, START_LUA
from rlmq.common.jobs.record import F_META, F_REPLY, encode_job_data, job_hash, utcnow_str
from rlmq.common.schemas import SubLLMResult
from rlmq.common.scripts import run_pipeline, sha1
from rlmq.common.settings import setting_default


def slot_of(jid: str, meta_raw: bytes | None) -> tuple[str, str, int]:
    """``(rollout id, batch id, index)`` of a job, from its ``rlmq_meta`` or else its id."""
    try:
        meta = json.loads(meta_raw) if meta_raw else {}
        return str(meta["rollout_id"]), str(meta["batch_id"]), int(meta["index"])
    except (ValueError, TypeError, KeyError):
        return K.parse_job_id(jid) or ("unknown", "unknown", 0)


ABANDONED_CONTENT = "[error] sub-LLM call lost: its worker died and the retries are used up"
"""What the root model sees of a sub-LLM job the reaper failed."""


def sub_llm_abandoned(jid: str, meta_raw: bytes | None) -> str:
    """The error result (JSON) of a sub-LLM job whose worker died and whose retries are used up."""
    rollout, batch, index = slot_of(jid, meta_raw)
    return SubLLMResult.failure(
        rollout, batch, index, job_id=jid, kind="abandoned", content=ABANDONED_CONTENT,
        error="worker stopped heartbeating",
    ).model_dump_json()  # fmt: skip


_PER_JOB_FIELDS = ("data", "description", F_META)
DEFAULT_REPLY_TTL: int = setting_default("rollout_key_ttl")
"""Seconds a reply stream lives after a result when its job hash names no ``rlmq_reply_ttl`` (a
job enqueued by an older producer): the default of ``RolloutOptions.rollout_key_ttl``."""
ENQUEUE_SHA = sha1(ENQUEUE_LUA)


@dataclass(slots=True)
class NewJob:
    """One job to enqueue.

    Attributes:
        job_id: its RQ job id.
        args_json: the job function's positional arguments, encoded as a JSON array.
        description: what rq-dashboard shows; keep it short (never the prompt).
        meta: what the reaper needs to write the job's error result (``rlmq_meta``).
    """

    job_id: str
    args_json: str
    description: str
    meta: dict[str, Any]


@dataclass(frozen=True)
class EnqueueShared:
    """What every job of one enqueue shares (times in seconds).

    Attributes:
        func: the job function's import path (names the job kind).
        reply_key: the reply stream the results go to.
        timeout: RQ's job timeout, also how long a job may wait unstarted (its hash's TTL).
        result_ttl / failure_ttl: seconds RQ keeps the finished / failed job.
        reply_ttl: seconds the reply stream lives after a result (the producer's, stored in
            each job hash: ``FINISH`` and ``REAP`` use it, not the worker's own settings).
    """

    func: str
    reply_key: str
    timeout: int
    result_ttl: int
    failure_ttl: int
    reply_ttl: int


@dataclass
class StartedJob:
    """A job this worker now runs. Times in Unix seconds."""

    job_id: str
    execution_id: str
    data: bytes
    attempt: int
    reply_key: str

    @property
    def member(self) -> str:
        return f"{self.job_id}:{self.execution_id}"


@dataclass
class FinishedJob:
    """What :meth:`JobStore.finish` needs of one job."""

    job: StartedJob
    ok: bool
    result_json: str
    rq_payload: str
    """:func:`rq_return_value` of a summary when ok, :func:`rq_exc_string` otherwise."""
    settles: list[Settle] = field(default_factory=list)
    """Budget settlements sent in the same round trip as ``FINISH`` (each with the answer it ends, if any)."""
    spill_key: str | None = None
    """Where the result's token payload was spilled (:mod:`rlmq.common.jobs.spill`), if it was."""


class JobStore:
    """The queue protocol of one queue: ``ENQUEUE`` (producer), ``START``, heartbeat, ``FINISH``
    and ``REAP`` (worker), batched, keeping RQ's records truthful.

    Args:
        redis: asyncio client, ``decode_responses=False``.
        queue: RQ queue name.
        worker_name: RQ worker name of the worker side (its ``rq:worker:<name>`` hash is
            written by RQ's own ``Worker.register_birth``); ``""`` for a producer.
        heartbeat_ttl: seconds a started job stays owned without a heartbeat.
        result_ttl / failure_ttl: seconds finished and failed jobs are kept.
        reply_ttl: seconds a reply stream lives after a result when its job hash does not say
            (``rlmq_reply_ttl``, written by the producer; a job enqueued by an older producer).
        max_attempts: executions a job may get before the reaper fails it.
        ledger: the budget ledger whose settlements :meth:`finish` sends along (see
            :attr:`FinishedJob.settles`).
        abandoned_result: ``(job id, its rlmq_meta) -> result JSON`` of a job the reaper fails
            (its kind's failure result); default: :func:`sub_llm_abandoned`.
    """

    def __init__(
        self,
        redis: Redis,
        queue: str,
        worker_name: str = "",
        *,
        heartbeat_ttl: int = setting_default("job_heartbeat_ttl"),
        result_ttl: int = setting_default("result_ttl"),
        failure_ttl: int = 86400,
        reply_ttl: int = DEFAULT_REPLY_TTL,
        max_attempts: int = setting_default("job_max_attempts"),
        ledger: BudgetLedger | None = None,
        abandoned_result: Callable[[str, bytes | None], str] | None = None,
    ) -> None:
        self.redis = redis
        self.ledger = ledger
        self.queue = queue
        self.worker_name = worker_name
        self.heartbeat_ttl = heartbeat_ttl
        self.result_ttl = result_ttl
        self.failure_ttl = failure_ttl
        self.reply_ttl = reply_ttl
        self.max_attempts = max_attempts
        self.abandoned_result = abandoned_result or sub_llm_abandoned
        self.queue_key = K.rq_queue(queue)
        self.started_key = K.rq_started(queue)
        self.worker_key = K.rq_worker(worker_name)
        self.executions_key = K.rq_worker_executions(worker_name)
        self._start = redis.register_script(START_LUA)
        self._finish_sha = sha1(FINISH_LUA)
        self._reap = redis.register_script(REAP_LUA)
        self._exec_seq = 0
        self._exec_prefix = f"{time.time_ns():x}"

    # ------------------------------------------------------------------ producer side

    def add_enqueue(self, pipe: Pipeline, jobs: list[NewJob], shared: EnqueueShared, stamp: str) -> None:
        """Queue one ``ENQUEUE`` of ``jobs`` on ``pipe``, for a caller that sends it in one round
        trip with its own commands (the dispatcher's wake-up and lane hints). Safe to send twice
        with the same ``stamp`` (see ``ENQUEUE_LUA``); on ``NOSCRIPT`` the caller loads
        :data:`ENQUEUE_LUA` and sends the pipeline again.

        Args:
            pipe: a redis-py asyncio pipeline.
            jobs: the jobs, in queue order.
            shared: what they share.
            stamp: the enqueue time in RQ's format (:func:`rlmq.common.jobs.record.utcnow_str`).
        """
        per_job: list[Any] = []
        common: dict[str, Any] = {}
        for job in jobs:
            fields = job_hash(
                queue=self.queue,
                data=encode_job_data(shared.func, args_json=job.args_json),
                description=job.description,
                timeout=shared.timeout,
                result_ttl=shared.result_ttl,
                failure_ttl=shared.failure_ttl,
                ttl=shared.timeout,
                reply_key=shared.reply_key,
                reply_ttl=shared.reply_ttl,
                meta=job.meta,
                now=stamp,
            )
            if not common:
                common = {k: v for k, v in fields.items() if k not in _PER_JOB_FIELDS}
            per_job += [job.job_id, *(fields[k] for k in _PER_JOB_FIELDS)]
        keys = [self.queue_key, *(K.rq_job(j.job_id) for j in jobs)]
        argv: list[Any] = [shared.timeout, stamp, len(common)]
        for k, v in common.items():
            argv += [k, v]
        argv += per_job
        pipe.evalsha(ENQUEUE_SHA, len(keys), *keys, *argv)

    async def withdraw(self, job_ids: list[str]) -> None:
        """Take back still-queued jobs (remove them from the queue, delete their hashes).

        Raises:
            redis.RedisError: Redis refused or is away.
        """
        async with self.redis.pipeline(transaction=False) as pipe:
            for jid in job_ids:
                pipe.lrem(self.queue_key, 0, jid)
                pipe.delete(K.rq_job(jid))
            await pipe.execute()

    # ------------------------------------------------------------------ worker side

    def _next_execution_id(self) -> str:
        self._exec_seq += 1
        return f"{self._exec_prefix}{self._exec_seq:x}"

    async def start(self, job_ids: list[bytes]) -> list[StartedJob]:
        """Take the given queued jobs and mark them started by this worker (one round trip).

        Safe to re-send after a lost reply (see ``START_LUA``): the jobs the first run took
        come back again, so none is left started with nobody running it."""
        if not job_ids:
            return []
        keys: list[str] = [self.queue_key, self.started_key, self.executions_key]
        argv: list[Any] = [self.worker_name, utcnow_str(), time.time(), self.heartbeat_ttl]
        for raw in job_ids:
            jid = raw.decode()
            eid = self._next_execution_id()
            keys += [K.rq_job(jid), K.rq_execution(jid, eid)]
            argv += [jid, eid]
        rows: list[list[bytes]] = await self._start(keys=keys, args=argv)
        return [
            StartedJob(
                job_id=r[0].decode(),
                execution_id=r[1].decode(),
                data=r[2],
                attempt=int(r[3] or 0) + 1,
                reply_key=K.reply_of_job(r[0].decode()) or r[4].decode(),  # never another rollout's
            )
            for r in rows
        ]

    async def finish(self, done: list[FinishedJob]) -> tuple[int, int]:
        """Record the end of ``done`` and add their results to their reply streams.

        The budget settlements the jobs carry (:attr:`FinishedJob.settles`) go first, in the
        same round trip. Safe to run twice (a retry after a lost reply records nothing twice).

        Returns:
            ``(recorded, undeliverable)``: jobs recorded now (the others were taken back by
            the reaper, or recorded by an earlier run of the same call), and of those, jobs
            whose reply key was not a stream (recorded as failed; the producer's slot ends
            at its deadline).

        Raises:
            redis.RedisError: an error reply (``READONLY``, ``OOM``, ...) or a lost connection;
                nothing was moved then, and the same call may be made again.
        """
        if not done:
            return (0, 0)
        keys: list[str] = [
            self.started_key,
            self.executions_key,
            K.rq_finished(self.queue),
            K.rq_failed(self.queue),
            self.worker_key,
        ]
        argv: list[Any] = [
            utcnow_str(), time.time(), self.result_ttl, self.failure_ttl, self.reply_ttl, self.worker_name,
        ]  # fmt: skip
        for d in done:
            j = d.job
            keys += [K.rq_job(j.job_id), K.rq_execution(j.job_id, j.execution_id), K.rq_results(j.job_id), j.reply_key]
            argv += [j.job_id, j.execution_id, "1" if d.ok else "0", d.result_json, d.rq_payload]
        settles = [s for d in done for s in d.settles]

        # Settlements first, then FINISH, in one round trip on one connection: by the time a
        # producer sees a result, the ledger has already released what its last call did not use.
        def build(pipe: Pipeline) -> None:
            if settles and self.ledger is not None:
                self.ledger.add_settles(pipe, settles)
            pipe.evalsha(self._finish_sha, len(keys), *keys, *argv)

        outcomes = await run_pipeline(self.redis, build, [LEDGER_LUA, FINISH_LUA])
        recorded, undeliverable = outcomes[-1]
        return int(recorded), int(undeliverable)

    async def heartbeat(self, members: list[str], state: str) -> None:
        """Extend this worker's ownership of ``members`` (``job:exec``) and its own liveness
        (its RQ worker hash and its entry in :func:`rlmq.common.keys.serving`)."""
        expires = await redis_time(self.redis) + self.heartbeat_ttl  # Redis's clock, never this host's
        async with self.redis.pipeline(transaction=False) as pipe:
            for i in range(0, len(members), 2000):
                chunk = members[i : i + 2000]
                pipe.zadd(self.started_key, dict.fromkeys(chunk, expires), xx=True)
            pipe.hset(self.worker_key, mapping={"last_heartbeat": utcnow_str(), "state": state})
            pipe.expire(self.worker_key, self.heartbeat_ttl + 60)
            pipe.expire(self.executions_key, self.heartbeat_ttl + 60)
            serving = K.serving(self.queue)
            pipe.zadd(serving, {self.worker_name: expires})
            pipe.zremrangebyscore(serving, "-inf", expires - self.heartbeat_ttl - 3600)  # long-dead workers
            await pipe.execute()

    async def expired_members(self, limit: int = 200) -> list[str]:
        """Started-registry members whose heartbeat has lapsed (oldest first)."""
        now = await redis_time(self.redis)
        raw = await self.redis.zrangebyscore(self.started_key, "-inf", now, start=0, num=limit)
        return [m.decode() for m in cast(list[bytes], raw)]

    async def reap(
        self, members: list[str], *, hand_back: bool = False, taken: list[tuple[str, int]] | None = None
    ) -> tuple[int, int]:
        """Re-queue (or fail, when out of attempts) the executions ``members``.

        With ``hand_back`` the members are taken back whatever their heartbeat (graceful
        shutdown); otherwise only those whose heartbeat has lapsed. A job failed here gets
        its kind's error result on its reply stream (``abandoned_result``).

        Args:
            taken: when given, ``(job id, attempt)`` of each execution this call took back is
                appended to it (the attempt it ran as, from 1): only those, never an execution
                whose worker heartbeated again or that another reaper took first.

        Returns:
            ``(requeued, failed)``.
        """
        if not members:
            return (0, 0)
        job_ids = [m.rsplit(":", 1)[0] for m in members]
        async with self.redis.pipeline(transaction=False) as pipe:
            for jid in job_ids:
                pipe.hmget(K.rq_job(jid), F_REPLY, F_META, "worker_name")
            infos: list[list[bytes | None] | Exception] = await pipe.execute(raise_on_error=False)
        keys: list[str] = [self.started_key, self.queue_key, K.rq_failed(self.queue)]
        argv: list[Any] = [
            utcnow_str(), "+inf" if hand_back else time.time(), self.failure_ttl, self.reply_ttl,
            self.max_attempts, time.time(),
        ]  # fmt: skip
        for member, jid, info in zip(members, job_ids, infos, strict=True):
            reply, meta_raw, worker = info if not isinstance(info, Exception) else (None, None, None)
            eid = member.rsplit(":", 1)[1]
            wname = worker.decode() if worker else self.worker_name
            keys += [
                K.rq_job(jid), K.rq_execution(jid, eid), K.rq_results(jid),
                K.reply_of_job(jid) or (reply.decode() if reply else K.ORPHAN_REPLIES), K.rq_worker_executions(wname),
            ]  # fmt: skip
            argv += [member, jid, self.abandoned_result(jid, meta_raw)]
        res = await self._reap(keys=keys, args=argv)
        if taken is not None and len(res) > 2:
            flat = res[2]
            taken += [(_text(flat[i]), int(flat[i + 1])) for i in range(0, len(flat) - 1, 2)]
        return int(res[0]), int(res[1])


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
