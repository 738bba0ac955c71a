"""The budget ledger on fakeredis (Lua through lupa): grants, waits, rejections, idempotence."""

from __future__ import annotations

import asyncio
import time

import fakeredis
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rlmq.common.budget.ledger as ledger_module
from rlmq.common.budget.ledger import GRANTED, NO_LEDGER, REJECTED, WAIT, BudgetLedger


def make() -> tuple[fakeredis.aioredis.FakeRedis, BudgetLedger]:
    r = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer())
    return r, BudgetLedger(r, ttl=60)


async def test_grant_is_a_whole_cap_and_a_held_remainder_means_wait() -> None:
    _, ledger = make()
    await ledger.open("r1", 100)
    deadline = time.time() + 60
    g1 = await ledger.reserve("r1", "a", 40, deadline)
    assert (g1.tokens, g1.charged, g1.code) == (40, 40, GRANTED)
    g2 = await ledger.reserve("r1", "b", 40, deadline)
    assert (g2.tokens, g2.charged, g2.code) == (40, 80, GRANTED)
    g3 = await ledger.reserve("r1", "c", 40)
    # 20 free, less than a whole grant, and "a" and "b" may give tokens back: wait, until the
    # earliest live deadline (never a grant of 20 that would cut an answer the budget can pay)
    assert (g3.tokens, g3.code, g3.granted, g3.need) == (0, WAIT, False, 40)
    assert abs(g3.retry_at - deadline) < 0.01
    await ledger.settle("r1", "a", 10)  # a stopped early: 30 released
    g4 = await ledger.reserve("r1", "c", 40)
    assert (g4.tokens, g4.charged, g4.code, g4.cut) == (40, 90, GRANTED, False)
    snap = await ledger.snapshot("r1")
    assert snap is not None and (snap.grants, snap.rejections, snap.waits, snap.held) == (3, 0, 1, 80)


async def test_a_call_waits_for_a_whole_grant_while_running_calls_may_give_tokens_back() -> None:
    _, ledger = make()
    await ledger.open("r1", 100)
    deadline = time.time() + 60
    assert (await ledger.reserve("r1", "a", 60, deadline)).tokens == 60
    g = await ledger.reserve("r1", "b", 60)  # 40 free < a whole 60: "a" may give back, so wait
    assert (g.tokens, g.code, g.need) == (0, WAIT, 60)
    c = await ledger.reserve("r1", "c", 40, deadline)  # a smaller cap fits whole at once
    assert (c.tokens, c.code, c.need, c.cut) == (40, GRANTED, 40, False)
    await ledger.settle("r1", "a", 50)  # 10 released: 10 free, "c" still running
    assert (await ledger.reserve("r1", "b", 60)).code == WAIT
    await ledger.settle("r1", "c", 10)  # 30 released: 40 free, nothing live: the last remainder
    b = await ledger.reserve("r1", "b", 60)
    assert (b.tokens, b.code, b.need, b.cut) == (40, GRANTED, 60, True)


async def test_a_grant_is_a_whole_cap_and_never_more_than_the_limit() -> None:
    _, ledger = make()
    await ledger.open("r1", 100, cap=2048)
    g = await ledger.reserve("r1", "a", None, time.time() + 60)
    assert (g.tokens, g.need, g.cut) == (100, 100, False)  # a cap past the budget: the whole budget


async def test_the_last_remainder_goes_to_one_call_and_only_a_spent_budget_rejects() -> None:
    _, ledger = make()
    await ledger.open("r1", 100)
    await ledger.reserve("r1", "a", 60)
    await ledger.settle("r1", "a", 60)
    g = await ledger.reserve("r1", "b", 60)  # 40 free, nothing open: the remainder, not a wait
    assert (g.tokens, g.code, g.need, g.cut) == (40, GRANTED, 60, True)
    assert (await ledger.reserve("r1", "c", 60)).code == WAIT  # b may give some back
    await ledger.settle("r1", "b", 40)
    rejected = await ledger.reserve("r1", "c", 60)
    assert (rejected.tokens, rejected.code, rejected.charged) == (0, REJECTED, 100)
    snap = await ledger.snapshot("r1")
    assert snap is not None and (snap.rejections, snap.used, snap.held) == (1, 100, 0)


async def test_a_reservation_past_its_deadline_is_not_waited_for_but_stays_charged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, ledger = make()
    await ledger.open("r1", 100)
    now = time.time()
    await ledger.reserve("r1", "dead", 80, now + 5)  # its worker dies: never settled
    assert (await ledger.reserve("r1", "b", 80)).code == WAIT
    monkeypatch.setattr(ledger_module.time, "time", lambda: now + 6)  # past the dead call's deadline
    g = await ledger.reserve("r1", "b", 80)
    assert (g.tokens, g.code, g.charged) == (20, GRANTED, 100)  # the dead 80 stay charged
    await ledger.settle("r1", "b", 20)
    assert (await ledger.reserve("r1", "c", 80)).code == REJECTED
    snap = await ledger.snapshot("r1")
    assert snap is not None and (snap.charged, snap.used, snap.held) == (100, 20, 80)


