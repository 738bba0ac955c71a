"""The budget wait's wake-ups, model-checked: every ordering of a small scenario, on the real code.

:mod:`tests.budget_model` runs schedules of a worker's waiting calls, the rest of the fleet's
settles, pub/sub connection kills, connect latency and pool state on fakeredis, driving the real
:class:`~rlmq.common.budget.ledger.BudgetLedger` (its Lua) and :class:`~rlmq.common.budget.wait.ReleaseWaits`,
and checks that no call is left waiting once its tokens are free and nothing runs. On the code
before its fix the explorer's fifth schedule is a counterexample:
``[call(R0) +0 call(R1) +quiet settle(R0) +0 settle(R1) +quiet] connect_turns=2 warm=False``
(two first waits made two pub/sub connections; R0's call parked on the one nobody read).
``python -m bench.budget_wake --explore`` runs the larger spaces (11,520 schedules).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.budget_model import QUIET, Schedule, explore, run, schedules


def test_every_ordering_of_two_rollouts_first_waits_and_their_releases_wakes_every_call() -> None:
    # 2 rollouts x (W's call, O's settle): 24 orders x 8 gap patterns x cold/warm pool = 384 schedules
    n, counterexample, why = explore(schedules([1, 1], gaps=[0, QUIET], connect_turns=[2]))
    assert counterexample is None, f"lost wake-up after {n} schedules: {counterexample}: {why}"
    assert n == 384


@st.composite
def wider(draw: st.DrawFn) -> Schedule:
    """A schedule of the wider space: up to 3 calls over 2 rollouts, a pub/sub kill or not,
    any order, gaps of 0, 1, 3 turns or until quiet, connects of 0-3 turns, either pool."""
    calls = draw(st.sampled_from([[1, 1], [2, 1], [1, 2]]))
    events: list[tuple[str, int]] = [("call", r) for r, n in enumerate(calls) for _ in range(n)]
    events += [("settle", 0), ("settle", 1)]
    if draw(st.booleans()):
        events.append(("kill", -1))
    order = draw(st.permutations(events))
    gaps = draw(st.lists(st.sampled_from([0, 1, 3, QUIET]), min_size=len(order) - 1, max_size=len(order) - 1))
    return Schedule(tuple(order), (*gaps, QUIET), draw(st.integers(0, 3)), draw(st.booleans()))


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(wider())
def test_sampled_orderings_with_kills_and_several_calls_of_a_rollout_wake_every_call(schedule: Schedule) -> None:
    assert run(schedule) is None, str(schedule)
