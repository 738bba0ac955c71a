"""A worker killed with ``kill -9`` while its calls hold a rollout's whole budget and others wait.

The dead worker's reservations stay charged (the tokens may have been spent), and when its
jobs run again (the reaper re-queues them within ``DETECTION`` seconds) their new attempts
*retire* the old reservations: nobody waits for them any more. So the waiting calls end with
a clear "budget spent" rejection soon after the death, not at their deadline.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import pytest

from rlmq.cli.local import LocalFleet
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.keys import queue_name_for_model
from rlmq.common.schemas import SubCallOptions
from rlmq.producer.dispatch import BatchSpec, Dispatcher
from tests.faults.conftest import HEARTBEAT_TTL, await_until, start_named_worker

pytestmark = pytest.mark.e2e
DETECTION = HEARTBEAT_TTL + 1.5 * max(0.5, HEARTBEAT_TTL / 4)
TIMEOUT = 60.0  # the sub-calls' deadline, far beyond detection


async def test_waiters_stop_waiting_for_a_dead_workers_reservations(fault_fleet: LocalFleet) -> None:
    victim, _ = start_named_worker(fault_fleet, "budget-victim")
    redis = async_client(str(fault_fleet.redis_url))
    try:
        ledger = BudgetLedger(redis)
        rid = f"dead-{uuid.uuid4().hex[:8]}"
        await ledger.open(rid, 500, cap=250)
        spec = BatchSpec(
            rollout_id=rid,
            batch_id="b1",
            queue=queue_name_for_model(fault_fleet.model),
            sub_call_timeout=TIMEOUT,
            parallelism=10,
            call=SubCallOptions(model=fault_fleet.model, budgeted=True),
        )
        prompts = [f"Slow {i}. [[mock:tokens:100]] [[mock:sleep:30]]" for i in range(10)]
        batch = asyncio.create_task(Dispatcher(redis).run_batch(spec, prompts))

        async def held_and_waiting() -> bool:
            snap = await ledger.snapshot(rid)
            return snap is not None and snap.grants == 2 and snap.waits >= 8

        await await_until(held_and_waiting, 30, "two calls holding the budget and eight waiting")
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        start_named_worker(fault_fleet, "budget-survivor")
        results = await asyncio.wait_for(batch, TIMEOUT + 10)
        ended = time.monotonic() - killed
        snap = await ledger.snapshot(rid)
    finally:
        await redis.aclose()
    assert [r.status for r in results] == ["rejected"] * 10
    assert all("budget spent: 500/500" in r.content for r in results), [r.content for r in results]
    assert ended < DETECTION + 15 < TIMEOUT, ended  # not at the deadline
    assert snap is not None and (snap.charged, snap.used, snap.held) == (500, 0, 500)  # still charged
