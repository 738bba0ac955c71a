"""The hard budget is also *used*: models that stop early, real worker processes, a real Redis.

The scripted model answers ``[[mock:tokens:250]]`` prompts in exactly 250 completion tokens
and ``[[mock:tokens:1-400]]`` prompts in a length drawn per prompt (``answer_tokens`` says
which), so a test knows the demand. What the model served is read from its own counters
(``GET /stats``), never from rlmq.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from rlmq.cli.local import LocalFleet
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.keys import queue_name_for_model, tenant_queue
from rlmq.common.schemas import DatasetRow, SubCallOptions, SubLLMResult
from rlmq.common.settings import load_settings
from rlmq.producer.dispatch import BatchSpec, Dispatcher
from rlmq.producer.env import RLMEnv
from rlmq.scripted.server import answer_tokens, root_code_directive

pytestmark = pytest.mark.e2e
MODEL = f"budget-early-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def early_fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    """4 worker processes x 64 in flight, against the scripted model (it stops early)."""
    logs = tmp_path_factory.mktemp("budget-usable-logs")
    with LocalFleet(redis_url=redis_url, model=MODEL, workers=4, worker_concurrency=64, log_dir=str(logs)) as fleet:
        yield fleet


def served_to(fleet: LocalFleet, rollout_id: str) -> int:
    base = str(fleet.base_url).removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/stats", timeout=10) as resp:
        stats: dict[str, Any] = json.load(resp)
    return int(stats["per_user"].get(rollout_id, {}).get("completion_tokens", 0))


def batch_code(prompt_expr: str, n: int) -> str:
    return f"""
