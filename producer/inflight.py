"""The sub-calls one rollout has queued or running at once, over all its batches.

``max_sub_llm_parallelism`` bounds a rollout's sub-calls (and child rollouts) queued or running
at once. A cell can run many ``llm_batch`` / ``rlm_batch`` calls at once (from threads): each
batch's :class:`~rlmq.producer.dispatch.Dispatcher` loop asks a rollout's :class:`RolloutInFlight`
how many more it may enqueue, so the bound holds for the rollout, not per call. A batch that
finds no room waits until another batch of the rollout holds fewer.
"""

from __future__ import annotations

import asyncio
import contextlib


class RolloutInFlight:
    """One rollout's in-flight count, kept per batch.

    Args:
        limit: sub-calls of the rollout queued or running at once (>= 1).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, int] = {}
        self._freed = asyncio.Event()

    def room(self, batch_id: str) -> int:
        """How many sub-calls batch ``batch_id`` may have in flight now (its own included)."""
        return self.limit - sum(n for b, n in self._held.items() if b != batch_id)

    def hold(self, batch_id: str, n: int) -> None:
        """Batch ``batch_id`` now has ``n`` sub-calls in flight (0: none, or it ended); a batch
        waiting for room is woken when this is fewer than before."""
        before = self._held.get(batch_id, 0)
        if n > 0:
            self._held[batch_id] = n
        else:
            self._held.pop(batch_id, None)
        if n < before:
            self._freed.set()
            self._freed = asyncio.Event()

    @property
    def held(self) -> int:
        """Sub-calls in flight over all the rollout's batches."""
        return sum(self._held.values())

    async def wait_for_room(self, timeout: float) -> None:
        """Return when another batch holds fewer sub-calls, or after ``timeout`` seconds."""
        freed = self._freed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(freed.wait(), timeout)
