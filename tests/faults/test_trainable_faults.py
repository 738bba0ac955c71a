"""Trainable turns under faults: a sub-call retried after ``kill -9`` of its worker, and a child
rollout re-run after ``kill -9`` of its REPL host. Only the attempt whose answer reached the
parent gives turns: none lost, none twice, each equal to what the server served.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from rlmq.cli.local import LocalFleet
from rlmq.common import keys as K
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.common.token_wire import expand_trajectory
from rlmq.producer.env import RLMEnv
from rlmq.scripted.server import root_code_directive
from tests.e2e.test_child_host import DEADLINE, enqueue_child, repl_pids_of, replies
from tests.faults.conftest import HEARTBEAT_TTL, await_until, model_stats, start_named_worker, wait_until

N_CALLS = 4


def served(base_url: str) -> list[dict[str, Any]]:
    """``GET /served`` of the scripted model."""
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/served", timeout=30) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
    return list(doc["served"])


def key(t: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(t["prompt_token_ids"]), tuple(t["completion_token_ids"]), tuple(t["completion_logprobs"])


async def test_a_sub_call_retried_after_kill_9_gives_its_turns_once(fault_fleet: LocalFleet) -> None:
    fleet = fault_fleet
    victim, victim_name = start_named_worker(fleet, "victim")
    settings = load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model, sub_call_timeout=30)
    rid = f"train-kill9-{time.time_ns()}"
    code = f"""
out = llm_batch([f"item {{i}} [[mock:sleep:2]] " + "word " * 500 for i in range({N_CALLS})])
answer["content"] = str(len(out))
answer["ready"] = True
"""
    row = DatasetRow(id="k", question="Kill a worker. " + root_code_directive(code), context="x")
    sync = redis.Redis.from_url(str(fleet.redis_url))
    async with RLMEnv(settings=settings, include_sub_llm_in_trajectory=True) as env:
        task = asyncio.create_task(env.rollout(row, model=fleet.model, rollout_id=rid))

        async def at_model() -> bool:
            stats = await asyncio.to_thread(model_stats, str(fleet.base_url))
            return bool(stats["per_user"].get(rid, {}).get("requests", 0) >= N_CALLS)

        await await_until(at_model, 30, "the victim's calls at the model")
        assert sync.scard(K.rq_worker_executions(victim_name)) == N_CALLS
        os.kill(victim.pid, signal.SIGKILL)
        fleet.start_worker("rescuer")
        res = await asyncio.wait_for(task, 30 + HEARTBEAT_TTL + 30)
    sync.close()
    assert res.row.stop_reason == "answer_ready", res.row.error
    [batch] = [e for e in expand_trajectory(res.trajectory) if e["type"] == "llm_batch"]
    assert [r["attempt"] for r in batch["results"]] == [2] * N_CALLS
    steps = [s for r in batch["results"] for s in r["steps"]]
    assert len(steps) == N_CALLS and all(s["trainable"] for s in steps)
    mine = [s for s in served(str(fleet.base_url)) if s["user"] == rid]
    # the killed attempts were cut before an answer was served: what was served is what is kept
    assert Counter(key(s) for s in steps) == Counter(key(s) for s in mine)
    assert res.row.metrics["trainable_turn_count"] == N_CALLS + 1  # the sub-calls and the root turn


HOST_HEARTBEAT_TTL = 6
"""Seconds: a hosted child's job heartbeat lapsed within 2 s on a loaded 2-core machine (a
child that was alive was taken back), so its hosts here are declared dead after 6."""


@pytest.fixture
def host_fleet(redis_url: str, tmp_path: Any) -> Iterator[LocalFleet]:
    """The scripted model and no worker yet (the test starts two REPL hosts)."""
    with LocalFleet(
        redis_url=redis_url, model=f"train-child-{uuid.uuid4().hex[:6]}", workers=0, worker_concurrency=8,
        worker_args=["--repl-slots", "1", "--heartbeat-ttl", str(HOST_HEARTBEAT_TTL)], worker_grace=1.0,
        log_dir=str(tmp_path / "logs"),
    ) as f:  # fmt: skip
        yield f


def test_a_child_re_run_after_kill_9_of_its_host_gives_only_the_answering_runs_turns(host_fleet: LocalFleet) -> None:
    r = redis.Redis.from_url(str(host_fleet.redis_url))
    workers = [host_fleet.start_worker("host-a"), host_fleet.start_worker("host-b")]
    host_fleet.wait_for_workers(2)
    # the cell sleeps in the REPL first (the host is killed then), then makes one leaf sub-call
    code = "import time; time.sleep(4); llm_batch(['leaf ' + 'word ' * 300]); answer.update(content='ok', ready=True)"
    queue = K.queue_name_for_model(host_fleet.model)
    req = enqueue_child(str(host_fleet.redis_url), queue, code, include_sub_llm_in_trajectory=True)
    first, second = f"{req.child_id}-1", f"{req.child_id}-2"
    base = str(host_fleet.base_url)
    host, _ = wait_until(lambda: repl_pids_of(workers, 1), 30, "the REPL of the child")
    wait_until(lambda: r.exists(K.RolloutKeys(first).info), 10, "the child announced")
    served_root = lambda: model_stats(base)["per_role"]["root"]["completions"] >= 1  # noqa: E731
    wait_until(served_root, 10, "its first root turn served (its cell then sleeps 4 s)")
    host.send_signal(signal.SIGKILL)
    host.wait(10)
    [res] = wait_until(lambda: replies(r, req), DEADLINE, "the re-run child's result")
    assert res.status == "ok" and res.attempt == 2 and res.child is not None and res.child.rollout_id == second
    if res.spilled:  # read as the parent does
        from rlmq.common.connection import async_client
        from rlmq.common.jobs.spill import unspill

        async def read() -> None:
            client = async_client(str(host_fleet.redis_url))
            try:
                await unspill(client, [res])
            finally:
                await client.aclose()

        asyncio.run(read())
    trajectory = expand_trajectory(res.child.trajectory)
    roots = [e for e in trajectory if e["type"] == "root"]
    steps = [s for e in trajectory if e["type"] == "llm_batch" for x in e["results"] for s in x["steps"]]
    log = served(base)
    assert len(roots) == 1 and len(steps) == 1 and all(t["trainable"] for t in [*roots, *steps])
    assert Counter(key(s) for s in steps) == Counter(key(s) for s in log if s["user"] == second)
    assert all(key(s) not in {key(x) for x in log if x["user"] == first} for s in steps)
    served_roots = Counter(key(s) for s in log if s["role"] == "root")
    assert all(served_roots[key(t)] == 1 for t in roots)  # each was served once, and is kept once
    assert sum(served_roots.values()) >= 2  # the dead run's first root turn was served too, and is not kept
    r.close()


async def test_a_worker_stopped_and_resumed_after_its_job_was_re_run_leaves_no_spilled_payload(
    fault_fleet: LocalFleet,
) -> None:
    """SIGSTOP of the worker while its calls are at the model, a rescuer re-runs them, then
    SIGCONT: the stopped worker's late answers spill (their payloads are large), its FINISH is
    not recorded, and it deletes what it spilled instead of leaving it until the TTL."""
    fleet = fault_fleet
    victim, victim_name = start_named_worker(fleet, "stopped")
    settings = load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model, sub_call_timeout=60)
    rid = f"train-stop-{time.time_ns()}"
    code = f"""
