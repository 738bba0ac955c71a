"""The segment side of a budget ledger: reservation ops of a kind, and answers that end.

:class:`LedgerSegments` is a part of :class:`rlmq.common.budget.ledger.BudgetLedger` (its methods are the
ledger's); kept apart so the reservation side reads on its own. An answer granted in segments
(``docs/budget.md``) is reserved with :func:`reserve_op`'s ``g`` / ``G`` ops and counts as running
in the ledger until :meth:`LedgerSegments.note_answer` says it ended (or its call's deadline passes,
or its job is retried).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Any

from redis.exceptions import RedisError

from rlmq.common.budget.wire import Op, answered_op

__all__ = ["ROOT", "SUB_LLM", "LedgerSegments", "reserve_op"]

SUB_LLM = "sub"
"""Reservation kind of a sub-LLM model turn (the default; its cap is the ledger's ``cap``)."""
ROOT = "root"
"""Reservation kind of a root-model turn of a child rollout (its cap: ``cap:root``)."""
_KIND = re.compile(r"[a-z_]{1,16}")


def reserve_op(kind: str, *, leased: bool = False, segment: int | None = None) -> str:
    """The script's op of a reservation of ``kind``: ``r`` for :data:`SUB_LLM`, else ``r:<kind>``
    (:attr:`~rlmq.common.budget.wire.Op.RESERVE`); ``L`` / ``L:<kind>`` when ``leased``. With
    ``segment`` (tokens the answer has spent, 0 for its first segment): ``g:<kind>:<segment>``
    (``G:...`` leased; the kind empty for :data:`SUB_LLM`).

    Raises:
        ValueError: ``kind`` is not 1-16 characters of ``[a-z_]``, or ``segment`` is negative.
    """
    if kind != SUB_LLM and not _KIND.fullmatch(kind):
        raise ValueError(f"invalid reservation kind {kind!r}: use 1-16 characters of [a-z_]")
    if segment is not None:
        if segment < 0:
            raise ValueError(f"a segment's spent tokens must be >= 0, got {segment}")
        seg = Op.SEGMENT_LEASED if leased else Op.SEGMENT
        return f"{seg.value}:{'' if kind == SUB_LLM else kind}:{int(segment)}"
    op = Op.LEASED if leased else Op.RESERVE
    if kind == SUB_LLM:
        return op.value
    if not _KIND.fullmatch(kind):
        raise ValueError(f"invalid reservation kind {kind!r}: use 1-16 characters of [a-z_]")
    return f"{op.value}:{kind}"


class LedgerSegments:
    """Answers granted in segments, for :class:`rlmq.common.budget.ledger.BudgetLedger` (whose ``_submit``
    and background-task set it uses)."""

    _give_backs: set[asyncio.Task[None]]

    def _submit(
        self, ledger_id: str, op: str, reservation_id: str, n: int, deadline: float, nodes: tuple[str, ...] = ()
    ) -> asyncio.Future[Any]:
        raise NotImplementedError  # pragma: no cover - LedgerCalls'

    def note_answer(self, ledger_id: str, tokens: int, kind: str = SUB_LLM, answer: str = "") -> None:
        """Tell the ledger, without waiting, that an answer of ``kind`` ended after ``tokens`` completion
        tokens (0: it did not end on its own: cut, failed): it sizes later answers' first segments
        from the longest, and the answer ``answer`` (its first segment's reservation id) stops
        counting as running (``docs/budget.md``). A note that fails (Redis away) only leaves the
        estimate as it was; the running answer then stops counting at its call's deadline."""
        op = answered_op(tokens, "" if kind == SUB_LLM else kind)
        reserve_op(kind)  # ValueError for an invalid kind, now

        async def note() -> None:
            with contextlib.suppress(RedisError, OSError):
                await self._submit(ledger_id, op, answer, 0, 0.0)

        task = asyncio.get_running_loop().create_task(note())
        self._give_backs.add(task)
        task.add_done_callback(self._give_backs.discard)
