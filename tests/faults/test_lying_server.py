"""A model server that lies about its tokens: non-finite or positive logprobs, more completion ids
than ``max_tokens``, a flood of ids, a ``usage`` below what it served. No lie becomes a trainable
turn, a non-finite value in a file, an unbounded Redis value or a charge below what was served.

The model is the scripted server (a test double); the sub-calls run on a worker's own code (in
this process) or on a real fleet of worker processes.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import fakeredis.aioredis
import pytest

from rlmq.cli.export_samples import export_samples
from rlmq.cli.local import LocalFleet
from rlmq.cli.report import write_run
from rlmq.common.jobs.spill import spill_result
from rlmq.common.schemas import DatasetRow, SubLLMRequest, SubLLMResult
from rlmq.common.settings import load_settings
from rlmq.common.token_wire import expand_trajectory
from rlmq.producer.env import RLMEnv
from rlmq.scripted.server import ScriptedModelServer, root_code_directive
from rlmq.workers.model import ChatClient
from rlmq.workers.subllm import SubLLMContext, run_sub_llm
from rlmq.workers.tools import ToolRegistry
from tests.faults.conftest import model_stats

LIES = {"nan": "bad_logprob", "inf": "bad_logprob", "-inf": "bad_logprob", "positive": "bad_logprob"}


def strict_json(line: str) -> Any:
    """``line`` parsed as strict JSON (RFC 8259): ``NaN`` and ``Infinity`` are refused, as most
    readers outside Python refuse them."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(line, parse_constant=refuse)


def request(prompt: str, max_tokens: int | None = None) -> SubLLMRequest:
    now = time.time()
    return SubLLMRequest(
        model="m", rollout_id="r1", batch_id="b1", index=0, prompt=prompt, enqueued_at=now, deadline=now + 60,
        include_sub_llm_in_trajectory=True, max_turns=2, max_completion_tokens=max_tokens,
    )  # fmt: skip


async def call(server: ScriptedModelServer, req: SubLLMRequest, max_ids: int | None = None) -> SubLLMResult:
    async with ChatClient(server.url, retries=0) as client:
        ctx = SubLLMContext(client=client, ledger=None, tools=ToolRegistry.from_paths([]), worker_name="w")
        if max_ids is not None:
            ctx.turn_token_max_ids = max_ids
        return await run_sub_llm(req, ctx, job_id="j1")


@pytest.mark.parametrize("lie", sorted(LIES))
async def test_a_lying_logprob_makes_the_turn_untrainable(lie: str) -> None:
    async with ScriptedModelServer() as server:
        res = await call(server, request(f"say hello [[mock:token-ids:{lie}]]"))
    assert res.status == "ok" and res.content
    assert res.turn_tokens is not None and [t.untrainable for t in res.turn_tokens] == [LIES[lie]]
    (step,) = expand_trajectory([{"type": "llm_batch", "results": [res.model_dump()]}])[0]["results"][0]["steps"]
    assert step["trainable"] is False and "completion_logprobs" not in step
    strict_json(res.model_dump_json())


async def test_more_completion_ids_than_max_tokens_is_untrainable() -> None:
    async with ScriptedModelServer() as server:
        res = await call(server, request("say hello [[mock:token-ids:flood-3000]]", max_tokens=2048))
    assert res.status == "ok" and res.content
    assert res.turn_tokens is not None and [t.untrainable for t in res.turn_tokens] == ["over_max_tokens"]
    assert res.completion_tokens == 3000 and res.overrun_tokens == 3000 - 2048  # charged what it served


async def test_a_flood_of_ids_never_reaches_redis_whole() -> None:
    """300,000 completion ids (a 3.2 MB payload before this bound) against the default bound of
    262,144 ids per turn, and 5,000 against a bound set to 4,096: dropped on the worker, the
    answer kept; the value the worker writes to Redis (its result, spilled or not) stays small."""
    redis = fakeredis.aioredis.FakeRedis()
    async with ScriptedModelServer() as server:
        big = await call(server, request("say hello [[mock:token-ids:flood-300000]]"))
        small = await call(server, request("say hello [[mock:token-ids:flood-5000]]"), max_ids=4096)
    for res in (big, small):
        assert res.status == "ok" and res.content
        assert res.turn_tokens is not None and [t.untrainable for t in res.turn_tokens] == ["too_many_ids"]
        await spill_result(redis, res, time.time() + 30)
        assert len(res.model_dump_json()) < 16_000
    assert big.completion_tokens == 300_000  # charged what it served
    sizes = [await redis.memory_usage(k) or 0 for k in await redis.keys("*")]
    assert all(s < 16_000 for s in sizes), sizes


