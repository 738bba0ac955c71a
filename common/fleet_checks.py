"""What a fleet's Redis must be, checked at start: an eviction policy that keeps rlmq's keys,
and a clock to measure the host's against.

* :func:`check_eviction_policy`: ``maxmemory-policy`` must be ``noeviction`` whenever a
  ``maxmemory`` is set. rlmq's rollout keys all carry TTLs, so a ``volatile-*`` policy evicts
  exactly them (ledgers, reservations, reply streams), and an ``allkeys-*`` one anything, jobs
  included: both are refused unless the operator accepts it (``allow_evicting_redis``). A
  managed Redis that refuses ``CONFIG GET`` cannot be checked: a warning says so and the
  process goes on (the operator must set ``noeviction`` at the provider).
* :func:`redis_time` / :func:`clock_offset`: Redis's own clock (``TIME``) and how far this
  host's is from it. Leases, registry scores and the ledger's "now" are taken from Redis's
  clock inside the scripts; a host whose clock is off only logs a warning.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from redis.asyncio import Redis

from rlmq.common.errors import ConfigError

log = logging.getLogger("rlmq.fleet")

SAFE_POLICY = "noeviction"
CLOCK_WARN_SECONDS = 2.0
"""A host clock this many seconds off Redis's is reported (leases do not depend on it)."""


def eviction_verdict(policy: str | None, maxmemory: int | None, *, allow: bool) -> tuple[bool, str]:
    """``(ok, message)`` for a Redis with ``maxmemory-policy`` ``policy`` and ``maxmemory`` bytes
    (``None``: unknown, ``CONFIG GET`` was refused). Pure: the rule, apart from the round trip."""
    if policy is None:
        return True, (
            "cannot read Redis's maxmemory-policy (CONFIG GET refused: a managed Redis?); "
            "rlmq needs 'noeviction' (or no maxmemory): check it at your provider"
        )
    if policy == SAFE_POLICY or not maxmemory:
        return True, ""
    text = (
        f"Redis evicts keys when full (maxmemory-policy {policy}, maxmemory {maxmemory} bytes): it would "
        "silently drop budget ledgers, jobs and results (rlmq's rollout keys all have TTLs, so volatile-* "
        "evicts exactly them). Set 'CONFIG SET maxmemory-policy noeviction'"
    )
    if allow:
        return True, text + " (accepted: --allow-evicting-redis)"
    return False, text + ", or accept the risk with --allow-evicting-redis / RLMQ_ALLOW_EVICTING_REDIS=1"


async def check_eviction_policy(client: Redis, *, allow: bool = False) -> None:
    """Refuse a Redis that may evict rlmq's keys (see :func:`eviction_verdict`).

    Raises:
        ConfigError: an evicting policy with a ``maxmemory`` set, not accepted by ``allow``.
        redis.RedisError: Redis away.
    """
    try:
        got: dict[Any, Any] = dict(await client.config_get("maxmemory*"))
        text = {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in got.items()}
        raw_policy = text.get("maxmemory-policy", SAFE_POLICY)
        policy: str | None = raw_policy.decode() if isinstance(raw_policy, bytes) else str(raw_policy)
        maxmemory: int | None = int(text.get("maxmemory", 0) or 0)
    except (redis.exceptions.NoPermissionError, redis.exceptions.ResponseError) as exc:
        log.debug("CONFIG GET refused: %s", exc)
        policy, maxmemory = None, None
    ok, message = eviction_verdict(policy, maxmemory, allow=allow)
    if not ok:
        raise ConfigError(message)
    if message:
        log.warning("%s", message)


async def redis_time(client: Redis) -> float:
    """Redis's clock (``TIME``), Unix seconds.

    Raises:
        redis.RedisError: Redis away.
    """
    sec, usec = await client.time()
    return float(sec) + float(usec) / 1e6


async def clock_offset(client: Redis) -> float:
    """Seconds this host's clock is ahead of Redis's (negative: behind), within the round trip.

    Raises:
        redis.RedisError: Redis away.
    """
    before = time.time()
    server = await redis_time(client)
    after = time.time()
    return (before + after) / 2 - server


async def report_clock(client: Redis, who: str) -> float:
    """Measure :func:`clock_offset` and log a warning when it exceeds :data:`CLOCK_WARN_SECONDS`;
    returns the offset (seconds)."""
    offset = await clock_offset(client)
    if abs(offset) > CLOCK_WARN_SECONDS:
        log.warning(
            "%s: this host's clock is %+.1f s off Redis's; leases and registry scores use Redis's clock, "
            "but sub-call deadlines are compared with this one: fix its time sync (NTP)", who, offset,
        )  # fmt: skip
    return offset
