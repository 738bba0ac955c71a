"""Shared tools that misbehave: one that raises with a 52 MB message, one that hangs, one rollout
that floods its tool stream. What a tool answers is bounded before it travels, and one rollout's
flood or hang costs another rollout nothing.

The tools live in this test module and no worker allow-lists them: every call travels through
Redis to the rollout's process (this one), as :mod:`rlmq.producer.hosted_tools` serves it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from rlmq.cli.local import LocalFleet
from rlmq.cli.report import write_run
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv
from rlmq.scripted.server import root_code_directive
from tests.faults.conftest import model_stats

HUGE = 52_000_000
"""Characters of the message the failing tool raises with."""


def shout(key: str) -> str:
    """Fail loudly.

    Args:
        key: anything; the tool raises with a 52 MB message whatever it is.
    """
    raise ValueError(key + "x" * HUGE)


@pytest.fixture(scope="module")
def tool_fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    logs = tmp_path_factory.mktemp("tool-flood-logs")
    with LocalFleet(
        redis_url=redis_url, model=f"flood-{uuid.uuid4().hex[:6]}", workers=1, log_dir=str(logs)
    ) as fleet:  # fmt: skip
        fleet.wait_for_workers(1)
        yield fleet


async def test_a_tool_raising_a_52_mb_message_is_cut_before_it_travels(tool_fleet: LocalFleet, tmp_path: Path) -> None:
    fleet = tool_fleet
    settings = load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model)
    prompt = 'Shout. [[mock:tool:shout:{"key": "k"}]] [[mock:echo-tool-result]]'
    code = f"out = llm_batch([{prompt!r}])\nanswer['content'] = out[0]\nanswer['ready'] = True\n"
    rid = f"shout-{uuid.uuid4().hex[:8]}"
    row = DatasetRow(id="shout", question="Shout. " + root_code_directive(code), context="x")
    async with RLMEnv(settings=settings, tools=[shout], include_sub_llm_in_trajectory=True) as env:
        res = await env.rollout(row, model=fleet.model, rollout_id=rid)
    assert res.row.stop_reason == "answer_ready", res.row.error
    answer = str(res.row.final_answer)
    assert "[tool error] shout: ValueError: kxxx" in answer and "[tool output truncated: " in answer, answer[:300]
    limit = settings.sub_tool_max_result_chars
    assert len(answer) < limit + 1000
    assert model_stats(str(fleet.base_url))["largest_request_bytes"] < limit + 20_000  # the next model request
    r = redis.Redis.from_url(str(fleet.redis_url))
    try:
        sizes = {k: r.memory_usage(k) or 0 for k in r.scan_iter(f"*{rid}*")}
    finally:
        r.close()
    assert sizes and max(sizes.values()) < limit + 20_000, sizes  # the answer stream, kept rollout_key_ttl
    folder = write_run(tmp_path / "run", [res], {"command": "test"})
    assert (folder / "trajectories.jsonl").stat().st_size < 10 * limit