out = llm_batch([{prompt_expr} for i in range({n})])
ok = sum(1 for o in out if not o.startswith("[rejected]") and not o.startswith("[error]"))
rejected = sum(1 for o in out if o.startswith("[rejected]"))
answer["content"] = f"{{ok}} {{rejected}} {{len(out)}}"
answer["ready"] = True
"""


async def budgeted_rollout(
    fleet: LocalFleet, label: str, prompt_expr: str, n: int, budget: int, sub_call_timeout: float, **options: Any
) -> tuple[str, Any]:
    """One rollout whose root code sends ``n`` prompts in one batch under ``budget``; returns
    its rollout id and its :class:`~rlmq.producer.env.RolloutResult`."""
    settings = load_settings(
        redis_url=fleet.redis_url, base_url=fleet.base_url, model=MODEL, sub_call_timeout=sub_call_timeout
    )
    code = batch_code(prompt_expr, n)
    rid = f"{label}-{uuid.uuid4().hex[:8]}"
    async with RLMEnv(
        settings=settings, sub_llm_max_completion_tokens=budget, max_sub_llm_parallelism=n, **options
    ) as env:
        res = await env.rollout(
            DatasetRow(id=label, question="Q. " + root_code_directive(code), context="x"), model=MODEL, rollout_id=rid
        )
    return rid, res


async def test_250_token_answers_use_nearly_all_of_a_3000_token_budget(early_fleet: LocalFleet) -> None:
    budget, n = 3000, 112
    prompt = 'f"Summarise part {i} of the report. [[mock:tokens:250]]"'
    rid, res = await budgeted_rollout(early_fleet, "fixed", prompt, n, budget, 120)
    assert res.row.stop_reason == "answer_ready", res.row.error
    ok, rejected, total = (int(x) for x in str(res.row.final_answer).split())
    assert total == n and ok + rejected == n  # every call ended: a grant or a clear rejection

    served = served_to(early_fleet, rid)
    assert 0.9 * budget <= served <= budget, served
    redis = async_client(str(early_fleet.redis_url))
    snap = await BudgetLedger(redis).snapshot(rid)
    await redis.aclose()
    assert snap is not None and snap.used == snap.charged == served and snap.overrun == 0
    results = [SubLLMResult(**r) for e in res.trajectory if e["type"] == "llm_batch" for r in e["results"]]
    full = sum(1 for r in results if r.status == "ok" and r.completion_tokens == 250)
    assert full >= 10  # answered fully, not 112 answers cut to a few tokens each
    for r in results:
        if r.status == "rejected":  # only once fewer than 250 tokens were left unspent
            used = int(re.search(r"(\d+)/3000", r.content).group(1))  # type: ignore[union-attr]
            assert budget - used < 250, r.content
    m = res.row.metrics
    assert m["sub_llm_rejected_count"] == rejected == snap.rejections
    assert m["sub_llm_budget_waits"] > 0 and m["sub_llm_budget_wait_seconds"] > 0
    assert m["sub_llm_truncated_count"] == sum(1 for r in results if r.truncated) == ok - full
    cell = next(e for e in res.trajectory if e["type"] == "cell")
    assert f"[{served}/{budget} sub-LLM completion tokens used]" in cell["output"]


async def test_random_lengths_serve_at_least_95_percent_under_budgets_from_500_to_20000(
    early_fleet: LocalFleet,
) -> None:
    budgets, n = [500, 2000, 5000, 20000], 125  # 500 sub-calls in all, four rollouts at once
    settings = load_settings(
        redis_url=early_fleet.redis_url, base_url=early_fleet.base_url, model=MODEL, sub_call_timeout=120
    )
    tag = uuid.uuid4().hex[:6]

    async def one(budget: int) -> tuple[int, int, Any]:
        prompt = f'f"Item {{i}} of {tag}-{budget}. [[mock:tokens:1-400]]"'
        demand = sum(answer_tokens(f"Item {i} of {tag}-{budget}. [[mock:tokens:1-400]]") or 0 for i in range(n))
        rid = f"rand-{budget}-{tag}"
        row = DatasetRow(id=rid, question="Q. " + root_code_directive(batch_code(prompt, n)), context="x")
        async with RLMEnv(settings=settings, sub_llm_max_completion_tokens=budget, max_sub_llm_parallelism=n) as env:
            res = await env.rollout(row, model=MODEL, rollout_id=rid)
        return budget, demand, res

    outcomes = await asyncio.gather(*(one(b) for b in budgets))
    redis = async_client(str(early_fleet.redis_url))
    try:
        for budget, demand, res in outcomes:
            rid = res.row.id
            assert res.row.stop_reason == "answer_ready", res.row.error
            ok, rejected, total = (int(x) for x in str(res.row.final_answer).split())
            assert total == n and ok + rejected == n, res.row.final_answer  # nothing hung, no error
            served = served_to(early_fleet, rid)
            assert served <= budget, (budget, served)
            assert served >= 0.95 * min(budget, demand), (budget, demand, served)
            snap = await BudgetLedger(redis).snapshot(rid)
            assert snap is not None and snap.held == 0 and snap.used == served
    finally:
        await redis.aclose()


async def test_a_job_claiming_no_budget_is_held_to_its_rollouts_ledger(early_fleet: LocalFleet) -> None:
    redis = async_client(str(early_fleet.redis_url))
    rid = f"forged-{uuid.uuid4().hex[:8]}"
    try:
        await BudgetLedger(redis).open(rid, 300, cap=100)
        # The payload says "no budget" and asks for 5,000 tokens a call.
        forged = SubCallOptions(model=MODEL, budgeted=False, max_completion_tokens=5000)
        spec = BatchSpec(
            rollout_id=rid,
            batch_id="b1",
            queue=queue_name_for_model(MODEL),
            sub_call_timeout=60,
            parallelism=10,
            call=forged,
        )
        results = await Dispatcher(redis).run_batch(spec, [f"Spend it {i}. [[mock:spend-all]]" for i in range(10)])
        snap = await BudgetLedger(redis).snapshot(rid)
    finally:
        await redis.aclose()
    assert served_to(early_fleet, rid) == 300
    assert [r.status for r in results].count("ok") == 3 and all(r.granted_tokens <= 100 for r in results)
    assert snap is not None and (snap.used, snap.grants, snap.rejections) == (300, 3, 7)


async def test_parked_calls_do_not_hold_a_small_worker_hostage(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """One worker with 4 slots; rollout A's 11 calls wait behind one slow call holding its whole
    budget; rollout B (another trainer node's tenant queue) still gets the worker's slots at once
    (parked calls, up to 4 x the concurrency by default, do not count against it)."""
    model = f"budget-small-{uuid.uuid4().hex[:6]}"
    logs = tmp_path_factory.mktemp("budget-small-logs")
    with LocalFleet(redis_url=redis_url, model=model, workers=1, worker_concurrency=4, log_dir=str(logs)) as fleet:
        redis = async_client(str(fleet.redis_url))
        ledger = BudgetLedger(redis)
        base = queue_name_for_model(model)
        a, b = f"hostA-{uuid.uuid4().hex[:6]}", f"hostB-{uuid.uuid4().hex[:6]}"
        await ledger.open(a, 250, cap=250)

        def spec(rid: str, queue: str, n: int, budgeted: bool) -> BatchSpec:
            return BatchSpec(
                rollout_id=rid,
                batch_id="b1",
                queue=queue,
                sub_call_timeout=60,
                parallelism=n,
                call=SubCallOptions(model=model, budgeted=budgeted),
            )

        dispatcher = Dispatcher(redis)
        slow = [f"Slow {i}. [[mock:tokens:250]] [[mock:sleep:3]]" for i in range(12)]
        task_a = asyncio.create_task(dispatcher.run_batch(spec(a, tenant_queue(base, "a"), 12, True), slow))
        deadline = time.monotonic() + 30
        while True:  # polling the ledger in Redis, bounded: A's calls are parked, its budget held
            snap = await ledger.snapshot(a)
            if snap is not None and snap.waits >= 3:
                break
            assert time.monotonic() < deadline and not task_a.done()
            await asyncio.sleep(0.02)
        results_b = await asyncio.wait_for(
            dispatcher.run_batch(spec(b, tenant_queue(base, "b"), 4, False), [f"Quick {i}?" for i in range(4)]), 30
        )
        a_served_when_b_done = served_to(fleet, a)  # 0 until A's 3-second call has answered
        results_a = await asyncio.wait_for(task_a, 60)
        await redis.aclose()
    assert [r.status for r in results_b] == ["ok"] * 4
    assert a_served_when_b_done == 0  # B did not wait for A's 3-second call
    statuses = [r.status for r in results_a]
    assert statuses.count("ok") == 1 and statuses.count("rejected") == 11  # spent, then clearly rejected


async def test_a_budget_under_two_caps_answers_a_batch_at_once_not_one_call_at_a_time(
    early_fleet: LocalFleet,
) -> None:
    """Budget 1,000, a per-call cap of 250 (the answers' size), four calls that each answer in 100
    tokens after 2 s, a 6 s deadline per call: four whole caps fit in the budget, so all four run at
    once and are answered in full, in one call's time rather than four. (Without the per-call cap a
    call's max_tokens is 2,048, past the whole budget: one whole call at a time, by design.)"""
    budget, n = 1000, 4
    prompt = 'f"Slow part {i}. [[mock:tokens:100]] [[mock:sleep:2]]"'
    rid, res = await budgeted_rollout(early_fleet, "small", prompt, n, budget, 6, sub_llm_per_call_max_tokens=250)
    assert res.row.stop_reason == "answer_ready", res.row.error
    results = [SubLLMResult(**r) for e in res.trajectory if e["type"] == "llm_batch" for r in e["results"]]
    assert [r.status for r in results] == ["ok"] * n, [r.content[:80] for r in results]
    assert all(r.completion_tokens == 100 and not r.truncated for r in results)
    assert served_to(early_fleet, rid) == 400
    assert res.row.metrics["sub_llm_budget_waits"] == 0  # nobody waited: four 250-token grants, 1,000 free
