"""Whole grants stay hard: the budget cases of ``tests/e2e/test_budget_whole.py`` with a worker
killed (``kill -9``) while it holds whole grants, on CPUs kept busy by other processes.

A dead worker's grants stay charged (its calls may have spent them), its jobs run again under new
grants, and the tokens the model server itself served for the rollout never pass the budget.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid

import pytest

from rlmq.cli.local import LocalFleet
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.keys import queue_name_for_model
from rlmq.common.sampling import DEFAULT_CALL_MAX_TOKENS
from rlmq.common.schemas import SubCallOptions
from rlmq.producer.dispatch import BatchSpec, Dispatcher
from tests.faults.conftest import await_until, model_stats, start_named_worker

pytestmark = pytest.mark.e2e
BUDGET = 20_000
CASES = {  # (prompts, directives): 1,500-token answers, 8 or 40 of them; random lengths 1..1,500
    "a": (8, "[[mock:tokens:1500]] [[mock:tps:1000]]"),
    "b": (40, "[[mock:tokens:1500]] [[mock:tps:3000]]"),
    "c": (48, "[[mock:tokens:1-1500]] [[mock:tps:3000]]"),
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_zero_overshoot_with_a_worker_killed_mid_call_on_busy_cpus(fault_fleet: LocalFleet, case: str) -> None:
    victim, _ = start_named_worker(fault_fleet, f"whole-victim-{case}")
    start_named_worker(fault_fleet, f"whole-other-{case}")
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)
    ]  # fmt: skip
    redis = async_client(str(fault_fleet.redis_url))
    try:
        ledger = BudgetLedger(redis)
        rid = f"whole-kill-{case}-{uuid.uuid4().hex[:8]}"
        await ledger.open(rid, BUDGET, cap=DEFAULT_CALL_MAX_TOKENS)  # as a rollout opens it: whole caps
        n, directives = CASES[case]
        prompts = [f"Part {i} of {rid}. {directives}" for i in range(n)]
        spec = BatchSpec(
            rollout_id=rid,
            batch_id="b1",
            queue=queue_name_for_model(fault_fleet.model),
            sub_call_timeout=90,
            parallelism=len(prompts),
            call=SubCallOptions(model=fault_fleet.model, budgeted=True, max_completion_tokens=DEFAULT_CALL_MAX_TOKENS),
        )
        batch = asyncio.create_task(Dispatcher(redis).run_batch(spec, prompts))

        async def calls_running() -> bool:
            snap = await ledger.snapshot(rid)
            return snap is not None and snap.grants >= 4

        await await_until(calls_running, 30, "calls granted and running")
        os.kill(victim.pid, signal.SIGKILL)  # mid-call: its grants stay charged
        results = await asyncio.wait_for(batch, 120)
        snap = await ledger.snapshot(rid)
    finally:
        for p in burners:
            p.kill()
            p.wait()
        await redis.aclose()
    served = model_stats(str(fault_fleet.base_url))["per_user"].get(rid, {}).get("completion_tokens", 0)
    assert served <= BUDGET, served  # zero overshoot, as the model server counted it
    assert snap is not None and snap.overrun == 0 and snap.used <= snap.charged <= BUDGET
    assert len(results) == len(prompts) and all(r.status in ("ok", "rejected", "error") for r in results)
    assert sum(1 for r in results if r.status == "ok") >= 1
