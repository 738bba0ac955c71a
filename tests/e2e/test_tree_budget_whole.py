"""Whole answers under a tree budget at depth 3, with real workers: a top rollout in this process
(``RLMEnv``, ``max_depth=3``), real ``rlmq worker --repl-slots`` processes hosting its children
and grandchildren, the scripted model serving every root turn and leaf, a real Redis.

The scripted root splits its ``context`` by ``[[mock:rlm-split:2,2,4]]``: 2 children, 4
grandchildren, 16 leaves that answer in 1,500 tokens (``[[mock:tokens:1500]]``, paced by
``[[mock:tps:N]]``), 24,000 tokens of leaves under a tree budget of 20,000. The rollout's sampling
``max_tokens`` (2,000) is the cap of every leaf and of every child root turn. What was served is the
model server's own count (``GET /stats``): ``per_model`` of the fleet's model is what the tree is
charged with (the top's root model has a name of its own), and ``params`` holds the ``max_tokens``
each request was sent with; a leaf answer is whole when that was at least 1,500.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from rlmq.cli.local import LocalFleet
from tests.e2e.test_tree_budget import TOP_MODEL, ledger_snapshot, run_tree, tree_row

pytestmark = pytest.mark.e2e

BUDGET = 20_000
CAP = 2_000
ANSWER = 1_500
LEAVES = 16


@pytest.fixture(scope="module")
def fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    """Two REPL-hosting workers, 4 child rollouts per depth and 64 sub-calls in flight each."""
    with LocalFleet(
        redis_url=redis_url, model=f"tree-whole-{uuid.uuid4().hex[:6]}", workers=2, worker_concurrency=64,
        repl_slots=4, worker_grace=1.0, log_dir=str(tmp_path_factory.mktemp("tree-whole-logs")),
    ) as f:  # fmt: skip
        yield f


async def test_d_depth_3_leaves_whole_until_the_last_remainder_and_child_root_turns_never_cut(
    fleet: LocalFleet,
) -> None:
    """The tree asks for more than its budget: the server serves at most the budget and at least
    90 % of it; every child root turn is sent with its whole cap (never a grant cut below it); every
    leaf's first segment is a whole cap or the estimate of an answer but for the budget's last
    remainder (at most two calls, one after the other), at most one leaf answer is cut, and the whole
    answers are within one of a sequential caller's; the ledger's figures are the server's."""
    row = tree_row("2,2,4", f"[[mock:tokens:{ANSWER}]] [[mock:tps:3000]]", lines=40, seed=31)
    res, rid, st, took = await run_tree(
        fleet, row, sub_llm_max_completion_tokens=BUDGET, sampling_args={"max_tokens": CAP},
        max_sub_llm_parallelism=8, rollout_timeout=60, sub_call_timeout=30,
    )  # fmt: skip
    tree = st["per_model"][fleet.model]
    mine = [p for p in st["params"] if p.get("model") == fleet.model]
    roots = [p["max_tokens"] for p in mine if "call_python_repl" in p.get("tool_names", [])]
    leaf_calls = [p for p in mine if not p.get("tool_names")]
    # An answer's first segment, and the continuations of answers that reached their segment's end.
    leaves = sorted((p["max_tokens"] for p in leaf_calls if not p.get("continue_final_message")), reverse=True)
    continued = [p["max_tokens"] for p in leaf_calls if p.get("continue_final_message")]
    snap = await ledger_snapshot(fleet, rid)
    print(
        f"\n{took:.1f} s, served {tree['completion_tokens']}/{BUDGET}, root turns by depth "
        f"{st['root_requests_by_depth']} sent with {roots}, leaves sent with {leaves}, continued with "
        f"{continued}, ledger {snap}"
    )
    assert res.row.stop_reason == "answer_ready", res.row.error
    assert st["per_model"][TOP_MODEL]["completions"] == 1 and tree["faults"] == 0
    assert len(mine) == tree["requests"] == tree["completions"]  # every request of the tree is in params
    # Child root turns: each sent with its whole cap, none with what was left of the budget.
    assert roots and all(m == CAP for m in roots), roots
    assert st["root_requests_by_depth"].get("2") == 2 and len(roots) == sum(st["root_requests_by_depth"].values()) - 1
    # Leaves: a first segment of a whole cap before any answer ended, then 1.25 x the longest answer
    # that ended (1,875: a whole answer in one segment), but for the budget's last remainder, which
    # runs one call at a time (a first grant below that which may still fit an answer, then what that
    # one left): at most two, and at most one answer cut, by the server's own count.
    assert 0 < len(leaves) < LEAVES  # the demand exceeded the budget: some leaves were refused
    estimate = ANSWER + ANSWER // 4
    remainder = [m for m in leaves if m not in (CAP, estimate)]
    assert len(remainder) <= 2 and len([m for m in leaves if m < ANSWER]) <= 1, leaves
    assert len(continued) <= 1, continued  # only a remainder grant below the answer is continued
    leaf_tokens = st["per_role"]["sub"]["completion_tokens"]
    assert (len(leaves) - 1) * ANSWER <= leaf_tokens <= len(leaves) * ANSWER, (leaves, leaf_tokens)
    # As many whole answers as a sequential caller gets from what the child root turns left.
    oracle = (BUDGET - (tree["completion_tokens"] - leaf_tokens)) // ANSWER
    assert leaf_tokens // ANSWER >= oracle - 1, (leaves, leaf_tokens, oracle)
    # Nearly all the budget used, never more, and the ledger says what the server served.
    assert 0.9 * BUDGET <= tree["completion_tokens"] <= BUDGET
    assert snap is not None and snap.used == snap.charged == tree["completion_tokens"] and snap.overrun == 0
    assert res.row.metrics["tree_charged_completion_tokens"] == snap.used
    assert took < 30
