"""Redis restarted without persistence in the middle of a batch.

Everything in Redis is lost: queued and started jobs, reply lists, the worker's
registration. The batch that was in flight ends with error results at its deadline (its
jobs' state is gone; the worker's late results are not delivered because their started
record vanished), the producer notices within seconds that its jobs are gone and ends
the slots with ``redis_lost`` error results naming the restart (not at the 120 s deadline),
the worker reconnects with backoff and registers again, and the next rollout succeeds.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import redis

from rlmq.cli.local import LocalFleet
from rlmq.common import keys as K
from rlmq.common.redis_server import EmbeddedRedis
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv
from rlmq.scripted.server import root_code_directive
from tests.faults.conftest import HEARTBEAT_TTL, await_until, start_named_worker, wait_until

TIMEOUT = 120.0


def code_for(prompts: list[str]) -> str:
    return f"""
try:
    out = llm_batch({prompts!r})
    answer["content"] = "|".join(o[:7] for o in out)
except Exception as exc:
    answer["content"] = "raised: " + repr(exc)
answer["ready"] = True
"""


async def test_redis_restart_mid_batch(tmp_path_factory, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level("WARNING", logger="rlmq.dispatch")
    server = EmbeddedRedis().start()
    logs = tmp_path_factory.mktemp("restart-logs")
    fleet = LocalFleet(
        redis_url=server.url,
        model=f"restart-{uuid.uuid4().hex[:6]}",
        workers=0,
        worker_args=["--heartbeat-ttl", str(HEARTBEAT_TTL)],
        log_dir=str(logs),
    )
    try:
        fleet.start()
        sync = redis.Redis.from_url(server.url, socket_connect_timeout=0.5, socket_timeout=2)
        proc, name = start_named_worker(fleet, "survivor")
        settings = load_settings(
            redis_url=server.url, base_url=fleet.base_url, model=fleet.model, sub_call_timeout=TIMEOUT
        )
        n = 20
        lost = [f"Lost {i}. [[mock:sleep:2]]" for i in range(n)]
        row_a = DatasetRow(id="lost", question="Lost. " + root_code_directive(code_for(lost)), context="x")
        async with RLMEnv(settings=settings, max_sub_llm_parallelism=n) as env:
            task = asyncio.create_task(env.rollout(row_a, model=fleet.model))

            async def in_flight() -> bool:
                return bool(sync.scard(K.rq_worker_executions(name)) >= n)

            await await_until(in_flight, 30, "the batch to be in flight")
            t0 = time.monotonic()
            server.stop()
            server.start()  # same port, empty
            res_a = await asyncio.wait_for(task, 30)
            waited = time.monotonic() - t0
            # The batch whose state was lost ended with error results, by its deadline.
            assert res_a.row.stop_reason == "answer_ready", res_a.row.error
            assert res_a.row.final_answer == "|".join(["[error]"] * n), res_a.row.final_answer
            batch = next(e for e in res_a.trajectory if e["type"] == "llm_batch")
            kinds = {r["error_kind"] for r in batch["results"]}
            assert kinds == {"redis_lost"}, kinds
            assert all("Redis restarted" in r["content"] for r in batch["results"]), batch["results"][0]
            assert waited < 15, waited  # within seconds, not at the 120 s deadline
            assert "gone from Redis (Redis restarted" in caplog.text, caplog.text[-2000:]

            # The worker survived and registered again on the new, empty server.
            def registered() -> bool:
                try:
                    return bool(sync.sismember("rq:workers", K.rq_worker(name)))
                except redis.ConnectionError:
                    return False

            wait_until(registered, 20, "the worker to register again after the restart")
            assert proc.poll() is None

            ok = [f"After the restart {i}. The code is 77." for i in range(5)]
            row_b = DatasetRow(id="after", question="After. " + root_code_directive(code_for(ok)), context="x")
            res_b = await asyncio.wait_for(env.rollout(row_b, model=fleet.model), 30)
            assert res_b.row.stop_reason == "answer_ready", res_b.row.error
            batch = next(e for e in res_b.trajectory if e["type"] == "llm_batch")
            assert [r["status"] for r in batch["results"]] == ["ok"] * 5
        sync.close()
    finally:
        fleet.stop()
        server.stop()
        for f in sorted(os.listdir(logs)):
            with open(os.path.join(logs, f), errors="replace") as fh:
                print(f"----- {f} -----\n{fh.read()[-3000:]}")
