"""The sub-LLM completion-token budget ledger of a rollout, kept in Redis.

The guarantee (``shared/DESIGN.md``, invariants 1 and 2): for every rollout, the completion
tokens sub-LLM servers return add up to at most ``sub_llm_max_completion_tokens``, with
any number of workers and parallel calls, as long as the server honours ``max_tokens``;
and a call is rejected only when the budget is really spent.

How: before every model call (each tool-loop turn and the final answer) a worker
*reserves* a grant in one Lua script (:data:`LEDGER_LUA`), keyed by a reservation id, and
calls the model with ``max_tokens = grant``. Afterwards it *settles* the reservation with
the tokens the server reported, releasing the unused part. Both scripts are idempotent per
reservation id: reserving an open reservation again returns the same grant, settling twice
changes nothing. A reservation whose worker died stays charged in full (the tokens may have
been spent): never refunded twice, never lost.

The policy (what "spent" means):

* ``free = limit - charged``; ``charged`` = tokens servers reported + tokens held by open
  reservations. ``cap`` = the ledger's per-call cap: ``sub_llm_per_call_max_tokens``, else
  :func:`default_cap` (an eighth of the budget, at least 128 and at most
  ``sub_llm_budget_grant_tokens``, default 512), lowered (never raised) by the job's own.
* A call is granted ``min(cap, free)`` when ``free`` is at least half a full grant
  (``ceil(min(cap, limit) / 2)``): a call does not wait for a whole ``cap`` when most of one is
  free (waiting for the whole cap serialised the calls of a small budget: with a budget of
  1,000 and a cap of 512, the second call waited though 488 tokens were free).
* Otherwise, while *live* reservations exist (open, and their call's deadline has not
  passed), the call is told to **wait**: those calls may give tokens back. It parks until the
  settle script publishes a release (:mod:`rlmq.common.budget_wait`), until the earliest live
  deadline, or until its own deadline, when it is rejected clearly (never left hanging).
* With nothing live left, a call gets whatever is free, even less than ``cap`` (the last
  remainder; the answer may be cut, ``finish_reason == "length"``, counted as truncated).
* Only with nothing free and nothing live is a call **rejected**: the budget is spent
  (``limit - used`` is 0, or held by dead workers' reservations, which stay charged; they stop
  being live at their deadline, or earlier when their job runs again: :meth:`BudgetLedger.retire`).

The trade-off: small grants answer *many* calls, each cut short; grants as large as an
answer answer *fewer* calls, *fully*, and the others wait for releases. This ledger leans to
the second, bounded by the first: one call holds at most an eighth of a small budget, so
several calls run at once instead of one after another. The figures, measured with the
scripted model, are in the README's budget section and ``bench/results/budget.json``
(``python -m bench.budget``).

Compared with the reference ``RLMEnv`` (verifiers, March 2026), which checks a counter
that moves only when a whole sub-call finishes, so parallel calls and the forced final
answer overshoot, the charge here happens *before* the call, atomically.

Whether a call is budgeted is the ledger's to say, not the job's: a worker asks the ledger
for every call of a rollout it has not seen without one (:meth:`BudgetLedger.known_unbudgeted`).

Ledger hash fields (``RolloutKeys.budget``): ``limit``, ``cap`` (0: none), ``charged``,
``used`` (tokens servers reported), ``grants``, ``rejections`` (calls refused: by the
script, by a waiter giving up, or up front by the producer), ``waits`` ("wait" answers),
``released``, ``overrun`` (tokens a server returned beyond its grant; stays 0 with a server
that honours ``max_tokens``). Live reservations: ``RolloutKeys.live_reservations``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from rlmq.common.keys import RolloutKeys
from rlmq.common.ledger_script import LEDGER_LUA
from rlmq.common.scripts import run_pipeline

__all__ = ["LEDGER_LUA", "BudgetLedger", "BudgetSnapshot", "Grant", "Settlement"]

_Op = tuple[str, str, int, float, "asyncio.Future[list[int]]"]
"""One coalesced ledger operation: kind (``r`` / ``s``), reservation id, cap or used, deadline, its waiter."""

GRANTED, REJECTED, NO_LEDGER, ALREADY_SETTLED, WAIT, WAITED_OUT = 0, 1, 2, 3, 4, 5
"""Reservation codes (:attr:`Grant.code`); ``WAITED_OUT`` is never the script's: the waiter gave up at
the call's deadline (:mod:`rlmq.common.budget_wait`)."""

