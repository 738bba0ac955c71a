"""The rollout engine's tree side on fakeredis, with an in-memory root model and REPL: a top opens
and closes its tree's ledger and node; a child charges the tree, carries its chain, reserves every
root turn and ends with its best answer (``budget_spent``) when the grant is too small or its tree
or parent is gone."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import pytest
from redis.asyncio import Redis

from rlmq.common import keys as K
from rlmq.common.budget.ledger import ROOT, TREE_CLOSED, BudgetLedger
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import RolloutOptions
from rlmq.common.tree import TreePosition
from rlmq.producer.engine import run_rollout
from rlmq.producer.rollout import Rollout
from tests.root_fakes import FakeRoot, code_turn, host_for

ROW = DatasetRow(id="row-1", question="Find the code.", context="The code is 7.", answer="7")


@pytest.fixture
async def redis() -> AsyncIterator[Redis]:
    client = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer())
    yield client
    await client.aclose()


async def test_a_top_opens_its_node_and_closes_its_tree_when_it_ends(redis: Redis) -> None:
    seen: dict[str, Any] = {}

    async def turn(kwargs: dict[str, Any]) -> Any:
        seen["node"] = await redis.exists(K.LedgerKeys("top1").node("top1"))
        seen["node_ttl"] = await redis.ttl(K.LedgerKeys("top1").node("top1"))
        return code_turn("answer:7")

    host = host_for(redis, FakeRoot(turn), [])
    options = RolloutOptions(sub_llm_max_completion_tokens=1000, child_root_min_grant_tokens=100)
    res = await run_rollout(
        host, ROW, options, model="m", queue="q", rollout_id="top1", tree=TreePosition("top1", 1, 3)
    )
    assert res.row.stop_reason == "answer_ready"
    assert seen["node"] == 1 and 0 < seen["node_ttl"] <= 30
    assert not await redis.exists(K.LedgerKeys("top1").node("top1"))
    budget = await redis.hgetall(K.LedgerKeys("top1").budget)
    assert budget[b"closed"] == b"1" and budget[b"cap:root"] == b"2048"  # max(cap 2048, 2 x 100)
    refused = await BudgetLedger(redis).reserve("top1", "late", None, None)  # a call without a chain
    assert refused.code == TREE_CLOSED


async def test_an_unbudgeted_tree_gets_a_liveness_only_ledger_and_a_lone_top_nothing(redis: Redis) -> None:
    host = host_for(redis, FakeRoot(code_turn("answer:7")), [])
    await run_rollout(host, ROW, RolloutOptions(), model="m", queue="q", rollout_id="t2", tree=TreePosition("t2", 1, 2))
    assert await redis.hget(K.LedgerKeys("t2").budget, "unlimited") == b"1"
    assert await redis.hget(K.LedgerKeys("t2").budget, "closed") == b"1"
    await run_rollout(host, ROW, RolloutOptions(), model="m", queue="q", rollout_id="t3")
    assert not await redis.exists(K.LedgerKeys("t3").budget)  # depth 1, no budget: as before


async def test_a_child_charges_its_tree_and_carries_its_chain(redis: Redis) -> None:
    ledger = BudgetLedger(redis, ttl=60)
    await ledger.open("top", 1000, cap=100, kind_caps={ROOT: 300})
    for node in ("top", "mid"):
        await ledger.open_node("top", node)
    seen: dict[str, Any] = {}
    root = FakeRoot(code_turn("x = 1", completion_tokens=40), code_turn("answer:7", completion_tokens=25))

    async def handler_probe(kwargs: dict[str, Any]) -> Any:
        seen.setdefault("max_tokens", []).append(kwargs.get("max_tokens"))
        seen["own_node"] = await redis.exists(K.LedgerKeys("top").node("kid-1"))
        if len(seen["max_tokens"]) == 1:  # the REPL's llm_batch, as the engine serves it
            await host.interception.handlers["t1"](["a prompt"])  # type: ignore[attr-defined]
        return await root.chat(**kwargs)

    async def record_batch(ro: Rollout, prompts: list[str]) -> tuple[list[str], str]:
        seen["spec"] = host.batches.spec(ro, "b1")
        return ["ok"], "summary"

    host = host_for(redis, FakeRoot(handler_probe), [])
    host.batches.run = record_batch  # type: ignore[method-assign]
    options = RolloutOptions(sub_llm_max_completion_tokens=1000, child_root_min_grant_tokens=100)
    pos = TreePosition("top", depth=3, max_depth=3, nodes=("top", "mid"), parent_id="mid")
    res = await run_rollout(host, ROW, options, model="m", queue="q", rollout_id="kid-1", tree=pos)
    assert (res.row.stop_reason, res.row.final_answer) == ("answer_ready", "7")
    assert seen["max_tokens"] == [300, 300] and seen["own_node"] == 1
    snap = await ledger.snapshot("top")
    assert snap is not None and (snap.used, snap.charged, snap.grants) == (65, 65, 2)  # both root turns
    assert not await redis.exists(K.LedgerKeys("kid-1").budget)  # a child opens no ledger of its own
    assert not await redis.exists(K.LedgerKeys("top").node("kid-1"))  # its node is gone with it
    assert await ledger.node_alive("top", "mid") and "sub_llm_budget_limit" not in res.row.metrics
    # its llm_batch jobs carry the tree's ledger and the chain ending with it
    spec = seen["spec"]
    assert (spec.ledger_id, spec.nodes, spec.call.budgeted) == ("top", ("top", "mid", "kid-1"), True)


async def test_a_child_root_turn_takes_the_last_remainder_it_can_use(redis: Redis) -> None:
    ledger = BudgetLedger(redis, ttl=60)
    await ledger.open("top", 500, cap=100, kind_caps={ROOT: 300})
    await ledger.open_node("top", "top")
    # turn 1: a whole 300 granted, 290 spent, content set; turn 2: 210 free and nothing live: the
    # budget's last remainder, taken (before, it was given back and the child ended while the tree
    # had 210 tokens a turn could use); turn 3: 10 left, below child_root_min_grant_tokens: the
    # child ends with its best answer
    root = FakeRoot(
        code_turn("content:partial 7", completion_tokens=290),
        code_turn("x = 2", completion_tokens=200),
    )
    host = host_for(redis, root, [])
    options = RolloutOptions(sub_llm_max_completion_tokens=500, child_root_min_grant_tokens=100, max_turns=10)
    pos = TreePosition("top", depth=2, max_depth=2, nodes=("top",), parent_id="top")
    res = await run_rollout(host, ROW, options, model="m", queue="q", rollout_id="kid-2", tree=pos)
    assert (res.row.stop_reason, res.row.final_answer) == ("budget_spent", "partial 7")
    assert [c["max_tokens"] for c in root.calls] == [300, 210]
    assert any(e.get("type") == "note" and "less than the 100 a root turn can use" in e["text"] for e in res.trajectory)
    snap = await ledger.snapshot("top")
    assert snap is not None and (snap.used, snap.charged) == (490, 490)  # the 10-token remainder went back


async def test_a_child_root_turn_takes_a_remainder_below_min_grant_that_holds_a_root_turn(redis: Redis) -> None:
    ledger = BudgetLedger(redis, ttl=60)
    await ledger.open("top", 650, cap=250, kind_caps={ROOT: 300})
    await ledger.open_node("top", "top")
    for rid, n in (("s1", 250), ("s2", 110)):  # sub-calls of the tree spent 360: 290 are left
        grant, _, _ = await ledger.acquire("top", rid, n, time.time() + 60)
        assert grant.tokens == n
        await ledger.settle("top", rid, n)
    # turn 1: the last remainder, 290 (no root turn has ended: usable down to min_grant), ends on
    # its own after 40 tokens; turn 2: 250 free, below child_root_min_grant_tokens (256) but above
    # an estimate of a root turn (max(64, 1.25 x 40)): taken, and the child answers (before, it
    # ended budget_spent while its tree had 250 tokens for a 40-token turn)
    root = FakeRoot(code_turn("x = 1", completion_tokens=40), code_turn("answer:7", completion_tokens=40))
    host = host_for(redis, root, [])
    options = RolloutOptions(sub_llm_max_completion_tokens=650, child_root_min_grant_tokens=256, max_turns=10)
    pos = TreePosition("top", depth=2, max_depth=2, nodes=("top",), parent_id="top")
    res = await run_rollout(host, ROW, options, model="m", queue="q", rollout_id="kid-3", tree=pos)
    assert (res.row.stop_reason, res.row.final_answer) == ("answer_ready", "7"), (res.row.error, res.trajectory)
    assert [c["max_tokens"] for c in root.calls] == [290, 250]
    snap = await ledger.snapshot("top")
    assert snap is not None and (snap.used, snap.charged) == (440, 440)


async def test_a_child_of_a_closed_tree_or_gone_parent_ends_before_calling_its_model(redis: Redis) -> None:
    ledger = BudgetLedger(redis, ttl=60)
    await ledger.open("top", 5000, cap=100, kind_caps={ROOT: 300})
    await ledger.open_node("top", "top")  # "mid" is not alive: it died
    root = FakeRoot(code_turn("answer:7"))
    host = host_for(redis, root, [])
    options = RolloutOptions(sub_llm_max_completion_tokens=5000)
    pos = TreePosition("top", depth=3, max_depth=3, nodes=("top", "mid"), parent_id="mid")
    res = await run_rollout(host, ROW, options, model="m", queue="q", rollout_id="orphan", tree=pos)
    assert res.row.stop_reason == "budget_spent" and root.calls == []
    assert any("parent_gone" in e.get("text", "") and "mid" in e["text"] for e in res.trajectory)
    await ledger.close("top", top_node="top")
    pos2 = TreePosition("top", depth=2, max_depth=3, nodes=("top",), parent_id="top")
    res2 = await run_rollout(host, ROW, options, model="m", queue="q", rollout_id="late", tree=pos2)
    assert res2.row.stop_reason == "budget_spent" and root.calls == []
    assert any("tree_closed" in e.get("text", "") for e in res2.trajectory)


async def test_the_live_set_refreshes_node_keys_and_never_revives_a_gone_one(redis: Redis) -> None:
    host = host_for(redis, FakeRoot(code_turn("answer:7")), [])
    ledger = BudgetLedger(redis, ttl=60)
    await ledger.open_node("top", "a", ttl=5)
    await host.live.enter("a", 60, {"row": "r"}, node=("top", 20))
    await host.live.enter("b", 60, {"row": "r"}, node=("top", 20))  # its node was never opened (or is gone)
    await host.live.refresh()
    assert 5 < await redis.ttl(K.LedgerKeys("top").node("a")) <= 20
    assert not await redis.exists(K.LedgerKeys("top").node("b"))
    await host.live.leave("a")
    await redis.expire(K.LedgerKeys("top").node("a"), 3)
    await host.live.refresh_leases()
    assert await redis.ttl(K.LedgerKeys("top").node("a")) <= 3  # a rollout that left is not refreshed
