"""Running Lua scripts by ``EVALSHA`` inside a pipeline, with one reload after ``NOSCRIPT``.

redis-py's ``Script`` objects, called on a pipeline, send ``SCRIPT EXISTS`` before every
execute (a round trip more on the hot path); rlmq sends ``EVALSHA`` itself and reloads only
when Redis answers ``NOSCRIPT`` (a restarted or flushed Redis), then runs the pipeline again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import NoScriptError


def sha1(script: str) -> str:
    """The SHA1 Redis names ``script`` by (what ``EVALSHA`` takes)."""
    return hashlib.sha1(script.encode()).hexdigest()


async def run_pipeline(
    redis: Redis, build: Callable[[Pipeline], None], scripts: Sequence[str], *, raise_on_error: bool = True
) -> list[Any]:
    """Build and execute one non-transactional pipeline; on ``NOSCRIPT`` load ``scripts`` and
    run the whole pipeline once more.

    Every command of the pipeline must be safe to run twice (the first run may have applied
    the commands before the one that failed): rlmq's scripts are (settled reservations,
    finished jobs and started executions stay so).

    Args:
        redis: asyncio client.
        build: adds the commands to the pipeline (called once per run).
        scripts: the Lua sources whose ``EVALSHA`` the pipeline may send.
        raise_on_error: raise the first error reply (default), or return it in its place.

    Returns:
        The outcome of each command, in order.

    Raises:
        redis.RedisError: the first error reply (other than a ``NOSCRIPT`` cured by the
            reload), or a connection error past the client's retries.
    """
    for attempt in (1, 2):
        async with redis.pipeline(transaction=False) as pipe:
            build(pipe)
            outcomes: list[Any] = await pipe.execute(raise_on_error=False)
        if attempt == 1 and any(isinstance(o, NoScriptError) for o in outcomes):
            for script in scripts:
                await redis.script_load(script)
            continue
        for o in outcomes:
            if raise_on_error and isinstance(o, Exception):
                raise o
        return outcomes
    raise AssertionError("unreachable")  # pragma: no cover
