"""A REPL host's bookkeeping of child-rollout jobs on a real Redis: the reaper of a child queue
re-runs a dead worker's child under the next attempt (a fresh node id), then, out of attempts,
gives its slot the child kind's error result."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from redis.asyncio import Redis

from rlmq.common import keys as K
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.jobs.lua import ENQUEUE_LUA
from rlmq.common.jobs.record import CHILD_ROLLOUT_FUNC, utcnow_str
from rlmq.common.jobs.store import EnqueueShared, JobStore, NewJob, StartedJob
from rlmq.common.schemas import ChildRolloutRequest, SubLLMResult
from rlmq.common.settings import load_settings
from rlmq.workers.child_kind import CHILD_ABANDONED_CONTENT, child_node
from rlmq.workers.worker import SubLLMWorker
from tests.replies import reply_results

pytestmark = pytest.mark.integration


async def test_a_dead_hosts_child_is_rerun_under_the_next_attempt_then_given_an_error_slot(
    real_redis: redis.Redis, aredis: Redis, redis_url: str
) -> None:
    model = "rec-" + uuid.uuid4().hex[:6]
    s = load_settings(redis_url=redis_url, base_url="http://127.0.0.1:9/v1", model=model, repl_slots=1)
    w = SubLLMWorker(s, name="alive")
    w.redis, w.ledger = aredis, BudgetLedger(aredis)
    cq = K.child_queue(w.queue, 2)
    now = time.time()
    req = ChildRolloutRequest(
        rollout_id="top1", batch_id="b1", index=0, child_id="c1", ledger_id="top1", nodes=["top1"], depth=2,
        max_depth=2, prompt="p", model=model, enqueued_at=now, deadline=now + 60,
    )  # fmt: skip
    await aredis.script_load(ENQUEUE_LUA)
    async with aredis.pipeline(transaction=False) as pipe:
        JobStore(aredis, cq).add_enqueue(
            pipe,
            [NewJob("top1-b1-0", f"[{req.model_dump_json()}]", "child rollout depth=2 parent=top1", {
                "rollout_id": "top1", "batch_id": "b1", "index": 0})],
            EnqueueShared(CHILD_ROLLOUT_FUNC, K.RolloutKeys("top1").reply("b1"), 600, 600, 600, 600),
            utcnow_str(),
        )  # fmt: skip
        await pipe.execute()
    rec = w.records_for(cq)
    assert rec.max_attempts == s.job_max_attempts == 2 and rec.abandoned_result == w.children.abandoned
    dead = JobStore(aredis, cq, "dead", heartbeat_ttl=1)
    first = await dead.start([b"top1-b1-0"])
    assert child_node(req.child_id, first[0].attempt) == "c1-1"
    real_redis.zadd(K.rq_started(cq), {first[0].member: time.time() - 1})  # its lease lapsed
    assert await rec.reap(await rec.expired_members()) == (1, 0)
    second = await rec.start([b"top1-b1-0"])
    assert child_node(req.child_id, second[0].attempt) == "c1-2"  # the re-run never reuses the dead id
    real_redis.zadd(K.rq_started(cq), {second[0].member: time.time() - 1})
    assert await rec.reap(await rec.expired_members()) == (0, 1)
    [res] = reply_results(real_redis, K.RolloutKeys("top1").reply("b1"))
    assert (res.status, res.error_kind, res.index, res.content) == ("error", "abandoned", 0, CHILD_ABANDONED_CONTENT)


async def test_the_reaper_ends_the_dead_attempts_tree_node_and_only_that_one(
    real_redis: redis.Redis, aredis: Redis, redis_url: str
) -> None:
    """Without this, a dead child attempt's descendants run on until its node's TTL (30 s) runs out."""
    model = "rec-" + uuid.uuid4().hex[:6]
    s = load_settings(redis_url=redis_url, base_url="http://127.0.0.1:9/v1", model=model, repl_slots=1)
    w = SubLLMWorker(s, name="alive")
    w.redis, w.ledger = aredis, BudgetLedger(aredis)
    cq = K.child_queue(w.queue, 2)
    now = time.time()
    top = "top" + uuid.uuid4().hex[:8]
    jobs = []
    for i, child in enumerate(["cdead", "clive"]):
        req = ChildRolloutRequest(
            rollout_id=top, batch_id="b1", index=i, child_id=child, ledger_id=top, nodes=[top], depth=2,
            max_depth=3, prompt="p", model=model, enqueued_at=now, deadline=now + 60,
        )  # fmt: skip
        jobs.append(NewJob(K.job_id(top, "b1", i), f"[{req.model_dump_json()}]", "child", {"rollout_id": top}))
    await aredis.script_load(ENQUEUE_LUA)
    async with aredis.pipeline(transaction=False) as pipe:
        JobStore(aredis, cq).add_enqueue(
            pipe, jobs, EnqueueShared(CHILD_ROLLOUT_FUNC, K.RolloutKeys(top).reply("b1"), 600, 600, 600, 600),
            utcnow_str(),
        )  # fmt: skip
        await pipe.execute()
    ledger = BudgetLedger(aredis)
    await ledger.open_unlimited(top, ttl=600)
    for node in (top, "cdead-1", "clive-1"):
        await ledger.open_node(top, node, ttl=600)
    host = JobStore(aredis, cq, "host", heartbeat_ttl=60)
    dead, live = await host.start([j.job_id.encode() for j in jobs])
    real_redis.zadd(K.rq_started(cq), {dead.member: time.time() - 1})  # only the first one's lease lapsed
    w.fetcher.queues = [cq]
    assert await w.upkeep.reap_once() == 1
    assert not await ledger.node_alive(top, "cdead-1")  # ended at once: its descendants are refused now
    assert await ledger.node_alive(top, "clive-1") and await ledger.node_alive(top, top)
    assert real_redis.lrange(K.rq_queue(cq), 0, -1) == [dead.job_id.encode()]  # re-queued for attempt 2
    # a lease that lapsed but was renewed before the reaper's script ran is not taken, nor its node ended
    taken: list[tuple[str, int]] = []
    assert await w.records_for(cq).reap([live.member], taken=taken) == (0, 0) and taken == []
    assert await ledger.node_alive(top, "clive-1")
    await ledger.aclose()


async def test_a_child_whose_parent_is_gone_ends_before_starting_a_repl(aredis: Redis, redis_url: str) -> None:
    """A queued grandchild of a dead attempt takes no REPL: it ends with a ``parent_gone`` error."""
    from rlmq.common.jobs.store import StartedJob
    from rlmq.common.schemas import SubLLMResult

    model = "rec-" + uuid.uuid4().hex[:6]
    s = load_settings(redis_url=redis_url, base_url="http://127.0.0.1:9/v1", model=model, repl_slots=1)
    w = SubLLMWorker(s, name="alive")
    w.redis, w.ledger = aredis, BudgetLedger(aredis)
    top = "top" + uuid.uuid4().hex[:8]
    ledger = BudgetLedger(aredis)
    await ledger.open_unlimited(top, ttl=600)
    await ledger.open_node(top, top, ttl=600)  # the dead middle node "mid-1" is not there
    now = time.time()
    req = ChildRolloutRequest(
        rollout_id="mid-1", batch_id="b1", index=0, child_id="gc", ledger_id=top, nodes=[top, "mid-1"], depth=3,
        max_depth=3, prompt="p", model=model, enqueued_at=now, deadline=now + 60,
    )  # fmt: skip
    job = StartedJob(K.job_id("mid-1", "b1", 0), "e1", b"", 1, K.RolloutKeys("mid-1").reply("b1"))
    t0 = time.monotonic()
    out = await w.children.run(req, job)  # the worker's child host is not started: reaching it would raise
    res = SubLLMResult.model_validate_json(out.result_json)
    assert (res.status, res.error_kind) == ("error", "parent_gone") and "mid-1" in res.content, res
    assert time.monotonic() - t0 < 2
    await ledger.open_node(top, "mid-1", ttl=600)  # alive: it goes on to the host (not started here)
    res = SubLLMResult.model_validate_json((await w.children.run(req, job)).result_json)
    assert res.error_kind == "host" and "not started" in res.content, res
    await ledger.aclose()


async def test_a_child_job_naming_a_tree_its_parent_is_not_a_live_node_of_is_refused_before_it_runs(
    real_redis: redis.Redis, aredis: Redis, redis_url: str
) -> None:
    """A tenant's producer may write only its own job ids (hence ``rollout_id``), but ``ledger_id``
    and ``nodes`` are the payload's word: a forged child job naming another tenant's live tree must
    not make the worker open a node in it (nor reserve its root turns from it)."""
    model = "forge-" + uuid.uuid4().hex[:6]
    s = load_settings(redis_url=redis_url, base_url="http://127.0.0.1:9/v1", model=model, repl_slots=1)
    w = SubLLMWorker(s, name="deputy")
    w.redis, w.ledger = aredis, BudgetLedger(aredis)
    victim = "u_top" + uuid.uuid4().hex[:6]
    await w.ledger.open(victim, 10_000, cap=1000)
    await w.ledger.open_node(victim, victim, ttl=60)  # the victim's top is alive
    now = time.time()
    for nodes in ([victim], [victim, "t_x"]):  # the chain names the victim's top / the forger's rollout last
        req = ChildRolloutRequest(
            rollout_id="t_x", batch_id="b1", index=0, child_id="c9", ledger_id=victim, nodes=nodes,
            depth=len(nodes) + 1, max_depth=3, prompt="p", model=model, enqueued_at=now, deadline=now + 60,
        )  # fmt: skip
        job = StartedJob("t_x-b1-0", "e1", b"", 1, K.RolloutKeys("t_x").reply("b1"))
        out = await w.children.run(req, job)
        res = SubLLMResult.model_validate_json(out.result_json)
        assert res.status == "error" and res.error_kind == ("payload" if len(nodes) == 1 else "parent_gone"), res
        assert not real_redis.exists(K.LedgerKeys(victim).node(child_node("c9", 1)))
    snap = await w.ledger.snapshot(victim)
    assert snap is not None and snap.charged == 0 and snap.grants == 0
