"""Faults in a real rollout tree: a top rollout (``RLMEnv`` with ``max_depth=3``, in a
process of its own), real ``rlmq worker --repl-slots 1`` processes and the scripted model
(:mod:`tests.faults.tree`: top -> one child -> grandchildren that call ``llm_batch`` in a loop).

* ``kill -9`` of the worker hosting the child while its grandchildren run on other workers (and
  one waits in the queue): the child is re-run as attempt 2 (fresh node id), exactly one result
  reaches the top's slot, the tree's budget is exact, the dead worker's REPLs are gone, and the dead
  attempt's grandchildren stop: the reaper deletes the dead attempt's node when it takes the job
  back, so their next model call is refused (``parent_gone``) within the detection time, not the
  node TTL; a queued one ends at its first model call.
* ``kill -9`` of the top's process mid-tree: its subtree stops at its next model call within the
  node TTL, every key of the tree gets a TTL, the workers serve the next tree.
* A child's job out of attempts gives the parent's slot an error result.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from rlmq.cli.local import LocalFleet
from rlmq.cli.status import collect
from rlmq.common import keys as K
from rlmq.common.budget.ledger import BudgetLedger, BudgetSnapshot
from rlmq.common.connection import async_client
from rlmq.common.settings import load_settings
from tests.faults.conftest import model_stats, process_gone, start_named_worker, wait_until
from tests.faults.tree import jobs_of, meta_of, start_top, started_jobs, tree_question

pytestmark = pytest.mark.e2e

BUDGET = 200_000
DONE = ("finished", "failed")
TREE_HEARTBEAT_TTL = 5
"""Seconds a REPL host may be silent before its jobs are taken back: a host starting REPLs on a
loaded 2-core machine can miss the 2 s of the other fault tests (its jobs then re-run needlessly).
A dead host is detected within ``5 + 1.5 * 1.25`` = 6.9 s."""


@pytest.fixture
def tree_fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    """The scripted model; each test starts its own REPL hosts (1 REPL slot per depth each)."""
    logs = tmp_path_factory.mktemp("tree-logs")
    fleet = LocalFleet(
        redis_url=redis_url, model=f"tree-{uuid.uuid4().hex[:8]}", workers=0, worker_concurrency=32,
        worker_args=["--heartbeat-ttl", str(TREE_HEARTBEAT_TTL), "--repl-slots", "1"], worker_grace=1.0,
        log_dir=str(logs),
    )  # fmt: skip
    fleet.start()
    try:
        yield fleet
    finally:
        fleet.stop()


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (from /proc)."""
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def snapshot(url: str, ledger_id: str) -> BudgetSnapshot | None:
    async def go() -> BudgetSnapshot | None:
        r = async_client(url)
        try:
            return await BudgetLedger(r).snapshot(ledger_id)
        finally:
            await r.aclose()

    return asyncio.run(go())


