"""The rollout engine end to end: a rollout run from its options alone by a process that has
only Redis and a model client, and the root loop's stops against the scripted model, through
real worker processes and a real Redis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from typing import Any

import redis

from rlmq.cli.local import LocalFleet, child_env
from rlmq.common.keys import queue_name_for_model, tenant_queue
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import RolloutOptions, load_settings
from rlmq.producer.env import RLMEnv
from rlmq.scripted.root_script import root_code_for
from rlmq.scripted.server import root_code_directive

ENGINE_ALONE = """
import asyncio, json, sys

import rlmq.common.settings as settings_module


def refuse(*args, **kwargs):
    raise AssertionError("the rollout engine built Settings or read the environment's settings")


settings_module.Settings.__init__ = refuse
settings_module.load_settings = refuse

from rlmq.common.connection import async_client
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import RolloutOptions
from rlmq.producer.engine import RolloutHost, run_rollout
from rlmq.producer.interception import InterceptionServer
from rlmq.producer.root import RootModel

redis_url, base_url, model, queue, rollout_id = sys.argv[1:6]
options = RolloutOptions.model_validate_json(sys.argv[6])
row = DatasetRow.model_validate_json(sys.argv[7])


async def main():
    redis = async_client(redis_url)
    root = RootModel(base_url, "EMPTY")
    server = InterceptionServer()
    await server.start()
    host = RolloutHost.build(redis, root, server)
    refresher = asyncio.create_task(host.live.refresh_forever(options.rollout_key_ttl / 3))
    try:
        res = await run_rollout(host, row, options, model=model, queue=queue, rollout_id=rollout_id)
    finally:
        refresher.cancel()
        await server.stop()
        await root.close()
        await redis.aclose()
    loaded = sorted(m for m in sys.modules if m.startswith(("rlmq.workers", "rlmq.producer.env", "rlmq.cli")))
    print(json.dumps({"row": res.row.model_dump(), "trajectory": res.trajectory, "loaded": loaded}))


