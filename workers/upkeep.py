"""A worker's upkeep: its RQ registration, its heartbeat, and the reaper of dead workers' jobs.

* registration: RQ's own ``Worker.register_birth`` / ``register_death``, so ``rq info`` and
  rq-dashboard list the worker; registered again when Redis forgot it (restarted without
  persistence); and an entry in ``rlmq:serving:<queue>`` (name -> heartbeat expiry) that tells
  producers, within seconds, whether anybody serves a queue;
* the heartbeat (every ``heartbeat_interval`` seconds, and at least :data:`HEARTBEAT_MARGIN`
  times per ``job_heartbeat_ttl``, on a fixed rate) extends the started-registry scores of
  all in-flight jobs, the worker's own key and its serving entry;
* the reaper (every ``max(0.5, job_heartbeat_ttl / 4)`` seconds, jittered) re-queues, or
  fails when out of attempts, jobs of workers that stopped heartbeating, so a ``kill -9``
  loses no job (and ends the tree node of a child rollout's dead attempt: its subtree stops
  at its next model call); and prunes expired registry members and dead workers' entries, as RQ's own
  ``clean_registries`` would, so Redis memory stays flat over weeks.

Redis errors (connection or error replies) are logged and retried on the next tick; anything
else escapes to the worker's supervisor (:mod:`rlmq.common.supervise`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from typing import TYPE_CHECKING, Protocol

import redis
from rq import Queue
from rq import Worker as RQWorker
from rq.serializers import JSONSerializer

from rlmq.common import keys as K
from rlmq.common.connection import sync_client
from rlmq.common.fleet_checks import redis_time

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from rlmq.common.jobs.store import JobStore
    from rlmq.common.metrics import Metrics
    from rlmq.common.settings import Settings
    from rlmq.workers.inflight import InFlight
    from rlmq.workers.kinds import JobKind

log = logging.getLogger("rlmq.worker")


HEARTBEAT_MARGIN = 4
"""Heartbeats a worker sends per ``job_heartbeat_ttl`` at least: its jobs are taken back only after
it missed this many in a row (its event loop stalled for 3/4 of the TTL), so a host under load is
not declared dead while alive. The bound: heartbeat period <= ``job_heartbeat_ttl / HEARTBEAT_MARGIN``."""


def heartbeat_period(interval: float, ttl: float) -> float:
    """Seconds between two heartbeats: ``interval`` (``heartbeat_interval``), at most
    ``ttl / HEARTBEAT_MARGIN`` (``job_heartbeat_ttl``): ``--heartbeat-ttl 2`` beats every 0.5 s."""
    return min(interval, ttl / HEARTBEAT_MARGIN)


class ServedQueues(Protocol):
    """The queues a worker takes jobs from now (its fetcher's: its own, its child queues, the
    tenant queues found)."""

    @property
    def queues(self) -> list[str]: ...


class UpkeepPort(Protocol):
    """What the upkeep uses of its worker, and nothing else (:class:`rlmq.workers.worker.SubLLMWorker`
    is one): who it registers (``name``, ``queue``, :meth:`child_queues`, ``concurrency``,
    ``repl_slots``, ``settings``: ``redis_url``, ``heartbeat_interval``, ``job_heartbeat_ttl``),
    what it extends and takes back (``jobs``, :meth:`records_for`, :meth:`kind_of_queue`, the
    ``fetcher``'s queues) on which Redis (``redis``), and what it reports (``metrics``)."""

    settings: Settings
    name: str
    queue: str
    concurrency: int
    repl_slots: int
    redis: Redis
    jobs: InFlight
    metrics: Metrics

    @property
    def fetcher(self) -> ServedQueues: ...

    def child_queues(self) -> list[str]: ...

    def records_for(self, queue: str) -> JobStore: ...

    def kind_of_queue(self, queue: str) -> JobKind: ...


class Upkeep:
    """Registration, heartbeat and reaper of one worker.

    Args:
        worker: the worker it keeps (see :class:`UpkeepPort`).
    """

    def __init__(self, worker: UpkeepPort) -> None:
        self.w = worker
        self.late_beats = 0
        """Heartbeats that came more than half a ``job_heartbeat_ttl`` after the one before (a
        stalled event loop: the host is near being declared dead while alive)."""

    # ------------------------------------------------------------------ RQ registration

    def register_birth(self, again: bool = False) -> RQWorker:
        """Register with RQ (blocking client; call once before the loop serves).

        Args:
            again: registering again after Redis forgot this worker: a partial worker hash that
                writes since then recreated (job counters, heartbeat fields) is dropped first, as
                RQ refuses to register a name whose hash exists without a death mark.
        """
        w = self.w
        sync = sync_client(str(w.settings.redis_url))
        own = [w.queue, *w.child_queues()]  # a REPL host also serves one child queue per depth
        qs = [Queue(name, connection=sync, serializer=JSONSerializer) for name in own]
        rq_worker = RQWorker(qs, name=w.name, connection=sync, serializer=JSONSerializer)
        if again:
            sync.delete(rq_worker.key)
        rq_worker.register_birth()  # type: ignore[no-untyped-call]
        sync.hset(rq_worker.key, mapping={"state": "idle", "rlmq_concurrency": w.concurrency})
        if w.repl_slots:
            sync.hset(rq_worker.key, "rlmq_repl_slots", w.repl_slots)
        sync.sadd(K.RQ_QUEUES, *(q.key for q in qs))
        sec, usec = sync.time()  # Redis's clock, as the heartbeat's
        for name in own:
            sync.zadd(K.serving(name), {w.name: sec + usec / 1e6 + w.settings.job_heartbeat_ttl})
        return rq_worker

    async def register_again(self) -> None:
        """Register this worker's birth again: its ``rq:worker`` hash and ``rq:workers`` entries
        are gone (a Redis restarted without persistence), so ``rq info`` would not list it."""
        log.warning("worker %s: its registration is gone from Redis (restarted?); registering again", self.w.name)
        try:
            rq_worker = await asyncio.to_thread(self.register_birth, True)
        except (redis.RedisError, OSError, ValueError) as exc:
            log.warning("worker %s: could not register again (%s); will retry", self.w.name, exc)
            return
        with contextlib.suppress(Exception):
            rq_worker.connection.close()

    def register_death(self, rq_worker: RQWorker) -> None:
        """Unregister from RQ and from the serving set (best effort: the worker is leaving)."""
        for name in [self.w.queue, *self.w.child_queues()]:
            with contextlib.suppress(Exception):
                rq_worker.connection.zrem(K.serving(name), self.w.name)
        with contextlib.suppress(Exception):
            rq_worker.register_death()  # type: ignore[no-untyped-call]
            rq_worker.connection.close()

    # ------------------------------------------------------------------ heartbeat

    async def heartbeat_once(self) -> None:
        """Extend every in-flight job and this worker's liveness (one pipeline per queue).

        Raises:
            redis.RedisError: Redis away or refusing writes.
        """
        w = self.w
        by_queue = w.jobs.members_by_queue()
        for own in [w.queue, *w.child_queues()]:  # the serving entries of every queue it serves
            if not any(K.serving(q) == K.serving(own) for q in by_queue):
                by_queue[own] = []
        state = "busy" if len(w.jobs) else "idle"
        if not await w.redis.sismember(K.RQ_WORKERS, K.rq_worker(w.name)):
            # Redis restarted (or flushed): it forgot this worker. Asked of RQ's registry, not of
            # the worker hash, which a job's end (HINCRBY) or this beat's own write recreates
            await self.register_again()
        await asyncio.gather(*(w.records_for(q).heartbeat(m, state) for q, m in by_queue.items()))

    async def heartbeat_loop(self) -> None:
        """:meth:`heartbeat_once` at a fixed rate, for ever: every :func:`heartbeat_period`
        seconds, counted from the previous beat's start (a slow beat does not push the next one
        later). A beat later than half the TTL is counted (``late_beats``) and logged."""
        settings = self.w.settings
        period = heartbeat_period(settings.heartbeat_interval, settings.job_heartbeat_ttl)
        loop = asyncio.get_running_loop()
        next_at = previous = loop.time()
        while True:
            now = loop.time()
            if now - previous > settings.job_heartbeat_ttl / 2:
                self.late_beats += 1
                log.warning(
                    "worker %s: heartbeat %.1f s after the last one (its jobs are taken back after %d s): "
                    "its event loop is stalled; a larger --heartbeat-ttl suits a host this loaded",
                    self.w.name, now - previous, settings.job_heartbeat_ttl,
                )  # fmt: skip
            previous = now
            try:
                await self.heartbeat_once()
            except redis.exceptions.NoPermissionError:
                raise  # not transient (an ACL that does not let this worker write): supervised
            except (redis.RedisError, OSError) as exc:
                log.warning("worker %s: heartbeat failed (%s)", self.w.name, exc)
                self.w.metrics.reconnect()
            next_at = max(next_at + period, loop.time())  # fixed rate; never a burst after a stall
            await asyncio.sleep(next_at - loop.time())  # periodic timer, not synchronisation

    # ------------------------------------------------------------------ reaper

    async def reap_once(self) -> int:
        """Take back abandoned jobs of every queue this worker serves; returns how many."""
        w = self.w
        total = 0
        for queue in list(w.fetcher.queues):
            rec = w.records_for(queue)
            expired = [m for m in await rec.expired_members() if m not in w.jobs]
            if not expired:
                continue
            taken: list[tuple[str, int]] = []
            requeued, failed = await rec.reap(expired, taken=taken)
            kind = w.kind_of_queue(queue)
            if kind.dead_attempts is not None:  # a child's subtree stops now
                await kind.dead_attempts(taken)
            total += requeued + failed
            if requeued or failed:
                log.warning(
                    "worker %s: took back %d abandoned jobs (%d re-queued, %d failed)",
                    w.name, len(expired), requeued, failed,
                )  # fmt: skip
        return total

    async def prune_once(self) -> int:
        """Prune what RQ's own maintenance (``clean_registries``) would, for every queue this
        worker serves (tenant queues included), by Redis's clock: finished and failed registry
        members past their expiry (their job hashes are gone), ``rq:workers`` and the queue's
        worker set entries whose worker hash expired (killed with ``kill -9``), and live-rollout
        entries past their expiry. Started registries are the reaper's. Returns members removed.

        Raises:
            redis.RedisError: Redis away.
        """
        w = self.w
        now = await redis_time(w.redis)
        sets = [K.RQ_WORKERS, K.rq_workers_of_queue(w.queue)]
        async with w.redis.pipeline(transaction=False) as pipe:
            for queue in list(w.fetcher.queues):
                pipe.zremrangebyscore(K.rq_finished(queue), "-inf", now)
                pipe.zremrangebyscore(K.rq_failed(queue), "-inf", now)
            pipe.zremrangebyscore(K.LIVE_ROLLOUTS, "-inf", now)
            for key in sets:
                pipe.smembers(key)
            out = await pipe.execute()
        removed = sum(int(n) for n in out[: -len(sets)])
        for key, members in zip(sets, out[-len(sets) :], strict=True):
            names = sorted(members)
            if not names:
                continue
            async with w.redis.pipeline(transaction=False) as pipe:
                for m in names:
                    pipe.exists(m)
                alive = await pipe.execute()
            gone = [m for m, a in zip(names, alive, strict=True) if not a]
            if gone:
                removed += int(await w.redis.srem(key, *gone))
        return removed

    async def reaper_loop(self) -> None:
        """:meth:`reap_once` every ``max(0.5, job_heartbeat_ttl / 4)`` seconds (jittered), for ever."""
        interval = max(0.5, self.w.settings.job_heartbeat_ttl / 4)
        while True:
            await asyncio.sleep(interval * (0.5 + random.random()))  # jittered timer across the fleet
            try:
                await self.reap_once()
                await self.prune_once()
            except (redis.RedisError, OSError) as exc:
                log.warning("worker %s: reaper failed (%s)", self.w.name, exc)
