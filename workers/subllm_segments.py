"""The segments of one sub-call turn: continuing its answer under a new grant until it ends.

A budgeted sub-call turn that offers no tools (a sub-LLM's answer, the forced final-answer turn)
reserves a *segment* (:meth:`rlmq.common.budget.ledger.BudgetLedger.acquire` with ``segment``), not its
whole cap; see ``docs/budget.md`` for how the ledger sizes it. When the model stops for length at
the segment's end, the turn settles that segment, reserves the next one (waiting, as a first
grant does, while live reservations may give tokens back) and continues the same answer on the
server (:mod:`rlmq.workers.continuation`), until the answer ends, reaches its own cap, or the budget
is truly spent (then it is cut: the budget's last remainder). Every segment is reserved before it is
generated, so the budget stays hard; each settles the server's own count.

Reservation ids: the first segment keeps the turn's id (``<job>:<attempt>:<turn>``), the k-th
(k >= 2) is ``<job>:<attempt>:<turn>:s<k>``; a turn has at most :data:`MAX_SEGMENTS`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from rlmq.common.budget.ledger import Grant
from rlmq.workers.continuation import continuation_request, join_segments
from rlmq.workers.model import ChatResponse

if TYPE_CHECKING:
    from rlmq.common.schemas import SubLLMRequest
    from rlmq.workers.subllm import SubLLMContext

__all__ = ["MAX_SEGMENTS", "SegmentedTurns", "segment_id"]

MAX_SEGMENTS = 64
"""Segments one turn may take at most (then its answer is cut where it is)."""


def segment_id(reservation: str, k: int) -> str:
    """The reservation id of segment ``k`` (1-based) of the turn reserved as ``reservation``."""
    return reservation if k == 1 else f"{reservation}:s{k}"


class SegmentedTurns:
    """The segment loop of a sub-call (mixed into its ``_Run``, which provides the calls below)."""

    request: SubLLMRequest
    ctx: SubLLMContext
    messages: list[dict[str, Any]]
    segments: int
    overrun_tokens: int
    running_answer: str | None = None
    """The first segment's reservation id of an answer granted in segments and not yet noted as ended."""
    answer_tokens: int = 0
    """The tokens that answer ended after, on its own (0: not, or not yet)."""

    async def _reserve(self, reservation: str, *, leased: bool = False, segment: int | None = None) -> Grant | None:
        raise NotImplementedError  # pragma: no cover - _Run's

    async def _begin(self, reservation: str) -> bool:
        raise NotImplementedError  # pragma: no cover - _Run's

    async def _settle(self, reservation: str, used: int) -> None:
        raise NotImplementedError  # pragma: no cover - _Run's

    async def _call(
        self,
        turn: int,
        reservation: str,
        grant: Grant | None,
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

    async def _next_grant(self, reservation: str, spent: int) -> Grant | None:
        """The next segment's grant, begun; ``None`` when the budget (or the tree) has none for it."""
        while True:
            grant = await self._reserve(reservation, segment=spent)
            if grant is None or not grant.granted:
                return None
            if not grant.leased or await self._begin(reservation):
                return grant

    async def continue_answer(
        self, turn: int, reservation: str, grant: Grant, response: ChatResponse, tools: list[dict[str, Any]]
    ) -> tuple[ChatResponse, str, Grant | None, ChatResponse, int]:
        """Continue the turn's answer segment by segment (see the module docstring).

        Args:
            turn: the turn (1-based).
            reservation / grant / response: the first segment's reservation id, grant and reply.
            tools: the tools the turn offered (a turn that offers tools is never continued).

        Returns:
            ``(turn, reservation, grant, last, granted)``: the whole turn (:func:`join_segments`), the
            last segment's reservation id and grant (``None`` when it is settled already), its own
            reply (whose count settles it), and the tokens granted over all segments.
        """
        joined, last, k, spent, granted = response, response, 1, response.completion_tokens, grant.tokens
        ledger, base = self.ctx.ledger, reservation
        self.running_answer = base
        while not tools and self._continues(last, grant, spent, k):
            await self._settle(reservation, last.completion_tokens)
            nxt_id = segment_id(base, k + 1)
            nxt = await self._next_grant(nxt_id, spent)
            if nxt is None:  # the budget's true end (or the tree's): the answer is cut here
                self.segments += k
                self.answer_over()
                return joined, reservation, None, last, granted
            messages, sampling = continuation_request(
                self.messages, joined.content or "", dict(self.request.sampling), self.ctx.continuation
            )
            last = await self._call(turn, nxt_id, nxt, nxt.tokens, [], messages=messages, sampling=sampling)
            if last.completion_tokens > nxt.tokens:
                self.overrun_tokens += last.completion_tokens - nxt.tokens  # charged, and recorded
            joined, reservation, grant = join_segments(joined, last), nxt_id, nxt
            spent, granted, k = spent + last.completion_tokens, granted + nxt.tokens, k + 1
        self.segments += k
        whole = ledger is not None and joined.finish_reason != "length" and joined.usage_reported
        self.answer_tokens = spent if whole else 0  # noted with the turn's last settlement
        return joined, reservation, grant, last, granted

    def take_answer(self) -> tuple[str, int]:
        """The running answer (its first segment's reservation id; ``""``: none) and the tokens it ended
        after (0: not on its own), for the caller to note with its last settlement; it is no longer
        this turn's to note."""
        answer, tokens = self.running_answer or "", self.answer_tokens
        self.running_answer, self.answer_tokens = None, 0
        return answer, tokens

    def answer_over(self) -> None:
        """Tell the ledger now, without waiting, that the running answer (if any) ended (see
        :meth:`take_answer`); it stops counting as running."""
        answer, tokens = self.take_answer()
        if answer and self.ctx.ledger is not None:
            self.ctx.ledger.note_answer(self.request.charged_ledger, tokens, answer=answer)
