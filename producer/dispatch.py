"""Batch dispatch: a batch's prompts become RQ jobs; results come back on its reply stream.

The producer side of the queue path. One ``ENQUEUE`` script call writes the jobs (job hashes
exactly as RQ writes them, see :mod:`rlmq.common.jobs.record`) and pushes their ids, then the
batch reads its own reply stream (``XREAD BLOCK`` from the last entry id it saw) until every
slot has a result or the deadline passes; missing slots become error results, so a batch
never hangs. Both sides survive a reply lost after Redis ran the command (a dropped
connection; redis-py then sends the command again): ``ENQUEUE`` skips jobs it already wrote,
and reading is by entry id, not a destructive pop, so the re-sent read returns the same
results again. A duplicate result for a slot (the re-sent read, or a job re-run after its
worker was presumed dead) is dropped here as well as at the worker.

A batch's jobs are sub-LLM calls (:class:`~rlmq.common.schemas.SubLLMRequest`), or, for an
``rlm_batch`` below the tree's depth limit, child rollouts (a :class:`JobBuilder`): both share the reply
stream, the per-slot deadlines, the parallelism and the ``no_worker`` and gone handling.

When no live worker serves the queue (``rlmq:serving:<queue>``, refreshed by every worker's
heartbeat) for ``no_worker_grace`` seconds, the batch's open slots end with
``error_kind="no_worker"`` at once instead of at their deadline, and the log says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Protocol

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from rlmq.common import keys as K
from rlmq.common.aio import raise_if_cancelling
from rlmq.common.errors import PayloadError
from rlmq.common.jobs.lua import ENQUEUE_LUA
from rlmq.common.jobs.record import SUB_LLM_FUNC, utcnow_str
from rlmq.common.jobs.store import EnqueueShared, JobStore, NewJob
from rlmq.common.schemas import LaneEntry, LaneJob, SubCallOptions, SubLLMRequest, SubLLMResult, load_result
from rlmq.common.scripts import run_pipeline
from rlmq.common.settings import setting_default
from rlmq.producer.inflight import RolloutInFlight

log = logging.getLogger("rlmq.dispatch")

_REPLY_FIELD = K.REPLY_FIELD.encode()

NO_WORKER_GRACE = 5.0
"""Seconds a batch waits, with no live worker on its queue, before its open slots end with
``error_kind="no_worker"`` (a worker that is starting gets this long to register)."""


class JobBuilder(Protocol):
    """Makes a batch's jobs when they are not sub-LLM calls (the child rollouts of an
    ``rlm_batch``: :class:`rlmq.producer.rlm_batch.ChildJobs`). Their answers come as
    :class:`~rlmq.common.schemas.SubLLMResult` on the batch's reply stream, like a sub-call's."""

    @property
    def func(self) -> str:
        """The RQ job function (an import path)."""
        ...

    @property
    def what(self) -> str:
        """What one job is, in messages (``child rollout``)."""
        ...

    @property
    def start_hint(self) -> str:
        """The command that starts a worker of the batch's queue (named when none serves it)."""
        ...

    def jobs(self, spec: BatchSpec, prompts: list[str], indices: list[int], now: float) -> list[NewJob]:
        """The jobs of slots ``indices`` (ids :func:`job_id_for`), enqueued at ``now`` (Unix s)."""
        ...


