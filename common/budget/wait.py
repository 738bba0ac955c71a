"""Budgeted calls that wait for a release of their rollout's budget, woken by Redis pub/sub.

The ledger (:mod:`rlmq.common.budget.ledger`) answers "wait" when less than a full grant is free
but live reservations (calls still running, before their deadline) may give tokens back.
Such a call *parks* here. The process keeps one pub/sub connection, subscribed to the
``rlmq:{<rollout>}:released`` channel (:attr:`rlmq.common.keys.LedgerKeys.released`) of every
rollout with a waiting call, to which the ledger's settle script publishes. A parked call
asks again when

* a release of its rollout is published: the message says how many tokens are free and how
  many live reservations are left; the process wakes, in arrival order, each parked call of
  that rollout whose grant fits in what is still free (every one of them when no live
  reservation is left: they get the last remainder or a rejection),
* a subscription of its rollout's channel is confirmed (a release published before it was
  unheard),
* the pub/sub connection fails (every waiting call asks again; a new connection subscribes
  to every channel still wanted, and its confirmations wake them once more),
* the earliest live reservation's deadline passes (it stops counting as live: a dead
  worker's reservation holds its tokens, but nobody waits for it any more; when the ledger,
  by Redis's clock, still counts it live after this host's clock passed it, the call asks
  again after a short pause that grows, :data:`STALE_RETRY_FIRST`), or
* it gives up at its own deadline minus a margin: a clear rejection, never a hang.

Why no wake-up is lost (``tests/unit/test_budget_wait_model.py`` explores the orderings):

1. A call marks its rollout's channel *wanted* before it asks the ledger, and reads the
   rollout's wake count before each ask; a wake that arrives while it asks makes it ask
   again instead of parking.
2. Every release published after that ask reaches the process: either the channel was
   subscribed when Redis ran the ask (the message follows), or its ``SUBSCRIBE`` is processed
   after the ask and its confirmation, read after the ask, wakes the call; or the connection
   failed, which wakes every waiting call.
3. Exactly one pub/sub connection exists at a time, and only two tasks touch it: the *reader*
   makes it (subscribing every wanted channel), reads it, and on any error throws it away and
   makes a new one; the *syncer* sends the ``SUBSCRIBE`` / ``UNSUBSCRIBE`` that follow the wanted
   set. Both hold one lock while they connect or send, and redis-py's own reconnect-in-place is
   off for this connection, so no connection is made twice and no subscription lands on a
   connection nobody reads. (Calls used to subscribe themselves: two rollouts whose first
   waits met while the lazily made connection was still connecting made two connections, and
   the calls whose subscription went to the one nobody read parked until their deadline.)
4. Calls never send a pub/sub command themselves, so a killed pub/sub connection can only
   wake them, never fail them.

A parked call does not occupy one of its worker's in-flight slots (the worker adds
:attr:`ReleaseWaits.parked` back to its free slots, up to a bound), so one rollout's
waiting calls cannot starve another rollout of the worker; a call granted after parking
passes the worker's resume gate (:attr:`rlmq.common.budget.ledger.BudgetLedger.resume_gate`)
before it calls the model, so running calls stay within the worker's concurrency.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from rlmq.common.budget.wire import Code, Grant, Release
from rlmq.common.keys import LedgerKeys

log = logging.getLogger(__name__)


class _Asks(Protocol):
    """What a waiter needs of the ledger (:class:`rlmq.common.budget.ledger.BudgetLedger`): to ask again
    and to count a call that gave up. A protocol, so this module does not import the ledger,
    which imports it."""

    async def reserve_until(
        self, until: float, ledger_id: str, reservation_id: str, cap: int | None, deadline: float | None = None
    ) -> Grant: ...

    async def count_rejections(self, ledger_id: str, n: int) -> None: ...


__all__ = ["ReleaseWaits"]

MAX_BACKOFF = 2.0
"""Seconds, at most, between two attempts to make the pub/sub connection again."""
LINK_CHECK_SECONDS = 10.0
"""Seconds the pub/sub connection may say nothing before the reader sends it a ``PING``; a link
that then says nothing for as long again is thrown away (a half-open connection, as a NAT that
forgot an idle flow leaves, would otherwise strand every parked call until a deadline)."""


LEASE_END_SLACK = 0.05
"""Seconds after a grant lease's end at which its parked calls ask again (clock skew, rounding)."""

