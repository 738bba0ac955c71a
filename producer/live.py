"""Live rollouts of one host: their ``rlmq status`` entries and their keys' TTL refresh.

Every rollout key has a TTL, refreshed while the rollout lives, so an abandoned rollout (its
host killed) leaves nothing behind. The rollout engine announces a rollout when it starts
(:meth:`LiveRollouts.enter`: its info hash and its entry in :data:`~rlmq.common.keys.LIVE_ROLLOUTS`)
and withdraws it when it ends (:meth:`LiveRollouts.leave`); the host that runs rollouts (an
``RLMEnv``, or a worker hosting child rollouts) runs :meth:`LiveRollouts.refresh_forever` beside
them.

Two clocks run in that loop: the rollouts' keys (an hour by default) are pushed forward every
third of their TTL, and the short leases every third of theirs: a tree node's key and the
rollout's entry in the live set, scored by Redis's clock at :func:`lease_seconds` ahead. So
``rlmq status`` stops listing a rollout whose host was killed within that lease (30 s by default),
as it stops counting a killed worker, not when its keys expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping

from redis.asyncio import Redis
from redis.exceptions import RedisError

from rlmq.common import keys as K
from rlmq.common.budget.ledger import BudgetLedger, node_ttl
from rlmq.common.fleet_checks import redis_time


def lease_seconds(ttl: int) -> int:
    """Seconds a live rollout's entry in :data:`~rlmq.common.keys.LIVE_ROLLOUTS` (what ``rlmq
    status`` lists) lives without a refresh, for a rollout whose keys live ``ttl`` seconds: as long
    as its tree node would (:func:`~rlmq.common.budget.ledger.node_ttl`, 30 s at most)."""
    return node_ttl(ttl)


class LiveRollouts:
    """The rollouts a host is running now, each with its key TTL (seconds).

    Args:
        redis: an asyncio Redis client.
    """

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._ttls: dict[str, int] = {}
        self._nodes: dict[str, tuple[str, int]] = {}  # rollout id -> (its tree's ledger, node TTL)
        self._entered = asyncio.Event()  # wakes refresh_forever to re-time its ticks

    def __contains__(self, rollout_id: object) -> bool:
        return rollout_id in self._ttls

    def __len__(self) -> int:
        return len(self._ttls)

    async def enter(
        self,
        rollout_id: str,
        ttl: int,
        info: Mapping[str, str | int | float],
        *,
        node: tuple[str, int] | None = None,
    ) -> None:
        """Announce a starting rollout: write its info hash (what ``rlmq status`` shows), living
        ``ttl`` seconds unless refreshed, and its entry in the live-rollout set, a lease of
        :func:`lease_seconds` by Redis's clock.

        Args:
            node: ``(ledger id, TTL seconds)`` when the rollout is a node of a tree
                (:mod:`rlmq.producer.tree_node`, which opens and deletes the node key): its node
                key is refreshed too, at least every third of its TTL.

        Raises:
            redis.RedisError: Redis refused or is gone (the rollout is then not tracked).
        """
        self._ttls[rollout_id] = ttl
        if node is not None:
            self._nodes[rollout_id] = node
        self._entered.set()
        try:
            info_key = K.RolloutKeys(rollout_id).info
            await self._redis.hset(info_key, mapping=dict(info))  # type: ignore[arg-type]  # redis-py's key type is invariant
            await self._redis.expire(info_key, ttl)
            await self._redis.zadd(K.LIVE_ROLLOUTS, {rollout_id: await redis_time(self._redis) + lease_seconds(ttl)})
        except BaseException:  # also cancelled: a command Redis ran before the cancellation is undone
            await self.leave(rollout_id)
            raise

    async def leave(self, rollout_id: str) -> None:
        """Withdraw an ended rollout (also a cancelled one: ``rlmq status`` must not list it as
        live). Never raises for Redis: its entry then lapses with its lease."""
        self._ttls.pop(rollout_id, None)
        self._nodes.pop(rollout_id, None)
        with contextlib.suppress(RedisError, OSError):
            await self._redis.zrem(K.LIVE_ROLLOUTS, rollout_id)

    async def refresh(self) -> None:
        """Push the TTL of every live rollout's keys forward by its own TTL (one round trip), then
        its leases (:meth:`refresh_leases`).

        Raises:
            redis.RedisError: Redis refused or is gone.
        """
        live = dict(self._ttls)
        if live:
            async with self._redis.pipeline(transaction=False) as pipe:
                for rid, ttl in live.items():
                    for key in K.RolloutKeys(rid).all_static():
                        pipe.expire(key, ttl)
                await pipe.execute()
        await self.refresh_leases()

    async def refresh_leases(self) -> None:
        """Push the live rollouts' short leases forward: their tree nodes' TTL (a node already gone
        stays gone) and their live-set entries (:func:`lease_seconds` past Redis's clock).

        Raises:
            redis.RedisError: Redis refused or is gone.
        """
        live = dict(self._ttls)
        if not live:
            return
        now = await redis_time(self._redis)  # Redis's clock, never this host's
        await self._redis.zadd(K.LIVE_ROLLOUTS, {rid: now + lease_seconds(ttl) for rid, ttl in live.items()})
        nodes = [(ledger, rid, ttl) for rid, (ledger, ttl) in list(self._nodes.items())]
        await BudgetLedger(self._redis).refresh_nodes(nodes)

    def periods(self, interval: float) -> tuple[float, float]:
        """``(keys, leases)``: how often (seconds) the live rollouts' keys and their leases (tree
        nodes, live-set entries) are refreshed: a third of the shortest TTL of each kind, at most
        ``interval`` (a rollout that entered with a TTL shorter than this host's own gets its keys
        refreshed in time too)."""
        keys = min([interval, *(ttl / 3 for ttl in self._ttls.values())])
        leases = [*(lease_seconds(ttl) / 3 for ttl in self._ttls.values()), *(t / 3 for _, t in self._nodes.values())]
        return keys, min([keys, *leases])

    async def refresh_forever(self, interval: float) -> None:
        """:meth:`refresh` the live rollouts' keys every :meth:`periods` seconds (a third of the
        shortest key TTL keeps keys alive across two missed refreshes) until cancelled, and their
        leases (:meth:`refresh_leases`: tree nodes and live-set entries, 30 s by default) every
        third of the shortest one in between; a failed refresh is retried at the next tick.

        The ticks are due at fixed times from the last refresh of each kind: a rollout that enters
        (its TTLs may shorten the periods) wakes the loop to re-time them, never to restart their wait,
        so nodes entering however often never starve the refresh.

        Args:
            interval: the longest period (seconds) between two refreshes of the keys.
        """
        last_keys = last_leases = time.monotonic()
        while True:
            keys_every, leases_every = self.periods(interval)
            now = time.monotonic()
            due = min(last_keys + keys_every, last_leases + leases_every)
            if now < due:
                self._entered.clear()
                with contextlib.suppress(TimeoutError):  # periodic timer, re-timed when a rollout enters
                    await asyncio.wait_for(self._entered.wait(), due - now)
                continue
            whole = now >= last_keys + keys_every
            last_leases = now
            if whole:
                last_keys = now
            with contextlib.suppress(Exception):
                await (self.refresh() if whole else self.refresh_leases())
