"""``rlmq export-samples``: branches of an expanded tree become samples (ids, mask, logprobs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlmq.cli.export_samples import Staleness, branch_samples, export_samples
from rlmq.cli.main import main
from rlmq.common.errors import ConfigError
from rlmq.common.token_wire import ServedTokens, TurnEncoder, expand_trajectory


def encoded(turns: list[ServedTokens | None]) -> list[dict[str, Any]]:
    enc = TurnEncoder()
    return [enc.encode(i + 1, t, None if t else "no_token_ids", {"temperature": 1.0}).model_dump()
            for i, t in enumerate(turns)]  # fmt: skip


T1 = ServedTokens([1, 2, 3], [4, 5], [-0.5, -0.25])
T2 = ServedTokens([1, 2, 3, 4, 5, 6, 7], [8], [-1.0])  # continues T1: one sample of two turns
T3 = ServedTokens([9, 9], [10], [-2.0])  # a re-rendered history: a new part


def tree() -> list[dict[str, Any]]:
    roots = encoded([T1, T2, None, T3])
    sub = {"status": "ok", "index": 0, "turn_tokens": encoded([T3])}
    rejected = {"status": "rejected", "index": 1, "turn_tokens": encoded([T1])}  # never a sample
    child = {"status": "ok", "index": 0, "child": {"trajectory": [{"type": "root", "tokens": encoded([T1])[0]}]}}
    return [
        {"type": "root", "tokens": roots[0]}, {"type": "root", "tokens": roots[1]},
        {"type": "llm_batch", "batch_id": "b1", "results": [sub, rejected]},
        {"type": "root", "tokens": roots[2]}, {"type": "root", "tokens": roots[3]},
        {"type": "rlm_batch", "batch_id": "r1", "results": [child]},
    ]  # fmt: skip


def test_branches_become_samples_with_the_mask_on_sampled_tokens_only() -> None:
    samples = list(branch_samples(expand_trajectory(tree())))
    assert [(s["branch"], s["part"], s["kind"], s["depth"], s["turns"]) for s in samples] == [
        ("root", 0, "root", 1, 2), ("root", 1, "root", 1, 1), ("b1/0", 0, "sub", 1, 1), ("r1/0/root", 0, "root", 2, 1),
    ]  # fmt: skip
    two = samples[0]
    assert two["token_ids"] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert two["loss_mask"] == [0, 0, 0, 1, 1, 0, 0, 1]
    assert two["logprobs"] == [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -1.0]
    assert samples[1]["token_ids"] == [9, 9, 10] and samples[1]["loss_mask"] == [0, 0, 1]


def test_the_command_writes_one_line_per_sample_with_the_reward(tmp_path: Path) -> None:
    row = {"id": "q1", "final_answer": "a", "answer": "a", "correct": True, "stop_reason": "answer_ready",
           "metrics": {}, "error": None}  # fmt: skip
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    record = {"id": "q1", "messages": [], "trajectory": expand_trajectory(tree())}
    (tmp_path / "trajectories.jsonl").write_text(json.dumps(record) + "\n")
    assert main(["export-samples", str(tmp_path)]) == 0
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and {x["reward"] for x in lines} == {1.0} and {x["id"] for x in lines} == {"q1"}
    with pytest.raises(ConfigError):
        export_samples(tmp_path / "nowhere")


@pytest.mark.parametrize("tokens", [False, True], ids=["run-without-tokens", "only-untrainable-turns"])
def test_no_sample_says_why_and_exits_non_zero(
    tmp_path: Path, tokens: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    row = {"id": "q1", "final_answer": "a", "answer": "a", "correct": True, "stop_reason": "answer_ready",
           "metrics": {}, "error": None}  # fmt: skip
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    trajectory = [{"type": "root", "content": "", "tool_calls": []}]
    if tokens:  # a server that returned no ids: the turn is kept, marked untrainable
        trajectory = [{"type": "root", "tokens": encoded([None])[0]}]
    record = {"id": "q1", "messages": [], "trajectory": expand_trajectory(trajectory)}
    (tmp_path / "trajectories.jsonl").write_text(json.dumps(record) + "\n")
    assert main(["export-samples", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    why = "none of the 1 turn(s) with token ids was trainable" if tokens else "without --include-sub-llm-in-trajectory"
    assert "no sample" in err and why in err, err
    assert not (tmp_path / "samples.jsonl").exists()


def versioned(spans: list[list[tuple[str, int, int]]], sampled: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One sub-call's turns (T1 then T2, one conversation) with the weight-version spans given."""
    enc = TurnEncoder()
    turns = [ServedTokens(t.prompt_ids, t.completion_ids, t.logprobs, v) for t, v in zip((T1, T2), spans, strict=True)]
    return [enc.encode(i + 1, t, None, {}, sampled).model_dump() for i, t in enumerate(turns)]


