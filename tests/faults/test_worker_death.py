"""A worker killed with ``kill -9`` while it holds 200 sub-calls, and a worker stopped with SIGTERM.

Detection time. A started job's score in RQ's started registry is the time its ownership
expires: the worker's heartbeat (every ``heartbeat_interval`` = 1 s) pushes it to
``now + job_heartbeat_ttl``. Once a worker dies, its jobs' scores lapse at most
``job_heartbeat_ttl`` seconds later, and the reaper of any live worker on the queue (every
``max(0.5, ttl / 4)`` s, jittered x0.5..1.5) re-queues them. So a dead worker's jobs are back
in the queue within ``ttl + 1.5 * max(0.5, ttl / 4)`` seconds of its death: 2.75 s with the
``--heartbeat-ttl 2`` used here, 13.75 s with the default of 10 s. A job re-queued then runs
again on a live worker (``job_max_attempts`` = 2) or, when out of attempts, gets an error
result; either way before the producer's deadline when ``sub_call_timeout`` exceeds the
detection time plus one call.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest
import redis
from rq import Queue
from rq.registry import StartedJobRegistry

import rlmq.producer.dispatch as dispatch_mod
from rlmq.cli.local import LocalFleet
from rlmq.common import keys as K
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.schemas import DatasetRow, SubLLMResult
from rlmq.common.settings import Settings, load_settings
from rlmq.producer.env import RLMEnv
from rlmq.scripted.server import root_code_directive
from tests.faults.conftest import (
    HEARTBEAT_TTL,
    await_until,
    model_stats,
    process_gone,
    start_named_worker,
    wait_until,
    worker_registered,
)

N_CALLS = 200
PER_CALL = 10  # tokens: every call spends exactly this (spend-all, per-call cap)
DETECTION = HEARTBEAT_TTL + 1.5 * max(0.5, HEARTBEAT_TTL / 4)


def batch_code(n: int, directive: str) -> str:
    return f"""
out = llm_batch([f"fault item {{i}}. {directive}" for i in range({n})])
answer["content"] = str(len(out))
answer["ready"] = True
"""


class DuplicateCounter:
    """Wraps the producer's result decoding to count every result that reaches it per slot."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: dict[tuple[str, str, int], int] = {}
        real = dispatch_mod.load_result

        def counting(raw: str | bytes) -> SubLLMResult:
            res = real(raw)
            key = (res.rollout_id, res.batch_id, res.index)
            self.seen[key] = self.seen.get(key, 0) + 1
            return res

        monkeypatch.setattr(dispatch_mod, "load_result", counting)

    @property
    def duplicates(self) -> int:
        return sum(n - 1 for n in self.seen.values() if n > 1)


def settings_for(fleet: LocalFleet, **kw: Any) -> Settings:
    return load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model, **kw)


async def test_kill9_worker_holding_200_calls(fault_fleet: LocalFleet, monkeypatch: pytest.MonkeyPatch) -> None:
    fleet = fault_fleet
    sync = redis.Redis.from_url(str(fleet.redis_url))
    victim, victim_name = start_named_worker(fleet, "victim")
    dups = DuplicateCounter(monkeypatch)
    timeout = 30.0
    settings = settings_for(fleet, sub_call_timeout=timeout)
    rid = f"kill9-{time.time_ns()}"
    budget = 100_000
    # Each call sleeps 3 s in the model server, so all 200 are in flight on the victim.
    code = batch_code(N_CALLS, "[[mock:sleep:3]] [[mock:spend-all]]")
    row = DatasetRow(id="kill9", question="Kill a worker. " + root_code_directive(code), context="x")
    async with RLMEnv(
        settings=settings,
        sub_llm_max_completion_tokens=budget,
        sub_llm_per_call_max_tokens=PER_CALL,
        max_sub_llm_parallelism=N_CALLS,
    ) as env:
        task = asyncio.create_task(env.rollout(row, model=fleet.model, rollout_id=rid))
        executions = K.rq_worker_executions(victim_name)

        async def victim_calls_model() -> bool:
            # all taken by the victim, and all reserved and sent to the model server
            if sync.scard(executions) < N_CALLS:
                return False
            stats = await asyncio.to_thread(model_stats, str(fleet.base_url))
            return bool(stats["per_user"].get(rid, {}).get("requests", 0) >= N_CALLS)

        await await_until(victim_calls_model, 30, f"the victim to have {N_CALLS} sub-calls at the model")
        t_kill = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        rescuer_name = f"rescuer-{os.getpid()}-{time.time_ns() % 10**6}"
        fleet.start_worker("rescuer", ["--name", rescuer_name])
        res = await asyncio.wait_for(task, timeout + DETECTION + 30)
        elapsed = time.monotonic() - t_kill

    assert res.row.stop_reason == "answer_ready", res.row.error
    assert res.row.final_answer == str(N_CALLS)
    batch = next(e for e in res.trajectory if e["type"] == "llm_batch")
    results = batch["results"]
    assert [r["index"] for r in results] == list(range(N_CALLS))
    # Every prompt got exactly one result: each re-ran on the rescuer (second attempt).
    assert all(r["status"] == "ok" for r in results), {r.get("error_kind") for r in results}
    assert {r["worker"] for r in results} == {rescuer_name}
    assert {r["attempt"] for r in results} == {2}
    assert dups.duplicates == 0
    assert len(dups.seen) == N_CALLS
    # Within the deadline plus detection (the batch was enqueued before the kill).
    assert elapsed < timeout + DETECTION

    # The budget ledger is exact: the victim's 200 reservations stay charged (open), the
    # rescuer's 200 were settled with what the server reported, and the server's own count
    # equals what was settled (the killed calls were cancelled before they were served).
    client = async_client(str(fleet.redis_url))
    try:
        snap = await BudgetLedger(client).snapshot(rid)
        resv = await client.hgetall(K.RolloutKeys(rid).reservations)
    finally:
        await client.aclose()
    assert snap is not None
    states = {k.decode(): v.decode() for k, v in resv.items()}
    open_ = {k for k, v in states.items() if v.startswith("open:")}
    assert len(open_) == N_CALLS and all(k.split(":")[1] == "1" for k in open_)  # attempt 1: the victim's
    assert all(states[k] == f"settled:{PER_CALL}" for k in states if k not in open_)
    served = model_stats(str(fleet.base_url))["per_user"].get(rid, {}).get("completion_tokens", 0)
    assert snap.used == served == N_CALLS * PER_CALL
    assert snap.charged == snap.used + PER_CALL * len(open_) <= budget
    assert snap.overrun == 0
    sync.close()


