"""A sub-call's turns in its ledger, each one object from its grant to its settlement.

A sub-LLM call (``workers/subllm.py``) asks its :class:`CallBudget` for a turn
(:meth:`CallBudget.turn`) and gets a :class:`LedgerTurn` that holds the turn's grant; the steps the
ledger needs, in the order it needs them, are the turn's: reserve (waiting for releases:
:meth:`~rlmq.common.budget.ledger.BudgetLedger.acquire`), wait for the job's ``START`` (the gate),
begin a leased grant and reserve again when its lease was reclaimed, give it back when the call is
cancelled before its model call, reserve each next segment of an answer granted in segments
(``docs/budget.md``), settle, and note that the answer ended. The call's retry retires the
reservations of its job's earlier attempts (:meth:`CallBudget.retire_earlier_attempts`).

Reservation ids: turn ``t`` of attempt ``a`` of job ``j`` is ``j:a:t``; segment ``k >= 2`` of it is
``j:a:t:s<k>`` (:func:`segment_id`); a turn has at most :data:`MAX_SEGMENTS`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from rlmq.common.budget.calls import Settle
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.budget.wire import Code, Grant

__all__ = ["MAX_SEGMENTS", "BudgetStop", "CallBudget", "LedgerTurn", "segment_id"]

log = logging.getLogger(__name__)

MAX_SEGMENTS = 64
"""Segments one turn may take at most (then its answer is cut where it is)."""


def segment_id(reservation: str, k: int) -> str:
    """The reservation id of segment ``k`` (1-based) of the turn reserved as ``reservation``."""
    return reservation if k == 1 else f"{reservation}:s{k}"


class BudgetStop(Exception):
    """The ledger ends the call with an error result: ``kind`` is its ``error_kind`` (``budget_lost``,
    ``duplicate``, ``redis``), ``content`` the message the root model sees."""

    def __init__(self, kind: str, content: str) -> None:
        super().__init__(content)
        self.kind = kind
        self.content = content
        self.error = content


@dataclass
class CallBudget:
    """One sub-call's reservations in the ledger ``ledger_id`` charges (its counters go into its result).

    Attributes:
        ledger: the worker's ledger.
        ledger_id: the ledger the job names.
        call_id: ``<job id>:<attempt>``, the prefix of the call's reservation ids.
        cap: the job's own cap (tokens) or ``None``.
        deadline: the call's deadline (Unix seconds); ``margin`` seconds before it, waiting ends.
        nodes: the calling rollout's tree chain (top .. caller).
        must_be_budgeted: the job says it is budgeted (a missing ledger is then lost, never "none").
        gate: awaited once, after the first grant and before its model call (the job's ``START``);
            while it is set, grants are leased.
        settle_out: where a call's last settlement goes instead of being sent (``FINISH`` sends it).
    """

    ledger: BudgetLedger
    ledger_id: str
    call_id: str
    cap: int | None
    deadline: float
    margin: float
    nodes: Sequence[str] = ()
    must_be_budgeted: bool = False
    gate: Awaitable[object] | None = None
    settle_out: list[Settle] | None = None
    grants: int = 0
    granted_tokens: int = 0
    released_tokens: int = 0
    waits: int = 0
    wait_seconds: float = 0.0
    seen_ledger: bool = False
    """A ledger answered once: one that vanishes later is lost, never "unbudgeted"."""
    unbudgeted: bool = False
    """No ledger, and the job said it has none: the call's turns run without grants."""
    running: LedgerTurn | None = field(default=None, repr=False)
    """The turn whose answer (granted in segments) runs and is not noted as ended yet."""

    async def retire_earlier_attempts(self, job_id: str, attempt: int, turns: int) -> None:
        """This job runs again (attempt ``attempt``) because its earlier attempt's worker was declared
        dead: the reservations of its earlier attempts (``turns`` turns each, every segment) stay
        charged, but calls of the rollout stop waiting for them. A failure only logs: waiters then wait
        for the old reservations' deadline (slower, still safe)."""
        ids = [
            segment_id(f"{job_id}:{a}:{t}", k)
            for a in range(1, attempt)
            for t in range(1, turns + 1)
            for k in range(1, MAX_SEGMENTS + 1)
        ]
        try:
            await self.ledger.retire(self.ledger_id, ids)
        except RedisError as exc:
            log.warning("could not retire the earlier attempts of %s (%s)", job_id, exc)

    async def turn(self, turn: int, *, segmented: bool) -> LedgerTurn:
        """Reserve turn ``turn``'s grant (a first segment when ``segmented``), wait for the gate, and
        begin it; a grant whose lease was reclaimed before its call began is asked for again.

        Returns:
            The turn; its :attr:`LedgerTurn.grant` is ``None`` when the call runs unbudgeted (no ledger,
            and the job said it has none; or a tree without a budget), else the ledger's answer (a
            refusal too: :attr:`~rlmq.common.budget.wire.Grant.granted` False).

        Raises:
            BudgetStop: the ledger is lost, the reservation was settled by another copy of the job, or
                Redis failed.
            asyncio.CancelledError: cancelled (a leased grant is given back first).
        """
        t = LedgerTurn(self, f"{self.call_id}:{turn}", segmented)
        while not self.unbudgeted:
            grant = await t.reserve(leased=self.gate is not None, segment=0 if segmented else None)
            if grant is None or not grant.granted:
                self.gate = None if grant is None else self.gate
                return t
            if segmented:
                self.running = t
            try:
                if self.gate is not None:
                    await self.gate  # the worker's START has not confirmed this job yet
                    self.gate = None
                if not grant.leased or await t.begin():
                    return t
            except BaseException:  # cancelled (it lost its START), or Redis failed: never begun
                if grant.leased:
                    self.ledger.give_back_soon(self.ledger_id, t.reservation)
                raise
            self.grants -= 1  # reclaimed: it went back to the budget unused
            self.granted_tokens -= grant.tokens
        self.gate = None
        return t

    def answer_over(self) -> None:
        """Tell the ledger now, without waiting, that the running answer (if any) ended (not on its own
        unless its turn said so); it stops counting as running."""
        if self.running is not None:
            answer, tokens = self.running.take_answer()
            self.ledger.note_answer(self.ledger_id, tokens, answer=answer)


class LedgerTurn:
    """One model turn of a sub-call in its ledger: its grant, its segments and its settlement.

    Attributes:
        reservation: the reservation id of its last grant (a segment's, once continued).
        grant: that grant (``None``: the turn runs unbudgeted, or its last segment is settled).
        answer: the first segment's reservation id of an answer granted in segments.
        answer_tokens: the tokens the answer ended after on its own (0: not, or not yet).
    """

    def __init__(self, call: CallBudget, reservation: str, segmented: bool) -> None:
        self.call = call
        self.reservation = reservation
        self.answer = reservation if segmented else ""
        self.answer_tokens = 0
        self.grant: Grant | None = None

    async def reserve(self, *, leased: bool = False, segment: int | None = None) -> Grant | None:
        """Reserve (waiting for releases) this turn's grant under :attr:`reservation`; ``None``: the call
        runs unbudgeted. ``segment``: a segment of an answer that has spent this many tokens."""
        call = self.call
        try:
            grant, waits, seconds = await call.ledger.acquire(
                call.ledger_id,
                self.reservation,
                call.cap,
                call.deadline,
                margin=call.margin,
                nodes=call.nodes,
                leased=leased,
                segment=segment,
            )
        except RedisError as exc:
            raise BudgetStop("redis", f"[error] sub-LLM budget could not be reserved: {exc}") from exc
        call.waits += waits
        call.wait_seconds += seconds
        if grant.code == Code.NO_LEDGER:
            if not call.must_be_budgeted and not call.seen_ledger and not waits:  # a wait came from a ledger
                call.unbudgeted = True
                return None
            raise BudgetStop("budget_lost", "[error] sub-LLM budget ledger of this rollout is gone (expired or lost)")
        if grant.code == Code.ALREADY_SETTLED:
            raise BudgetStop(
                "duplicate",
                "[error] sub-LLM call already ran: another copy of this job attempt settled its reservation",
            )
        call.seen_ledger = True
        if grant.code == Code.UNLIMITED:
            return None  # a tree without a budget, alive: this turn runs ungranted
        if grant.granted:
            call.grants += 1
            call.granted_tokens += grant.tokens
        self.grant = grant
        return grant

    async def begin(self) -> bool:
        """Begin the leased grant right before its model call; False: its lease was reclaimed while the
        call waited (for its ``START`` or a slot), reserve again."""
        try:
            return await self.call.ledger.begin(self.call.ledger_id, self.reservation)
        except RedisError as exc:  # never call the model under a grant that may be reclaimed
            raise BudgetStop("redis", f"[error] sub-LLM budget grant could not be confirmed: {exc}") from exc

    async def next_segment(self, k: int, spent: int) -> Grant | None:
        """Reserve segment ``k`` (2, 3, ...) of the turn's answer, which has spent ``spent`` tokens (the
        segment before it settled), and begin it; ``None`` when the budget (or the tree) has none for
        it: the answer is cut there, and noted so."""
        self.reservation = segment_id(self.answer, k)
        self.grant = None
        while True:
            grant = await self.reserve(segment=spent)
            if grant is None or not grant.granted:
                self.grant = None
                self.call.answer_over()
                return None
            if not grant.leased or await self.begin():
                return grant

    async def settle(self, used: int) -> None:
        """Settle this turn's grant with ``used`` tokens (the server's count) now; a failure leaves it
        charged in full (safe for the budget)."""
        grant, self.grant = self.grant, None
        if grant is None:
            return
        try:
            settlement = await self.call.ledger.settle(self.call.ledger_id, self.reservation, used)
        except RedisError as exc:
            log.warning("could not settle reservation %s (%s); it stays charged in full", self.reservation, exc)
            return
        if settlement.released > 0:
            self.call.released_tokens += settlement.released

    async def settle_last(self, used: int, *, final: bool) -> None:
        """Settle the turn's last grant with ``used`` tokens; the call's ``final`` turn's settlement goes
        to the call's ``settle_out`` (sent with ``FINISH``; until then it stays charged in full), with
        the note that its answer ended. A turn that is not final settles now, and notes its answer now."""
        grant = self.grant
        if grant is None:
            return
        call = self.call
        if final and call.settle_out is not None:
            answer, answered = self.take_answer()
            call.settle_out.append(Settle(call.ledger_id, self.reservation, used, answer, answered))
            call.released_tokens += max(0, grant.tokens - used)
            self.grant = None
            return
        call.answer_over()  # submitted first: both go out in one script call
        await self.settle(used)

    def ended(self, tokens: int) -> None:
        """The answer ended after ``tokens`` on its own (0: it did not); noted with the last settlement."""
        self.answer_tokens = tokens

    def take_answer(self) -> tuple[str, int]:
        """The running answer (``""``: none) and its tokens, no longer this turn's to note."""
        if self.call.running is self:
            self.call.running = None
            return self.answer, self.answer_tokens
        return "", 0
