"""Budgeted calls that wait for a release, on a real Redis (pub/sub wake-ups, deadlines, lost connections).

Two :class:`BudgetLedger` objects on two clients stand for two worker processes: one parks
a call, the other settles. Nothing here sleeps to synchronise: every wait is on an event
or a future, bounded by a deadline.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis

from rlmq.common.budget.ledger import GRANTED, REJECTED, WAIT, WAITED_OUT, BudgetLedger
from rlmq.common.budget.wait import ReleaseWaits
from rlmq.common.budget.wire import Grant
from rlmq.common.connection import async_client
from tests.integration.conftest import parked

pytestmark = pytest.mark.integration


async def test_a_parked_call_is_granted_when_another_process_settles(
    two: tuple[BudgetLedger, BudgetLedger],
) -> None:
    worker1, worker2 = two
    rid = f"w{uuid.uuid4().hex[:8]}"
    await worker1.open(rid, 1000, cap=900)
    deadline = time.time() + 30
    first = await worker2.reserve(rid, "first", None, deadline)
    assert first.tokens == 900  # 100 left: less than a whole grant, so the next call parks
    waiter = asyncio.create_task(worker1.acquire(rid, "second", None, deadline))
    await parked(worker1, 1)
    await worker2.settle(rid, "first", 150)  # stopped early: 750 go back, the settle script publishes
    grant, waits, seconds = await asyncio.wait_for(waiter, 10)
    assert (grant.code, grant.tokens, grant.cut) == (GRANTED, 850, True)  # nothing live: the last remainder
    assert waits >= 1 and seconds > 0
    assert worker1.parked == 0


async def test_the_last_remainder_wakes_one_parked_call_at_a_time(two: tuple[BudgetLedger, BudgetLedger]) -> None:
    """Three calls parked for a whole 60-token grant; once nothing runs, each release wakes one of
    them (it takes what is free), not all three (two of which would only be told to wait again):
    the ledger counts no extra "wait" answer, and the calls are served one after another."""
    worker1, worker2 = two
    rid = f"w{uuid.uuid4().hex[:8]}"
    await worker1.open(rid, 100, cap=60)
    deadline = time.time() + 30
    assert (await worker2.reserve(rid, "a", None, deadline)).tokens == 60
    waiters = [asyncio.create_task(worker1.acquire(rid, c, None, deadline)) for c in "bcd"]
    await parked(worker1, 3)
    snap = await worker1.snapshot(rid)
    assert snap is not None
    waits_before = snap.waits
    await worker2.settle(rid, "a", 10)  # 90 free, nothing live: one call is woken and granted whole
    done, _ = await asyncio.wait(waiters, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    (first,) = done
    grant, _, _ = first.result()
    assert (grant.code, grant.tokens, grant.cut) == (GRANTED, 60, False)
    await parked(worker1, 2)
    snap = await worker1.snapshot(rid)
    assert snap is not None and snap.waits == waits_before  # the other two never asked again
    rest = [w for w in waiters if w is not first]
    await worker1.settle(rid, "bcd"[waiters.index(first)], 10)  # 80 free
    done, _ = await asyncio.wait(rest, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    (second,) = done
    assert second.result()[0].tokens == 60
    await worker1.settle(rid, "bcd"[waiters.index(second)], 60)  # 20 free, nothing live: the remainder
    last = next(w for w in rest if w is not second)
    grant, _, _ = await asyncio.wait_for(last, 10)
    assert (grant.code, grant.tokens, grant.cut) == (GRANTED, 20, True)


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


async def test_first_waits_of_several_rollouts_on_a_busy_worker_are_all_woken(redis_url: str) -> None:
    """Issue 25: calls of four rollouts start waiting at once on a worker whose pool has no idle
    connection (all busy, as on a loaded worker). The pub/sub connection used to be made lazily by
    each first subscription: four connections, one read, and the calls subscribed on the others
    parked until their deadline while their tokens were free."""
    waiter_client, other_client = async_client(redis_url), async_client(redis_url)
    other = BudgetLedger(other_client, ttl=60)
    waits = ReleaseWaits(waiter_client, lambda: None)  # its pool is cold: every connection is new
    admin = redis.Redis.from_url(redis_url)
    try:
        deadline = time.time() + 30
        rids = [f"w{uuid.uuid4().hex[:8]}" for _ in range(4)]
        told = []
        for rid in rids:
            await other.open(rid, 20)
            assert (await other.reserve(rid, "running", None, deadline)).tokens == 20
            told.append(await other.reserve(rid, "waiting", None, deadline))
        assert all(g.code == WAIT for g in told)
        calls = [
            asyncio.create_task(waits.wait_for_grant(other, rid, "waiting", None, deadline, deadline - 0.5, g))
            for rid, g in zip(rids, told, strict=True)
        ]
        changed = asyncio.Event()
        waits._on_change = changed.set
        async with asyncio.timeout(10):
            while waits.parked < len(rids):
                await changed.wait()
                changed.clear()
        # This test's subscriber: on its database (a shared RLMQ_TEST_REDIS_URL serves the other
        # pytest-xdist processes' subscribers too, each on a database of its own)
        db = str(admin.connection_pool.connection_kwargs.get("db", 0))
        subscribers = [c for c in admin.client_list() if c.get("sub", "0") != "0" and str(c.get("db")) == db]
        assert len(subscribers) == 1 and subscribers[0]["sub"] == str(len(rids))
        for rid in rids:
            await other.settle(rid, "running", 2)  # 18 free, nothing running
        results = await asyncio.wait_for(asyncio.gather(*calls), 10)
        assert [g.tokens for g, _, _ in results] == [18] * len(rids)
    finally:
        admin.close()
        await waits.aclose()
        await other.aclose()
        await waiter_client.aclose()
        await other_client.aclose()


async def test_killing_pubsub_connections_again_and_again_never_fails_a_waiting_call(
    redis_url: str, two: tuple[BudgetLedger, BudgetLedger]
) -> None:
    """Issue 23 item 7: ``CLIENT KILL TYPE pubsub``, again and again, while 120 calls of 60 rollouts
    are released and end their waits, used to fail calls as ``internal`` (redis-py's
    ``AttributeError: 'NoneType' object has no attribute 'writelines'`` escaping the wait's
    unsubscribe, or a read racing a reconnect: 6 of 6 runs of this test). Every call must end granted."""
    worker1, worker2 = two
    killer = async_client(redis_url)

    async def kill(times: int) -> None:
        for _ in range(times):
            await killer.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
            await asyncio.sleep(0)  # one loop turn between kills, not synchronisation

    try:
        for round_ in range(30):
            deadline = time.time() + 30
            rids = [f"k{round_}x{i}{uuid.uuid4().hex[:6]}" for i in range(60)]
            for rid in rids:
                await worker1.open(rid, 40, cap=40)
                await worker2.reserve(rid, "running", None, deadline)
            calls = [asyncio.create_task(worker1.acquire(rid, f"c{j}", 10, deadline)) for rid in rids for j in range(2)]
            await parked(worker1, len(calls))

            async def release(rids: list[str]) -> None:
                for rid in rids:  # the calls end their waits (and unsubscribe) amid the kills
                    await worker2.settle(rid, "running", 2)

            await asyncio.gather(release(rids), kill(20))
            results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 15)
            assert [r[0].tokens if isinstance(r, tuple) else repr(r) for r in results] == [10] * len(calls)
    finally:
        await killer.aclose()


class _StaleLedger:
    """A ledger whose clock is behind this host's: it says "wait until ``retry_at``" with a
    ``retry_at`` this host has already passed (the earliest live reservation still counts as live
    by Redis's ``TIME``), ``stale`` times, then grants."""

    def __init__(self, stale: int) -> None:
        self.stale = stale
        self.asked: list[float] = []

    async def reserve_until(
        self, until: float, ledger_id: str, reservation_id: str, cap: int | None, deadline: float | None = None
    ) -> Grant:
        self.asked.append(time.monotonic())
        if len(self.asked) <= self.stale:
            return Grant(0, 100, 100, WAIT, retry_at=time.time() - 0.001, need=50)
        return Grant(50, 100, 100, GRANTED, need=50)

    async def count_rejections(self, ledger_id: str, n: int) -> None:
        raise AssertionError("the call was not granted")


async def test_a_wait_until_a_deadline_that_has_already_passed_here_asks_again_soon_not_at_the_calls_end(
    redis_url: str,
) -> None:
    """A live reservation's deadline passed by this host's clock but not yet by Redis's (the two
    clocks a millisecond or more apart): the call asks again after a short, growing pause, where it
    used to park until its own deadline (20 s in the worker test that found it)."""
    client = async_client(redis_url)
    waits = ReleaseWaits(client, lambda: None)
    ledger = _StaleLedger(stale=4)
    first = Grant(0, 100, 100, WAIT, retry_at=time.time() - 0.001, need=50)
    t0 = time.monotonic()
    try:
        grant, _, _ = await asyncio.wait_for(
            waits.wait_for_grant(ledger, "stale", "r1", None, time.time() + 30, time.time() + 29, first), 10
        )
    finally:
        await waits.aclose()
        await client.aclose()
    assert grant.code == GRANTED and len(ledger.asked) == 5
    assert time.monotonic() - t0 < 2.0  # pauses of 0.05, 0.1, 0.2, 0.4 s (and the subscription's round trip)
    gaps = [b - a for a, b in zip(ledger.asked, ledger.asked[1:], strict=False)]
    assert gaps[-1] > gaps[0]  # the pause grows while the ledger keeps saying the same
