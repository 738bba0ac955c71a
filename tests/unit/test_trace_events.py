"""The trajectory verifiers gets in ``trace.info["rlmq"]``: long prompts and tasks cut, at every depth."""

from __future__ import annotations

from rlmq.verifiers_plugin.harness import trace_events
from tests.trees import child, llm_batch, rlm_batch, root


def test_prompts_and_tasks_are_cut_in_the_children_too() -> None:
    long = "p" * 50
    inner = llm_batch(1)
    inner["prompts"] = [long, "short"]
    grandchild = child(0, 3, [root(1), inner])
    mid = child(0, 2, [root(1), rlm_batch([grandchild], tasks=[long])])
    traj = [root(1), rlm_batch([mid, {"not": "a result"}], tasks=[long, "t"]), {"type": "rlm_batch", "tasks": "x"}]
    out = trace_events(traj, 10)
    cut = "pppppppppp[... 50 characters in all]"
    assert out[1]["tasks"] == [cut, "t"]
    mid_traj = out[1]["results"][0]["child"]["trajectory"]
    assert mid_traj[1]["tasks"] == [cut]
    assert mid_traj[1]["results"][0]["child"]["trajectory"][1]["prompts"] == [cut, "short"]
    assert out[2] == {"type": "rlm_batch", "tasks": "x"}
    assert traj[1]["tasks"] == [long, "t"]  # the rollout's own trajectory is left as it was


def test_trainable_turns_reach_the_trace_as_json_lists() -> None:
    from rlmq.common.token_wire import ServedTokens, TurnEncoder

    enc = TurnEncoder()
    turn = enc.encode(1, ServedTokens([1, 2, 3], [4, 5], [-0.5, -0.25]), None, {"temperature": 1.0}).model_dump()
    sub = enc.encode(1, None, "no_token_ids", {}).model_dump()
    batch = llm_batch(1)
    batch["results"][0]["turn_tokens"] = [sub]
    [first, second] = trace_events([{"type": "root", "content": "", "tokens": turn}, batch], 500)
    assert (first["prompt_token_ids"], first["completion_token_ids"]) == ([1, 2, 3], [4, 5])
    assert first["completion_logprobs"] == [-0.5, -0.25] and "tokens" not in first
    assert second["results"][0]["steps"] == [
        {"turn": 1, "sampling": {}, "trainable": False, "untrainable_reason": "no_token_ids"}
    ]
