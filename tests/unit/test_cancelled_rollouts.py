"""A rollout cut short by a cancellation is not a finished rollout.

After Ctrl-C, ``rlmq run`` wrote rows with ``stop_reason: error`` and ``ReplStartupError: the
REPL failed to start: [Errno 9] Bad file descriptor``: uvloop closes the reply pipe when its
``connect_read_pipe`` is cancelled, the second close raised ``EBADF``, and that ``OSError``
replaced the cancellation. These tests cancel at every event-loop step of a REPL's start, on
uvloop (the commands' loop), and check what comes out.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import uvloop

from rlmq.common.errors import ReplStartupError
from rlmq.producer.env import raise_if_cancelled
from rlmq.producer.repl import Repl
from tests.suspension import where

MAX_POINTS = 200
"""More suspension points than a REPL's start has (it has a few dozen)."""


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def start_cancelled_at(point: int) -> tuple[str, tuple[tuple[str, int], ...]]:
    """Start a REPL and cancel its start at its ``point``-th suspension point (0: at once).

    Returns what came out of it and where the cancel landed. The test's task steps the loop
    one iteration at a time and looks where the start is suspended after each; a new place
    is a new point.
    """
    repl = Repl(context="ctx", endpoint_url="http://127.0.0.1:9/unused", token="t", namespaces=False)
    task = asyncio.create_task(repl.start())
    seen: list[tuple[tuple[str, int], ...]] = []
    at: tuple[tuple[str, int], ...] = ()
    while not task.done() and len(seen) < point:
        await asyncio.sleep(0)  # one loop iteration
        here = where(task) if not task.done() else ()
        if here and (not seen or seen[-1] != here):
            seen.append(here)
        at = here
    task.cancel()
    try:
        await task
        outcome = "started"
    except asyncio.CancelledError:
        outcome = "cancelled"
    except ReplStartupError as exc:
        outcome = f"ReplStartupError: {exc}"
    await repl.close()
    return outcome, at


def test_a_repl_start_cancelled_at_any_point_ends_cancelled_not_failed() -> None:
    fds: list[int] = []

    async def sweep() -> list[tuple[int, str, tuple[tuple[str, int], ...]]]:
        seen = []
        await start_cancelled_at(MAX_POINTS)  # once through, so the loop holds what it keeps
        fds.append(open_fds())
        for point in range(MAX_POINTS):
            outcome, at = await start_cancelled_at(point)
            seen.append((point, outcome, at))
            if outcome == "started":
                break
        fds.append(open_fds())
        return seen

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        seen = runner.run(sweep())
    failed = [(point, outcome, at[-1:]) for point, outcome, at in seen if outcome not in ("started", "cancelled")]
    assert not failed, failed
    assert seen[-1][1] == "started", "the sweep never got past the start: it tested nothing"
    lines = {at[-1] for _, _, at in seen if at}
    assert any("launch.py" in file for file, _ in lines), lines  # it did cancel inside the child's spawn
    assert fds[1] <= fds[0], fds  # no pipe end left open by a cancelled start


def test_raise_if_cancelled_turns_a_failure_during_cancellation_into_the_cancellation() -> None:
    async def rollout_end() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass  # a library that swallowed it (or replaced it with its own error)
        raise_if_cancelled("rollout r1")
        return "a row"

    async def main() -> Any:
        task = asyncio.create_task(rollout_end())
        await asyncio.sleep(0)
        task.cancel()
        return (await asyncio.gather(task, return_exceptions=True))[0]

    out = asyncio.run(main())
    assert isinstance(out, asyncio.CancelledError), out


def test_a_deadline_of_its_own_still_ends_in_a_row() -> None:
    """``asyncio.timeout`` uncancels: a rollout past its own deadline is a finished (error) row."""

    async def rollout_with_deadline() -> str:
        try:
            async with asyncio.timeout(0.01):
                await asyncio.sleep(10)
        except TimeoutError:
            pass
        raise_if_cancelled("rollout r2")
        return "error row"

    assert asyncio.run(rollout_with_deadline()) == "error row"