def run_folder(tmp_path: Path, subs: list[list[dict[str, Any]]]) -> Path:
    row = {"id": "q1", "correct": False}
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    results = [{"status": "ok", "index": i, "turn_tokens": t} for i, t in enumerate(subs)]
    trajectory = expand_trajectory([{"type": "llm_batch", "batch_id": "b1", "results": results}])
    (tmp_path / "trajectories.jsonl").write_text(json.dumps({"id": "q1", "trajectory": trajectory}) + "\n")
    return tmp_path


def test_a_sample_carries_its_weight_versions_at_its_own_positions() -> None:
    turns = versioned([[("step-7", 0, 2)], [("step-8", 0, 1)]])
    traj = expand_trajectory([{"type": "llm_batch", "batch_id": "b1", "results": [
        {"status": "ok", "index": 0, "turn_tokens": turns}]}])  # fmt: skip
    (sample,) = branch_samples(traj)
    assert sample["token_ids"] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert sample["weight_versions"] == [
        {"version": "step-7", "start": 3, "end": 5}, {"version": "step-8", "start": 7, "end": 8}
    ]  # fmt: skip
    (plain,) = branch_samples(expand_trajectory([{"type": "llm_batch", "batch_id": "b1", "results": [
        {"status": "ok", "index": 0, "turn_tokens": encoded([T1])}]}]))  # fmt: skip
    assert plain["weight_versions"] is None and plain["sampled_with"] is None


def test_the_staleness_filters_drop_a_sample_sampled_across_an_update(tmp_path: Path) -> None:
    fresh = versioned([[("step-8", 0, 2)], [("step-8", 0, 1)]])
    across = versioned([[("step-7", 0, 1), ("step-8", 1, 2)], [("step-8", 0, 1)]])  # a turn spans the update
    old = versioned([[("step-6", 0, 2)], [("step-6", 0, 1)]])
    unknown = encoded([T1, T2])  # no versions recorded
    folder = run_folder(tmp_path, [fresh, across, old, unknown])
    out, kept, dropped = export_samples(folder)
    assert (kept, dropped) == (4, 0)

    def branches(*argv: str) -> list[str]:
        assert main(["export-samples", str(folder), *argv]) == 0
        return [json.loads(x)["branch"] for x in (folder / "samples.jsonl").read_text().splitlines()]

    assert branches("--weight-version", "step-8") == ["b1/0"]
    assert branches("--max-version-lag", "0") == ["b1/0"]  # step-7 in b1/1 is one behind step-8
    assert branches("--max-version-lag", "1") == ["b1/0", "b1/1"]
    assert branches("--max-version-lag", "1", "--current-version", "step-9") == ["b1/0"]
    assert branches("--max-version-lag", "1", "--current-version", "step-10") == []
    assert branches("--max-version-lag", "3") == ["b1/0", "b1/1", "b1/2"]  # never b1/3: its staleness is unknown
    with pytest.raises(ConfigError):
        export_samples(folder, staleness=Staleness(max_lag=1, current="latest"))


def test_a_turn_sampled_at_another_temperature_starts_another_sample() -> None:
    enc = TurnEncoder()
    at = [
        {"temperature": 1.0, "temperature_source": "server_default"},
        {"temperature": 0.5, "temperature_source": "request"},
    ]
    recs = [enc.encode(i + 1, t, None, {}, s).model_dump() for i, (t, s) in enumerate(zip((T1, T2), at, strict=True))]
    traj = expand_trajectory([{"type": "llm_batch", "batch_id": "b1", "results": [
        {"status": "ok", "index": 0, "turn_tokens": recs}]}])  # fmt: skip
    samples = list(branch_samples(traj))
    assert [(s["part"], s["sampled_with"]["temperature"]) for s in samples] == [(0, 1.0), (1, 0.5)]