UNBUDGETED_MEMORY = 60.0
"""Seconds a worker remembers that a rollout has no ledger (see :meth:`BudgetLedger.known_unbudgeted`)."""


@dataclass(frozen=True)
class Grant:
    """Outcome of a reservation.

    Attributes:
        tokens: completion tokens granted (0 unless ``code`` is 0); the model call's ``max_tokens``.
        charged: tokens charged to the rollout after this reservation.
        limit: the rollout's budget in tokens.
        code: 0 granted, 1 rejected (budget spent), 2 ledger missing, 3 already settled,
            4 wait (ask again after a release), 5 waited out (see :data:`WAITED_OUT`).
        retry_at: for ``code`` 4, the Unix time (seconds) at which the earliest live
            reservation's deadline passes and it stops counting as live (0 otherwise).
        need: for ``code`` 4, the grant the call waits for (tokens free before it is given).
    """

    tokens: int
    charged: int
    limit: int
    code: int
    retry_at: float = 0.0
    need: int = 0

    @property
    def granted(self) -> bool:
        return self.tokens > 0


@dataclass(frozen=True)
class Settlement:
    """Outcome of settling a reservation: ``released`` tokens went back to the budget."""

    released: int
    charged: int
    limit: int
    code: int


@dataclass(frozen=True)
class BudgetSnapshot:
    """The ledger of a rollout at one moment (all figures in completion tokens).

    ``waits`` counts the reservations answered "wait" (a call can be told to wait several
    times); ``cap`` is the per-call cap (0: none).
    """

    limit: int
    charged: int
    used: int
    grants: int
    rejections: int
    released: int
    overrun: int
    cap: int = 0
    waits: int = 0

    @property
    def remaining(self) -> int:
        """Tokens neither spent nor held by an open reservation."""
        return max(0, self.limit - self.charged)

    @property
    def held(self) -> int:
        """Tokens held by open reservations (running calls, or calls of dead workers)."""
        return self.charged - self.used


DEFAULT_CAP_SHARE = 8
"""Without a per-call cap, one call holds at most ``limit // DEFAULT_CAP_SHARE`` tokens of a budget."""
DEFAULT_CAP_FLOOR = 128
"""...but never less than this many tokens (or the whole budget, when that is smaller)."""


