"""The budget ledger on fakeredis (Lua through lupa): grants, rejections, idempotence."""

from __future__ import annotations

import asyncio

import fakeredis
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmq.common.ledger import BudgetLedger


def make() -> tuple[fakeredis.aioredis.FakeRedis, BudgetLedger]:
    r = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer())
    return r, BudgetLedger(r, ttl=60)


async def test_grant_is_min_of_cap_and_remaining() -> None:
    _, ledger = make()
    await ledger.open("r1", 100)
    g1 = await ledger.reserve("r1", "a", 60)
    assert (g1.tokens, g1.charged, g1.code) == (60, 60, 0)
    g2 = await ledger.reserve("r1", "b", 60)
    assert (g2.tokens, g2.charged) == (40, 100)
    g3 = await ledger.reserve("r1", "c", 60)
    assert (g3.tokens, g3.code, g3.granted) == (0, 1, False)
    snap = await ledger.snapshot("r1")
    assert snap is not None and (snap.grants, snap.rejections, snap.remaining) == (2, 1, 0)


async def test_settle_releases_unused_once() -> None:
    _, ledger = make()
    await ledger.open("r1", 100)
    await ledger.reserve("r1", "a", 80)
    s = await ledger.settle("r1", "a", 30)
    assert (s.released, s.charged, s.code) == (50, 30, 0)
    again = await ledger.settle("r1", "a", 0)
    assert (again.released, again.charged, again.code) == (0, 30, 1)
    snap = await ledger.snapshot("r1")
    assert snap is not None and (snap.used, snap.released, snap.charged) == (30, 50, 30)


async def test_reserve_is_idempotent_per_reservation_id() -> None:
    _, ledger = make()
    await ledger.open("r1", 100)
    first = await ledger.reserve("r1", "job:1:1", 70)
    second = await ledger.reserve("r1", "job:1:1", 70)
    assert first.tokens == second.tokens == 70 and second.charged == 70
    await ledger.settle("r1", "job:1:1", 70)
    closed = await ledger.reserve("r1", "job:1:1", 70)
    assert (closed.tokens, closed.code) == (0, 3)


async def test_missing_ledger_and_unknown_reservation() -> None:
    _, ledger = make()
    g = await ledger.reserve("gone", "a", 10)
    assert g.code == 2 and not g.granted
    await ledger.open("r1", 10)
    s = await ledger.settle("r1", "never", 5)
    assert s.code == 2 and s.charged == 0


async def test_no_cap_grants_the_remainder() -> None:
    _, ledger = make()
    await ledger.open("r1", 25)
    g = await ledger.reserve("r1", "a", None)
    assert g.tokens == 25


async def test_server_overrun_is_charged_and_recorded() -> None:
    _, ledger = make()
    await ledger.open("r1", 100)
    await ledger.reserve("r1", "a", 10)
    s = await ledger.settle("r1", "a", 15)
    assert s.released == -5 and s.charged == 15
    snap = await ledger.snapshot("r1")
    assert snap is not None and snap.overrun == 5


async def test_open_keeps_an_existing_ledger_and_refuses_negative() -> None:
    _, ledger = make()
    await ledger.open("r1", 50)
    await ledger.reserve("r1", "a", 20)
    await ledger.open("r1", 999)
    snap = await ledger.snapshot("r1")
    assert snap is not None and (snap.limit, snap.charged) == (50, 20)
    with pytest.raises(ValueError):
        await ledger.open("r2", -1)


async def test_parallel_reservations_never_exceed_the_limit() -> None:
    _, ledger = make()
    await ledger.open("r1", 1000)
    grants = await asyncio.gather(*(ledger.reserve("r1", f"c{i}", 64) for i in range(100)))
    assert sum(g.tokens for g in grants) == 1000
    assert sum(1 for g in grants if not g.granted) == 100 - 16


# --- property: random interleavings of reserve, settle, retry and crash --------------------

op = st.tuples(
    st.sampled_from(["reserve", "settle", "retry_reserve", "retry_settle", "crash"]),
    st.integers(0, 7),  # which call
    st.integers(0, 100),  # fraction (percent) of the grant the server spends
)


@settings(max_examples=60, deadline=None)
@given(limit=st.integers(0, 500), cap=st.integers(1, 200), ops=st.lists(op, max_size=60))
def test_ledger_invariants_hold_under_any_interleaving(limit: int, cap: int, ops: list[tuple[str, int, int]]) -> None:
    async def run() -> None:
        _, ledger = make()
        await ledger.open("r", limit)
        grants: dict[int, int] = {}  # call -> open grant
        settled: dict[int, int] = {}  # call -> tokens used
        crashed: set[int] = set()
        served = 0
        for kind, call, pct in ops:
            rid = f"call{call}"
            if kind in ("reserve", "retry_reserve"):
                g = await ledger.reserve("r", rid, cap)
                if call in grants:
                    assert g.tokens == grants[call]  # an open reservation is returned again, not re-charged
                elif call in settled:
                    assert g.code == 3 and g.tokens == 0
                elif g.granted:
                    grants[call] = g.tokens
            elif kind in ("settle", "retry_settle") and call in grants and call not in crashed:
                used = grants[call] * pct // 100
                s = await ledger.settle("r", rid, used)
                assert s.code == 0
                served += used
                settled[call] = used
                del grants[call]
                again = await ledger.settle("r", rid, used)
                assert again.code == 1
            elif kind == "crash" and call in grants:
                crashed.add(call)  # its reservation stays charged: never refunded, never lost
            snap = await ledger.snapshot("r")
            assert snap is not None
            assert snap.charged <= limit
            assert snap.charged == sum(grants.values()) + sum(settled.values())
            assert snap.used == served <= limit

    asyncio.run(run())
