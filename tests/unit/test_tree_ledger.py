"""The tree ledger on fakeredis (Lua through lupa): node chains, a closed ledger, liveness-only ledgers."""

from __future__ import annotations

import asyncio
import time

import fakeredis
import pytest

from rlmq.common.budget.ledger import (
    GRANTED,
    NO_LEDGER,
    NODE_GONE,
    ROOT,
    TREE_CLOSED,
    UNLIMITED,
    BudgetLedger,
    node_ttl,
)
from rlmq.common.errors import ConfigError
from rlmq.common.keys import LedgerKeys


def make() -> tuple[fakeredis.aioredis.FakeRedis, BudgetLedger]:
    r = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer())
    return r, BudgetLedger(r, ttl=60)


async def open_tree(ledger: BudgetLedger, limit: int = 1000) -> None:
    """A tree top -> c1 -> g1 (three levels) in ledger "top"."""
    await ledger.open("top", limit, cap=100, kind_caps={ROOT: 200})
    for node in ("top", "c1", "g1"):
        await ledger.open_node("top", node)


async def test_a_live_chain_is_granted_and_a_gone_node_refuses_its_descendants_only() -> None:
    r, ledger = make()
    await open_tree(ledger)
    deadline = time.time() + 60
    g = await ledger.reserve("top", "a", None, deadline, nodes=("top", "c1", "g1"))
    assert (g.tokens, g.code) == (100, GRANTED)
    root = await ledger.reserve("top", "b", None, deadline, kind=ROOT, nodes=("top", "c1"))
    assert (root.tokens, root.code) == (200, GRANTED)
    await ledger.close_node("top", "c1")  # the middle rollout ended (or its attempt died)
    refused = await ledger.reserve("top", "c", None, deadline, nodes=("top", "c1", "g1"))
    assert (refused.tokens, refused.code, refused.gone_node) == (0, NODE_GONE, "c1")
    assert (refused.tree_refused, refused.refusal_reason) == (True, "parent_gone")
    other = await ledger.reserve("top", "d", None, deadline, nodes=("top",))  # a sibling subtree: still fine
    assert other.code == GRANTED
    # settling a reservation of the gone subtree still counts what it spent
    s = await ledger.settle("top", "a", 40)
    assert s.released == 60
    snap = await ledger.snapshot("top")
    assert snap is not None and snap.used == 40 and snap.charged == 40 + 200 + 100
    assert await r.ttl(LedgerKeys("top").node("g1")) > 0


async def test_a_closed_ledger_refuses_every_reservation_with_or_without_a_chain() -> None:
    r, ledger = make()
    await open_tree(ledger)
    deadline = time.time() + 60
    assert (await ledger.reserve("top", "a", None, deadline)).code == GRANTED
    assert await ledger.close("top", top_node="top")
    assert not await r.exists(LedgerKeys("top").node("top"))
    for rid, nodes in (("b", ()), ("c", ("top", "c1")), ("d", ("c1",))):
        g = await ledger.reserve("top", rid, None, deadline, nodes=nodes)
        assert (g.code, g.refusal_reason) == (TREE_CLOSED, "tree_closed"), nodes
    assert (await ledger.settle("top", "a", 10)).released == 90  # settles still count after the close
    assert await r.ttl(LedgerKeys("top").budget) > 0  # the close keeps the ledger's TTL
    assert not await ledger.close("gone")  # a lost ledger is not re-created
    assert not await r.exists(LedgerKeys("gone").budget)


async def test_an_expired_node_refuses_like_a_closed_one() -> None:
    r, ledger = make()
    await open_tree(ledger)
    await r.pexpire(LedgerKeys("top").node("top"), 1)
    deadline = time.time() + 5
    while await r.exists(LedgerKeys("top").node("top")):
        assert time.time() < deadline
        await asyncio.sleep(0.005)
    g = await ledger.reserve("top", "a", None, time.time() + 60, nodes=("top", "c1", "g1"))
    assert (g.code, g.gone_node) == (NODE_GONE, "top")
    # refresh never re-creates a gone node
    await ledger.refresh_nodes([("top", "top", 30), ("top", "c1", 30)])
    assert not await ledger.node_alive("top", "top") and await ledger.node_alive("top", "c1")


async def test_a_liveness_only_ledger_answers_unlimited_while_the_chain_lives() -> None:
    r, ledger = make()
    await ledger.open_unlimited("t2", ttl=50)
    await ledger.open_node("t2", "t2")
    await ledger.open_node("t2", "k1")
    g = await ledger.reserve("t2", "a", None, time.time() + 60, nodes=("t2", "k1"))
    assert (g.tokens, g.code) == (0, UNLIMITED)
    assert (await ledger.reserve("t2", "b", None, None)).code == UNLIMITED  # the top's own call
    assert await ledger.snapshot("t2") is None  # no budget figures
    assert 0 < await r.ttl(LedgerKeys("t2").budget) <= 50
    await ledger.close_node("t2", "k1")
    assert (await ledger.reserve("t2", "c", None, None, nodes=("t2", "k1"))).code == NODE_GONE
    await ledger.close("t2", top_node="t2")
    assert (await ledger.reserve("t2", "d", None, None)).code == TREE_CLOSED
    # a ledger without a budget and not opened as liveness-only is "no ledger", as before
    assert (await ledger.reserve("none", "e", None, None, nodes=("none",))).code == NO_LEDGER


async def test_invalid_node_ids_and_ttls_are_refused_before_redis() -> None:
    _, ledger = make()
    with pytest.raises(ConfigError):
        await ledger.reserve("top", "a", None, None, nodes=("bad node",))
    with pytest.raises(ValueError):
        await ledger.open_node("top", "n", ttl=0)
    assert node_ttl(3600) == 30 and node_ttl(12) == 12
