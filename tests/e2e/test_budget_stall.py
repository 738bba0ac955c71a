"""Issue 25: small budgets under CPU load never leave a call waiting for free tokens.

``rlmq demo --sub-llm-max-completion-tokens 20`` stalled for the sub-call deadline in 2 of 8
runs on a busy machine. This repeats that shape (8 rollouts at once, 6 prompts of 2 tokens
each, budget 20, fresh worker processes every round) with a CPU burner on every core. Every
call fits the budget, so any call rejected or waiting out its deadline waited while tokens were
free and nothing ran. The long version: ``python -m bench.budget_wake`` (hundreds of rounds).
"""

from __future__ import annotations

import pytest

from bench.budget_wake import stress

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(300)
def test_small_budget_rounds_under_cpu_load_never_wait_for_free_tokens() -> None:
    out = stress(4, timeout=20.0)  # a lost wake-up shows as a call waiting out its 20 s deadline
    assert out["batches"] == 32
    assert out["stalled_batches"] == 0, out["examples_not_ok"]
    assert out["parks"] > 0  # calls did wait for releases: the case under test happened
    assert out["wall_max_s"] < 15, out
