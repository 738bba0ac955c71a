"""``RLMEnv.evaluate`` runs ``concurrency`` rollouts at a time without a task per rollout
waiting its turn: ``rlmq run -r 100000000`` (or a huge dataset) must start at once and hold
memory for the rollouts running, not for every one to come."""

from __future__ import annotations

import asyncio

from rlmq.common.schemas import DatasetRow, ResultRow
from rlmq.producer.env import RLMEnv, RolloutResult


class CountingRollouts:
    """A stand-in for RLMEnv's rollout that records how many asyncio tasks exist while it runs."""

    def __init__(self) -> None:
        self.most_tasks = 0
        self.running = 0
        self.most_running = 0

    async def rollout(self, row: DatasetRow, *, model: str, rollout_index: int | None = None) -> RolloutResult:
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        self.most_tasks = max(self.most_tasks, len(asyncio.all_tasks()))
        await asyncio.sleep(0)
        self.running -= 1
        return RolloutResult(row=ResultRow(id=row.id, final_answer="x", answer=None, correct=None,
                                           stop_reason="answer_ready", metrics={}, rollout=rollout_index))  # fmt: skip


async def test_many_rollouts_per_example_are_run_by_a_bounded_pool_in_order() -> None:
    fake = CountingRollouts()
    rows = [DatasetRow(id="a", question="q", context="c"), DatasetRow(id="b", question="q", context="c")]
    done: list[RolloutResult] = []
    out = await RLMEnv.evaluate(
        fake,  # type: ignore[arg-type]
        rows,
        model="m",
        concurrency=3,
        rollouts_per_example=2_000,
        on_done=done.append,
        skip={("a", 0), ("b", 1999)},
    )
    assert fake.most_running == 3
    assert fake.most_tasks <= 3 + 2, fake.most_tasks  # the pool and the test's own task, not 4,000
    keys = [(r.row.id, r.row.rollout) for r in out]
    assert keys == [(i, k) for i in ("a", "b") for k in range(2_000) if (i, k) not in {("a", 0), ("b", 1999)}]
    assert len(done) == len(out)
