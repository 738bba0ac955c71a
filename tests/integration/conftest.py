"""Fixtures and waits the integration tests share."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis
from redis.asyncio import Redis

from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client


@pytest.fixture
async def aredis(real_redis: redis.Redis, redis_url: str) -> AsyncIterator[Redis]:
    """An asyncio client on the session's Redis, whose database ``real_redis`` flushes before and after."""
    client = Redis.from_url(redis_url)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def two(redis_url: str) -> AsyncIterator[tuple[BudgetLedger, BudgetLedger]]:
    """Two budget ledgers on the session's Redis, each on its own client (two processes' view)."""
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
    """Wait (event-driven, bounded by ``timeout`` seconds) until ``ledger`` has ``n`` parked calls."""
    changed = asyncio.Event()
    ledger.on_park = changed.set
    async with asyncio.timeout(timeout):
        while ledger.parked != n:
            await changed.wait()
            changed.clear()
