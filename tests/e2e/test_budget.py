"""The sub-LLM budget as a hard guarantee, across real worker processes (issue: budget).

The scripted model runs with ``--spend-all``: every completion uses its whole ``max_tokens``,
the worst case for a budget. What the model server served is read from its own counters
(``GET /stats``), not from rlmq.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from rlmq.cli.local import LocalFleet
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv
from rlmq.scripted.server import root_code_directive

pytestmark = pytest.mark.e2e
MODEL = f"budget-scripted-{uuid.uuid4().hex[:6]}"  # a queue of its own, even on a shared Redis


@pytest.fixture(scope="module")
def spend_all_fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    """4 worker processes x 64 in flight, against a model that always spends all of max_tokens."""
    logs = tmp_path_factory.mktemp("budget-logs")
    with LocalFleet(
        redis_url=redis_url, model=MODEL, workers=4, worker_concurrency=64, mock_spend_all=True, log_dir=str(logs)
    ) as fleet:
        yield fleet


def served_to(fleet: LocalFleet, rollout_id: str) -> int:
    """Completion tokens the model server itself counted for one rollout (its `user`)."""
    base = str(fleet.base_url).removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/stats", timeout=10) as resp:
        stats: dict[str, Any] = json.load(resp)
    return int(stats["per_user"].get(rollout_id, {}).get("completion_tokens", 0))


STRESS_CODE = """
out = llm_batch([f"Say something about item {i}." for i in range(500)])
ok = sum(1 for o in out if not o.startswith("[rejected]") and not o.startswith("[error]"))
rejected = sum(1 for o in out if o.startswith("[rejected]"))
answer["content"] = f"{ok} {rejected} {len(out)}"
answer["ready"] = True
"""


@pytest.mark.parametrize("cap", [37, None])
async def test_budget_is_never_overshot_under_parallel_load(spend_all_fleet: LocalFleet, cap: int | None) -> None:
    budget = 10_000
    settings = load_settings(
        redis_url=spend_all_fleet.redis_url, base_url=spend_all_fleet.base_url, model=MODEL, sub_call_timeout=60
    )
    row = DatasetRow(id="stress", question="Stress. " + root_code_directive(STRESS_CODE), context="x")
    rid = f"stress-{cap}-{uuid.uuid4().hex[:8]}"
    async with RLMEnv(
        settings=settings,
        sub_llm_max_completion_tokens=budget,
        sub_llm_per_call_max_tokens=cap,
        max_sub_llm_parallelism=500,
    ) as env:
        res = await env.rollout(row, model=MODEL, rollout_id=rid)
    assert res.row.stop_reason == "answer_ready", res.row.error
    ok, rejected, total = (int(x) for x in str(res.row.final_answer).split())
    assert total == 500 and ok + rejected == 500

    served = served_to(spend_all_fleet, rid)
    redis = async_client(str(spend_all_fleet.redis_url))
    snap = await BudgetLedger(redis).snapshot(rid)
    await redis.aclose()
    assert snap is not None
    assert served <= budget, f"the model server served {served} > budget {budget}"
    assert snap.charged == snap.used == served, (snap, served)  # the ledger equals what was served
    assert served >= 0.95 * budget, f"only {served} of {budget} used"
    assert snap.overrun == 0
    m = res.row.metrics
    assert m["sub_llm_budget_limit"] == budget and m["sub_llm_budget_charged"] == served
    assert m["sub_llm_rejected_count"] == rejected
    cell = next(e for e in res.trajectory if e["type"] == "cell")
    assert f"[{served}/{budget} sub-LLM completion tokens used]" in cell["output"]
    if cap is not None:
        assert snap.grants == ok == -(-budget // cap)  # ceil: the last grant takes the remainder


SPENT_CODE_1 = """
first = llm_batch(["Use the whole budget, please."])
print(first[0][:40])
"""
SPENT_CODE_2 = """
second = llm_batch(["Anything left?", "And here?"])
print(second)
answer["content"] = "done"
answer["ready"] = True
"""


async def test_a_spent_budget_refuses_the_whole_batch_and_the_root_goes_on(spend_all_fleet: LocalFleet) -> None:
    settings = load_settings(redis_url=spend_all_fleet.redis_url, base_url=spend_all_fleet.base_url, model=MODEL)
    question = "Spent. " + root_code_directive(SPENT_CODE_1, 1) + " " + root_code_directive(SPENT_CODE_2, 2)
    rid = f"spent-{uuid.uuid4().hex[:8]}"
    async with RLMEnv(settings=settings, sub_llm_max_completion_tokens=100) as env:
        res = await env.rollout(DatasetRow(id="spent", question=question, context="x"), model=MODEL, rollout_id=rid)
    assert res.row.stop_reason == "answer_ready", res.row.error
    assert "100 completion tokens" in res.messages[0]["content"]  # the scaffold states the budget
    cells = [e for e in res.trajectory if e["type"] == "cell"]
    assert "[100/100 sub-LLM completion tokens used]" in cells[0]["output"]
    assert "[rejected] sub-LLM token budget spent: 100/100" in cells[1]["output"]
    batches = [e for e in res.trajectory if e["type"] == "llm_batch"]
    assert all(r["job_id"] == "" for r in batches[1]["results"])  # refused up front: nothing enqueued
    assert served_to(spend_all_fleet, rid) == 100
    assert res.row.metrics["sub_llm_rejected_count"] == 2
    assert res.row.metrics["sub_llm_budget_rejections"] == 2  # refused up front, still counted in the ledger
