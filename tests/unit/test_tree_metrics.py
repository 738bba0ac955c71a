"""Per-depth and tree-wide figures from nested rlm_batch trajectories (producer/tree_metrics.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rlmq.producer.tree_metrics import (
    MAX_TREE_DEPTH,
    PER_DEPTH,
    TREE_KEYS,
    depth_key,
    first_sub_call_error,
    is_tree_metric,
    tree_metrics,
)
from tests.trees import cell, child, leaf, llm_batch, rlm_batch, root, sub, three_levels

EXPECTED = {
    1: {"rollouts": 1, "root_turns": 2, "root_completion_tokens": 110, "sub_llm_call_count": 1,
        "sub_llm_completion_tokens": 7},
    2: {"rollouts": 2, "root_turns": 2, "root_completion_tokens": 60, "sub_llm_call_count": 2,
        "sub_llm_completion_tokens": 10},
    3: {"rollouts": 4, "root_turns": 8, "root_completion_tokens": 120, "sub_llm_call_count": 8,
        "sub_llm_completion_tokens": 28},
}  # fmt: skip


def test_three_levels_by_depth_and_in_all() -> None:
    m = tree_metrics(three_levels(), {})
    for d, figures in EXPECTED.items():
        for name, n in figures.items():
            assert m[depth_key(d, name)] == n, (d, name)
    assert depth_key(4, "rollouts") not in m
    assert m["rlm_batch_count"] == 3  # the top's, and one in each depth-2 child
    assert m["rlm_call_count"] == 3 + 2 * 3
    assert m["rlm_call_failed_count"] == 1 + 2  # the rejected slot, the two error slots
    assert m["tree_rollout_count"] == 7 and m["tree_depth"] == 3
    assert m["tree_root_turns"] == 12 and m["tree_root_completion_tokens"] == 290
    assert m["tree_sub_llm_call_count"] == 11 and m["tree_sub_llm_completion_tokens"] == 45
    # charged to the tree's budget: every sub-LLM token and the children's root tokens, not the top's
    assert m["tree_charged_completion_tokens"] == 45 + 60 + 120
    assert set(m) == set(TREE_KEYS) | {depth_key(d, n) for d in (1, 2, 3) for n in PER_DEPTH}
    assert all(type(v) is int for v in m.values())
    assert all(is_tree_metric(k) for k in m)
    assert not any(is_tree_metric(k) for k in ("main_rlm_turns", "sub_llm_call_count", "depth1_x", "xdepth1_rollouts"))


def test_own_metrics_win_over_counting_the_events() -> None:
    # the top's own figures come from its metrics (verifiers' names), here unlike its events
    m = tree_metrics(three_levels(), {"main_rlm_turns": 5, "main_rlm_completion_tokens": 999})
    assert m["depth1_root_turns"] == 5 and m["depth1_root_completion_tokens"] == 999
    assert m["tree_charged_completion_tokens"] == 45 + 60 + 120  # the top's root is never charged


def test_no_recursion_is_depth_one_only() -> None:
    m = tree_metrics([root(12), llm_batch(1, 2, 3), cell(), root(4)], {})
    assert m["depth1_rollouts"] == 1 and m["depth1_sub_llm_call_count"] == 3
    assert m["rlm_call_count"] == 0 and m["tree_rollout_count"] == 1 and m["tree_depth"] == 1
    assert m["tree_charged_completion_tokens"] == 6
    assert tree_metrics([], {}) == tree_metrics([], {}) and tree_metrics([], {})["depth1_root_turns"] == 0


def test_max_depth_gives_every_depth_its_names() -> None:
    m = tree_metrics([root(1)], {}, max_depth=3)
    assert m["depth3_rollouts"] == 0 and m["depth2_root_turns"] == 0 and "depth4_rollouts" not in m


def test_max_depth_at_the_deepest_level_counts_plain_calls() -> None:
    # at max_depth rlm_batch runs as plain sub-LLM calls: slots without a child
    m = tree_metrics([root(1), rlm_batch([sub(0, 8), sub(1, 9)])], {}, max_depth=1)
    assert m["depth1_sub_llm_call_count"] == 2 and m["depth1_sub_llm_completion_tokens"] == 17
    assert m["rlm_call_count"] == 2 and m["tree_rollout_count"] == 1


def test_a_child_computed_at_its_depth_is_taken_from_its_metrics() -> None:
    # each child's host ran tree_metrics at the child's depth; the parent's copy of the trajectory
    # is cut (no events at all): the figures are the same as walking the whole tree
    whole = tree_metrics(three_levels(), {})
    traj = three_levels()
    for ev in traj:
        if ev["type"] == "rlm_batch":
            for res in ev["results"]:
                if "child" in res:
                    c = res["child"]
                    c["metrics"] = tree_metrics(c["trajectory"], {}, depth=2)
                    c["trajectory"] = c["trajectory"][:1]  # only its first root turn kept
    assert tree_metrics(traj, {}) == whole


def test_a_child_computed_at_the_wrong_depth_is_walked() -> None:
    # a child host that ran it as a top rollout (depth 1): its figures are not under its depth
    whole = tree_metrics(three_levels(), {})
    traj = three_levels()
    mid = traj[2]["results"][0]["child"]
    mid["metrics"] = tree_metrics(mid["trajectory"], {})
    assert tree_metrics(traj, {}) == whole


def test_a_child_reports_its_own_depth() -> None:
    m = tree_metrics([root(30), rlm_batch([leaf(0)])], {}, depth=2, max_depth=3)
    assert "depth1_rollouts" not in m
    assert m["depth2_rollouts"] == 1 and m["depth3_rollouts"] == 1 and m["tree_depth"] == 3
    assert m["tree_charged_completion_tokens"] == 30 + 30 + 7  # a child's own root turns are charged
    with pytest.raises(ValueError):
        tree_metrics([], {}, depth=0)


def test_truncated_and_malformed_parts_count_as_nothing() -> None:
    traj: list[Any] = copy.deepcopy(three_levels())
    batch = traj[2]
    batch["tasks"] = batch["tasks"][:1]  # tasks are bounded in the event; results are what counts
    traj += [
        "not an event",
        {"type": "rlm_batch", "results": "not a list"},
        {"type": "rlm_batch", "results": [None, {"status": "ok", "completion_tokens": "12"},
                                          {"child": "not a dict", "completion_tokens": float("nan")},
                                          {"child": {"metrics": [], "trajectory": None}}]},
        {"type": "note", "text": "root completion-token limit reached"},
    ]  # fmt: skip
    m = tree_metrics(traj, {"main_rlm_turns": True, "main_rlm_completion_tokens": -5})
    assert m["rlm_batch_count"] == 3 + 2 and m["rlm_call_count"] == 9 + 3
    # the child with neither metrics nor trajectory is a rollout of no turns
    assert m["depth2_rollouts"] == 3 and m["depth2_root_turns"] == EXPECTED[2]["root_turns"]
    # the two slots without a dict child are calls of no tokens (a rejected slot is no call that
    # ran); bool/negative own figures are 0
    assert m["depth1_sub_llm_call_count"] == 1 + 2 and m["depth1_sub_llm_completion_tokens"] == 7
    assert m["depth1_root_turns"] == 0 and m["depth1_root_completion_tokens"] == 0


def test_nesting_past_the_limit_is_not_walked() -> None:
    traj: list[dict[str, Any]] = [root(1)]
    for d in range(MAX_TREE_DEPTH + 5, 1, -1):
        traj = [root(1), rlm_batch([child(0, d, traj)])]
    m = tree_metrics(traj, {})
    assert m["tree_depth"] == MAX_TREE_DEPTH and m["tree_rollout_count"] == MAX_TREE_DEPTH
    assert depth_key(MAX_TREE_DEPTH + 1, "rollouts") not in m


def test_the_first_failed_sub_call_of_a_tree_is_found_in_a_child() -> None:
    ok = {"type": "llm_batch", "results": [{"status": "ok", "content": "a"}, {"status": "rejected", "error": "spent"}]}
    child = {
        "stop_reason": "answer_ready",
        "trajectory": [
            {"type": "llm_batch", "results": [{"status": "error", "error": "model server http://h/v1 is unreachable"}]}
        ],
    }
    tree = [ok, {"type": "rlm_batch", "results": [{"status": "ok", "child": child}]},
            {"type": "llm_batch", "results": [{"status": "error", "error": "later"}]}]  # fmt: skip
    assert first_sub_call_error(tree) == "model server http://h/v1 is unreachable"
    assert first_sub_call_error([ok]) is None