async def test_the_ledger_cap_bounds_a_call_and_a_job_can_only_lower_it() -> None:
    _, ledger = make()
    await ledger.open("r1", 1000, cap=50)
    assert (await ledger.reserve("r1", "big", 900)).tokens == 50  # a job asking for more gets the cap
    assert (await ledger.reserve("r1", "none", None)).tokens == 50
    assert (await ledger.reserve("r1", "small", 10)).tokens == 10
    snap = await ledger.snapshot("r1")
    assert snap is not None and snap.cap == 50


async def test_zero_budget_is_refused_and_up_front_refusals_are_counted() -> None:
    _, ledger = make()
    with pytest.raises(ValueError, match="budget of 0"):
        await ledger.open("r0", 0)
    with pytest.raises(ValueError):
        await ledger.open("r0", 10, cap=0)
    await ledger.open("r1", 10)
    await ledger.count_rejections("r1", 3)
    snap = await ledger.snapshot("r1")
    assert snap is not None and snap.rejections == 3


async def test_a_missing_ledger_is_remembered_as_unbudgeted() -> None:
    _, ledger = make()
    assert not ledger.known_unbudgeted("free")
    assert (await ledger.reserve("free", "a", 10)).code == NO_LEDGER
    assert ledger.known_unbudgeted("free")
    await ledger.open("capped", 10)
    await ledger.reserve("capped", "a", 10)
    assert not ledger.known_unbudgeted("capped")


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


async def test_no_cap_grants_all_that_is_free() -> None:
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
    # 15 whole grants; the 40 left are less than a whole grant while 15 calls may give tokens back
    assert sum(g.tokens for g in grants) == 960
    assert {g.tokens for g in grants if g.tokens} == {64}
    assert sum(1 for g in grants if g.code == WAIT) == 100 - 15


# --- property: random interleavings of reserve, settle, retry and crash --------------------

op = st.tuples(
    st.sampled_from(["reserve", "settle", "retry_reserve", "retry_settle", "crash"]),
    st.integers(0, 7),  # which call
    st.integers(0, 100),  # fraction (percent) of the grant the server spends
)


@settings(max_examples=60, deadline=None)
@given(limit=st.integers(1, 500), cap=st.integers(1, 200), ops=st.lists(op, max_size=60))
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
                    assert g.tokens <= cap
                elif g.code == WAIT:  # less than a full grant free, and an open call may give some back
                    assert grants and limit - g.charged < min(cap, limit)
                else:  # rejected only when nothing is free and nothing is open
                    assert g.code == REJECTED and g.charged == limit and not grants
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


async def test_retiring_a_dead_attempts_reservation_stops_the_wait_but_keeps_the_charge() -> None:
    _, ledger = make()
    await ledger.open("r1", 100)
    await ledger.reserve("r1", "job:1:1", 80, time.time() + 60)  # its worker dies mid-call
    assert (await ledger.reserve("r1", "other", 80)).code == WAIT
    assert await ledger.retire("r1", ["job:1:1", "job:1:2"]) == 1  # the job runs again as attempt 2
    g = await ledger.reserve("r1", "other", 80)
    assert (g.tokens, g.code, g.charged) == (20, GRANTED, 100)  # nothing live: the remainder
    late = await ledger.settle("r1", "job:1:1", 30)  # the old attempt was alive after all: still settles
    assert (late.code, late.released, late.charged) == (0, 50, 50)


async def test_a_ledger_is_addressed_by_its_own_id_and_its_kinds_have_caps_of_their_own() -> None:
    """One ledger for a tree: calls of different rollouts charge it by its id; a root-model turn
    (kind ``root``) is capped by ``cap:root``, a sub-LLM turn by ``cap``; one budget for both."""
    from rlmq.common.budget.ledger import ROOT, SUB_LLM
    from rlmq.common.keys import LedgerKeys

    r, ledger = make()
    await ledger.open("tree-1", 1000, cap=100, kind_caps={ROOT: 300})
    assert await r.exists(LedgerKeys("tree-1").budget) and not await ledger.snapshot("child-a")
    deadline = time.time() + 60
    sub = await ledger.reserve("tree-1", "child-a-b1-0:1:1", None, deadline)
    root = await ledger.reserve("tree-1", "child-b:root:1", None, deadline, kind=ROOT)
    lowered = await ledger.reserve("tree-1", "child-c:root:1", 50, deadline, kind=ROOT)  # a caller lowers it
    uncapped = await ledger.reserve("tree-1", "x:1", None, deadline, kind="other")  # no cap of its own
    assert (sub.tokens, root.tokens, lowered.tokens) == (100, 300, 50)
    assert (uncapped.tokens, uncapped.charged) == (550, 1000)  # whatever was free: the budget is one
    again, _, _ = await ledger.acquire("tree-1", "child-b:root:1", None, deadline, kind=SUB_LLM)
    assert again.tokens == 300  # an open reservation answers with its grant, whatever is asked
    await ledger.settle("tree-1", "child-b:root:1", 120)
    snap = await ledger.snapshot("tree-1")
    assert snap is not None and (snap.charged, snap.used, snap.grants) == (820, 120, 4)
    with pytest.raises(ValueError, match="reservation kind"):
        await ledger.reserve("tree-1", "y", None, deadline, kind="Root!")