@dataclass
class BatchSpec:
    """What every sub-call of one batch shares.

    Attributes:
        rollout_id / batch_id: ids (``[A-Za-z0-9_-]``; batch ids without ``-``).
        queue: the RQ queue of the sub-model.
        sub_call_timeout: seconds from a sub-call's enqueue to its deadline (per sub-call,
            not for the whole batch: a slot enqueued later gets a later deadline).
        parallelism: at most this many of the batch's sub-calls are queued or running at once.
        call: how the sub-LLM is called (model, system prompt, tools, turns, token cap, ...);
            every request of the batch carries these fields.
        result_ttl / reply_ttl: seconds RQ keeps a finished job / a failed job and the reply list
            (``result_ttl`` / ``rollout_key_ttl``).
        ledger_id: the budget ledger the batch's calls charge (every job carries it); ``None``:
            the rollout's own (a job without one charges the ledger named by its rollout id).
        nodes: the rollout's tree chain (top .. the rollout itself) for a child rollout's calls;
            empty for a top rollout's (see :attr:`SubLLMRequest.nodes <rlmq.common.schemas.SubLLMRequest.nodes>`).
    """

    rollout_id: str
    batch_id: str
    queue: str
    sub_call_timeout: float
    parallelism: int
    call: SubCallOptions
    result_ttl: int = setting_default("result_ttl")
    reply_ttl: int = setting_default("rollout_key_ttl")
    ledger_id: str | None = None
    nodes: tuple[str, ...] = ()
    kind: JobBuilder | None = None
    """Set when the batch's jobs are not sub-LLM calls (``call`` then only names the model)."""
    inflight: RolloutInFlight | None = None
    """The rollout's count over all its batches: ``parallelism`` then bounds them together."""

    @property
    def what(self) -> str:
        """What one slot's job is, for messages: ``sub-LLM call`` or the kind's own word."""
        return "sub-LLM call" if self.kind is None else self.kind.what


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
    return SubLLMResult.failure(
        spec.rollout_id, spec.batch_id, index, job_id=job_id_for(spec, index), kind="deadline",
        content=f"[error] {spec.what} got no result within its deadline ({spec.sub_call_timeout:g} s)",
        error="deadline exceeded",
    )  # fmt: skip


GONE_CHECK_SECONDS = 2.0
"""Seconds between checks that a batch's open jobs still exist in Redis; a job missing at two
checks in a row (a delivered result is read in between) ends its slot at once."""


def gone_result(spec: BatchSpec, index: int, restarted: float | None) -> SubLLMResult:
    """The error result of a slot whose job vanished from Redis (``restarted``: seconds since
    Redis restarted, when it restarted during the batch)."""
    why = (
        f"Redis restarted {restarted:.0f} s ago without persistence and lost it"
        if restarted is not None
        else "Redis lost it (evicted or deleted)"
    )
    return SubLLMResult.failure(
        spec.rollout_id, spec.batch_id, index, job_id=job_id_for(spec, index), kind="redis_lost",
        content=f"[error] {spec.what} lost: its job is gone from Redis ({why})", error=f"job gone: {why}",
    )  # fmt: skip


def no_worker_result(spec: BatchSpec, index: int, grace: float) -> SubLLMResult:
    """The error result of a slot whose queue no live worker served for ``grace`` seconds."""
    start = f"rlmq worker --model {spec.call.model}" if spec.kind is None else spec.kind.start_hint
    return SubLLMResult.failure(
        spec.rollout_id, spec.batch_id, index, job_id=job_id_for(spec, index), kind="no_worker",
        content=(
            f"[error] {spec.what} not run: no live worker serves queue {spec.queue} "
            f"(none for {grace:g} s); start `{start}`"
        ),
        error=f"no live worker serves queue {spec.queue}",
    )  # fmt: skip


QUEUE_SET_REFRESH = 30.0
"""Seconds between re-adding a queue to RQ's ``rq:queues`` set (workers add theirs at start)."""


def job_id_for(spec: BatchSpec, index: int) -> str:
    """RQ job id of slot ``index``: ``<rollout>-<batch>-<index>`` (see :func:`rlmq.common.keys.job_id`)."""
    return K.job_id(spec.rollout_id, spec.batch_id, index)


