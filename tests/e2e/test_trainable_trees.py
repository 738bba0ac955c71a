"""Trainable trees end to end: ``rlmq run --include-sub-llm-in-trajectory`` at depth 1 and 2.

Real ``rlmq worker --repl-slots`` processes on a real Redis, the scripted model (which serves
vLLM's token fields and records what it served, ``GET /served``). Every model turn the server
served with token fields (the top rollouts' root turns, every child's root turns, every
sub-call's turns) must be in ``trajectories.jsonl`` exactly once, where it happened, with every
id and every logprob equal; ``rlmq export-samples`` must give one sample per branch whose
tokens are the served prompt and completion, the mask on the completion only.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from rlmq.cli.local import LocalFleet, child_env, rlmq_command
from tests.e2e.test_recursion import needle_data, read_jsonl, reset_stats, run_argv

pytestmark = pytest.mark.e2e

Turn = tuple[str, tuple[int, ...], tuple[int, ...], tuple[float, ...]]


def served(base_url: str) -> list[dict[str, Any]]:
    """``GET /served`` of the scripted model."""
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/served", timeout=30) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
    return list(doc["served"])


def as_turn(role: str, t: dict[str, Any]) -> Turn:
    return role, tuple(t["prompt_token_ids"]), tuple(t["completion_token_ids"]), tuple(t["completion_logprobs"])


def tree_turns(trajectory: list[dict[str, Any]], out: list[Turn], depths: Counter[int], depth: int = 1) -> None:
    """Every turn of a trajectory and its children's, as (role, prompt, completion, logprobs)."""
    for ev in trajectory:
        if ev.get("type") == "root":
            assert ev["trainable"] is True, ev
            out.append(as_turn("root", ev))
            depths[depth] += 1
        if ev.get("type") in ("llm_batch", "rlm_batch"):
            for res in ev["results"]:
                assert res["status"] == "ok", res
                if "steps" in res:  # a sub-call: its conversation is back too, when it was spilled
                    assert [m["role"] for m in res["messages"]][-1] == "assistant", res.get("messages")
                for t in res.get("steps", []):
                    assert t["trainable"] is True, t
                    out.append(as_turn("sub", t))
                if "child" in res:
                    assert "steps" not in res
                    tree_turns(res["child"]["trajectory"], out, depths, depth + 1)


