"""Size bounds on child trajectories: a child's on its worker, a parent's allowance."""

from __future__ import annotations

import json
from typing import Any

from rlmq.producer.child_trajectory import KeptChildren, cut_trajectory, json_chars


def _child(n_events: int, chars: int) -> dict[str, Any]:
    traj = [{"type": "cell", "output": "y" * chars} for _ in range(n_events)]
    return {"index": 0, "status": "ok", "content": "z" * 5_000, "child": {"depth": 2, "trajectory": traj}}


def test_a_small_trajectory_is_kept_as_is() -> None:
    t = [{"type": "root", "n": 1}, {"type": "cell", "output": "ok"}]
    assert cut_trajectory(t, 1_000) is t


def test_a_big_trajectory_is_cut_in_order_and_says_what_it_left_out() -> None:
    t: list[Any] = [{"type": "cell", "output": "x" * 100} for _ in range(100)]
    t.append({"type": "root", "n": 101, "content": "the answer"})
    cut = cut_trajectory(t, 2_000)
    assert json_chars(cut) <= 2_000
    assert cut[-2] == t[-1]  # the last turn, small, is still there
    assert cut[-1]["type"] == "cut" and cut[-1]["events_dropped"] == 101 - (len(cut) - 1)
    assert cut[-1]["chars"] == json_chars(t) and cut[-1]["max_chars"] == 2_000
    assert cut[: len(cut) - 2] == t[: len(cut) - 2]


def test_an_rlm_batch_event_too_big_keeps_its_results_without_the_childrens_trajectories() -> None:
    ev = {"type": "rlm_batch", "batch_id": "b1", "tasks": ["t"], "results": [_child(50, 10_000), "junk"]}
    cut = cut_trajectory([ev], 20_000)
    assert json_chars(cut) <= 20_000
    stub, marker = cut
    (r,) = stub["results"]  # a malformed result is left out
    assert r["child"]["trajectory"] == [] and r["child"]["trajectory_cut"] == 50 and r["child"]["depth"] == 2
    assert r["content"].startswith("z" * 2_000) and "cut at 2,000 of 5,000" in r["content"]
    assert marker["events_stubbed"] == 1 and marker["events_dropped"] == 0
    assert ev["results"][0]["child"]["trajectory"]  # the input is not changed


def test_a_rollouts_allowance_of_child_trajectories_runs_out_in_call_order() -> None:
    kept = KeptChildren(max_chars=25_000)
    a, b, c = _child(1, 10_000), _child(2, 10_000), _child(1, 10)
    assert kept.keep(a) is a
    out_b = kept.keep(b)
    assert out_b["child"]["trajectory"] == [] and out_b["child"]["trajectory_cut"] == 2
    assert out_b["content"] == b["content"] and b["child"]["trajectory"]  # answer kept, input unchanged
    assert kept.keep(c)["child"]["trajectory"] == []  # later ones too: no holes in the order
    plain = {"index": 3, "status": "error", "content": "[error] no worker"}
    assert kept.keep(plain) is plain
    json.dumps([a, out_b])
