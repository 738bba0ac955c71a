"""A hard budget across a Sentinel failover: grants wait for the replica's acknowledgement (``WAIT``).

The condition is made for real: a master, its replica and a Sentinel (:class:`SentinelSet`); the
replica's replication broken (it follows a master that does not exist, keeping its data) so the
master's last writes never reach it; then the master killed (``kill -9``) and the replica promoted
without them. A ledger on a client that asks no acknowledgement (``redis_replica_acks`` 0, as every
client before) is granted tokens the promoted replica never heard of, and grants them again: its
tree overshoots. A ledger that waits for one replica never gets (so never uses) such a grant; it
asks again, and is granted on the promoted master once a replica acknowledges there.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from rlmq.common.budget import replica_acks
from rlmq.common.budget.ledger import GRANTED, REJECTED, BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.errors import ReplicaAckMissing
from tests.fleet.sentinel import SentinelSet, unreplicated_failover_run

pytestmark = pytest.mark.e2e


async def _reconnected(client: Redis) -> None:
    """Wait until ``client`` reaches the promoted master: redis-py 8.2 reconnects a connection that
    failed mid-command to the address it had, the Sentinel is asked again on the next command."""
    deadline = time.monotonic() + 15
    while True:
        try:
            await client.ping()
            return
        except RedisError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_a_grant_no_replica_acknowledged_is_never_used_and_the_budget_holds_across_a_failover(
    tmp_path: Path,
) -> None:
    s = SentinelSet(tmp_path / "redis")
    safe_client = async_client(s.url, replica_ack_timeout=0.2)  # a Sentinel URL: 1 replica by default
    plain_client = async_client(s.url, replica_acks=0)
    assert replica_acks.of(safe_client).replicas == 1 and replica_acks.of(plain_client).replicas == 0
    safe, plain = BudgetLedger(safe_client, ttl=600), BudgetLedger(plain_client, ttl=600)
    used = {"safe": 0, "plain": 0}  # tokens of the grants a model call ran on (a grant is spent in full)

    async def spend(ledger: BudgetLedger, name: str, rid: str) -> int:
        grant = await ledger.reserve_until(time.time() + 15, name, rid, None)
        if grant.code == GRANTED:
            used[name] += grant.tokens
            await ledger.settle(name, rid, grant.tokens)
        return int(grant.code)

    try:
        await safe.open("safe", 300, cap=100)
        await plain.open("plain", 300, cap=100)
        assert await spend(safe, "safe", "s1") == GRANTED and await spend(plain, "plain", "p1") == GRANTED
        s.heal_replica()  # both ledgers' first grants are on the replica

        s.cut_replica()
        with pytest.raises(ReplicaAckMissing, match="NOREPLICAS"):
            await safe.reserve("safe", "s2", None)  # written on the master, unacknowledged: not used
        s.heal_replica()  # asked again on the same master: the same grant, never a second one
        again = await safe.reserve("safe", "s2", None)
        snap = await safe.snapshot("safe")
        assert again.code == GRANTED and again.tokens == 100 and snap is not None and snap.charged == 200, snap
        await safe.settle("safe", "s2", 100)
        used["safe"] += 100

        s.cut_replica()
        with pytest.raises(ReplicaAckMissing):
            await safe.reserve("safe", "s3", None)  # lost with the master below: never used
        assert await spend(plain, "plain", "p2") == GRANTED  # used, but the replica never got it
        before = s.master_port()
        s.kill_master()
        s.wait_promoted(before)
        await _reconnected(plain_client)
        await _reconnected(safe_client)

        lost = await plain.snapshot("plain")
        assert lost is not None and lost.charged == 100, lost  # p2 forgotten by the promoted replica
        assert await spend(plain, "plain", "p3") == GRANTED and await spend(plain, "plain", "p4") == GRANTED
        assert used["plain"] == 400 > 300  # without acknowledgement: the tree overshot its budget

        with pytest.raises(ReplicaAckMissing):  # no replica of the promoted master yet: nothing granted
            await safe.reserve("safe", "s3", None)
        s.rejoin()
        assert await spend(safe, "safe", "s3") == GRANTED  # made anew on the promoted master
        assert await spend(safe, "safe", "s4") == REJECTED
        snap = await safe.snapshot("safe")
        assert snap is not None and snap.charged == snap.used == used["safe"] == 300, (snap, used)
    finally:
        await safe_client.aclose()
        await plain_client.aclose()
        s.close()


async def test_a_failover_that_loses_the_last_grants_leaves_no_tree_over_its_budget(tmp_path: Path) -> None:
    # The fleet's workers on a Sentinel URL wait for 1 replica by default. Without it, the same run
    # serves each rollout twice its budget: bench/fleet_hosts.py --unreplicated-failovers.
    run = await unreplicated_failover_run(tmp_path)
    out = run["out"]
    summary: dict[str, Any] = {**out.summary(), "served": out.served, **{k: v for k, v in run.items() if k != "out"}}
    print(summary)
    assert out.slots == 48 and out.duplicated == 0, summary  # every sub-call has one result
    assert out.lost == sum(out.errors.values()) and "None" not in out.errors, summary  # each error has its kind
    assert out.overshoot == 0 and all(0 < served <= 800 for served in out.served.values()), summary
