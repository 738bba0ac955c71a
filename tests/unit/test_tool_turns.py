"""FairTurns: hosted-tool calls in flight per rollout, fair between rollouts. Orders and counts of
turns on asyncio's own scheduling; no timing is asserted (each wait has a deadline)."""

from __future__ import annotations

import asyncio

import pytest

from rlmq.common.tool_turns import FairTurns
from rlmq.workers.hosted_tools import RolloutSlots


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_rollout_alone_has_the_whole_cap_and_the_rest_wait() -> None:
    turns = FairTurns(4, clock=Clock())
    assert turns.room("hog") == 4
    for _ in range(4):
        turns.hold("hog")
    assert turns.room("hog") == 0 and turns.held("hog") == 4


def test_another_rollouts_single_call_holds_a_flood_of_young_calls_to_one() -> None:
    clock = Clock()
    turns = FairTurns(16, linger=0.1, young=0.05, clock=clock)
    hog = [turns.hold("hog") for _ in range(16)]
    assert turns.room("victim") == 16  # never waits behind the flood
    victim = turns.hold("victim")
    for turn in hog[:15]:
        turns.release("hog", turn)
    assert turns.room("hog") == 0  # one young call: its share beside the victim's one call
    clock.now += 0.05
    assert turns.room("hog") == 1  # that call waits on a slow tool now: one more may start
    turns.hold("hog")
    assert turns.room("hog") == 0
    turns.release("victim", victim)
    assert turns.room("hog") == 0  # the victim calls again soon: it still counts between its calls
    clock.now += 0.1
    assert turns.room("hog") == 14  # gone quiet: the hog has its whole cap back (2 in flight)


def test_a_slow_flood_fills_its_cap_one_young_call_at_a_time() -> None:
    clock = Clock()
    turns = FairTurns(4, linger=0.1, young=0.05, clock=clock)
    turns.hold("victim")
    for _ in range(4):
        assert turns.room("hog") == 1
        turns.hold("hog")
        assert turns.room("hog") == 0
        clock.now += 0.05
    assert turns.room("hog") == 0 and turns.held("hog") == 4  # the cap holds


def test_rollouts_that_stopped_lingering_are_forgotten_while_another_stays_busy() -> None:
    clock = Clock()
    turns = FairTurns(4, linger=0.1, clock=clock)
    turns.hold("busy")
    for i in range(1000):
        turns.release(f"r{i}", turns.hold(f"r{i}"))
        clock.now += 0.01
    assert len(turns._ended) <= 11  # those that ended in the last 0.1 s, not every one seen


def test_two_floods_keep_the_whole_cap_each() -> None:
    turns = FairTurns(8, clock=Clock())
    for _ in range(8):
        turns.hold("a")
    for _ in range(8):
        assert turns.room("b") > 0
        turns.hold("b")
    assert turns.held("a") == turns.held("b") == 8
    assert turns.room("a") == turns.room("b") == 0


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        FairTurns(0)
    with pytest.raises(ValueError):
        FairTurns(4, linger=-1)
    with pytest.raises(ValueError):
        FairTurns(4, young=0)


async def test_a_rollouts_waiting_calls_start_in_the_order_they_asked() -> None:
    turns = FairTurns(1)
    started: list[int] = []

    async def call(i: int) -> None:
        turn = await turns.acquire("r", 10)
        assert turn is not None
        started.append(i)
        await asyncio.sleep(0)
        turns.release("r", turn)

    await asyncio.wait_for(asyncio.gather(*(call(i) for i in range(20))), 10)
    assert started == list(range(20))


async def test_a_flood_beside_a_sequential_rollout_gets_one_turn_at_a_time() -> None:
    """The hog (2,000 calls queued, cap 16) beside a victim that makes 50 calls one after another:
    once the victim calls, every hog call starts with no other hog call in flight, until the
    victim is done; the hog's calls all run, each once."""
    turns = FairTurns(16, linger=60.0, young=60.0)  # the victim counts for the whole test; no call ages
    hog_in_flight: list[int] = []
    victim_on = asyncio.Event()
    victim_done = asyncio.Event()
    ran: list[int] = []

    async def hog_call(i: int) -> None:
        turn = await turns.acquire("hog", 30)
        assert turn is not None
        try:
            if victim_on.is_set() and not victim_done.is_set():
                hog_in_flight.append(turns.held("hog"))
            ran.append(i)
            await asyncio.sleep(0)
        finally:
            turns.release("hog", turn)

    async def victim() -> None:
        while turns.held("hog") < 16:  # the flood under way first
            await asyncio.sleep(0)
        victim_on.set()
        for _ in range(50):
            turn = await turns.acquire("victim", 30)
            assert turn is not None
            await asyncio.sleep(0)
            turns.release("victim", turn)
        victim_done.set()

    await asyncio.wait_for(asyncio.gather(victim(), *(hog_call(i) for i in range(2000))), 60)
    assert hog_in_flight and max(hog_in_flight) == 1, hog_in_flight[:40]
    assert sorted(ran) == list(range(2000))


async def test_a_lingering_rollout_lets_the_waiting_flood_back_in_when_it_stops_counting() -> None:
    turns = FairTurns(4, linger=0.05, young=0.05)
    victim = turns.hold("victim")
    turns.hold("hog")
    waiting = [asyncio.create_task(turns.acquire("hog", 10)) for _ in range(3)]
    await asyncio.sleep(0)
    assert turns.waiting("hog") == 3
    turns.release("victim", victim)  # the hog still holds 1 while the victim lingers
    assert turns.held("hog") == 1
    done, _ = await asyncio.wait(waiting, timeout=10)  # then its cap comes back on its own
    assert len(done) == 3 and all(t.result() is not None for t in done)
    assert turns.held("hog") == 4


async def test_a_turn_that_never_comes_is_refused_and_a_cancelled_waiter_takes_none() -> None:
    turns = FairTurns(1)
    held = turns.hold("r")
    assert await turns.acquire("r", 0.01) is None
    assert turns.waiting("r") == 0
    waiter = asyncio.create_task(turns.acquire("r", 10))
    await asyncio.sleep(0)
    turns.release("r", held)  # the turn is handed to the waiter...
    waiter.cancel()  # ...which is cancelled before it runs: the turn is given back
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert turns.held("r") == 0 and turns.waiting("r") == 0
    assert turns.room("r") == 1


async def test_rollout_slots_never_queue_a_rollout_behind_anothers_flood() -> None:
    slots = RolloutSlots(per_rollout=4)
    gate = asyncio.Event()

    async def hold() -> str:
        await gate.wait()
        return "hog"

    flood = [asyncio.create_task(slots.run("hog", 1e12, hold)) for _ in range(100)]
    while slots.in_flight("hog") < 4:
        await asyncio.sleep(0)

    async def quick() -> str:
        return "victim"

    assert await asyncio.wait_for(slots.run("victim", 1e12, quick), 10) == "victim"
    gate.set()
    assert await asyncio.wait_for(asyncio.gather(*flood), 30) == ["hog"] * 100
    assert slots.in_flight("hog") == 0
