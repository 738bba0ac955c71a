"""Trainable trees end to end against each server's token shape, with weight versions and sampling.

Real ``rlmq worker --repl-slots`` processes on a real Redis and the scripted model playing one
server (``rlmq mock-llm --token-shape``): SGLang 0.5.23's chat shape read by workers and a producer
set to ``--token-ids-api sglang`` gives every turn as served; vLLM's weight versions asked for with
``--weight-versions`` come back on every turn, through spills and child trajectories, into the
exported samples, whose staleness filter drops the samples sampled across a weight update.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlmq.cli.local import LocalFleet, child_env, rlmq_command
from tests.e2e.test_recursion import needle_data, read_jsonl, reset_stats, run_argv
from tests.e2e.test_trainable_trees import Turn, as_turn, served, tree_turns

pytestmark = pytest.mark.e2e


def shaped_fleet(redis_url: str, log_dir: Path, shape: str, *worker_args: str) -> LocalFleet:
    return LocalFleet(
        redis_url=redis_url, model=f"{shape}-{uuid.uuid4().hex[:6]}", workers=2, worker_concurrency=16,
        repl_slots=2, mock_token_shape=shape, worker_args=list(worker_args), log_dir=str(log_dir),
    )  # fmt: skip


def run(hosts: LocalFleet, redis_url: str, data: Path, run_dir: Path, *extra: str) -> list[dict[str, Any]]:
    """``rlmq run`` at depth 2 with trainable turns; returns what the scripted model served."""
    base = str(hosts.base_url)
    reset_stats(base)
    argv = run_argv(data, run_dir, base, hosts.model, 2, "--include-sub-llm-in-trajectory", *extra)
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=180, env=child_env({"RLMQ_REDIS_URL": redis_url}), check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return served(base)


def all_turns(trajectory: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for ev in trajectory:
        if ev.get("type") == "root":
            yield ev
        for res in ev.get("results", []) if ev.get("type") in ("llm_batch", "rlm_batch") else []:
            yield from res.get("steps", [])
            if "child" in res:
                yield from all_turns(res["child"]["trajectory"])


def test_sglangs_chat_shape_gives_every_turn_as_served_at_the_temperature_it_was_drawn_at(
    redis_url: str, tmp_path: Path
) -> None:
    data, _ = needle_data(tmp_path, rows=2, split=2, lines=1200)
    with shaped_fleet(redis_url, tmp_path / "logs", "sglang", "--token-ids-api", "sglang") as hosts:
        hosts.wait_for_workers(2)
        records = run(hosts, redis_url, data, tmp_path / "run", "--token-ids-api", "sglang")
    assert records and {r["shape"] for r in records} == {"sglang"}
    want = Counter(as_turn(r["role"], r) for r in records)
    got: list[Turn] = []
    depths: Counter[int] = Counter()
    turns = []
    for record in read_jsonl(tmp_path / "run" / "trajectories.jsonl"):
        tree_turns(record["trajectory"], got, depths)  # every turn trainable
        turns += list(all_turns(record["trajectory"]))
    assert Counter(got) == want and sorted(depths) == [1, 2]
    # the run set no temperature: each turn says it was drawn at the server's default
    assert len(turns) == len(got)
    assert {json.dumps(t["sampled_with"], sort_keys=True) for t in turns} == {
        json.dumps({"temperature": 1.0, "temperature_source": "server_default", "top_p": 1.0,
                    "top_p_source": "server_default"}, sort_keys=True)
    }  # fmt: skip


def test_vllms_weight_versions_reach_the_samples_and_the_staleness_filter_drops_the_stale(
    redis_url: str, tmp_path: Path
) -> None:
    data, _ = needle_data(tmp_path, rows=2, split=2, lines=1200)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[1]["question"] += " [[mock:weight-update:1]]"  # its root turns span a weight update each
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    with shaped_fleet(redis_url, tmp_path / "logs", "vllm", "--weight-versions") as hosts:
        hosts.wait_for_workers(2)
        records = run(hosts, redis_url, data, run_dir, "--weight-versions")
    by_ids = {(tuple(r["prompt_token_ids"]), tuple(r["completion_logprobs"])): r for r in records}  # distinct per reply
    turns = [t for rec in read_jsonl(run_dir / "trajectories.jsonl") for t in all_turns(rec["trajectory"])]
    assert len(turns) == len(records) and all(t["trainable"] for t in turns)
    for t in turns:  # every turn carries the spans its server sent, over its completion tokens
        sent = by_ids[(tuple(t["prompt_token_ids"]), tuple(t["completion_logprobs"]))]
        assert t["weight_versions"] == sent["weight_versions"]
    across = [t for t in turns if len(t["weight_versions"]) == 2]
    assert across  # the leaves that read the marker were sampled across an update

    def export(*argv: str) -> list[dict[str, Any]]:
        out = subprocess.run(rlmq_command("export-samples", str(run_dir), *argv), capture_output=True, text=True,
                             timeout=60, env=child_env())  # fmt: skip
        assert out.returncode == 0, out.stderr
        return read_jsonl(run_dir / "samples.jsonl")

    every = export()
    assert len(every) == len(turns) and all(isinstance(s["weight_versions"], list) for s in every)
    fresh = export("--max-version-lag", "0")
    newest = max(int(sp["version"].rsplit("-", 1)[1]) for s in every for sp in s["weight_versions"])
    assert fresh and len(fresh) < len(every)
    for s in every:
        spans = s["weight_versions"]
        assert all(s["loss_mask"][i] for sp in spans for i in range(sp["start"], sp["end"]))  # on completion only
        assert sum(sp["end"] - sp["start"] for sp in spans) == sum(s["loss_mask"])
        kept = all(sp["version"] == f"step-{newest}" for sp in spans)
        assert (s in fresh) == kept  # a sample sampled across an update, or before it, is dropped
    assert not [s for s in fresh if len({sp["version"] for sp in s["weight_versions"]}) > 1]
