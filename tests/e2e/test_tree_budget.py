"""One hard budget for a rollout tree at depth 3, end to end: a top rollout in this
process (``RLMEnv``, ``max_depth=3``), real ``rlmq worker --repl-slots`` processes hosting its
children and grandchildren, the scripted model serving every root turn and leaf, a real Redis.

The scripted root splits its ``context`` by ``[[mock:rlm-split:K1,K2,K3]]`` (one ``K`` per depth):
``rlm_batch`` at depths 1 and 2, ``llm_batch`` of ``K3`` leaves at depth 3. The top rollout's root
model has a name of its own (``TOP_MODEL``), so the model server's ``per_model`` counters of the
fleet's model are exactly what the tree's budget is charged with: child root turns (depth >= 2) and
leaf sub-LLM calls. Leaves sleep at the server (``[[mock:sleep:S]]``) so that their calls overlap;
the server's ``in_flight_peak`` is the high-water mark of requests open at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from bench.needle import needle_rows
from rlmq.cli.local import LocalFleet
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv

pytestmark = pytest.mark.e2e

TOP_MODEL = "top-root"
SLOTS_PER_DEPTH = 16


def stats(fleet: LocalFleet) -> dict[str, Any]:
    with urllib.request.urlopen(str(fleet.base_url).removesuffix("/v1") + "/stats", timeout=30) as resp:
        doc: dict[str, Any] = json.load(resp)
    return doc


def reset_stats(fleet: LocalFleet) -> None:
    req = urllib.request.Request(str(fleet.base_url).removesuffix("/v1") + "/stats", method="DELETE")
    with urllib.request.urlopen(req, timeout=30):
        pass


@pytest.fixture(scope="module")
def tree_fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    """Two REPL-hosting workers, each 16 child rollouts per depth and 800 sub-calls in flight."""
    with LocalFleet(
        redis_url=redis_url, model=f"tree-{uuid.uuid4().hex[:6]}", workers=2, worker_concurrency=800,
        repl_slots=SLOTS_PER_DEPTH, worker_grace=1.0, log_dir=str(tmp_path_factory.mktemp("tree-logs")),
    ) as f:  # fmt: skip
        yield f


def tree_row(splits: str, leaf: str, lines: int, seed: int = 1) -> DatasetRow:
    """A needle row whose question splits by ``splits`` per depth and carries the ``leaf`` directives."""
    row = needle_rows(1, lines, parts=1, seed=seed)[0]
    question = str(row["question"]).replace("[[mock:rlm-split:1]]", f"[[mock:rlm-split:{splits}]] {leaf}")
    return DatasetRow(id=f"tree-{seed}", question=question, context=row["context"], answer=row["answer"])


def env_for(fleet: LocalFleet, *, max_depth: int = 3, **kw: Any) -> RLMEnv:
    settings = load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model)
    return RLMEnv(settings=settings, sub_model=fleet.model, max_depth=max_depth, **kw)


async def ledger_snapshot(fleet: LocalFleet, ledger_id: str) -> Any:
    r = async_client(str(fleet.redis_url))
    try:
        return await BudgetLedger(r).snapshot(ledger_id)
    finally:
        await r.aclose()


async def run_tree(fleet: LocalFleet, row: DatasetRow, **kw: Any) -> tuple[Any, str, dict[str, Any], float]:
    """Run ``row`` as a top rollout; its result, its id (= its tree's ledger id), the model server's
    counters of the run and its seconds."""
    reset_stats(fleet)
    rid = "top" + uuid.uuid4().hex[:12]
    started = time.monotonic()
    async with env_for(fleet, **kw) as env:
        res = await env.rollout(row, model=TOP_MODEL, rollout_id=rid)
    return res, rid, stats(fleet), time.monotonic() - started


def refused_first_turns(trajectory: list[dict[str, Any]]) -> dict[str, int]:
    """Per depth: child rollouts the budget ended before their first root turn (``budget_spent``
    with no ``root`` event): the tree's leaves had taken what a whole turn needs before they came."""
    found: dict[str, int] = {}
    for ev in trajectory:
        for res in ev.get("results") or [] if ev.get("type") == "rlm_batch" else []:
            child = res.get("child") if isinstance(res, dict) else None
            if not isinstance(child, dict):
                continue
            inner = child.get("trajectory") or []
            if child.get("stop_reason") == "budget_spent" and not any(e.get("type") == "root" for e in inner):
                key = str(child.get("depth"))
                found[key] = found.get(key, 0) + 1
            for depth, n in refused_first_turns(inner).items():
                found[depth] = found.get(depth, 0) + n
    return found


BUDGET = 23_000
CAP = 16
SPLITS = "4,5,75"  # 4 children, 20 grandchildren, 1,500 leaf calls: the demand exceeds the budget


@pytest.mark.parametrize("leaf", ["[[mock:spend-all]]", "[[mock:tokens:10-16]]"], ids=["spend-all", "early-stop"])
async def test_depth_3_with_1000_leaf_calls_in_flight_holds_the_tree_budget(tree_fleet: LocalFleet, leaf: str) -> None:
    """Spend-all leaves (each call spends its whole grant) and early-stopping ones (10..16 of a
    16-token grant): either way the tree asks for more than its budget (1,500 leaves; 24 child root
    turns), over 1,000 leaf calls are at the model server at once, the server serves at most the
    budget and at least 90 % of it, the ledger's figures are the server's, and a call is refused
    only once the budget is spent (what is left unspent is less than one grant)."""
    row = tree_row(SPLITS, f"{leaf} [[mock:sleep:6]]", lines=1600)
    res, rid, st, took = await run_tree(
        tree_fleet, row, sub_llm_max_completion_tokens=BUDGET, sub_llm_per_call_max_tokens=CAP,
        max_sub_llm_parallelism=100, rollout_timeout=110, sub_call_timeout=100,
    )  # fmt: skip
    tree = st["per_model"][tree_fleet.model]  # child root turns and leaves: what the tree is charged
    snap = await ledger_snapshot(tree_fleet, rid)
    print(
        f"\n{leaf}: {took:.1f} s, served {tree['completion_tokens']}/{BUDGET} in {tree['completions']} completions "
        f"({st['per_role']['sub']['completions']} leaves), peak in flight {st['in_flight_peak']}, "
        f"root requests by depth {st['root_requests_by_depth']}, ledger {snap}"
    )
    assert res.row.stop_reason == "answer_ready", res.row.error
    # Every child ran, or (grandchildren that started late on a loaded machine, after the leaves of
    # those before them had reserved what a whole root turn needs) was refused its first turn by the
    # budget, which is the budget's rule, not a lost child.
    refused = refused_first_turns(res.trajectory)
    asked = st["root_requests_by_depth"]
    assert {d: asked.get(d, 0) + refused.get(d, 0) for d in ("1", "2", "3")} == {"1": 1, "2": 4, "3": 20}, (
        asked,
        refused,
    )
    assert st["in_flight_peak"] >= 1000
    assert 0.9 * BUDGET <= tree["completion_tokens"] <= BUDGET
    assert tree["faults"] == 0 and st["per_model"][TOP_MODEL]["completions"] == 1  # the top answers at its first turn
    assert snap is not None and snap.limit == BUDGET
    assert snap.used == snap.charged == tree["completion_tokens"] and snap.overrun == 0  # all settled, as served
    assert snap.grants == tree["completions"]
    leaves = st["per_role"]["sub"]["completions"]
    assert leaves < 1500 and snap.rejections >= 1500 - leaves  # the demand exceeded the budget ...
    assert BUDGET - snap.used < CAP  # ... and a call was refused only once less than a grant was left
    assert res.row.metrics["tree_charged_completion_tokens"] == snap.used


def tree_keys_without_ttl(r: redis.Redis, tags: set[str]) -> list[str]:
    """Keys whose hash tag is one of ``tags`` (``{id}``) and that have no TTL."""
    bad = []
    for key in r.scan_iter(match="*{*}*", count=1000):
        name = key.decode()
        tag = name[name.index("{") : name.index("}") + 1]
        if tag in tags and r.ttl(key) == -1:
            bad.append(name)
    return bad


@pytest.mark.parametrize("end", ["cancelled", "timeout"])
async def test_after_the_top_ends_its_tree_is_refused_and_served_nothing(tree_fleet: LocalFleet, end: str) -> None:
    """The top rollout ends (cancelled, as ``rlmq run`` does on SIGINT, or past its
    ``rollout_timeout``) while its grandchildren are still running: each has 6 slow leaf calls of
    which only 2 run at once, so the rest ask for their reservations after the top's end. Every one
    is refused: the model server gets no request after the top's end, the ledger is closed, a
    reservation under any node of the tree is refused, and every key of the tree has a TTL."""
    row = tree_row("2,2,6", "[[mock:tokens:5]] [[mock:sleep:4]]", lines=200, seed=2)
    kw: dict[str, Any] = {"sub_llm_max_completion_tokens": 50_000, "max_sub_llm_parallelism": 2}
    kw["rollout_timeout"] = 60.0 if end == "cancelled" else 12.0
    reset_stats(tree_fleet)
    rid = "top" + uuid.uuid4().hex[:12]
    sync = redis.Redis.from_url(str(tree_fleet.redis_url))
    try:
        async with env_for(tree_fleet, **kw) as env:
            task = asyncio.create_task(env.rollout(row, model=TOP_MODEL, rollout_id=rid))
            deadline = time.monotonic() + 60
            while stats(tree_fleet)["per_role"]["sub"]["requests"] < 4:  # the grandchildren's first leaves
                assert time.monotonic() < deadline and not task.done(), "no leaf call reached the model"
                await asyncio.sleep(0.05)  # polling another process's state, bounded by the deadline
            if end == "cancelled":
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:
                res = await asyncio.wait_for(task, 30)
                assert res.row.stop_reason != "answer_ready"
        ended = time.time()
        at_end = stats(tree_fleet)
        assert sync.hget(f"rlmq:{{{rid}}}:budget", "closed") == b"1"
        live_children = [m.decode() for m in sync.zrange("rlmq:rollouts", 0, -1)]
        assert live_children or at_end["in_flight"] > 0  # the tree was still at work when its top ended
        # every node key of the tree, and the chain of a grandchild still running, is refused from now on
        r = async_client(str(tree_fleet.redis_url))
        try:
            ledger = BudgetLedger(r)
            for node in [rid, *live_children]:
                grant = await ledger.reserve(rid, f"late-{node}", 8, time.time() + 30, nodes=[rid, node])
                assert grant.tree_refused and grant.refusal_reason == "tree_closed", grant
        finally:
            await r.aclose()
        # the children wind down on their own: refused calls, then their end
        deadline = time.monotonic() + 60
        while sync.zcard("rlmq:rollouts") or stats(tree_fleet)["in_flight"]:
            assert time.monotonic() < deadline, "the tree's rollouts did not end"
            await asyncio.sleep(0.1)  # polling the workers' state, bounded by the deadline
        after = stats(tree_fleet)
        budget_hash = sync.hgetall(f"rlmq:{{{rid}}}:budget")
        print(
            f"\n{end}: at the end {at_end['requests']} requests ({at_end['in_flight']} in flight), "
            f"later {after['requests']}; last request {after['last_request_at'] - ended:+.3f} s from the end; "
            f"children live at the end {len(live_children)}; ledger {budget_hash}"
        )
        assert after["requests"] == at_end["requests"]  # nothing after the top's end
        assert after["last_request_at"] is not None and after["last_request_at"] < ended
        tags = {"{" + rid + "}", *("{" + c + "}" for c in live_children)}
        assert tree_keys_without_ttl(sync, tags) == []
        assert not [k for k in sync.scan_iter(match=f"*{{{rid}}}*") if sync.ttl(k) == -1]
    finally:
        sync.close()


CHILD_CODE = "answer['content'] = 'best of ' + context; r = llm_batch(['leaf [[mock:tokens:50]]'] * 12)"


async def test_a_child_root_turn_granted_too_little_ends_the_child_with_its_best_answer(tree_fleet: LocalFleet) -> None:
    """One child: its first root turn (T tokens) sets its best answer and spends 600 tokens on 12
    leaves, leaving 40 of the budget T + 640 unspent; its second root turn would be granted that,
    less than ``child_root_min_grant_tokens`` (256) and than an estimate of a root turn (at least 64):
    the child ends with stop reason ``budget_spent`` and its best answer, and the model server never
    sees that cut turn. (A remainder of 64 or more, above 1.25 x its first turn, would be taken:
    ``tests/unit/test_engine_tree.py``.)"""
    from rlmq.scripted.server import root_code_directive

    child_prompt = "child " + root_code_directive(CHILD_CODE)
    top_code = (
        f"r = rlm_batch([{{'prompt': {child_prompt!r}, 'context': 'part A'}}]); "
        "answer['content'] = r[0]; answer['ready'] = True"
    )
    turn_tokens = len(json.dumps({"code": CHILD_CODE}).split())  # the scripted model's count of that tool call
    budget = turn_tokens + 640
    row = DatasetRow(id="small-grant", question="top " + root_code_directive(top_code), context="ctx", answer="x")
    res, rid, st, _ = await run_tree(
        tree_fleet, row, sub_llm_max_completion_tokens=budget, sub_llm_per_call_max_tokens=64,
        child_root_min_grant_tokens=256, max_depth=2,
    )  # fmt: skip
    assert res.row.stop_reason == "answer_ready", res.row.error
    assert res.row.final_answer == "best of part A"
    (event,) = [e for e in res.trajectory if e["type"] == "rlm_batch"]
    (slot,) = event["results"]
    assert slot["status"] == "ok" and slot["content"] == "best of part A"
    assert slot["child"]["stop_reason"] == "budget_spent" and slot["child"]["depth"] == 2
    tree = st["per_model"][tree_fleet.model]
    assert tree["completions"] == 1 + 12  # the child's first turn and its leaves; no second turn
    root_calls = [p for p in st["params"] if p.get("model") == tree_fleet.model and p.get("tool_names")]
    assert len(root_calls) == 1 and root_calls[0]["max_tokens"] >= 256
    snap = await ledger_snapshot(tree_fleet, rid)
    assert snap is not None and snap.used == tree["completion_tokens"] <= budget
    assert 0 < budget - snap.used < 64  # left unspent: less than any estimate of a root turn
    assert snap.charged == snap.used  # the too-small grant was given back


STRESS_RUNS = int(os.environ.get("RLMQ_TREE_STRESS_RUNS", "8"))
"""Trees of the stress test (even); the suite runs 8, the repetition runs 20 and more
(``RLMQ_TREE_STRESS_RUNS=20``), as bench/results/tree_budget_2026-11-25.md reports."""
STRESS_BUDGET = 3_000


async def test_zero_overshoot_in_repeated_trees_under_cpu_load(tree_fleet: LocalFleet) -> None:
    """Two busy loops hog the CPUs; STRESS_RUNS depth-3 trees (2 children, 4 grandchildren, 48 spend-all
    leaves: demand above the budget), two at a time, each under its own budget of 3,000: for every
    tree its ledger charged and settled at most the budget, the model server served exactly what the
    two ledgers of a pair settled, and what is left unspent is less than a root turn's minimum grant."""
    import subprocess
    import sys

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    figures: list[tuple[int, int, float]] = []
    try:
        for pair in range(STRESS_RUNS // 2):
            reset_stats(tree_fleet)
            rows = [tree_row("2,2,12", "[[mock:spend-all]]", lines=120, seed=10 + 2 * pair + k) for k in range(2)]
            rids = ["top" + uuid.uuid4().hex[:12] for _ in rows]
            started = time.monotonic()
            async with env_for(
                tree_fleet, sub_llm_max_completion_tokens=STRESS_BUDGET, sub_llm_per_call_max_tokens=64,
                sub_sampling_args={"max_tokens": 400}, rollout_timeout=100,  # child root turns: 400 whole
            ) as env:  # fmt: skip
                results = await asyncio.gather(
                    *(env.rollout(row, model=TOP_MODEL, rollout_id=rid) for row, rid in zip(rows, rids, strict=True))
                )
            took = time.monotonic() - started
            st = stats(tree_fleet)
            served = st["per_model"][tree_fleet.model]["completion_tokens"]
            snaps = [await ledger_snapshot(tree_fleet, rid) for rid in rids]
            used = [s.used if s is not None else -1 for s in snaps]
            for res, snap in zip(results, snaps, strict=True):
                assert res.row.stop_reason == "answer_ready", res.row.error
                assert snap is not None and snap.charged == snap.used <= STRESS_BUDGET and snap.overrun == 0
                assert STRESS_BUDGET - snap.used < 400  # less than a child root turn's whole grant left
                figures.append((snap.used, snap.rejections, took))
            assert served == sum(used)  # the two trees' tokens, as the server counted them
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    used_all, took_all = [f[0] for f in figures], [f[2] for f in figures]
    print(
        f"\n{len(figures)} trees under load: used {min(used_all)}..{max(used_all)} of {STRESS_BUDGET}, "
        f"rejections {sum(f[1] for f in figures)}, {min(took_all):.1f}..{max(took_all):.1f} s per pair"
    )
    assert len(figures) == STRESS_RUNS
