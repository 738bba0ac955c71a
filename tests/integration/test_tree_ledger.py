"""The tree ledger on a real Redis: a parked call refused when its tree closes, and zero overshoot
with many parallel reservations across a three-level chain whose middle node dies mid-way.

Nothing sleeps to synchronise: every wait is on an event or a future, bounded by a deadline.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import pytest

from rlmq.common.budget.ledger import GRANTED, NODE_GONE, REJECTED, ROOT, TREE_CLOSED, WAIT, WAITED_OUT, BudgetLedger
from tests.integration.conftest import parked

pytestmark = pytest.mark.integration


async def test_a_parked_call_is_refused_when_its_tree_closes(two: tuple[BudgetLedger, BudgetLedger]) -> None:
    host, worker = two
    top = f"t{uuid.uuid4().hex[:8]}"
    await host.open(top, 100, cap=100)
    for node in (top, "c1", "g1"):
        await host.open_node(top, node)
    deadline = time.time() + 30
    assert (await worker.reserve(top, "a", None, deadline, nodes=(top, "c1"))).tokens == 100
    waiter = asyncio.create_task(worker.acquire(top, "b", None, deadline, nodes=(top, "c1", "g1")))
    await parked(worker, 1)
    assert await host.close(top, top_node=top)  # the top ended: its tree closes, its parked calls wake
    grant, waits, _ = await asyncio.wait_for(waiter, 10)  # "a" still holds the budget: no settle needed
    assert (grant.code, grant.refusal_reason, waits) == (TREE_CLOSED, "tree_closed", 1)


async def test_a_parked_call_under_an_ended_node_is_refused_at_once(two: tuple[BudgetLedger, BudgetLedger]) -> None:
    host, worker = two
    top = f"t{uuid.uuid4().hex[:8]}"
    await host.open(top, 100, cap=100)
    for node in (top, "c1", "c2"):
        await host.open_node(top, node)
    deadline = time.time() + 30
    assert (await worker.reserve(top, "a", None, deadline, nodes=(top, "c2"))).tokens == 100
    under = asyncio.create_task(worker.acquire(top, "b", None, deadline, nodes=(top, "c1")))
    beside = asyncio.create_task(worker.acquire(top, "c", None, deadline, nodes=(top, "c2")))
    await parked(worker, 2)
    await host.close_node(top, "c1")  # c1 ended: its parked call is refused, c2's waits on
    grant, _, _ = await asyncio.wait_for(under, 10)
    assert (grant.code, grant.gone_node) == (NODE_GONE, "c1")
    await parked(worker, 1)
    await host.settle(top, "a", 30)
    other, _, _ = await asyncio.wait_for(beside, 10)
    assert (other.code, other.tokens) == (GRANTED, 70)


async def test_zero_overshoot_with_parallel_reservations_across_a_three_level_chain(
    two: tuple[BudgetLedger, BudgetLedger],
) -> None:
    """400 calls from two "workers" on leaves of a 3-level tree (2 children x 3 grandchildren),
    sub-LLM and root kinds, each spending a random part of its grant; one child dies half-way
    (its node is deleted): its grandchildren's later calls are refused, the budget is never
    overshot, and nearly all of it is used."""
    a, b = two
    top = f"t{uuid.uuid4().hex[:8]}"
    limit = 20_000
    await a.open(top, limit, cap=300, kind_caps={ROOT: 500})
    chains = [(top, f"c{i}", f"g{i}{j}") for i in range(2) for j in range(3)]
    for node in {n for chain in chains for n in chain}:
        await a.open_node(top, node)
    rng = random.Random(22)
    spent = 0
    outcomes: list[int] = []
    dead = asyncio.Event()
    deadline = time.time() + 60

    async def call(k: int) -> None:
        nonlocal spent
        ledger = a if k % 2 else b
        chain = chains[k % len(chains)] if k % 5 else chains[k % len(chains)][:2]  # some root turns of children
        kind = ROOT if k % 5 == 0 else "sub"
        if k == 200:
            await a.close_node(top, "c1")
            dead.set()
        grant, _, _ = await ledger.acquire(top, f"r{k}", None, deadline, kind=kind, nodes=chain, margin=0.5)
        outcomes.append(grant.code)
        if grant.code == GRANTED:
            if dead.is_set() and "c1" in chain:
                raise AssertionError(f"granted to a call under a dead node: {chain}")
            used = rng.randint(grant.tokens // 2, grant.tokens)
            spent += used
            await asyncio.sleep(0)  # let other calls interleave between reserve and settle
            await ledger.settle(top, f"r{k}", used)

    await asyncio.wait_for(asyncio.gather(*(call(k) for k in range(400))), 60)
    snap = await a.snapshot(top)
    assert snap is not None
    assert spent == snap.used <= limit, (spent, snap)
    assert snap.charged == snap.used  # every reservation settled
    assert NODE_GONE in outcomes and WAIT not in outcomes and WAITED_OUT not in outcomes
    assert REJECTED in outcomes  # the budget ran out: the leftover is less than a useful grant
    assert snap.used >= 0.9 * limit, snap


async def test_whole_grants_across_a_three_level_tree_never_cut_an_answer_the_budget_could_pay(
    two: tuple[BudgetLedger, BudgetLedger],
) -> None:
    """Depth 3, the tree's one budget of 20,000: 40 sub-LLM calls on the grandchildren (answers
    of 1,500 tokens, each spending min(grant, 1,500): the worst case) and 4 root turns of the
    children (300 tokens each), whole caps of 2,048 (the default ``max_tokens``). The tokens spent
    stay within the budget; at least 12 sub-answers are whole and at most 2 cut; every root turn
    that ran was granted whole (a remainder is given back, as the child's root client does)."""
    a, b = two
    top = f"t{uuid.uuid4().hex[:8]}"
    limit, cap = 20_000, 2048
    await a.open(top, limit, cap=cap, kind_caps={ROOT: cap})
    chains = [(top, f"c{i}", f"g{i}{j}") for i in range(2) for j in range(3)]
    for node in {n for chain in chains for n in chain}:
        await a.open_node(top, node)
    deadline = time.time() + 60
    sub_spent: list[int] = []
    root_granted: list[int] = []

    async def call(k: int, kind: str, answer: int) -> None:
        ledger = a if k % 2 else b
        chain = chains[k % len(chains)] if kind == "sub" else chains[k % len(chains)][:2]
        grant, _, _ = await ledger.acquire(top, f"{kind}{k}", cap, deadline, kind=kind, nodes=chain, margin=0.5)
        if not grant.granted:
            return
        if kind == ROOT and grant.cut:  # whole or not started: the remainder goes back
            await ledger.settle(top, f"{kind}{k}", 0)
            return
        used = min(grant.tokens, answer)
        (root_granted if kind == ROOT else sub_spent).append(grant.tokens if kind == ROOT else used)
        await asyncio.sleep(0.01 * (k % 5))  # calls overlap and end in another order than they began
        await ledger.settle(top, f"{kind}{k}", used)

    calls = [call(k, "sub", 1500) for k in range(40)] + [call(100 + k, ROOT, 300) for k in range(4)]
    await asyncio.wait_for(asyncio.gather(*calls), 60)
    snap = await a.snapshot(top)
    assert snap is not None and snap.used <= limit and snap.charged == snap.used, snap
    whole, cut = sum(1 for u in sub_spent if u == 1500), sum(1 for u in sub_spent if u < 1500)
    assert whole >= 12 and cut <= 2, (whole, cut, sub_spent)
    assert all(g == cap for g in root_granted), root_granted
    assert snap.used >= 0.9 * limit, snap