class Dispatcher:
    """Runs batches of sub-LLM calls through Redis.

    Args:
        redis: asyncio client (``decode_responses=False``); its pool must allow one
            blocking connection per batch in flight.
        no_worker_grace: seconds without a live worker on a batch's queue before its open
            slots end with ``error_kind="no_worker"``.
    """

    def __init__(self, redis: Redis, *, no_worker_grace: float = NO_WORKER_GRACE) -> None:
        self.redis = redis
        self.no_worker_grace = no_worker_grace
        self._queues_registered: dict[str, float] = {}
        self._script_loaded = False
        self._drops: set[asyncio.Task[None]] = set()  # reply streams being deleted
        self._stores: dict[str, JobStore] = {}

    def _store(self, queue: str) -> JobStore:
        """The job store of ``queue`` (enqueue and withdraw go through it)."""
        store = self._stores.get(queue)
        if store is None:
            store = self._stores[queue] = JobStore(self.redis, queue)
        return store

    async def enqueue(self, spec: BatchSpec, prompts: list[str], indices: list[int]) -> float:
        """Enqueue slots ``indices`` of ``prompts`` in one round trip; returns the enqueue time
        (Unix seconds). Safe to re-send (see ``ENQUEUE_LUA``).

        Raises:
            redis.RedisError: Redis refused or stayed away past the client's retries.
        """
        now, _ = await self._enqueue(spec, prompts, indices)
        return now

    async def _enqueue(self, spec: BatchSpec, prompts: list[str], indices: list[int]) -> tuple[float, int]:
        """:meth:`enqueue`, also returning how many live workers serve the queue now."""
        now = time.time()
        stamp = utcnow_str()
        reply = K.RolloutKeys(spec.rollout_id).reply(spec.batch_id)
        ttl = max(1, int(spec.sub_call_timeout) + 1)
        ids: list[str] = []
        new_jobs: list[NewJob] = []
        lane_jobs: list[LaneJob] | None = None
        if spec.kind is not None:  # no lane: its entries are sub-LLM requests
            new_jobs = spec.kind.jobs(spec, prompts, indices, now)
            ids = [j.job_id for j in new_jobs]
        else:
            lane_jobs = [] if len(indices) <= LANE_MAX_JOBS else None
            self._sub_jobs(spec, prompts, indices, now, ids, new_jobs, lane_jobs)
        shared = EnqueueShared(
            func=SUB_LLM_FUNC if spec.kind is None else spec.kind.func,
            reply_key=reply,
            timeout=ttl,
            result_ttl=spec.result_ttl,
            failure_ttl=spec.reply_ttl,
            reply_ttl=spec.reply_ttl,
        )
        return await self._send(spec, now, stamp, ids, new_jobs, shared, lane_jobs)

    @staticmethod
    def _sub_jobs(
        spec: BatchSpec, prompts: list[str], indices: list[int], now: float,
        ids: list[str], new_jobs: list[NewJob], lane_jobs: list[LaneJob] | None,
    ) -> None:  # fmt: skip
        """Append the sub-LLM jobs of slots ``indices`` to ``ids`` and ``new_jobs`` (and their
        lane entries to ``lane_jobs``, when the batch is announced on the lane)."""
        call = spec.call.model_dump()
        # The job names its ledger; the rollout's own (a depth-1 rollout) is named by leaving the
        # field out (the worker reads it as the rollout id), so its payload stays as short as before.
        ledger_id = spec.ledger_id if spec.ledger_id != spec.rollout_id else None
        for i in indices:
            req = SubLLMRequest(
                rollout_id=spec.rollout_id,
                batch_id=spec.batch_id,
                index=i,
                prompt=prompts[i],
                enqueued_at=now,
                deadline=now + spec.sub_call_timeout,
                session_id=spec.rollout_id,
                ledger_id=ledger_id,
                nodes=list(spec.nodes),
                **call,
            )
            jid = job_id_for(spec, i)
            ids.append(jid)
            if lane_jobs is not None:
                lane_jobs.append(LaneJob(job_id=jid, request=req if len(req.prompt) <= LANE_MAX_PROMPT else None))
            new_jobs.append(
                NewJob(
                    job_id=jid,
                    args_json=f"[{req.model_dump_json(exclude_defaults=True)}]",
                    description=(
                        f"sub-LLM rollout={spec.rollout_id} batch={spec.batch_id} index={i} model={spec.call.model}"
                    ),
                    meta={"rollout_id": spec.rollout_id, "batch_id": spec.batch_id, "index": i},
                )
            )

    async def _send(
        self, spec: BatchSpec, now: float, stamp: str, ids: list[str], new_jobs: list[NewJob],
        shared: EnqueueShared, lane_jobs: list[LaneJob] | None,
    ) -> tuple[float, int]:  # fmt: skip
        """Enqueue ``new_jobs`` with the hints in one pipeline; returns (``now``, live workers)."""
        store = self._store(spec.queue)
        # The reply stream gets its TTL from the worker's FINISH script with every result (an
        # EXPIRE here would hit a key that does not exist yet), and the queue's entry in
        # RQ's queue set is re-asserted every QUEUE_SET_REFRESH seconds, not per batch.
        announce = now - self._queues_registered.get(spec.queue, 0.0) > QUEUE_SET_REFRESH

        def build(pipe: Pipeline) -> None:
            store.add_enqueue(pipe, new_jobs, shared, stamp)
            if announce:
                pipe.sadd(K.RQ_QUEUES, K.rq_queue(spec.queue))
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
            pipe.zcount(K.serving(spec.queue), now - K.SERVING_CLOCK_SKEW, "+inf")

        if not self._script_loaded:  # once: a NOSCRIPT later (Redis restarted) re-runs the pipeline
            await self.redis.script_load(ENQUEUE_LUA)
            self._script_loaded = True
        outcomes = await run_pipeline(self.redis, build, [ENQUEUE_LUA], raise_on_error=False)
        if isinstance(outcomes[0], Exception):
            raise outcomes[0]  # the jobs were not enqueued (all of them or none: one script)
        # The rest are hints (RQ's queue set, the lane, the wake-up, the live-worker count): one
        # that failed (a key of the wrong type, say) costs latency, never the batch.
        for o in outcomes[1:]:
            if isinstance(o, Exception):
                log.warning("batch %s: an enqueue hint failed (%s)", spec.batch_id, o)
        if announce:
            self._queues_registered[spec.queue] = now
        live = outcomes[-1]
        return now, int(live) if isinstance(live, int) else 1

    async def _withdraw(self, spec: BatchSpec, indices: list[int]) -> None:
        """Take back the still-queued jobs of slots the batch has given up on (no live worker):
        a worker that comes later would otherwise run them, before their deadlines, for a
        rollout that has moved on. Off the normal path; a failure leaves them to their TTL."""
        if not indices:
            return
        with contextlib.suppress(RedisError, OSError):
            await self._store(spec.queue).withdraw([job_id_for(spec, i) for i in indices])

    def _drop_later(self, reply: str) -> None:
        """Delete a finished batch's reply stream without making the batch wait for it (a
        round trip off the light-load path). A late duplicate recreates the stream with the
        worker's TTL; a failed delete leaves it to that TTL."""

        async def drop() -> None:
            with contextlib.suppress(RedisError, OSError):
                await self.redis.unlink(reply)

        task = asyncio.create_task(drop())
        self._drops.add(task)
        task.add_done_callback(self._drops.discard)

    async def _live_workers(self, queue: str) -> int:
        """How many workers of ``queue`` heartbeated recently (``rlmq:serving:<queue>``)."""
        return int(await self.redis.zcount(K.serving(queue), time.time() - K.SERVING_CLOCK_SKEW, "+inf"))

    async def _gone(
        self, spec: BatchSpec, open_slots: list[int], missing: set[int], started: float
    ) -> tuple[set[int], dict[int, SubLLMResult]]:
        """Which open slots' jobs are gone from Redis: ``(missing now, {slot: error result})``
        for the slots missing now and at the previous check too (``missing``). A Redis error
        checks nothing (the deadlines still hold)."""
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for i in open_slots:
                    pipe.exists(K.rq_job(job_id_for(spec, i)))
                found = await pipe.execute()
            now_missing = {i for i, f in zip(open_slots, found, strict=True) if not f}
            twice = sorted(now_missing & missing)
            if not twice:
                return now_missing, {}
            info = await self.redis.info("server")
        except (RedisError, OSError):
            return set(), {}
        uptime, elapsed = float(info.get("uptime_in_seconds", 0)), time.time() - started
        restarted = uptime if uptime <= elapsed + 1 else None  # uptime is whole seconds
        log.warning(
            "batch %s of rollout %s: %d open sub-call jobs are gone from Redis (%s); "
            "their slots end now with error_kind=redis_lost",
            spec.batch_id, spec.rollout_id, len(twice),
            f"Redis restarted {uptime:.0f} s ago, without persistence"
            if restarted is not None
            else f"evicted? Redis up {uptime:.0f} s, batch {elapsed:.0f} s",
        )  # fmt: skip
        return now_missing - set(twice), {i: gone_result(spec, i, restarted) for i in twice}

    async def run_batch(self, spec: BatchSpec, prompts: list[str]) -> list[SubLLMResult]:
        """Run every prompt as one sub-call; return one result per prompt, in order.

        At most ``spec.parallelism`` sub-calls of the batch are queued or running at once;
        the next ones are enqueued as results arrive. Each slot's deadline is ``spec.sub_call_timeout``
        seconds after its enqueue. Never raises for a sub-call's failure: the slot gets an
        error result instead (``deadline``; ``no_worker`` when no live worker served the
        queue for ``no_worker_grace`` seconds; ``redis_lost`` within seconds when its job is
        gone from Redis, which a restart without persistence does).

        Redis errors (a lost connection, an error reply) are retried until the slots'
        deadlines; slots Redis never let the batch enqueue end as ``deadline`` errors too.
        """
        if not prompts:
            return []
        try:
            return await self._run_batch(spec, prompts)
        finally:
            if spec.inflight is not None:
                spec.inflight.hold(spec.batch_id, 0)

    async def _run_batch(self, spec: BatchSpec, prompts: list[str]) -> list[SubLLMResult]:
        return await _BatchRun(self, spec, prompts).run()


