"""The tree side of a budget ledger: its nodes (which rollouts of a tree are alive) and its closing.

:class:`LedgerTree` is a part of :class:`rlmq.common.budget.ledger.BudgetLedger` (its methods are the
ledger's); kept apart so the reservation side reads on its own. A reservation names its caller's
chain of nodes and is refused once one of them is gone, or once the ledger is closed
(:data:`rlmq.common.budget.wire.Code.NODE_GONE`, :data:`~rlmq.common.budget.wire.Code.TREE_CLOSED`).
"""

from __future__ import annotations

from collections.abc import Sequence

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from rlmq.common.budget.wire import CLOSE_WIRE, OPEN_UNLIMITED_WIRE
from rlmq.common.keys import LedgerKeys

__all__ = ["NODE_TTL", "LedgerTree", "node_ttl"]

NODE_TTL = 30
"""Seconds a tree node's key lives without a refresh (:meth:`BudgetLedger.open_node`; at most the
rollout's key TTL, :func:`node_ttl`). Short, unlike the ledger's own TTL (an hour by default): a
host killed with its rollouts stops their subtrees within this long, at their next model call. The
host refreshes its nodes every third of it (:class:`rlmq.producer.live.LiveRollouts`), so two missed
refreshes in a row still keep a node alive; a rollout that ends deletes its node at once."""


def node_ttl(rollout_key_ttl: int) -> int:
    """The TTL of a tree node's key for a rollout whose keys live ``rollout_key_ttl`` seconds:
    ``min(NODE_TTL, rollout_key_ttl)``, at least 1 (seconds)."""
    return max(1, min(NODE_TTL, rollout_key_ttl))


class LedgerTree:
    """Tree nodes and closing of ledgers addressed by their own ids (a part of
    :class:`~rlmq.common.budget.ledger.BudgetLedger`, which sets ``_redis``, ``_ttl`` and the small
    scripts, registered on ``_redis``)."""

    _redis: Redis
    _ttl: int
    _close_script: AsyncScript
    _open_unlimited_script: AsyncScript

    async def open_unlimited(self, ledger_id: str, ttl: int | None = None) -> None:
        """Open a liveness-only ledger ``ledger_id``: no budget, but closable and with tree nodes,
        for a tree whose top has no sub-LLM budget (its calls get :data:`UNLIMITED` while their
        chain is alive). Keeps an existing ledger as it is (only its TTL is pushed).

        Args:
            ttl: seconds it lives after a refresh; default: this object's ``ttl``.

        Raises:
            ValueError: ``ttl`` < 1.
            redis.RedisError: Redis refused or is gone.
        """
        ttl = self._ttl if ttl is None else ttl
        if ttl < 1:
            raise ValueError("ledger ttl must be >= 1 second")
        keys, args = OPEN_UNLIMITED_WIRE.layout(LedgerKeys(ledger_id), ttl=ttl)
        await self._open_unlimited_script(keys=keys, args=args)

    async def open_node(self, ledger_id: str, node_id: str, ttl: int = NODE_TTL) -> None:
        """Mark the tree node ``node_id`` alive in ledger ``ledger_id`` for ``ttl`` seconds (its host
        refreshes it: :meth:`refresh_nodes`). Reservations whose chain names it are granted only
        while it is.

        Raises:
            ConfigError: an invalid id. ValueError: ``ttl`` < 1.
            redis.RedisError: Redis refused or is gone.
        """
        if ttl < 1:
            raise ValueError("node ttl must be >= 1 second")
        await self._redis.set(LedgerKeys(ledger_id).node(node_id), 1, ex=ttl)

    async def refresh_nodes(self, nodes: Sequence[tuple[str, str, int]]) -> None:
        """Push the TTL of live nodes ``(ledger_id, node_id, ttl seconds)`` in one round trip. A node
        already gone (expired, closed, deleted by a reaper) stays gone: ``EXPIRE`` never re-creates it.

        Raises:
            redis.RedisError: Redis refused or is gone.
        """
        if not nodes:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for ledger_id, node_id, ttl in nodes:
                pipe.expire(LedgerKeys(ledger_id).node(node_id), ttl)
            await pipe.execute()

    async def node_alive(self, ledger_id: str, node_id: str) -> bool:
        """True when the node ``node_id`` of ledger ``ledger_id`` is alive (one ``EXISTS``)."""
        return bool(await self._redis.exists(LedgerKeys(ledger_id).node(node_id)))

    async def close_node(self, ledger_id: str, node_id: str) -> None:
        """End the node ``node_id`` (its rollout ended, or a reaper found its attempt dead): every
        later reservation whose chain names it (its own calls, its descendants') is refused, and
        the ledger's parked calls are woken to ask again (those under it are refused now).

        Raises:
            redis.RedisError: Redis refused or is gone.
        """
        keys = LedgerKeys(ledger_id)
        names, args = CLOSE_WIRE.layout(keys, [keys.node(node_id)], close=0)
        await self._close_script(keys=names, args=args)

    async def close(self, ledger_id: str, top_node: str | None = None) -> bool:
        """Close the ledger ``ledger_id`` (its top rollout ended, timed out or was cancelled): every
        later reservation is refused (:data:`TREE_CLOSED`), with or without a chain; settlements
        still count. Deletes the node ``top_node`` too, in the same script, and wakes the ledger's
        parked calls (they are refused now, not at their deadline). A lost ledger is not
        re-created. Returns True when a ledger was closed.

        Raises:
            redis.RedisError: Redis refused or is gone.
        """
        keys = LedgerKeys(ledger_id)
        names, args = CLOSE_WIRE.layout(keys, [keys.node(top_node)] if top_node is not None else [], close=1)
        return bool(await self._close_script(keys=names, args=args))
