"""The concurrent sub-LLM worker: one process, hundreds of sub-calls in flight.

A stock RQ worker runs one job at a time, which wastes a process on every in-flight
LLM call. This worker runs on one asyncio loop:

* the *fetch* task serves the model's queue and all its tenant queues (``<queue>@<tenant>``,
  one per trainer node), round-robin: each round every non-empty queue gets an equal share
  of the free slots, so one trainer's burst of 10,000 prompts cannot starve another's batch
  of 8. It takes jobs with ``LRANGE`` then the ``START`` script (which removes them from the
  queue and marks them started atomically: a worker dying while it waits loses nothing), and
  when every queue is empty it waits for a wake-up the producer publishes after enqueueing
  (``rlmq:wake:<queue>``), for an entry of the queue's *lane*, or one second;
* the *lane* (``rlmq:lane:<queue>``, a list) is how small batches (up to 8 prompts) reach
  an idle worker: one ``BLPOP`` hands the entry to exactly one worker instead of waking
  them all, and the entry carries the requests, so a job's first budget reservation and,
  when unbudgeted, its model call start while its ``START`` is on the way (``START`` still
  decides who runs the job; a lost race cancels the early call). This is the light-load
  path (see ``bench/README.md``);
* each job runs :func:`rlmq.workers.subllm.run_sub_llm` as its own task;
* the *flush* task records finished jobs and pushes their results to their reply lists
  in one ``FINISH`` script call per flush (whatever finished meanwhile: natural batching
  under load, immediate at light load);
* the *heartbeat* task extends the started-registry scores of all in-flight jobs and the
  worker's own key every ``heartbeat_interval`` seconds;
* the *reaper* task re-queues (or fails) jobs of workers that stopped heartbeating for
  ``job_heartbeat_ttl`` seconds, so a ``kill -9`` loses no job.

RQ's records stay truthful: ``rq info`` and rq-dashboard list the worker (registered with
RQ's own ``Worker.register_birth``), the queue depth, and each job as queued, started,
finished or failed (see :mod:`rlmq.workers.records`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import socket
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import redis
from rq import Queue
from rq import Worker as RQWorker
from rq.serializers import JSONSerializer

from rlmq.common import keys as K
from rlmq.common.aio import cancel_and_wait
from rlmq.common.connection import async_client, sync_client
from rlmq.common.errors import PayloadError
from rlmq.common.ledger import BudgetLedger
from rlmq.common.metrics import Metrics
from rlmq.common.rqjobs import SUB_LLM_FUNC, decode_job_data
from rlmq.common.schemas import LaneEntry, SubLLMRequest, SubLLMResult, load_lane_entry, load_request
from rlmq.common.settings import Settings
from rlmq.workers.model import ChatClient
from rlmq.workers.records import FinishedJob, Records, StartedJob, rq_exc_string, rq_return_value
from rlmq.workers.subllm import SubLLMContext, run_sub_llm
from rlmq.workers.tools import ToolRegistry

log = logging.getLogger("rlmq.worker")
T = TypeVar("T")


async def _gather(aws: list[Coroutine[Any, Any, T]]) -> list[T]:
    """``asyncio.gather``, without its extra task and loop turn for a single awaitable (one
    queue: the usual case, and the one that counts at light load)."""
    if len(aws) == 1:
        return [await aws[0]]
    return list(await asyncio.gather(*aws))


LANE_EARLY_MAX_AGE = 1.0
"""Seconds: a lane entry older than this (producer's clock against the worker's) starts no
call before ``START``; its jobs have most likely been taken from the queue already."""


def _cancel_early(pair: tuple[asyncio.Task[None], asyncio.Future[StartedJob]]) -> None:
    """Stop an early lane call that will not run: cancel its task and its ``START`` future
    too, so the call ends at its next wait for ``START`` even if a Redis command it was in
    swallowed the task's cancellation (see :func:`rlmq.common.aio.cancel_and_wait`)."""
    task, claim = pair
    task.cancel()
    claim.cancel()


