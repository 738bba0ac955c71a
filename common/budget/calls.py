"""How a budget ledger's operations reach its script: coalesced, one ``EVALSHA`` per ledger.

:class:`LedgerCalls` is a part of :class:`rlmq.common.budget.ledger.BudgetLedger` (its base); kept apart
so the ledger's policy reads on its own. Every operation submitted in the same event-loop turn goes
out in one round trip (one ``EVALSHA`` of :data:`~rlmq.common.budget.script.LEDGER_LUA` per ledger
and node chain, pipelined), laid out as :mod:`rlmq.common.budget.wire` names it: the script's keys
(``SCRIPT_KEYS``) and node keys, its head arguments (``HEAD_ARGS``), then each operation's
``OP_ARGS``; each reply is read by :meth:`~rlmq.common.budget.wire.Reply.of`.

With replicas to wait for (:mod:`rlmq.common.budget.replica_acks`, ``redis_replica_acks`` > 0) every
round trip goes through the pipeline and ends with a write of
:data:`~rlmq.common.keys.REPLICA_ACK_MARK` and ``WAIT <replicas> <ms>`` on the same connection; an
operation whose reply lets a model call run (a reserve granted, a begin begun) fails with
:class:`~rlmq.common.errors.ReplicaAckMissing` when fewer replicas acknowledged, and the ledger asks
again as for any passing refusal. The other replies stand as Redis gave them: a settlement, a
give-back or a retire lost with a master only leaves tokens charged (never an overshoot), a refusal
or a "wait" runs nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, NamedTuple

from redis.asyncio import Redis

from rlmq.common.budget import replica_acks
from rlmq.common.budget.script import CLOSE_LEDGER_LUA, COUNT_REJECTIONS_LUA, LEDGER_LUA, OPEN_UNLIMITED_LUA
from rlmq.common.budget.wire import HEAD_ARGS, SCRIPT_KEYS, BeginCode, Code, Op, Reply, answered_op
from rlmq.common.errors import ReplicaAckMissing
from rlmq.common.keys import REPLICA_ACK_MARK, LedgerKeys
from rlmq.common.scripts import run_pipeline

__all__ = ["LedgerCalls", "Settle"]

_Op = tuple[str, str, int, float, "asyncio.Future[Reply]"]
"""One coalesced ledger operation: op (an :class:`~rlmq.common.budget.wire.Op`, ``r:<kind>``,
``L:<kind>``), reservation id, cap or used, deadline, its waiter."""
_Group = tuple[str, tuple[str, ...]]
"""What one script call serves: a ledger id and the node chain its reservations name."""


class Settle(NamedTuple):
    """A settlement a caller sends with its own round trip (:meth:`LedgerCalls.add_settles`).

    Attributes:
        ledger_id: the ledger charged.
        reservation_id: the reservation settled.
        used: completion tokens the server reported (tokens, >= 0).
        answer: the running answer this settlement ends (its first segment's reservation id), noted
            in the same script call as the settlement (:attr:`~rlmq.common.budget.wire.Op.ANSWERED`);
            ``""``: none.
        answered: the tokens of that answer when it ended on its own (sizes later answers' first
            segments); 0: it did not (cut, failed).
    """

    ledger_id: str
    reservation_id: str
    used: int
    answer: str = ""
    answered: int = 0


GRANTING_OPS: tuple[str, ...] = (Op.RESERVE.value, Op.LEASED.value, Op.SEGMENT.value, Op.SEGMENT_LEASED.value)
"""The ops whose granted reply lets a model call run at once (a reservation, a segment of an
answer, leased or not): each waits for the replicas' acknowledgement (a leased one's begin too)."""


class LedgerCalls:
    """The coalesced script calls of a :class:`~rlmq.common.budget.ledger.BudgetLedger`.

    Args:
        redis: an asyncio Redis client (``decode_responses`` either way).
        grant_lease: seconds a leased grant may wait for its begin (sent as ``ARGV_LEASE``).
    """

    def __init__(self, redis: Redis, grant_lease: float) -> None:
        self._redis = redis
        self._lease = grant_lease
        self._script = redis.register_script(LEDGER_LUA)
        self._count_script = redis.register_script(COUNT_REJECTIONS_LUA)  # the small scripts, on the same client
        self._close_script = redis.register_script(CLOSE_LEDGER_LUA)
        self._open_unlimited_script = redis.register_script(OPEN_UNLIMITED_LUA)
        self._pending: dict[_Group, list[_Op]] = {}
        self._flush_scheduled = False
        self._flushes: set[asyncio.Task[None]] = set()
        self._acks = replica_acks.of(redis)

    def _submit(
        self, ledger_id: str, op: str, reservation_id: str, n: int, deadline: float, nodes: tuple[str, ...] = ()
    ) -> asyncio.Future[Reply]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Reply] = loop.create_future()
        self._pending.setdefault((ledger_id, nodes), []).append((op, reservation_id, n, deadline, fut))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._start_flush)
        return fut

    def _start_flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, {}
        if pending:
            task = asyncio.get_running_loop().create_task(self._flush(pending))
            self._flushes.add(task)
            task.add_done_callback(self._flushes.discard)

    async def _flush(self, pending: dict[_Group, list[_Op]]) -> None:
        groups = list(pending.items())
        acked: Any = None  # the WAIT's reply (replicas that acknowledged), or its error
        try:
            if len(groups) == 1 and not self._acks.replicas:
                outcomes: list[Any] = [await self._script(keys=self._keys(groups[0][0]), args=self._args(groups[0][1]))]
            else:
                outcomes = await self._pipelined(groups)
                if self._acks.replicas:
                    acked = outcomes.pop()
                    mark = outcomes.pop()  # without the mark's write the WAIT may not cover a grant found again
                    acked = mark if isinstance(mark, Exception) else acked
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter, then re-raised if fatal
            for _, ops in groups:
                for *_, fut in ops:
                    if not fut.done():
                        fut.set_exception(exc if isinstance(exc, Exception) else RuntimeError("ledger flush cancelled"))
            if not isinstance(exc, Exception):
                raise
            return
        for (_, ops), outcome in zip(groups, outcomes, strict=True):
            for i, (*_, fut) in enumerate(ops):
                if fut.done():
                    continue
                if isinstance(outcome, Exception):
                    fut.set_exception(outcome)
                    continue
                reply = Reply.of(outcome[i])
                if self._unacked(ops[i][0], reply, acked):
                    fut.set_exception(self._ack_error(acked))
                else:
                    fut.set_result(reply)

    def _ack_error(self, acked: Any) -> Exception:
        """The error of a grant fewer replicas acknowledged: the error reply of the mark's ``SET`` or
        of the ``WAIT`` (a ``NOPERM``), else :class:`ReplicaAckMissing`."""
        if isinstance(acked, Exception):
            return acked
        return ReplicaAckMissing(int(acked), self._acks.replicas, self._acks.timeout)

    def _unacked(self, op: str, reply: Reply, acked: Any) -> bool:
        """Whether ``reply`` to ``op`` would let a model call run (a grant, a begin) on a write fewer
        replicas acknowledged than required (``acked``: the ``WAIT`` reply, or its error)."""
        if not self._acks.replicas or (isinstance(acked, int) and acked >= self._acks.replicas):
            return False
        if op.startswith(GRANTING_OPS):
            return reply.code == Code.GRANTED
        return op == Op.BEGIN.value and reply.code == BeginCode.BEGUN

    async def _pipelined(self, groups: list[tuple[_Group, list[_Op]]]) -> list[Any]:
        """One round trip for several ledgers: ``EVALSHA`` each (loading the script on ``NOSCRIPT``);
        with replicas to wait for, then the mark's ``SET`` and ``WAIT`` (their outcomes last)."""

        def build(pipe: Any) -> None:
            for group, ops in groups:
                keys = self._keys(group)
                pipe.evalsha(self._script.sha, len(keys), *keys, *self._args(ops))
            if self._acks.replicas:
                pipe.set(REPLICA_ACK_MARK, b"1", ex=60)
                pipe.execute_command("WAIT", self._acks.replicas, self._acks.timeout_ms)

        return await run_pipeline(self._redis, build, [LEDGER_LUA], raise_on_error=False)

    def add_settles(self, pipe: Any, settles: Sequence[Settle | tuple[str, str, int]]) -> None:
        """Queue settlements on ``pipe`` (one ``EVALSHA`` per ledger), for a caller that sends
        them in one round trip with its own commands (the worker's ``FINISH``). A settlement that
        ends a running answer (:attr:`Settle.answer`) notes it in the same script call, after it.

        Args:
            pipe: a redis-py asyncio pipeline; the caller executes it and, on ``NOSCRIPT``,
                loads :data:`LEDGER_LUA` and sends it again (settling and noting are idempotent).
            settles: :class:`Settle` each (a plain ``(ledger_id, reservation_id, used)`` too).
        """
        by_ledger: dict[str, list[Any]] = {}
        for entry in settles:
            s = Settle(*entry)
            ops = by_ledger.setdefault(s.ledger_id, [])
            ops += [Op.SETTLE.value, s.reservation_id, max(0, int(s.used)), 0]
            if s.answer:
                ops += [answered_op(s.answered), s.answer, 0, 0]
        for ledger_id, ops in by_ledger.items():
            keys = self._keys((ledger_id, ()))
            pipe.evalsha(self._script.sha, len(keys), *keys, *self._head_args(), *ops)

    @staticmethod
    def _keys(group: _Group) -> list[str]:
        """The script's keys (:data:`~rlmq.common.budget.wire.SCRIPT_KEYS`), then the chain's node keys."""
        keys = LedgerKeys(group[0])
        return [*(getattr(keys, attr) for attr in SCRIPT_KEYS.values()), *map(keys.node, group[1])]

    def _head_args(self) -> list[Any]:
        """The script's :data:`~rlmq.common.budget.wire.HEAD_ARGS`: TTL 0 (the script uses the TTL
        stored in the ledger, or for a ledger without one the budget hash's own, never this
        process's) and this process's grant lease (seconds)."""
        head: dict[str, Any] = {"ttl": 0, "lease": self._lease}
        return [head[name] for name in HEAD_ARGS]

    def _args(self, ops: list[_Op]) -> list[Any]:
        """The script's arguments: the HEAD_ARGS, then each operation's OP_ARGS."""
        args: list[Any] = self._head_args()
        for kind, reservation_id, n, deadline, _ in ops:
            args += [kind, reservation_id, n, repr(deadline)]
        return args
