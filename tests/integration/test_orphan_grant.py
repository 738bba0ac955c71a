"""A grant whose call never runs must not hold its tree's budget until the call's deadline.

The stall this reproduces: a lane entry's *early* call (:mod:`rlmq.workers.fetch`) reserves the
job's first grant while its ``START`` is on the way. Another worker took the job first and its own
run of it waits (parked) for the very same reservation id. The early call's reservation is granted
in the same ledger script as a settlement of another call of the tree, so the release message
says nothing is free, and the parked owner is not woken. Then the early call is cancelled (it lost
``START``). Before the fix, the grant stayed open and *live* until the call's deadline: every
call of the tree waited for it, and was rejected "waited ... for tokens held by running calls".

The orderings are set up, not waited for: the settlement and the early reservation go out in one
ledger round trip (the worker coalesces a loop turn's ledger operations), the early call is the
real :func:`rlmq.workers.subllm.run_sub_llm` with a ``START`` future as its gate, cancelled the way
the fetcher cancels it. Real Redis, two ledger clients (two workers' views).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

from rlmq.common.budget.ledger import WAITED_OUT, BudgetLedger, Grant
from rlmq.common.schemas import SubLLMRequest
from rlmq.workers.model import ChatClient
from rlmq.workers.subllm import SubLLMContext, run_sub_llm
from rlmq.workers.tools import ToolRegistry
from tests.integration.conftest import parked

pytestmark = pytest.mark.integration

LIMIT, CAP = 256, 128  # two calls of 128 hold the whole budget; a call is granted a whole 128


def request(ledger_id: str, deadline: float) -> SubLLMRequest:
    return SubLLMRequest(
        rollout_id=ledger_id, batch_id="b1", index=0, prompt="p", model="m", enqueued_at=time.time(),
        deadline=deadline, budgeted=True,
    )  # fmt: skip


async def test_a_cancelled_early_call_gives_its_grant_back_to_the_parked_owner(
    two: tuple[BudgetLedger, BudgetLedger],
) -> None:
    early_worker, owner_worker = two
    lid = "orph" + uuid.uuid4().hex[:8]
    await early_worker.open(lid, LIMIT, CAP)
    deadline = time.time() + 12
    job = "job-" + uuid.uuid4().hex[:6]
    reservation = f"{job}:1:1"
    # Two running calls hold the whole budget.
    for other in ("c:1:1", "d:1:1"):
        g = await early_worker.reserve(lid, other, CAP, time.time() + 60)
        assert g.tokens == CAP
    # The worker that took the job from its queue runs it: its first reservation waits for a release.
    owner = asyncio.create_task(early_worker_free_acquire(owner_worker, lid, reservation, deadline))
    await parked(owner_worker, 1)

    # One loop turn of the lane worker: call c ends (nothing used: its whole 128 back) and the lane
    # entry's early call of the same job reserves; both go out in one script, in that order.
    async with ChatClient("http://127.0.0.1:9/v1", retries=1, backoff_base=0.001) as client:
        ctx = SubLLMContext(client=client, ledger=early_worker, tools=ToolRegistry(), worker_name="lane")
        claim: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        settle = asyncio.create_task(early_worker.settle(lid, "c:1:1", 0))
        early = asyncio.create_task(run_sub_llm(request(lid, deadline), ctx, job_id=job, attempt=1, gate=claim))
        await settle
        # The early call holds the grant and waits for START at its gate.
        while (await early_worker.snapshot(lid)).charged != LIMIT:  # type: ignore[union-attr]
            await asyncio.sleep(0.01)
        # START lost to the owner: the fetcher cancels the early call and its START future.
        early.cancel()
        claim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await early

    t0 = time.monotonic()
    grant, waited = await asyncio.wait_for(owner, 15)
    # The owner gets the job's grant within seconds, not at its deadline.
    assert grant.code != WAITED_OUT, f"the owner waited {waited:.1f} s for a grant nobody used"
    assert grant.granted
    assert time.monotonic() - t0 < 3.0
    snap = await early_worker.snapshot(lid)
    assert snap is not None and snap.charged <= LIMIT


async def early_worker_free_acquire(
    ledger: BudgetLedger, lid: str, reservation: str, deadline: float
) -> tuple[Grant, float]:
    """The owner's first reservation of the job (as ``run_sub_llm`` makes it): the grant and seconds waited."""
    grant, _, seconds = await ledger.acquire(lid, reservation, CAP, deadline, margin=0.5)
    return grant, seconds
