"""A sub-model that ignores ``max_tokens`` is accounted one way: what it served is charged to the
budget in full, the excess is the ledger's ``overrun``, the results' ``overrun_tokens`` and the
rollout's ``sub_llm_overrun_tokens``, and ``sub_llm_completion_tokens`` is what it served."""

from __future__ import annotations

import uuid

from rlmq.cli.local import LocalFleet
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.schemas import DatasetRow, SubLLMResult
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv
from rlmq.scripted.server import root_code_directive
from tests.fleet.harness import model_stats

CODE = """
out = llm_batch([f"Part {i}. [[mock:tokens:300]] [[mock:ignore-max-tokens]]" for i in range(3)])
answer["content"] = "done"
answer["ready"] = True
"""


async def test_a_sub_model_ignoring_max_tokens_is_charged_and_recorded_as_overrun(fleet: LocalFleet) -> None:
    settings = load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model)
    rid = f"overrun-{uuid.uuid4().hex[:8]}"
    row = DatasetRow(id="overrun", question="Q. " + root_code_directive(CODE), context="x")
    async with RLMEnv(
        settings=settings, sub_llm_max_completion_tokens=300, sub_llm_per_call_max_tokens=100,
        max_sub_llm_parallelism=3,
    ) as env:  # fmt: skip
        res = await env.rollout(row, model=fleet.model, rollout_id=rid)
    assert res.row.stop_reason == "answer_ready", res.row.error
    served = int(model_stats(str(fleet.base_url))["per_user"][rid]["completion_tokens"])
    results = [SubLLMResult(**r) for e in res.trajectory if e["type"] == "llm_batch" for r in e["results"]]
    ok = [r for r in results if r.status == "ok"]
    assert ok and all(r.completion_tokens == 300 and r.granted_tokens == 100 for r in ok), results
    redis = async_client(str(fleet.redis_url))
    try:
        snap = await BudgetLedger(redis).snapshot(rid)
    finally:
        await redis.aclose()
    assert snap is not None
    m = res.row.metrics
    assert served == 300 * len(ok) == snap.used == snap.charged == m["sub_llm_completion_tokens"]
    assert snap.overrun == 200 * len(ok) == m["sub_llm_overrun_tokens"] == sum(r.overrun_tokens for r in ok)
