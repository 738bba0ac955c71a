"""Sub-tools end to end: allow-listed on the worker, offered by the rollout, run in the sub-LLM's loop."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from rlmq.cli.local import LocalFleet
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv
from rlmq.scripted.server import root_code_directive

pytestmark = pytest.mark.e2e

TOOL_CODE = """
out = llm_batch([
    'Count these. [[mock:tool:count_words:{"text": "one two three four"}]] [[mock:echo-tool-result]]',
    'Plain question without tools.',
])
answer["content"] = " || ".join(out)
answer["ready"] = True
"""


@pytest.fixture(scope="module")
def tool_fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    logs = tmp_path_factory.mktemp("tool-logs")
    with LocalFleet(
        redis_url=redis_url,
        model=f"tools-{uuid.uuid4().hex[:6]}",
        workers=1,
        worker_args=["--allow-tool", "rlmq.workers.tools.count_words"],
        log_dir=str(logs),
    ) as fleet:
        yield fleet


async def test_an_allowed_sub_tool_runs_in_the_sub_llm_loop(tool_fleet: LocalFleet) -> None:
    settings = load_settings(redis_url=tool_fleet.redis_url, base_url=tool_fleet.base_url, model=tool_fleet.model)
    row = DatasetRow(id="tools", question="Tools. " + root_code_directive(TOOL_CODE), context="x")
    async with RLMEnv(
        settings=settings, sub_tools=["rlmq.workers.tools.count_words"], include_sub_llm_in_trajectory=True
    ) as env:
        res = await env.rollout(row, model=tool_fleet.model)
    assert res.row.stop_reason == "answer_ready", res.row.error
    with_tool, plain = str(res.row.final_answer).split(" || ")
    assert "tool result: 4" in with_tool
    assert not plain.startswith("[error]")
    assert res.row.metrics["sub_llm_total_tool_calls"] == 1
    assert res.row.metrics["sub_llm_total_turns"] == 3  # two turns with the tool, one without
    batch = next(e for e in res.trajectory if e["type"] == "llm_batch")
    roles = [m["role"] for m in batch["results"][0]["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]


async def test_a_tool_the_worker_does_not_allow_never_reaches_the_model(tool_fleet: LocalFleet) -> None:
    settings = load_settings(redis_url=tool_fleet.redis_url, base_url=tool_fleet.base_url, model=tool_fleet.model)
    row = DatasetRow(id="no-tools", question="Tools. " + root_code_directive(TOOL_CODE), context="x")
    async with RLMEnv(settings=settings, sub_tools=["rlmq.workers.tools.grep"]) as env:
        res = await env.rollout(row, model=tool_fleet.model)
    assert res.row.stop_reason == "answer_ready", res.row.error
    first, second = str(res.row.final_answer).split(" || ")
    assert first.startswith("[error]") and "grep" in first
    assert second.startswith("[error]")
    assert res.row.metrics["sub_llm_error_count"] == 2
    assert res.row.metrics["sub_llm_total_turns"] == 0
