"""Workers hosting child rollouts, end to end: real ``rlmq worker --repl-slots`` processes,
the scripted model and a real Redis. A child-rollout job is enqueued by hand through the job store,
as a parent's dispatcher does, on the child queue of depth 2; its result (a ``SubLLMResult`` with
``child``) must reach the parent's reply stream. Also: the containment check at start, ``kill -9``
of the worker hosting a child (re-run elsewhere under a fresh node id, exactly one result, its REPL
processes gone) and a SIGTERM drain (the child is cancelled, its REPL stopped, its job handed back).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from rlmq.cli.exits import EXIT_USAGE
from rlmq.cli.local import LocalFleet, ProcessGroup, child_env, start_mock_llm
from rlmq.common import keys as K
from rlmq.common.jobs.lua import ENQUEUE_LUA
from rlmq.common.jobs.record import CHILD_ROLLOUT_FUNC, F_ATTEMPTS, utcnow_str
from rlmq.common.jobs.store import EnqueueShared, JobStore, NewJob
from rlmq.common.schemas import ChildRolloutRequest, SubLLMResult
from rlmq.common.settings import RolloutOptions
from rlmq.scripted.server import root_code_directive

HEARTBEAT_TTL = 2
DEADLINE = 90.0


def wait_until(pred: Any, timeout: float, what: str) -> Any:
    """Poll ``pred`` (another process's state) until it is truthy, at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)  # polling another process's state, bounded by the deadline


def enqueue_child(
    redis_url: str, queue: str, code: str, *, context: Any = "ctx", depth: int = 2, **options: Any
) -> ChildRolloutRequest:
    """Enqueue one child-rollout job on ``child_queue(queue, depth)`` as a parent's dispatcher does;
    its root model runs ``code`` at its first turn; ``options``: more of its rollout options."""
    import asyncio

    from rlmq.common.budget.ledger import BudgetLedger
    from rlmq.common.connection import async_client

    # the chain top .. parent; the parent (the job's rollout) is its last node
    chain = ["p" + uuid.uuid4().hex[:10], *("n" + uuid.uuid4().hex[:8] for _ in range(depth - 2))]
    parent, batch = chain[-1], "b1"
    now = time.time()
    req = ChildRolloutRequest(
        rollout_id=parent, batch_id=batch, index=0, child_id="c" + uuid.uuid4().hex[:12], ledger_id=chain[0],
        nodes=chain, depth=depth, max_depth=depth,
        prompt="child question " + root_code_directive(code),
        context=context, model="scripted",
        options=RolloutOptions(rollout_timeout=120, **options).model_dump(mode="json"),
        enqueued_at=now, deadline=now + DEADLINE,
    )  # fmt: skip
    cq = K.child_queue(queue, depth)

    async def go() -> None:
        r = async_client(redis_url)
        try:
            # the tree the child belongs to: its top's ledger (liveness only) and the chain's nodes
            ledger = BudgetLedger(r)
            await ledger.open_unlimited(req.ledger_id, ttl=600)
            for node in dict.fromkeys(req.nodes):
                await ledger.open_node(req.ledger_id, node, ttl=600)
            await r.script_load(ENQUEUE_LUA)
            store = JobStore(r, cq)
            job = NewJob(
                job_id=K.job_id(parent, batch, 0),
                args_json=f"[{req.model_dump_json()}]",
                description=f"child rollout depth={depth} parent={parent} batch={batch} index=0",
                meta={"rollout_id": parent, "batch_id": batch, "index": 0, "depth": depth, "parent": parent},
            )
            shared = EnqueueShared(
                func=CHILD_ROLLOUT_FUNC, reply_key=K.RolloutKeys(parent).reply(batch), timeout=600,
                result_ttl=600, failure_ttl=600, reply_ttl=600,
            )  # fmt: skip
            async with r.pipeline(transaction=False) as pipe:
                store.add_enqueue(pipe, [job], shared, utcnow_str())
                pipe.sadd(K.RQ_QUEUES, K.rq_queue(cq))
                pipe.publish(K.wake_channel(cq), K.wake_message(cq))
                await pipe.execute()
        finally:
            await r.aclose()

    asyncio.run(go())
    return req


def replies(r: redis.Redis, req: ChildRolloutRequest) -> list[SubLLMResult]:
    """Every result on the parent's reply stream so far."""
    entries = r.xrange(K.RolloutKeys(req.rollout_id).reply(req.batch_id))
    return [SubLLMResult.model_validate_json(fields[K.REPLY_FIELD.encode()]) for _, fields in entries]


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def host_fleet(redis_url: str, tmp_path: Any) -> Iterator[LocalFleet]:
    """The scripted model and no worker yet (each test starts its own REPL hosts)."""
    with LocalFleet(
        redis_url=redis_url, model=f"child-{uuid.uuid4().hex[:6]}", workers=0, worker_concurrency=8,
        worker_args=["--repl-slots", "1", "--heartbeat-ttl", str(HEARTBEAT_TTL)], worker_grace=1.0,
        log_dir=str(tmp_path / "logs"),
    ) as f:  # fmt: skip
        yield f


def queue_of(fleet: LocalFleet) -> str:
    return K.queue_name_for_model(fleet.model)


def test_a_child_rollout_job_runs_on_a_repl_host_and_its_result_reaches_the_parent(
    host_fleet: LocalFleet, real_redis: redis.Redis
) -> None:
    host_fleet.start_worker("host-0")
    host_fleet.wait_for_workers(1)
    q = queue_of(host_fleet)
    code = "r = llm_batch(['say hi']); answer['content'] = 'child of ' + context + ' got ' + str(len(r)); " \
           "answer['ready'] = True"  # fmt: skip
    t0 = time.monotonic()
    req = enqueue_child(str(host_fleet.redis_url), q, code, context="ctx")
    [res] = wait_until(lambda: replies(real_redis, req), DEADLINE, "the child's result")
    took = time.monotonic() - t0
    assert (res.status, res.content, res.rollout_id, res.index, res.attempt) == (
        "ok", "child of ctx got 1", req.rollout_id, 0, 1,
    )  # fmt: skip
    assert res.child is not None
    assert (res.child.rollout_id, res.child.depth, res.child.stop_reason) == (f"{req.child_id}-1", 2, "answer_ready")
    kinds = [e.get("type") for e in res.child.trajectory]
    assert "root" in kinds and "cell" in kinds and "llm_batch" in kinds  # its sub-call went back to the queue
    # RQ's record: the job finished on the child queue of depth 2, under its description
    job = {k.decode(): v for k, v in real_redis.hgetall(K.rq_job(res.job_id)).items()}
    assert job["status"] == b"finished" and job["origin"].decode() == K.child_queue(q, 2)
    assert b"depth=2" in job["description"] and req.rollout_id.encode() in job["description"]
    # the worker serves (and rq info lists it on) every depth's child queue
    assert real_redis.sismember(K.RQ_QUEUES, K.rq_queue(K.child_queue(q, 3)))
    assert (
        real_redis.zcard(K.serving(K.child_queue(q, 2))) == 1 and real_redis.zcard(K.serving(K.child_queue(q, 8))) == 1
    )
    print(f"child rollout with one sub-call: {took:.2f} s from enqueue to result")


STUCK = "import time; time.sleep({seconds}); answer['content'] = 'slept'; answer['ready'] = True"


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (children, their children, ...)."""
    out, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        out += kids
        todo += kids
    return out


def repl_pids_of(
    workers: list[subprocess.Popen[bytes]], at_least: int = 1
) -> tuple[subprocess.Popen[bytes], list[int]] | None:
    """The worker that has at least ``at_least`` descendants now (its REPL and what its cell
    started), and those descendants."""
    for w in workers:
        kids = descendants(w.pid)
        if len(kids) >= at_least:
            return w, kids
    return None


def test_kill_9_of_the_worker_hosting_a_child_reruns_it_elsewhere_once_and_kills_its_repl(
    host_fleet: LocalFleet, real_redis: redis.Redis
) -> None:
    workers = [host_fleet.start_worker("host-a"), host_fleet.start_worker("host-b")]
    host_fleet.wait_for_workers(2)
    # the cell also starts a process in a session of its own: it must not outlive the dead worker either
    escape = "import subprocess; subprocess.Popen(['sleep', '300'], start_new_session=True); "
    req = enqueue_child(str(host_fleet.redis_url), queue_of(host_fleet), escape + STUCK.format(seconds=4))
    victim, repl_pids = wait_until(lambda: repl_pids_of(workers, 2), 30, "the child's REPL and its cell's process")
    wait_until(lambda: real_redis.exists(K.RolloutKeys(f"{req.child_id}-1").info), 10, "the child announced")
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    # the dead worker's REPL dies with it (its command pipe closed), well before the lease lapses
    wait_until(lambda: not any(alive(p) for p in repl_pids), 10, "the dead worker's REPL processes to end")
    [res] = wait_until(lambda: replies(real_redis, req), DEADLINE, "the re-run child's result")
    survivor = next(w for w in workers if w is not victim)
    assert (res.status, res.content, res.attempt) == ("ok", "slept", 2)
    assert res.child is not None and res.child.rollout_id == f"{req.child_id}-2"  # never the dead attempt's id
    assert str(survivor.pid) in res.worker
    # exactly one result, and none can follow: the job is finished, neither queued nor started anywhere
    cq = K.child_queue(queue_of(host_fleet), 2)
    assert real_redis.hget(K.rq_job(res.job_id), "status") == b"finished"
    assert real_redis.llen(K.rq_queue(cq)) == 0 and real_redis.zcard(K.rq_started(cq)) == 0
    assert len(replies(real_redis, req)) == 1
    assert not children_of(survivor.pid)  # the re-run's REPL closed with its rollout


def test_a_full_depth_does_not_stop_the_next_depth(host_fleet: LocalFleet, real_redis: redis.Redis) -> None:
    """One worker, one REPL slot per depth: a depth-2 child holding its depth's slot (as a parent
    waiting for its children does) leaves a second depth-2 child queued, and a depth-3 child runs."""
    host_fleet.start_worker("host-depths")
    host_fleet.wait_for_workers(1)
    q, url = queue_of(host_fleet), str(host_fleet.redis_url)
    waiting = enqueue_child(url, q, STUCK.format(seconds=30))
    wait_until(lambda: real_redis.zcard(K.rq_started(K.child_queue(q, 2))), 30, "the first depth-2 child to start")
    queued = enqueue_child(url, q, STUCK.format(seconds=0))
    deeper = enqueue_child(url, q, STUCK.format(seconds=0), depth=3)
    [res] = wait_until(lambda: replies(real_redis, deeper), DEADLINE, "the depth-3 child's result")
    assert res.status == "ok" and res.child is not None and res.child.depth == 3
    assert replies(real_redis, waiting) == [] and replies(real_redis, queued) == []
    jid = K.job_id(queued.rollout_id, queued.batch_id, 0)
    assert real_redis.lrange(K.rq_queue(K.child_queue(q, 2)), 0, -1) == [jid.encode()]  # waits for its depth's slot


def test_sigterm_drain_cancels_the_hosted_child_stops_its_repl_and_hands_its_job_back(
    host_fleet: LocalFleet, real_redis: redis.Redis
) -> None:
    worker = host_fleet.start_worker("host-drain")
    host_fleet.wait_for_workers(1)
    req = enqueue_child(str(host_fleet.redis_url), queue_of(host_fleet), STUCK.format(seconds=60))
    _, repl_pids = wait_until(lambda: repl_pids_of([worker]), 30, "the worker to start the child's REPL")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    assert not any(alive(p) for p in repl_pids)
    jid = K.job_id(req.rollout_id, req.batch_id, 0)
    cq = K.child_queue(queue_of(host_fleet), 2)
    assert real_redis.lrange(K.rq_queue(cq), 0, -1) == [jid.encode()]  # handed back for a re-run
    assert real_redis.hget(K.rq_job(jid), F_ATTEMPTS) == b"1"
    assert replies(real_redis, req) == []  # no result yet: a re-run gives the one result
    assert not real_redis.zscore(K.LIVE_ROLLOUTS, f"{req.child_id}-1")  # rlmq status no longer lists it


PROBE_UNCONTAINED = """
import sys
import rlmq.workers.child_host as ch
from rlmq.producer.repl.containment import Containment

