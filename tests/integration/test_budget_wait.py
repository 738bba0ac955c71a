"""Budgeted calls that wait for a release, on a real Redis (pub/sub wake-ups, deadlines, lost connections).

Two :class:`BudgetLedger` objects on two clients stand for two worker processes: one parks
a call, the other settles. Nothing here sleeps to synchronise: every wait is on an event
or a future, bounded by a deadline.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis

from rlmq.common.connection import async_client
from rlmq.common.ledger import GRANTED, REJECTED, WAITED_OUT, BudgetLedger

pytestmark = pytest.mark.integration


@pytest.fixture
async def two(redis_url: str) -> AsyncIterator[tuple[BudgetLedger, BudgetLedger]]:
    a, b = async_client(redis_url), async_client(redis_url)
    la, lb = BudgetLedger(a, ttl=60), BudgetLedger(b, ttl=60)
    try:
        yield la, lb
    finally:
        await la.aclose()
        await lb.aclose()
        await a.aclose()
        await b.aclose()


async def parked(ledger: BudgetLedger, n: int, timeout: float = 10.0) -> None:
    """Wait (event-driven, bounded) until ``ledger`` has ``n`` parked calls."""
    changed = asyncio.Event()
    ledger.on_park = changed.set
    async with asyncio.timeout(timeout):
        while ledger.parked != n:
            await changed.wait()
            changed.clear()


async def test_a_parked_call_is_granted_when_another_process_settles(
    two: tuple[BudgetLedger, BudgetLedger],
) -> None:
    worker1, worker2 = two
    rid = f"w{uuid.uuid4().hex[:8]}"
    await worker1.open(rid, 1000, cap=900)
    deadline = time.time() + 30
    first = await worker2.reserve(rid, "first", None, deadline)
    assert first.tokens == 900  # 100 left: less than half a grant, so the next call parks
    waiter = asyncio.create_task(worker1.acquire(rid, "second", None, deadline))
    await parked(worker1, 1)
    await worker2.settle(rid, "first", 150)  # stopped early: 750 go back, the settle script publishes
    grant, waits, seconds = await asyncio.wait_for(waiter, 10)
    assert (grant.code, grant.tokens) == (GRANTED, 850)
    assert waits >= 1 and seconds > 0
    assert worker1.parked == 0


async def test_a_waiter_gives_up_at_its_deadline_with_a_counted_rejection(
    two: tuple[BudgetLedger, BudgetLedger],
) -> None:
    worker1, worker2 = two
    rid = f"w{uuid.uuid4().hex[:8]}"
    await worker1.open(rid, 100, cap=100)
    await worker2.reserve(rid, "holder", None, time.time() + 60)  # runs past the waiter's deadline
    t0 = time.monotonic()
    grant, waits, _ = await worker1.acquire(rid, "late", None, time.time() + 1.0, margin=0.2)
    assert (grant.code, grant.tokens) == (WAITED_OUT, 0)
    assert waits >= 1 and 0.6 < time.monotonic() - t0 < 5
    snap = await worker1.snapshot(rid)
    assert snap is not None and snap.rejections == 1 and snap.held == 100


async def test_a_dead_workers_reservation_stops_being_waited_for_at_its_deadline(
    two: tuple[BudgetLedger, BudgetLedger],
) -> None:
    worker1, worker2 = two
    rid = f"w{uuid.uuid4().hex[:8]}"
    await worker1.open(rid, 100, cap=80)
    await worker2.reserve(rid, "dead", None, time.time() + 0.5)  # its worker dies: never settled
    grant, waits, _ = await asyncio.wait_for(worker1.acquire(rid, "next", None, time.time() + 30), 10)
    assert (grant.code, grant.tokens) == (GRANTED, 20)  # the rest; the dead 80 stay charged
    assert waits == 1  # woken once, at the dead reservation's deadline, not by polling
    await worker1.settle(rid, "next", 20)
    rejected, _, _ = await worker1.acquire(rid, "more", None, time.time() + 30)
    assert rejected.code == REJECTED
    snap = await worker1.snapshot(rid)
    assert snap is not None and (snap.charged, snap.used) == (100, 20)


async def test_parked_calls_survive_a_killed_pubsub_connection(
    redis_url: str, two: tuple[BudgetLedger, BudgetLedger]
) -> None:
    worker1, worker2 = two
    rid = f"w{uuid.uuid4().hex[:8]}"
    await worker1.open(rid, 500, cap=500)
    deadline = time.time() + 30
    await worker2.reserve(rid, "holder", None, deadline)
    waiters = [asyncio.create_task(worker1.acquire(rid, f"c{i}", 100, deadline)) for i in range(3)]
    await parked(worker1, 3)
    admin = redis.Redis.from_url(redis_url)
    try:
        assert admin.client_kill_filter(_type="pubsub") >= 1  # the waiting process's pub/sub connection
    finally:
        admin.close()
    await worker2.settle(rid, "holder", 200)  # 300 free: three grants of 100
    results = await asyncio.wait_for(asyncio.gather(*waiters), 15)
    assert sorted(g.tokens for g, _, _ in results) == [100, 100, 100]
