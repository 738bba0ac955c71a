"""The HTTP transport of the worker's model client, a seam as httpx's transports are.

:class:`~rlmq.workers.model.ChatClient` hands each attempt's bytes to a :class:`Transport`
and gets an :class:`HttpReply` back; statuses, retries, deadlines and parsing stay in the
client. Production uses :class:`AiohttpTransport` (one pooled aiohttp session); a test
passes an in-memory transport and needs no HTTP server (``tests/unit/test_model_transport.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from rlmq.common.errors import ModelError

__all__ = ["AiohttpTransport", "HttpReply", "Transport"]


@dataclass(frozen=True, slots=True)
class HttpReply:
    """What a :class:`Transport` got back: HTTP status, headers and the whole body (bytes)."""

    status: int
    headers: Mapping[str, str]
    body: bytes


class Transport(Protocol):
    """Sends one HTTP POST and returns the reply: the seam between :class:`ChatClient` and the network.

    ``post`` raises :class:`TimeoutError` when no whole reply came within ``timeout``
    seconds, :class:`ConnectionError` when the connection failed or broke (both are
    retried), and :class:`~rlmq.common.errors.ModelError` when the request cannot be sent
    at all (not retried). Any HTTP status is a reply, not an exception.
    """

    async def post(self, url: str, data: bytes, *, headers: Mapping[str, str], timeout: float) -> HttpReply: ...

    async def close(self) -> None: ...


class AiohttpTransport:
    """The production :class:`Transport`: one aiohttp session with a pooled connector.

    The session is created lazily inside the running event loop on the first request.

    Args:
        max_connections: size of the connection pool (``aiohttp.TCPConnector(limit=...)``).
    """

    def __init__(self, max_connections: int = 1024) -> None:
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        session = self._session
        if session is None or session.closed:
            connector = aiohttp.TCPConnector(limit=self.max_connections, ttl_dns_cache=300)
            session = self._session = aiohttp.ClientSession(connector=connector)
        return session

    async def post(self, url: str, data: bytes, *, headers: Mapping[str, str], timeout: float) -> HttpReply:
        """POST ``data`` to ``url``; see :class:`Transport` for what it raises."""
        session = self._get_session()
        try:
            async with session.post(
                url, data=data, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                return HttpReply(resp.status, resp.headers, await resp.read())
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise ConnectionError(f"{type(exc).__name__}: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise ModelError(f"request to the model server at {url} failed ({type(exc).__name__}: {exc})") from exc

    async def close(self) -> None:
        """Close the HTTP session (idempotent)."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None
