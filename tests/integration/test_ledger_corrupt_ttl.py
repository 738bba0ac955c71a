"""A ledger whose stored ``ttl`` is corrupt (not a whole number of seconds >= 1) on a real Redis.

The ledger script reads the TTL its owner stored and sets it on the reservations hash and the
live set with ``EXPIRE``. On the old code a stored ``1.5``, ``inf`` or ``1e30`` made that
``EXPIRE`` fail *after* the script had already charged the grant and written the reservation
(a Redis script is not rolled back on an error): the caller saw a Redis error, the tokens stayed
charged with nobody to settle them, and each attempt leaked another grant until the budget was
"spent" with nothing served. ``nan`` never failed but set no TTL at all. A corrupt TTL now falls
back to the budget hash's own remaining TTL, which its owner keeps.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis

from rlmq.common.budget.ledger import GRANTED, BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.keys import LedgerKeys

pytestmark = pytest.mark.integration


@pytest.fixture
async def ledger(redis_url: str, real_redis: redis.Redis) -> AsyncIterator[BudgetLedger]:
    client = async_client(redis_url)
    led = BudgetLedger(client, ttl=60)
    try:
        yield led
    finally:
        await led.aclose()
        await client.aclose()


@pytest.mark.parametrize("stored", ["1.5", "inf", "-inf", "nan", "1e30", "0", "-7", "abc", ""])
async def test_a_corrupt_stored_ttl_neither_leaks_a_grant_nor_drops_the_expiry(
    ledger: BudgetLedger, real_redis: redis.Redis, stored: str
) -> None:
    lid = f"corrupt-{uuid.uuid4().hex[:8]}"
    await ledger.open(lid, 1000, cap=100, ttl=60)
    keys = LedgerKeys(lid)
    real_redis.hset(keys.budget, "ttl", stored)
    grant = await ledger.reserve(lid, "job:1:1", None, time.time() + 30)
    assert grant.code == GRANTED and grant.tokens == 100
    settled = await ledger.settle(lid, "job:1:1", 40)
    assert settled.released == 60
    snap = await ledger.snapshot(lid)
    assert snap is not None and snap.charged == 40 and snap.used == 40
    # The keys the script wrote expire with the ledger (its owner's refresh keeps them alive).
    for key in (keys.budget, keys.reservations):
        assert 0 < real_redis.ttl(key) <= 60, key