async def test_the_owner_ttl_is_stored_and_used_by_every_caller() -> None:
    """The TTL is the opener's (stored in the ledger); a worker's ledger object with another TTL
    neither shortens the keys at the first grant nor when it counts a refusal."""
    from rlmq.common.keys import LedgerKeys

    r = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer())
    producer, worker = BudgetLedger(r, ttl=4000), BudgetLedger(r, ttl=10)
    await producer.open("t1", 100, cap=50)
    keys = LedgerKeys("t1")
    await worker.reserve("t1", "a", None, time.time() + 60)
    await worker.count_rejections("t1", 2)
    snap = await worker.snapshot("t1")
    assert snap is not None and (snap.ttl, snap.rejections) == (4000, 2)
    for key in keys.all():
        assert 10 < await r.ttl(key) <= 4000, key
    await worker.count_rejections("gone", 1)  # a missing ledger is not re-created
    assert not await r.exists(LedgerKeys("gone").budget)
    with pytest.raises(ValueError, match="ttl"):
        await producer.open("t2", 100, ttl=0)


async def test_a_ledger_without_a_stored_ttl_keeps_its_own_expiry() -> None:
    """A ledger opened by an older producer (no ``ttl`` field): the reservations take the budget
    hash's own remaining TTL, never the caller's."""
    from rlmq.common.keys import LedgerKeys

    r, ledger = make()
    keys = LedgerKeys("old")
    await r.hset(keys.budget, mapping={"limit": 100, "charged": 0, "cap": 0})
    await r.expire(keys.budget, 3000)
    grant = await BudgetLedger(r, ttl=10).reserve("old", "a", None, time.time() + 60)
    assert grant.tokens == 100
    assert 10 < await r.ttl(keys.reservations) <= 3000


class _Refusing:
    """Wraps a ledger's ``_submit``: the first ``n`` calls fail with ``error`` before reaching Redis."""

    def __init__(self, ledger: BudgetLedger, n: int, error: Exception) -> None:
        self.inner, self.left, self.error, self.calls = ledger._submit, n, error, 0
        ledger._submit = self  # type: ignore[method-assign]

    async def __call__(self, *args: object) -> list[int]:
        self.calls += 1
        if self.left > 0:
            self.left -= 1
            raise self.error
        return await self.inner(*args)  # type: ignore[arg-type]


async def test_acquire_asks_again_through_a_burst_of_readonly_replies() -> None:
    """A failover's READONLY replies (or OOM, LOADING) are asked again with backoff until the
    call's deadline: the call is granted once Redis takes writes again, reserved once."""
    from redis.exceptions import ReadOnlyError

    _, ledger = make()
    await ledger.open("r1", 100)
    refusing = _Refusing(ledger, 4, ReadOnlyError("You can't write against a read only replica."))
    grant, _, _ = await ledger.acquire("r1", "a", 30, time.time() + 30)
    assert (grant.code, grant.tokens) == (GRANTED, 30)
    assert refusing.calls == 5
    snap = await ledger.snapshot("r1")
    assert snap is not None and (snap.grants, snap.held) == (1, 30)


async def test_acquire_gives_up_at_its_deadline_and_at_once_on_noperm() -> None:
    from redis.exceptions import NoPermissionError, ReadOnlyError, ResponseError

    _, ledger = make()
    await ledger.open("r1", 100)
    _Refusing(ledger, 10**6, ReadOnlyError("READONLY"))
    t0 = time.monotonic()
    with pytest.raises(ReadOnlyError):
        await ledger.acquire("r1", "a", 30, time.time() + 0.6, margin=0.1)
    assert 0.4 <= time.monotonic() - t0 < 3.0  # asked again until deadline - margin, then raised
    _, ledger = make()
    await ledger.open("r1", 100)
    refusing = _Refusing(ledger, 10**6, NoPermissionError("NOPERM"))
    with pytest.raises(NoPermissionError):
        await ledger.acquire("r1", "a", 30, time.time() + 30)
    assert refusing.calls == 1  # asking again cannot change an ACL
    _, ledger = make()
    await ledger.open("r1", 100)
    refusing = _Refusing(ledger, 10**6, ResponseError("WRONGTYPE Operation against a key holding the wrong kind"))
    with pytest.raises(ResponseError):
        await ledger.acquire("r1", "b", 30, time.time() + 30)
    assert refusing.calls == 1  # nor a key of the wrong type
    _, ledger = make()
    await ledger.open("r1", 100)
    refusing = _Refusing(ledger, 3, ResponseError("OOM command not allowed when used memory > 'maxmemory'."))
    grant, _, _ = await ledger.acquire("r1", "c", 30, time.time() + 30)
    assert grant.code == GRANTED and refusing.calls == 4  # a full memory frees up: asked again
