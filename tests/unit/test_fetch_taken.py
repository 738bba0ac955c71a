"""A worker's memory of the jobs it took from its queues (what keeps a stale lane entry from
starting a second call for them): remembered for TAKEN_MEMORY_SECONDS, then forgotten."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest

from rlmq.workers import fetch
from rlmq.workers.fetch import TAKEN_MEMORY_SECONDS, Fetcher
from rlmq.workers.worker import SubLLMWorker


def fetcher() -> Fetcher:
    return Fetcher(cast(SubLLMWorker, SimpleNamespace(queue="q", child_queues=list)))


def test_a_job_taken_is_remembered_for_the_memory_window_then_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(fetch.time, "monotonic", lambda: now[0])
    f = fetcher()
    f.remember_taken("r-b1-0")
    assert f.took("r-b1-0") and not f.took("r-b1-1")
    now[0] += TAKEN_MEMORY_SECONDS
    assert f.took("r-b1-0")
    now[0] += 0.5
    assert not f.took("r-b1-0")


def test_the_memory_stays_bounded_by_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(fetch.time, "monotonic", lambda: now[0])
    f = fetcher()
    for i in range(3000):  # 100 jobs a second for three windows
        now[0] = i / 100
        f.remember_taken(f"r-b{i}-0")
    assert len(f._taken) == len(f._taken_order) <= TAKEN_MEMORY_SECONDS * 100 + 1
    assert f.took("r-b2999-0") and not f.took("r-b0-0")


def test_a_job_taken_again_keeps_its_newest_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A re-queued job this worker takes again (a later attempt) is remembered from then on."""
    now = [0.0]
    monkeypatch.setattr(fetch.time, "monotonic", lambda: now[0])
    f = fetcher()
    f.remember_taken("r-b1-0")
    now[0] = TAKEN_MEMORY_SECONDS - 1
    f.remember_taken("r-b1-0")
    now[0] = TAKEN_MEMORY_SECONDS + 2
    f.remember_taken("other")  # prunes the first entry, not the second
    assert f.took("r-b1-0")


def idle_fetcher() -> tuple[Fetcher, SimpleNamespace]:
    """A fetcher whose worker has a stop event and a slot-free event, its lane pop never answering."""
    worker = SimpleNamespace(
        queue="q", child_queues=list, stopping=asyncio.Event(), jobs=SimpleNamespace(slot_free=asyncio.Event())
    )
    f = Fetcher(cast(SubLLMWorker, worker))
    f._lane_pop = cast("asyncio.Task[Any]", asyncio.get_running_loop().create_future())
    return f, worker


async def test_an_idle_round_with_a_full_pool_peeks_again_as_soon_as_a_slot_frees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One model-call slot, a lane entry of two jobs: the worker takes one, the other waits on the
    queue and no wake-up announces it again. The round that found the pool full must end when the
    slot frees (before: at the one-second timeout, a second per job on a worker at capacity)."""
    monkeypatch.setattr(fetch, "IDLE_WAIT_SECONDS", 60.0)
    f, worker = idle_fetcher()
    waiting = asyncio.create_task(f._wait_for_work(False, pool_full=True))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not waiting.done()
    worker.jobs.slot_free.set()
    await asyncio.wait_for(waiting, 5.0)


async def test_an_idle_round_with_free_slots_does_not_wake_for_a_freed_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch, "IDLE_WAIT_SECONDS", 60.0)
    f, worker = idle_fetcher()
    waiting = asyncio.create_task(f._wait_for_work(False))
    worker.jobs.slot_free.set()
    for _ in range(20):
        await asyncio.sleep(0)
    assert not waiting.done()
    f._wake.set()  # a wake-up ends it
    await asyncio.wait_for(waiting, 5.0)
