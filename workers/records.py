"""RQ's records of jobs, kept truthful by rlmq's asyncio worker in batched Lua scripts.

A stock RQ worker spends about 57 Redis commands and a few milliseconds of Python per
job on bookkeeping, one job at a time. rlmq's worker holds hundreds of jobs in flight,
so it writes the same records (job hash status and timestamps, the started registry
with ``job_id:execution_id`` members and heartbeat-expiry scores, execution hashes, the
worker's executions set, finished / failed registries, the job's result stream) for a
whole batch of jobs in one script call. What is *not* written: RQ's per-job
``rq:executions:<job>`` index (only RQ's own horse reads it) and dependents/callbacks
(rlmq's jobs have none). ``tests/integration/test_records.py`` reads everything back
through RQ's own classes.

The scripts (:mod:`rlmq.workers.lua`) take all their keys through ``KEYS[]``; each has a
header comment stating its contract.
"""

from __future__ import annotations

import base64
import json
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from rlmq.common import keys as K
from rlmq.common.ledger import LEDGER_LUA, BudgetLedger
from rlmq.common.rqjobs import F_META, F_REPLY, utcnow_str
from rlmq.common.schemas import SubLLMResult
from rlmq.common.scripts import run_pipeline, sha1
from rlmq.workers.lua import FINISH_LUA, REAP_LUA, START_LUA


def slot_of(jid: str, meta_raw: bytes | None) -> tuple[str, str, int]:
    """``(rollout id, batch id, index)`` of a job, from its ``rlmq_meta`` or else its id."""
    try:
        meta = json.loads(meta_raw) if meta_raw else {}
        return str(meta["rollout_id"]), str(meta["batch_id"]), int(meta["index"])
    except (ValueError, TypeError, KeyError):
        return K.parse_job_id(jid) or ("unknown", "unknown", 0)


def rq_return_value(value: Any) -> str:
    """RQ's result-stream encoding of a return value with the JSON serializer."""
    return base64.b64encode(json.dumps(value, separators=(",", ":")).encode()).decode()


def rq_exc_string(text: str) -> str:
    """RQ's result-stream encoding of an exception string."""
    return base64.b64encode(zlib.compress(text.encode())).decode()


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
    """What :meth:`Records.finish` needs of one job."""

    job: StartedJob
    ok: bool
    result_json: str
    rq_payload: str
    """:func:`rq_return_value` of a summary when ok, :func:`rq_exc_string` otherwise."""
    settles: list[tuple[str, str, int]] = field(default_factory=list)
    """Budget settlements sent in the same round trip as ``FINISH`` (rollout, reservation, used)."""


class Records:
    """RQ-compatible bookkeeping of one worker on one queue, batched.

    Args:
        redis: asyncio client, ``decode_responses=False``.
        queue: RQ queue name.
        worker_name: RQ worker name (its ``rq:worker:<name>`` hash is written by RQ's
            own ``Worker.register_birth``).
        heartbeat_ttl: seconds a started job stays owned without a heartbeat.
        result_ttl / failure_ttl / reply_ttl: seconds finished jobs, failed jobs and
            reply lists are kept.
        max_attempts: executions a job may get before the reaper fails it.
        ledger: the budget ledger whose settlements :meth:`finish` sends along (see
            :attr:`FinishedJob.settles`).
    """

    def __init__(
        self,
        redis: Redis,
        queue: str,
        worker_name: str,
        *,
        heartbeat_ttl: int = 10,
        result_ttl: int = 600,
        failure_ttl: int = 86400,
        reply_ttl: int = 3600,
        max_attempts: int = 2,
        ledger: BudgetLedger | None = None,
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
        self.queue_key = K.rq_queue(queue)
        self.started_key = K.rq_started(queue)
        self.worker_key = K.rq_worker(worker_name)
        self.executions_key = K.rq_worker_executions(worker_name)
        self._start = redis.register_script(START_LUA)
        self._finish_sha = sha1(FINISH_LUA)
        self._reap = redis.register_script(REAP_LUA)
        self._exec_seq = 0
        self._exec_prefix = f"{time.time_ns():x}"

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
                reply_key=r[4].decode(),
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
        expires = time.time() + self.heartbeat_ttl
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
        raw = await self.redis.zrangebyscore(self.started_key, "-inf", time.time(), start=0, num=limit)
        return [m.decode() for m in cast(list[bytes], raw)]

    async def reap(self, members: list[str], *, hand_back: bool = False) -> tuple[int, int]:
        """Re-queue (or fail, when out of attempts) the executions ``members``.

        With ``hand_back`` the members are taken back whatever their heartbeat (graceful
        shutdown); otherwise only those whose heartbeat has lapsed. A job failed here gets
        an error :class:`~common.schemas.SubLLMResult` on its reply stream.

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
            rollout, batch, index = slot_of(jid, meta_raw)
            eid = member.rsplit(":", 1)[1]
            err = SubLLMResult.failure(
                rollout, batch, index, job_id=jid, kind="abandoned",
                content="[error] sub-LLM call lost: its worker died and the retries are used up",
                error="worker stopped heartbeating",
            )  # fmt: skip
            wname = worker.decode() if worker else self.worker_name
            keys += [
                K.rq_job(jid), K.rq_execution(jid, eid), K.rq_results(jid),
                reply.decode() if reply else K.ORPHAN_REPLIES, K.rq_worker_executions(wname),
            ]  # fmt: skip
            argv += [member, jid, err.model_dump_json()]
        res = await self._reap(keys=keys, args=argv)
        return int(res[0]), int(res[1])