@pytest.fixture(scope="module")
def hosts(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    with LocalFleet(
        redis_url=redis_url, model=f"train-{uuid.uuid4().hex[:6]}", workers=2, worker_concurrency=16,
        repl_slots=2, log_dir=str(tmp_path_factory.mktemp("train-logs")),
    ) as fleet:  # fmt: skip
        fleet.wait_for_workers(2)
        yield fleet


def getdel_calls(r: redis.Redis) -> int:
    """``GETDEL`` commands the Redis ran (only a producer reading a spilled payload sends one)."""
    stats: dict[str, Any] = r.info("commandstats")
    return int(stats.get("cmdstat_getdel", {}).get("calls", 0))


def run(hosts: LocalFleet, redis_url: str, tmp_path: Path, depth: int, *extra: str) -> tuple[Path, list[Turn]]:
    data, _ = needle_data(tmp_path, rows=2, split=2, lines=1200)
    base = str(hosts.base_url)
    reset_stats(base)
    run_dir = tmp_path / f"run{depth}"
    argv = run_argv(data, run_dir, base, hosts.model, depth, "--include-sub-llm-in-trajectory", *extra)
    env = child_env({"RLMQ_REDIS_URL": redis_url})
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    want = [as_turn(s["role"], s) for s in served(base)]
    return run_dir, want


@pytest.mark.parametrize("depth", [1, 2])
def test_every_served_turn_of_every_tree_is_in_the_trajectories_as_served(
    hosts: LocalFleet, redis_url: str, tmp_path: Path, depth: int
) -> None:
    r = redis.Redis.from_url(redis_url)
    spills = getdel_calls(r)
    run_dir, want = run(hosts, redis_url, tmp_path, depth)
    assert getdel_calls(r) > spills  # large payloads went beside the reply streams...
    assert list(r.scan_iter("rlmq:*:spill:*")) == []  # ...and nothing of them stays in Redis
    got: list[Turn] = []
    depths: Counter[int] = Counter()
    rows = read_jsonl(run_dir / "rows.jsonl")
    for record in read_jsonl(run_dir / "trajectories.jsonl"):
        tree_turns(record["trajectory"], got, depths)
    assert len(want) >= (2 + 2 * 2) * depth  # roots and leaves of both trees
    assert Counter(got) == Counter(want)  # no turn lost, none twice, every id and logprob equal
    assert sorted(depths) == list(range(1, depth + 1))
    assert all(len(t[1]) > 3000 for t in got if t[0] == "sub")  # realistic prompts: thousands of tokens
    assert sum(r["metrics"]["trainable_turn_count"] for r in rows) == len(want)
    assert all(r["metrics"]["untrainable_turn_count"] == 0 for r in rows)

    out = subprocess.run(
        rlmq_command("export-samples", str(run_dir)), capture_output=True, text=True, timeout=60, env=child_env()
    )
    assert out.returncode == 0, out.stderr
    samples = read_jsonl(run_dir / "samples.jsonl")
    by_completion = {t[2] + tuple(t[3]): t for t in want}
    sampled = 0
    for s in samples:
        assert len(s["token_ids"]) == len(s["loss_mask"]) == len(s["logprobs"])
        assert s["reward"] == 1.0 and s["kind"] in ("root", "sub") and 1 <= s["depth"] <= depth
        assert s["turns"] == 1  # the scripted tokenizer re-renders nothing: one turn per part
        ones = [i for i, m in enumerate(s["loss_mask"]) if m]
        completion = tuple(s["token_ids"][i] for i in ones)
        turn = by_completion[completion + tuple(s["logprobs"][i] for i in ones)]
        assert tuple(s["token_ids"]) == turn[1] + turn[2]  # prompt then completion, exactly as served
        assert ones == list(range(len(turn[1]), len(turn[1]) + len(turn[2])))  # the mask: completion only
        sampled += 1
    assert sampled == len(want)


def test_a_frozen_fleet_serves_turns_kept_untrainable_and_asked_for_no_tokens(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from rlmq.common import keys as K
    from rlmq.common.token_wire import expand_trajectory
    from tests.e2e.test_child_host import enqueue_child, replies, wait_until

    with LocalFleet(
        redis_url=redis_url, model=f"frozen-{uuid.uuid4().hex[:6]}", workers=1, worker_concurrency=8,
        repl_slots=1, worker_args=["--frozen"], log_dir=str(tmp_path_factory.mktemp("frozen-logs")),
    ) as fleet:  # fmt: skip
        fleet.wait_for_workers(1)
        r = redis.Redis.from_url(redis_url)
        code = "llm_batch(['leaf ' + 'word ' * 300]); answer.update(content='ok', ready=True)"
        req = enqueue_child(redis_url, K.queue_name_for_model(fleet.model), code, include_sub_llm_in_trajectory=True)
        [res] = wait_until(lambda: replies(r, req), 90, "the child's result")
        params = json.loads(urllib.request.urlopen(str(fleet.base_url).removesuffix("/v1") + "/stats").read())["params"]
        r.close()
    assert res.status == "ok" and res.child is not None and not res.spilled
    trajectory = expand_trajectory(res.child.trajectory)
    roots = [e for e in trajectory if e["type"] == "root"]
    steps = [s for e in trajectory if e["type"] == "llm_batch" for x in e["results"] for s in x["steps"]]
    assert roots and steps
    assert all(t["untrainable_reason"] == "frozen_fleet" and "prompt_token_ids" not in t for t in [*roots, *steps])
    assert res.child.metrics["untrainable_turns_frozen_fleet"] == len(roots) + len(steps)
    assert params and not any("return_token_ids" in p or "logprobs" in p for p in params)


@pytest.mark.parametrize("depth", [1, 2])
def test_the_verifiers_harness_puts_every_served_turn_in_the_trace_as_a_trainable_branch(
    hosts: LocalFleet, tmp_path: Path, depth: int
) -> None:
    from verifiers.v1.trace import WireTrace

    from tests.e2e.test_verifiers import vf_eval
    from tests.unit.test_tree_nodes import samples

    data, _ = needle_data(tmp_path, rows=1, split=2, lines=1200)
    base = str(hosts.base_url)
    reset_stats(base)
    args = [
        "--model", hosts.model, "--client.base-url", base,
        "--env.agent.harness.include-sub-llm-in-trajectory", "true",
        # the harness's max_depth is the rlm harness's: levels below the root
        *(["--env.agent.harness.max-depth", str(depth - 1)] if depth > 1 else []),
    ]  # fmt: skip
    (record,) = vf_eval(tmp_path, data, args, child_env({"REDIS_URL": hosts.redis_url}))
    trace = WireTrace.model_validate(record)
    assert trace.ok, record.get("errors")
    tops = [e for e in trace.info["rlmq"]["trajectory"] if e["type"] == "root"]
    inner: list[Turn] = []
    depths: Counter[int] = Counter()
    tree_turns([e for e in trace.info["rlmq"]["trajectory"] if e["type"] != "root"], inner, depths)
    want = Counter(as_turn(s["role"], s) for s in served(base))
    # every served turn is in the trace's info: the top root turns (verifiers relays the token request) and the tree's
    assert not Counter(inner) - want and want.total() - len(inner) == len(tops) >= 1
    assert sorted(depths) == list(range(2, depth + 1))
    assert len(inner) >= 2 * (1 + 2 * (depth - 1))  # two sub-calls per leaf rollout, two child roots per split

    # one trainable branch per served turn (the scripted tokenizer re-renders: no turn extends another)
    ours = [b for b in trace.branches if str(b.nodes[0].message.content).startswith("[rlmq ")]
    assert len(ours) == len(inner) == trace.info["rlmq"]["tree_nodes"]["turns"]
    by_tokens = {t[1] + t[2]: t for t in inner}
    assert len(by_tokens) == len(inner)
    for branch in ours:
        turn = by_tokens[tuple(branch.token_ids)]  # prompt then completion, exactly as served
        ones = [i for i, m in enumerate(branch.sampled_mask) if m]
        assert ones == list(range(len(turn[1]), len(turn[1]) + len(turn[2])))  # the mask: completion only
        assert [branch.logprobs[i] for i in ones] == [round(lp, 4) for lp in turn[3]]  # the record keeps 4 decimals
        assert not any(branch.logprobs[: len(turn[1])])
    # prime-rl's sample builder: a sample per trainable branch; vf-eval's client keeps no tokens on the top's own
    assert len(samples(trace)) == len(inner)
    links = Counter(link.type for node in trace.nodes for link in node.semantic_parents)
    conversations = trace.info["rlmq"]["tree_nodes"]["conversations"]
    assert links["subagent_call"] == conversations == 2 * (2 ** (depth - 1)) + (2**depth - 2)
