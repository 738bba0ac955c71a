"""Redis clients for rlmq, built the same way everywhere (no module-level clients).

Timeouts: ``socket_timeout`` must exceed every blocking command's own timeout (rlmq's
blocking waits are at most 2 s), so a slow network shows up as a reconnect, not as a
spurious error. Reconnects use redis-py's own retry with exponential backoff. ``rediss://``
URLs (TLS) and passwords in the URL work as redis-py parses them.
"""

from __future__ import annotations

import redis
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

SOCKET_TIMEOUT = 15.0
CONNECT_TIMEOUT = 5.0


def async_client(url: str, *, max_connections: int = 1024) -> Redis:
    """An asyncio client on ``url`` (bytes responses) with reconnect backoff.

    Its pool blocks (up to ``SOCKET_TIMEOUT`` seconds) when ``max_connections`` are in use
    instead of failing, so hundreds of concurrent sub-calls share it safely.
    """
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=SOCKET_TIMEOUT,
        decode_responses=False,
        socket_timeout=SOCKET_TIMEOUT,
        socket_connect_timeout=CONNECT_TIMEOUT,
        health_check_interval=30,
        retry=AsyncRetry(ExponentialBackoff(cap=2.0, base=0.05), 5),
        retry_on_error=[RedisConnectionError, RedisTimeoutError, ConnectionResetError],
    )
    return Redis.from_pool(pool)


def sync_client(url: str) -> redis.Redis:
    """A blocking client on ``url`` (bytes responses), for RQ's own classes."""
    return redis.Redis.from_url(
        url,
        socket_timeout=SOCKET_TIMEOUT,
        socket_connect_timeout=CONNECT_TIMEOUT,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), 5),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )
