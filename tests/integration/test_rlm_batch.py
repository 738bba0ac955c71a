"""``rlm_batch`` from a rollout's REPL to child-rollout jobs on a real Redis.

A top rollout (``max_depth=2``, scripted in-memory root model, the real sandboxed REPL and
interception server) calls ``rlm_batch`` in a cell; a test-only REPL host takes the
:class:`~rlmq.common.schemas.ChildRolloutRequest` jobs off ``child_queue(queue, 2)`` through the
job store (as a worker does: heartbeat, ``START``, ``FINISH``) and answers each with a
:class:`~rlmq.common.schemas.SubLLMResult` carrying a ``child`` outcome. The REPL host that runs
real child rollouts is the worker's (``rlmq worker --repl-slots``); this one only answers.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
import redis

from rlmq.common import keys as K
from rlmq.common.connection import async_client
from rlmq.common.jobs.record import CHILD_ROLLOUT_FUNC, decode_job_data, rq_return_value
from rlmq.common.jobs.store import FinishedJob, JobStore
from rlmq.common.schemas import ChildOutcome, ChildRolloutRequest, DatasetRow, SubLLMResult
from rlmq.common.settings import RolloutOptions
from rlmq.producer.engine import RolloutHost, run_rollout
from rlmq.producer.interception import InterceptionServer
from tests.root_fakes import FakeRoot, code_turn

pytestmark = pytest.mark.integration

CELL = (
    "out = rlm_batch(['first task', {'prompt': 'second task', 'context': {'rows': [1, 2, 3]}}])\n"
    "answer['content'] = ' | '.join(out)\n"
    "answer['ready'] = True\n"
)


async def answer_children(
    r: Any, queue: str, seen: list[tuple[ChildRolloutRequest, str]], n: int, ready: asyncio.Event
) -> None:
    """A test-only REPL host of ``queue``: answers ``n`` child-rollout jobs through the job store."""
    store = JobStore(r, queue, "test-repl-host", heartbeat_ttl=30)
    await store.heartbeat([], "idle")  # the dispatcher sees a live worker on the child queue
    pubsub = r.pubsub()
    await pubsub.subscribe(K.wake_channel(queue))
    ready.set()
    done = 0
    async with asyncio.timeout(60):
        while done < n:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
            if message is None:
                continue
            name, ids, _ = K.parse_wake_message(message["data"].decode())
            assert name == queue and ids, message  # the dispatcher names its jobs in the wake-up
            for job in await store.start([i.encode() for i in ids]):
                await answer(r, store, job, seen)
                done += 1
    await pubsub.aclose()


async def answer(r: Any, store: JobStore, job: Any, seen: list[tuple[ChildRolloutRequest, str]]) -> None:
    """Answer one started child-rollout job with a made-up child outcome."""
    func, args, _ = decode_job_data(job.data)
    assert func == CHILD_ROLLOUT_FUNC
    req = ChildRolloutRequest.model_validate(args[0])
    description = (await r.hget(K.rq_job(job.job_id), "description")).decode()
    seen.append((req, description))
    child = ChildOutcome(
        rollout_id=f"{req.child_id}-{job.attempt}", depth=req.depth, stop_reason="answer_ready",
        metrics={"main_rlm_turns": 3, "main_rlm_completion_tokens": 7},
        trajectory=[{"type": "turn", "question": req.prompt}],
    )  # fmt: skip
    result = SubLLMResult(
        rollout_id=req.rollout_id, batch_id=req.batch_id, index=req.index, job_id=job.job_id,
        status="ok", content=f"{req.prompt} -> {json.dumps(req.context)}", turns=3, child=child,
        worker="test-repl-host", attempt=job.attempt,
    )  # fmt: skip
    await store.finish([FinishedJob(job, True, result.model_dump_json(), rq_return_value("ok"))])


async def test_a_rollout_runs_rlm_batch_as_child_rollout_jobs(redis_url: str, real_redis: redis.Redis) -> None:
    queue = K.tenant_queue(K.queue_name_for_model("sub-m"), f"rlm{uuid.uuid4().hex[:6]}")
    child_q = K.child_queue(queue, 2)
    r = async_client(redis_url)
    server = InterceptionServer()
    await server.start()
    root = FakeRoot(code_turn(CELL))
    host = RolloutHost.build(r, root, server)
    seen: list[tuple[ChildRolloutRequest, str]] = []
    ready = asyncio.Event()
    answering = asyncio.create_task(answer_children(r, child_q, seen, 2, ready))
    async with asyncio.timeout(10):
        await ready.wait()
    options = RolloutOptions(max_depth=2, sub_model="sub-m", rollout_timeout=120, max_turns=3)
    row = DatasetRow(id="row1", question="Ask two children.", context="top context")
    try:
        res = await run_rollout(host, row, options, model="root-m", queue=queue, rollout_id="top1")
        await answering
    finally:
        answering.cancel()
        await server.stop()
        await r.aclose()
    assert res.row.stop_reason == "answer_ready", res.row.error
    assert res.row.final_answer == 'first task -> null | second task -> {"rows": [1, 2, 3]}'
    # the jobs: one per task, on the depth-2 queue, named for rq info / rq-dashboard
    reqs = sorted(seen, key=lambda s: s[0].index)
    assert [d for _, d in reqs] == [f"child rollout depth=2 parent=top1 index={i} model=sub-m" for i in range(2)]
    for req, _ in reqs:
        assert (req.rollout_id, req.depth, req.max_depth, req.nodes, req.ledger_id) == ("top1", 2, 2, ["top1"], "top1")
        assert req.model == "sub-m" and 100 < req.deadline - req.enqueued_at <= 120
        options_of_child = RolloutOptions.model_validate(req.options)
        assert options_of_child.max_depth == 2 and options_of_child.sub_model == "sub-m"
    assert reqs[0][0].child_id != reqs[1][0].child_id
    # the trajectory nests the children's, the metrics count them
    event = next(e for e in res.trajectory if e["type"] == "rlm_batch")
    assert event["tasks"] == ["first task", "second task"] and event["batch_id"] == "r1"
    assert [x["child"]["trajectory"] for x in event["results"]] == [
        [{"type": "turn", "question": "first task"}],
        [{"type": "turn", "question": "second task"}],
    ]
    m = res.row.metrics
    assert m["rlm_call_count"] == 2 and m["rlm_batch_count"] == 1 and m["tree_rollout_count"] == 3
    assert (m["depth2_rollouts"], m["depth2_root_turns"], m["depth2_root_completion_tokens"]) == (2, 6, 14)
    assert m["sub_llm_call_count"] == 0 and m["tree_depth"] == 2
    # the cell printed the summary; the root model saw it
    tool_message = next(msg["content"] for msg in res.messages if msg["role"] == "tool")
    assert "rlm_batch: 2 task(s) as child rollouts at depth 2 of 2" in tool_message
    # the scaffold told the root model about rlm_batch at depth 1 of 2
    system = root.calls[0]["messages"][0]["content"]
    assert "rlm_batch(tasks: list) -> list[str]" in system and "depth 1 of 2" in system
    # the jobs are recorded as RQ records them
    assert real_redis.zcard(K.rq_finished(child_q)) == 2