out = llm_batch([f"item {{i}} [[mock:sleep:2]] " + "word " * 4000 for i in range({N_CALLS})])
answer["content"] = str(len(out))
answer["ready"] = True
"""
    row = DatasetRow(id="s", question="Stop a worker. " + root_code_directive(code), context="x")
    sync = redis.Redis.from_url(str(fleet.redis_url))
    base = str(fleet.base_url)
    try:
        async with RLMEnv(settings=settings, include_sub_llm_in_trajectory=True) as env:
            task = asyncio.create_task(env.rollout(row, model=fleet.model, rollout_id=rid))

            async def at_model() -> bool:
                stats = await asyncio.to_thread(model_stats, base)
                return bool(stats["per_user"].get(rid, {}).get("requests", 0) >= N_CALLS)

            await await_until(at_model, 30, "the victim's calls at the model")
            os.kill(victim.pid, signal.SIGSTOP)
            fleet.start_worker("rescuer")
            res = await asyncio.wait_for(task, 60 + HEARTBEAT_TTL + 30)
        assert res.row.stop_reason == "answer_ready", res.row.error
        [batch] = [e for e in res.trajectory if e["type"] == "llm_batch"]
        assert [r["attempt"] for r in batch["results"]] == [2] * N_CALLS
        os.kill(victim.pid, signal.SIGCONT)
        pattern = K.RolloutKeys(rid).spill("*", 1)
        served_twice = lambda: model_stats(base)["per_user"][rid]["completions"] >= 2 * N_CALLS  # noqa: E731
        wait_until(served_twice, 30, "the resumed worker's calls answered")
        # its results spill (within milliseconds), its FINISH records none of them; what it
        # spilled goes with them, instead of staying until its TTL (minutes)
        settled = time.monotonic() + 3
        wait_until(
            lambda: time.monotonic() > settled and not list(sync.scan_iter(pattern)), 30,
            "no spilled payload of the stale attempt left",
        )  # fmt: skip
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim.pid, signal.SIGCONT)
        sync.close()
