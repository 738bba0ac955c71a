"""Provider limits shared by the whole fleet: requests and tokens per window, concurrent requests.

A provider with a quota (OpenAI, a hosted vLLM behind a gateway) counts every caller of one
API key together. A limit kept in each worker's memory lets N workers send N times the allowed
rate (LiteLLM's pre-call check, a limiter behind a lock file on one host). Here the limits of
one *upstream* (a model queue, or a name several queues share with ``--provider-upstream``)
live in Redis and every request takes a grant from one Lua script
(:mod:`rlmq.common.provider_limits_lua`) that reads Redis's clock (``TIME``), never a worker's:

* requests per window: a sliding log of grant times; a request is granted while fewer than
  ``rpm`` were granted in the last ``window + margin`` seconds (the margin covers the network
  delay between a grant and the provider's own count);
* tokens per window: a request counts its prompt (estimated) and its ``max_tokens`` before it
  starts, corrected to the usage it reported when it ends, as the budget ledger does;
* concurrent requests: a lease per request in flight, ended when it ends (a worker that dies
  leaves a lease that lapses after the request's timeout);
* a 429 from the provider pauses the upstream for every worker until its ``Retry-After``.

A request over a limit waits; it does not fail. The waiting requests of one worker ask Redis
together (one script call for up to :data:`BATCH` of them), taken round-robin over their
rollouts, so one rollout's burst cannot starve another's call. :class:`ProviderLimiter` is the
client; :mod:`rlmq.workers.provider_transport` puts it on the model-call path.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from rlmq.common import keys as K
from rlmq.common.provider_limits_lua import ACQUIRE_LUA, FINISH_LUA, PAUSE_LUA

log = logging.getLogger("rlmq.provider_limits")

BATCH = 64
"""Waiting requests one script call may grant."""

MAX_SLEEP = 1.0
"""Longest sleep (seconds) between two asks of a refused request: a grant freed early (a lease
ended, a 429 pause lifted) is seen within this."""

KEY_TTL_WINDOWS = 3
"""An upstream's keys live this many windows (plus the longest lease) after its last grant."""


@dataclass(frozen=True)
class ProviderLimits:
    """The limits of one upstream, as declared in the settings.

    Attributes:
        upstream: the name the limits are counted under (:class:`rlmq.common.keys.ProviderKeys`).
        rpm: requests per window (``None``: no limit).
        tpm: tokens per window (``None``: no limit).
        max_concurrent: requests in flight at once (``None``: no limit).
        window: seconds (60 for per-minute limits).
        margin: seconds a grant is counted beyond the window.
    """

    upstream: str
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    window: float = 60.0
    margin: float = 0.5

    @classmethod
    def from_settings(cls, settings: Any, queue: str) -> ProviderLimits | None:
        """The limits a worker of ``queue`` declared (``provider_*`` settings), or ``None`` when it
        declared none (its calls then take no grant: no Redis round trip)."""
        s = settings
        if s.provider_rpm is None and s.provider_tpm is None and s.provider_max_concurrent is None:
            return None
        return cls(
            upstream=s.provider_upstream or queue.split("@", 1)[0],
            rpm=s.provider_rpm, tpm=s.provider_tpm, max_concurrent=s.provider_max_concurrent,
            window=s.provider_window, margin=s.provider_window_margin,
        )  # fmt: skip

    def as_json(self) -> str:
        """The limits as JSON (what :data:`rlmq.common.keys.PROVIDER_LIMITS` holds)."""
        return json.dumps(asdict(self), sort_keys=True)


@dataclass
class Permit:
    """One granted request. ``id``: its entry in Redis; ``tokens``: what it counts now;
    ``waited``: seconds from the ask to the grant; ``refused``: whether it was refused at least once."""

    id: str
    tokens: int
    waited: float = 0.0
    refused: bool = False


@dataclass
class _Waiter:
    id: str
    tokens: int
    lease: float
    key: str
    future: asyncio.Future[Permit]
    asked: float = field(default_factory=time.monotonic)
    refused: bool = False


