"""Redis clients for rlmq, built the same way everywhere (no module-level clients).

Timeouts: ``socket_timeout`` must exceed every blocking command's own timeout (rlmq's
blocking waits are at most 2 s), so a slow network shows up as a reconnect, not as a
spurious error. Reconnects use redis-py's own retry with exponential backoff. ``rediss://``
URLs (TLS) and passwords in the URL work as redis-py parses them; a Sentinel URL
(``redis+sentinel://host:port[,host:port]/<service>[/<db>]``, :mod:`rlmq.common.sentinel`) works
wherever a Redis URL goes.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable

import redis
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from rlmq.common import sentinel
from rlmq.common.budget import replica_acks as replica_acks_mod
from rlmq.common.budget.replica_acks import ReplicaAcks
from rlmq.common.errors import ConfigError, RedisUnavailableError

SOCKET_TIMEOUT = 15.0
CONNECT_TIMEOUT = 5.0
CHECK_TIMEOUT = 3.0
"""Seconds :func:`check_redis` gives one ``PING`` (connect included)."""

_URL_PASSWORD = re.compile(r"(://[^:/@\s]*:)[^/\s]*@")


def mask_url(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``
    (``redis://:s3cret@h:6379/0`` -> ``redis://:***@h:6379/0``); other text is unchanged.
    The one URL masker of rlmq: messages, ``meta.json``, ``rlmq status`` and argv all use it."""
    return _URL_PASSWORD.sub(r"\1***@", text)


def check_redis(url: str, *, timeout: float = CHECK_TIMEOUT) -> None:
    """``PING`` the Redis at ``url`` once, with no retry.

    Raises:
        RedisUnavailableError: it did not answer within ``timeout`` seconds, refused the
            connection, or refused the password (``auth=True``); the message names the URL
            (password masked) and what went wrong.
        ConfigError: ``url`` is not a Redis URL.
    """
    where = mask_url(url)
    try:
        sentinels = sentinel.parse(url)
        if sentinels is not None:
            client = sentinel.sync_client(sentinels, socket_connect_timeout=timeout, socket_timeout=timeout)
        else:
            client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    except ValueError as exc:
        raise ConfigError(f"not a Redis URL: {where} ({exc})") from exc
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        if client.connection_pool.connection_kwargs.get("password") is None:
            raise RedisUnavailableError(
                f"Redis at {where} refused the connection: it needs a password, give it in the URL"
                " (redis://:PASSWORD@host:port/db)",
                auth=True,
            ) from exc
        raise RedisUnavailableError(f"Redis at {where} refused the credentials: {exc}", auth=True) from exc
    except redis.ResponseError as exc:  # NOAUTH on servers redis-py does not map, and the like
        auth = "auth" in str(exc).lower()
        raise RedisUnavailableError(f"Redis at {where} refused the connection: {exc}", auth=auth) from exc
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:  # MasterNotFoundError included
        raise RedisUnavailableError(f"cannot reach Redis at {where}: {exc}") from exc
    finally:
        client.close()


FIRST_CONNECT_WAIT = 15.0
"""Seconds a command's first connection to Redis retries a connection the network dropped or that
timed out (:func:`reach_redis`), as the clients retry a later drop, before the command gives up."""


