"""Leased grants on a real Redis: a grant whose call never began goes back within its lease, a
begun one never does, and no interleaving of cancellations, stalls and reclaims overspends a budget.

A *leased* grant must be begun (:meth:`BudgetLedger.begin`) before its call reaches the model; one
that is not begun within the lease (its holder was cancelled, lost its ``START``, stalled, or was
killed) is reclaimed by the ledger's next reservation. Waiters parked before the grant existed are
told when its lease ends (the grant's release message), so nobody waits for it until a deadline.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from rlmq.common.budget.ledger import GRANTED, WAIT, BudgetLedger
from rlmq.common.connection import async_client
from tests.integration.conftest import parked

pytestmark = pytest.mark.integration

LEASE = 0.5  # seconds


@pytest.fixture
async def leased(redis_url: str) -> AsyncIterator[tuple[BudgetLedger, BudgetLedger]]:
    """Two ledgers (two processes' views) whose leased grants last :data:`LEASE` seconds."""
    a, b = async_client(redis_url), async_client(redis_url)
    la, lb = BudgetLedger(a, ttl=60, grant_lease=LEASE), BudgetLedger(b, ttl=60, grant_lease=LEASE)
    try:
        yield la, lb
    finally:
        await la.aclose()
        await lb.aclose()
        await a.aclose()
        await b.aclose()


def new_id() -> str:
    return "lease" + uuid.uuid4().hex[:8]


async def test_an_orphaned_grant_is_reclaimed_for_a_call_parked_before_it_was_made(
    leased: tuple[BudgetLedger, BudgetLedger],
) -> None:
    """The guard: a leased grant nobody begins or gives back (its holder was killed) goes back to the
    budget within its lease, and the call parked for it is granted then, not at its deadline."""
    holder, waiter = leased
    lid = new_id()
    await holder.open(lid, 256, cap=128)
    deadline = time.time() + 30
    for running in ("r1", "r2"):  # two running calls hold the budget
        assert (await holder.reserve(lid, running, None, deadline)).tokens == 128
    call = asyncio.create_task(waiter.acquire(lid, "w:1:1", None, deadline))
    await parked(waiter, 1)
    # In one ledger round trip of the holder's worker: r1 ends unspent, and a lane entry's early call
    # takes what it freed (leased); the release message says nothing is free. Then that worker is
    # killed: the early grant is never begun, never given back.
    _, orphan = await asyncio.gather(
        holder.settle(lid, "r1", 0), holder.reserve(lid, "ghost:1:1", None, deadline, leased=True)
    )
    assert (orphan.code, orphan.tokens, orphan.leased) == (GRANTED, 128, True)
    t0 = time.monotonic()
    grant, waits, _ = await asyncio.wait_for(call, 10)
    took = time.monotonic() - t0
    assert (grant.code, grant.tokens) == (GRANTED, 128) and waits >= 1
    assert took < LEASE + 2.0, f"the parked call waited {took:.1f} s for a grant whose call never began"
    snap = await holder.snapshot(lid)
    assert snap is not None and snap.charged == 256  # r2's and the waiter's; the orphan's went back
    assert not await holder.begin(lid, "ghost:1:1")  # its holder, had it lived, must reserve again


async def test_a_call_that_parks_after_the_grant_asks_again_when_its_lease_ends(
    leased: tuple[BudgetLedger, BudgetLedger],
) -> None:
    holder, waiter = leased
    lid = new_id()
    await holder.open(lid, 256, cap=128)
    deadline = time.time() + 30
    assert (await holder.reserve(lid, "running", None, deadline)).tokens == 128
    assert (await holder.reserve(lid, "ghost:1:1", None, deadline, leased=True)).leased
    first = await waiter.reserve(lid, "w:1:1", None, deadline)
    assert first.code == WAIT and first.retry_at < time.time() + LEASE + 0.5  # the lease's end, not a deadline
    grant, _, _ = await asyncio.wait_for(waiter.acquire(lid, "w:1:1", None, deadline), 10)
    assert grant.tokens == 128


async def test_a_begun_grant_is_never_reclaimed_nor_given_back(leased: tuple[BudgetLedger, BudgetLedger]) -> None:
    holder, other = leased
    lid = new_id()
    await holder.open(lid, 256, cap=128)
    deadline = time.time() + 30
    assert (await holder.reserve(lid, "a:1:1", None, deadline, leased=True)).tokens == 128
    assert await holder.begin(lid, "a:1:1")
    assert await holder.begin(lid, "a:1:1")  # begun twice: still begun
    await asyncio.sleep(LEASE + 0.2)  # past the lease: a begun grant has none (this wait is the test's subject)
    holder.give_back_soon(lid, "a:1:1")  # a give-back of a begun grant changes nothing
    assert (await other.reserve(lid, "b:1:1", None, deadline)).tokens == 128  # reclaims nothing
    assert (await other.reserve(lid, "c:1:1", None, deadline)).code == WAIT
    snap = await other.snapshot(lid)
    assert snap is not None and snap.charged == 256
    assert (await holder.settle(lid, "a:1:1", 100)).released == 28


async def test_an_unleased_call_that_shares_a_leased_grant_begins_it(leased: tuple[BudgetLedger, BudgetLedger]) -> None:
    """A lane worker's early call leased the job's grant; the worker that took the job reserves the
    same id without a lease and calls the model at once: that grant must never be given back."""
    early, owner = leased
    lid = new_id()
    await early.open(lid, 256, cap=128)
    deadline = time.time() + 30
    assert (await early.reserve(lid, "job:1:1", None, deadline, leased=True)).leased
    shared = await owner.reserve(lid, "job:1:1", None, deadline)
    assert (shared.tokens, shared.leased) == (128, False)
    early.give_back_soon(lid, "job:1:1")  # the early call lost START and is cancelled
    await asyncio.sleep(LEASE + 0.2)  # past the lease too
    assert (await early.reserve(lid, "x:1:1", None, deadline)).tokens == 128
    snap = await early.snapshot(lid)
    assert snap is not None and snap.charged == 256  # job:1:1 is still charged: its call is running


async def test_a_cancelled_give_back_of_a_shared_grant_makes_the_owner_reserve_again(
    leased: tuple[BudgetLedger, BudgetLedger],
) -> None:
    early, owner = leased
    lid = new_id()
    await early.open(lid, 256, cap=128)
    deadline = time.time() + 30
    assert (await early.reserve(lid, "job:1:1", None, deadline, leased=True)).leased
    again = await owner.reserve(lid, "job:1:1", None, deadline, leased=True)  # the owner, parked before
    assert again.leased
    early.give_back_soon(lid, "job:1:1")
    await asyncio.sleep(0.2)  # the give-back is fire-and-forget; the begin below must see it either way
    if not await owner.begin(lid, "job:1:1"):
        assert (await owner.reserve(lid, "job:1:1", None, deadline, leased=True)).tokens == 128
        assert await owner.begin(lid, "job:1:1")
    snap = await owner.snapshot(lid)
    assert snap is not None and snap.charged == 128


@pytest.mark.timeout(120)
async def test_no_interleaving_of_cancels_stalls_and_reclaims_overspends(
    leased: tuple[BudgetLedger, BudgetLedger],
) -> None:
    """Zero overshoot with reclaiming: 300 calls on two ledger clients, each reserving leased, some
    cancelled, some stalling past their lease before they begin, the rest calling a "model" that
    spends up to its grant. The tokens spent by calls whose grant was begun never exceed the budget,
    and neither does what the ledger says is spent."""
    rng = random.Random(29)
    lid = new_id()
    limit = 2_000
    a, b = leased
    await a.open(lid, limit, cap=64)
    spent = 0
    in_calls = 0  # tokens granted to calls that are at the model now
    peak = 0
    begun_calls = reclaimed = cancelled = 0

    async def call(i: int, ledger: BudgetLedger) -> None:
        nonlocal spent, in_calls, peak, begun_calls, reclaimed
        rid = f"c{i}:1:1"
        deadline = time.time() + 20
        while True:
            grant, _, _ = await ledger.acquire(lid, rid, None, deadline, margin=0.5, leased=True)
            if not grant.granted:
                return
            stall = rng.random()
            if stall < 0.2:
                await asyncio.sleep(LEASE * 1.5)  # stalled past its lease (a CPU-starved worker)
            elif stall < 0.5:
                await asyncio.sleep(rng.random() * 0.05)
            if await ledger.begin(lid, rid):
                break
            reclaimed += 1
        begun_calls += 1
        in_calls += grant.tokens
        peak = max(peak, spent + in_calls)
        await asyncio.sleep(rng.random() * 0.3)  # at the model
        used = rng.randint(0, grant.tokens)
        in_calls -= grant.tokens
        spent += used
        await ledger.settle(lid, rid, used)

    tasks = [asyncio.create_task(call(i, a if i % 2 else b)) for i in range(300)]
    for t in rng.sample(tasks, 60):
        await asyncio.sleep(rng.random() * 0.02)
        if not t.done():
            t.cancel()
            cancelled += 1
    await asyncio.wait(tasks, timeout=60)
    assert all(t.done() for t in tasks)
    snap = await a.snapshot(lid)
    assert snap is not None
    print(f"\nbegun {begun_calls}, reclaimed {reclaimed}, cancelled {cancelled}, spent {spent}, peak {peak}, {snap}")
    assert peak <= limit and spent <= limit and snap.used == spent <= snap.charged <= limit
    assert reclaimed > 0 and cancelled > 0  # the cases under test happened
