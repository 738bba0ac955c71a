"""A sub-LLM tool that hangs (on a worker, or hosted in a rollout's process) costs a bounded
number of threads: past :data:`MAX_OVERRUN_THREADS` still running after their calls gave up, sync
tools are refused at once, and served again once one returns."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rlmq.common.tool_registry import MAX_OVERRUN_THREADS, ToolRegistry

RELEASE = threading.Event()


def stuck(key: str) -> str:
    """Wait (at most 30 s) until released.

    Args:
        key: any text.
    """
    RELEASE.wait(30)
    return f"late {key}"


def fine(key: str) -> str:
    """Answer at once.

    Args:
        key: any text.
    """
    return f"fine {key}"


async def quick(key: str) -> str:
    """An async tool: never in a thread.

    Args:
        key: any text.
    """
    return f"quick {key}"


def tool_threads() -> int:
    """Threads of this module's sync tools running now (other tests' threads may come and go)."""
    return sum(1 for t in threading.enumerate() if t.name in ("rlmq-sub-tool-stuck", "rlmq-sub-tool-fine"))


def registry() -> ToolRegistry:
    return ToolRegistry.from_callables([(f"{__name__}.{f.__name__}", f) for f in (stuck, fine, quick)])


async def test_hung_sync_tools_hold_at_most_the_cap_of_threads_then_calls_are_refused_until_one_returns() -> None:
    RELEASE.clear()
    tools = registry()
    assert tool_threads() == 0
    try:
        outs = await asyncio.gather(
            *(tools.call("stuck", f'{{"key": "k{i}"}}', timeout=0.2) for i in range(MAX_OVERRUN_THREADS))
        )
        assert all(o == "[tool error] stuck timed out after 0.2 s" for o in outs), outs
        assert tool_threads() == MAX_OVERRUN_THREADS
        t0 = time.monotonic()
        refused = await tools.call("fine", '{"key": "a"}', timeout=5)
        assert time.monotonic() - t0 < 1.0  # at once, no thread started
        assert refused.startswith(f"[tool error] fine: refused: {MAX_OVERRUN_THREADS} earlier sync tool calls"), refused
        assert tool_threads() == MAX_OVERRUN_THREADS
        assert await tools.call("quick", '{"key": "b"}', timeout=5) == "quick b"  # async tools take no thread
    finally:
        RELEASE.set()
    deadline = time.monotonic() + 10
    while tool_threads() > 0:  # the stuck threads return once released
        assert time.monotonic() < deadline, "the released threads did not end"
        await asyncio.sleep(0.01)
    assert await tools.call("fine", '{"key": "c"}', timeout=5) == "fine c"


async def test_calls_that_return_in_time_never_count_against_the_cap() -> None:
    tools = registry()
    for i in range(MAX_OVERRUN_THREADS * 3):
        assert await tools.call("fine", f'{{"key": "{i}"}}', timeout=5) == f"fine {i}"
    outs = await asyncio.gather(
        *(tools.call("fine", '{"key": "x"}', timeout=5) for _ in range(MAX_OVERRUN_THREADS * 2))
    )
    assert set(outs) == {"fine x"}


async def test_a_thread_that_fails_to_start_with_any_error_is_not_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    tools = registry()

    def no_thread(self: threading.Thread) -> None:
        raise MemoryError("no memory for a thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    for _ in range(MAX_OVERRUN_THREADS):
        assert (
            await tools.call("fine", '{"key": "x"}', timeout=5)
            == "[tool error] fine: MemoryError: no memory for a thread"
        )
    monkeypatch.undo()
    assert await tools.call("fine", '{"key": "y"}', timeout=5) == "fine y"


async def test_one_rollouts_hung_calls_cost_other_rollouts_nothing() -> None:
    """20 hung sync calls of one rollout: that rollout's next sync call is refused, another
    rollout's sync tool runs at once (the cap is per rollout, not per registry)."""
    RELEASE.clear()
    tools = registry()
    try:
        outs = await asyncio.gather(
            *(tools.call("stuck", f'{{"key": "h{i}"}}', timeout=0.2, owner="hog") for i in range(20))
        )
        assert all(o.startswith("[tool error] stuck") for o in outs), outs
        assert tools.overrun_threads("hog") == 20 > MAX_OVERRUN_THREADS  # all started at once, all hung
        assert (await tools.call("fine", '{"key": "a"}', timeout=5, owner="hog")).startswith(
            "[tool error] fine: refused"
        )
        t0 = time.monotonic()
        assert await tools.call("fine", '{"key": "b"}', timeout=5, owner="victim") == "fine b"
        assert time.monotonic() - t0 < 1.0
        assert tools.overrun_threads("victim") == 0
    finally:
        RELEASE.set()
    deadline = time.monotonic() + 10
    while tools.overrun_threads("hog") > 0:
        assert time.monotonic() < deadline, "the released threads did not end"
        await asyncio.sleep(0.01)
