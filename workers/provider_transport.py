"""The model-call path's one meeting point with the fleet-wide provider limits.

:class:`LimitedTransport` wraps the worker's :class:`~rlmq.workers.transport.Transport`: every HTTP
attempt takes a grant from the upstream's :class:`~rlmq.common.provider_limits.ProviderLimiter`
first (waiting while the fleet is at a limit), and ends it when the reply comes: the request
no longer runs, and it counts the tokens the server reported. A 429 pauses the upstream for the
whole fleet for its ``Retry-After`` and the attempt is sent again once the pause ends, within
the attempt's timeout, so a worker does not burn its retries on a quota. Statuses, retries and
parsing stay in :class:`~rlmq.workers.model.ChatClient`.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Mapping
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from rlmq.common.metrics import Metrics
from rlmq.common.provider_limits import ProviderLimiter, ProviderLimits
from rlmq.common.sampling import DEFAULT_CALL_MAX_TOKENS
from rlmq.workers.model import _parse_retry_after
from rlmq.workers.transport import AiohttpTransport, HttpReply, Transport

log = logging.getLogger("rlmq.provider_limits")

__all__ = ["LimitedTransport", "model_transport"]

DEFAULT_PAUSE = 1.0
"""Seconds the upstream pauses after a 429 without a (readable) ``Retry-After``."""

MAX_PAUSE = 60.0
"""Longest pause (seconds) a 429's ``Retry-After`` sets."""

LEASE_SLACK = 30.0
"""Seconds a request's in-flight lease outlives its attempt's timeout (a dead worker's lapses then)."""

_CAP = re.compile(rb'[{,] ?"max(?:_completion)?_tokens": ?(\d+)')
_USER = re.compile(rb'[{,] ?"user": ?"((?:[^"\\]|\\.){0,200})"')


def request_tokens(data: bytes) -> int:
    """What a request counts before it starts: its body's length / 4 (an estimate of its prompt)
    plus its cap (the smallest ``max_tokens`` / ``max_completion_tokens`` of the body, else
    :data:`~rlmq.common.sampling.DEFAULT_CALL_MAX_TOKENS`), in tokens."""
    caps = [int(m) for m in _CAP.findall(data)]
    return math.ceil(len(data) / 4) + (min(caps) if caps else DEFAULT_CALL_MAX_TOKENS)


def spent_tokens(reply: HttpReply) -> int | None:
    """The tokens a reply says it spent (``usage``: prompt + completion); 0 for an error status;
    ``None`` when a 2xx body reports no usage (the request keeps what it counts)."""
    if not 200 <= reply.status < 300:
        return 0
    try:
        usage = json.loads(reply.body).get("usage")
        total = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
    except (ValueError, TypeError, AttributeError):
        return None
    return total if total >= 0 else None


class LimitedTransport:
    """A :class:`~rlmq.workers.transport.Transport` whose requests take fleet-wide grants first.

    Args:
        inner: the transport that sends.
        limiter: the upstream's limiter.
        metrics: where waits, 429s and pauses are counted (``rlmq_provider_*``).
    """

    def __init__(self, inner: Transport, limiter: ProviderLimiter, metrics: Metrics | None = None) -> None:
        self.inner = inner
        self.limiter = limiter
        self.metrics = metrics
        self.upstream = limiter.limits.upstream
        self.answered_429 = 0
        """Replies with status 429 this transport got (the provider refused a request)."""

    async def post(self, url: str, data: bytes, *, headers: Mapping[str, str], timeout: float) -> HttpReply:
        """Send ``data`` once a grant allows it; see :class:`~rlmq.workers.transport.Transport`.

        Raises:
            TimeoutError: no grant, or no reply, within ``timeout`` seconds.
            ConnectionError: as the inner transport.
            ModelError: as the inner transport.
        """
        end = time.monotonic() + timeout
        tokens = request_tokens(data) if self.limiter.limits.tpm else 0
        user = _USER.search(data)
        key = user.group(1).decode(errors="replace") if user else ""
        while True:
            permit = await self.limiter.acquire(tokens, lease=timeout + LEASE_SLACK, key=key, timeout=timeout)
            self._observe_wait(permit.waited if permit.refused else None)
            left = end - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError(f"waited {timeout:.3g} s for the provider limits of {self.upstream!r}")
                reply = await self.inner.post(url, data, headers=headers, timeout=left)
            except BaseException:
                self.limiter.finish_later(permit, None)  # it may have run: it keeps what it counts
                raise
            self.limiter.finish_later(permit, spent_tokens(reply))
            if reply.status != 429:
                return reply
            self.answered_429 += 1
            pause = _parse_retry_after(reply.headers.get("Retry-After"))
            pause = min(MAX_PAUSE, DEFAULT_PAUSE if pause is None else pause)
            await self._pause(pause)
            if end - time.monotonic() <= pause:  # no time left to wait: the client's retry layer decides
                return reply

    async def _pause(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.provider_429.labels(upstream=self.upstream).inc()
        try:
            await self.limiter.pause(seconds)
        except RedisError as exc:  # this worker still waits: the next grant comes after the pause at most
            log.warning("could not pause upstream %s for %.3g s after a 429 (%s)", self.upstream, seconds, exc)

    def _observe_wait(self, seconds: float | None) -> None:
        if seconds is not None and self.metrics is not None:
            self.metrics.provider_waits.labels(upstream=self.upstream).inc()
            self.metrics.provider_wait_seconds.labels(upstream=self.upstream).inc(seconds)

    async def close(self) -> None:
        """Finish the background work of the limiter, then close the inner transport."""
        await self.limiter.close()
        await self.inner.close()


def model_transport(
    settings: Any, queue: str, redis: Redis, *, name: str, max_connections: int, metrics: Metrics | None = None
) -> Transport:
    """The transport of a worker's model client: a :class:`LimitedTransport` over an
    :class:`~rlmq.workers.transport.AiohttpTransport` when ``settings`` declare provider limits
    (``provider_*``), the plain one otherwise (no Redis round trip per call)."""
    inner = AiohttpTransport(max_connections)
    limits = ProviderLimits.from_settings(settings, queue)
    if limits is None:
        return inner
    log.info("provider limits of upstream %s: %s", limits.upstream, limits.as_json())
    return LimitedTransport(inner, ProviderLimiter(redis, limits, name=name), metrics)
