"""Whole rollouts through real worker processes, the scripted model and a real Redis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import redis
from rq import Queue, Worker
from rq.registry import FinishedJobRegistry

from rlmq.cli.demo import needle_rows
from rlmq.cli.local import LocalFleet, child_env, rlmq_command
from rlmq.common.keys import queue_name_for_model
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv
from rlmq.scripted.server import root_code_directive

pytestmark = pytest.mark.e2e


def env_for(fleet: LocalFleet, **kw: Any) -> RLMEnv:
    overrides = {k: kw.pop(k) for k in list(kw) if k in ("sub_call_timeout",)}
    settings = load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model, **overrides)
    return RLMEnv(settings=settings, **kw)


def scripted(question: str, *codes: str) -> str:
    """A question whose root turns run exactly ``codes`` (turn 1, 2, ...)."""
    return question + " " + " ".join(root_code_directive(c, turn=i + 1) for i, c in enumerate(codes))


async def test_needle_rollouts_answer_correctly_with_metrics(fleet: LocalFleet) -> None:
    rows = [DatasetRow.model_validate(r) for r in needle_rows(3, min_chars=100_000, seed=7)]
    async with env_for(fleet) as env:
        results = await env.evaluate(rows, model=fleet.model, concurrency=3)
    for res in results:
        row = res.row
        assert row.correct, (row.final_answer, row.answer, row.error)
        assert row.stop_reason == "answer_ready"
        m = row.metrics
        assert m["sub_llm_call_count"] == m["sub_llm_max_batch_size"] >= 5  # 100K chars / 20K chunks
        assert m["sub_llm_batch_count"] == 1 and m["repl_call_count"] == 1 and m["main_rlm_turns"] == 1
        assert m["sub_llm_error_count"] == 0 and m["sub_llm_completion_tokens"] > 0
        assert m["sub_llm_queue_wait_seconds_mean"] >= 0
        kinds = [e["type"] for e in res.trajectory]
        assert kinds == ["root", "llm_batch", "cell"]
    sync = redis.Redis.from_url(str(fleet.redis_url))
    base = queue_name_for_model(fleet.model)
    q = Queue(base, connection=sync)
    # the producer enqueued on its tenant queue (this host's name), which the workers also serve
    tenant = Queue(load_settings(model=fleet.model).producer_queue(), connection=sync)
    assert tenant.name.startswith(base + "@")
    finished = FinishedJobRegistry(queue=tenant).get_job_ids()
    assert len(finished) >= sum(r.row.metrics["sub_llm_call_count"] for r in results)
    names = {w.name for w in Worker.all(queue=q)}
    assert len(names) == 2


ORDER_CODE = """
import random
prompts = []
for i in range(40):
    delay = random.choice([0, 0.05, 0.1, 0.2])
    prompts.append(f"What is the code of item {i}? [[mock:sleep:{delay}]]\\nThe code of item {i} is c{i}.")
