"""A worker's side of hosted tools: a sub-LLM's call of a tool that lives in its rollout's process.

The worker sends the call to the rollout through Redis and waits for its answer (the wire
format and the id of a logical call: :mod:`rlmq.common.tool_wire`). A dropped connection is
retried until the wait's deadline: the request is sent again (the rollout answers each id once)
and the answer stream is read again from its start (nothing is consumed by reading it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rlmq.common.aio import raise_if_cancelling
from rlmq.common.keys import RolloutKeys
from rlmq.common.tool_turns import LINGER, FairTurns
from rlmq.common.tool_wire import CALLS_PER_ROLLOUT, FIELD, TOOL_ERROR, ToolCallAnswer, ToolCallRequest

__all__ = ["ANSWER_GRACE", "REQUESTS_TTL_MARGIN", "RolloutSlots", "call_hosted"]

ANSWER_GRACE = 10.0
"""Seconds a worker waits for an answer past the tool's own timeout (the rollout's turn-around)."""
REQUESTS_TTL_MARGIN = 60
"""Seconds a rollout's request stream outlives the wait of its latest request (a rollout whose
process is gone leaves nothing behind for longer)."""
_RETRY_PAUSE = 0.2
_READ_BLOCK = 2.0
"""Seconds of one blocking read: short, so a connection gone quiet is noticed and retried."""


class RolloutSlots:
    """A worker's hosted-tool calls in flight, at most ``per_rollout`` per rollout at once, fair
    between rollouts (:class:`~rlmq.common.tool_turns.FairTurns`): one rollout's flood waits for its
    own slots, never queues other rollouts' calls, and while another rollout calls tools it keeps no
    more young calls in flight than that one has calls.

    Args:
        per_rollout: calls of one rollout in flight at once (:data:`CALLS_PER_ROLLOUT`).
        linger: seconds a rollout still counts as calling tools after its last call ended.
    """

    def __init__(self, per_rollout: int = CALLS_PER_ROLLOUT, *, linger: float = LINGER) -> None:
        self.per_rollout = per_rollout
        self.turns = FairTurns(per_rollout, linger=linger)

    def in_flight(self, rollout_id: str) -> int:
        """Calls of ``rollout_id`` in flight now."""
        return self.turns.held(rollout_id)

    async def run(self, rollout_id: str, deadline: float, call: Callable[[], Awaitable[str]]) -> str | None:
        """``call()`` in one of ``rollout_id``'s slots; ``None`` when none freed up before ``deadline``
        (Unix seconds)."""
        turn = await self.turns.acquire(rollout_id, deadline - time.time())
        if turn is None:
            return None
        try:
            return await call()
        finally:
            self.turns.release(rollout_id, turn)


async def call_hosted(
    redis: Redis,
    rollout_id: str,
    request: ToolCallRequest,
    *,
    name: str,
    deadline: float,
    slots: RolloutSlots | None = None,
) -> str:
    """Send ``request`` to rollout ``rollout_id`` and return its answer text; never raises
    (except cancellation).

    Args:
        redis: the worker's asyncio client.
        name: the tool's model-facing name (for error lines).
        deadline: Unix time (``time.time()``) past which the answer is no longer waited for.
        slots: the worker's per-rollout cap on calls in flight (``None``: no cap).

    Returns:
        The tool's result text, or one ``[tool error] ...`` line: the tool's own error (from the
        rollout), or no answer before ``deadline`` (the rollout's process is gone or stuck).
    """
    if slots is not None:
        text = await slots.run(rollout_id, deadline, lambda: _call(redis, rollout_id, request, name, deadline))
        if text is None:
            return f"{TOOL_ERROR} {name}: no free slot for this rollout's tool calls within {request.wait:g} s"
        return text
    return await _call(redis, rollout_id, request, name, deadline)


async def _call(redis: Redis, rollout_id: str, request: ToolCallRequest, name: str, deadline: float) -> str:
    keys = RolloutKeys(rollout_id)
    answer_key = keys.tool_answer(request.id)
    body = request.model_dump_json()
    sent = False
    last_error = ""
    while time.time() < deadline:
        raise_if_cancelling()  # a cancelled job never reads on until the deadline
        try:
            if not sent:
                async with redis.pipeline(transaction=True) as pipe:
                    pipe.xadd(keys.tool_requests, {FIELD: body})
                    pipe.expire(keys.tool_requests, int(request.wait) + REQUESTS_TTL_MARGIN)
                    await pipe.execute()
                sent = True
            block = max(1, int(min(_READ_BLOCK, deadline - time.time()) * 1000))
            got: list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]] = await redis.xread(
                {answer_key: "0-0"}, count=1, block=block
            )  # type: ignore[assignment]
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            last_error = f"{type(exc).__name__}: {exc}"  # a failed send is sent again (answered once)
            await asyncio.sleep(_RETRY_PAUSE)
            continue
        except RedisError as exc:
            return f"{TOOL_ERROR} {name}: Redis refused the call: {type(exc).__name__}: {exc}"
        for _key, entries in got or []:
            for _entry_id, fields in entries:
                text = _answer_text(fields, request.id, name)
                if text is not None:
                    return text
    why = f" (last Redis error: {last_error})" if last_error else ""
    return (
        f"{TOOL_ERROR} {name}: no answer from the rollout's process within {request.wait:g} s "
        f"(it is gone or stuck){why}"
    )


def _answer_text(fields: dict[bytes, bytes], request_id: str, name: str) -> str | None:
    raw = fields.get(FIELD.encode())
    if raw is None:
        return None
    try:
        answer = ToolCallAnswer.model_validate_json(raw)
    except ValidationError:
        return f"{TOOL_ERROR} {name}: the rollout's answer is not a tool answer"
    if answer.id != request_id:
        return None
    return answer.text