asyncio.run(main())
"""


def model_stats(base_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/stats", timeout=10) as resp:
        stats: dict[str, Any] = json.load(resp)
    return stats


def scripted(question: str, *codes: str) -> str:
    """A question whose root turns run exactly ``codes`` (turn 1, 2, ...)."""
    return question + " " + " ".join(root_code_directive(c, turn=i + 1) for i, c in enumerate(codes))


def test_a_rollout_runs_from_its_options_alone_in_a_process_without_settings(fleet: LocalFleet) -> None:
    """No RLMEnv, no Settings (both refused in the child), hostile RLMQ_* variables that would
    change the rollout if anything read them: the options alone decide, and the answer is right."""
    needle = "The secret code of the vault is 4471."
    context = "Filler sentence about nothing in particular. " * 2000 + needle + " More filler text here." * 500
    question = "What is the secret code of the vault?"
    row = DatasetRow(
        id="alone", question=scripted(question, "print('warming up')", root_code_for(question)), context=context,
        answer="4471",
    )  # fmt: skip
    options = RolloutOptions(max_turns=4, sub_llm_max_completion_tokens=5000, max_sub_llm_parallelism=4)
    queue = tenant_queue(queue_name_for_model(fleet.model), "engine-alone")
    hostile = {
        "RLMQ_MAX_TURNS": "1",  # would stop it before its second turn
        "RLMQ_SUB_LLM_MAX_COMPLETION_TOKENS": "3",  # would reject every sub-call
        "RLMQ_ROLLOUT_TIMEOUT": "0.001",  # would end it at once
        "REDIS_URL": "redis://127.0.0.1:1/0",  # would connect nowhere
        "RLMQ_BASE_URL": "http://127.0.0.1:1/v1",
    }
    rid = f"alone-{os.getpid()}"
    argv = [sys.executable, "-c", ENGINE_ALONE, str(fleet.redis_url), str(fleet.base_url), fleet.model, queue, rid]
    argv += [options.model_dump_json(), row.model_dump_json()]
    done = subprocess.run(argv, env=child_env(hostile), capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    result = out["row"]
    assert result["stop_reason"] == "answer_ready", result
    assert result["final_answer"] == "4471" and result["correct"] is True and result["error"] is None
    m = result["metrics"]
    assert m["main_rlm_turns"] == 2 and m["sub_llm_call_count"] >= 2 and m["sub_llm_error_count"] == 0
    assert m["sub_llm_budget_limit"] == 5000 and 0 < m["sub_llm_budget_used"] <= 5000
    assert m["sub_llm_rejected_count"] == 0
    # a rollout without children: its tree is itself, charged what its sub-calls spent
    assert m["depth1_root_turns"] == m["main_rlm_turns"] and m["depth1_sub_llm_call_count"] == m["sub_llm_call_count"]
    assert m["rlm_call_count"] == 0 and m["tree_rollout_count"] == 1 and m["tree_depth"] == 1
    assert m["tree_charged_completion_tokens"] == m["sub_llm_completion_tokens"] == m["sub_llm_budget_used"]
    assert out["loaded"] == []  # neither the worker side, nor RLMEnv, nor the CLI
    # the sub-calls ran on the fleet's workers under the rollout's id, within its budget
    served = model_stats(str(fleet.base_url))["per_user"][rid]
    assert served["completions"] == m["sub_llm_call_count"] and served["completion_tokens"] == m["sub_llm_budget_used"]
    sync = redis.Redis.from_url(str(fleet.redis_url))
    try:
        assert sync.zscore("rlmq:rollouts", rid) is None
        assert all(sync.ttl(k) > 0 for k in sync.scan_iter(match=f"*{{{rid}}}*"))
    finally:
        sync.close()


def env_for(fleet: LocalFleet, **kw: Any) -> RLMEnv:
    settings = load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model)
    return RLMEnv(settings=settings, **kw)


async def test_no_turn_limit_runs_past_fifty_turns(fleet: LocalFleet) -> None:
    codes = [f"step = {i}" for i in range(1, 56)] + ["answer['content'] = str(step)\nanswer['ready'] = True"]
    row = DatasetRow(id="long", question=scripted("Count.", *codes), context="x")
    async with env_for(fleet, max_turns=0) as env:
        res = await env.rollout(row, model=fleet.model)
    assert res.row.stop_reason == "answer_ready", res.row.error
    assert res.row.final_answer == "55" and res.row.metrics["main_rlm_turns"] == 56
    async with env_for(fleet) as env:  # the default limit of 50 stops the same row
        res = await env.rollout(row, model=fleet.model)
    assert res.row.stop_reason == "max_turns" and res.row.metrics["main_rlm_turns"] == 50


HANG = "answer['content'] = 'partial'\nimport time\ntime.sleep(60)"
AFTER = "answer['ready'] = True"


async def test_abort_on_code_timeout_ends_the_rollout_at_the_timed_out_cell(fleet: LocalFleet) -> None:
    row = DatasetRow(id="hang", question=scripted("Hang.", HANG, AFTER), context="x")
    async with env_for(fleet, code_execution_timeout=1.0, abort_on_code_timeout=True) as env:
        res = await env.rollout(row, model=fleet.model)
    assert (res.row.stop_reason, res.row.error) == ("code_timeout", None)
    assert res.row.metrics["main_rlm_turns"] == 1 and res.row.metrics["repl_call_count"] == 1
    cell = next(e for e in res.trajectory if e["type"] == "cell")
    assert cell["timed_out"] is True
    async with env_for(fleet, code_execution_timeout=1.0) as env:  # default: the model reads it and goes on
        res = await env.rollout(row, model=fleet.model)
    assert res.row.stop_reason == "answer_ready" and res.row.metrics["main_rlm_turns"] == 2


async def test_the_context_warning_and_prompt_too_long_against_the_scripted_model(fleet: LocalFleet) -> None:
    # turn 1 prints 3,000 words; the model's window is 2,000 words: turn 2's prompt is refused
    words = "print(' '.join(['w'] * 3000))"
    question = scripted("Long. [[mock:context-tokens:2000]]", words, AFTER)
    row = DatasetRow(id="long-prompt", question=question, context="x")
    async with env_for(fleet, root_context_tokens=2000) as env:
        res = await env.rollout(row, model=fleet.model)
    assert (res.row.stop_reason, res.row.error) == ("prompt_too_long", None)
    assert res.row.metrics["main_rlm_turns"] == 1
    note = res.trajectory[-1]
    assert note["type"] == "note" and "maximum context length is 2000 tokens" in note["text"]
    # no declared window: no warning; a first prompt that fills 85 % of one: turn 1's tool message warns
    row = DatasetRow(id="warned", question=scripted("Warn.", "x = 1", AFTER), context="x")
    async with env_for(fleet) as env:
        res = await env.rollout(row, model=fleet.model)
    assert not any("[context warning]" in m["content"] for m in res.messages if m["role"] == "tool")
    first = res.trajectory[0]["usage"]["prompt"]
    async with env_for(fleet, root_context_tokens=int(first / 0.85)) as env:
        res = await env.rollout(row, model=fleet.model)
    assert res.row.stop_reason == "answer_ready"
    tools = [m["content"] for m in res.messages if m["role"] == "tool"]
    assert "[context warning]" in tools[0] and "[context warning]" not in tools[1]


RLM_CELL = """
out = rlm_batch([{"prompt": "What is the secret code of the vault?", "context": context},
                 {"prompt": "What is the colour of the door?", "context": "The colour of the door is green."},
                 "A bare task without a context."])
print(out)
answer["content"] = out[0]
answer["ready"] = True
"""


async def test_rlm_batch_at_max_depth_runs_plain_sub_llm_calls_on_the_workers(fleet: LocalFleet) -> None:
    """``max_depth=1`` (the default): the top rollout is at the deepest level, so ``rlm_batch``
    runs its tasks as sub-LLM calls on the fleet's workers, each task's context in its prompt."""
    context = "Filler sentence about nothing. " * 50 + "The secret code of the vault is 4471. " + "More filler. " * 50
    row = DatasetRow(id="rlm-flat", question=scripted("Use rlm_batch.", RLM_CELL), context=context, answer="4471")
    async with env_for(fleet, max_depth=1) as env:
        res = await env.rollout(row, model=fleet.model)
    assert res.row.stop_reason == "answer_ready", res.row.error
    assert "4471" in (res.row.final_answer or "")
    m = res.row.metrics
    assert m["rlm_call_count"] == 3 and m["sub_llm_call_count"] == 3 and m["sub_llm_error_count"] == 0
    (event,) = [e for e in res.trajectory if e["type"] in ("rlm_batch", "llm_batch")]
    assert event["type"] == "rlm_batch" and event["tasks"][0] == "What is the secret code of the vault?"
    assert [r["status"] for r in event["results"]] == ["ok"] * 3 and "green" in event["results"][1]["content"]
    assert all("child" not in r for r in event["results"])
    cell_output = next(m["content"] for m in res.messages if m["role"] == "tool")
    assert "rlm_batch: 3 task(s) as plain sub-LLM calls (depth 1 is the deepest, max_depth=1)" in cell_output
    assert "rlm_batch" not in res.messages[0]["content"]  # max_depth 1: the scaffold is as before
