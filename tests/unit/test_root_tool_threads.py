"""The threads of sync root tools: one rollout cannot take them all, a busy tool is not a hung
one, results are encoded off the event loop, a result whose repr fails is the tool's error, and
a call still running when its rollout ends is recorded then, never after."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from typing import Any

import pytest

from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import RolloutOptions
from rlmq.producer.rollout import Rollout
from rlmq.producer.root_tools import RootToolbox, RootToolService, ToolFailure, encode_result


class BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("repr exploded")


class SlowRepr:
    def __repr__(self) -> str:
        time.sleep(1.5)
        return "slow"


def test_a_result_whose_repr_raises_is_a_tool_failure() -> None:
    with pytest.raises(ToolFailure, match="not JSON and its repr failed: RuntimeError"):
        encode_result(BadRepr(), 1024)
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ToolFailure):
        encode_result(deep, 10_000_000)


async def test_a_tool_whose_result_has_a_failing_repr_gives_its_error() -> None:
    def bad() -> Any:
        return BadRepr()

    box = RootToolbox([bad], timeout=5, max_result_bytes=1024)
    with pytest.raises(ToolFailure, match="bad: result is not JSON and its repr failed"):
        await box.call("bad", [], {})


async def test_a_slow_repr_does_not_stall_the_event_loop() -> None:
    def slow() -> Any:
        return SlowRepr()

    box = RootToolbox([slow], timeout=10, max_result_bytes=1024)
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    task = asyncio.ensure_future(ticker())
    try:
        assert await box.call("slow", [], {}) == '"slow"'
    finally:
        stop.set()
        await task
    assert max(gaps) < 1.0, max(gaps)  # the 1.5 s repr ran in the tool's thread, not on the loop


async def test_more_concurrent_calls_than_threads_all_run_when_none_is_hung() -> None:
    parties = 12
    meet = threading.Barrier(parties, timeout=20)

    def rendezvous(i: int) -> int:
        meet.wait()  # returns only once all the calls run at once
        return i

    box = RootToolbox([rendezvous], timeout=30, max_result_bytes=1024, max_threads=8)
    got = await asyncio.gather(*(box.call("rendezvous", [i], {}) for i in range(parties)))
    assert sorted(int(g) for g in got) == list(range(parties))


async def test_one_owner_holds_at_most_one_thread_past_its_timeout() -> None:
    release = threading.Event()

    def stuck() -> str:
        release.wait(30)
        return "late"

    def fine() -> int:
        return 1

    box = RootToolbox([stuck, fine], timeout=0.2, max_result_bytes=1024, max_threads=2)
    try:
        with pytest.raises(ToolFailure, match="stuck did not return within its timeout"):
            await box.call("stuck", [], {}, owner="hostile")
        for _ in range(5):  # its later calls fail at once: its hung call still holds its thread
            t0 = time.monotonic()
            with pytest.raises(ToolFailure, match="previous call of stuck is still running"):
                await box.call("stuck", [], {}, owner="hostile")
            assert time.monotonic() - t0 < 0.15
        # Others are not starved: the hostile owner holds one thread of the two.
        assert await box.call("fine", [], {}, owner="other") == "1"
        release.set()
        deadline = time.monotonic() + 10
        while box._threads.count:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert await box.call("fine", [], {}, owner="hostile") == "1"
    finally:
        release.set()
        box.close()


async def test_a_call_running_when_the_rollout_ends_is_recorded_then_and_never_again() -> None:
    started, release = threading.Event(), threading.Event()

    def slow() -> str:
        started.set()
        release.wait(30)
        return "late"

    box = RootToolbox([slow], timeout=30, max_result_bytes=1024)
    ro = Rollout(id="r1", row=DatasetRow(id="1", question="q", context="c"), model="m", sub_model="m", queue="q",
                 options=RolloutOptions())  # fmt: skip
    service = RootToolService(box)
    call = asyncio.ensure_future(service.run(ro, "slow", [], {}))
    try:
        assert await asyncio.get_running_loop().run_in_executor(None, started.wait, 20)
        service.close()
        assert [(e["name"], e["ok"], e.get("error")) for e in ro.trajectory] == [
            ("slow", False, "slow: the rollout ended before it returned")
        ]
        assert ro.stats.metrics()["root_tool_call_count"] == 1
        with pytest.raises(asyncio.CancelledError):
            await call
        assert await service.run(ro, "slow", [], {}) == (False, "slow: the rollout has ended")
        release.set()
        deadline = time.monotonic() + 10
        while box._threads.count:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert len(ro.trajectory) == 1 and ro.stats.metrics()["root_tool_call_count"] == 1
    finally:
        release.set()


async def test_a_tool_raising_systemexit_keyboardinterrupt_or_cancellederror_only_fails_its_call() -> None:
    def quits() -> None:
        sys.exit(2)

    async def quits_async() -> None:
        sys.exit(3)

    def interrupts() -> None:
        raise KeyboardInterrupt

    def cancels() -> None:
        raise asyncio.CancelledError

    async def cancels_async() -> None:
        raise asyncio.CancelledError

    box = RootToolbox([quits, quits_async, interrupts, cancels, cancels_async], timeout=5, max_result_bytes=1024)
    expected = {
        "quits": "quits raised SystemExit: 2",
        "quits_async": "quits_async raised SystemExit: 3",
        "interrupts": "interrupts raised KeyboardInterrupt",
        "cancels": "cancels raised CancelledError",
        "cancels_async": "cancels_async raised CancelledError",
    }
    for name, message in expected.items():
        with pytest.raises(ToolFailure) as info:
            await box.call(name, [], {})
        assert str(info.value).startswith(message), (name, str(info.value))


async def test_a_call_cancelled_from_outside_is_still_cancelled() -> None:
    started = threading.Event()

    async def waits() -> None:
        started.set()
        await asyncio.Event().wait()

    box = RootToolbox([waits], timeout=30, max_result_bytes=1024)
    call = asyncio.ensure_future(box.call("waits", [], {}))
    deadline = time.monotonic() + 10
    while not started.is_set():
        assert time.monotonic() < deadline
        await asyncio.sleep(0)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


async def test_a_closed_toolbox_serves_again_when_its_environment_starts_again() -> None:
    def fine() -> int:
        return 1

    box = RootToolbox([fine], timeout=5, max_result_bytes=1024)
    assert await box.call("fine", [], {}) == "1"
    box.close()
    assert await box.call("fine", [], {}) == "1"