async def uncontained(server, options):
    return Containment(network=False, private_fs=False, read_only_root=False, hidden_sockets=0,
                       hidden_processes=False, no_user_namespaces=False, own_uid=False,
                       not_contained=["network: test says so"])

ch.probe_containment = uncontained
from rlmq.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_worker_refuses_to_host_an_uncontained_repl_unless_told_so_in_so_many_words(
    redis_url: str, tmp_path: Any
) -> None:
    group = ProcessGroup()
    try:
        base = start_mock_llm(group)
        model = "m-" + uuid.uuid4().hex[:6]
        argv = [sys.executable, "-c", PROBE_UNCONTAINED, "worker", "--base-url", base, "--model", model,
                "--repl-slots", "1", "--burst"]  # fmt: skip
        env = child_env({"RLMQ_REDIS_URL": redis_url})
        refused = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert refused.returncode == EXIT_USAGE, refused.stderr
        assert "refuses to host child rollouts" in refused.stderr and "--allow-uncontained-repl" in refused.stderr
        assert "network: test says so" in refused.stderr
        allowed = subprocess.run(
            [*argv, "--allow-uncontained-repl"], env=env, capture_output=True, text=True, timeout=60
        )
        assert allowed.returncode == 0, allowed.stderr
        assert "UNCONTAINED REPL" in allowed.stderr
        # this host (root, namespaces) contains the REPL: the real probe passes without the override
        real = subprocess.run(argv[:1] + ["-m", "rlmq"] + argv[3:], env=env, capture_output=True, text=True, timeout=60)
        assert real.returncode == 0, real.stderr
    finally:
        group.stop()
