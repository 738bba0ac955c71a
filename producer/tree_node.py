"""A rollout's place in its tree, as the rollout engine keeps it in Redis.

The whole tree charges one ledger, its top rollout's (:mod:`rlmq.common.budget.ledger`), and every rollout
of the tree is a *node* of it, alive while its host refreshes it:

* The top rollout (depth 1) opens the ledger: a budgeted one (``sub_llm_max_completion_tokens``;
  root turns of its children capped at ``max(per-call cap, 2 * child_root_min_grant_tokens)``), or,
  for a tree without a budget (``max_depth`` > 1), a *liveness-only* one (no limit; calls whose chain
  is alive run ungranted). It opens its own node. When it ends, times out or is cancelled it closes
  the ledger (field ``closed``) and deletes its node in one script: every later reservation of the
  tree is refused (``tree_closed``), also the calls that carry no chain. A depth-1 rollout without
  a budget and without children opens nothing, as before.
* A child (depth >= 2) opens no ledger: it opens its own node (its rollout id) in the tree's ledger,
  its calls carry ``(*tree.nodes, its id)``, its root turns reserve from the tree
  (:class:`~rlmq.producer.root_budget.TreeBudgetedRoot`), and it deletes its node when it ends:
  its descendants' later calls are refused (``parent_gone``).

Node keys live :func:`~rlmq.common.budget.ledger.node_ttl` seconds (30 by default) unless refreshed; the
host's :class:`~rlmq.producer.live.LiveRollouts` refreshes them with the rollout's other keys, so a
host that dies takes its subtrees down within that TTL, at their next model call.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError

from rlmq.common.budget.ledger import ROOT, BudgetLedger, node_ttl
from rlmq.common.settings import RolloutOptions, setting_default
from rlmq.common.tree import TreePosition
from rlmq.producer.budget import RolloutBudget
from rlmq.producer.rollout import Rollout
from rlmq.producer.root import RootClient
from rlmq.producer.root_budget import TreeBudgetedRoot


def tree_position(
    rollout_id: str, tree: TreePosition | None, max_depth: int = setting_default("max_depth")
) -> TreePosition:
    """The position of rollout ``rollout_id``: ``tree``, or a top rollout of a tree at most
    ``max_depth`` deep (the rollout's ``options.max_depth``) when ``None``.

    Raises:
        ValueError: a top position (depth 1) whose ledger is not the rollout's own id.
    """
    pos = tree if tree is not None else TreePosition(ledger_id=rollout_id, depth=1, max_depth=max_depth)
    if pos.depth == 1 and pos.ledger_id != rollout_id:
        raise ValueError(f"a top rollout's ledger is its own id ({rollout_id!r}), not {pos.ledger_id!r}")
    return pos


def chain_of(rollout_id: str, pos: TreePosition) -> tuple[str, ...]:
    """The chain a rollout's calls carry: none for a top rollout, ``(*pos.nodes, rollout_id)`` for a child."""
    return () if pos.depth == 1 else (*pos.nodes, rollout_id)


class TreeNode:
    """One rollout's ledger and node, opened when it starts and closed when it ends.

    Args:
        redis: an asyncio Redis client.
        rollout: the rollout (``ledger_id`` and ``nodes`` already set from ``pos``).
        pos: its position (:func:`tree_position`).
    """

    def __init__(self, redis: Redis, rollout: Rollout, pos: TreePosition) -> None:
        self.rollout = rollout
        self.pos = pos
        self.options: RolloutOptions = rollout.options
        self.ttl = node_ttl(self.options.rollout_key_ttl)
        self._ledger = BudgetLedger(redis, ttl=self.options.rollout_key_ttl)
        self._redis = redis
        self.opened = False

    @property
    def top(self) -> bool:
        return self.pos.depth == 1

    @property
    def has_node(self) -> bool:
        """Whether this rollout is a node in a ledger: every child, and a top that has a ledger."""
        return not self.top or self.rollout.budget is not None or self.pos.max_depth > 1

    @property
    def live_node(self) -> tuple[str, int] | None:
        """``(ledger id, node TTL seconds)`` for the host's key refresh, or ``None``."""
        return (self.pos.ledger_id, self.ttl) if self.has_node else None

    async def open(self) -> None:
        """Open what the rollout needs (see the module docstring); sets ``rollout.ledger``.

        Raises:
            redis.RedisError: Redis refused or is gone.
        """
        ro, o = self.rollout, self.options
        if ro.budget is not None:
            ro.ledger = RolloutBudget(self._redis, ro.ledger_id, o)
        if self.top:
            if ro.ledger is not None:
                await ro.ledger.open(kind_caps={ROOT: max(ro.ledger.cap, 2 * o.child_root_min_grant_tokens)})
            elif self.pos.max_depth > 1:
                await self._ledger.open_unlimited(ro.ledger_id, o.rollout_key_ttl)
        if self.has_node:
            self.opened = True
            await self._ledger.open_node(ro.ledger_id, ro.id, self.ttl)

    def wrap_root(self, root: RootClient) -> RootClient:
        """A child's root client reserves every root turn from the tree; a top's is returned as is."""
        if self.top:
            return root
        return TreeBudgetedRoot(
            root,
            self._ledger,
            self.rollout.ledger_id,
            self.rollout.nodes,
            self.rollout.id,
            min_grant=self.options.child_root_min_grant_tokens,
            deadline=time.time() + self.options.rollout_timeout,
        )

    async def close(self) -> None:
        """End the node (a top: close the whole tree's ledger); never raises for Redis (the node
        then expires within its TTL). Shielded: a cancelled rollout still closes its tree."""
        try:
            if self.opened:
                await asyncio.shield(self._close())
        except (RedisError, OSError):
            pass
        finally:
            with contextlib.suppress(RedisError, OSError):
                await self._ledger.aclose()

    async def _close(self) -> None:
        ro = self.rollout
        if self.top:
            await self._ledger.close(ro.ledger_id, top_node=ro.id)
        else:
            await self._ledger.close_node(ro.ledger_id, ro.id)
