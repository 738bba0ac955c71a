"""Supervision of long-lived tasks: restarted after a failure, or the process is told to stop."""

from __future__ import annotations

import asyncio

import pytest

import rlmq.common.supervise as sup
from rlmq.common.supervise import supervised


async def test_a_failing_task_is_restarted_until_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sup, "BACKOFF_BASE", 0.001)
    runs: list[int] = []
    gave_up: list[str] = []

    async def body() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise ConnectionResetError("transient")

    await asyncio.wait_for(supervised("t", body, on_give_up=lambda n, e: gave_up.append(n)), 10)
    assert len(runs) == 3 and gave_up == []


async def test_a_task_that_keeps_failing_gives_up(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sup, "BACKOFF_BASE", 0.001)
    monkeypatch.setattr(sup, "BACKOFF_MAX", 0.001)
    runs: list[int] = []
    gave_up: list[tuple[str, BaseException]] = []

    async def body() -> None:
        runs.append(1)
        raise ValueError("WRONGTYPE Operation against a key holding the wrong kind of value")

    await asyncio.wait_for(
        supervised("flush", body, on_give_up=lambda n, e: gave_up.append((n, e)), max_restarts=3), 10
    )
    assert len(runs) == 4
    assert gave_up and gave_up[0][0] == "flush" and isinstance(gave_up[0][1], ValueError)
    assert "task flush failed" in caplog.text and "giving up" in caplog.text


async def test_cancellation_is_never_swallowed() -> None:
    started = asyncio.Event()

    async def body() -> None:
        started.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(supervised("t", body, on_give_up=lambda n, e: None))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