STALE_RETRY_FIRST, STALE_RETRY_MAX = 0.05, 1.0
"""Seconds before a call asks again when the ledger said "wait until ``retry_at``" and ``retry_at``
has already passed by this host's clock (the live reservation ended between the ledger's check
and now, or Redis's clock is behind this host's): the first pause, doubled at each such answer
up to the second. Without it such a call would park until its own deadline."""


def _park_until(grant: Grant, give_up: float, now: float, stale: int) -> tuple[float, int]:
    """When a call told to wait (``grant``) asks again, in Unix seconds, and how many such answers
    in a row had a ``retry_at`` already passed by this host's clock (``stale``: the count before
    this one): at the earliest live reservation's deadline (``retry_at``), or, when that has
    passed, after a pause of :data:`STALE_RETRY_FIRST` doubled for each earlier such answer;
    never after ``give_up``."""
    if grant.retry_at <= 0:
        return give_up, 0
    if grant.retry_at > now:
        return min(give_up, grant.retry_at), 0
    pause: float = STALE_RETRY_FIRST * 2.0**stale
    return min(give_up, now + min(STALE_RETRY_MAX, pause)), stale + 1


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


TAIL = -1
"""What :func:`_fits` says for a release with no live reservation left and tokens free: the last
remainder goes to one call (whichever asks first), so one parked call is woken, not all of them."""


def _fits(data: Any) -> tuple[int | None, float | None]:
    """What a release (:class:`rlmq.common.budget.wire.Release`) says: the tokens the parked calls
    may share (``None``: wake them all: nothing is free and no live reservation is left, so each
    gets a rejection, or the message is not one of these; :data:`TAIL`: nothing live and some
    tokens free: the last remainder, for one call, whose settle wakes the next) and when the
    ledger's earliest grant lease ends (Unix seconds; ``None``: no lease is open). A grant not begun
    by then is reclaimed by the next ask, so the parked calls ask again then."""
    release = Release.of(data if isinstance(data, bytes | str) else str(data))
    if release is None:
        return None, None
    if release.live <= 0:
        return (TAIL if release.free > 0 else None), release.lease_end
    return release.free, release.lease_end


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Link:
    """One pub/sub connection: made, read and closed by :class:`ReleaseWaits`' reader only.

    Its connection is its own (not the pool's) and does not reconnect in place: redis-py's
    retry would reconnect it under a reader and a sender at once. A failed link is thrown
    away; a new one subscribes again to every wanted channel.
    """

    def __init__(self, redis: Redis) -> None:
        self.pubsub: Any = redis.pubsub()
        conn = redis.connection_pool.make_connection()  # type: ignore[no-untyped-call]
        conn.retry = Retry(NoBackoff(), 0, supported_errors=())  # fail, never reconnect in place
        conn.health_check_interval = 0  # no PING of its own between a reader and a sender
        self.pubsub.connection = conn
        self.conn: Any = conn
        self.channels: set[str] = set()
        """Channels whose ``SUBSCRIBE`` was sent on this link (and no ``UNSUBSCRIBE`` since)."""
        self.unconfirmed: dict[str, int] = {}
        """Channel -> ``SUBSCRIBE`` commands sent on this link whose confirmation has not been read."""

    async def subscribe(self, channels: list[str]) -> None:
        self.channels.update(channels)
        for ch in channels:
            self.unconfirmed[ch] = self.unconfirmed.get(ch, 0) + 1
        await self.pubsub.subscribe(*channels)

    async def unsubscribe(self, channels: list[str]) -> None:
        self.channels.difference_update(channels)
        await self.pubsub.unsubscribe(*channels)

    def confirm(self, channel: str) -> bool:
        """A ``subscribe`` reply for ``channel`` was read; True when its latest ``SUBSCRIBE`` is confirmed."""
        left = self.unconfirmed.pop(channel, 0) - 1
        if left > 0:
            self.unconfirmed[channel] = left  # a later SUBSCRIBE of it is still unanswered
        return left <= 0 and channel in self.channels

    def confirmed(self, channel: str) -> bool:
        return channel in self.channels and self.unconfirmed.get(channel, 0) == 0

    @property
    def up(self) -> bool:
        return bool(self.conn.is_connected)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.conn.disconnect(nowait=True)


CLOSE_WAIT_SECONDS = 5.0
"""Seconds :meth:`ReleaseWaits.aclose` waits for its cancelled tasks and for its connection to close."""


