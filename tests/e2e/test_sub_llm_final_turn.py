"""The sub-LLM's forced final-answer turn at ``sub_llm_max_turns``, inside the budget, end to end:
real workers, a real Redis, the scripted model counting what it served per rollout."""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from rlmq.cli.local import LocalFleet
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv
from rlmq.scripted.server import root_code_directive

pytestmark = pytest.mark.e2e

COUNT_WORDS = "rlmq.workers.tools.count_words"
# Two tool calls of 3 tokens each ('{"text":', '"a', 'b"}'), then (tools no longer offered) the answer.
PROMPT = (
    '[[mock:tool:count_words:{"text": "a b"}]] [[mock:tool:count_words:{"text": "a b"}]] '
    "[[mock:echo-tool-result]] What is the code of vault ORCHID? The code of vault ORCHID is 48213."
)
CELL = f"out = llm_batch([{PROMPT!r}])\nanswer['content'] = out[0]\nanswer['ready'] = True"


@pytest.fixture(scope="module")
def tool_fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    with LocalFleet(
        redis_url=redis_url,
        model=f"final-turn-{uuid.uuid4().hex[:6]}",
        workers=1,
        worker_args=["--allow-tool", COUNT_WORDS],
        log_dir=str(tmp_path_factory.mktemp("final-turn-logs")),
    ) as fleet:
        yield fleet


def served(fleet: LocalFleet, rollout_id: str) -> dict[str, Any]:
    """What the scripted model served for one rollout (workers send the rollout id as ``user``)."""
    with urllib.request.urlopen(str(fleet.base_url).removesuffix("/v1") + "/stats", timeout=10) as resp:
        return json.loads(resp.read())["per_user"].get(rollout_id, {})  # type: ignore[no-any-return]


async def run(fleet: LocalFleet, budget: int | None, **kw: Any) -> tuple[Any, str]:
    settings = load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model)
    rid = uuid.uuid4().hex
    row = DatasetRow(id="final", question="Final. " + root_code_directive(CELL), context="x")
    async with RLMEnv(
        settings=settings,
        sub_tools=[COUNT_WORDS],
        sub_llm_max_turns=2,
        sub_llm_max_completion_tokens=budget,
        include_sub_llm_in_trajectory=True,
        **kw,
    ) as env:
        res = await env.rollout(row, model=fleet.model, rollout_id=rid)
    assert res.row.stop_reason == "answer_ready", res.row.error
    return res, rid


async def test_with_budget_left_the_final_turn_answers_within_the_budget(tool_fleet: LocalFleet) -> None:
    res, rid = await run(tool_fleet, budget=200)
    result = next(e for e in res.trajectory if e["type"] == "llm_batch")["results"][0]
    assert result["status"] == "ok" and result["final_turn"] == "answered"
    # The scripted sub-LLM answers the last user message: the final-answer request holds no question.
    assert res.row.final_answer == "NOT FOUND"
    roles = [m["role"] for m in result["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant", "tool", "user", "assistant"]
    assert (result["turns"], result["tool_calls"]) == (3, 2)
    last = result["messages"][-2]  # the tools' results came before it
    assert last["role"] == "user" and "final answer" in last["content"]
    counted = served(tool_fleet, rid)
    assert counted["completions"] == 3
    m = res.row.metrics
    assert m["sub_llm_completion_tokens"] == counted["completion_tokens"] == m["sub_llm_budget_used"] <= 200


async def test_without_budget_left_the_final_turn_is_skipped_and_nothing_overshoots(tool_fleet: LocalFleet) -> None:
    res, rid = await run(tool_fleet, budget=6)  # the two tool turns spend all six tokens
    batch = next(e for e in res.trajectory if e["type"] == "llm_batch")
    result = batch["results"][0]
    assert result["status"] == "ok" and result["final_turn"] == "skipped"
    assert str(res.row.final_answer).startswith(
        "[sub-LLM used all 2 turn(s) calling tools; its final-answer turn was skipped: the sub-LLM token budget "
        "is spent (6/6 completion tokens used)]"
    )
    cell = next(e for e in res.trajectory if e["type"] == "cell")
    assert "final-answer turn skipped (budget spent)" in cell["output"]
    counted = served(tool_fleet, rid)
    assert counted["completions"] == 2 and counted["completion_tokens"] == 6  # no third call, no overshoot


async def test_the_final_turn_can_be_turned_off(tool_fleet: LocalFleet) -> None:
    res, rid = await run(tool_fleet, budget=200, sub_llm_final_answer_turn=False)
    result = next(e for e in res.trajectory if e["type"] == "llm_batch")["results"][0]
    assert result.get("final_turn") is None and result["turns"] == 2
    assert str(res.row.final_answer).startswith("[sub-LLM used all 2 turn(s) calling tools")
    assert served(tool_fleet, rid)["completions"] == 2
