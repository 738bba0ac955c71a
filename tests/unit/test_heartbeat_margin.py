"""A worker's heartbeat under load: with ``--heartbeat-ttl 2`` and an event loop stalled 1.1 s in
every 1.2 s (the child rollouts of a loaded REPL host), no gap between two beats reaches the TTL,
so the host is never declared dead while alive. The bound: a beat at least every
``job_heartbeat_ttl / HEARTBEAT_MARGIN`` seconds, on a fixed rate."""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace
from typing import Any

from rlmq.common.metrics import Metrics
from rlmq.workers.upkeep import HEARTBEAT_MARGIN, Upkeep, heartbeat_period

TTL = 2


def test_the_period_holds_the_margin() -> None:
    assert heartbeat_period(1.0, 10) == 1.0
    assert heartbeat_period(1.0, 2) == 2 / HEARTBEAT_MARGIN == 0.5


async def test_a_stalled_loop_still_beats_within_the_ttl() -> None:
    settings = SimpleNamespace(heartbeat_interval=1.0, job_heartbeat_ttl=TTL)
    upkeep = Upkeep(SimpleNamespace(settings=settings, name="w", metrics=Metrics()))  # type: ignore[arg-type]
    beats: list[float] = []

    async def beat() -> None:
        beats.append(time.monotonic())
        await asyncio.sleep(0.01)  # its Redis round trip: answered, but read after the next stall

    upkeep.heartbeat_once = beat  # type: ignore[method-assign]

    async def load() -> None:  # CPU work on the loop: 1.1 s busy, 0.1 s free
        while True:
            t = time.monotonic()
            while time.monotonic() - t < 1.1:
                pass
            await asyncio.sleep(0.1)

    tasks: list[asyncio.Task[Any]] = [asyncio.create_task(upkeep.heartbeat_loop())]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(load()))
    try:
        await asyncio.sleep(9)
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
    gaps = [b - a for a, b in zip(beats, beats[1:], strict=False)]
    assert len(gaps) >= 5 and max(gaps) < TTL, gaps
