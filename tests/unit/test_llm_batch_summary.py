"""The batch summary the root model reads (producer/llm_batch.py), on fakeredis."""

from __future__ import annotations

import fakeredis

from rlmq.common.ledger import BudgetLedger
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
        SubLLMResult(index=1, status="ok", content="cut", completion_tokens=88, truncated=True, **common),
    ]
    text = await service.summary(rollout, results, 0.5)
    lines = text.splitlines()
    assert lines[1] == "[128/1000 sub-LLM completion tokens used]"  # right under the header
    assert "truncated" not in lines[2]
    assert lines[3].startswith("  [1] ok") and lines[3].endswith("truncated (cut at its token grant)")
    await redis.aclose()
