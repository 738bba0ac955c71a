"""Which ledger replies wait for replicas' acknowledgement, on a real Redis that has none.

A ledger on a client asking 1 replica (``redis_replica_acks``) of a Redis without replicas: its
grants and begins fail with :class:`ReplicaAckMissing` (``NOREPLICAS``: a passing refusal, asked
again until the caller's deadline), and asking again finds the same grant, never a second one;
refusals and settlements stand as Redis answered them (they let no model call run). The failover
itself is in ``tests/fleet/test_replica_acks.py``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis
from redis.asyncio import Redis
from redis.exceptions import NoPermissionError

from rlmq.common.budget import replica_acks
from rlmq.common.budget.ledger import GRANTED, WAIT, BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.errors import ReplicaAckMissing

pytestmark = pytest.mark.integration


@pytest.fixture
async def acked(redis_url: str) -> AsyncIterator[tuple[BudgetLedger, BudgetLedger, Redis]]:
    """A ledger asking 1 replica (50 ms), one asking none (the plain URL's default), and a raw client."""
    a = async_client(redis_url, replica_acks=1, replica_ack_timeout=0.05)
    b = async_client(redis_url)
    assert replica_acks.of(a).replicas == 1 and replica_acks.of(b).replicas == 0
    try:
        yield BudgetLedger(a, ttl=60, grant_lease=5), BudgetLedger(b, ttl=60), b
    finally:
        await a.aclose()
        await b.aclose()


async def test_grants_and_begins_wait_for_the_replica_and_asking_again_never_grants_twice(
    acked: tuple[BudgetLedger, BudgetLedger, Redis],
) -> None:
    ledger, plain, _ = acked
    lid = "acks" + uuid.uuid4().hex[:8]
    await plain.open(lid, 200, cap=100)
    for _ in range(2):  # asked again: the same open reservation, never a second grant
        with pytest.raises(ReplicaAckMissing, match="NOREPLICAS .* by 0 of the 1"):
            await ledger.reserve(lid, "r1", None)
        snap = await plain.snapshot(lid)
        assert snap is not None and (snap.charged, snap.grants) == (100, 1), snap
    with pytest.raises(ReplicaAckMissing):  # a leased grant, then its begin
        await ledger.reserve(lid, "r2", None, leased=True)
    assert (await plain.reserve(lid, "r2", None, leased=True)).tokens == 100  # the same lease
    with pytest.raises(ReplicaAckMissing):
        await ledger.begin(lid, "r2")
    assert (await ledger.reserve(lid, "r3", None)).code == WAIT  # no error: a "wait" runs nothing
    assert (await ledger.settle(lid, "r1", 40)).released == 60  # a settlement stands: it only frees tokens
    assert (await plain.reserve(lid, "r4", 50)).code == GRANTED  # what it freed, for a ledger asking none


async def test_an_unacknowledged_grant_is_asked_again_until_the_deadline_in_one_batch_or_many(
    acked: tuple[BudgetLedger, BudgetLedger, Redis],
) -> None:
    ledger, plain, _ = acked
    lids = ["acks" + uuid.uuid4().hex[:8] for _ in range(3)]
    for lid in lids:
        await plain.open(lid, 1000, cap=100)
    started = time.monotonic()
    outcomes = await asyncio.gather(  # one round trip for the three ledgers (the pipelined path)
        *(ledger.reserve_until(time.time() + 0.6, lid, "r1", None) for lid in lids), return_exceptions=True
    )
    assert all(isinstance(o, ReplicaAckMissing) for o in outcomes), outcomes
    assert 0.5 < time.monotonic() - started < 5  # asked again with backoff, then given up at the deadline
    for lid in lids:
        snap = await plain.snapshot(lid)
        assert snap is not None and snap.charged == 100, snap  # one grant each, however often asked


async def test_a_grant_whose_mark_is_refused_is_refused_too(real_redis: redis.Redis, redis_url: str) -> None:
    # Without the mark's write the WAIT may not cover a grant found again: a user that may not write
    # it (an ACL from before the mark) gets its NOPERM at once, never a grant.
    user = "rlmq-noack-" + uuid.uuid4().hex[:6]
    real_redis.execute_command("ACL", "SETUSER", user, "reset", "on", "nopass", "~rlmq:{*", "&*", "+@all")
    client = async_client(redis_url.replace("redis://", f"redis://{user}:x@", 1), replica_acks=1)
    try:
        lid = "acks" + uuid.uuid4().hex[:8]
        ledger = BudgetLedger(client, ttl=60)
        await ledger.open(lid, 200, cap=100)
        with pytest.raises(NoPermissionError):
            await ledger.reserve_until(time.time() + 5, lid, "r1", None)
    finally:
        await client.aclose()
        real_redis.execute_command("ACL", "DELUSER", user)


async def test_a_segment_grant_waits_for_the_replica_as_a_whole_grant_does(
    acked: tuple[BudgetLedger, BudgetLedger, Redis],
) -> None:
    """Segment grants (an answer's first segment, its next one, leased or not) let a model call run
    at once, as a whole grant does: none is used before the replica has it."""
    ledger, plain, _ = acked
    lid = "acks" + uuid.uuid4().hex[:8]
    await plain.open(lid, 2000, cap=500)
    for segment, leased in ((0, False), (0, True), (120, False)):
        rid = f"seg{segment}{'L' if leased else ''}"
        with pytest.raises(ReplicaAckMissing):
            await ledger.reserve(lid, rid, None, leased=leased, segment=segment)
        granted = await plain.reserve(lid, rid, None, leased=leased, segment=segment)  # asked again: the same
        assert granted.code == GRANTED and granted.tokens > 0, granted