def default_cap(limit: int, grant_tokens: int) -> int:
    """The per-call cap of a rollout whose ``sub_llm_per_call_max_tokens`` is unset (tokens).

    ``min(grant_tokens, max(DEFAULT_CAP_FLOOR, limit // DEFAULT_CAP_SHARE))``: budgets of 4,096
    tokens and more get ``grant_tokens`` (``sub_llm_budget_grant_tokens``, default 512); a
    smaller budget is shared by about eight calls at once (budget 1,000: 128 a call) rather than
    handed out one large grant at a time.

    Args:
        limit: the rollout's budget, completion tokens (>= 1).
        grant_tokens: the largest grant of one call, tokens (>= 1).
    """
    return max(1, min(grant_tokens, max(DEFAULT_CAP_FLOOR, limit // DEFAULT_CAP_SHARE)))


class BudgetLedger:
    """Atomic reserve / settle of sub-LLM completion tokens for rollouts.

    Args:
        redis: an asyncio Redis client (``decode_responses`` either way).
        ttl: seconds each ledger key lives after its last write; the producer refreshes it
            while the rollout lives.

    Reservations and settlements are coalesced: every call made in the same event-loop turn
    (hundreds of sub-calls in flight in one worker) goes out in one round trip, one
    ``EVALSHA`` of :data:`LEDGER_LUA` per rollout, pipelined; each operation still applies
    atomically and in order, exactly as if it ran alone. At light load that is one round
    trip per call, as before, started on the next loop turn.

    :meth:`acquire` is the worker's entry point: a reservation that waits for a release
    (woken by Redis pub/sub, :mod:`rlmq.common.budget_wait`) instead of being rejected.
    """

    def __init__(self, redis: Redis, ttl: int = 3600) -> None:
        self._redis = redis
        self._ttl = ttl
        self._script = redis.register_script(LEDGER_LUA)
        self._pending: dict[str, list[_Op]] = {}
        self._flush_scheduled = False
        self._flushes: set[asyncio.Task[None]] = set()
        self._unbudgeted: dict[str, float] = {}
        self._waits: Any = None  # a ReleaseWaits, made on the first wait
        self._abandon = False  # a stopping worker gave up its parked calls (abandon_waits)
        self.on_park: Callable[[], None] | None = None
        """Called whenever the number of :attr:`parked` calls changes (the worker's slot count)."""
        self.resume_gate: Callable[[], Awaitable[None]] | None = None
        """Awaited by a call granted after parking, before it returns: the worker holds it there until
        it fits in its concurrency again (parked calls do not count against it, resumed ones do)."""

    def _submit(
        self, rollout_id: str, kind: str, reservation_id: str, n: int, deadline: float
    ) -> asyncio.Future[list[int]]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[int]] = loop.create_future()
        self._pending.setdefault(rollout_id, []).append((kind, reservation_id, n, deadline, fut))
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

    async def _flush(self, pending: dict[str, list[_Op]]) -> None:
        groups = list(pending.items())
        try:
            if len(groups) == 1:
                outcomes: list[Any] = [await self._script(keys=self._keys(groups[0][0]), args=self._args(groups[0][1]))]
            else:
                outcomes = await self._pipelined(groups)
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
                else:
                    fut.set_result([int(x) for x in outcome[i]])

    async def _pipelined(self, groups: list[tuple[str, list[_Op]]]) -> list[Any]:
        """One round trip for several rollouts: ``EVALSHA`` each (loading the script on ``NOSCRIPT``)."""

        def build(pipe: Any) -> None:
            for rollout_id, ops in groups:
                pipe.evalsha(self._script.sha, 4, *self._keys(rollout_id), *self._args(ops))

        return await run_pipeline(self._redis, build, [LEDGER_LUA], raise_on_error=False)

    def add_settles(self, pipe: Any, settles: Sequence[tuple[str, str, int]]) -> None:
        """Queue settlements on ``pipe`` (one ``EVALSHA`` per rollout), for a caller that sends
        them in one round trip with its own commands (the worker's ``FINISH``).

        Args:
            pipe: a redis-py asyncio pipeline; the caller executes it and, on ``NOSCRIPT``,
                loads :data:`LEDGER_LUA` and sends it again (settling is idempotent).
            settles: ``(rollout_id, reservation_id, completion tokens used)`` each.
        """
        by_rollout: dict[str, list[Any]] = {}
        for rollout_id, reservation_id, used in settles:
            by_rollout.setdefault(rollout_id, []).extend(["s", reservation_id, max(0, int(used)), 0])
        for rollout_id, ops in by_rollout.items():
            pipe.evalsha(self._script.sha, 4, *self._keys(rollout_id), self._ttl, time.time(), *ops)

    @staticmethod
    def _keys(rollout_id: str) -> list[str]:
        keys = RolloutKeys(rollout_id)
        return [keys.budget, keys.reservations, keys.live_reservations, keys.released]

    def _args(self, ops: list[_Op]) -> list[Any]:
        args: list[Any] = [self._ttl, repr(time.time())]
        for kind, reservation_id, n, deadline, _ in ops:
            args += [kind, reservation_id, n, repr(deadline)]
        return args

    async def open(self, rollout_id: str, limit: int, cap: int | None = None) -> None:
        """Create the rollout's ledger with a budget of ``limit`` tokens (keeps an existing one).

        Args:
            rollout_id: the rollout.
            limit: the budget in completion tokens, >= 1.
            cap: the per-call cap in tokens (a grant is at most this; a job can lower it for
                itself, never raise it), or ``None`` for none (a call may be granted all that is free).

        Raises:
            ValueError: ``limit`` < 1 (a budget of 0 would refuse every call: leave the budget
                unset instead) or ``cap`` < 1.
        """
        if limit < 1:
            raise ValueError("budget limit must be >= 1 token (a budget of 0 refuses every sub-LLM call)")
        if cap is not None and cap < 1:
            raise ValueError("per-call cap must be >= 1 token")
        keys = RolloutKeys(rollout_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hsetnx(keys.budget, "limit", limit)
            pipe.hsetnx(keys.budget, "charged", 0)
            pipe.hsetnx(keys.budget, "cap", cap or 0)
            pipe.expire(keys.budget, self._ttl)
            await pipe.execute()

    async def reserve(
        self, rollout_id: str, reservation_id: str, cap: int | None, deadline: float | None = None
    ) -> Grant:
        """Reserve ``min(cap, ledger cap, free)`` tokens under ``reservation_id``, or learn to wait.

        One attempt: a ``code`` 4 (wait) answer is the caller's to handle (:meth:`acquire` does).

        Args:
            rollout_id: the rollout whose budget is charged.
            reservation_id: unique per model call *attempt*; reserving it again while open
                returns the same grant.
            cap: the caller's cap in tokens, or ``None``; it can only lower the ledger's cap.
            deadline: Unix time (seconds) after which the call can no longer report tokens;
                until then its reservation is *live* (others may wait for it). Default: the TTL.
        """
        dl = deadline if deadline is not None else time.time() + self._ttl
        out = await self._submit(rollout_id, "r", reservation_id, cap or 0, dl)
        if out[3] == NO_LEDGER:
            self._remember_unbudgeted(rollout_id)
        return Grant(out[0], out[1], out[2], out[3], out[4] / 1000.0, out[5] if len(out) > 5 else 0)

    async def acquire(
        self, rollout_id: str, reservation_id: str, cap: int | None, deadline: float, *, margin: float = 0.5
    ) -> tuple[Grant, int, float]:
        """Reserve, waiting for releases while the ledger says "wait"; the worker's entry point.

        A call that finds less than a full grant free while live reservations may give tokens
        back parks (it does not count as in flight: :attr:`parked`, :attr:`on_park`) until the
        settle script publishes a release for its rollout, or until the earliest live
        reservation's deadline, then asks again. It gives up at ``deadline - margin`` with
        ``code`` :data:`WAITED_OUT`, so its result still reaches the producer in time.

        Args:
            rollout_id / reservation_id / cap / deadline: as for :meth:`reserve` (seconds).
            margin: seconds before ``deadline`` at which waiting ends.

        Returns:
            ``(grant, waits, wait_seconds)``: the final answer (never ``code`` 4), how many
            times the call parked, and the seconds it spent parked.

        Raises:
            redis.RedisError: a reservation failed (waiting itself survives a lost pub/sub
                connection: every waiter is woken to ask again).
            asyncio.CancelledError: the worker is stopping (:meth:`abandon_waits`): a parked
                call, or one granted after parking that has not called its model yet (its grant
                is settled at 0 first), is handed back instead.
        """
        grant = await self.reserve(rollout_id, reservation_id, cap, deadline)
        if grant.code != WAIT:
            return grant, 0, 0.0
        if self._waits is None:
            from rlmq.common.budget_wait import ReleaseWaits

            self._waits = ReleaseWaits(self._redis, self._park_changed)
            if self._abandon:
                self._waits.abandon()
        waits: Any = self._waits
        result: tuple[Grant, int, float] = await waits.wait_for_grant(
            self, rollout_id, reservation_id, cap, deadline, deadline - margin, grant
        )
        if result[0].granted and result[1] and self.resume_gate is not None:
            await self.resume_gate()  # cancelled here: the reservation stays charged in full
        if result[0].granted and self._abandon:
            # Granted as the worker began to stop: the model was never called, so the grant goes
            # back (settled at 0 tokens) and the job is handed back like the parked ones.
            await self.settle(rollout_id, reservation_id, 0)
            raise asyncio.CancelledError("the worker is stopping: a granted call that had not started is handed back")
        return result

    @property
    def parked(self) -> int:
        """Calls of this process parked now, waiting for a release."""
        return int(self._waits.parked) if self._waits is not None else 0

    def _park_changed(self) -> None:
        if self.on_park is not None:
            self.on_park()

    def known_unbudgeted(self, rollout_id: str) -> bool:
        """True when this process found no ledger for ``rollout_id`` in the last :data:`UNBUDGETED_MEMORY`
        seconds. Safe to trust: the producer opens a rollout's ledger before it enqueues any
        of its jobs, so a rollout seen without one gets none later."""
        expiry = self._unbudgeted.get(rollout_id)
        if expiry is None:
            return False
        if expiry < time.monotonic():
            del self._unbudgeted[rollout_id]
            return False
        return True

    def _remember_unbudgeted(self, rollout_id: str) -> None:
        if len(self._unbudgeted) >= 10_000:  # bounded: forget the oldest half
            for key in list(self._unbudgeted)[:5_000]:
                del self._unbudgeted[key]
        self._unbudgeted[rollout_id] = time.monotonic() + UNBUDGETED_MEMORY

    async def settle(self, rollout_id: str, reservation_id: str, used: int) -> Settlement:
        """Settle a reservation with the ``used`` completion tokens the server reported."""
        return Settlement(*(await self._submit(rollout_id, "s", reservation_id, max(0, int(used)), 0.0))[:4])

    async def retire(self, rollout_id: str, reservation_ids: Sequence[str]) -> int:
        """Stop counting ``reservation_ids`` as live (nobody waits for them any more); they stay
        charged and can still be settled. For the reservations of a job's earlier attempts when
        the job runs again (its earlier worker was declared dead). Returns how many were live."""
        if not reservation_ids:
            return 0
        outs = await asyncio.gather(*(self._submit(rollout_id, "x", rid, 0, 0.0) for rid in reservation_ids))
        return sum(out[0] for out in outs)

    async def count_rejections(self, rollout_id: str, n: int) -> None:
        """Add ``n`` calls refused before they were enqueued (the producer's up-front refusal of a
        batch on a spent budget) to the ledger's ``rejections``, so it counts every refusal."""
        key = RolloutKeys(rollout_id).budget
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hincrby(key, "rejections", n)
            pipe.expire(key, self._ttl)
            await pipe.execute()

    @property
    def abandoning(self) -> bool:
        """True once :meth:`abandon_waits` was called (the worker is stopping)."""
        return self._abandon

    def abandon_waits(self) -> None:
        """A stopping worker gives up its parked calls: each ends with
        :class:`asyncio.CancelledError` instead of a grant (see
        :meth:`rlmq.common.budget_wait.ReleaseWaits.abandon`), so its job is handed back."""
        self._abandon = True
        if self._waits is not None:
            self._waits.abandon()

    async def aclose(self) -> None:
        """Stop waiting: wake every parked call (it asks once more) and close the pub/sub connection."""
        if self._waits is not None:
            await self._waits.aclose()

    async def snapshot(self, rollout_id: str) -> BudgetSnapshot | None:
        """Read the ledger, or ``None`` when the rollout has none."""
        raw = await self._redis.hgetall(RolloutKeys(rollout_id).budget)
        if not raw or not any(k in (b"limit", "limit") for k in raw):
            return None
        f = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}
        return BudgetSnapshot(
            limit=f.get("limit", 0),
            charged=f.get("charged", 0),
            used=f.get("used", 0),
            grants=f.get("grants", 0),
            rejections=f.get("rejections", 0),
            released=f.get("released", 0),
            overrun=f.get("overrun", 0),
            cap=f.get("cap", 0),
            waits=f.get("waits", 0),
        )