def test_kill_9_of_the_worker_hosting_a_mid_tree_child(tree_fleet: LocalFleet) -> None:
    fleet = tree_fleet
    r = redis.Redis.from_url(str(fleet.redis_url))
    q = load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model).producer_queue(fleet.model)
    workers = dict(start_named_worker(fleet, f"host{i}")[::-1] for i in range(3))  # name -> process
    rid = "top" + uuid.uuid4().hex[:10]
    top = start_top(fleet, rid, tree_question(grandchildren=4, leaf_seconds=15), budget=BUDGET)
    try:
        [(child_job, victim_name)] = wait_until(lambda: started_jobs(r, q, 2), 60, "the child to start")
        meta = meta_of(r, child_job)
        dead = f"{meta['child_id']}-1"
        # its 4 grandchildren enqueued, at least one running on another worker (one slot of depth 3
        # per worker: at least one waits in the queue)
        wait_until(lambda: len(jobs_of(r, dead)) == 4, 60, "the grandchildren enqueued")
        wait_until(
            lambda: any(w != victim_name for _, w in started_jobs(r, q, 3)), 60, "a grandchild running elsewhere"
        )
        queued_at_kill = sum(1 for s in jobs_of(r, dead).values() if s == "queued")
        victim = workers[victim_name]
        doomed = descendants(victim.pid)
        assert doomed, "the victim hosts REPLs"
        victim.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        victim.wait(10)
        wait_until(lambda: all(process_gone(p) for p in doomed), 10, "the dead worker's REPLs to end")
        t_repl = time.monotonic() - t_kill
        # the reaper takes the child back and ends the dead attempt's node at once
        wait_until(lambda: not r.exists(K.LedgerKeys(rid).node(dead)), 30, "the dead attempt's node to go")
        t_node = time.monotonic() - t_kill
        assert t_node < 15, f"the dead attempt's node outlived the reaper ({t_node:.1f} s; its TTL is 30 s)"
        # ...and `rlmq status` no longer lists it as live (its lease would last 30 s)
        wait_until(lambda: dead not in listed_live(r), 5, "rlmq status to drop the dead attempt")
        # every grandchild of the dead attempt ends soon after (refused at its next model call)
        wait_until(lambda: all(s in DONE for s in jobs_of(r, dead).values()), 30, "the dead attempt's grandchildren")
        t_stop = time.monotonic() - t_kill
        out, _ = top.communicate(timeout=120)
    finally:
        if top.poll() is None:
            top.kill()
            top.wait()
    assert top.returncode == 0
    doc = json.loads(out.decode().strip().splitlines()[-1])
    row = doc["row"]
    assert row["stop_reason"] == "answer_ready", row
    [event] = [e for e in doc["trajectory"] if e["type"] == "rlm_batch"]
    [res] = event["results"]  # exactly one result in the parent's slot
    assert res["status"] == "ok" and res["attempt"] == 2, res["content"][:2000]
    assert res["child"]["rollout_id"] == f"{meta['child_id']}-2"
    assert res["content"].count("done") == 4, res["content"]  # the re-run's grandchildren ran to the end
    # the dead attempt's grandchildren: each refused (parent_gone) or ended unstarted, none ran on
    streams = {K.reply_of_job(jid) for jid in jobs_of(r, dead)}
    dead_results = [
        json.loads(fields[K.REPLY_FIELD.encode()]) for s in streams if s is not None for _, fields in r.xrange(s)
    ]
    whys = sorted(x["content"][:60] for x in dead_results)
    assert len(dead_results) == 4 and all("done" not in w for w in whys), whys
    # the budget stays exact: what the server served to the tree <= budget <= ... charged >= served
    stats = model_stats(str(fleet.base_url))
    served = stats["completion_tokens"] - int(row["metrics"]["main_rlm_completion_tokens"])
    snap = snapshot(str(fleet.redis_url), rid)
    assert snap is not None and served <= snap.limit == BUDGET and snap.charged >= served, (served, snap)
    # the row reports what the ledger charged, also the tokens served to the dead attempt's calls
    metrics = row["metrics"]
    assert metrics["tree_charged_completion_tokens"] == metrics["sub_llm_budget_charged"] == snap.charged, metrics
    assert all(p.poll() is None for n, p in workers.items() if n != victim_name)
    print(
        f"kill -9 mid-tree: REPLs gone {t_repl:.2f} s, dead node deleted {t_node:.2f} s, dead attempt's "
        f"grandchildren ended {t_stop:.2f} s after the kill; "
        f"queued at kill {queued_at_kill}, dead grandchildren said {whys}"
    )


def listed_live(r: redis.Redis) -> set[str]:
    """The rollout ids ``rlmq status`` lists as live now."""
    return {x["id"] for x in collect(r)["rollouts"]}


def tree_ids(r: redis.Redis, rid: str) -> set[str]:
    """The rollout ids of the tree under top ``rid`` whose jobs Redis still holds (top, children, ...)."""
    ids, todo = {rid}, [rid]
    while todo:
        for jid in jobs_of(r, todo.pop()):
            child = meta_of(r, jid).get("child_id")
            if child:
                for node in (f"{child}-{a}" for a in (1, 2)):
                    if node not in ids:
                        ids.add(node)
                        todo.append(node)
                ids.add(child)
    return ids


