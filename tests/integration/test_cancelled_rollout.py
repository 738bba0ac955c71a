"""A rollout that a cancellation cut short never becomes a row, on a real Redis.

``RLMEnv.rollout`` is cancelled at every suspension point of a whole rollout (REPL start, root
call, cell, the end), on uvloop as the ``rlmq`` commands run it: each attempt either finishes
with its answer or raises ``CancelledError``; none returns an ``error`` row. And a cancellation
that a library replaced with its own error (as redis-py's client and uvloop's pipes did) still
ends the rollout as cancelled, and ``evaluate`` reports no row for it.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
import uvloop

from rlmq.common.errors import ModelError
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv, RolloutResult
from tests.suspension import where

pytestmark = pytest.mark.integration

MAX_POINTS = 400
"""More suspension points than one rollout has."""

CODE = 'answer["content"] = "42"\nanswer["ready"] = True\n'


def reply(code: str) -> Any:
    """A chat completion that calls ``call_python_repl(code)``, shaped as the openai client's."""
    call = SimpleNamespace(
        id="c1", function=SimpleNamespace(name="call_python_repl", arguments=json.dumps({"code": code}))
    )
    message = SimpleNamespace(content="", tool_calls=[call])
    return SimpleNamespace(
        choices=[SimpleNamespace(message=message)], usage=SimpleNamespace(prompt_tokens=3, completion_tokens=5)
    )


class OneCellRoot:
    """A root model that answers in one cell, after a loop iteration (a network round trip)."""

    async def chat(self, **kwargs: Any) -> Any:
        await asyncio.sleep(0)
        return reply(CODE)

    async def close(self) -> None:
        return None


class SwallowingRoot:
    """A root model whose client, cancelled mid-call, raises its own error instead."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()

    async def chat(self, **kwargs: Any) -> Any:
        self.entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise ModelError("root model call failed: connection reset") from None
        raise AssertionError("unreachable")

    async def close(self) -> None:
        return None


async def rollout_cancelled_at(env: RLMEnv, point: int) -> tuple[bool, str]:
    """One rollout, cancelled at its ``point``-th suspension point.

    Returns whether the cancel came before the rollout had ended, and what came out of it.
    """
    row = DatasetRow(id=f"p{point}", question="What is the answer?", context="ctx", answer="42")
    task = asyncio.create_task(env.rollout(row, model="m"))
    places = 0
    last: tuple[tuple[str, int], ...] = ()
    while not task.done() and places < point:
        await asyncio.sleep(0)  # one loop iteration
        here = where(task) if not task.done() else ()
        if here and here != last:
            places += 1
            last = here
    cut_short = not task.done()
    task.cancel()
    try:
        result = await task
    except asyncio.CancelledError:
        return cut_short, "cancelled"
    return cut_short, f"{result.row.stop_reason}: {result.row.error}"


def test_a_rollout_cancelled_at_any_point_finishes_or_is_cancelled_never_an_error_row(redis_url: str) -> None:
    async def sweep() -> list[tuple[bool, str]]:
        settings = load_settings(redis_url=redis_url, model="m", base_url="http://127.0.0.1:9/v1")
        outcomes = []
        async with RLMEnv(settings=settings, root=OneCellRoot()) as env:
            for point in range(MAX_POINTS):
                outcomes.append(await rollout_cancelled_at(env, point))
                if not outcomes[-1][0]:  # it ended before the cancel: every point was tried
                    break
        return outcomes

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        outcomes = runner.run(sweep())
    assert outcomes[-1] == (False, "answer_ready: None"), outcomes[-3:]
    assert len(outcomes) > 10, outcomes  # it did cancel at many places
    wrong = [(i, o) for i, (cut_short, o) in enumerate(outcomes) if cut_short and o != "cancelled"]
    assert not wrong, wrong


async def test_a_cancellation_replaced_by_a_library_error_is_still_a_cancellation(redis_url: str) -> None:
    settings = load_settings(redis_url=redis_url, model="m", base_url="http://127.0.0.1:9/v1")
    root = SwallowingRoot()
    done: list[RolloutResult] = []
    rows = [DatasetRow(id="r1", question="q", context="ctx", answer="42")]
    async with RLMEnv(settings=settings, root=root) as env:
        task = asyncio.create_task(env.evaluate(rows, model="m", on_done=done.append))
        await asyncio.wait_for(root.entered.wait(), 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert done == []  # no row for a rollout the stop cut short
