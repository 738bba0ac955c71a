"""Shared tools no worker can import: a sub-LLM's call runs in the rollout's process (this one).

``lookup`` lives in this test module and no worker allow-lists it, so every call must travel
through Redis to the rollout and run here: ``CALLS`` counts them in this process.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlmq.cli.local import LocalFleet
from rlmq.common.metrics import Metrics
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv
from rlmq.scripted.server import root_code_directive

pytestmark = pytest.mark.e2e

CALLS: Counter[str] = Counter()
RELEASE = threading.Event()


def lookup(key: str) -> str:
    """Look a key up in the author's own table.

    Args:
        key: the key; "slow..." takes a second, "hang" waits (at most 20 s) until released.
    """
    CALLS[key] += 1
    if key.startswith("slow"):
        time.sleep(1.0)
    if key == "hang":
        RELEASE.wait(20)
    return f"value-of-{key}-" + "x" * 400


def batch_code(keys: list[str]) -> str:
    prompts = [
        f'Find {k}. [[mock:tool:lookup:{{"key": "{k}"}}]] [[mock:echo-tool-result]] [[mock:tokens:300]]' for k in keys
    ]
    return f"""
out = llm_batch({prompts!r})
answer["content"] = " || ".join(out)
answer["ready"] = True
"""


@pytest.fixture(scope="module")
def fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    logs = tmp_path_factory.mktemp("hosted-logs")
    allow = ["--allow-tool", "rlmq.workers.tools.count_words"]  # the fast path for this one, not for lookup
    with LocalFleet(
        redis_url=redis_url, model=f"hosted-{uuid.uuid4().hex[:6]}", workers=1, worker_args=allow, log_dir=str(logs)
    ) as f:
        yield f


async def run(fleet: LocalFleet, keys: list[str], code: str = "", **kw: object) -> tuple[list[str], Metrics]:
    settings = load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model, **kw)
    metrics = Metrics()
    row = DatasetRow(id="hosted", question="Hosted. " + root_code_directive(code or batch_code(keys)), context="x")
    tools = [lookup, "rlmq.workers.tools:count_words"]
    async with RLMEnv(settings=settings, tools=tools, metrics=metrics) as env:
        res = await env.rollout(row, model=fleet.model)
    assert res.row.stop_reason == "answer_ready", res.row.error
    return str(res.row.final_answer).split(" || "), metrics


def counted(metrics: Metrics, outcome: str) -> float:
    return float(metrics.hosted_tool_calls.labels(outcome=outcome)._value.get())


async def test_a_shared_callable_no_worker_imports_runs_in_the_rollouts_process(fleet: LocalFleet) -> None:
    keys = [f"k{i}-{uuid.uuid4().hex[:4]}" for i in range(4)]
    answers, metrics = await run(fleet, keys)
    for key, answer in zip(keys, answers, strict=True):
        assert f"tool result: value-of-{key}-xxx" in answer, answer
    assert {k: CALLS[k] for k in keys} == dict.fromkeys(keys, 1)
    assert counted(metrics, "ok") == 4


async def test_a_hanging_callable_gives_a_timeout_line_not_a_hang(fleet: LocalFleet) -> None:
    RELEASE.clear()
    t0 = time.monotonic()
    try:
        answers, metrics = await run(fleet, ["hang"], hosted_tool_timeout=1.0)
    finally:
        RELEASE.set()
    assert time.monotonic() - t0 < 15
    assert "tool result: [tool error] lookup timed out after 1 s" in answers[0], answers
    assert counted(metrics, "error") == 1


async def test_a_shared_tool_the_worker_allow_lists_runs_on_the_worker(fleet: LocalFleet) -> None:
    code = """
out = llm_batch(['Count. [[mock:tool:count_words:{"text": "one two three four"}]] [[mock:echo-tool-result]]'])
answer["content"] = " || ".join(out)
answer["ready"] = True
"""
    answers, metrics = await run(fleet, [], code=code)
    assert "tool result: 4" in answers[0], answers
    assert counted(metrics, "ok") == counted(metrics, "error") == 0  # nothing ran in this process


def child_task(key: str) -> str:
    """An ``rlm_batch`` task whose child rollout asks one sub-LLM to call ``lookup(key)``."""
    return "child " + root_code_directive(batch_code([key]))


async def test_the_sub_llms_of_child_rollouts_reach_the_tops_process(redis_url: str, tmp_path: Path) -> None:
    """Children run on a REPL host, their sub-calls on a worker; neither imports ``lookup``: each
    call travels to the top rollout's process (this one), once, and its answer back down the tree."""
    keys = [f"c{i}-{uuid.uuid4().hex[:4]}" for i in range(2)]
    tasks = [child_task(k) for k in keys]
    top = f"got = rlm_batch({tasks!r})\nanswer['content'] = ' || '.join(got)\nanswer['ready'] = True"
    with LocalFleet(
        redis_url=redis_url, model=f"hosted-tree-{uuid.uuid4().hex[:6]}", workers=1, repl_slots=2,
        log_dir=str(tmp_path / "logs"),
    ) as tree_fleet:  # fmt: skip
        tree_fleet.wait_for_workers(1)
        answers, metrics = await run(tree_fleet, [], code=top, max_depth=2)
    for key, answer in zip(keys, answers, strict=True):
        assert f"tool result: value-of-{key}-xxx" in answer, answer
    assert {k: CALLS[k] for k in keys} == dict.fromkeys(keys, 1)
    assert counted(metrics, "ok") == 2


async def test_a_hung_shared_tool_frees_the_worker_slot_by_the_deadline(redis_url: str, tmp_path: Path) -> None:
    """The tool hangs (its rollout ended, nobody answers), the sub-call's deadline is 2 s: the
    worker's only slot is free again by then, not at the tool's timeout plus the answer grace."""
    RELEASE.clear()
    try:
        with LocalFleet(
            redis_url=redis_url, model=f"hosted-dl-{uuid.uuid4().hex[:6]}", workers=1, worker_concurrency=1,
            log_dir=str(tmp_path / "logs"),
        ) as one_slot:  # fmt: skip
            one_slot.wait_for_workers(1)
            answers, _ = await run(one_slot, ["hang"], sub_call_timeout=2.0, hosted_tool_timeout=15.0)
            assert "within its deadline" in answers[0], answers
            code = 'out = llm_batch(["plain"])\nanswer["content"] = " || ".join(out)\nanswer["ready"] = True'
            t0 = time.monotonic()
            await run(one_slot, [], code=code)
            assert time.monotonic() - t0 < 8, "the slot stayed held by a call past its deadline"
    finally:
        RELEASE.set()
