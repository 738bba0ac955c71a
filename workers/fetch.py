"""A worker's fetching: which jobs it takes, from which queue, and when it wakes up.

* the *fetch* loop serves the model's queue and all its tenant queues (``<queue>@<tenant>``,
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
  path (see ``bench/README.md``). Only an entry that reached a worker waiting in ``BLPOP``
  starts calls early: one that was already in the lane (nobody was popping when it came,
  ``LPOP`` found it) may name jobs a worker has taken from the queue since, and is served
  through ``START`` alone; nor does a worker start an early call for a job it took from its
  queue itself. (An early call the model answered for a job another worker took is a
  second answer to that sub-call: a wasted call, dropped by the producer.)

Redis errors (a lost connection, or an error reply such as ``READONLY`` during a failover)
are logged and retried with backoff; anything else escapes to the worker's supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

import redis
from redis.asyncio import Redis

from rlmq.common import keys as K
from rlmq.common.aio import cancel_and_wait
from rlmq.common.errors import PayloadError
from rlmq.common.jobs.store import JobStore, StartedJob
from rlmq.common.metrics import Metrics
from rlmq.common.schemas import LaneEntry, SubLLMRequest, load_lane_entry
from rlmq.common.settings import setting_default
from rlmq.workers.capacity import MODEL_CALLS, Capacity, fetch_shares
from rlmq.workers.inflight import InFlight
from rlmq.workers.kinds import KindRegistry

log = logging.getLogger("rlmq.worker")
T = TypeVar("T")

LANE_EARLY_MAX_AGE = 1.0
"""Seconds: a lane entry older than this (producer's clock against the worker's) starts no
call before ``START``; its jobs have most likely been taken from the queue already."""

IDLE_WAIT_SECONDS = 1.0
"""Longest wait of a fetch round that found no job it could take (then it peeks again)."""

TAKEN_MEMORY_SECONDS = 10.0
"""Seconds a worker remembers the jobs it took from its queues (not from a lane entry): a lane
entry naming one of them in that time starts no early call for it (the job ran, or runs, here
already; an early call would have the model answer it twice). Longer than
:data:`LANE_EARLY_MAX_AGE` plus any clock difference worth serving with."""


async def _gather(aws: list[Coroutine[Any, Any, T]]) -> list[T]:
    """``asyncio.gather``, without its extra task and loop turn for a single awaitable (one
    queue: the usual case, and the one that counts at light load)."""
    if len(aws) == 1:
        return [await aws[0]]
    return list(await asyncio.gather(*aws))


def _cancel_early(pair: tuple[asyncio.Task[None], asyncio.Future[StartedJob]]) -> None:
    """Stop an early lane call that will not run: cancel its task and its ``START`` future
    too, so the call ends at its next wait for ``START`` even if a Redis command it was in
    swallowed the task's cancellation (see :func:`rlmq.common.aio.cancel_and_wait`)."""
    task, claim = pair
    task.cancel()
    claim.cancel()


class EarlyCalls(Protocol):
    """Starts a lane job's sub-LLM call before ``START`` confirms it (the sub-LLM kind's ``call``)."""

    def call(
        self, request: SubLLMRequest, job_id: str, attempt: int, job: StartedJob | asyncio.Future[StartedJob]
    ) -> Coroutine[Any, Any, None]: ...


class FetchPort(Protocol):
    """What the fetcher uses of its worker, and nothing else (:class:`rlmq.workers.worker.SubLLMWorker`
    is one): where to fetch from (``queue``, :meth:`child_queues`, :meth:`pool_of_queue`, ``redis``),
    how much (``capacity``, ``jobs``), what to do with a job taken (:meth:`records_for` to
    ``START`` it, :meth:`spawn` to run it, ``sub_llm`` for a lane job's early call, ``kinds`` to
    read it), and what to report (``name``, ``metrics``, :meth:`update_gauge`)."""

    name: str
    queue: str
    redis: Redis
    stopping: asyncio.Event
    capacity: Capacity
    jobs: InFlight
    metrics: Metrics
    kinds: KindRegistry

    @property
    def sub_llm(self) -> EarlyCalls: ...

    def child_queues(self) -> list[str]: ...

    def pool_of_queue(self, queue: str) -> str | None: ...

    def records_for(self, queue: str) -> JobStore: ...

    def spawn(self, job: StartedJob, queue: str) -> None: ...

    def update_gauge(self) -> None: ...


