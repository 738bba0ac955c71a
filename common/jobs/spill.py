"""Large token payloads travel beside the reply stream, in a key of their own.

A sub-call's ``turn_tokens`` (an 8,000-token prompt is ~43 KB of base64 ids) with its
conversation (``messages``), and a child rollout's trajectory (its own turns' tokens, nested)
would make every reply-stream entry large.
Past :data:`SPILL_BYTES`, the worker moves them to :meth:`RolloutKeys.spill
<rlmq.common.keys.RolloutKeys.spill>` of the job attempt, with a TTL, and sends the result with
``spilled=True``; the producer reads and deletes the key once the result is its slot's
(:func:`unspill`), so Redis holds a spilled payload only while its batch runs (or, if the
producer is gone, until its TTL). The key is derived from the result's own rollout, job and
attempt, never taken from the payload, so a result cannot point a producer at another key.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from rlmq.common import keys as K
from rlmq.common.schemas import SubLLMResult
from rlmq.common.token_wire import TurnTokens

__all__ = ["SPILL_BYTES", "SPILL_TTL_SLACK", "spill_key_of", "spill_result", "unspill"]

log = logging.getLogger(__name__)

SPILL_BYTES = 16 * 1024
"""Bytes of JSON of a result's token payload above which the worker spills it."""
SPILL_TTL_SLACK = 600
"""Seconds a spilled payload outlives its call's deadline (the producer deletes it sooner)."""


class _Spilled(BaseModel):
    model_config = ConfigDict(extra="forbid")

    turn_tokens: list[TurnTokens] | None = None
    trajectory: list[dict[str, Any]] | None = None
    messages: list[dict[str, Any]] | None = None


def _heavy(result: SubLLMResult) -> _Spilled | None:
    trajectory = result.child.trajectory if result.child is not None else None
    if not result.turn_tokens and not trajectory:
        return None
    return _Spilled(turn_tokens=result.turn_tokens, trajectory=trajectory or None, messages=result.messages)


async def spill_result(
    redis: Redis, result: SubLLMResult, deadline: float, *, threshold: int = SPILL_BYTES
) -> SubLLMResult:
    """Move ``result``'s token payload (with its ``messages``) to its spill key when its JSON is
    over ``threshold`` bytes.

    Args:
        redis: the worker's client.
        result: the result about to go on the reply stream (changed in place and returned).
        deadline: the call's deadline (Unix seconds); the key lives ``SPILL_TTL_SLACK`` past it.
        threshold: bytes of payload JSON kept inline.

    A Redis error leaves the payload inline (a larger entry, never a lost turn).
    """
    heavy = _heavy(result)
    if heavy is None or result.spilled:
        return result
    text = heavy.model_dump_json(exclude_none=True)
    if len(text) <= threshold:
        return result
    ttl = max(60, int(deadline - time.time()) + SPILL_TTL_SLACK)
    try:
        await redis.set(K.RolloutKeys(result.rollout_id).spill(result.job_id, result.attempt), text, ex=ttl)
    except (RedisError, OSError) as exc:
        log.warning("could not spill the token payload of %s (%s): it stays in the result", result.job_id, exc)
        return result
    result.spilled = True
    result.turn_tokens = None
    result.messages = None
    if result.child is not None:
        result.child.trajectory = []
    return result


def spill_key_of(result: SubLLMResult) -> str | None:
    """The key ``result``'s payload was spilled to, ``None`` when it was not spilled: a worker
    whose ``FINISH`` did not record the result (its job was taken back and re-run while the
    worker was stopped) deletes it, as nobody will read it."""
    return K.RolloutKeys(result.rollout_id).spill(result.job_id, result.attempt) if result.spilled else None


async def unspill(redis: Redis, results: list[SubLLMResult]) -> None:
    """Put back the spilled payloads of ``results`` (in place), reading and deleting their keys.

    A key that is gone (its TTL passed) or does not hold a payload leaves its result's turns
    untrainable (``spill_lost``): one record per model turn, no tokens.

    Raises:
        RedisError: Redis failed (the caller treats it as any Redis failure of the batch).
    """
    spilled = [r for r in results if r.spilled]
    if not spilled:
        return
    async with redis.pipeline(transaction=False) as pipe:
        for r in spilled:
            pipe.getdel(K.RolloutKeys(r.rollout_id).spill(r.job_id, r.attempt))
        raws = await pipe.execute()
    for r, raw in zip(spilled, raws, strict=True):
        r.spilled = False
        try:
            heavy = _Spilled.model_validate(json.loads(raw)) if raw is not None else None
        except (ValueError, ValidationError):
            heavy = None
        if heavy is None:
            r.turn_tokens = [TurnTokens(turn=t, untrainable="spill_lost") for t in range(1, r.turns + 1)] or None
            continue
        r.turn_tokens = heavy.turn_tokens
        r.messages = heavy.messages
        if r.child is not None and heavy.trajectory is not None:
            r.child.trajectory = heavy.trajectory
