"""A child rollout's root turns under its tree's budget: a :class:`~rlmq.producer.root.RootClient`
wrapper that reserves before every root call.

Every root-model completion token of a child rollout (depth >= 2) counts against the tree's one
budget, the top rollout's ledger, exactly like a sub-LLM turn: before each root turn the wrapper
reserves a grant of kind :data:`~rlmq.common.budget.ledger.ROOT` with the child's node chain (refused when
the tree or an ancestor has ended), calls the root model with ``max_tokens`` = the grant, and
settles with the completion tokens the server reported (the whole grant when it reported none, or
when the call failed: the tokens may have been spent). Zero overshoot holds as for sub-LLM calls.

A root turn takes its grant as a sub-call does: its whole ``max_tokens`` while that much is free,
else it waits while running calls of the tree may give tokens back, then takes the budget's last
remainder (:attr:`~rlmq.common.budget.ledger.Grant.cut`: the turn may be cut). Only a remainder below
``child_root_min_grant_tokens`` (tokens no root turn could use) is given back (settled at 0) and
ends the child; once a root turn of the tree has ended on its own, the remainder a turn can use
reaches down to an estimate of a root turn (1.25 x the longest that ended, at least 64 tokens), as a
sub-call's first segment does: :class:`~rlmq.common.errors.RootBudgetSpent`, which the root loop turns into the stop
reason ``budget_spent`` with the child's best answer so far. (Before, any remainder below the whole
turn ended the child: 32 trees of budget 2,000 ended every child before its first turn, "the tree
budget has 1805 tokens left, less than the whole 2000 a root turn needs".) A refusal by the tree (``tree_closed``,
``parent_gone``) or a lost ledger ends the child the same way. A tree without a budget (a
liveness-only ledger) gets no grant: the call runs as it would have, once its chain is found alive.

The engine wraps a child's root client with :class:`TreeBudgetedRoot`; a top rollout's root turns
are not charged (its own root limit is ``root_max_completion_tokens``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from redis.exceptions import RedisError

from rlmq.common.budget.ledger import NO_LEDGER, ROOT, UNLIMITED, WAITED_OUT, BudgetLedger, Grant
from rlmq.common.errors import RootBudgetSpent
from rlmq.producer.root import RootClient
from rlmq.producer.root_tokens import served_completion_ids


class TreeBudgetedRoot:
    """Root calls of one child rollout, each reserved from its tree's ledger first.

    Args:
        inner: the root model client.
        ledger: the budget ledger client.
        ledger_id: the tree's ledger (the top rollout's id).
        nodes: the child's chain, top .. the child itself.
        rollout_id: the child's id (names its reservations ``<rollout_id>:root:<turn>``).
        min_grant: tokens; a last remainder below it ends the child (``child_root_min_grant_tokens``).
        deadline: Unix seconds, the child's deadline (its reservations are live until then).

    Attributes:
        grants / granted_tokens / used_tokens: reservations granted, tokens granted, tokens settled.
    """

    def __init__(
        self,
        inner: RootClient,
        ledger: BudgetLedger,
        ledger_id: str,
        nodes: Sequence[str],
        rollout_id: str,
        *,
        min_grant: int,
        deadline: float,
    ) -> None:
        self.inner = inner
        self.ledger = ledger
        self.ledger_id = ledger_id
        self.nodes = tuple(nodes)
        self.rollout_id = rollout_id
        self.min_grant = min_grant
        self.deadline = deadline
        self.turn = 0
        self.grants = 0
        self.granted_tokens = 0
        self.used_tokens = 0
        self.sent_max_tokens: int | None = None
        """The ``max_tokens`` its last granted call sent (the grant)."""

    async def chat(self, **kwargs: Any) -> Any:
        """Reserve, call the root model with ``max_tokens`` = the grant, settle.

        Raises:
            RootBudgetSpent: the grant is below ``min_grant`` (given back), the budget is spent,
                the tree or an ancestor ended, the ledger is lost or unreachable.
            PromptTooLongError / ModelError: as the inner client (the grant stays charged in full).
        """
        self.turn += 1
        reservation = f"{self.rollout_id}:root:{self.turn}"
        cap = kwargs.get("max_tokens")
        while True:  # a leased grant reclaimed before its call began (this task stalled) is asked for again
            grant = await self._acquire(reservation, cap)
            if not grant.granted or self._partial(grant) or await self._begin(reservation):
                break
        if grant.code == UNLIMITED:
            return await self.inner.chat(**kwargs)
        if grant.tree_refused:
            raise RootBudgetSpent(f"root turn {self.turn} refused: {grant.refusal_message}")
        if grant.code == NO_LEDGER:
            raise RootBudgetSpent(f"root turn {self.turn} refused: the tree's budget ledger is gone (expired or lost)")
        if not grant.granted:
            waited = " (waited until its deadline)" if grant.code == WAITED_OUT else ""
            raise RootBudgetSpent(
                f"root turn {self.turn}: the tree budget is spent{waited}: {grant.charged}/{grant.limit} tokens"
            )
        if self._partial(grant):
            await self._settle(reservation, 0)  # never called: the tokens go back to the tree
            raise RootBudgetSpent(
                f"root turn {self.turn}: the tree budget has {grant.tokens} tokens left, less than the "
                f"{self._least(grant)} a root turn can use ({grant.charged}/{grant.limit} tokens charged)"
            )
        self.grants += 1
        self.granted_tokens += grant.tokens
        kwargs["max_tokens"] = self.sent_max_tokens = grant.tokens  # recorded with a trainable turn
        used = grant.tokens  # a failed call may have spent them: charged in full
        try:
            resp = await self.inner.chat(**kwargs)
            reported = getattr(getattr(resp, "usage", None), "completion_tokens", None)
            if isinstance(reported, int) and reported >= 0:
                used = reported
                self._note_ended(resp, reported)
            used = max(used, served_completion_ids(resp))  # never below the ids it served
            return resp
        finally:
            self.used_tokens += used
            await self._settle(reservation, used)

    def _note_ended(self, resp: Any, tokens: int) -> None:
        """Tell the tree's ledger a root turn ended on its own after ``tokens`` (not at its
        ``max_tokens``): the ledger keeps the longest, and sizes what a later root turn's last
        remainder must hold from it (1.25 x, at least 64 tokens; ``docs/budget.md``)."""
        choices = getattr(resp, "choices", None) or [None]
        if getattr(choices[0], "finish_reason", None) in ("stop", "tool_calls"):
            self.ledger.note_answer(self.ledger_id, tokens, kind=ROOT)

    def _partial(self, grant: Grant) -> bool:
        """A grant the turn must not run under: the budget's last remainder below ``min_grant``
        (a turn as short as that could not even write its tool call)."""
        return grant.granted and grant.tokens < self._least(grant)

    def _least(self, grant: Grant) -> int:
        """Tokens a root turn can use: ``min_grant``, or less where the ledger's estimate of a root
        turn (its ``need``) is less."""
        return self.min_grant if grant.need <= 0 else min(self.min_grant, grant.need)

    async def _acquire(self, reservation: str, cap: Any) -> Grant:
        """The root turn's grant, leased: a call cancelled before it begins gives it back, and a
        grant never begun is reclaimed after its lease (see :meth:`BudgetLedger.begin`)."""
        margin = min(0.5, max(0.0, (self.deadline - time.time()) * 0.05))
        try:
            grant, _, _ = await self.ledger.acquire(
                self.ledger_id,
                reservation,
                int(cap) if cap is not None else None,
                self.deadline,
                margin=margin,
                kind=ROOT,
                nodes=self.nodes,
                leased=True,
            )
        except RedisError as exc:
            raise RootBudgetSpent(f"the tree budget could not be reserved: {exc}") from exc
        return grant

    async def _begin(self, reservation: str) -> bool:
        """Begin the leased grant right before the root call; False: it was reclaimed, ask again."""
        try:
            return await self.ledger.begin(self.ledger_id, reservation)
        except asyncio.CancelledError:
            self.ledger.give_back_soon(self.ledger_id, reservation)
            raise
        except RedisError as exc:  # never call the model under a grant that may be reclaimed
            self.ledger.give_back_soon(self.ledger_id, reservation)
            raise RootBudgetSpent(f"the tree budget grant could not be confirmed: {exc}") from exc

    async def _settle(self, reservation: str, used: int) -> None:
        try:
            await self.ledger.settle(self.ledger_id, reservation, used)
        except RedisError:
            pass  # the reservation stays open, i.e. charged in full: safe for the budget
