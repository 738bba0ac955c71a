"""Settling a reservation with exactly its grant (a call that spent all its ``max_tokens``).

Found by the kill -9 test: ``SETTLE_LUA`` computes ``HINCRBY charged -release`` and with
``release == 0`` Lua's ``-0`` is sent as the string ``"-0"``, which Redis refuses ("value
is not an integer or out of range"). The script aborts after it has already marked the
reservation settled and added ``used``, so the ledger ends correct by luck, but the worker
logs "could not settle" and gets no settlement. Fix in ``common/budget/ledger.py`` (not this
folder's). Fixed there: the script now writes the counters it computed with one ``HSET``.
"""

from __future__ import annotations

from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client


async def test_settle_with_the_whole_grant(redis_url: str) -> None:
    client = async_client(redis_url)
    try:
        ledger = BudgetLedger(client, ttl=60)
        rid = "settle-negzero"
        await client.delete("rlmq:{settle-negzero}:budget", "rlmq:{settle-negzero}:resv")
        await ledger.open(rid, 100)
        grant = await ledger.reserve(rid, "r1", 10)
        assert grant.tokens == 10
        settled = await ledger.settle(rid, "r1", 10)
        assert settled.released == 0
        snap = await ledger.snapshot(rid)
        assert snap is not None and snap.charged == 10 and snap.used == 10
    finally:
        await client.delete("rlmq:{settle-negzero}:budget", "rlmq:{settle-negzero}:resv")
        await client.aclose()
