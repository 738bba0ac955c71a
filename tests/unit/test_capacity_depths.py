"""The per-depth REPL-slot pools of a worker hosting child rollouts: each queue gets a
share of its own pool, a full pool never stops another's queues, and a tree of any depth finishes
on the smallest worker (one model-call slot, one REPL slot per depth)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlmq.common import keys as K
from rlmq.common.jobs.record import CHILD_ROLLOUT_FUNC, SUB_LLM_FUNC, encode_job_data
from rlmq.common.jobs.store import StartedJob
from rlmq.common.settings import load_settings
from rlmq.workers.capacity import (
    MAX_HOSTED_DEPTH,
    MODEL_CALLS,
    PEEK_MAX,
    REPL,
    Capacity,
    PoolSpec,
    fetch_shares,
    pool_family,
    repl_pool,
)


def test_each_queue_gets_a_share_of_its_own_pool_only() -> None:
    free = {MODEL_CALLS: 0, repl_pool(2): 0, repl_pool(3): 1}
    queues = [("m", MODEL_CALLS), ("m@t", MODEL_CALLS), ("m+rlm2", repl_pool(2)), ("m+rlm3", repl_pool(3))]
    # model calls and depth 2 full: depth 3 is still fetched (its parents wait on depth 2's slots)
    assert fetch_shares(free, queues) == {"m": 0, "m@t": 0, "m+rlm2": 0, "m+rlm3": 1}
    free = {MODEL_CALLS: 5, repl_pool(2): 3, repl_pool(3): 0}
    assert fetch_shares(free, queues) == {"m": 3, "m@t": 3, "m+rlm2": 3, "m+rlm3": 0}
    assert fetch_shares({MODEL_CALLS: 10_000}, [("m", MODEL_CALLS)]) == {"m": PEEK_MAX}
    assert fetch_shares({}, [("x", "nope")]) == {"x": 0}  # a pool this worker lacks: nothing peeked


@given(
    free=st.dictionaries(st.sampled_from([MODEL_CALLS, repl_pool(2), repl_pool(5)]), st.integers(-3, 40)),
    queues=st.lists(
        st.tuples(st.text(min_size=1, max_size=3), st.sampled_from([MODEL_CALLS, repl_pool(2)])),
        max_size=6,
        unique_by=lambda q: q[0],
    ),  # fmt: skip
)
def test_a_pool_is_never_oversubscribed_by_more_than_its_rounding(
    free: dict[str, int], queues: list[tuple[str, str]]
) -> None:
    shares = fetch_shares(free, queues)
    for pool in {p for _, p in queues}:
        mine = [shares[q] for q, p in queues if p == pool]
        slots = free.get(pool, 0)
        if slots <= 0:
            assert not any(mine)
        else:  # every queue of a pool with room is peeked; together at most one rounding per queue over
            assert all(m >= 1 for m in mine) and sum(mine) < slots + len(mine)


def test_repl_pools_are_named_by_depth() -> None:
    assert repl_pool(2) == "repl@2" and pool_family(repl_pool(7)) == REPL and pool_family(MODEL_CALLS) == MODEL_CALLS
    with pytest.raises(ValueError):
        repl_pool(1)


@dataclass
class _Node:
    depth: int
    waiting: int = 0  # children not finished yet
    parent: _Node | None = None
    started: bool = False
    children: list[_Node] = field(default_factory=list)


def _run_tree(max_depth: int, fan_out: int, model_slots: int, repl_slots: int) -> int:
    """Schedule one tree on one worker with the per-depth pools; returns the steps taken (raises on deadlock).

    A rollout at depth d < max_depth holds a slot of repl@d while it waits for fan_out children at
    d + 1; one at max_depth runs its rlm_batch as fan_out sub-calls, each a model-call slot."""
    pools = {MODEL_CALLS: PoolSpec(model_slots)}
    pools.update({repl_pool(d): PoolSpec(repl_slots) for d in range(2, MAX_HOSTED_DEPTH + 1)})
    cap = Capacity(pools)
    top = _Node(depth=1, waiting=fan_out)
    queued: list[tuple[str, _Node]] = []  # (pool, the node the job belongs to / the parent of a sub-call)
    if max_depth == 1:
        queued += [(MODEL_CALLS, top)] * fan_out
    else:
        queued += [(repl_pool(2), _Node(depth=2, parent=top)) for _ in range(fan_out)]
    running: list[tuple[str, _Node]] = []
    steps = 0
    while top.waiting:
        steps += 1
        if steps > 100_000:
            raise AssertionError("no progress")
        started = []
        for pool, node in list(queued):
            if cap.free(pool) > 0:
                cap.hold(pool)
                queued.remove((pool, node))
                started.append((pool, node))
                if pool != MODEL_CALLS:  # a child rollout starts: it fans out at once
                    d = node.depth
                    node.waiting = fan_out
                    if d < max_depth:
                        queued += [(repl_pool(d + 1), _Node(depth=d + 1, parent=node)) for _ in range(fan_out)]
                    else:
                        queued += [(MODEL_CALLS, node)] * fan_out
        running += started
        done = [(p, n) for p, n in running if p == MODEL_CALLS or n.waiting == 0]
        if not done and not started:
            raise AssertionError(f"deadlock: {len(running)} running, {len(queued)} queued")
        for pool, node in done:
            running.remove((pool, node))
            cap.let_go(pool)
            target = node if pool == MODEL_CALLS else node.parent
            assert target is not None
            target.waiting -= 1
    return steps


@pytest.mark.parametrize("max_depth", [1, 2, 3, 5, MAX_HOSTED_DEPTH])
@pytest.mark.parametrize("fan_out", [1, 3])
def test_a_tree_finishes_on_one_call_slot_and_one_repl_slot_per_depth(max_depth: int, fan_out: int) -> None:
    assert _run_tree(max_depth, fan_out, model_slots=1, repl_slots=1) > 0


def _job(jid: str, func: str, payload: dict[str, object]) -> StartedJob:
    return StartedJob(jid, "e-" + jid, encode_job_data(func, [payload]), 1, "k")


def _child(depth: int, index: int) -> dict[str, object]:
    return {
        "rollout_id": "top", "batch_id": "b1", "index": index, "child_id": f"c{index}", "ledger_id": "top",
        "nodes": ["top"], "depth": depth, "max_depth": 3, "prompt": "p", "model": "m",
        "enqueued_at": 0, "deadline": 1,
    }  # fmt: skip


async def test_a_repl_host_holds_each_child_in_its_depths_pool_and_refuses_misplaced_jobs() -> None:
    from rlmq.workers.worker import SubLLMWorker

    s = load_settings(redis_url="redis://127.0.0.1:1", base_url="http://127.0.0.1:1/v1", model="m", repl_slots=1)
    w = SubLLMWorker(s)
    q = w.queue
    assert w.child_queues() == [K.child_queue(q, d) for d in range(2, MAX_HOSTED_DEPTH + 1)]
    assert w.pool_of_queue(K.child_queue(q + "@t1", 3)) == repl_pool(3)
    assert w.pool_of_queue(K.child_queue("rlmq.sub.other", 2)) is None
    assert w.pool_of_queue(K.child_queue(q, MAX_HOSTED_DEPTH + 1)) is None
    assert w.pool_of_queue(q + "@t1") == MODEL_CALLS
    w.children.run = _never  # type: ignore[method-assign]  # the kind's run is not what is tested here
    w.kinds._kinds[CHILD_ROLLOUT_FUNC] = w.children.kind(max_attempts=2)
    w.spawn(_job("top-b1-0", CHILD_ROLLOUT_FUNC, _child(2, 0)), K.child_queue(q, 2))
    assert (w.capacity.free(repl_pool(2)), w.capacity.free(repl_pool(3)), w.capacity.free(MODEL_CALLS)) == (0, 1, 256)
    # misplaced: a depth-3 child on the depth-2 queue, a sub-call on a child queue, a child on the model queue
    w.spawn(_job("top-b1-1", CHILD_ROLLOUT_FUNC, _child(3, 1)), K.child_queue(q, 2))
    w.spawn(_job("top-b1-2", SUB_LLM_FUNC, {"prompt": "x"}), K.child_queue(q, 3))
    w.spawn(_job("top-b1-3", CHILD_ROLLOUT_FUNC, _child(2, 3)), q)
    errors = {d.job.job_id: json.loads(d.result_json) for d in w.jobs.take_done()}
    assert set(errors) == {"top-b1-1", "top-b1-2", "top-b1-3"}
    assert all(e["status"] == "error" and e["error_kind"] == "payload" for e in errors.values())
    assert errors["top-b1-1"]["content"].startswith("[error] invalid child-rollout job")
    assert errors["top-b1-3"]["content"].startswith("[error] invalid sub-LLM job")
    for t in w.jobs.tasks:
        t.cancel()


async def _never(payload: object, job: StartedJob) -> object:
    import asyncio

    await asyncio.Event().wait()
    raise AssertionError("unreachable")
