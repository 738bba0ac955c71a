"""Live rollouts of one host: their ``rlmq status`` entries and their keys' TTL refresh.

Every rollout key has a TTL, refreshed while the rollout lives, so an abandoned rollout (its
host killed) leaves nothing behind. The rollout engine announces a rollout when it starts
(:meth:`LiveRollouts.enter`: its info hash and its entry in :data:`~rlmq.common.keys.LIVE_ROLLOUTS`)
and withdraws it when it ends (:meth:`LiveRollouts.leave`); the host that runs rollouts (an
``RLMEnv`` today, a worker hosting child rollouts tomorrow) runs :meth:`LiveRollouts.refresh_forever`
beside them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping

from redis.asyncio import Redis
from redis.exceptions import RedisError

from rlmq.common import keys as K
from rlmq.common.ledger import BudgetLedger


class LiveRollouts:
    """The rollouts a host is running now, each with its key TTL (seconds).

    Args:
        redis: an asyncio Redis client.
    """

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._ttls: dict[str, int] = {}
        self._nodes: dict[str, tuple[str, int]] = {}  # rollout id -> (its tree's ledger, node TTL)
        self._node_entered = asyncio.Event()  # wakes refresh_forever to re-time its ticks

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
        """Announce a starting rollout: write its info hash (what ``rlmq status`` shows) and its
        entry in the live-rollout set, both living ``ttl`` seconds unless refreshed.

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
            self._node_entered.set()
        try:
            info_key = K.RolloutKeys(rollout_id).info
            await self._redis.hset(info_key, mapping=dict(info))  # type: ignore[arg-type]  # redis-py's key type is invariant
            await self._redis.expire(info_key, ttl)
            await self._redis.zadd(K.LIVE_ROLLOUTS, {rollout_id: time.time() + ttl})
        except BaseException:  # also cancelled: a command Redis ran before the cancellation is undone
            await self.leave(rollout_id)
            raise

    async def leave(self, rollout_id: str) -> None:
        """Withdraw an ended rollout (also a cancelled one: ``rlmq status`` must not list it as
        live). Never raises for Redis: its entry then expires with its TTL."""
        self._ttls.pop(rollout_id, None)
        self._nodes.pop(rollout_id, None)
        with contextlib.suppress(RedisError, OSError):
            await self._redis.zrem(K.LIVE_ROLLOUTS, rollout_id)

    async def refresh(self) -> None:
        """Push the TTL of every live rollout's keys forward by its own TTL, in one round trip.

        Raises:
            redis.RedisError: Redis refused or is gone.
        """
        live = dict(self._ttls)
        if not live:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for rid, ttl in live.items():
                for key in K.RolloutKeys(rid).all_static():
                    pipe.expire(key, ttl)
                pipe.zadd(K.LIVE_ROLLOUTS, {rid: time.time() + ttl})
            await pipe.execute()
        await self.refresh_nodes()

    async def refresh_nodes(self) -> None:
        """Push the TTL of the live rollouts' tree nodes (a node already gone stays gone).

        Raises:
            redis.RedisError: Redis refused or is gone.
        """
        nodes = [(ledger, rid, ttl) for rid, (ledger, ttl) in list(self._nodes.items())]
        await BudgetLedger(self._redis).refresh_nodes(nodes)

    async def refresh_forever(self, interval: float) -> None:
        """:meth:`refresh` every ``interval`` seconds (a third of the shortest key TTL keeps
        keys alive across two missed refreshes) until cancelled, and the tree nodes' TTL
        (:func:`~rlmq.common.ledger.node_ttl`, 30 s by default) every third of the shortest one
        in between; a failed refresh is retried at the next tick."""
        last = time.monotonic()
        while True:
            shortest = min((ttl for _, ttl in self._nodes.values()), default=None)
            tick = interval if shortest is None else min(interval, shortest / 3)
            self._node_entered.clear()
            with contextlib.suppress(TimeoutError):  # periodic timer, re-timed when a node enters
                await asyncio.wait_for(self._node_entered.wait(), tick)
                continue
            with contextlib.suppress(Exception):
                if time.monotonic() - last >= interval - tick / 10:
                    last = time.monotonic()
                    await self.refresh()
                else:
                    await self.refresh_nodes()