class ReleaseWaits:
    """The parked budgeted calls of one process and their pub/sub subscriptions.

    Args:
        redis: the process's asyncio client; the pub/sub connection is made from its pool's
            settings (made on the first wait, again after it fails).
        on_change: called whenever :attr:`parked` changes (the worker recounts its free slots).
    """

    def __init__(self, redis: Redis, on_change: Callable[[], None]) -> None:
        self._redis = redis
        self._on_change = on_change
        self._lock = asyncio.Lock()  # held while the link is made or a command is sent on it
        self._link: _Link | None = None
        self._reader: asyncio.Task[None] | None = None
        self._syncer: asyncio.Task[None] | None = None
        self._dirty = asyncio.Event()  # the wanted channels changed: the syncer sends the difference
        self._backoff = 0.05  # seconds before the next link, after a failed one
        self._refs: dict[str, int] = {}  # rollout -> calls in a wait episode
        self._wanted: dict[str, str] = {}  # channel -> rollout, for every rollout with calls in an episode
        self._seen: dict[str, int] = {}  # rollout -> wakes (releases, confirmations, failures) seen
        self._parked: dict[str, dict[asyncio.Future[None], int]] = {}  # rollout -> parked call -> need
        self._lease_ends: dict[str, tuple[float, asyncio.TimerHandle]] = {}  # rollout -> (when, its wake)
        self._closed = False
        self._abandoned = False
        self._failures = 0  # wake-ups of every call (a failed link, closing) so far
        self.parked = 0
        """Calls parked now (waiting for a release)."""
        self.links = 0
        """Pub/sub connections made so far (one, unless one failed)."""

    async def wait_for_grant(
        self,
        ledger: _Asks,
        rollout_id: str,
        reservation_id: str,
        cap: int | None,
        deadline: float,
        give_up: float,
        grant: Grant,
    ) -> tuple[Grant, int, float]:
        """Ask the ledger again until it grants or rejects, parking between asks.

        Args:
            ledger: the ledger to ask (its :meth:`~rlmq.common.budget.ledger.BudgetLedger.reserve_until`).
            rollout_id / reservation_id / cap / deadline: the reservation (tokens, Unix seconds).
            give_up: Unix time (seconds) at which to stop waiting.
            grant: the "wait" answer that brought the call here.

        Returns:
            ``(grant, parks, parked seconds)``; the grant's code is never 4 (wait): a call
            still told to wait at ``give_up`` gets code 5 (waited out) and is counted in
            the ledger's ``rejections``.

        Raises:
            redis.RedisError: asking the ledger failed (never the pub/sub connection: its
                failures only wake the waiting calls).
            asyncio.CancelledError: the worker is stopping (:meth:`abandon`): the call is not
                granted after all, and its job is handed back to the queue unrun.
        """
        parks, parked_seconds, stale = 0, 0.0, 0
        self._enter(rollout_id)
        failures = self._failures
        try:
            until, stale = _park_until(grant, give_up, time.time(), stale)
            while True:
                if (
                    not self._confirmed(rollout_id)
                    and failures == self._failures
                    and not self._closed
                    and not self._abandoned
                ):
                    # Not subscribed yet (or again): its confirmation wakes this call, which then asks;
                    # asking before it would only be asked again. After a link failure, though, the
                    # call asks at once: a release may have gone unheard, and the next link may
                    # never confirm (a link that stays silent fails again, and the call asks again).
                    t0 = time.monotonic()
                    await self._park(rollout_id, max(0.001, until - time.time()), 0, counted=False)
                    parked_seconds += time.monotonic() - t0
                # Read before asking: a wake that comes while the ask is out makes it ask again.
                seen = self._seen.get(rollout_id, 0)
                failures = self._failures
                grant = await ledger.reserve_until(give_up, rollout_id, reservation_id, cap, deadline)
                if grant.code != Code.WAIT:
                    if not grant.granted:  # refused: a last remainder it was woken for goes to the next
                        self._wake(rollout_id, TAIL)
                    return grant, parks, parked_seconds
                if self._abandoned:
                    raise asyncio.CancelledError("the worker is stopping: a parked call is handed back")
                now = time.time()
                if now >= give_up or self._closed:
                    with contextlib.suppress(RedisError, OSError):
                        await ledger.count_rejections(rollout_id, 1)
                    return Grant(0, grant.charged, grant.limit, Code.WAITED_OUT), parks, parked_seconds
                if self._seen.get(rollout_id, 0) != seen:
                    continue  # woken while asking: ask again at once
                until, stale = _park_until(grant, give_up, now, stale)
                t0 = time.monotonic()
                await self._park(rollout_id, max(0.001, until - now), grant.need)
                parks += 1
                parked_seconds += time.monotonic() - t0
        finally:
            self._leave(rollout_id)

    def _enter(self, rollout_id: str) -> None:
        """A call of ``rollout_id`` starts waiting: its channel is wanted from now on (before its
        next ask, so every release after that ask reaches this process or a wake replaces it)."""
        self._refs[rollout_id] = self._refs.get(rollout_id, 0) + 1
        if self._refs[rollout_id] == 1:
            self._wanted[LedgerKeys(rollout_id).released] = rollout_id
            self._dirty.set()
        if self._closed:
            return
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read_loop(), name="budget-releases")
        if self._syncer is None or self._syncer.done():
            self._syncer = asyncio.create_task(self._sync_loop(), name="budget-subscriptions")

    def _leave(self, rollout_id: str) -> None:
        self._refs[rollout_id] -= 1
        if self._refs[rollout_id] == 0:
            del self._refs[rollout_id]
            self._wanted.pop(LedgerKeys(rollout_id).released, None)
            self._seen.pop(rollout_id, None)
            lease = self._lease_ends.pop(rollout_id, None)
            if lease is not None:
                lease[1].cancel()
            self._dirty.set()

    async def _park(self, rollout_id: str, timeout: float, need: int, *, counted: bool = True) -> None:
        """Wait until woken (:meth:`_wake`) or ``timeout`` seconds pass; ``counted``: in :attr:`parked`
        (a call waiting only for its subscription's confirmation, one round trip, keeps its slot)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._parked.setdefault(rollout_id, {})[fut] = need
        timer = loop.call_later(timeout, _resolve, fut)  # a deadline, not a polling interval
        if counted:
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
            if counted:
                self.parked -= 1
                self._on_change()

    def _wake(self, rollout_id: str, free: int | None = None) -> None:
        """Wake the parked calls of ``rollout_id`` whose grants fit in ``free`` tokens (``None``: all;
        :data:`TAIL`: the first, unless one is woken and has not asked yet), in arrival order; calls
        already woken (not yet gone) take no share."""
        self._seen[rollout_id] = self._seen.get(rollout_id, 0) + 1
        for fut, need in list(self._parked.get(rollout_id, {}).items()):
            if free == TAIL:  # the last remainder: the first call woken (now or before) asks for it
                if fut.cancelled():
                    continue
                if not fut.done():
                    _resolve(fut)
                return
            if fut.done():
                continue
            if free is not None:
                if need > free:
                    continue  # this one waits on; a smaller grant behind it may fit
                free -= need
            _resolve(fut)

    def _confirmed(self, rollout_id: str) -> bool:
        """True when this rollout's channel is subscribed, confirmed, on the link being read."""
        link = self._link
        return link is not None and link.confirmed(LedgerKeys(rollout_id).released)

    def _wake_all(self) -> None:
        self._failures += 1  # a failed link (or closing): every waiting call asks before it waits again
        for rollout_id in set(self._refs) | set(self._parked):
            self._wake(rollout_id)

    # ------------------------------------------------------------------ the pub/sub connection

    async def _read_loop(self, failed: _Link | None = None) -> None:
        """Make the link, read it, and after any failure throw it away and make another.

        Args:
            failed: a link the syncer gave up on (closed here first, then a backoff).
        """
        if failed is not None:
            await failed.close()
            await asyncio.sleep(self._backoff)  # reconnect backoff, not synchronisation
            self._backoff = min(self._backoff * 2, MAX_BACKOFF)
        while not self._closed:
            link: _Link | None = None
            try:
                async with self._lock:
                    link = _Link(self._redis)
                    self.links += 1
                    await link.conn.connect()
                    wanted = list(self._wanted)
                    if wanted:
                        await link.subscribe(wanted)
                    self._link = link
                self._dirty.set()  # the wanted set may have changed while connecting
                pinged = False
                while True:
                    if not link.up:  # get_message would reconnect it in place
                        raise ConnectionError("the pub/sub connection was closed")
                    message = await link.pubsub.get_message(timeout=LINK_CHECK_SECONDS)
                    if message:
                        self._backoff = 0.05
                        pinged = False  # anything read (the PONG too) shows the link is alive
                        self._dispatch(link, message)
                        continue
                    if pinged:
                        raise ConnectionError(f"the pub/sub connection did not answer PING in {LINK_CHECK_SECONDS:g} s")
                    if not link.up:
                        raise ConnectionError("the pub/sub connection was closed")
                    async with self._lock:
                        await link.pubsub.ping()
                    pinged = True
            except asyncio.CancelledError:
                if link is not None:
                    if self._link is link:
                        self._link = None
                    await link.close()
                raise
            except Exception as exc:  # RedisError, OSError, or redis-py's own AttributeError on a killed connection
                if not self._closed:
                    log.warning("budget release connection failed (%r); waiting calls ask again", exc)
            if self._link is link:
                self._link = None
            if link is not None:
                await link.close()
            self._wake_all()  # a release may have gone unheard while the link was failing
            if self._closed:
                return
            await asyncio.sleep(self._backoff)  # reconnect backoff, not synchronisation
            self._backoff = min(self._backoff * 2, MAX_BACKOFF)

    async def _sync_loop(self) -> None:
        """Send the ``SUBSCRIBE`` / ``UNSUBSCRIBE`` that make the link's channels the wanted ones."""
        while not self._closed:
            await self._dirty.wait()
            self._dirty.clear()
            async with self._lock:
                link = self._link
                if link is None or not link.up:
                    continue  # the reader's next link subscribes to every wanted channel
                drop = [ch for ch in link.channels if ch not in self._wanted]
                add = [ch for ch in self._wanted if ch not in link.channels]
                try:
                    if drop:
                        await link.unsubscribe(drop)
                    if add:
                        await link.subscribe(add)
                except Exception as exc:  # any failure: the link goes, a new reader makes a new one
                    if self._closed:
                        return
                    log.warning("budget release subscription failed (%r); reconnecting", exc)
                    self._restart_reader(link)

    def _restart_reader(self, link: _Link) -> None:
        """Throw ``link`` away: cancel the reader (which closes it) and start a new one; every waiting
        call asks again, and the new link's confirmations wake them once more."""
        if self._reader is not None:
            self._reader.cancel()
        if self._link is link:
            self._link = None
        self._reader = asyncio.create_task(self._read_loop(link), name="budget-releases")
        self._wake_all()

    def _dispatch(self, link: _Link, message: dict[str, Any]) -> None:
        channel = _text(message.get("channel"))
        kind = message.get("type")
        confirmed = kind == "subscribe" and link.confirm(channel)
        rollout_id = self._wanted.get(channel)
        if rollout_id is None:
            return
        if confirmed:
            self._wake(rollout_id)  # (re)subscribed: a release may have gone unheard before
        elif kind == "message":
            free, lease_end = _fits(message.get("data"))
            self._wake(rollout_id, free)
            if lease_end is not None:
                self._wake_at_lease_end(rollout_id, lease_end)

    def _wake_at_lease_end(self, rollout_id: str, lease_end: float) -> None:
        """Wake every parked call of ``rollout_id`` once the grant lease ending at ``lease_end`` (Unix
        seconds, Redis's clock) has ended: their next ask reclaims it if its call never began. One
        timer per rollout, the earliest end wins."""
        known = self._lease_ends.get(rollout_id)
        if known is not None and known[0] <= lease_end:
            return
        if known is not None:
            known[1].cancel()
        delay = max(0.0, lease_end - time.time()) + LEASE_END_SLACK

        def fire() -> None:
            self._lease_ends.pop(rollout_id, None)
            self._wake(rollout_id)

        self._lease_ends[rollout_id] = (lease_end, asyncio.get_running_loop().call_later(delay, fire))

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
        for _, timer in self._lease_ends.values():
            timer.cancel()
        self._lease_ends.clear()
        self._wake_all()
        tasks = {t for t in (self._reader, self._syncer) if t is not None}
        for task in tasks:
            task.cancel()
        if tasks:  # bounded: a task stuck on a dead connection must not hang its process's stop
            done, _ = await asyncio.wait(tasks, timeout=CLOSE_WAIT_SECONDS)
            for task in done:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    task.result()
        if self._link is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._link.close(), CLOSE_WAIT_SECONDS)
            self._link = None
