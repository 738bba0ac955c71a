"""The grant lease with a real ``rlmq worker`` process, the scripted model server (a test double, its
own process) and a real Redis: a grant orphaned on purpose (leased and never begun, as a worker
killed between its early reservation and its model call leaves it) goes back within seconds, and
the tree's budget is never overspent; a grant whose call did begin is never reclaimed.
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from rlmq.cli.local import LocalFleet
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.keys import queue_name_for_model
from rlmq.common.schemas import SubCallOptions, SubLLMResult
from rlmq.producer.dispatch import BatchSpec, Dispatcher

pytestmark = pytest.mark.e2e

LEASE = 1.0  # seconds: the worker's --sub-llm-budget-grant-lease
LIMIT, CAP = 256, 128


@pytest.fixture(scope="module")
def fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    with LocalFleet(
        redis_url=redis_url, model=f"lease-{uuid.uuid4().hex[:6]}", workers=1, worker_concurrency=16,
        worker_args=["--sub-llm-budget-grant-lease", str(LEASE)], worker_grace=1.0,
        log_dir=str(tmp_path_factory.mktemp("lease-logs")),
    ) as f:  # fmt: skip
        yield f


def served_tokens(fleet: LocalFleet) -> int:
    with urllib.request.urlopen(str(fleet.base_url).removesuffix("/v1") + "/stats", timeout=30) as resp:
        doc: dict[str, Any] = json.load(resp)
    return int(doc.get("per_model", {}).get(fleet.model, {}).get("completion_tokens", 0))


async def batch(fleet: LocalFleet, ledger: BudgetLedger, lid: str, n: int, timeout: float) -> list[SubLLMResult]:
    """``n`` prompts answered in 20 tokens each, charging ledger ``lid``, through the worker."""
    spec = BatchSpec(
        rollout_id=lid, batch_id="b1", queue=queue_name_for_model(fleet.model), sub_call_timeout=timeout,
        parallelism=n, call=SubCallOptions(model=fleet.model, budgeted=True),
    )  # fmt: skip
    return await Dispatcher(ledger._redis).run_batch(spec, [f"Part {j}. [[mock:tokens:20]]" for j in range(n)])


async def test_an_orphaned_grant_is_released_within_seconds_and_the_budget_holds(fleet: LocalFleet) -> None:
    redis = async_client(str(fleet.redis_url))
    try:
        ledger = BudgetLedger(redis, ttl=600, grant_lease=LEASE)
        lid = "orph" + uuid.uuid4().hex[:8]
        await ledger.open(lid, LIMIT, CAP)
        before = served_tokens(fleet)
        far = time.time() + 120  # the orphans would be waited for until then without the lease
        for ghost in ("ghost-b0-0:1:1", "ghost-b0-1:1:1"):
            g = await ledger.reserve(lid, ghost, None, far, leased=True)
            assert (g.tokens, g.leased) == (CAP, True)  # the whole budget, held by calls that never began
        t0 = time.monotonic()
        results = await batch(fleet, ledger, lid, 6, timeout=60)
        took = time.monotonic() - t0
        assert [r.status for r in results] == ["ok"] * 6, [r.content for r in results]
        assert took < LEASE + 8, f"the batch took {took:.1f} s: it waited for grants whose calls never began"
        assert not await ledger.begin(lid, "ghost-b0-0:1:1")  # reclaimed: its holder must reserve again
        snap = await ledger.snapshot(lid)
        assert snap is not None
        served = served_tokens(fleet) - before
        assert snap.used == served == 120 <= LIMIT and snap.charged == snap.used and snap.overrun == 0
    finally:
        await redis.aclose()


async def test_a_grant_whose_call_began_is_never_reclaimed(fleet: LocalFleet) -> None:
    """A begun grant (a model call that may still be streaming: its worker was killed mid-call) stays
    charged in full: the worker's calls share only what is left, and never spend it."""
    redis = async_client(str(fleet.redis_url))
    try:
        ledger = BudgetLedger(redis, ttl=600, grant_lease=LEASE)
        lid = "begun" + uuid.uuid4().hex[:8]
        await ledger.open(lid, LIMIT, CAP)
        before = served_tokens(fleet)
        g = await ledger.reserve(lid, "killed-b0-0:1:1", None, time.time() + 4, leased=True)
        assert g.tokens == CAP and await ledger.begin(lid, "killed-b0-0:1:1")
        results = await batch(fleet, ledger, lid, 12, timeout=20)  # demand 240 > the 128 left
        snap = await ledger.snapshot(lid)
        assert snap is not None
        served = served_tokens(fleet) - before
        ok = sum(1 for r in results if r.status == "ok")
        assert snap.used == served <= LIMIT - CAP  # the begun grant's tokens are never spent by other calls
        assert snap.charged == snap.used + CAP  # still charged in full
        outcomes = [(r.status, r.completion_tokens, r.budget_waits, round(r.budget_wait_seconds, 2)) for r in results]
        assert ok >= 6, outcomes  # the 128 left served calls (the last one cut short)
    finally:
        await redis.aclose()