def test_kill_9_of_the_top_rollout_mid_tree_stops_its_subtree_and_every_key_expires(tree_fleet: LocalFleet) -> None:
    fleet = tree_fleet
    r = redis.Redis.from_url(str(fleet.redis_url))
    q = load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model).producer_queue(fleet.model)
    workers = [start_named_worker(fleet, f"host{i}")[0] for i in range(2)]
    rid = "top" + uuid.uuid4().hex[:10]
    key_ttl = 15  # the top's node lives min(30, key_ttl) s without a refresh
    top = start_top(fleet, rid, tree_question(grandchildren=2, leaf_seconds=120), key_ttl=key_ttl)
    try:
        wait_until(lambda: len(started_jobs(r, q, 3)) == 2, 60, "both grandchildren running")
        doomed = descendants(top.pid)
        top.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        top.wait(10)
    finally:
        if top.poll() is None:
            top.kill()
            top.wait()
    wait_until(lambda: all(process_gone(p) for p in doomed), 15, "the top's REPL to exit")
    assert rid in listed_live(r) or time.monotonic() - t_kill > key_ttl  # listed while its lease runs
    # `rlmq status` drops the killed top within its lease (min(30, key TTL) s), not its keys' TTL
    wait_until(lambda: rid not in listed_live(r), key_ttl + 5, "rlmq status to drop the killed top")
    # the subtree stops at its next model call once the top's node expires: nothing started or queued
    ids = tree_ids(r, rid)
    assert len(ids) >= 5, ids  # top, child id and node, two grandchildren's ids and nodes

    def tree_idle() -> bool:
        states = [s for i in tree_ids(r, rid) for s in jobs_of(r, i).values()]
        return bool(states) and all(s in DONE for s in states)

    wait_until(tree_idle, key_ttl + 30, "every job of the dead top's tree to end")
    t_stop = time.monotonic() - t_kill
    ids = tree_ids(r, rid)
    results = [
        json.loads(fields[K.REPLY_FIELD.encode()])
        for i in ids
        for key in r.scan_iter(match=f"*{i}*reply*", count=1000)
        for _, fields in r.xrange(key)
    ]
    contents = sorted(x["content"][:70] for x in results)
    assert not any("done" in c for c in contents), contents  # no leaf loop ran to its end
    # every key of the tree has a TTL
    keys = {k for i in ids for k in r.scan_iter(match=f"*{i}*", count=1000)}
    assert any(b"rq:job" in k for k in keys), keys
    forever = sorted(k for k in keys if r.ttl(k) == -1)
    assert forever == [], forever
    longest = max(r.ttl(k) for k in keys)
    # the workers stay healthy and serve the next tree
    assert all(w.poll() is None for w in workers)
    assert r.zcard(K.rq_started(K.child_queue(q, 2))) == 0 and r.zcard(K.rq_started(K.child_queue(q, 3))) == 0
    nxt = start_top(fleet, "next" + uuid.uuid4().hex[:8], tree_question(grandchildren=2, leaf_seconds=0.5))
    try:
        out, _ = nxt.communicate(timeout=120)
    finally:
        if nxt.poll() is None:
            nxt.kill()
            nxt.wait()
    row = json.loads(out.decode().strip().splitlines()[-1])["row"]
    assert row["stop_reason"] == "answer_ready" and row["final_answer"].count("done") == 2, row
    print(
        f"kill -9 of the top: its subtree's jobs all ended {t_stop:.2f} s after the kill (node TTL {key_ttl} s); "
        f"{len(keys)} keys of the tree, all with a TTL (longest {longest} s); what the subtree said: {contents}"
    )


def test_a_child_out_of_attempts_gives_its_parents_slot_an_error_result(tree_fleet: LocalFleet) -> None:
    fleet = tree_fleet
    r = redis.Redis.from_url(str(fleet.redis_url))
    q = load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model).producer_queue(fleet.model)
    workers = dict(start_named_worker(fleet, f"host{i}", "--job-max-attempts", "1")[::-1] for i in range(2))
    rid = "top" + uuid.uuid4().hex[:10]
    top = start_top(fleet, rid, tree_question(grandchildren=1, leaf_seconds=60))
    try:
        [(child_job, victim_name)] = wait_until(lambda: started_jobs(r, q, 2), 60, "the child to start")
        dead = f"{meta_of(r, child_job)['child_id']}-1"
        wait_until(lambda: started_jobs(r, q, 3), 60, "the grandchild running")
        workers[victim_name].send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        out, _ = top.communicate(timeout=60)
        t_top = time.monotonic() - t_kill
        wait_until(lambda: all(s in DONE for s in jobs_of(r, dead).values()), 30, "the dead child's grandchild")
        t_stop = time.monotonic() - t_kill
    finally:
        if top.poll() is None:
            top.kill()
            top.wait()
    doc = json.loads(out.decode().strip().splitlines()[-1])
    [event] = [e for e in doc["trajectory"] if e["type"] == "rlm_batch"]
    [res] = event["results"]
    assert (res["status"], res["error_kind"]) == ("error", "abandoned"), res
    assert res["content"].startswith("[error] child rollout lost")
    assert doc["row"]["final_answer"] == res["content"]  # the top's root model saw the error slot
    assert r.hget(K.rq_job(child_job), "status") == b"failed"
    print(
        f"child out of attempts: the top got its error slot and ended {t_top:.2f} s after the kill, "
        f"the dead child's grandchild ended {t_stop:.2f} s after it"
    )
