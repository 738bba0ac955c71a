"""The completion-token budget ledger of a rollout (with recursion: of a rollout tree), kept in Redis.

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
  reservations. ``cap`` = the ledger's per-call cap of the kind (the producer stores the rollout's
  per-call ``max_tokens``: :func:`rlmq.common.sampling.sub_call_max_tokens`), lowered (never
  raised) by the job's own.
* A call is granted a *whole* cap, ``min(cap, limit)``, when that much is free: an answer is never
  cut while the budget can still pay for it.
* Otherwise, while *live* reservations exist (open, and their call's deadline has not
  passed), the call is told to **wait**: those calls may give tokens back. It parks until the
  settle script publishes a release (:mod:`rlmq.common.budget.wait`), until the earliest live
  deadline, or until its own deadline, when it is rejected clearly (never left hanging).
* With nothing live left, a call gets whatever is free, even less than ``cap`` (the last
  remainder; the answer may be cut, ``finish_reason == "length"``, counted as truncated; the
  grant says so: :attr:`Grant.cut`). Such calls run one at a time, each on what the last left.
* Only with nothing free and nothing live is a call **rejected**: the budget is spent
  (``limit - used`` is 0, or held by dead workers' reservations, which stay charged; they stop
  being live at their deadline, or earlier when their job runs again: :meth:`BudgetLedger.retire`).

Leased grants: a call that does not reach the model at once after its grant (an early lane call
waiting for ``START``, a call granted after parking, a child's root turn) reserves *leased*
(:meth:`BudgetLedger.reserve`, ``leased``) and *begins* the grant (:meth:`BudgetLedger.begin`)
right before its model call. A grant never begun goes back: at once when its call is cancelled
(:meth:`BudgetLedger.give_back_soon`), else when its lease (``sub_llm_budget_grant_lease``) ends,
reclaimed by the ledger's next reservation; parked calls are told when a lease ends. A begun grant
is never reclaimed (its call may be spending it): the budget stays hard.

The trade-off: whole answers before many answers. Calls run in parallel as far as the budget
pays for whole caps (``limit // cap`` at once); the others wait for releases. The figures, measured
with the scripted model, are in ``docs/budget.md`` and ``bench/results/budget.json``
(``python -m bench.budget``).

Compared with the reference ``RLMEnv`` (verifiers, March 2026), which checks a counter
that moves only when a whole sub-call finishes, so parallel calls and the forced final
answer overshoot, the charge here happens *before* the call, atomically.

Whether a call is budgeted is the ledger's to say, not the job's: a worker asks the ledger
for every call of a rollout it has not seen without one (:meth:`BudgetLedger.known_unbudgeted`).

A ledger is addressed by its own id (:class:`rlmq.common.keys.LedgerKeys`), which every job
charging it carries: a depth-1 rollout opens one whose id is its rollout id; all rollouts of one
tree will share their top rollout's. Its reservations have a *kind* (:data:`SUB_LLM`, a
sub-LLM turn, the default; :data:`ROOT`, a root-model turn), each with its own per-call cap; the
budget is one for all kinds. The ledger stores the TTL its owner chose (``ttl``): every script that
touches its keys uses that one, never the caller's own, so a worker configured with a shorter TTL
cannot make a producer's ledger expire under it.

Ledger hash fields (``LedgerKeys.budget``): ``limit``, ``ttl`` (seconds), ``cap`` (0: none; the
cap of :data:`SUB_LLM` reservations), ``cap:<kind>`` (the cap of another kind), ``charged``,
``used`` (tokens servers reported), ``grants``, ``rejections`` (calls refused: by the
script, by a waiter giving up, or up front by the producer), ``waits`` ("wait" answers),
``released``, ``overrun`` (tokens a server returned beyond its grant; stays 0 with a server
that honours ``max_tokens``), ``reclaimed`` (tokens of leased grants given back unbegun). Live
reservations: ``LedgerKeys.live_reservations``; open leases: ``LedgerKeys.grant_leases``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import BusyLoadingError, NoPermissionError, ReadOnlyError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_exponential, wait_random

from rlmq.common.budget.calls import LedgerCalls
from rlmq.common.budget.script import LEDGER_LUA
from rlmq.common.budget.segments import ROOT, SUB_LLM, LedgerSegments, reserve_op
from rlmq.common.budget.tree import NODE_TTL, LedgerTree, node_ttl
from rlmq.common.budget.wait import ReleaseWaits
from rlmq.common.budget.wire import COUNT_REJECTIONS_WIRE, BeginCode, BudgetSnapshot, Code, Grant, Op, Settlement
from rlmq.common.keys import LedgerKeys
from rlmq.common.settings import setting_default

__all__ = [
    "LEDGER_LUA", "NODE_TTL", "ROOT", "SUB_LLM", "BudgetLedger", "BudgetSnapshot", "Code", "Grant", "Settlement",
    "node_ttl",
    "GRANTED", "REJECTED", "NO_LEDGER", "ALREADY_SETTLED", "WAIT", "WAITED_OUT", "TREE_CLOSED", "NODE_GONE",
    "UNLIMITED",
]  # fmt: skip

GRANTED, REJECTED, NO_LEDGER, ALREADY_SETTLED, WAIT = (
    Code.GRANTED,
    Code.REJECTED,
    Code.NO_LEDGER,
    Code.ALREADY_SETTLED,
    Code.WAIT,
)
WAITED_OUT, TREE_CLOSED, NODE_GONE, UNLIMITED = Code.WAITED_OUT, Code.TREE_CLOSED, Code.NODE_GONE, Code.UNLIMITED
"""The reservation codes (:class:`rlmq.common.budget.wire.Code`) by their short names."""

_PASSING_REPLIES = ("READONLY", "OOM", "LOADING", "BUSY", "MASTERDOWN", "TRYAGAIN", "MISCONF", "NOREPLICAS")
"""Error replies of a Redis that will take the same command again soon: a failover, a full
memory that eviction or expiry frees, a start-up, a busy script, a failed snapshot."""


def _refused_for_now(exc: BaseException) -> bool:
    """Whether a failed reservation may succeed when asked again: a lost connection or a
    timeout, or an error reply of :data:`_PASSING_REPLIES`. Not ``NOPERM``, a key of the wrong
    type or a script error, which asking again cannot change."""
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, ReadOnlyError, BusyLoadingError)):
        return True
    return (
        isinstance(exc, ResponseError)
        and not isinstance(exc, NoPermissionError)
        and (str(exc).split(" ", 1)[0].upper() in _PASSING_REPLIES)
    )


UNBUDGETED_MEMORY = 60.0
"""Seconds a worker remembers that a rollout has no ledger (see :meth:`BudgetLedger.known_unbudgeted`)."""


class BudgetLedger(LedgerTree, LedgerCalls, LedgerSegments):
    """Atomic reserve / settle of completion tokens in ledgers addressed by their own ids.

    Args:
        redis: an asyncio Redis client (``decode_responses`` either way).
        ttl: seconds the keys of a ledger *this process opens* live after a refresh (stored in
            the ledger by :meth:`open`; the owner refreshes them while its rollout lives;
            ``rollout_key_ttl``).
            Nothing else uses it: a worker's scripts use the TTL stored in each ledger.
        grant_lease: seconds a leased grant of this process may wait for its :meth:`begin` before
            the ledger's next reservation reclaims it (``sub_llm_budget_grant_lease``; > 0).

    Raises:
        ValueError: ``grant_lease`` <= 0.

    Reservations and settlements are coalesced: every call made in the same event-loop turn
    (hundreds of sub-calls in flight in one worker) goes out in one round trip, one
    ``EVALSHA`` of :data:`LEDGER_LUA` per rollout, pipelined; each operation still applies
    atomically and in order, exactly as if it ran alone. At light load that is one round
    trip per call, as before, started on the next loop turn.

    :meth:`acquire` is the worker's entry point: a reservation that waits for a release
    (woken by Redis pub/sub, :mod:`rlmq.common.budget.wait`) instead of being rejected.
    """

    def __init__(
        self,
        redis: Redis,
        ttl: int = setting_default("rollout_key_ttl"),
        grant_lease: float = setting_default("sub_llm_budget_grant_lease"),
    ) -> None:
        if grant_lease <= 0:
            raise ValueError("grant lease must be > 0 seconds")
        super().__init__(redis, grant_lease)
        self._ttl = ttl
        self._parked_leased: set[tuple[str, str]] = set()  # parked reservations asked again leased
        self._give_backs: set[asyncio.Task[None]] = set()
        self._unbudgeted: dict[str, float] = {}
        self._waits: ReleaseWaits | None = None  # made on the first wait
        self._abandon = False  # a stopping worker gave up its parked calls (abandon_waits)
        self._parked_kinds: dict[tuple[str, str], str] = {}  # (ledger, reservation) -> kind, while acquiring
        self._parked_nodes: dict[tuple[str, str], tuple[str, ...]] = {}  # ... -> node chain, while acquiring
        self._parked_segments: dict[tuple[str, str], int] = {}  # ... -> a segment's spent tokens, while acquiring
        self.on_park: Callable[[], None] | None = None
        """Called whenever the number of :attr:`parked` calls changes (the worker's slot count)."""
        self.resume_gate: Callable[[], Awaitable[None]] | None = None
        """Awaited by a call granted after parking, before it returns: the worker holds it there until
        it fits in its concurrency again (parked calls do not count against it, resumed ones do)."""

    async def open(
        self,
        ledger_id: str,
        limit: int,
        cap: int | None = None,
        *,
        ttl: int | None = None,
        kind_caps: Mapping[str, int] | None = None,
    ) -> None:
        """Create the ledger ``ledger_id`` with a budget of ``limit`` tokens (keeps an existing one).

        Args:
            ledger_id: the ledger's own id (a depth-1 rollout: its rollout id).
            limit: the budget in completion tokens, >= 1, for reservations of every kind.
            cap: the per-call cap of :data:`SUB_LLM` reservations in tokens (a grant is at most
                this; a job can lower it for itself, never raise it), or ``None`` for none (a call
                may be granted all that is free).
            ttl: seconds the ledger's keys live after a refresh, stored in the ledger (every
                script touching its keys uses it); default: this ledger object's ``ttl``.
            kind_caps: per-call caps of other reservation kinds (``{ROOT: 2048}``), tokens; a
                kind without one has no cap of its own.

        Raises:
            ValueError: ``limit`` < 1 (a budget of 0 would refuse every call: leave the budget
                unset instead), a cap < 1, ``ttl`` < 1 or an invalid kind.
        """
        if limit < 1:
            raise ValueError("budget limit must be >= 1 token (a budget of 0 refuses every sub-LLM call)")
        if cap is not None and cap < 1:
            raise ValueError("per-call cap must be >= 1 token")
        ttl = self._ttl if ttl is None else ttl
        if ttl < 1:
            raise ValueError("ledger ttl must be >= 1 second")
        extra = {}
        for kind, kcap in (kind_caps or {}).items():
            if kcap < 1:
                raise ValueError(f"per-call cap of {kind!r} reservations must be >= 1 token")
            extra["cap:" + reserve_op(kind).removeprefix(Op.RESERVE + ":")] = kcap
        keys = LedgerKeys(ledger_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hsetnx(keys.budget, "limit", limit)
            pipe.hsetnx(keys.budget, "charged", 0)
            pipe.hsetnx(keys.budget, "cap", cap or 0)
            pipe.hsetnx(keys.budget, "ttl", ttl)
            for field, value in extra.items():
                pipe.hsetnx(keys.budget, field, value)
            pipe.expire(keys.budget, ttl)
            await pipe.execute()

    async def reserve(
        self,
        ledger_id: str,
        reservation_id: str,
        cap: int | None,
        deadline: float | None = None,
        *,
        kind: str | None = None,
        nodes: Sequence[str] | None = None,
        leased: bool | None = None,
        segment: int | None = None,
    ) -> Grant:
        """Reserve ``min(cap, ledger cap of the kind, free)`` tokens under ``reservation_id``, or learn to wait.

        One attempt: a ``code`` 4 (wait) answer is the caller's to handle (:meth:`acquire` does).

        Args:
            ledger_id: the ledger charged (the id the job carries).
            reservation_id: unique per model call *attempt*; reserving it again while open
                returns the same grant.
            cap: the caller's cap in tokens, or ``None``; it can only lower the ledger's cap.
            deadline: Unix time (seconds) after which the call can no longer report tokens;
                until then its reservation is *live* (others may wait for it). Default: the TTL.
            kind: the reservation kind (:data:`SUB_LLM`, :data:`ROOT`); default: the kind
                :meth:`acquire` is waiting with for this reservation, else :data:`SUB_LLM`.
            nodes: the calling rollout's tree chain (node ids, top .. caller; empty for a top
                rollout's call): refused (:data:`NODE_GONE`) unless each node is alive in this
                ledger; default: the chain :meth:`acquire` is waiting with, else none.
                A closed ledger refuses every reservation (:data:`TREE_CLOSED`).
            leased: a new grant is leased (:attr:`Grant.leased`): for a call that does not reach
                the model at once (it waits for its job's ``START``, or for a slot after parking).
                Its holder calls :meth:`begin` right before the model call; a grant not begun within
                the lease (``grant_lease`` seconds) is reclaimed by the ledger's next reservation.
                Default: leased when :meth:`acquire` parked this reservation, else not.
            segment: reserve a *segment* of an answer instead of a whole cap (``docs/budget.md``):
                the tokens the answer has spent so far (0: its first segment; ``cap`` is the whole
                answer's cap). Default: the segment :meth:`acquire` is waiting with, else a whole cap.

        Raises:
            ValueError: an invalid ``kind``.
            ConfigError: an invalid node id.
        """
        parked = (ledger_id, reservation_id)
        if leased is None:
            leased = parked in self._parked_leased
        if kind is None:
            kind = self._parked_kinds.get(parked, SUB_LLM)
        chain = tuple(nodes) if nodes is not None else self._parked_nodes.get(parked, ())
        if segment is None:
            segment = self._parked_segments.get(parked)
        if chain:
            for node in chain:
                LedgerKeys(ledger_id).node(node)  # ConfigError now, not a script error later
        dl = deadline if deadline is not None else time.time() + self._ttl
        op = reserve_op(kind, leased=bool(leased), segment=segment)
        r = await self._submit(ledger_id, op, reservation_id, cap or 0, dl, chain)
        if r.code == Code.NO_LEDGER:
            self._remember_unbudgeted(ledger_id)
        if r.code in (Code.TREE_CLOSED, Code.NODE_GONE):
            gone = chain[r.detail - 1] if r.code == Code.NODE_GONE and 0 < r.detail <= len(chain) else ""
            return Grant(0, r.charged, r.limit, r.code, gone_node=gone)
        leased_grant = bool(leased) and r.code == Code.GRANTED
        return Grant(r.value, r.charged, r.limit, r.code, r.detail / 1000.0, r.need, leased=leased_grant)

    async def reserve_until(
        self,
        until: float,
        ledger_id: str,
        reservation_id: str,
        cap: int | None,
        deadline: float | None = None,
        **kwargs: Any,
    ) -> Grant:
        """:meth:`reserve`, asked again with backoff (50 ms doubling up to 1 s, jittered) while
        Redis refuses for a moment (a lost connection, ``READONLY`` in a failover, ``OOM``,
        ``LOADING``, ...), until the Unix time ``until`` (seconds). Asking again is safe: a
        reservation still open returns the same grant.

        Raises:
            redis.RedisError: the last passing refusal at ``until``; any other error at once
                (``NOPERM``, a key of the wrong type, a script error).
            ValueError / ConfigError: as :meth:`reserve`.
        """
        try:  # the fast path: no retry bookkeeping on a call that succeeds
            return await self.reserve(ledger_id, reservation_id, cap, deadline, **kwargs)
        except RedisError as exc:
            if not _refused_for_now(exc) or time.time() >= until:
                raise

        def past_until(state: RetryCallState) -> bool:
            return time.time() >= until

        async for attempt in AsyncRetrying(
            retry=retry_if_exception(_refused_for_now),
            wait=wait_exponential(multiplier=0.05, max=1.0) + wait_random(0, 0.05),
            stop=past_until,
            reraise=True,
        ):
            with attempt:
                return await self.reserve(ledger_id, reservation_id, cap, deadline, **kwargs)
        raise AssertionError("unreachable: tenacity re-raises the last refusal")  # pragma: no cover

    async def acquire(
        self,
        ledger_id: str,
        reservation_id: str,
        cap: int | None,
        deadline: float,
        *,
        margin: float = 0.5,
        kind: str = SUB_LLM,
        nodes: Sequence[str] = (),
        leased: bool = False,
        segment: int | None = None,
    ) -> tuple[Grant, int, float]:
        """Reserve, waiting for releases while the ledger says "wait"; the worker's entry point.

        A call that finds less than a full grant free while live reservations may give tokens
        back parks (it does not count as in flight: :attr:`parked`, :attr:`on_park`) until the
        settle script publishes a release for its rollout, or until the earliest live
        reservation's deadline, then asks again. It gives up at ``deadline - margin`` with
        ``code`` :data:`WAITED_OUT`, so its result still reaches the producer in time.

        Args:
            ledger_id / reservation_id / cap / deadline / kind / nodes: as for :meth:`reserve` (seconds).
            margin: seconds before ``deadline`` at which waiting ends.
            leased: lease the first ask's grant (see :meth:`reserve`); a grant after parking is
                always leased (it waits for the resume gate): when the returned grant is
                :attr:`~Grant.leased`, :meth:`begin` it right before the model call.
            segment: reserve a segment of an answer that has spent this many tokens (see :meth:`reserve`).

        Returns:
            ``(grant, waits, wait_seconds)``: the final answer (never ``code`` 4), how many
            times the call parked, and the seconds it spent parked.

        Raises:
            redis.RedisError: Redis kept refusing the reservation until ``deadline - margin``
                (a refusal or lost connection is asked again with backoff until then; waiting
                itself survives a lost pub/sub connection: every waiter is woken to ask again),
                or refused it in a way asking again cannot change (``NOPERM``, a key of the wrong
                type, a script error; see :meth:`reserve_until`).
            asyncio.CancelledError: the worker is stopping (:meth:`abandon_waits`): a parked
                call, or one granted after parking that has not called its model yet (its grant
                is settled at 0 first), is handed back instead.
        """
        try:
            grant = await self.reserve_until(
                deadline - margin,
                ledger_id,
                reservation_id,
                cap,
                deadline,
                kind=kind,
                nodes=nodes,
                leased=leased,
                segment=segment,
            )
        except asyncio.CancelledError:
            if leased:
                self.give_back_soon(ledger_id, reservation_id)  # the ask may have been granted
            raise
        if grant.code != Code.WAIT:
            return grant, 0, 0.0
        if segment is not None:
            self._parked_segments[(ledger_id, reservation_id)] = segment
        try:
            result = await self._park_until_answered(
                ledger_id, reservation_id, cap, deadline, margin, grant, kind, nodes
            )
        finally:
            self._parked_segments.pop((ledger_id, reservation_id), None)
        if result[0].granted:
            await self._resume(ledger_id, reservation_id, parked=result[1] > 0)
        return result

    def _release_waits(self) -> ReleaseWaits:
        """The waits of this process's parked calls, made on the first one."""
        if self._waits is None:
            self._waits = ReleaseWaits(self._redis, self._park_changed)
            if self._abandon:
                self._waits.abandon()
        return self._waits

    async def _park_until_answered(
        self,
        ledger_id: str,
        reservation_id: str,
        cap: int | None,
        deadline: float,
        margin: float,
        grant: Grant,
        kind: str,
        nodes: Sequence[str],
    ) -> tuple[Grant, int, float]:
        """Park the call told to wait (``grant``) until the ledger grants or rejects it (:meth:`acquire`)."""
        parked_key = (ledger_id, reservation_id)
        if kind != SUB_LLM:
            self._parked_kinds[parked_key] = kind  # the waiter asks again through reserve(), by id
        if nodes:
            self._parked_nodes[parked_key] = tuple(nodes)
        self._parked_leased.add(parked_key)  # granted after parking: it passes the resume gate first
        try:
            return await self._release_waits().wait_for_grant(
                self, ledger_id, reservation_id, cap, deadline, deadline - margin, grant
            )
        except asyncio.CancelledError:
            self.give_back_soon(ledger_id, reservation_id)  # an ask in flight may have been granted
            raise
        finally:
            self._parked_kinds.pop(parked_key, None)
            self._parked_nodes.pop(parked_key, None)
            self._parked_leased.discard(parked_key)

    async def _resume(self, ledger_id: str, reservation_id: str, *, parked: bool) -> None:
        """A granted call goes on: through the resume gate when it had parked (cancelled there, its
        grant, never begun, goes back to the budget); handed back when the worker began to stop
        before its model was called (the grant is settled at 0 tokens).

        Raises:
            asyncio.CancelledError: the worker is stopping.
        """
        if parked and self.resume_gate is not None:
            try:
                await self.resume_gate()
            except asyncio.CancelledError:
                self.give_back_soon(ledger_id, reservation_id)  # never begun: back to the budget
                raise
        if self._abandon:
            # Granted as the worker began to stop: the model was never called, so the grant goes
            # back (settled at 0 tokens) and the job is handed back like the parked ones.
            await self.settle(ledger_id, reservation_id, 0)
            raise asyncio.CancelledError("the worker is stopping: a granted call that had not started is handed back")

    @property
    def parked(self) -> int:
        """Calls of this process parked now, waiting for a release."""
        return int(self._waits.parked) if self._waits is not None else 0

    def _park_changed(self) -> None:
        if self.on_park is not None:
            self.on_park()

    def known_unbudgeted(self, ledger_id: str) -> bool:
        """True when this process found no ledger ``ledger_id`` in the last :data:`UNBUDGETED_MEMORY`
        seconds. Safe to trust: the producer opens a rollout's ledger before it enqueues any
        of its jobs, so a ledger id seen without one gets none later."""
        expiry = self._unbudgeted.get(ledger_id)
        if expiry is None:
            return False
        if expiry < time.monotonic():
            del self._unbudgeted[ledger_id]
            return False
        return True

    def _remember_unbudgeted(self, ledger_id: str) -> None:
        if len(self._unbudgeted) >= 10_000:  # bounded: forget the oldest half
            for key in list(self._unbudgeted)[:5_000]:
                del self._unbudgeted[key]
        self._unbudgeted[ledger_id] = time.monotonic() + UNBUDGETED_MEMORY

    async def settle(self, ledger_id: str, reservation_id: str, used: int) -> Settlement:
        """Settle a reservation of ledger ``ledger_id`` with the ``used`` completion tokens the server reported."""
        r = await self._submit(ledger_id, Op.SETTLE, reservation_id, max(0, int(used)), 0.0)
        return Settlement(r.value, r.charged, r.limit, r.code)

    async def begin(self, ledger_id: str, reservation_id: str) -> bool:
        """Mark a leased grant *begun*: its call is about to reach the model. From now on it is never
        reclaimed, only settled (the model may be spending it). Call it right before the model call,
        and call the model only when it returns True.

        Returns:
            True: begun (or begun already, or a grant that was never leased). False: the lease was
            reclaimed (the grant went back to the budget) or the reservation is settled: do not call
            the model under it; reserve again.

        Raises:
            redis.RedisError: Redis refused or is gone (do not call the model either).
        """
        r = await self._submit(ledger_id, Op.BEGIN, reservation_id, 0, 0.0)
        return r.code == BeginCode.BEGUN

    def give_back_soon(self, ledger_id: str, reservation_id: str) -> None:
        """Give a leased grant that will never be begun back to the budget, without waiting (for a
        call being cancelled: nothing here can be cancelled with it). Sent after this process's
        ledger round trips in flight (the grant may be in one of them). A begun, settled, unknown or
        never leased reservation is left as it is; a give-back that fails (Redis away) leaves the
        grant to its lease."""
        earlier = set(self._flushes)

        async def give_back() -> None:
            if earlier:
                await asyncio.wait(earlier)
            with contextlib.suppress(RedisError, OSError):
                await self._submit(ledger_id, Op.GIVE_BACK, reservation_id, 0, 0.0)

        task = asyncio.get_running_loop().create_task(give_back())
        self._give_backs.add(task)
        task.add_done_callback(self._give_backs.discard)

    async def retire(self, ledger_id: str, reservation_ids: Sequence[str]) -> int:
        """Stop counting ``reservation_ids`` as live (nobody waits for them any more); they stay
        charged and can still be settled. For the reservations of a job's earlier attempts when
        the job runs again (its earlier worker was declared dead). Returns how many were live."""
        if not reservation_ids:
            return 0
        outs = await asyncio.gather(*(self._submit(ledger_id, Op.RETIRE, rid, 0, 0.0) for rid in reservation_ids))
        return sum(r.value for r in outs)

    async def count_rejections(self, ledger_id: str, n: int) -> None:
        """Add ``n`` calls refused outside the ledger script (the producer's up-front refusal of a
        batch on a spent budget, a waiter giving up) to the ledger's ``rejections``, so it counts
        every refusal. A missing ledger is not re-created, and the ledger's TTL is left as its
        owner set it (a worker's own TTL never touches it)."""
        keys, args = COUNT_REJECTIONS_WIRE.layout(LedgerKeys(ledger_id), n=n)
        await self._count_script(keys=keys, args=args)

    @property
    def abandoning(self) -> bool:
        """True once :meth:`abandon_waits` was called (the worker is stopping)."""
        return self._abandon

    def abandon_waits(self) -> None:
        """A stopping worker gives up its parked calls: each ends with
        :class:`asyncio.CancelledError` instead of a grant (see
        :meth:`rlmq.common.budget.wait.ReleaseWaits.abandon`), so its job is handed back."""
        self._abandon = True
        if self._waits is not None:
            self._waits.abandon()

    async def aclose(self) -> None:
        """Stop waiting: wake every parked call (it asks once more) and close the pub/sub connection;
        give-backs under way get up to a second."""
        if self._waits is not None:
            await self._waits.aclose()
        if self._give_backs:
            await asyncio.wait(set(self._give_backs), timeout=1.0)

    async def exists(self, ledger_id: str) -> bool:
        """True when the ledger ``ledger_id`` exists in Redis (one ``EXISTS``)."""
        return bool(await self._redis.exists(LedgerKeys(ledger_id).budget))

    async def snapshot(self, ledger_id: str) -> BudgetSnapshot | None:
        """Read the ledger ``ledger_id``, or ``None`` when there is none."""
        raw = await self._redis.hgetall(LedgerKeys(ledger_id).budget)
        if not raw or not any(k in (b"limit", "limit") for k in raw):
            return None
        f = {(k.decode() if isinstance(k, bytes) else k): _int_or_zero(v) for k, v in raw.items()}
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
            ttl=f.get("ttl", 0),
        )


def _int_or_zero(value: bytes | str) -> int:
    """A ledger field as an int; 0 for one that is not an integer (a corrupt ``ttl``: the script
    ignores it too, and a snapshot must not fail a rollout's usage line over it)."""
    try:
        return int(value)
    except ValueError:
        return 0
