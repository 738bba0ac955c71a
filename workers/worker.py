"""The concurrent sub-LLM worker: one process, hundreds of sub-calls in flight.

A stock RQ worker runs one job at a time, which wastes a process on every in-flight
LLM call. This worker runs on one asyncio loop, in three parts:

* :class:`SubLLMWorker` (here): the lifecycle (start, serve, drain, stop) and the running
  of jobs: each job runs its kind's run as its own task (:mod:`rlmq.workers.kinds`; the sub-LLM
  kind, :mod:`rlmq.workers.subllm_kind`, runs :func:`rlmq.workers.subllm.run_sub_llm`), holding a
  slot of its queue's capacity pool (:mod:`rlmq.workers.capacity`; a worker started with
  ``--repl-slots`` also runs child rollouts, :mod:`rlmq.workers.child_kind`, on the rollout host
  of :mod:`rlmq.workers.child_host`, from one child queue per depth), and the
  *flush* task records finished jobs and adds their results to their reply streams in one
  ``FINISH`` script call per flush (whatever finished meanwhile: natural batching under
  load, immediate at light load);
* :class:`rlmq.workers.fetch.Fetcher`: which jobs to take, from which queue, and when to
  wake up (round-robin over tenant queues, wake-ups, the small-batch lane);
* :class:`rlmq.workers.upkeep.Upkeep`: RQ registration, the heartbeat, the reaper.

What the parts share (in-flight jobs, their tasks, finished jobs not yet recorded) is an
:class:`rlmq.workers.inflight.InFlight`, ``worker.jobs``.

Every long-lived task (fetch, flush, heartbeat, reaper, wake listener) runs under
:func:`rlmq.common.supervise.supervised`: an unexpected error is logged and the task is
restarted with backoff; one that keeps failing stops the worker, which hands its jobs back
and raises :class:`~rlmq.common.errors.WorkerFailed`, so its process exits non-zero and its
supervisor starts a fresh one. A worker is never alive doing nothing.

RQ's records stay truthful: ``rq info`` and rq-dashboard list the worker (registered with
RQ's own ``Worker.register_birth``), the queue depth, and each job as queued, started,
finished or failed (see :mod:`rlmq.common.jobs.store`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import redis
from redis.asyncio import Redis

from rlmq.common import keys as K
from rlmq.common.aio import cancel_and_wait
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.errors import ConfigError, PayloadError, WorkerFailed
from rlmq.common.fleet_checks import check_eviction_policy, report_clock
from rlmq.common.jobs.store import FinishedJob, JobStore, StartedJob
from rlmq.common.metrics import Metrics
from rlmq.common.settings import Settings
from rlmq.common.supervise import supervised
from rlmq.common.token_servers import TokenFieldsLog
from rlmq.workers.capacity import MODEL_CALLS, Capacity, PoolSpec, hosted_depths, pool_family, pool_of_queue, repl_pool
from rlmq.workers.fetch import Fetcher
from rlmq.workers.inflight import InFlight
from rlmq.workers.kinds import JobKind, KindRegistry, Outcome, check_slot
from rlmq.workers.model import ChatClient
from rlmq.workers.provider_transport import model_transport
from rlmq.workers.subllm import SubLLMContext
from rlmq.workers.subllm_kind import SubLLMKind
from rlmq.workers.tools import ToolRegistry
from rlmq.workers.upkeep import Upkeep

if TYPE_CHECKING:
    from rq import Worker as RQWorker

    from rlmq.workers.child_host import ChildHost
    from rlmq.workers.child_kind import ChildKind

log = logging.getLogger("rlmq.worker")


FLUSH_GIVE_UP = 30.0
"""Seconds a batch of finished jobs may keep failing to be recorded (error replies such as
``READONLY`` or ``OOM``; a lost connection waits for ever, the jobs' heartbeats stop with it)
before the worker lets go of them: it stops heartbeating them, so the reaper of any worker
re-queues them once Redis takes writes again. Slower, never lost."""


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The signals that request a worker's stop (a second one hands its in-flight jobs back at once)."""


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

    redis: Redis
    """The worker's Redis client (made by :meth:`run`)."""
    ledger: BudgetLedger
    """The budget ledgers of the sub-calls and children it runs (made by :meth:`run`)."""
    ctx: SubLLMContext
    """What its sub-calls run with: model client, ledger, tools (made by :meth:`run`)."""

    def __init__(
        self,
        settings: Settings,
        *,
        client_factory: Callable[[], ChatClient] | None = None,
        name: str | None = None,
        metrics: Metrics | None = None,
    ) -> None:
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
        """Budgeted calls parked for a release that do not count against ``concurrency``."""
        self.capacity = Capacity({MODEL_CALLS: PoolSpec(self.concurrency, self.max_parked)})
        """The worker's capacity pools (model-call slots: ``concurrency``)."""
        self.kinds = KindRegistry()
        """The job kinds this worker runs: the sub-LLM call; with ``repl_slots`` > 0 the child rollout too."""
        self.repl_slots = settings.repl_slots
        """Child rollouts hosted at once per depth (0: this worker hosts none)."""
        self.child_host: ChildHost | None = None
        """The rollout host of the child rollouts (``repl_slots`` > 0; started by :meth:`run`)."""
        self.children: ChildKind | None = None
        """The child-rollout kind (``repl_slots`` > 0)."""
        self.sub_llm = self._register_kinds()
        self.metrics = metrics or Metrics()
        self.token_fields_log = TokenFieldsLog()
        """Says once for this worker (its sub-calls and its children's root turns) that its server
        answers no token field rlmq reads."""
        self._client_factory = client_factory or self._model_client
        self.jobs = InFlight(self.queue, self.capacity)
        """In-flight jobs, their tasks, finished jobs waiting to be recorded."""
        self.fetcher = Fetcher(self, lane_early_calls=settings.lane_early_calls)
        self.upkeep = Upkeep(self)
        self.stopping = asyncio.Event()
        self._hurry = asyncio.Event()  # a second stop request: hand in-flight jobs back now
        self._flush_lock = asyncio.Lock()  # one FINISH round at a time (see _flush_once)
        self.processed = 0
        """Sub-calls that produced a result (recorded or about to be)."""
        self.failure: tuple[str, BaseException] | None = None
        """The task that kept failing and its last error, when one stopped the worker."""
        self._records: dict[str, JobStore] = {}

    def _register_kinds(self) -> SubLLMKind:
        """Register the job kinds this worker runs (the sub-LLM call; with ``repl_slots`` > 0 the
        child rollout, its host and one REPL pool per depth); returns the sub-LLM kind."""
        settings = self.settings
        sub_llm = SubLLMKind(self)
        self.kinds.register(sub_llm.kind(max_attempts=settings.job_max_attempts))
        if self.repl_slots > 0:
            # Imported here: the rollout engine brings the root model's client (openai), which a
            # worker that hosts no REPL never needs (it would double its start-up time and memory).
            from rlmq.workers.child_host import ChildHost
            from rlmq.workers.child_kind import ChildKind

            self.child_host = ChildHost(self)
            self.children = ChildKind(self)
            for depth in self.child_depths:
                self.capacity.add_pool(repl_pool(depth), PoolSpec(self.repl_slots))
            self.kinds.register(self.children.kind(max_attempts=settings.job_max_attempts))
        return sub_llm

    def _model_client(self) -> ChatClient:
        """The model client of the worker's sub-calls (``base_url``, ``api_key``, ``model_timeout``,
        ``model_retries``, ``token_ids_api``), through the fleet's provider limits when declared;
        built by :meth:`run`, on its Redis client."""
        settings = self.settings
        return ChatClient(
            str(settings.base_url),
            settings.api_key.get_secret_value(),
            timeout=settings.model_timeout,
            retries=settings.model_retries,
            transport=model_transport(  # fleet-wide provider limits, when declared
                settings,
                self.queue,
                self.redis,
                name=self.name,
                max_connections=max(100, self.concurrency),
                metrics=self.metrics,
            ),  # fmt: skip
            token_api=settings.token_api(),
        )

    # ------------------------------------------------------------------ lifecycle

    def request_stop(self) -> None:
        """Stop taking jobs; in-flight jobs finish (or are handed back after the grace period).
        A second request (a second SIGINT / SIGTERM / SIGHUP) hands them back at once."""
        if self.stopping.is_set() and self.failure is None:
            log.warning("worker %s: stop requested again: handing back in-flight sub-calls now", self.name)
            self._hurry.set()
        self.stopping.set()
        self.jobs.slot_free.set()

    def _give_up(self, task: str, exc: BaseException) -> None:
        """A supervised task kept failing: stop the worker (``run`` then raises WorkerFailed)."""
        if self.failure is None:
            self.failure = (task, exc)
        self.request_stop()

    async def _resume_gate(self) -> None:
        """Hold a budgeted call that was granted after parking until it fits in ``concurrency``:
        running calls (held, neither parked nor held here) stay at most ``concurrency``. The
        first held call always passes when nothing else runs, so holding never deadlocks."""
        self.capacity.enter_resume(MODEL_CALLS)
        try:
            while not self.ledger.abandoning and self.capacity.must_wait(MODEL_CALLS):
                self.jobs.running_changed.clear()
                await self.jobs.running_changed.wait()
        finally:
            self.capacity.leave_resume(MODEL_CALLS)

    def _parked_changed(self) -> None:
        """The ledger's parked calls changed: they give their model-call slots back (or take them)."""
        self.capacity.set_parked(MODEL_CALLS, self.ledger.parked)
        self.jobs.slots_changed()

    async def run(self, *, burst: bool = False, grace: float = 30.0) -> None:
        """Serve the queue until :meth:`request_stop` (or SIGTERM/SIGINT), or, with ``burst``,
        until the queue is empty and nothing is in flight.

        Args:
            burst: exit when there is no more work.
            grace: seconds in-flight jobs get to finish on shutdown before they are handed
                back to the queue.

        Raises:
            WorkerFailed: a long-lived task kept failing (after the worker handed its jobs
                back and unregistered).
        """
        await self._connect()
        self._make_context()
        rq_worker = self.upkeep.register_birth()
        loop = asyncio.get_running_loop()
        self._handle_signals(loop)
        log.info(
            "worker %s serving queue %s with up to %d sub-calls in flight", self.name, self.queue, self.concurrency
        )
        await self.fetcher.discover_queues()
        aux = self._start_tasks()
        try:
            await supervised("fetch", lambda: self.fetcher.fetch_loop(burst), on_give_up=self._give_up)
            await self._drain(grace)
        finally:
            await self._close(aux, rq_worker, loop)
        if self.failure is not None:
            task, exc = self.failure
            raise WorkerFailed(f"worker {self.name}: its {task} task kept failing ({type(exc).__name__}: {exc})")

    async def _connect(self) -> None:
        """Make the Redis client and check the server (its eviction policy, its clock); start the
        rollout host of a REPL-hosting worker. Nothing is left open when it raises.

        Raises:
            ConfigError: Redis may evict rlmq's keys (and ``allow_evicting_redis`` is off).
            UncontainedReplError: a REPL host's REPL is not contained (see :meth:`ChildHost.start`).
        """
        s = self.settings
        # one blocking connection per llm_batch in flight: a hosted child rollout has one at a time
        hosted = self.repl_slots * len(self.child_depths)
        self.redis = async_client(
            str(s.redis_url), max_connections=self.concurrency + 64 + hosted,
            replica_acks=s.redis_replica_acks, replica_ack_timeout=s.redis_replica_ack_timeout,
        )  # fmt: skip
        try:
            await check_eviction_policy(self.redis, allow=s.allow_evicting_redis)
            await report_clock(self.redis, f"worker {self.name}")
            if self.child_host is not None:
                await self.child_host.start()  # refuses an uncontained REPL (UncontainedReplError)
        except BaseException:
            await self.redis.aclose()
            raise

    def _make_context(self) -> None:
        """Make the budget ledger and what the sub-calls run with (``ctx``) on the worker's Redis."""
        s = self.settings
        # each ledger's TTL is stored in it: never this worker's; the lease of grants not begun is this worker's
        self.ledger = BudgetLedger(self.redis, grant_lease=s.sub_llm_budget_grant_lease)
        self.ledger.on_park = self._parked_changed  # parked budget waiters give their slots back...
        self.ledger.resume_gate = self._resume_gate  # ...and take one again before calling the model
        self.ctx = SubLLMContext(
            client=self._client_factory(),
            ledger=self.ledger,
            tools=ToolRegistry.from_paths(s.allowed_sub_tools, max_output_chars=s.sub_tool_max_result_chars),
            worker_name=self.name,
            frozen=s.frozen_fleet,
            continuation=s.sub_llm_continuation,
            redis=self.redis,
            turn_token_max_ids=s.turn_token_max_ids,
        )
        self.ctx.client.token_fields_log = self.token_fields_log  # one warning per worker, children's roots too

    def _handle_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        """SIGTERM, SIGINT and SIGHUP request a stop (a signal the process ignores stays ignored)."""
        with contextlib.suppress(NotImplementedError, RuntimeError):
            for sig in STOP_SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:  # `nohup rlmq worker` keeps SIGHUP ignored
                    loop.add_signal_handler(sig, self.request_stop)

    def _start_tasks(self) -> list[asyncio.Task[None]]:
        """Start the long-lived tasks beside the fetch loop, each supervised: the wake listener,
        the flush, the heartbeat, the reaper, and a REPL host's refresh of its children."""

        def keep(name: str, body: Callable[[], object]) -> asyncio.Task[None]:
            return asyncio.create_task(supervised(name, body, on_give_up=self._give_up), name=name)  # type: ignore[arg-type]

        aux = [
            keep("wake", self.fetcher.wake_listener),
            keep("flush", self._flush_loop),
            keep("heartbeat", self.upkeep.heartbeat_loop),
            keep("reaper", self.upkeep.reaper_loop),
        ]
        if self.child_host is not None:
            aux.append(keep("children", self.child_host.refresh_forever))
        return aux

    async def _close(self, aux: list[asyncio.Task[None]], rq_worker: RQWorker, loop: asyncio.AbstractEventLoop) -> None:
        """Stop the tasks ``aux``, record what finished, remove the signal handlers, close the
        model client, the rollout host and the ledger, unregister, and close the Redis client."""
        await cancel_and_wait(aux)
        with contextlib.suppress(Exception):
            await self._flush_once()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)  # a worker run in-process leaves no handler behind
        await self.ctx.client.close()
        if self.child_host is not None:
            await self.child_host.close()
        await self.ledger.aclose()
        self.upkeep.register_death(rq_worker)
        await self.redis.aclose()
        log.info("worker %s stopped after %d sub-calls", self.name, self.processed)

    async def _drain(self, grace: float) -> None:
        # Parked budget calls are not granted while the worker stops: their jobs are handed
        # back unrun (their model calls would start inside the grace period and could be cut
        # at its end, leaving their grants charged in full).
        self.ledger.abandon_waits()
        self.jobs.running_changed.set()  # a call held by the resume gate re-checks (and is handed back)
        tasks = self.jobs.tasks
        if tasks:
            log.info("worker %s: waiting up to %.0f s for %d in-flight sub-calls", self.name, grace, len(tasks))
            running = set(tasks)
            waiters = {asyncio.ensure_future(asyncio.wait(running)), asyncio.ensure_future(self._hurry.wait())}
            await asyncio.wait(waiters, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
            await cancel_and_wait(waiters | {t for t in running if not t.done()})
        # Waits for a FINISH round the flush task may have in flight: the jobs it carries are
        # still tracked until it returns, and handing them back now would run them twice.
        with contextlib.suppress(redis.RedisError, OSError):
            await self._flush_once()
        for queue, members in self.jobs.members_by_queue().items():
            try:
                requeued, failed = await self.records_for(queue).reap(members, hand_back=True)
            except (redis.RedisError, OSError) as exc:
                log.warning(
                    "worker %s: could not hand back %d jobs (%s); the reaper will", self.name, len(members), exc
                )
                continue
            log.warning("worker %s handed back %d jobs (%d failed: out of attempts)", self.name, requeued, failed)
        self.jobs.clear()
        self.update_gauge()

    @property
    def child_depths(self) -> range:
        """The depths of the child rollouts this worker hosts (empty when ``repl_slots`` is 0)."""
        return hosted_depths(self.repl_slots)

    def child_queues(self) -> list[str]:
        """The child-rollout queues of this worker's model it serves, one per depth (tenants aside)."""
        return [K.child_queue(self.queue, d) for d in self.child_depths]

    def pool_of_queue(self, queue: str) -> str | None:
        """The pool the jobs of ``queue`` take here (see :func:`rlmq.workers.capacity.pool_of_queue`)."""
        return pool_of_queue(self.queue, queue, self.repl_slots)

    def kind_of_queue(self, queue: str) -> JobKind:
        """The kind the jobs of ``queue`` are (its failure and abandoned results are that kind's)."""
        return self.kinds.for_pool(self.pool_of_queue(queue))

    def records_for(self, queue: str) -> JobStore:
        """The RQ bookkeeping of this worker on ``queue`` (one per queue served)."""
        rec = self._records.get(queue)
        if rec is None:
            st = self.settings
            kind = self.kind_of_queue(queue)
            rec = self._records[queue] = JobStore(
                self.redis,
                queue,
                self.name,
                heartbeat_ttl=st.job_heartbeat_ttl,
                result_ttl=st.result_ttl,
                max_attempts=kind.max_attempts,
                ledger=self.ledger,
                abandoned_result=kind.abandoned,
            )
        return rec

    def update_gauge(self) -> None:
        """Set the in-flight gauge to the sub-calls still running (see :attr:`InFlight.running`)."""
        self.metrics.inflight(self.jobs.running)

    # ------------------------------------------------------------------ one job

    def spawn(self, job: StartedJob, queue: str) -> None:
        """Hold ``job`` (taken from ``queue``) with a slot of its queue's pool and run it as a task
        of its own. A job of a kind its queue does not carry (a sub-call on a child queue, a
        child of another depth) gets its queue's kind's payload error instead."""
        served = self.pool_of_queue(queue)  # None: a queue named by no rule here (a test's)
        try:
            kind, payload = self.kinds.decode(job.data)
            check_slot(job.job_id, payload)
            pool = served or kind.pool
            if kind.pool != pool_family(pool):
                raise PayloadError(f"a {kind.name} job on queue {queue}, which carries other jobs")
            if kind.check_pool is not None:
                kind.check_pool(payload, pool, queue)
        except PayloadError as exc:
            kind = self.kind_of_queue(queue)
            pool = served or kind.pool
            self.jobs.track(job, queue, pool)
            self.finish_job(job, kind.failure(job.job_id, None, "payload", str(exc), job.attempt))
            return
        self.jobs.track(job, queue, pool)
        self.jobs.add_task(self._run_job(job, kind, payload))

    async def _run_job(self, job: StartedJob, kind: JobKind, payload: object) -> None:
        try:
            if kind.timeout is None:  # the hot path: the payload's own deadline bounds it
                outcome = await kind.run(payload, job)
            else:
                async with asyncio.timeout(kind.timeout):
                    outcome = await kind.run(payload, job)
        except TimeoutError as exc:
            if kind.timeout is None:
                outcome = kind.failure(job.job_id, None, "host", f"TimeoutError: {exc}", job.attempt)
            else:
                message = f"ran past its kind's timeout of {kind.timeout:g} s on worker {self.name}"
                outcome = kind.failure(job.job_id, None, "timeout", message, job.attempt)
        except Exception as exc:  # a bug: the job still ends (a held job would hang its caller until its deadline)
            log.exception("worker %s: %s job %s failed", self.name, kind.name, job.job_id)
            outcome = kind.failure(job.job_id, None, "host", f"{type(exc).__name__}: {exc}", job.attempt)
        self.finish_job(job, outcome)

    def finish_job(self, job: StartedJob, outcome: Outcome) -> None:
        """Hand a finished job to the flush (its result reaches the producer with the next ``FINISH``)."""
        self.processed += 1
        self.jobs.finished(
            FinishedJob(
                job=job, ok=outcome.ok, result_json=outcome.result_json, rq_payload=outcome.rq_payload,
                settles=outcome.settles, spill_key=outcome.spill_key,
            )
        )  # fmt: skip
        self.update_gauge()  # before the flush: no producer sees the result while it still counts

    # ------------------------------------------------------------------ flush

    async def _flush_loop(self) -> None:
        """Record finished jobs as they come, for ever; Redis errors are retried with backoff,
        and a batch that keeps getting error replies is let go after :data:`FLUSH_GIVE_UP`."""
        failing_since: float | None = None
        backoff = 0.1
        while True:
            await self.jobs.done_event.wait()
            try:
                await self._flush_once()
                failing_since, backoff = None, 0.1
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                log.warning("worker %s: could not record results (%s); retrying", self.name, exc)
                self.metrics.reconnect()
                await asyncio.sleep(backoff)  # backoff before retrying the same results, not synchronisation
                backoff = min(backoff * 2, 2.0)
            except redis.exceptions.NoPermissionError:
                raise  # not transient: supervised (restarted, then the worker stops)
            except redis.RedisError as exc:  # an error reply: READONLY, MISCONF, OOM, ...
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since >= FLUSH_GIVE_UP:
                    self._let_go(exc)
                    failing_since = None
                else:
                    log.warning("worker %s: Redis refused to record results (%s); retrying", self.name, exc)
                    await asyncio.sleep(backoff)  # backoff before retrying the same results
                    backoff = min(backoff * 2, 2.0)

    def _let_go(self, exc: BaseException) -> None:
        """Stop holding the finished jobs Redis keeps refusing: the reaper re-queues them."""
        batch = self.jobs.take_done()
        self.jobs.release([d.job.member for d in batch])
        log.error(
            "worker %s: Redis refused to record %d results for %.0f s (%s); letting the reaper re-queue them",
            self.name, len(batch), FLUSH_GIVE_UP, exc,
        )  # fmt: skip

    async def _flush_once(self) -> None:
        """Record the finished jobs held now (one FINISH per queue, in one round trip).

        Serialised by a lock: the flush task and the shutdown path (``_drain``) may both call
        it, and a caller that finds a round in flight waits for it instead of seeing an empty
        list while those jobs are still tracked as in flight.
        """
        async with self._flush_lock:
            await self._flush_held()

    async def _drop_unrecorded_spills(self, batch: list[FinishedJob]) -> None:
        """Delete the spilled payloads of ``batch``'s results that ``FINISH`` did not record (no
        result entry of their execution): their jobs were taken back while this worker was
        stopped, nobody will read them, and they would stay until their TTL otherwise."""
        spilled = [d for d in batch if d.spill_key is not None]
        if not spilled:
            return
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for d in spilled:
                    pipe.xrevrange(K.rq_results(d.job.job_id), count=10)
                entries = await pipe.execute()
            eid = b"execution_id"
            stale = [
                d.spill_key for d, got in zip(spilled, entries, strict=True)
                if d.spill_key is not None and not any(f.get(eid) == d.job.execution_id.encode() for _, f in got or [])
            ]  # fmt: skip
            if stale:
                await self.redis.delete(*stale)
        except redis.RedisError as exc:  # the TTL still ends them
            log.warning("worker %s: could not delete unrecorded spilled payloads: %s", self.name, exc)

    async def _flush_held(self) -> None:
        batch = self.jobs.take_done()
        if not batch:
            return
        by_queue: dict[str, list[FinishedJob]] = {}
        for d in batch:
            by_queue.setdefault(self.jobs.queue_of(d.job.member), []).append(d)
        try:
            outcomes = await asyncio.gather(*(self.records_for(q).finish(b) for q, b in by_queue.items()))
        except BaseException:
            self.jobs.put_back(batch)
            raise
        if sum(r for r, _ in outcomes) < len(batch):  # some were taken back (and re-run) meanwhile
            await self._drop_unrecorded_spills(batch)
        undeliverable = sum(u for _, u in outcomes)
        if undeliverable:
            log.error("worker %s: %d results had a reply key that is not a stream; recorded as failed",
                      self.name, undeliverable)  # fmt: skip
        self.jobs.release([d.job.member for d in batch])
        self.update_gauge()
