"""The live-rollout refresh loop (:meth:`LiveRollouts.refresh_forever`) on a real Redis, with
rollouts and tree nodes entering and leaving faster than its tick for several TTLs.

A loop that restarts its wait whenever a rollout enters never refreshes anything on a host where
rollouts keep starting: a long rollout's node key then expires while it works, and its tree's
calls are refused (``parent_gone`` / ``tree_closed``). Each test watches the long rollout's keys
with ``PTTL`` every 50 ms: a key that is ever missing fails it.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import Redis

from rlmq.common import keys as K
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.producer.live import LiveRollouts

pytestmark = pytest.mark.integration

TTL = 3
"""Seconds a key of the test's rollouts lives unrefreshed: a tick of 1 s, so a key expires only when
the loop is starved, not when a loaded machine delays one tick by a second."""


async def churn(live: LiveRollouts, ledger: BudgetLedger, every: float, until: float) -> int:
    """Short rollouts (each a tree node) entering and leaving every ``every`` seconds until the
    monotonic time ``until``; returns how many entered."""
    n = 0
    while time.monotonic() < until:
        rid = f"short-{n}"
        await ledger.open_node("tree", rid, TTL)
        await live.enter(rid, TTL, {"model": "m"}, node=("tree", TTL))
        await asyncio.sleep(every / 2)  # the short rollout works
        await live.leave(rid)
        await ledger.close_node("tree", rid)
        await asyncio.sleep(every / 2)  # pacing of the stream of short rollouts, not synchronisation
        n += 1
    return n


async def missing_keys(aredis: Redis, keys: list[str], until: float) -> list[tuple[float, str]]:
    """``(seconds, key)`` for every poll (each 50 ms until ``until``) that found a key gone."""
    gone: list[tuple[float, str]] = []
    start = time.monotonic()
    while time.monotonic() < until:
        for key, pttl in zip(keys, [await aredis.pttl(k) for k in keys], strict=True):
            if pttl < 0:
                gone.append((round(time.monotonic() - start, 2), key))
        await asyncio.sleep(0.05)  # sampling period of the watch
    return gone


@pytest.mark.parametrize("every", [0.05, 0.3])
async def test_a_long_rollouts_keys_live_while_short_ones_keep_entering(aredis: Redis, every: float) -> None:
    live = LiveRollouts(aredis)
    ledger = BudgetLedger(aredis)
    await ledger.open_node("tree", "long", TTL)
    await live.enter("long", TTL, {"model": "m"}, node=("tree", TTL))
    refresher = asyncio.create_task(live.refresh_forever(3600 / 3))  # the host's own key TTL is an hour
    until = time.monotonic() + 4 * TTL
    watched = [K.LedgerKeys("tree").node("long"), K.RolloutKeys("long").info]
    try:
        entered, gone = await asyncio.gather(churn(live, ledger, every, until), missing_keys(aredis, watched, until))
    finally:
        refresher.cancel()
        await asyncio.gather(refresher, return_exceptions=True)
    assert entered >= min(20, (4 * TTL) / every / 4), f"only {entered} short rollouts entered"
    assert gone == [], f"the long rollout's keys expired while it worked (first: {gone[:3]})"
    assert await aredis.zscore(K.LIVE_ROLLOUTS, "long") is not None


async def test_the_periods_follow_the_shortest_ttls_entered(aredis: Redis) -> None:
    live = LiveRollouts(aredis)
    assert live.periods(1200) == (1200, 1200)
    await live.enter("a", 60, {"model": "m"})  # a child whose parent chose a 60 s key TTL
    assert live.periods(1200) == (20, 10)  # its keys every 20 s, its 30 s status lease every 10 s
    await live.enter("b", 600, {"model": "m"}, node=("tree", 6))
    assert live.periods(1200) == (20, 2)
    await live.leave("a")
    assert live.periods(1200) == (200, 2)