def default_worker_name() -> str:
    """``<host>.<pid>.<4 hex>``: what rq-dashboard and ``rq info`` show."""
    return f"{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:4]}"


class SubLLMWorker:
    """One worker process serving one queue (one model) with many sub-calls in flight.

    Args:
        settings: ``redis_url``, ``base_url``, ``model``, ``api_key``, ``worker_concurrency``
            (max in-flight sub-calls), ``heartbeat_interval`` / ``job_heartbeat_ttl``
            (seconds), ``job_max_attempts``, ``result_ttl``, ``model_timeout``,
            ``model_retries``, ``allowed_sub_tools`` are used.
        client_factory: builds the model client (a seam for tests); defaults to
            :class:`rlmq.workers.model.ChatClient` on ``settings.base_url``.
        name: RQ worker name; default ``host.pid.xxxx``.
        metrics: Prometheus metrics to update (in-flight, outcomes, tokens, latencies).

    Raises:
        ConfigError: ``base_url`` / ``model`` / ``redis_url`` missing.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        client_factory: Callable[[], ChatClient] | None = None,
        name: str | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        from rlmq.common.errors import ConfigError

        if not settings.redis_url:
            raise ConfigError("the worker needs --redis-url or REDIS_URL")
        if client_factory is None and not settings.base_url:
            raise ConfigError("the worker needs --base-url")
        self.settings = settings
        self.queue = settings.worker_queue()
        self.name = name or default_worker_name()
        self.concurrency = settings.worker_concurrency
        self.max_parked = (
            settings.sub_llm_budget_max_parked
            if settings.sub_llm_budget_max_parked is not None
            else 4 * settings.worker_concurrency
        )
        self.metrics = metrics or Metrics()
        self._client_factory = client_factory or (
            lambda: ChatClient(
                str(settings.base_url),
                settings.api_key.get_secret_value(),
                timeout=settings.model_timeout,
                retries=settings.model_retries,
                max_connections=max(100, self.concurrency),
            )
        )
        self._inflight: dict[str, StartedJob] = {}
        self._queue_of: dict[str, str] = {}  # in-flight member -> the queue it came from
        self._records: dict[str, Records] = {}
        self._queues: list[str] = [self.queue]
        self._wake = asyncio.Event()
        self._hints: dict[str, list[str]] = {}  # queue -> job ids named by wake-ups (idle fast path)
        self._lane_pop: asyncio.Task[LaneEntry | None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._done: list[FinishedJob] = []
        self._done_event = asyncio.Event()
        self._slot_free = asyncio.Event()
        self._running_changed = asyncio.Event()
        self._resuming = 0
        self._stopping = asyncio.Event()
        self.processed = 0

    # ------------------------------------------------------------------ lifecycle

    def _slots_changed(self) -> None:
        self._slot_free.set()
        self._running_changed.set()

    async def _resume_gate(self) -> None:
        """Hold a budgeted call that was granted after parking until it fits in ``concurrency``:
        running calls (in flight, neither parked nor held here) stay at most ``concurrency``. The
        first held call always passes when nothing else runs, so holding never deadlocks."""
        self._resuming += 1
        try:
            while len(self._inflight) - self.ledger.parked - self._resuming >= self.concurrency:
                self._running_changed.clear()
                await self._running_changed.wait()
        finally:
            self._resuming -= 1

    def request_stop(self) -> None:
        """Stop taking jobs; in-flight jobs finish (or are handed back after the grace period)."""
        self._stopping.set()
        self._slot_free.set()

    async def run(self, *, burst: bool = False, grace: float = 30.0) -> None:
        """Serve the queue until :meth:`request_stop` (or SIGTERM/SIGINT), or, with ``burst``,
        until the queue is empty and nothing is in flight.

        Args:
            burst: exit when there is no more work.
            grace: seconds in-flight jobs get to finish on shutdown before they are handed
                back to the queue.
        """
        s = self.settings
        self.redis = async_client(str(s.redis_url), max_connections=self.concurrency + 64)
        self.ledger = BudgetLedger(self.redis, ttl=s.rollout_key_ttl)
        self.ledger.on_park = self._slots_changed  # parked budget waiters give their slots back...
        self.ledger.resume_gate = self._resume_gate  # ...and take one again before calling the model
        self.ctx = SubLLMContext(
            client=self._client_factory(),
            ledger=self.ledger,
            tools=ToolRegistry.from_paths(s.allowed_sub_tools),
            worker_name=self.name,
        )
        rq_worker = self._register_birth()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
        log.info(
            "worker %s serving queue %s with up to %d sub-calls in flight", self.name, self.queue, self.concurrency
        )
        await self._discover_queues()
        aux = [
            asyncio.create_task(self._wake_listener(), name="wake"),
            asyncio.create_task(self._flush_loop(), name="flush"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._reaper_loop(), name="reaper"),
        ]
        try:
            await self._fetch_loop(burst)
            await self._drain(grace)
        finally:
            await cancel_and_wait(aux)
            with contextlib.suppress(Exception):
                await self._flush_once()
            with contextlib.suppress(NotImplementedError, RuntimeError):
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)  # a worker run in-process leaves no handler behind
            await self.ctx.client.close()
            await self.ledger.aclose()
            self._register_death(rq_worker)
            await self.redis.aclose()
            log.info("worker %s stopped after %d sub-calls", self.name, self.processed)

    def _register_birth(self) -> RQWorker:
        sync = sync_client(str(self.settings.redis_url))
        q = Queue(self.queue, connection=sync, serializer=JSONSerializer)
        w = RQWorker([q], name=self.name, connection=sync, serializer=JSONSerializer)
        w.register_birth()  # type: ignore[no-untyped-call]
        sync.hset(w.key, mapping={"state": "idle", "rlmq_concurrency": self.concurrency})
        sync.sadd(K.RQ_QUEUES, q.key)
        return w

    async def _register_again(self) -> None:
        """Register this worker's birth again: its ``rq:worker`` hash and ``rq:workers`` entries
        are gone (a Redis restarted without persistence), so ``rq info`` would not list it."""
        log.warning("worker %s: its registration is gone from Redis (restarted?); registering again", self.name)
        try:
            w = await asyncio.to_thread(self._register_birth)
        except (redis.RedisError, OSError, ValueError) as exc:
            log.warning("worker %s: could not register again (%s); will retry", self.name, exc)
            return
        with contextlib.suppress(Exception):
            w.connection.close()

    def _register_death(self, w: RQWorker) -> None:
        with contextlib.suppress(Exception):
            w.register_death()  # type: ignore[no-untyped-call]
            w.connection.close()

    async def _drain(self, grace: float) -> None:
        if self._tasks:
            log.info("worker %s: waiting up to %.0f s for %d in-flight sub-calls", self.name, grace, len(self._tasks))
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            await cancel_and_wait(pending)
        await self._flush_once()
        for queue, members in self._members_by_queue().items():
            requeued, failed = await self._records_for(queue).reap(members, hand_back=True)
            log.warning("worker %s handed back %d jobs (%d failed: out of attempts)", self.name, requeued, failed)
        self._inflight.clear()
        self._queue_of.clear()
        self.metrics.inflight(0)

    # ------------------------------------------------------------------ fetch

    def _records_for(self, queue: str) -> Records:
        rec = self._records.get(queue)
        if rec is None:
            st = self.settings
            rec = self._records[queue] = Records(
                self.redis,
                queue,
                self.name,
                heartbeat_ttl=st.job_heartbeat_ttl,
                result_ttl=st.result_ttl,
                reply_ttl=st.rollout_key_ttl,
                max_attempts=st.job_max_attempts,
                ledger=self.ledger,
            )
        return rec

    def _members_by_queue(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for member in self._inflight:
            out.setdefault(self._queue_of.get(member, self.queue), []).append(member)
        return out

    async def _discover_queues(self) -> None:
        """Find the tenant queues of this worker's queue (``rq:queues`` holds every queue key)."""
        prefix = K.rq_queue("")
        members: set[bytes] = await self.redis.smembers(K.RQ_QUEUES)  # type: ignore[assignment]
        names = {m.decode()[len(prefix) :] for m in members}
        found = sorted(q for q in names if K.serves(self.queue, q))
        if self.queue not in found:
            found.insert(0, self.queue)
        # keep the round-robin position of known queues; new ones join at the end
        self._queues = [q for q in self._queues if q in found] + [q for q in found if q not in self._queues]

    def _adopt(self, queue: str) -> bool:
        """Whether this worker serves ``queue`` (its own or one of its tenants); a tenant it
        did not know yet joins the round-robin from the next round on."""
        if not K.serves(self.queue, queue):
            return False
        if queue not in self._queues:
            self._queues.append(queue)
        return True

    async def _wake_listener(self) -> None:
        """Set the wake event on every ``rlmq:wake:<queue>`` message.

        Producers publish the name of the (tenant) queue they just enqueued on, so a new
        tenant is served at once instead of at the next discovery."""
        backoff = 0.1
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(K.wake_channel(self.queue))
                backoff = 0.1
                async for msg in pubsub.listen():
                    data = msg.get("data")
                    text = data.decode(errors="replace") if isinstance(data, bytes) else str(data)
                    queue, ids, announce_only = K.parse_wake_message(text)
                    if not self._adopt(queue):
                        continue
                    if announce_only:
                        continue  # its jobs went to the lane (an idle worker pops them)
                    if ids:  # a small batch named its jobs: an idle worker takes them directly
                        self._hints.setdefault(queue, []).extend(ids)
                    self._wake.set()
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                await asyncio.sleep(backoff)  # reconnect backoff
                backoff = min(backoff * 2, 5.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def _fetch_loop(self, burst: bool) -> None:
        backoff = 0.1
        last_discovery = time.monotonic()
        idle = False
        after_lane = False  # the last round served a lane entry: peek again only when woken
        try:
            while not self._stopping.is_set():
                free = self.concurrency - len(self._inflight) + min(self.ledger.parked, self.max_parked)
                entry = self._popped_lane_entry()
                if entry is not None and (free <= 0 or not (idle or after_lane)):
                    # Popped by a pop left waiting from an idle spell, but this worker has found
                    # queued work since: taking the entry's jobs now would put them ahead of older
                    # jobs on their queue. They stay in queue order; the others are woken.
                    self._adopt(entry.queue)
                    with contextlib.suppress(redis.RedisError, OSError):
                        await self._pass_on(entry)
                    entry = None
                if free <= 0:
                    self._slot_free.clear()
                    slot = asyncio.create_task(self._slot_free.wait())
                    await asyncio.wait({slot} | ({self._lane_pop} if self._lane_pop else set()),
                                       return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                    slot.cancel()
                    continue
                try:
                    if time.monotonic() - last_discovery > 1.0:
                        await self._discover_queues()
                        last_discovery = time.monotonic()
                    if entry is not None:
                        await self._take_lane_entry(entry, free)
                        idle, after_lane, backoff = False, True, 0.1
                        continue
                    woken = self._wake.is_set()
                    self._wake.clear()
                    hints, self._hints = self._hints, {}
                    queues = list(self._queues)
                    peeked: list[list[bytes]]
                    if idle and hints:
                        # Idle worker, woken by a batch that named its jobs: take them without
                        # peeking (one round trip saved). Jobs another worker took first are
                        # skipped by START; under load the round-robin peek below decides instead.
                        peeked = [[j.encode() for j in hints.get(q, [])][:free] for q in queues]
                    elif after_lane and not woken and not hints:
                        peeked = []  # nothing announced since the lane entry: wait for the next one
                    else:
                        share = max(1, -(-free // len(queues)))  # ceil: an equal share of the free slots each
                        async with self.redis.pipeline(transaction=False) as pipe:
                            for q in queues:
                                pipe.lrange(K.rq_queue(q), 0, min(share, 500) - 1)
                            peeked = await pipe.execute()
                    idle = after_lane = False
                    if not any(peeked):
                        idle = True
                        if burst and not self._inflight:
                            return
                        await self._wait_for_work(burst)
                        if time.monotonic() - last_discovery > 0.5:
                            last_discovery = 0.0  # an idle worker looks for new tenant queues sooner
                        continue
                    taken = [(q, ids) for q, ids in zip(queues, peeked, strict=True) if ids]
                    started_by_queue = await _gather([self._records_for(q).start(ids) for q, ids in taken])
                    # rotate so the next round starts with the next queue
                    self._queues = self._queues[1:] + self._queues[:1]
                    backoff = 0.1
                except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                    log.warning("worker %s: Redis unavailable (%s); retrying in %.1f s", self.name, exc, backoff)
                    self.metrics.reconnect()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._stopping.wait(), backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                for (q, _), started in zip(taken, started_by_queue, strict=True):
                    for job in started:
                        self._spawn(job, q, self._run_job(job))
                self.metrics.inflight(len(self._inflight))
        finally:
            await self._stop_lane_pop()

    async def _wait_for_work(self, burst: bool) -> None:
        """Wait (at most a second) for a wake-up, a lane entry, a stop, or in burst mode a free slot."""
        waiter = asyncio.create_task(self._wake.wait())
        stop = asyncio.create_task(self._stopping.wait())
        slot = asyncio.create_task(self._slot_free.wait()) if burst else None
        pending = {waiter, stop} | ({slot} if slot else set())
        if not burst and self._lane_pop is None:
            self._lane_pop = asyncio.create_task(self._pop_lane(), name="lane")
        await asyncio.wait(
            pending | ({self._lane_pop} if self._lane_pop else set()), timeout=1.0, return_when=asyncio.FIRST_COMPLETED
        )
        for t in pending:
            t.cancel()  # the lane pop stays pending across rounds: cancelling it could drop an entry
        self._slot_free.clear()

    # ------------------------------------------------------------------ the lane

    async def _pop_lane(self) -> LaneEntry | None:
        """Wait up to a second for one entry of this queue's lane (``None``: none came)."""
        try:
            got = await self.redis.blpop([K.lane(self.queue)], timeout=1)
        except (redis.RedisError, OSError):
            await asyncio.sleep(0.1)  # reconnect backoff; the fetch loop reports the outage
            return None
        if got is None:
            return None
        try:
            return load_lane_entry(got[1])
        except PayloadError as exc:
            log.warning("worker %s: dropped an invalid lane entry (%s)", self.name, exc)
            return None

    def _popped_lane_entry(self) -> LaneEntry | None:
        """The entry the lane pop brought, once it is done (then a new pop may start)."""
        t = self._lane_pop
        if t is None or not t.done():
            return None
        self._lane_pop = None
        if t.cancelled() or t.exception() is not None:
            return None
        return t.result()

    async def _stop_lane_pop(self) -> None:
        """On the way out: cancel a pending lane pop, or pass on an entry it already brought."""
        t = self._lane_pop
        if t is not None and not t.done():
            await cancel_and_wait([t])
        entry = self._popped_lane_entry()
        self._lane_pop = None
        if entry is not None:
            with contextlib.suppress(redis.RedisError, OSError):
                await self._pass_on(entry)

    async def _pass_on(self, entry: LaneEntry) -> None:
        """Wake the other workers for a lane entry this worker does not take. The wake-up
        does not name the jobs: they never left their queue, and a woken worker takes them
        in queue order, behind any older ones."""
        await self.redis.publish(K.wake_channel(entry.queue), K.wake_message(entry.queue))

    async def _take_lane_entry(self, entry: LaneEntry, free: int) -> None:
        """Take the jobs of a lane entry with ``START``, starting each fresh one while ``START`` is on the way.

        A job whose request the entry carries starts *before* ``START`` answers (the
        light-load latency saving): an unbudgeted one calls the model at once; a budgeted one
        makes its first reservation at once but waits for ``START`` before calling the model
        (the reservation id ``<job>:<attempt>:<turn>`` is the same whichever worker makes it,
        ``START`` never grants one attempt twice, and only the execution ``START`` granted
        spends it, so the budget stays exact).
        ``START`` still decides who runs the job: when another worker took it first (it
        peeked the queue in the fraction of a millisecond between the enqueue and this
        ``START``), the early call is cancelled and counted as ``lost``. An entry older than
        ``LANE_EARLY_MAX_AGE`` (by the two hosts' clocks) starts nothing early: its jobs are
        likely gone, or re-queued as a later attempt (then the early reservation, never
        spent, would stay charged in full: a waste of budget, never an overshoot).
        """
        queue = entry.queue
        if not self._adopt(queue):
            log.warning("worker %s: lane entry for queue %s it does not serve", self.name, queue)
            return
        jobs = entry.jobs[:free]
        if len(jobs) < len(entry.jobs):
            await self._pass_on(LaneEntry(queue=queue, enqueued_at=entry.enqueued_at, jobs=entry.jobs[free:]))
        early: dict[str, tuple[asyncio.Task[None], asyncio.Future[StartedJob]]] = {}
        if abs(time.time() - entry.enqueued_at) <= LANE_EARLY_MAX_AGE:
            loop = asyncio.get_running_loop()
            for j in jobs:
                if j.request is not None:
                    claim: asyncio.Future[StartedJob] = loop.create_future()
                    task = asyncio.create_task(self._call(j.request, j.job_id, 1, claim))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                    early[j.job_id] = (task, claim)
            if early:
                await asyncio.sleep(0)  # yield once: the early calls go out before START does
        try:
            started = await self._records_for(queue).start([j.job_id.encode() for j in jobs])
        except BaseException:
            for early_call in early.values():
                _cancel_early(early_call)
            raise
        for job in started:
            pair = early.pop(job.job_id, None)
            if pair is not None and job.attempt == 1:
                self._track(job, queue)
                pair[1].set_result(job)
                self.metrics.lane_job("early")
            else:
                if pair is not None:  # a re-queued job (attempt > 1): run it from its own record
                    _cancel_early(pair)
                self._spawn(job, queue, self._run_job(job))
                self.metrics.lane_job("after_start")
        for early_call in early.values():  # another worker took these first
            _cancel_early(early_call)
            self.metrics.lane_job("lost")
        self.metrics.inflight(len(self._inflight))

    # ------------------------------------------------------------------ one job

    def _track(self, job: StartedJob, queue: str) -> None:
        self._inflight[job.member] = job
        self._queue_of[job.member] = queue

    def _spawn(self, job: StartedJob, queue: str, coro: Coroutine[Any, Any, None]) -> None:
        self._track(job, queue)
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_job(self, job: StartedJob) -> None:
        try:
            request = self._decode(job)
        except PayloadError as exc:
            self._record(job, self._payload_error(job, str(exc)), [])
            return
        await self._call(request, job.job_id, job.attempt, job)

    async def _call(
        self, request: SubLLMRequest, job_id: str, attempt: int, job: StartedJob | asyncio.Future[StartedJob]
    ) -> None:
        """Run one sub-call; ``job`` is a future when the call started before ``START`` answered."""
        settles: list[tuple[str, str, int]] = []
        gate = job if isinstance(job, asyncio.Future) else None  # awaited only if the call is budgeted
        # The call's last budget settlement rides with this job's FINISH round trip.
        result = await run_sub_llm(
            request,
            self.ctx,
            job_id=job_id,
            attempt=attempt,
            started_at=time.time(),
            settle_out=settles,
            gate=gate,
        )
        if isinstance(job, asyncio.Future):
            job = await job
        self._record(job, result, settles)

    def _record(self, job: StartedJob, result: SubLLMResult, settles: list[tuple[str, str, int]]) -> None:
        ok = result.status != "error"
        summary = {
            "status": result.status,
            "completion_tokens": result.completion_tokens,
            "turns": result.turns,
            "seconds": round(result.seconds, 3),
        }
        payload = (
            rq_return_value(summary) if ok else rq_exc_string(f"{result.error_kind}: {result.error or result.content}")
        )
        self.metrics.observe_result(result)
        self._done.append(
            FinishedJob(job=job, ok=ok, result_json=result.model_dump_json(), rq_payload=payload, settles=settles)
        )
        self._done_event.set()
        self.processed += 1

    def _decode(self, job: StartedJob) -> SubLLMRequest:
        try:
            func, args, kwargs = decode_job_data(job.data)
        except ValueError as exc:
            raise PayloadError(str(exc)) from exc
        if func != SUB_LLM_FUNC or len(args) != 1 or kwargs:
            raise PayloadError(f"not an rlmq sub-LLM job: {func}")
        return load_request(args[0])

    def _payload_error(self, job: StartedJob, message: str) -> SubLLMResult:
        rollout, batch, index = "unknown", "unknown", 0
        parts = job.job_id.split("-")
        if len(parts) >= 3 and parts[-1].isdigit():
            rollout, batch, index = "-".join(parts[:-2]), parts[-2], int(parts[-1])
        return SubLLMResult(
            rollout_id=rollout,
            batch_id=batch,
            index=index,
            job_id=job.job_id,
            status="error",
            error_kind="payload",
            content=f"[error] invalid sub-LLM job: {message}",
            error=message,
            worker=self.name,
            attempt=job.attempt,
        )

    # ------------------------------------------------------------------ flush

    async def _flush_loop(self) -> None:
        while True:
            await self._done_event.wait()
            try:
                await self._flush_once()
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                log.warning("worker %s: could not record results (%s); retrying", self.name, exc)
                self.metrics.reconnect()
                await asyncio.sleep(0.5)  # backoff before retrying the same results, not synchronisation

    async def _flush_once(self) -> None:
        self._done_event.clear()
        if not self._done:
            return
        batch, self._done = self._done, []
        by_queue: dict[str, list[FinishedJob]] = {}
        for d in batch:
            by_queue.setdefault(self._queue_of.get(d.job.member, self.queue), []).append(d)
        try:
            await _gather([self._records_for(q).finish(b) for q, b in by_queue.items()])
        except BaseException:
            self._done = batch + self._done
            self._done_event.set()
            raise
        for d in batch:
            self._inflight.pop(d.job.member, None)
            self._queue_of.pop(d.job.member, None)
        self.metrics.inflight(len(self._inflight))
        self._slots_changed()

    # ------------------------------------------------------------------ heartbeat & reaper

    async def _heartbeat_loop(self) -> None:
        interval = self.settings.heartbeat_interval
        while True:
            try:
                by_queue = self._members_by_queue()
                state = "busy" if self._inflight else "idle"
                if not by_queue:
                    by_queue = {self.queue: []}
                if not await self.redis.exists(K.rq_worker(self.name)):
                    await self._register_again()  # Redis restarted (or flushed): it forgot this worker
                await asyncio.gather(*(self._records_for(q).heartbeat(m, state) for q, m in by_queue.items()))
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                log.warning("worker %s: heartbeat failed (%s)", self.name, exc)
                self.metrics.reconnect()
            await asyncio.sleep(interval)  # periodic timer, not synchronisation

    async def _reaper_loop(self) -> None:
        interval = max(0.5, self.settings.job_heartbeat_ttl / 4)
        while True:
            await asyncio.sleep(interval * (0.5 + random.random()))  # jittered timer across the fleet
            try:
                for queue in list(self._queues):
                    rec = self._records_for(queue)
                    expired = [m for m in await rec.expired_members() if m not in self._inflight]
                    if not expired:
                        continue
                    requeued, failed = await rec.reap(expired)
                    if requeued or failed:
                        log.warning(
                            "worker %s: took back %d abandoned jobs (%d re-queued, %d failed)",
                            self.name, len(expired), requeued, failed,
                        )  # fmt: skip
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                log.warning("worker %s: reaper failed (%s)", self.name, exc)
