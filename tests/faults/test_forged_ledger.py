"""A job forging ``ledger_id``: its rollout has a budget of its own, the job names another ledger.

On the old code a worker charged whatever ledger the job named. A job of a rollout with a budget
of 100 tokens that named another rollout's (larger) ledger had its calls served with nothing
charged to its own rollout: the model server served 5 x 90 = 450 tokens for a rollout whose
limit was 100, and the other rollout paid for them. The ledger, not the job, decides: a job whose
rollout has a ledger of its own and that names another one is refused as an invalid payload,
before any reservation or model call. For a tree, membership decides: a job naming its tree's
ledger must carry a chain ending with its own rollout id whose node is alive in that ledger.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from rlmq.cli.local import LocalFleet
from rlmq.common import keys as K
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.schemas import SubCallOptions
from rlmq.producer.dispatch import BatchSpec, Dispatcher
from tests.faults.conftest import model_stats, start_named_worker

pytestmark = pytest.mark.e2e


async def test_a_job_cannot_move_its_rollouts_spending_to_another_ledger(fault_fleet: LocalFleet) -> None:
    start_named_worker(fault_fleet, "forged-ledger")
    redis = async_client(str(fault_fleet.redis_url))
    try:
        ledger = BudgetLedger(redis, ttl=60)
        own, other = f"own-{uuid.uuid4().hex[:8]}", f"other-{uuid.uuid4().hex[:8]}"
        await ledger.open(own, 100, cap=100)
        await ledger.open(other, 100_000, cap=1000)
        served_before = model_stats(fault_fleet.base_url)["completion_tokens"]
        spec = BatchSpec(
            rollout_id=own,
            ledger_id=other,
            batch_id="b1",
            queue=K.queue_name_for_model(fault_fleet.model),
            sub_call_timeout=30.0,
            parallelism=5,
            call=SubCallOptions(model=fault_fleet.model, budgeted=True),
            reply_ttl=60,
        )
        results = await asyncio.wait_for(
            Dispatcher(redis).run_batch(spec, [f"Call {i}. [[mock:tokens:90]]" for i in range(5)]), 40
        )
        served = model_stats(fault_fleet.base_url)["completion_tokens"] - served_before
        snap_own, snap_other = await ledger.snapshot(own), await ledger.snapshot(other)
    finally:
        await redis.aclose()
    assert snap_own is not None and snap_other is not None
    # The hard promise for the rollout: what the server served for it is within its own limit.
    assert served <= snap_own.limit, (served, snap_own, snap_other)  # old code: 450 > 100
    assert snap_other.charged == 0, snap_other
    assert len(results) == 5
    assert all(r.status == "error" and r.error_kind == "payload" for r in results), results


async def test_tree_membership_decides_which_jobs_charge_a_tree_ledger(fault_fleet: LocalFleet) -> None:
    """A child's jobs (chain ending with their own rollout, a live node of the tree) are served and
    charged to the tree; a job claiming a chain whose last node is not alive in that ledger, or a
    chain not ending with its rollout, gets no token; once the top closes, none of the tree's calls do."""
    start_named_worker(fault_fleet, "tree-member")
    redis = async_client(str(fault_fleet.redis_url))
    try:
        ledger = BudgetLedger(redis, ttl=60)
        top, child, stranger = (f"{name}-{uuid.uuid4().hex[:8]}" for name in ("top", "kid", "stranger"))
        await ledger.open(top, 1000, cap=100)
        await ledger.open_node(top, top)
        await ledger.open_node(top, child)
        queue = K.queue_name_for_model(fault_fleet.model)

        async def batch(rollout: str, nodes: tuple[str, ...], batch_id: str) -> list[Any]:
            spec = BatchSpec(
                rollout_id=rollout,
                ledger_id=top,
                nodes=nodes,
                batch_id=batch_id,
                queue=queue,
                sub_call_timeout=30.0,
                parallelism=3,
                call=SubCallOptions(model=fault_fleet.model, budgeted=True),
                reply_ttl=60,
            )
            prompts = [f"Call {i}. [[mock:tokens:20]]" for i in range(3)]
            return await asyncio.wait_for(Dispatcher(redis).run_batch(spec, prompts), 40)

        served_before = model_stats(fault_fleet.base_url)["completion_tokens"]
        member = await batch(child, (top, child), "b1")
        served_member = model_stats(fault_fleet.base_url)["completion_tokens"] - served_before
        not_alive = await batch(stranger, (top, stranger), "b2")  # its node was never opened
        wrong_chain = await batch(stranger, (top, child), "b3")  # a chain that is not its own
        await ledger.close(top, top_node=top)
        after_close = await batch(child, (top, child), "b4")
        served = model_stats(fault_fleet.base_url)["completion_tokens"] - served_before
        snap = await ledger.snapshot(top)
    finally:
        await redis.aclose()
    assert snap is not None
    assert [r.status for r in member] == ["ok"] * 3 and served_member == 60 == snap.used, (member, snap)
    assert served == served_member  # nothing served after the member batch
    assert all(r.status == "rejected" and "parent_gone" in (r.content or "") for r in not_alive), not_alive
    assert all(r.status == "error" and r.error_kind == "payload" for r in wrong_chain), wrong_chain
    assert all(r.status == "rejected" and "tree_closed" in (r.content or "") for r in after_close), after_close