async def test_no_lie_reaches_trajectories_or_samples(fault_fleet: LocalFleet, tmp_path: Path) -> None:
    """Root turns that lie (the question's directive) and sub-calls that lie, on real workers:
    ``trajectories.jsonl`` and ``samples.jsonl`` are strict JSON and keep no lying turn."""
    fleet = fault_fleet
    fleet.start_worker("liar-host")
    fleet.wait_for_workers(1)
    settings = load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model)
    prompts = [f"part {lie} [[mock:token-ids:{lie}]]" for lie in sorted(LIES)] + ["honest part"]
    code = f"out = llm_batch({prompts!r})\nanswer['content'] = 'done'\nanswer['ready'] = True\n"
    row = DatasetRow(id="liar", question="Lie. [[mock:token-ids:positive]] " + root_code_directive(code), context="x")
    async with RLMEnv(settings=settings, include_sub_llm_in_trajectory=True) as env:
        res = await env.rollout(row, model=fleet.model, rollout_id=f"liar-{uuid.uuid4().hex[:8]}")
    assert res.row.stop_reason == "answer_ready", res.row.error
    folder = write_run(tmp_path / "run", [res], {"command": "test"})
    _, count, _ = export_samples(folder)
    lines = [strict_json(x) for x in (folder / "trajectories.jsonl").read_text().splitlines()]
    samples = [strict_json(x) for x in (folder / "samples.jsonl").read_text().splitlines()]
    [batch] = [e for e in lines[0]["trajectory"] if e["type"] == "llm_batch"]
    steps = [s for r in batch["results"] for s in r["steps"]]
    assert [s.get("untrainable_reason") for s in steps] == [*(LIES[k] for k in sorted(LIES)), None]
    roots = [e for e in lines[0]["trajectory"] if e["type"] == "root"]
    assert roots and all(e["untrainable_reason"] == "bad_logprob" for e in roots)
    assert count == len(samples) == 1 and samples[0]["kind"] == "sub"  # the honest sub-call only
    assert res.row.metrics["untrainable_turns_bad_logprob"] == len(LIES) + len(roots)


async def test_an_under_reporting_server_is_charged_what_it_served(fault_fleet: LocalFleet) -> None:
    """A server whose ``usage`` says a quarter of what it served, with token ids on: the budget
    holds against what it served (its own count), and the disagreement is counted."""
    fleet = fault_fleet
    fleet.start_worker("under-host")
    fleet.wait_for_workers(1)
    budget = 10_000
    settings = load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model)
    code = (
        "out = llm_batch([f'part {i} [[mock:usage-quarter]] [[mock:tokens:1000]]' for i in range(40)])\n"
        "answer['content'] = 'done'\nanswer['ready'] = True\n"
    )
    rid = f"under-{uuid.uuid4().hex[:8]}"
    row = DatasetRow(id="under", question="Under-report. " + root_code_directive(code), context="x")
    async with RLMEnv(
        settings=settings, include_sub_llm_in_trajectory=True, sub_llm_max_completion_tokens=budget,
        sub_llm_per_call_max_tokens=1000, max_sub_llm_parallelism=8,
    ) as env:  # fmt: skip
        res = await env.rollout(row, model=fleet.model, rollout_id=rid)
    assert res.row.stop_reason == "answer_ready", res.row.error
    served = int(model_stats(str(fleet.base_url))["per_user"][rid]["completion_tokens"])
    m = res.row.metrics
    assert 0 < served <= budget, (served, m)
    assert m["sub_llm_completion_tokens"] == served
    assert m["sub_llm_underreported_tokens"] >= served // 2  # each reply said a quarter of it
