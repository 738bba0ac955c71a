"""The batch summary the root model reads (producer/llm_batch.py), on fakeredis."""

from __future__ import annotations

import fakeredis

from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.schemas import DatasetRow, SubLLMResult
from rlmq.common.settings import RolloutOptions
from rlmq.producer.budget import RolloutBudget
from rlmq.producer.dispatch import Dispatcher
from rlmq.producer.llm_batch import LlmBatchService
from rlmq.producer.rollout import Rollout


async def test_the_summary_marks_an_answer_cut_at_its_grant_and_shows_the_budget_line() -> None:
    redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer())
    ledger = BudgetLedger(redis, ttl=60)
    await ledger.open("r1", 1000, cap=128)
    await ledger.reserve("r1", "a", None)
    await ledger.settle("r1", "a", 128)
    options = RolloutOptions(sub_llm_max_completion_tokens=1000, rollout_key_ttl=60)
    rollout = Rollout(
        id="r1",
        row=DatasetRow(id="x", question="q", context="c"),
        model="m",
        sub_model="m",
        queue="q",
        options=options,
        ledger=RolloutBudget(redis, "r1", options),
    )
    service = LlmBatchService(Dispatcher(redis))
    common = {"rollout_id": "r1", "batch_id": "b1", "job_id": "j", "turns": 1, "seconds": 0.5}
    results = [
        SubLLMResult(index=0, status="ok", content="full", completion_tokens=40, **common),
        SubLLMResult(index=1, status="ok", content="cut", completion_tokens=88, truncated=True, granted_tokens=88,
                     **common),
        SubLLMResult(index=2, status="ok", content="long", completion_tokens=2048, truncated=True,
                     granted_tokens=2048, **common),
    ]  # fmt: skip
    text = await service.summary(rollout, results, 0.5)
    lines = text.splitlines()
    assert lines[0].endswith("3 ok, 0 rejected, 0 error, 2 cut short")
    assert lines[1] == "[128/1000 sub-LLM completion tokens used]"  # right under the header
    assert lines[2] == "[872 sub-LLM completion tokens left]"
    assert "CUT" not in lines[3]
    assert lines[4].startswith("  [1] ok") and lines[4].endswith("CUT: the budget's last 88 tokens")
    assert lines[5].startswith("  [2] ok") and lines[5].endswith("CUT: reached max_tokens 2048")
    await redis.aclose()
