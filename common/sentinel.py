"""Redis behind Sentinel: a Sentinel URL wherever a Redis URL goes (redis-py's Sentinel support).

``redis+sentinel://[[user]:password@]host:port[,host:port...]/<service>[/<db>]`` names the
Sentinels (one or more) and the monitored master's service name; ``rediss+sentinel://`` uses TLS
to the master. The password and user are the master's (and its replicas'); the Sentinels are
asked without credentials. A client on such a URL asks the Sentinels for the master's address
when it connects and after any connection error, and a connection to a master that was demoted
(it answers ``READONLY``) is dropped and made again to the promoted one: with the clients' retry
(:mod:`rlmq.common.connection`), a failover is a reconnect, not an error.

What a failover costs is in ``docs/fleet.md`` ("Redis with a replica and Sentinel").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.sentinel
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool

from rlmq.common.errors import ConfigError

SCHEMES = ("redis+sentinel", "rediss+sentinel")


@dataclass(frozen=True)
class SentinelUrl:
    """A parsed Sentinel URL (see the module docstring)."""

    sentinels: list[tuple[str, int]]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ssl: bool = False

    def master_kwargs(self) -> dict[str, Any]:
        """The connection arguments of the master's connections (db, credentials, TLS)."""
        out: dict[str, Any] = {"db": self.db, "username": self.username, "password": self.password}
        if self.ssl:
            out["ssl"] = True
        return out


def parse(url: str) -> SentinelUrl | None:
    """The Sentinel URL ``url`` parsed, or ``None`` when it is not one (a plain Redis URL).

    Raises:
        ConfigError: a Sentinel URL without a host or a service name, or with a bad port or db.
    """
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        return None
    hosts = parts.netloc.rpartition("@")[2]
    sentinels: list[tuple[str, int]] = []
    try:
        for item in filter(None, hosts.split(",")):
            host, _, port = item.rpartition(":") if ":" in item else (item, "", "26379")
            sentinels.append((host.strip("[]"), int(port)))
        path = [p for p in parts.path.split("/") if p]
        db = int(path[1]) if len(path) > 1 else 0
    except ValueError as exc:
        raise ConfigError(f"not a Sentinel URL: {parts.scheme}://...{parts.path} ({exc})") from exc
    if not sentinels or not path:
        raise ConfigError(
            f"a Sentinel URL names its Sentinels and the master's service: "
            f"{parts.scheme}://[:password@]host:port[,host:port]/<service>[/<db>]"
        )
    return SentinelUrl(
        sentinels, path[0], db, unquote(parts.username) if parts.username else None,
        unquote(parts.password) if parts.password is not None else None, parts.scheme.startswith("rediss"),
    )  # fmt: skip


def _timeouts(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The socket timeouts of ``kwargs``, for the connections to the Sentinels themselves."""
    return {k: kwargs[k] for k in ("socket_timeout", "socket_connect_timeout") if k in kwargs}


class _BlockingSentinelPool(AsyncSentinelPool, BlockingConnectionPool):
    """A Sentinel-managed pool that blocks (up to its ``timeout``) when all its connections are in
    use, as rlmq's plain pools do, instead of failing."""


def async_client(s: SentinelUrl, *, max_connections: int, **kwargs: Any) -> Redis:
    """An asyncio client of the master ``s`` names; ``kwargs``: the connection arguments
    (timeouts, retry) of :func:`rlmq.common.connection.async_client`."""
    sentinel = AsyncSentinel(s.sentinels, sentinel_kwargs=_timeouts(kwargs))
    pool = _BlockingSentinelPool(  # type: ignore[no-untyped-call]
        s.service, sentinel, max_connections=max_connections, **s.master_kwargs(), **kwargs
    )
    return Redis.from_pool(pool)


def sync_client(s: SentinelUrl, **kwargs: Any) -> redis.Redis:
    """A blocking client of the master ``s`` names; ``kwargs``: connection arguments (timeouts, retry)."""
    sentinel = redis.sentinel.Sentinel(s.sentinels, sentinel_kwargs=_timeouts(kwargs))
    client: redis.Redis = sentinel.master_for(s.service, **s.master_kwargs(), **kwargs)
    return client