def _refused(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) is a refused TCP connection (nothing listens there) or a
    host name that does not resolve: nothing a wait would change."""
    while exc is not None:
        if isinstance(exc, (ConnectionRefusedError, socket.gaierror)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def reach_redis(url: str, *, say: Callable[[str], None], max_wait: float = FIRST_CONNECT_WAIT) -> None:
    """A command's first ``PING`` of the Redis at ``url``: a connection dropped or timed out is
    retried with backoff for up to ``max_wait`` seconds (saying so), as a later drop is; a refused
    connection (nothing listens) and refused credentials fail at once.

    Raises:
        RedisUnavailableError: refused, or not reached within ``max_wait`` seconds.
        ConfigError: ``url`` is not a Redis URL.
    """
    wait_for_redis(url, say=say, max_wait=max_wait, max_backoff=2.0, retry_refused=False)


def wait_for_redis(
    url: str,
    *,
    say: Callable[[str], None],
    max_wait: float | None = None,
    max_backoff: float = 10.0,
    retry_refused: bool = True,
) -> None:
    """Block until the Redis at ``url`` answers, retrying with exponential backoff (tenacity:
    0.5 s doubling up to ``max_backoff`` seconds, with jitter), and ``say`` each retry.

    Args:
        max_wait: give up after this many seconds (``None``: wait as long as it takes).
        retry_refused: also retry a refused connection (a Redis not started yet).

    Raises:
        RedisUnavailableError: the credentials were refused (waiting would not help), or
            ``max_wait`` passed.
    """
    from tenacity import Retrying, retry_if_exception, stop_after_delay, stop_never, wait_exponential, wait_random

    def retryable(exc: BaseException) -> bool:
        return isinstance(exc, RedisUnavailableError) and not exc.auth and (retry_refused or not _refused(exc))

    def before_sleep(state: object) -> None:
        outcome = getattr(state, "outcome", None)
        wait = getattr(getattr(state, "next_action", None), "sleep", 0.0)
        exc = outcome.exception() if outcome is not None else None
        say(f"{str(exc).rstrip('.')}; retrying in {wait:.1f} s (waiting for Redis)")

    for attempt in Retrying(
        retry=retry_if_exception(retryable),
        wait=wait_exponential(multiplier=0.5, max=max_backoff) + wait_random(0, 0.25),
        stop=stop_never if max_wait is None else stop_after_delay(max_wait),
        before_sleep=before_sleep,
        reraise=True,
    ):
        with attempt:
            check_redis(url)


def async_client(
    url: str,
    *,
    max_connections: int = 1024,
    replica_acks: int | None = None,
    replica_ack_timeout: float = ReplicaAcks.timeout,
) -> Redis:
    """An asyncio client on ``url`` (bytes responses) with reconnect backoff.

    Its pool blocks (up to ``SOCKET_TIMEOUT`` seconds) when ``max_connections`` are in use
    instead of failing, so hundreds of concurrent sub-calls share it safely.

    Args:
        replica_acks / replica_ack_timeout: the settings ``redis_replica_acks`` (replicas; ``None``:
            1 with a Sentinel URL, else 0) and ``redis_replica_ack_timeout`` (seconds): the budget
            ledgers made on this client wait for that many replicas' acknowledgement of every grant
            (:mod:`rlmq.common.budget.replica_acks`).
    """
    client = _async_client(url, max_connections)
    replica_acks_mod.attach(client, replica_acks_mod.resolve(url, replica_acks, replica_ack_timeout))
    return client


def _async_client(url: str, max_connections: int) -> Redis:
    kwargs = {
        "timeout": SOCKET_TIMEOUT,
        "decode_responses": False,
        "socket_timeout": SOCKET_TIMEOUT,
        "socket_connect_timeout": CONNECT_TIMEOUT,
        "health_check_interval": 30,
        "retry": AsyncRetry(ExponentialBackoff(cap=2.0, base=0.05), 5),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError, ConnectionResetError],
    }
    sentinels = sentinel.parse(url)
    if sentinels is not None:
        return sentinel.async_client(sentinels, max_connections=max_connections, **kwargs)
    pool = BlockingConnectionPool.from_url(url, max_connections=max_connections, **kwargs)
    return Redis.from_pool(pool)


def sync_client(url: str) -> redis.Redis:
    """A blocking client on ``url`` (bytes responses), for RQ's own classes."""
    kwargs = {
        "socket_timeout": SOCKET_TIMEOUT,
        "socket_connect_timeout": CONNECT_TIMEOUT,
        "retry": Retry(ExponentialBackoff(cap=2.0, base=0.05), 5),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
    }
    sentinels = sentinel.parse(url)
    if sentinels is not None:
        return sentinel.sync_client(sentinels, **kwargs)
    return redis.Redis.from_url(url, **kwargs)
