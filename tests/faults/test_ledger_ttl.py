"""Who decides how long a rollout's keys live: the producer, never a worker.

A worker whose own ``rollout_key_ttl`` is 10 s serves a rollout whose producer chose 40 s. On the
old code the reservations hash took the worker's TTL at the first grant and expired at about
10 s, so the settlement of a call that ran 13 s found no reservation: the ledger ended charged
with the whole grant and 0 used, against 5 tokens really served, and nothing was logged. The
TTL now lives in the ledger (and the reply TTL in the job): every script that touches the keys
uses the stored one.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from rlmq.cli.local import LocalFleet
from rlmq.common import keys as K
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.schemas import SubCallOptions
from rlmq.producer.dispatch import BatchSpec, Dispatcher
from tests.faults.conftest import model_stats, start_named_worker

pytestmark = pytest.mark.e2e

WORKER_TTL = 10  # the worker's own rollout_key_ttl (seconds)
PRODUCER_TTL = 40  # the producer's: what the rollout's keys must live by
CALL_SECONDS = 13  # longer than the worker's TTL, shorter than the producer's


async def test_a_workers_own_key_ttl_never_shortens_a_producers_ledger(fault_fleet: LocalFleet) -> None:
    fault_fleet.worker_env["RLMQ_ROLLOUT_KEY_TTL"] = str(WORKER_TTL)
    start_named_worker(fault_fleet, "short-ttl")
    redis = async_client(str(fault_fleet.redis_url))
    try:
        ledger = BudgetLedger(redis, ttl=PRODUCER_TTL)
        rid = f"ttl-{uuid.uuid4().hex[:8]}"
        await ledger.open(rid, 1000, cap=128)
        served_before = model_stats(fault_fleet.base_url)["completion_tokens"]
        spec = BatchSpec(
            rollout_id=rid,
            batch_id="b1",
            queue=K.queue_name_for_model(fault_fleet.model),
            sub_call_timeout=60.0,
            parallelism=1,
            call=SubCallOptions(model=fault_fleet.model, budgeted=True),
            reply_ttl=PRODUCER_TTL,
        )
        batch = asyncio.create_task(
            Dispatcher(redis).run_batch(spec, [f"Slow. [[mock:tokens:5]] [[mock:sleep:{CALL_SECONDS}]]"])
        )
        [result] = await asyncio.wait_for(batch, 60 + 10)
        snap = await ledger.snapshot(rid)
        served = model_stats(fault_fleet.base_url)["completion_tokens"] - served_before
        keys = K.RolloutKeys(rid)
        resv_ttl = await redis.ttl(keys.reservations)
        budget_ttl = await redis.ttl(keys.budget)
    finally:
        await redis.aclose()
    assert result.status == "ok", result
    assert served == 5 == result.completion_tokens
    assert snap is not None
    assert (snap.charged, snap.used, snap.held) == (5, 5, 0), snap  # old code: (128, 0, 128)
    # The keys still live by the producer's TTL (40 s, set at most ~15 s ago), not the worker's 10 s.
    assert resv_ttl > WORKER_TTL, resv_ttl
    assert budget_ttl > WORKER_TTL, budget_ttl
    assert snap.ttl == PRODUCER_TTL
