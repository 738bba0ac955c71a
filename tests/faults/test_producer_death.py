"""A producer killed with ``kill -9`` while its jobs wait in the queue.

Its queued jobs' hashes expire with their deadline (``ttl`` = timeout + 1 s), and a worker
that reaches one drops it unstarted; jobs already running finish and push to a reply list
nobody reads, which expires. Every key the rollout left has a TTL; its REPL child exits
(EOF on its command pipe); the worker is not blocked and serves the next producer at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import psutil
import redis

from rlmq.cli.local import LocalFleet, child_env
from rlmq.common import keys as K
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv
from rlmq.scripted.server import root_code_directive
from tests.faults.conftest import model_stats, process_gone, start_named_worker, wait_until

TIMEOUT = 4.0
N = 300

PRODUCER = f"""
import asyncio, sys
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv
from rlmq.scripted.server import root_code_directive

redis_url, base_url, model, rid = sys.argv[1:5]
code = "llm_batch([f'Doomed {{i}}. [[mock:sleep:1]]' for i in range({N})])"

async def main():
    settings = load_settings(redis_url=redis_url, base_url=base_url, model=model, sub_call_timeout={TIMEOUT},
                             rollout_key_ttl=10)
    row = DatasetRow(id="doomed", question="Doomed. " + root_code_directive(code), context="x")
    async with RLMEnv(settings=settings, max_sub_llm_parallelism={N}) as env:
        await env.rollout(row, model=model, rollout_id=rid)

asyncio.run(main())
"""


async def test_producer_killed_while_its_jobs_are_queued(fault_fleet: LocalFleet) -> None:
    fleet = fault_fleet
    sync = redis.Redis.from_url(str(fleet.redis_url))
    worker, name = start_named_worker(fleet, "bystander", "--concurrency", "16")
    rid = f"doomed-{time.time_ns()}"
    settings = load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model)
    queue = settings.producer_queue(fleet.model)
    producer = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, str(fleet.redis_url), str(fleet.base_url), fleet.model, rid],
        env=child_env(), cwd=os.getcwd(), start_new_session=True,
    )  # fmt: skip
    try:
        wait_until(
            lambda: sync.llen(K.rq_queue(queue)) >= N - 16 and sync.scard(K.rq_worker_executions(name)) >= 16,
            30,
            "the producer's jobs to be queued and the worker busy",
        )
        children = [c.pid for c in psutil.Process(producer.pid).children(recursive=True)]
        assert children, "the producer has a REPL child"
        os.kill(producer.pid, signal.SIGKILL)
        producer.wait(10)
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.wait()
    t_kill = time.monotonic()
    # Its REPL child exits by itself (EOF on its command pipe).
    wait_until(lambda: all(process_gone(p) for p in children), 15, "the orphaned REPL to exit")
    # The queue drains: expired jobs are dropped, running ones finish; nothing stays started.
    wait_until(
        lambda: sync.llen(K.rq_queue(queue)) == 0 and sync.zcard(K.rq_started(queue)) == 0,
        TIMEOUT + 15,
        "the dead producer's jobs to drain",
    )
    drained = time.monotonic() - t_kill
    served = model_stats(str(fleet.base_url))["per_user"].get(rid, {}).get("requests", 0)
    assert served < N / 2, f"{served} of the dead producer's jobs reached the model"
    assert drained < TIMEOUT + 10
    # Every key of the dead rollout has a TTL (nothing is left forever).
    keys = list(sync.scan_iter(match=f"*{rid}*", count=1000))
    assert keys
    persistent = [k for k in keys if sync.ttl(k) == -1]
    assert persistent == []
    # The worker was not blocked: it serves the next producer at once.
    ok = RLMEnv(settings=load_settings(
        redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model, sub_call_timeout=20
    ), max_sub_llm_parallelism=8)  # fmt: skip
    code = "out = llm_batch([f'Next {i}. The code is 5.' for i in range(8)])\nanswer['content'] = str(len(out))\n"
    code += "answer['ready'] = True"
    row = DatasetRow(id="next", question="Next. " + root_code_directive(code), context="x")
    async with ok as env:
        res = await asyncio.wait_for(env.rollout(row, model=fleet.model), 30)
    batch = next(e for e in res.trajectory if e["type"] == "llm_batch")
    assert [r["status"] for r in batch["results"]] == ["ok"] * 8
    assert worker.poll() is None
    sync.close()
