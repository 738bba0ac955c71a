"""The sub-LLM completion-token budget ledger of a rollout, kept in Redis.

The guarantee (``shared/DESIGN.md``, invariant 1): for every rollout, the completion
tokens sub-LLM servers return add up to at most ``sub_llm_max_completion_tokens``, with
any number of workers and parallel calls, as long as the server honours ``max_tokens``.

How: before every model call (each tool-loop turn and the final answer) a worker
*reserves* a grant ``min(per-call cap, limit - charged)`` in one Lua script, keyed by a
reservation id, and calls the model with ``max_tokens = grant``. Afterwards it *settles*
the reservation with the tokens the server reported, releasing the unused part. Both
scripts are idempotent per reservation id: reserving an open reservation again returns
the same grant, settling twice changes nothing. A reservation whose worker died stays
charged in full (the tokens may have been spent): never refunded twice, never lost.

Compared with the reference ``RLMEnv`` (verifiers, March 2026), which checks a counter
that moves only when a whole sub-call finishes, so parallel calls and the forced final
answer overshoot, the charge here happens *before* the call, atomically.

Ledger hash fields (``RolloutKeys.budget``): ``limit``, ``charged`` (reserved and not
released: the figure the budget is checked against), ``used`` (tokens servers reported),
``grants``, ``rejections``, ``released``, ``overrun`` (tokens a server returned beyond
its grant; stays 0 with a server that honours ``max_tokens``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from rlmq.common.keys import RolloutKeys

# KEYS[1] budget hash, KEYS[2] reservations hash, KEYS[3] live-open sorted set, KEYS[4] release
# channel (one rollout: all share its hash tag). ARGV[1] TTL seconds, ARGV[2] now (Unix seconds),
# then per operation i four arguments from ARGV[4i-1]: kind ('r' reserve, 's' settle),
# reservation id, n, deadline. For a reserve n is the caller's cap in tokens (<= 0: none; it can
# only lower the ledger's own 'cap') and deadline the call's deadline (Unix seconds); for a settle
# n is the completion tokens the server reported (>= 0) and deadline is unused.
# The operations are applied in order, each exactly as if it ran alone; the script reads the
# ledger once (HMGET) and writes it once (HSET). Returns one {a, charged, limit, code, next} per
# operation:
# * reserve: a = grant. code 0 granted (grant > 0); 1 rejected (grant 0: nothing free and no live
#   reservation that could give tokens back); 2 no ledger (budget hash missing: expired, lost, or
#   an unbudgeted rollout); 3 already settled (a retried job asked again for a closed reservation);
#   4 wait (less than a full grant is free but live reservations may give some back: ask again
#   after a release, or at 'next', the earliest live reservation's deadline in ms, when it stops
#   counting as live). An open reservation with the same id returns its grant again.
#   The grant is min(cap, free), free = limit - charged, cap = min(ledger cap, caller's cap); it is
#   given when free >= min(cap, limit) (no cap: free > 0), or, when no live reservation is left,
#   whatever is free (the last remainder).
# * settle: a = released = grant - used (>= 0 with a server that honours max_tokens; a server
#   that returned more than its grant is charged the excess, recorded in 'overrun').
#   code 0 settled now, 1 already settled (nothing changes), 2 unknown reservation.
# A live reservation is an open one whose call's deadline has not passed (KEYS[3], scored by
# deadline): one held by a dead worker stops being live at its deadline but stays charged.
# After any settle, once the rollout has had a waiter, the script publishes on KEYS[4].
# The reservations hash gets its TTL with the rollout's first grant, the live set with every
# script that adds to it (the producer's key refresh keeps both alive with the ledger).
LEDGER_LUA = """
local ttl, now = tonumber(ARGV[1]), tonumber(ARGV[2])
local nops = (#ARGV - 2) / 4
local b = redis.call('HMGET', KEYS[1], 'limit', 'charged', 'grants', 'used', 'released', 'overrun', 'rejections',
                     'waits', 'cap')
local limit, lcap = tonumber(b[1]), tonumber(b[9] or '0')
local f = {charged = tonumber(b[2] or '0'), grants = tonumber(b[3] or '0'), used = tonumber(b[4] or '0'),
           released = tonumber(b[5] or '0'), overrun = tonumber(b[6] or '0'), rejections = tonumber(b[7] or '0'),
           waits = tonumber(b[8] or '0')}
local changed, names = {}, {'charged', 'grants', 'used', 'released', 'overrun', 'rejections', 'waits'}
local state, writes, order = {}, {}, {}
local ids = {}
for i = 1, nops do ids[i] = ARGV[4 * i] end
for i = 1, nops, 500 do
  local part = redis.call('HMGET', KEYS[2], unpack(ids, i, math.min(i + 499, nops)))
  for j = 1, #part do
    if part[j] then state[ids[i + j - 1]] = part[j] end
  end
end
local function put(id, value)
  if not writes[id] then order[#order + 1] = id end
  writes[id] = value
  state[id] = value
end
local live = nil
local function live_count()
  if live == nil then
    redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
    live = redis.call('ZCARD', KEYS[3])
  end
  return live
end
local added, settled, first_grant = false, false, false
local out = {}
for i = 1, nops do
  local kind, id, n, dl = ARGV[4 * i - 1], ARGV[4 * i], tonumber(ARGV[4 * i + 1]), tonumber(ARGV[4 * i + 2])
  local s = state[id]
  if kind == 'r' then
    if not limit then
      out[i] = {0, 0, 0, 2, 0}
    elseif s then
      if string.sub(s, 1, 5) == 'open:' then
        out[i] = {tonumber(string.sub(s, 6)), f.charged, limit, 0, 0}
      else
        out[i] = {0, f.charged, limit, 3, 0}
      end
    else
      local cap = lcap
      if n > 0 and (cap <= 0 or n < cap) then cap = n end
      local free = limit - f.charged
      local full = 1
      if cap > 0 then full = math.min(cap, limit) end
      local grant = 0
      if free >= full then
        grant = free
        if cap > 0 and cap < grant then grant = cap end
      elseif live_count() > 0 then
        local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
        f.waits = f.waits + 1
        changed.waits = true
        out[i] = {0, f.charged, limit, 4, math.floor(tonumber(first[2]) * 1000)}
      elseif free > 0 then
        grant = free
      end
      if grant > 0 then
        if f.grants == 0 then first_grant = true end
        f.charged = f.charged + grant
        f.grants = f.grants + 1
        changed.charged, changed.grants = true, true
        put(id, 'open:' .. grant)
        if dl > now then
          redis.call('ZADD', KEYS[3], dl, id)
          if live ~= nil then live = live + 1 end
          added = true
        end
        out[i] = {grant, f.charged, limit, 0, 0}
      elseif not out[i] then
        f.rejections = f.rejections + 1
        changed.rejections = true
        out[i] = {0, f.charged, limit, 1, 0}
      end
    end
  else
    local lim = limit or 0
    if not s then
      out[i] = {0, f.charged, lim, 2, 0}
    elseif string.sub(s, 1, 5) ~= 'open:' then
      out[i] = {0, f.charged, lim, 1, 0}
    else
      local release = tonumber(string.sub(s, 6)) - n
      f.charged = f.charged - release
      f.used = f.used + n
      changed.charged, changed.used = true, true
      if release > 0 then
        f.released = f.released + release
        changed.released = true
      elseif release < 0 then
        f.overrun = f.overrun - release
        changed.overrun = true
      end
      put(id, 'settled:' .. n)
      if live ~= nil then live = nil end
      redis.call('ZREM', KEYS[3], id)
      settled = true
      out[i] = {release, f.charged, lim, 0, 0}
    end
  end
end
local hset = {}
for _, name in ipairs(names) do
  if changed[name] then
    hset[#hset + 1] = name
    hset[#hset + 1] = f[name]
  end
end
if #hset > 0 then redis.call('HSET', KEYS[1], unpack(hset)) end
local rargs = {}
for _, id in ipairs(order) do
  rargs[#rargs + 1] = id
  rargs[#rargs + 1] = writes[id]
end
for i = 1, #rargs, 1000 do
  redis.call('HSET', KEYS[2], unpack(rargs, i, math.min(i + 999, #rargs)))
end
if first_grant then redis.call('EXPIRE', KEYS[2], ttl) end
if added then redis.call('EXPIRE', KEYS[3], ttl) end
if settled and f.waits > 0 then redis.call('PUBLISH', KEYS[4], f.charged) end
return out
"""


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
    """

    tokens: int
    charged: int
    limit: int
    code: int
    retry_at: float = 0.0

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
        self.on_park: Callable[[], None] | None = None
        """Called whenever the number of :attr:`parked` calls changes (the worker's slot count)."""

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
        for attempt in (1, 2):
            async with self._redis.pipeline(transaction=False) as pipe:
                for rollout_id, ops in groups:
                    pipe.evalsha(self._script.sha, 4, *self._keys(rollout_id), *self._args(ops))
                outcomes: list[Any] = await pipe.execute(raise_on_error=False)
            if attempt == 1 and any(isinstance(o, NoScriptError) for o in outcomes):
                await self._redis.script_load(LEDGER_LUA)
                continue
            return outcomes
        raise AssertionError("unreachable")  # pragma: no cover

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
        return Grant(out[0], out[1], out[2], out[3], out[4] / 1000.0)

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
        """
        grant = await self.reserve(rollout_id, reservation_id, cap, deadline)
        if grant.code != WAIT:
            return grant, 0, 0.0
        if self._waits is None:
            from rlmq.common.budget_wait import ReleaseWaits

            self._waits = ReleaseWaits(self._redis, self._park_changed)
        waits: Any = self._waits
        result: tuple[Grant, int, float] = await waits.wait_for_grant(
            self, rollout_id, reservation_id, cap, deadline, deadline - margin, grant
        )
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

    async def count_rejections(self, rollout_id: str, n: int) -> None:
        """Add ``n`` calls refused before they were enqueued (the producer's up-front refusal of a
        batch on a spent budget) to the ledger's ``rejections``, so it counts every refusal."""
        key = RolloutKeys(rollout_id).budget
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hincrby(key, "rejections", n)
            pipe.expire(key, self._ttl)
            await pipe.execute()

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
