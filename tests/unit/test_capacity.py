"""The capacity rules of a worker as pure functions, and the pools that apply them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlmq.workers.capacity import MODEL_CALLS, Capacity, PoolSpec, free_slots, must_wait_to_resume


def test_parked_calls_give_their_slots_back_up_to_max_parked() -> None:
    assert free_slots(slots=4, held=4, parked=0, max_parked=16) == 0
    assert free_slots(slots=4, held=4, parked=3, max_parked=16) == 3  # three wait for tokens: three more may start
    assert free_slots(slots=4, held=20, parked=16, max_parked=16) == 0  # the parked allowance is used up
    assert free_slots(slots=4, held=21, parked=17, max_parked=16) == -1  # past it, parked calls hold their slots
    assert free_slots(slots=4, held=4, parked=4, max_parked=0) == 0  # sub_llm_budget_max_parked=0


def test_a_granted_call_resumes_only_when_running_calls_leave_it_a_slot() -> None:
    # 4 slots; 6 held: 2 parked, 1 at the gate (this one), so 3 run: a slot is free.
    assert not must_wait_to_resume(slots=4, held=6, parked=2, resuming=1)
    # 4 run: it waits.
    assert must_wait_to_resume(slots=4, held=7, parked=2, resuming=1)
    # Nothing else runs: it passes whatever the pool's size (never a deadlock).
    assert not must_wait_to_resume(slots=1, held=3, parked=2, resuming=1)


@given(
    slots=st.integers(1, 64),
    running=st.integers(0, 100),
    parked=st.integers(0, 100),
    resuming=st.integers(1, 100),
    max_parked=st.integers(0, 100),
)
def test_running_calls_never_exceed_the_pool_after_a_resume(
    slots: int, running: int, parked: int, resuming: int, max_parked: int
) -> None:
    held = running + parked + resuming
    if not must_wait_to_resume(slots, held, parked, resuming):
        assert running < slots  # this call's start keeps running calls within the pool
    # a fetch round fills the pool up to its size with the held jobs that count: all but the
    # parked ones within the allowance
    counted = held - min(parked, max_parked)
    assert counted + free_slots(slots, held, parked, max_parked) == slots


def test_capacity_counts_per_pool() -> None:
    cap = Capacity({MODEL_CALLS: PoolSpec(2, max_parked=1), "repl": PoolSpec(1)})
    cap.hold(MODEL_CALLS)
    cap.hold(MODEL_CALLS)
    cap.hold("repl")
    assert (cap.free(MODEL_CALLS), cap.free("repl")) == (0, 0)
    cap.set_parked(MODEL_CALLS, 2)  # one of the two gives its slot back (max_parked=1)
    assert cap.free(MODEL_CALLS) == 1 and cap.free("repl") == 0  # pools do not lend each other slots
    cap.set_parked(MODEL_CALLS, 1)
    cap.enter_resume(MODEL_CALLS)  # the other one was granted: nothing else runs, it goes
    assert not cap.must_wait(MODEL_CALLS)
    cap.leave_resume(MODEL_CALLS)
    cap.let_go("repl")
    assert cap.held("repl") == 0 and cap.free("repl") == 1
    with pytest.raises(KeyError, match="no capacity pool"):
        cap.hold("gpu")
    with pytest.raises(ValueError):
        PoolSpec(0)
    with pytest.raises(ValueError):
        Capacity({})