def _carries(w: FetchPort, job: StartedJob, request: SubLLMRequest | None) -> bool:
    """True when the lane entry's copy of a request is the job's own (the lane is a shared
    hint any producer may write; the job hash, confined to its tenant, is the record)."""
    try:
        _, payload = w.kinds.decode(job.data)
    except PayloadError:
        return False
    return request is not None and payload == request


class Fetcher:
    """Takes jobs for one worker: round-robin over its queues, wake-ups and the lane.

    Args:
        worker: the worker it feeds (see :class:`FetchPort`).
        lane_early_calls: start the calls a lane entry carries before ``START`` confirms them
            (the ``lane_early_calls`` setting).
    """

    def __init__(self, worker: FetchPort, *, lane_early_calls: bool = setting_default("lane_early_calls")) -> None:
        self.w = worker
        self.lane_early_calls = lane_early_calls
        self.queues: list[str] = [worker.queue, *worker.child_queues()]
        """The queues served, in round-robin order (the worker's own and its tenants; a REPL
        host's child queues, one per depth, and their tenants)."""
        self._wake = asyncio.Event()
        self._hints: dict[str, list[str]] = {}  # queue -> job ids named by wake-ups (idle fast path)
        self._lane_pop: asyncio.Task[tuple[LaneEntry, bool] | None] | None = None  # (entry, fresh)
        self._bad_queues: set[str] = set()  # queues whose last peek failed (logged once)
        self._taken: dict[str, float] = {}  # job id -> when this worker took it from a queue
        self._taken_order: deque[tuple[float, str]] = deque()  # the same, oldest first (for pruning)
        self._backoff = 0.1  # seconds before the next round after a Redis error
        self._last_discovery = 0.0  # monotonic time of the last discover_queues
        self._idle = False  # the last round found no job
        self._after_lane = False  # the last round served a lane entry: peek again only when woken

    # ------------------------------------------------------------------ jobs taken from the queues

    def remember_taken(self, job_id: str, now: float | None = None) -> None:
        """Note that this worker took ``job_id`` from a queue (``now``: monotonic seconds);
        forgets what it took more than :data:`TAKEN_MEMORY_SECONDS` ago."""
        now = time.monotonic() if now is None else now
        self._taken[job_id] = now
        self._taken_order.append((now, job_id))
        horizon = now - TAKEN_MEMORY_SECONDS
        while self._taken_order and self._taken_order[0][0] < horizon:
            when, old = self._taken_order.popleft()
            if self._taken.get(old) == when:
                del self._taken[old]

    def took(self, job_id: str) -> bool:
        """Whether this worker took ``job_id`` from a queue in the last :data:`TAKEN_MEMORY_SECONDS`."""
        when = self._taken.get(job_id)
        return when is not None and time.monotonic() - when <= TAKEN_MEMORY_SECONDS

    # ------------------------------------------------------------------ queues

    async def discover_queues(self) -> None:
        """Find the tenant queues of this worker's queue (``rq:queues`` holds every queue key)."""
        w = self.w
        members: set[bytes] = await w.redis.smembers(K.RQ_QUEUES)  # type: ignore[assignment]
        found = sorted(q for q in map(K.queue_of_key, members) if w.pool_of_queue(q) is not None)
        for own in reversed([w.queue, *w.child_queues()]):
            if own not in found:
                found.insert(0, own)
        # keep the round-robin position of known queues; new ones join at the end
        self.queues = [q for q in self.queues if q in found] + [q for q in found if q not in self.queues]

    def adopt(self, queue: str) -> bool:
        """Whether this worker serves ``queue`` (its own or one of its tenants, or a child queue
        it hosts); a tenant it did not know yet joins the round-robin from the next round on."""
        if self.w.pool_of_queue(queue) is None:
            return False
        if queue not in self.queues:
            self.queues.append(queue)
        return True

    async def wake_listener(self) -> None:
        """Set the wake event on every ``rlmq:wake:<queue>`` message, for ever.

        Producers publish the name of the (tenant) queue they just enqueued on, so a new
        tenant is served at once instead of at the next discovery."""
        backoff = 0.1
        while True:
            pubsub = self.w.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(*{K.wake_channel(q) for q in [self.w.queue, *self.w.child_queues()]})
                backoff = 0.1
                async for msg in pubsub.listen():
                    data = msg.get("data")
                    text = data.decode(errors="replace") if isinstance(data, bytes) else str(data)
                    queue, ids, announce_only = K.parse_wake_message(text)
                    if not self.adopt(queue):
                        continue
                    if announce_only:
                        continue  # its jobs went to the lane (an idle worker pops them)
                    if ids:  # a small batch named its jobs: an idle worker takes them directly
                        self._hints.setdefault(queue, []).extend(ids)
                    self._wake.set()
            except (redis.RedisError, OSError):
                await asyncio.sleep(backoff)  # reconnect backoff
                backoff = min(backoff * 2, 5.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    # ------------------------------------------------------------------ fetch

    async def fetch_loop(self, burst: bool) -> None:
        """Take jobs until the worker stops (or, with ``burst``, until there is no more work).

        One round: pass on a lane entry that would jump the queue (:meth:`_defer_entry`), wait
        while every pool is full, else serve the lane entry or peek the queues and ``START``
        what they hold (:meth:`_take_from_queues`); an empty round waits for work."""
        self._backoff, self._last_discovery = 0.1, time.monotonic()
        self._idle = self._after_lane = False  # after_lane: the last round served a lane entry
        try:
            while not self.w.stopping.is_set():
                if await self._round(burst):
                    return
        finally:
            await self._stop_lane_pop()

    async def _round(self, burst: bool) -> bool:
        """One round of :meth:`fetch_loop`; True when a burst worker has no more work."""
        w = self.w
        free = w.capacity.free(MODEL_CALLS)  # the pool of the sub-LLM jobs (and of the lane)
        frees = {pool: w.capacity.free(pool) for pool in w.capacity.pools}
        entry, fresh = await self._defer_entry(free)
        if all(f <= 0 for f in frees.values()):
            await self._wait_for_a_slot()
            return False
        try:
            if time.monotonic() - self._last_discovery > 1.0:
                await self.discover_queues()
                self._last_discovery = time.monotonic()
            if entry is not None:
                await self._take_lane_entry(entry, free, fresh=fresh)
                self._idle, self._after_lane, self._backoff = False, True, 0.1
                return False
            done, started = await self._take_from_queues(burst, frees)
        except redis.exceptions.NoPermissionError:
            raise  # not transient: the supervisor restarts the loop, then stops the worker
        except (redis.RedisError, OSError) as exc:
            await self._redis_away(exc)
            return False
        for q, jobs in started:
            for job in jobs:
                self.remember_taken(job.job_id)
                w.spawn(job, q)
        if started:
            w.update_gauge()
        return done

    async def _defer_entry(self, free: int) -> tuple[LaneEntry | None, bool]:
        """The lane entry the pop brought (and whether it is fresh), unless taking it now would
        jump the queue: then it is passed on and ``(None, False)`` returned.

        Popped by a pop left waiting from an idle spell, but this worker has found queued work
        since, or been woken for some (a larger batch's announcement that came in with the
        entry): taking the entry's jobs now would put them ahead of older jobs on their queue.
        They stay in queue order; the others are woken."""
        popped = self._popped_lane_entry()
        entry, fresh = popped if popped is not None else (None, False)
        announced = self._wake.is_set() or bool(self._hints)  # other work announced meanwhile
        if entry is not None and (free <= 0 or not (self._idle or self._after_lane) or announced):
            self.adopt(entry.queue)
            with contextlib.suppress(redis.RedisError, OSError):
                await self._pass_on(entry)
            return None, False
        return entry, fresh

    async def _wait_for_a_slot(self) -> None:
        """Every pool is full: wait for a slot to free (or for the lane pop to bring an entry)."""
        jobs = self.w.jobs
        jobs.slot_free.clear()
        slot = asyncio.create_task(jobs.slot_free.wait())
        await asyncio.wait({slot} | ({self._lane_pop} if self._lane_pop else set()),
                           return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        slot.cancel()

    async def _take_from_queues(
        self, burst: bool, frees: dict[str, int]
    ) -> tuple[bool, list[tuple[str, list[StartedJob]]]]:
        """Peek the queues (or take the jobs a wake-up named) and ``START`` them; an empty round
        waits for work.

        Returns:
            ``(done, started)``: done when a burst worker has no more work; the jobs ``START``
            gave this worker, per queue (the caller runs them).

        Raises:
            redis.RedisError / OSError: a round trip failed (``START`` moves nothing unless it
                succeeds, and is safe to send again).
        """
        w = self.w
        woken = self._wake.is_set()
        self._wake.clear()
        hints, self._hints = self._hints, {}
        queues = list(self.queues)
        # each queue's equal share of its own pool's free slots (0: its pool is full)
        shares = fetch_shares(frees, [(q, w.pool_of_queue(q) or MODEL_CALLS) for q in queues])
        peeked: list[list[bytes]]
        if self._idle and hints:
            # Idle worker, woken by a batch that named its jobs: take them without
            # peeking (one round trip saved). Jobs another worker took first are
            # skipped by START; under load the round-robin peek below decides instead.
            peeked = [[j.encode() for j in hints.get(q, [])][: shares[q]] for q in queues]
        elif self._after_lane and not woken and not hints:
            peeked = []  # nothing announced since the lane entry: wait for the next one
        else:
            peeked = await self._peek(queues, shares)
        self._idle = self._after_lane = False
        if not any(peeked):
            self._idle = True
            if burst and not len(w.jobs):
                return True, []
            await self._wait_for_work(burst, pool_full=any(f <= 0 for f in frees.values()))
            if time.monotonic() - self._last_discovery > 0.5:
                self._last_discovery = 0.0  # an idle worker looks for new tenant queues sooner
            return False, []
        taken = [(q, ids) for q, ids in zip(queues, peeked, strict=True) if ids]
        started_by_queue = await _gather([w.records_for(q).start(ids) for q, ids in taken])
        self.queues = self.queues[1:] + self.queues[:1]  # the next round starts with the next queue
        self._backoff = 0.1
        return False, [(q, started) for (q, _), started in zip(taken, started_by_queue, strict=True)]

    async def _redis_away(self, exc: BaseException) -> None:
        """A lost connection, or an error reply (READONLY in a failover, OOM, ...): log, count,
        and wait the backoff (or for a stop) before the next round."""
        w = self.w
        log.warning("worker %s: Redis unavailable (%s); retrying in %.1f s", w.name, exc, self._backoff)
        w.metrics.reconnect()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(w.stopping.wait(), self._backoff)
        self._backoff = min(self._backoff * 2, 5.0)

    async def _peek(self, queues: list[str], shares: dict[str, int]) -> list[list[bytes]]:
        """The first ``shares[q]`` job ids of each queue ``q`` (one round trip; a queue of share 0
        is not read).

        Raises:
            redis.RedisError: the round trip failed.
        """
        read = [q for q in queues if shares[q] > 0]
        if not read:
            return [[] for _ in queues]
        async with self.w.redis.pipeline(transaction=False) as pipe:
            for q in read:
                pipe.lrange(K.rq_queue(q), 0, shares[q] - 1)
            outcomes = await pipe.execute(raise_on_error=False)
        got = dict(zip(read, self._usable(read, outcomes), strict=True))
        return [got.get(q, []) for q in queues]

    def _usable(self, queues: list[str], outcomes: list[Any]) -> list[list[bytes]]:
        """The peeked job ids per queue; a queue whose peek failed counts as empty this round.

        One queue key of the wrong type (a tenant queue someone overwrote) must not stop the
        worker serving the others. A connection error is raised (the whole round failed)."""
        peeked: list[list[bytes]] = []
        for q, o in zip(queues, outcomes, strict=True):
            if isinstance(o, (redis.ConnectionError, redis.TimeoutError)):
                raise o
            if isinstance(o, Exception):
                if q not in self._bad_queues:
                    log.error("worker %s: cannot read queue %s (%s); serving the others", self.w.name, q, o)
                    self._bad_queues.add(q)
                peeked.append([])
            else:
                self._bad_queues.discard(q)
                peeked.append(o)
        return peeked

    async def _wait_for_work(self, burst: bool, *, pool_full: bool = False) -> None:
        """Wait (at most :data:`IDLE_WAIT_SECONDS`) for a wake-up, a lane entry, a stop, or a free
        slot: in burst mode, or when ``pool_full`` (a pool had no free slot this round, so jobs of
        its queues may be waiting that no wake-up will announce again: the round that freed the
        slot must peek at once, not after the timeout)."""
        w = self.w
        waiter = asyncio.create_task(self._wake.wait())
        stop = asyncio.create_task(w.stopping.wait())
        slot = asyncio.create_task(w.jobs.slot_free.wait()) if burst or pool_full else None
        pending = {waiter, stop} | ({slot} if slot else set())
        if not burst and self._lane_pop is None:
            self._lane_pop = asyncio.create_task(self._pop_lane(), name="lane")
        await asyncio.wait(
            pending | ({self._lane_pop} if self._lane_pop else set()),
            timeout=IDLE_WAIT_SECONDS,
            return_when=asyncio.FIRST_COMPLETED,
        )
        for t in pending:
            t.cancel()  # the lane pop stays pending across rounds: cancelling it could drop an entry
        w.jobs.slot_free.clear()

    # ------------------------------------------------------------------ the lane

    async def _pop_lane(self) -> tuple[LaneEntry, bool] | None:
        """One entry of this queue's lane and whether it is *fresh*, waiting up to a second
        (``None``: none came).

        An entry already in the lane (``LPOP`` finds it) is not fresh: nobody was popping when
        it came, so its jobs may have been taken from the queue since (by this worker too). A
        fresh one came while this worker waited in ``BLPOP``: only a peek in the moment between
        the enqueue and this worker's ``START`` can have taken its jobs.
        """
        lane = K.lane(self.w.queue)
        try:
            lingering: bytes | None = await self.w.redis.lpop(lane)  # type: ignore[assignment]
            got = None if lingering is not None else await self.w.redis.blpop([lane], timeout=1)
        except (redis.RedisError, OSError):
            await asyncio.sleep(0.1)  # reconnect backoff; the fetch loop reports the outage
            return None
        raw = lingering if lingering is not None else got[1] if got is not None else None
        if raw is None:
            return None
        try:
            return load_lane_entry(raw), lingering is None
        except PayloadError as exc:
            log.warning("worker %s: dropped an invalid lane entry (%s)", self.w.name, exc)
            return None

    def _popped_lane_entry(self) -> tuple[LaneEntry, bool] | None:
        """The entry the lane pop brought and whether it is fresh, once it is done (then a new
        pop may start)."""
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
        popped = self._popped_lane_entry()
        self._lane_pop = None
        if popped is not None:
            with contextlib.suppress(redis.RedisError, OSError):
                await self._pass_on(popped[0])

    async def _pass_on(self, entry: LaneEntry) -> None:
        """Wake the other workers for a lane entry this worker does not take. The wake-up
        does not name the jobs: they never left their queue, and a woken worker takes them
        in queue order, behind any older ones."""
        await self.w.redis.publish(K.wake_channel(entry.queue), K.wake_message(entry.queue))

    async def _take_lane_entry(self, entry: LaneEntry, free: int, *, fresh: bool = True) -> None:
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
        likely gone, or re-queued as a later attempt. An early call's grant is *leased*
        (:meth:`~rlmq.common.budget.ledger.BudgetLedger.begin`): cancelled before it began (a lost
        ``START``), it gives the grant back at once, and a grant it never began (its worker died)
        goes back when its lease ends; never left charged and live until the call's deadline with
        no call behind it, which made every call of its tree wait for it. Nor does an
        entry that is not ``fresh`` (see :meth:`_pop_lane`), nor a job this worker took from
        the queue itself (:meth:`took`): an early call would be the model's second answer to it.
        """
        w = self.w
        queue = entry.queue
        if not self.adopt(queue):
            log.warning("worker %s: lane entry for queue %s it does not serve", w.name, queue)
            return
        jobs = entry.jobs[:free]
        if len(jobs) < len(entry.jobs):
            await self._pass_on(LaneEntry(queue=queue, enqueued_at=entry.enqueued_at, jobs=entry.jobs[free:]))
        early: dict[str, tuple[asyncio.Task[None], asyncio.Future[StartedJob]]] = {}
        if fresh and self.lane_early_calls and abs(time.time() - entry.enqueued_at) <= LANE_EARLY_MAX_AGE:
            loop = asyncio.get_running_loop()
            for j in jobs:
                if j.request is not None and not self.took(j.job_id):
                    claim: asyncio.Future[StartedJob] = loop.create_future()
                    task = w.jobs.add_task(w.sub_llm.call(j.request, j.job_id, 1, claim))
                    early[j.job_id] = (task, claim)
            if early:
                await asyncio.sleep(0)  # yield once: the early calls go out before START does
        try:
            started = await w.records_for(queue).start([j.job_id.encode() for j in jobs])
        except BaseException:
            for early_call in early.values():
                _cancel_early(early_call)
            raise
        carried = {j.job_id: j.request for j in jobs}
        for job in started:
            pair = early.pop(job.job_id, None)
            if pair is not None and job.attempt == 1 and _carries(w, job, carried[job.job_id]):
                w.jobs.track(job, queue)
                pair[1].set_result(job)
                w.metrics.lane_job("early")
            else:
                if pair is not None:  # re-queued (attempt > 1), or the lane lied: run it from its own record
                    _cancel_early(pair)
                w.spawn(job, queue)
                w.metrics.lane_job("after_start")
        for early_call in early.values():  # another worker took these first
            _cancel_early(early_call)
            w.metrics.lane_job("lost")
        w.update_gauge()
