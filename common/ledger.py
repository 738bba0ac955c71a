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

from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from common.keys import RolloutKeys

# KEYS[1] budget hash, KEYS[2] reservations hash.
# ARGV[1] reservation id, ARGV[2] per-call cap in tokens (<= 0: no cap), ARGV[3] TTL seconds.
# Returns {grant, charged, limit, code}. code: 0 granted (grant > 0), 1 rejected (grant 0,
# budget spent), 2 no ledger (budget hash missing: expired or Redis lost it), 3 already
# settled (a retried job asked again for a reservation that is closed; grant 0).
# An open reservation with the same id returns its grant again and charges nothing.
RESERVE_LUA = """
local limit = tonumber(redis.call('HGET', KEYS[1], 'limit'))
if not limit then return {0, 0, 0, 2} end
local charged = tonumber(redis.call('HGET', KEYS[1], 'charged') or '0')
local state = redis.call('HGET', KEYS[2], ARGV[1])
if state then
  if string.sub(state, 1, 5) == 'open:' then
    return {tonumber(string.sub(state, 6)), charged, limit, 0}
  end
  return {0, charged, limit, 3}
end
local cap = tonumber(ARGV[2])
local grant = limit - charged
if cap > 0 and cap < grant then grant = cap end
if grant <= 0 then
  redis.call('HINCRBY', KEYS[1], 'rejections', 1)
  return {0, charged, limit, 1}
end
charged = redis.call('HINCRBY', KEYS[1], 'charged', grant)
redis.call('HINCRBY', KEYS[1], 'grants', 1)
redis.call('HSET', KEYS[2], ARGV[1], 'open:' .. grant)
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[3]))
return {grant, charged, limit, 0}
"""

# KEYS[1] budget hash, KEYS[2] reservations hash.
# ARGV[1] reservation id, ARGV[2] completion tokens the server reported (>= 0).
# Returns {released, charged, limit, code}. code: 0 settled now, 1 already settled
# (nothing changes), 2 unknown reservation (nothing changes).
# released = grant - used, >= 0 with a server that honours max_tokens; a server that
# returned more than its grant is charged the excess (recorded in 'overrun').
SETTLE_LUA = """
local state = redis.call('HGET', KEYS[2], ARGV[1])
local limit = tonumber(redis.call('HGET', KEYS[1], 'limit') or '0')
if not state then
  return {0, tonumber(redis.call('HGET', KEYS[1], 'charged') or '0'), limit, 2}
end
if string.sub(state, 1, 5) ~= 'open:' then
  return {0, tonumber(redis.call('HGET', KEYS[1], 'charged') or '0'), limit, 1}
end
local grant = tonumber(string.sub(state, 6))
local used = tonumber(ARGV[2])
local release = grant - used
redis.call('HSET', KEYS[2], ARGV[1], 'settled:' .. used)
redis.call('HINCRBY', KEYS[1], 'used', used)
local charged = redis.call('HINCRBY', KEYS[1], 'charged', -release)
if release > 0 then
  redis.call('HINCRBY', KEYS[1], 'released', release)
elseif release < 0 then
  redis.call('HINCRBY', KEYS[1], 'overrun', -release)
end
return {release, charged, limit, 0}
"""


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

    One round trip per reservation and per settlement (``EVALSHA``).
    """

    def __init__(self, redis: Redis, ttl: int = 3600) -> None:
        self._redis = redis
        self._ttl = ttl
        self._reserve = redis.register_script(RESERVE_LUA)
        self._settle = redis.register_script(SETTLE_LUA)

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
        keys = RolloutKeys(rollout_id)
        res: list[Any] = await self._reserve(
            keys=[keys.budget, keys.reservations], args=[reservation_id, cap or 0, self._ttl]
        )
        return Grant(*(int(x) for x in res))

    async def settle(self, rollout_id: str, reservation_id: str, used: int) -> Settlement:
        """Settle a reservation with the ``used`` completion tokens the server reported."""
        keys = RolloutKeys(rollout_id)
        res: list[Any] = await self._settle(
            keys=[keys.budget, keys.reservations], args=[reservation_id, max(0, int(used))]
        )
        return Settlement(*(int(x) for x in res))

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
