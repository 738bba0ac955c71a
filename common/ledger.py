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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from rlmq.common.keys import RolloutKeys
from rlmq.common.scripts import run_pipeline

# KEYS[1] budget hash, KEYS[2] reservations hash (one rollout: both share its hash tag).
# ARGV[1] TTL seconds, then per operation i three arguments: ARGV[3i-1] kind ('r' reserve,
# 's' settle), ARGV[3i] reservation id, ARGV[3i+1] per-call cap in tokens for a reserve
# (<= 0: no cap) or the completion tokens the server reported for a settle (>= 0).
# The operations are applied in order, each exactly as if it ran alone; the script reads the
# ledger once (HMGET) and writes it once (HSET), so a batch of any size costs about 4
# commands. Returns one {a, charged, limit, code} per operation:
# * reserve: a = grant. code 0 granted (grant > 0), 1 rejected (grant 0, budget spent),
#   2 no ledger (budget hash missing: expired or Redis lost it), 3 already settled (a retried
#   job asked again for a reservation that is closed; grant 0). An open reservation with the
#   same id returns its grant again and charges nothing.
# * settle: a = released = grant - used (>= 0 with a server that honours max_tokens; a server
#   that returned more than its grant is charged the excess, recorded in 'overrun').
#   code 0 settled now, 1 already settled (nothing changes), 2 unknown reservation.
# The reservations hash gets its TTL with the rollout's first grant (the producer's key refresh
# keeps it alive with the ledger); later grants only HSET into it.
LEDGER_LUA = """
local ttl = tonumber(ARGV[1])
local nops = (#ARGV - 1) / 3
local b = redis.call('HMGET', KEYS[1], 'limit', 'charged', 'grants', 'used', 'released', 'overrun', 'rejections')
local limit = tonumber(b[1])
local f = {charged = tonumber(b[2] or '0'), grants = tonumber(b[3] or '0'), used = tonumber(b[4] or '0'),
           released = tonumber(b[5] or '0'), overrun = tonumber(b[6] or '0'), rejections = tonumber(b[7] or '0')}
local changed, names = {}, {'charged', 'grants', 'used', 'released', 'overrun', 'rejections'}
local state, writes, order = {}, {}, {}
local ids = {}
for i = 1, nops do ids[i] = ARGV[3 * i] end
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
local first_grant = false
local out = {}
for i = 1, nops do
  local kind, id, n = ARGV[3 * i - 1], ARGV[3 * i], tonumber(ARGV[3 * i + 1])
  local s = state[id]
  if kind == 'r' then
    if not limit then
      out[i] = {0, 0, 0, 2}
    elseif s then
      if string.sub(s, 1, 5) == 'open:' then
        out[i] = {tonumber(string.sub(s, 6)), f.charged, limit, 0}
      else
        out[i] = {0, f.charged, limit, 3}
      end
    else
      local grant = limit - f.charged
      if n > 0 and n < grant then grant = n end
      if grant <= 0 then
        f.rejections = f.rejections + 1
        changed.rejections = true
        out[i] = {0, f.charged, limit, 1}
      else
        if f.grants == 0 then first_grant = true end
        f.charged = f.charged + grant
        f.grants = f.grants + 1
        changed.charged, changed.grants = true, true
        put(id, 'open:' .. grant)
        out[i] = {grant, f.charged, limit, 0}
      end
    end
  else
    local lim = limit or 0
    if not s then
      out[i] = {0, f.charged, lim, 2}
    elseif string.sub(s, 1, 5) ~= 'open:' then
      out[i] = {0, f.charged, lim, 1}
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
      out[i] = {release, f.charged, lim, 0}
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
return out
"""


_Op = tuple[str, str, int, "asyncio.Future[list[int]]"]
"""One coalesced ledger operation: kind (``r`` / ``s``), reservation id, cap or used, its waiter."""


@dataclass(frozen=True)
class Grant:
    """Outcome of a reservation.

    Attributes:
        tokens: completion tokens granted (0 when rejected); the model call's ``max_tokens``.
        charged: tokens charged to the rollout after this reservation.
        limit: the rollout's budget in tokens.
        code: 0 granted, 1 rejected (budget spent), 2 ledger missing, 3 already settled.
    """

    tokens: int
    charged: int
    limit: int
    code: int

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
    """The ledger of a rollout at one moment (all figures in completion tokens)."""

    limit: int
    charged: int
    used: int
    grants: int
    rejections: int
    released: int
    overrun: int

    @property
    def remaining(self) -> int:
        return max(0, self.limit - self.charged)


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
    """

    def __init__(self, redis: Redis, ttl: int = 3600) -> None:
        self._redis = redis
        self._ttl = ttl
        self._script = redis.register_script(LEDGER_LUA)
        self._pending: dict[str, list[_Op]] = {}
        self._flush_scheduled = False
        self._flushes: set[asyncio.Task[None]] = set()

    def _submit(self, rollout_id: str, kind: str, reservation_id: str, n: int) -> asyncio.Future[list[int]]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[int]] = loop.create_future()
        self._pending.setdefault(rollout_id, []).append((kind, reservation_id, n, fut))
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
                pipe.evalsha(self._script.sha, 2, *self._keys(rollout_id), *self._args(ops))

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
            by_rollout.setdefault(rollout_id, []).extend(["s", reservation_id, max(0, int(used))])
        for rollout_id, ops in by_rollout.items():
            pipe.evalsha(self._script.sha, 2, *self._keys(rollout_id), self._ttl, *ops)

    @staticmethod
    def _keys(rollout_id: str) -> list[str]:
        keys = RolloutKeys(rollout_id)
        return [keys.budget, keys.reservations]

    def _args(self, ops: list[_Op]) -> list[Any]:
        args: list[Any] = [self._ttl]
        for kind, reservation_id, n, _ in ops:
            args += [kind, reservation_id, n]
        return args

    async def open(self, rollout_id: str, limit: int) -> None:
        """Create the rollout's ledger with a budget of ``limit`` tokens (keeps an existing one).

        Raises:
            ValueError: ``limit`` is negative.
        """
        if limit < 0:
            raise ValueError("budget limit must be >= 0 tokens")
        keys = RolloutKeys(rollout_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hsetnx(keys.budget, "limit", limit)
            pipe.hsetnx(keys.budget, "charged", 0)
            pipe.expire(keys.budget, self._ttl)
            await pipe.execute()

    async def reserve(self, rollout_id: str, reservation_id: str, cap: int | None) -> Grant:
        """Reserve ``min(cap, remaining)`` tokens under ``reservation_id``.

        Args:
            rollout_id: the rollout whose budget is charged.
            reservation_id: unique per model call *attempt*; reserving it again while open
                returns the same grant.
            cap: per-call cap in tokens, or ``None`` for none.
        """
        return Grant(*(await self._submit(rollout_id, "r", reservation_id, cap or 0)))

    async def settle(self, rollout_id: str, reservation_id: str, used: int) -> Settlement:
        """Settle a reservation with the ``used`` completion tokens the server reported."""
        return Settlement(*(await self._submit(rollout_id, "s", reservation_id, max(0, int(used)))))

    async def snapshot(self, rollout_id: str) -> BudgetSnapshot | None:
        """Read the ledger, or ``None`` when the rollout has none."""
        raw = await self._redis.hgetall(RolloutKeys(rollout_id).budget)
        if not raw:
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
        )