out = llm_batch(prompts)
answer["content"] = ",".join(out)
answer["ready"] = True
"""


async def test_results_come_back_in_prompt_order(fleet: LocalFleet) -> None:
    row = DatasetRow(id="order", question=scripted("Order test.", ORDER_CODE), context="unused")
    async with env_for(fleet, max_sub_llm_parallelism=16) as env:
        res = await env.rollout(row, model=fleet.model)
    assert res.row.stop_reason == "answer_ready", res.row.error
    assert res.row.final_answer == ",".join(f"c{i}" for i in range(40))
    cell = next(e for e in res.trajectory if e["type"] == "cell")
    assert "llm_batch: 40 prompt(s)" in cell["output"]
    assert cell["output"].count(" ok ") == 40


DEADLINE_CODE = """
out = llm_batch([
    "What is the code of item 1?\\nThe code of item 1 is fast.",
    "What is the code of item 2? [[mock:sleep:30]]\\nThe code of item 2 is slow.",
])
answer["content"] = " | ".join(out)
answer["ready"] = True
"""


async def test_a_slow_sub_call_becomes_an_error_at_its_deadline(fleet: LocalFleet) -> None:
    row = DatasetRow(id="deadline", question=scripted("Deadline test.", DEADLINE_CODE), context="x")
    t0 = time.monotonic()
    async with env_for(fleet, sub_call_timeout=2.0) as env:
        res = await env.rollout(row, model=fleet.model)
    took = time.monotonic() - t0
    assert res.row.stop_reason == "answer_ready", res.row.error
    first, second = str(res.row.final_answer).split(" | ")
    assert first == "fast"
    assert second.startswith("[error]") and "deadline" in second
    assert took < 15, took
    assert res.row.metrics["sub_llm_error_count"] == 1


HANG_CODE = "x = 41\nwhile True:\n    pass\n"
AFTER_HANG_CODE = """
print("x survived:", "x" in globals())
answer["content"] = f"{len(context)}"
answer["ready"] = True
"""


async def test_a_hung_cell_restarts_the_repl_and_the_rollout_goes_on(fleet: LocalFleet) -> None:
    row = DatasetRow(id="hang", question=scripted("Hang test.", HANG_CODE, AFTER_HANG_CODE), context="abcdef")
    async with env_for(fleet, code_execution_timeout=1.0) as env:
        res = await env.rollout(row, model=fleet.model)
    assert res.row.stop_reason == "answer_ready", res.row.error
    assert res.row.final_answer == "6"
    cells = [e for e in res.trajectory if e["type"] == "cell"]
    assert cells[0]["timed_out"] and cells[0]["restarted"]
    assert "restarted" in cells[0]["output"]
    assert "x survived: False" in cells[1]["output"]
    assert res.row.metrics["main_rlm_turns"] == 2


async def test_no_tool_call_and_max_turns_stop_reasons(fleet: LocalFleet) -> None:
    async with env_for(fleet, max_turns=2) as env:
        plain = await env.rollout(
            DatasetRow(id="plain", question="Hi [[mock:no-tool]]", context="c"), model=fleet.model
        )
        looping = await env.rollout(
            DatasetRow(id="loop", question=scripted("Loop.", "print(1)", "print(2)", "print(3)"), context="c"),
            model=fleet.model,
        )
    assert plain.row.stop_reason == "no_tool_call"
    assert looping.row.stop_reason == "max_turns" and looping.row.metrics["main_rlm_turns"] == 2


def test_rlmq_run_on_a_dataset_written_by_someone_else(fleet: LocalFleet, tmp_path: Any) -> None:
    """`rlmq run` against a Redis with workers started by hand; `rq info` lists them meanwhile."""
    dataset = tmp_path / "ds.jsonl"
    needle = "The access code for the vault named ORCHID is 48213. "
    lines = [
        {
            "id": "q1",
            "question": "What is the access code for the vault named ORCHID?",
            "context": "Filler text. " * 3000 + needle + "More filler. " * 3000,
            "answer": "48213",
        },
        {
            "id": "q2",
            "question": "Which city hosts the archive of KESTREL?",
            "context": [f"Unrelated line {i}." for i in range(2000)] + ["The archive of KESTREL is hosted in Tallinn."],
            "answer": "Tallinn",
        },
    ]
    dataset.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "rows.jsonl"
    argv = rlmq_command(
        "run", str(dataset), "--base-url", str(fleet.base_url), "--model", fleet.model,
        "--redis-url", str(fleet.redis_url), "--output", str(out), "--quiet", "--run-dir", str(tmp_path / "run"),
        "--tenant", "someone-else",
    )  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=child_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert {r["id"]: r["correct"] for r in rows} == {"q1": True, "q2": True}, rows
    assert set(rows[0]) == {"id", "final_answer", "answer", "correct", "stop_reason", "metrics", "error"}
    assert "accuracy: 2/2" in proc.stdout
    assert (tmp_path / "run" / "report.html").is_file() and (tmp_path / "run" / "trajectories.jsonl").is_file()
    # Named, the queue limits the worker count to its own workers: a worker another test
    # module killed stays listed (as RQ lists any dead worker) until its key expires.
    queue = queue_name_for_model(fleet.model)
    info = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "rq"), "info", "--url", str(fleet.redis_url), queue],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert info.returncode == 0, info.stderr
    assert queue in info.stdout
    assert "2 workers" in info.stdout, info.stdout
    tenant_queue = Queue(
        f"{queue_name_for_model(fleet.model)}@someone-else", connection=redis.Redis.from_url(str(fleet.redis_url))
    )
    assert len(FinishedJobRegistry(queue=tenant_queue).get_job_ids()) >= 2  # the sub-calls went by --tenant
