"""The segments of one sub-call turn: continuing its answer under a new grant until it ends.

A budgeted sub-call turn that offers no tools (a sub-LLM's answer, the forced final-answer turn)
reserves a *segment* (:meth:`rlmq.common.budget.ledger.BudgetLedger.acquire` with ``segment``), not its
whole cap; see ``docs/budget.md`` for how the ledger sizes it. When the model stops for length at
the segment's end, the turn settles that segment, reserves the next one (waiting, as a first
grant does, while live reservations may give tokens back) and continues the same answer on the
server (:mod:`rlmq.workers.continuation`), until the answer ends, reaches its own cap, or the budget
is truly spent (then it is cut: the budget's last remainder). Every segment is reserved before it is
generated, so the budget stays hard; each settles the server's own count.

The ledger's side of it (reservation ids, each segment's grant, settlements, the answer's end) is the
turn's in the ledger (:class:`rlmq.common.budget.turn.LedgerTurn`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from rlmq.common.budget.turn import MAX_SEGMENTS, LedgerTurn, segment_id
from rlmq.common.budget.wire import Grant
from rlmq.workers.continuation import continuation_request, join_segments
from rlmq.workers.model import ChatResponse

if TYPE_CHECKING:
    from rlmq.common.schemas import SubLLMRequest
    from rlmq.workers.subllm import SubLLMContext

__all__ = ["MAX_SEGMENTS", "SegmentedTurns", "segment_id"]


class SegmentedTurns:
    """The segment loop of a sub-call (mixed into its ``_Run``, which provides the calls below)."""

    request: SubLLMRequest
    ctx: SubLLMContext
    messages: list[dict[str, Any]]
    segments: int
    overrun_tokens: int

    async def _call(
        self,
        turn: int,
        lt: LedgerTurn | None,
        max_tokens: int | None,
        tools: list[dict[str, Any]],
        *,
        messages: list[dict[str, Any]] | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> ChatResponse:
        raise NotImplementedError  # pragma: no cover - _Run's

    def _continues(self, last: ChatResponse, grant: Grant, spent: int, k: int) -> bool:
        """Whether the turn goes on: its last segment stopped for length at the segment's end (the
        server's own count), the answer is below its own cap, and the turn has segments left."""
        cap = self.request.max_completion_tokens
        return (
            last.finish_reason == "length"
            and not last.tool_calls
            and last.usage_reported
            and last.completion_tokens >= grant.tokens
            and (cap is None or spent < cap)
            and k < MAX_SEGMENTS
            and time.time() < self.request.deadline
        )

    async def continue_answer(
        self, turn: int, lt: LedgerTurn, response: ChatResponse, tools: list[dict[str, Any]]
    ) -> tuple[ChatResponse, ChatResponse, int]:
        """Continue the turn's answer segment by segment (see the module docstring).

        Args:
            turn: the turn (1-based).
            lt: the turn in the ledger, holding its first segment's grant (its last segment's, after).
            response: the first segment's reply.
            tools: the tools the turn offered (a turn that offers tools is never continued).

        Returns:
            ``(turn, last, granted)``: the whole turn (:func:`join_segments`), its last segment's own
            reply (whose count settles it; the answer's end goes with that settlement), and the tokens
            granted over all segments.
        """
        assert lt.grant is not None
        joined, last, k, spent, granted = response, response, 1, response.completion_tokens, lt.grant.tokens
        while not tools and self._continues(last, lt.grant, spent, k):
            await lt.settle(last.completion_tokens)
            nxt = await lt.next_segment(k + 1, spent)
            if nxt is None:  # the budget's true end (or the tree's): the answer is cut here
                self.segments += k
                return joined, last, granted
            messages, sampling = continuation_request(
                self.messages, joined.content or "", dict(self.request.sampling), self.ctx.continuation
            )
            last = await self._call(turn, lt, nxt.tokens, [], messages=messages, sampling=sampling)
            if last.completion_tokens > nxt.tokens:
                self.overrun_tokens += last.completion_tokens - nxt.tokens  # charged, and recorded
            joined = join_segments(joined, last)
            spent, granted, k = spent + last.completion_tokens, granted + nxt.tokens, k + 1
        self.segments += k
        lt.ended(spent if joined.finish_reason != "length" and joined.usage_reported else 0)
        return joined, last, granted