async def test_sigterm_finishes_in_flight_jobs(fault_fleet: LocalFleet) -> None:
    fleet = fault_fleet
    sync = redis.Redis.from_url(str(fleet.redis_url))
    proc, name = start_named_worker(fleet, "graceful")
    settings = settings_for(fleet, sub_call_timeout=30)
    n = 50
    code = batch_code(n, "[[mock:sleep:1.5]]")
    row = DatasetRow(id="term", question="Stop a worker. " + root_code_directive(code), context="x")
    async with RLMEnv(settings=settings, max_sub_llm_parallelism=n) as env:
        queue = settings.producer_queue(fleet.model)
        task = asyncio.create_task(env.rollout(row, model=fleet.model))

        async def holds_all() -> bool:
            return bool(sync.scard(K.rq_worker_executions(name)) >= n)

        await await_until(holds_all, 30, "the worker to hold the batch")
        os.kill(proc.pid, signal.SIGTERM)
        res = await asyncio.wait_for(task, 40)
    wait_until(lambda: proc.poll() is not None, 30, "the worker to exit after SIGTERM")
    assert proc.returncode == 0
    batch = next(e for e in res.trajectory if e["type"] == "llm_batch")
    assert [r["status"] for r in batch["results"]] == ["ok"] * n
    assert {r["worker"] for r in batch["results"]} == {name}
    started = StartedJobRegistry(queue=Queue(queue, connection=sync))
    assert started.get_job_ids() == []
    assert sync.zcard(K.rq_started(queue)) == 0
    assert not sync.sismember("rq:workers", K.rq_worker(name))  # it registered its death
    sync.close()


async def test_shutdown_past_grace_hands_jobs_back(fault_fleet: LocalFleet) -> None:
    """A worker whose grace period runs out hands its in-flight jobs back; another runs them."""
    from rlmq.workers.worker import SubLLMWorker

    fleet = fault_fleet
    sync = redis.Redis.from_url(str(fleet.redis_url))
    name = f"handback-{os.getpid()}-{time.time_ns() % 10**6}"
    wsettings = load_settings(
        redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model, job_heartbeat_ttl=HEARTBEAT_TTL
    )
    worker = SubLLMWorker(wsettings, name=name)
    run = asyncio.create_task(worker.run(grace=0.2))
    await await_until(lambda: asyncio.to_thread(worker_registered, sync, name), 30, "the in-process worker")
    settings = settings_for(fleet, sub_call_timeout=30)
    n = 20
    code = batch_code(n, "[[mock:sleep:2]] [[mock:fail-times:1]]")
    row = DatasetRow(id="handback", question="Hand back. " + root_code_directive(code), context="x")
    async with RLMEnv(settings=settings, max_sub_llm_parallelism=n) as env:
        queue = settings.producer_queue(fleet.model)
        task = asyncio.create_task(env.rollout(row, model=fleet.model))

        async def holds_all() -> bool:
            return len(worker.jobs) >= n

        await await_until(holds_all, 30, "the worker to hold the batch")
        worker.request_stop()
        await asyncio.wait_for(run, 15)
        # Handed back: queued again, none left started.
        assert sync.zcard(K.rq_started(queue)) == 0
        assert sync.llen(K.rq_queue(queue)) == n
        rescuer = f"after-handback-{os.getpid()}"
        fleet.start_worker("after-handback", ["--name", rescuer])
        res = await asyncio.wait_for(task, 40)
    batch = next(e for e in res.trajectory if e["type"] == "llm_batch")
    assert [r["status"] for r in batch["results"]] == ["ok"] * n
    assert {r["worker"] for r in batch["results"]} == {rescuer}
    assert StartedJobRegistry(queue=Queue(queue, connection=sync)).get_job_ids() == []
    sync.close()


def test_dead_process_helper() -> None:
    assert not process_gone(os.getpid())