class _BatchRun:
    """One batch's run (:meth:`Dispatcher.run_batch`): its slots, their deadlines and its reply
    stream, advanced step by named step until every slot has a result."""

    def __init__(self, dispatcher: Dispatcher, spec: BatchSpec, prompts: list[str]) -> None:
        self.d, self.spec, self.prompts, self.n = dispatcher, spec, prompts, len(prompts)
        self.results: list[SubLLMResult | None] = [None] * self.n
        self.pending = self.n
        self.deadlines: dict[int, float] = {}
        """Slot -> its deadline (Unix seconds), for the slots enqueued and still open."""
        self.next_index = 0
        """The first slot not enqueued yet."""
        self.reply = K.RolloutKeys(spec.rollout_id).reply(spec.batch_id)
        self.last_id: bytes | str = b"0-0"
        self.started = self.progress = time.time()  # progress: a result came or a live worker was seen
        self.unserved_since: float | None = None
        self.enqueue_failing_since: float | None = None
        self.next_check = self.started + GONE_CHECK_SECONDS
        self.missing: set[int] = set()

    async def run(self) -> list[SubLLMResult]:
        """Every slot's result, in order; never raises for a sub-call's failure."""
        while self.pending:
            now = time.time()
            self.end_past_deadlines(now)
            self.end_never_enqueued(now)
            if not self.pending:
                break
            if self.unserved_since is not None and now - self.unserved_since >= self.d.no_worker_grace:
                await self.end_unserved(now)
                break
            try:
                raws = await self.exchange()
            except (RedisError, OSError) as exc:
                await self.wait_for_redis(exc)
                continue
            if raws is None:
                continue
            self.record(raws)
            await self.end_gone()
        self.d._drop_later(self.reply)
        return [r if r is not None else deadline_result(self.spec, i) for i, r in enumerate(self.results)]

    def _end(self, i: int, result: SubLLMResult) -> None:
        self.results[i] = result
        self.deadlines.pop(i, None)
        self.pending -= 1

    def end_past_deadlines(self, now: float) -> None:
        """Slots past their deadline get an error result now."""
        for i, dl in list(self.deadlines.items()):
            if dl <= now and self.results[i] is None:
                self._end(i, deadline_result(self.spec, i))

    def end_never_enqueued(self, now: float) -> None:
        """Slots Redis refused to enqueue for a whole deadline end as ``deadline`` errors."""
        if self.enqueue_failing_since is not None and now - self.enqueue_failing_since >= self.spec.sub_call_timeout:
            for i in range(self.next_index, self.n):
                self._end(i, deadline_result(self.spec, i))
            self.next_index = self.n

    async def end_unserved(self, now: float) -> None:
        """No live worker served the queue for ``no_worker_grace``: withdraw the jobs, end every open slot."""
        spec, unserved = self.spec, now - (self.unserved_since or now)
        log.warning(
            "batch %s of rollout %s: no live worker serves queue %s (none for %.0f s); "
            "%d open sub-calls end with error_kind=no_worker",
            spec.batch_id, spec.rollout_id, spec.queue, unserved, self.pending,
        )  # fmt: skip
        await self.d._withdraw(spec, [i for i in range(self.next_index) if self.results[i] is None])
        for i in range(self.n):
            if self.results[i] is None:
                self.results[i] = no_worker_result(spec, i, self.d.no_worker_grace)

    async def exchange(self) -> list[bytes] | None:
        """Enqueue what fits, then read the reply stream once; ``None``: nothing is out (the
        rollout's other batches hold every slot, waited for here).

        Raises:
            RedisError / OSError: Redis is away or refused (:meth:`wait_for_redis`).
        """
        await self.enqueue_what_fits()
        if not self.deadlines:
            if self.spec.inflight is not None:
                await self.spec.inflight.wait_for_room(2.0)
            return None
        raws = await self.read_replies()
        await self.note_progress(bool(raws))
        return raws

    async def enqueue_what_fits(self) -> None:
        """Enqueue the next slots, as many as the batch's (and the rollout's) parallelism allows."""
        spec, shared, open_now = self.spec, self.spec.inflight, len(self.deadlines)
        room = spec.parallelism - open_now
        if shared is not None:  # the rollout's other batches count too
            shared.hold(spec.batch_id, open_now)
            room = min(room, shared.room(spec.batch_id) - open_now)
        if self.next_index >= self.n or room <= 0:
            return
        take = list(range(self.next_index, min(self.n, self.next_index + room)))
        if shared is not None:  # taken before the enqueue yields to the other batches
            shared.hold(spec.batch_id, open_now + len(take))
        t, live = await self.d._enqueue(spec, self.prompts, take)
        self.enqueue_failing_since = None
        for i in take:
            self.deadlines[i] = t + spec.sub_call_timeout
        self.next_index = take[-1] + 1
        if not live and self.unserved_since is None:
            self.unserved_since = t

    async def read_replies(self) -> list[bytes]:
        """The results added to the reply stream since the last read (blocks up to 2 s, or to
        the next deadline). A cancellation swallowed by an earlier read is raised here again."""
        raise_if_cancelling()
        wait = max(0.01, min(self.deadlines.values()) - time.time())
        if self.unserved_since is not None:
            wait = min(wait, max(0.01, self.unserved_since + self.d.no_worker_grace - time.time()))
        got: list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]] = await self.d.redis.xread(
            {self.reply: self.last_id}, count=1000, block=max(1, int(min(wait, 2.0) * 1000))
        )  # type: ignore[assignment]
        raws: list[bytes] = []
        for _key, entries in got or []:
            for entry_id, fields in entries:
                self.last_id = entry_id
                raw = fields.get(_REPLY_FIELD)
                if raw is not None:
                    raws.append(raw)
        return raws

    async def note_progress(self, got_results: bool) -> None:
        """A result, or a live worker on the queue, is progress; none for ``no_worker_grace``
        starts the no-worker clock."""
        if got_results:
            self.progress, self.unserved_since = time.time(), None
        elif time.time() - self.progress >= self.d.no_worker_grace:
            # Nothing for a while: is anybody serving this queue at all?
            if await self.d._live_workers(self.spec.queue):
                self.progress, self.unserved_since = time.time(), None
            elif self.unserved_since is None:
                self.unserved_since = time.time()

    async def wait_for_redis(self, exc: BaseException) -> None:
        """Redis is away (restarting?) or refused (READONLY in a failover, OOM): keep trying until
        the deadlines turn the missing slots into error results; the client reconnects with
        backoff. Enqueue and read are both safe to repeat."""
        if self.next_index < self.n and self.enqueue_failing_since is None:
            self.enqueue_failing_since = time.time()
        log.debug("batch %s: Redis error (%s); retrying", self.spec.batch_id, exc)
        await asyncio.sleep(0.5)  # backoff before the next try, bounded by the deadlines

    def record(self, raws: list[bytes]) -> None:
        """Give each slot its result; a late duplicate or a stranger is ignored."""
        for raw in raws:
            try:
                res = load_result(raw)
            except PayloadError:
                continue
            i = res.index
            if res.batch_id != self.spec.batch_id or not (0 <= i < self.n) or self.results[i] is not None:
                continue
            self._end(i, res)

    async def end_gone(self) -> None:
        """Every ``GONE_CHECK_SECONDS``: slots whose job is gone from Redis end as ``redis_lost``."""
        if self.deadlines and time.time() >= self.next_check:
            self.next_check = time.time() + GONE_CHECK_SECONDS
            self.missing, gone = await self.d._gone(self.spec, sorted(self.deadlines), self.missing, self.started)
            for i, res in gone.items():
                self._end(i, res)
