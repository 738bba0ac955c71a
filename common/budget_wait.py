"""Budgeted calls that wait for a release of their rollout's budget, woken by Redis pub/sub.

The ledger (:mod:`rlmq.common.ledger`) answers "wait" when less than a full grant is free
but live reservations (calls still running, before their deadline) may give tokens back.
Such a call *parks* here: one pub/sub connection per process, subscribed to the
``rlmq:{<rollout>}:released`` channel (:attr:`rlmq.common.keys.RolloutKeys.released`) of every
rollout with a parked call, to which the ledger's settle script publishes. A parked call
asks again when

* a release of its rollout is published: the message says how many tokens are free and how
  many live reservations are left; the process wakes its parked calls of that rollout in
  arrival order as long as their grants fit in what is free (every one of them when no live
  reservation is left: they get the last remainder or a rejection). Woken calls ask again in
  one coalesced script call per process,
* the earliest live reservation's deadline passes (it stops counting as live: a dead
  worker's reservation holds its tokens, but nobody waits for it any more),
* its subscription is confirmed again after the pub/sub connection was lost (a release
  published meanwhile may have been missed), or
* it gives up at its own deadline minus a margin: a clear rejection, never a hang.

No sleeps: every wait is a future woken by a message, bounded by a deadline. Lost wake-ups
are excluded by subscribing *before* asking again, and by a per-rollout count of releases
seen: a release that arrives while a call is asking makes it ask once more.

A parked call does not occupy one of its worker's in-flight slots (the worker adds
:attr:`ReleaseWaits.parked` back to its free slots, up to a bound), so one rollout's
waiting calls cannot starve another rollout of the worker; a call granted after parking
passes the worker's resume gate (:attr:`rlmq.common.ledger.BudgetLedger.resume_gate`)
before it calls the model, so running calls stay within the worker's concurrency.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from rlmq.common.keys import RolloutKeys

if TYPE_CHECKING:
    from rlmq.common.ledger import BudgetLedger, Grant

log = logging.getLogger(__name__)

__all__ = ["ReleaseWaits"]


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _fits(data: Any) -> int | None:
    """Tokens the parked calls may share after a release ``'<free> <live>'``; ``None``: wake them all
    (no live reservation is left, so each gets the last remainder or a rejection)."""
    try:
        free, live = (int(x) for x in (data.decode() if isinstance(data, bytes) else str(data)).split())
    except ValueError:
        return None
    return None if live <= 0 else free


class ReleaseWaits:
    """The parked budgeted calls of one process and their pub/sub subscriptions.

    Args:
        redis: the process's asyncio client; one connection of its pool becomes the
            pub/sub connection (made on the first wait).
        on_change: called whenever :attr:`parked` changes (the worker recounts its free slots).
    """

    def __init__(self, redis: Redis, on_change: Callable[[], None]) -> None:
        self._redis = redis
        self._on_change = on_change
        self._pubsub: Any = None
        self._listener: asyncio.Task[None] | None = None
        self._refs: dict[str, int] = {}  # rollout -> calls in a wait episode
        self._confirmed: dict[str, asyncio.Event] = {}  # rollout -> subscription confirmed
        self._channels: dict[str, str] = {}  # channel -> rollout
        self._seen: dict[str, int] = {}  # rollout -> releases (and re-subscriptions) seen
        self._parked: dict[str, dict[asyncio.Future[None], int]] = {}  # rollout -> parked call -> need
        self._closed = False
        self._abandoned = False
        self.parked = 0
        """Calls parked now (waiting for a release)."""

    async def wait_for_grant(
        self,
        ledger: BudgetLedger,
        rollout_id: str,
        reservation_id: str,
        cap: int | None,
        deadline: float,
        give_up: float,
        grant: Grant,
    ) -> tuple[Grant, int, float]:
        """Ask the ledger again until it grants or rejects, parking between asks.

        Args:
            ledger: the ledger to ask (its :meth:`~rlmq.common.ledger.BudgetLedger.reserve`).
            rollout_id / reservation_id / cap / deadline: the reservation (tokens, Unix seconds).
            give_up: Unix time (seconds) at which to stop waiting.
            grant: the "wait" answer that brought the call here.

        Returns:
            ``(grant, parks, parked seconds)``; the grant's code is never 4 (wait): a call
            still told to wait at ``give_up`` gets code 5 (waited out) and is counted in
            the ledger's ``rejections``.

        Raises:
            redis.RedisError: asking the ledger failed.
            asyncio.CancelledError: the worker is stopping (:meth:`abandon`): the call is not
                granted after all, and its job is handed back to the queue unrun.
        """
        from rlmq.common.ledger import WAIT, WAITED_OUT, Grant

        parks, parked_seconds = 0, 0.0
        self._refs[rollout_id] = self._refs.get(rollout_id, 0) + 1
        try:
            await self._subscribe(rollout_id, give_up)
            while True:
                seen = self._seen.get(rollout_id, 0)
                grant = await ledger.reserve(rollout_id, reservation_id, cap, deadline)
                if grant.code != WAIT:
                    return grant, parks, parked_seconds
                if self._abandoned:
                    raise asyncio.CancelledError("the worker is stopping: a parked call is handed back")
                now = time.time()
                if now >= give_up or self._closed:
                    with contextlib.suppress(RedisError, OSError):
                        await ledger.count_rejections(rollout_id, 1)
                    return Grant(0, grant.charged, grant.limit, WAITED_OUT), parks, parked_seconds
                if self._seen.get(rollout_id, 0) != seen:
                    continue  # a release came while asking: ask again at once
                until = min(give_up, grant.retry_at) if grant.retry_at > now else give_up
                t0 = time.monotonic()
                await self._park(rollout_id, max(0.001, until - now), grant.need)
                parks += 1
                parked_seconds += time.monotonic() - t0
        finally:
            self._refs[rollout_id] -= 1
            if self._refs[rollout_id] == 0:
                del self._refs[rollout_id]
                await self._unsubscribe(rollout_id)

    async def _park(self, rollout_id: str, timeout: float, need: int) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._parked.setdefault(rollout_id, {})[fut] = need
        timer = loop.call_later(timeout, _resolve, fut)  # a deadline, not a polling interval
        self.parked += 1
        self._on_change()
        try:
            await fut
        finally:
            timer.cancel()
            waiting = self._parked.get(rollout_id)
            if waiting is not None:
                waiting.pop(fut, None)
                if not waiting:
                    del self._parked[rollout_id]
            self.parked -= 1
            self._on_change()

    def _wake(self, rollout_id: str, free: int | None = None) -> None:
        """Wake the parked calls of ``rollout_id`` whose grants fit in ``free`` tokens (``None``: all)."""
        self._seen[rollout_id] = self._seen.get(rollout_id, 0) + 1
        for fut, need in list(self._parked.get(rollout_id, {}).items()):
            if free is not None:
                if need > free:
                    break  # arrival order: a later, smaller call does not overtake
                free -= need
            _resolve(fut)

    def _wake_all(self) -> None:
        for rollout_id in list(self._parked):
            self._wake(rollout_id)
        for event in self._confirmed.values():
            event.set()  # nobody waits for a confirmation that a lost connection may never send

    async def _subscribe(self, rollout_id: str, give_up: float) -> None:
        event = self._confirmed.get(rollout_id)
        if event is None:
            event = self._confirmed[rollout_id] = asyncio.Event()
            channel = RolloutKeys(rollout_id).released
            self._channels[channel] = rollout_id
            if self._pubsub is None:
                self._pubsub = self._redis.pubsub()
            try:
                await self._pubsub.subscribe(channel)
            except (RedisError, OSError) as exc:
                log.warning("could not subscribe to budget releases of %s (%s)", rollout_id, exc)
                event.set()  # ask anyway; the waits stay bounded by their deadlines
            if self._listener is None or self._listener.done():
                self._listener = asyncio.create_task(self._listen(), name="budget-releases")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), max(0.001, give_up - time.time()))

    async def _unsubscribe(self, rollout_id: str) -> None:
        channel = RolloutKeys(rollout_id).released
        self._confirmed.pop(rollout_id, None)
        self._channels.pop(channel, None)
        self._seen.pop(rollout_id, None)
        if self._pubsub is not None and not self._closed:
            with contextlib.suppress(RedisError, OSError):
                await self._pubsub.unsubscribe(channel)

    async def _listen(self) -> None:
        backoff = 0.05
        while not self._closed:
            try:
                message = await self._pubsub.get_message(timeout=None)
                backoff = 0.05
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # RedisError, OSError, or anything else: it must not die
                log.warning("budget release listener failed (%r); parked calls ask again", exc)
                self._wake_all()
                await asyncio.sleep(backoff)  # reconnect backoff, not synchronisation
                backoff = min(backoff * 2, 2.0)
                continue
            if not message:
                continue
            channel = message.get("channel")
            channel = channel.decode() if isinstance(channel, bytes) else str(channel)
            rollout_id = self._channels.get(channel)
            if rollout_id is None:
                continue
            if message.get("type") == "subscribe":
                event = self._confirmed.get(rollout_id)
                if event is not None:
                    event.set()
                self._wake(rollout_id)  # (re)subscribed: a release may have gone unheard
            elif message.get("type") == "message":
                self._wake(rollout_id, _fits(message.get("data")))

    def abandon(self) -> None:
        """The worker is stopping: every parked call, and every call that would park from now
        on, ends with :class:`asyncio.CancelledError` at its next answer from the ledger, so
        its job is handed back instead of calling the model during the worker's grace period
        (a grant it was about to get stays free for the rest of the fleet)."""
        self._abandoned = True
        self._wake_all()

    async def aclose(self) -> None:
        """Wake every parked call (each asks once more, then gives up) and close the connection."""
        self._closed = True
        self._wake_all()
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._listener
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                await self._pubsub.aclose()
