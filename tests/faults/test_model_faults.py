"""Model-server faults through a real worker process: each gives the documented retry or
error result (``workers/model.py``, ``workers/subllm.py``), and the worker stays healthy.

The worker runs with ``--model-retries 2`` (at most 3 attempts per call).
"""

from __future__ import annotations

import asyncio
import uuid

import redis

from rlmq.cli.local import LocalFleet
from rlmq.common import keys as K
from rlmq.common.connection import async_client
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv
from rlmq.scripted.server import root_code_directive
from tests.faults.conftest import model_stats, start_named_worker

TIMEOUT = 6.0  # sub-call deadline (s)
PER_CALL = 50

# (directive, expected status, expected error_kind, text the result must contain, model requests)
CASES = [
    ("[[mock:status:429:retry-after=1]] [[mock:fail-times:1]]", "ok", None, "", 2),
    ("[[mock:status:429:retry-after=0.2]]", "error", "model", "429 Too Many Requests after 3 attempts", 3),
    ("[[mock:status:500]]", "error", "model", "500 Internal Server Error after 3 attempts", 3),
    ("[[mock:status:503]] [[mock:fail-times:2]]", "ok", None, "", 3),
    ("[[mock:malformed]]", "error", "model", "not a chat completion", 3),
    ("[[mock:no-usage]]", "ok", None, "", 1),
    ("[[mock:reset]]", "error", "model", "connection to the model server", 3),
    ("[[mock:reset]] [[mock:fail-times:1]]", "ok", None, "", 2),
    ("[[mock:sleep:30]]", "error", "deadline", "deadline", 1),
]


async def test_model_faults_give_documented_results(fault_fleet: LocalFleet) -> None:
    fleet = fault_fleet
    sync = redis.Redis.from_url(str(fleet.redis_url))
    proc, name = start_named_worker(fleet, "faulty-model", "--model-retries", "2")
    tag = uuid.uuid4().hex[:8]  # fail-times counts attempts per prompt text: keep texts unique
    prompts = [f"Fault case {i} ({tag}). What is the code? {d}" for i, (d, *_rest) in enumerate(CASES)]
    code1 = f"out = llm_batch({prompts!r})\nprint(out)"
    code2 = (
        f"out2 = llm_batch(['After the faults ({tag}). The code is 4242. What is the code?'])\n"
        "answer['content'] = out2[0]\nanswer['ready'] = True"
    )
    question = "Faults. " + root_code_directive(code1) + root_code_directive(code2, turn=2)
    row = DatasetRow(id="faults", question=question, context="x")
    settings = load_settings(
        redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model, sub_call_timeout=TIMEOUT
    )
    rid = f"modelfaults-{tag}"
    async with RLMEnv(
        settings=settings, sub_llm_max_completion_tokens=10_000, sub_llm_per_call_max_tokens=PER_CALL
    ) as env:
        res = await asyncio.wait_for(env.rollout(row, model=fleet.model, rollout_id=rid), 60)
    assert res.row.stop_reason == "answer_ready", res.row.error
    batches = [e for e in res.trajectory if e["type"] == "llm_batch"]
    assert len(batches) == 2
    results = batches[0]["results"]
    for (directive, status, kind, needle, _), r in zip(CASES, results, strict=True):
        assert r["status"] == status, (directive, r)
        assert r.get("error_kind") == kind, (directive, r)
        assert needle in r["content"], (directive, r["content"])
    assert results[0]["seconds"] >= 0.9  # Retry-After: 1 was honoured
    # The worker stays healthy: the next batch is answered normally, and it still runs.
    assert batches[1]["results"][0]["status"] == "ok"
    assert not str(res.row.final_answer).startswith("[")
    assert proc.poll() is None
    # Attempts the model server saw: the retry layer retried exactly as documented.
    stats = model_stats(str(fleet.base_url))
    assert stats["per_user"][rid]["requests"] == sum(c[4] for c in CASES) + 1

    # Budget settlements: an HTTP error answer (500, 429) refunds the grant; a malformed
    # body, a reset, a timeout or a body without usage stays charged in full (tokens may
    # have been generated); usage reported settles with what the server counted.
    client = async_client(str(fleet.redis_url))
    try:
        resv = {k.decode(): v.decode() for k, v in (await client.hgetall(K.RolloutKeys(rid).reservations)).items()}
    finally:
        await client.aclose()
    job = f"{rid}-b1-"
    assert resv[f"{job}2:1:1"] == "settled:0"  # 500
    assert resv[f"{job}4:1:1"] == f"settled:{PER_CALL}"  # malformed
    assert resv[f"{job}5:1:1"] == f"settled:{PER_CALL}"  # no usage
    assert resv[f"{job}6:1:1"] == f"settled:{PER_CALL}"  # reset
    assert resv[f"{job}8:1:1"] in (f"settled:{PER_CALL}", f"open:{PER_CALL}")  # slower than the deadline
    sync.close()