class ProviderLimiter:
    """The client of one upstream's fleet-wide limits (one per worker process).

    Args:
        redis: an asyncio client (bytes responses).
        limits: the upstream's limits.
        name: a name unique to this process (the worker's), prefixing request ids.

    ``refusals`` counts script answers that refused a request, by reason (``rpm``, ``tpm``,
    ``concurrent``, ``paused``); ``pauses`` the 429 pauses this process set.
    """

    def __init__(self, redis: Redis, limits: ProviderLimits, *, name: str) -> None:
        self.redis = redis
        self.limits = limits
        self.keys = K.ProviderKeys(limits.upstream)
        self._ids = (f"{name}.{i}" for i in itertools.count(1))
        self._acquire = redis.register_script(ACQUIRE_LUA)
        self._finish = redis.register_script(FINISH_LUA)
        self._pause = redis.register_script(PAUSE_LUA)
        self._waiting: collections.OrderedDict[str, collections.deque[_Waiter]] = collections.OrderedDict()
        self._pump: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._announce_at = 0.0  # when to write the limits for rlmq status next (monotonic s)
        self.refusals: collections.Counter[str] = collections.Counter()
        self.pauses = 0

    async def acquire(self, tokens: int, *, lease: float, key: str = "", timeout: float) -> Permit:
        """Wait for a grant of one request counting ``tokens`` tokens (>= 0).

        Args:
            lease: seconds after which a request that never finished stops counting as in flight.
            key: the fair-share key (rlmq passes the rollout id): waiting requests are granted
                round-robin over keys, in order within one key.
            timeout: seconds to wait at most.

        Raises:
            TimeoutError: no grant within ``timeout`` seconds (the request counts nothing).
        """
        future: asyncio.Future[Permit] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(next(self._ids), max(0, int(tokens)), lease, key, future)
        self._waiting.setdefault(key, collections.deque()).append(waiter)
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._run_pump(), name=f"provider-limits-{self.limits.upstream}")
        try:
            async with asyncio.timeout(timeout):
                return await waiter.future
        except TimeoutError:
            raise TimeoutError(
                f"waited {timeout:.3g} s for the provider limits of upstream {self.limits.upstream!r}"
            ) from None

    async def finish(self, permit: Permit, spent: int | None) -> None:
        """The request of ``permit`` ended: it no longer runs; it counts ``spent`` tokens (``None``:
        keep what it counts). Idempotent.

        Raises:
            RedisError: Redis failed (the lease then lapses on its own).
        """
        await self._finish(keys=self.keys.all(), args=[permit.id, -1 if spent is None else max(0, int(spent))])

    async def pause(self, seconds: float) -> float:
        """Pause the upstream for every worker for ``seconds`` (a 429's ``Retry-After``), unless it is
        paused longer already. Returns when the pause ends (Unix seconds, Redis's clock).

        Raises:
            RedisError: Redis failed.
        """
        self.pauses += 1
        raw = await self._pause(keys=self.keys.all(), args=[f"{max(0.0, seconds):.3f}"])
        return float(raw)

    def _batch(self) -> list[_Waiter]:
        """Up to :data:`BATCH` waiters in fair order: the first of each key, then the second, ...;
        the keys rotate by one per call. Waiters whose ask was abandoned are dropped."""
        for key in list(self._waiting):
            q = self._waiting[key]
            while q and q[0].future.done():
                q.popleft()
            if not q:
                del self._waiting[key]
        if self._waiting:
            self._waiting.move_to_end(next(iter(self._waiting)))
        queues = [list(q) for q in self._waiting.values()]
        out: list[_Waiter] = []
        for rank in range(BATCH):
            row = [q[rank] for q in queues if rank < len(q) and not q[rank].future.done()]
            if not row:
                break
            out.extend(row)
        return out[:BATCH]

    async def _run_pump(self) -> None:
        while True:
            batch = self._batch()
            if not batch:
                return
            if time.monotonic() >= self._announce_at:
                await self._announce()
            try:
                granted, wait_ms, reason = await self._ask(batch)
            except RedisError as exc:  # waiters keep waiting until their timeout; ask again soon
                log.warning("provider limits of %s: Redis failed (%s); asking again", self.limits.upstream, exc)
                await asyncio.sleep(0.2)
                continue
            for waiter in batch[:granted]:
                self._granted(waiter)
            if granted < len(batch):
                self.refusals[reason] += 1
                for waiter in batch[granted:]:
                    waiter.refused = True
                sleep = min(max(wait_ms / 1000.0, 0.001), MAX_SLEEP)
                await asyncio.sleep(sleep)

    async def _ask(self, batch: list[_Waiter]) -> tuple[int, int, str]:
        lim = self.limits
        lease = max(w.lease for w in batch)
        ttl = int(KEY_TTL_WINDOWS * (lim.window + lim.margin) + lease) + 1
        args: list[Any] = [lim.rpm or 0, lim.tpm or 0, lim.max_concurrent or 0, lim.window + lim.margin, lease, ttl]
        for w in batch:
            args += [w.id, w.tokens]
        raw = await self._acquire(keys=self.keys.all(), args=args)
        reason = raw[2].decode() if isinstance(raw[2], bytes) else str(raw[2])
        return int(raw[0]), int(raw[1]), reason

    def _granted(self, waiter: _Waiter) -> None:
        q = self._waiting.get(waiter.key)
        if q is not None:
            q.remove(waiter)
        permit = Permit(waiter.id, waiter.tokens, time.monotonic() - waiter.asked, waiter.refused)
        if waiter.future.done():  # its ask timed out between the grant and now: give it back
            self._background(self.finish(permit, 0))
        else:
            waiter.future.set_result(permit)

    async def _announce(self) -> None:
        """Write this upstream's limits where ``rlmq status`` reads them (again every 5 minutes, so a
        Redis that restarted shows them; after a failure, in 30 s)."""
        self._announce_at = time.monotonic() + 300.0
        try:
            await self.redis.hset(K.PROVIDER_LIMITS, self.limits.upstream, self.limits.as_json())
        except RedisError as exc:
            self._announce_at = time.monotonic() + 30.0
            log.warning("could not announce the provider limits of %s (%s)", self.limits.upstream, exc)

    def _background(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("provider limits of %s: %s", self.limits.upstream, task.exception())

    def finish_later(self, permit: Permit, spent: int | None) -> None:
        """:meth:`finish` in the background (the caller's reply is not held up by it); an error is
        logged (the request's lease then lapses on its own)."""
        self._background(self.finish(permit, spent))

    async def close(self) -> None:
        """Wait (at most 5 s) for the background finishes, then stop asking for waiters."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5.0)
        if self._pump is not None and not self._pump.done():
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)


def snapshot(redis: Any) -> list[dict[str, Any]]:
    """What ``rlmq status`` shows of every upstream's limits (``redis``: a sync client).

    Returns one dict per upstream: ``upstream``, ``rpm``, ``tpm``, ``max_concurrent``, ``window``,
    ``requests`` (granted in the window), ``tokens`` (counted in the window), ``running`` (in
    flight) and ``paused_for`` (seconds left of a 429 pause, 0 when none), by Redis's clock.
    """
    sec, usec = redis.time()
    now = float(sec) + float(usec) / 1e6
    out: list[dict[str, Any]] = []
    for raw_name, raw_conf in sorted(redis.hgetall(K.PROVIDER_LIMITS).items()):
        name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
        try:
            conf = json.loads(raw_conf)
            keys = K.ProviderKeys(name)
        except (ValueError, TypeError):
            continue
        span = float(conf.get("window", 60.0)) + float(conf.get("margin", 0.0))
        ids = redis.zrangebyscore(keys.requests, now - span, "+inf")
        tokens = sum(int(v or 0) for v in redis.hmget(keys.tokens, ids)) if ids else 0
        paused = redis.get(keys.paused)
        out.append(
            {
                **{k: conf.get(k) for k in ("upstream", "rpm", "tpm", "max_concurrent", "window")},
                "requests": len(ids), "tokens": tokens, "running": int(redis.zcount(keys.running, now, "+inf")),
                "paused_for": max(0.0, float(paused) - now) if paused else 0.0,
            }
        )  # fmt: skip
    return out
