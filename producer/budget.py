"""The producer's side of one rollout's sub-LLM budget: the one place the rollout engine
touches the budget ledger (:mod:`rlmq.common.budget.ledger`).

The engine opens the ledger when the rollout starts, the ``llm_batch`` service asks it
whether a batch is refused up front and what is charged (the summary's budget line), and
the engine reads its figures into the result row's metrics at the end. Workers reserve and
settle against the same ledger on their side.
"""

from __future__ import annotations

from collections.abc import Mapping

from redis.asyncio import Redis

from rlmq.common.budget.ledger import BudgetLedger, BudgetSnapshot
from rlmq.common.sampling import sub_call_max_tokens
from rlmq.common.settings import RolloutOptions

LEDGER_LOST = (
    "[rejected] sub-LLM token budget ledger lost (Redis restarted?); sub-LLM calls are "
    "refused so the budget cannot be overshot"
)


class RolloutBudget:
    """One rollout's sub-LLM completion-token budget, kept in Redis.

    Args:
        redis: an asyncio Redis client.
        ledger_id: the ledger's own id (a depth-1 rollout: its rollout id; see
            :class:`~rlmq.common.keys.LedgerKeys`).
        options: the rollout's options: ``sub_llm_max_completion_tokens`` (the limit, tokens,
            >= 1), the per-call cap (:func:`~rlmq.common.sampling.sub_call_max_tokens`: a whole
            grant) and ``rollout_key_ttl`` (seconds the ledger lives without a write).

    Raises:
        ValueError: the options set no budget.
    """

    def __init__(self, redis: Redis, ledger_id: str, options: RolloutOptions) -> None:
        limit = options.sub_llm_max_completion_tokens
        if limit is None:
            raise ValueError("RolloutBudget needs options.sub_llm_max_completion_tokens")
        self.ledger_id = ledger_id
        self.ttl = options.rollout_key_ttl
        self.limit: int = limit
        self.cap: int = sub_call_max_tokens(options)
        self._ledger = BudgetLedger(redis, ttl=options.rollout_key_ttl)

    async def open(self, kind_caps: Mapping[str, int] | None = None) -> None:
        """Create the ledger (keeps an existing one: a resumed rollout keeps what it spent).

        Args:
            kind_caps: per-call caps of other reservation kinds (tokens; see
                :meth:`BudgetLedger.open <rlmq.common.budget.ledger.BudgetLedger.open>`).

        Raises:
            redis.RedisError: Redis refused or is gone.
        """
        await self._ledger.open(self.ledger_id, self.limit, self.cap, ttl=self.ttl, kind_caps=kind_caps)

    async def snapshot(self) -> BudgetSnapshot | None:
        """The ledger's figures, or ``None`` when it is gone (Redis restarted, TTL ran out)."""
        return await self._ledger.snapshot(self.ledger_id)

    async def refusal(self) -> tuple[str, bool] | None:
        """Why a batch is refused up front, else ``None``: ``(message, spent)``, ``spent`` being
        true for a spent budget (the ledger counts those refusals) and false for a lost ledger.

        Refused up front only when spent: nothing free and nothing held by open reservations
        (calls that find the rest reserved wait for a release on the worker instead).

        Raises:
            redis.RedisError: reading the ledger failed.
        """
        snap = await self.snapshot()
        if snap is None:
            # Opening a fresh ledger would forget what was already spent, so refuse instead.
            return LEDGER_LOST, False
        if snap.remaining <= 0 and snap.held <= 0:
            return f"[rejected] sub-LLM token budget spent: {snap.charged}/{self.limit} completion tokens used", True
        return None

    async def count_rejections(self, n: int) -> None:
        """Add ``n`` calls refused up front to the ledger's ``rejections``.

        Raises:
            redis.RedisError: Redis refused or is gone.
        """
        await self._ledger.count_rejections(self.ledger_id, n)

    async def metrics(self) -> dict[str, float | int]:
        """The result row's budget figures (``sub_llm_budget_limit``, ``..._charged``, ``..._used``,
        ``sub_llm_grants``, ``sub_llm_budget_rejections``, ``sub_llm_released_tokens``; tokens and
        counts), or ``{}`` when the ledger is gone. ``tree_charged_completion_tokens`` is the
        ledger's ``charged`` too: what the tree's budget was charged, also for calls whose results
        never reached the trajectory (a child host killed after its calls were served).

        Raises:
            redis.RedisError: Redis refused or is gone.
        """
        snap = await self.snapshot()
        if snap is None:
            return {}
        return {
            "sub_llm_budget_limit": snap.limit,
            "sub_llm_budget_charged": snap.charged,
            "tree_charged_completion_tokens": snap.charged,
            "sub_llm_budget_used": snap.used,
            "sub_llm_grants": snap.grants,
            "sub_llm_budget_rejections": snap.rejections,
            "sub_llm_released_tokens": snap.released,
        }
